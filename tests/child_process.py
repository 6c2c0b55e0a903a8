"""Running test code in a fresh interpreter, for checks of process-wide state (imports, Numba's
threading layer, fork, the kernel cache, warnings issued once per process)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_python(code, *, env=None, timeout=300, cwd=None, check=True, prefix=()):
    """Run ``code`` in a fresh interpreter that imports this checkout; returns the CompletedProcess."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "DCN_CUPY_"))}
    environment["PYTHONPATH"] = str(REPO) + os.pathsep + str(REPO / "tests")
    environment.update(env or {})
    environment = {k: v for k, v in environment.items() if v is not None}
    result = subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(code)], env=environment,
                            capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if check:
        assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result
