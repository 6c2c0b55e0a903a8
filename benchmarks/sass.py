"""SASS of kernel instantiations without a GPU: NVRTC compiles them, nvdisasm disassembles them.

    python benchmarks/sass.py NAME [NAME ...] [--source deform_fused_backward.cu] [--arch sm_90] \
        [--nvrtc PATH/libnvrtc.so.13] [--nvdisasm PATH/nvdisasm] [--listing FILE] [--top 30] \
        [--same-as TREE]

NAME is a name expression of the module built from ``cuda/SOURCE`` (its local headers inlined, as
the backends build it), e.g. ``"deform_fused_backward_data<__half, int, 2, 0, 64, 64, 64, 2, true,
false, 4, 16>"``. Prints each one's instruction count and most frequent opcodes, and with
``--listing`` writes nvdisasm's listings: a first, cheap look at what a change does to a kernel
before device time is spent on it (not a prediction of its time: 72 fewer instructions in the
data kernel measured level, NOTES-gpu.md session 18).

``--same-as TREE`` compiles each NAME also from ``TREE/cuda/SOURCE`` (another checkout, e.g. ``git
worktree add ../old REV``), with this tree's compile options, and says whether the two SASS
listings are the same instruction for instruction (exit status 1 where any differs): a change
that leaves every instantiation's SASS as it was runs the machine code an earlier GPU run tested
(NOTES-gpu.md session 24, where a rewritten address expression changed a kernel it was not meant
to touch).

NVRTC is called through ctypes (``--nvrtc``: by default the ``nvidia-cuda-nvrtc`` wheel's
libnvrtc, the one CuPy compiles with here), nvdisasm found on PATH or in the
``nvidia-cuda-nvdisasm`` wheel (``pip install nvidia-cuda-nvdisasm``; 13.5 reads NVRTC 13.0's and
13.5's cubins). CuPy's own ``nvrtc.getCUBIN`` binding gave cubins that nvdisasm rejected ("invalid
ELF file"), hence ctypes. The device machine's ``cuobjdump -sass`` of a kernel built there stays
the reference for what runs.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: One instruction line of nvdisasm's listing: address comment, optional predicate, opcode.
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def opcode_counts(listing: str) -> collections.Counter:
    """Opcodes (without their modifiers) of an nvdisasm listing, counted."""
    counts = collections.Counter()
    for line in listing.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            counts[match.group(1)] += 1
    return counts


def instructions(listing: str) -> list:
    """The instruction lines of an nvdisasm listing, without their address comments: what two
    builds of one kernel are compared by."""
    return [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip() for line in listing.splitlines()
            if _INSTRUCTION.match(line)]


def _check(lib, status: int, program, what: str) -> None:
    if status == 0:
        return
    log = ""
    if program is not None:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, buf)
        log = buf.value.decode(errors="replace")[-4000:]
    raise RuntimeError(f"{what} failed with NVRTC status {status}\n{log}")


def compile_cubin(nvrtc_path: str, source: str, name: str, options) -> bytes:
    """The cubin of ``name`` (a name expression of ``source``), compiled by the libnvrtc at
    ``nvrtc_path`` (through ctypes: any NVRTC, not only CuPy's) with ``options``."""
    lib = ctypes.CDLL(nvrtc_path)
    program = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"module.cu", 0, None, None), None,
           "nvrtcCreateProgram")
    try:
        _check(lib, lib.nvrtcAddNameExpression(program, name.encode()), program, "nvrtcAddNameExpression")
        encoded = [o.encode() for o in options]
        _check(lib, lib.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded)),
               program, f"compiling {name}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), program, "nvrtcGetCUBINSize")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(program, buf), program, "nvrtcGetCUBIN")
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def disassemble(nvdisasm: str, cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "module.cubin"
        path.write_bytes(cubin)
        done = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvdisasm failed: {done.stderr.strip()} (does it read this NVRTC's cubins? see --help)")
    return done.stdout


def _in_site_packages(*parts):
    """The first ``nvidia/cu13/...`` file of that name on sys.path (the CUDA wheels' layout)."""
    for folder in map(Path, sys.path):
        candidate = folder.joinpath("nvidia", "cu13", *parts)
        if candidate.is_file():
            return str(candidate)
    return None


def _default_nvdisasm():
    return shutil.which("nvdisasm") or _in_site_packages("bin", "nvdisasm")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", metavar="NAME",
                        help="a name expression, e.g. 'fused_channels_last<__half, int>'")
    parser.add_argument("--source", default="deform_fused_backward.cu", help="a file of cuda/")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--nvrtc", default=None, help="path of the libnvrtc to compile with (default: the "
                                                      "nvidia-cuda-nvrtc wheel's)")
    parser.add_argument("--nvdisasm", default=None, help="path of nvdisasm (default: PATH, then site-packages)")
    parser.add_argument("--listing", default=None, help="write nvdisasm's listings to this file")
    parser.add_argument("--same-as", default=None, metavar="TREE",
                        help="compare each kernel's SASS with its build from TREE/cuda (another checkout)")
    parser.add_argument("--top", type=int, default=30, help="opcodes to print")
    args = parser.parse_args(argv)
    from dcn_cupy._backends import cuda
    nvdisasm = args.nvdisasm or _default_nvdisasm()
    if nvdisasm is None:
        parser.error("no nvdisasm found: pip install nvidia-cuda-nvdisasm, or pass --nvdisasm")
    nvrtc = args.nvrtc or _in_site_packages("lib", "libnvrtc.so.13")
    if nvrtc is None or not Path(nvrtc).is_file():
        parser.error(f"--nvrtc: no libnvrtc at {nvrtc} (pip install nvidia-cuda-nvrtc, or pass its path)")
    if not (cuda.cuda_source_dir() / args.source).is_file():
        parser.error(f"--source: no cuda/{args.source}")
    other = None
    if args.same_as is not None:
        folder = Path(args.same_as) / "cuda"
        if not (folder / args.source).is_file():
            parser.error(f"--same-as: no {folder / args.source}")
        other = cuda.source_text(args.source, folder)
    options = tuple(cuda.compile_options()) + (f"-arch={args.arch}",)
    listings, differ = [], 0
    for name in args.names:
        try:
            listing = disassemble(nvdisasm, compile_cubin(nvrtc, cuda.module_text(args.source), name, options))
            theirs = None if other is None else disassemble(nvdisasm, compile_cubin(nvrtc, other, name, options))
        except RuntimeError as error:
            print(f"sass.py: {error}", file=sys.stderr)
            return 1
        listings.append(listing)
        counts = opcode_counts(listing)
        print(f"{name} ({args.arch}): {sum(counts.values())} instructions")
        if theirs is None:
            print(", ".join(f"{op} {n}" for op, n in counts.most_common(args.top)))
        elif instructions(listing) == instructions(theirs):
            print(f"  the same SASS as {args.same_as}'s")
        else:
            differ += 1
            print(f"  differs from {args.same_as}'s ({len(instructions(theirs))} instructions there)")
    if args.listing:
        Path(args.listing).write_text("\n".join(listings))
    if other is not None:
        print(f"{len(args.names) - differ} of {len(args.names)} the same as {args.same_as}'s")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
