"""A representative subset of the CUDA backend for ``compute-sanitizer --tool memcheck``.

    compute-sanitizer --tool memcheck --leak-check no python benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize.py --fused-quick

CuPy's memory pool is switched off (plain cudaMalloc per array), so that memcheck sees every
array's real bounds. Runs forward and all gradients of conv and transposed conv for N = 1, 2, 3,
float64 / float32 / float16 / bfloat16, with offset groups != mask groups, conv groups, stride /
padding / dilation, non-finite and huge offsets, positions at the box edges, one-sample chunks,
the 64-bit index instantiations, and the tiled scatter with no halo and with almost no shared
memory (corners outside its box); checks the float64 results against the reference.
Then the fused forward (cuda/fused, ``fused_cases``): both samplers, every precision, N = 1, 2,
3, poisoned offsets, partial tiles, one-sample chunks and the 64-bit instantiation, checked
against the reference; ``--fused-only`` runs just those (for racecheck).
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


def fused_cases(quick: bool = False) -> int:
    from dcn_cupy import _geometry, reference
    from dcn_cupy._backends import cuda_fused as fu
    count = 0

    def run(case, dtype, allow_tf32, poison, tile=None):
        arrays = dict(case.arrays_)
        if poison and arrays["offset"] is not None:
            off = arrays["offset"].copy()
            off.reshape(-1)[::5] = np.resize(BAD, off.reshape(-1)[::5].size)
            arrays["offset"] = off
        with np.errstate(over="ignore"):
            gpu = {k: None if a is None else cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
            rounded = {k: None if a is None else a.astype(dtype).astype(np.float64) for k, a in arrays.items()}
        shapes = [None if arrays[k] is None else arrays[k].shape for k in ARGUMENTS]
        geom = _geometry.conv_geometry(*shapes, ndim=case.ndim, **case.params)[0]
        out = cupy.empty(geom.y_shape, dtype=dtype)
        if tile is None:
            fu.fused_conv_forward(*(gpu[k] for k in ARGUMENTS), geom, out, allow_tf32=allow_tf32)
        else:
            fu.run_forward(fu.LaunchConfig(geom, dtype, allow_tf32, tile=tile), *(gpu[k] for k in ARGUMENTS), out)
        cupy.cuda.Device().synchronize()
        got = cupy.asnumpy(out).astype(np.float64)
        assert np.all(np.isfinite(got)), case.label
        err = relative_error(got, reference.deform_conv(**rounded, **case.params))
        assert err < {np.dtype(np.float32): 3e-3, np.dtype(np.float16): 3e-3, BFLOAT16: 2.4e-2}[np.dtype(dtype)], \
            (err, case.label)

    for ndim in (2,) if quick else (1, 2, 3):
        for scale in (1, 16):   # per-channel and (mostly) 16-byte-vector sampling
            rng = np.random.default_rng(990 + ndim + scale)
            case = random_case(rng, ndim, False, batch=2, channels_scale=scale)
            for dtype, tf32 in ((np.float32, True), (np.float32, False), (np.float16, False), (BFLOAT16, False)):
                if quick and dtype == BFLOAT16:
                    continue
                run(case, dtype, tf32, poison=scale == 16)
                count += 1
    # every tile (both engines where the device has wgmma), channel counts that suit them all
    rng = np.random.default_rng(999)
    case = random_case(rng, 2, False, batch=2, channels_scale=64)
    for dtype, tf32 in ((np.float16, False), (np.float32, True), (np.float32, False)):
        for tile in fu._tiles(dtype):
            if tile[4] == 1 and (not tf32 and dtype == np.float32 or not fu.wgmma_available()):
                continue
            run(case, dtype, tf32, poison=True, tile=tile)
            count += 1
    if quick:
        return count
    limit, safe = fu.WORKSPACE_LIMIT_BYTES, fu._INT32_SAFE
    try:
        fu.WORKSPACE_LIMIT_BYTES, fu._INT32_SAFE = 1, 0
        for ndim in (1, 2, 3):
            rng = np.random.default_rng(995 + ndim)
            case = random_case(rng, ndim, False, batch=3, channels_scale=16)
            run(case, np.float16, False, poison=True)
            run(case, np.float32, False, poison=True)
            count += 2
    finally:
        fu.WORKSPACE_LIMIT_BYTES, fu._INT32_SAFE = limit, safe
    return count


def main() -> int:
    if "--fused-only" in sys.argv or "--fused-quick" in sys.argv:
        count = fused_cases(quick="--fused-quick" in sys.argv)
        print(f"SANITIZE RUN OK: {count} fused cases")
        return 0
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
    count += fused_cases()
    print(f"SANITIZE RUN OK: {count} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
