"""The CUDA backend on a GPU: against the float64 reference, finite differences, the CPU
backend and torchvision; dtypes, non-finite offsets, chunking, 64-bit indexing, interop.

Every test carries ``@pytest.mark.gpu`` (conftest.py skips them where no CUDA device is
visible). Tolerances: float64 1e-10 relative (rounding only), float32 1e-4, and for the half
types a few units of their roundoff u (2^-11 float16, 2^-8 bfloat16): inputs are rounded
once (the reference sees the same rounded values), the columns are stored in the half type
(one rounding of every sampled value, relative u) and the output is rounded once; sums with
random signs keep the relative error in the norm at about u per rounding, hence 6u for the
forward (3e-3 / 2.4e-2) and 10u for gradients, whose column operands are rounded too.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before anything imports jax

import numpy as np
import pytest

import dcn_cupy
from dcn_cupy import reference
from dcn_cupy._interop import BFLOAT16

from dcn_cupy.testing import ARGUMENTS, directional_derivative, random_case, relative_error

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _im2col(monkeypatch):
    """This file tests cuda/im2col: its small cases would otherwise go to cuda/direct (which
    tests/test_cuda_direct.py covers), so cuda/direct leaves the automatic choice (the
    functional API's plan key includes its limit; NumPy arrays still go to the CPU)."""
    from dcn_cupy._backends import cuda_direct
    monkeypatch.setattr(cuda_direct, "MAX_MACS", 0)

HALF_TOL = {np.dtype(np.float16): 3e-3, BFLOAT16: 2.4e-2}
HALF_GRAD_TOL = {np.dtype(np.float16): 5e-3, BFLOAT16: 4e-2}


def to_gpu(dtype=None):
    def convert(a):
        a = np.asarray(a)
        return cupy.asarray(a if dtype is None else a.astype(dtype))
    return convert


def host(a):
    if a is None:
        return None
    if isinstance(a, cupy.ndarray):
        a = cupy.asnumpy(a)
    return np.asarray(a).astype(np.float64)


def rounded(case, dtype):
    """The case's arrays rounded to ``dtype`` and back to float64 (what the GPU sees)."""
    return {k: None if a is None else a.astype(dtype).astype(np.float64) for k, a in case.arrays_.items()}


def cuda_backend():
    from dcn_cupy._backends import cuda
    return cuda


# ---------------------------------------------------------------------------------------------
# against the reference


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_forward_float64_matches_reference(ndim, transposed, seed):
    rng = np.random.default_rng(100 * ndim + seed)
    case = random_case(rng, ndim, transposed, offset=seed % 3 != 1, mask=seed % 3 != 2, bias=seed % 2 == 0)
    out = case.forward(**case.arrays(to_gpu()), **case.params)
    assert isinstance(out, cupy.ndarray) and out.dtype == np.float64
    assert relative_error(host(out), case.reference()) < 1e-10, case.label


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_forward_float32_matches_reference(ndim, transposed):
    rng = np.random.default_rng(7 + ndim)
    case = random_case(rng, ndim, transposed, channels_scale=3)
    out = case.forward(**case.arrays(to_gpu(np.float32)), **case.params)
    assert out.dtype == np.float32
    assert relative_error(host(out), case.reference(rounded(case, np.float32))) < 1e-4, case.label


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_half_types(ndim, transposed, dtype):
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(11 + ndim)
    case = random_case(rng, ndim, transposed, channels_scale=3)
    ref_arrays = rounded(case, dtype)
    out = case.forward(**case.arrays(to_gpu(dtype)), **case.params)
    assert out.dtype == dtype
    assert relative_error(host(out), case.reference(ref_arrays)) < HALF_TOL[dtype], case.label
    # Gradients against the float64 GPU gradients of the same (rounded) inputs.
    grad_output = rng.standard_normal(out.shape).astype(dtype)
    grads = case.backward(cupy.asarray(grad_output), **case.arrays(to_gpu(dtype)), **case.params)
    exact = case.backward(cupy.asarray(grad_output.astype(np.float64)),
                          **{k: None if a is None else cupy.asarray(a) for k, a in ref_arrays.items()},
                          **case.params)
    for name in ARGUMENTS:
        got = getattr(grads, name)
        assert got.dtype == dtype, name
        err = relative_error(host(got), host(getattr(exact, name)))
        assert err < HALF_GRAD_TOL[dtype], f"{name}: {err} {case.label}"


@pytest.mark.parametrize("channels_scale", [8, 32], ids=["c8", "c32"])
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32], ids=["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_channels_last_columns(ndim, transposed, dtype, channels_scale, monkeypatch):
    """cuda/im2col's columns from the channels-last sampler (``CHANNELS_LAST_COLUMNS``) against
    deform_im2col's and the float64 reference: forward and every gradient, with conv groups and
    offset groups != mask groups (channels per group multiples of 8), 1, 2 or 4 vectors per
    thread (8 to 256 channels), in one chunk, in chunks of samples, and with 64-bit indices; in
    3D for every dtype (CHANNELS_LAST_COLUMNS_3D holds all three)."""
    cuda = cuda_backend()
    dtype = np.dtype(dtype)
    if ndim == 3:
        assert dtype in cuda.CHANNELS_LAST_COLUMNS_3D
    tol, grad_tol = HALF_TOL.get(dtype, 1e-4), HALF_GRAD_TOL.get(dtype, 1e-4)
    rng = np.random.default_rng(61 + ndim + 2 * transposed + channels_scale)
    case = random_case(rng, ndim, transposed, batch=5, channels_scale=channels_scale)
    arrays = case.arrays(to_gpu(dtype))
    ref_arrays = rounded(case, dtype)
    expected = case.reference(ref_arrays)
    grad_output = cupy.asarray(rng.standard_normal(expected.shape).astype(dtype))
    exact = case.backward(grad_output.astype(np.float64),
                          **{k: None if a is None else cupy.asarray(a) for k, a in ref_arrays.items()},
                          **case.params)

    def run(channels_last, limit=cuda.WORKSPACE_LIMIT_BYTES, int32_safe=cuda._INT32_SAFE):
        monkeypatch.setattr(cuda, "CHANNELS_LAST_COLUMNS", channels_last)
        monkeypatch.setattr(cuda, "WORKSPACE_LIMIT_BYTES", limit)
        monkeypatch.setattr(cuda, "_INT32_SAFE", int32_safe)
        p = dcn_cupy.plan(**arrays, **case.params, transposed=transposed, algorithm="cuda/im2col")
        return str(p), p.forward(**arrays), p.backward(grad_output, **arrays)

    described, y_old, g_old = run(False)
    assert "channels-last copy" not in described, described
    described, y_one, g_one = run(True)
    assert "channels-last copy" in described and "of up to 5 sample(s)" in described, described
    results = [(y_one, g_one), run(True, int32_safe=0)[1:]]
    for limit in sorted({int(2**20 * 0.8**i) // 256 * 256 for i in range(40)}, reverse=True):
        described, *result = run(True, limit=limit)   # the largest limit that splits the batch
        if "channels-last copy" in described and ("up to 1 sample(s)" in described
                                                   or "up to 2 sample(s)" in described):
            results.append(result)
            break
    assert len(results) == 3, "no workspace limit gave chunks of samples with the channels-last sampler"
    for y, g in [(y_old, g_old)] + results:
        assert relative_error(host(y), expected) < tol, case.label
        assert relative_error(host(y), host(y_old)) < tol, case.label
        for name in ARGUMENTS:
            got = getattr(g, name)
            assert got.dtype == dtype, name
            err = relative_error(host(got), host(getattr(exact, name)))
            assert err < grad_tol, f"{name}: {err} {case.label}"
    # 64-bit indices: the same columns, the same GEMMs
    assert relative_error(host(results[1][1].weight), host(g_one.weight)) < 1e-12


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("shape", [(3, 35), (3, 5, 7), (2, 4, 6)], ids=["1d-odd", "2d-odd", "2d-even"])
def test_channels_last_columns_odd_row_length(shape, dtype, monkeypatch):
    """fused_columns stores two positions per lane only where a columns row (n*Q positions) has
    even length; an odd one (3 samples of 35 or 5x7 positions) takes its one-value stores, and
    both give deform_im2col's columns (forward and the weight gradient, which reads them)."""
    cuda = cuda_backend()
    dtype = np.dtype(dtype)
    batch, *spatial = shape
    ndim = len(spatial)
    rng = np.random.default_rng(sum(shape) + ndim)
    C, K = 16, 3 ** ndim
    arrays = {"input": rng.standard_normal((batch, C, *spatial)),
              "weight": rng.standard_normal((C, C) + (3,) * ndim) / (C * K) ** 0.5,
              "offset": rng.standard_normal((batch, ndim * K, *spatial)),
              "mask": rng.random((batch, K, *spatial))}
    arrays = {k: a.astype(dtype) for k, a in arrays.items()}
    grad_output = rng.standard_normal((batch, C, *spatial)).astype(dtype)
    expected = reference.deform_conv(**{k: a.astype(np.float64) for k, a in arrays.items()}, padding=1)
    results = {}
    for channels_last in (False, True):
        monkeypatch.setattr(cuda, "CHANNELS_LAST_COLUMNS", channels_last)
        p = dcn_cupy.plan(**{k: cupy.asarray(a) for k, a in arrays.items()}, padding=1, algorithm="cuda/im2col")
        assert ("channels-last copy" in str(p)) == channels_last, str(p)
        gpu = {k: cupy.asarray(a) for k, a in arrays.items()}
        results[channels_last] = (host(p.forward(**gpu)), p.backward(cupy.asarray(grad_output), **gpu))
    tol = HALF_TOL.get(dtype, 1e-4)
    for y, _ in results.values():
        assert relative_error(y, expected) < tol
    assert relative_error(results[True][0], results[False][0]) < tol
    for name in ARGUMENTS:
        got, old = getattr(results[True][1], name), getattr(results[False][1], name)
        if old is None:
            continue
        assert relative_error(host(got), host(old)) < HALF_GRAD_TOL.get(dtype, 1e-4), name


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_channels_last_columns_by_any_lanes_per_position(ndim, dtype, monkeypatch):
    """fused_columns' block shapes (``cuda.COLUMN_MIN_LANES`` 8, 4 and 2: 1 to 4 vectors per
    thread at 8, 4 or 2 threads per position, so 32 to 128 positions per block) give the same
    columns bit for bit: the forward and the weight gradient (which reads them) equal across
    shapes, and the float64 reference's; 1 to 32 vectors of channels, two offset groups, odd and
    even row lengths (paired stores or not), partial position tiles."""
    cuda = cuda_backend()
    dtype = np.dtype(dtype)
    vec = cuda._COLUMN_VEC[dtype]
    spatial = {1: (37,), 2: (5, 7), 3: (3, 5, 3)}[ndim]
    K = 3 ** ndim
    for i, vectors in enumerate((1, 2, 4, 8, 16, 32)):
        C, batch = vectors * vec, 2 + i % 2
        groups = 2 if vectors % 2 == 0 else 1
        rng = np.random.default_rng(1000 * ndim + vectors)
        arrays = {"input": rng.standard_normal((batch, C, *spatial)),
                  "weight": rng.standard_normal((8, C) + (3,) * ndim) / (C * K) ** 0.5,
                  "offset": 2 * rng.standard_normal((batch, groups * ndim * K, *spatial)),
                  "mask": rng.random((batch, K, *spatial))}
        arrays = {k: a.astype(dtype) for k, a in arrays.items()}
        grad_output = cupy.asarray(rng.standard_normal((batch, 8, *spatial)).astype(dtype))
        gpu = {k: cupy.asarray(a) for k, a in arrays.items()}
        expected = reference.deform_conv(**{k: a.astype(np.float64) for k, a in arrays.items()}, padding=1)
        results = []
        for min_lanes in (8, 4, 2):
            monkeypatch.setattr(cuda, "COLUMN_MIN_LANES", min_lanes)
            p = dcn_cupy.plan(**gpu, padding=1, algorithm="cuda/im2col")
            assert "channels-last copy" in str(p), str(p)
            results.append((cupy.asnumpy(p.forward(**gpu)), cupy.asnumpy(p.backward(grad_output, **gpu).weight)))
        for y, gw in results[1:]:
            assert np.array_equal(y, results[0][0]) and np.array_equal(gw, results[0][1]), (C, ndim)
        assert relative_error(host(results[-1][0]), expected) < HALF_TOL.get(dtype, 1e-4), (C, ndim)


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_gradients_match_finite_differences(ndim, transposed, seed):
    rng = np.random.default_rng(5000 + 100 * ndim + seed)
    case = random_case(rng, ndim, transposed, offset=True, mask=seed != 2, bias=True)
    out = case.reference()
    grad_output = rng.standard_normal(out.shape)
    grads = case.backward(cupy.asarray(grad_output), **case.arrays(to_gpu()), **case.params)
    for name in ARGUMENTS:
        value = case.arrays_[name]
        if value is None:
            assert getattr(grads, name) is None
            continue
        direction = rng.standard_normal(value.shape)
        expected = directional_derivative(case, name, grad_output, direction)
        actual = float(np.vdot(host(getattr(grads, name)), direction))
        assert actual == pytest.approx(expected, rel=1e-6, abs=1e-8), f"{name}: {case.label}"


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_gpu_matches_cpu_backend(ndim, transposed):
    rng = np.random.default_rng(77 + ndim)
    case = random_case(rng, ndim, transposed, batch=3, channels_scale=2)
    grad_output = rng.standard_normal(case.reference().shape)
    for dtype, tol in ((np.float64, 1e-10), (np.float32, 1e-4)):
        cpu_arrays = case.arrays(lambda a: a.astype(dtype))
        gpu_arrays = case.arrays(to_gpu(dtype))
        y_cpu = case.forward(**cpu_arrays, **case.params)
        y_gpu = case.forward(**gpu_arrays, **case.params)
        assert relative_error(host(y_gpu), host(y_cpu)) < tol
        g_cpu = case.backward(grad_output.astype(dtype), **cpu_arrays, **case.params)
        g_gpu = case.backward(cupy.asarray(grad_output.astype(dtype)), **gpu_arrays, **case.params)
        for name in ARGUMENTS:
            assert relative_error(host(getattr(g_gpu, name)), host(getattr(g_cpu, name))) < tol, (dtype, name)


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_wrt_subsets_and_missing_arguments(transposed):
    rng = np.random.default_rng(4)
    case = random_case(rng, 2, transposed)
    gy = cupy.asarray(rng.standard_normal(case.reference().shape))
    full = case.backward(gy, **case.arrays(to_gpu()), **case.params)
    for name in ARGUMENTS:
        part = case.backward(gy, **case.arrays(to_gpu()), **case.params, wrt=[name])
        assert relative_error(host(getattr(part, name)), host(getattr(full, name))) < 1e-12, name
        assert all(getattr(part, other) is None for other in ARGUMENTS if other != name)
    # offset only, mask only (different kernel variants when G_o != G_m)
    for wanted in ({"offset"}, {"mask"}, {"offset", "mask"}):
        part = case.backward(gy, **case.arrays(to_gpu()), **case.params, wrt=wanted)
        for name in wanted:
            assert relative_error(host(getattr(part, name)), host(getattr(full, name))) < 1e-12, name


@pytest.mark.parametrize("offset_groups,mask_groups", [(1, 4), (4, 1), (2, 4), (4, 2), (3, 1), (1, 3)])
def test_independent_offset_and_mask_groups(offset_groups, mask_groups):
    rng = np.random.default_rng(31 + offset_groups * 10 + mask_groups)
    c_in = math.lcm(offset_groups, mask_groups) * 2
    x = rng.standard_normal((2, c_in, 6, 7))
    w = rng.standard_normal((5, c_in, 3, 2))
    grid = (4, 6)
    off = rng.standard_normal((2, offset_groups * 6 * 2) + grid) * 1.5
    msk = rng.uniform(0.1, 1.5, (2, mask_groups * 6) + grid)
    kwargs = dict(padding=(0, 0), stride=1)
    y = dcn_cupy.deform_conv2d(cupy.asarray(x), cupy.asarray(w), cupy.asarray(off), cupy.asarray(msk), **kwargs)
    assert relative_error(host(y), reference.deform_conv(x, w, off, msk, **kwargs)) < 1e-10
    gy = rng.standard_normal(y.shape)
    grads = dcn_cupy.deform_conv2d_backward(cupy.asarray(gy), cupy.asarray(x), cupy.asarray(w), cupy.asarray(off),
                                            cupy.asarray(msk), **kwargs)
    cpu = dcn_cupy.deform_conv2d_backward(gy, x, w, off, msk, **kwargs)
    for name in ("input", "weight", "offset", "mask"):
        assert relative_error(host(getattr(grads, name)), getattr(cpu, name)) < 1e-10, name


def test_plain_convolution_without_offset_is_exact_conv():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 4, 9, 8))
    w = rng.standard_normal((6, 2, 3, 2))
    b = rng.standard_normal(6)
    y = dcn_cupy.deform_conv2d(cupy.asarray(x), cupy.asarray(w), bias=cupy.asarray(b), stride=(2, 1),
                               padding=(1, 0), dilation=(1, 2), groups=2)
    expected = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b),
                                          stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2)
    assert relative_error(host(y), expected.numpy()) < 1e-12


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64],
                         ids=["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("batch,channels,inner", [(3, 5, 37), (2, 3, 4096), (33, 2, 8), (1, 1, 1), (0, 4, 9),
                                                  (5, 3, 50001)],
                         ids=["odd", "long-rows", "batch33", "one", "batch0", "ranges"])
def test_bias_gradient_sum_is_exact_and_independent_of_addresses(dtype, batch, channels, inner):
    """``channel_sum`` (the bias gradient: grad_output summed over all but its channel axis)
    against float64 sums of the same values; rows that are no multiple of a 16-byte chunk, a
    batch stride other than channels * inner (a view), a channel cut into several ranges whose
    partial sums a second kernel adds ("ranges"), and the same values at an address off 16-byte
    alignment (element loads instead of vectors) on a differently poisoned workspace give bitwise
    the same sums."""
    cuda = cuda_backend()
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(batch * 100 + inner)
    values = rng.standard_normal((batch, channels + 1, inner)).astype(np.float32).astype(dtype)
    kernels = cuda.channel_sum_kernel(dtype)
    summing = cuda.ChannelSum(kernels, batch, channels, inner, dtype, batch_stride=(channels + 1) * inner)
    if inner == 50001:
        assert summing.splits > 1 and summing.workspace_bytes > 0
    expected = values[:, :channels].astype(np.float64).sum(axis=(0, 2))
    sums = []
    for shift in (0, 1):   # the second copy starts one element past a 16-byte boundary
        padded = np.zeros(values.size + 8, dtype=dtype)
        padded[shift:shift + values.size] = values.ravel()
        flat = cupy.asarray(padded)
        view = flat[shift:shift + values.size].reshape(values.shape)[:, :channels]   # batch stride (C + 1) * inner
        out = cupy.asarray(np.full((channels,), np.nan, dtype=dtype))   # every channel must be written
        workspace = cupy.full(summing.workspace_bytes + 8, 0x7F if shift else 0xFF, dtype=np.uint8)
        summing(view.data.ptr, out.data.ptr, workspace.data.ptr, cupy.cuda.get_current_stream().ptr)
        sums.append(host(out))
    assert sums[0].tobytes() == sums[1].tobytes()
    # float32 / float64 accumulation of batch * inner terms, one rounding to the dtype at the end
    scale = np.abs(values[:, :channels]).astype(np.float64).sum(axis=(0, 2)) + 1e-30
    acc_eps = 2.0 ** -52 if dtype == np.float64 else 2.0 ** -23
    out_eps = {np.dtype(np.float16): 2.0 ** -11, BFLOAT16: 2.0 ** -8}.get(dtype, acc_eps)
    err = np.abs(sums[0].astype(np.float64) - expected)
    assert np.all(err <= out_eps * np.abs(expected) + 4 * acc_eps * scale * math.log2(batch * inner + 2)), err


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_replays_as_cuda_graphs_give_the_same_bits(transposed, monkeypatch):
    """Recorded launch lists of kernels and memsets run as CUDA graphs from their second replay
    (``cuda.GRAPHS``): a deterministic float16 plan's forward and every gradient, replayed five
    times, give bitwise what launch-by-launch replays give, and the reference's values."""
    cuda = cuda_backend()
    original = cuda._Graphs.build
    built = []

    def build(self, ops):
        graph = original(self, ops)
        built.append(bool(graph))
        return graph

    monkeypatch.setattr(cuda._Graphs, "build", build)
    rng = np.random.default_rng(5 + transposed)
    case = random_case(rng, 2, transposed, batch=4, channels_scale=16)
    dtype = np.dtype(np.float16)
    arrays = case.arrays(to_gpu(dtype))
    grad_output = cupy.asarray(rng.standard_normal(case.reference().shape).astype(dtype))
    results = {}
    for graphs in (True, False):
        monkeypatch.setattr(cuda, "GRAPHS", graphs)
        p = dcn_cupy.plan(**arrays, **case.params, transposed=transposed, deterministic=True)
        for _ in range(5):   # the same addresses each time (CuPy's pool hands the blocks back)
            y = p.forward(*(arrays[k] for k in ARGUMENTS))
            grads = p.backward(grad_output, *(arrays[k] for k in ARGUMENTS))
        results[graphs] = [host(y)] + [host(getattr(grads, name)) for name in ARGUMENTS
                                      if getattr(grads, name) is not None]
        if graphs:
            assert built and all(built), (built, p.algorithm)
    for with_graphs, without in zip(results[True], results[False]):
        assert with_graphs.tobytes() == without.tobytes()
    assert relative_error(results[True][0], case.reference(rounded(case, dtype))) < HALF_TOL[dtype]


# ---------------------------------------------------------------------------------------------
# torchvision


@pytest.mark.parametrize("algorithm", ["cuda/im2col", "cuda/direct"])
@pytest.mark.parametrize("offset_groups,groups", [(1, 1), (2, 1), (4, 2)])
def test_matches_torchvision_deform_conv2d_float64(offset_groups, groups, algorithm):
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("torchvision.ops")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    dev = torch.device("cuda", cupy.cuda.runtime.getDevice())
    g = torch.Generator(device="cpu").manual_seed(offset_groups * 10 + groups)
    B, C_in, C_out, H, W, k = 33, 8, 6, 11, 10, (3, 3)
    stride, padding, dilation = 2, (1, 2), (2, 1)
    Ho = (H + 2 * padding[0] - dilation[0] * (k[0] - 1) - 1) // stride + 1
    Wo = (W + 2 * padding[1] - dilation[1] * (k[1] - 1) - 1) // stride + 1
    K = k[0] * k[1]

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dev)

    x = rand(B, C_in, H, W)
    w = rand(C_out, C_in // groups, *k)
    bias = rand(C_out)
    off = rand(B, 2 * offset_groups * K, Ho, Wo, scale=2.0)
    off[:, :, 0, 0] = 0.0   # integer positions, -1 included with padding: torchvision's kinks
    msk = (torch.rand(B, offset_groups * K, Ho, Wo, generator=g, dtype=torch.float64) * 1.4 + 0.1).to(dev)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, off, msk, bias)]
    xt, wt, ot, mt, bt = leaves
    y_tv = ops.deform_conv2d(xt, ot, wt, bt, stride=stride, padding=padding, dilation=dilation, mask=mt)
    gy = torch.randn(y_tv.shape, generator=g, dtype=torch.float64).to(dev)
    y_tv.backward(gy)

    from dcn_cupy._backends import use_algorithm
    with use_algorithm(algorithm):
        y = dcn_cupy.deform_conv2d(x, w, off, msk, bias, stride=stride, padding=padding, dilation=dilation,
                                   groups=groups)
        grads = dcn_cupy.deform_conv2d_backward(gy, x, w, off, msk, bias, stride=stride, padding=padding,
                                                dilation=dilation, groups=groups)
    assert isinstance(y, torch.Tensor) and y.device == dev and y.dtype == torch.float64
    assert relative_error(y.cpu().numpy(), y_tv.detach().cpu().numpy()) < 1e-10
    for name, leaf in zip(("input", "weight", "offset", "mask", "bias"), leaves):
        got = getattr(grads, name)
        assert isinstance(got, torch.Tensor) and got.device == dev
        err = relative_error(got.cpu().numpy(), leaf.grad.cpu().numpy())
        assert err < 1e-10, f"{name}: {err}"


# ---------------------------------------------------------------------------------------------
# robustness


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16], ids=["float64", "float32", "float16"])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_non_finite_and_huge_offsets(ndim, transposed, dtype):
    rng = np.random.default_rng(13 + ndim)
    case = random_case(rng, ndim, transposed, batch=2)
    offset = case.arrays_["offset"].copy()
    flat = offset.reshape(-1)
    bad = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 3e9, -3e9, 65504.0, 2.0**31])
    picks = rng.choice(flat.size, size=min(flat.size, 4 * bad.size), replace=False)
    flat[picks] = np.resize(bad, picks.size)
    arrays = dict(case.arrays_)
    arrays["offset"] = offset
    with np.errstate(over="ignore"):  # 1e30 and 3e9 become inf in float16, on purpose
        gpu = {k: None if a is None else cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
        expected = case.reference({k: None if a is None else a.astype(dtype).astype(np.float64)
                                   for k, a in arrays.items()})
    out = case.forward(**gpu, **case.params)
    assert bool(cupy.isfinite(out).all())
    tol = {np.float64: 1e-10, np.float32: 1e-4, np.float16: 3e-3}[dtype]
    assert relative_error(host(out), expected) < tol
    grads = case.backward(cupy.ones(out.shape, dtype=dtype), **gpu, **case.params)
    for name in ARGUMENTS:
        assert bool(cupy.isfinite(getattr(grads, name)).all()), name
    # Where the position is non-finite or far outside, the offset gradient is exactly 0.
    goff = host(grads.offset).reshape(-1)
    assert np.all(goff[picks[np.isin(np.resize(bad, picks.size), bad[:7])]] == 0)
    cupy.cuda.Device().synchronize()


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_chunked_batch_equals_one_chunk(transposed, monkeypatch):
    cuda = cuda_backend()
    rng = np.random.default_rng(41)
    case = random_case(rng, 2, transposed, batch=7, channels_scale=2)
    gy = cupy.asarray(rng.standard_normal(case.reference().shape))
    whole_y = case.forward(**case.arrays(to_gpu()), **case.params)
    whole_g = case.backward(gy, **case.arrays(to_gpu()), **case.params)
    chunking = set()
    limits = sorted({int(2**20 * 0.8**i) // 256 * 256 for i in range(32)}, reverse=True)
    for limit in limits:  # from chunks of samples down to slabs of output rows, then too small
        monkeypatch.setattr(cuda, "WORKSPACE_LIMIT_BYTES", limit)
        try:
            p = dcn_cupy.plan(**case.arrays(to_gpu()), **case.params, transposed=transposed,
                              algorithm="cuda/im2col")   # plan() does not read use_algorithm
            y = case.forward(**case.arrays(to_gpu()), **case.params)
            g = case.backward(gy, **case.arrays(to_gpu()), **case.params)
        except MemoryError:  # the limit is below one row of output positions
            continue
        chunking.add("rows" if "output row" in str(p) else "samples")
        assert relative_error(host(y), host(whole_y)) < 1e-13, limit
        for name in ARGUMENTS:
            assert relative_error(host(getattr(g, name)), host(getattr(whole_g, name))) < 1e-12, (name, limit)
    assert chunking == {"rows", "samples"}
    monkeypatch.setattr(cuda, "WORKSPACE_LIMIT_BYTES", 1)
    with pytest.raises(MemoryError, match=r"needs a workspace of at least \d+ bytes .* limit of 1 bytes"):
        case.forward(**case.arrays(to_gpu()), **case.params)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16], ids=["float64", "float32", "float16"])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_weight_gemm_split_along_positions(transposed, dtype, monkeypatch):
    """The weight gradient's GEMM split along the positions (``gemm_splits``: the splits'
    products into partial sums, added in order, the positions past the whole splits apart) gives
    the reference's weight gradient and, to rounding, the unsplit one: 5 splits of 344
    positions and 8 left over, 8 of 216, and none."""
    from dcn_cupy.testing import Case, fractional_offsets
    cuda = cuda_backend()
    rng = np.random.default_rng(47)
    # 3 x 24x24 positions (the transposed one's on its input grid), a 8 x 72 weight gradient
    arrays = {"input": rng.standard_normal((3, 8, 24, 24)), "weight": rng.standard_normal((8, 8, 3, 3)),
              "offset": fractional_offsets(rng, (3, 18, 24, 24)), "mask": rng.uniform(0.1, 1.5, (3, 9, 24, 24)),
              "bias": None}
    case = Case(2, transposed, arrays, dict(stride=1, padding=1, dilation=1, groups=1), "split")
    gy = rng.standard_normal(case.reference().shape)
    monkeypatch.setattr(cuda, "_GEMM_SPLIT_DEPTH", 64)
    tol = {np.float64: 1e-10, np.float32: 1e-4, np.float16: HALF_GRAD_TOL[np.dtype(np.float16)]}[dtype]
    backward = reference.deform_conv_transpose_backward if transposed else reference.deform_conv_backward
    gy = gy.astype(dtype).astype(np.float64)
    expected_weight = backward(gy, **rounded(case, dtype), **case.params)[1]
    grads = {}
    for splits in (1, 5, 8):
        monkeypatch.setattr(cuda, "GEMM_SPLITS", splits)
        p = dcn_cupy.plan(**case.arrays(to_gpu(dtype)), **case.params, transposed=transposed,
                          algorithm="cuda/im2col")
        assert (f"split {splits} ways" in str(p)) == (splits > 1), str(p)
        g = p.backward(cupy.asarray(gy.astype(dtype)), **case.arrays(to_gpu(dtype)), wrt="weight")
        grads[splits] = host(g.weight)
        assert relative_error(grads[splits], expected_weight) < tol, splits
    for splits in (5, 8):
        assert relative_error(grads[splits], grads[1]) < (1e-13 if dtype == np.float64 else tol / 2), splits


TILE_SETTINGS = {
    "default": {},
    "halo0": dict(TILE_HALO=0),
    "no-smem": dict(TILE_SMEM_BYTES=0),
}


@pytest.mark.parametrize("setting", list(TILE_SETTINGS))
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_tiled_scatter_settings(ndim, transposed, setting, monkeypatch):
    """The tiled input-gradient scatter agrees with the reference and the CPU backend with its
    shared-memory box (offsets larger than the halo reach corners outside it), with no halo
    (most corners take the global path) and with no shared memory (all do)."""
    cuda = cuda_backend()
    for name, value in TILE_SETTINGS[setting].items():
        monkeypatch.setattr(cuda, name, value)
    rng = np.random.default_rng(60 + 7 * ndim + transposed)
    case = random_case(rng, ndim, transposed, batch=2, channels_scale=3)
    # larger offsets than the halo for some positions
    case.arrays_["offset"] = case.arrays_["offset"] * rng.choice([1.0, 3.0], size=case.arrays_["offset"].shape)
    y = case.forward(**case.arrays(to_gpu()), **case.params)
    assert relative_error(host(y), case.reference()) < 1e-10, case.label
    gy = rng.standard_normal(y.shape)
    grads = case.backward(cupy.asarray(gy), **case.arrays(to_gpu()), **case.params)
    cpu = case.backward(gy, **case.arrays(), **case.params)
    for name in ARGUMENTS:
        assert relative_error(host(getattr(grads, name)), getattr(cpu, name)) < 1e-10, (name, case.label)


@pytest.mark.parametrize("wanted", [("input",), ("weight",), ("offset",), ("mask",), ("input", "offset"),
                                    ("input", "mask"), ("input", "offset", "mask"),
                                    ("input", "weight", "offset", "mask")], ids="+".join)
def test_one_pass_backward_subsets_match_full(wanted):
    """Asking ``cuda.conv_backward`` for a subset gives the same numbers as asking for all."""
    cuda = cuda_backend()
    from dcn_cupy import _geometry
    rng = np.random.default_rng(71)
    case = random_case(rng, 2, False, batch=3, channels_scale=2)
    a = case.arrays(to_gpu())
    geom, _ = _geometry.conv_geometry(a["input"].shape, a["weight"].shape, a["offset"].shape, a["mask"].shape,
                                      None, **case.params)
    gy = cupy.asarray(rng.standard_normal(geom.y_shape))
    flags = [name in wanted for name in ("input", "weight", "offset", "mask")]
    got = cuda.conv_backward(gy, a["input"], a["weight"], a["offset"], a["mask"], geom, frozenset(wanted))
    full = cuda.conv_backward(gy, a["input"], a["weight"], a["offset"], a["mask"], geom,
                              frozenset(("input", "weight", "offset", "mask")))
    for g, ref, flag in zip(got, full, flags):
        if flag:
            assert relative_error(host(g), host(ref)) < 1e-12
        else:
            assert g is None


@pytest.mark.parametrize("dtype", [np.float64, np.float16], ids=["float64", "float16"])
def test_64bit_indexing_path(dtype, monkeypatch):
    cuda = cuda_backend()
    rng = np.random.default_rng(42)
    case = random_case(rng, 3, False, batch=2)
    base_y = case.forward(**case.arrays(to_gpu(dtype)), **case.params)
    gy = cupy.asarray(rng.standard_normal(base_y.shape).astype(dtype))
    base_g = case.backward(gy, **case.arrays(to_gpu(dtype)), **case.params)
    monkeypatch.setattr(cuda, "_INT32_SAFE", 0)  # every kernel takes the long long instantiation
    y = case.forward(**case.arrays(to_gpu(dtype)), **case.params)
    g = case.backward(gy, **case.arrays(to_gpu(dtype)), **case.params)
    assert relative_error(host(y), host(base_y)) < 1e-12
    for name in ("weight", "offset", "mask", "bias"):
        assert relative_error(host(getattr(g, name)), host(getattr(base_g, name))) < 1e-12, name
    # input gradients come from float atomics: order may differ
    assert relative_error(host(g.input), host(base_g.input)) < (1e-12 if dtype == np.float64 else 2e-3)


def test_more_than_2_31_elements():
    """A real 64-bit case: columns and input of 2^31 + 2^15 elements (float16, 1D, kernel 1)."""
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < 24 * 2**30:
        pytest.skip("needs 24 GiB of free GPU memory")
    channels, length = 2**16 + 1, 2**15
    assert channels * length > 2**31
    pattern = (cupy.arange(4093, dtype=cupy.float32) / 2048 - 1).astype(cupy.float16)  # exact in float16
    x = cupy.tile(pattern, channels * length // 4093 + 1)[:channels * length].reshape(1, channels, length)
    w = (cupy.random.default_rng(0).standard_normal((1, channels, 1), dtype=cupy.float32) * 0.01)
    w[0, -1, 0] = 8.0  # the last channel (elements from 2^31 on) dominates the output
    w = w.astype(cupy.float16)
    offset = cupy.full((1, 1, length), 0.25, dtype=cupy.float16)
    y = dcn_cupy.deform_conv1d(x, w, offset)
    assert y.shape == (1, 1, length) and y.dtype == cupy.float16
    expected = cupy.zeros(length, dtype=cupy.float32)
    for start in range(0, channels, 8192):
        xs = x[0, start:start + 8192].astype(cupy.float32)
        shifted = cupy.concatenate([xs[:, 1:], cupy.zeros((xs.shape[0], 1), cupy.float32)], axis=1)
        expected += w[0, start:start + 8192, 0].astype(cupy.float32) @ (0.75 * xs + 0.25 * shifted)
        del xs, shifted
    assert relative_error(host(y[0, 0]), host(expected)) < 1e-2
    del x, y, offset, expected
    cupy.get_default_memory_pool().free_all_blocks()


def test_large_batch_within_default_workspace():
    """B=1024, C=64, 56x56, 3x3 with offsets and mask runs in chunks bounded by the default limit."""
    cuda = cuda_backend()
    rng = cupy.random.default_rng(1)
    B, C, H = 1024, 64, 56
    x = rng.standard_normal((B, C, H, H), dtype=cupy.float32)
    w = rng.standard_normal((C, C, 3, 3), dtype=cupy.float32) * 0.05
    off = rng.standard_normal((B, 18, H, H), dtype=cupy.float32)
    msk = rng.random((B, 9, H, H), dtype=cupy.float32)
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.used_bytes()
    y = dcn_cupy.deform_conv2d(x, w, off, msk, padding=1)
    cupy.cuda.Device().synchronize()
    out_bytes = y.nbytes
    # the pool never held more than inputs + output + the workspace limit (+ slack)
    assert pool.total_bytes() - before <= out_bytes + cuda.WORKSPACE_LIMIT_BYTES + 64 * 2**20
    picks = [0, 517, B - 1]
    expected = reference.deform_conv(cupy.asnumpy(x[picks]), cupy.asnumpy(w), cupy.asnumpy(off[picks]),
                                     cupy.asnumpy(msk[picks]), padding=1)
    assert relative_error(host(y[picks]), expected) < 1e-4


def test_runs_on_a_non_default_stream():
    rng = np.random.default_rng(5)
    case = random_case(rng, 2, False, batch=4)
    expected = case.reference()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        arrays = case.arrays(to_gpu())
        y = case.forward(**arrays, **case.params)
        g = case.backward(cupy.ones(y.shape), **arrays, **case.params)
    stream.synchronize()
    assert relative_error(host(y), expected) < 1e-10
    assert all(getattr(g, n) is not None for n in ARGUMENTS)


def test_arrays_on_another_device():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    rng = np.random.default_rng(6)
    case = random_case(rng, 2, False)
    with cupy.cuda.Device(1):
        arrays = case.arrays(to_gpu())
    with cupy.cuda.Device(0):
        y = case.forward(**arrays, **case.params)
    assert y.device.id == 1
    assert relative_error(host(y), case.reference()) < 1e-10


def test_inputs_are_not_modified_and_non_contiguous_inputs():
    rng = np.random.default_rng(8)
    case = random_case(rng, 2, True)
    views = {}
    for name, a in case.arrays().items():
        big = cupy.zeros(a.shape[:-1] + (2 * a.shape[-1],))
        big[..., ::2] = cupy.asarray(a)
        views[name] = big[..., ::2]
    copies = {k: v.copy() for k, v in views.items()}
    y = case.forward(**views, **case.params)
    assert relative_error(host(y), case.reference()) < 1e-10
    case.backward(cupy.ones(y.shape), **views, **case.params)
    for name in views:
        assert bool((views[name] == copies[name]).all()), name


# ---------------------------------------------------------------------------------------------
# interop: CuPy, torch and JAX arrays come back in their own library


def test_torch_cuda_tensors_round_trip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    rng = np.random.default_rng(14)
    case = random_case(rng, 2, False)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, HALF_TOL[BFLOAT16])):
        arrays = {k: None if a is None else torch.from_numpy(a).to("cuda", dtype) for k, a in case.arrays_.items()}
        y = case.forward(**arrays, **case.params)
        assert isinstance(y, torch.Tensor) and y.is_cuda and y.dtype == dtype
        ref = case.reference({k: None if a is None else a.to(torch.float64).cpu().numpy() for k, a in arrays.items()})
        assert relative_error(y.to(torch.float64).cpu().numpy(), ref) < tol
        grads = case.backward(torch.ones_like(y), **arrays, **case.params)
        for name in ARGUMENTS:
            got = getattr(grads, name)
            assert isinstance(got, torch.Tensor) and got.is_cuda and got.dtype == dtype, name


def test_jax_gpu_arrays_round_trip():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    try:
        gpu = jax.devices("gpu")[0]
    except Exception:
        pytest.skip("jax has no GPU")
    rng = np.random.default_rng(15)
    case = random_case(rng, 2, True)
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, HALF_TOL[BFLOAT16])):
        arrays = {k: None if a is None else jax.device_put(jnp.asarray(a, dtype=dtype), gpu)
                  for k, a in case.arrays_.items()}
        y = case.forward(**arrays, **case.params)
        assert isinstance(y, jax.Array) and y.dtype == dtype
        assert list(y.devices())[0].platform == "gpu"
        ref = case.reference({k: None if a is None else np.asarray(a.astype(jnp.float32), dtype=np.float64)
                              for k, a in arrays.items()})
        assert relative_error(np.asarray(y.astype(jnp.float32), dtype=np.float64), ref) < tol
        grads = case.backward(jnp.ones_like(y), **arrays, **case.params)
        for name in ARGUMENTS:
            got = getattr(grads, name)
            assert isinstance(got, jax.Array) and got.dtype == dtype, name


def test_cupy_bfloat16_round_trip():
    rng = np.random.default_rng(16)
    case = random_case(rng, 1, False)
    y = case.forward(**case.arrays(to_gpu(BFLOAT16)), **case.params)
    assert isinstance(y, cupy.ndarray) and y.dtype == BFLOAT16
