"""``cuda/direct``: the single-launch SIMT algorithm for small float32/float64 problems.

CPU (no GPU needed): every instantiation of ``cuda/deform_direct.cu`` compiles through NVRTC
(skipped without CuPy, NVRTC or the CUDA headers unless ``DCN_CUPY_REQUIRE_NVRTC`` is set), the
source defines exactly the kernels the backend instantiates and launches, and the registry picks
``cuda/direct`` exactly for small float32/float64 problems (not for a large one, not for the half
types, not for a deterministic backward).

GPU (``@pytest.mark.gpu``), with ``cuda/direct`` forced: forward and every gradient against the
float64 reference (float64 1e-10, float32 1e-4 relative in norm), N = 1, 2, 3, conv and
transposed, groups, offset groups != mask groups, stride/padding/dilation, with and without
offset/mask/bias, every ``wrt`` subset, non-finite and huge offsets, batch 0 and 33, finite
differences, the CPU backend, batch strides of 0, 64-bit indices, streams and a CUDA-graph
capture. Parity with torchvision: ``tests/test_cuda.py``'s test, run for each CUDA algorithm.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import dcn_cupy
from dcn_cupy import _backends, reference
from dcn_cupy._geometry import conv_geometry
from dcn_cupy.testing import ARGUMENTS, directional_derivative, random_case, relative_error

DIRECT = "cuda/direct"
SUBSETS = [frozenset(s) for r in range(1, 6) for s in itertools.combinations(ARGUMENTS, r)]


# ---------------------------------------------------------------------------------------------
# without a GPU: compilation and the registry


def _module_keys():
    try:
        from dcn_cupy._backends import cuda_direct
    except ImportError:
        return [pytest.param(None, id="cupy-unavailable")]
    return cuda_direct.all_module_keys()


def _key_id(key):
    return "none" if key is None else f"{np.dtype(key[0]).name}-{key[1]}d-{'i64' if key[2] else 'i32'}"


@pytest.mark.parametrize("key", _module_keys(), ids=_key_id)
def test_every_instantiation_compiles(key, compile_module):
    from dcn_cupy._backends import cuda_direct
    compile_module(cuda_direct.module_source(), "deform_direct.cu", cuda_direct.name_expressions(*key))


def test_module_source_and_kernels():
    pytest.importorskip("cupy")
    import inspect
    import re

    from dcn_cupy._backends import cuda_direct
    source = cuda_direct.module_source()
    assert '#line 1 "cuda/dcn_common.cuh"' in source and '#line 1 "cuda/deform_direct.cu"' in source
    assert not re.search(r'#\s*include\s+"', source)
    defined = set(re.findall(r"__global__\s+void\s+(\w+)\s*\(", source))
    for key in cuda_direct.all_module_keys():
        assert {n.split("<", 1)[0] for n in cuda_direct.name_expressions(*key)} == defined
    # every kernel (and every variant of the data-gradient kernel) is launched by an executable
    text = inspect.getsource(cuda_direct)
    for key in ('kernels["forward"]', 'kernels["params"]', "kernels[(want_x, want_o, want_m)]"):
        assert key in text
    assert len(cuda_direct._DATA_VARIANTS) == 7


def _spec(shape=(1, 16, 8, 8), out_channels=16, dtype=np.float32, deterministic=False, groups=1):
    B, C = shape[:2]
    spatial = shape[2:]
    n = len(spatial)
    k = (3,) * n
    K = 3 ** n
    geom, _ = conv_geometry(shape, (out_channels, C // groups) + k, (B, K * n) + spatial, (B, K) + spatial,
                            (out_channels,), 1, 1, 1, groups)
    return _backends.PlanSpec(geom, np.dtype(dtype), "cuda", 0, deterministic, False)


def _chosen(spec, primitive):
    backend, reason = _backends.choose(spec, primitive)
    return f"{backend.device}/{backend.algorithm}" if backend is not None else reason


def test_registry_picks_direct_for_small_problems_only(monkeypatch):
    pytest.importorskip("cupy")
    direct = _backends.backend_named(DIRECT)
    assert direct.priority == 30 and direct.device == "cuda"
    tiny = _spec()
    assert _chosen(tiny, "conv_forward") == DIRECT
    assert _chosen(tiny, "conv_backward") == DIRECT
    assert _chosen(_spec(dtype=np.float64), "conv_backward") == DIRECT
    assert _chosen(_spec((1, 8, 20)), "conv_forward") == DIRECT                # 1D
    assert _chosen(_spec((1, 4, 6, 6, 6), 4), "conv_forward") == DIRECT       # 3D
    big = _spec((8, 256, 56, 56), 256)
    for primitive in _backends.PRIMITIVES:
        assert _chosen(big, primitive) != DIRECT
        assert "multiply-adds" in direct.recommends(big, primitive)
        assert direct.serves(big, primitive) is None       # still served when forced
    # few positions but many channels: one backward thread's serial loop would be long
    from dcn_cupy._backends import cuda_direct
    monkeypatch.setattr(cuda_direct, "MAX_MACS", 2**40)
    wide = _spec((1, 256, 2, 2), 256)
    assert _chosen(wide, "conv_backward") != DIRECT and "C_in * C_out/groups" in direct.recommends(wide, "conv_backward")


def test_registry_refuses_half_types_and_deterministic_backward():
    pytest.importorskip("cupy")
    from dcn_cupy._interop import BFLOAT16
    direct = _backends.backend_named(DIRECT)
    for dtype in (np.float16, BFLOAT16):
        spec = _spec(dtype=dtype)
        for primitive in _backends.PRIMITIVES:
            assert _chosen(spec, primitive) != DIRECT
            assert "float32 accumulator" in direct.serves(spec, primitive)
        with pytest.raises(ValueError, match="does not serve this conv_forward"):
            _backends.choose(spec, "conv_forward", DIRECT)
    det = _spec(deterministic=True)
    assert _chosen(det, "conv_backward") == "cuda/im2col-deterministic"
    assert "atomics" in direct.serves(det, "conv_backward")
    assert _chosen(det, "conv_forward") == DIRECT           # the forward's sums have a fixed order
    with pytest.raises(ValueError, match="does not serve this conv_backward: .*atomics"):
        _backends.choose(det, "conv_backward", DIRECT)


def test_threshold_setting(monkeypatch):
    pytest.importorskip("cupy")
    from dcn_cupy._backends import cuda_direct
    spec = _spec()
    work = cuda_direct.macs(spec.geom)
    assert work == 1 * 64 * 16 * 16 * 9
    monkeypatch.setattr(cuda_direct, "MAX_MACS", work - 1)
    assert _chosen(spec, "conv_forward") != DIRECT
    monkeypatch.setattr(cuda_direct, "MAX_MACS", work)
    assert _chosen(spec, "conv_forward") == DIRECT
    monkeypatch.setenv("DCN_CUPY_DIRECT_MAX_MACS", "1e6")
    assert cuda_direct._int_from_env("DCN_CUPY_DIRECT_MAX_MACS", 5) == 1000000
    monkeypatch.setenv("DCN_CUPY_DIRECT_MAX_MACS", "lots")
    with pytest.raises(ValueError, match="DCN_CUPY_DIRECT_MAX_MACS must be an integer"):
        cuda_direct._int_from_env("DCN_CUPY_DIRECT_MAX_MACS", 5)


def test_lanes_never_straddle_a_group():
    """The data-gradient lanes split the input channels in chunks inside one offset group and one
    mask group; the forward's split the taps."""
    pytest.importorskip("cupy")
    from dcn_cupy._backends import cuda_direct
    for C, Go, Gm, expected in ((16, 1, 1, 8), (8, 2, 4, 2), (8, 1, 8, 1), (12, 1, 1, 4), (6, 3, 1, 2),
                                (3, 1, 1, 1), (64, 4, 2, 8), (16, 0, 0, 8), (16, 0, 2, 8), (24, 2, 0, 4)):
        geom, _ = conv_geometry((1, C, 5, 5), (4, C, 3, 3), (1, 18 * Go, 3, 3) if Go else None,
                                (1, 9 * Gm, 3, 3) if Gm else None, None, 1, 0, 1, 1)
        lanes = cuda_direct.backward_lanes(geom)
        assert lanes == expected, (C, Go, Gm, lanes)
        for groups in (Go, Gm):
            if groups:
                assert (C // groups) % lanes == 0
    for k, expected in (((1, 1), 1), ((3, 1), 2), ((3, 3), 8), ((2, 2), 4), ((3, 3, 3), 8)):
        n = len(k)
        geom, _ = conv_geometry((1, 2) + (5,) * n, (2, 2) + k, None, None, None, 1, 0, 1, 1)
        assert cuda_direct.forward_lanes(geom) == expected, k


# ---------------------------------------------------------------------------------------------
# on a GPU, cuda/direct forced

gpu = pytest.mark.gpu


def _cupy():
    return pytest.importorskip("cupy")


def to_gpu(dtype=None):
    cupy = _cupy()

    def convert(a):
        a = np.asarray(a)
        return cupy.asarray(a if dtype is None else a.astype(dtype))
    return convert


def host(a):
    if a is None:
        return None
    cupy = _cupy()
    if isinstance(a, cupy.ndarray):
        a = cupy.asnumpy(a)
    return np.asarray(a).astype(np.float64)


def rounded(arrays, dtype):
    return {k: None if a is None else a.astype(dtype).astype(np.float64) for k, a in arrays.items()}


def reference_backward(case, grad_output, arrays=None):
    """The float64 reference gradients (input, weight, offset, mask, bias) of a case."""
    arrays = case.arrays_ if arrays is None else arrays
    fn = reference.deform_conv_transpose_backward if case.transposed else reference.deform_conv_backward
    return dict(zip(ARGUMENTS, fn(grad_output, **arrays, **case.params)))


def forced():
    return _backends.use_algorithm(DIRECT)


def _check_plan_is_direct(case, arrays):
    p = dcn_cupy.plan(**arrays, **case.params, transposed=case.transposed, algorithm=DIRECT)
    assert p.algorithm == f"forward: {DIRECT}, backward: {DIRECT}", p.algorithm
    assert "cuda/direct forward" in str(p) and "cuda/direct backward" in str(p)
    assert p.workspace_bytes == 0


@gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_float64_matches_reference(ndim, transposed, seed):
    cupy = _cupy()
    rng = np.random.default_rng(300 + 10 * ndim + seed)
    case = random_case(rng, ndim, transposed, offset=seed % 3 != 1, mask=seed % 3 != 2, bias=seed % 2 == 0)
    arrays = case.arrays(to_gpu())
    _check_plan_is_direct(case, arrays)
    with forced():
        y = case.forward(**arrays, **case.params)
        assert isinstance(y, cupy.ndarray) and y.dtype == np.float64
        assert relative_error(host(y), case.reference()) < 1e-10, case.label
        gy = rng.standard_normal(y.shape)
        grads = case.backward(cupy.asarray(gy), **arrays, **case.params)
    expected = reference_backward(case, gy)
    for name in ARGUMENTS:
        if case.arrays_[name] is None:
            assert getattr(grads, name) is None, name
            continue
        err = relative_error(host(getattr(grads, name)), expected[name])
        assert err < 1e-10, f"{name}: {err} {case.label}"


@gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_float32_matches_reference(ndim, transposed):
    cupy = _cupy()
    rng = np.random.default_rng(17 + ndim + 5 * transposed)
    case = random_case(rng, ndim, transposed, channels_scale=3)
    arrays = case.arrays(to_gpu(np.float32))
    exact = rounded(case.arrays_, np.float32)
    with forced():
        y = case.forward(**arrays, **case.params)
        assert y.dtype == np.float32
        assert relative_error(host(y), case.reference(exact)) < 1e-4, case.label
        gy = rng.standard_normal(y.shape).astype(np.float32)
        grads = case.backward(cupy.asarray(gy), **arrays, **case.params)
    expected = reference_backward(case, gy.astype(np.float64), exact)
    for name in ARGUMENTS:
        got = getattr(grads, name)
        assert got.dtype == np.float32, name
        err = relative_error(host(got), expected[name])
        assert err < 1e-4, f"{name}: {err} {case.label}"


@gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("offset_groups,mask_groups", [(2, 4), (4, 2), (1, 8), (8, 1), (4, 4)])
def test_groups_and_independent_offset_mask_groups(offset_groups, mask_groups, transposed):
    """groups=2, C=8 channels partitioned by G_o and G_m independently, stride/padding/dilation."""
    cupy = _cupy()
    rng = np.random.default_rng(40 + 10 * offset_groups + mask_groups + 100 * transposed)
    groups, c_part, c_other = 2, 8, 6            # c_part: the channels G_o / G_m partition
    kernel, stride, padding, dilation = (3, 2), (2, 1), (1, 0), (1, 2)
    K = math.prod(kernel)
    if transposed:   # offset/mask groups partition the transposed op's OUTPUT channels
        size = (5, 6)
        grid = size
        x = rng.standard_normal((3, c_other) + size)
        w = rng.standard_normal((c_other, c_part // groups) + kernel)
        bias = rng.standard_normal(c_part)
        params = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, output_padding=(1, 0))
        fn, ref, ref_b = "deform_conv_transpose2d", reference.deform_conv_transpose, reference.deform_conv_transpose_backward
    else:
        size = (9, 8)
        grid = tuple((s + 2 * p - d * (k - 1) - 1) // st + 1
                     for s, k, st, p, d in zip(size, kernel, stride, padding, dilation))
        x = rng.standard_normal((3, c_part) + size)
        w = rng.standard_normal((c_other, c_part // groups) + kernel)
        bias = rng.standard_normal(c_other)
        params = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
        fn, ref, ref_b = "deform_conv2d", reference.deform_conv, reference.deform_conv_backward
    off = rng.standard_normal((3, offset_groups * K * 2) + grid) * 1.5
    msk = rng.uniform(0.1, 1.5, (3, mask_groups * K) + grid)
    host_args = dict(input=x, weight=w, offset=off, mask=msk, bias=bias)
    args = {k: cupy.asarray(v) for k, v in host_args.items()}
    with forced():
        y = getattr(dcn_cupy, fn)(**args, **params)
        assert relative_error(host(y), ref(**host_args, **params)) < 1e-10
        gy = rng.standard_normal(y.shape)
        grads = getattr(dcn_cupy, fn + "_backward")(cupy.asarray(gy), **args, **params)
    expected = dict(zip(ARGUMENTS, ref_b(gy, **host_args, **params)))
    for name in ARGUMENTS:
        assert relative_error(host(getattr(grads, name)), expected[name]) < 1e-10, name


@gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_wrt_subsets(transposed):
    cupy = _cupy()
    rng = np.random.default_rng(8 + transposed)
    case = random_case(rng, 2, transposed, batch=2)
    arrays = case.arrays(to_gpu())
    gy_host = rng.standard_normal(case.reference().shape)
    gy = cupy.asarray(gy_host)
    expected = reference_backward(case, gy_host)
    with forced():
        for wanted in SUBSETS:
            part = case.backward(gy, **arrays, **case.params, wrt=wanted)
            for name in ARGUMENTS:
                got = getattr(part, name)
                if name not in wanted:
                    assert got is None, (name, sorted(wanted))
                else:
                    assert relative_error(host(got), expected[name]) < 1e-10, (name, sorted(wanted))


@gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_non_finite_and_huge_offsets(ndim, transposed, dtype):
    cupy = _cupy()
    rng = np.random.default_rng(13 + ndim)
    case = random_case(rng, ndim, transposed, batch=2)
    offset = case.arrays_["offset"].copy()
    flat = offset.reshape(-1)
    bad = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 3e9, -3e9, 65504.0, 2.0**31])
    picks = rng.choice(flat.size, size=min(flat.size, 4 * bad.size), replace=False)
    flat[picks] = np.resize(bad, picks.size)
    arrays = dict(case.arrays_)
    arrays["offset"] = offset
    gpu_arrays = {k: None if a is None else cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    expected = case.reference(rounded(arrays, dtype))
    with forced():
        out = case.forward(**gpu_arrays, **case.params)
        assert bool(cupy.isfinite(out).all())
        tol = {np.float64: 1e-10, np.float32: 1e-4}[dtype]
        assert relative_error(host(out), expected) < tol
        gy = np.ones(out.shape)
        grads = case.backward(cupy.ones(out.shape, dtype=dtype), **gpu_arrays, **case.params)
    exact = reference_backward(case, gy, rounded(arrays, dtype))
    for name in ARGUMENTS:
        got = getattr(grads, name)
        assert bool(cupy.isfinite(got).all()), name
        assert relative_error(host(got), exact[name]) < tol, name
    # Where the position is non-finite or far outside, the offset gradient is exactly 0.
    goff = host(grads.offset).reshape(-1)
    assert np.all(goff[picks[np.isin(np.resize(bad, picks.size), bad[:7])]] == 0)


@gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_batch_0_and_33(transposed):
    cupy = _cupy()
    rng = np.random.default_rng(33 + transposed)
    case = random_case(rng, 2, transposed, batch=33)
    arrays = case.arrays(to_gpu())
    with forced():
        y = case.forward(**arrays, **case.params)
        assert relative_error(host(y), case.reference()) < 1e-10
        gy = rng.standard_normal(y.shape)
        grads = case.backward(cupy.asarray(gy), **arrays, **case.params)
        expected = reference_backward(case, gy)
        for name in ARGUMENTS:
            assert relative_error(host(getattr(grads, name)), expected[name]) < 1e-10, name
        empty = {k: v[:0] if k in ("input", "offset", "mask") else v for k, v in arrays.items()}
        y0 = case.forward(**empty, **case.params)
        assert y0.shape == (0,) + y.shape[1:]
        g0 = case.backward(y0, **empty, **case.params)
        assert g0.input.shape[0] == 0 and not bool(g0.weight.any()) and not bool(g0.bias.any())


@gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_gradients_match_finite_differences(ndim, transposed):
    cupy = _cupy()
    rng = np.random.default_rng(7000 + 10 * ndim + transposed)
    case = random_case(rng, ndim, transposed, offset=True, mask=True, bias=True)
    grad_output = rng.standard_normal(case.reference().shape)
    with forced():
        grads = case.backward(cupy.asarray(grad_output), **case.arrays(to_gpu()), **case.params)
    for name in ARGUMENTS:
        direction = rng.standard_normal(case.arrays_[name].shape)
        expected = directional_derivative(case, name, grad_output, direction)
        actual = float(np.vdot(host(getattr(grads, name)), direction))
        assert actual == pytest.approx(expected, rel=1e-6, abs=1e-8), f"{name}: {case.label}"


@gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_matches_cpu_backend(ndim, transposed):
    cupy = _cupy()
    rng = np.random.default_rng(77 + ndim)
    case = random_case(rng, ndim, transposed, batch=3, channels_scale=2)
    grad_output = rng.standard_normal(case.reference().shape)
    for dtype, tol in ((np.float64, 1e-10), (np.float32, 1e-4)):
        cpu_arrays = case.arrays(lambda a: a.astype(dtype))
        gpu_arrays = case.arrays(to_gpu(dtype))
        y_cpu = case.forward(**cpu_arrays, **case.params)
        g_cpu = case.backward(grad_output.astype(dtype), **cpu_arrays, **case.params)
        with forced():
            y_gpu = case.forward(**gpu_arrays, **case.params)
            g_gpu = case.backward(cupy.asarray(grad_output.astype(dtype)), **gpu_arrays, **case.params)
        assert relative_error(host(y_gpu), host(y_cpu)) < tol
        for name in ARGUMENTS:
            assert relative_error(host(getattr(g_gpu, name)), host(getattr(g_cpu, name))) < tol, (dtype, name)


@gpu
def test_automatic_choice_on_a_gpu():
    """Without forcing: tiny float32 plans take cuda/direct, a larger one cuda/im2col."""
    cupy = _cupy()
    rng = np.random.default_rng(2)
    a = {"input": rng.standard_normal((1, 16, 8, 8)), "weight": rng.standard_normal((16, 16, 3, 3)),
         "offset": rng.standard_normal((1, 18, 8, 8)), "mask": rng.random((1, 9, 8, 8)),
         "bias": rng.standard_normal(16)}
    a = {k: cupy.asarray(v.astype(np.float32)) for k, v in a.items()}
    p = dcn_cupy.plan(**a, padding=1)
    assert p.algorithm == f"forward: {DIRECT}, backward: {DIRECT}", str(p)
    assert "cuda/direct forward: one launch (8 lane(s)" in str(p) and "32-bit index" in str(p)
    # the numbers (8 lanes per output and per (sample, tap, position))
    y = p.forward(**a)
    host_a = {k: host(v) for k, v in a.items()}
    assert relative_error(host(y), reference.deform_conv(**host_a, padding=1)) < 1e-5
    gy = rng.standard_normal(y.shape)
    grads = p.backward(cupy.asarray(gy.astype(np.float32)), **a)
    expected = reference.deform_conv_backward(gy.astype(np.float32).astype(np.float64), **host_a, padding=1)
    for name, value in zip(ARGUMENTS, expected):
        assert relative_error(host(getattr(grads, name)), value) < 1e-4, name
    big = dict(a, input=cupy.zeros((4, 64, 32, 32), np.float32), weight=cupy.zeros((64, 64, 3, 3), np.float32),
               offset=cupy.zeros((4, 18, 32, 32), np.float32), mask=cupy.zeros((4, 9, 32, 32), np.float32),
               bias=cupy.zeros(64, np.float32))
    p = dcn_cupy.plan(**big, padding=1)
    assert DIRECT not in p.algorithm, str(p)


@gpu
def test_batch_stride_zero_and_non_contiguous_inputs():
    """Offsets broadcast over the batch (batch stride 0) and strided inputs: run() copies them."""
    cupy = _cupy()
    rng = np.random.default_rng(9)
    case = random_case(rng, 2, False, batch=3)
    arrays = case.arrays(to_gpu())
    shared = dict(case.arrays_)
    shared["offset"] = np.broadcast_to(case.arrays_["offset"][:1], case.arrays_["offset"].shape).copy()
    arrays["offset"] = cupy.broadcast_to(arrays["offset"][:1], arrays["offset"].shape)
    assert arrays["offset"].strides[0] == 0
    big = cupy.zeros(arrays["input"].shape[:-1] + (2 * arrays["input"].shape[-1],))
    big[..., ::2] = arrays["input"]
    arrays["input"] = big[..., ::2]
    with forced():
        y = case.forward(**arrays, **case.params)
        assert relative_error(host(y), case.reference(shared)) < 1e-10
        gy = rng.standard_normal(y.shape)
        grads = case.backward(cupy.asarray(gy), **arrays, **case.params)
    expected = reference_backward(case, gy, shared)
    for name in ARGUMENTS:
        assert relative_error(host(getattr(grads, name)), expected[name]) < 1e-10, name


@gpu
def test_deterministic_parts_and_replay_on_new_pointers():
    """The forward, weight, offset and mask gradients are bitwise repeatable (fixed-order sums);
    a plan called on new buffers records new launches (its replay cache follows the pointers)."""
    cupy = _cupy()
    rng = np.random.default_rng(10)
    case = random_case(rng, 2, False, batch=2, channels_scale=2)
    arrays = case.arrays(to_gpu())
    p = dcn_cupy.plan(**arrays, **case.params, algorithm=DIRECT)
    gy = cupy.asarray(rng.standard_normal(p.output_shape))
    first = p.forward(**arrays), p.backward(gy, **arrays)
    for _ in range(3):
        y, g = p.forward(**arrays), p.backward(gy, **arrays)
        assert bool((y == first[0]).all())
        for name in ("weight", "offset", "mask", "bias"):
            assert bool((getattr(g, name) == getattr(first[1], name)).all()), name
    other = {k: v.copy() * 2 for k, v in arrays.items()}      # new pointers, doubled values
    y2 = p.forward(**other)
    assert relative_error(host(y2), case.reference({k: v * 2 for k, v in case.arrays_.items()})) < 1e-10
    out = cupy.empty_like(y2)
    assert p.forward(**arrays, out=out) is out
    assert relative_error(host(out), case.reference()) < 1e-10


@gpu
def test_64bit_indices(monkeypatch):
    cupy = _cupy()
    from dcn_cupy._backends import cuda
    rng = np.random.default_rng(42)
    case = random_case(rng, 3, True, batch=2)
    arrays = case.arrays(to_gpu())
    monkeypatch.setattr(cuda, "_INT32_SAFE", 0)   # every kernel takes the long long instantiation
    p = dcn_cupy.plan(**arrays, **case.params, transposed=True, algorithm=DIRECT)
    assert "64-bit index" in str(p)
    y = p.forward(**arrays)
    assert relative_error(host(y), case.reference()) < 1e-10
    gy = rng.standard_normal(y.shape)
    grads = p.backward(cupy.asarray(gy), **arrays)
    expected = reference_backward(case, gy)
    for name in ARGUMENTS:
        assert relative_error(host(getattr(grads, name)), expected[name]) < 1e-10, name


@gpu
def test_non_default_stream_and_graph_capture():
    cupy = _cupy()
    rng = np.random.default_rng(5)
    case = random_case(rng, 2, False, batch=4)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        arrays = case.arrays(to_gpu())
        p = dcn_cupy.plan(**arrays, **case.params, algorithm=DIRECT)
        y = cupy.empty(p.output_shape)
        gy = cupy.asarray(rng.standard_normal(p.output_shape))
        grads = {n: cupy.empty_like(arrays[n]) for n in ARGUMENTS}
        p.forward(**arrays, out=y)
        p.backward(gy, **arrays, out=grads)
        stream.synchronize()
        assert relative_error(host(y), case.reference()) < 1e-10
        expected = reference_backward(case, host(gy))
        y[...] = 0
        for g in grads.values():
            g[...] = 0
        # capture forward + backward (the bias gradient is one launch too) and replay it
        stream.begin_capture()
        p.forward(**arrays, out=y)
        p.backward(gy, **arrays, out=grads)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert relative_error(host(y), case.reference()) < 1e-10
    for name in ARGUMENTS:
        assert relative_error(host(grads[name]), expected[name]) < 1e-10, name
