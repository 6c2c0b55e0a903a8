"""``python -m dcn_cupy bench``: run the benchmark script that fits this machine, optionally plot it.

``benchmarks/gpu.py`` on a CUDA machine with PyTorch (it times torchvision and cuDNN side by
side), else ``benchmarks/cpu.py``; both live in the source checkout, next to the package.
Results are written only where asked (``--json PATH``); ``--plot FILE.png`` draws them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
import tempfile
from pathlib import Path

__all__ = ["benchmarks_dir", "load_script", "run"]


def benchmarks_dir() -> Path:
    """``benchmarks/`` of the source checkout this package was imported from (may not exist)."""
    import dcn_cupy

    return Path(dcn_cupy.__file__).resolve().parent.parent / "benchmarks"


def load_script(path: Path, name: str):
    """Import a benchmark script by path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def _choose(folder: Path):
    """``("GPU"|"CPU", path)``, saying why when a GPU is visible but its benchmark cannot run."""
    from ._info import cuda_devices

    if cuda_devices():
        gpu = folder / "gpu.py"
        if not gpu.is_file():
            print(f"A CUDA device is visible but {gpu} is missing: falling back to the CPU benchmark.", flush=True)
        elif not torch_installed():
            print("A CUDA device is visible but PyTorch is not installed, which the GPU benchmark needs: "
                  "falling back to the CPU benchmark.", flush=True)
        else:
            return "GPU", gpu
    else:
        print("No CUDA device visible (or CuPy missing): running the CPU benchmark.", flush=True)
    return "CPU", folder / "cpu.py"


def _split_plot(argv: list):
    """``(plot path or None, remaining argv)``: ``--plot FILE`` / ``--plot=FILE`` belong to the CLI."""
    plot, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--plot":
            if i + 1 >= len(argv):
                raise SystemExit("error: --plot needs a file name, e.g. --plot bench.png")
            plot, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--plot="):
            plot = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return plot, rest


def _json_argument(argv: list):
    for i, arg in enumerate(argv):
        if arg == "--json" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--json="):
            return arg.split("=", 1)[1]
    return None


class _Without(io.TextIOBase):
    """A stdout that drops the lines mentioning ``text``."""

    def __init__(self, stream, text: str):
        self.stream, self.text, self.pending = stream, text, ""

    def write(self, data: str) -> int:
        self.pending += data
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if self.text not in line:
                self.stream.write(line + "\n")
        return len(data)

    def flush(self) -> None:
        if self.pending and self.text not in self.pending:
            self.stream.write(self.pending)
            self.pending = ""
        self.stream.flush()


def run(argv: list) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: python -m dcn_cupy bench [--plot FILE.png] [--json FILE.json] [BENCHMARK ARGS...]\n"
              "Runs benchmarks/gpu.py on a CUDA machine with PyTorch, else benchmarks/cpu.py; the other\n"
              "arguments go to the benchmark (its own help follows where the checkout has it).\n")
    try:
        plot, argv = _split_plot(list(argv))
    except SystemExit as error:
        print(error, file=sys.stderr)
        return 2
    if plot is not None:
        from . import _plot
        missing = _plot.missing_dependency()
        if missing:
            print(missing, file=sys.stderr)
            return 2

    folder = benchmarks_dir()
    if not folder.is_dir():
        print(f"The benchmarks are not installed with the package: {folder} does not exist. "
              f"Run `python -m dcn_cupy bench` from a source checkout of dcn_cupy "
              f"(the benchmarks/ folder next to the dcn_cupy/ package).", file=sys.stderr)
        return 2
    kind, path = _choose(folder)
    if not path.is_file():
        print(f"The {kind} benchmark {path} is missing.", file=sys.stderr)
        return 2

    json_path, scratch = _json_argument(argv), None
    if plot is not None and json_path is None:  # the plot needs the numbers: keep them in a scratch file
        handle, json_path = tempfile.mkstemp(prefix="dcn_cupy_bench_", suffix=".json")
        os.close(handle)
        scratch = json_path
        argv = argv + ["--json", json_path]
    try:
        module = load_script(path, f"_dcn_cupy_benchmark_{kind.lower()}")
        if scratch is None:
            result = module.main(list(argv))
        else:  # the scratch file is the CLI's business: do not announce it
            quiet = _Without(sys.stdout, scratch)
            with contextlib.redirect_stdout(quiet):
                result = module.main(list(argv))
            quiet.flush()
        status = int(result) if isinstance(result, int) else 0
        if plot is not None and status == 0:
            from . import _plot
            _plot.plot_file(json_path, plot)
            print(f"wrote {plot}")
        return status
    finally:
        if scratch is not None:
            os.unlink(scratch)
