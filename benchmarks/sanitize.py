"""A representative subset of the CUDA backend for ``compute-sanitizer --tool memcheck``.

    compute-sanitizer --tool memcheck --leak-check no python benchmarks/sanitize.py

CuPy's memory pool is switched off (plain cudaMalloc per array), so that memcheck sees every
array's real bounds. Runs forward and all gradients of conv and transposed conv for N = 1, 2, 3,
float64 / float32 / float16 / bfloat16, with offset groups != mask groups, conv groups, stride /
padding / dilation, non-finite and huge offsets, positions at the box edges, one-sample chunks,
the 64-bit index instantiations, and the tiled scatter with no halo and with almost no shared
memory (corners outside its box); checks the float64 results against the reference.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import cupy  # noqa: E402

cupy.cuda.set_allocator(None)          # no pool: every array is its own cudaMalloc
cupy.cuda.set_pinned_memory_allocator(None)

import dcn_cupy  # noqa: E402
from dcn_cupy._backends import cuda as dcn_cuda  # noqa: E402
from dcn_cupy._interop import BFLOAT16  # noqa: E402

from cases import ARGUMENTS, random_case, relative_error  # noqa: E402

BAD = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 65504.0, -0.999999, 0.0])


def run_case(case, dtype, poison: bool):
    arrays = dict(case.arrays_)
    if poison and arrays["offset"] is not None:
        off = arrays["offset"].copy()
        flat = off.reshape(-1)
        flat[::5] = np.resize(BAD, flat[::5].size)
        arrays["offset"] = off
    with np.errstate(over="ignore"):  # huge offsets become inf in float16, on purpose
        gpu = {k: None if a is None else cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    y = case.forward(**gpu, **case.params)
    grads = case.backward(cupy.ones(y.shape, dtype=dtype), **gpu, **case.params)
    cupy.cuda.Device().synchronize()
    assert bool(cupy.isfinite(y).all())
    for name in ARGUMENTS:
        g = getattr(grads, name)
        assert g is None or bool(cupy.isfinite(g).all()), name
    if np.dtype(dtype) == np.float64:
        expected = case.reference({k: None if a is None else a.astype(np.float64) for k, a in arrays.items()})
        err = relative_error(cupy.asnumpy(y), expected)
        assert err < 1e-10, (err, case.label)


def edge_case():
    """Positions just inside and just outside the (-1, S) box, and exactly on integers."""
    x = cupy.asarray(np.random.default_rng(0).standard_normal((1, 2, 5, 4)))
    w = cupy.asarray(np.random.default_rng(1).standard_normal((3, 2, 2, 2)))
    grid = (4, 3)
    values = np.array([-1.0, -0.9999, 3.9999, 4.0, 5.0, -2.0, 0.0, 1.0, 2.5, -1.5])
    off = np.resize(values, (1, 8) + grid)
    y = dcn_cupy.deform_conv2d(x, w, cupy.asarray(off))
    dcn_cupy.deform_conv2d_backward(cupy.ones(y.shape), x, w, cupy.asarray(off))
    cupy.cuda.Device().synchronize()


def main() -> int:
    count = 0
    for ndim, transposed, seed in itertools.product((1, 2, 3), (False, True), range(2)):
        rng = np.random.default_rng(900 + 10 * ndim + seed + 100 * transposed)
        case = random_case(rng, ndim, transposed, batch=2 + seed)
        for dtype in (np.float64, np.float32, np.float16, BFLOAT16):
            run_case(case, dtype, poison=seed == 1)
            count += 1
    # one-sample chunks and the 64-bit instantiations
    limit, safe = dcn_cuda.WORKSPACE_LIMIT_BYTES, dcn_cuda._INT32_SAFE
    try:
        dcn_cuda.WORKSPACE_LIMIT_BYTES = 1
        dcn_cuda._INT32_SAFE = 0
        for ndim in (1, 2, 3):
            rng = np.random.default_rng(950 + ndim)
            for transposed in (False, True):
                case = random_case(rng, ndim, transposed, batch=3)
                run_case(case, np.float64, poison=True)
                run_case(case, np.float16, poison=True)
                count += 2
    finally:
        dcn_cuda.WORKSPACE_LIMIT_BYTES, dcn_cuda._INT32_SAFE = limit, safe
    # the tiled scatter's global fallback: no halo, and only 64 bytes of shared memory
    names = ("TILE_HALO", "TILE_SMEM_BYTES")
    saved = {name: getattr(dcn_cuda, name) for name in names}
    try:
        for values in ((0, 48 * 1024), (3, 64)):
            for name, value in zip(names, values):
                setattr(dcn_cuda, name, value)
            for ndim in (1, 2, 3):
                rng = np.random.default_rng(970 + ndim)
                case = random_case(rng, ndim, ndim == 2, batch=2, channels_scale=3)
                run_case(case, np.float64, poison=True)
                run_case(case, np.float32, poison=True)
                count += 2
    finally:
        for name, value in saved.items():
            setattr(dcn_cuda, name, value)
    edge_case()
    count += 1
    count += robustness_cases()
    print(f"SANITIZE RUN OK: {count} cases")
    return 0


# ---------------------------------------------------------------------------------------------
# Degenerate shapes and non-finite inputs (issue 11): empty batches, refused empty axes, inf/nan
# input and grad_output elements with zero, integer and fractional offsets (positions exactly at
# -1, S-1 and S), in every dtype, with the default chunks and with one-sample 64-bit chunks.


from dcn_cupy import reference  # noqa: E402


def _poison(rng, a, count):
    a = a.copy()
    picks = rng.choice(a.size, size=min(count, a.size), replace=False)
    a.reshape(-1)[picks] = np.resize([np.inf, np.nan, -np.inf], picks.size)
    return a


def _non_finite_case(case, dtype, offsets, rng):
    arrays = dict(case.arrays_)
    if arrays["offset"] is not None and offsets != "fractional":
        arrays["offset"] = (np.zeros_like(arrays["offset"]) if offsets == "zero"
                            else np.round(arrays["offset"]))
    arrays["input"] = _poison(rng, arrays["input"], 3)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = case.reference(arrays)
    grad_output = _poison(rng, rng.standard_normal(expected.shape), 1)
    gpu = {k: None if a is None else cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    y = case.forward(**gpu, **case.params)
    grads = case.backward(cupy.asarray(grad_output.astype(dtype)), **gpu, **case.params)
    cupy.cuda.Device().synchronize()
    if np.dtype(dtype) == np.float64:
        got = cupy.asnumpy(y)
        assert (np.isfinite(got) == np.isfinite(expected)).all(), ("forward pattern", case.label)
        backward = (reference.deform_conv_transpose_backward if case.transposed
                    else reference.deform_conv_backward)
        with np.errstate(invalid="ignore", over="ignore"):
            want = backward(grad_output, **arrays, **case.params)
        for name, w in zip(ARGUMENTS, want):
            g = getattr(grads, name)
            if w is not None:
                assert (np.isfinite(cupy.asnumpy(g)) == np.isfinite(w)).all(), (name, case.label)


def _degenerate_cases() -> int:
    count = 0
    for ndim in (1, 2, 3):
        S, k = (4,) * ndim, (3,) * ndim
        K = 3 ** ndim
        w = cupy.ones((2, 3) + k)
        # an empty batch: nothing to launch, forward and every gradient
        x0 = cupy.zeros((0, 3) + S)
        off0, m0 = cupy.zeros((0, K * ndim) + S), cupy.zeros((0, K) + S)
        y = dcn_cupy.deform_conv(x0, w, off0, m0, cupy.ones(2), padding=1)
        dcn_cupy.deform_conv_backward(cupy.zeros(y.shape), x0, w, off0, m0, cupy.ones(2), padding=1)
        z = dcn_cupy.deform_conv_transpose(cupy.zeros((0, 3) + S), cupy.ones((3, 2) + k), padding=1)
        dcn_cupy.deform_conv_transpose_backward(cupy.zeros(z.shape), cupy.zeros((0, 3) + S), cupy.ones((3, 2) + k),
                                                padding=1)
        # an empty spatial axis with padding: refused before any kernel runs
        for a in range(ndim):
            shape = [2, 3] + list(S)
            shape[2 + a] = 0
            for call in (lambda: dcn_cupy.deform_conv(cupy.zeros(shape), w, padding=2),
                         lambda: dcn_cupy.deform_conv_transpose(cupy.zeros(shape), cupy.ones((3, 2) + k), padding=1)):
                try:
                    call()
                except ValueError:
                    pass
                else:
                    raise AssertionError(f"empty axis {a} of {shape} accepted")
        cupy.cuda.Device().synchronize()
        count += 1
    return count


def _padding_one_case(ndim: int, rng):
    """3^N kernel, padding 1: with zero offsets the border taps sit at exactly -1 and at S."""
    from cases import Case

    S, k = (5, 4, 3)[:ndim], (3,) * ndim
    K = 3 ** ndim
    arrays = {
        "input": rng.standard_normal((2, 4) + S),
        "weight": rng.standard_normal((6, 2) + k),
        "offset": rng.uniform(-1.5, 1.5, (2, 2 * K * ndim) + S),
        "mask": rng.uniform(0.2, 1.2, (2, 4 * K) + S),
        "bias": rng.standard_normal(6),
    }
    params = dict(stride=1, padding=1, dilation=1, groups=2)
    return Case(ndim, False, arrays, params, f"{ndim}d padding 1")


def robustness_cases(dtypes=(np.float64, np.float32, np.float16, BFLOAT16)) -> int:
    count = _degenerate_cases()
    for ndim, kind in itertools.product((1, 2, 3), ("padding", "conv", "transposed")):
        rng = np.random.default_rng(1200 + 10 * ndim + len(kind))
        case = (_padding_one_case(ndim, rng) if kind == "padding"
                else random_case(rng, ndim, kind == "transposed", batch=2))
        for offsets, dtype in itertools.product(("zero", "integer", "fractional"), dtypes):
            _non_finite_case(case, dtype, offsets, rng)
            count += 1
    limit, safe = dcn_cuda.WORKSPACE_LIMIT_BYTES, dcn_cuda._INT32_SAFE
    try:  # one-sample chunks, 64-bit indices
        dcn_cuda.WORKSPACE_LIMIT_BYTES = 1
        dcn_cuda._INT32_SAFE = 0
        for ndim in (1, 2, 3):
            rng = np.random.default_rng(1300 + ndim)
            case = random_case(rng, ndim, ndim != 2, batch=3)
            for offsets in ("zero", "integer", "fractional"):
                _non_finite_case(case, np.float64, offsets, rng)
                count += 1
    finally:
        dcn_cuda.WORKSPACE_LIMIT_BYTES, dcn_cuda._INT32_SAFE = limit, safe
    return count

if __name__ == "__main__":
    sys.exit(main())
