"""A copy of what the wheel is built from, for the tests that build one.

Copies only the build's inputs (``pyproject.toml``, ``README.md``, ``dcn_cupy/``, ``cuda/``),
never the whole checkout: CI keeps its virtual environments (``.venv``, ``.venv-readme``,
4 GB) inside the clone, and a copy of the clone filled the CI machine's disk.
"""

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: What ``pip wheel`` reads: ``pyproject.toml`` names the README and the two source folders.
BUILD_INPUTS = ("pyproject.toml", "README.md", "dcn_cupy", "cuda")

_CACHES = shutil.ignore_patterns("__pycache__", "*.pyc", "*.nbi", "*.nbc", "*.egg-info")


def source_snapshot(destination: Path) -> Path:
    """Copy the build inputs of the repository into ``destination`` (created) and return it."""
    destination.mkdir(parents=True)
    for name in BUILD_INPUTS:
        origin = REPO / name
        if origin.is_dir():
            shutil.copytree(origin, destination / name, ignore=_CACHES)
        else:
            shutil.copy2(origin, destination / name)
    return destination
