"""The CPU algorithms side by side: ``cpu/numba`` (loops along positions) against
``cpu/channels-last`` (loops along channels), forced in turn, interleaved, over runs of channels
that share an offset, mask and conv group, and over N = 1, 2, 3. The rule that plans follow
(``cpu_channels_last.MIN_CHANNELS``) comes from this table (benchmarks/README.md, "CPU algorithms").

Each row: forward and forward+backward (all five gradients) ms, the median of ``--repeats``
interleaved runs after one untimed run of each, and channels-last's time over numba's.

    python benchmarks/cpu_algorithms.py [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path and (HERE.parent / "dcn_cupy").is_dir():
    sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

ALGORITHMS = ("cpu/numba", "cpu/channels-last")

#: (label, N, batch, channels, size, offset groups): 3x3(x3) kernels, padding 1, masks, float32;
#: "T" rows are transposed, stride 2 (output padding 1: twice the size out).
CASES = [
    ("2D C64 run 64", 2, 2, 64, 56, 1),
    ("2D C64 og8 run 8", 2, 2, 64, 56, 8),
    ("2D C64 og16 run 4", 2, 2, 64, 56, 16),
    ("2D C16 og4 run 4", 2, 4, 16, 56, 4),
    ("2D C16 og2 run 8", 2, 4, 16, 56, 2),
    ("2D C16 run 16", 2, 4, 16, 56, 1),
    ("2D C8 run 8", 2, 4, 8, 56, 1),
    ("2D C4 run 4", 2, 4, 4, 56, 1),
    ("2D C256 14x14", 2, 2, 256, 14, 1),
    ("1D C64 L4096", 1, 2, 64, 4096, 1),
    ("3D C32 16^3", 3, 1, 32, 16, 1),
    ("3D C8 16^3", 3, 1, 8, 16, 1),
    ("T2D C64 28x28 s2", 2, 2, 64, 28, 1),
]
QUICK = [("2D C16 run 16", 2, 1, 16, 12, 1), ("2D C4 run 4", 2, 1, 4, 12, 1)]


def _calls(rng, ndim, batch, channels, size, offset_groups, transposed=False):
    import dcn_cupy

    shape, taps = (size,) * ndim, 3 ** ndim
    x = rng.standard_normal((batch, channels) + shape).astype(np.float32)
    w = (rng.standard_normal((channels, channels) + (3,) * ndim) / np.sqrt(channels * taps)).astype(np.float32)
    off = rng.uniform(-2, 2, (batch, offset_groups * taps * ndim) + shape).astype(np.float32)
    m = rng.random((batch, taps) + shape).astype(np.float32)
    gy = rng.standard_normal((batch, channels) + shape).astype(np.float32)
    name, params = f"deform_conv{ndim}d", {"padding": 1}
    if transposed:
        name, params = f"deform_conv_transpose{ndim}d", {"padding": 1, "stride": 2, "output_padding": 1}
        gy = rng.standard_normal((batch, channels) + (2 * size,) * ndim).astype(np.float32)
    forward, backward = getattr(dcn_cupy, name), getattr(dcn_cupy, name + "_backward")
    return (lambda: forward(x, w, off, m, None, **params)), (lambda: backward(gy, x, w, off, m, None, **params))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/cpu_algorithms.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="two small cases (a smoke test)")
    args = parser.parse_args(argv)
    from dcn_cupy._backends import use_algorithm

    rng = np.random.default_rng(0)
    print(f"{'case':20s} {'numba fwd':>10s} {'cl fwd':>8s} {'ratio':>6s} {'numba f+b':>10s} {'cl f+b':>8s} {'ratio':>6s}")
    for label, *shape in (QUICK if args.quick else CASES):
        forward, backward = _calls(rng, *shape, transposed=label.startswith("T"))
        times = {(a, mode): [] for a in ALGORITHMS for mode in ("fwd", "f+b")}
        for algorithm in ALGORITHMS:  # compilation and first-call work, untimed
            with use_algorithm(algorithm):
                forward(), backward()
        for _ in range(args.repeats):
            for algorithm in ALGORITHMS:
                with use_algorithm(algorithm):
                    tic = time.perf_counter()
                    forward()
                    mid = time.perf_counter()
                    backward()
                    end = time.perf_counter()
                times[(algorithm, "fwd")].append((mid - tic) * 1e3)
                times[(algorithm, "f+b")].append((end - tic) * 1e3)
        med = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
        nf, cf = med[("cpu/numba", "fwd")], med[("cpu/channels-last", "fwd")]
        nb, cb = med[("cpu/numba", "f+b")], med[("cpu/channels-last", "f+b")]
        print(f"{label:20s} {nf:10.2f} {cf:8.2f} {cf / nf:6.2f} {nb:10.2f} {cb:8.2f} {cb / nb:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
