"""The fused forward ("cuda/fused"): NVRTC compilation of every instantiation (no GPU needed),
then, on a GPU, the kernel forced (``fused_conv_forward``, or a given tile of either engine,
mma.sync or wgmma, in either step order) against the float64 reference, the CPU backend and
torchvision, for N = 1, 2, 3, both samplers (16-byte vectors and per channel), groups, offset
groups != mask groups, stride / padding / dilation, with and without offset / mask / bias,
non-finite and huge offsets, non-finite inputs, a broadcast batch, one-sample chunks, 64-bit
indices, and the transposed backward-to-input. float32 is tested in TF32 and 3xTF32 (both of
which plans consider on compute capability 9.0, the wgmma tiles); plans replay recorded
launches.

Tolerances (relative error in the norm): float16 3e-3 and bfloat16 2.4e-2 as for cuda/im2col
(inputs rounded once, samples rounded once to the half type, output rounded once); TF32 3e-3
(both operands rounded to 10 mantissa bits); strict float32 (3xTF32) 1e-5: the split keeps
about 21 bits of each operand, float32 accumulation.
"""

from __future__ import annotations

import itertools
import math
import os
import re

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest

from dcn_cupy import _geometry, reference
from dcn_cupy._interop import BFLOAT16

from cases import fractional_offsets, random_case, relative_error, tf32_rounded

ARCH = os.environ.get("DCN_CUPY_NVRTC_ARCH", "sm_90")

TOL = {"float16": 3e-3, "bfloat16": 2.4e-2, "tf32": 3e-3, "float32": 1e-5}
DTYPE = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "tf32": np.dtype(np.float32),
         "float32": np.dtype(np.float32)}
PRECISIONS = tuple(TOL)
#: The kernels' PREC of each precision (0 the half type's own MMA, 1 TF32, 2 3xTF32).
PREC = {"float16": 0, "bfloat16": 0, "tf32": 1, "float32": 2}


# ---------------------------------------------------------------------------------------------
# compilation (no GPU)


def _fused():
    pytest.importorskip("cupy")
    from dcn_cupy._backends import cuda_fused
    return cuda_fused


@pytest.fixture(scope="module")
def toolchain(nvrtc_toolchain):
    nvrtc, _, cuda = nvrtc_toolchain
    from dcn_cupy._backends import cuda_fused
    return nvrtc, cuda, cuda_fused


def _module_keys():
    try:
        from dcn_cupy._backends import cuda_fused
    except ImportError:
        return []
    return cuda_fused.all_module_keys()


def _key_id(key):
    dtype, ndim, index64, engine = key
    return f"{np.dtype(dtype).name}-{ndim}d-{'i64' if index64 else 'i32'}-{('mma', 'wgmma', 'pipeline', 'wgmma-ws')[engine]}"


def _compile_module(key):
    """NVRTC-compile one module to a cubin: (error log or None, lowered names, cubin size, log)."""
    from dcn_cupy._backends import cuda_fused as fused
    arch = fused.SM90A if key[3] in fused.WGMMA_ENGINES else f"-arch={ARCH}"
    return _compile_source(fused.module_source(), fused.name_expressions(*key), arch)


def _compile_source(source, names, arch):
    """NVRTC-compile module text with its name expressions for one architecture option: (error
    log or None, lowered names, cubin size, log)."""
    from cupy_backends.cuda.libs import nvrtc
    from dcn_cupy._backends import cuda
    program = nvrtc.createProgram(source, "dcn_cupy_fused.cu", (), ())
    try:
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, tuple(cuda.compile_options()) + (arch,))
        except nvrtc.NVRTCError:
            return nvrtc.getProgramLog(program), {}, 0, ""
        lowered = {name: nvrtc.getLoweredName(program, name) for name in names}
        return None, lowered, len(nvrtc.getCUBIN(program)), nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


@pytest.fixture(scope="module")
def compiled(toolchain):
    """Every module compiled once, in parallel processes (each module takes 10-40 s)."""
    from concurrent.futures import ProcessPoolExecutor
    keys = _module_keys()
    with ProcessPoolExecutor(max(1, min(len(keys), os.cpu_count() or 1))) as pool:
        return dict(zip(keys, pool.map(_compile_module, keys)))


@pytest.mark.parametrize("key", _module_keys(), ids=_key_id)
def test_every_fused_instantiation_compiles(compiled, key):
    error, lowered, size, log = compiled[key]
    if error is not None:
        pytest.fail("NVRTC compilation failed:\n" + error)
    from dcn_cupy._backends import cuda_fused as fused
    assert set(lowered) == set(fused.name_expressions(*key)) and all(lowered.values())
    assert size > 0
    assert "warning" not in log.lower(), log


def test_fused_source_defines_exactly_the_instantiated_kernels():
    fused = _fused()
    source = fused.module_source()
    assert '#line 1 "cuda/deform_fused.cu"' in source and '#line 1 "cuda/dcn_common.cuh"' in source
    defined = set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(", source))
    for key in fused.all_module_keys():
        assert {name.split("<", 1)[0] for name in fused.name_expressions(*key)} == defined
        # ..., UNIFORM, ENGINE[, DEPTH[, THREADS[, PLAN: 1 the sampling plan, 2 the warps' corner
        # batches, 3 those with two steps of loads in flight[, PERSIST]]]]>
        assert all(re.search(rf", (true|false), {key[3]}(, [1-9](, (256|384|448|512|640|768)"
                             rf"(, [123]|, [012], true)?)?)?>$", name)
                   for name in fused.name_expressions(*key) if name.startswith("deform_fused_forward"))


#: Experiment switches of cuda/deform_fused.cu (benchmarks/fused_variants.py prepends them) with
#: the kernels each is for, tiles outside TILES among them: they must keep compiling cleanly.
EXPERIMENTS = {
    "loads-ahead": ({"DCN_FUSED_LOADS_AHEAD": 2, "DCN_FUSED_AHEAD_REGS": 88}, (
        "deform_fused_forward<__half, int, 2, 0, 64, 64, 32, 2, true, 3, 4, 384, 2>",
        "deform_fused_forward<float, int, 2, 1, 64, 64, 16, 2, true, 3, 4, 384, 2>",
        "deform_fused_forward<__half, int, 2, 0, 256, 64, 64, 1, true, 3, 4, 512, 2>",
        "deform_fused_forward<float, int, 3, 2, 256, 64, 16, 1, true, 3, 4, 512>")),
    "ws-no-mma": ({"DCN_FUSED_WS_EXPERIMENT": 1}, (
        "deform_fused_forward<__half, int, 2, 0, 64, 64, 64, 2, true, 3, 4, 384, 2>",)),
    # the samplers' last step peeled in every dtype (the default: the half types only), or in none
    "peel-every-dtype": ({"DCN_FUSED_PEEL_LAST_STEP": 1}, (
        "deform_fused_forward<float, int, 2, 1, 256, 64, 32, 1, true, 3, 4, 512, 2>",
        "deform_fused_forward<float, int, 2, 2, 256, 64, 16, 1, true, 3, 4, 512, 1>")),
    "peel-none": ({"DCN_FUSED_PEEL_LAST_STEP": 0}, (
        "deform_fused_forward<__half, int, 2, 0, 256, 64, 64, 1, true, 3, 4, 512, 2>",
        "deform_fused_forward<__nv_bfloat16, int, 3, 0, 64, 64, 64, 2, true, 3, 4, 384, 2>")),
    # 3xTF32's products joining the accumulators every step (the default: every 64 channels)
    "promote-every-step": ({"DCN_FUSED_PROMOTE_CHANNELS": 16}, (
        "deform_fused_forward<float, int, 2, 2, 256, 64, 16, 1, true, 3, 4, 512, 1>",
        "deform_fused_forward<float, int, 2, 2, 64, 64, 32, 2, true, 3, 4, 384, 1>")),
    # 512 samplers (768 threads) at the launch's registers, their MMA warpgroups spilling (the A/B's other side)
    "wide-sampler-regs-none": ({"DCN_FUSED_WIDE_SAMPLER_REGS": 0}, (
        "deform_fused_forward<__half, int, 2, 0, 256, 64, 64, 1, true, 3, 4, 768, 2>",
        "deform_fused_forward<float, int, 2, 1, 256, 64, 32, 1, true, 3, 4, 768, 2>")),
    # ENGINE 3's 3xTF32 MMAs as two m64n64, the output channels as M (the default: one m64n128, the
    # positions as M; PLAN 3 and PLAN 0, 1D and 2D)
    "position-rows-off": ({"DCN_FUSED_POSITION_ROWS": 0}, (
        "deform_fused_forward<float, int, 2, 2, 256, 64, 16, 1, true, 3, 4, 512, 3>",
        "deform_fused_forward<float, int, 1, 2, 256, 64, 16, 1, true, 3, 4, 512>")),
    "row-phases-off": ({"DCN_FUSED_ROW_PHASES": 0}, (
        "deform_fused_forward<__half, int, 2, 0, 256, 64, 64, 1, true, 3, 4, 512, 2>",
        "deform_fused_forward<float, int, 3, 1, 64, 64, 32, 2, true, 3, 4, 384, 2>")),
    # the channels-last copy held to 6 blocks an SM (40 registers; the default 4)
    "layout-min-blocks-6": ({"DCN_LAYOUT_MIN_BLOCKS": 6}, (
        "fused_channels_last<__half, int>", "fused_channels_last<float, long long>")),
}


@pytest.mark.parametrize("experiment", sorted(EXPERIMENTS))
def test_experiment_switches_compile(toolchain, experiment):
    _, _, fused = toolchain
    defines, names = EXPERIMENTS[experiment]
    source = "".join(f"#define {name} {value}\n" for name, value in defines.items()) + fused.module_source()
    error, lowered, size, log = _compile_source(source, names, fused.SM90A)
    if error is not None:
        pytest.fail(f"{experiment}: NVRTC compilation failed:\n" + error)
    assert set(lowered) == set(names) and all(lowered.values())
    assert size > 0
    assert "warning" not in log.lower(), log


class _Spec:
    def __init__(self, dtype, device="cuda", geom=None):
        self.dtype, self.device, self.geom, self.device_id, self.allow_tf32 = np.dtype(dtype), device, geom, 0, False
        self.deterministic = False


def test_serves_rule(monkeypatch):
    fused = _fused()
    monkeypatch.setattr(fused, "fused_versus_im2col", lambda *a: None)   # no measurement: the rule
    backend = fused.BACKEND
    assert backend.device == "cuda" and backend.algorithm == "fused" and backend.priority > 10
    assert "float64 stays on cuda/im2col" in backend.serves(_Spec(np.float64), "conv_forward")
    monkeypatch.setattr(fused, "_compute_capability", lambda device_id: 80)
    assert "measured slower than cuda/im2col" in backend.recommends(_Spec(np.float32), "conv_forward")
    assert backend.recommends(_Spec(np.float16), "conv_forward") is None
    assert backend.primitives == ("conv_forward",)
    assert "only the forward" in backend.serves(_Spec(np.float32), "conv_backward")
    assert "CUDA" in backend.serves(_Spec(np.float32, device="cpu"), "conv_forward")


def test_float32_is_considered_on_compute_capability_9(monkeypatch):
    """float32, through TF32 or strict (3xTF32), is timed against cuda/im2col (and taken
    without a measurement) on compute capability 9.0 only (the wgmma tiles)."""
    fused = _fused()
    monkeypatch.setattr(fused, "fused_versus_im2col", lambda *a: None)
    g = _geom((8, 256, 56, 56), (256, 256, 3, 3), (8, 18, 56, 56), (8, 9, 56, 56), padding=1)
    tf32 = _Spec(np.float32, geom=g)
    tf32.allow_tf32 = True
    monkeypatch.setattr(fused, "_compute_capability", lambda device_id: 90)
    assert fused.BACKEND.recommends(tf32, "conv_forward") is None
    assert fused.BACKEND.recommends(_Spec(np.float32, geom=g), "conv_forward") is None
    # strict float32 only where a warp-specialised tile serves (mma.sync's 3xTF32 is slower than
    # cuda/im2col): 16 offset groups of 4 channels need the per-channel sampler (mma.sync)
    g4 = _geom((2, 64, 9, 9), (64, 64, 3, 3), (2, 16 * 18, 9, 9), padding=1)
    assert "only on the warp-specialised tiles" in fused.BACKEND.recommends(_Spec(np.float32, geom=g4),
                                                                            "conv_forward")
    tf32_g4 = _Spec(np.float32, geom=g4)
    tf32_g4.allow_tf32 = True
    assert fused.BACKEND.recommends(tf32_g4, "conv_forward") is None
    assert all(tile[4] == 3 for tile in fused._candidates(g, np.float32, True, False, 2))
    assert all(tile[4] == 0 for tile in fused._candidates(g4, np.float32, True, False, 2))
    monkeypatch.setattr(fused, "_compute_capability", lambda device_id: 80)
    assert "TF32 measured slower than cuda/im2col below compute capability 9.0 (got 8.0" in \
        fused.BACKEND.recommends(tf32, "conv_forward")
    assert "3xTF32 (strict float32) measured slower than cuda/im2col below compute capability 9.0" in \
        fused.BACKEND.recommends(_Spec(np.float32), "conv_forward")

    def no_device(device_id):
        raise RuntimeError("no device")

    monkeypatch.setattr(fused, "_compute_capability", no_device)
    assert "no CUDA device 0" in fused.BACKEND.recommends(tf32, "conv_forward")


def test_recommends_without_a_device_falls_back_to_the_rule():
    """With CuPy but no usable CUDA device (CI), nothing is measured and the half types take
    the fused kernel by the rule."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a CUDA device is present")
    except cupy.cuda.runtime.CUDARuntimeError:
        pass
    assert _fused().BACKEND.recommends(_Spec(np.float16), "conv_forward") is None


@pytest.mark.gpu
def test_serves_the_half_types_and_float32_on_the_gpu():
    cupy = _cupy()
    fused = _fused()
    for dtype in (np.float16, BFLOAT16):
        reason = fused.BACKEND.serves(_Spec(dtype), "conv_forward")
        assert (reason is None) == (int(cupy.cuda.Device(0).compute_capability) >= 80)


def _geom(x_shape, w_shape, off_shape=None, m_shape=None, b_shape=None, **params):
    return _geometry.conv_geometry(x_shape, w_shape, off_shape, m_shape, b_shape, **params)[0]


def _case_geom(arrays: dict, params: dict, **extra):
    """The geometry of a case's ``arrays`` (input, weight, offset, mask, bias; absent or None: not
    given) and ``params``."""
    return _geom(*(None if arrays.get(k) is None else arrays[k].shape
                   for k in ("input", "weight", "offset", "mask", "bias")), **params, **extra)


def test_sampling_plan_rule():
    """The plan serves the 16-byte sampler of engines 0 and 1 with at most MAX_PLAN_SEGMENTS
    segments, only when asked (the tuner times both); its rows and weights are in the workspace."""
    fused = _fused()
    g = _geom((8, 256, 56, 56), (256, 256, 3, 3), (8, 18, 56, 56), (8, 9, 56, 56), padding=1)
    assert fused.plan_segments(g) == (256, 1)
    tile = fused._tiles(np.float16)[0]
    off = fused.LaunchConfig(g, np.float16, False, 132, tile=tile)
    on = fused.LaunchConfig(g, np.float16, False, 132, tile=tile, sampling_plan=True)
    assert not off.sampling_plan and on.sampling_plan and "sampling plan" in on.description
    assert on.workspace_bytes >= off.workspace_bytes + 8 * 56 * 56 * 9 * 4 * 8   # 8 bytes per corner
    assert fused.kernel_name(np.float16, False, 2, 0, tile, True, True).endswith(", 0, 1, 256, 1>")
    # per-channel sampling (a thread's channels cross a group: C/G_o = 12) and too many segments: none
    g12 = _geom((2, 24, 8, 8), (16, 24, 3, 3), (2, 2 * 18, 8, 8), (2, 9, 8, 8), padding=1)
    c = fused.LaunchConfig(g12, np.float16, False, 132, sampling_plan=True)
    assert not c.uniform and not c.sampling_plan
    g16 = _geom((2, 256, 8, 8), (16, 256, 3, 3), (2, 16 * 18, 8, 8), (2, 9, 8, 8), padding=1)
    assert fused.plan_segments(g16) == (16, 16)
    assert not fused.LaunchConfig(g16, np.float16, False, 132, sampling_plan=True).sampling_plan


def test_sampling_plan_chunks_keep_it_within_the_channels_last_copy():
    """With the plan, a chunk holds at most as many samples as keep the plan (8 bytes per corner:
    segments x taps x corners a position) within the whole batch's channels-last copy, in chunks
    of balanced sizes; without it, or where it is smaller than a sample's copy, chunks are as
    before."""
    fused = _fused()
    tile = fused._tiles(np.float16)[0]

    def chunk(geom, dtype, plan):
        c = fused.LaunchConfig(geom, dtype, False, 132, tile=tile, sampling_plan=plan)
        assert c.sampling_plan == plan
        plan_bytes = c.chunk * geom.output_size * c.segments * geom.kernel_volume * (1 << geom.ndim) * 8
        assert not plan or c.chunk == 1 or plan_bytes <= geom.batch * geom.input_size * c.Cp * c.itemsize
        return c.chunk

    c64 = _geom((32, 64, 56, 56), (64, 64, 3, 3), (32, 18, 56, 56), (32, 9, 56, 56), padding=1)
    # 9 taps x 4 corners x 8 bytes = 288 bytes a position, against C x itemsize = 128 (fp16), 256
    assert chunk(c64, np.float16, False) == 32 and chunk(c64, np.float32, False) == 32
    assert chunk(c64, np.float16, True) == 11      # at most 14: 11 + 11 + 10
    assert chunk(c64, np.float32, True) == 16      # at most 28: 16 + 16
    assert chunk(c64.with_batch(1), np.float16, True) == 1
    c256 = _geom((8, 256, 56, 56), (256, 256, 3, 3), (8, 18, 56, 56), (8, 9, 56, 56), padding=1)
    assert chunk(c256, np.float16, True) == chunk(c256, np.float16, False) == 8   # 288 <= 512
    three_d = _geom((2, 32, 16, 16, 16), (32, 32, 3, 3, 3), (2, 81, 16, 16, 16), (2, 27, 16, 16, 16), padding=1)
    assert chunk(three_d, np.float16, True) == 1   # 27 x 8 x 8 = 1728 bytes against 64


def test_launch_config_choices(monkeypatch):
    fused = _fused()
    # the benchmark shape: uniform sampler, 128-channel tiles, 32-bit indices, bounded workspace
    g = _geom((8, 256, 56, 56), (256, 256, 3, 3), (8, 18, 56, 56), (8, 9, 56, 56), padding=1)
    c = fused.LaunchConfig(g, np.float16, False, 132)
    assert (c.uniform, c.tile[0], c.precision, c.index64, c.chunk) == (True, 256, 0, False, 8)
    assert c.workspace_bytes >= 8 * 56 * 56 * 256 * 2 + 256 * 9 * 256 * 2
    assert fused.LaunchConfig(g, np.float32, True, 132).precision == 1
    assert fused.LaunchConfig(g, np.float32, False, 132).precision == 2
    # untuned, wgmma first (warp-specialised where its 16-byte sampler serves; 3xTF32 too, in
    # the tallest tile whose ring of twice-as-long stages fits), else mma.sync
    assert fused.LaunchConfig(g, np.float16, False, 132, wgmma=True).tile[4] == 3
    assert fused.LaunchConfig(g, np.float32, True, 132, wgmma=True).tile[4] == 3
    strict = fused.LaunchConfig(g, np.float32, False, 132, wgmma=True)
    assert strict.tile[:5] == (256, 64, 16, 1, 3) and strict.depth == 4 and strict.smem_bytes == 160 * 1024
    assert fused.LaunchConfig(g, np.float32, False, 132).tile[4] == 0
    assert fused.pipeline_depth(np.float32, 2, (256, 64, 32, 1, 3, 512), 2) == 0   # 3 stages of 80 KiB: too long
    # the 768-thread tiles (512 samplers at 72 registers): 1D and 2D kernels, no 3D ones, no 3xTF32
    wide = (256, 64, 64, 1, 3, 768)
    assert wide in fused.TILES["half"] and fused.tile_samplers(wide) == fused.WIDE_SAMPLERS
    assert [fused.tile_builds(np.float16, n, wide, 0) for n in (1, 2, 3)] == [True, True, False]
    assert not fused.tile_builds(np.float32, 2, (256, 64, 32, 1, 3, 768), 2)
    assert all(t != wide for t in fused._candidates(
        _geom((2, 256, 8, 8, 8), (256, 256, 3, 3, 3), (2, 81, 8, 8, 8), padding=1), np.float16, True))
    with pytest.raises(ValueError, match=r"has no 3-d kernel: its 512 samplers \(WIDE_SAMPLERS = 512 or more\)"):
        fused.LaunchConfig(_geom((2, 256, 8, 8, 8), (256, 256, 3, 3, 3), padding=1), np.float16, False, 132,
                           tile=wide)
    # 32-channel offset groups: not ENGINE 3 (each of its steps' 64-channel chunks in one group)
    g32 = _geom((8, 256, 56, 56), (256, 256, 3, 3), (8, 8 * 18, 56, 56), (8, 9, 56, 56), padding=1)
    assert fused.LaunchConfig(g32, np.float16, False, 132, wgmma=True).tile[4] == 1
    assert not fused.tile_serves(g32, np.float16, (256, 64, 64, 1, 3, 512))
    assert fused.tile_serves(g32, np.float16, (64, 128, 32, 1, 3, 384))   # 32-channel steps
    # 64 output channels per group: 64-channel tiles; 3 channels: per-channel sampler
    g = _geom((2, 64, 9, 9), (64, 32, 3, 3), groups=2)
    assert fused.LaunchConfig(g, np.float16, False, 132).tile[0] == 64
    g = _geom((2, 6, 9, 9), (4, 3, 3, 3), (2, 36, 7, 7), (2, 9, 7, 7), groups=2)
    assert not fused.LaunchConfig(g, np.float16, False, 132).uniform
    # offset groups of 8 channels split a float16 thread's 16: per-channel sampler
    g = _geom((2, 64, 9, 9), (8, 64, 3, 3), (2, 8 * 18, 7, 7))
    assert not fused.LaunchConfig(g, np.float16, False, 132).uniform
    assert fused.LaunchConfig(g, np.float32, False, 132).uniform
    with pytest.raises(ValueError, match="float16, bfloat16 and float32"):
        fused.LaunchConfig(g, np.float64, False, 132)
    # a tile without the per-channel sampler is refused where one is needed
    with pytest.raises(ValueError, match="has no per-channel sampler"):
        fused.LaunchConfig(g, np.float16, False, 132, tile=fused.TILES["half"][1])
    with pytest.raises(ValueError, match="not 3xTF32"):
        fused.LaunchConfig(g, np.float32, False, 132, tile=fused.TILES["float"][3])
    # 64 output channels: 64-row tiles, the warp-specialised ones with one MMA warpgroup
    g64 = _geom((32, 64, 56, 56), (64, 64, 3, 3), (32, 18, 56, 56), (32, 9, 56, 56), padding=1)
    assert all(tile[0] == 64 for tile in fused._candidates(g64, np.float32, True, False, 2))
    assert [tile for tile in fused._candidates(g64, np.float32, True, False, 2) if tile[4] == 3] == [
        (64, 64, 32, 2, 3, 384), (64, 64, 32, 1, 3, 384)]
    assert {tile for tile in fused._candidates(g64, np.float16, True) if tile[4] == 3} == {
        (64, 64, 64, 2, 3, 384), (64, 128, 32, 1, 3, 384)}
    assert all(tile[4] != 3 for tile in fused._candidates(g64, np.float16, False))
    strict64 = fused.LaunchConfig(g64, np.float32, False, 132, wgmma=True)
    # a ring of a tile asking 2 blocks per multiprocessor fits half of one: 3 stages of 32 KiB in 3xTF32
    assert strict64.tile == (64, 64, 32, 2, 3, 384) and strict64.depth == 3 and strict64.smem_bytes == 96 * 1024
    assert fused.tile_mma_threads(strict64.tile) == 128 and fused.tile_samplers(strict64.tile) == 256
    assert fused.pipeline_depth(np.float32, 2, (64, 64, 32, 2, 3, 384), 1) == 4
    # the same tile at one block per SM (a ring of 4 stages in 3xTF32 too): the descriptions tell them apart
    one_block = fused.LaunchConfig(g64, np.float32, False, 132, tile=(64, 64, 32, 1, 3, 384), wgmma=True)
    assert one_block.depth == 4 and "tile 64x64x32 (384 threads, 1 block per SM)" in one_block.description
    assert "tile 64x64x32 (384 threads, 2 blocks per SM)" in strict64.description
    # persistent blocks: kernels of ENGINE 3 with two MMA warpgroups, not 3xTF32, 32-bit indices;
    # untuned, the rule takes them in the half types where a chunk's tiles outnumber the blocks
    # the device holds at once; a grid of at most PERSISTENT_BLOCKS (or those blocks)
    assert fused.tile_persists((256, 64, 64, 1, 3, 768), 0) and fused.tile_persists((256, 64, 32, 1, 3, 512), 1)
    assert not fused.tile_persists((256, 64, 16, 1, 3, 512), 2)
    assert not fused.tile_persists((64, 64, 64, 2, 3, 384), 0) and not fused.tile_persists((256, 64, 64, 1, 0, 512), 0)
    assert not strict.persistent and not strict64.persistent and "persistent" not in strict.description
    g = _geom((8, 256, 56, 56), (256, 256, 3, 3), (8, 18, 56, 56), (8, 9, 56, 56), padding=1)
    wide32 = (256, 64, 32, 1, 3, 768)
    c = fused.LaunchConfig(g, np.float16, False, 132, tile=wide)
    assert c.persistent and c.steps == 36 and "persistent blocks" in c.description and c.blocks(8) == 392
    assert fused.kernel_name(np.float16, False, 2, 0, wide, True, 0, True).endswith(", 4, 768, 0, true>")
    assert not fused.LaunchConfig(g, np.float16, False, 132, tile=wide, persistent=False).persistent
    assert not fused.LaunchConfig(g, np.float16, False, 392, tile=wide).persistent   # one wave
    assert not fused.LaunchConfig(g, np.float32, True, 132, tile=wide32).persistent     # TF32: tuned only
    assert fused.LaunchConfig(g, np.float32, True, 132, tile=wide32, persistent=True).persistent
    names = fused.name_expressions(np.float16, 2, False, 3)
    assert sum(name.endswith(", true>") for name in names) == 3 * sum(
        fused.tile_persists(t, 0) for t in fused.TILES["half"])   # (every PLAN)
    assert not any(name.endswith(", true>") for name in fused.name_expressions(np.float16, 2, True, 3))
    monkeypatch.setattr(fused, "PERSISTENT_BLOCKS", 100)
    assert c.grid(8, None) == 100 and c.grid(1, None) == 49
    c.steps = 2**31 // 3    # a block's steps past 32 bits: one tile a block
    assert c.grid(8, None) == 392


def test_row_phases_rule():
    """ENGINE 3 samples by row phases, into a swizzled tile 1 KiB further aligned, exactly where
    it reads the warps' corner batches in 128-byte chunk rows outside 3xTF32."""
    fused = _fused()
    g = _geom((8, 256, 56, 56), (256, 256, 3, 3), (8, 18, 56, 56), (8, 9, 56, 56), padding=1)
    table = fused.warp_corner_bytes(2, (256, 64, 64, 1, 3, 512), False)
    assert table == 8 * 2 * 32 * 4 * 8
    for dtype, tf32, tile in ((np.float16, False, (256, 64, 64, 1, 3, 512)), (fused.BFLOAT16, False, (64, 64, 64, 2, 3, 384)),
                              (np.float32, True, (256, 64, 32, 1, 3, 512))):
        c = fused.LaunchConfig(g, dtype, tf32, 132, tile=tile, warp_corners=True)
        assert c.warp_corners and c.row_phases, (dtype, tile)
        ring = fused.smem_bytes(dtype, 2, tile, c.depth, c.precision)
        assert c.smem_bytes == ring + table + fused.SWIZZLE_ALIGN
        assert "by row phases" in c.description
        plain = fused.LaunchConfig(g, dtype, tf32, 132, tile=tile, warp_corners=False)
        assert not plain.row_phases and plain.smem_bytes == ring
    # 64-byte chunk rows (32 half-type or 16 float32 channels a step), 3xTF32, other engines: not
    assert not fused.row_phases(np.float16, (64, 128, 32, 1, 3, 384), 0, True)
    assert not fused.row_phases(np.float32, (256, 64, 16, 1, 3, 512), 1, True)
    assert not fused.row_phases(np.float32, (256, 64, 32, 1, 3, 512), 2, True)
    assert not fused.row_phases(np.float16, (256, 64, 64, 1, 0, 512), 0, True)
    assert not fused.LaunchConfig(g, np.float32, False, 132, tile=(256, 64, 16, 1, 3, 512), warp_corners=True).row_phases


def test_loads_ahead_rule():
    """Two steps of corner loads in flight (PLAN 3) exactly for LOADS_AHEAD_TILES in float32, 1D
    and 2D, with the warps' corner batches: its own kernels (no row phases, one tile a block),
    named in the description."""
    fused = _fused()
    g2 = _geom((8, 256, 56, 56), (256, 256, 3, 3), (8, 18, 56, 56), (8, 9, 56, 56), padding=1)
    g3 = _geom((2, 64, 8, 8, 8), (64, 64, 3, 3, 3), (2, 81, 8, 8, 8), (2, 27, 8, 8, 8), padding=1)
    for tile in fused.LOADS_AHEAD_TILES:
        for tf32 in (True, False):
            c = fused.LaunchConfig(g2, np.float32, tf32, 132, tile=tile, warp_corners=True, loads_ahead=True)
            assert c.loads_ahead and c.warp_corners and not c.row_phases and not c.can_persist, (tile, tf32)
            assert "two steps of corner loads in flight" in c.description
            name = fused.kernel_name(np.float32, False, 2, c.precision, tile, True, 3)
            assert name in fused.name_expressions(np.float32, 2, False, 3)
            assert not fused.LaunchConfig(g2, np.float32, tf32, 132, tile=tile, warp_corners=False,
                                          loads_ahead=True).loads_ahead
            assert not fused.LaunchConfig(g3, np.float32, tf32, 132, tile=tile, warp_corners=True,
                                          loads_ahead=True).loads_ahead
    # the 64x64x32 TF32 tile gives up its row phases for it
    assert fused.LaunchConfig(g2, np.float32, True, 132, tile=(64, 64, 32, 1, 3, 384), warp_corners=True).row_phases
    for ndim in (1, 2, 3):
        for dtype in (np.float32, np.float16):
            ahead = {n for n in fused.name_expressions(dtype, ndim, False, 3) if n.startswith("deform_fused_forward")
                     and n.endswith(", 3>")}
            expected = {fused.kernel_name(dtype, False, ndim, prec, tile, True, 3) for tile in fused.LOADS_AHEAD_TILES
                        for prec in (1, 2) if dtype == np.float32 and ndim < 3
                        and fused.tile_builds(dtype, ndim, tile, prec)}
            assert ahead == expected, (ndim, dtype)
    assert not fused.LaunchConfig(g2, np.float16, False, 132, tile=(64, 128, 32, 1, 3, 384), warp_corners=True,
                                  loads_ahead=True).loads_ahead


def test_position_rows_rule(monkeypatch):
    """POSITION_ROWS reaches ENGINE 3's 256x64 tiles of 512 threads in 3xTF32 (deform_fused.cu's
    rule: two 128-row MMA warpgroups, 64 positions, 96 registers a thread), and only ENGINE 3's
    module text carries its value."""
    fused = _fused()
    reached = {(tile, prec) for dtype in (np.float32, np.float16) for tile in fused._tiles(dtype)
               for prec in fused._precisions(dtype) if fused.position_rows_serve(tile, prec)}
    assert reached == {((256, 64, 32, 1, 3, 512), 2), ((256, 64, 16, 1, 3, 512), 2)}
    assert not fused.position_rows_serve((256, 64, 32, 1, 3, 768), 2)      # 80 registers a thread
    assert not fused.position_rows_serve((256, 64, 32, 1, 0), 2)           # mma.sync
    off = "#define DCN_FUSED_POSITION_ROWS 0\n"
    for rows in (False, True):
        monkeypatch.setattr(fused, "POSITION_ROWS", rows)
        assert fused.module_source(3).startswith(off) != rows
        assert (fused.module_source(3) == fused.module_source(0)) == rows
        assert not fused.module_source(0).startswith(off) and not fused.module_source(1).startswith(off)


@pytest.mark.parametrize("tile, plan", [((256, 64, 64, 1, 3, 512), True), ((64, 64, 64, 1, 0), False)])
def test_forward_launches_address_every_chunk(monkeypatch, tile, plan):
    """The launches a plan records for a forward (no GPU: kernels and launches stubbed): per
    batch chunk the channels-last copy (the first followed by the weight re-layout), the sampling
    plan where the config has one, and the kernel, each on its chunk's addresses and the
    workspace's parts; every launch but the first and the sampling plans' overlapping the kernel
    before it (programmatic dependent launch)."""
    fused = _fused()
    B, C, H, K, it = 5, 64, 9, 9, 2
    g = _geom((B, C, H, H), (C, C, 3, 3), (B, 2 * K, H, H), (B, K, H, H), (C,), padding=1)
    monkeypatch.setattr(fused, "WORKSPACE_LIMIT_BYTES", 1)   # one-sample chunks
    monkeypatch.setattr(fused, "PERSISTENT_BLOCKS", 1)      # (a chunk's 2 tiles: one persistent block)
    config = fused.LaunchConfig(g, np.float16, False, 132, tile=tile, sampling_plan=plan, persistent=True)
    assert config.persistent == (tile[4] == 3)
    assert config.chunk == 1 and config.sampling_plan == plan
    monkeypatch.setattr(fused.LaunchConfig, "kernel", lambda self, name: name)
    monkeypatch.setattr(fused._cuda, "_kernel_op",
                        lambda kernel, grid, block, args, shared_mem=0, overlap=False:
                        (0, kernel, grid, block, args, shared_mem, overlap))   # (0: a kernel, as recorded)
    x, w, off, msk, b, out, ws = (k << 24 for k in range(1, 8))
    Q = S = H * H
    strides = (C * S, 2 * K * Q, K * Q)
    assert fused.FusedForward(config)._strides == strides   # those of C-contiguous arrays
    ops = [op[1:] for op in fused.forward_launches(config, (x, w, off, msk, b), strides, out, ws)]
    xcl_at, wr_at, rows_at, weights_at = fused._workspace_offsets(config)
    per_chunk = ["fused_channels_last"] + (["fused_sampling_plan"] if plan else []) + ["forward"]
    assert [op[0] for op in ops] == per_chunk[:1] + [config.weight_kernel] + per_chunk[1:] + per_chunk * (B - 1)
    assert [int(a) for a in ops[1][3][:2]] == [w, ws + wr_at]
    assert [op[5] for op in ops] == [i > 0 and op[0] != "fused_sampling_plan" for i, op in enumerate(ops)]
    chunks = [[ops[0]] + ops[2:1 + len(per_chunk)]] + [
        ops[1 + k * len(per_chunk):1 + (k + 1) * len(per_chunk)] for k in range(1, B)]
    for k, chunk in enumerate(chunks):
        layout, forward = chunk[0], chunk[-1]
        assert [int(a) for a in layout[3][:2]] == [x + k * C * S * it, ws + xcl_at]
        a = forward[3]
        assert [int(v) for v in a[:6]] == [ws + xcl_at, ws + wr_at, off + k * 2 * K * Q * it, msk + k * K * Q * it,
                                           b, out + k * C * Q * it]
        assert config.blocks(1) == 2 and forward[1] == (1 if config.persistent else 2,)
        assert int(a[7]) == 1 and forward[2] == (config.threads,)
        assert forward[4] == config.smem_bytes
        if plan:
            p = chunk[1][3]
            assert [int(v) for v in p[:4]] == [off + k * 2 * K * Q * it, msk + k * K * Q * it, ws + rows_at,
                                               ws + weights_at]
            assert [int(v) for v in a[18:20]] == [ws + rows_at, ws + weights_at]
        else:
            assert a[18] is None and a[19] is None


def _stand_in_driver(launch_kernel_ex):
    """A driver library whose cuLaunchKernelEx is the Python function ``launch_kernel_ex(config,
    function, params, extra) -> CUresult`` behind a ctypes function pointer (no GPU)."""
    import ctypes
    prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)

    class Driver:
        cuLaunchKernelEx = prototype(launch_kernel_ex)

    return Driver()


def test_programmatic_launch_marshals_its_attribute():
    """cuLaunchKernelEx's arguments as the driver reads them (no GPU: a ctypes stand-in for the
    driver function): grid, block, shared memory, the stream (an address, or the ctypes value
    replays pass), and one attribute, programmatic stream serialization (id 6), allowed."""
    import ctypes
    import struct
    pytest.importorskip("cupy")
    from dcn_cupy._backends import cuda
    seen = []

    def launch_kernel_ex(config, function, params, extra):
        raw = ctypes.string_at(config, 56)
        stream, attrs, count = struct.unpack_from("QQI", raw, 32)
        attribute = ctypes.string_at(attrs, 72)
        seen.append((struct.unpack_from("7I", raw), stream, count, struct.unpack_from("i", attribute)[0],
                     struct.unpack_from("i", attribute, 8)[0], function, params, extra))
        return 0

    plain = []
    launch = cuda._launch_ex(_stand_in_driver(launch_kernel_ex), lambda *args: plain.append(args) or 0)
    head = launch.prepare(0x1234, 77, 384, 99000, 0x5678)
    launch.launch(head, 0xABC)
    launch.launch(head, ctypes.c_void_p(0xDEF))
    assert seen == [((77, 1, 1, 384, 1, 1, 99000), stream, 1, 6, 1, 0x1234, 0x5678, None)
                    for stream in (0xABC, 0xDEF)]
    assert not plain and cuda._launch_ex(object(), None) is None   # a driver without cuLaunchKernelEx


@pytest.mark.parametrize("min_lanes", [8, 4, 2])
def test_column_block_shapes_are_compiled_and_fill_their_tiles(monkeypatch, min_lanes):
    """fused_columns' rule (``cuda._column_shape``, no GPU): each (vectors, lanes) it picks, for
    every channel count that is a multiple of the vector and N = 1, 2, 3, is an instantiation the
    module compiles (``COLUMN_SHAPES``, at the default ``COLUMN_MIN_LANES``) and a tile of at
    most the channels (but below ``COLUMN_MIN_LANES`` vectors: the 1 x 8 fallback); the most
    vectors first, then the most lanes, and in 3D four vectors at four lanes or more."""
    pytest.importorskip("cupy")
    from dcn_cupy._backends import cuda, cuda_fused
    default = cuda.COLUMN_MIN_LANES
    monkeypatch.setattr(cuda, "COLUMN_MIN_LANES", min_lanes)
    picked = set()
    for ndim in (1, 2, 3):
        for vec in (8, 4):
            for channels in range(vec, 1025, vec):
                vectors, lanes = cuda._column_shape(channels, vec, ndim)
                picked.add((vectors, lanes))
                assert lanes >= min_lanes or (vectors, lanes) == (1, 8)
                assert not (ndim == 3 and vectors == 4 and lanes < 4)
                if channels >= min_lanes * vec:
                    assert lanes * vec * vectors <= channels, (channels, vec)
    if min_lanes == default:
        assert picked == set(cuda_fused.COLUMN_SHAPES)
    assert cuda._column_shape(256, 4, 2) == cuda._column_shape(128, 4, 3) == (4, 8)
    expected = {8: (1, 8), 4: (2, 4), 2: (4, 2)}[min_lanes]
    assert cuda._column_shape(64, 8, 2) == cuda._column_shape(32, 4, 1) == expected
    assert cuda._column_shape(32, 4, 3) == {8: (1, 8), 4: (2, 4), 2: (2, 4)}[min_lanes]
    assert cuda._column_shape(32, 8, 3) == {8: (1, 8), 4: (1, 4), 2: (2, 2)}[min_lanes]


def test_column_sampler_settings_are_part_of_the_plan_key(monkeypatch):
    """The column sampler's module settings (``CHANNELS_LAST_COLUMNS``, ``_3D``, ``COLUMN_MIN_LANES``)
    are part of ``cuda_settings()``, the functional API's plan key: a changed one builds new
    plans (no GPU)."""
    pytest.importorskip("cupy")
    from dcn_cupy import _backends
    from dcn_cupy._backends import cuda
    for name, value in (("CHANNELS_LAST_COLUMNS", False), ("CHANNELS_LAST_COLUMNS_3D", frozenset()),
                        ("COLUMN_MIN_LANES", 8)):
        before = _backends.cuda_settings()
        with monkeypatch.context() as m:
            m.setattr(cuda, name, value)
            assert _backends.cuda_settings() != before, name
        assert _backends.cuda_settings() == before, name


def test_fused_workspace_bound_reads_sizes_and_keys_plans(monkeypatch):
    """``DCN_CUPY_FUSED_WORKSPACE_BYTES`` takes sizes like the other workspace variables (``512M``)
    and names itself when it is not one; the bound is part of the functional API's plan key, and
    it sets the fused backward's batch chunk (no GPU)."""
    pytest.importorskip("cupy")
    import subprocess
    import sys
    from dcn_cupy import _backends
    from dcn_cupy._backends import cuda_fused, cuda_fused_backward
    script = "from dcn_cupy._backends import cuda_fused; print(cuda_fused.WORKSPACE_LIMIT_BYTES)"
    env = {**os.environ, "DCN_CUPY_FUSED_WORKSPACE_BYTES": "512M"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(512 * 2**20)]
    env["DCN_CUPY_FUSED_WORKSPACE_BYTES"] = "a lot"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "DCN_CUPY_FUSED_WORKSPACE_BYTES must be a positive number of bytes" in done.stderr
    assert "got 'a lot'" in done.stderr
    geom, _ = _geometry.conv_geometry((16, 256, 4096), (256, 256, 3), (16, 6, 4096), (16, 3, 4096), padding=1)
    keys, chunks = {}, {}
    for limit in (128 * 2**20, 2**30):
        monkeypatch.setattr(cuda_fused, "WORKSPACE_LIMIT_BYTES", limit)
        keys[limit] = _backends.cuda_settings()
        chunks[limit] = cuda_fused_backward.BackwardConfig(geom, np.dtype(np.float32), True).chunk
    assert keys[128 * 2**20] != keys[2**30]
    assert chunks[128 * 2**20] == 6 and chunks[2**30] == 16   # 6 + 6 + 4 samples, then one chunk


def test_a_refused_programmatic_launch_is_made_plainly(monkeypatch):
    """A driver that refuses cuLaunchKernelEx (no GPU: a ctypes stand-in): the kernel is launched
    with cuLaunchKernel instead, same arguments and stream, and later recordings launch plainly."""
    pytest.importorskip("cupy")
    from dcn_cupy._backends import cuda
    refused = _stand_in_driver(lambda config, function, params, extra: 1)   # CUDA_ERROR_INVALID_VALUE
    plain = []
    monkeypatch.setattr(cuda, "PDL", True)
    launch = cuda._launch_ex(refused, lambda *args: plain.append([getattr(a, "value", a) for a in args]) or 0)
    launch.launch(launch.prepare(0x1234, 77, 384, 99000, 0x5678), 0xABC)
    assert plain == [[0x1234, 77, 1, 1, 384, 1, 1, 99000, 0xABC, 0x5678, None]]
    assert cuda.PDL is False


def test_64bit_indices_use_the_first_tile_of_each_engine(monkeypatch):
    fused = _fused()
    g = _geom((8, 256, 56, 56), (256, 256, 3, 3), (8, 18, 56, 56), (8, 9, 56, 56), padding=1)
    monkeypatch.setattr(fused, "_INT32_SAFE", 0)
    for dtype, key in ((np.float16, "half"), (np.float32, "float")):
        first = {tile[4]: tile for tile in reversed(fused.TILES[key]) if tile[4] != 2}
        assert set(fused._tiles(dtype, True)) == set(first.values())
        # a corner-pipeline tile (engine 2, benchmarks only) has no 64-bit kernel: engine 0's first
        assert fused.LaunchConfig(g, dtype, True, 132, tile=(256, 64, 32, 1, 2)).tile == first[0]
        for wgmma in (False, True):
            c = fused.LaunchConfig(g, dtype, True, 132, wgmma=wgmma)
            assert c.index64 and c.tile == first[c.tile[4]]
            c = fused.LaunchConfig(g, dtype, True, 132, tile=fused.TILES[key][1])
            assert c.index64 and c.tile == first[0]
        for engine in (0, 1, 3):
            parts = [n.split("<", 1)[1].rstrip(">").split(", ")
                     for n in fused.name_expressions(dtype, 2, True, engine) if n.startswith("deform_fused")]
            assert parts and all(p[1] == "long long" for p in parts)
            assert {tuple(int(v) for v in p[4:8] + p[9:10]) for p in parts} == {first[engine][:5]}


# ---------------------------------------------------------------------------------------------
# GPU


def _cupy():
    return pytest.importorskip("cupy")


ENGINES = pytest.mark.parametrize("engine", [0, 1, 3], ids=["mma", "wgmma", "wgmma-ws"])


def engine_tile(engine, precision):
    """The first tile of TILES of ``engine`` that runs here in ``precision`` (``tile_runs``;
    skips where there is none). ENGINE 3 has no per-channel sampler: its tests take channel
    counts it serves."""
    fused = _fused()
    tile = next((tile for tile in fused._tiles(DTYPE[precision]) if tile[4] == engine and tile_runs(tile, precision)),
                None)
    if tile is None:
        pytest.skip("wgmma: compute capability 9.0; ENGINE 1 has no 3xTF32")
    return tile


def tile_runs(tile, precision, ndim: int = 2) -> bool:
    """Whether ``tile`` runs here in ``precision`` and N = ``ndim``: the wgmma tiles on compute
    capability 9.0, ENGINE 1 in fp16, bf16 and TF32 only, ENGINE 3 where its ring fits (3xTF32
    stages are twice as long) and (its 512-sampler tiles) not in 3D."""
    fused = _fused()
    return ((not fused.is_wgmma(tile) or fused.wgmma_available())
            and fused.tile_builds(DTYPE[precision], ndim, tile, PREC[precision]))


def run_fused(arrays: dict, params: dict, precision: str, ndim: int, engine=None):
    """The fused forward of float64 NumPy ``arrays`` cast to ``precision``'s dtype (the
    automatic tile, or the first of ``engine``); returns (result as float64 NumPy, the float64
    reference of the rounded inputs, launch config)."""
    cupy = _cupy()
    fused = _fused()
    dtype = DTYPE[precision]
    tile = None if engine is None else engine_tile(engine, precision)
    with np.errstate(over="ignore"):
        rounded = {k: None if a is None else a.astype(dtype).astype(np.float64) for k, a in arrays.items()}
        dev = {k: None if a is None else cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    geom = _case_geom(arrays, params, ndim=ndim)
    out = cupy.full(geom.y_shape, np.nan, dtype=dtype)   # poisoned: every element must be written
    if tile is None:
        fused.fused_conv_forward(dev["input"], dev["weight"], dev["offset"], dev["mask"], dev["bias"], geom, out,
                                 allow_tf32=precision == "tf32")
        config = fused.LaunchConfig(geom, dtype, precision == "tf32", wgmma=fused.wgmma_available())
    else:
        config = fused.LaunchConfig(geom, dtype, precision == "tf32", tile=tile)
        fused.run_forward(config, dev["input"], dev["weight"], dev["offset"], dev["mask"], dev["bias"], out)
    expected = reference.deform_conv(**rounded, **params)
    return cupy.asnumpy(out).astype(np.float64), expected, config


def wide_case(rng, ndim, *, groups=2, offset_groups=2, mask_groups=1, c_in=64, c_out=48, batch=3,
              offset=True, mask=True, bias=True, kernel=None, stride=None, padding=None, dilation=None):
    """Channel counts that take the 16-byte-vector sampler."""
    kernel = kernel or (3,) * ndim
    stride = stride or tuple(int(v) for v in rng.integers(1, 3, size=ndim))
    padding = padding or tuple(int(v) for v in rng.integers(0, 2, size=ndim))
    dilation = dilation or tuple(int(v) for v in rng.integers(1, 3, size=ndim))
    size = {1: 23, 2: 11, 3: 6}[ndim]
    S = (size,) * ndim
    Q = tuple((s + 2 * p - d * (k - 1) - 1) // st + 1 for s, p, d, k, st in zip(S, padding, dilation, kernel, stride))
    K = math.prod(kernel)
    arrays = {
        "input": rng.standard_normal((batch, c_in) + S),
        "weight": rng.standard_normal((c_out, c_in // groups) + kernel) / math.sqrt(c_in * K / groups),
        "offset": fractional_offsets(rng, (batch, offset_groups * K * ndim) + Q) if offset else None,
        "mask": rng.uniform(0.1, 1.5, size=(batch, mask_groups * K) + Q) if mask else None,
        "bias": rng.standard_normal(c_out) if bias else None,
    }
    params = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    return arrays, params


@pytest.mark.gpu
@ENGINES
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_vector_sampler_matches_reference(ndim, precision, engine):
    rng = np.random.default_rng(20 + ndim)
    arrays, params = wide_case(rng, ndim, c_in=128 if engine == 3 else 64)
    got, expected, config = run_fused(arrays, params, precision, ndim, engine)
    assert config.uniform
    assert relative_error(got, expected) < TOL[precision]


@pytest.mark.gpu
@ENGINES
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_per_channel_sampler_matches_reference(ndim, precision, seed, engine):
    if engine == 3:
        pytest.skip("ENGINE 3 has no per-channel sampler (plans take another engine there)")
    rng = np.random.default_rng(300 + 10 * ndim + seed)
    case = random_case(rng, ndim, False, offset=seed != 1, mask=seed != 2, bias=seed != 0, channels_scale=3)
    got, expected, config = run_fused(case.arrays_, case.params, precision, ndim, engine)
    assert not config.uniform
    assert relative_error(got, expected) < TOL[precision], case.label


@pytest.mark.gpu
@pytest.mark.parametrize("offset_groups,mask_groups", [(1, 2), (2, 1), (4, 2), (2, 4)])
@pytest.mark.parametrize("present", ["offset+mask+bias", "offset", "mask", "none"])
def test_groups_and_missing_arguments(offset_groups, mask_groups, present):
    """Every tile of TILES (the wgmma ones where the device has wgmma) that serves each case."""
    fused = _fused()
    rng = np.random.default_rng(offset_groups * 7 + mask_groups)
    arrays, params = wide_case(rng, 2, groups=2, offset_groups=offset_groups, mask_groups=mask_groups, c_in=128,
                               c_out=160, offset="offset" in present, mask="mask" in present,
                               bias="bias" in present)
    for precision in PRECISIONS:
        for tile in fused._tiles(DTYPE[precision]):
            if not tile_runs(tile, precision):
                continue
            if not serves(arrays, params, precision, tile):
                continue
            for taps_inner in (True, False):
                got, expected, _ = run_fused_tile(arrays, params, precision, tile, taps_inner)
                assert relative_error(got, expected) < TOL[precision], (precision, tile, taps_inner)


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_sampling_plan_gives_the_corners_each_thread_computes(ndim):
    """The forward with its corners from the sampling plan equals (bitwise) the forward that
    computes them per thread, for every 16-byte-vector tile, both step orders, every precision,
    offset groups != mask groups, stride / padding / dilation, with and without offsets / mask;
    and both match the reference."""
    fused = _fused()
    rng = np.random.default_rng(70 + ndim)
    cases = ((2, 1, True, True), (1, 1, True, False), (1, 2, False, True))
    for offset_groups, mask_groups, offset, mask in cases:
        # 64 input channels (32-channel groups), and 128 (64-channel groups: ENGINE 3 serves
        # them) for the precisions other than 3xTF32, whose tolerance is set for the 64
        by_width = {c_in: wide_case(rng, ndim, groups=1, offset_groups=offset_groups, mask_groups=mask_groups,
                                    c_in=c_in, c_out=64, batch=3, offset=offset, mask=mask) for c_in in (64, 128)}
        orders = (True, False) if offset_groups == cases[0][0] else (False,)
        for precision in PRECISIONS:
            arrays, params = by_width[64 if precision == "float32" else 128]
            for tile in fused._tiles(DTYPE[precision]):
                if tile[4] == 2 or not tile_runs(tile, precision, ndim):
                    continue
                if not serves(arrays, params, precision, tile):
                    continue
                for taps_inner in orders:
                    planned, expected, config = run_fused_tile(arrays, params, precision, tile, taps_inner, True)
                    assert config.sampling_plan and "sampling plan" in config.description
                    in_place, _, config = run_fused_tile(arrays, params, precision, tile, taps_inner, False)
                    assert not config.sampling_plan
                    label = (precision, tile, taps_inner, offset_groups, mask_groups, offset, mask)
                    assert np.array_equal(planned, in_place), label
                    assert relative_error(planned, expected) < TOL[precision], label


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_warp_corner_batches_give_the_corners_each_thread_computes(ndim):
    """The forward with its corners from its warps' batches equals (bitwise) the forward whose
    threads compute their own, for every engine-0 and engine-3 tile, both step orders, every
    precision, with and without offsets / mask: kernels of 3^N taps (batches of 2, 4 or 8 taps,
    the last partial), 1 tap, and in 2D 1x2 (taps inner: the same tap again in a lane's next
    batch); a partial last channel chunk (96 channels, 64 a step); and both match the reference.
    So does (bitwise) the kernel with two steps of corner loads in flight, where the tile has one."""
    fused = _fused()
    rng = np.random.default_rng(90 + ndim)
    kernels = [(3,) * ndim, (1,) * ndim] + ([(1, 2)] if ndim == 2 else [])
    served = ahead_served = 0
    for kernel in kernels:
        for c_in, offset, mask in ((128, True, True), (64, False, True), (96, True, False)):
            arrays, params = wide_case(rng, ndim, groups=1, offset_groups=1, mask_groups=1, c_in=c_in, c_out=64,
                                       batch=3, offset=offset, mask=mask, kernel=kernel)
            for precision in PRECISIONS:
                if precision == "float32" and c_in != 64:
                    continue   # (3xTF32's tolerance is set for 64 channels)
                for tile in fused._tiles(DTYPE[precision]):
                    if tile[4] not in (0, 3) or not tile_runs(tile, precision, ndim) or not serves(arrays, params, precision, tile):
                        continue
                    for taps_inner in (True, False):
                        batched, expected, config = run_fused_tile(arrays, params, precision, tile, taps_inner,
                                                                   False, True)
                        if not config.warp_corners:
                            continue
                        served += 1
                        assert "corners a batch of taps ahead per warp" in config.description
                        own, _, config = run_fused_tile(arrays, params, precision, tile, taps_inner, False, False)
                        assert not config.warp_corners
                        label = (precision, tile, taps_inner, kernel, c_in, offset, mask)
                        assert np.array_equal(batched, own), label
                        assert relative_error(batched, expected) < TOL[precision], label
                        # two steps of loads in flight (PLAN 3), where the tile has that kernel
                        if fused.loads_ahead_serves(DTYPE[precision], ndim, tile):
                            ahead, _, config = run_fused_tile(arrays, params, precision, tile, taps_inner, False, True,
                                                              loads_ahead=True)
                            assert config.loads_ahead, label
                            ahead_served += 1
                            assert np.array_equal(ahead, own), label + ("loads ahead",)
    assert served
    assert bool(ahead_served) == (ndim < 3 and any(tile_runs(t, "float32", ndim) for t in fused.LOADS_AHEAD_TILES))


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2])
def test_position_rows_give_the_bits_of_two_m64n64(monkeypatch, ndim):
    """ENGINE 3's 3xTF32 MMAs with the operands' roles swapped (POSITION_ROWS: the sampled
    positions the wgmma's M, one m64n128 a k step) give the bits of the two-m64n64 order, and the
    reference's values: every tile it reaches, each corner source (the threads' own, the sampling
    plan, the warps' batches, two steps of loads in flight), both step orders; 160 output channels
    (the second warpgroup's rows partly past C_out) and a partial last position tile. (3xTF32 does
    not persist, and its 512-thread tiles do not build in 3D.)"""
    cupy = _cupy()
    fused = _fused()
    rng = np.random.default_rng(110 + ndim)
    arrays, params = wide_case(rng, ndim, groups=1, offset_groups=2, mask_groups=1, c_in=64, c_out=160, batch=3)
    geom = _case_geom(arrays, params)
    precision, dtype = "float32", DTYPE["float32"]
    dev = {k: cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    expected = reference.deform_conv(**{k: a.astype(dtype).astype(np.float64) for k, a in arrays.items()}, **params)
    # (sampling plan, warp corners, loads ahead)
    sources = ((False, False, False), (True, False, False), (False, True, False), (False, True, True))
    ran = 0
    for tile in fused._tiles(dtype):
        if not (fused.position_rows_serve(tile, PREC[precision]) and tile_runs(tile, precision, ndim)
                and serves(arrays, params, precision, tile)):
            continue
        for taps_inner, (plan, warp, ahead) in itertools.product((True, False), sources):
            config = fused.LaunchConfig(geom, dtype, False, tile=tile, taps_inner=taps_inner, sampling_plan=plan,
                                        warp_corners=warp, loads_ahead=ahead)
            if (config.sampling_plan, config.warp_corners, config.loads_ahead) != (plan, warp, ahead):
                continue   # (not served: a kernel another combination runs)
            label = (tile, taps_inner, plan, warp, ahead)
            results = []
            for rows in (False, True):
                monkeypatch.setattr(fused, "POSITION_ROWS", rows)
                out = cupy.full(geom.y_shape, np.nan, dtype=dtype)
                fused.run_forward(config, dev["input"], dev["weight"], dev["offset"], dev["mask"], dev["bias"], out)
                results.append(cupy.asnumpy(out))
            np.testing.assert_array_equal(results[1], results[0], err_msg=str(label))
            assert relative_error(results[1].astype(np.float64), expected) < TOL[precision], label
            ran += 1
    if not ran:
        pytest.skip("POSITION_ROWS: ENGINE 3's 512-thread 3xTF32 tiles, compute capability 9.0")


def serves(arrays, params, precision, tile) -> bool:
    """Whether ``tile`` can compute this case (ENGINE 3 needs each step's chunk in one group)."""
    geom = _case_geom(arrays, params)
    return _fused().tile_serves(geom, DTYPE[precision], tile)


def run_fused_tile(arrays, params, precision, tile, taps_inner=True, sampling_plan=None, warp_corners=False,
                   loads_ahead=False):
    cupy = _cupy()
    fused = _fused()
    dtype = DTYPE[precision]
    dev = {k: None if a is None else cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    rounded = {k: None if a is None else a.astype(dtype).astype(np.float64) for k, a in arrays.items()}
    geom = _case_geom(arrays, params)
    config = fused.LaunchConfig(geom, dtype, precision == "tf32", tile=tile, taps_inner=taps_inner,
                                sampling_plan=sampling_plan, warp_corners=warp_corners, loads_ahead=loads_ahead)
    out = cupy.full(geom.y_shape, np.nan, dtype=dtype)
    fused.run_forward(config, dev["input"], dev["weight"], dev["offset"], dev["mask"], dev["bias"], out)
    return cupy.asnumpy(out).astype(np.float64), reference.deform_conv(**rounded, **params), config


@pytest.mark.gpu
def test_strict_float32_keeps_float32_accuracy_over_a_long_reduction():
    """3xTF32 on the warp-specialised tiles over C_in*K = 4608: each step's products summed apart
    and added in float32, so that the error stays that of float32 FMAs (~6e-7 here; the tensor
    cores' truncating accumulation alone gave ~3e-5, growing with K)."""
    rng = np.random.default_rng(14)
    arrays, params = wide_case(rng, 2, groups=1, offset_groups=1, mask_groups=1, c_in=512, c_out=192, batch=2,
                               stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    tiles = [tile for tile in _fused().TILES["float"] if tile[4] == 3 and tile_runs(tile, "float32")]
    if not tiles:
        pytest.skip("wgmma: compute capability 9.0")
    for tile in tiles:
        got, expected, _ = run_fused_tile(arrays, params, "float32", tile)
        assert relative_error(got, expected) < 2e-6, tile


@pytest.mark.gpu
def test_large_output_channel_tiles_and_batch_spanning_tiles():
    # C_out/groups = 200: two 128-channel tiles, the second partial; 5 samples of 9x9 (81
    # positions): position tiles span samples
    rng = np.random.default_rng(5)
    arrays, params = wide_case(rng, 2, groups=1, offset_groups=1, mask_groups=1, c_in=128, c_out=200, batch=5,
                               stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    fused = _fused()
    for precision in PRECISIONS:
        for tile in fused._tiles(DTYPE[precision]):
            if not tile_runs(tile, precision):
                continue
            assert serves(arrays, params, precision, tile), tile
            got, expected, _ = run_fused_tile(arrays, params, precision, tile)
            assert relative_error(got, expected) < TOL[precision], (precision, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float16", "bfloat16", "float32", "tf32"])
def test_channels_last_copy_by_vectors_and_by_elements(precision):
    """The channels-last copy: x (B, C, S) -> (B, S, Cp) with channels from C on and the row
    after the batch zero, the per-tile channel sums and the weight gradient's rows (``xr``) too,
    by ``fused_channels_last`` (one element a thread) and by ``fused_channels_last_vectors``
    (16-byte vectors where S, the sample stride and Cp are multiples of one and x is aligned;
    else elements: x one element past an aligned address). Every way gives the transpose and
    bitwise the same sums. Partial channel and position tiles, a padded sample stride, a grid
    smaller than the tiles (grid-stride). ``tf32``: the fused backward's ``_tf32`` copies (its
    TF32 data kernel's operand rows), whose xcl is rounded to TF32 (ties included) while the sums
    and xr keep the values: the sums bitwise those of the plain copies."""
    cupy = _cupy()
    fused = _fused()
    dtype = DTYPE[precision]
    vec = 16 // dtype.itemsize
    t = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "tf32": "float"}[precision]
    kernels = [fused._function(f"{name}<{t}, int>", dtype, 2, False)
               for name in ("fused_channels_last", "fused_channels_last_vectors")]
    rounding = precision == "tf32"
    if rounding:
        from dcn_cupy._backends import cuda_fused_backward as fb
        kernels += [fb._function(f"{name}_tf32<int>", dtype, 2, False)
                    for name in ("fused_channels_last", "fused_channels_last_vectors")]
    rng = np.random.default_rng(11)
    # (B, C, S, sample stride): S = 200 is 3 position tiles and 8 more; S = 21 no whole vectors
    for B, C, S, stride in ((3, 80, 200, 80 * 200), (2, 37, 24, 37 * 24 + vec), (2, 16, 21, 16 * 21),
                            (1, 70, 64, 70 * 64)):
        Cp = -(-C // vec) * vec
        s_tiles = -(-S // 64)
        Pp = -(-(B * S) // vec) * vec
        values = rng.standard_normal((B, stride)).astype(dtype)
        if rounding:   # ties of the TF32 rounding (low 13 bits 0x1000), both signs, and their neighbours
            bits = values.view(np.uint32)
            bits[:, ::3] = (bits[:, ::3] & np.uint32(0xFFFFE000)) | np.uint32(0x1000)
            bits[:, 1::7] = (bits[:, 1::7] & np.uint32(0xFFFFE000)) | np.uint32(0x0FFF)
        x = values[:, :C * S].reshape(B, C, S)
        expected = np.zeros((B * S + 1, Cp), dtype=dtype)
        expected[:B * S, :C] = x.transpose(0, 2, 1).reshape(B * S, C)
        rounded = np.zeros_like(expected)
        rounded[:B * S, :C] = tf32_rounded(expected[:B * S, :C])
        rows = np.zeros((C, Pp), dtype=dtype)
        rows[:, :B * S] = x.transpose(1, 0, 2).reshape(C, B * S)
        results = []
        for shift in (0, 1):   # x aligned, or one element past
            buffer = np.zeros(B * stride + vec, dtype=dtype)
            buffer[shift:shift + B * stride] = values.reshape(-1)
            buffer = cupy.asarray(buffer)
            for copy in kernels:
                for grid in (fused.layout_grid(B, Cp, S), (3,)):
                    xcl = cupy.asarray(np.full((B * S + 1) * Cp, 7, dtype=dtype))   # poisoned
                    sums = cupy.full(C * B * s_tiles, np.nan, dtype=np.float32)
                    xr = cupy.asarray(np.full(C * Pp, 7, dtype=dtype))
                    copy(grid, (256,), (buffer[shift:], xcl, np.int32(B), np.int32(C), np.int32(Cp), np.int32(S),
                                        np.int32(stride), sums, xr, np.int32(Pp), np.int32(0)))
                    got = cupy.asnumpy(xcl).reshape(B * S + 1, Cp)
                    k = kernels.index(copy)
                    where = (C, S, shift, k, grid)
                    np.testing.assert_array_equal(got.view(np.uint8), (rounded if k >= 2 else expected).view(np.uint8),
                                                  err_msg=str(where))
                    np.testing.assert_array_equal(cupy.asnumpy(xr).reshape(C, Pp).view(np.uint8),
                                                  rows.view(np.uint8), err_msg=str(where))
                    results.append(cupy.asnumpy(sums).tobytes())
            per_tile = np.zeros((C, B, s_tiles * 64))
            per_tile[:, :, :S] = x.astype(np.float64).transpose(1, 0, 2)
            np.testing.assert_allclose(cupy.asnumpy(sums).reshape(C, B, s_tiles),
                                       per_tile.reshape(C, B, s_tiles, 64).sum(axis=3), rtol=1e-5, atol=1e-5)
        assert len(results) == 8 * (1 + rounding) and len(set(results)) == 1, (C, S)
        if rounding:   # the ties were there to round
            assert not np.array_equal(rounded.view(np.uint32), expected.view(np.uint32))


def test_copy_kernel_rule():
    """The channels-last copy in 16-byte vectors only where each vector is whole and aligned
    and the copy is large enough (``VECTOR_COPY_POSITIONS``, at least one 64-channel tile)."""
    fused = _fused()
    big = fused.VECTOR_COPY_POSITIONS
    h, f = np.float16, np.float32
    vectors, elements = "fused_channels_last_vectors", "fused_channels_last"
    assert fused.copy_kernel(h, 3136, 256, 256 * 3136, (1 << 20, 2 << 20)) == vectors
    assert fused.copy_kernel(f, 4096, 64, 0, (1 << 20, 2 << 20, 0)) == vectors   # broadcast batch, no xr
    assert fused.copy_kernel(h, 196, 512, 512 * 196, (1 << 20, 2 << 20)) == elements    # not whole vectors
    assert fused.copy_kernel(f, 196, 512, 512 * 196, (1 << 20, 2 << 20)) == elements    # below the rule
    assert fused.copy_kernel(f, 32768, 32, 32 * 32768, (1 << 20, 2 << 20)) == elements  # under one channel tile
    assert fused.copy_kernel(h, big, 64, 64 * big + 4, (1 << 20, 2 << 20)) == elements  # sample stride
    assert fused.copy_kernel(h, big, 64, 64 * big, ((1 << 20) + 2, 2 << 20)) == elements  # x misaligned
    assert fused.copy_kernel(f, big, 68, 68 * big, (1 << 20, 2 << 20, (3 << 20) + 8)) == elements  # xr misaligned
    # rounded to TF32 (the fused backward's TF32 operand rows), by the same rule
    assert fused.copy_kernel(f, 4096, 64, 0, (1 << 20, 2 << 20, 0), tf32=True) == vectors + "_tf32"
    assert fused.copy_kernel(f, 196, 512, 512 * 196, (1 << 20, 2 << 20), tf32=True) == elements + "_tf32"
    # split into 3xTF32's planes (strict float32): the rule weighs the rows written, twice as long
    assert fused.copy_kernel(f, 4096, 32, 32 * 4096, (1 << 20, 2 << 20), split=True) == vectors + "_split"
    assert fused.copy_kernel(f, 4096, 16, 16 * 4096, (1 << 20, 2 << 20), split=True) == elements + "_split"
    assert fused.copy_kernel(f, 4096, 36, 36 * 4096 + 2, (1 << 20, 2 << 20), split=True) == elements + "_split"


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_persistent_blocks_compute_every_tile_as_one_tile_blocks_do(monkeypatch, ndim):
    """ENGINE 3's persistent blocks (grids of 1, 3 and 7 blocks here, so that each block runs
    many tiles through one ring: position tiles spanning samples and a partial last one, two conv
    groups, two output-channel tiles of the 128-row tiles, 3 steps a tile in 1D fp16, fewer than the
    ring's stages) give the bits of one tile a block, and the reference's values: every tile that
    persists, each corner source, both step orders, fp16/bf16/TF32."""
    cupy = _cupy()
    fused = _fused()
    rng = np.random.default_rng(60 + ndim)
    arrays, params = wide_case(rng, ndim, groups=2, offset_groups=1, mask_groups=1, c_in=128, c_out=512,
                               batch=12, stride=(1,) * ndim, padding=(1,) * ndim, dilation=(1,) * ndim)
    geom = _case_geom(arrays, params)
    ran = 0
    for precision in ("float16", "bfloat16", "tf32"):
        dtype = DTYPE[precision]
        dev = {k: cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
        expected = reference.deform_conv(**{k: a.astype(dtype).astype(np.float64) for k, a in arrays.items()},
                                         **params)
        for tile in fused._tiles(dtype):
            if not (fused.tile_persists(tile, PREC[precision]) and tile_runs(tile, precision, ndim)):
                continue
            for taps_inner, plan, warp in ((True, False, False), (False, True, False), (False, False, True)):
                kwargs = dict(tile=tile, taps_inner=taps_inner, sampling_plan=plan, warp_corners=warp)
                single = fused.LaunchConfig(geom, dtype, precision == "tf32", persistent=False, **kwargs)
                config = fused.LaunchConfig(geom, dtype, precision == "tf32", persistent=True, **kwargs)
                assert config.persistent and not single.persistent and "persistent blocks" in config.description
                want = cupy.full(geom.y_shape, np.nan, dtype=dtype)
                fused.run_forward(single, dev["input"], dev["weight"], dev["offset"], dev["mask"], dev["bias"], want)
                want = cupy.asnumpy(want)
                assert relative_error(want.astype(np.float64), expected) < TOL[precision], (precision, tile)
                tiles = config.blocks(geom.batch)
                for blocks in (1, 3, 7):
                    monkeypatch.setattr(fused, "PERSISTENT_BLOCKS", blocks)
                    assert config.grid(geom.batch, config.kernel("forward")) == min(blocks, tiles) < tiles
                    out = cupy.full(geom.y_shape, np.nan, dtype=dtype)
                    fused.run_forward(config, dev["input"], dev["weight"], dev["offset"], dev["mask"], dev["bias"],
                                      out)
                    np.testing.assert_array_equal(cupy.asnumpy(out), want, err_msg=f"{precision} {tile} {blocks}")
                ran += 1
    if not ran:
        pytest.skip("persistent tiles: ENGINE 3, compute capability 9.0")


@pytest.mark.gpu
@pytest.mark.parametrize("size", [10, 9], ids=["even-Q", "odd-Q"])
def test_paired_and_single_output_stores_agree(size):
    """The epilogues store two adjacent positions at a time where every pair of a thread lies in
    one sample at an aligned address, else each output alone: an output misaligned by one element
    takes the single stores and must get the same bits, with nothing written outside it. Q even
    (10x10) and odd (9x9), position tiles spanning samples, every engine's first tile and the
    64-row warp-specialised one, every precision."""
    cupy = _cupy()
    fused = _fused()
    rng = np.random.default_rng(8)
    arrays, params = wide_case(rng, 2, groups=1, offset_groups=1, mask_groups=1, c_in=64, c_out=72, batch=3,
                               stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    arrays["input"] = rng.standard_normal((3, 64, size, size))
    arrays["offset"] = fractional_offsets(rng, (3, 18, size, size))
    arrays["mask"] = rng.uniform(0.1, 1.5, size=(3, 9, size, size))
    geom = _case_geom(arrays, params)
    for precision in PRECISIONS:
        dtype = DTYPE[precision]
        dev = {k: cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
        expected = reference.deform_conv(**{k: a.astype(dtype).astype(np.float64) for k, a in arrays.items()},
                                         **params)
        tiles = {tile for tile in fused._tiles(dtype) if tile_runs(tile, precision)
                 and (tile == next(t for t in fused._tiles(dtype) if t[4] == tile[4]) or tile[:3] == (64, 64, 64)
                      or (tile[4] == 3 and tile[0] == 64))}
        for tile in sorted(tiles):
            config = fused.LaunchConfig(geom, dtype, precision == "tf32", tile=tile)
            aligned = cupy.full(geom.y_shape, np.nan, dtype=dtype)
            fused.run_forward(config, dev["input"], dev["weight"], dev["offset"], dev["mask"], dev["bias"], aligned)
            n = math.prod(geom.y_shape)
            buffer = cupy.full(n + 2, np.nan, dtype=dtype)
            shifted = buffer[1:n + 1].reshape(geom.y_shape)   # one element past an aligned address
            fused.run_forward(config, dev["input"], dev["weight"], dev["offset"], dev["mask"], dev["bias"], shifted)
            got = cupy.asnumpy(aligned)
            np.testing.assert_array_equal(cupy.asnumpy(shifted), got, err_msg=f"{precision} {tile}")
            assert np.isnan(cupy.asnumpy(buffer[[0, n + 1]])).all(), (precision, tile)
            assert relative_error(got.astype(np.float64), expected) < TOL[precision], (precision, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_every_half_tile_in_every_dimension(ndim):
    """Every tile of the half types (MINB 1 and 2; wgmma where the device has it), float16 and
    bfloat16, both step orders, in 1-d, 2-d and 3-d: the tuner may pick any of them for any N
    (the MINB 2 tiles spill in 3-d, benchmarks/fused_regs.py)."""
    cupy = _cupy()
    fused = _fused()
    rng = np.random.default_rng(40 + ndim)
    arrays, params = wide_case(rng, ndim, groups=1, offset_groups=2, mask_groups=1, c_in=128, c_out=160, batch=2)
    geom = _case_geom(arrays, params)
    for precision in ("float16", "bfloat16"):
        dtype = DTYPE[precision]
        dev = {k: cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
        expected = reference.deform_conv(**{k: a.astype(dtype).astype(np.float64) for k, a in arrays.items()},
                                         **params)
        for tile in fused._tiles(dtype):
            if not tile_runs(tile, precision, ndim):
                continue
            for taps_inner in (True, False):
                config = fused.LaunchConfig(geom, dtype, False, tile=tile, taps_inner=taps_inner)
                assert config.uniform
                out = cupy.full(geom.y_shape, np.nan, dtype=dtype)
                fused.run_forward(config, dev["input"], dev["weight"], dev["offset"], dev["mask"], dev["bias"], out)
                got = cupy.asnumpy(out).astype(np.float64)
                assert relative_error(got, expected) < TOL[precision], (precision, tile, taps_inner)


@pytest.mark.gpu
def test_matches_cpu_backend():
    cupy = _cupy()
    from dcn_cupy._backends import cpu
    rng = np.random.default_rng(8)
    for ndim in (1, 2, 3):
        arrays, params = wide_case(rng, ndim)
        geom = _case_geom(arrays, params)
        host = {k: a.astype(np.float32) for k, a in arrays.items()}
        expected = cpu.conv_forward(host["input"], host["weight"], host["offset"], host["mask"], host["bias"], geom)
        out = cupy.empty(geom.y_shape, dtype=np.float32)
        _fused().fused_conv_forward(*(cupy.asarray(host[k]) for k in ("input", "weight", "offset", "mask", "bias")),
                                    geom, out, allow_tf32=False)
        assert relative_error(cupy.asnumpy(out), expected) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_matches_torchvision(precision):
    cupy = _cupy()
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("torchvision.ops")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    rng = np.random.default_rng(9)
    arrays, params = wide_case(rng, 2, groups=1, offset_groups=2, mask_groups=2, c_in=64, c_out=64, batch=4,
                               stride=(2, 1), padding=(1, 2), dilation=(1, 2))
    dev = torch.device("cuda", cupy.cuda.runtime.getDevice())
    tdtype = {"float32": torch.float32, "float16": torch.float16}[precision]
    t = {k: torch.from_numpy(a).to(dev, tdtype) for k, a in arrays.items()}
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        y_tv = ops.deform_conv2d(t["input"], t["offset"], t["weight"], t["bias"], stride=params["stride"],
                                 padding=params["padding"], dilation=params["dilation"], mask=t["mask"])
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    got, expected, _ = run_fused(arrays, params, precision, 2)
    tv = y_tv.double().cpu().numpy()
    assert relative_error(got, tv) < 2 * TOL[precision]
    if precision == "float16":   # no worse than torchvision against the float64 reference
        assert relative_error(got, expected) <= 1.5 * relative_error(tv, expected)


@pytest.mark.gpu
@ENGINES
@pytest.mark.parametrize("precision", ["float32", "tf32", "float16"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("wide", [True, False], ids=["vector", "per-channel"])
def test_non_finite_and_huge_offsets(ndim, precision, wide, engine):
    if engine == 3 and not wide:
        pytest.skip("ENGINE 3 has no per-channel sampler")
    rng = np.random.default_rng(40 + ndim)
    if wide:
        arrays, params = wide_case(rng, ndim, c_in=128 if engine == 3 else 64)
    else:
        case = random_case(rng, ndim, False, batch=2)
        arrays, params = dict(case.arrays_), case.params
    offset = arrays["offset"].copy()
    flat = offset.reshape(-1)
    bad = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 3e9, -3e9, 65504.0, 2.0**31, -0.999999, -1.0])
    picks = rng.choice(flat.size, size=min(flat.size, 4 * bad.size), replace=False)
    flat[picks] = np.resize(bad, picks.size)
    arrays = dict(arrays, offset=offset)
    got, expected, _ = run_fused(arrays, params, precision, ndim, engine)
    assert np.all(np.isfinite(got))
    assert relative_error(got, expected) < TOL[precision]


@pytest.mark.gpu
@ENGINES
@pytest.mark.parametrize("precision", ["float32", "tf32"])
@pytest.mark.parametrize("wide", [True, False], ids=["vector", "per-channel"])
def test_non_finite_input_reaches_exactly_the_dense_convolution_pattern(wide, precision, engine):
    """Zero offsets, no mask: the non-finite pattern equals the dense convolution's (corners of
    weight 0 are not read; 3xTF32 keeps an infinite operand infinite)."""
    torch = pytest.importorskip("torch")
    if engine == 3 and not wide:
        pytest.skip("ENGINE 3 has no per-channel sampler")
    rng = np.random.default_rng(77)
    C = (64 if engine == 3 else 32) if wide else 6
    x = rng.standard_normal((2, C, 9, 8))
    x[0, 1, 3, 4] = np.inf
    x[1, C - 1, 0, 0] = np.nan
    w = rng.standard_normal((8, C, 3, 3))
    arrays = {"input": x, "weight": w, "offset": np.zeros((2, 18, 9, 8)), "mask": None, "bias": None}
    got, _, _ = run_fused_tile(arrays, dict(padding=1), precision, engine_tile(engine, precision))
    dense = torch.nn.functional.conv2d(torch.from_numpy(x.astype(np.float32).astype(np.float64)),
                                       torch.from_numpy(w.astype(np.float32).astype(np.float64)), padding=1).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(dense))
    assert np.array_equal(np.isinf(got), np.isinf(dense))
    finite = np.isfinite(dense)
    assert relative_error(got[finite], dense[finite]) < TOL[precision]


@pytest.mark.gpu
def test_tuner_times_each_tile_with_and_without_the_sampling_plan(monkeypatch):
    """The tuner's candidates: each tile with and without the plan where it serves (16-byte
    sampler, at most MAX_PLAN_SEGMENTS segments), the plan in smaller chunks where it is larger
    than a sample's copy (C_in = 64 in float16); only the plan where SAMPLING_PLAN forces it on;
    persistent blocks as the rule takes them in the half types, both ways in TF32."""
    _cupy()
    fused = _fused()
    timed, warps, configs = [], [], []

    def record(candidates, args, out, rounds=2, repeats=2):
        configs.append(candidates)
        timed.append([(config.sampling_plan, config.chunk, config.uniform and config.tile[4] != 2)
                      for config in candidates])
        warps.append([config.warp_corners for config in candidates])
        return [1.0 + i for i in range(len(candidates))]   # the first candidate wins

    monkeypatch.setattr(fused, "_time_configs", record)
    monkeypatch.setattr(fused, "_tuned", {})
    monkeypatch.setattr(fused, "TUNE", True)
    monkeypatch.setattr(fused, "SAMPLING_PLAN", None)
    # a sample's fp16 copy 64 x 64 x 2 = 8 KiB, its plan 64 x 288 = 18 KiB: at most 3 samples
    narrow = _geom((8, 64, 8, 8), (64, 64, 3, 3), (8, 18, 8, 8), (8, 9, 8, 8), padding=1)
    config = fused.plan_config(narrow, np.float16, False)
    assert not config.sampling_plan   # the first candidate: no plan
    assert {plan for plan, _, _ in timed[0]} == {False, True}
    assert {n for plan, n, _ in timed[0] if plan} == {3} and {n for plan, n, _ in timed[0] if not plan} == {8}
    assert all(serves for plan, _, serves in timed[0] if plan)
    assert any(warps[0])   # the warps' corner batches too, where they serve (one offset and mask group)
    monkeypatch.setattr(fused, "SAMPLING_PLAN", True)
    monkeypatch.setattr(fused, "_tuned", {})
    fused.plan_config(narrow, np.float16, False)
    assert any(plan for plan, _, _ in timed[1])
    assert all(plan == serves for plan, _, serves in timed[1])   # no candidate without it where it serves
    # persistent blocks where the tiles outnumber the blocks the device holds: the half types as
    # the rule takes them (no twin of one tile a block), TF32 timed both ways; none at 8x8
    assert not any(config.persistent for config in configs[0])
    monkeypatch.setattr(fused, "SAMPLING_PLAN", None)
    big = _geom((8, 256, 56, 56), (256, 256, 3, 3), (8, 18, 56, 56), (8, 9, 56, 56), padding=1)
    for dtype, tf32 in ((np.float16, False), (np.float32, True)):
        monkeypatch.setattr(fused, "_tuned", {})
        fused.plan_config(big, dtype, tf32)
        twins = {}
        for config in configs[-1]:
            key = (config.tile, config.taps_inner, config.sampling_plan, config.warp_corners, config.loads_ahead)
            twins.setdefault(key, set()).add(config.persistent)
            assert config.persistent <= config.can_persist
        # the warps' corner batches with two steps of loads in flight too, wherever the tile has them
        batched = {key[:2] for key in twins if key[3] and fused.loads_ahead_serves(dtype, 2, key[0])}
        assert {key[:2] for key in twins if key[4]} == batched, dtype
        persisting = {key: found for key, found in twins.items()
                      if fused.tile_persists(key[0], int(tf32)) and not key[4]}   # (loads ahead: one tile a block)
        assert all(found == {False} for key, found in twins.items() if key[4])
        assert persisting and all(found == ({True} if dtype == np.float16 else {False, True})
                                  for found in persisting.values()), (dtype, persisting)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_plans_choose_and_force_fused(dtype, monkeypatch):
    """The plan layer: automatic choice (fused for the half types, and for float32 on compute
    capability 9.0 in TF32, and in 3xTF32 where a warp-specialised tile serves), forced
    selection through ``algorithm=`` and ``use_algorithm``, and the transposed convolution's
    backward-to-input (a conv forward by duality) on the fused kernel."""
    cupy = _cupy()
    from dcn_cupy._backends import cuda_direct
    monkeypatch.setattr(cuda_direct, "MAX_MACS", 0)   # the choice among the other CUDA algorithms
    from dcn_cupy._backends import cuda_fused
    monkeypatch.setattr(cuda_fused, "fused_versus_im2col", lambda *a: (1.0, 2.0))   # fused measured faster
    import dcn_cupy
    from dcn_cupy._backends import use_algorithm
    rng = np.random.default_rng(12)
    tol = 1e-5 if dtype == np.float32 else 3e-3
    for ndim in (1, 2, 3):
        conv = random_case(rng, ndim, False, channels_scale=16)
        arrays = conv.arrays(lambda a: cupy.asarray(a.astype(dtype)))
        rounded = {k: None if a is None else a.astype(dtype).astype(np.float64) for k, a in conv.arrays_.items()}
        auto = dcn_cupy.plan(**arrays, **conv.params, allow_tf32=False)
        geom = _case_geom(conv.arrays_, conv.params)
        # strict float32: where a warp-specialised tile serves (float32-accurate accumulation)
        accurate = cuda_fused.LaunchConfig(geom, dtype, False, wgmma=True).tile[4] == 3
        expected_auto = ("cuda/fused" if dtype == np.float16 or (cuda_fused.wgmma_available() and accurate)
                         else "cuda/im2col")
        assert f"forward: {expected_auto}" in auto.algorithm, auto.algorithm
        if dtype == np.float32:   # TF32: the fused forward where the wgmma tile runs
            tf32 = dcn_cupy.plan(**arrays, **conv.params, allow_tf32=True)
            expected = "cuda/fused" if cuda_fused.wgmma_available() else "cuda/im2col"
            assert f"forward: {expected}" in tf32.algorithm, tf32.algorithm
        forced = dcn_cupy.plan(**arrays, **conv.params, algorithm="cuda/fused")
        assert "forward: cuda/fused" in forced.algorithm, forced.algorithm
        y = forced.forward(**arrays)
        assert relative_error(cupy.asnumpy(y).astype(np.float64), conv.reference(rounded)) < tol, conv.label
        with use_algorithm("cuda/fused"):
            y2 = conv.forward(**arrays, **conv.params)
        assert cupy.array_equal(y, y2), conv.label

        case = random_case(rng, ndim, True, channels_scale=16)
        arrays = case.arrays(lambda a: cupy.asarray(a.astype(dtype)))
        rounded = {k: None if a is None else cupy.asarray(a.astype(dtype).astype(np.float64))
                   for k, a in case.arrays_.items()}
        gy = rng.standard_normal(case.reference().shape).astype(dtype)
        exact = case.backward(cupy.asarray(gy, np.float64), **rounded, wrt=("input",), **case.params).input
        with use_algorithm("cuda/fused"):
            got = case.backward(cupy.asarray(gy), **arrays, wrt=("input",), **case.params).input
        assert relative_error(cupy.asnumpy(got).astype(np.float64), cupy.asnumpy(exact)) < tol, case.label


@pytest.mark.gpu
def test_broadcast_batch_chunks_and_64bit_indices(monkeypatch):
    """A batch of stride 0, one-sample channels-last chunks, and the 64-bit instantiation."""
    cupy = _cupy()
    fused = _fused()
    rng = np.random.default_rng(13)
    arrays, params = wide_case(rng, 2, batch=3)
    dev = {k: None if a is None else cupy.asarray(a.astype(np.float16)) for k, a in arrays.items()}
    x1 = dev["input"][:1]
    dev["input"] = cupy.broadcast_to(x1, (3,) + x1.shape[1:])
    rounded = {k: None if a is None else a.astype(np.float16).astype(np.float64) for k, a in arrays.items()}
    rounded["input"] = np.broadcast_to(rounded["input"][:1], rounded["input"].shape)
    expected = reference.deform_conv(**rounded, **params)
    geom = _case_geom(arrays, params)
    monkeypatch.setattr(fused, "WORKSPACE_LIMIT_BYTES", 1)
    monkeypatch.setattr(fused, "_INT32_SAFE", 0)
    config = fused.LaunchConfig(geom, np.float16, False)
    assert config.chunk == 1 and config.index64
    out = cupy.full(geom.y_shape, np.nan, dtype=np.float16)
    workspace = cupy.empty(config.workspace_bytes, dtype=np.uint8)
    fused.FusedForward(config).run(dev, out, workspace)
    assert relative_error(cupy.asnumpy(out).astype(np.float64), expected) < TOL["float16"]
    with pytest.raises(ValueError, match="workspace must hold at least"):
        fused.FusedForward(config).run(dev, out, workspace[:10])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float16", "tf32"])
def test_warp_specialised_64bit_indices(monkeypatch, precision):
    """ENGINE 3's 64-bit instantiation (its first tile) with one-sample chunks: C_out/groups = 96
    (zero-padded weight tiles) and 5 samples of 7x7 (position tiles span samples)."""
    fused = _fused()
    if not fused.wgmma_available():
        pytest.skip("ENGINE 3: compute capability 9.0")
    rng = np.random.default_rng(17)
    arrays, params = wide_case(rng, 2, groups=2, offset_groups=2, mask_groups=1, c_in=128, c_out=192, batch=5,
                               stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    monkeypatch.setattr(fused, "WORKSPACE_LIMIT_BYTES", 1)
    monkeypatch.setattr(fused, "_INT32_SAFE", 0)
    tile = fused._tiles(DTYPE[precision], True)[-1]
    assert tile[4] == 3
    got, expected, config = run_fused_tile(arrays, params, precision, tile)
    assert config.index64 and config.chunk == 1 and config.tile == tile and "warp-specialised" in config.description
    assert relative_error(got, expected) < TOL[precision]


@pytest.mark.gpu
def test_plans_replay_recorded_fused_launches():
    """A plan's fused forward on C-contiguous arrays replays launches recorded once per set of
    addresses (and serves Plan.launch_forward); new buffers record again; a batch that is not
    C-contiguous takes the array path (run_forward). Every result is bitwise the same."""
    cupy = _cupy()
    fused = _fused()
    import dcn_cupy
    rng = np.random.default_rng(29)
    arrays, params = wide_case(rng, 2, groups=2, offset_groups=2, mask_groups=1, c_in=64, c_out=64, batch=3,
                               stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    dev = {k: cupy.asarray(a.astype(np.float16)) for k, a in arrays.items()}
    p = dcn_cupy.plan(**dev, **params, algorithm="cuda/fused")
    exe = p._fwd
    assert isinstance(exe, fused.FusedForward) and exe.pointer_path
    ws = cupy.empty(p.workspace_bytes, dtype=np.uint8)
    outs = [cupy.full(p.output_shape, np.nan, dtype=np.float16) for _ in range(5)]
    p.forward(**dev, out=outs[0], workspace=ws)
    p.forward(**dev, out=outs[0], workspace=ws)
    assert len(exe._recordings.entries) == 1
    p.forward(**dev, out=outs[1], workspace=ws)
    assert len(exe._recordings.entries) == 2
    pointers = tuple(dev[k].data.ptr for k in ("input", "weight", "offset", "mask", "bias"))
    assert p.launch_forward(pointers, outs[2].data.ptr, ws.data.ptr, cupy.cuda.get_current_stream().ptr)
    fused.run_forward(exe.config, *(dev[k] for k in ("input", "weight", "offset", "mask", "bias")), outs[3], ws)
    strided = cupy.stack([dev["input"], dev["input"]], axis=1)[:, 0]   # batch stride 2 * C * S
    assert not strided.flags.c_contiguous
    fused.run_forward(exe.config, strided, dev["weight"], dev["offset"], dev["mask"], dev["bias"], outs[4], ws)
    cupy.cuda.get_current_stream().synchronize()
    for out in outs[1:]:
        np.testing.assert_array_equal(cupy.asnumpy(out), cupy.asnumpy(outs[0]))
    rounded = {k: a.astype(np.float16).astype(np.float64) for k, a in arrays.items()}
    assert relative_error(cupy.asnumpy(outs[0]).astype(np.float64), reference.deform_conv(**rounded, **params)) \
        < TOL["float16"]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float16", "float32"])
def test_programmatic_dependent_launch_gives_the_same_bits(monkeypatch, precision):
    """The forward's launches with programmatic dependent launch (the weight re-layout beside the
    channels-last copy, each launch beside the kernel before it) and without, launch
    by launch and as a CUDA graph, in one-sample chunks, with and without the sampling plan, on a
    workspace poisoned (NaN) before every run: bitwise the same, and the reference's values. A
    kernel that read its inputs before they were written would read the poison."""
    cupy = _cupy()
    fused = _fused()
    from dcn_cupy._backends import cuda
    monkeypatch.setattr(fused, "WORKSPACE_LIMIT_BYTES", 1)   # one-sample chunks: copy, kernel, copy, ...
    rng = np.random.default_rng(31)
    arrays, params = wide_case(rng, 2, groups=1, offset_groups=1, mask_groups=1, c_in=64, c_out=64, batch=3,
                               stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    dtype = DTYPE[precision]
    dev = {k: cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    inputs = tuple(dev[k].data.ptr for k in ("input", "weight", "offset", "mask", "bias"))
    geom = _case_geom(arrays, params)
    expected = reference.deform_conv(**{k: a.astype(dtype).astype(np.float64) for k, a in arrays.items()}, **params)
    stream = cupy.cuda.get_current_stream()
    tiles = [tile for tile in fused._tiles(dtype) if tile[4] in (0, 3) and tile_runs(tile, precision)]
    checked = 0
    for tile in tiles:
        for plan in (False, True):
            config = fused.LaunchConfig(geom, dtype, False, tile=tile, sampling_plan=plan)
            if config.sampling_plan != plan:
                continue
            assert config.chunk == 1
            workspace = cupy.empty(config.workspace_bytes, dtype=np.uint8)
            strides = fused.FusedForward(config)._strides
            out = cupy.empty(geom.y_shape, dtype=dtype)
            results = []
            for pdl in (False, True):
                monkeypatch.setattr(cuda, "PDL", pdl)
                ops = cuda._Ops(fused.forward_launches(config, inputs, strides, out.data.ptr, workspace.data.ptr))
                if pdl and cuda._prepare is not None:   # all but the first and the plans': cuLaunchKernelEx
                    assert sum(len(op[7]) == 6 for op in ops) == len(ops) - 1 - plan * geom.batch
                for _ in range(3):   # launch by launch, then (second replay on) as a CUDA graph
                    workspace.fill(0xFF)
                    out.fill(np.nan)
                    cuda._replay(ops, None, stream.ptr)
                    results.append(cupy.asnumpy(out))
                assert ops.graph, "the launches were not captured as a CUDA graph"
            for got in results[1:]:
                np.testing.assert_array_equal(got, results[0], err_msg=str((tile, plan)))
            assert relative_error(results[0].astype(np.float64), expected) < TOL[precision], (tile, plan)
            checked += 1
    assert checked >= 2


@pytest.mark.gpu
def test_automatic_choice_follows_the_fused_versus_im2col_measurement(monkeypatch):
    """For the half types the plan times the fused forward (its tuned tile) against cuda/im2col's
    once per configuration and takes cuda/im2col where it measured faster than IM2COL_MARGIN of
    the fused one's time; without a measurement (no tuning) fused."""
    cupy = _cupy()
    import dcn_cupy
    from dcn_cupy._backends import cuda_direct, cuda_fused
    monkeypatch.setattr(cuda_direct, "MAX_MACS", 0)
    rng = np.random.default_rng(5)
    case = random_case(rng, 2, False, channels_scale=16)
    arrays = case.arrays(lambda a: cupy.asarray(a.astype(np.float16)))
    geom = dcn_cupy.plan(**arrays, **case.params).geom

    measured = cuda_fused.fused_versus_im2col(geom, np.float16, False)
    assert len(measured) == 2 and all(0 < t < 1e4 for t in measured), measured
    assert cuda_fused.fused_versus_im2col(geom, np.float16, False) is measured   # measured once
    auto = dcn_cupy.plan(**arrays, **case.params)
    winner = "cuda/im2col" if measured[1] < cuda_fused.IM2COL_MARGIN * measured[0] else "cuda/fused"
    assert auto.algorithm.startswith(f"forward: {winner}"), (auto.algorithm, measured)

    monkeypatch.setattr(cuda_fused, "fused_versus_im2col", lambda *a: (2.0, 1.0))
    slower = dcn_cupy.plan(**arrays, **case.params)
    assert slower.algorithm.startswith("forward: cuda/im2col"), slower.algorithm
    not_clearly = (1.0, cuda_fused.IM2COL_MARGIN + 0.05)   # im2col faster, not clearly: fused
    monkeypatch.setattr(cuda_fused, "fused_versus_im2col", lambda *a: not_clearly)
    assert dcn_cupy.plan(**arrays, **case.params).algorithm.startswith("forward: cuda/fused")
    monkeypatch.setattr(cuda_fused, "fused_versus_im2col", lambda *a: None)
    assert dcn_cupy.plan(**arrays, **case.params).algorithm.startswith("forward: cuda/fused")
    y = slower.forward(**arrays)
    rounded = {k: None if a is None else a.astype(np.float16).astype(np.float64) for k, a in case.arrays_.items()}
    assert relative_error(cupy.asnumpy(y).astype(np.float64), case.reference(rounded)) < 3e-3
