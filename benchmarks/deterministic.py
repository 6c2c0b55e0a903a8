"""GPU benchmark: the cost of ``deterministic=True`` on the backward.

B=8, C 256->256, 56x56, 3x3, padding 1, DCNv2 (offset + mask), one process, one GPU, CuPy
arrays, through plans (no per-call host validation). Rows:

* ``backward``: every gradient (input, weight, offset, mask, bias), default vs deterministic;
* ``backward input``: the input gradient alone (the scatter's share);
* ``transposed forward``: the transposed convolution of the same sizes (a pure scatter).

Times are medians of CUDA-event timed loops (warm-up first), in ms; "ratio" is deterministic
over default (target: at most 1.3). "determ." is the automatic choice (cuda/fused-backward's
fixed-point scatter where the plan takes the fused backward, else cuda/im2col-deterministic),
"im2col-det" the same plan forced to cuda/im2col-deterministic. "bitwise" says whether 3
deterministic runs gave the same bits (and, for information, whether 3 default runs did).
Precisions: fp32 (strict, no TF32), tf32 (float32 with ``allow_tf32=True``), fp16 and bf16.

Usage: ``python benchmarks/deterministic.py [--quick] [--precisions fp32,tf32,fp16,bf16]``
(without a CUDA device it says so and exits with status 0).

Measured on one NVIDIA H200 (2026-12-01, session 55, CuPy 14.2, CUDA 13, ``--quick``; the
deterministic scatter's fast path), ms:

    prec  what                 default  determ.  ratio im2col-det
    fp32  backward               1.349    1.649   1.22      4.518
    fp32  backward input         0.600    0.889   1.48      2.202
    fp32  transposed forward     0.601    0.888   1.48      2.209
    tf32  backward               0.794    1.105   1.39      2.994
    tf32  backward input         0.363    0.651   1.79      1.685
    tf32  transposed forward     0.366    0.653   1.79      1.695
    fp16  backward               0.578    0.824   1.42      2.529
    fp16  backward input         0.314    0.584   1.86      1.519
    fp16  transposed forward     0.316    0.585   1.85      1.520
    bf16  backward               0.581    0.824   1.42      2.539
    bf16  backward input         0.313    0.583   1.86      1.526
    bf16  transposed forward     0.313    0.582   1.86      1.524

Earlier sessions' tables are in ``benchmarks/README.md`` ("Deterministic backward").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import _time_cupy as _time, no_gpu_reason  # noqa: E402


def _bits(result) -> tuple:
    import cupy
    arrays = result if isinstance(result, tuple) else (result,)
    return tuple(None if a is None else cupy.asnumpy(a).tobytes() for a in arrays)


def _inputs(dtype, B=8, C=256, H=56, W=56, seed=0):
    import cupy
    rng = cupy.random.default_rng(seed)
    x = rng.standard_normal((B, C, H, W), dtype=cupy.float32).astype(dtype)
    w = (rng.standard_normal((C, C, 3, 3), dtype=cupy.float32) / (C * 9) ** 0.5).astype(dtype)
    b = rng.standard_normal((C,), dtype=cupy.float32).astype(dtype)
    off = rng.standard_normal((B, 18, H, W), dtype=cupy.float32).astype(dtype)
    msk = rng.random((B, 9, H, W), dtype=cupy.float32).astype(dtype)
    gy = rng.standard_normal((B, C, H, W), dtype=cupy.float32).astype(dtype)
    return x, w, b, off, msk, gy


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--precisions", default="fp32,tf32,fp16,bf16", help="comma-separated, of fp32,tf32,fp16,bf16")
    args = parser.parse_args(argv)
    precisions = args.precisions.split(",")
    unknown = sorted(set(precisions) - {"fp32", "tf32", "fp16", "bf16"})
    if unknown:
        parser.error(f"--precisions: expected names among fp32,tf32,fp16,bf16, got {','.join(unknown)}")
    reason = no_gpu_reason()
    if reason is not None:
        print(f"deterministic.py: {reason}: nothing to measure.")
        return 0
    import cupy
    import numpy as np

    import dcn_cupy
    warmup, repeats, inner = (2, 3, 3) if args.quick else (3, 7, 5)
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    rows = []
    from dcn_cupy._interop import BFLOAT16
    for precision, dtype in (("fp32", np.float32), ("tf32", np.float32), ("fp16", np.float16), ("bf16", BFLOAT16)):
        if precision not in precisions:
            continue
        tf32 = precision == "tf32"
        x, w, b, off, msk, gy = _inputs(dtype)
        for what in ("backward", "backward input", "transposed forward"):
            timings, bitwise = {}, {}
            for mode in ("default", "deterministic", "im2col"):
                deterministic = mode != "default"
                algorithm = "cuda/im2col-deterministic" if mode == "im2col" else None
                if what == "transposed forward":
                    wt = cupy.ascontiguousarray(w.swapaxes(0, 1))
                    p = dcn_cupy.plan(x, wt, off, msk, b, padding=1, transposed=True, deterministic=deterministic,
                                      allow_tf32=tf32, algorithm=algorithm)

                    def fn(p=p, wt=wt):
                        return p.forward(x, wt, off, msk, b)
                else:
                    p = dcn_cupy.plan(x, w, off, msk, b, padding=1, deterministic=deterministic, allow_tf32=tf32,
                                      algorithm=algorithm)
                    wrt = ("input",) if what == "backward input" else None

                    def fn(p=p, wrt=wrt):
                        return tuple(p.backward(gy, x, w, off, msk, b, wrt=wrt))
                timings[mode] = _time(fn, warmup, repeats, inner)
                bitwise[mode] = len({_bits(fn()) for _ in range(3)}) == 1
                if mode == "deterministic":
                    chosen = p.algorithm
            rows.append((precision, what, timings["default"], timings["deterministic"],
                         timings["deterministic"] / timings["default"], timings["im2col"],
                         bitwise["deterministic"] and bitwise["im2col"], bitwise["default"], chosen))
    print(f"deterministic mode cost on {name} (B=8 C256->256 56x56 3x3, offset+mask), ms")
    print(f"{'prec':5} {'what':19} {'default':>8} {'determ.':>8} {'ratio':>6} {'im2col-det':>10}  "
          f"bitwise(det/default)  deterministic plan")
    for precision, what, t0, t1, ratio, t2, bit1, bit0, chosen in rows:
        print(f"{precision:5} {what:19} {t0:8.3f} {t1:8.3f} {ratio:6.2f} {t2:10.3f}  {str(bit1) + '/' + str(bit0):20}  "
              f"{chosen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
