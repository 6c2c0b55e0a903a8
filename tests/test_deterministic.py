"""``deterministic=True``: bitwise repeatable gradients and transposed forwards.

CPU (no GPU needed): the deterministic module compiles through NVRTC (skipped without CuPy,
NVRTC or the CUDA headers unless ``DCN_CUPY_REQUIRE_NVRTC`` is set), the backend registry
picks ``cuda/im2col-deterministic`` exactly for deterministic CUDA backwards that
cuda/fused-backward does not take, and the CPU backend accepts ``deterministic=True`` and is
bitwise repeatable at any thread count.

GPU (``@pytest.mark.gpu``): inputs whose offsets pull every tap of every position onto a few
input points (hundreds of contributions collide on each of their corners, in the shared-memory
box and in global memory), run 5 times with and without ``deterministic``: bitwise equal in
deterministic mode, and in both modes equal to the reference (the input gradient of a
convolution is the reference transposed convolution of grad_output, by definition; the other
gradients against the default CUDA backward in float64, itself validated against the
reference in test_cuda.py) for
N = 1, 2, 3, conv and transposed, every ``wrt`` subset, float16/bfloat16/float32/float64.
Tolerances as in test_cuda.py (float64 1e-10, float32 1e-4 relative in norm, half types
against float64 gradients of the same rounded inputs). Then cuda/fused-backward's deterministic
kernels on colliding inputs with its channel constraints: bitwise equal over runs, every data
tile, both main loops (wgmma and mma.sync, on an sm_90a device), the sampling plans on and off
and one-sample chunks; its scatter's fast path against the general loop, bit for bit; non-finite
contributions; the automatic choice between it and cuda/im2col-deterministic.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import dcn_cupy
from dcn_cupy import _backends, _plan, reference
from dcn_cupy._geometry import conv_geometry
from dcn_cupy._interop import BFLOAT16

from cases import ARGUMENTS, directional_derivative, relative_error

DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))
DTYPE_IDS = ("float16", "bfloat16", "float32", "float64")
TOL = {np.dtype(np.float16): 5e-3, BFLOAT16: 4e-2, np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-10}
SUBSETS = [frozenset(s) for r in range(1, 6) for s in itertools.combinations(ARGUMENTS, r)]


# ---------------------------------------------------------------------------------------------
# colliding inputs


class Collide:
    """A (transposed) deformable convolution whose sampling positions all fall on a few points.

    Each (sample, offset group, tap, position) samples one of ``points`` fractional positions
    (fractional parts in [0.2, 0.8], off the kinks), some far from their regular position
    (outside the scatter's shared-memory box), so every corner of those points receives
    hundreds of contributions. ``channels``: the convolution's (C_in, C_out) (default 4 and 6,
    swapped for the transposed one); the transposed op's input has C_out channels.
    """

    def __init__(self, ndim, transposed, seed=0, batch=2, channels=None, groups=2, offset_groups=2, mask_groups=1):
        rng = np.random.default_rng(1000 * ndim + 10 * transposed + seed)
        spatial, kernel = {1: ((300,), (3,)), 2: ((20, 21), (3, 2)), 3: ((6, 7, 5), (2, 3, 2))}[ndim]
        stride, padding, dilation = (1,) * ndim, (1,) * ndim, (1,) * (ndim - 1) + (2,)
        if channels is None:                 # the convolution's (C_in, C_out), small
            c_small, c_large = 4, 6          # (C_out/groups, C_in/G_o ... integral)
            channels = (c_small, c_large) if not transposed else (c_large, c_small)
        conv_in, conv_out = channels
        geom, _ = conv_geometry((batch, conv_in) + spatial, (conv_out, conv_in // groups) + kernel,
                                None, None, None, stride, padding, dilation, groups)
        Q, K = geom.output_shape, geom.kernel_volume
        # regular positions (Q..., K, N) and the collision points
        grids = np.meshgrid(*[np.arange(q) for q in Q], indexing="ij")
        taps = np.stack(np.unravel_index(np.arange(K), kernel), axis=-1)            # (K, N)
        regular = np.stack([g[..., None] * stride[a] - padding[a] + taps[:, a] * dilation[a]
                            for a, g in enumerate(grids)], axis=-1)                # (*Q, K, N)
        points = np.array([[rng.integers(0, s - 1) + rng.uniform(0.2, 0.8) for s in spatial] for _ in range(3)])
        choice = rng.integers(0, len(points), size=(batch, offset_groups) + tuple(Q) + (K,))
        target = points[choice]                                                    # (B, Go, *Q, K, N)
        off = target - regular[None, None]
        off = np.moveaxis(off, (-2, -1), (2, 3))                                   # (B, Go, K, N, *Q)
        offset = off.reshape((batch, offset_groups * K * ndim) + tuple(Q))
        mask = rng.uniform(0.1, 1.5, size=(batch, mask_groups * K) + tuple(Q))
        if transposed:   # the transposed op's input lives on the conv's output grid Q
            x = rng.standard_normal((batch, conv_out) + tuple(Q))
            w = rng.standard_normal((conv_out, conv_in // groups) + kernel)
            bias = rng.standard_normal(conv_in)
        else:
            x = rng.standard_normal((batch, conv_in) + spatial)
            w = rng.standard_normal((conv_out, conv_in // groups) + kernel)
            bias = rng.standard_normal(conv_out)
        self.ndim, self.transposed = ndim, transposed
        self.arrays_ = {"input": x, "weight": w, "offset": offset, "mask": mask, "bias": bias}
        self.params = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
        self.label = f"{'T' if transposed else ''}{ndim}d B{batch} S{spatial} k{kernel}"
        self.grad_output = rng.standard_normal(self.reference().shape)

    def arrays(self, convert=lambda a: a):
        return {k: convert(a) for k, a in self.arrays_.items()}

    def reference(self, arrays=None):
        arrays = self.arrays_ if arrays is None else arrays
        fn = reference.deform_conv_transpose if self.transposed else reference.deform_conv
        return fn(**arrays, **self.params)

    @property
    def forward(self):
        return getattr(dcn_cupy, f"deform_conv_transpose{self.ndim}d" if self.transposed else f"deform_conv{self.ndim}d")

    @property
    def backward(self):
        return getattr(dcn_cupy, (f"deform_conv_transpose{self.ndim}d" if self.transposed
                                  else f"deform_conv{self.ndim}d") + "_backward")

    def input_gradient_reference(self, arrays, grad_output):
        """The input gradient by the adjoint definition (design section 1)."""
        a = dict(arrays, bias=None)
        if self.transposed:   # d/dz <T(z), g> = conv(g)
            return reference.deform_conv(grad_output, a["weight"], a["offset"], a["mask"], **self.params)
        return reference.deform_conv_transpose(grad_output, a["weight"], a["offset"], a["mask"], **self.params)


def test_collide_case_really_collides():
    case = Collide(2, False)
    # every sampling position is one of three points: the offsets' fractional parts say so
    off = case.arrays_["offset"]
    assert np.all(np.abs(off - np.round(off)) > 0.19)
    assert case.reference().shape == (2, 6, 20, 21)


# ---------------------------------------------------------------------------------------------
# without a GPU: compilation, the registry, the CPU backend


def _module_keys():
    try:
        from dcn_cupy._backends import cuda
    except ImportError:
        return []
    return cuda.all_module_keys()


@pytest.mark.parametrize("key", _module_keys(),
                         ids=lambda k: f"{np.dtype(k[0]).name}-{k[1]}d-{'i64' if k[2] else 'i32'}")
def test_deterministic_module_compiles(key, compile_module):
    from dcn_cupy._backends import cuda_deterministic
    compile_module(cuda_deterministic.module_source(), "deform_deterministic.cu",
                   cuda_deterministic.name_expressions(*key))


def test_deterministic_module_source_and_kernels():
    pytest.importorskip("cupy")
    import inspect
    import re

    from dcn_cupy._backends import cuda_deterministic as det
    source = det.module_source()
    assert '#line 1 "cuda/dcn_common.cuh"' in source and '#line 1 "cuda/deform_deterministic.cu"' in source
    assert not re.search(r'#\s*include\s+"', source)
    defined = set(re.findall(r"__global__\s+void\s+(\w+)\s*\(", source))
    assert {n.split("<", 1)[0] for n in det.name_expressions(np.float32, 2, False)} == defined
    # each kernel is launched by the executable (dict keys: col2im/finalize through kernels())
    text = inspect.getsource(det)
    for key in ("det_col2im", "det_finalize", '["weight_bound"]', '["sample_bound"]'):
        assert key in text


def _spec(deterministic, dtype=np.float32, device="cuda"):
    geom, _ = conv_geometry((2, 4, 8, 8), (6, 4, 3, 3), (2, 18, 8, 8), (2, 9, 8, 8), None, 1, 1, 1, 1)
    return _backends.PlanSpec(geom, np.dtype(dtype), device, 0, deterministic, False)


def test_registry_chooses_the_deterministic_backward(monkeypatch):
    pytest.importorskip("cupy")
    from dcn_cupy._backends import cuda_direct, cuda_fused_backward
    monkeypatch.setattr(cuda_direct, "MAX_MACS", 0)   # the choice among the other CUDA algorithms
    # cuda/im2col measured faster than cuda/fused-backward (which also serves these plans on a GPU)
    monkeypatch.setattr(cuda_fused_backward, "fused_versus_im2col", lambda *a: (2.0, 1.0, 2.0, 1.0))
    chosen = lambda spec, primitive: "{0.device}/{0.algorithm}".format(_backends.choose(spec, primitive)[0])
    assert chosen(_spec(True), "conv_backward") == "cuda/im2col-deterministic"
    assert chosen(_spec(False), "conv_backward") == "cuda/im2col"
    assert chosen(_spec(True), "conv_forward") == "cuda/im2col"      # the forward has no atomics
    reason = _backends.backend_named("cuda/im2col").serves(_spec(True), "conv_backward")
    assert "atomics" in reason
    # forcing the deterministic algorithm serves any backward; the forward stays automatic
    backend, _ = _backends.choose(_spec(False), "conv_backward", "cuda/im2col-deterministic")
    assert backend.algorithm == "im2col-deterministic"
    backend, _ = _backends.choose(_spec(False), "conv_forward", "cuda/im2col-deterministic")
    assert backend.algorithm == "im2col"
    with pytest.raises(ValueError, match="does not serve this conv_backward: .*atomics"):
        _backends.choose(_spec(True), "conv_backward", "cuda/im2col")
    # the CPU backend serves deterministic plans
    assert chosen(_spec(True, device="cpu"), "conv_backward") == "cpu/numba"


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_cpu_accepts_deterministic_and_is_bitwise_repeatable(transposed):
    numba = pytest.importorskip("numba")
    case = Collide(2, transposed, batch=2)
    arrays = case.arrays(lambda a: a.astype(np.float32))
    gy = case.grad_output.astype(np.float32)
    p = dcn_cupy.plan(**arrays, **case.params, transposed=transposed, deterministic=True)
    assert p.algorithm.startswith("forward: cpu/numba") and "deterministic" in str(p)
    threads = numba.get_num_threads()
    results = []
    try:
        for n in sorted({1, threads}):
            numba.set_num_threads(n)
            for _ in range(2):
                results.append((p.forward(**arrays), p.backward(gy, **arrays),
                                case.forward(**arrays, **case.params, **({"deterministic": True} if transposed else {})),
                                case.backward(gy, **arrays, **case.params, deterministic=True)))
    finally:
        numba.set_num_threads(threads)
    y0, g0, f0, b0 = results[0]
    for y, g, f, b in results[1:]:
        assert y.tobytes() == y0.tobytes() and f.tobytes() == f0.tobytes()
        for name in ARGUMENTS:
            assert getattr(g, name).tobytes() == getattr(g0, name).tobytes(), name
            assert getattr(b, name).tobytes() == getattr(b0, name).tobytes(), name
    # the same numbers as the default mode (one code path), and right
    plain = case.backward(gy, **arrays, **case.params)
    for name in ARGUMENTS:
        assert getattr(plain, name).tobytes() == getattr(b0, name).tobytes(), name
    ref = case.reference({k: a.astype(np.float64) for k, a in arrays.items()})
    assert relative_error(y0, ref) < 1e-5


def test_functional_cache_key_includes_deterministic():
    case = Collide(1, True, batch=1)
    arrays = case.arrays()
    _plan.clear_plan_cache()
    case.forward(**arrays, **case.params)
    case.forward(**arrays, **case.params, deterministic=True)
    case.backward(case.grad_output, **arrays, **case.params, deterministic=True)
    assert _plan.plan_cache_size() == 2
    keys = list(_plan._cache)
    assert {k[-1] for k in keys} == {False, True}
    assert [p.deterministic for p in _plan._cache.values()] == [False, True]


# ---------------------------------------------------------------------------------------------
# GPU


def _cupy():
    return pytest.importorskip("cupy")


def _host(a):
    cupy = _cupy()
    return None if a is None else cupy.asnumpy(a).astype(np.float64)


def _bits(a):
    cupy = _cupy()
    return None if a is None else cupy.asnumpy(a).tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_weight_bound_is_the_largest_column_sum_in_a_fixed_order(dtype):
    """``det_weight_bound``: max over (g, j) of sum_o |W[g, o, j]| over the finite entries, W seen
    as (G, C_out/G, C/G * K), each column summed by 8 warps' runs of rows added in a fixed order:
    the float64 column sums within rounding, and bitwise the same bound for every grid (one
    block, a few, one per 32 columns); groups, row counts below and off the 8 runs, non-finite
    weights left out; blocks of 64 and 32 threads too."""
    cupy = _cupy()
    from dcn_cupy._backends import cuda_deterministic
    kernel = cuda_deterministic._kernels(dtype, 2, False)["weight_bound"]
    rng = np.random.default_rng(15)
    for groups, rows, cols in ((1, 256, 2304), (3, 5, 33), (2, 37, 7), (1, 8, 100), (4, 1, 9)):
        w = rng.standard_normal((groups, rows, cols)).astype(dtype)
        w.reshape(-1)[rng.integers(0, w.size, 3)] = np.inf
        w.reshape(-1)[rng.integers(0, w.size, 2)] = np.nan
        magnitude = np.abs(w.astype(np.float64))
        expected = np.where(np.isfinite(magnitude), magnitude, 0).sum(axis=1).max()
        device = cupy.asarray(w)
        found = set()
        for blocks, threads in ((1, 256), (3, 256), (-(-groups * cols // 32), 256), (2, 64), (5, 32)):
            bound = cupy.zeros(1, dtype=np.uint64)
            kernel((blocks,), (threads,), (device, np.int32(groups), np.int32(rows), np.int32(cols), bound))
            found.add(int(cupy.asnumpy(bound)[0]))
        assert len(found) == 1, (groups, rows, cols)
        got = np.array(list(found), dtype=np.uint64).view(np.float64)[0]
        assert abs(got - expected) <= 1e-13 * expected, (groups, rows, cols, got, expected)


def _expected_gradients(case, arrays64, grad_output64):
    """Float64 gradients of the (rounded) inputs: the input gradient from the reference (by
    the adjoint definition), the others from the default CUDA backward in float64 (validated
    against the reference and finite differences in test_cuda.py; no Numba compilation here)."""
    cupy = _cupy()
    gpu = case.backward(cupy.asarray(grad_output64), **{k: cupy.asarray(a) for k, a in arrays64.items()},
                        **case.params)
    expected = {name: _host(getattr(gpu, name)) for name in ARGUMENTS}
    reference_input = case.input_gradient_reference(arrays64, grad_output64)
    assert relative_error(expected["input"], reference_input) < 1e-10
    expected["input"] = reference_input
    return expected


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_colliding_backward_bitwise_repeatable_and_right(ndim, transposed, dtype):
    cupy = _cupy()
    case = Collide(ndim, transposed)
    arrays64 = {k: a.astype(dtype).astype(np.float64) for k, a in case.arrays_.items()}
    gy64 = case.grad_output.astype(dtype).astype(np.float64)
    arrays = {k: cupy.asarray(a.astype(dtype)) for k, a in case.arrays_.items()}
    gy = cupy.asarray(case.grad_output.astype(dtype))
    expected = _expected_gradients(case, arrays64, gy64)
    tol = TOL[np.dtype(dtype)]
    # the forward (the transposed one is the scatter)
    y_ref = case.reference(arrays64)
    for deterministic in (False, True):
        kw = {"deterministic": deterministic} if transposed else {}
        ys = [case.forward(**arrays, **case.params, **kw) for _ in range(5)]
        assert relative_error(_host(ys[0]), y_ref) < tol, (deterministic, case.label)
        if deterministic:
            assert len({_bits(y) for y in ys}) == 1, case.label
    # every gradient, 5 runs in each mode
    full = {}
    for deterministic in (False, True):
        runs = [case.backward(gy, **arrays, **case.params, deterministic=deterministic) for _ in range(5)]
        for name in ARGUMENTS:
            got = getattr(runs[0], name)
            assert got.dtype == dtype
            err = relative_error(_host(got), expected[name])
            assert err < tol, f"{name} deterministic={deterministic}: {err} {case.label}"
            if deterministic:
                assert len({_bits(getattr(r, name)) for r in runs}) == 1, f"{name}: {case.label}"
        full[deterministic] = runs[0]
    # every wrt subset: computed alone, repeatable, right; input and weight bitwise the full ones
    for wanted in SUBSETS:
        first, second = (case.backward(gy, **arrays, **case.params, wrt=wanted, deterministic=True)
                         for _ in range(2))
        for name in ARGUMENTS:
            got = getattr(first, name)
            if name not in wanted:
                assert got is None, (name, wanted)
                continue
            assert _bits(got) == _bits(getattr(second, name)), (name, wanted)
            if name in ("input", "weight", "bias"):
                assert _bits(got) == _bits(getattr(full[True], name)), (name, wanted)
            else:
                assert relative_error(_host(got), expected[name]) < tol, (name, wanted)


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_deterministic_float64_finite_differences(ndim, transposed):
    cupy = _cupy()
    case = Collide(ndim, transposed, seed=1, batch=1)
    rng = np.random.default_rng(7)
    grads = case.backward(cupy.asarray(case.grad_output), **case.arrays(cupy.asarray), **case.params,
                          deterministic=True)
    from cases import Case
    as_case = Case(ndim, transposed, case.arrays_, case.params, case.label)
    for name in ARGUMENTS:
        direction = rng.standard_normal(case.arrays_[name].shape)
        expected = directional_derivative(as_case, name, case.grad_output, direction)
        actual = float(np.vdot(_host(getattr(grads, name)), direction))
        assert actual == pytest.approx(expected, rel=1e-6, abs=1e-8), f"{name}: {case.label}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16], ids=["float32", "float64", "float16"])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_bitwise_across_launch_configurations(transposed, dtype, monkeypatch):
    """The scatter's shared-memory box (on, off, no halo) and its grid do not change one bit."""
    cupy = _cupy()
    from dcn_cupy._backends import cuda, cuda_deterministic
    case = Collide(2, transposed, seed=2, batch=3)
    arrays = {k: cupy.asarray(a.astype(dtype)) for k, a in case.arrays_.items()}
    gy = cupy.asarray(case.grad_output.astype(dtype))

    def run():
        p = dcn_cupy.plan(**arrays, **case.params, transposed=transposed, deterministic=True)
        assert "im2col-deterministic" in p.algorithm
        g = p.backward(gy, **arrays)
        return (_bits(p.forward(**arrays)) if transposed else None), _bits(g.input), _bits(g.weight)

    baseline = run()
    for setting, value in (("TILE_SMEM_BYTES", 0), ("TILE_HALO", 0), ("TILE_HALO", 40)):
        with monkeypatch.context() as m:
            m.setattr(cuda, setting, value)
            assert run() == baseline, setting
    with monkeypatch.context() as m:   # grid-stride loops over 3 blocks, other block and tile sizes
        for module in (cuda, cuda_deterministic):
            m.setattr(module, "_MAX_GRID", 3)
            m.setattr(module, "_BLOCK", 64)
        m.setattr(cuda_deterministic, "_TILE", 128)
        assert run() == baseline, "grid"


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_row_chunks_and_sample_chunks(transposed, monkeypatch):
    """Chunks of whole samples and slabs of rows (bounds over the whole sample) agree."""
    cupy = _cupy()
    from dcn_cupy._backends import cuda
    case = Collide(2, transposed, seed=3, batch=3)
    arrays = case.arrays(cupy.asarray)
    gy = cupy.asarray(case.grad_output)
    expected = _expected_gradients(case, case.arrays_, case.grad_output)
    results = []
    for limit in (cuda.WORKSPACE_LIMIT_BYTES, 300_000, 150_000, 40_000):
        with monkeypatch.context() as m:
            m.setattr(cuda, "WORKSPACE_LIMIT_BYTES", limit)
            p = dcn_cupy.plan(**arrays, **case.params, transposed=transposed, deterministic=True)
            runs = [p.backward(gy, **arrays) for _ in range(3)]
        for name in ARGUMENTS:
            assert len({_bits(getattr(r, name)) for r in runs}) == 1, (name, limit)
            assert relative_error(_host(getattr(runs[0], name)), expected[name]) < 1e-10, (name, limit)
        results.append(str(p))
    assert any("row(s)" in s for s in results), results


@pytest.mark.gpu
def test_non_finite_contributions_are_order_free():
    cupy = _cupy()
    case = Collide(2, False, seed=4)
    gy = case.grad_output.copy()
    gy[0, 1, 3, 4] = np.inf
    gy[0, 2, 5, 5] = -np.inf
    gy[1, 0, 2, 2] = np.nan
    # float atomics give order-free non-finite patterns too: the default mode is the yardstick
    expected = _host(case.backward(cupy.asarray(gy), **case.arrays(cupy.asarray), **case.params,
                                   wrt=["input"]).input)
    assert np.isnan(expected).any() and np.isfinite(expected).any()
    runs = [case.backward(cupy.asarray(gy), **case.arrays(cupy.asarray), **case.params, wrt=["input"],
                          deterministic=True).input for _ in range(3)]
    assert len({_bits(r) for r in runs}) == 1
    got = _host(runs[0])
    for test in (np.isnan, np.isposinf, np.isneginf):
        assert np.array_equal(test(got), test(expected)), test.__name__
    finite = np.isfinite(expected)
    assert relative_error(got[finite], expected[finite]) < 1e-10


@pytest.mark.gpu
def test_plan_descriptions_and_broadcast_batch(monkeypatch):
    cupy = _cupy()
    from dcn_cupy._backends import cuda_direct
    monkeypatch.setattr(cuda_direct, "MAX_MACS", 0)   # the choice among the other CUDA algorithms
    case = Collide(2, True, seed=5, batch=3)
    arrays = case.arrays(cupy.asarray)
    p = dcn_cupy.plan(**arrays, **case.params, transposed=True, deterministic=True)
    assert p.algorithm == "forward: cuda/im2col-deterministic, backward: cuda/im2col + cuda/im2col-deterministic"
    assert "fixed-point" in str(p)
    q = dcn_cupy.plan(**arrays, **case.params, transposed=True)
    assert q.algorithm == "forward: cuda/im2col, backward: cuda/im2col"
    # a broadcast batch (stride 0) of the transposed input: the bound reads it in place
    z = cupy.broadcast_to(arrays["input"][:1], arrays["input"].shape)
    y = p.forward(z, arrays["weight"], arrays["offset"], arrays["mask"], arrays["bias"])
    z64 = np.broadcast_to(case.arrays_["input"][:1], case.arrays_["input"].shape)
    assert relative_error(_host(y), case.reference(dict(case.arrays_, input=z64))) < 1e-10


# ---------------------------------------------------------------------------------------------
# the fused backward's deterministic mode (cuda/fused-backward's DET data kernel)

#: The convolution's (C_in, C_out), groups, offset groups, mask groups: every pass of a
#: position's lanes in one group (the coalesced fixed-point scatter), and segments smaller than
#: a pass (each lane its own 4 channels).
FUSED_LAYOUTS = {"uniform": ((128, 32), 1, 1, 1), "grouped": ((64, 32), 2, 2, 1)}


def _fused_case(ndim, transposed, layout, seed=6):
    channels, groups, offset_groups, mask_groups = FUSED_LAYOUTS[layout]
    return Collide(ndim, transposed, seed=seed, channels=channels, groups=groups, offset_groups=offset_groups,
                   mask_groups=mask_groups)


def _fused_plan(case, arrays, monkeypatch, tile=None, plans=None, allow_tf32=False):
    """A deterministic plan whose backward (the transposed forward too) is cuda/fused-backward's,
    with the data tile ``tile`` and the sampling plans forced on or off (None: the rules)."""
    from dcn_cupy._backends import cuda_fused_backward as fb
    if tile is not None:
        monkeypatch.setattr(fb, "_choose_tile", lambda geom, dtype: tile)
    monkeypatch.setattr(fb, "SAMPLING_PLAN", plans)
    return dcn_cupy.plan(**arrays, **case.params, transposed=case.transposed, deterministic=True,
                         algorithm="cuda/fused-backward", allow_tf32=allow_tf32)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(FUSED_LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES[:3], ids=DTYPE_IDS[:3])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_fused_deterministic_bitwise_across_runs_tiles_and_plans(ndim, transposed, dtype, layout, monkeypatch):
    """Colliding inputs: every gradient (and the transposed forward, the same scatter) is bitwise
    the same over 3 runs, over both data tiles and with the sampling plans on and off, and right."""
    cupy = _cupy()
    from dcn_cupy._backends import cuda_fused_backward as fb
    case = _fused_case(ndim, transposed, layout)
    arrays64 = {k: a.astype(dtype).astype(np.float64) for k, a in case.arrays_.items()}
    gy64 = case.grad_output.astype(dtype).astype(np.float64)
    arrays = {k: cupy.asarray(a.astype(dtype)) for k, a in case.arrays_.items()}
    gy = cupy.asarray(case.grad_output.astype(dtype))
    results = []
    for tile in fb._tiles(dtype):
        for plans in (False, True):
            with monkeypatch.context() as m:
                p = _fused_plan(case, arrays, m, tile, plans)
                assert "fixed-point 64-bit channels-last scatter" in str(p), str(p)
                runs = []
                for _ in range(3):
                    grads = p.backward(gy, **arrays)
                    y = p.forward(**arrays) if transposed else None
                    runs.append(tuple(_bits(getattr(grads, name)) for name in ARGUMENTS) + (_bits(y),))
            assert len(set(runs)) == 1, (tile, plans, case.label)
            results.append(runs[0])
    assert len(set(results)) == 1, case.label
    tol = TOL[np.dtype(dtype)]
    expected = _expected_gradients(case, arrays64, gy64)
    for name in ARGUMENTS:
        err = relative_error(_host(getattr(grads, name)), expected[name])
        assert err < tol, (name, err, case.label)
    if transposed:
        assert relative_error(_host(y), case.reference(arrays64)) < tol, case.label


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float32", "tf32", "float16", "bfloat16"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_fused_deterministic_bitwise_on_wgmma_and_mma_sync(ndim, precision, monkeypatch):
    """Deterministic mode's data kernel on wgmma (sm_90a: the 64-row tiles) adds the column
    gradients' products in the mma.sync loop's order (3xTF32: each k8's three products summed
    apart, then added), so every tile on either main loop gives the same bits; and right."""
    cupy = _cupy()
    from dcn_cupy._backends import cuda_fused_backward as fb
    if not fb._wgmma_device():
        pytest.skip("the wgmma main loop needs an sm_90a device")
    dtype = np.dtype(np.float32) if precision == "tf32" else DTYPES[DTYPE_IDS.index(precision)]
    # (C_out/groups 80: several reduction steps, the last partial, in every precision)
    case = Collide(ndim, False, seed=7, channels=(64, 160), groups=2, offset_groups=2, mask_groups=1)
    arrays = {k: cupy.asarray(a.astype(dtype)) for k, a in case.arrays_.items()}
    gy = cupy.asarray(case.grad_output.astype(dtype))
    results = {}
    for tile in fb._tiles(dtype):
        for wgmma in ((False, True) if tile[0] == 64 else (False,)):
            with monkeypatch.context() as m:
                m.setattr(fb, "WGMMA_DATA", wgmma)
                p = _fused_plan(case, arrays, m, tile, allow_tf32=precision == "tf32")
                # the backward's line (the forward's may name wgmma too: its engine is timed)
                backward = next(line for line in str(p).splitlines() if "(backward):" in line)
                assert ("wgmma, tile" in backward) == wgmma, str(p)
                grads = p.backward(gy, **arrays)
                results[tile, wgmma] = tuple(_bits(getattr(grads, name)) for name in ARGUMENTS)
    assert len(set(results.values())) == 1, [key for key in results if results[key] != results[tile, False]]
    arrays64 = {k: a.astype(dtype).astype(np.float64) for k, a in case.arrays_.items()}
    expected = _expected_gradients(case, arrays64, case.grad_output.astype(dtype).astype(np.float64))
    tol = 5e-3 if precision == "tf32" else TOL[dtype]
    for name in ARGUMENTS:
        err = relative_error(_host(getattr(grads, name)), expected[name])
        assert err < tol, (name, err, case.label)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(FUSED_LAYOUTS))
@pytest.mark.parametrize("precision", ["float16", "tf32", "float32"])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_fused_deterministic_fast_path_same_bits(ndim, transposed, precision, layout, monkeypatch):
    """The deterministic scatter's fast path (a position's values finite and 2^E a normal float
    at most 2^100: each value scaled by 2^E once, each corner's reductions issued together;
    DETERMINISTIC_FAST_PATH) gives the integers, so the bits, of the general loop (ldexpf per
    contribution): on colliding and on small random offsets, with inf, -inf and NaN among the
    scattered values (their positions take the general loop), with values so small that E
    exceeds 100 (every position takes it), with the gradient plans on and off."""
    cupy = _cupy()
    from dcn_cupy._backends import cuda_fused_backward as fb
    dtype = np.dtype(np.float32) if precision == "tf32" else np.dtype(precision)
    case = _fused_case(ndim, transposed, layout, seed=8)
    rng = np.random.default_rng(ndim)
    smooth = rng.normal(0.0, 0.6, case.arrays_["offset"].shape)
    # the scattered values: grad_output's, or the transposed forward's input
    name = "input" if transposed else "grad_output"
    plain = (case.arrays_["input"] if transposed else case.grad_output).astype(dtype)
    non_finite = plain.copy()
    flat = non_finite.reshape(-1)
    flat[rng.choice(flat.size, 3, replace=False)] = (np.inf, -np.inf, np.nan)
    variants = [(case.arrays_["offset"], non_finite), (smooth, plain)]
    if dtype == np.float32:   # (below float16's range)
        variants.append((smooth, (plain * 1e-20).astype(dtype)))
    for offset, scattered in variants:
        finite = np.isfinite(scattered).all()
        inputs = dict(case.arrays_, offset=offset, grad_output=case.grad_output)
        inputs[name] = scattered
        arrays = {k: cupy.asarray(np.asarray(a).astype(dtype)) for k, a in inputs.items()}
        gy = arrays.pop("grad_output")
        results = {}
        for fast in (False, True):
            for plans in (False, True):
                with monkeypatch.context() as m:
                    m.setattr(fb, "DETERMINISTIC_FAST_PATH", fast)
                    p = _fused_plan(case, arrays, m, plans=plans, allow_tf32=precision == "tf32")
                    grads = p.backward(gy, **arrays)
                    alone = p.backward(gy, **arrays, wrt=["input"]).input
                    y = p.forward(**arrays) if transposed else None
                    results[fast, plans] = (tuple(_bits(getattr(grads, n)) for n in ARGUMENTS)
                                            + (_bits(alone), _bits(y)))
        assert results[True, False] == results[False, False], case.label
        assert results[True, True] == results[False, True], case.label
        out = _host(y if transposed else grads.input)
        # (colliding offsets spread the non-finite values over every point sampled)
        assert np.isfinite(out).all() and np.abs(out).max() > 0 if finite else not np.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(FUSED_LAYOUTS))
def test_fused_deterministic_non_finite_and_chunks(layout, monkeypatch):
    """Non-finite contributions (inf, -inf, NaN in grad_output) give the default mode's pattern,
    bitwise the same in every run; one sample per chunk gives the same input, offset and mask
    gradients bit for bit (the exponents are per sample)."""
    cupy = _cupy()
    from dcn_cupy._backends import cuda_fused
    case = _fused_case(2, False, layout, seed=4)
    gy = case.grad_output.astype(np.float32)
    gy[0, 1, 3, 4] = np.inf
    gy[0, 2, 5, 5] = -np.inf
    gy[1, 0, 2, 2] = np.nan
    arrays = case.arrays(lambda a: cupy.asarray(a.astype(np.float32)))
    expected = _host(case.backward(cupy.asarray(gy), **arrays, **case.params, wrt=["input"]).input)
    assert np.isnan(expected).any() and np.isfinite(expected).any()
    p = _fused_plan(case, arrays, monkeypatch)
    runs = [p.backward(cupy.asarray(gy), **arrays) for _ in range(3)]
    assert len({_bits(r.input) for r in runs}) == 1
    got = _host(runs[0].input)
    for test in (np.isnan, np.isposinf, np.isneginf):
        assert np.array_equal(test(got), test(expected)), test.__name__
    finite = np.isfinite(expected)
    assert relative_error(got[finite], expected[finite]) < 1e-4
    monkeypatch.setattr(cuda_fused, "WORKSPACE_LIMIT_BYTES", 1)
    chunked = _fused_plan(case, arrays, monkeypatch)
    assert "chunks of 1 samples" in str(chunked)
    again = chunked.backward(cupy.asarray(gy), **arrays)
    for name in ("input", "offset", "mask"):
        assert _bits(getattr(again, name)) == _bits(getattr(runs[0], name)), name


@pytest.mark.gpu
def test_deterministic_plans_follow_the_fused_measurement(monkeypatch):
    """Deterministic plans take cuda/fused-backward where it measured faster than cuda/im2col
    (the same measurement as the default mode), else cuda/im2col-deterministic."""
    cupy = _cupy()
    from dcn_cupy._backends import cuda_direct, cuda_fused_backward as fb
    monkeypatch.setattr(cuda_direct, "MAX_MACS", 0)
    case = _fused_case(2, False, "uniform")
    arrays = case.arrays(lambda a: cupy.asarray(a.astype(np.float16)))
    monkeypatch.setattr(fb, "fused_versus_im2col", lambda *a: (1.0, 2.0, 2.0, 1.0))
    p = dcn_cupy.plan(**arrays, **case.params, deterministic=True)
    assert "backward: cuda/fused-backward" in p.algorithm and "fixed-point" in str(p)
    monkeypatch.setattr(fb, "fused_versus_im2col", lambda *a: (2.0, 1.0, 1.0, 2.0))
    p = dcn_cupy.plan(**arrays, **case.params, deterministic=True)
    assert "backward: cuda/im2col-deterministic" in p.algorithm
