"""SASS of one kernel instantiation without a GPU: NVRTC compiles it, nvdisasm disassembles it.

    python benchmarks/sass.py NAME [--source deform_fused_backward.cu] [--arch sm_90] \
        [--nvrtc PATH/libnvrtc.so.13] [--nvdisasm PATH/nvdisasm] [--listing FILE] [--top 30]

NAME is a name expression of the module built from ``cuda/SOURCE`` (its local headers inlined, as
the backends build it), e.g. ``"deform_fused_backward_data<__half, int, 2, 0, 64, 64, 64, 2, true,
false, 4, 16>"``. Prints the instruction count and the most frequent opcodes, and with
``--listing`` writes nvdisasm's listing: a first, cheap look at what a change does to a kernel
before device time is spent on it (not a prediction of its time: 72 fewer instructions in the
data kernel measured level, NOTES-gpu.md session 18).

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
    parser.add_argument("name", help="a name expression, e.g. 'fused_channels_last<__half, int>'")
    parser.add_argument("--source", default="deform_fused_backward.cu", help="a file of cuda/")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--nvrtc", default=None, help="path of the libnvrtc to compile with (default: the "
                                                      "nvidia-cuda-nvrtc wheel's)")
    parser.add_argument("--nvdisasm", default=None, help="path of nvdisasm (default: PATH, then site-packages)")
    parser.add_argument("--listing", default=None, help="write nvdisasm's listing to this file")
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
    options = tuple(cuda.compile_options()) + (f"-arch={args.arch}",)
    try:
        listing = disassemble(nvdisasm, compile_cubin(nvrtc, cuda.module_text(args.source), args.name, options))
    except RuntimeError as error:
        print(f"sass.py: {error}", file=sys.stderr)
        return 1
    if args.listing:
        Path(args.listing).write_text(listing)
    counts = opcode_counts(listing)
    print(f"{args.name} ({args.arch}): {sum(counts.values())} instructions")
    print(", ".join(f"{op} {n}" for op, n in counts.most_common(args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
