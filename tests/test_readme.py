"""Every Python example of the README runs as written, each in a fresh interpreter (Keras picks
its backend once per process), where the frameworks it imports are installed."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_OPTIONAL = ("torch", "jax", "tensorflow", "keras", "cupy", "matplotlib", "sklearn")
_KERAS_BACKENDS = ("tensorflow", "jax", "torch")


def _blocks():
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    heading = {}
    for match in re.finditer(r"```python\n", text):
        titles = re.findall(r"^## (.+)$", text[:match.start()], flags=re.M)
        heading[match.start()] = titles[-1] if titles else "top"
    return list(zip(heading.values(), blocks))


def _imports(block: str) -> set:
    names = re.findall(r"^\s*(?:import|from)\s+([A-Za-z_][\w]*)", block, flags=re.M)
    names += re.findall(r"^\s*import\s+[\w.]+\s*,\s*([A-Za-z_]\w*)", block, flags=re.M)
    return {n for n in names if n in _OPTIONAL}


def test_readme_has_an_example_per_framework():
    titles = [title for title, _ in _blocks()]
    for section in ("Example (NumPy)", "PyTorch", "JAX", "TensorFlow", "Keras 3"):
        assert section in titles, titles


@pytest.mark.parametrize("title, block", _blocks(), ids=[t for t, _ in _blocks()])
def test_readme_example_runs(title, block, tmp_path):
    missing = sorted(n for n in _imports(block) if importlib.util.find_spec(n) is None)
    if missing:
        pytest.skip(f"the {title} example needs {', '.join(missing)}, which is not installed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        TF_CPP_MIN_LOG_LEVEL="2")
    if "keras" in _imports(block) and "KERAS_BACKEND" not in os.environ:
        backend = next((b for b in _KERAS_BACKENDS if importlib.util.find_spec(b) is not None), None)
        if backend is None:
            pytest.skip("the Keras example needs one Keras backend (TensorFlow, JAX or PyTorch)")
        env["KERAS_BACKEND"] = backend
    script = tmp_path / "example.py"
    script.write_text(block)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"README example '{title}' failed:\n{result.stdout}\n{result.stderr[-6000:]}"
