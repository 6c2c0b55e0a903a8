"""Shared test configuration: the ``gpu`` marker skips where no CUDA device is visible."""

import pytest


def _cuda_device_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    if _cuda_device_count() > 0:
        return
    skip = pytest.mark.skip(reason="no CUDA device visible (CuPy missing or no GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
