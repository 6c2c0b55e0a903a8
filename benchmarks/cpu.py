"""CPU benchmark: dcn_cupy's Numba backend against torchvision's CPU kernel and a dense conv.

Shape of the CPU targets in benchmarks/README.md ("## Targets"): B=2, C 64->64, 56x56, 3x3, padding 1, offsets and masks
(DCNv2), float32, NumPy arrays. Times the forward and the forward+backward (the backward is
``deform_conv2d_backward`` for all five gradients); each measurement is the median of
``--repeats`` runs after ``--warmup`` runs (the Numba JIT compilation is excluded), and the
candidates are timed in rounds, one run of each per round, so that a shared machine's drift
reaches every row alike and their ratios stay fair. The rows
``dcn_cupy`` are the automatic choice of CPU algorithm (named above the table); each CPU
algorithm is then timed forced (``dcn_cupy cpu/numba``, ...). When they import, torchvision's
``deform_conv2d`` and ``torch.nn.functional.conv2d`` are timed the same way. Prints a table
with each row's speed-up over torchvision and its time over the dense conv's, and the targets of
benchmarks/README.md at their shape; writes JSON only where asked (``--json PATH``).

    python benchmarks/cpu.py [--repeats 7] [--json out.json]
    python -m dcn_cupy bench          # the same on a machine without a CUDA device
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path and (HERE.parent / "dcn_cupy").is_dir():
    sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

TARGETS_FILE = HERE / "README.md"


def read_targets(path=TARGETS_FILE) -> dict:
    """``{mode: (limit_ms, why)}`` from the rows of the "## Targets" table whose first cell is
    ``cpu``: the targets live in benchmarks/README.md, next to the numbers they judge."""
    targets, inside = {}, False
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return targets
    for line in lines:
        if line.startswith("## "):
            inside = line.strip() == "## Targets"
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if inside and len(cells) >= 5 and cells[0] == "cpu":
            try:
                targets[cells[2]] = (float(cells[3].lstrip("<= ")), cells[4])
            except ValueError:
                continue
    return targets


def _time_rounds(candidates, warmup: int, repeats: int) -> list:
    """Results of ``candidates`` [(library, mode, fn)], timed in rounds: each round runs every
    candidate in turn, so that the load of a shared machine is spread over all of them. Each
    timed run follows an untimed one of the same candidate, and each round runs them in another
    order (seeded): torch's OpenMP threads spin for a while after their work, which slowed
    whatever ran right after them (5.7 -> 11.4 ms, and still 5.0 -> 6.4 after an untimed run)."""
    for _ in range(warmup):
        for _, _, fn in candidates:
            fn()
    times = [[] for _ in candidates]
    order = np.random.default_rng(0)
    for _ in range(repeats):
        for i in order.permutation(len(candidates)):
            (_, _, fn), mine = candidates[i], times[i]
            fn()
            tic = time.perf_counter()
            fn()
            mine.append((time.perf_counter() - tic) * 1e3)
    return [_result(library, mode, mine) for (library, mode, _), mine in zip(candidates, times)]


def _inputs(args):
    rng = np.random.default_rng(args.seed)
    b, c_in, c_out, size, k = args.batch, args.in_channels, args.out_channels, args.size, 3
    out = size  # padding 1, stride 1
    f32 = np.float32
    return {
        "input": rng.standard_normal((b, c_in, size, size)).astype(f32),
        "weight": (rng.standard_normal((c_out, c_in, k, k)) / np.sqrt(c_in * k * k)).astype(f32),
        "offset": rng.uniform(-2.0, 2.0, (b, 2 * k * k, out, out)).astype(f32),
        "mask": rng.uniform(0.0, 1.0, (b, k * k, out, out)).astype(f32),
        "bias": rng.standard_normal(c_out).astype(f32),
        "grad_output": rng.standard_normal((b, c_out, out, out)).astype(f32),
    }


#: The CPU algorithms timed forced, beside the automatic choice.
ALGORITHMS = ("cpu/numba", "cpu/channels-last")


def _dcn_cupy_candidates(data) -> list:
    import dcn_cupy
    from dcn_cupy._backends import use_algorithm

    x, w, off, m, bias, gy = (data[k] for k in ("input", "weight", "offset", "mask", "bias", "grad_output"))
    chosen = dcn_cupy.plan(x, w, off, m, bias, padding=1).algorithm
    print(f"  dcn_cupy's automatic choice: {chosen}", flush=True)

    def forward():
        return dcn_cupy.deform_conv2d(x, w, off, m, bias, padding=1)

    def forward_backward():
        dcn_cupy.deform_conv2d(x, w, off, m, bias, padding=1)
        return dcn_cupy.deform_conv2d_backward(gy, x, w, off, m, bias, padding=1)

    def forced(algorithm, fn):
        def run():
            with use_algorithm(algorithm):
                return fn()
        return run

    tic = time.perf_counter()
    forward_backward()  # JIT compilation (or loading Numba's cache), excluded from the timings
    print(f"  dcn_cupy first call (JIT compile / cache load): {time.perf_counter() - tic:.1f} s", flush=True)
    candidates = [("dcn_cupy", "forward", forward), ("dcn_cupy", "forward+backward", forward_backward)]
    for algorithm in ALGORITHMS:
        forced(algorithm, forward_backward)()  # its own compilation, excluded
        candidates += [(f"dcn_cupy {algorithm}", "forward", forced(algorithm, forward)),
                       (f"dcn_cupy {algorithm}", "forward+backward", forced(algorithm, forward_backward))]
    return candidates


def _torch_candidates(data) -> list:
    try:
        import torch
    except Exception as error:
        print(f"  torch not importable ({type(error).__name__}: {error}): skipping torch and torchvision")
        return []
    candidates = []
    t = {k: torch.from_numpy(v.copy()) for k, v in data.items()}

    def leaves(*names):
        return [t[n].clone().requires_grad_(True) for n in names]

    try:
        from torchvision.ops import deform_conv2d as tv_deform_conv2d
    except Exception as error:
        print(f"  torchvision not importable ({type(error).__name__}: {str(error).splitlines()[0]}): skipping it")
        tv_deform_conv2d = None

    if tv_deform_conv2d is not None:
        def tv_forward():
            with torch.no_grad():
                return tv_deform_conv2d(t["input"], t["offset"], t["weight"], t["bias"], padding=(1, 1), mask=t["mask"])

        def tv_forward_backward():
            x, off, w, bias, m = leaves("input", "offset", "weight", "bias", "mask")
            y = tv_deform_conv2d(x, off, w, bias, padding=(1, 1), mask=m)
            y.backward(t["grad_output"])
            return x.grad

        candidates += [("torchvision deform_conv2d", "forward", tv_forward),
                       ("torchvision deform_conv2d", "forward+backward", tv_forward_backward)]

    def dense_forward():
        with torch.no_grad():
            return torch.nn.functional.conv2d(t["input"], t["weight"], t["bias"], padding=1)

    def dense_forward_backward():
        x, w, bias = leaves("input", "weight", "bias")
        y = torch.nn.functional.conv2d(x, w, bias, padding=1)
        y.backward(t["grad_output"])
        return x.grad

    return candidates + [("torch conv2d (dense)", "forward", dense_forward),
                         ("torch conv2d (dense)", "forward+backward", dense_forward_backward)]


def _result(library: str, mode: str, times: list) -> dict:
    return {"library": library, "mode": mode, "median_ms": statistics.median(times), "min_ms": min(times),
            "times_ms": times}


def _environment() -> dict:
    import numba

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "numba_threads": numba.get_num_threads(),
    }
    try:
        import dcn_cupy
        from dcn_cupy._backends import cpu

        env["dcn_cupy"] = dcn_cupy.__version__
        env["numba_threading"] = cpu.threading_layer()
    except Exception:
        pass
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        import torchvision

        env["torchvision"] = torchvision.__version__
    except Exception:
        pass
    return env


def _numba_threads() -> int:
    import numba

    return numba.get_num_threads()


def _print_table(results: list) -> None:
    by = {(r["library"], r["mode"]): r for r in results}
    tv = {mode: by.get(("torchvision deform_conv2d", mode)) for mode in ("forward", "forward+backward")}
    dense = {mode: by.get(("torch conv2d (dense)", mode)) for mode in ("forward", "forward+backward")}
    headers = ("library", "mode", "median ms", "min ms", "speed-up vs torchvision", "time / dense conv's")
    rows = []
    for r in results:
        ref, conv = tv[r["mode"]], dense[r["mode"]]
        speedup = f"{ref['median_ms'] / r['median_ms']:.2f}x" if ref else "-"
        over_dense = f"{r['median_ms'] / conv['median_ms']:.2f}x" if conv else "-"
        rows.append((r["library"], r["mode"], f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}", speedup, over_dense))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def _print_targets(results: list, args) -> None:
    if (args.batch, args.in_channels, args.out_channels, args.size) != (2, 64, 64, 56):
        return
    targets = read_targets()
    if not targets:
        return
    print()
    print(f"Targets ({TARGETS_FILE.parent.name}/{TARGETS_FILE.name}, for 2 cores):")
    threads = _numba_threads()
    if threads != 2:
        print(f"  (this run used {threads} Numba threads)")
    for mode, (limit, why) in targets.items():
        mine = next((r for r in results if r["library"] == "dcn_cupy" and r["mode"] == mode), None)
        if mine is None:
            continue
        verdict = "met" if mine["median_ms"] <= limit else "NOT met"
        print(f"  {mode:<17} {mine['median_ms']:8.2f} ms  target <= {limit:g} ms ({why}): {verdict}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/cpu.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--in-channels", type=int, default=64)
    parser.add_argument("--out-channels", type=int, default=64)
    parser.add_argument("--size", type=int, default=56, help="input height = width")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs after the first call (default 2)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs; the median is reported (default 7)")
    parser.add_argument("--threads", type=int, default=None,
                        help="Numba (and torch) thread count (default: Numba's default)")
    parser.add_argument("--no-torch", action="store_true", help="skip torch and torchvision")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results as JSON to this path (default: nowhere)")
    args = parser.parse_args(argv)

    import numba

    if args.threads:
        numba.set_num_threads(args.threads)
    threads = numba.get_num_threads()
    try:
        import torch

        torch.set_num_threads(threads)
    except Exception:
        pass
    print(f"dcn_cupy CPU benchmark: B={args.batch}, C {args.in_channels}->{args.out_channels}, "
          f"{args.size}x{args.size}, 3x3, padding 1, offsets+mask, float32; "
          f"median of {args.repeats} after {args.warmup} warm-up runs", flush=True)
    print(f"  Numba threads: {threads} (os.cpu_count() = {os.cpu_count()})", flush=True)

    data = _inputs(args)
    candidates = _dcn_cupy_candidates(data)
    if not args.no_torch:
        candidates += _torch_candidates(data)
    results = _time_rounds(candidates, args.warmup, args.repeats)

    print()
    _print_table(results)
    _print_targets(results, args)

    report = {
        "benchmark": "cpu",
        "config": {"batch": args.batch, "in_channels": args.in_channels, "out_channels": args.out_channels,
                   "size": [args.size, args.size], "kernel_size": [3, 3], "padding": 1, "offset": True,
                   "mask": True, "bias": True, "dtype": "float32", "warmup": args.warmup, "repeats": args.repeats},
        "environment": _environment(),
        "results": results,
    }
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
