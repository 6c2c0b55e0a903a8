"""CPU backend: Numba sampling kernels on a pool of Python threads, and NumPy matmul (BLAS) GEMMs.

This module is the ``cpu/numba`` algorithm, whose loops run along positions, and what both CPU
algorithms share: compilation, the thread pool, the GEMM blocks, the chunks and the sampling
plan. ``cpu_channels_last.py`` (``cpu/channels-last``) runs its loops along the channels of a
channels-last copy of the input instead, where the channels' groups are wide enough.

One code path serves N = 1, 2 and 3: spatial axes are padded in front to three with size-1
axes (kernel 1, stride 1, padding 0, dilation 1), which always sample at their single index,
and only the N real axes get two interpolation corners each.

The work of one *chunk* (some samples, or a box of output positions of one sample) goes through
a *sampling plan*: for every (sample, offset group, tap, output position) the flat input
indices and N-linear weights of its 2^N corners (and their derivatives along each axis, when the
offset gradient is wanted). The plan is shared by the C_in / G_o channels of an offset group. Then

* forward:   columns[c*K + t, q] = mask * sum_corners weight * x[c, index]; y = W_g @ columns_g
* to input:  column grads = W_g^T @ grad_y_g, scattered back through the plan (col2im)
* weight:    grad_W_g = sum_b grad_y_g @ columns_g^T
* offset, mask: per (sample, tap), a sum over channels of column grads times the sampled
  value (mask) or its derivative (offset).

Every kernel loop owns the elements it writes (channels in col2im, taps in the offset and
mask gradients), so there are no data races and no atomics, and results do not depend on
the number of threads. Half types are computed in float32 and cast back.

Threads, fork and process state. The kernels are serial Numba functions compiled with
``nogil=True``; ``_parallel_for`` shares each kernel's jobs out among a pool of Python threads
(the caller's thread works too). Numba's own threading layer (tbb, omp or workqueue) is never
started by dcn_cupy, so

* a process that used dcn_cupy can ``fork`` (``multiprocessing``, a torch ``DataLoader`` with
  workers): the child starts a fresh pool, where GNU OpenMP (Numba's ``omp`` layer) would kill
  it and ``workqueue`` is not thread-safe;
* calls from several Python threads run concurrently and safely, whatever threading layer the
  rest of the process uses (``NUMBA_THREADING_LAYER`` only affects the caller's own kernels);
* compilation is about 3x faster than with ``parallel=True`` (no parfor passes).

The thread count is ``NUMBA_NUM_THREADS`` (default: the CPU count), or ``numba.get_num_threads()``
once the calling process has started Numba's threading layer (so ``numba.set_num_threads`` is
honoured). The GEMMs run in blocks of columns on the same pool, with BLAS held to one thread
(threadpoolctl) while any call runs: one process-wide, reference-counted limit, set by the first
call to enter and restored by the last to leave, so concurrent calls leave BLAS as they found it.
Work is cut into parts by the shapes alone, so results are bitwise the same for any thread count.

Compilation and its cache. Each kernel is compiled once per compute dtype (float32, float64),
for explicit signatures whose input arrays are read-only, so that read-only and writeable arrays
share one compilation. The first compilation warns once (``CompilationWarning``). Compiled code
is cached on disk in ``$DCN_CUPY_NUMBA_CACHE`` if set to a directory, else ``$NUMBA_CACHE_DIR``,
else ``$XDG_CACHE_HOME/dcn_cupy/numba`` (``~/.cache/dcn_cupy/numba``); never in the package's
source tree unless that variable says so. ``DCN_CUPY_NUMBA_CACHE=0`` turns the disk cache off.
Where no cache directory is writable (a read-only install and home), the kernels are compiled in
memory, with one warning.

Memory. The workspace of a chunk (columns, column gradients, sampling plan and the staging
copies of a chunk's inputs) stays within ``DCN_CUPY_CPU_WORKSPACE_BYTES`` (a size such as
``64M``; default ``DEFAULT_WORKSPACE_BYTES``): chunks are several samples when one sample fits,
else boxes of output positions of one sample. A call whose smallest chunk (one output position)
does not fit is refused with a ``MemoryError`` before anything is allocated. Inputs are read
chunk by chunk, so a broadcast (zero-stride) batch is never copied whole. Outside the bound:
the outputs (with float64 accumulators for the weight, offset and mask gradients) and the weight
gradient's GEMM temporaries (at most the weight's size).
"""

from __future__ import annotations

import contextlib
import math
import itertools
import logging
import os
import sys
import threading
import time
import warnings

import numba
import numpy as np
from numba import njit, types

from .._interop import compute_dtype
from .._limits import format_size, size_from_env

xp = np

#: Default upper bound of the per-chunk workspace, chosen by measurement (benchmarks/README.md,
#: "CPU workspace limit").
DEFAULT_WORKSPACE_BYTES = 64 * 2**20

#: Set (in bytes) to override ``DCN_CUPY_CPU_WORKSPACE_BYTES``; None reads the variable per call.
WORKSPACE_LIMIT_BYTES = None

_log = logging.getLogger("dcn_cupy")


class CompilationWarning(UserWarning):
    """The CPU kernels are being compiled (the first call of a dtype on this machine)."""


def workspace_limit() -> int:
    """The workspace bound in bytes: ``WORKSPACE_LIMIT_BYTES`` or ``DCN_CUPY_CPU_WORKSPACE_BYTES``."""
    if WORKSPACE_LIMIT_BYTES is not None:
        return int(WORKSPACE_LIMIT_BYTES)
    return size_from_env("DCN_CUPY_CPU_WORKSPACE_BYTES", DEFAULT_WORKSPACE_BYTES)


def device_context(device_id: int):
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# Compilation: one dispatcher per (kernel, compute dtype), explicit signatures, own cache place.

_KERNELS = {}
_compiled = {}
_compile_lock = threading.RLock()
_warned = set()

#: About how long the first compilation of one dtype takes (2 cores), quoted in the warning.
_COMPILE_SECONDS = "5"


def _kernel(py_func):
    """Register a kernel; it is compiled per dtype on first use (``_compiled_kernel``)."""
    _KERNELS[py_func.__name__] = py_func
    return py_func


def _signature(name, dtype, index_dtype):
    """The one signature of kernel ``name`` for compute dtype ``dtype`` and sampling-plan index
    dtype ``index_dtype``: inputs read-only."""
    f, i = numba.from_dtype(np.dtype(dtype)), numba.from_dtype(np.dtype(index_dtype))
    i64, flag = types.int64, types.boolean

    def array(dt, ndim, readonly=False):
        return types.Array(dt, ndim, "C", readonly=readonly)

    ints = array(i64, 1, True)
    runs = array(types.uint64, 2, True)
    index, weight = array(i, 5, True), array(f, 5, True)
    args = {
        "_sampling_plan": (array(f, 3, True), flag, i64, i64, ints, ints, ints, ints, ints, ints,
                           array(i, 5), array(f, 5), array(f, 6), flag),
        "_im2col": (array(f, 3, True), array(f, 3, True), flag, i64, index, weight, array(f, 3)),
        "_col2im": (array(f, 3, True), array(f, 3, True), flag, i64, index, weight, array(f, 3)),
        "_offset_mask_grads": (array(f, 3, True), array(f, 3, True), array(f, 3, True), flag, i64, index,
                               weight, array(f, 6, True), i64, flag, flag, array(types.float64, 3),
                               array(types.float64, 3)),
        # cpu_channels_last's: the runs of channels (cpu_channels_last._channel_runs) after the mask
        "_im2col_cl": (array(f, 3, True), array(f, 3, True), flag, runs, index, weight, array(f, 5), i64, i64),
        "_col2im_cl": (array(f, 5, True), array(f, 3, True), flag, runs, index, weight, i64, array(f, 3)),
        "_offset_mask_grads_cl": (array(f, 3, True), array(f, 5, True), array(f, 3, True), flag, runs, index,
                                  weight, array(f, 6, True), i64, flag, flag, array(types.float64, 3),
                                  array(types.float64, 3)),
        "_to_channels_last": (array(f, 3, True), array(f, 3)),
        "_add_channels_first": (array(f, 3, True), array(f, 3)),
    }[name]
    return types.void(*args, i64, i64)


def cache_location():
    """The folder of the on-disk kernel cache, or None when it is turned off.

    ``DCN_CUPY_NUMBA_CACHE``: ``0`` (off), a folder, or unset/``1`` (the default below);
    else ``NUMBA_CACHE_DIR``; else ``$XDG_CACHE_HOME/dcn_cupy/numba`` or ``~/.cache/dcn_cupy/numba``.
    """
    setting = os.environ.get("DCN_CUPY_NUMBA_CACHE", "").strip()
    if setting.lower() in ("0", "false", "no", "off"):
        return None
    if setting and setting.lower() not in ("1", "true", "yes", "on"):
        return os.path.abspath(os.path.expanduser(setting))
    if numba.config.CACHE_DIR:
        return os.path.abspath(os.path.expanduser(numba.config.CACHE_DIR))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dcn_cupy", "numba")


def _function_cache(py_func, folder):
    """A Numba FunctionCache that lives in ``folder``; raises RuntimeError if it is not writable."""
    from numba.core import caching

    class Locator(caching.UserProvidedCacheLocator):
        def __init__(self, func, py_file):
            super().__init__(func, py_file)
            self._cache_path = os.path.join(folder, self.get_suitable_cache_subpath(py_file))

        @classmethod
        def from_function(cls, func, py_file):
            return super(caching.UserProvidedCacheLocator, cls).from_function(func, py_file)

    class Impl(caching.CompileResultCacheImpl):
        _locator_classes = [Locator]

    class Cache(caching.FunctionCache):
        _impl_class = Impl

    return Cache(py_func)


def _warn_once(key, message):
    with _compile_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, CompilationWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel():
    """The stack level of the first frame outside dcn_cupy, Numba and the standard library."""
    skip = tuple(os.path.dirname(os.path.abspath(module.__file__)) for module in (numba, contextlib))
    skip += (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def _compiled_kernel(name, dtype, index_dtype):
    """Kernel ``name`` compiled (or loaded from the cache) for compute dtype ``dtype`` and plan
    index dtype ``index_dtype``."""
    key = (name, np.dtype(dtype), np.dtype(index_dtype))
    kernel = _compiled.get(key)
    if kernel is not None:
        return kernel
    with _compile_lock:
        kernel = _compiled.get(key)
        if kernel is not None:
            return kernel
        py_func = _KERNELS[name]
        dispatcher = njit(nogil=True, error_model="numpy")(py_func)  # no divisor here is ever zero
        folder = cache_location()
        if folder is not None:
            try:
                dispatcher._cache = _function_cache(py_func, folder)
            except RuntimeError:  # Numba's "no locator available": the folder is not writable
                _warn_once("cache", (
                    f"dcn_cupy cannot write its Numba kernel cache in {folder!r}: compiling the CPU "
                    f"kernels in memory, again in every process. Set DCN_CUPY_NUMBA_CACHE to a "
                    f"writable folder to keep them (or to 0 to silence this)."))
                folder = None
        signature = _signature(name, dtype, index_dtype)
        tic = time.perf_counter()
        with _announce_compilation(dispatcher, dtype, folder):
            dispatcher.compile(signature)
        dispatcher.disable_compile()  # a call with other types is a bug here, not a reason to compile
        _log.debug("dcn_cupy: %s for %s ready in %.2f s", name, np.dtype(dtype), time.perf_counter() - tic)
        _compiled[key] = dispatcher
        return dispatcher


@contextlib.contextmanager
def _announce_compilation(dispatcher, dtype, folder):
    """Warn, once per dtype, when Numba really compiles (a cache miss), before it does."""
    from numba.core import event

    class Listener(event.Listener):
        def on_start(self, ev):
            if ev.data.get("dispatcher") is dispatcher:
                where = f"cached in {folder}" if folder else "not cached: every new process compiles again"
                _warn_once(("compile", np.dtype(dtype)), (
                    f"dcn_cupy is compiling its CPU kernels for {np.dtype(dtype)} with Numba; this takes "
                    f"about {_COMPILE_SECONDS} s on 2 cores, once per dtype ({where})."))

        def on_end(self, ev):
            pass

    with event.install_listener("numba:compile", Listener()):
        yield


# ---------------------------------------------------------------------------------------------
# The thread pool that runs the kernels' jobs and the GEMMs' blocks.

_pool = None
_pool_lock = threading.Lock()
#: Parts per thread in _parallel_for: a few, so that a busy core does not hold the others up.
_PARTS_PER_THREAD = 4


def num_threads() -> int:
    """Threads the kernels use: Numba's setting (``NUMBA_NUM_THREADS``, ``numba.set_num_threads``)."""
    from numba.np.ufunc import parallel

    if parallel._is_initialized:  # the process started Numba's layer: honour set_num_threads
        return numba.get_num_threads()
    return max(1, int(numba.config.NUMBA_NUM_THREADS))


def _executor(workers):
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:
            from concurrent.futures import ThreadPoolExecutor

            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dcn_cupy-cpu")
        return _pool


def _run_parts(run, parts):
    """``run(i)`` for i in range(parts), on up to ``num_threads()`` threads, the caller's included.

    What a part computes depends on ``i`` alone (never on the thread that runs it), so results
    are the same for any thread count.
    """
    threads = min(num_threads(), parts)
    if threads <= 1:
        for i in range(parts):
            run(i)
        return
    counter = itertools.count()
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                i = next(counter)
            if i >= parts:
                return
            run(i)

    futures = [_executor(threads - 1).submit(work) for _ in range(threads - 1)]
    try:
        work()
    finally:
        for future in futures:
            future.result()


def _parallel_for(name, dtype, index_dtype, args, jobs):
    """Kernel ``name`` (for ``dtype`` and plan indices of ``index_dtype``) over its ``jobs`` jobs,
    cut into parts by the shape alone; every job writes only its own elements."""
    kernel = _compiled_kernel(name, dtype, index_dtype)
    parts = min(jobs, num_threads() * _PARTS_PER_THREAD)
    edges = [jobs * i // parts for i in range(parts + 1)]
    _run_parts(lambda i: kernel(*args, edges[i], edges[i + 1]), parts)


def _blocks(n, least=256, most=16):
    """Edges of a split of range(n) into blocks of about ``least`` or more (at most ``most``
    blocks). More than one block come in a multiple of 4, so that 2 or 4 threads get equal
    shares (3 GEMM blocks on 2 threads took 1.3x the time of 4): the split depends on n alone,
    since BLAS's bits may depend on a block's width."""
    parts = n // least
    if parts >= 2:
        parts = min(most, -(-parts // 4) * 4)
    parts = max(1, parts)
    return [n * i // parts for i in range(parts + 1)]


#: Fewest columns of a GEMM block (narrower blocks cost more in BLAS's packing than they gain),
#: and of a block of the weight gradient's columns; measured on 2 cores (benchmarks/README.md).
_GEMM_COLUMNS = 1024
_WEIGHT_GRAD_COLUMNS = 128


def _matmul(a, b, out):
    """``out = a @ b`` for stacked (.., M, K) @ (.., K, N), in blocks on the pool: blocks of columns
    when there are many, else of rows (a chunk of a few positions still uses every thread)."""
    columns = _blocks(b.shape[-1], least=_GEMM_COLUMNS)
    if len(columns) > 2:
        _run_parts(lambda i: np.matmul(a, b[..., columns[i]:columns[i + 1]],
                                       out=out[..., columns[i]:columns[i + 1]]), len(columns) - 1)
        return
    # Blocks of 1024 rows or more where there are rows enough (cpu/channels-last's column
    # gradients, P x C_out/G @ C_out/G x C_in*K/G: 0.85x the backward's time of blocks of 196)
    rows = _blocks(a.shape[-2], least=_GEMM_COLUMNS)
    if len(rows) <= 2:
        rows = _blocks(a.shape[-2], least=64)
    _run_parts(lambda i: np.matmul(a[..., rows[i]:rows[i + 1], :], b, out=out[..., rows[i]:rows[i + 1], :]),
               len(rows) - 1)


def _add_weight_gradient(grad_w, gy, cols):
    """``grad_w[g] += sum_b gy[b, g] @ cols[b, g]^T``, blocks of grad_w's columns in parallel.

    grad_w: (G, C_out/G, C_in/G * K) float64; gy: (B, G, C_out/G, P); cols: (B, G, C_in/G * K, P).
    """
    edges = _blocks(cols.shape[2], least=_WEIGHT_GRAD_COLUMNS)

    def run(i):
        s, e = edges[i], edges[i + 1]
        for b in range(gy.shape[0]):
            grad_w[:, :, s:e] += np.matmul(gy[b], cols[b, :, s:e].transpose(0, 2, 1))

    _run_parts(run, len(edges) - 1)


class _SingleThreadedBlas:
    """Holds BLAS to one thread while any call of the backend runs, in any thread.

    Process-wide and reference-counted: the first call to enter sets the limit, the last to leave
    restores what it found, so overlapping calls from several threads leave BLAS's thread count
    exactly as it was. The GEMMs run in blocks on dcn_cupy's own threads instead, where a
    multi-threaded BLAS would compete with them for the cores.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._limiter = None
        self._controller = None

    def _limit(self):
        if self._controller is None:
            try:
                from threadpoolctl import ThreadpoolController
                self._controller = ThreadpoolController()
            except ImportError:
                self._controller = False
                warnings.warn(
                    "threadpoolctl is not installed: dcn_cupy's CPU backend cannot hold BLAS to one "
                    "thread, and its GEMMs run 2-4x slower where BLAS's threads compete with its own; "
                    "pip install threadpoolctl", RuntimeWarning, stacklevel=_caller_stacklevel())
        return self._controller.limit(limits=1, user_api="blas") if self._controller else None

    def __enter__(self):
        with self._lock:
            if self._depth == 0:
                self._limiter = self._limit()
            self._depth += 1

    def __exit__(self, *exc):
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._limiter is not None:
                self._limiter.restore_original_limits()
                self._limiter = None

    def after_fork_in_child(self):
        if self._depth and self._limiter is not None:  # forked while another thread ran a call
            self._limiter.restore_original_limits()
        self._lock, self._depth, self._limiter = threading.Lock(), 0, None


_single_threaded_blas = _SingleThreadedBlas()


def _after_fork_in_child():
    # The parent's pool threads do not exist in the child: start afresh (and never wait on them).
    global _pool, _pool_lock, _compile_lock
    _pool = None
    _pool_lock = threading.Lock()
    _compile_lock = threading.RLock()
    _single_threaded_blas.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: Largest input size (positions of one channel) whose sampling plans index in uint32; tests lower
#: it to run the int64 indices on small problems.
INDEX32_LIMIT = 2**32 - 1

# ---------------------------------------------------------------------------------------------
# Numba kernels. Spatial parameters are int64 arrays of length 3 (padded in front). Each kernel
# runs the jobs [start, stop) of its loop; _parallel_for shares the jobs out among threads.


@_kernel
def _sampling_plan(offset, has_offset, n_offset_groups, ndim, in_shape, out_shape, kernel, stride,
                   padding, dilation, index, weight, dweight, want_dweight, start, stop):
    taps = index.shape[2]
    positions = index.shape[3]
    corners = index.shape[4]
    # The shapes and hyper-parameters in locals: read from arrays, they would be read again after
    # every store (the compiler cannot tell the arrays apart).
    size0, size1, size2 = in_shape[0], in_shape[1], in_shape[2]
    out1, out2 = out_shape[1], out_shape[2]
    stride0, stride1, stride2 = stride[0], stride[1], stride[2]
    pad0, pad1, pad2 = padding[0], padding[1], padding[2]
    dil0, dil1, dil2 = dilation[0], dilation[1], dilation[2]
    for job in range(start, stop):  # jobs: batch * n_offset_groups * taps
        b = job // (n_offset_groups * taps)
        g = (job // taps) % n_offset_groups
        t = job % taps
        t0 = t // (kernel[1] * kernel[2])
        t1 = (t // kernel[2]) % kernel[1]
        t2 = t % kernel[2]
        base = (g * taps + t) * ndim
        # The output grid's loops, rather than divisions of q (a few dozen cycles each).
        for q in range(positions):
            if q == 0:
                q0 = q1 = q2 = 0
            else:
                q2 += 1
                if q2 == out2:
                    q2 = 0
                    q1 += 1
                    if q1 == out1:
                        q1 = 0
                        q0 += 1
            p0 = float(q0 * stride0 - pad0 + t0 * dil0)
            p1 = float(q1 * stride1 - pad1 + t1 * dil1)
            p2 = float(q2 * stride2 - pad2 + t2 * dil2)
            if has_offset:
                if ndim == 3:
                    p0 += offset[b, base, q]
                    p1 += offset[b, base + 1, q]
                    p2 += offset[b, base + 2, q]
                elif ndim == 2:
                    p1 += offset[b, base, q]
                    p2 += offset[b, base + 1, q]
                else:
                    p2 += offset[b, base, q]
            # NaN fails every comparison, +-inf fails the range: both sample zero. A coordinate
            # of exactly -1 stays: its corner 0 has weight 0 but slope 1 (torchvision's
            # one-sided offset derivative there); below -1 and from S on no corner is inside.
            valid = p0 >= -1.0 and p0 < size0 and p1 >= -1.0 and p1 < size1 and p2 >= -1.0 and p2 < size2
            if not valid:
                for c in range(corners):
                    index[b, g, t, q, c] = 0
                    weight[b, g, t, q, c] = 0.0
                    if want_dweight:
                        for a in range(ndim):
                            dweight[b, g, t, q, c, a] = 0.0
                continue
            l0 = math.floor(p0)
            l1 = math.floor(p1)
            l2 = math.floor(p2)
            f0 = p0 - l0
            f1 = p1 - l1
            f2 = p2 - l2
            if corners == 4 and not want_dweight:
                # 2D without slopes (every forward's plan), written out without branches: 2x
                # faster than the loop below (10 against 20 ns a point on one core).
                i1 = int(l1)
                i2 = int(l2)
                lo1, hi1, lo2, hi2 = i1 >= 0, i1 + 1 < size1, i2 >= 0, i2 + 1 < size2
                in00, in01, in10, in11 = lo1 & lo2, lo1 & hi2, hi1 & lo2, hi1 & hi2
                first = i1 * size2 + i2
                index[b, g, t, q, 0] = first if in00 else 0
                index[b, g, t, q, 1] = first + 1 if in01 else 0
                index[b, g, t, q, 2] = first + size2 if in10 else 0
                index[b, g, t, q, 3] = first + size2 + 1 if in11 else 0
                weight[b, g, t, q, 0] = (1.0 - f1) * (1.0 - f2) if in00 else 0.0
                weight[b, g, t, q, 1] = (1.0 - f1) * f2 if in01 else 0.0
                weight[b, g, t, q, 2] = f1 * (1.0 - f2) if in10 else 0.0
                weight[b, g, t, q, 3] = f1 * f2 if in11 else 0.0
                continue
            for c in range(corners):
                # Bit 0 of c picks the corner along the last axis, bit 1 the second last, bit 2 the first.
                i0 = int(l0)
                i1 = int(l1)
                i2 = int(l2)
                w0 = 1.0
                w1 = 1.0
                w2 = 1.0
                s0 = -1.0
                s1 = -1.0
                s2 = -1.0
                if ndim == 3:
                    if (c >> 2) & 1:
                        i0 += 1
                        w0 = f0
                        s0 = 1.0
                    else:
                        w0 = 1.0 - f0
                if ndim >= 2:
                    if (c >> 1) & 1:
                        i1 += 1
                        w1 = f1
                        s1 = 1.0
                    else:
                        w1 = 1.0 - f1
                if c & 1:
                    i2 += 1
                    w2 = f2
                    s2 = 1.0
                else:
                    w2 = 1.0 - f2
                inside = 0 <= i0 < size0 and 0 <= i1 < size1 and 0 <= i2 < size2
                if inside:
                    index[b, g, t, q, c] = (i0 * size1 + i1) * size2 + i2
                    weight[b, g, t, q, c] = w0 * w1 * w2
                else:
                    index[b, g, t, q, c] = 0
                    weight[b, g, t, q, c] = 0.0
                if want_dweight:
                    # d weight / d position along each real axis (zero for corners outside).
                    for a in range(ndim):
                        axis = 3 - ndim + a
                        if not inside:
                            dweight[b, g, t, q, c, a] = 0.0
                        elif axis == 0:
                            dweight[b, g, t, q, c, a] = s0 * w1 * w2
                        elif axis == 1:
                            dweight[b, g, t, q, c, a] = w0 * s1 * w2
                        else:
                            dweight[b, g, t, q, c, a] = w0 * w1 * s2


@njit(nogil=True, error_model="numpy")
def _exact_sample(x, b, c, index, weight, g, t, q, corners):
    """The N-linear sample over the corners of non-zero weight only: a zero-weight corner
    reads nothing (no 0 * inf). The kernels sum every corner first, which is the same value
    whenever it is finite, and come here only when it is not."""
    value = 0.0
    for k in range(corners):
        w = weight[b, g, t, q, k]
        if w != 0.0:
            value += w * x[b, c, index[b, g, t, q, k]]
    return value


@_kernel
def _im2col(x, mask, has_mask, n_mask_groups, index, weight, columns, start, stop):
    batch, channels, _ = x.shape
    n_offset_groups = index.shape[1]
    taps = index.shape[2]
    positions = index.shape[3]
    corners = index.shape[4]
    for job in range(start, stop):  # jobs: batch * channels
        b = job // channels
        c = job % channels
        g = c // (channels // n_offset_groups)
        m_row = (c // (channels // n_mask_groups)) * taps if has_mask else 0
        for t in range(taps):
            row = c * taps + t
            for q in range(positions):
                value = 0.0
                for k in range(corners):
                    value += weight[b, g, t, q, k] * x[b, c, index[b, g, t, q, k]]
                if not math.isfinite(value):
                    value = _exact_sample(x, b, c, index, weight, g, t, q, corners)
                if has_mask:
                    value *= mask[b, m_row + t, q]
                columns[b, row, q] = value


@_kernel
def _col2im(column_grads, mask, has_mask, n_mask_groups, index, weight, grad_x, start, stop):
    batch, channels, _ = grad_x.shape
    n_offset_groups = index.shape[1]
    taps = index.shape[2]
    positions = index.shape[3]
    corners = index.shape[4]
    for job in range(start, stop):  # batch * channels jobs, each owns grad_x[b, c]
        b = job // channels
        c = job % channels
        g = c // (channels // n_offset_groups)
        m_row = (c // (channels // n_mask_groups)) * taps if has_mask else 0
        for t in range(taps):
            row = c * taps + t
            for q in range(positions):
                value = column_grads[b, row, q]
                if has_mask:
                    value *= mask[b, m_row + t, q]
                if math.isfinite(value):
                    for k in range(corners):
                        grad_x[b, c, index[b, g, t, q, k]] += value * weight[b, g, t, q, k]
                else:  # zero-weight corners receive nothing, not 0 * inf
                    for k in range(corners):
                        w = weight[b, g, t, q, k]
                        if w != 0.0:
                            grad_x[b, c, index[b, g, t, q, k]] += value * w


@_kernel
def _offset_mask_grads(x, column_grads, mask, has_mask, n_mask_groups, index, weight, dweight, ndim,
                       want_offset, want_mask, grad_offset, grad_mask, start, stop):
    batch, channels, _ = x.shape
    n_offset_groups = index.shape[1]
    taps = index.shape[2]
    positions = index.shape[3]
    corners = index.shape[4]
    for job in range(start, stop):  # batch * taps jobs, each owns the entries of tap t of sample b
        b = job // taps
        t = job % taps
        # corner_grads[g, q, k] = sum over the channels c of offset group g of
        # grad_column[c] * mask * x[c, corner k]; the offset gradient is then one dot product
        # with the corner weights' slopes per position, not one per channel.
        corner_grads = np.zeros((n_offset_groups if want_offset else 1, positions, corners))
        for c in range(channels):
            g = c // (channels // n_offset_groups)
            m_row = (c // (channels // n_mask_groups)) * taps + t if has_mask else 0
            row = c * taps + t
            for q in range(positions):
                grad = column_grads[b, row, q]
                scaled = grad * mask[b, m_row, q] if has_mask else grad
                value = 0.0
                for k in range(corners):
                    v = x[b, c, index[b, g, t, q, k]]
                    value += weight[b, g, t, q, k] * v
                    if want_offset:
                        corner_grads[g, q, k] += scaled * v
                if want_mask:
                    term = grad * value
                    if not math.isfinite(term):
                        # A tap that samples nothing has a zero gradient whatever grad holds.
                        used = False
                        for k in range(corners):
                            used = used or weight[b, g, t, q, k] != 0.0
                        value = _exact_sample(x, b, c, index, weight, g, t, q, corners)
                        term = grad * value if used else 0.0
                    grad_mask[b, m_row, q] += term
        if want_offset:
            for g in range(n_offset_groups):
                o_row = (g * taps + t) * ndim
                for q in range(positions):
                    for a in range(ndim):
                        total = 0.0
                        for k in range(corners):
                            total += dweight[b, g, t, q, k, a] * corner_grads[g, q, k]
                        if not math.isfinite(total):  # outside and zero-slope corners add nothing
                            total = 0.0
                            for k in range(corners):
                                slope = dweight[b, g, t, q, k, a]
                                if slope != 0.0:
                                    total += slope * corner_grads[g, q, k]
                        grad_offset[b, o_row + a, q] = total


# ---------------------------------------------------------------------------------------------
# Chunks: which samples and output positions one pass over the workspace covers.


def _padded(values, fill, ndim):
    return np.array((fill,) * (3 - ndim) + tuple(values), dtype=np.int64)


class _Chunk:
    """Samples [b0, b1) at the output positions [q0, q1), a box of the (padded) output grid."""

    __slots__ = ("b0", "b1", "q0", "q1", "out_shape", "padding", "all_positions")

    def __init__(self, b0, b1, q0, q1, out_shape, padding, all_positions):
        self.b0, self.b1, self.q0, self.q1 = b0, b1, q0, q1
        self.out_shape, self.padding, self.all_positions = out_shape, padding, all_positions

    @property
    def batch(self):
        return self.b1 - self.b0

    @property
    def positions(self):
        return self.q1 - self.q0


class _Workspace:
    """The chunking of one call, checked against the workspace limit before anything is allocated.

    Per output position of a sample a chunk holds: the sampling plan (an index and a weight per
    corner, plus a slope per axis when the offset gradient is wanted), the columns and/or column
    gradients (C_in * K values each), staging copies of the offset, mask and output (gradient)
    rows, and float64 offset/mask gradient rows. Per sample: a copy of the input, when it has to
    be converted or gathered from a strided batch.
    """

    def __init__(self, geom, dtype, *, columns, column_grads, dweight, grads, input_copy, copies=None):
        itemsize = dtype.itemsize
        taps = max(geom.offset_groups, 1) * geom.kernel_volume
        index_size = plan_index_dtype(geom).itemsize
        plan = taps * (1 << geom.ndim) * (index_size + itemsize * (1 + (geom.ndim if dweight else 0)))
        rows = geom.in_channels * geom.kernel_volume * (int(columns) + int(column_grads))
        staged = geom.offset_groups * geom.kernel_volume * geom.ndim + geom.mask_groups * geom.kernel_volume
        grad_rows = staged if grads else 0
        # _offset_mask_grads keeps per-group corner sums of one tap in every running thread.
        grad_rows += num_threads() * max(geom.offset_groups, 1) * (1 << geom.ndim) if dweight else 0
        self.per_position = plan + itemsize * (rows + staged + geom.out_channels) + 8 * grad_rows
        # Per sample: ``copies`` input-sized arrays (cpu_channels_last's), else one where ``input_copy``.
        copies = int(input_copy) if copies is None else copies
        self.per_sample = copies * geom.in_channels * geom.input_size * itemsize
        self.limit = workspace_limit()
        self.geom = geom
        q = geom.output_size
        whole = self.per_sample + q * self.per_position
        if whole <= self.limit:
            self.samples, self.box_positions = min(geom.batch, self.limit // whole), q
        else:
            least = self.per_sample + self.per_position
            if least > self.limit:
                raise MemoryError(
                    f"dcn_cupy's CPU backend needs at least {format_size(least)} of workspace for one "
                    f"output position of this convolution, over the limit of {format_size(self.limit)}; "
                    f"raise DCN_CUPY_CPU_WORKSPACE_BYTES (e.g. 1G) to run it")
            self.samples, self.box_positions = 1, (self.limit - self.per_sample) // self.per_position

    @property
    def bytes(self) -> int:
        """The workspace one chunk uses, at most the limit."""
        return self.samples * self.per_sample + self.samples * self.box_positions * self.per_position

    def chunks(self):
        geom = self.geom
        n = geom.ndim
        out = _padded(geom.output_shape, 1, n)
        padding = _padded(geom.padding, 0, n)
        stride = _padded(geom.stride, 1, n)
        q = geom.output_size
        if self.box_positions >= q:
            for b0 in range(0, geom.batch, self.samples):
                yield _Chunk(b0, min(b0 + self.samples, geom.batch), 0, q, out, padding, True)
            return
        # Boxes: fixed indices on the axes before `axis`, a range of `rows` on it, whole axes after.
        inner = [int(np.prod(out[a + 1:])) for a in range(3)]
        axis = next(a for a in range(3) if inner[a] <= self.box_positions)
        rows = self.box_positions // inner[axis]
        for b in range(geom.batch):
            for prefix in itertools.product(*(range(int(out[a])) for a in range(axis))):
                for r0 in range(0, int(out[axis]), rows):
                    r1 = min(r0 + rows, int(out[axis]))
                    start = np.array(prefix + (r0,) + (0,) * (2 - axis), dtype=np.int64)
                    shape = out.copy()
                    shape[:axis] = 1
                    shape[axis] = r1 - r0
                    q0 = int(np.dot(start, inner))
                    yield _Chunk(b, b + 1, q0, q0 + (r1 - r0) * inner[axis], shape, padding - start * stride, False)


def _needs_copy(array, dtype):
    """Whether a chunk of ``array`` must be copied: another dtype, or samples not evenly laid out."""
    if array is None:
        return False
    per_sample = int(np.prod(array.shape[1:])) * array.itemsize
    return array.dtype != dtype or (array.shape[0] > 1 and array.strides[0] != per_sample)


def _stage(array, chunk, dtype, positions=True):
    """``array[b0:b1]`` as a C-contiguous (Bc, C, P) array in ``dtype``, at the chunk's positions
    when ``positions`` (else the whole grid); a view where no copy is needed."""
    part = array[chunk.b0:chunk.b1]
    part = part.reshape(chunk.batch, array.shape[1], -1)
    if positions and not chunk.all_positions:
        part = part[:, :, chunk.q0:chunk.q1]
    return np.ascontiguousarray(part, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Driver


def plan_index_dtype(geom):
    """The dtype of the sampling plan's corner indices (into one channel of one sample): uint32
    where every index fits, which halves their memory and makes the gathers faster than int64
    ones (no negative-index wrap-around to test), else int64."""
    return np.dtype(np.uint32) if geom.input_size <= INDEX32_LIMIT else np.dtype(np.int64)


class _Plan:
    """The sampling plan of one chunk."""

    def __init__(self, geom, chunk, offset, want_dweight, dtype):
        n = geom.ndim
        groups = max(geom.offset_groups, 1)
        corners = 1 << n
        shape = (chunk.batch, groups, geom.kernel_volume, chunk.positions, corners)
        self.index = np.empty(shape, dtype=plan_index_dtype(geom))
        self.weight = np.empty(shape, dtype=dtype)
        self.dweight = np.empty(shape + (n,) if want_dweight else (1,) * 6, dtype=dtype)
        has_offset = offset is not None
        off = offset if has_offset else np.zeros((1, 1, 1), dtype)
        args = (off, has_offset, groups, n, _padded(geom.input_shape, 1, n), chunk.out_shape,
                _padded(geom.kernel_size, 1, n), _padded(geom.stride, 1, n), chunk.padding,
                _padded(geom.dilation, 1, n), self.index, self.weight, self.dweight, want_dweight)
        _parallel_for("_sampling_plan", dtype, self.index.dtype, args, chunk.batch * groups * geom.kernel_volume)


def _grouped_weight(weight, geom, dtype):
    """(C_out, C_in/G, *k) -> (G, C_out/G, C_in/G * K)."""
    return np.asarray(weight, dtype=dtype).reshape(
        geom.groups, geom.out_channels_per_group, geom.in_channels_per_group * geom.kernel_volume
    )


def _mask_args(mask, geom, dtype):
    """The kernels' mask, its flag and its groups. Without a mask, a placeholder of 1: the
    channels-last kernels multiply by it rather than branch on the flag in their loops (exact,
    and one loop to compile rather than two); cpu/numba's never read it."""
    if mask is None:
        return np.ones((1, 1, 1), dtype), False, 1
    return mask, True, geom.mask_groups


def _columns(x, mask, plan, geom, dtype):
    """im2col of the staged chunk ``x`` (Bc, C_in, S) -> (Bc, C_in * K, P)."""
    batch, positions = plan.index.shape[0], plan.index.shape[3]
    columns = np.empty((batch, geom.in_channels * geom.kernel_volume, positions), dtype=dtype)
    m, has_mask, mask_groups = _mask_args(mask, geom, dtype)
    _parallel_for("_im2col", dtype, plan.index.dtype, (x, m, has_mask, mask_groups, plan.index, plan.weight, columns),
                  batch * geom.in_channels)
    return columns


def _add_bias(out, bias, ndim):
    if bias is not None:
        out += np.asarray(bias, dtype=out.dtype).reshape((1, -1) + (1,) * ndim)


def _output(out, geom, dtype, inputs):
    """``(y, into_out)``: the (B, G, C_out/G, P) output to compute into, a view of ``out`` where
    that is C-contiguous in the compute dtype and overlaps none of ``inputs`` (no copy
    afterwards), else a new array."""
    shape = (geom.batch, geom.groups, geom.out_channels_per_group, geom.output_size)
    if (out is not None and out.dtype == dtype and out.flags.c_contiguous and out.flags.writeable
            and not any(a is not None and np.may_share_memory(a, out) for a in inputs)):
        return out.reshape(shape), True
    return np.empty(shape, dtype=dtype), False


def conv_forward(x, weight, offset, mask, bias, geom, out=None):
    """``y = deform_conv(x) (+ bias)``, shape ``geom.y_shape``, in ``x``'s dtype: computed into
    ``out`` (of that shape) where ``_output`` allows, and then ``out`` itself, else a new array."""
    with _single_threaded_blas:
        return _conv_forward(x, weight, offset, mask, bias, geom, out)


def _conv_forward(x, weight, offset, mask, bias, geom, out):
    dtype = compute_dtype(x.dtype)
    space = _Workspace(geom, dtype, columns=True, column_grads=False, dweight=False, grads=False,
                       input_copy=_needs_copy(x, dtype))
    w = _grouped_weight(weight, geom, dtype)
    y, into_out = _output(out, geom, dtype, (x, weight, offset, mask, bias))
    staged = None
    for chunk in space.chunks():
        if staged is None or staged[0] != (chunk.b0, chunk.b1):
            staged = ((chunk.b0, chunk.b1), _stage(x, chunk, dtype, positions=False))
        off = None if offset is None else _stage(offset, chunk, dtype)
        msk = None if mask is None else _stage(mask, chunk, dtype)
        plan = _Plan(geom, chunk, off, False, dtype)
        columns = _columns(staged[1], msk, plan, geom, dtype)
        cols = columns.reshape(chunk.batch, geom.groups, -1, chunk.positions)
        _matmul(w[None], cols, y[chunk.b0:chunk.b1, :, :, chunk.q0:chunk.q1])
        del plan, columns, cols, off, msk  # before the next chunk allocates its own
    y = y.reshape(geom.y_shape)
    _add_bias(y, bias, geom.ndim)
    return out if into_out else y.astype(x.dtype, copy=False)


def conv_backward(grad_output, x, weight, offset, mask, geom, wanted, bias=None):
    """Every gradient in ``wanted`` (a frozenset of "input", "weight", "offset", "mask") in one
    pass over the batch: the plan and the column gradients are shared by the input, offset and
    mask gradients. Returns ``(grad_x, grad_weight, grad_offset, grad_mask)``, None where not
    wanted. ``x`` may be None when only the input gradient is wanted; ``bias`` is added to the
    input gradient (the transposed forward)."""
    with _single_threaded_blas:
        return _conv_backward(grad_output, x, weight, offset, mask, geom, wanted, bias)


def _conv_backward(grad_output, x, weight, offset, mask, geom, wanted, bias):
    dtype = compute_dtype(grad_output.dtype)
    out_dtype = grad_output.dtype
    need_input, need_weight = "input" in wanted, "weight" in wanted
    need_offset = "offset" in wanted and offset is not None
    need_mask = "mask" in wanted and mask is not None
    need_grads = need_input or need_offset or need_mask
    space = _Workspace(geom, dtype, columns=need_weight, column_grads=need_grads, dweight=need_offset,
                       grads=need_offset or need_mask,
                       input_copy=(need_weight or need_offset or need_mask) and _needs_copy(x, dtype))
    w = _grouped_weight(weight, geom, dtype)
    grad_x = np.zeros((geom.batch, geom.in_channels, geom.input_size), dtype=dtype) if need_input else None
    grad_w = np.zeros(w.shape, dtype=np.float64) if need_weight else None
    grad_off, grad_m = _offset_mask_accumulators(geom, need_offset, need_mask)
    staged = None
    for chunk in space.chunks():
        batch, positions = chunk.batch, chunk.positions
        if (need_weight or need_offset or need_mask) and (staged is None or staged[0] != (chunk.b0, chunk.b1)):
            staged = ((chunk.b0, chunk.b1), _stage(x, chunk, dtype, positions=False))
        xc = None if staged is None else staged[1]
        off = None if offset is None else _stage(offset, chunk, dtype)
        msk = None if mask is None else _stage(mask, chunk, dtype)
        gy = _stage(grad_output, chunk, dtype).reshape(batch, geom.groups, geom.out_channels_per_group, positions)
        plan = _Plan(geom, chunk, off, need_offset, dtype)
        if need_weight:
            cols = _columns(xc, msk, plan, geom, dtype).reshape(batch, geom.groups, -1, positions)
            _add_weight_gradient(grad_w, gy, cols)
            del cols
        if not need_grads:
            del plan, off, msk, gy
            continue
        column_grads = np.empty((batch, geom.in_channels * geom.kernel_volume, positions), dtype=dtype)
        _matmul(w.transpose(0, 2, 1)[None], gy, column_grads.reshape(batch, geom.groups, -1, positions))
        m, has_mask, mask_groups = _mask_args(msk, geom, dtype)
        if need_input:
            _parallel_for("_col2im", dtype, plan.index.dtype, (column_grads, m, has_mask, mask_groups, plan.index,
                                                                plan.weight, grad_x[chunk.b0:chunk.b1]),
                          batch * geom.in_channels)
        if need_offset or need_mask:
            g_off, g_m = _chunk_rows(grad_off, chunk), _chunk_rows(grad_m, chunk)
            _parallel_for("_offset_mask_grads", dtype, plan.index.dtype, (
                xc, column_grads, m, has_mask, mask_groups, plan.index, plan.weight, plan.dweight,
                geom.ndim, need_offset, need_mask, g_off, g_m), batch * geom.kernel_volume)
            _store_chunk_rows(grad_off, g_off, chunk)
            _store_chunk_rows(grad_m, g_m, chunk)
            del g_off, g_m
        del plan, column_grads, off, msk, gy  # before the next chunk allocates its own
    return _gradients(grad_x, grad_w, grad_off, grad_m, geom, bias, out_dtype)


def _offset_mask_accumulators(geom, need_offset, need_mask):
    """The float64 (B, rows, P) offset and mask gradients, None where not wanted."""
    return (np.zeros(geom.offset_shape[:2] + (geom.output_size,), np.float64) if need_offset else None,
            np.zeros(geom.mask_shape[:2] + (geom.output_size,), np.float64) if need_mask else None)


def _chunk_rows(full, chunk):
    """What a chunk's offset/mask kernel writes of ``full`` (an accumulator, or None): its view where
    the chunk holds every position, else zeros for ``_store_chunk_rows``; a dummy for None."""
    if full is None:
        return np.zeros((1, 1, 1))
    if chunk.all_positions:
        return full[chunk.b0:chunk.b1]
    return np.zeros((chunk.batch, full.shape[1], chunk.positions))


def _store_chunk_rows(full, rows, chunk):
    """``rows`` (from ``_chunk_rows``) into ``full`` where they are not already its view."""
    if full is not None and not chunk.all_positions:
        full[chunk.b0:chunk.b1, :, chunk.q0:chunk.q1] = rows


def _gradients(grad_x, grad_w, grad_off, grad_m, geom, bias, dtype):
    """The backward's result: the accumulators in their shapes and ``dtype``, ``bias`` added to the
    input gradient (the transposed forward); ``grad_w`` already in the weight's order."""
    if grad_x is not None:
        grad_x = grad_x.reshape(geom.x_shape)
        _add_bias(grad_x, bias, geom.ndim)
    return (
        None if grad_x is None else grad_x.astype(dtype, copy=False),
        None if grad_w is None else grad_w.reshape(geom.weight_shape).astype(dtype, copy=False),
        None if grad_off is None else grad_off.reshape(geom.offset_shape).astype(dtype, copy=False),
        None if grad_m is None else grad_m.reshape(geom.mask_shape).astype(dtype, copy=False),
    )


def threading_layer() -> str:
    """How the kernels run, for ``python -m dcn_cupy info``."""
    return (f"numba {numba.__version__}, {num_threads()} threads (dcn_cupy's thread pool; Numba's "
            f"threading layer is not used)")
