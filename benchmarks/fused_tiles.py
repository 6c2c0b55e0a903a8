"""Time fused-forward tiles of your choice (TILES and others) on a few shapes, each checked first.

    python benchmarks/fused_tiles.py [--shapes '8,256,56;32,64,56;16,512,14;2,32,32x32x32'] [--dtypes float16,bfloat16,tf32,float32]
        [--tiles 'BM,BN,BK,MINB,ENGINE[,THREADS];...'] [--only-tiles] [--warp-corners] [--budget 190]

Per shape (B, C_in = C_out, spatial size: H for HxW, 32x32x32 in 3D, L4096 in 1D;
a 3^N kernel, padding 1, offsets and mask, DCNv2) and dtype: the float64
reference through a ``cuda/im2col`` plan on the same (rounded) inputs; then per tile (those of
TILES that ``_candidates`` keeps for the shape, then ``--tiles``, each instantiated on demand: a
tile outside TILES gets a module of its own) and step order: the
relative error in the norm against that reference (must be < 3e-3 fp16, 2.4e-2 bf16, 5e-3 tf32,
1e-5 float32, which runs in 3xTF32), the
kernel alone (CuPy events, median of 5 x 10 launches, all candidates timed in two interleaved
rounds, best round kept) and the whole forward (``FusedForward.run``, recorded launches as
plans run them: weight re-layout, channels-last copy, kernel). ``--warp-corners``: the corners
from the sampling warps' batches (``PLAN`` 2) wherever they serve, as the tuner may pick them.
``--budget`` seconds: no new shape is started past it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from dcn_cupy._interop import BFLOAT16  # noqa: E402
from gpu import _device_name, _time_cupy, no_gpu_reason  # noqa: E402

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "tf32": np.dtype(np.float32),
          "float32": np.dtype(np.float32)}
TOL = {"float16": 3e-3, "bfloat16": 2.4e-2, "tf32": 5e-3, "float32": 1e-5}
EXTRA = "128,64,32,2,0;128,64,64,2,0;64,128,32,2,0;64,64,64,2,0;256,64,32,2,0;128,64,64,2,1;128,64,32,2,1;128,64,32,1,0"


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8,256,56;32,64,56;16,512,14")
    parser.add_argument("--dtypes", default="float16")
    parser.add_argument("--tiles", default=EXTRA)
    parser.add_argument("--budget", type=float, default=190.0)
    parser.add_argument("--only-tiles", action="store_true", help="time the --tiles only, not TILES' candidates")
    parser.add_argument("--warp-corners", action="store_true",
                        help="the sampling warps' corner batches (PLAN 2) wherever they serve")
    parser.add_argument("--time-failures", action="store_true",
                        help="time tiles whose results fail the check too (experiment switches)")
    args = parser.parse_args(argv)
    reason = no_gpu_reason()
    if reason is not None:
        print(f"fused_tiles.py: {reason}: nothing to time.")
        return 0
    import cupy
    import dcn_cupy
    from dcn_cupy import _geometry
    from dcn_cupy._backends import cuda_fused as fu
    t0 = time.time()
    extra = [tuple(int(v) for v in tile.split(",")) for tile in args.tiles.split(";") if tile]
    sms, wgmma = fu._multiprocessors(), fu.wgmma_available()
    print(f"device: {_device_name()}, {sms} SMs, wgmma {wgmma}", flush=True)
    for shape in [s for s in args.shapes.split(";") if s]:
        B, C, size = shape.split(",")
        B, C = int(B), int(C)
        dims = tuple(int(v) for v in size.lstrip("L").split("x"))
        spatial = dims if size.startswith("L") or len(dims) > 1 else dims * 2   # "L4096": 1D; "56": 56x56
        n = len(spatial)
        K = 3 ** n
        where = "x".join(map(str, spatial))
        for dname in [d for d in args.dtypes.split(",") if d]:
            if time.time() - t0 > args.budget:
                print(f"budget of {args.budget:.0f} s spent: B={B} C={C} {where} {dname} skipped", flush=True)
                continue
            dtype = DTYPES[dname]
            rng = cupy.random.default_rng(0)
            x = rng.standard_normal((B, C) + spatial, dtype=cupy.float32).astype(dtype)
            w = (rng.standard_normal((C, C) + (3,) * n, dtype=cupy.float32) / (C * K) ** 0.5).astype(dtype)
            off = (rng.standard_normal((B, n * K) + spatial, dtype=cupy.float32) * 2).astype(dtype)
            msk = rng.random((B, K) + spatial, dtype=cupy.float32).astype(dtype)
            f64 = [a.astype(cupy.float64) for a in (x, w, off, msk)]
            ref = dcn_cupy.plan(*f64, padding=1, algorithm="cuda/im2col").forward(*f64)
            geom, _ = _geometry.conv_geometry(x.shape, w.shape, off.shape, msk.shape, None, padding=1)
            flop = 2.0 * C * C * K * B * int(np.prod(spatial))
            tf32 = dname == "tf32"    # float32 through TF32; "float32": 3xTF32
            precision = fu.precision_of(dtype, tf32)
            cands = [] if args.only_tiles else fu._candidates(geom, dtype, wgmma, False, precision)
            limit = max(64, -(-C // 64) * 64)
            tiles = list(cands) + [t for t in extra if t not in cands and t[0] <= limit and (not fu.is_wgmma(t) or wgmma)
                                   and fu.tile_builds(dtype, n, t, precision)]
            out = cupy.empty(geom.y_shape, dtype=dtype)
            named = {"input": x, "weight": w, "offset": off, "mask": msk, "bias": None}
            runs = []   # (label, kernel fn, whole fn: recorded launches, as plans run it)
            for tile in tiles:
                for taps_inner in (0, 1):
                    try:
                        c = fu.LaunchConfig(geom, dtype, tf32, sms, tile=tile, taps_inner=bool(taps_inner),
                                            warp_corners=args.warp_corners)
                        ws = cupy.empty(c.workspace_bytes, dtype=np.uint8)
                        out.fill(np.nan)
                        fu.run_forward(c, x, w, off, msk, None, out, ws)
                        kern = c.kernel("forward")
                    except Exception as error:
                        print(f"  {tile} taps {'in' if taps_inner else 'out'}: {type(error).__name__}: "
                              f"{str(error)[:300]}", flush=True)
                        continue
                    d = out.astype(cupy.float64) - ref
                    err = float(cupy.linalg.norm(d) / cupy.linalg.norm(ref))
                    ok = err < TOL[dname]
                    xcl, wr, plan_rows, plan_weights = fu._views(c, ws)
                    kargs = (xcl, wr, off, msk, None, out, c.struct, np.int32(B), np.int32(C), np.int32(c.Cp),
                             np.int32(C), np.int32(1), np.int32(1), np.int32(1), np.int32(c.Cgp),
                             np.int32(fu._batch_stride(off)), np.int32(fu._batch_stride(msk)), np.int32(taps_inner),
                             plan_rows, plan_weights, np.int32(c.seg_len))
                    label = ("%dx%dx%d minb %d %s" % (tile[:4] + (("mma", "wgmma", "pipe", "wgmma-ws")[tile[4]],))
                             + (f" {c.threads}t" if c.threads != 256 else "")
                             + (" taps in " if taps_inner else " taps out")
                             + (" batches" if c.warp_corners else ""))
                    runs.append(dict(label=label, err=err, ok=ok, regs=fu.num_registers(kern), blocks=c.blocks(B),
                                     kernel=(lambda kern=kern, c=c, kargs=kargs:
                                             kern((c.blocks(B),), (c.threads,), kargs, shared_mem=c.smem_bytes)),
                                     whole=(lambda run=fu.FusedForward(c).run, ws=ws: run(named, out, ws)),
                                     k=float("inf"), f=float("inf")))
            for _ in range(2):    # two interleaved rounds, the best kept
                for r in runs:
                    if r["ok"] or args.time_failures:
                        r["k"] = min(r["k"], _time_cupy(r["kernel"], 3, 5, 10))
                        r["f"] = min(r["f"], _time_cupy(r["whole"], 3, 5, 10))
            print(f"== B={B} C={C}->{C} {where} 3^{n} {dname} (candidates of TILES: {len(cands)}; "
                  f"{time.time() - t0:.0f} s)")
            print("| tile | regs | blocks | rel err | kernel ms | TFLOP/s | whole fwd ms |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            best = min((r["k"] for r in runs if r["ok"]), default=float("inf"))
            for r in sorted(runs, key=lambda r: r["k"]):
                mark = " *" if r["k"] == best else ""
                print(f"| {r['label']}{mark} | {r['regs']} | {r['blocks']} | {r['err']:.2e}{'' if r['ok'] else ' FAIL'}"
                      f" | {r['k']:.4f} | {flop / r['k'] / 1e9:.1f} | {r['f']:.4f} |", flush=True)
            del runs
            cupy.get_default_memory_pool().free_all_blocks()
    print(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
