"""Every CUDA kernel instantiation compiles through NVRTC (a library: no GPU needed).

Each module (one per dtype x N x index width, as the backend builds them) is compiled with
all of its name expressions to a cubin for an explicit architecture (``DCN_CUPY_NVRTC_ARCH``,
default ``sm_90``; ptxas runs too), with the same source text and options the backend hands
to ``cupy.RawModule``. The tests skip when CuPy, NVRTC or the CUDA headers are missing,
unless ``DCN_CUPY_REQUIRE_NVRTC`` is set (CI sets it), in which case they fail.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

ARCH = os.environ.get("DCN_CUPY_NVRTC_ARCH", "sm_90")


@pytest.fixture(scope="module")
def toolchain(nvrtc_toolchain):
    return nvrtc_toolchain


def _compile(nvrtc, source, names, options):
    program = nvrtc.createProgram(source, "dcn_cupy_kernels.cu", (), ())
    try:
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError:
            pytest.fail("NVRTC compilation failed:\n" + nvrtc.getProgramLog(program))
        lowered = {name: nvrtc.getLoweredName(program, name) for name in names}
        binary = nvrtc.getCUBIN(program) if options[-1].startswith("-arch=sm_") else nvrtc.getPTX(program)
        return lowered, binary, nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


def _module_keys():
    """The backend's module keys; one placeholder where the backend cannot import (no CuPy), so
    that collection never imports a missing CuPy and the test skips (or fails, if required)."""
    try:
        from dcn_cupy._backends import cuda
    except Exception as error:  # ImportError, or a broken CUDA installation
        return [pytest.param(None, id=f"backend-unavailable ({type(error).__name__})")]
    return cuda.all_module_keys()


def _key_id(key):
    if key is None:
        return "backend-unavailable"
    dtype, ndim, index64 = key
    return f"{np.dtype(dtype).name}-{ndim}d-{'i64' if index64 else 'i32'}"


def test_module_source_inlines_local_headers(toolchain):
    _, _, cuda = toolchain
    source = cuda.module_source()
    assert '#line 1 "cuda/dcn_common.cuh"' in source
    assert '#line 1 "cuda/deform_conv.cu"' in source
    # no local include is left for NVRTC to resolve (CuPy's cache key would not see it)
    assert not re.search(r'#\s*include\s+"', source)


@pytest.mark.parametrize("key", _module_keys(), ids=_key_id)
def test_every_instantiation_compiles(toolchain, key):
    nvrtc, _, cuda = toolchain
    names = cuda.name_expressions(*key)
    options = tuple(cuda.compile_options()) + (f"-arch={ARCH}",)
    lowered, binary, log = _compile(nvrtc, cuda.module_source(), names, options)
    assert len(lowered) == len(names) and all(lowered.values())
    assert len(binary) > 0
    assert "warning" not in log.lower(), log


def test_bias_gradient_kernel_compiles(toolchain):
    """``channel_sum`` and ``channel_sum_total`` (the plans' bias gradient, a module of its own)
    for every dtype."""
    nvrtc, _, cuda = toolchain
    names = [f"{k}<{t}>" for k in ("channel_sum", "channel_sum_total")
             for t in ("__half", "__nv_bfloat16", "float", "double")]
    options = tuple(cuda.compile_options()) + (f"-arch={ARCH}",)
    lowered, binary, log = _compile(nvrtc, cuda.channel_sum_source(), names, options)
    assert len(lowered) == len(names) and all(lowered.values())
    assert len(binary) > 0
    assert "warning" not in log.lower(), log


def test_bias_gradient_ranges_follow_the_shape_alone():
    """``channel_sum``'s ranges a channel (its summation order) are a function of the shape and
    dtype, not of the device: one for many channels or short rows, else enough blocks of at least
    one round of loads each."""
    cuda = pytest.importorskip("dcn_cupy._backends.cuda")   # CuPy installed; no device needed
    assert cuda.channel_sum_splits(8, 512, 3136, 2) == 1
    assert cuda.channel_sum_splits(16, 256, 4096, 4) == 1            # 1D: 256 channels fill the device
    assert cuda.channel_sum_splits(8, 128, 12544, 4) == 1            # 2D transposed: 128 channels
    assert cuda.channel_sum_splits(2, 32, 32 ** 3, 4) == 8           # 3D transposed: 32 channels
    assert cuda.channel_sum_splits(32, 64, 3136, 2) == 6
    assert cuda.channel_sum_splits(1, 4, 9, 8) == 1 and cuda.channel_sum_splits(0, 4, 9, 4) == 1
    for batch, channels, inner, itemsize in ((2, 32, 32 ** 3, 4), (5, 3, 50001, 2), (64, 1, 10 ** 6, 8)):
        splits = cuda.channel_sum_splits(batch, channels, inner, itemsize)
        chunks = batch * -(-inner // (16 // itemsize))
        assert 1 < splits and channels * splits <= cuda._CHANNEL_SUM_BLOCKS + channels
        assert chunks // splits >= 4 * cuda._CHANNEL_SUM_BLOCK * cuda._CHANNEL_SUM_MIN_ROUNDS


def test_every_kernel_is_instantiated_and_launched(toolchain):
    """The source defines exactly the kernels the module instantiates, and the backend launches
    each of them (no dead kernel variants)."""
    import inspect

    cuda = toolchain[2]
    defined = set(re.findall(r"__global__\s+void\s+(\w+)\s*\(", cuda.module_source()))
    for key in cuda.all_module_keys():
        instantiated = {name.split("<", 1)[0] for name in cuda.name_expressions(*key)}
        assert instantiated == defined, key
    launched = set(re.findall(r'\bkern\.get\(\s*"(\w+)"', inspect.getsource(cuda)))
    assert launched == defined


def test_compile_error_names_the_real_file(toolchain):
    """A broken kernel is reported against cuda/<file> thanks to the #line directives."""
    nvrtc, _, cuda = toolchain
    source = cuda.module_source().replace("using dcn::Traits;", "using dcn::Traits; int broken = undeclared;", 1)
    program = nvrtc.createProgram(source, "dcn_cupy_kernels.cu", (), ())
    try:
        with pytest.raises(nvrtc.NVRTCError):
            nvrtc.compileProgram(program, tuple(cuda.compile_options()) + (f"-arch={ARCH}",))
        assert "cuda/deform_conv.cu" in nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)
