"""Time the CUDA algorithms whole, through plans, and the stages of their executables alone (for NOTES-gpu.md).

    python benchmarks/stages.py [--shape 8,256,56] [--dtypes float16,float32] [--ndim 2] [--tf32] [--fused]
                                [--fused-backward] [--sampling-plan auto|on|off] [--columns auto|on|off]
                                [--deterministic]

Prints, per dtype: for each distinct plan (``dcn_cupy.plan`` with the automatic choice, which
takes cuda/fused for float16/bfloat16; forced ``algorithm="cuda/im2col"`` and
``"cuda/fused"``; ``deterministic=True``), with ``out=`` and ``workspace=`` given so that no
allocation is timed: the forward, the one-pass backward (all gradients), and the backward to
the input and to the parameters as separate calls. Then each stage of the cuda/im2col
executables alone, summed over the executable's chunks as a call runs them (im2col, GEMMs,
layout kernel, batch_to_columns, tiled col2im, grouped offset/mask-gradient kernel); then the
fused forward ("cuda/fused", ``--fused`` alone skips the rest): the whole forward, its
channels-last copy, its weight re-layout and the fused kernel alone for each tile height, with
TFLOP/s (2 * C_out * C_in * K * B * Q over the time); then the fused backward
("cuda/fused-backward", ``--fused-backward`` alone skips the rest): whole, its parts, its two
kernels alone and the weight gradient's sampling plan (``--sampling-plan on|off`` forces it;
``--deterministic``: its deterministic configuration, against cuda/im2col-deterministic).
TF32 GEMMs only with ``--tf32``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from dcn_cupy._interop import BFLOAT16  # noqa: E402
from gpu import _device_name, _time_cupy, no_gpu_reason  # noqa: E402

DTYPES = {"float16": np.float16, "bfloat16": BFLOAT16, "float32": np.float32, "float64": np.float64}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="8,256,56", help="B,C,H (C_in = C_out, HxW, 3x3, padding 1)")
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--ndim", type=int, default=2)
    parser.add_argument("--tf32", action="store_true", help="float32 GEMMs in TF32 (default: strict float32)")
    parser.add_argument("--fused", action="store_true", help="only the fused forward's stages")
    parser.add_argument("--fused-backward", action="store_true", help="only the fused backward's stages")
    parser.add_argument("--tiles", default="", help="extra fused tiles to time, 'BM,BN,BK,MINB,ENGINE;...'")
    parser.add_argument("--sampling-plan", choices=("auto", "on", "off"), default="auto",
                        help="the fused weight gradient's corners from a sampling plan: the rule, forced on or off")
    parser.add_argument("--columns", choices=("auto", "on", "off"), default="auto",
                        help="cuda/im2col's channels-last column sampler forced on or off (CHANNELS_LAST_COLUMNS)")
    parser.add_argument("--deterministic", action="store_true",
                        help="the fused backward's deterministic configuration (fixed-point scatter)")
    args = parser.parse_args(argv)
    B, C, H = (int(v) for v in args.shape.split(","))
    names = [name for name in args.dtypes.split(",") if name]
    unknown = [name for name in names if name not in DTYPES]
    if unknown:
        parser.error(f"--dtypes must name some of {sorted(DTYPES)}, got {unknown}")
    reason = no_gpu_reason()
    if reason is not None:
        print(f"stages.py: {reason}: nothing to time.")
        return 0
    import cupy
    from dcn_cupy import _geometry
    if args.columns != "auto":
        from dcn_cupy._backends import cuda
        cuda.CHANNELS_LAST_COLUMNS = args.columns == "on"
    if args.sampling_plan != "auto":
        from dcn_cupy._backends import cuda_fused_backward
        cuda_fused_backward.SAMPLING_PLAN = args.sampling_plan == "on"
    n = args.ndim
    K = 3 ** n
    rng = cupy.random.default_rng(0)
    t = lambda f, inner=10: _time_cupy(f, 2, 5, inner)  # noqa: E731
    device = _device_name()
    for name in names:
        dtype = DTYPES[name]
        x = rng.standard_normal((B, C) + (H,) * n, dtype=cupy.float32).astype(dtype)
        w = (rng.standard_normal((C, C) + (3,) * n, dtype=cupy.float32) / (C * K) ** 0.5).astype(dtype)
        off = rng.standard_normal((B, n * K) + (H,) * n, dtype=cupy.float32).astype(dtype)
        msk = rng.random((B, K) + (H,) * n, dtype=cupy.float32).astype(dtype)
        gy = rng.standard_normal((B, C) + (H,) * n, dtype=cupy.float32).astype(dtype)
        geom, _ = _geometry.conv_geometry(x.shape, w.shape, off.shape, msk.shape, None, padding=1)
        extra = [tuple(int(v) for v in tile.split(",")) for tile in args.tiles.split(";") if tile]
        extra = [tile for tile in extra if tile[2] % (16 if np.dtype(dtype) == np.float32 else 32) == 0]
        if args.fused or args.fused_backward:
            if np.dtype(dtype) != np.float64:
                if args.fused:
                    fused_stages(x, w, off, msk, geom, name, t, extra)
                if args.fused_backward:
                    fused_backward_stages(x, w, off, msk, gy, geom, name, t, args.deterministic)
            continue
        print(f"== {name}: B={B} C={C}->{C} {'x'.join([str(H)] * n)} 3^{n}, offset+mask, "
              f"{'TF32' if args.tf32 and np.dtype(dtype) == np.float32 else 'no TF32'}, {device}", flush=True)
        plan_timings(x, w, off, msk, gy, t, args.tf32)
        im2col_stages(x, w, off, msk, gy, geom, t, args.tf32)
        if np.dtype(dtype) != np.float64:
            fused_stages(x, w, off, msk, geom, name, t, extra)
            fused_backward_stages(x, w, off, msk, gy, geom, name, t, args.deterministic)
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


def plan_timings(x, w, off, msk, gy, t, allow_tf32):
    """Forward and backward of every distinct plan of the configuration (automatic choice,
    forced cuda/im2col and cuda/fused, deterministic), caller's out= and workspace=."""
    import cupy
    import dcn_cupy
    variants = [("automatic", {}), ("forced cuda/im2col", {"algorithm": "cuda/im2col"}),
                ("forced cuda/fused", {"algorithm": "cuda/fused"}),
                ("forced cuda/fused-backward", {"algorithm": "cuda/fused-backward"}),
                ("deterministic", {"deterministic": True})]
    params = ("weight", "offset", "mask")
    grads = {"input": cupy.empty_like(x), "weight": cupy.empty_like(w), "offset": cupy.empty_like(off),
             "mask": cupy.empty_like(msk)}
    seen = set()
    for label, options in variants:
        try:
            p = dcn_cupy.plan(x, w, off, msk, padding=1, allow_tf32=bool(allow_tf32), **options)
        except ValueError as error:   # e.g. cuda/fused for float64, or a device below sm_80
            print(f"  {label}: not available: {error}")
            continue
        if p.algorithm in seen:
            continue
        seen.add(p.algorithm)
        ws = cupy.empty(p.workspace_bytes, dtype=cupy.uint8)
        y = cupy.empty(p.output_shape, dtype=x.dtype)
        fwd = t(lambda: p.forward(x, w, off, msk, out=y, workspace=ws))
        bwd = t(lambda: p.backward(gy, x, w, off, msk, out=grads, workspace=ws), 4)
        bi = t(lambda: p.backward(gy, None, w, off, msk, wrt=("input",), out={"input": grads["input"]},
                                  workspace=ws), 4)
        bp = t(lambda: p.backward(gy, x, w, off, msk, wrt=params, out={k: grads[k] for k in params},
                                  workspace=ws), 4)
        print(f"  plan, {label} ({p.algorithm}; workspace {p.workspace_bytes / 2**20:.1f} MiB):")
        print(f"    forward {fwd:.3f} ms | one-pass backward (all gradients) {bwd:.3f} ms | separate calls: "
              f"backward to input {bi:.3f} ms + backward to parameters {bp:.3f} ms", flush=True)


def im2col_stages(x, w, off, msk, gy, geom, t, allow_tf32):
    """Each stage of the cuda/im2col executables alone, over all of their chunks."""
    import cupy
    from dcn_cupy._backends import PlanSpec
    from dcn_cupy._backends import cuda as be
    spec = PlanSpec(geom, np.dtype(x.dtype), "cuda", cupy.cuda.runtime.getDevice(), False,
                    bool(allow_tf32) and np.dtype(x.dtype) == np.float32)
    fx = be.BACKEND.build(spec, "conv_forward")
    bx = be.BACKEND.build(spec, "conv_backward")
    print(f"  stages alone: {fx.description}\n                {bx.description}")
    if fx.rows is not None or bx.rows is not None:
        print("  (chunks of rows within a sample: stage timings skipped; raise DCN_CUPY_CUDA_WORKSPACE_BYTES)")
        return
    rng = cupy.random.default_rng(1)
    G, C, Co, K, Cg, Cog = fx.G, fx.C, fx.Co, fx.K, fx.Cg, fx.Cog
    flop = 2.0 * Co * Cg * K * geom.batch * geom.output_size
    half = bx.acc != bx.dtype
    y = cupy.empty(geom.y_shape, dtype=x.dtype)
    gx = cupy.zeros(geom.x_shape, dtype=x.dtype)
    gw = cupy.zeros(w.shape, dtype=x.dtype)
    goff, gm = cupy.empty_like(off), cupy.empty_like(msk)
    fws = cupy.empty(fx.workspace_bytes, dtype=cupy.uint8)
    bws = cupy.empty(bx.workspace_bytes, dtype=cupy.uint8)
    # per chunk: the operands a call hands the kernels (views of the workspaces, sample slices)
    fwd_chunks, bwd_chunks = [], []
    for c in fx.chunks:
        q = c.n * c.Q
        fwd_chunks.append((c, q, fx._samples(x, c.start, c.stop), fx._samples(off, c.start, c.stop),
                           fx._samples(msk, c.start, c.stop), fx.layout.view(fws, "cols", (G, Cg * K, q)),
                           fx.layout.view(fws, "gemm", (G, Cog, q)), y[c.start:c.stop]))
    # (the half types' float32 accumulator, where the weight GEMM does not write the gradient itself)
    w_acc = (gw.reshape(G, Cog, Cg * K) if bx.weight_in_one_gemm or not half
             else bx.layout.view(bws, "grad_w", (G, Cog, Cg * K)))
    for c in bx.chunks:
        q = c.n * c.Q
        cgrad = bx.layout.view(bws, "cgrad", (G, Cg * K, q))
        # random column gradients: zeros would skip the scatter's atomics (and time nothing)
        cgrad[...] = rng.standard_normal(cgrad.shape, dtype=cupy.float32)
        target = bx.layout.view(bws, "grad_x", (c.n, C, bx.S)) if half else gx[c.start:c.stop]
        bwd_chunks.append((c, q, bx._samples(x, c.start, c.stop), bx._samples(off, c.start, c.stop),
                           bx._samples(msk, c.start, c.stop), bx._samples(gy, c.start, c.stop),
                           bx.layout.view(bws, "gy", (G, Cog, q)), bx.layout.view(bws, "cols", (G, Cg * K, q)),
                           cgrad, target, goff[c.start:c.stop], gm[c.start:c.stop]))

    def f_im2col():
        for c, q, xs, os_, ms, cols, _, _ in fwd_chunks:
            fx._sample_columns(fws, c, xs, os_, ms, cols)

    def f_gemm():
        handle = fx._cublas(fws)
        for c, q, _, _, _, cols, gout, _ in fwd_chunks:
            fx.gemms[q](handle, w.data.ptr, cols.data.ptr, gout.data.ptr)

    def f_layout():
        for c, q, _, _, _, _, gout, ys in fwd_chunks:
            fx._launch(c.kernels["to_batch"], Co * q, (gout, None, ys, c.i_n, fx.i_Co, c.i_q))

    def b_to_columns():
        for c, q, _, _, _, gys, gyc, *_ in bwd_chunks:
            bx._launch(c.kernels["to_columns"], Co * q, (gys, gyc, c.i_n, bx.i_Co, c.i_q))

    def b_im2col():
        for c, q, xs, os_, ms, _, _, cols, *_ in bwd_chunks:
            bx._sample_columns(bws, c, xs, os_, ms, cols)

    def b_gemm_weight():
        handle = bx._cublas(bws)
        for c, q, _, _, _, _, gyc, cols, *_ in bwd_chunks:   # (split along the positions: bx.gemm_splits)
            for _, gemm, a, b, out in bx._weight_gemm_ops(q, gyc.data.ptr, cols.data.ptr, w_acc.data.ptr,
                                                          bws.data.ptr):
                gemm(handle, a, b, out)

    def b_gemm_cgrad():
        handle = bx._cublas(bws)
        for c, q, _, _, _, _, gyc, _, cgrad, *_ in bwd_chunks:
            bx.gemms[q][1](handle, w.data.ptr, gyc.data.ptr, cgrad.data.ptr)

    def b_col2im():
        for c, q, _, os_, ms, _, _, _, cgrad, target, _, _ in bwd_chunks:
            blocks = -(-c.Q // be._TILE) * C * c.n
            c.kernels["col2im"]((min(blocks, be._MAX_GRID),), (be._TILE,), (
                cgrad, os_, ms, target, c.struct, c.i_n, bx.i_C, bx.i_Go, bx.i_Gm, np.int32(bx.halo),
                np.int32(c.cap)), shared_mem=c.cap * bx.acc.itemsize)

    def b_grouped():
        for c, q, xs, os_, ms, _, _, _, cgrad, _, go, g_m in bwd_chunks:
            bx._offset_mask(c.kernels, c, True, True, cgrad, xs, os_, ms, go, g_m)

    b_to_columns()
    b_im2col()    # the columns the weight GEMM reads
    stages = {
        f"forward: im2col{' (channels-last copy + fused_columns)' if fx.channels_last else ''}": t(f_im2col),
        "forward: gemm W@cols": t(f_gemm),
        "forward: layout (columns_to_batch)": t(f_layout),
        "backward: batch_to_columns": t(b_to_columns),
        f"backward: im2col{' (channels-last copy + fused_columns)' if bx.channels_last else ''}": t(b_im2col),
        "backward: gemm gy@cols^T (weight)": t(b_gemm_weight),
        "backward: gemm W^T@gy (column grads)": t(b_gemm_cgrad),
        "backward: col2im (tiled)": t(b_col2im),
        "backward: grouped (offset+mask)": t(b_grouped),
    }
    for label, ms in stages.items():
        rate = f"  {flop / ms / 1e9:7.1f} TFLOP/s" if "gemm" in label else ""
        print(f"  {label:<40} {ms:8.3f} ms{rate}")
    print(f"  ({len(fx.chunks)} forward / {len(bx.chunks)} backward chunk(s), each stage summed over them)",
          flush=True)


def fused_stages(x, w, off, msk, geom, name, t, extra_tiles=()):
    """Time the fused forward and its kernels alone: every precision of the dtype, every tile
    of TILES (and ``extra_tiles``), with TFLOP/s."""
    import cupy
    from dcn_cupy._backends import cuda as be
    from dcn_cupy._backends import cuda_fused as fu
    flop = 2.0 * geom.out_channels * geom.in_channels_per_group * geom.kernel_volume * geom.batch * geom.output_size
    out = cupy.empty(geom.y_shape, dtype=x.dtype)
    print(f"== fused forward, {name}: x {x.shape}, w {w.shape}, {_device_name()}")
    tf32_modes = (True, False) if np.dtype(x.dtype) == np.float32 else (False,)
    sms = fu._multiprocessors()
    for allow_tf32 in tf32_modes:
        config = fu.plan_config(geom, x.dtype, allow_tf32)   # what a plan's cuda/fused forward runs
        ws = cupy.empty(config.workspace_bytes, dtype=np.uint8)
        print(f"  chosen for plans: {config.description}")
        named = {"input": x, "weight": w, "offset": off, "mask": msk, "bias": None}
        run = fu.FusedForward(config).run   # as plans run it: launches recorded once, replayed
        total = t(lambda: run(named, out, ws))
        print(f"  {'fused forward (all of it)':<40} {total:8.3f} ms  {flop / total / 1e9:7.1f} TFLOP/s", flush=True)
        if config.chunk < geom.batch:   # the copies below hold the whole batch
            print(f"  (the channels-last copy goes in chunks of {config.chunk} samples: kernel-alone timings "
                  f"skipped; raise DCN_CUPY_FUSED_WORKSPACE_BYTES)")
            continue
        index = np.int64 if config.index64 else np.int32
        xcl = fu._views(config, ws)[0]
        n = geom.batch
        copy = fu.copy_kernel(x.dtype, config.S, config.Cp, fu._batch_stride(x), (x.data.ptr, xcl.data.ptr))
        layout = config.kernel(copy)
        cl = t(lambda: layout(fu.layout_grid(n, config.Cp, config.S), (256,), (
            x, xcl, np.int32(n), np.int32(geom.in_channels), np.int32(config.Cp), index(config.S),
            index(fu._batch_stride(x)), None, None, index(0), np.int32(0))))
        print(f"  {'channels-last copy of x':<40} {cl:8.3f} ms  ({copy})")
        struct = be._geom_struct(geom)
        relayouts = set()
        for tile in tuple(fu._tiles(x.dtype)) + tuple(extra_tiles):
            if fu.is_wgmma(tile) and not fu.wgmma_available() or not fu.tile_builds(
                    x.dtype, geom.ndim, tile, fu.precision_of(x.dtype, allow_tf32)):
                continue
            if not fu.tile_serves(geom, x.dtype, tile):
                continue
            c = fu.LaunchConfig(geom, x.dtype, allow_tf32, sms, tile=tile)
            wsc = cupy.empty(c.workspace_bytes, dtype=np.uint8)
            fu.run_forward(c, x, w, off, msk, None, out, wsc)   # fills the channels-last copy and weight rows
            xcl, wr, plan_rows, plan_weights = fu._views(c, wsc)
            if c.weight_kernel not in relayouts:   # once per re-layout kernel
                relayouts.add(c.weight_kernel)
                relayout = [fu._relayout_launch(c, w.data.ptr, wr.data.ptr)]   # recorded once, replayed
                wt = t(lambda: be._replay(relayout, None, cupy.cuda.get_current_stream().ptr))
                print(f"  {'weight re-layout (' + c.weight_kernel + ')':<40} {wt:8.3f} ms")
            try:
                kern = c.kernel("forward")
            except Exception as error:
                print(f"  tile {tile}: {type(error).__name__}: {str(error)[:200]}")
                continue
            for taps_inner in (1, 0):
                args = (xcl, wr, off, msk, None, out, struct, np.int32(n), np.int32(geom.in_channels),
                        np.int32(c.Cp), np.int32(geom.out_channels), np.int32(geom.groups), np.int32(1),
                        np.int32(1), np.int32(c.Cgp), index(fu._batch_stride(off)), index(fu._batch_stride(msk)),
                        np.int32(taps_inner), plan_rows, plan_weights, np.int32(c.seg_len))
                grid = c.grid(n, kern)   # (persistent where the rule takes them: fewer blocks than tiles)
                k = t(lambda: kern((grid,), (c.threads,), args, shared_mem=c.smem_bytes))
                label = ("kernel alone, tile %dx%dx%d minb %d eng %d" % tile[:5] + f" {c.threads}t"
                         + (" taps in" if taps_inner else " taps out"))
                print(f"  {label:<48} {k:8.3f} ms  {flop / k / 1e9:7.1f} TFLOP/s "
                      f"({grid} blocks{' persistent' if c.persistent else ''}, {fu.num_registers(kern)} regs, "
                      f"{'vector' if c.uniform else 'per-channel'})", flush=True)


def fused_backward_stages(x, w, off, msk, gy, geom, name, t, deterministic=False):
    """Time the fused backward (cuda/fused-backward) whole, with its own weight gradient and with
    cuda/im2col's, then its parts as calls (each with its layout copies: the input gradient
    alone, the offset and mask gradients, the weight gradient) and its two kernels alone, every
    precision of the dtype, with TFLOP/s of each GEMM's work (2 * C_out * C_in/G * K * B * Q).
    ``deterministic``: its deterministic configuration, cuda/im2col-deterministic's backward
    beside it."""
    import cupy
    from dcn_cupy._backends import PlanSpec, cuda as be, cuda_deterministic, cuda_fused_backward as fb
    flop = 2.0 * geom.out_channels * geom.in_channels_per_group * geom.kernel_volume * geom.batch * geom.output_size
    print(f"== fused backward{' (deterministic)' if deterministic else ''}, {name}: x {x.shape}, w {w.shape}, "
          f"{_device_name()}")
    grads = {"input": cupy.empty_like(x), "weight": cupy.empty_like(w), "offset": cupy.empty_like(off),
             "mask": cupy.empty_like(msk)}
    args = {"grad_output": gy, "input": x, "weight": w, "offset": off, "mask": msk, "bias": None}
    sms = fb._fused._multiprocessors()
    for allow_tf32 in ((True, False) if np.dtype(x.dtype) == np.float32 else (False,)):
        own = fb.BackwardConfig(geom, x.dtype, allow_tf32, multiprocessors=sms, deterministic=deterministic)
        print(f"  {own.description}")
        spec = PlanSpec(geom, np.dtype(x.dtype), "cuda", cupy.cuda.runtime.getDevice(), deterministic, allow_tf32)
        im2col = (cuda_deterministic._DeterministicBackward if deterministic else be._Backward)(spec)
        through = fb.BackwardConfig(geom, x.dtype, allow_tf32, multiprocessors=sms, fused_weight=False,
                                    deterministic=deterministic)
        # the plans' weight gradient through cuda/im2col (its _Backward, deterministic or not), on the
        # workspace past the channels-last copy of x where it takes that copy
        through_weight = fb.FusedBackward(through, fb.weight_through_im2col(through, spec))
        ws = cupy.empty(max(own.workspace_bytes, through_weight.workspace_bytes, im2col.workspace_bytes),
                        dtype=np.uint8)

        def call(config, wanted, executable=None):
            executable = executable or fb.FusedBackward(config)   # its launches recorded once, then replayed
            return lambda: executable.run(dict(args, wanted=frozenset(wanted)), grads, ws)

        every = ("input", "weight", "offset", "mask")
        rows = [("whole backward, weight gradient fused", call(own, every)) if own.fused_weight else None,
                ("whole backward, weight through cuda/im2col", call(through, every, through_weight)),
                (f"{'cuda/im2col-deterministic' if deterministic else 'cuda/im2col'}'s whole backward",
                 lambda: im2col.run(dict(args, wanted=frozenset(every)), grads, ws)),
                ("input gradient alone", call(through, ("input",))),
                ("offset and mask gradients", call(through, ("offset", "mask"))),
                ("weight gradient, fused", call(own, ("weight",))) if own.fused_weight else None]
        for label, run in filter(None, rows):
            ms = t(run, 4)
            print(f"  {label:<44} {ms:8.3f} ms  {flop / ms / 1e9:7.1f} TFLOP/s", flush=True)
        if own.chunk < geom.batch:
            print(f"  (chunks of {own.chunk} samples: kernel-alone timings skipped)")
            continue
        # Each kernel alone: the launch the library records for a call (its arguments and grid as
        # plans pass them), replayed by itself after that call has left its inputs in the
        # workspace. The data kernels' call leaves out the weight gradient, whose rows of
        # grad_output would go over the channels-last copy of it (rows_over_copy).
        stream = cupy.cuda.get_current_stream().ptr
        n = geom.batch

        def alone(wanted, kernel):
            call(own, wanted)()
            function = own.kernel(kernel)
            ptr = (function.kernel if hasattr(function, "kernel") else function).ptr
            ops = [op[:7] + (None,) for op in fb.gradient_launches(own, dict(args, wanted=frozenset(wanted)), grads, ws)
                   if op[0] == 0 and op[1] == ptr]   # (no programmatic dependent launch)
            assert len(ops) == 1, (kernel, len(ops))
            return function, lambda: be._replay(ops, None, stream)

        data_gradients = ("input", "offset", "mask")
        entries = n * own.Q * own.K * own.segments
        if own.gradient_plan:
            _, run = alone(data_gradients, "fused_gradient_plan")
            print(f"  {'plan of the data gradients':<44} {t(run, 4):8.3f} ms  ({entries} entries)")
        data, run = alone(data_gradients, "data")
        ms = t(run, 4)
        print(f"  {'data-gradient kernel alone, tile %dx%dx%d' % own.tile[:3]:<44} {ms:8.3f} ms  "
              f"{flop / ms / 1e9:7.1f} TFLOP/s ({own.blocks(n)} blocks, {fb._fused.num_registers(data)} regs)")
        if own.fused_weight:
            if own.sampling_plan and not own.plan_shared:
                _, run = alone(("weight",), "fused_sampling_plan")
                print(f"  {'sampling plan of the weight gradient':<44} {t(run, 4):8.3f} ms  ({entries} entries)")
            weight, run = alone(("weight",), "weight")
            ms = t(run, 4)
            kind = "warp-specialised " if own.ws_weight else ""
            print(f"  {kind + 'weight-gradient kernel alone, tile %dx%dx%d' % own.weight_tile[:3]:<44} {ms:8.3f} ms  "
                  f"{flop / ms / 1e9:7.1f} TFLOP/s ({own.weight_grid} blocks for {own.splits * own.weight_tiles} "
                  f"units, {fb._fused.num_registers(weight)} regs)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
