"""The wheel ships the CUDA sources, and an installed (non-editable) copy finds them.

Builds the wheel from a snapshot of the build's inputs (so the checkout gets no build/ or
*.egg-info), checks that every file of ``cuda/`` is in it as ``dcn_cupy/cuda/<name>``, then
installs it with ``--no-deps`` into a fresh virtual environment and, from another working
directory, imports dcn_cupy there and asks it for its CUDA sources. Needs pip, venv and
setuptools>=77 (the ``test`` extra); no network.
"""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from snapshot import REPO, source_snapshot

pytestmark = pytest.mark.slow


def _run(command, **kwargs):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    result = subprocess.run([str(c) for c in command], env=env, capture_output=True, text=True, timeout=600,
                            **kwargs)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result


def _cuda_files(root: Path) -> dict:
    """``{relative posix path: bytes}`` of every file under ``root``."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``(snapshot_root, wheel_path)``: the wheel built from a snapshot of the repository."""
    tmp = tmp_path_factory.mktemp("packaging")
    source = source_snapshot(tmp / "src")
    wheels = tmp / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", wheels, source], cwd=tmp)
    found = sorted(wheels.glob("dcn_cupy-*.whl"))
    assert len(found) == 1, found
    return source, found[0]


def test_wheel_contains_every_cuda_source(built):
    source, wheel = built
    cuda = _cuda_files(source / "cuda")
    assert any(name.endswith(".cu") for name in cuda), f"no .cu file in {REPO / 'cuda'}"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        missing = [name for name in cuda if f"dcn_cupy/cuda/{name}" not in names]
        assert not missing, f"cuda/ files missing from {wheel.name}: {missing}"
        for name, content in cuda.items():
            assert archive.read(f"dcn_cupy/cuda/{name}") == content, name
    for module in ("__init__.py", "__main__.py", "_api.py", "reference.py", "_backends/__init__.py",
                   "_backends/cpu.py"):
        assert f"dcn_cupy/{module}" in names
    top = {name.split("/", 1)[0] for name in names}
    assert all(t == "dcn_cupy" or t.endswith(".dist-info") for t in top), top
    entry_points = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert entry_points
    with zipfile.ZipFile(wheel) as archive:
        assert "dcn-cupy = dcn_cupy.__main__:main" in archive.read(entry_points[0]).decode()


_PROBE = """
import json, sys
import dcn_cupy
from dcn_cupy._backends import cuda_source_dir
folder = cuda_source_dir()
files = sorted(str(p.relative_to(folder).as_posix()) for p in folder.rglob("*") if p.is_file())
print(json.dumps({"file": dcn_cupy.__file__, "cuda": str(folder), "files": files, "prefix": sys.prefix}))
"""


def test_installed_wheel_finds_its_cuda_sources(built, tmp_path):
    source, wheel = built
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", venv])
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    # When this interpreter is itself a virtual environment, --system-site-packages reaches the
    # base interpreter's packages, not ours: expose ours (numpy, numba, ...) with a .pth file.
    # Plain path lines only extend sys.path after the new environment's own site-packages (and
    # run no editable-install hooks), so the installed wheel still wins.
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    parent = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_parent_environment.pth").write_text("".join(f"{p}\n" for p in sorted(parent)))

    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", wheel])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = json.loads(_run([python, "-c", _PROBE], cwd=elsewhere).stdout.strip().splitlines()[-1])
    prefix = Path(probe["prefix"]).resolve()
    assert prefix == venv.resolve()
    assert Path(probe["file"]).resolve().is_relative_to(prefix), probe["file"]
    cuda = Path(probe["cuda"]).resolve()
    assert cuda.is_relative_to(prefix) and cuda.parent == Path(probe["file"]).resolve().parent, probe["cuda"]
    expected = sorted(_cuda_files(source / "cuda"))
    missing = sorted(set(expected) - set(probe["files"]))
    assert not missing, f"installed dcn_cupy/cuda lacks {missing}"
    for name in expected:
        assert (cuda / name).read_bytes() == (source / "cuda" / name).read_bytes(), name

    # The console script runs; `bench` explains that the benchmarks are not installed.
    script = venv / ("Scripts/dcn-cupy.exe" if os.name == "nt" else "bin/dcn-cupy")
    assert script.exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([script, "bench"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "not installed with the package" in result.stderr
