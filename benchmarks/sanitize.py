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
    print(f"SANITIZE RUN OK: {count} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
