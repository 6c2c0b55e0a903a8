"""CPU memory benchmark: time and peak RSS of the Numba backend per workspace limit.

For each shape and each ``DCN_CUPY_CPU_WORKSPACE_BYTES`` limit, a fresh child process builds the
float32 DCNv2 inputs (3x3 or 7x7 kernel, padding k//2, offsets and masks), compiles the kernels on
a tiny problem (or loads them from the cache), then runs the forward and the forward+backward
(all five gradients). Peak extra memory is the process's peak resident set (``VmHWM``, reset
through ``/proc/self/clear_refs`` before each measurement) less its resident set before the call:
the workspace, the outputs and any temporaries. Times are the fastest of ``--repeats`` runs.

Shapes (issue 11 item 6): ``batch`` B=64 C64->64 64x64 k3 and ``wide`` B=1 C512->512 128x128 k7.

    python benchmarks/memory.py                                  # every shape, limits 16M..512M
    python benchmarks/memory.py --shapes batch --limits 16M,64M --repeats 5 --json out.json

Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = {
    "batch": dict(batch=64, channels=64, size=64, kernel=3),
    "wide": dict(batch=1, channels=512, size=128, kernel=7),
}
DEFAULT_LIMITS = "16M,32M,64M,128M,256M,512M"


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS


def _child(shape: str, repeats: int) -> dict:
    """Measure one shape under the limit in this process's environment; returns a result row."""
    if str(HERE.parent) not in sys.path and (HERE.parent / "dcn_cupy").is_dir():
        sys.path.insert(0, str(HERE.parent))
    import numpy as np

    import dcn_cupy
    from dcn_cupy._backends import cpu

    p = SHAPES[shape]
    b, c, s, k = p["batch"], p["channels"], p["size"], p["kernel"]
    rng = np.random.default_rng(0)
    f = np.float32

    def inputs(b, c, s, k):
        return (rng.standard_normal((b, c, s, s), dtype=f), (rng.standard_normal((c, c, k, k), dtype=f) / (c * k)),
                rng.uniform(-2, 2, (b, 2 * k * k, s, s)).astype(f), rng.uniform(0, 1, (b, k * k, s, s)).astype(f),
                rng.standard_normal((b, c, s, s), dtype=f))

    def step(arrays, backward, padding):
        x, w, off, m, gy = arrays
        y = dcn_cupy.deform_conv2d(x, w, off, m, padding=padding)
        if backward:
            return dcn_cupy.deform_conv2d_backward(gy, x, w, off, m, padding=padding)
        return y

    step(inputs(1, 2, 5, 3), True, 1)  # compile, or load the kernels from the cache
    data = inputs(b, c, s, k)
    limit = cpu.workspace_limit() if hasattr(cpu, "workspace_limit") else cpu.WORKSPACE_LIMIT_BYTES  # older versions
    row = {"shape": shape, **p, "limit_bytes": limit, "version": dcn_cupy.__version__}
    for mode, backward in (("forward", False), ("forward+backward", True)):
        times, peaks = [], []
        for _ in range(repeats):
            before = _status("VmRSS")
            _reset_peak()
            tic = time.perf_counter()
            result = step(data, backward, k // 2)
            times.append(time.perf_counter() - tic)
            peaks.append(_status("VmHWM") - before)
            del result
        row[mode] = {"seconds": min(times), "peak_extra_bytes": max(peaks)}
    return row


def _measure(shape: str, limit: str, repeats: int) -> dict:
    env = dict(os.environ, DCN_CUPY_CPU_WORKSPACE_BYTES=limit)
    command = [sys.executable, __file__, "--child", shape, "--repeats", str(repeats)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{shape} at {limit} failed:\n{done.stderr}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["limit"] = limit
    return row


def _print_row(row: dict) -> None:
    mib = 2**20
    cells = [f"{row['shape']:6s}", f"{row['limit']:>6s}"]
    for mode in ("forward", "forward+backward"):
        cells.append(f"{row[mode]['seconds'] * 1e3:10.0f} ms {row[mode]['peak_extra_bytes'] / mib:8.0f} MiB")
    print(" | ".join(cells), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated among {list(SHAPES)}")
    parser.add_argument("--limits", default=DEFAULT_LIMITS, help=f"workspace limits (default {DEFAULT_LIMITS})")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (default 3)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.repeats)))
        return 0
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs")
    print("shape  |  limit |   forward: time, peak extra RSS |   forward+backward: time, peak extra RSS")
    rows = []
    for shape in args.shapes.split(","):
        for limit in args.limits.split(","):
            rows.append(_measure(shape, limit, args.repeats))
            _print_row(rows[-1])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
