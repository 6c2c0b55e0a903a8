"""Registers, spills and shared memory of fused-forward tiles, from ptxas (NVRTC, no GPU needed).

    python benchmarks/fused_regs.py [--dtype float16] [--ndim 2] [--arch sm_90] [--strict] \
        [--tiles 'BM,BN,BK,MINB,ENGINE[,THREADS];...'] [--jobs 2] [--defines NAME=VALUE,...]

Compiles each tile's uniform (16-byte-vector) kernel alone with ``--ptxas-options=-v`` and
prints registers per thread, spill stores / loads (bytes), stack frame, the dynamic shared
memory of the tile (``cuda_fused.smem_bytes``) and how many blocks of the tile's threads fit one SM by
registers (64K per SM) and by shared memory (228 KiB per SM, 1 KiB reserved per block).
Default tiles: those of TILES plus MINB=2 candidates (NOTES-gpu.md, fused3).
"""

from __future__ import annotations

import argparse
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_EXTRA = ((128, 64, 32, 2, 0), (128, 64, 64, 2, 0), (256, 64, 32, 2, 0), (256, 64, 64, 2, 0),
                 (64, 128, 32, 2, 0), (128, 128, 32, 2, 0), (64, 64, 64, 2, 0), (64, 64, 32, 2, 0),
                 (128, 64, 32, 1, 0), (256, 64, 32, 1, 0), (128, 64, 64, 2, 1), (128, 64, 32, 2, 1))


def _compile(job):
    name, arch, prefix = job
    from cupy_backends.cuda.libs import nvrtc
    from dcn_cupy._backends import cuda, cuda_fused as fused
    program = nvrtc.createProgram(prefix + fused.module_source(), "deform_fused.cu", (), ())
    try:
        nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, tuple(cuda.compile_options()) + (f"-arch={arch}", "--ptxas-options=-v"))
        except nvrtc.NVRTCError:
            return name, "FAILED\n" + nvrtc.getProgramLog(program)
        return name, nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


def parse(log: str) -> dict:
    out = {}
    for key, pattern in (("regs", r"Used (\d+) registers"), ("stack", r"(\d+) bytes stack frame"),
                         ("spill_st", r"(\d+) bytes spill stores"), ("spill_ld", r"(\d+) bytes spill loads")):
        m = re.findall(pattern, log)
        out[key] = int(m[-1]) if m else None
    return out


def main(argv=None):
    import numpy as np
    from dcn_cupy._interop import BFLOAT16
    from dcn_cupy._backends import cuda_fused as fused
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--ndim", type=int, default=2)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--tiles", default="")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--log", action="store_true", help="print the ptxas log of each kernel")
    parser.add_argument("--defines", default="", help="NAME=VALUE,... prepended as #defines (experiment switches)")
    parser.add_argument("--strict", action="store_true", help="float32 in 3xTF32 (default: TF32)")
    args = parser.parse_args(argv)
    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "float32": np.dtype(np.float32)}[args.dtype]
    tiles = ([tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";") if t] if args.tiles
             else list(fused._tiles(dtype)) + list(DEFAULT_EXTRA))
    prec = fused.precision_of(dtype, not args.strict)
    tiles = [tile for tile in tiles if fused.tile_computes(tile, prec)]
    prefix = "".join(f"#define {d.split('=', 1)[0]} {d.split('=', 1)[1]}\n" for d in args.defines.split(",") if d)
    jobs = []
    for tile in tiles:
        name = fused.kernel_name(dtype, False, args.ndim, prec, tile, True)
        jobs.append((name, "sm_90a" if fused.is_wgmma(tile) else args.arch, prefix))
    with ProcessPoolExecutor(args.jobs) as pool:
        logs = dict(pool.map(_compile, jobs))
    print(f"{args.dtype} {args.ndim}-d, {args.arch}{', 3xTF32' if prec == 2 else ''}")
    print("| tile BMxBNxBK | threads | MINB | engine | regs | spill st/ld B | stack B | smem KiB | blocks/SM (regs, smem) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for tile, (name, _, _) in zip(tiles, jobs):
        log = logs[name]
        if log.startswith("FAILED"):
            print(f"| {tile} | compile failed: {log[:300]!r} |")
            continue
        p = parse(log)
        smem = fused.smem_bytes(dtype, args.ndim, tile, fused.pipeline_depth(dtype, args.ndim, tile, prec), prec)
        regs = p["regs"] or 0
        threads = fused.tile_threads(tile)
        by_regs = 65536 // (((regs + 7) // 8 * 8) * threads) if regs else 0
        by_smem = (228 * 1024) // (smem + 1024)
        bm, bn, bk, minb, engine = tile[:5]
        print(f"| {bm}x{bn}x{bk} | {threads} | {minb} | {('mma', 'wgmma', 'pipe', 'wgmma-ws')[engine]} | {regs} | {p['spill_st']}/{p['spill_ld']}"
              f" | {p['stack']} | {smem / 1024:.1f} | {min(by_regs, by_smem)} ({by_regs}, {by_smem}) |", flush=True)
        if args.log:
            print(log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
