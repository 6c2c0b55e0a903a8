"""``python -m dcn_cupy info``: versions, the CPU runtime, optional frameworks and devices.

Fast: optional frameworks are reported from their installed metadata, never imported; only
CuPy is imported, and only when installed, to list the CUDA devices.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from pathlib import Path

import numpy as np

__all__ = ["cuda_devices", "available_backends", "run"]

#: (label, distribution names to try): the first installed one is reported.
_OPTIONAL = (
    ("CuPy", ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy")),
    ("PyTorch", ("torch",)),
    ("torchvision", ("torchvision",)),
    ("JAX", ("jax",)),
    ("jaxlib", ("jaxlib",)),
    ("TensorFlow", ("tensorflow", "tensorflow-cpu", "tf-nightly")),
    ("Keras", ("keras",)),
    ("matplotlib", ("matplotlib",)),
    ("scikit-learn", ("scikit-learn",)),
)


def installed_version(*distributions: str):
    """``(distribution, version)`` of the first installed distribution, else None."""
    for name in distributions:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cuda_devices() -> list:
    """``[(index, name, "major.minor")]`` of the visible CUDA devices; [] when none or no CuPy."""
    try:
        import cupy

        devices = []
        for index in range(cupy.cuda.runtime.getDeviceCount()):
            props = cupy.cuda.runtime.getDeviceProperties(index)
            name = props["name"]
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            devices.append((index, name, f"{props['major']}.{props['minor']}"))
        return devices
    except Exception:
        return []


def available_backends() -> list:
    """``["cpu"]``, plus ``"cuda"`` when CuPy imports and sees at least one device."""
    return ["cpu"] + (["cuda"] if cuda_devices() else [])


def _cuda_versions() -> str:
    try:
        import cupy

        def fmt(v):
            return f"{v // 1000}.{(v % 1000) // 10}"

        runtime = cupy.cuda.runtime.runtimeGetVersion()
        driver = cupy.cuda.runtime.driverGetVersion()
        return f" (CUDA runtime {fmt(runtime)}, " + (f"driver {fmt(driver)})" if driver else "no CUDA driver)")
    except Exception as error:
        return f" (does not load: {type(error).__name__}: {str(error).splitlines()[0][:100]})"


def numba_cache_location() -> str:
    """Where the CPU backend keeps its compiled kernels between processes, and how to move it."""
    from ._backends import cpu

    folder = cpu.cache_location()
    if folder is None:
        return "off (DCN_CUPY_NUMBA_CACHE=0): every process compiles again"
    return f"{folder} (DCN_CUPY_NUMBA_CACHE sets another folder, 0 turns it off)"


def _threadpoolctl() -> str:
    found = installed_version("threadpoolctl")
    if found is None:
        return "NOT INSTALLED: BLAS and Numba threads compete on the CPU (2-4x slower); pip install threadpoolctl"
    return f"{found[1]} (holds BLAS to one thread inside the CPU kernels)"


def _numba() -> str:
    from ._backends import cpu

    describe = getattr(cpu, "threading_layer", None)
    if describe is not None:
        return describe()
    import numba
    return f"numba {numba.__version__}, {numba.get_num_threads()} threads"


def run(args=None) -> int:
    import dcn_cupy

    rows = [
        ("dcn_cupy", f"{dcn_cupy.__version__} ({Path(dcn_cupy.__file__).parent})"),
        ("Python", f"{platform.python_version()} ({sys.executable})"),
        ("Platform", platform.platform()),
        ("NumPy", np.__version__),
        ("Numba", _numba()),
        ("Numba cache", numba_cache_location()),
        ("threadpoolctl", _threadpoolctl()),
    ]
    found = installed_version("ml_dtypes")
    rows.append(("ml_dtypes", found[1] if found else "not installed"))
    for label, distributions in _OPTIONAL:
        found = installed_version(*distributions)
        if found is None:
            rows.append((label, "not installed"))
            continue
        name, version = found
        text = version if name == distributions[0] else f"{version} ({name})"
        if label == "CuPy":
            text += _cuda_versions()
        rows.append((label, text))
    width = max(len(label) for label, _ in rows)
    for label, text in rows:
        print(f"{label:<{width}}  {text}")

    print()
    print("Backends:")
    print("  cpu   Numba + NumPy (always available)")
    devices = cuda_devices() if installed_version(*_OPTIONAL[0][1]) else []
    if devices:
        print("  cuda  CuPy")
        for index, name, capability in devices:
            print(f"        device {index}: {name}, compute capability {capability}")
        try:
            from dcn_cupy._backends import cuda_source_dir
            print(f"        CUDA sources: {cuda_source_dir()}")
        except Exception as error:
            print(f"        CUDA sources: not found ({error})")
    else:
        print("  cuda  none (no CuPy or no visible CUDA device)")
    return 0
