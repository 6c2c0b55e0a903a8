"""A representative subset of the CUDA algorithms for ``compute-sanitizer --tool memcheck``.

    compute-sanitizer --tool memcheck --leak-check no python benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize.py --fused-quick

CuPy's memory pool is switched off (plain cudaMalloc per array), so that memcheck sees every
array's real bounds. Runs forward and all gradients of conv and transposed conv for N = 1, 2, 3,
float64 / float32 / float16 / bfloat16 (the automatic choice, which takes cuda/fused for the
half types' forwards, and cuda/im2col forced for them too), with offset groups != mask groups,
conv groups, stride / padding / dilation, non-finite and huge offsets, positions at the box
edges; then cuda/im2col (forced through ``use_algorithm``) and cuda/im2col-deterministic with a
workspace limit just large enough for the configuration (one-sample chunks, and chunks of rows
within a sample wherever the grid has several rows) and the 64-bit index instantiations; the
tiled scatter (both algorithms) with no halo and with almost no shared memory (corners outside
its box); checks the float64 results against the reference.
Then the fused forward (cuda/fused, ``fused_cases``, through plans with
``algorithm="cuda/fused"`` and, per tile, its launch configurations): both samplers, with and
without the sampling plan, every precision, N = 1, 2, 3, poisoned offsets, partial tiles,
one-sample chunks and the 64-bit instantiation, checked against the reference; then the fused
backward (cuda/fused-backward, ``fused_backward_cases``: every gradient of conv and transposed
conv, every data and weight tile, the weight gradient with and without its sampling plan,
deterministic plans (the fixed-point scatter), the warp-specialised weight kernel in persistent
blocks, one-sample chunks, 64-bit indices). ``--fused-only`` runs just the fused cases (for
racecheck; ``--fused-quick`` fewer of them; ``--fused-persistent`` the persistent weight kernel's;
``--fused-backward-only`` the fused backward's alone, which under racecheck takes longer than a
10-minute device call, so ``--ndims 1,2`` and ``--ndims 3`` split it; every fused case prints a
line as it passes); ``--columns-only`` just cuda/im2col's channels-last column sampler (half
types and float32, 1D/2D/3D, channels per group multiples of 8, its block shapes: conv and
transposed, poisoned offsets, one-sample chunks, 64-bit); ``--robustness-only`` just the
degenerate-shape and non-finite cases.
Without a CUDA device (or CuPy) it says so and exits with status 0.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dcn_cupy  # noqa: E402
from dcn_cupy._backends import use_algorithm  # noqa: E402
from dcn_cupy._interop import BFLOAT16  # noqa: E402

from cases import ARGUMENTS, random_case, relative_error  # noqa: E402
from gpu import no_gpu_reason  # noqa: E402

BAD = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 65504.0, -0.999999, 0.0])
HALF = (np.dtype(np.float16), BFLOAT16)

cupy = None        # imported by _setup(), once a CUDA device is known to be there
dcn_cuda = None    # dcn_cupy._backends.cuda (imports CuPy)
_STARTED = time.perf_counter()
_PASSED = collections.Counter()   # section -> its cases passed so far


def progress(section: str, what: str) -> None:
    """One line a case passed, numbered in its section and flushed: a run that a time limit cuts
    off (compute-sanitizer is slow: the full fused backward takes about 8 minutes under memcheck
    or racecheck on an H200) still says how far it got."""
    _PASSED[section] += 1
    print(f"[{time.perf_counter() - _STARTED:6.0f} s] {section} {_PASSED[section]}: {what}", flush=True)


def _setup() -> None:
    global cupy, dcn_cuda
    import cupy as module
    module.cuda.set_allocator(None)          # no pool: every array is its own cudaMalloc
    module.cuda.set_pinned_memory_allocator(None)
    cupy = module
    from dcn_cupy._backends import cuda
    dcn_cuda = cuda


def _poisoned(arrays: dict) -> dict:
    arrays = dict(arrays)
    if arrays["offset"] is not None:
        off = arrays["offset"].copy()
        flat = off.reshape(-1)
        flat[::5] = np.resize(BAD, flat[::5].size)
        arrays["offset"] = off
    return arrays


def run_case(case, dtype, poison: bool, deterministic: bool = False):
    """Forward and every gradient through the functional API (the algorithm forced by the
    caller's ``use_algorithm``, if any); float64 checked against the reference."""
    arrays = _poisoned(case.arrays_) if poison else dict(case.arrays_)
    with np.errstate(over="ignore"):  # huge offsets become inf in float16, on purpose
        gpu = {k: None if a is None else cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    flags = {"deterministic": True} if deterministic else {}
    y = case.forward(**gpu, **case.params, **(flags if case.transposed else {}))
    grads = case.backward(cupy.ones(y.shape, dtype=dtype), **gpu, **case.params, **flags)
    cupy.cuda.Device().synchronize()
    assert bool(cupy.isfinite(y).all())
    for name in ARGUMENTS:
        g = getattr(grads, name)
        assert g is None or bool(cupy.isfinite(g).all()), name
    if np.dtype(dtype) == np.float64:
        expected = case.reference({k: None if a is None else a.astype(np.float64) for k, a in arrays.items()})
        err = relative_error(cupy.asnumpy(y), expected)
        assert err < 1e-10, (err, case.label)


def _spec_of(case, dtype):
    """The PlanSpec of ``case`` at ``dtype`` on the current device."""
    from dcn_cupy import _geometry
    from dcn_cupy._backends import PlanSpec
    shapes = [None if case.arrays_[k] is None else case.arrays_[k].shape for k in ARGUMENTS]
    geometry = _geometry.conv_transpose_geometry if case.transposed else _geometry.conv_geometry
    geom = geometry(*shapes, ndim=case.ndim, **case.params)[0]
    return PlanSpec(geom, np.dtype(dtype), "cuda", cupy.cuda.runtime.getDevice(), False, False)


def smallest_limit(case, dtype, backward: str, whole_samples: bool = False):
    """A workspace limit (dcn_cupy._backends.cuda.WORKSPACE_LIMIT_BYTES) just large enough for
    ``backward``'s conv_backward of ``case`` and, where the plan's forward is cuda/im2col's, that
    forward (bisection on building them; the limit 1 would refuse them with a MemoryError), and
    whether either runs chunks of rows within a sample there (``whole_samples``: the smallest
    limit that needs none: one-sample chunks)."""
    from dcn_cupy._backends import backend_named
    spec = _spec_of(case, dtype)
    builders = [(backward, "conv_backward")]
    if backward == "cuda/im2col" or np.dtype(dtype) not in HALF:  # else the forward is cuda/fused's
        builders.insert(0, ("cuda/im2col", "conv_forward"))

    def build(limit):
        with _settings(WORKSPACE_LIMIT_BYTES=limit):
            try:
                built = [backend_named(name).build(spec, primitive) for name, primitive in builders]
            except MemoryError:
                return None
            return None if whole_samples and any(c.rows for e in built for c in e.chunks) else built

    lo, hi = 1, 1 << 12
    while build(hi) is None:
        lo, hi = hi, hi * 2
    while hi - lo > 1:    # lo refused, hi builds (the smallest such limit, up to the cuBLAS share's steps)
        mid = (lo + hi) // 2
        if build(mid) is None:
            lo = mid
        else:
            hi = mid
    return hi, any(c.rows for e in build(hi) for c in e.chunks)


@contextlib.contextmanager
def _settings(**values):
    """Set dcn_cupy._backends.cuda's module settings (part of the functional API's plan key)."""
    saved = {name: getattr(dcn_cuda, name) for name in values}
    try:
        for name, value in values.items():
            setattr(dcn_cuda, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(dcn_cuda, name, value)


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


def columns_cases() -> int:
    """cuda/im2col's channels-last column sampler (half types and float32 in 1D, 2D and 3D,
    channels per group multiples of 8; 1, 2 and 4 vectors per thread at 8, 4 or 2 threads per
    position: ``COLUMN_MIN_LANES`` 8 and 2): conv and transposed, poisoned offsets, one-sample
    chunks, 64-bit."""
    count = 0
    for ndim, transposed, scale in itertools.product((1, 2, 3), (False, True), (8, 32)):
        if ndim == 3 and scale == 32:   # 3D's many taps: 8 is enough
            continue
        rng = np.random.default_rng(990 + 10 * ndim + transposed + scale)
        case = random_case(rng, ndim, transposed, batch=3, channels_scale=scale)
        for dtype, min_lanes in itertools.product((np.float16, BFLOAT16, np.float32), (8, 2)):
            with _settings(COLUMN_MIN_LANES=min_lanes), use_algorithm("cuda/im2col"):
                run_case(case, dtype, poison=False)
                run_case(case, dtype, poison=True)
            limit, _ = smallest_limit(case, dtype, "cuda/im2col", whole_samples=True)
            with _settings(_INT32_SAFE=0, WORKSPACE_LIMIT_BYTES=limit, COLUMN_MIN_LANES=min_lanes), \
                    use_algorithm("cuda/im2col"):
                run_case(case, dtype, poison=True)
            count += 3
    return count


def _first_offset_and_mask_group(case):
    """A 2-d case with its first offset and mask group alone (the grouping the warps' corner
    batches serve)."""
    taps = int(np.prod(case.arrays_["weight"].shape[2:]))
    return dataclasses.replace(case, label=case.label + " (one offset and mask group)", arrays_=dict(
        case.arrays_, offset=case.arrays_["offset"][:, :2 * taps], mask=case.arrays_["mask"][:, :taps]))


def fused_cases(quick: bool = False) -> int:
    from dcn_cupy import _geometry, reference
    from dcn_cupy._backends import cuda_fused as fu
    count = 0

    def run(case, dtype, allow_tf32, poison, tile=None, sampling_plan=None, warp_corners=False, loads_ahead=False):
        arrays = _poisoned(case.arrays_) if poison else dict(case.arrays_)
        with np.errstate(over="ignore"):
            gpu = {k: None if a is None else cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
            rounded = {k: None if a is None else a.astype(dtype).astype(np.float64) for k, a in arrays.items()}
        if tile is None:   # a plan forcing the algorithm, as a user would
            p = dcn_cupy.plan(*(gpu[k] for k in ARGUMENTS), **case.params, algorithm="cuda/fused",
                              allow_tf32=allow_tf32)
            assert p.algorithm.startswith("forward: cuda/fused"), p.algorithm
            out = p.forward(*(gpu[k] for k in ARGUMENTS))
        else:              # one tile: its launch configuration (plans choose the tile themselves)
            shapes = [None if arrays[k] is None else arrays[k].shape for k in ARGUMENTS]
            geom = _geometry.conv_geometry(*shapes, ndim=case.ndim, **case.params)[0]
            if not fu.tile_serves(geom, dtype, tile):
                return False
            out = cupy.empty(geom.y_shape, dtype=dtype)
            config = fu.LaunchConfig(geom, dtype, allow_tf32, tile=tile, sampling_plan=sampling_plan,
                                     warp_corners=warp_corners, loads_ahead=loads_ahead)
            if warp_corners and not config.warp_corners or loads_ahead and not config.loads_ahead:
                return False
            fu.run_forward(config, *(gpu[k] for k in ARGUMENTS), out)
        cupy.cuda.Device().synchronize()
        got = cupy.asnumpy(out).astype(np.float64)
        assert np.all(np.isfinite(got)), case.label
        err = relative_error(got, reference.deform_conv(**rounded, **case.params))
        assert err < {np.dtype(np.float32): 3e-3, np.dtype(np.float16): 3e-3, BFLOAT16: 2.4e-2}[np.dtype(dtype)], \
            (err, case.label)
        progress("fused forward", f"{case.label}, {np.dtype(dtype).name}, "
                 + (f"tile {tile}" if tile is not None else p.algorithm))
        return True

    for ndim in (2,) if quick else (1, 2, 3):
        for scale in (1, 16):   # per-channel and (mostly) 16-byte-vector sampling
            rng = np.random.default_rng(990 + ndim + scale)
            case = random_case(rng, ndim, False, batch=2, channels_scale=scale)
            for dtype, tf32 in ((np.float32, True), (np.float32, False), (np.float16, False), (BFLOAT16, False)):
                if quick and dtype == BFLOAT16:
                    continue
                run(case, dtype, tf32, poison=scale == 16)
                count += 1
    # every tile (the wgmma ones where the device has wgmma), channel counts that suit them all
    rng = np.random.default_rng(999)
    case = random_case(rng, 2, False, batch=2, channels_scale=64)
    one_group = _first_offset_and_mask_group(case)
    for dtype, tf32 in ((np.float16, False), (np.float32, True), (np.float32, False)):
        for tile in fu._tiles(dtype):
            if fu.is_wgmma(tile) and not fu.wgmma_available() or not fu.tile_builds(dtype, 2, tile,
                                                                                      fu.precision_of(dtype, tf32)):
                continue
            # corners computed per thread, and read from the sampling plan (16-byte sampler, engines 0, 1 and 3);
            # a tile that cannot serve the case (ENGINE 3 where a chunk spans groups) is skipped
            for sampling_plan in (False, True) if tile[4] != 2 else (False,):
                count += run(case, dtype, tf32, poison=True, tile=tile, sampling_plan=sampling_plan)
            # the warps' corner batches (engines 0 and 3): the case with its first offset and mask
            # group alone, the one grouping they serve
            if tile[4] in (0, 3):
                count += run(one_group, dtype, tf32, poison=True, tile=tile, warp_corners=True)
            # with two steps of corner loads in flight, where the tile has that kernel
            if fu.loads_ahead_serves(dtype, 2, tile):
                count += run(one_group, dtype, tf32, poison=True, tile=tile, warp_corners=True, loads_ahead=True)
    # ENGINE 3's persistent blocks: a grid of 2, each block running its tiles (12 samples' worth)
    # through one ring
    many = random_case(np.random.default_rng(998), 2, False, batch=12, channels_scale=64)
    many_one_group = _first_offset_and_mask_group(many)
    blocks, persistent = fu.PERSISTENT_BLOCKS, fu.PERSISTENT
    try:
        fu.PERSISTENT_BLOCKS, fu.PERSISTENT = 2, True
        for dtype, tf32 in ((np.float16, False), (np.float32, True)):
            for tile in fu._tiles(dtype):
                if fu.tile_persists(tile, fu.precision_of(dtype, tf32)) and fu.wgmma_available():
                    count += run(many, dtype, tf32, poison=True, tile=tile, sampling_plan=True)
                    count += run(many_one_group, dtype, tf32, poison=True, tile=tile, warp_corners=True)
    finally:
        fu.PERSISTENT_BLOCKS, fu.PERSISTENT = blocks, persistent
    if quick:
        return count
    # one-sample chunks of the channels-last copy (a sample is never split) and 64-bit indices
    limit, safe = fu.WORKSPACE_LIMIT_BYTES, fu._INT32_SAFE
    try:
        fu.WORKSPACE_LIMIT_BYTES, fu._INT32_SAFE = 1, 0
        for ndim in (1, 2, 3):
            rng = np.random.default_rng(995 + ndim)
            case = random_case(rng, ndim, False, batch=3, channels_scale=16)
            run(case, np.float16, False, poison=True)
            run(case, np.float32, False, poison=True)
            count += 2
            try:   # the same with the sampling plan (64-bit rows) wherever it can serve (tuned anew)
                fu.SAMPLING_PLAN = True
                fu._tuned.clear()
                run(case, np.float16, False, poison=True)
                count += 1
            finally:
                fu.SAMPLING_PLAN = None
                fu._tuned.clear()
    finally:
        fu.WORKSPACE_LIMIT_BYTES, fu._INT32_SAFE = limit, safe
    return count


def forcing_data_tile(tiles: dict, key: str, tile: tuple) -> dict:
    """``cuda_fused_backward.TILES`` with ``tile`` as every data tile its rule may take for
    ``key`` ("half" or "float"): the rule picks the list's first (narrow) or second (wide) tile,
    and a one-tile list would leave it no second."""
    return dict(tiles, **{key: (tuple(tile), tuple(tile))})


def fused_backward_cases(quick: bool = False, persistent_only: bool = False, ndims=(1, 2, 3)) -> int:
    """cuda/fused-backward (forced through plans): every gradient of conv and transposed conv
    (its forward is this backward's input gradient), N = 1, 2, 3, every precision, poisoned
    offsets; the weight gradient with and without its sampling plan; deterministic plans; every
    data and weight tile; one-sample chunks and the 64-bit instantiation;
    checked against the float64 reference of the rounded inputs. ``ndims``: the dimensions
    whose cases run (the data and weight tiles' cases are 2D, the taller weight tiles' 1D)."""
    from dcn_cupy import reference
    from dcn_cupy._backends import cuda_fused_backward as fb
    tol = {np.dtype(np.float32): 5e-3, np.dtype(np.float16): 5e-3, BFLOAT16: 4e-2}
    count = 0

    def run(case, dtype, allow_tf32, tile=None, weight_tile=None, sampling_plan=None, deterministic=False):
        dtype = np.dtype(dtype)
        arrays = _poisoned(case.arrays_)
        with np.errstate(over="ignore"):
            gpu = {k: None if a is None else cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
            rounded = {k: None if a is None else a.astype(dtype).astype(np.float64) for k, a in arrays.items()}
        saved = fb.TILES, fb.WEIGHT_TILES, fb.SAMPLING_PLAN
        key = "float" if dtype == np.float32 else "half"
        weight_key = fb.weight_tile_key(dtype, fb._fused.precision_of(dtype, allow_tf32))
        try:
            if tile is not None:
                fb.TILES = forcing_data_tile(saved[0], key, tile)
                fb.WEIGHT_TILES = {n: dict(tables, **{weight_key: (weight_tile,)}) for n, tables in saved[1].items()}
            fb.SAMPLING_PLAN = sampling_plan
            p = dcn_cupy.plan(*(gpu[k] for k in ARGUMENTS), **case.params, transposed=case.transposed,
                              algorithm="cuda/fused-backward", allow_tf32=allow_tf32, deterministic=deterministic)
        finally:
            fb.TILES, fb.WEIGHT_TILES, fb.SAMPLING_PLAN = saved
        assert "backward: cuda/fused-backward" in p.algorithm or case.transposed, p.algorithm
        assert tile is None or "tile {}x{}x{},".format(*tile[:3]) in str(p), (tile, str(p))
        y = p.forward(*(gpu[k] for k in ARGUMENTS))
        gy = cupy.ones(y.shape, dtype=dtype)
        grads = p.backward(gy, *(gpu[k] for k in ARGUMENTS))
        cupy.cuda.Device().synchronize()
        assert bool(cupy.isfinite(y).all()), case.label
        assert relative_error(cupy.asnumpy(y).astype(np.float64), case.reference(rounded)) < tol[dtype], case.label
        backward = reference.deform_conv_transpose_backward if case.transposed else reference.deform_conv_backward
        exact = backward(np.ones(y.shape), *(rounded[k] for k in ARGUMENTS), **case.params)
        for name, value in zip(ARGUMENTS, exact):
            g = getattr(grads, name)
            assert (g is None) == (value is None), name
            if g is not None:
                got = cupy.asnumpy(g).astype(np.float64)
                assert np.isfinite(got).all(), (name, case.label)
                # weight / bias of float32: strict or TF32 GEMMs, within the float32 budget
                assert relative_error(got, value) < tol[dtype], (name, case.label)
        description = str(p)
        progress("fused backward", f"{case.label}, {dtype.name}: {description}")
        return description

    def persistent_cases():
        # the warp-specialised weight kernel (forced) in persistent blocks: a grid of 2, each
        # block running its units (tile and split) through one ring; 64 channels a group (its
        # tile's); not tuned, so that no timing hands the weight gradient to cuda/im2col. Whole,
        # then in one-sample chunks: each launch after the first adds to the partial sums (the
        # epilogue's reductions, WS_EPILOGUE_RED), and each chunk's copy of grad_output goes over
        # the rows the weight kernel read before (ROWS_OVER_COPY). A one-sample chunk may have
        # just 2 units (1D, a tap, 2 groups), so its grid is one block, to stay persistent
        count = 0
        saved = fb.WS_WEIGHT, fb.WS_PERSISTENT, fb.WS_PERSISTENT_BLOCKS, fb._fused.TUNE, fb._fused.WORKSPACE_LIMIT_BYTES
        try:
            fb.WS_WEIGHT, fb.WS_PERSISTENT, fb.WS_PERSISTENT_BLOCKS, fb._fused.TUNE = True, True, 2, False
            if fb._fused.wgmma_available():
                for ndim in (n for n in (1, 2) if n in ndims):
                    many = random_case(np.random.default_rng(1998), ndim, False, batch=12, channels_scale=64)
                    few = random_case(np.random.default_rng(1997), ndim, False, batch=3, channels_scale=64)
                    for dtype, tf32 in ((np.float16, False), (np.float32, True), (np.float32, False)):
                        for case, limit, blocks in ((many, saved[-1], 2), (few, 1, 1)):
                            fb._fused.WORKSPACE_LIMIT_BYTES, fb.WS_PERSISTENT_BLOCKS = limit, blocks
                            description = run(case, dtype, tf32)
                            assert "warp-specialised wgmma" in description and "persistent blocks" in description, \
                                description
                            assert (limit != 1) or "chunks of 1 sample" in description, description
                            assert (not fb.ROWS_OVER_COPY) or "rows over its copy" in description, description
                            count += 1
        finally:
            (fb.WS_WEIGHT, fb.WS_PERSISTENT, fb.WS_PERSISTENT_BLOCKS, fb._fused.TUNE,
             fb._fused.WORKSPACE_LIMIT_BYTES) = saved
        return count

    if persistent_only:
        return persistent_cases()
    for ndim in (n for n in ((2,) if quick else (1, 2, 3)) if n in ndims):
        for transposed in (False, True):
            rng = np.random.default_rng(1990 + ndim + 10 * transposed)
            case = random_case(rng, ndim, transposed, batch=2, channels_scale=16)
            for dtype, tf32 in ((np.float16, False), (BFLOAT16, False), (np.float32, True), (np.float32, False)):
                if quick and dtype == BFLOAT16:
                    continue
                run(case, dtype, tf32)
                count += 1
            # the weight gradient's corners from the sampling plan (and computed in place), whatever the rule says
            for sampling_plan in (True, False):
                run(case, np.float16, False, sampling_plan=sampling_plan)
                count += 1
            # deterministic: the fixed-point scatter and the per-segment partial sums
            for dtype, tf32 in ((np.float16, False),) if quick else ((np.float16, False), (np.float32, True),
                                                                     (np.float32, False)):
                run(case, dtype, tf32, deterministic=True)
                count += 1
    precisions = ((np.float16, "half", False), (np.float32, "float", False), (np.float32, "float", True))
    if 2 in ndims:
        case = random_case(np.random.default_rng(1999), 2, False, batch=2, channels_scale=16)
        for dtype, key, tf32 in precisions:
            weight_tiles = fb._weight_tiles(dtype, 2, fb._fused.precision_of(dtype, tf32))
            for tile, weight_tile in itertools.zip_longest(fb.TILES[key], weight_tiles):
                run(case, dtype, tf32, tile or fb.TILES[key][0], weight_tile or weight_tiles[0])
                count += 1
    if 1 in ndims:   # 1D's own weight tiles (the taller one; the shorter is 2D's too)
        case = random_case(np.random.default_rng(1998), 1, False, batch=2, channels_scale=16)
        for dtype, key, tf32 in precisions:
            run(case, dtype, tf32, fb.TILES[key][0],
                fb._weight_tiles(dtype, 1, fb._fused.precision_of(dtype, tf32))[-1])
            count += 1
    count += persistent_cases()
    if quick:
        return count
    limit, safe = fb._fused.WORKSPACE_LIMIT_BYTES, fb._INT32_SAFE
    try:
        fb._fused.WORKSPACE_LIMIT_BYTES, fb._INT32_SAFE = 1, 0
        for ndim in (n for n in (1, 2, 3) if n in ndims):
            rng = np.random.default_rng(1995 + ndim)
            case = random_case(rng, ndim, False, batch=3, channels_scale=16)
            run(case, np.float16, False)
            run(case, np.float32, False)
            run(case, np.float16, False, deterministic=True)
            count += 3
    finally:
        fb._fused.WORKSPACE_LIMIT_BYTES, fb._INT32_SAFE = limit, safe
    return count


def ndims_option(argv) -> tuple:
    """The dimensions of ``--ndims 1,3`` in ``argv`` (default 1, 2 and 3), for the fused
    backward's cases."""
    if "--ndims" not in argv:
        return (1, 2, 3)
    at = argv.index("--ndims")
    text = argv[at + 1] if at + 1 < len(argv) else ""
    try:
        ndims = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        ndims = ()
    if not ndims or not set(ndims) <= {1, 2, 3}:
        raise ValueError(f"--ndims takes a comma-separated list of 1, 2 and 3, got {text!r}")
    return ndims


def main() -> int:
    try:
        ndims = ndims_option(sys.argv)
    except ValueError as error:
        print(f"sanitize.py: {error}", file=sys.stderr)
        return 2
    reason = no_gpu_reason()
    if reason is not None:
        print(f"sanitize.py: {reason}: nothing to run.")
        return 0
    _setup()
    if "--fused-only" in sys.argv or "--fused-quick" in sys.argv:
        count = fused_cases(quick="--fused-quick" in sys.argv)
        count += fused_backward_cases(quick="--fused-quick" in sys.argv, ndims=ndims)
        print(f"SANITIZE RUN OK: {count} fused cases")
        return 0
    if "--fused-backward-only" in sys.argv:   # the fused backward's whole section alone
        print(f"SANITIZE RUN OK: {fused_backward_cases(ndims=ndims)} fused backward cases")
        return 0
    if "--fused-persistent" in sys.argv:   # the warp-specialised weight kernel's persistent blocks
        print(f"SANITIZE RUN OK: {fused_backward_cases(persistent_only=True)} persistent weight kernel cases")
        return 0
    if "--columns-only" in sys.argv:
        print(f"SANITIZE RUN OK: {columns_cases()} channels-last column cases")
        return 0
    if "--robustness-only" in sys.argv:  # degenerate shapes and non-finite inputs (issue 11)
        count = robustness_cases()
        print(f"SANITIZE RUN OK: {count} robustness cases")
        return 0
    count = 0
    # every dtype: the automatic choice (cuda/fused forwards for the half types), and for the
    # half types cuda/im2col forced as well
    for ndim, transposed, seed in itertools.product((1, 2, 3), (False, True), range(2)):
        rng = np.random.default_rng(900 + 10 * ndim + seed + 100 * transposed)
        case = random_case(rng, ndim, transposed, batch=2 + seed)
        for dtype in (np.float64, np.float32, np.float16, BFLOAT16):
            run_case(case, dtype, poison=seed == 1)
            count += 1
            if np.dtype(dtype) in HALF:
                with use_algorithm("cuda/im2col"):
                    run_case(case, dtype, poison=seed == 1)
                count += 1
    # one-sample chunks, chunks of rows within a sample and the 64-bit instantiations: the
    # smallest workspace limit each configuration builds with (the limit 1 is refused)
    rows = total = 0
    with _settings(_INT32_SAFE=0):
        for ndim in (1, 2, 3):
            rng = np.random.default_rng(950 + ndim)
            for transposed in (False, True):
                case = random_case(rng, ndim, transposed, batch=3)
                for dtype in (np.float64, np.float16):
                    for backward, deterministic in (("cuda/im2col", False), ("cuda/im2col-deterministic", True)):
                        limit, in_rows = smallest_limit(case, dtype, backward)
                        rows, total = rows + in_rows, total + 1
                        with _settings(WORKSPACE_LIMIT_BYTES=limit), use_algorithm(backward):
                            run_case(case, dtype, poison=True, deterministic=deterministic)
                        count += 1
    print(f"small workspace limits: {total} configurations, {rows} of them in chunks of rows within a sample",
          flush=True)
    # the tiled scatters' global fallback: no halo, and only 64 bytes of shared memory
    for values in ((0, 48 * 1024), (3, 64)):
        with _settings(TILE_HALO=values[0], TILE_SMEM_BYTES=values[1]):
            for ndim in (1, 2, 3):
                rng = np.random.default_rng(970 + ndim)
                case = random_case(rng, ndim, ndim == 2, batch=2, channels_scale=3)
                with use_algorithm("cuda/im2col"):
                    run_case(case, np.float64, poison=True)
                    run_case(case, np.float32, poison=True)
                with use_algorithm("cuda/im2col-deterministic"):
                    run_case(case, np.float64, poison=True, deterministic=True)
                count += 3
    edge_case()
    count += 1
    count += columns_cases()
    count += fused_cases()
    count += fused_backward_cases()
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
    # the smallest workspace each case accepts (one-sample and row chunks), 64-bit indices
    for ndim in (1, 2, 3):
        rng = np.random.default_rng(1300 + ndim)
        case = random_case(rng, ndim, ndim != 2, batch=3)
        limit, _ = smallest_limit(case, np.float64, "cuda/im2col")
        with _settings(WORKSPACE_LIMIT_BYTES=limit, _INT32_SAFE=0):
            for offsets in ("zero", "integer", "fractional"):
                _non_finite_case(case, np.float64, offsets, rng)
                count += 1
    return count

if __name__ == "__main__":
    sys.exit(main())
