"""Shared test configuration: the ``gpu`` marker skips where no CUDA device is visible, and the
NVRTC toolchain that the compile tests need (no GPU needed)."""

import os

import pytest

# JAX takes 75% of a GPU's memory at its first use unless told not to: with pytest-xdist workers
# side by side, the second one runs out of memory. Set here, before any test module imports JAX,
# so that any subset of the suite (not only one that happens to collect test_cuda.py first) runs.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

#: CI sets it: compile tests then fail, instead of skipping, where NVRTC or the headers are missing.
REQUIRE_NVRTC = bool(os.environ.get("DCN_CUPY_REQUIRE_NVRTC"))


def _unavailable(reason: str):
    if REQUIRE_NVRTC:
        pytest.fail(f"DCN_CUPY_REQUIRE_NVRTC is set but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def nvrtc_toolchain():
    """``(nvrtc, nvrtc_version, dcn_cupy._backends.cuda)``: CuPy's NVRTC binding and the CUDA
    backend module whose ``cuda_include_dirs()`` found the CUDA headers."""
    try:
        from cupy_backends.cuda.libs import nvrtc
        version = nvrtc.getVersion()
    except Exception as error:  # ImportError, or the NVRTC library not found
        _unavailable(f"CuPy/NVRTC is not available ({type(error).__name__}: {str(error)[:200]})")
    from dcn_cupy._backends import cuda
    if not cuda.cuda_include_dirs():
        _unavailable("the CUDA headers (cuda_fp16.h; the nvidia-cuda-runtime wheel) were not found")
    return nvrtc, version, cuda


@pytest.fixture(scope="session")
def compile_module(nvrtc_toolchain):
    """``compile_module(source, filename, names, arch=None)``: compile one module's instantiations
    to a cubin for ``arch`` (default ``DCN_CUPY_NVRTC_ARCH``, else sm_90; the wgmma modules:
    "sm_90a") with the backend's options, failing the test with NVRTC's log on an error, a
    missing lowered name, an empty cubin or a warning."""
    nvrtc, _, cuda = nvrtc_toolchain
    default_arch = os.environ.get("DCN_CUPY_NVRTC_ARCH", "sm_90")

    def compile_(source: str, filename: str, names, arch=None) -> None:
        program = nvrtc.createProgram(source, filename, (), ())
        try:
            for name in names:
                nvrtc.addNameExpression(program, name)
            try:
                nvrtc.compileProgram(program, tuple(cuda.compile_options()) + (f"-arch={arch or default_arch}",))
            except nvrtc.NVRTCError:
                pytest.fail("NVRTC compilation failed:\n" + nvrtc.getProgramLog(program))
            assert all(nvrtc.getLoweredName(program, name) for name in names)
            assert len(nvrtc.getCUBIN(program)) > 0
            assert "warning" not in nvrtc.getProgramLog(program).lower()
        finally:
            nvrtc.destroyProgram(program)

    return compile_


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
