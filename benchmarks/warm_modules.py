"""Compile every CUDA module of the backends once, several processes at a time, into CuPy's
kernel cache, so that later processes load them instead of compiling.

    CUPY_CACHE_DIR=$PWD/.kcache python benchmarks/warm_modules.py [--jobs 16] \
        [--backends fused,fused-backward,im2col,direct,deterministic] \
        [--dtypes float32,float16] [--ndims 2] [--index 32,64] [--set MODULE.NAME=VALUE ...] \
        [--unpack PREFIX] [--pack PREFIX]

A cold process spends minutes in NVRTC before its first launch (a fused module of sm_90a
kernels takes about a minute alone). Test groups or benchmarks run in parallel on a fresh
machine would each compile the same modules; run this first, with the same CUPY_CACHE_DIR, and
they load them (NOTES-gpu.md, session 27: 72 fused modules in 74 s on 16 cores). Each module is
built by the backend's own loader on the current device, so the cache holds exactly what the
backends look up: CuPy's cache for the RawModules, ``cuda_fused``'s own files for the sm_90a ones.
The fused backward's two modules of a key (sm_90 and sm_90a) are two tasks, so that they build
side by side; the sm_90a ones, the slowest, start first. ``--dtypes``, ``--ndims`` and ``--index``
(the index widths: 32, 64 or both) keep the modules of those keys alone: what a test group or a
benchmark of one dtype and N loads, when the source has changed and every module would be rebuilt.
``--set MODULE.NAME=VALUE`` (repeatable) sets a backend's module-level source switch in every
worker before it builds, e.g. ``--set cuda_fused_backward.WS_LOADS_AHEAD=False``: the modules of a
switch's other value, which an ``ab.py`` A/B of that switch would otherwise compile one after the
other inside the timed process.

A fresh device machine starts with an empty cache, and one left by an earlier call does not
survive to the next. ``--pack PREFIX`` writes the cache, after building, as an xz tar in pieces
``PREFIX.00``, ``PREFIX.01``, ... of at most 15 MiB each (the device tool returns files of at most
16 MiB from $OUT); ``--unpack PREFIX`` extracts such pieces into the cache before building, so a
later call that carries them finds its modules built (NOTES-gpu.md, session 72: 150 modules, 18 MB
packed, found in 4 s where compiling took 125-150 s). CuPy and the fused loader key each entry by
its source, so entries of an older source are never loaded, only left unused.

Run it as a file: its workers are spawned processes, which import this script again (a pool
started from a script on standard input cannot, and waits for ever). Without a CUDA device it
says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import glob
import io
import multiprocessing
import os
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: Backend name -> its module under dcn_cupy._backends.
BACKENDS = {"fused": "cuda_fused", "fused-backward": "cuda_fused_backward", "im2col": "cuda",
            "direct": "cuda_direct", "deterministic": "cuda_deterministic"}


#: Largest piece of a packed cache: the device tool brings back files of at most 16 MiB.
PIECE_BYTES = 15 << 20


def cache_dir() -> Path:
    """The kernel cache the backends use: CuPy's, which also holds ``cuda_fused``'s own sm_90a files."""
    from dcn_cupy._backends import cuda_fused
    return Path(cuda_fused.kernel_cache_folder())


def pack_cache(folder, prefix, piece_bytes: int = PIECE_BYTES) -> list:
    """Write ``folder``'s files as one xz tar (paths relative to it) in pieces ``prefix.00``,
    ``prefix.01``, ... of at most ``piece_bytes`` each; returns the pieces' paths."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"--pack: the kernel cache {str(folder)!r} is not a folder")
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz", preset=2) as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    blob = data.getvalue()
    for stale in _pieces(prefix):   # (an earlier pack's, which unpack would read after these)
        stale.unlink()
    pieces = []
    for number, start in enumerate(range(0, max(len(blob), 1), piece_bytes)):
        piece = Path(f"{prefix}.{number:02d}")
        piece.parent.mkdir(parents=True, exist_ok=True)
        piece.write_bytes(blob[start:start + piece_bytes])
        pieces.append(piece)
    return pieces


def _pieces(prefix) -> list:
    """The pieces ``prefix.00``, ``prefix.01``, ... that exist, in order."""
    return sorted(Path(name) for name in glob.glob(glob.escape(str(prefix)) + ".[0-9][0-9]"))


def unpack_cache(prefix, folder) -> int:
    """Extract the pieces ``prefix.NN`` of ``pack_cache`` into ``folder``; returns the number of
    files. Anything but a plain file under ``folder`` is refused before a byte is written."""
    pieces = _pieces(prefix)
    if not pieces:
        raise ValueError(f"--unpack: expected pieces {str(prefix)!r}.00, .01, ..., found none")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    blob = b"".join(Path(piece).read_bytes() for piece in pieces)
    try:
        tar = tarfile.open(fileobj=io.BytesIO(blob), mode="r:xz")
    except (tarfile.TarError, EOFError) as error:
        raise ValueError(f"--unpack: the {len(pieces)} pieces {str(prefix)!r}.NN are not an xz tar "
                         f"({error})") from None
    with tar:
        members = tar.getmembers()
        root = folder.resolve()
        for member in members:
            target = (folder / member.name).resolve()
            if root not in target.parents or not member.isfile():
                raise ValueError(f"--unpack: member {member.name!r} of {str(prefix)!r}.NN is not a file under "
                                 "the cache")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(folder, filter="data")
        else:
            tar.extractall(folder)
    return len(members)   # (every one a file: checked above)


def module_keys(backend: str) -> list:
    """The keys of every module ``backend`` can build: (dtype, ndim, index64), with the engine
    last for the fused forward (one module each)."""
    import importlib
    module = importlib.import_module(f"dcn_cupy._backends.{BACKENDS[backend]}")
    if hasattr(module, "all_module_keys"):
        return list(module.all_module_keys())
    from dcn_cupy._backends import cuda
    return list(cuda.all_module_keys())   # cuda_deterministic: one module per cuda/im2col key


def _sm90a(task) -> bool:
    """Whether a task builds an sm_90a module: a fused engine 1 or 3, a fused backward's second."""
    backend, key = task
    return (backend == "fused" and key[3] in (1, 3)) or (backend == "fused-backward" and key[3])


def tasks(backends, dtypes=None, ndims=None, index_bits=None) -> list:
    """(backend, key) of every module to build, the sm_90a ones (the slowest) first; a fused
    backward's key ends with whether it is the sm_90a module. ``dtypes`` (numpy dtypes),
    ``ndims`` and ``index_bits`` (widths, of 32 and 64), where given, keep those keys alone."""
    found = []
    for backend in backends:
        for key in module_keys(backend):
            dtype, ndim, index64 = key[:3]
            if ((dtypes is not None and dtype not in dtypes) or (ndims is not None and ndim not in ndims)
                    or (index_bits is not None and (64 if index64 else 32) not in index_bits)):
                continue
            if backend == "fused-backward":   # (its sm_90 and its sm_90a module)
                found += [(backend, tuple(key) + (sm90a,)) for sm90a in (False, True)]
            else:
                found.append((backend, tuple(key)))
    return sorted(found, key=lambda task: not _sm90a(task))


def parse_setting(text: str) -> tuple:
    """``"cuda_fused_backward.WS_LOADS_AHEAD=False"`` -> ("dcn_cupy._backends.cuda_fused_backward",
    "WS_LOADS_AHEAD", False): ab.py's ``parse_setting`` (its ``--set`` too)."""
    from ab import parse_setting as parse
    return parse(text)


def apply_settings(settings) -> None:
    """Set each (module path, name, value) of ``parse_setting`` (a worker's initializer)."""
    import importlib
    for path, name, value in settings:
        setattr(importlib.import_module(path), name, value)


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
        elif backend == "fused-backward":
            *key, sm90a = key
            if not sm90a:
                module._function(module.name_expressions(*key)[0], *key)
            elif module._fused.wgmma_available():   # (its sm_90a module: only where it runs)
                module._function(module.ws_name_expressions(*key)[0], *key)
        elif backend == "im2col":
            module._function(module.name_expressions(*key)[0], *key)
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
    parser.add_argument("--dtypes", default=None, help="comma-separated, of float16,bfloat16,float32,float64 "
                        "(default: all)")
    parser.add_argument("--ndims", default=None, help="comma-separated, of 1,2,3 (default: all)")
    parser.add_argument("--index", default=None, help="comma-separated index widths, of 32,64 (default: both)")
    parser.add_argument("--unpack", default=None, metavar="PREFIX",
                        help="extract a packed cache (pieces PREFIX.00, PREFIX.01, ...) into the kernel cache first")
    parser.add_argument("--pack", default=None, metavar="PREFIX",
                        help="write the kernel cache, after building, as pieces PREFIX.00, PREFIX.01, ...")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="a backend module's switch set in every worker before it builds (a Python literal; "
                             "repeatable), e.g. cuda_fused_backward.WS_LOADS_AHEAD=False")
    args = parser.parse_args(argv)
    backends = [name for name in args.backends.split(",") if name]
    unknown = [name for name in backends if name not in BACKENDS]
    if unknown:
        parser.error(f"--backends: unknown {', '.join(unknown)} (known: {', '.join(BACKENDS)})")
    dtypes = ndims = widths = None
    if args.dtypes is not None:
        from stages import DTYPES as known
        names = [name for name in args.dtypes.split(",") if name]
        bad = [name for name in names if name not in known]
        if bad or not names:
            parser.error(f"--dtypes: expected names among {', '.join(known)}, got {args.dtypes!r}")
        dtypes = [np.dtype(known[name]) for name in names]
    if args.ndims is not None:
        try:
            ndims = [int(n) for n in args.ndims.split(",") if n]
        except ValueError:
            ndims = []
        if not ndims or any(n not in (1, 2, 3) for n in ndims):
            parser.error(f"--ndims: expected numbers among 1,2,3, got {args.ndims!r}")
    if args.index is not None:
        try:
            widths = [int(n) for n in args.index.split(",") if n]
        except ValueError:
            widths = []
        if not widths or any(n not in (32, 64) for n in widths):
            parser.error(f"--index: expected widths among 32,64, got {args.index!r}")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    try:
        settings = [parse_setting(text) for text in args.set]
    except ValueError as error:
        parser.error(f"--set: {error}")
    if args.unpack is not None:
        start = time.perf_counter()
        try:
            count = unpack_cache(args.unpack, cache_dir())
        except ValueError as error:
            parser.error(str(error))
        print(f"warm_modules.py: unpacked {count} files from {args.unpack}.NN into {cache_dir()} in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    status = build_all(args, backends, dtypes, ndims, widths, settings)
    if args.pack is not None:
        try:
            pieces = pack_cache(cache_dir(), args.pack)
        except ValueError as error:
            parser.error(str(error))
        size = sum(piece.stat().st_size for piece in pieces)
        print(f"warm_modules.py: packed {cache_dir()} into {len(pieces)} pieces {args.pack}.NN "
              f"({size / 2**20:.1f} MiB)")
    return status


def build_all(args, backends, dtypes, ndims, widths, settings) -> int:
    """Build the modules ``main`` asked for, ``args.jobs`` processes at a time; its exit status."""
    from gpu import no_gpu_reason
    reason = no_gpu_reason()
    if reason is not None:
        print(f"benchmarks/warm_modules.py: {reason}: nothing to compile.")
        return 0
    todo = tasks(backends, dtypes, ndims, widths)
    if not todo:
        print("warm_modules.py: no module of those backends has those keys: nothing to compile.")
        return 0
    start = time.perf_counter()
    failed = 0
    with multiprocessing.get_context("spawn").Pool(min(args.jobs, len(todo)), initializer=apply_settings,
                                                   initargs=(settings,)) as pool:
        for (backend, key), seconds, error in pool.imap_unordered(build, todo):
            if error is not None:
                failed += 1
                print(f"  {backend} {key}: {error}", flush=True)
    switches = "".join(f", {path.rsplit('.', 1)[1]}.{name}={value!r}" for path, name, value in settings)
    print(f"warm_modules.py: {len(todo) - failed} of {len(todo)} modules ({', '.join(backends)}{switches}) in "
          f"{time.perf_counter() - start:.0f} s, {min(args.jobs, len(todo))} processes; "
          f"cache {cache_dir()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
