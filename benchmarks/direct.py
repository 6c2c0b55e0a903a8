"""cuda/direct against cuda/im2col, from tiny to medium problems: where the threshold lies.

For each shape (float32, DCNv2: offset + mask + bias, 3^N kernel, padding 1), plans forced to
each algorithm are timed in one process on one GPU, forward alone and forward + backward (every
gradient), with caller-provided outputs (the plan API):

* GPU µs per call: CUDA events around a batch of calls queued behind a spinning kernel, so the
  GPU runs them back to back (their host time does not show);
* host µs per call: the GPU kept busy by a spinning kernel while the calls are enqueued
  (benchmarks/overhead.py's method and helpers).

A call costs about max(GPU, host) when calls are issued back to back; the ratio column is
that of direct over im2col (< 1: direct is faster); "auto" is what the registry picks without
forcing (cuda/direct's ``recommends``: MACs and channel rules). The threshold printed at the end
is the largest MAC count up to which direct wins (forward and forward + backward) on every shape
that passes the channel rule (``cuda_direct.MAX_CHANNEL_PRODUCT``).

    python benchmarks/direct.py
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import dcn_cupy  # noqa: E402
from gpu import _device_name, no_gpu_reason  # noqa: E402
from overhead import _Busy, _time  # noqa: E402

#: (label, B, C_in = C_out, spatial)
SHAPES = (
    ("1D B1 C32 L64", 1, 32, (64,)),
    ("2D B1 C16 8x8", 1, 16, (8, 8)),
    ("3D B1 C8 8^3", 1, 8, (8, 8, 8)),
    ("2D B1 C128 4x4", 1, 128, (4, 4)),
    ("2D B1 C32 16x16", 1, 32, (16, 16)),
    ("2D B1 C16 32x32", 1, 16, (32, 32)),
    ("3D B1 C16 8^3", 1, 16, (8, 8, 8)),
    ("2D B1 C64 16x16", 1, 64, (16, 16)),
    ("1D B4 C64 L256", 4, 64, (256,)),
    ("2D B2 C32 32x32", 2, 32, (32, 32)),
    ("2D B1 C256 14x14", 1, 256, (14, 14)),
    ("2D B4 C64 32x32", 4, 64, (32, 32)),
    ("2D B8 C64 32x32", 8, 64, (32, 32)),
)
ALGORITHMS = ("cuda/direct", "cuda/im2col")


def _arrays(cupy, B, C, spatial, rng):
    n = len(spatial)
    K = 3 ** n
    f = np.float32
    a = dict(input=rng.standard_normal((B, C) + spatial).astype(f),
             weight=(rng.standard_normal((C, C) + (3,) * n) / math.sqrt(C * K)).astype(f),
             offset=rng.standard_normal((B, K * n) + spatial).astype(f),
             mask=rng.random((B, K) + spatial).astype(f),
             bias=rng.standard_normal(C).astype(f))
    return {k: cupy.asarray(v) for k, v in a.items()}


def _gpu_us(cupy, busy, call, host_us, calls=20, repeats=3) -> float:
    """GPU µs per call: ``calls`` calls queued behind a spin long enough to enqueue them all."""
    results = []
    for _ in range(repeats):
        busy(max(0.005, 3e-6 * host_us * calls))
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(calls):
            call()
        stop.record()
        stop.synchronize()
        results.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls)
    return statistics.median(results)


def measure(cupy, busy, label, B, C, spatial, rng) -> dict:
    a = _arrays(cupy, B, C, spatial, rng)
    row = {"auto": dcn_cupy.plan(**a, padding=1).algorithm.split(",")[0].split(": ")[1]}
    for algorithm in ALGORITHMS:
        p = dcn_cupy.plan(**a, padding=1, algorithm=algorithm)
        y = cupy.empty(p.output_shape, np.float32)
        gy = cupy.asarray(rng.standard_normal(p.output_shape).astype(np.float32))
        grads = {k: cupy.empty_like(v) for k, v in a.items()}
        ws = cupy.empty(max(p.workspace_bytes, 1), np.uint8)

        def fwd():
            p.forward(**a, out=y, workspace=ws)

        def both():
            p.forward(**a, out=y, workspace=ws)
            p.backward(gy, **a, out=grads, workspace=ws)

        for name, call in (("fwd", fwd), ("f+b", both)):
            call()
            cupy.cuda.Device().synchronize()
            host = _time(call, busy, calls=20, repeats=5)
            row[(algorithm, name)] = (_gpu_us(cupy, busy, call, host), host)
    return row


def main() -> int:
    reason = no_gpu_reason()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    import cupy
    from dcn_cupy._backends import cuda_direct
    busy = _Busy("cupy")
    rng = np.random.default_rng(0)
    began = time.perf_counter()
    print(f"# cuda/direct vs cuda/im2col, float32 DCNv2, {_device_name()}")
    print("GPU / host: µs per call; ratio: max(GPU, host) of direct / of im2col (< 1: direct wins)\n")
    print("| shape | MACs | fwd direct GPU / host | fwd im2col GPU / host | fwd ratio "
          "| f+b direct GPU / host | f+b im2col GPU / host | f+b ratio | auto |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    results = []
    for label, B, C, spatial in SHAPES:
        macs = B * math.prod(spatial) * C * C * 3 ** len(spatial)
        row = measure(cupy, busy, label, B, C, spatial, rng)
        cells, ratios = [], []
        for name in ("fwd", "f+b"):
            d, i = row[("cuda/direct", name)], row[("cuda/im2col", name)]
            ratio = max(d) / max(i)
            ratios.append(ratio)
            cells += [f"{d[0]:.1f} / {d[1]:.1f}", f"{i[0]:.1f} / {i[1]:.1f}", f"{ratio:.2f}"]
        if C * C <= cuda_direct.MAX_CHANNEL_PRODUCT:
            results.append((macs, ratios))
        print(f"| {label} | {macs:,} | " + " | ".join(cells) + f" | {row['auto']} |", flush=True)
    # the largest MAC count below which direct wins on every shape (forward and forward+backward)
    threshold = 0
    for macs, ratios in sorted(results):
        if max(ratios) > 1.0:
            break
        threshold = macs
    losers = [f"{m:,}" for m, r in sorted(results) if max(r) > 1.0]
    print(f"\nchannel rule: C_in * C_out/groups <= {cuda_direct.MAX_CHANNEL_PRODUCT}; MACs limit now "
          f"{cuda_direct.MAX_MACS:,}")
    print(f"implied threshold: direct wins on every shape (within the channel rule) up to {threshold:,} MACs "
          f"(2^{math.log2(threshold):.1f})" if threshold else "\nimplied threshold: none (direct never wins)")
    print(f"shapes (within the channel rule) where im2col wins: {', '.join(losers) or 'none'}")
    print(f"({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
