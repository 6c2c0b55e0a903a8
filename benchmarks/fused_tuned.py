"""The tuned fused forward (``plan_config``'s choice, whole forward) with TILES as they are
against TILES without some tiles, same process and card (for NOTES-gpu.md).

    python benchmarks/fused_tuned.py [--without 'BM,BN,BK,MINB,ENGINE;...'] [--dtypes float16,bfloat16]
        [--shapes 0,1,2,3,4] [--warm]

Per shape of ``gpu.py``'s SHAPES (offsets and mask, 3^N kernel, 'same' padding) and dtype: the
tile each set chooses, tuned anew for each ("without": the same modules, the tiles of
``--without`` left out of ``_candidates``), and the whole forward (``FusedForward.run``, the
launches recorded once and replayed as plans run them, median of 7 x 10 calls), the two sets
timed alternately in two rounds, best kept. ``--warm`` first compiles every half-type and
float32 32-bit module (both engines) in parallel processes, filling CuPy's kernel cache (the
GPU tests then load instead of compiling).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from dcn_cupy._interop import BFLOAT16  # noqa: E402
from gpu import SHAPES, _device_name, _time_cupy, no_gpu_reason  # noqa: E402

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}
WITHOUT = "64,128,32,2,0;64,64,64,2,0;128,64,64,2,0"


def _warm(key):
    from dcn_cupy._backends import cuda_fused as fu
    dtype, ndim, index64, engine = key
    names = fu.name_expressions(dtype, ndim, index64, engine)
    fu._function(names[0], dtype, ndim, index64, engine)
    return key


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--without", default=WITHOUT)
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--shapes", default="0,1,2,3,4")
    parser.add_argument("--warm", action="store_true")
    args = parser.parse_args(argv)
    reason = no_gpu_reason()
    if reason is not None:
        print(f"fused_tuned.py: {reason}: nothing to time.")
        return 0
    import time
    import cupy
    from dcn_cupy import _geometry
    from dcn_cupy._backends import cuda_fused as fu
    t0 = time.time()
    if args.warm:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        keys = [k for k in fu.all_module_keys() if not k[2] and k[3] in (0, 1)]
        with ProcessPoolExecutor(16, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_warm, keys))
        print(f"warmed {len(keys)} modules in {time.time() - t0:.0f} s", flush=True)
    drop = {tuple(int(v) for v in t.split(",")) for t in args.without.split(";") if t}
    # "without": the same modules (TILES unchanged), the dropped tiles left out of the candidates
    all_candidates = fu._candidates

    def reduced_candidates(*a, **k):
        tiles = all_candidates(*a, **k)
        return [t for t in tiles if t not in drop] or tiles
    print(f"device: {_device_name()}; without = TILES less {sorted(drop)}")
    print("| shape | dtype | TILES: choice | whole ms | without: choice | whole ms | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for index in (int(v) for v in args.shapes.split(",")):
        sh = SHAPES[index]
        n = len(sh["S"])
        for dname in [d for d in args.dtypes.split(",") if d]:
            dtype = DTYPES[dname]
            rng = cupy.random.default_rng(0)
            K = 3 ** n
            x = rng.standard_normal((sh["B"], sh["C_in"]) + sh["S"], dtype=cupy.float32).astype(dtype)
            w = (rng.standard_normal((sh["C_out"], sh["C_in"]) + (3,) * n, dtype=cupy.float32)
                 / math.sqrt(sh["C_in"] * K)).astype(dtype)
            off = rng.standard_normal((sh["B"], n * K) + sh["S"], dtype=cupy.float32).astype(dtype)
            msk = rng.random((sh["B"], K) + sh["S"], dtype=cupy.float32).astype(dtype)
            geom, _ = _geometry.conv_geometry(x.shape, w.shape, off.shape, msk.shape, None, padding=1)
            out = cupy.empty(geom.y_shape, dtype=dtype)
            runs = []
            for candidates in (all_candidates, reduced_candidates):
                fu._candidates = candidates
                fu._tuned.clear()
                c = fu.plan_config(geom, dtype, False)
                ws = cupy.empty(c.workspace_bytes, dtype=np.uint8)
                runs.append([c, ws, math.inf, fu.FusedForward(c).run])   # recorded launches, as plans run it
            fu._candidates = all_candidates
            named = {"input": x, "weight": w, "offset": off, "mask": msk, "bias": None}
            for _ in range(2):
                for r in runs:
                    ws, run = r[1], r[3]
                    r[2] = min(r[2], _time_cupy(lambda: run(named, out, ws), 3, 7, 10))
            desc = lambda c: "%dx%dx%d m%d %s %dt taps %s" % (c.tile[:4] + (("mma", "wgmma", "pipe", "wgmma-ws")[c.tile[4]],  # noqa: E731
                                                                        c.threads, "in" if c.taps_inner else "out"))
            (a, _, ta, _), (b, _, tb, _) = runs
            print(f"| {sh['name']} | {dname} | {desc(a)} | {ta:.4f} | {desc(b)} | {tb:.4f} | {tb / ta:.2f}x |",
                  flush=True)
            cupy.get_default_memory_pool().free_all_blocks()
    fu._tuned.clear()
    print(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
