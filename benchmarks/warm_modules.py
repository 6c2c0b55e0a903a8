"""Compile every CUDA module of the backends once, several processes at a time, into CuPy's
kernel cache, so that later processes load them instead of compiling.

    CUPY_CACHE_DIR=$PWD/.kcache python benchmarks/warm_modules.py [--jobs 16] \
        [--backends fused,fused-backward,im2col,direct,deterministic]

A cold process spends minutes in NVRTC before its first launch (a fused module of sm_90a
kernels takes about a minute alone). Test groups or benchmarks run in parallel on a fresh
machine would each compile the same modules; run this first, with the same CUPY_CACHE_DIR, and
they load them (NOTES-gpu.md, session 27: 72 fused modules in 74 s on 16 cores). Each module is
built by the backend's own loader on the current device, so the cache holds exactly what the
backends look up: CuPy's cache for the RawModules, ``cuda_fused``'s own files for the sm_90a ones.

Run it as a file: its workers are spawned processes, which import this script again (a pool
started from a script on standard input cannot, and waits for ever). Without a CUDA device it
says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: Backend name -> its module under dcn_cupy._backends.
BACKENDS = {"fused": "cuda_fused", "fused-backward": "cuda_fused_backward", "im2col": "cuda",
            "direct": "cuda_direct", "deterministic": "cuda_deterministic"}


def module_keys(backend: str) -> list:
    """The keys of every module ``backend`` can build: (dtype, ndim, index64), with the engine
    last for the fused forward (one module each)."""
    import importlib
    module = importlib.import_module(f"dcn_cupy._backends.{BACKENDS[backend]}")
    if hasattr(module, "all_module_keys"):
        return list(module.all_module_keys())
    from dcn_cupy._backends import cuda
    return list(cuda.all_module_keys())   # cuda_deterministic: one module per cuda/im2col key


def tasks(backends) -> list:
    """(backend, key) of every module to build, the sm_90a ones (the slowest) first."""
    found = [(backend, tuple(key)) for backend in backends for key in module_keys(backend)]
    return sorted(found, key=lambda task: not (task[0] == "fused" and task[1][3] in (1, 3)))


def build(task) -> tuple:
    """Compile and load one module through its backend's loader; (task, seconds, error or None)."""
    backend, key = task
    start = time.perf_counter()
    try:
        import importlib
        module = importlib.import_module(f"dcn_cupy._backends.{BACKENDS[backend]}")
        if backend == "fused":
            dtype, ndim, index64, engine = key
            module._function(module.name_expressions(dtype, ndim, index64, engine)[0], dtype, ndim, index64, engine)
        elif backend in ("fused-backward", "im2col"):
            module._function(module.name_expressions(*key)[0], *key)
            if backend == "fused-backward" and module._fused.wgmma_available():   # its sm_90a module
                module._function(module.ws_name_expressions(*key)[0], *key)
        else:   # direct, deterministic: their kernels dict loads the whole module
            for fn in module._kernels(*key).values():
                getattr(fn, "kernel", None)
    except Exception as error:   # reported, not raised: the other modules still build
        return task, time.perf_counter() - start, f"{type(error).__name__}: {str(error)[:300]}"
    return task, time.perf_counter() - start, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes at a time")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"comma-separated, of {', '.join(BACKENDS)}")
    args = parser.parse_args(argv)
    backends = [name for name in args.backends.split(",") if name]
    unknown = [name for name in backends if name not in BACKENDS]
    if unknown:
        parser.error(f"--backends: unknown {', '.join(unknown)} (known: {', '.join(BACKENDS)})")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    from gpu import no_gpu_reason
    reason = no_gpu_reason()
    if reason is not None:
        print(f"benchmarks/warm_modules.py: {reason}: nothing to compile.")
        return 0
    todo = tasks(backends)
    start = time.perf_counter()
    failed = 0
    with multiprocessing.get_context("spawn").Pool(min(args.jobs, len(todo))) as pool:
        for (backend, key), seconds, error in pool.imap_unordered(build, todo):
            if error is not None:
                failed += 1
                print(f"  {backend} {key}: {error}", flush=True)
    print(f"warm_modules.py: {len(todo) - failed} of {len(todo)} modules ({', '.join(backends)}) in "
          f"{time.perf_counter() - start:.0f} s, {min(args.jobs, len(todo))} processes; "
          f"cache {os.environ.get('CUPY_CACHE_DIR', '~/.cupy/kernel_cache')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
