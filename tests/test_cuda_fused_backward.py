"""The fused backward ("cuda/fused-backward"): NVRTC compilation of every instantiation (no GPU
needed), its serving rule, then, on a GPU, the input, offset and mask gradients of every tile
against the float64 reference for N = 1, 2, 3 and every precision, with groups, offset groups !=
mask groups, stride / padding / dilation, with and without offset / mask, each gradient alone
and all together, partial channel and position tiles (batch 33), non-finite and huge offsets,
a broadcast batch, one-sample chunks, 64-bit indices, every output element written (outputs
poisoned with NaN), the bias gradient from the tile sums of grad_output's copy (plans fold it in,
bitwise repeatable), plans choosing and forcing it (the weight gradient through cuda/im2col), and
the transposed forward (the input gradient with a bias, by duality).

Tolerances (relative error in the norm): float16 5e-3 and bfloat16 4e-2 as for cuda/im2col's
gradients; TF32 5e-3; strict float32 (3xTF32) 1e-5.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest

from dcn_cupy import _geometry, reference
from dcn_cupy._interop import BFLOAT16

from cases import fractional_offsets, relative_error, tf32_rounded

TOL = {"float16": 5e-3, "bfloat16": 4e-2, "tf32": 5e-3, "float32": 1e-5}
DTYPE = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "tf32": np.dtype(np.float32),
         "float32": np.dtype(np.float32)}
PRECISIONS = tuple(TOL)
NAMES = ("input", "weight", "offset", "mask")


def _backward_module():
    pytest.importorskip("cupy")
    from dcn_cupy._backends import cuda_fused_backward
    return cuda_fused_backward


# ---------------------------------------------------------------------------------------------
# compilation and rules (no GPU)


def _module_keys():
    try:
        from dcn_cupy._backends import cuda_fused_backward
    except ImportError:
        return [pytest.param(None, id="cupy-unavailable")]
    return cuda_fused_backward.all_module_keys()


def _key_id(key):
    return "none" if key is None else f"{np.dtype(key[0]).name}-{key[1]}d-{'i64' if key[2] else 'i32'}"


@pytest.mark.parametrize("key", _module_keys(), ids=_key_id)
def test_every_instantiation_compiles(key, compile_module):
    fb = _backward_module()
    compile_module(fb.module_source(), "deform_fused_backward.cu", fb.name_expressions(*key))


@pytest.mark.parametrize("key", _module_keys(), ids=_key_id)
def test_sm90a_kernels_compile(key, compile_module):
    """The sm_90a module: the warp-specialised weight kernel and the data kernel's wgmma loop."""
    fb = _backward_module()
    compile_module(fb.module_source(), "deform_fused_backward.cu", fb.ws_name_expressions(*key), arch="sm_90a")


@pytest.mark.parametrize("switch", ["WS_LOADS_AHEAD", "WS_CHANNEL_ROWS", "WS_EPILOGUE_RED"])
def test_sm90a_kernels_compile_with_a_switch_flipped(switch, compile_module, monkeypatch):
    """The sm_90a module built with one of the warp-specialised weight kernel's switches away from
    its default (the A/B's other side, benchmarks/ab.py) compiles; the other module's source does
    not change."""
    fb = _backward_module()
    other, default = fb.module_source(sm90a=False), fb.module_source()
    value = not getattr(fb, switch)
    monkeypatch.setattr(fb, switch, value)
    source = fb.module_source()
    assert source == f"#define DCN_{switch} {int(value)}\n" + default and fb.module_source(sm90a=False) == other
    assert fb._switches(sm90a=False) == (fb.DETERMINISTIC_FAST_PATH, False) and value in fb._switches()
    for key in ((np.float32, 2, False), (np.float16, 1, True), (np.float32, 3, False)):
        compile_module(source, "deform_fused_backward.cu", fb.ws_name_expressions(*key), arch="sm_90a")


def test_weight_kernel_compiles_with_its_epilogue_reductions(compile_module, monkeypatch):
    """The other module built with the mma.sync weight kernel's epilogue reductions
    (WEIGHT_EPILOGUE_RED, the A/B's other side) compiles; the sm_90a module's source and key do
    not change."""
    fb = _backward_module()
    other, default, other_key = fb.module_source(), fb.module_source(sm90a=False), fb._switches()
    monkeypatch.setattr(fb, "WEIGHT_EPILOGUE_RED", True)
    source = fb.module_source(sm90a=False)
    assert source == "#define DCN_WEIGHT_EPILOGUE_RED 1\n" + default and fb.module_source() == other
    assert fb._switches(sm90a=False) == (fb.DETERMINISTIC_FAST_PATH, True) and fb._switches() == other_key
    for key in ((np.float32, 2, False), (np.float16, 1, True), (np.float32, 3, True)):
        names = [name for name in fb.name_expressions(*key) if name.startswith("deform_fused_backward_weight<")]
        assert names, key
        compile_module(source, "deform_fused_backward.cu", names)


def test_ws_switch_defaults_are_the_sources():
    """``_WS_SOURCE_DEFAULTS`` (what module_source leaves undefined) is what the source's #ifndef
    blocks define, and the module's settings start there."""
    import re
    from dcn_cupy._backends import cuda_source_dir
    fb = _backward_module()
    text = (cuda_source_dir() / "deform_fused_backward.cu").read_text()
    for switch, value in fb._WS_SOURCE_DEFAULTS.items():
        found = re.search(rf"#ifndef DCN_{switch}\n#define DCN_{switch} ([01])\n#endif", text)
        assert found and int(found.group(1)) == int(value), switch
        assert getattr(fb, switch) == value, switch
    # (the other module's: off in the source and in the module)
    assert "#ifndef DCN_WEIGHT_EPILOGUE_RED\n#define DCN_WEIGHT_EPILOGUE_RED 0\n#endif" in text
    assert fb.WEIGHT_EPILOGUE_RED is False


def test_module_source_defines_exactly_the_instantiated_kernels():
    import re
    fb = _backward_module()
    source = fb.module_source()
    assert '#line 1 "cuda/deform_fused_backward.cu"' in source and '#line 1 "cuda/fused_common.cuh"' in source
    defined = set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(", source))
    for key in fb.all_module_keys():
        names = fb.name_expressions(*key) + fb.ws_name_expressions(*key)
        assert {name.split("<", 1)[0] for name in names} == defined


def _geom(c_in=64, c_out=48, groups=1, offset_groups=1, mask_groups=1, ndim=2, batch=2):
    k = (3,) * ndim
    K = math.prod(k)
    S = (8,) * ndim
    shapes = ((batch, c_in) + S, (c_out, c_in // groups) + k,
              (batch, offset_groups * K * ndim) + S if offset_groups else None,
              (batch, mask_groups * K) + S if mask_groups else None, None)
    return _geometry.conv_geometry(*shapes, stride=1, padding=1, dilation=1, groups=groups)[0]


def test_one_plan_for_both_kernels_and_equal_chunks():
    """Where the data kernel has its plan and the weight kernel would have a sampling plan, the
    weight kernel reads the data kernel's (no sampling plan in the workspace); the data kernel's
    rule counts the sampling plan it replaces; the batch is cut into equal chunks."""
    fb = _backward_module()

    def config(dtype, tf32, batch=32, channels=64, size=56, ndim=2, **forced):
        S, k = (size,) * ndim, (3,) * ndim
        K = math.prod(k)
        geom = _geometry.conv_geometry((batch, channels) + S, (channels, channels) + k, (batch, K * ndim) + S,
                                       (batch, K) + S, None, stride=1, padding=1, dilation=1, groups=1)[0]
        return fb.BackwardConfig(geom, dtype, tf32, multiprocessors=132, **forced)

    # B=32 C64 56x56 fp16: the data kernel's plan (2.37 MB a sample) is larger than the other
    # buffers (2.34 MB) but not than them and the sampling plan (0.90 MB) together
    c = config(np.float16, False)
    assert c.gradient_plan and c.sampling_plan and c.plan_shared
    assert c.offsets["plan_rows"][1] == c.offsets["plan_weights"][1] == 0
    assert c.weight_plan == ("gradient_rows", "gradient_weights", "gradient_masks")
    assert c.chunk == 16        # at most 28 samples within the bound: 16 + 16, not 28 + 4
    assert "the data gradients' plan" in c.description
    assert config(np.float32, True).chunk == 16 and config(np.float32, True).plan_shared    # not 19 + 13
    # forced apart: the sampling plan of its own, in the workspace
    c = config(np.float16, False, gradient_plan=False)
    assert c.sampling_plan and not c.plan_shared and c.offsets["plan_rows"][1] > 0
    assert c.weight_plan == ("plan_rows", "plan_weights", None)
    assert "a sampling plan per chunk" in c.description
    # 1D: no data kernel plan, so the weight kernel keeps its own
    c = config(np.float16, False, batch=16, channels=256, size=4096, ndim=1)
    assert c.sampling_plan and not c.gradient_plan and not c.plan_shared
    chunks = -(-16 // c.chunk)
    assert chunks > 1 and c.chunk == -(-16 // chunks)                  # equal chunks (but the last)


@pytest.mark.parametrize("deterministic", [False, True])
def test_leading_copies_start_beside_the_kernel_before_them(monkeypatch, deterministic):
    """The launches a backward records (no GPU: kernels and launches stubbed): the list's leading
    channels-last copies of its inputs (the weight's rows, x and grad_output of the first chunk,
    before any other kernel) are ``early`` (they run beside the kernel before them and wait for it
    only before they exit); every later copy waits first, since it overwrites what the chunk
    before read. Whole batch and one-sample chunks, x's copy left out (``input_copied``),
    deterministic mode (its weight bound's kernel comes between), and ``EARLY_COPIES`` off."""
    fb = _backward_module()
    geom = _geometry.conv_geometry((3, 64, 9, 9), (64, 64, 3, 3), (3, 18, 9, 9), (3, 9, 9, 9), None, stride=1,
                                   padding=1, dilation=1, groups=1)[0]
    monkeypatch.setattr(fb.BackwardConfig, "kernel", lambda self, name, scatter=False: name)
    monkeypatch.setattr(fb._cuda, "_kernel_op", lambda kernel, grid, block, args, shared_mem=0, overlap=False:
                        (0, kernel, args, overlap))   # (0: a kernel, as recorded)
    inputs = tuple(k << 24 for k in range(1, 7))
    outs = tuple(k << 24 for k in range(7, 12))
    strides = (64 * 81, 64 * 81, 18 * 81, 9 * 81, 64 * 81, 18 * 81, 9 * 81)

    def early_flags(config, **options):
        ops = fb._launches(config, inputs, strides, outs, 12 << 24, **options)
        copies = [op for op in ops if op[0] == 0 and op[1].startswith("fused_channels_last")]
        assert all(isinstance(op[2][-1], np.int32) for op in copies)
        return [int(op[2][-1]) for op in copies], [op[1] for op in ops if op[0] == 0]

    whole = fb.BackwardConfig(geom, np.float16, False, deterministic=deterministic)
    assert whole.chunk == 3
    flags, kernels = early_flags(whole)
    # the weight's rows, x and grad_output; in deterministic mode the weight's bound between
    assert flags == ([1, 0, 0] if deterministic else [1, 1, 1]), kernels
    flags, _ = early_flags(whole, input_copied=True)
    assert flags == ([1, 0] if deterministic else [1, 1])
    monkeypatch.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", 1)
    chunked = fb.BackwardConfig(geom, np.float16, False, deterministic=deterministic)
    assert chunked.chunk == 1
    flags, _ = early_flags(chunked)
    assert flags == ([1, 0, 0] if deterministic else [1, 1, 1]) + [0, 0] * 2
    monkeypatch.setattr(fb, "EARLY_COPIES", False)
    assert early_flags(chunked)[0] == [0] * 7


def _pointer(address: int):
    """A CuPy array's ``.data`` without a GPU: its ``ptr``."""
    return type("Pointer", (), {"ptr": address})()


class _StubArray:
    """What ``gradient_launches`` reads of an array, without a GPU: its address, shape and strides
    (C-contiguous, 2-byte elements by default)."""

    def __init__(self, address, shape, itemsize=2):
        self.data = _pointer(address)
        self.shape, self.itemsize = shape, itemsize
        self.strides = (math.prod(shape[1:]) * itemsize,) + (itemsize,) * (len(shape) - 1)


def _stubbed_launch_arguments(monkeypatch, fb, shapes: dict, shift: int):
    """``gradient_launches``' arguments without a GPU: kernels named and launches recorded as
    ``(0, name, args)``; ``shapes`` of grad_output, input, weight, offset and mask; the arrays and
    the gradients at addresses ``k << shift`` (1-5 and 7-10). (args, grads, geometry)."""
    monkeypatch.setattr(fb.BackwardConfig, "kernel", lambda self, name, scatter=False: name)
    monkeypatch.setattr(fb._cuda, "_kernel_op", lambda kernel, grid, block, args, shared_mem=0, overlap=False:
                        (0, kernel, args))
    args = {name: _StubArray((k + 1) << shift, shape) for k, (name, shape) in enumerate(shapes.items())}
    args["bias"] = None
    names = ("input", "weight", "offset", "mask")
    grads = {name: _StubArray((k + 7) << shift, shapes[name]) for k, name in enumerate(names)}
    geom = _geometry.conv_geometry(*(shapes[name] for name in names), None, stride=1, padding=1, dilation=1,
                                   groups=1)[0]
    return args, grads, geom


@pytest.mark.parametrize("deterministic", [False, True])
def test_gradient_launches_hold_each_kernel_once(monkeypatch, deterministic):
    """``gradient_launches`` (no GPU: kernels, launches and arrays stubbed) records what
    ``run_gradients`` runs: for the data gradients one data kernel and, where the config makes it,
    one plan of them; for the weight gradient alone one weight kernel (and its sampling plan where
    it does not share the data gradients'). ``benchmarks/stages.py`` replays each of these launches
    alone, with the library's own arguments."""
    fb = _backward_module()
    args, grads, geom = _stubbed_launch_arguments(
        monkeypatch, fb, dict(grad_output=(3, 64, 9, 9), input=(3, 64, 9, 9), weight=(64, 64, 3, 3),
                              offset=(3, 18, 9, 9), mask=(3, 9, 9, 9)), shift=24)
    config = fb.BackwardConfig(geom, np.float16, False, deterministic=deterministic)
    assert config.chunk == 3 and config.fused_weight

    def kernels(wanted):
        ops = fb.gradient_launches(config, dict(args, wanted=frozenset(wanted)), grads, _StubArray(12 << 24, (1,)))
        return [op[1] for op in ops if op[0] == 0]

    data = kernels(("input", "offset", "mask"))
    assert data.count("data") == 1 and "weight" not in data
    assert data.count("fused_gradient_plan") == int(config.gradient_plan)
    weight = kernels(("weight",))
    assert weight.count("weight") == 1 and "data" not in weight
    assert weight.count("fused_sampling_plan") == int(config.sampling_plan and not config.plan_shared)


@pytest.mark.parametrize("ws_weight", [False, True], ids=["mma.sync", "warp-specialised"])
def test_default_mode_reduces_the_weight_splits_into_one_sum(monkeypatch, ws_weight):
    """The launches of the weight gradient (no GPU: kernels, launches and arrays stubbed). In the
    default mode, its position splits reduce their sums into one float32 slot (``REDUCED_SPLITS``):
    the workspace holds one copy of the weight gradient, not one a split, cleared by a memset
    before any kernel; every chunk's weight kernel reduces (``SUMS_REDUCE``), and
    ``fused_weight_sum`` reads one slot. Deterministic mode, ``REDUCED_SPLITS`` off and a single
    split keep a slot a split, stored by the first chunk and added to by the others."""
    fb = _backward_module()
    args, grads, geom = _stubbed_launch_arguments(
        monkeypatch, fb, dict(grad_output=(4, 256, 14, 14), input=(4, 128, 14, 14), weight=(256, 128, 3, 3),
                              offset=(4, 18, 14, 14), mask=(4, 9, 14, 14)), shift=28)
    workspace = 12 << 28
    weight_size = 256 * 128 * 9

    def launches(config, wanted):
        ops = fb.gradient_launches(config, dict(args, wanted=frozenset(wanted)), grads, _StubArray(workspace, (1,)))
        part = workspace + config.offsets["part"][0]
        memsets = [k for k, op in enumerate(ops) if op[0] == 2 and op[1] == part]
        first_kernel = next(k for k, op in enumerate(ops) if op[0] == 0)
        weights = [op[2] for op in ops if op[0] == 0 and op[1] == "weight"]
        sums = [op[2] for op in ops if op[0] == 0 and op[1] == "fused_weight_sum"]
        assert len(sums) == 1 and int(sums[0][2]) == config.part_slots, wanted
        # the kernels' sum_mode: the warp-specialised one's last argument but one, the mma.sync one's last
        return memsets, first_kernel, [int(a[-2] if config.ws_weight else a[-1]) for a in weights]

    def config(**options):
        c = fb.BackwardConfig(geom, np.float16, False, ws_weight=ws_weight, wgmma=ws_weight, **options)
        assert c.fused_weight and c.ws_weight == ws_weight and c.splits > 1, c.description
        return c

    for chunked in (False, True):
        with monkeypatch.context() as m:
            if chunked:
                m.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", 1)
            reduced = config()
            fixed = config(deterministic=True)
            unreduced = config(reduced_splits=False)
            m.setattr(fb, "REDUCED_SPLITS", False)
            off = config()
        chunks = 4 if chunked else 1
        assert reduced.chunk == 4 // chunks
        assert reduced.reduced_splits and reduced.part_slots == 1
        assert reduced.offsets["part"][1] == weight_size and "reduced into one sum" in reduced.description
        for wanted in (NAMES, ("weight",)):
            memsets, first_kernel, modes = launches(reduced, wanted)
            assert len(memsets) == 1 and memsets[0] < first_kernel, wanted
            assert modes == [fb.SUMS_REDUCE] * chunks, wanted
        for c in (fixed, unreduced, off):
            assert not c.reduced_splits and c.part_slots == c.splits
            assert c.offsets["part"][1] == c.splits * weight_size and "fixed-order sum" in c.description
            memsets, _, modes = launches(c, ("weight",))
            assert not memsets and modes == [fb.SUMS_STORE] + [fb.SUMS_ADD] * (chunks - 1)
        assert unreduced.workspace_bytes - reduced.workspace_bytes >= (reduced.splits - 1) * weight_size * 4
    # one split: nothing to reduce
    monkeypatch.setattr(fb, "MAX_SPLITS", 1)
    single = fb.BackwardConfig(geom, np.float16, False, ws_weight=ws_weight, wgmma=ws_weight)
    assert single.splits == 1 and not single.reduced_splits and launches(single, ("weight",))[2] == [fb.SUMS_STORE]


@pytest.mark.parametrize("in_place", [True, False])
def test_deterministic_offset_and_mask_gradients_stored_in_place(monkeypatch, in_place):
    """The deterministic backward's launches (no GPU: kernels and launches stubbed): float32 offset
    and mask gradients of one partial-sum slot are stored where they go by the data kernel, each
    chunk's samples at their place, with no ``fused_store`` (``DETERMINISTIC_IN_PLACE``; off: the
    workspace and a store a chunk each); a gradient whose samples are not back to back, a half
    type, or two partial-sum slots keep the store."""
    fb = _backward_module()
    monkeypatch.setattr(fb, "DETERMINISTIC_IN_PLACE", in_place)
    monkeypatch.setattr(fb.BackwardConfig, "kernel", lambda self, name, scatter=False: name)
    monkeypatch.setattr(fb._cuda, "_kernel_op", lambda kernel, grid, block, args, shared_mem=0, overlap=False:
                        (0, kernel, args))
    monkeypatch.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", 1)   # a sample a chunk
    outs = tuple(k << 24 for k in range(7, 12))   # the gradients of x, w, offset, mask, bias

    def launches(dtype, mask_groups=1, goff_stride=0):
        # 64 channels: one slot each (64 = 4 channels x 16 lanes); with 2 mask groups of 32,
        # segments of 32 channels, so two for the offset gradient's group and one for the mask's
        geom = _geometry.conv_geometry((3, 64, 9, 9), (64, 64, 3, 3), (3, 18, 9, 9), (3, 9 * mask_groups, 9, 9),
                                       None, stride=1, padding=1, dilation=1, groups=1)[0]
        config = fb.BackwardConfig(geom, dtype, False, deterministic=True)
        assert config.chunk == 1
        strides = (64 * 81, 64 * 81, 18 * 81, 9 * mask_groups * 81, 64 * 81, goff_stride or 18 * 81,
                   9 * mask_groups * 81)
        ops = fb._launches(config, tuple(k << 24 for k in range(1, 7)), strides, outs, 12 << 24)
        # the data kernel's goff and gmsk pointers, a chunk each; the stores' targets
        pointers = [(int(op[2][6]), int(op[2][7])) for op in ops if op[0] == 0 and op[1] == "data"]
        stores = [int(op[2][1]) for op in ops if op[0] == 0 and op[1] == "fused_store"]
        workspace = ((12 << 24) + config.offsets["goff"][0], (12 << 24) + config.offsets["gmsk"][0])
        return config, pointers, stores, strides, workspace

    config, pointers, stores, strides, workspace = launches(np.float32)
    assert config.slots == (1, 1)
    if in_place:
        assert pointers == [(outs[2] + b * strides[5] * 4, outs[3] + b * strides[6] * 4) for b in range(3)]
        assert stores == []
    else:
        assert pointers == [workspace] * 3
        assert stores == [target + b * stride * 4 for b in range(3) for target, stride in ((outs[2], strides[5]),
                                                                                          (outs[3], strides[6]))]
    _, pointers, stores, strides, workspace = launches(np.float16)
    assert pointers == [workspace] * 3 and len(stores) == 6
    _, pointers, stores, strides, workspace = launches(np.float32, goff_stride=18 * 81 + 4)   # goff's apart
    assert [p for p, _ in pointers] == [workspace[0]] * 3
    assert len(stores) == (3 if in_place else 6)
    config, pointers, stores, strides, workspace = launches(np.float32, mask_groups=2)
    assert config.slots == (2, 1)   # (segments of 32 channels: the offset group's two)
    assert [p for p, _ in pointers] == [workspace[0]] * 3
    assert len(stores) == (3 if in_place else 6)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["float16", "float32"])
def test_input_gradient_alone_takes_the_scatter_tile(monkeypatch, dtype):
    """The data kernel launched for the input gradient alone (a transposed forward's scatter, or
    wrt the input only) takes ``scatter_tile`` (no GPU: kernels and launches stubbed): in 3D the
    64x64 tile, its blocks and shared memory, where the offset and mask gradients keep the rule's
    64x128; in 2D, with a forced tile, deterministic, or ``SCATTER_NARROW_3D`` off, one tile."""
    fb = _backward_module()
    geom3 = _geometry.conv_geometry((2, 32, 6, 6, 6), (32, 32, 3, 3, 3), (2, 81, 6, 6, 6), (2, 27, 6, 6, 6), None,
                                    stride=1, padding=1, dilation=1, groups=1)[0]
    geom2 = _geometry.conv_geometry((2, 32, 9, 9), (32, 32, 3, 3), (2, 18, 9, 9), (2, 9, 9, 9), None, stride=1,
                                    padding=1, dilation=1, groups=1)[0]
    monkeypatch.setattr(fb.BackwardConfig, "kernel", lambda self, name, scatter=False: (name, scatter))
    monkeypatch.setattr(fb._cuda, "_kernel_op", lambda kernel, grid, block, args, shared_mem=0, overlap=False:
                        (0, kernel, grid, shared_mem))
    narrow, wide = fb._tiles(dtype)[:2]

    def data_launch(config, wrt):   # (scatter, grid, shared memory) of the data kernel's launch
        inputs = tuple(k << 24 for k in range(1, 7))
        outs = tuple((k << 24) if name in wrt else 0 for k, name in zip(range(7, 11), ("x", "w", "off", "m")))
        ops = fb._launches(config, inputs, (1,) * 7, outs, 12 << 24)
        (found,) = [(op[1][1], op[2], op[3]) for op in ops if op[0] == 0 and op[1][0] == "data"]
        return found

    config = fb.BackwardConfig(geom3, dtype, False)
    assert config.tile == wide and config.scatter_tile == narrow
    assert "(the input gradient alone: 64x64x" in config.description, config.description
    q = geom3.output_size * 2   # the chunk's positions
    assert data_launch(config, ("x",)) == (True, (-(-q // narrow[1]) * 27,), config.scatter_smem_bytes)
    for wrt in (("x", "off", "m"), ("off",), ("m",)):
        assert data_launch(config, wrt) == (False, (-(-q // wide[1]) * 27,), config.smem_bytes)
    for other in (fb.BackwardConfig(geom2, dtype, False), fb.BackwardConfig(geom3, dtype, False, tile=wide),
                  fb.BackwardConfig(geom3, dtype, False, deterministic=True)):
        assert other.scatter_tile == other.tile and "input gradient alone" not in other.description
    monkeypatch.setattr(fb, "SCATTER_NARROW_3D", False)
    assert fb.BackwardConfig(geom3, dtype, False).scatter_tile == wide


def test_weight_splits_fill_whole_waves(monkeypatch):
    fb = _backward_module()
    # B=32 C64 56x56 fp16 (one chunk): 9 tiles, 1568 steps, 2 blocks x 132 SMs. 59 splits (531
    # blocks) took a third wave of 3 blocks; 29 fill one wave of 261
    assert fb.weight_splits(9, 1568, 264) == 29
    cost = lambda splits: -(-9 * splits // 264) * (-(-1568 // splits) + 1)
    assert cost(29) < cost(59) and all(cost(29) <= cost(s) for s in range(1, fb.MAX_SPLITS + 1))
    # never more splits than steps or MAX_SPLITS; ties to fewer splits
    assert fb.weight_splits(9, 3, 264) == 3 and fb.weight_splits(9, 1, 264) == 1
    assert fb.weight_splits(1, 10**6, 10**4) == fb.MAX_SPLITS
    assert fb.weight_splits(600, 8, 132) == 1
    # MAX_SPLITS is read at call time (the long-reduction tests set it to 1)
    monkeypatch.setattr(fb, "MAX_SPLITS", 1)
    assert fb.weight_splits(1, 10**6, 10**4) == 1
    monkeypatch.undo()
    # the config takes the tile's MINB blocks an SM as a wave
    config = fb.BackwardConfig(_geom(c_in=64, c_out=64, batch=4), np.float32, True, multiprocessors=132)
    steps = -(-4 * config.Q // config.weight_tile[2])
    assert config.splits == fb.weight_splits(config.weight_tiles, steps, config.weight_tile[3] * 132)


def test_weight_gradient_through_im2col_only_where_clearly_faster(monkeypatch):
    """The fused backward keeps its own weight gradient (no columns buffer) unless cuda/im2col's
    measured faster than WEIGHT_COLUMNS_MARGIN of its time, per use (all gradients in one call, or
    split as a transposed convolution uses them); the times it reports are those of its choice."""
    import contextlib
    fb = _backward_module()
    geom = _geom(c_in=64, c_out=64, batch=4)
    margin = fb.WEIGHT_COLUMNS_MARGIN
    assert 0.5 < margin < 1.0
    monkeypatch.setattr(fb, "_key", lambda g, d, t: ("device", g, np.dtype(d).str, t))
    monkeypatch.setattr(fb._fused, "TUNE", True)
    monkeypatch.setattr(fb._fused, "_capturing", lambda: False)
    monkeypatch.setattr(fb._fused, "private_pool", contextlib.nullcontext)
    cases = [   # (own, own split), (through, through split) -> chosen (all, split)
        (((1.0, 2.0), (0.99 * margin, 2.0)), (False, True)),        # all: im2col's clearly faster
        (((1.0, 2.0), (1.01 * margin, 1.5)), (True, False)),        # all: not clearly; split: clearly
        (((1.0, 2.0), (1.2, 2.2)), (True, True)),
        (((math.inf, math.inf), (1.0, 2.0)), (False, False)),        # no weight gradient of its own
    ]
    for (own, through), (mine, mine_split) in cases:
        fb._versus.clear()
        fb._fused_weight.clear()
        monkeypatch.setattr(fb, "_time_one_chunk", lambda *a, own=own, through=through: (own, through, (3.0, 4.0)))
        found = fb.fused_versus_im2col(geom, np.float16, False)
        assert fb.fused_weight_choice(geom, np.float16, False) is mine
        assert fb.fused_weight_choice(geom, np.float16, False, transposed=True) is mine_split
        assert found == ((own if mine else through)[0], 3.0, (own if mine_split else through)[1], 4.0)
        assert fb.fused_versus_im2col(geom, np.float16, False) is found   # measured once
    fb._versus.clear()
    fb._fused_weight.clear()


def test_serving_rule_and_segments(monkeypatch):
    fb = _backward_module()
    assert fb.unsupported(_geom(), np.float16) is None
    assert "C_in/groups = 18" in fb.unsupported(_geom(c_in=36, groups=2), np.float16)
    assert "C_in/offset_groups = 6" in fb.unsupported(_geom(c_in=24, offset_groups=4), np.float16)
    assert "C_in/mask_groups = 10" in fb.unsupported(_geom(c_in=40, mask_groups=4), np.float32)
    # several conv groups: C_out/groups a multiple of the 16-byte vector (8 half, 4 float32)
    assert "C_out/groups = 12" in fb.unsupported(_geom(c_out=24, groups=2), np.float16)
    assert fb.unsupported(_geom(c_out=24, groups=2), np.float32) is None
    # a segment of lanes (4 channels each) never crosses a group; at most the lanes of a position
    assert fb.segment_lanes(_geom(c_in=256), 256) == 32
    assert fb.segment_lanes(_geom(c_in=256), 64) == 16
    assert fb.segment_lanes(_geom(c_in=64, offset_groups=4), 128) == 4
    assert fb.segment_lanes(_geom(c_in=48, mask_groups=2), 64) == 2     # 24 channels per mask group
    assert fb.segment_lanes(_geom(c_in=12), 64) == 1
    assert fb.segment_lanes(_geom(c_in=256), 64, 8) == 8                 # 8 lanes of 8 channels a position
    assert fb.segment_lanes(_geom(c_in=64, offset_groups=4), 128, 8) == 2
    # the data kernel's epilogue: 8 channels a lane in 3D where every group's channel count is a
    # multiple of 8 and the backward is not deterministic; 4 otherwise, and 8 cannot be forced there
    assert fb.epilogue_lane_channels(_geom(c_in=48, mask_groups=2, ndim=3), False) == 8   # 24 channels a group
    assert fb.epilogue_lane_channels(_geom(c_in=48, mask_groups=2), False) == 4          # 2D
    assert fb.epilogue_lane_channels(_geom(c_in=12, ndim=3), False) == 4
    assert fb.epilogue_lane_channels(_geom(c_in=64, offset_groups=16, ndim=3), False) == 4   # 4 channels a group
    assert fb.epilogue_lane_channels(_geom(c_in=64, ndim=3), True) == 4
    assert fb.BackwardConfig(_geom(c_in=64, ndim=3), np.float16, False).lane_channels == 8
    assert "8 channels a lane" in fb.BackwardConfig(_geom(c_in=64, ndim=3), np.float16, False).description
    assert fb.BackwardConfig(_geom(c_in=64, ndim=3), np.float16, False, lane_channels=4).lane_channels == 4
    assert fb.BackwardConfig(_geom(c_in=64), np.float16, False).lane_channels == 4
    for geom in (_geom(c_in=64), _geom(c_in=64, offset_groups=16, ndim=3)):
        with pytest.raises(ValueError, match="lane_channels=8"):
            fb.BackwardConfig(geom, np.float16, False, lane_channels=8)
    # lanes per position: all of the tile's (at most 32), or half where the 64-channel tiles'
    # half still covers C_in/groups in one pass
    assert fb.epilogue_lanes(_geom(c_in=128), 64, 4) == 16
    assert fb.epilogue_lanes(_geom(c_in=64, groups=2), 64, 4) == 8              # 32 channels a group
    assert fb.epilogue_lanes(_geom(c_in=64, groups=4), 64, 4) == 8              # 16: half is the least
    assert fb.epilogue_lanes(_geom(c_in=48), 64, 4) == 16                       # 48 > 8 lanes x 4
    assert fb.epilogue_lanes(_geom(c_in=32, ndim=3), 64, 8) == 4
    assert fb.epilogue_lanes(_geom(c_in=64, groups=2), 128, 4) == 32            # no narrow 128-row tile
    assert fb.epilogue_lanes(_geom(c_in=512), 128, 4) == 32
    narrow = fb.BackwardConfig(_geom(c_in=64, groups=2, c_out=64), np.float16, False)
    assert narrow.lanes == 8 and "8 lanes a position" in narrow.description
    assert narrow.seg == fb.segment_lanes(_geom(c_in=64, groups=2, c_out=64), 64)   # segments unchanged
    assert fb.BackwardConfig(_geom(c_in=256), np.float16, False).lanes == 16
    # the data tile: 64x128 where C_out/groups >= DATA_WIDE_MIN_ROWS (256) and in 3D, else 64x64
    assert fb._tiles(np.float16)[:2] == ((64, 64, 64, 2), (64, 128, 64, 2))
    assert fb._tiles(np.float32)[:2] == ((64, 64, 32, 2), (64, 128, 32, 2))
    long_reduction = fb.BackwardConfig(_geom(c_out=256), np.float32, True, wgmma=False)
    assert long_reduction.tile == (64, 128, 32, 2) and "tf32 mma.sync, tile 64x128x32" in long_reduction.description
    assert long_reduction.blocks(3) == -(-3 * 64 // 128) * 9
    # (the epilogue's column gradients and lane sums outgrow the operand buffers' 48 KiB)
    assert long_reduction.smem_bytes == 128 * 68 * 4 + 3 * 128 * 17 * 4 > 2 * 192 * 32 * 4
    # the 64x128 tile's main loop on wgmma where the device has it (sm_90a; not deterministic): 1 KiB
    # more, to lift the swizzled rows (strict float32 too) to their 1024-byte period
    on_wgmma = fb.BackwardConfig(_geom(c_out=256), np.float32, True, wgmma=True)
    assert on_wgmma.data_on_wgmma(on_wgmma.tile) and "tf32 wgmma, tile 64x128x32" in on_wgmma.description
    assert on_wgmma.smem_bytes == long_reduction.smem_bytes + 1024
    strict = fb.BackwardConfig(_geom(c_out=256), np.float32, False, wgmma=True)
    assert strict.data_on_wgmma(strict.tile) and strict.smem_bytes == 2 * 2 * 192 * 32 * 4 + 1024
    # deterministic too (its 3xTF32 products added per k8, as mma.sync's: the same bits), unless
    # WGMMA_DATA_DETERMINISTIC is off
    det = fb.BackwardConfig(_geom(c_out=256), np.float32, False, wgmma=True, deterministic=True)
    assert det.wgmma_data and "3xtf32 wgmma, tile 64x128x32" in det.description
    monkeypatch.setattr(fb, "WGMMA_DATA_DETERMINISTIC", False)
    assert not fb.BackwardConfig(_geom(c_out=256), np.float32, False, wgmma=True, deterministic=True).wgmma_data
    assert fb.BackwardConfig(_geom(c_out=256), np.float32, False, wgmma=True).wgmma_data
    det_name = fb.kernel_name(np.float32, False, 2, 2, (64, 128, 32, 2), "data", False, True, 4, None, True)
    assert fb._is_sm90a(det_name) and det_name in fb.ws_name_expressions(np.float32, 2, False)
    assert not fb.BackwardConfig(_geom(c_out=256), np.float32, False, wgmma=True, wgmma_data=False).wgmma_data
    narrow_on = fb.BackwardConfig(_geom(c_out=192), np.float32, False, wgmma=True)   # the 64x64 tile
    assert narrow_on.tile == (64, 64, 32, 2) and narrow_on.data_on_wgmma(narrow_on.tile)
    assert narrow_on.smem_bytes == 2 * 2 * 128 * 32 * 4 + 1024
    assert not narrow_on.data_on_wgmma((128, 64, 32, 1))   # (the 128-row tile keeps mma.sync)
    assert fb.wgmma_data_tiles(np.float16) == ((64, 64, 64, 2), (64, 128, 64, 2))
    # its kernels live in the sm_90a module, in 3xTF32 at WGMMA_SPLIT_NARROW_MINB (64x128: 2, where 3 spilled)
    name = fb.kernel_name(np.float32, False, 2, 2, (64, 64, 32, 3), "data", True, False, 4, None, True)
    assert name.endswith(", 16, true>") and fb._is_sm90a(name) and name in fb.ws_name_expressions(np.float32, 2, False)
    wide_name = fb.kernel_name(np.float32, False, 2, 2, (64, 128, 32, 2), "data", True, False, 4, None, True)
    assert wide_name in fb.ws_name_expressions(np.float32, 2, False)
    plain = fb.kernel_name(np.float32, False, 2, 2, (64, 128, 32, 3), "data", True)
    assert not fb._is_sm90a(plain) and plain in fb.name_expressions(np.float32, 2, False)
    assert fb.BackwardConfig(_geom(c_in=64, c_out=512, groups=2), np.float16, False).tile == (64, 128, 64, 2)
    assert fb.BackwardConfig(_geom(c_in=64, c_out=512, groups=4), np.float16, False).tile == (64, 64, 64, 2)
    assert fb.BackwardConfig(_geom(c_out=192), np.float32, False).tile == (64, 64, 32, 2)
    assert fb.BackwardConfig(_geom(ndim=3), np.float32, False).tile == (64, 128, 32, 2)
    assert fb.BackwardConfig(_geom(ndim=3), np.float16, False, deterministic=True).tile == (64, 128, 64, 2)
    assert fb.BackwardConfig(_geom(ndim=1), np.float16, False).tile == (64, 64, 64, 2)
    # the lanes' offset and mask partial sums wait in shared memory after the column gradients
    # (8 lanes a position or more, or deterministic): (N + 1) x BN x (BM / channels a lane + 1)
    # floats, within the operand buffers' 32 KiB for the 64-row tiles, beyond them for 128 rows;
    # the operand rows are 128 bytes, swizzled, but in strict float32 in 1D and 2D (padded by 16)
    assert fb.lane_sums_in_smem(16, False) and fb.lane_sums_in_smem(8, False)
    assert fb.lane_sums_in_smem(4, True) and not fb.lane_sums_in_smem(4, False)
    assert fb.data_smem_bytes(np.float16, (64, 64, 64, 4), 2, 4, 16, False, 0) == 32768
    assert fb.data_smem_bytes(np.float32, (64, 64, 32, 4), 2, 4, 16, False, 1) == 32768
    # (strict float32: a tile each of the operands' big and small parts)
    assert fb.data_smem_bytes(np.float32, (64, 64, 32, 4), 2, 4, 16, False, 2) == 2 * 2 * 128 * 36 * 4
    assert fb.data_smem_bytes(np.float32, (64, 64, 32, 2), 3, 8, 4, False, 2) == 2 * 2 * 128 * 32 * 4
    assert fb.data_rows_padded(2, 1) and fb.data_rows_padded(2, 2) and not fb.data_rows_padded(2, 3)
    assert not fb.data_rows_padded(0, 2) and not fb.data_rows_padded(1, 2)
    assert fb.data_smem_bytes(np.float16, (128, 64, 64, 1), 2, 4, 32, False, 0) == 64 * 132 * 4 + 3 * 64 * 33 * 4
    assert (fb.data_smem_bytes(np.float16, (128, 64, 64, 1), 3, 8, 4, False, 0)
            == fb.smem_bytes(np.float16, (128, 64, 64, 1), padded=False) == 2 * 192 * 64 * 2)
    assert fb.BackwardConfig(_geom(c_in=256), np.float16, False).smem_bytes == 32768
    strict = fb.BackwardConfig(_geom(c_in=256), np.float32, False)
    assert strict.smem_bytes == 2 * 2 * 128 * 36 * 4
    # strict float32's operand rows: the values' big parts, then their small ones (fused_channels_last_split)
    assert (strict.gy_row, strict.wt_row) == (2 * strict.Cop, 2 * strict.Cogp)
    assert strict.offsets["gycl"][1] == (2 * 8 * 8 + 1) * 2 * 48
    tf32 = fb.BackwardConfig(_geom(c_in=256), np.float32, True)
    assert (tf32.gy_row, tf32.wt_row) == (tf32.Cop, tf32.Cogp)
    # the weight kernel's grad_output rows are swizzled (BK a row; padded in strict float32), its
    # sampled rows padded
    assert fb.weight_smem_bytes(np.float16, (256, 64, 128, 1), 0) == 2 * (256 * 128 + 64 * 136) * 2
    assert fb.weight_smem_bytes(np.float32, (64, 64, 32, 2), 1) == 2 * (64 * 32 + 64 * 36) * 4
    assert fb.weight_smem_bytes(np.float32, (64, 64, 32, 2), 2) == 2 * (64 * 36 + 64 * 36) * 4
    config = fb.BackwardConfig(_geom(c_in=256, c_out=256), np.float16, False)
    assert config.weight_smem_bytes == fb.weight_smem_bytes(np.float16, config.weight_tile, 0)
    # the fused weight gradient: a sampling thread's 16 (half) / 8 (float32) channels in one group
    assert fb.weight_unsupported(_geom(c_in=64, offset_groups=2), np.float16) is None
    assert "C_in/offset_groups = 8 is not a multiple of 16" in fb.weight_unsupported(
        _geom(c_in=64, offset_groups=8), np.float16)
    assert fb.weight_unsupported(_geom(c_in=64, offset_groups=8), np.float32) is None
    # the tallest weight tile no taller than C_out/groups: fewer re-samplings of the input
    assert fb._weight_tile(_geom(c_out=48), np.float16)[0] == 64
    assert fb._weight_tile(_geom(c_in=256, c_out=512, groups=2), np.float16)[0] == 256
    # in 1D (two corners a sample) at most 128 rows, at 2 blocks per SM
    assert fb._weight_tile(_geom(c_in=256, c_out=256, ndim=1), np.float16) == (128, 64, 64, 2)
    assert fb._weight_tile(_geom(c_in=256, c_out=256, ndim=1), np.float32) == (128, 64, 32, 2)
    assert fb._weight_tile(_geom(c_in=256, c_out=64, ndim=1), np.float16)[0] == 64
    assert all(any(f"deform_fused_backward_weight<{t}, int, 1, {p}, 128, 64, {bk}, 2, true>" in name
                   for name in fb.name_expressions(dtype, 1, False))
               for dtype, t, p, bk in ((np.float16, "__half", 0, 64), (np.float32, "float", 2, 32)))
    # TF32 has its own tiles: steps of 64 positions in 2D, 32 in 1D and 3D (and in 3xTF32); its
    # 32-deep 2D tile serves where a group's channels are a multiple of 8, not of 16
    assert fb._weight_tile(_geom(c_in=64, c_out=64), np.float32, 1) == (64, 64, 64, 2)
    assert fb._weight_tile(_geom(c_in=64, c_out=64), np.float32, 2) == (64, 64, 32, 2)
    assert fb._weight_tile(_geom(c_in=64, c_out=64, ndim=3), np.float32, 1) == (64, 64, 32, 2)
    assert fb._weight_tile(_geom(c_in=64, c_out=64, offset_groups=8), np.float32, 1) == (64, 64, 32, 2)
    assert fb.weight_unsupported(_geom(c_in=64, offset_groups=8), np.float32, precision=1) is None
    assert fb.BackwardConfig(_geom(c_in=64, c_out=64), np.float32, True).weight_tile == (64, 64, 64, 2)
    assert fb.BackwardConfig(_geom(c_in=64, c_out=64), np.float32, False).weight_tile == (64, 64, 32, 2)
    names = fb.name_expressions(np.float32, 2, False)
    assert "deform_fused_backward_weight<float, int, 2, 1, 64, 64, 64, 2, true>" in names
    assert not any("deform_fused_backward_weight<float, int, 2, 2, 64, 64, 64," in name for name in names)
    assert "multiple of 8" in fb.weight_unsupported(_geom(c_in=64, offset_groups=16), np.float16, (256, 64, 32, 1))
    # where the tallest tile's 32 channels per sampling thread cross a group, the next one serves
    tall, short = fb._weight_tiles(np.float16)[1], fb._weight_tiles(np.float16)[0]
    assert fb.weight_unsupported(_geom(c_in=48, c_out=256), np.float16, tall) is not None
    assert fb._weight_tile(_geom(c_in=48, c_out=256), np.float16) == short
    assert fb.weight_unsupported(_geom(c_in=48, c_out=256), np.float16) is None
    # the sampling plan: segments of channels sharing their offset and mask group; used where
    # there are at most MAX_PLAN_SEGMENTS and several blocks sample each position (channel tiles)
    # or the problem is 1D or 2D
    assert fb.plan_segments(_geom(c_in=64)) == (64, 1)
    assert fb.plan_segments(_geom(c_in=64, offset_groups=2, mask_groups=4)) == (16, 4)
    assert fb.plan_segments(_geom(c_in=48, offset_groups=0, mask_groups=3)) == (16, 3)
    assert fb.BackwardConfig(_geom(c_in=256, offset_groups=8), np.float32, False).sampling_plan
    assert fb.BackwardConfig(_geom(c_in=64), np.float32, False).sampling_plan   # one block per position, 2D
    assert fb.BackwardConfig(_geom(c_in=64, ndim=1), np.float16, False).sampling_plan
    assert not fb.BackwardConfig(_geom(c_in=32, c_out=32, ndim=3), np.float16, False).sampling_plan   # 3D
    assert fb.BackwardConfig(_geom(c_in=256, c_out=256, ndim=3), np.float16, False).sampling_plan   # 4 tiles
    many = fb.BackwardConfig(_geom(c_in=256, offset_groups=16), np.float32, False)
    assert many.fused_weight and many.segments == 16 and not many.sampling_plan
    assert not fb.BackwardConfig(_geom(c_in=256), np.float16, False, fused_weight=False).sampling_plan
    # the data gradients' plan: in 2D and 3D, and in 1D for float32, where it is no larger than a
    # sample's other buffers
    assert fb.BackwardConfig(_geom(c_in=256), np.float16, False).gradient_plan
    assert not fb.BackwardConfig(_geom(c_in=32, c_out=32), np.float16, False).gradient_plan   # too large
    assert not fb.BackwardConfig(_geom(c_in=256, ndim=1), np.float16, False).gradient_plan
    for tf32 in (True, False):
        one_d = fb.BackwardConfig(_geom(c_in=256, ndim=1), np.float32, tf32)
        assert one_d.gradient_plan and one_d.plan_shared
    assert not fb.BackwardConfig(_geom(c_in=256, offset_groups=16), np.float16, False).gradient_plan
    forced = fb.BackwardConfig(_geom(c_in=64), np.float16, False, gradient_plan=True)
    assert forced.gradient_plan and forced.offsets["gradient_slopes"][1] == 2 * 64 * 9 * 4 * 2
    assert fb.BackwardConfig(_geom(c_in=48, c_out=256), np.float16, False).fused_weight
    with pytest.raises(ValueError, match="C_in/groups = 18"):
        fb.BackwardConfig(_geom(c_in=36, groups=2), np.float16, False)


def test_deterministic_configuration():
    """Deterministic: a 64-bit fixed-point accumulator with its flags and bounds in place of the
    float32 one, one partial sum per segment of channels (of at most 16 lanes, whatever the
    tile) for the offset and mask gradients, and 2^L >= Q * K contributions per element."""
    fb = _backward_module()
    geom = _geom(c_in=64, offset_groups=2, mask_groups=1)          # 32 channels per offset group
    plain = fb.BackwardConfig(geom, np.float16, False)
    det = fb.BackwardConfig(geom, np.float16, False, deterministic=True)
    assert plain.slots == (1, 1) and plain.offsets["gxq"][1] == 0 and plain.offsets["gxcl"][1] > 0
    assert det.seg == 8 and det.slots == (1, 2)                     # 32 / (4 * 8), 64 / (4 * 8)
    n, S, Cpa = det.chunk, det.S, det.Cpa
    assert det.offsets["gxcl"][1] == 0
    assert det.offsets["gxq"][1:] == (n * S * Cpa, np.dtype(np.uint64))
    assert det.offsets["gx_flags"][1] == -(-n * S * Cpa // 16)
    assert det.offsets["bounds"][1] == 2 * n and det.offsets["weight_bound"][1] == 1
    assert det.offsets["gmsk"][1] == 2 * n * det.m_ch * det.Q
    assert det.log2_count == (det.Q * det.K - 1).bit_length()
    assert "fixed-point" in det.description and "fixed-point" not in plain.description
    wide = _geom(c_in=256)
    for tile in fb._tiles(np.float16):
        assert fb.BackwardConfig(wide, np.float16, False, tile, deterministic=True).seg == 16
    tall = fb._tiles(np.float16)[2]   # 128 rows: 32 lanes a position
    assert tall[0] == 128 and fb.BackwardConfig(wide, np.float16, False, tall).seg == 32
    wide3 = _geom(c_in=256, ndim=3)
    assert fb.BackwardConfig(wide3, np.float16, False, tall).seg == 16   # 8 channels a lane
    assert fb.BackwardConfig(wide3, np.float16, False, tall, lane_channels=4).seg == 32
    no_offset = fb.BackwardConfig(_geom(offset_groups=0), np.float32, False, deterministic=True)
    assert no_offset.log2_count == (no_offset.K - 1).bit_length()
    # MINB 2 tiles: 4 blocks per SM in 1D and 2D (default and deterministic), 3 for 64x128, 2 in 3D
    assert fb.data_tile((64, 64, 64, 2), 2) == (64, 64, 64, 4)
    assert fb.data_tile((64, 64, 32, 2), 1) == (64, 64, 32, 4)
    assert fb.data_tile((64, 64, 64, 2), 3) == (64, 64, 64, 2)
    assert fb.data_tile((64, 128, 32, 2), 2) == (64, 128, 32, 3)
    assert fb.data_tile((64, 128, 64, 2), 1) == (64, 128, 64, 3)
    assert fb.data_tile((64, 128, 64, 2), 3) == (64, 128, 64, 2)
    assert fb.data_tile((128, 64, 64, 1), 2) == (128, 64, 64, 1)
    # 3xTF32 on wgmma: the 64x64 tile at 3 blocks per SM in 1D and 2D, 64x128 at 2; TF32 as mma.sync
    assert fb.data_tile((64, 64, 32, 2), 2, 2, True) == (64, 64, 32, 3)
    assert fb.data_tile((64, 64, 32, 2), 1, 2, True) == (64, 64, 32, 3)
    assert fb.data_tile((64, 64, 32, 2), 3, 2, True) == (64, 64, 32, 2)
    assert fb.data_tile((64, 128, 32, 2), 2, 2, True) == (64, 128, 32, 2)
    assert fb.data_tile((64, 64, 32, 2), 2, 1, True) == (64, 64, 32, 4)
    assert fb.kernel_name(np.float32, False, 2, 2, (64, 64, 32, 3), "data", True, True, wgmma=True) in (
        fb.ws_name_expressions(np.float32, 2, False))
    assert fb.kernel_name(np.float32, False, 2, 1, (64, 128, 32, 3), "data", True, True) in fb.name_expressions(
        np.float32, 2, False)
    names = fb.name_expressions(np.float16, 2, False)
    assert "fused_channels_first<__half, int, true>" in names
    assert fb.kernel_name(np.float16, False, 2, 0, (64, 64, 64, 4), "data", False, True) in names
    assert fb.kernel_name(np.float16, False, 2, 0, (64, 64, 64, 3), "data", False, True) not in names
    assert fb.kernel_name(np.float16, False, 2, 0, (64, 64, 64, 2), "data", True, True).endswith(", true, true, 4, 16>")
    assert fb.kernel_name(np.float16, False, 2, 0, (64, 64, 64, 2), "data", True, False, 8) not in names
    assert fb.kernel_name(np.float16, False, 2, 0, (64, 64, 64, 4), "data", True, False, 4, 8) in names
    assert fb.kernel_name(np.float16, False, 2, 0, (64, 64, 64, 2), "data", True, False, 4, 8) not in names
    assert fb.kernel_name(np.float16, False, 2, 0, (128, 64, 64, 1), "data", True, False, 4, 16) not in names
    names3 = fb.name_expressions(np.float16, 3, False)
    assert fb.kernel_name(np.float16, False, 3, 0, (64, 64, 64, 2), "data", True, False, 8) in names3
    assert fb.kernel_name(np.float16, False, 3, 0, (64, 64, 64, 2), "data", True, True, 8) not in names3


class _Spec:
    def __init__(self, dtype, geom, device="cuda", deterministic=False):
        self.dtype, self.device, self.geom, self.device_id = np.dtype(dtype), device, geom, 0
        self.deterministic, self.allow_tf32 = deterministic, False


def test_serves_only_the_backward_of_what_it_can_compute():
    backend = _backward_module().BACKEND
    geom = _geom()
    assert "only conv_backward" in backend.serves(_Spec(np.float16, geom), "conv_forward")
    assert "float64 stays on cuda/im2col" in backend.serves(_Spec(np.float64, geom), "conv_backward")
    # deterministic plans too (the fixed-point scatter); without a GPU only the device is missing
    reason = backend.serves(_Spec(np.float16, geom, deterministic=True), "conv_backward")
    assert reason is None or "CUDA device" in reason
    assert "runs on CUDA devices" in backend.serves(_Spec(np.float16, geom, device="cpu"), "conv_backward")
    assert "multiple of 4" in backend.serves(_Spec(np.float16, _geom(c_in=36, groups=2)), "conv_backward")


# ---------------------------------------------------------------------------------------------
# GPU


def _cupy():
    return pytest.importorskip("cupy")


def wide_case(rng, ndim, *, groups=2, offset_groups=2, mask_groups=1, c_in=64, c_out=48, batch=3,
              offset=True, mask=True, size=None, kernel=None, stride=None, padding=None, dilation=None):
    kernel = kernel or (3,) * ndim
    stride = stride or tuple(int(v) for v in rng.integers(1, 3, size=ndim))
    padding = padding or tuple(int(v) for v in rng.integers(0, 2, size=ndim))
    dilation = dilation or tuple(int(v) for v in rng.integers(1, 3, size=ndim))
    size = size or {1: 23, 2: 11, 3: 6}[ndim]
    S = (size,) * ndim
    Q = tuple((s + 2 * p - d * (k - 1) - 1) // st + 1 for s, p, d, k, st in zip(S, padding, dilation, kernel, stride))
    K = math.prod(kernel)
    arrays = {
        "input": rng.standard_normal((batch, c_in) + S),
        "weight": rng.standard_normal((c_out, c_in // groups) + kernel) / math.sqrt(c_in * K / groups),
        "offset": fractional_offsets(rng, (batch, offset_groups * K * ndim) + Q) if offset else None,
        "mask": rng.uniform(0.1, 1.5, size=(batch, mask_groups * K) + Q) if mask else None,
    }
    params = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    return arrays, params, rng.standard_normal((batch, c_out) + Q)


def run_gradients(arrays, params, grad_output, precision, tile=None, wanted=NAMES, broadcast=False, weight_tile=None,
                  sampling_plan=None, gradient_plan=None, lane_channels=None, ws_weight=None, reduced_splits=None):
    """The fused data gradients of float64 NumPy arrays cast to ``precision``'s dtype (outputs
    poisoned with NaN) and the float64 reference gradients of the rounded inputs; "bias" in
    ``wanted``: the bias gradient too (folded into the copy of grad_output). ``reduced_splits``
    as :class:`BackwardConfig`'s (False: a partial sum a split, added in a fixed order, where a
    test compares weight gradients bitwise)."""
    cupy = _cupy()
    fb = _backward_module()
    dtype = DTYPE[precision]
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = {k: None if a is None else a.astype(dtype).astype(np.float64) for k, a in arrays.items()}
        dev = {k: None if a is None else cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
        gy = grad_output.astype(dtype)
    if broadcast:   # one sample seen as several (batch stride 0)
        dev = {k: None if a is None or k == "weight" else cupy.broadcast_to(a[:1], a.shape) for k, a in dev.items()}
        dev["weight"] = cupy.asarray(arrays["weight"].astype(dtype))
        rounded = {k: None if a is None or k == "weight" else np.broadcast_to(a[:1], a.shape) for k, a in rounded.items()}
        rounded["weight"] = arrays["weight"].astype(dtype).astype(np.float64)
        gy = np.broadcast_to(gy[:1], gy.shape)
    shapes = [None if arrays[k] is None else arrays[k].shape for k in ("input", "weight", "offset", "mask")]
    geom = _geometry.conv_geometry(*shapes, None, **params)[0]
    config = fb.BackwardConfig(geom, dtype, precision == "tf32", tile, weight_tile=weight_tile,
                               sampling_plan=sampling_plan, gradient_plan=gradient_plan, lane_channels=lane_channels,
                               ws_weight=ws_weight, reduced_splits=reduced_splits)
    out = {name: cupy.full(arrays[name].shape, np.nan, dtype=dtype) for name in wanted
           if name != "bias" and arrays[name] is not None}
    if "bias" in wanted:
        out["bias"] = cupy.full(grad_output.shape[1], np.nan, dtype=dtype)
    gy_dev = cupy.asarray(gy) if not broadcast else cupy.broadcast_to(cupy.asarray(gy[:1]), gy.shape)
    args = dict(grad_output=gy_dev, bias=None, wanted=frozenset(wanted), **dev)
    workspace = cupy.full(config.workspace_bytes, 0xFF, dtype=np.uint8)   # NaN in every float type
    fb.run_gradients(config, args, out, workspace)
    gx, gw, goff, gm, _ = reference.deform_conv_backward(gy.astype(np.float64), **rounded, **params)
    expected = {"input": gx, "weight": gw, "offset": goff, "mask": gm,
                "bias": gy.astype(np.float64).sum(axis=(0,) + tuple(range(2, gy.ndim)))}
    if not config.fused_weight:   # cuda/im2col computes it (FusedBackward.run)
        out.pop("weight", None)
    return {k: cupy.asnumpy(v).astype(np.float64) for k, v in out.items()}, expected, config


def check(got, expected, precision, label=""):
    for name, value in got.items():
        assert np.isfinite(value).all(), (name, label)
        assert relative_error(value, expected[name]) < TOL[precision], (name, label)


def tf32_split(values):
    """``fused::split_tf32`` in NumPy: (big, small) of float32 ``values``, big the TF32 truncation
    (one TF32 unit nearer 0 where that is the value itself), small the rest rounded to TF32; both
    the value itself for 0 and non-finite values."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    big = bits & np.uint32(0xFFFFE000)
    big = np.where(big == bits, big - np.uint32(0x2000), big).astype(np.uint32)
    plain = (values == 0) | ~np.isfinite(values)
    big = np.where(plain, bits, big).view(np.float32)
    with np.errstate(invalid="ignore"):
        small = np.where(plain, values, tf32_rounded(values - big))
    return big, small.astype(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32", "float16", "float32"])
def test_data_operand_rows_rounded_by_their_copies(precision):
    """In TF32 the data kernel takes its operands' fragments as loaded, so their copies round
    them: after a backward, the workspace's weight rows wt[g, c, t, o] and channels-last
    grad_output gycl[p, o] hold each value rounded to TF32 (to nearest, ties away from zero, as
    ``cvt.rna`` and the NumPy rounding below), ties included, while the channels-last input xcl
    (corner values of the offset and mask gradients) keeps them; in strict float32 the copies
    split them (rows twice as long: 3xTF32's big parts, then the small ones, ``tf32_split``);
    float16: plain copies. Groups (C_out/G 24, rows padded to the step) and the weight and bias
    gradients beside them, which must match the reference."""
    cupy = _cupy()
    fb = _backward_module()
    dtype = DTYPE[precision]
    rng = np.random.default_rng(45)
    arrays, params, gy = wide_case(rng, 2, groups=2, offset_groups=2, mask_groups=1, c_in=64, c_out=48, batch=3,
                                   stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    if precision == "tf32":   # ties of the rounding (low 13 bits 0x1000) in every operand
        def with_ties(values):
            values = np.array(values, dtype=np.float32)
            every_third = values.view(np.uint32).reshape(-1)[::3]
            every_third[:] = (every_third & np.uint32(0xFFFFE000)) | np.uint32(0x1000)
            return values
        arrays["input"], arrays["weight"], gy = with_ties(arrays["input"]), with_ties(arrays["weight"]), with_ties(gy)
    got, expected, config = run_gradients(arrays, params, gy, precision, wanted=NAMES + ("bias",))
    check(got, expected, precision)
    assert config.precision == {"tf32": 1, "float16": 0, "float32": 2}[precision] and config.chunk == 3
    # the same backward again, on a workspace of our own: the operand rows it leaves there
    dev = {k: cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}   # (offset and mask: both given)
    out = {name: cupy.empty(dev[name].shape, dtype=dtype) for name in NAMES}
    workspace = cupy.full(config.workspace_bytes, 0xFF, dtype=np.uint8)
    fb.run_gradients(config, dict(grad_output=cupy.asarray(gy.astype(dtype)), bias=None, wanted=frozenset(NAMES),
                                  **dev), out, workspace)
    keep = tf32_rounded if precision == "tf32" else (lambda v: v)
    bits = lambda a: np.ascontiguousarray(a).view(np.uint8)  # noqa: E731
    g = config.geom
    B, C, Co, G, K, Q, S = g.batch, g.in_channels, g.out_channels, g.groups, config.K, config.Q, config.S
    w = arrays["weight"].astype(dtype).reshape(G, Co // G, C // G, K)               # [g, o, c, t]
    wt_all, gycl_all = config.view(workspace, "wt").get(), config.view(workspace, "gycl").get()
    wt = wt_all[:G * (C // G) * K * config.wt_row].reshape(G, C // G, K, config.wt_row)
    gycl = gycl_all[:B * Q * config.gy_row].reshape(B * Q, config.gy_row)
    # each followed by its zero row, whole (the workspace was all ones)
    assert not wt_all[wt.size:wt.size + config.wt_row].any()
    assert not gycl_all[gycl.size:gycl.size + config.gy_row].any()
    y = gy.astype(dtype).reshape(B, Co, Q).transpose(0, 2, 1).reshape(B * Q, Co)
    rows = ((wt, w.transpose(0, 2, 3, 1), Co // G, config.Cogp), (gycl, y, Co, config.Cop))
    for got_rows, values, count, half in rows:
        if precision == "float32":   # big parts, small parts; zero past the values in both
            assert got_rows.shape[-1] == 2 * half
            for plane, expected_plane in zip((got_rows[..., :half], got_rows[..., half:]), tf32_split(values)):
                np.testing.assert_array_equal(bits(plane[..., :count]), bits(expected_plane))
                assert not plane[..., count:].any()
        else:
            np.testing.assert_array_equal(bits(got_rows[..., :count]), bits(keep(values)))
    xcl = config.view(workspace, "xcl").get()[:B * S * config.Cp].reshape(B * S, config.Cp)
    x = arrays["input"].astype(dtype).reshape(B, C, S).transpose(0, 2, 1).reshape(B * S, C)
    np.testing.assert_array_equal(bits(xcl[:, :C]), bits(x))
    if precision == "tf32":   # the ties were there: rounding changed some values
        assert not np.array_equal(keep(y), y)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_every_tile_matches_reference(ndim, precision):
    fb = _backward_module()
    rng = np.random.default_rng(40 + ndim)
    arrays, params, gy = wide_case(rng, ndim)
    data_tiles = fb._tiles(DTYPE[precision])
    weight_tiles = fb._weight_tiles(DTYPE[precision], ndim, 1 if precision == "tf32" else None)
    for i in range(max(len(data_tiles), len(weight_tiles))):
        tile, weight_tile = data_tiles[i % len(data_tiles)], weight_tiles[i % len(weight_tiles)]
        got, expected, config = run_gradients(arrays, params, gy, precision, tile, weight_tile=weight_tile)
        assert config.fused_weight
        check(got, expected, precision, (tile, weight_tile))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_data_kernel_on_wgmma_matches_reference(ndim, precision, monkeypatch):
    """The data kernel's wgmma main loop (``WGMMA_DATA`` forced on; the 64x64 and 64x128 tiles)
    and its mma.sync one both match the reference: a conv group's channels below the tile's rows
    and a short reduction (C_in/groups 32, C_out/groups 24), then several channel tiles and steps
    with a partial last one (C_in 128, C_out 96), every gradient together and the input's alone."""
    fb = _backward_module()
    if not fb._wgmma_device():
        pytest.skip("the wgmma main loop needs an sm_90a device")
    rng = np.random.default_rng(90 + ndim)
    cases = (wide_case(rng, ndim), wide_case(rng, ndim, groups=1, offset_groups=2, mask_groups=4, c_in=128, c_out=96))
    for arrays, params, gy in cases:
        for tile in fb.wgmma_data_tiles(DTYPE[precision]):
            for forced in (True, False):
                monkeypatch.setattr(fb, "WGMMA_DATA", forced)
                for wanted in (NAMES, ("input",)):
                    got, expected, config = run_gradients(arrays, params, gy, precision, tile, wanted=wanted)
                    assert config.data_on_wgmma(config.tile) == forced
                    assert (f"wgmma, tile 64x{tile[1]}" in config.description) == forced
                    check(got, expected, precision, (tile, forced, wanted))


def long_reduction_errors(monkeypatch):
    """The relative errors of every strict float32 (3xTF32) tile pair's gradients where the data
    kernel reduces over C_out = 512 and the weight kernel over 2048 positions (one split)."""
    fb = _backward_module()
    monkeypatch.setattr(fb, "MAX_SPLITS", 1)
    rng = np.random.default_rng(15)
    arrays, params, gy = wide_case(rng, 2, groups=1, offset_groups=1, mask_groups=1, c_in=32, c_out=512, batch=2,
                                   size=32, stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    errors = {}
    for tile, weight_tile in zip(fb._tiles(np.float32), fb._weight_tiles(np.float32)):
        got, expected, config = run_gradients(arrays, params, gy, "float32", tile, weight_tile=weight_tile)
        assert config.fused_weight and config.splits == 1
        errors[tile, weight_tile] = {name: relative_error(value, expected[name]) for name, value in got.items()}
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float16", "float32"])
def test_weight_gradient_rows_from_vectors_or_elements(precision):
    """``fused_position_rows`` (grad_output's rows over the chunk's positions) copies 16-byte
    vectors where Q and the sample stride are multiples of a vector and grad_output is aligned,
    else elements: the same weight gradient, bitwise, and the reference's."""
    cupy = _cupy()
    fb = _backward_module()
    dtype = DTYPE[precision]
    rng = np.random.default_rng(17)
    arrays, params, gy = wide_case(rng, 2, groups=1, offset_groups=1, mask_groups=1, c_in=64, c_out=48, batch=3,
                                   size=8, stride=(1, 1), padding=(1, 1), dilation=(1, 1))   # Q = 64
    got, expected, config = run_gradients(arrays, params, gy, precision, wanted=("weight",), reduced_splits=False)
    assert config.fused_weight and not config.reduced_splits
    assert relative_error(got["weight"], expected["weight"]) < TOL[precision]
    # the same grad_output one element past a 16-byte boundary, with a sample stride of (C_out + 1) * Q
    geom = config.geom
    padded = cupy.zeros(gy.size + gy.size // 3 + 16, dtype=dtype)
    view = padded[1:1 + 3 * 49 * 64].reshape((3, 49) + geom.output_shape)[:, :48]
    view[...] = cupy.asarray(gy.astype(dtype))
    assert view.data.ptr % 16 and view.strides[0] == 49 * 64 * view.itemsize
    dev = {k: None if a is None else cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    out = {"weight": cupy.full(arrays["weight"].shape, np.nan, dtype=dtype)}
    args = dict(grad_output=view, bias=None, wanted=frozenset(("weight",)), **dev)
    fb.run_gradients(config, args, out, cupy.empty(config.workspace_bytes, dtype=np.uint8))
    assert cupy.asnumpy(out["weight"]).astype(np.float64).tobytes() == got["weight"].tobytes()


@pytest.mark.gpu
def test_strict_float32_gradients_keep_float32_accuracy_over_long_reductions(monkeypatch):
    """mma.sync's 3xTF32 sums each k8's three products apart and adds them in float32 (the data
    kernel's wgmma loop each step's, where the device has it), so that the error is float32
    FMAs' (about 1e-6 here). Summed straight into the tensor cores' truncating accumulators, it
    grew with the reduction's length (NOTES-gpu.md, session 15)."""
    for tiles, errors in long_reduction_errors(monkeypatch).items():
        for name, error in errors.items():
            assert error < 2e-6, (tiles, name, error)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float16", "bfloat16", "tf32", "float32"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_weight_gradient_from_the_sampling_plan_equals_corners_computed_in_place(ndim, precision):
    """The sampling plan, and the data kernel's plan read in its place, hold exactly the corners
    the weight kernel computes without them: the weight gradients are bitwise equal (all summed
    in a fixed order), and match the reference; offset groups != mask groups, with and without
    offsets / mask, the weight gradient alone (the data kernel's plan then made for it) or with
    the others (made for the data kernel first)."""
    rng = np.random.default_rng(80 + ndim)
    for offset_groups, mask_groups, offset, mask in ((2, 4, True, True), (1, 1, False, True), (4, 1, True, False)):
        arrays, params, gy = wide_case(rng, ndim, groups=1, offset_groups=offset_groups, mask_groups=mask_groups,
                                       c_in=64, c_out=32, offset=offset, mask=mask, batch=3)
        label = (offset_groups, mask_groups, offset, mask)
        planned, expected, config = run_gradients(arrays, params, gy, precision, wanted=("weight",), sampling_plan=True,
                                                  gradient_plan=False, reduced_splits=False)
        assert config.sampling_plan and not config.plan_shared and "sampling plan" in config.description
        in_place, _, config = run_gradients(arrays, params, gy, precision, wanted=("weight",), sampling_plan=False,
                                            reduced_splits=False)
        assert not config.sampling_plan
        assert np.array_equal(planned["weight"], in_place["weight"]), label
        check(planned, expected, precision, label)
        for wanted in (("weight",), NAMES):
            shared, expected_all, config = run_gradients(arrays, params, gy, precision, wanted=wanted,
                                                         sampling_plan=True, gradient_plan=True, reduced_splits=False)
            assert config.plan_shared and "the data gradients' plan" in config.description
            assert config.offsets["plan_rows"][1] == 0          # no sampling plan of its own
            assert np.array_equal(shared["weight"], in_place["weight"]), (label, wanted)
            check(shared, expected_all, precision, (label, wanted))


def poisoned_group_cases(rng, ndim, *, groups, c_in):
    """``(offset_groups, mask_groups, offset, mask), arrays, params, grad_output`` of wide cases
    with offset groups != mask groups and the offset or the mask absent once; an eighth of the
    offsets non-finite or huge."""
    for case in ((2, 4, True, True), (1, 1, False, True), (4, 1, True, False)):
        offset_groups, mask_groups, offset, mask = case
        arrays, params, gy = wide_case(rng, ndim, groups=groups, offset_groups=offset_groups, mask_groups=mask_groups,
                                       c_in=c_in, c_out=32, offset=offset, mask=mask, batch=3)
        if offset:
            off = arrays["offset"].reshape(-1)
            picks = rng.choice(off.size, size=off.size // 8, replace=False)
            off[picks] = np.array([np.nan, np.inf, -np.inf, 1e30, -3e9, 0.5])[rng.integers(0, 6, size=picks.size)]
        yield case, arrays, params, gy


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float16", "bfloat16", "tf32", "float32"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_data_gradients_from_their_plan_equal_corners_computed_in_place(ndim, precision):
    """The data kernel with its corners, slopes and mask from the chunk's plan gives the input,
    offset and mask gradients it gives computing them itself (up to the order of the atomics),
    both against the reference; every data tile, offset groups != mask groups, with and without
    offsets / mask, non-finite and huge offsets among them."""
    fb = _backward_module()
    rng = np.random.default_rng(90 + ndim)
    for case, arrays, params, gy in poisoned_group_cases(rng, ndim, groups=1, c_in=160):
        wanted = ("input", "offset", "mask")
        for tile in fb._tiles(DTYPE[precision]):
            planned, expected, config = run_gradients(arrays, params, gy, precision, tile, wanted=wanted,
                                                      gradient_plan=True)
            assert config.gradient_plan and "from a plan" in config.description
            in_place, _, config = run_gradients(arrays, params, gy, precision, tile, wanted=wanted, gradient_plan=False)
            assert not config.gradient_plan
            label = (tile,) + case
            check(planned, expected, precision, label)
            for name, value in planned.items():
                assert relative_error(value, in_place[name]) < TOL[precision] / 10, (name, label)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_eight_channels_per_lane_equal_four(precision):
    """The 3D data kernel's epilogue with 8 channels per lane (the rule where every group's
    channel count is a multiple of 8) gives the input, offset and mask gradients of 4 per lane
    (up to the order of the atomics), both against the reference: every data tile, with and
    without the gradients' plan, offset groups != mask groups, with and without offsets / mask,
    non-finite and huge offsets among them."""
    fb = _backward_module()
    rng = np.random.default_rng(123)
    for case, arrays, params, gy in poisoned_group_cases(rng, 3, groups=2, c_in=128):
        wanted = ("input", "offset", "mask")
        for tile in fb._tiles(DTYPE[precision]):
            for plan in (False, True):
                label = (tile, plan) + case
                eight, expected, config = run_gradients(arrays, params, gy, precision, tile, wanted=wanted,
                                                        gradient_plan=plan, lane_channels=8)
                assert config.lane_channels == 8 and "8 channels a lane" in config.description, label
                four, _, config = run_gradients(arrays, params, gy, precision, tile, wanted=wanted,
                                                gradient_plan=plan, lane_channels=4)
                assert config.lane_channels == 4
                check(eight, expected, precision, label)
                for name, value in eight.items():
                    assert relative_error(value, four[name]) < TOL[precision] / 10, (name, label)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float16", "tf32", "float32"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_half_the_epilogue_lanes_equal_all_of_them(ndim, precision, monkeypatch):
    """Where a conv group's channels fit half the 64-channel tile (C_in/groups 32, 16, 8), the
    data kernel's epilogue with half the lanes per position gives the input, offset and mask
    gradients of all the lanes (up to the order of the atomics), both against the reference;
    offset groups != mask groups, with and without the gradients' plan."""
    fb = _backward_module()
    rng = np.random.default_rng(90 + ndim)
    wanted = ("input", "offset", "mask")
    for groups in (2, 4, 8):
        arrays, params, gy = wide_case(rng, ndim, groups=groups, offset_groups=groups, mask_groups=groups // 2,
                                       c_in=64, c_out=8 * groups)
        for plan in (False, True):
            label = (groups, plan)
            half, expected, config = run_gradients(arrays, params, gy, precision, wanted=wanted, gradient_plan=plan)
            assert config.lanes == fb.full_lanes(64, config.lane_channels) // 2, label
            with monkeypatch.context() as m:
                m.setattr(fb, "NARROW_TILE_ROWS", ())
                full, _, config = run_gradients(arrays, params, gy, precision, wanted=wanted, gradient_plan=plan)
                assert config.lanes == fb.full_lanes(64, config.lane_channels), label
            check(half, expected, precision, label)
            check(full, expected, precision, label)
            for name, value in half.items():
                assert relative_error(value, full[name]) < TOL[precision] / 10, (name, label)


@pytest.mark.gpu
@pytest.mark.parametrize("offset_groups,mask_groups", [(1, 2), (2, 1), (4, 2), (2, 4), (16, 1)])
@pytest.mark.parametrize("present", ["offset+mask", "offset", "mask"])
def test_groups_and_missing_arguments(offset_groups, mask_groups, present):
    fb = _backward_module()
    rng = np.random.default_rng(offset_groups * 7 + mask_groups)
    arrays, params, gy = wide_case(rng, 2, groups=2, offset_groups=offset_groups, mask_groups=mask_groups,
                                   c_in=128, c_out=160, offset="offset" in present, mask="mask" in present)
    for precision in ("float16", "float32"):
        for tile in fb._tiles(DTYPE[precision]):
            got, expected, _ = run_gradients(arrays, params, gy, precision, tile)
            check(got, expected, precision, (tile, present))


@pytest.mark.gpu
@pytest.mark.parametrize("wanted", [("input",), ("weight",), ("offset",), ("mask",), ("offset", "mask"),
                                    ("input", "mask"), ("weight", "offset")])
def test_each_gradient_alone_equals_all_together(wanted):
    rng = np.random.default_rng(7)
    arrays, params, gy = wide_case(rng, 2)
    together, expected, _ = run_gradients(arrays, params, gy, "float32")
    alone, _, _ = run_gradients(arrays, params, gy, "float32", wanted=wanted)
    assert set(alone) == set(wanted)
    for name in wanted:
        assert relative_error(alone[name], expected[name]) < TOL["float32"]
        assert relative_error(alone[name], together[name]) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float16", "float32"])
def test_input_gradient_alone_at_the_scatter_tile_in_3d(precision, monkeypatch):
    """In 3D the input gradient alone takes the data kernel's 64x64 tile (``scatter_tile``), the
    data gradients together its 64x128 (``SCATTER_NARROW_3D``): the input gradient alone the
    reference's either way, and equal to the one computed together (the same sums, in the same
    order per tile; float32 atomics may add them in another order); with offset groups != mask
    groups, conv groups, stride, dilation, partial tiles."""
    fb = _backward_module()
    rng = np.random.default_rng(23)
    arrays, params, gy = wide_case(rng, 3, c_in=64, c_out=32, batch=2)
    together, expected, _ = run_gradients(arrays, params, gy, precision)
    for narrow in (True, False):
        monkeypatch.setattr(fb, "SCATTER_NARROW_3D", narrow)
        alone, _, config = run_gradients(arrays, params, gy, precision, wanted=("input",))
        assert config.tile[1] == 128 and config.scatter_tile[1] == (64 if narrow else 128)
        check(alone, expected, precision, ("scatter tile", narrow))
        assert relative_error(alone["input"], together["input"]) < TOL[precision], narrow


def _channels_first_kernels(precision, fixed):
    """(dtype, [fused_channels_first, fused_channels_first_vectors]) of a float32 (``fixed``
    False) or fixed-point accumulator, 32-bit index, 2D module."""
    fb = _backward_module()
    dtype = DTYPE[precision]
    t = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}[precision]
    f = "true" if fixed else "false"
    return dtype, [fb._function(f"fused_channels_first<{t}, int, {f}>", dtype, 2, False),
                   fb._function(f"fused_channels_first_vectors<{t}, int, {f}>", dtype, 2, False)]


def _channels_first_cases(vec):
    """(B, C, S, sample stride of gx): partial channel and position tiles, channel counts not a
    multiple of 4 (37: odd), a sample stride padded by a vector, S off a vector (21)."""
    return (3, 80, 200, 80 * 200), (2, 37, 24, 37 * 24 + vec), (2, 16, 21, 16 * 21), (1, 70, 64, 70 * 64)


def _channels_first_outputs(kernels, sources, bias, dtype, B, C, Cpa, S, stride):
    """(what, gx of shape (B, stride)) for each kernel, gx aligned and one element past an aligned
    address, at the layout's grid and at a grid of 3 blocks; gx's buffer poisoned with 7.
    ``sources``: the kernels' arguments before bias (gxcl, gxq, flags, the weight's, grad_output's
    and mask's bounds, log2_count)."""
    cupy = _cupy()
    fb = _backward_module()
    vec = 16 // dtype.itemsize
    for shift in (0, 1):
        for kernel in kernels:
            for grid in (fb._fused.layout_grid(B, C, S), (3,)):
                buffer = cupy.asarray(np.full(B * stride + vec, 7, dtype=dtype))
                kernel(grid, (256,), (*sources, np.uint64(0) if bias is None else cupy.asarray(bias), buffer[shift:],
                                      np.int32(B), np.int32(C), np.int32(Cpa), np.int32(S), np.int32(stride)))
                yield (str((C, S, shift, kernel is kernels[1], grid, bias is None)),
                       cupy.asnumpy(buffer)[shift:shift + B * stride].reshape(B, stride))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float16", "bfloat16", "float32"])
def test_channels_first_by_vectors_and_by_elements(precision):
    """The input gradient out of its float32 channels-last accumulator (B, S, Cpa) into
    (B, C, S) of the dtype, bias added where given: ``fused_channels_first`` (one element a
    thread) and ``fused_channels_first_vectors`` (16-byte vectors of positions where S, the
    sample stride and gx are aligned to one; else elements: gx one element past an aligned
    address) give bitwise the same result, the reference's rounding of accumulator + bias.
    Partial channel and position tiles, channel counts not a multiple of 4, a padded sample
    stride, a grid smaller than the tiles; nothing written outside the samples' channels."""
    cupy = _cupy()
    dtype, kernels = _channels_first_kernels(precision, fixed=False)
    rng = np.random.default_rng(12)
    for B, C, S, stride in _channels_first_cases(16 // dtype.itemsize):
        Cpa = -(-C // 4) * 4
        acc = rng.standard_normal((B, S, Cpa)).astype(np.float32)
        null = np.uint64(0)
        sources = (cupy.asarray(acc), null, null, null, null, null, np.int32(0))
        for bias in (None, rng.standard_normal(C).astype(dtype)):
            total = acc[:, :, :C].transpose(0, 2, 1) + (0 if bias is None else bias.astype(np.float32)[:, None])
            expected = np.full((B, stride), 7, dtype=dtype)
            expected[:, :C * S] = total.astype(dtype).reshape(B, C * S)
            for what, got in _channels_first_outputs(kernels, sources, bias, dtype, B, C, Cpa, S, stride):
                np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8), err_msg=what)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float16", "bfloat16", "float32"])
def test_fixed_point_channels_first_by_vectors_and_by_elements(precision):
    """The deterministic mode's input gradient out of its fixed-point accumulator (B, S, Cpa) of
    64-bit sums with 2 flag bits each: ``fused_channels_first<T, I, true>`` (one element a thread)
    and ``fused_channels_first_vectors<T, I, true>`` (a 16-byte pair of sums a thread where S, the
    sample stride and gx are aligned to a vector; else elements) give bitwise the same result:
    each sum times 2^-E (E from the sample's bounds, fixed_point.cuh) plus bias, rounded through
    float32, and +inf, -inf or NaN where the flags say so. Odd channel counts (a pair's second
    sum a padded channel), partial tiles, a padded sample stride, a grid smaller than the tiles;
    nothing written outside the samples' channels."""
    cupy = _cupy()
    dtype, kernels = _channels_first_kernels(precision, fixed=True)
    rng = np.random.default_rng(13)
    log2_count = 5
    for B, C, S, stride in _channels_first_cases(16 // dtype.itemsize):
        Cpa = -(-C // 4) * 4
        acc = rng.integers(-(1 << 56), 1 << 56, size=(B, S, Cpa), dtype=np.int64)
        codes = rng.choice(4, size=(B, S, Cpa), p=(0.94, 0.02, 0.02, 0.02)).astype(np.uint32)   # 1 +inf, 2 -inf, 3 NaN
        words = np.zeros(-(-codes.size // 16), dtype=np.uint32)
        for k in range(16):
            part = codes.reshape(-1)[k::16]
            words[:part.size] |= part << np.uint32(2 * k)
        weight_bound = np.array([1.5], dtype=np.float64)                 # frexp exponent 1
        gy_bounds = np.array([3.0, 0.3, 17.0], dtype=np.float64)[:B]    # 2, -1, 5
        mask_bounds = np.array([0.75, 1.0, 0.01], dtype=np.float64)[:B]  # 0, 1, -6
        E = np.array([62 - (1 + np.frexp(g)[1] + np.frexp(m)[1] + log2_count)
                      for g, m in zip(gy_bounds, mask_bounds)])
        values = np.ldexp(acc.astype(np.float64), -E[:, None, None])
        values[codes == 1], values[codes == 2], values[codes == 3] = np.inf, -np.inf, np.nan
        sources = (np.uint64(0), *(cupy.asarray(a) for a in (acc.view(np.uint64), words, weight_bound.view(np.uint64),
                                                              gy_bounds.view(np.uint64), mask_bounds.view(np.uint64))),
                   np.int32(log2_count))
        for bias in (None, rng.standard_normal(C).astype(dtype)):
            total = values[:, :, :C].transpose(0, 2, 1) + (
                0 if bias is None else bias.astype(np.float32).astype(np.float64)[:, None])
            expected = np.full((B, stride), 7, dtype=dtype)
            expected[:, :C * S] = total.astype(np.float32).astype(dtype).reshape(B, C * S)
            nan = np.isnan(expected.astype(np.float32))
            for what, got in _channels_first_outputs(kernels, sources, bias, dtype, B, C, Cpa, S, stride):
                np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan, err_msg=what)
                np.testing.assert_array_equal(got.view(np.uint8).reshape(B, stride, -1)[~nan],
                                              expected.view(np.uint8).reshape(B, stride, -1)[~nan], err_msg=what)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float16", "bfloat16", "float32"])
def test_sample_bound_per_block_equals_det_sample_bound(precision):
    """``fused_sample_bound`` (a block a slice of one sample, 16-byte vectors where the samples
    are whole and aligned ones) gives each sample's max |value| over its finite entries, bitwise
    cuda/im2col-deterministic's ``det_sample_bound`` (a float maximum is exact): vector and
    element paths (per-sample lengths and strides off the vector, an address one element past),
    a broadcast batch (stride 0), one slice and many, non-finite entries and an all-zero sample."""
    cupy = _cupy()
    fb = _backward_module()
    from dcn_cupy._backends import cuda_deterministic
    dtype = DTYPE[precision]
    vec = 16 // dtype.itemsize
    t = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}[precision]
    fused = fb._function(f"fused_sample_bound<{t}, int>", dtype, 2, False)
    det = cuda_deterministic._kernels(dtype, 2, False)["sample_bound"]
    rng = np.random.default_rng(14)
    for batch, per_sample, stride, shift in ((3, 64 * vec, 64 * vec, 0), (3, 64 * vec, 64 * vec, 1),
                                             (2, 1000 * vec + 3, 1000 * vec + 5, 0), (4, 40 * vec, 0, 0),
                                             (3, 7, 9, 0), (2, 3000 * vec, 3001 * vec, 0)):
        data = (rng.standard_normal(batch * max(stride, per_sample) + shift) * 10).astype(dtype)
        data[rng.integers(0, data.size, 5)] = np.inf
        data[rng.integers(0, data.size, 5)] = -np.inf
        data[rng.integers(0, data.size, 5)] = np.nan
        if stride:
            data[shift + stride:shift + stride + per_sample] = 0   # sample 1: zeros (and -0)
            data[shift + stride] = -0.0
        host = np.stack([data[shift + b * stride:shift + b * stride + per_sample] for b in range(batch)])
        finite = np.where(np.isfinite(host.astype(np.float32)), np.abs(host.astype(np.float32)), 0)
        expected = finite.max(axis=1).astype(np.float64)
        a = cupy.asarray(data)[shift:]
        reference_bits = cupy.zeros(batch, dtype=np.uint64)
        det((4, batch), (256,), (a, np.int32(per_sample), np.int64(stride), np.int32(batch), reference_bits))
        for slices in (1, 3, 64):
            bounds = cupy.zeros(batch, dtype=np.uint64)
            fused((batch * slices,), (256,), (a, np.int32(per_sample), np.int32(stride), np.int32(batch),
                                              np.int32(slices), bounds))
            got = cupy.asnumpy(bounds)
            what = str((batch, per_sample, stride, shift, slices))
            np.testing.assert_array_equal(got.view(np.float64), expected, err_msg=what)
            np.testing.assert_array_equal(got, cupy.asnumpy(reference_bits), err_msg=what)


def test_channels_first_kernel_rule():
    """The input gradient's channels-first kernel in vectors (from the float32 accumulator or the
    deterministic mode's fixed-point one) where its vectors are whole and aligned and the rule
    takes them."""
    fb = _backward_module()

    def config(L, deterministic=False):
        geom = _geometry.conv_geometry((2, 64, L), (64, 64, 3), (2, 3, L), (2, 3, L), None, padding=1)[0]
        return fb.BackwardConfig(geom, np.float16, False, deterministic=deterministic)

    vectors, elements = "fused_channels_first_vectors", "fused_channels_first"
    aligned = (1 << 20, 2 << 20)
    assert fb.channels_first_kernel(config(1024), 64 * 1024, aligned) == vectors
    assert fb.channels_first_kernel(config(1024, deterministic=True), 64 * 1024, aligned) == vectors
    assert fb.channels_first_kernel(config(1024, deterministic=True), 64 * 1024, (1 << 20, (2 << 20) + 8)) == elements
    assert fb.channels_first_kernel(config(1024), 64 * 1024 + 4, aligned) == elements       # sample stride
    assert fb.channels_first_kernel(config(1024), 64 * 1024, ((1 << 20) + 2, 2 << 20)) == elements   # gx
    assert fb.channels_first_kernel(config(1000), 64 * 1000, aligned) == elements   # below VECTOR_COPY_POSITIONS


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_bias_gradient_from_the_copy_of_grad_output(ndim, monkeypatch):
    """The bias gradient from the tile sums of grad_output's channels-last copy: with every
    gradient, alone, beside the weight or the input gradient alone; 80 output channels (a
    partial channel tile), position tiles spanning samples; a broadcast batch; one-sample chunks
    (the running sum between chunks)."""
    fb = _backward_module()
    rng = np.random.default_rng(60 + ndim)
    arrays, params, gy = wide_case(rng, ndim, c_out=80, batch=3)
    for precision in ("float16", "tf32"):
        for wanted in (NAMES + ("bias",), ("bias",), ("weight", "bias"), ("input", "bias")):
            got, expected, _ = run_gradients(arrays, params, gy, precision, wanted=wanted)
            assert "bias" in got
            check(got, expected, precision, (precision, wanted))
    got, expected, _ = run_gradients(arrays, params, gy, "float32", wanted=NAMES + ("bias",), broadcast=True)
    check(got, expected, "float32", "broadcast")
    monkeypatch.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", 1)
    for wanted in (("input", "bias"), ("bias",)):
        got, expected, config = run_gradients(arrays, params, gy, "bfloat16", wanted=wanted)
        assert config.chunk == 1
        check(got, expected, "bfloat16", wanted)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float32", "tf32"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_float32_offset_and_mask_gradients_accumulate_in_place(ndim, precision, monkeypatch):
    """float32 offset and mask gradients whose samples lie back to back take the data kernel's
    atomics themselves (each chunk's part cleared first, no fused_store); with a padded sample
    stride they go through the workspace and fused_store: the reference's values either way (the
    outputs poisoned with NaN), whole and in one-sample chunks, the two launch lists two stores
    apart."""
    cupy = _cupy()
    fb = _backward_module()
    rng = np.random.default_rng(70 + ndim)
    arrays, params, gy = wide_case(rng, ndim, batch=3)
    shapes = [arrays[k].shape for k in ("input", "weight", "offset", "mask")]
    geom = _geometry.conv_geometry(*shapes, None, **params)[0]
    dtype = np.float32
    _, _, goff, gm, _ = reference.deform_conv_backward(
        gy.astype(dtype).astype(np.float64), **{k: a.astype(dtype).astype(np.float64) for k, a in arrays.items()},
        **params)
    dev = {k: cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    for limit in (None, 1):
        if limit is not None:
            monkeypatch.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", limit)
        config = fb.BackwardConfig(geom, dtype, precision == "tf32")
        assert (config.chunk == 1) == (limit == 1)
        launches = []
        for pad in (0, 2):   # channels past the gradient's in each sample: a padded sample stride
            out = {name: cupy.full((3, arrays[name].shape[1] + pad) + arrays[name].shape[2:], np.nan,
                                   dtype=dtype)[:, :arrays[name].shape[1]] for name in ("offset", "mask")}
            args = dict(grad_output=cupy.asarray(gy.astype(dtype)), bias=None, wanted=frozenset(out), **dev)
            workspace = cupy.full(config.workspace_bytes, 0xFF, dtype=np.uint8)
            fb.run_gradients(config, args, out, workspace)
            for name, expected in (("offset", goff), ("mask", gm)):
                got = cupy.asnumpy(out[name]).astype(np.float64)
                assert np.isfinite(got).all() and relative_error(got, expected) < TOL[precision], (name, limit, pad)
            strides = tuple(0 if a is None else fb._fused._batch_stride(a) for a in (
                args["grad_output"], dev["input"], dev["offset"], dev["mask"], None, out["offset"], out["mask"]))
            inputs = tuple(a.data.ptr for a in (args["grad_output"], dev["input"], dev["weight"], dev["offset"],
                                                dev["mask"])) + (0,)
            launches.append(len(fb._launches(config, inputs, strides, (0, 0, out["offset"].data.ptr,
                                                                       out["mask"].data.ptr), workspace.data.ptr)))
        chunks = -(-3 // config.chunk)
        assert launches[1] == launches[0] + 2 * chunks, launches


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_weight_gradient_rows_from_the_copy_equal_their_own_copy(ndim, monkeypatch):
    """The weight gradient's rows of grad_output written by the data gradients' channels-last
    copy (``ROWS_FROM_COPY``) or by fused_position_rows: the reference's values and bitwise the
    same weight gradient, on a poisoned workspace (the rows' zero padding past the chunk's
    positions), whole and in one-sample chunks."""
    fb = _backward_module()
    rng = np.random.default_rng(70 + ndim)
    arrays, params, gy = wide_case(rng, ndim, c_out=80, batch=3)
    for limit in (None, 1):
        if limit is not None:
            monkeypatch.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", limit)
        for precision in ("float16", "tf32"):
            weights = []
            for rows in (False, True):
                monkeypatch.setattr(fb, "ROWS_FROM_COPY", rows)
                got, expected, config = run_gradients(arrays, params, gy, precision, reduced_splits=False)
                assert config.fused_weight and (limit is None or config.chunk == 1)
                check(got, expected, precision, (rows, limit))
                weights.append(got["weight"].tobytes())
            assert weights[0] == weights[1], (precision, limit)


class _StubDevice:
    """``cupy.cuda.Device`` of an H200 for executables built without a GPU (no kernel loaded)."""

    compute_capability = "90"
    attributes = {"MultiProcessorCount": 132}

    def __init__(self, device_id=0):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _StubKernel(str):
    """A kernel without a GPU: its name; called (cuda/im2col's direct path), it appends its name
    and arguments to ``calls``."""

    calls: list = []

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((str(self), args))


class _StubGemm(tuple):
    """A cuBLAS GEMM without a GPU: the tuple of its arguments; called, it appends them and its
    operands' addresses to ``_StubKernel.calls``."""

    def __call__(self, handle, a, b, c):
        _StubKernel.calls.append((tuple(self), a, b, c))


class _KernelNames(dict):
    """An executable's kernels without a GPU: each one a ``_StubKernel`` of its name."""

    def __missing__(self, key):
        return _StubKernel(key)


class _HostArray(np.ndarray):
    """A host array in a CuPy array's place (``.data.ptr`` its address), for cuda/im2col's direct
    path without a GPU."""

    @property
    def data(self):
        return _pointer(self.__array_interface__["data"][0])


def _host(shape, dtype) -> _HostArray:
    return np.zeros(shape, dtype).view(_HostArray)


def _stub_im2col_builds(monkeypatch, cuda) -> None:
    """cuda/im2col's executables built and run without a GPU: an H200's device, kernels and GEMMs
    stubbed, launches recorded as ``(0, kernel, grid, block, args, shared memory)``, the direct
    path's calls appended to ``_StubKernel.calls``."""
    monkeypatch.setattr(_StubKernel, "calls", [])
    monkeypatch.setattr(cuda.cupy.cuda, "Device", _StubDevice)
    monkeypatch.setattr(cuda._Executable, "kernels", lambda self, index64: _KernelNames())
    monkeypatch.setattr(cuda._Executable, "column_kernels", lambda self, wide: (_StubKernel("copy"),
                                                                                _StubKernel("sample")))
    monkeypatch.setattr(cuda, "_Gemm", lambda *args, **kwargs: _StubGemm(args + tuple(sorted(kwargs.items()))))
    monkeypatch.setattr(cuda, "_kernel_op", lambda kernel, grid, block, args, shared_mem=0, overlap=False:
                        (0, kernel, grid, block, args, shared_mem))
    monkeypatch.setattr(cuda.cupy, "ones", lambda count, dtype: _host((count,), dtype))


def _slotted(ops, executable, workspace: int, regions: dict):
    """``ops`` (recorded launches, or the direct path's calls) with each address, an integer from
    2**32 up or a host array's, as (slot name, offset) in ``workspace`` or (name, offset) in one
    of ``regions`` (name -> (address, bytes)); an AssertionError for one in none of them, past the
    workspace's end, or reaching past its slot."""
    ones = getattr(executable, "_ones", None)   # (the split weight GEMM's row of ones)
    if ones is not None:
        regions = dict(regions, ones=(ones.data.ptr, ones.nbytes))

    def within(at, size, length):
        return 0 <= at < length and at + size <= length

    def place(address, size):
        at = address - workspace
        if 0 <= at < executable.workspace_bytes:
            found = [(name, at - offset) for name, (offset, count, dt) in executable.layout.slots.items()
                     if within(at - offset, size, count * dt.itemsize)]
        else:
            found = [(name, address - start) for name, (start, length) in regions.items()
                     if within(address - start, size, length)]
        assert len(found) == 1, (at, size, executable.layout.slots)
        return found[0]

    def slot(value):
        if isinstance(value, _HostArray):
            return place(value.__array_interface__["data"][0], value.nbytes) + (value.shape, value.dtype.str)
        if isinstance(value, np.ndarray):
            return value.tobytes()
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 2**32:
            return place(int(value), 0)
        if isinstance(value, tuple):
            return tuple(slot(v) for v in value)
        return value

    return [slot(op) for op in ops]


#: Where the recording tests put the arrays (fake addresses, a TiB apart): grad_output, x, w,
#: offset and mask (``_record``'s inputs, then no bias), the workspace, the channels-last copy
#: of x a caller gives, the weight gradient.
_STUB_REGIONS = {name: (k << 40, 1 << 40) for k, name in ((1, "gy"), (2, "x"), (3, "w"), (4, "offset"), (5, "mask"),
                                                          (7, "xcl"), (8, "grad_w"))}
_STUB_INPUTS = tuple(_STUB_REGIONS[name][0] for name in ("gy", "x", "w", "offset", "mask")) + (0,)
_STUB_WORKSPACE = 6 << 40


def _direct_weight_gradient(executable, arrays: dict, copy=None) -> list:
    """cuda/im2col's direct path (batch-strided or staged calls) for the weight gradient alone on
    host arrays: its kernel and GEMM calls, with addresses as ``_slotted``'s."""
    calls = _StubKernel.calls
    del calls[:]
    ws = _host((executable.workspace_bytes,), np.uint8)
    grad_w = _host(arrays["weight"].shape, arrays["weight"].dtype)
    executable._direct(dict(arrays, bias=None, wanted=frozenset(("weight",))), {"weight": grad_w}, ws, None, copy)
    regions = {name: (a.data.ptr, a.nbytes) for name, a in dict(arrays, grad_weight=grad_w).items()}
    if copy is not None:
        regions["xcl"] = (copy[0].data.ptr, copy[0].nbytes)
    return _slotted(calls, executable, ws.data.ptr, regions)


@pytest.mark.parametrize("precision, saved_mib", [("float16", 61.25), ("tf32", 55.125), ("float32", 55.125)])
def test_weight_gradient_through_im2col_lays_out_the_weight_gradient_alone(monkeypatch, precision, saved_mib):
    """cuda/im2col's weight gradient beside the fused data gradients (``weight_through_im2col``,
    the plans' choice at B=16 C512 14x14 in fp16 and TF32) has a workspace without the whole
    backward's column grads and float32 input-gradient accumulator: 61 MiB less in fp16, 55 in
    float32, with the same chunks. Its recorded launches for the weight gradient (the shared
    channels-last copy made or not), and its direct path's calls, are the whole backward's, each
    workspace address in the slot of the same name; asked for a data gradient, it refuses rather
    than write past its workspace. No GPU: the device, kernels, GEMMs and launches stubbed, the
    direct path on host arrays."""
    fb = _backward_module()
    cuda = fb._cuda
    from dcn_cupy._backends import PlanSpec
    _stub_im2col_builds(monkeypatch, cuda)
    monkeypatch.setattr(fb, "WEIGHT_COLUMN_PANELS", False)   # (whole columns here: test_column_panels_rule)
    geom = _geometry.conv_geometry((16, 512, 14, 14), (512, 512, 3, 3), (16, 18, 14, 14), (16, 9, 14, 14), None,
                                   stride=1, padding=1, dilation=1, groups=1)[0]
    dtype, tf32 = DTYPE[precision], precision == "tf32"
    spec = PlanSpec(geom, dtype, "cuda", 0, False, tf32)
    config = fb.BackwardConfig(geom, dtype, tf32, fused_weight=False, multiprocessors=132, wgmma=True)
    assert fb.copy_shareable(config)
    lean, whole = fb.weight_through_im2col(config, spec), cuda._Backward(spec, shared_copy=True)
    assert lean.weight_only and not whole.weight_only and lean.copy_given and whole.copy_given
    assert "weight gradient alone" in lean.description
    left_out = {"cgrad", "grad_x"} if precision == "float16" else {"cgrad"}   # (grad_x: the half types')
    assert set(whole.layout.slots) - set(lean.layout.slots) == left_out
    assert [(c.start, c.stop) for c in lean.chunks] == [(c.start, c.stop) for c in whole.chunks] == [(0, 16)]
    assert (whole.workspace_bytes - lean.workspace_bytes) / 2**20 == saved_mib
    inputs, ws, grad_w, xcl = _STUB_INPUTS, _STUB_WORKSPACE, _STUB_REGIONS["grad_w"][0], _STUB_REGIONS["xcl"][0]
    for made in (False, True):
        recorded = [_slotted(e._record(*inputs, ws, frozenset(("weight",)), 0, grad_w, 0, 0, copy=(xcl, made)),
                             e, ws, _STUB_REGIONS) for e in (lean, whole)]
        assert recorded[0] == recorded[1] and len(recorded[0]) >= 4 - made, made
        assert ("copy" in str(recorded[0])) != made
    # the direct path (batch-strided arrays), on host arrays: the same calls on same-named slots
    arrays = {name: _host(shape, dtype) for name, shape in zip(
        ("grad_output", "input", "weight", "offset", "mask"),
        ((16, 512, 14, 14), (16, 512, 14, 14), (512, 512, 3, 3), (16, 18, 14, 14), (16, 9, 14, 14)))}
    copy = (_host(((16 * 196 + 1) * 512,), dtype), False)
    direct = [_direct_weight_gradient(e, arrays, copy) for e in (lean, whole)]
    assert direct[0] == direct[1] and "'sample'" in str(direct[0]) and "cols" in str(direct[0])
    with pytest.raises(ValueError, match="weight gradient alone.*input, offset or mask gradient"):
        lean._record(*inputs, ws, frozenset(("input", "weight")), 9 << 40, grad_w, 0, 0, copy=(xcl, True))
    with pytest.raises(ValueError, match="weight gradient alone"):
        lean._direct(dict(grad_output=None, input=None, weight=None, offset=None, mask=None,
                          wanted=frozenset(("input",))), {}, None, None)
    monkeypatch.setattr(fb, "WEIGHT_ONLY_WORKSPACE", False)   # the A/B: the whole backward's
    assert fb.weight_through_im2col(config, spec).workspace_bytes == whole.workspace_bytes


@pytest.mark.parametrize("shape, limit", [
    (dict(input=(2, 32, 16, 16, 16), weight=(32, 32, 3, 3, 3), offset=(2, 81, 16, 16, 16), mask=(2, 27, 16, 16, 16)),
     32 * 2**20),                                                    # 3D: whole, a sample a chunk
    (dict(input=(3, 64, 24, 24), weight=(16, 64, 3, 3), offset=(3, 36, 24, 24), mask=(3, 9, 24, 24)), None),
    (dict(input=(2, 16, 40, 40), weight=(16, 16, 3, 3), offset=(2, 18, 40, 40), mask=(2, 9, 40, 40)), 2**19),
])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_weight_only_im2col_records_within_its_workspace(monkeypatch, shape, limit, dtype):
    """A weight-only cuda/im2col backward records its launches (one chunk where the whole
    backward takes two, the weight GEMM split along the positions, or rows of one sample) with
    every workspace address inside one of its slots; it takes no more chunks than the whole
    backward, a smaller workspace in as many, and stays within the limit. No GPU
    (``_stub_im2col_builds``)."""
    fb = _backward_module()
    cuda = fb._cuda
    from dcn_cupy._backends import PlanSpec
    _stub_im2col_builds(monkeypatch, cuda)
    if limit is not None:
        monkeypatch.setattr(cuda, "WORKSPACE_LIMIT_BYTES", limit)
    geom = _geometry.conv_geometry(shape["input"], shape["weight"], shape["offset"], shape["mask"], None,
                                   stride=1, padding=1, dilation=1, groups=1)[0]
    spec = PlanSpec(geom, np.dtype(dtype), "cuda", 0, False, False)
    lean, whole = cuda._Backward(spec, weight_only=True), cuda._Backward(spec)
    assert len(lean.chunks) <= len(whole.chunks)
    if len(lean.chunks) == len(whole.chunks):
        assert lean.workspace_bytes < whole.workspace_bytes
    if limit is not None:   # (within the limit, but for its slots' 256-byte alignment)
        assert len(lean.chunks) < len(whole.chunks) and lean.workspace_bytes <= limit + 16 * 256
    assert (limit == 2**19) == (lean.rows is not None)   # (rows of one sample: the direct path only)
    if lean.rows is None:
        names = str(_slotted(lean._record(*_STUB_INPUTS, _STUB_WORKSPACE, frozenset(("weight",)), 0,
                                          _STUB_REGIONS["grad_w"][0], 0, 0), lean, _STUB_WORKSPACE, _STUB_REGIONS))
        assert "cgrad" not in names and "grad_x" not in names and "'cols'" in names
    arrays = {name: _host(shape["input" if name == "grad_output" else name], dtype)
              for name in ("grad_output", "input", "weight", "offset", "mask")}
    names = str(_direct_weight_gradient(lean, arrays))
    assert "cgrad" not in names and "grad_x" not in names and "'cols'" in names
    if lean.rows is not None:   # offsets and mask staged in their slots, no slots for their gradients
        assert "('offset', 0" in names and "('mask', 0" in names and "grad_offset" not in lean.layout.slots
    if shape["weight"][0] == 16 and limit is None:
        assert lean.gemm_splits > 1 and "w_split" in lean.layout.slots


# cuda/im2col's weight gradient run on host memory: its kernels and cuBLAS's GEMM emulated in
# NumPy from their launch arguments (no GPU), so that what the host code computes (addresses,
# sizes, leading dimensions, the order of the launches) is checked by the values it produces.

def _address(value) -> int:
    """A launch argument's address: a host array's, an integer's value, 0 for None."""
    if value is None:
        return 0
    if isinstance(value, np.ndarray):
        return value.__array_interface__["data"][0]
    return int(value)


def _memory(address: int, count: int, dtype) -> np.ndarray:
    """``count`` elements of ``dtype`` of host memory at ``address``, as a writable array."""
    import ctypes
    dtype = np.dtype(dtype)
    return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(address), dtype, count)


def _strided(address: int, shape: tuple, strides: tuple, dtype) -> np.ndarray:
    """The host memory at ``address`` seen as ``shape`` with ``strides`` in elements."""
    dtype = np.dtype(dtype)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    return np.lib.stride_tricks.as_strided(_memory(address, span, dtype), shape,
                                           tuple(s * dtype.itemsize for s in strides))


_CUBLAS_TYPES = {2: np.float16, 0: np.float32, 1: np.float64}


def _emulated_gemm(handle, transa, transb, m, n, k, alpha, a, a_type, lda, stride_a, b, b_type, ldb, stride_b,
                   beta, c, c_type, ldc, stride_c, batch, compute, algo) -> int:
    """cublasGemmStridedBatchedEx on host memory, from cuBLAS's definition: column-major
    ``C_i = alpha op(A_i) op(B_i) + beta C_i`` (C not read where beta is 0), in float64."""
    scalar = np.float64 if compute == 70 else np.float32      # CUBLAS_COMPUTE_64F
    alpha, beta = (float(_memory(p, 1, scalar)[0]) for p in (alpha, beta))
    for i in range(batch):
        def operand(address, t, ld, stride, rows, cols, trans):
            dt = np.dtype(_CUBLAS_TYPES[t])
            shape = (cols, rows) if trans else (rows, cols)
            matrix = _strided(address + i * stride * dt.itemsize, shape, (1, ld), dt).astype(np.float64)
            return matrix.T if trans else matrix
        product = alpha * operand(a, a_type, lda, stride_a, m, k, transa) @ operand(b, b_type, ldb, stride_b, k, n,
                                                                                    transb)
        out = _strided(c + i * stride_c * np.dtype(_CUBLAS_TYPES[c_type]).itemsize, (m, n), (1, ldc),
                       _CUBLAS_TYPES[c_type])
        out[...] = product + (beta * out.astype(np.float64) if beta else 0.0)
    return 0


class _EmulatedKernel(str):
    """A kernel of cuda/im2col's weight gradient run on host memory in NumPy (its name says
    which), for one geometry and dtype."""

    geom, dtype = None, None

    def __call__(self, grid, block, args, shared_mem=0):
        getattr(self, "_" + str(self))(*args)

    def _to_columns(self, src, dst, n, channels, q):
        """batch_to_columns: (n, channels, q) -> (channels, n * q)."""
        n, channels, q = int(n), int(channels), int(q)
        values = _memory(_address(src), n * channels * q, self.dtype).reshape(n, channels, q)
        _memory(_address(dst), n * channels * q, self.dtype)[...] = values.transpose(1, 0, 2).ravel()

    def _copy(self, x, xcl, n, channels, cp, size, stride, sums, rows, pp, early):
        """fused_channels_last: rows of ``cp`` channels, one per (sample, position), a zero row after."""
        n, channels, cp, size = int(n), int(channels), int(cp), int(size)
        out = _memory(_address(xcl), (n * size + 1) * cp, self.dtype).reshape(n * size + 1, cp)
        out[...] = 0
        out[:n * size, :channels] = _strided(_address(x), (n, size, channels), (int(stride), 1, size),
                                             self.dtype).reshape(n * size, channels)

    def _sample(self, xcl, offset, mask, cols, struct, n, channels, cp, offset_groups, mask_groups, taps):
        """fused_columns: ``columns[c*K + t, b*Q + q]`` of ``channels`` channels from the rows of
        ``xcl`` (``cp`` apart) on, by the float64 reference's sampler."""
        geom, n, channels, cp = self.geom, int(n), int(channels), int(cp)
        S, Q, K = geom.input_size, geom.output_size, geom.kernel_volume
        x = _strided(_address(xcl), (n, channels, S), (S * cp, 1, cp), self.dtype).astype(np.float64)
        x = x.reshape((n, channels) + tuple(geom.input_shape))
        field = lambda address, rows: None if not address else _memory(address, n * rows * Q, self.dtype).astype(
            np.float64).reshape((n, rows) + tuple(geom.output_shape))
        off = field(_address(offset), int(offset_groups) * K * geom.ndim)
        msk = field(_address(mask), int(mask_groups) * K)
        picks = np.zeros((channels * K, 1, K))   # a grouped convolution that picks each (channel, tap)
        picks[np.arange(channels * K), 0, np.tile(np.arange(K), channels)] = 1
        picked = reference._conv_forward_on_grid(x, picks.reshape((channels * K, 1) + tuple(geom.kernel_size)), off,
                                                 msk, geom.stride, geom.padding, geom.dilation, channels,
                                                 tuple(geom.output_shape))
        _memory(_address(cols), channels * K * n * Q, self.dtype)[...] = np.moveaxis(
            picked.reshape(n, channels * K, Q), 0, 1).ravel()

    def _finalize(self, src, bias, dst, total, channels, inner):
        """finalize (no bias): the float32 accumulator cast to the dtype."""
        assert bias is None and int(channels) == 1
        _memory(_address(dst), int(total), self.dtype)[...] = _memory(_address(src), int(total), np.float32)


def _emulate_im2col_builds(monkeypatch, cuda, geom, dtype) -> None:
    """cuda/im2col's executables built without a GPU (``_stub_im2col_builds``), their weight
    gradient's kernels and GEMMs run on host memory (``_EmulatedKernel``, ``_emulated_gemm``)."""
    from types import SimpleNamespace
    gemm = cuda._Gemm
    _stub_im2col_builds(monkeypatch, cuda)
    kernel = type("_Kernel", (_EmulatedKernel,), {"geom": geom, "dtype": np.dtype(dtype)})
    names = {"to_columns": kernel("to_columns"), "finalize": kernel("finalize")}
    monkeypatch.setattr(cuda._Executable, "kernels", lambda self, index64: names)
    monkeypatch.setattr(cuda._Executable, "column_kernels", lambda self, wide: (kernel("copy"), kernel("sample")))
    monkeypatch.setattr(cuda, "_Gemm", gemm)
    constants = SimpleNamespace(CUBLAS_OP_N=0, CUBLAS_OP_T=1, CUBLAS_COMPUTE_32F=68, CUBLAS_COMPUTE_32F_FAST_TF32=77,
                                CUBLAS_COMPUTE_64F=70, CUBLAS_GEMM_DEFAULT=-1)
    monkeypatch.setattr(cuda, "_cublas_module", lambda: constants)
    monkeypatch.setattr(cuda, "_cublas_library", lambda: SimpleNamespace(cublasGemmStridedBatchedEx=_emulated_gemm))


def _emulated_replay(ops) -> None:
    """Recorded launches (``_stub_im2col_builds``'s) run in order on host memory."""
    import ctypes
    for op in ops:
        if op[0] == 0:
            op[1](op[2], op[3], op[4])
        elif op[0] == 1:
            op[1](None, *op[2:5])
        else:
            ctypes.memset(op[1], 0, op[2])


def _panels_case(dtype):
    """B=3 5x5 3x3 DCNv2 (one offset and mask group) whose input channels are two of the
    channels-last sampler's channel tiles: 512 in the half types, 256 in float32."""
    rng = np.random.default_rng(75)
    channels = 512 if np.dtype(dtype).itemsize == 2 else 256
    arrays, params, gy = wide_case(rng, 2, groups=1, offset_groups=1, mask_groups=1, c_in=channels, c_out=8,
                                   size=5, stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    shapes = [arrays[k].shape for k in ("input", "weight", "offset", "mask")]
    return arrays, params, gy, _geometry.conv_geometry(*shapes, None, **params)[0]


@pytest.mark.parametrize("precision", ["float16", "tf32", "float32"])
def test_column_panels_rule(monkeypatch, precision):
    """``column_panels``: the fewest panels of whole sampler tiles whose columns fit the bytes
    given (else the most), 1 where they do not serve; at B=16 C512 14x14 the fused backward's
    weight gradient through cuda/im2col takes two panels of 256 channels (columns no larger than
    the fused part's workspace), its workspace 27.9 MiB in fp16 and 47.8 in float32 (41.7 and
    75.4 without panels: ``WEIGHT_COLUMN_PANELS`` off). No GPU (``_stub_im2col_builds``)."""
    fb = _backward_module()
    cuda = fb._cuda
    from dcn_cupy._backends import PlanSpec
    gemm = cuda._Gemm
    _stub_im2col_builds(monkeypatch, cuda)
    dtype, tf32 = DTYPE[precision], precision == "tf32"
    geom = _geometry.conv_geometry((16, 512, 14, 14), (512, 512, 3, 3), (16, 18, 14, 14), (16, 9, 14, 14), None,
                                   stride=1, padding=1, dilation=1, groups=1)[0]
    spec = PlanSpec(geom, dtype, "cuda", 0, False, tf32)
    config = fb.BackwardConfig(geom, dtype, tf32, fused_weight=False, multiprocessors=132, wgmma=True)
    lean = fb.weight_through_im2col(config, spec)
    columns = 512 * 9 * 16 * 196 * dtype.itemsize
    assert lean.panels == 2 and columns / 2 <= config.workspace_bytes < columns
    assert lean.layout.slots["cols"][1] == 256 * 9 * 16 * 196 and "2 panels of 256 channels" in lean.description
    both = fb.FusedBackward(config, lean)
    assert round(both.workspace_bytes / 2**20, 1) == (27.9 if precision == "float16" else 47.8)
    # the plan's description (the fused backward's) says what the weight gradient does
    assert "weight gradient through cuda/im2col" in both.description, both.description
    assert "(cuda/im2col backward: " in both.description and "2 panels of 256 channels" in both.description
    # its launches: the copy once, then per panel its sampling and GEMM, every address in a slot
    for made in (False, True):
        recorded = str(_slotted(lean._record(*_STUB_INPUTS, _STUB_WORKSPACE, frozenset(("weight",)), 0,
                                             _STUB_REGIONS["grad_w"][0], 0, 0, copy=(_STUB_REGIONS["xcl"][0], made)),
                                lean, _STUB_WORKSPACE, _STUB_REGIONS))
        assert recorded.count("'sample'") == 2 and recorded.count("'copy'") == int(not made)
        assert recorded.count("('xcl', 0)") == 1 + int(not made) and f"('xcl', {256 * dtype.itemsize})" in recorded
    monkeypatch.setattr(fb, "WEIGHT_COLUMN_PANELS", False)
    whole = fb.weight_through_im2col(config, spec)
    assert whole.panels == 1 and round(fb.FusedBackward(config, whole).workspace_bytes / 2**20, 1) == (
        41.7 if precision == "float16" else 75.4)
    # the rule: tiles of 256 (half types) or 128 (float32) channels
    tiles = 512 // lean.column_tile
    assert tiles == (2 if precision == "float16" else 4)
    assert cuda.column_panels(lean, columns, 132) == 1 and cuda.column_panels(lean, 1, 132) == tiles
    assert cuda.column_panels(lean, columns // 2, 132) == 2
    # not served: conv groups, several offset groups, deform_im2col's columns, a split GEMM
    grouped = _geometry.conv_geometry((16, 512, 14, 14), (512, 256, 3, 3), (16, 18, 14, 14), (16, 9, 14, 14), None,
                                      stride=1, padding=1, dilation=1, groups=2)[0]
    offset_groups = _geometry.conv_geometry((16, 512, 14, 14), (512, 512, 3, 3), (16, 36, 14, 14), None, None,
                                            stride=1, padding=1, dilation=1, groups=1)[0]
    narrow = _geometry.conv_geometry((16, 512, 32, 32), (16, 512, 3, 3), (16, 18, 32, 32), None, None,
                                     stride=1, padding=1, dilation=1, groups=1)[0]
    for g in (grouped, offset_groups, narrow):
        e = cuda._Backward(PlanSpec(g, dtype, "cuda", 0, False, tf32), weight_only=True, column_bytes=1)
        assert e.panels == 1 and "panels" not in e.description, g
    monkeypatch.setattr(cuda, "CHANNELS_LAST_COLUMNS", False)
    assert cuda._Backward(spec, weight_only=True, column_bytes=1).panels == 1
    with pytest.raises(ValueError, match="C rows of 8 elements cannot hold its 9 columns"):
        gemm(1, 4, 9, 16, np.float32, np.float32, ldc=8)


@pytest.mark.parametrize("one_gemm", [True, False], ids=["one-gemm", "accumulated"])
@pytest.mark.parametrize("precision", ["float16", "float32"])
def test_column_panels_weight_gradient_on_emulated_kernels(monkeypatch, precision, one_gemm):
    """The weight gradient of a weight-only cuda/im2col backward with its columns in panels
    (each sampled from its channels of the channels-last copy, multiplied into its columns of
    the gradient) equals the same backward's without panels and the float64 reference's, written
    by its GEMM (``WEIGHT_IN_ONE_GEMM``) or accumulated from zero (in float32 for float16, then
    cast): its kernels and cuBLAS's GEMMs emulated in NumPy on host memory
    (``_emulate_im2col_builds``), through the recorded launches (its own copy, the caller's made
    or not) and the direct path."""
    fb = _backward_module()
    cuda = fb._cuda
    from dcn_cupy._backends import PlanSpec
    dtype = DTYPE[precision]
    arrays, params, gy, geom = _panels_case(dtype)
    _emulate_im2col_builds(monkeypatch, cuda, geom, dtype)
    monkeypatch.setattr(cuda, "WEIGHT_IN_ONE_GEMM", one_gemm)
    spec = PlanSpec(geom, dtype, "cuda", 0, False, False)
    built = {(shared, panels): cuda._Backward(spec, shared_copy=shared, weight_only=True,
                                               column_bytes=1 if panels else None)
             for shared in (False, True) for panels in (False, True)}
    assert [e.panels for e in built.values()] == [1, 2, 1, 2] and all(e.copy_given for (s, _), e in built.items() if s)
    half_accumulator = precision == "float16" and not one_gemm
    assert all(e.weight_in_one_gemm == one_gemm and ("grad_w" in e.layout.slots) == half_accumulator
               for e in built.values())
    host = {k: _host(a.shape, dtype) for k, a in dict(arrays, grad_output=gy).items()}
    for k, a in dict(arrays, grad_output=gy).items():
        host[k][...] = a
    rounded = {k: np.asarray(a, np.float64) for k, a in host.items()}
    expected = reference.deform_conv_backward(rounded.pop("grad_output"), **rounded, **params)[1]
    inputs = tuple(_address(host[k]) for k in ("grad_output", "input", "weight", "offset", "mask")) + (0,)
    copy = _host(((geom.batch * geom.input_size + 1) * geom.in_channels,), dtype)
    got = {}
    for (shared, panels), e in built.items():
        ws = _host((e.workspace_bytes,), np.uint8)
        for made in ((False, True) if shared else (None,)):
            ws[...] = 0xFF   # poisoned: every byte read is one written first
            grad_w = _host(arrays["weight"].shape, dtype) + np.nan   # (written whole)
            given = None if made is None else (_address(copy), made)
            _emulated_replay(e._record(*inputs, _address(ws), frozenset(("weight",)), 0, _address(grad_w), 0, 0,
                                       copy=given))
            got[("recorded", shared, panels, made)] = grad_w.copy()
        ws[...] = 0xFF
        grad_w = _host(arrays["weight"].shape, dtype) + np.nan
        e._direct(dict(host, bias=None, wanted=frozenset(("weight",))), {"weight": grad_w}, ws, None,
                  None if not shared else (copy, False))
        got[("direct", shared, panels)] = grad_w.copy()
    first = next(iter(got.values()))
    for label, value in got.items():
        assert np.array_equal(value, first), label   # panels split the GEMM's columns, not its sums
    assert relative_error(first.astype(np.float64), expected) < TOL[precision]


def _device_and_strided(cupy, arrays: dict, dtype) -> tuple:
    """``arrays`` on the device in ``dtype``, contiguous and (but the weight) as every other
    sample of a batch twice as long: a batch stride, the primitive's (cuda/im2col's _direct then,
    on contiguous copies of the chunk's samples)."""
    dev = {k: cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    strided = {k: cupy.zeros((2 * a.shape[0],) + a.shape[1:], dtype)[::2] for k, a in dev.items() if k != "weight"}
    for k, a in strided.items():
        a[...] = dev[k]
    strided["weight"] = dev["weight"]
    return dev, strided


@pytest.mark.gpu
@pytest.mark.parametrize("ndim, precision", [(2, "float16"), (2, "tf32"), (3, "float32")])
def test_weight_gradient_through_im2col_samples_the_fused_copy(ndim, precision, monkeypatch):
    """cuda/im2col's weight gradient beside the fused ones samples its columns from their
    channels-last copy of x (``SHARED_COPY``), on the workspace past it: made by the offset and
    mask gradients' launches, else by its own into that slot. For each ``wanted``, through the
    raw-address path and through batch-strided arrays (a workspace poisoned each call): the weight
    gradient bitwise that of cuda/im2col with its own copy and with the whole backward's workspace
    (``WEIGHT_ONLY_WORKSPACE`` off), every gradient the reference's; and not shared where the
    fused backward cuts the batch into chunks."""
    cupy = _cupy()
    fb = _backward_module()
    from dcn_cupy._backends import PlanSpec
    rng = np.random.default_rng(80 + ndim)
    arrays, params, gy = wide_case(rng, ndim, groups=1, offset_groups=2, mask_groups=1, c_out=32, batch=3)
    dtype = DTYPE[precision]
    rounded = {k: a.astype(dtype).astype(np.float64) for k, a in arrays.items()}
    dev, strided = _device_and_strided(cupy, arrays, dtype)
    gy_dev = cupy.asarray(gy.astype(dtype))
    expected = dict(zip(NAMES, reference.deform_conv_backward(gy.astype(dtype).astype(np.float64), **rounded,
                                                              **params)))
    shapes = [arrays[k].shape for k in ("input", "weight", "offset", "mask")]
    geom = _geometry.conv_geometry(*shapes, None, **params)[0]
    spec = PlanSpec(geom, dtype, "cuda", cupy.cuda.runtime.getDevice(), False, precision == "tf32")
    config = fb.BackwardConfig(geom, dtype, precision == "tf32", fused_weight=False)
    weights = {}
    for shared, lean in ((False, True), (True, False), (True, True)):
        monkeypatch.setattr(fb, "SHARED_COPY", shared)
        monkeypatch.setattr(fb, "WEIGHT_ONLY_WORKSPACE", lean)
        executable = fb.FusedBackward(config, fb.weight_through_im2col(config, spec))
        assert bool(executable._weight_at) == shared and executable._weight.copy_given == shared
        assert executable._weight.weight_only == lean
        for wanted in (("input", "weight", "offset", "mask"), ("weight",), ("weight", "mask"), ("input", "weight")):
            for inputs in (dev, strided):
                out = {name: cupy.full(arrays[name].shape, np.nan, dtype=dtype) for name in wanted}
                workspace = cupy.full(executable.workspace_bytes, 0xFF, dtype=np.uint8)
                executable.run(dict(grad_output=gy_dev, bias=None, wanted=frozenset(wanted), **inputs), out,
                               workspace)
                got = {k: cupy.asnumpy(v).astype(np.float64) for k, v in out.items()}
                check(got, expected, precision, (shared, wanted))
                weights.setdefault(wanted, set()).add(got["weight"].tobytes())
    assert all(len(found) == 1 for found in weights.values()), [len(found) for found in weights.values()]
    monkeypatch.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", 1)   # one-sample chunks: each makes its own
    chunked = fb.BackwardConfig(geom, dtype, precision == "tf32", fused_weight=False)
    assert chunked.chunk == 1 and not fb.weight_through_im2col(chunked, spec).copy_given


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float16", "bfloat16", "tf32", "float32"])
def test_column_panels_weight_gradient(monkeypatch, precision):
    """cuda/im2col's weight gradient with its columns in two panels of input channels: alone
    (its own channels-last copy) and beside the fused data gradients (their copy, made by
    them or by its first panel), through the raw-address path and batch-strided arrays on a
    poisoned workspace, the reference's weight gradient and, within rounding, the one of whole
    columns (cuBLAS may choose other kernels for half the columns)."""
    cupy = _cupy()
    fb = _backward_module()
    from dcn_cupy._backends import PlanSpec
    dtype = DTYPE[precision]
    arrays, params, gy, geom = _panels_case(dtype)
    rounded = {k: a.astype(dtype).astype(np.float64) for k, a in arrays.items()}
    expected = dict(zip(NAMES, reference.deform_conv_backward(gy.astype(dtype).astype(np.float64), **rounded,
                                                              **params)))
    dev, strided = _device_and_strided(cupy, arrays, dtype)
    gy_dev = cupy.asarray(gy.astype(dtype))
    spec = PlanSpec(geom, dtype, "cuda", cupy.cuda.runtime.getDevice(), False, precision == "tf32")
    alone = {panels: fb._cuda._Backward(spec, weight_only=True, column_bytes=1 if panels else None)
             for panels in (False, True)}
    assert alone[True].panels == 2 and alone[False].panels == 1
    config = fb.BackwardConfig(geom, dtype, precision == "tf32", fused_weight=False)
    monkeypatch.setattr(fb._cuda, "column_panels", lambda *args, **kwargs: 2)
    beside = fb.FusedBackward(config, fb.weight_through_im2col(config, spec))
    assert beside._weight.panels == 2 and beside._weight.copy_given
    weights = {}
    for inputs in (dev, strided):
        for panels, e in alone.items():
            out = {"weight": cupy.full(arrays["weight"].shape, np.nan, dtype=dtype)}
            workspace = cupy.full(e.workspace_bytes, 0xFF, dtype=np.uint8)
            e.run(dict(grad_output=gy_dev, bias=None, wanted=frozenset(("weight",)), **inputs), out, workspace)
            weights[("alone", panels, inputs is dev)] = cupy.asnumpy(out["weight"]).astype(np.float64)
        for wanted in (("weight",), ("input", "weight", "offset", "mask")):   # the copy its own, or made
            out = {name: cupy.full(arrays[name].shape, np.nan, dtype=dtype) for name in wanted}
            workspace = cupy.full(beside.workspace_bytes, 0xFF, dtype=np.uint8)
            beside.run(dict(grad_output=gy_dev, bias=None, wanted=frozenset(wanted), **inputs), out, workspace)
            got = {k: cupy.asnumpy(v).astype(np.float64) for k, v in out.items()}
            check(got, expected, precision, (wanted, inputs is dev))
            weights[("beside", wanted, inputs is dev)] = got["weight"]
    whole = weights[("alone", False, True)]
    for label, value in weights.items():
        check({"weight": value}, expected, precision, label)
        assert relative_error(value, whole) < TOL[precision] / 4, label


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_plans_fold_the_bias_gradient_into_the_fused_backward(deterministic):
    """A plan whose backward is cuda/fused-backward takes the fused backward's bias gradient
    beside a data gradient, and reduces grad_output itself for the bias gradient alone or beside
    the weight's: the reference's values, each way bitwise the same on every call (fixed orders
    in both modes), through the raw-address path and through strided arrays."""
    cupy = _cupy()
    import dcn_cupy
    rng = np.random.default_rng(61)
    arrays, params, gy = wide_case(rng, 2, groups=1, offset_groups=2, mask_groups=1, c_out=80, batch=5)
    arrays["bias"] = rng.standard_normal(80)
    dtype = np.dtype(np.float16)
    dev = {k: cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    gy_r = gy.astype(dtype)
    p = dcn_cupy.plan(**dev, **params, algorithm="cuda/fused-backward", deterministic=deterministic)
    assert p._fold_bias and p._bias_sum_pointers is not None
    expected = gy_r.astype(np.float64).sum(axis=(0, 2, 3))
    strided = cupy.zeros((5, 160) + gy.shape[2:], dtype=dtype)[:, ::2]   # a sample's channels strided
    strided[...] = cupy.asarray(gy_r)
    results = {True: set(), False: set()}
    for grad_output in (cupy.asarray(gy_r), strided):
        for wrt in (None, ("input", "bias"), ("offset", "bias"), ("bias",), ("weight", "bias")):
            folded = p._folds_bias(frozenset(wrt or ("input", "weight", "offset", "mask", "bias")))
            assert folded == (wrt is None or "weight" not in wrt and wrt != ("bias",)), wrt
            for _ in range(2):
                workspace = cupy.full(p.backward_workspace_bytes, 0xFF, dtype=np.uint8)
                grads = p.backward(grad_output, **dev, wrt=wrt, workspace=workspace)
                bias = cupy.asnumpy(grads.bias)
                assert relative_error(bias.astype(np.float64), expected) < TOL["float16"], wrt
                results[folded].add(bias.tobytes())
    assert len(results[True]) == 1 and len(results[False]) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_transposed_plans_sum_the_bias_gradient_in_the_input_gradients_copy(ndim, monkeypatch):
    """A transposed plan takes its bias gradient (grad_output summed) from the sums its input
    gradient's convolution forward takes as it copies grad_output, beside the input gradient;
    alone or beside the parameter gradients from channel_sum: the reference's values, each way
    bitwise the same on every call, through the raw-address path, strided arrays (the arrays'
    path) and one-sample chunks (the running sum between chunks)."""
    cupy = _cupy()
    import dcn_cupy
    fb = _backward_module()
    from dcn_cupy._backends import cuda_direct
    monkeypatch.setattr(cuda_direct, "MAX_MACS", 0)
    monkeypatch.setattr(fb._fused, "TUNE", False)   # the rule: cuda/fused's forward for the input gradient
    rng = np.random.default_rng(80 + ndim)
    arrays, params, gy = wide_case(rng, ndim, groups=1, offset_groups=2, mask_groups=1, c_in=48, c_out=64, batch=3,
                                   stride=(2,) * ndim, padding=(1,) * ndim, dilation=(1,) * ndim)
    dtype = np.dtype(np.float16)
    # the transposed op: its input lives on the conv's output grid, its output on the conv's input grid
    x_t = rng.standard_normal(gy.shape).astype(dtype)
    w = cupy.asarray(arrays["weight"].astype(dtype))
    off, m = cupy.asarray(arrays["offset"].astype(dtype)), cupy.asarray(arrays["mask"].astype(dtype))
    bias = cupy.asarray(rng.standard_normal(arrays["input"].shape[1]).astype(dtype))
    g_t = rng.standard_normal(arrays["input"].shape).astype(dtype)
    expected = g_t.astype(np.float64).sum(axis=(0,) + tuple(range(2, g_t.ndim)))
    strided = cupy.zeros((3, 2 * g_t.shape[1]) + g_t.shape[2:], dtype=dtype)[:, ::2]
    strided[...] = cupy.asarray(g_t)
    # the output padding that gives back the conv's input grid (stride 2, padding 1, 3 taps)
    output_padding = tuple(s - (2 * (q - 1) + 1) for s, q in zip(g_t.shape[2:], gy.shape[2:]))
    for limit in (None, 1):
        if limit is not None:
            monkeypatch.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", limit)
        p = dcn_cupy.plan(cupy.asarray(x_t), w, off, m, bias, **params, transposed=True,
                          output_padding=output_padding, algorithm="cuda/fused-backward")
        assert p.output_shape == g_t.shape, (p.output_shape, g_t.shape)
        assert p._fold_transposed_bias, p.algorithm
        assert limit is None or p._bwd_input[1].config.chunk == 1
        results = {True: set(), False: set()}
        for grad_output in (cupy.asarray(g_t), strided):
            for wrt in (None, ("input", "bias"), ("bias",), ("weight", "offset", "bias")):
                folded = p._folds_bias(frozenset(wrt or ("input", "weight", "offset", "mask", "bias")))
                assert folded == (wrt is None or "input" in wrt), wrt
                for _ in range(2):
                    workspace = cupy.full(p.backward_workspace_bytes, 0xFF, dtype=np.uint8)
                    grads = p.backward(grad_output, cupy.asarray(x_t), w, off, m, bias, wrt=wrt, workspace=workspace)
                    got = cupy.asnumpy(grads.bias)
                    assert relative_error(got.astype(np.float64), expected) < TOL["float16"], (wrt, limit)
                    results[folded].add(got.tobytes())
        assert len(results[True]) == 1 and len(results[False]) == 1, limit


@pytest.mark.gpu
def test_partial_tiles_batch_33_and_one_sample_chunks(monkeypatch):
    """C_in = 200 (partial channel tiles), 33 samples of 7x7 (position tiles spanning samples),
    then one sample per chunk."""
    fb = _backward_module()
    rng = np.random.default_rng(3)
    arrays, params, gy = wide_case(rng, 2, groups=1, offset_groups=2, mask_groups=2, c_in=200, c_out=40, batch=33,
                                   size=7, stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    for tile in fb._tiles(np.float16):
        got, expected, _ = run_gradients(arrays, params, gy, "float16", tile)
        check(got, expected, "float16", tile)
    monkeypatch.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", 1)
    got, expected, config = run_gradients(arrays, params, gy, "bfloat16")
    assert config.chunk == 1
    check(got, expected, "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_programmatic_dependent_launch_gives_the_same_gradients(deterministic, monkeypatch):
    """Every gradient with programmatic dependent launch (each kernel of the list starting while
    the one before it finishes, waiting for it first) and without, launch by launch and as a CUDA
    graph, in one-sample chunks (the accumulators cleared between chunks), on a workspace poisoned
    (NaN) before every run: the reference's values, and in deterministic mode bitwise the same."""
    cupy = _cupy()
    fb = _backward_module()
    from dcn_cupy._backends import cuda
    monkeypatch.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", 1)
    rng = np.random.default_rng(37)
    arrays, params, gy = wide_case(rng, 2, groups=1, offset_groups=2, mask_groups=1, c_in=64, c_out=64, batch=3,
                                   stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    dtype = np.dtype(np.float16)
    dev = {k: cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    gy_dev = cupy.asarray(gy.astype(dtype))
    rounded = {k: a.astype(dtype).astype(np.float64) for k, a in arrays.items()}
    gx, gw, goff, gm, _ = reference.deform_conv_backward(gy.astype(dtype).astype(np.float64), **rounded, **params)
    expected = {"input": gx, "weight": gw, "offset": goff, "mask": gm,
                "bias": gy.astype(dtype).astype(np.float64).sum(axis=(0, 2, 3))}
    shapes = [arrays[k].shape for k in ("input", "weight", "offset", "mask")]
    geom = _geometry.conv_geometry(*shapes, None, **params)[0]
    config = fb.BackwardConfig(geom, dtype, False, deterministic=deterministic)
    assert config.chunk == 1 and config.fused_weight
    workspace = cupy.empty(config.workspace_bytes, dtype=np.uint8)
    out = {name: cupy.empty(expected[name].shape, dtype=dtype) for name in expected}
    outs = tuple(out[name].data.ptr for name in ("input", "weight", "offset", "mask", "bias"))
    inputs = (gy_dev.data.ptr,) + tuple(dev[k].data.ptr for k in ("input", "weight", "offset", "mask")) + (0,)
    strides = tuple(fb._fused._batch_stride(a) for a in (gy_dev, dev["input"], dev["offset"], dev["mask"],
                                                           out["input"], out["offset"], out["mask"]))
    stream = cupy.cuda.get_current_stream()
    results = []
    for pdl in (False, True):
        monkeypatch.setattr(cuda, "PDL", pdl)
        ops = cuda._Ops(fb._launches(config, inputs, strides, outs, workspace.data.ptr))
        overlapping = [op[0] == 0 and len(op[7]) == 6 for op in ops]
        if pdl and cuda._prepare is not None:
            assert sum(overlapping) >= 8, overlapping
        else:
            assert not any(overlapping)
        for _ in range(3):   # launch by launch, then (second replay on) as a CUDA graph
            workspace.fill(0xFF)
            for array in out.values():
                array.fill(np.nan)
            cuda._replay(ops, None, stream.ptr)
            results.append({name: cupy.asnumpy(array) for name, array in out.items()})
        assert ops.graph, "the launches were not captured as a CUDA graph"
    for got in results:
        check({k: v.astype(np.float64) for k, v in got.items()}, expected, "float16")
        if deterministic:
            for name in expected:
                assert got[name].tobytes() == results[0][name].tobytes(), name


@pytest.mark.gpu
def test_broadcast_batch_and_64bit_indices(monkeypatch):
    fb = _backward_module()
    rng = np.random.default_rng(5)
    arrays, params, gy = wide_case(rng, 3)
    got, expected, _ = run_gradients(arrays, params, gy, "float32", broadcast=True)
    check(got, expected, "float32", "broadcast")
    monkeypatch.setattr(fb, "_INT32_SAFE", 16)
    got, expected, config = run_gradients(arrays, params, gy, "float16")
    assert config.index64
    check(got, expected, "float16", "64-bit")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [128, 256])
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("precision", ["float16", "bfloat16", "tf32", "float32"])
def test_warp_specialised_weight_gradient(ndim, precision, rows, monkeypatch):
    """The warp-specialised wgmma weight kernel (sm_90a), its tile of ``rows`` rows (128: one MMA
    warpgroup, 256: two), against the float64 reference and the mma.sync weight kernel: conv and
    offset groups of 64 channels, 48 output channels (a partial tile), steps that run past the
    last position, beside the data gradients (the data kernel's plan) and alone (the sampling
    plan), 64-bit indices and one sample a chunk (its partial sums added chunk after chunk)."""
    fb = _backward_module()
    if not fb._fused.wgmma_available():
        pytest.skip("the warp-specialised weight kernel runs on sm_90a devices")
    monkeypatch.setattr(fb, "WS_NARROW_TILE", rows == 128)
    rng = np.random.default_rng(40 + ndim)
    cases = ((dict(groups=2, c_in=128, offset_groups=2, mask_groups=1), NAMES),
             (dict(groups=1, c_in=64, offset_groups=1, mask_groups=1), ("weight",)),
             (dict(groups=1, c_in=128, offset_groups=2, mask_groups=2, offset=False), ("weight", "mask")))
    for case, wanted in cases:
        arrays, params, gy = wide_case(rng, ndim, c_out=48, batch=5, **case)
        label = (case, wanted)
        got, expected, config = run_gradients(arrays, params, gy, precision, wanted=wanted, ws_weight=True)
        assert config.ws_weight and "warp-specialised" in config.description, label
        assert config.weight_tile[0] == rows and config.weight_threads == rows + fb.WS_RINGS[
            fb.weight_tile_key(config.dtype, config.precision)][1], label
        check(got, expected, precision, label)
        mma, _, mma_config = run_gradients(arrays, params, gy, precision, wanted=wanted, ws_weight=False)
        assert not mma_config.ws_weight
        assert relative_error(got["weight"], mma["weight"]) < TOL[precision] / 10, label
    monkeypatch.setattr(fb, "_INT32_SAFE", 16)
    got, expected, config = run_gradients(arrays, params, gy, precision, wanted=("weight",), ws_weight=True)
    assert config.index64 and config.ws_weight
    check(got, expected, precision, "64-bit")
    monkeypatch.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", 1)
    got, expected, config = run_gradients(arrays, params, gy, precision, ws_weight=True)
    assert config.chunk == 1 and config.ws_weight
    check(got, expected, precision, "one sample a chunk")


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("precision", ["float16", "tf32", "float32"])
def test_warp_specialised_loads_ahead_same_bits(ndim, precision, monkeypatch):
    """The warp-specialised weight kernel's samplers loading a step's corners while they store the
    step before (WS_LOADS_AHEAD) give the bits of loads at each step's start, and the reference's
    values: the 128-row tile (96 output channels) and the 256-row one (160), 5 splits of a few
    steps (the last partial), as many splits as steps (one step each), 64-bit indices."""
    fb = _backward_module()
    if not fb._fused.wgmma_available():
        pytest.skip("the warp-specialised weight kernel runs on sm_90a devices")
    rng = np.random.default_rng(70 + ndim)
    size = {1: 203, 2: 15}[ndim]
    for c_out in (96, 160):
        arrays, params, gy = wide_case(rng, ndim, groups=1, c_in=128, offset_groups=2, mask_groups=1, c_out=c_out,
                                       batch=4, size=size)
        for splits, index64 in ((5, False), (10**6, False), (5, True)):
            label = (c_out, splits, index64)
            weights = {}
            for ahead in (False, True):
                with monkeypatch.context() as m:
                    m.setattr(fb, "WS_LOADS_AHEAD", ahead)
                    m.setattr(fb, "weight_splits", lambda tiles, steps, slots: min(splits, steps))
                    if index64:
                        m.setattr(fb, "_INT32_SAFE", 16)
                    got, expected, config = run_gradients(arrays, params, gy, precision, wanted=("weight",),
                                                          ws_weight=True, reduced_splits=False)
                assert config.ws_weight and config.index64 == index64, label
                assert config.weight_tile[0] == (128 if c_out == 96 else 256), label
                assert config.splits == min(splits, -(-config.chunk * config.Q // config.weight_tile[2])), label
                check(got, expected, precision, label)
                weights[ahead] = got["weight"]
            assert np.array_equal(weights[False], weights[True]), label


#: The same-bits tests' position splits of the warp-specialised weight kernel (name, splits(steps)):
#: names as :func:`_ws_weight_gradient` reads them.
_WS_SPLITS = (("5 splits", lambda steps: min(5, steps)), ("64-bit", lambda steps: min(5, steps)),
              ("chunks", lambda steps: min(3, steps)))


def _ws_cases(rng, ndim):
    """(C_out, case) of the warp-specialised weight kernel's same-bits tests: 96 output channels
    (the 128-row tile, its rows past C_out/groups not stored) and 160 (the 256-row one), 128 input
    channels in 2 offset groups, 4 samples of 203 (1D) or 15x15 (2D) positions."""
    size = {1: 203, 2: 15}[ndim]
    for c_out in (96, 160):
        yield c_out, wide_case(rng, ndim, groups=1, c_in=128, offset_groups=2, mask_groups=1, c_out=c_out, batch=4,
                               size=size)


def _ws_weight_gradient(monkeypatch, case, precision, name, splits, gradient_plan=None, reduced_splits=False,
                        **switches):
    """The warp-specialised kernel's weight gradient of ``case`` (arrays, params, grad_output) with
    the module's ``switches`` set and ``splits(steps)`` position splits; ``name`` "64-bit": 64-bit
    indices, "chunks": one sample a chunk; ``gradient_plan`` and ``reduced_splits`` as
    :class:`BackwardConfig`'s (True: the corners from the plan shared with the data kernel; False:
    a partial sum a split, added in a fixed order, for the same-bits tests). (got, expected,
    config) of :func:`run_gradients`."""
    fb = _backward_module()
    with monkeypatch.context() as m:
        for switch, value in switches.items():
            m.setattr(fb, switch, value)
        m.setattr(fb, "weight_splits", lambda tiles, steps, slots: splits(steps))
        if name == "64-bit":
            m.setattr(fb, "_INT32_SAFE", 16)
        if name == "chunks":
            m.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", 1)
        return run_gradients(*case, precision, wanted=("weight",), ws_weight=True, gradient_plan=gradient_plan,
                             reduced_splits=reduced_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("precision", ["float16", "tf32", "float32"])
def test_warp_specialised_persistent_blocks_same_bits(ndim, precision, monkeypatch):
    """The warp-specialised weight kernel in persistent blocks (WS_PERSISTENT: several units, tile
    and split, a block through one ring) gives the bits of a block a unit, and the reference's
    values: the 128-row tile (96 output channels) and the 256-row one (160); 5 splits on 3 blocks;
    splits of no steps (as many splits as steps less one: two steps each, the last splits empty)
    on 2 blocks; 64-bit indices on 7 blocks; chunks of one sample (the units add to the partial
    sums) on 5 blocks."""
    fb = _backward_module()
    if not fb._fused.wgmma_available():
        pytest.skip("the warp-specialised weight kernel runs on sm_90a devices")
    rng = np.random.default_rng(80 + ndim)
    size = {1: 203, 2: 15}[ndim]
    geometry = dict(stride=(1,) * ndim, padding=(1,) * ndim, dilation=(1,) * ndim)   # 4 steps or more a sample
    cases = (("5 splits", 3, lambda steps: min(5, steps)), ("empty splits", 2, lambda steps: max(1, steps - 1)),
             ("64-bit", 7, lambda steps: min(5, steps)), ("chunks", 5, lambda steps: min(3, steps)))
    for c_out in (96, 160):
        case = wide_case(rng, ndim, groups=1, c_in=128, offset_groups=2, mask_groups=1, c_out=c_out, batch=4,
                         size=size, **geometry)
        for name, blocks, splits in cases:
            label = (c_out, name)
            weights = {}
            for persistent in (False, True):
                got, expected, config = _ws_weight_gradient(monkeypatch, case, precision, name, splits,
                                                            WS_PERSISTENT=persistent, WS_PERSISTENT_BLOCKS=blocks)
                units = config.splits * config.weight_tiles
                assert config.ws_weight and config.index64 == (name == "64-bit"), label
                assert config.weight_tile[0] == (128 if c_out == 96 else 256), label
                assert config.chunk == (1 if name == "chunks" else 4), label
                assert config.weight_grid == (min(blocks, units) if persistent else units), label
                assert (units > blocks * 2) and (("persistent blocks" in config.description) == persistent), label
                if name == "empty splits":   # (splits past the steps' end: units of no steps)
                    assert config.splits * config.weight_steps(config.chunk) >= -(-config.chunk * config.Q //
                                                                                 config.weight_tile[2]) + 2, label
                check(got, expected, precision, label)
                weights[persistent] = got["weight"]
            assert np.array_equal(weights[False], weights[True]), label


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("precision", ["float16", "tf32", "float32"])
def test_warp_specialised_channel_rows_same_bits(ndim, precision, monkeypatch):
    """The warp-specialised weight kernel's MMAs with the operands' roles swapped (WS_CHANNEL_ROWS:
    the sampled channels the wgmma's M, grad_output's rows its N, where the tile's threads have the
    registers) give the bits of the m64n64 order, and the reference's values: the 128-row tile (96
    output channels: the partial tile's rows past C_out/groups not stored) and the 256-row one
    (160); 5 splits, 64-bit indices, chunks of one sample (the units add to the partial sums)."""
    fb = _backward_module()
    if not fb._fused.wgmma_available():
        pytest.skip("the warp-specialised weight kernel runs on sm_90a devices")
    for c_out, case in _ws_cases(np.random.default_rng(90 + ndim), ndim):
        for name, splits in _WS_SPLITS:
            label = (c_out, name)
            weights = {}
            for channel_rows in (False, True):
                got, expected, config = _ws_weight_gradient(monkeypatch, case, precision, name, splits,
                                                            WS_CHANNEL_ROWS=channel_rows)
                assert config.ws_weight and config.index64 == (name == "64-bit"), label
                assert config.weight_tile[0] == (128 if c_out == 96 else 256), label
                check(got, expected, precision, label)
                weights[channel_rows] = got["weight"]
            assert np.array_equal(weights[False], weights[True]), label


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("precision", ["float16", "tf32", "float32"])
def test_warp_specialised_epilogue_reductions_same_bits(ndim, precision, monkeypatch):
    """The warp-specialised weight kernel adding to the chunks' partial sums by global reductions
    (WS_EPILOGUE_RED) gives the bits of its loads and stores (no sum here is subnormal), and the
    reference's values: chunks of one sample (every launch but the first adds), in both MMA orders
    (WS_CHANNEL_ROWS: scalar reductions; off, the m64n64 order's float2 ones), the 128-row tile
    (96 output channels: rows past C_out/groups not added) and the 256-row one (160); and whole
    (no chunk adds: the same code)."""
    fb = _backward_module()
    if not fb._fused.wgmma_available():
        pytest.skip("the warp-specialised weight kernel runs on sm_90a devices")
    for c_out, case in _ws_cases(np.random.default_rng(120 + ndim), ndim):
        for name, splits in _WS_SPLITS[::2]:   # ("5 splits": whole; "chunks")
            for channel_rows in ((True, False) if name == "chunks" else (True,)):
                label = (c_out, name, channel_rows)
                weights = {}
                for red in (False, True):
                    got, expected, config = _ws_weight_gradient(monkeypatch, case, precision, name, splits,
                                                                WS_EPILOGUE_RED=red, WS_CHANNEL_ROWS=channel_rows)
                    assert config.ws_weight and config.chunk == (1 if name == "chunks" else 4), label
                    assert config.weight_tile[0] == (128 if c_out == 96 else 256), label
                    check(got, expected, precision, label)
                    weights[red] = got["weight"]
                assert np.array_equal(weights[False], weights[True]), label


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("precision", ["float16", "tf32", "float32"])
def test_weight_kernel_epilogue_reductions_same_bits(ndim, precision, monkeypatch):
    """The mma.sync weight kernel adding to the chunks' partial sums by global reductions
    (WEIGHT_EPILOGUE_RED) gives the bits of its loads and stores, and the reference's values: in
    chunks of one sample (every launch but the first adds) and whole, C_out 96 (a partial tile)
    and 160."""
    fb = _backward_module()
    for c_out, case in _ws_cases(np.random.default_rng(130 + ndim), ndim):
        for limit in (None, 1):
            label = (c_out, limit)
            weights = {}
            for red in (False, True):
                with monkeypatch.context() as m:
                    m.setattr(fb, "WEIGHT_EPILOGUE_RED", red)
                    if limit is not None:
                        m.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", limit)
                    got, expected, config = run_gradients(*case, precision, wanted=("weight",), ws_weight=False,
                                                          reduced_splits=False)
                assert config.fused_weight and not config.ws_weight, label
                assert config.chunk == (1 if limit else 4), label
                check(got, expected, precision, label)
                weights[red] = got["weight"]
            assert np.array_equal(weights[False], weights[True]), label


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("precision", ["float16", "tf32", "float32"])
def test_reduced_splits_give_the_fixed_order_sums_values(ndim, precision, monkeypatch):
    """The default mode's position splits reduced into one float32 sum (``REDUCED_SPLITS``: the
    slot cleared first, on a workspace poisoned with NaN) give the reference's weight gradient and,
    to float32 rounding, that of the fixed-order sum of a slot a split: the mma.sync weight kernel
    and the warp-specialised one (where the device has it and it serves), 5 splits beside the data
    gradients, splits of no steps, 64-bit indices, and chunks of one sample (every chunk's splits
    reduced into the one slot) each for the weight gradient alone."""
    fb = _backward_module()
    rng = np.random.default_rng(150 + ndim)
    size = {1: 203, 2: 15, 3: 6}[ndim]
    geometry = dict(stride=(1,) * ndim, padding=(1,) * ndim, dilation=(1,) * ndim)
    case = wide_case(rng, ndim, groups=1, c_in=128, offset_groups=2, mask_groups=1, c_out=96, batch=4, size=size,
                     **geometry)
    cases = (("5 splits", NAMES, lambda steps: min(5, steps)),
             ("empty splits", ("weight",), lambda steps: max(1, steps - 1)),
             ("64-bit", ("weight",), lambda steps: min(5, steps)),
             ("chunks", ("weight",), lambda steps: min(3, steps)))
    kernels = (False, True) if fb._fused.wgmma_available() else (False,)
    for ws in kernels:
        for name, wanted, splits in cases:
            label = (ws, name)
            weights = {}
            for reduced in (False, True):
                with monkeypatch.context() as m:
                    m.setattr(fb, "weight_splits", lambda tiles, steps, slots: splits(steps))
                    if name == "64-bit":
                        m.setattr(fb, "_INT32_SAFE", 16)
                    if name == "chunks":
                        m.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", 1)
                    got, expected, config = run_gradients(*case, precision, wanted=wanted, ws_weight=ws,
                                                          reduced_splits=None if reduced else False)
                assert config.fused_weight and config.ws_weight == ws and config.splits > 1, label
                assert config.reduced_splits == reduced, label
                assert config.chunk == (1 if name == "chunks" else 4) and config.index64 == (name == "64-bit"), label
                assert ("reduced into one sum" in config.description) == reduced, label
                check(got, expected, precision, (label, reduced))
                weights[reduced] = got["weight"]
            # (float16: an element whose float32 sums differ in the last bits may round to the next half)
            assert relative_error(weights[True], weights[False]) < (1e-3 if precision == "float16" else 1e-6), label


@pytest.mark.gpu
def test_warp_specialised_strict_float32_keeps_float32_accuracy_over_long_reductions(monkeypatch):
    """The warp-specialised kernel's 3xTF32 sums its products a run of positions at a time apart
    from the accumulators, so that over 2048 positions in one split its weight gradient keeps
    float32 FMAs' error (about 1e-6), as the mma.sync kernel's does."""
    fb = _backward_module()
    if not fb._fused.wgmma_available():
        pytest.skip("the warp-specialised weight kernel runs on sm_90a devices")
    monkeypatch.setattr(fb, "MAX_SPLITS", 1)
    rng = np.random.default_rng(15)
    arrays, params, gy = wide_case(rng, 2, groups=1, offset_groups=1, mask_groups=1, c_in=64, c_out=512, batch=2,
                                   size=32, stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    got, expected, config = run_gradients(arrays, params, gy, "float32", wanted=("weight",))
    assert config.ws_weight and config.precision == 2 and config.splits == 1
    assert relative_error(got["weight"], expected["weight"]) < 2e-6


def test_warp_specialised_weight_rule(monkeypatch):
    """Where the warp-specialised weight kernel serves (no GPU needed: ``wgmma`` given)."""
    fb = _backward_module()
    assert fb.ws_weight_unsupported(_geom(c_in=64, c_out=48), np.float16, 0, wgmma=True) is None
    assert fb.ws_weight_unsupported(_geom(c_in=256, c_out=256, ndim=1), np.float32, 1, wgmma=True) is None
    assert "sm_90a" in fb.ws_weight_unsupported(_geom(c_in=64), np.float16, 0, wgmma=False)
    assert fb.ws_weight_unsupported(_geom(c_in=64), np.float32, 2, wgmma=True) is None
    assert "C_in/groups = 32" in fb.ws_weight_unsupported(_geom(c_in=64, groups=2), np.float16, 0, wgmma=True)
    assert "segment" in fb.ws_weight_unsupported(_geom(c_in=64, offset_groups=2), np.float16, 0, wgmma=True)
    assert "plan segments" in fb.ws_weight_unsupported(_geom(c_in=1024, offset_groups=16), np.float16, 0, wgmma=True)
    forced = fb.BackwardConfig(_geom(c_in=64, c_out=48), np.float16, False, ws_weight=True, wgmma=True)
    # (48 output channels: the narrow tile, one MMA warpgroup)
    assert forced.ws_weight and forced.sampling_plan and forced.weight_tile == (128,) + fb.WS_WEIGHT_TILES["half"][1:]
    assert forced.weight_threads == 128 + fb.WS_RINGS["half"][1]
    narrow = fb.ws_tiles(np.float16, 0)[0]
    assert narrow == forced.weight_tile and fb.ws_tiles(np.float16, 0)[1] == fb.WS_WEIGHT_TILES["half"]
    assert forced.weight_smem_bytes == fb.ws_weight_smem_bytes(np.float16, 0, narrow) <= 227 * 1024
    assert fb.ws_kernel_name(np.float16, False, 2, 0, narrow) in fb.ws_name_expressions(np.float16, 2, False)
    for rows, tile_rows in ((128, 128), (129, 256), (256, 256)):
        assert fb.ws_weight_tile(np.float32, 2, rows)[0] == tile_rows
    with monkeypatch.context() as m:
        m.setattr(fb, "WS_NARROW_TILE", False)
        wide = fb.BackwardConfig(_geom(c_in=64, c_out=48), np.float16, False, ws_weight=True, wgmma=True)
    assert wide.weight_tile == fb.WS_WEIGHT_TILES["half"] and wide.weight_threads == 256 + fb.WS_RINGS["half"][1]
    assert wide.weight_smem_bytes == fb.ws_weight_smem_bytes(np.float16, 0, fb.WS_WEIGHT_TILES["half"]) <= 227 * 1024
    assert forced.Pp % 64 == 0   # whole segments of grad_output
    # the rule: at least WS_MIN_ROWS output channels a group, 128 in strict float32 and in 2D, else 256
    assert not fb.BackwardConfig(_geom(c_in=64, c_out=48), np.float16, False, wgmma=True).ws_weight
    for ndim, dtype, allow_tf32, ws in ((2, np.float16, False, True), (2, np.float32, True, True),
                                        (1, np.float32, False, True), (3, np.float32, False, True),
                                        (1, np.float32, True, False), (1, np.float16, False, False),
                                        (3, np.float16, False, False)):
        assert fb.BackwardConfig(_geom(c_in=128, c_out=128, ndim=ndim), dtype, allow_tf32,
                                 wgmma=True).ws_weight == ws, (ndim, dtype, allow_tf32)
        assert not fb.BackwardConfig(_geom(c_in=128, c_out=64, ndim=ndim), dtype, allow_tf32, wgmma=True).ws_weight
    tall = fb.BackwardConfig(_geom(c_in=256, c_out=256), np.float32, True, wgmma=True)
    assert tall.ws_weight and tall.weight_tile == (256, 64, 32, 1) and tall.Pp % 32 == 0
    assert "warp-specialised" in tall.description
    assert not fb.BackwardConfig(_geom(c_in=256, c_out=256, groups=4), np.float16, False, wgmma=True).ws_weight
    assert not fb.BackwardConfig(_geom(c_in=256, c_out=256), np.float16, False, ws_weight=False, wgmma=True).ws_weight
    assert not fb.BackwardConfig(_geom(c_in=256, c_out=256), np.float16, False, wgmma=False).ws_weight
    assert not fb.BackwardConfig(_geom(c_in=256, c_out=256), np.float16, False, sampling_plan=False,
                                 wgmma=True).ws_weight
    # 3xTF32: two planes of each tile in a stage and of grad_output's segments
    strict = fb.BackwardConfig(_geom(c_in=256, c_out=256), np.float32, False, wgmma=True)
    assert strict.ws_weight and strict.precision == 2 and strict.weight_tile == fb.WS_WEIGHT_TILES["3xtf32"]
    depth, samplers = fb.WS_RINGS["3xtf32"]
    assert strict.weight_threads == 256 + samplers
    assert strict.weight_smem_bytes == depth * (2 * (256 + 64) * 128 + 8) + 1024 <= 227 * 1024
    assert strict.offsets["gyr"][1] == 2 * 256 * strict.Pp + 256 * 32 == 2 * tall.offsets["gyr"][1] - 256 * 32


def test_ws_rows_over_the_copy_share_its_region(monkeypatch):
    """ROWS_OVER_COPY: the warp-specialised weight kernel's rows of grad_output start where the
    data kernel's channels-last copy of it does, in one region as long as the longer of the two,
    and a sample's bytes lose that buffer: B=8 C256 56x56 strict float32 then takes one chunk of 8
    (two of 4 without), 1D B=16 C256 L4096 strict the same three chunks in less workspace, TF32
    two chunks of 8 (three of 6 without). The other weight kernels keep rows of their own."""
    fb = _backward_module()

    def config(dtype, tf32, batch, channels, size, ndim=2):
        S, k = (size,) * ndim, (3,) * ndim
        K = math.prod(k)
        geom = _geometry.conv_geometry((batch, channels) + S, (channels, channels) + k, (batch, K * ndim) + S,
                                       (batch, K) + S, None, stride=1, padding=1, dilation=1, groups=1)[0]
        return fb.BackwardConfig(geom, dtype, tf32, multiprocessors=132, wgmma=True)

    shapes = {"c256 strict": (np.float32, False, 8, 256, 56), "1d strict": (np.float32, False, 16, 256, 4096, 1),
              "1d tf32": (np.float32, True, 16, 256, 4096, 1), "c64 fp16": (np.float16, False, 32, 64, 56)}
    assert fb.ROWS_OVER_COPY is True   # (the default)
    monkeypatch.setattr(fb, "ROWS_OVER_COPY", False)
    off = {name: config(*shape) for name, shape in shapes.items()}
    monkeypatch.setattr(fb, "ROWS_OVER_COPY", True)
    on = {name: config(*shape) for name, shape in shapes.items()}
    for name, c in on.items():
        before = off[name]
        assert not before.rows_over_copy and before.offsets["gyr"][0] != before.offsets["gycl"][0], name
        assert "over its copy" not in before.description, name
        if not before.ws_weight:   # (C64: the 64-row weight tile's kernel)
            assert not c.rows_over_copy and c.offsets == before.offsets, name
            continue
        assert c.rows_over_copy and "grad_output's rows over its copy" in c.description, name
        assert (c.gradient_plan, c.plan_shared) == (before.gradient_plan, before.plan_shared), name   # (its rule)
        (copy_at, copy_count, dt), (rows_at, rows_count, rows_dt) = c.offsets["gycl"], c.offsets["gyr"]
        assert rows_at == copy_at and rows_dt == dt == np.dtype(shapes[name][0]), name
        n = c.chunk
        assert copy_count == max((n * c.Q + 1) * c.gy_row, rows_count), name
        assert rows_count == c.geom.out_channels * c.Pp * fb.operand_planes(c.precision) + 256 * 32, name
        # nothing else in the region: the next buffer starts past the longer of the two
        assert min(at for key, (at, _, _) in c.offsets.items() if at > copy_at) >= copy_at + copy_count * dt.itemsize
    assert (off["c256 strict"].chunk, on["c256 strict"].chunk) == (4, 8)
    assert (off["1d strict"].chunk, on["1d strict"].chunk) == (6, 6)
    assert on["1d strict"].workspace_bytes < off["1d strict"].workspace_bytes - 32 * 2**20
    assert (off["1d tf32"].chunk, on["1d tf32"].chunk) == (6, 8)


def test_fused_workspace_limit_sizes_the_chunk_not_the_workspace(monkeypatch):
    """README's figures: at the default ``DCN_CUPY_FUSED_WORKSPACE_BYTES`` (128M), B=8 C256 56x56
    takes one chunk in every precision, and its backward's workspace (132 SMs, wgmma) is 122 MiB
    in strict float32, 96 in TF32 and 70 in fp16: within the limit but for the buffers that do
    not grow with the batch (the re-laid weights ``wt`` and the weight gradient's partial sums
    ``part``), which take strict float32's over it with a partial sum a split (145 MiB,
    ``REDUCED_SPLITS`` off)."""
    fb = _backward_module()
    monkeypatch.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", 128 * 2**20)   # (the default, whatever the environment)
    geom = _geometry.conv_geometry((8, 256, 56, 56), (256, 256, 3, 3), (8, 18, 56, 56), (8, 9, 56, 56), None,
                                   stride=1, padding=1, dilation=1, groups=1)[0]
    for dtype, tf32, mib, reduced in ((np.float32, False, 122, None), (np.float32, True, 96, None),
                                      (np.float16, False, 70, None), (np.float32, False, 145, False)):
        c = fb.BackwardConfig(geom, dtype, tf32, multiprocessors=132, wgmma=True, reduced_splits=reduced)
        assert c.chunk == 8 and round(c.workspace_bytes / 2**20) == mib, (dtype, tf32, c.chunk, c.workspace_bytes)
        fixed = sum(count * dt.itemsize for name, (_, count, dt) in c.offsets.items() if name in ("wt", "part"))
        assert c.workspace_bytes - fixed <= 128 * 2**20 and (c.workspace_bytes > 128 * 2**20) == (mib > 128)


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("precision", ["float16", "tf32", "float32"])
def test_ws_rows_over_the_copy_same_bits(ndim, precision, monkeypatch):
    """The warp-specialised weight kernel reading grad_output's rows over the data kernel's copy
    of it (ROWS_OVER_COPY) gives the weight and bias gradients bitwise as with rows of their own
    (their sums are in a fixed order; the data gradients' float atomics are not, so those are held
    to the reference), and every gradient the reference's values, on a workspace poisoned with NaN:
    all the gradients with the bias's, the weight's alone, the weight's with the bias's (the copy
    made for the bias sums alone); whole and in one-sample chunks (the next chunk's copy over the
    rows the weight kernel read)."""
    fb = _backward_module()
    if not fb._fused.wgmma_available():
        pytest.skip("the warp-specialised weight kernel runs on sm_90a devices")
    _, case = next(_ws_cases(np.random.default_rng(110 + ndim), ndim))
    for limit in (None, 1):
        for wanted in (NAMES + ("bias",), ("weight",), ("weight", "bias")):
            label = (limit, wanted)
            got = {}
            for on in (False, True):
                with monkeypatch.context() as m:
                    m.setattr(fb, "ROWS_OVER_COPY", on)
                    if limit is not None:
                        m.setattr(fb._fused, "WORKSPACE_LIMIT_BYTES", limit)
                    got[on], expected, config = run_gradients(*case, precision, wanted=wanted, ws_weight=True,
                                                              reduced_splits=False)
                assert config.ws_weight and config.rows_over_copy == on, label
                assert config.chunk == (1 if limit else 4), label
                check(got[on], expected, precision, label)
            assert got[False].keys() == got[True].keys() == set(wanted), label
            for name in set(wanted) & {"weight", "bias"}:
                assert np.array_equal(got[False][name], got[True][name], equal_nan=True), (label, name)


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_non_finite_and_huge_offsets(ndim):
    """Positions outside [-1, S) or non-finite sample 0 and get no gradient; a coordinate of
    exactly -1 takes the one-sided slope."""
    rng = np.random.default_rng(60 + ndim)
    arrays, params, gy = wide_case(rng, ndim, groups=1, offset_groups=4, mask_groups=2)
    off = arrays["offset"].reshape(-1)
    picks = rng.choice(off.size, size=off.size // 3, replace=False)
    specials = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 3e9, -3e9, 0.5])
    off[picks] = specials[rng.integers(0, specials.size, size=picks.size)]
    for precision in ("float16", "float32"):
        got, expected, _ = run_gradients(arrays, params, gy, precision)
        check(got, expected, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_non_finite_column_gradients(ndim):
    """Infinite grad_output elements make column gradients infinite. The offset and mask
    gradients then have the reference's pattern of NaN, inf and -inf (per-corner sums would turn
    inf * 0, at an input of exactly 0, into NaN where the reference's per-channel sum is
    finite), and its values elsewhere; with the data kernel's plan and without."""
    rng = np.random.default_rng(70 + ndim)
    arrays, params, gy = wide_case(rng, ndim, groups=1, offset_groups=2, mask_groups=4)
    # one sign for the weights and the input, so that an infinite grad_output element gives column
    # gradients of one sign and mask gradients of +-inf (NaN where every used corner is 0);
    # many corners exactly 0
    arrays["weight"] = np.abs(arrays["weight"])
    x = arrays["input"] = np.abs(arrays["input"])
    x[x < 0.15] = 0.0
    gy.reshape(-1)[rng.choice(gy.size, size=3, replace=False)] = [np.inf, -np.inf, np.inf]
    for precision in ("float32", "float16"):
        for gradient_plan in (False, True):
            got, expected, _ = run_gradients(arrays, params, gy, precision, wanted=("offset", "mask"),
                                             gradient_plan=gradient_plan)
            assert np.isinf(expected["mask"]).any() and np.isnan(expected["offset"]).any()
            for name in ("offset", "mask"):
                e, g = expected[name], got[name]
                for test in (np.isnan, np.isposinf, np.isneginf):
                    assert np.array_equal(test(g), test(e)), (name, precision, gradient_plan, test.__name__)
                finite = np.isfinite(e)
                assert relative_error(g[finite], e[finite]) < TOL[precision], (name, precision, gradient_plan)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32], ids=["float16", "bfloat16", "float32"])
def test_plans_choose_and_force_the_fused_backward(dtype, monkeypatch):
    """Forced (every gradient, the weight's through cuda/im2col), chosen automatically where
    measured faster (float32 at this size: cuda/direct, priority 30), and the transposed forward
    (the input gradient plus bias)."""
    cupy = _cupy()
    import dcn_cupy
    fb = _backward_module()
    dtype = np.dtype(dtype)
    precision = "float32" if dtype == np.float32 else dtype.name
    rng = np.random.default_rng(9)
    arrays, params, gy = wide_case(rng, 2, groups=1, offset_groups=2, mask_groups=1, batch=2)
    arrays["bias"] = rng.standard_normal(arrays["weight"].shape[0])
    dev = {k: cupy.asarray(a.astype(dtype)) for k, a in arrays.items()}
    rounded = {k: a.astype(dtype).astype(np.float64) for k, a in arrays.items()}
    gy_r = gy.astype(dtype)
    forced = dcn_cupy.plan(**dev, **params, algorithm="cuda/fused-backward", allow_tf32=False)
    assert "cuda/fused-backward" in str(forced)
    grads = forced.backward(cupy.asarray(gy_r), **dev)
    exact = reference.deform_conv_backward(gy_r.astype(np.float64), **rounded, **params)
    for i, name in enumerate(("input", "weight", "offset", "mask", "bias")):
        tol = 1e-4 if dtype == np.float32 and name == "weight" else TOL[precision]
        assert relative_error(cupy.asnumpy(getattr(grads, name)).astype(np.float64), exact[i]) < tol, name
    # the automatic choice follows the measurement
    monkeypatch.setattr(fb, "fused_versus_im2col", lambda *a: (1.0, 2.0, 2.0, 1.0))
    auto = dcn_cupy.plan(**dev, **params, allow_tf32=False)
    assert ("cuda/fused-backward" in str(auto)) == (dtype != np.float32)
    monkeypatch.setattr(fb, "fused_versus_im2col", lambda *a: (2.0, 1.0, 1.0, 2.0))
    assert "cuda/fused-backward" not in str(dcn_cupy.plan(**dev, **params, allow_tf32=False))
    # a transposed plan goes by the split use (the input gradient alone, then the others)
    x_t, w_t = cupy.asarray(gy_r), dev["weight"]
    transposed_auto = dcn_cupy.plan(x_t, w_t, dev["offset"], dev["mask"], None, **params, transposed=True,
                                    allow_tf32=False)
    assert ("cuda/fused-backward" in str(transposed_auto)) == (dtype != np.float32)
    monkeypatch.setattr(fb, "fused_versus_im2col", lambda *a: (1.0, 2.0, 2.0, 1.0))
    transposed_auto = dcn_cupy.plan(x_t, w_t, dev["offset"], dev["mask"], None, **params, transposed=True,
                                    allow_tf32=False)
    assert "cuda/fused-backward" not in str(transposed_auto)
    # the transposed forward: the input gradient of the convolution it is the adjoint of
    x_t = rng.standard_normal(gy.shape).astype(dtype)
    bias_t = rng.standard_normal(arrays["input"].shape[1]).astype(dtype)
    w, off, m = dev["weight"], dev["offset"], dev["mask"]
    transposed = dcn_cupy.plan(cupy.asarray(x_t), w, off, m, cupy.asarray(bias_t), **params, transposed=True,
                               algorithm="cuda/fused-backward", allow_tf32=False)
    assert "cuda/fused-backward" in str(transposed)
    y = transposed.forward(cupy.asarray(x_t), w, off, m, cupy.asarray(bias_t))
    expected = reference.deform_conv_transpose(x_t.astype(np.float64), rounded["weight"], rounded["offset"],
                                               rounded["mask"], bias_t.astype(np.float64), **params)
    assert y.shape == expected.shape
    assert relative_error(cupy.asnumpy(y).astype(np.float64), expected) < TOL[precision]
