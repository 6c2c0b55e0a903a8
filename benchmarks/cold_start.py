"""Cold start on the CPU: ``import dcn_cupy`` and the first forward+backward with an empty kernel cache.

Each measurement is a fresh child process with a fresh, empty ``XDG_CACHE_HOME`` (so an empty Numba
kernel cache): it imports dcn_cupy, runs a float32 2D DCNv2 forward (B=2, 12x12, 3x3, padding 1,
offsets and mask) and a backward of all five gradients, and reports the import, forward and
backward times and its CPU time. The parent adds the whole process's wall time (the interpreter's
start included). ``--trees`` takes several source trees (e.g. a ``git worktree`` of another
commit), run in interleaved rounds, each round in another (seeded) order, so that a shared
machine's slow phases fall on all of them alike.

DESIGN.md section 5's target: the cold first forward+backward under 5 s (2 cores).

    python benchmarks/cold_start.py                          # C 64->64 (cpu/channels-last), C 8->8 (cpu/numba)
    python benchmarks/cold_start.py --rounds 5 --trees .,/tmp/other-commit
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_SECONDS = 5.0

_CHILD = """
import json, sys, time
start = time.perf_counter()
import numpy as np
import dcn_cupy
imported = time.perf_counter()
channels = int(sys.argv[1])
rng = np.random.default_rng(0)
x = rng.standard_normal((2, channels, 12, 12), dtype=np.float32)
w = rng.standard_normal((channels, channels, 3, 3), dtype=np.float32)
offset = rng.standard_normal((2, 18, 12, 12), dtype=np.float32)
mask = rng.random((2, 9, 12, 12), dtype=np.float32)
bias = rng.standard_normal(channels, dtype=np.float32)
first = time.perf_counter()
y = dcn_cupy.deform_conv2d(x, w, offset, mask, bias, padding=1)
forward = time.perf_counter()
dcn_cupy.deform_conv2d_backward(np.ones_like(y), x, w, offset, mask, bias, padding=1)
backward = time.perf_counter()
print("COLD", json.dumps({"import": imported - start, "forward": forward - first, "backward": backward - forward,
                          "fb": backward - first, "cpu": time.process_time(),
                          "algorithm": dcn_cupy.plan(x, w, offset, mask, bias, padding=1).algorithm,
                          "module": dcn_cupy.__file__}))
"""


def measure(tree: Path, channels: int) -> dict:
    """One cold child process of ``tree``'s dcn_cupy at ``channels`` channels."""
    cache = tempfile.mkdtemp(prefix="dcn_cupy_cold_")
    try:
        env = dict(os.environ, XDG_CACHE_HOME=cache, PYTHONPATH=str(tree), PYTHONWARNINGS="ignore")
        for name in ("DCN_CUPY_NUMBA_CACHE", "NUMBA_CACHE_DIR"):
            env.pop(name, None)
        tic = time.perf_counter()
        # run in the empty folder: with ``-c`` the working directory comes first on sys.path
        result = subprocess.run([sys.executable, "-c", _CHILD, str(channels)], env=env, cwd=cache,
                                capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - tic
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if result.returncode != 0:
        raise RuntimeError(f"the cold child process of {tree} failed:\n{result.stderr}")
    line = next(line for line in result.stdout.splitlines() if line.startswith("COLD "))
    run = dict(json.loads(line[5:]), process=wall)
    if not Path(run["module"]).resolve().is_relative_to(tree):
        raise RuntimeError(f"the child imported {run['module']}, not {tree}'s dcn_cupy")
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", default="64,8", help="comma-separated channel counts (default 64,8)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each case (default 3)")
    parser.add_argument("--trees", default=str(REPO), help="comma-separated source trees (default: this one)")
    parser.add_argument("--seed", type=int, default=0, help="the rounds' order (default 0)")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    channels = [int(c) for c in args.channels.split(",")]
    cases = [(tree, c) for tree in trees for c in channels]
    order = random.Random(args.seed)
    results = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case in order.sample(cases, len(cases)):
            results[case].append(measure(*case))
    print(f"Cold start, medians of {args.rounds} (min-max), float32 2D DCNv2 on 12x12, "
          f"{os.cpu_count()} CPUs; target: cold forward+backward < {TARGET_SECONDS:g} s")
    print(f"{'tree':<28} {'C':>4} {'forward':<18} {'import s':>16} {'forward+backward s':>20} {'process s':>16}  target")
    for (tree, c), runs in results.items():
        def cell(key):
            values = [run[key] for run in runs]
            return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
        met = "met" if statistics.median([run["fb"] for run in runs]) < TARGET_SECONDS else "NOT met"
        forward = runs[0]["algorithm"].split(",")[0].replace("forward: ", "")
        print(f"{str(tree)[-28:]:<28} {c:>4} {forward:<18} {cell('import'):>16} {cell('fb'):>20} "
              f"{cell('process'):>16}  {met}")
    if args.json:
        Path(args.json).write_text(json.dumps([dict(tree=str(t), channels=c, runs=r) for (t, c), r in results.items()],
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
