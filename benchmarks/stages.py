"""Time the CUDA backend's stages separately (for NOTES-gpu.md).

    python benchmarks/stages.py [--shape 8,256,56] [--dtypes float16,float32] [--ndim 2]

Prints, per dtype: the forward, the one-pass backward (all gradients), the backward to the
input and to the parameters as separate calls, and the time of each stage (im2col, GEMMs,
layout kernel, tiled col2im, grouped offset/mask-gradient kernel) alone; then the fused
forward ("cuda/fused", ``--fused`` alone skips the rest): the whole forward, its channels-last
copy, its weight re-layout and the fused kernel alone for each tile height, with TFLOP/s
(2 * C_out * C_in * K * B * Q over the time).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

from dcn_cupy import _geometry  # noqa: E402
from dcn_cupy._backends import cuda as be  # noqa: E402
from dcn_cupy._interop import BFLOAT16  # noqa: E402
from gpu import _time_cupy  # noqa: E402

DTYPES = {"float16": np.float16, "bfloat16": BFLOAT16, "float32": np.float32, "float64": np.float64}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="8,256,56", help="B,C,H (C_in = C_out, HxW, 3x3, padding 1)")
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--ndim", type=int, default=2)
    parser.add_argument("--fused", action="store_true", help="only the fused forward's stages")
    parser.add_argument("--tiles", default="", help="extra fused tiles to time, 'BM,BN,BK,MINB;...'")
    args = parser.parse_args(argv)
    B, C, H = (int(v) for v in args.shape.split(","))
    n = args.ndim
    K = 3 ** n
    rng = cupy.random.default_rng(0)
    t = lambda f, inner=10: _time_cupy(f, 2, 5, inner)  # noqa: E731
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        x = rng.standard_normal((B, C) + (H,) * n, dtype=cupy.float32).astype(dtype)
        w = (rng.standard_normal((C, C) + (3,) * n, dtype=cupy.float32) / (C * K) ** 0.5).astype(dtype)
        off = rng.standard_normal((B, n * K) + (H,) * n, dtype=cupy.float32).astype(dtype)
        msk = rng.random((B, K) + (H,) * n, dtype=cupy.float32).astype(dtype)
        gy = rng.standard_normal((B, C) + (H,) * n, dtype=cupy.float32).astype(dtype)
        geom, _ = _geometry.conv_geometry(x.shape, w.shape, off.shape, msk.shape, None, padding=1)
        extra = [tuple(int(v) for v in tile.split(",")) for tile in args.tiles.split(";") if tile]
        extra = [tile for tile in extra if tile[2] % (16 if np.dtype(dtype) == np.float32 else 32) == 0]
        if args.fused:
            fused_stages(x, w, off, msk, geom, name, t, extra)
            continue
        print(f"== {name}: B={B} C={C}->{C} {'x'.join([str(H)] * n)} 3^{n}, offset+mask, "
              f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
        fwd = t(lambda: be.conv_forward(x, w, off, msk, None, geom))
        bwd = t(lambda: be.conv_backward(gy, x, w, off, msk, geom), 4)
        print(f"  forward {fwd:.3f} ms | one-pass backward (all gradients) {bwd:.3f} ms", flush=True)
        bi = t(lambda: be.conv_backward(gy, None, w, off, msk, geom, True, False, False, False), 4)
        bp = t(lambda: be.conv_backward(gy, x, w, off, msk, geom, False, True, True, True), 4)
        print(f"  separate calls: backward to input {bi:.3f} ms + backward to parameters {bp:.3f} ms")
        # stages alone
        sh = be._Shape(geom, x.dtype)
        kern = sh.kernels(B)
        cols = cupy.empty((1, C * K, B * H ** n), dtype=dtype)
        outb = cupy.empty((1, C, B * H ** n), dtype=sh.acc)
        # random operands: zeros would skip the scatter's atomics (and time nothing)
        cg = rng.standard_normal((1, C * K, B * H ** n), dtype=cupy.float32).astype(sh.acc)
        gyc = rng.standard_normal((1, C, B * H ** n), dtype=cupy.float32).astype(dtype)
        gw = cupy.zeros((1, C, C * K), dtype=sh.acc)
        gx = cupy.zeros(x.shape, dtype=sh.acc)
        goff, gm = cupy.empty_like(off), cupy.empty_like(msk)
        wr = w.reshape(1, C, C * K)
        stages = {}
        stages["im2col"] = t(lambda: sh.im2col(kern, x, off, msk, cols, B))
        stages["col2im (tiled)"] = t(lambda: sh.col2im(kern, cg, off, msk, gx, B))
        stages["gemm forward W@cols"] = t(lambda: be._gemm(wr, cols, outb))
        stages["gemm W^T@gy"] = t(lambda: be._gemm(wr, gyc, cg, trans_a=True))
        stages["gemm gy@cols^T"] = t(lambda: be._gemm(gyc, cols, gw, trans_b=True, beta=1.0))
        stages["batch_to_columns"] = t(lambda: sh.to_columns(kern, gy, gyc, B))
        stages["grouped (offset+mask)"] = t(lambda: sh.grouped(kern, (True, True), 1, cg, x, off, msk, goff, gm, B))
        for k, v in stages.items():
            print(f"  {k:<32} {v:8.3f} ms")
        if np.dtype(dtype) != np.float64:
            fused_stages(x, w, off, msk, geom, name, t, extra)
        cupy.get_default_memory_pool().free_all_blocks()


def fused_stages(x, w, off, msk, geom, name, t, extra_tiles=()):
    """Time the fused forward and its kernels alone: every precision of the dtype, every tile
    of TILES (and ``extra_tiles``), with TFLOP/s."""
    from dcn_cupy._backends import cuda_fused as fu
    flop = 2.0 * geom.out_channels * geom.in_channels_per_group * geom.kernel_volume * geom.batch * geom.output_size
    out = cupy.empty(geom.y_shape, dtype=x.dtype)
    print(f"== fused forward, {name}: x {x.shape}, w {w.shape}, "
          f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    tf32_modes = (True, False) if np.dtype(x.dtype) == np.float32 else (False,)
    sms = fu._multiprocessors()
    for allow_tf32 in tf32_modes:
        config = fu.LaunchConfig(geom, x.dtype, allow_tf32, sms, wgmma=fu.wgmma_available())
        ws = cupy.empty(config.workspace_bytes, dtype=np.uint8)
        print(f"  chosen: {config.description}")
        total = t(lambda: fu.run_forward(config, x, w, off, msk, None, out, ws))
        print(f"  {'fused forward (all of it)':<40} {total:8.3f} ms  {flop / total / 1e9:7.1f} TFLOP/s", flush=True)
        index = np.int64 if config.index64 else np.int32
        xcl, _ = fu._views(config, ws)
        n = geom.batch
        layout = config.kernel("fused_channels_last")
        blocks = n * -(-config.Cp // 64) * -(-config.S // 64)
        cl = t(lambda: layout((min(blocks, fu._MAX_GRID),), (32, 8), (
            x, xcl, np.int32(n), np.int32(geom.in_channels), np.int32(config.Cp), index(config.S),
            index(fu._batch_stride(x)))))
        print(f"  {'channels-last copy of x':<40} {cl:8.3f} ms")
        struct = be._geom_struct(geom)
        for tile in tuple(fu._tiles(x.dtype)) + tuple(extra_tiles):
            if tile[4] == 1 and (not allow_tf32 and np.dtype(x.dtype) == np.float32 or not fu.wgmma_available()):
                continue
            c = fu.LaunchConfig(geom, x.dtype, allow_tf32, sms, tile=tile)
            wsc = cupy.empty(c.workspace_bytes, dtype=np.uint8)
            fu.run_forward(c, x, w, off, msk, None, out, wsc)   # fills the channels-last copy and weight rows
            xcl, wr = fu._views(c, wsc)
            rows = c.kernel("fused_weight_rows")
            if tile == tuple(fu._tiles(x.dtype))[0]:
                wt = t(lambda: rows((min(-(-geom.out_channels * c.Cgp // 256), fu._MAX_GRID),), (256,), (
                    w, wr, np.int32(geom.out_channels), np.int32(c.Cg), np.int32(c.Cgp), np.int32(c.K),
                    np.int32(c.precision == 1))))
                print(f"  {'weight re-layout':<40} {wt:8.3f} ms")
            try:
                kern = c.kernel("forward")
            except Exception as error:
                print(f"  tile {tile}: {type(error).__name__}: {str(error)[:200]}")
                continue
            for taps_inner in (1, 0):
                args = (xcl, wr, off, msk, None, out, struct, np.int32(n), np.int32(geom.in_channels),
                        np.int32(c.Cp), np.int32(geom.out_channels), np.int32(geom.groups), np.int32(1),
                        np.int32(1), np.int32(c.Cgp), index(fu._batch_stride(off)), index(fu._batch_stride(msk)),
                        np.int32(taps_inner))
                k = t(lambda: kern((c.blocks(n),), (256,), args, shared_mem=c.smem_bytes))
                label = "kernel alone, tile %dx%dx%d minb %d eng %d" % tile + (" taps in" if taps_inner else " taps out")
                print(f"  {label:<48} {k:8.3f} ms  {flop / k / 1e9:7.1f} TFLOP/s "
                      f"({c.blocks(n)} blocks, {fu.num_registers(kern)} regs, {'vector' if c.uniform else 'per-channel'})",
                      flush=True)


if __name__ == "__main__":
    main()
