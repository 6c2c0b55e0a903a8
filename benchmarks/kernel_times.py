"""Kernel by kernel: each kernel's GPU time in one forward or one backward, under Nsight Compute.

    python benchmarks/kernel_times.py --cases 1d-fp32,c256-fp32 [--phases forward,backward]
                                      [--set MODULE.NAME=VALUE ...]

Cases are ``ab.py``'s (``SHAPE-PRECISION`` on ``gpu.py``'s inputs; ``--shape KEY=B,C_in,C_out,S``
adds one). For each case and phase, a process of its own runs under ``ncu --profile-from-start off
--clock-control none --cache-control none --metrics gpu__time_duration.sum --csv``: the card's
clocks and caches are left as they are. That process builds the plan (with the ``--set`` settings
held, as ``ab.py`` holds them), runs three forward+backward steps, then profiles one call of the
phase (``cupyx.profiler.profile()``: the profiler's range). ncu runs each kernel alone, so the
times leave out the overlap of programmatic dependent launches, and their sum is above the phase's
CUDA-event time. The table gives each kernel (its name without template arguments) in the order of
its first launch, its launches and the sum of their times in µs. It shows where a chunk's launches
cost (NOTES-gpu.md, session 66: the fused backward in one chunk and in three).

Needs CuPy, a CUDA device, PyTorch (gpu.py's inputs) and ``ncu`` on the PATH (or ``--ncu``).
Without them it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ab  # noqa: E402

PHASES = ("forward", "backward")
NCU_OPTIONS = ("--profile-from-start", "off", "--clock-control", "none", "--cache-control", "none",
               "--metrics", "gpu__time_duration.sum", "--csv")
#: ncu's units of gpu__time_duration -> µs.
_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
#: The line the profiled process prints before its range: the plan's description.
_PLAN = "kernel_times plan: "


def kernel_name(signature: str) -> str:
    """``"void fused_store<float, int>(const float *, ...)"`` -> ``"fused_store"``."""
    name = signature.split("(", 1)[0].strip()
    name = name.split("<", 1)[0].strip()
    return name[len("void "):] if name.startswith("void ") else name


def kernel_times(text: str) -> list:
    """[(kernel, launches, µs summed)] from ncu's ``--csv`` output (other lines skipped), in
    the order of each kernel's first launch."""
    rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
    if not rows:
        return []
    head = rows[0]
    try:
        at = {key: head.index(key) for key in ("Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
    except ValueError:
        raise ValueError(f"ncu's CSV lacks a column of Kernel Name, Metric Name, Metric Unit, Metric Value: "
                         f"got {head}") from None
    found = {}
    for row in rows[1:]:
        if row[at["Metric Name"]] != "gpu__time_duration.sum":
            continue
        unit = row[at["Metric Unit"]]
        if unit not in _US:
            raise ValueError(f"gpu__time_duration in {unit!r}: expected one of {', '.join(_US)}")
        name = kernel_name(row[at["Kernel Name"]])
        launches, total = found.get(name, (0, 0.0))
        found[name] = (launches + 1, total + float(row[at["Metric Value"]].replace(",", "")) * _US[unit])
    return [(name, launches, total) for name, (launches, total) in found.items()]


def table(case: str, phase: str, plan: str, times: list) -> str:
    """A case's and phase's kernels as a Markdown table, its total last."""
    lines = [f"{case} {phase}: {plan}", "| kernel | launches | µs |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {launches} | {total:.1f} |" for name, launches, total in times]
    lines.append(f"| total | {sum(t[1] for t in times)} | {sum(t[2] for t in times):.1f} |")
    return "\n".join(lines)


def _hold(settings) -> None:
    for path, name, value in settings:
        setattr(importlib.import_module(path), name, value)


def profile(case_text: str, phase: str, settings, extra_shapes) -> None:
    """(In the process that ncu runs) one ``phase`` call of the case inside the profiler's range."""
    import cupy
    import cupyx.profiler

    import dcn_cupy
    _hold(settings)
    (shape, precision, _), = ab.parse_cases(case_text, extra_shapes)
    args, gy, keywords = ab._case_arguments(shape, precision)
    plan = dcn_cupy.plan(*args, **keywords)
    lines = str(plan).splitlines()
    print(_PLAN + next((line.strip() for line in lines if f"({phase})" in line), lines[0]), flush=True)
    for _ in range(3):
        plan.forward(*args)
        plan.backward(gy, *args)
    cupy.cuda.Device().synchronize()
    with cupyx.profiler.profile():
        if phase == "forward":
            plan.forward(*args)
        else:
            plan.backward(gy, *args)
        cupy.cuda.Device().synchronize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/kernel_times.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1d-fp32", help=f"SHAPE-PRECISION,... (SHAPE: {', '.join(ab.SHAPE_KEYS)}, "
                        "or a --shape KEY)")
    parser.add_argument("--shape", action="append", default=[],
                        help="KEY=B,C_in,C_out,S: a shape of one's own for --cases (repeatable)")
    parser.add_argument("--phases", default="backward", help="comma-separated, of forward,backward (default backward)")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="a module-level setting held at VALUE while the plans are built and run (repeatable)")
    parser.add_argument("--ncu", default="ncu", help="the Nsight Compute command line (default: ncu on the PATH)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for each profiled process")
    parser.add_argument("--profile", default=None, help=argparse.SUPPRESS)   # CASE:PHASE, in ncu's process
    args = parser.parse_args(argv)
    try:
        extra = dict(ab.parse_shape(text) for text in args.shape)
        cases = [name for _, _, name in ab.parse_cases(args.cases, extra)]
        settings = [ab.parse_setting(text) for text in args.set]
    except ValueError as error:
        parser.error(str(error))
    phases = [p.strip() for p in args.phases.split(",")]
    if not phases or any(p not in PHASES for p in phases):
        parser.error(f"--phases must be comma-separated, of {', '.join(PHASES)}, got {args.phases!r}")
    if args.profile is not None:
        case, _, phase = args.profile.rpartition(":")
        profile(case, phase, settings, extra)
        return 0
    reason = (ab._gpu.no_gpu_reason() or (None if ab._bench.torch_installed() else "PyTorch is not installed")
              or (None if shutil.which(args.ncu) else f"{args.ncu!r} (Nsight Compute) is not on the PATH"))
    if reason is not None:
        print(f"benchmarks/kernel_times.py: {reason}: nothing to measure.")
        return 0
    passed = [item for text in args.set for item in ("--set", text)] + [
        item for text in args.shape for item in ("--shape", text)]
    holding = "".join(f", {text.strip()}" for text in args.set)
    print(f"kernel_times on {ab._gpu._device_name()}{holding}: ncu's gpu__time_duration, kernel by kernel\n")
    for case in cases:
        for phase in phases:
            command = [args.ncu, *NCU_OPTIONS, sys.executable, str(Path(__file__).resolve()), "--cases", case,
                       "--profile", f"{case}:{phase}", *passed]
            run = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            plan = next((line[len(_PLAN):] for line in run.stdout.splitlines() if line.startswith(_PLAN)), "?")
            times = kernel_times(run.stdout)
            if run.returncode != 0 or not times:
                print(f"{case} {phase}: ncu exited with {run.returncode} and {len(times)} kernels; its last "
                      f"lines:\n" + "\n".join((run.stdout + run.stderr).splitlines()[-12:]) + "\n", flush=True)
                continue
            print(table(case, phase, plan, times) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
