"""Command line: ``python -m dcn_cupy {info,check,demo,bench}`` (also installed as ``dcn-cupy``).

``info``
    Versions of dcn_cupy, its dependencies and the optional frameworks (read from the installed
    metadata, nothing imported), the CPU runtime (Numba threads, its cache, threadpoolctl) and
    the CUDA devices.
``check [--device cpu|cuda|all] [--seed S] [-k TEXT]``
    Every public operation and gradient on every available backend against
    :mod:`dcn_cupy.reference`; prints one table; exits with 1 on any mismatch.
``demo [ARGS...]``
    Trains a small deformable CNN on distorted digits with the explicit forward/backward
    functions, against the same network with a plain convolution, and draws what it learned.
``bench [--plot FILE.png] [--json FILE] [ARGS...]``
    ``benchmarks/gpu.py`` on a CUDA machine, else ``benchmarks/cpu.py`` (source checkout).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dcn_cupy",
                                     description="dcn_cupy: framework-neutral deformable convolutions.")
    sub = parser.add_subparsers(dest="command", metavar="{info,check,bench,demo}")
    sub.required = True
    sub.add_parser("info", help="versions, CPU runtime, optional frameworks and available backends")
    check = sub.add_parser("check", help="check every operation and gradient against the reference")
    check.add_argument("--device", choices=("cpu", "cuda", "all"), default="all",
                       help="backend(s) to check (default: every available one)")
    check.add_argument("--seed", type=int, default=0, help="seed of the random test data (default 0)")
    check.add_argument("-k", "--select", action="append", default=[], metavar="TEXT",
                       help="only cases whose 'backend label dtype' contains TEXT (repeatable)")
    check.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing cases")
    sub.add_parser("bench", help="benchmarks/gpu.py on a CUDA machine, else benchmarks/cpu.py; --plot FILE.png "
                                 "draws it (other arguments go to the benchmark; try `bench --help`)",
                   add_help=False)
    sub.add_parser("demo", help="train a small deformable CNN on distorted digits and draw its sampling "
                                "positions (try `demo --help`)", add_help=False)
    return parser


def main(argv=None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # everything after `bench` belongs to the benchmark
        from . import _bench
        return _bench.run(argv[1:])
    if argv and argv[0] == "demo":  # everything after `demo` belongs to the demo
        from . import _demo
        return _demo.main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "info":
        from . import _info
        return _info.run(args)
    if args.command == "check":
        from . import _check
        return _check.run(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
