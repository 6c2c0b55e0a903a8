"""CUDA algorithm "cuda/fused": the deformable convolution forward as one implicit GEMM on tensor cores.

No columns buffer: ``cuda/deform_fused.cu`` samples each (tap, chunk of input channels) of a
block's positions straight into shared memory and multiplies it there with the weight tile on
tensor cores (fp16/bf16 in their format, float32 as TF32 when TF32 is allowed, else 3xTF32;
float32 accumulation; in 3xTF32 each step's products (warp-specialised tiles) or each k8's
(mma.sync) are summed apart and added in float32 FMAs, keeping float32 accuracy at any
C_in * kernel size). Per call, and part of the timed forward:

* the input is copied channels-last, ``(Bc, *S, Cp)`` with ``Cp`` = C_in rounded up to one
  16-byte vector, one batch chunk at a time (chunks bound that workspace by
  ``WORKSPACE_LIMIT_BYTES``; a sample is never split), in 16-byte vectors where they are whole
  and aligned and the rule takes them (``copy_kernel``), else one element a thread;
* the weight is re-laid as ``(C_out, K, Cgp)`` (rows along the input channels of one tap,
  ``Cgp`` = C_in/groups rounded up to the step's channel chunk, zero-padded).

Serves ``conv_forward`` for float16, bfloat16 and float32 on CUDA (``FusedBackend.serves``);
the automatic choice considers it for the half types, and for float32 (TF32, or 3xTF32 where
TF32 is not allowed and a warp-specialised tile serves) on compute capability 9.0, and takes it
per configuration unless ``cuda/im2col``'s forward measured clearly faster (both timed once on
one batch chunk when the plan is built, as plans run them: ``fused_versus_im2col``; e.g. at
B=16 C512 14x14 fp16 im2col is faster). Below compute capability 9.0 float32 (mma.sync, tested)
measured slower than ``cuda/im2col`` and stays there unless forced, as does float64 everywhere.
The transposed convolution's backward-to-input is such a forward, so it runs here too. A plan's
calls on C-contiguous arrays replay the launches recorded for their addresses
(``FusedForward.run_pointers``).

Launch parameters per shape: a tile (output channels x positions x channels per step) and an
MMA engine, ``mma.sync`` (any GPU of compute capability 8.0 or more) or ``wgmma`` (sm_90a, the
MMA running asynchronously while the block samples the next step; fp16, bf16 and TF32), the
latter also with specialised warps (ENGINE 3: two warpgroups multiply, one in a 64-row tile,
while the others sample up to ``RING_STAGES`` steps ahead; with two, also in persistent blocks,
``PERSISTENT``, where a chunk's tiles outnumber the blocks the device holds at once). The
candidates of ``TILES`` no taller than C_out/groups are timed once per (device, geometry, dtype,
precision) when a forward is first planned, on random data of one batch chunk, and the fastest
is kept (``plan_config``); during a CUDA-graph capture, or with ``DCN_CUPY_FUSED_TUNE=0``, a
fixed rule picks (``_choose_tile``). The "uniform" sampler (16-byte corner loads, one corner
set per thread and step) runs whenever no thread's channel slice crosses a conv / offset /
mask group boundary, else the sampler that reads one channel at a time (exact for any channel
counts, slower). The uniform sampler either computes its position's corners itself or reads
them from a sampling plan made per batch chunk (``fused_sampling_plan``: rows and weights per
segment of channels, tap and position, in the workspace; its chunks keep it within the whole
batch's channels-last copy); the tuner times both with each tile.

The plain entry point is :func:`fused_conv_forward`; :class:`FusedBackend` wraps it in the
backend contract (``serves`` / ``build`` -> an executable with ``run(args, out, workspace)``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import numpy as np

import cupy

from .. import _limits
from .._interop import BFLOAT16
from . import cuda as _cuda

#: Upper bound, in bytes, of one batch chunk's workspace: here the channels-last copy (and
#: sampling plan) of a chunk, in cuda/fused-backward a chunk's copies, plans and accumulators (a
#: sample is never split). ``DCN_CUPY_FUSED_WORKSPACE_BYTES`` sets it (sizes like ``512M``).
#: Fewer chunks cost less: H200, f+b, 1D B=16 C256 L4096 (chunks of 6 samples at 128M, one
#: chunk at 512M), TF32 0.995 -> 0.918 ms, strict 1.966 -> 1.884, fp16 0.646 -> 0.619; B=8 C256
#: 56x56 strict 2.145 -> 2.105, fp16 level; for 113 -> 286 MB (TF32) of workspace
#: (NOTES-gpu.md, session 51). The default keeps the memory: peak extra memory is a target too.
WORKSPACE_LIMIT_BYTES = _limits.size_from_env("DCN_CUPY_FUSED_WORKSPACE_BYTES", 128 * 2**20)


def settings() -> tuple:
    """The module settings an executable is built with (part of the functional API's plan key)."""
    return (WORKSPACE_LIMIT_BYTES,)


_SOURCE = "deform_fused.cu"
_THREADS = 256   # threads per block of the small kernels, and of a tile that names no other count
_LAYOUT_TILE = 64   # positions of a fused_channels_last tile, one channel sum each
#: Per storage dtype: channels per 16-byte vector (fused::Tile<T>::VEC, also the row padding).
_VEC = {np.dtype(np.float16): 8, BFLOAT16: 8, np.dtype(np.float32): 4}
DTYPES = tuple(_VEC)
#: The tiles (BM output channels, BN positions, BK channels per step, MINB blocks per SM asked
#: of the register allocator, ENGINE: 0 mma.sync, 1 wgmma, 3 warp-specialised wgmma[, THREADS
#: per block: 256 when not given; 512 for mma.sync's 256x64x64, 384 to 768 for ENGINE 3's])
#: instantiated per dtype, kept from those measured (NOTES-gpu.md); one is chosen per shape
#: (plan_config). The first of each
#: engine (the smallest) also has the per-channel sampler and the 64-bit indices. wgmma tiles
#: (sm_90a) need a compute capability 9.0 device and compute fp16, bf16 and TF32, and ENGINE 3's
#: 3xTF32 too (``tile_computes``).
#: ENGINE 2 (the corner pipeline: cp.async corner copies several steps ahead) is not listed:
#: slower than ENGINE 0 wherever measured; ``benchmarks/stages.py --tiles`` still times it.
#: The half tiles with MINB 2 (128 registers, two 256-thread blocks per SM; no spills in 1-d and
#: 2-d, ``benchmarks/fused_regs.py``) were 34-35% faster than 64x64x64 MINB 1 at B=32 C64 56x56
#: and second only to 256x64x64 MINB 1 at C256 / C512 (NOTES-gpu.md, fused3). 256x64x64 in
#: blocks of 512 threads (127 registers: 16 warps per SM where 256 threads give 8) was 2-4%
#: faster than with 256 threads at C256 and C512 (fused4).
#: ENGINE 3 (sm_90a, like 1) specialises the warps: 256 threads multiply with wgmma while the
#: other THREADS - 256 sample into a ring of ``RING_STAGES`` shared-memory stages, each stage's
#: weight tile one bulk copy of ``fused_weight_tiles``'s layout; its threads' vectors interleave
#: over a step's chunk, so it serves only where each chunk lies in one offset and mask group, and
#: has no per-channel sampler. H200, kernel alone, fp16: 0.141 ms against 0.234 for the 512-thread
#: mma.sync tile at B=8 C256 56x56, 0.081 against 0.141 at B=16 C512 14x14 (NOTES-gpu.md, session 11).
#: Where it reads the warps' corner batches in 128-byte chunk rows, each 8-lane phase of a
#: sampling warp samples one position's whole row into a tile in wgmma's 128-byte swizzle
#: (``row_phases``): kernel 4-7% faster in the half types, 22-25% in TF32 at B=8 C256 56x56 and
#: B=16 C512 14x14 (H200; NOTES-gpu.md, session 35).
#: Its 48-position tiles (wgmma n48) fill the card where 64-position blocks leave it a partial
#: wave: B=16 C512 14x14 gives 98 blocks of 256x64 for 132 SMs, 132 of 256x48. H200, whole
#: forward with the warps' corner batches there: TF32 141 -> 126 us and fp16 72.7 -> 65.8 with 384
#: samplers (640 threads), 3xTF32 311 -> 304 with 192 (448 threads; its 16-channel chunks leave
#: 384 samplers no whole vector); 11-20% slower at B=8 C256 56x56, where the tuner keeps 256x64
#: (NOTES-gpu.md, session 38).
#: Its 768-thread 256x64 tiles have 512 samplers, given 72 registers each so that the MMA
#: warpgroups hold their accumulators unspilled (``WIDE_SAMPLERS``; 1D and 2D only). H200, the
#: tuner's whole forward at B=8 C256 56x56 with / without them: fp16 119.9 / 125.0 us, TF32 215.7
#: / 224.7; not picked at the other benchmark shapes (NOTES-gpu.md, session 39). No 3xTF32: three
#: of its stages do not fit.
#: Its 64-row tiles have one MMA warpgroup (``tile_mma_threads``), for C_out/groups <= 64, where a
#: 128-row tile left half its rows idle: H200, B=32 C64 56x56 whole forward, TF32 64x64x32 (2
#: blocks per SM) 0.214 ms against 128x128x32's 0.288, 3xTF32 0.328 against 0.414; fp16
#: 64x64x64 level with mma.sync's 64x64x64 (NOTES-gpu.md, session 14).
#: Its float 64x64x32 tile also at one block per SM: in 3D 138-162 registers and no spill, where
#: the two-block form's 80 spill 508-856 bytes (ptxas, sm_90a). H200, B=2 C32 32^3 TF32, kernel
#: with the warps' corner batches 0.262 ms against 0.515 at two blocks and 0.347 for mma.sync's
#: 64x64x32, the tuner's choice until then (NOTES-gpu.md, session 56).
#: Its float 128x48x32 tile (two MMA warpgroups, 384 samplers, one block per SM) fills the card
#: where C_out/groups is 128 and 64-row tiles would sample each position twice in a partial second
#: wave: the 2D transposed backward's input gradient, B=8 C128 56x56 -> 28x28, gives 131 blocks of
#: it against 196 of 64x64x32 at two per SM. H200, f+b, the tuner's choice without it / with it at
#: 448 threads (192 samplers) / at 640: B=8 C128 28x28 s2 transposed strict 0.3138 / 0.2886 /
#: 0.2839 ms, TF32 0.2141 / 0.1980 / 0.1931; not taken at the other benchmark shapes
#: (NOTES-gpu.md, session 57).
TILES = {
    "half": ((64, 64, 64, 1, 0), (256, 64, 64, 1, 0), (128, 128, 64, 1, 0),
             (128, 64, 64, 1, 1), (256, 128, 32, 1, 1), (128, 128, 64, 1, 1),
             (64, 128, 32, 2, 0), (64, 64, 64, 2, 0), (128, 64, 64, 2, 0), (256, 64, 64, 1, 0, 512),
             (256, 64, 64, 1, 3, 512), (128, 128, 64, 1, 3, 512), (64, 64, 64, 2, 3, 384),
             (64, 128, 32, 1, 3, 384), (256, 48, 64, 1, 3, 640), (256, 64, 64, 1, 3, 768)),
    "float": ((64, 64, 32, 1, 0), (256, 64, 32, 1, 0), (128, 128, 16, 1, 0),
              (128, 64, 32, 1, 1), (256, 128, 16, 1, 1), (128, 128, 32, 1, 1),
              (256, 64, 32, 1, 3, 512), (256, 64, 16, 1, 3, 512), (128, 128, 32, 1, 3, 512),
              (64, 64, 32, 2, 3, 384), (256, 48, 32, 1, 3, 640), (256, 48, 16, 1, 3, 448),
              (256, 64, 32, 1, 3, 768), (64, 64, 32, 1, 3, 384), (128, 48, 32, 1, 3, 640)),
}
#: The engines that multiply with wgmma (sm_90a modules; fp16, bf16 and TF32; ENGINE 3 3xTF32 too).
WGMMA_ENGINES = (1, 3)
#: The most stages of an ENGINE 3 ring (two named barriers a stage); fewer where they do not fit
#: ``PIPELINE_SMEM_BYTES`` (3xTF32 stages hold big and small parts: twice as long).
RING_STAGES = 4
_INT32_SAFE = 2**30
_MAX_GRID = 1 << 20
_ALIGN = 256
#: The forward may read its corners from a sampling plan (``fused_sampling_plan``: the rows and
#: weights of every segment, tap and position of a batch chunk, 8 bytes per corner) where its
#: 16-byte sampler serves (engines 0, 1 and 3) and the channels form at most this many segments of
#: one offset and mask group; its chunks are then small enough that the plan is no larger than the
#: whole batch's channels-last copy. The tuner times each tile with and without it (H200: 3-6%
#: faster with it at B=8 C256 56x56 fp16; at B=32 C64 13% faster in one chunk, but 23% slower in
#: fp16's three bounded chunks and 8% faster in fp32's two; 7-13% slower at 512@14x14 and 3D C32,
#: where each thread computes its corners once per 8 channel chunks or the extra registers spill;
#: NOTES-gpu.md, sessions 6 and 16); untuned, each sampling thread computes the corners of its
#: position.
MAX_PLAN_SEGMENTS = 8
#: None: as above; True / False: the plan forced on (where it can serve) / off (tests, benchmarks).
SAMPLING_PLAN = None
#: ENGINE 3 in persistent blocks (kernels of their own, PERSIST): a grid of as many blocks as the
#: device holds at once, each computing tiles blockIdx.x, blockIdx.x + gridDim.x, ... through one
#: ring, so that its samplers fill the next tile's stages while its MMA warps finish a tile and
#: store it (a wave's fill, drain and epilogue were 13% of B=8 C256 56x56 fp16's forward,
#: NOTES-gpu.md session 39). Only tiles that ``tile_persists``, with 32-bit indices. H200, whole
#: forward, one tile a block / persistent: fp16 B=8 C256 56x56 120.3 / 114.4 us, 1D B=16 C256
#: L4096 145.4 / 126.0, never slower in two runs (the 512-thread tile level at C256); TF32 mixed:
#: 1D 239.1 / 232.0 but B=8 C256 56x56 (768 threads) 215.9 / 221.7, and the 512-thread tile's
#: times varying 10-15% between runs (session 40). So the half types take them wherever a chunk's
#: tiles outnumber the blocks the device holds at once (``persists_by_rule``, tuned or not), and
#: the tuner times TF32 with and without them there. None: so; True / False: forced (tests,
#: benchmarks).
PERSISTENT = None
#: None: a persistent grid of the blocks the device holds at once; a number: at most that many
#: blocks (tests and sanitizers: several tiles a block at small shapes).
PERSISTENT_BLOCKS = None
#: The float ENGINE 3 tiles that also have a 1D and 2D kernel whose samplers keep two steps of
#: corner loads in flight where they read their warps' corner batches (``loads_ahead``, PLAN 3;
#: one tile a block, no row phases). The tuner times them beside the rest. H200 (NOTES-gpu.md,
#: session 58), whole forward, one step / two: B=16 C512 14x14 3xTF32 256x48x16 0.3057 / 0.2894
#: ms; f+b with the tuner's choice, without / with them: B=16 C512 14x14 strict 0.9346 / 0.9148,
#: 1D B=16 C256 L4096 strict 1.7078 / 1.6893, TF32 and the other shapes level. Not listed: TF32's
#: 256x48x32 (0.1783 / 0.1752 at 14x14, its row phases lost), the 3D kernels (32-356 bytes of
#: spill; B=2 C32 32^3 3xTF32 64x64x32 0.4184 / 0.5953) and the MINB 2 64x64x32 (B=32 C64 16%
#: slower in 3xTF32, 72% in TF32).
LOADS_AHEAD_TILES = ((256, 48, 16, 1, 3, 448), (256, 64, 16, 1, 3, 512), (64, 64, 32, 1, 3, 384))
#: True: the tuner times the LOADS_AHEAD_TILES with two steps of loads in flight too; False: never
#: (the A/B; part of the tuner's key).
LOADS_AHEAD = True
#: ENGINE 3's MMAs in 3xTF32 with the operands' roles swapped where they serve
#: (``position_rows_serve``): the sampled tile's 64 positions the wgmma's M and each MMA
#: warpgroup's 128 weight rows its N, one m64n128 a k step for two m64n64 (fewer shared-memory
#: bytes a product, as the weight gradient's ``WS_CHANNEL_ROWS``). The same products in the same
#: order. H200, strict float32 f+b, two m64n64 -> m64n128 (NOTES-gpu.md, session 64): B=8 C256
#: 56x56 1.7026 -> 1.6724 ms, 1D B=16 C256 L4096 1.5700 -> 1.5502, B=16 C512 14x14 and B=32 C64
#: level (their tuner takes other tiles). TF32 and fp16 kept the other order: level, 1D TF32
#: 1.012x. False: two m64n64 (``DCN_FUSED_POSITION_ROWS 0``, the A/B; ENGINE 3's modules of their
#: own; part of the tuner's key).
POSITION_ROWS = True


def module_source(engine: int = 3) -> str:
    """The module text: ``deform_fused.cu`` with its local headers inlined (#line directives); for
    ENGINE 3's module (``engine``), with ``POSITION_ROWS``'s value, the only engine it reaches."""
    text = _cuda.module_text(_SOURCE)
    return "#define DCN_FUSED_POSITION_ROWS 0\n" + text if engine == 3 and not POSITION_ROWS else text


def position_rows_serve(tile: tuple, precision: int) -> bool:
    """Whether ``POSITION_ROWS`` reaches a tile's kernel in ``precision`` (deform_fused.cu's rule):
    ENGINE 3 in 3xTF32 (2), 64 positions, two MMA warpgroups of 128 rows, and launch registers for
    an m64n128's accumulators (``holds_m64n128``: 96 a thread, so at most 682 threads a
    multiprocessor)."""
    return (tile[4] == 3 and precision == 2 and tile[0] == 256 and tile[1] == 64
            and 65536 // (tile[3] * tile_threads(tile)) >= 96)


def _precisions(dtype) -> tuple:
    """PREC values instantiated for a dtype: 0 = the half type's own MMA; 1 TF32; 2 3xTF32."""
    return (1, 2) if np.dtype(dtype) == np.float32 else (0,)


def tile_threads(tile) -> int:
    """Threads per block of a tile's forward kernel."""
    return tile[5] if len(tile) > 5 else _THREADS


def tile_mma_threads(tile) -> int:
    """ENGINE 3's threads that only multiply (the kernel's MMA_THREADS): two warpgroups, one for a
    64-row tile; 0 for the other engines, whose threads all sample."""
    return 0 if tile[4] != 3 else (128 if tile[0] == 64 else 256)


def tile_samplers(tile) -> int:
    """Threads per block that sample (all, but for ENGINE 3's MMA threads)."""
    return tile_threads(tile) - tile_mma_threads(tile)


def tile_persists(tile, precision: int) -> bool:
    """Whether a tile's kernel may run in persistent blocks (the kernel's PERSISTENT): ENGINE 3
    with two MMA warpgroups, not in 3xTF32 (the others lack the registers for the tile loop)."""
    return tile[4] == 3 and tile_mma_threads(tile) == 256 and precision != 2


def is_wgmma(tile) -> bool:
    """Whether a tile multiplies with wgmma (sm_90a)."""
    return tile[4] in WGMMA_ENGINES


def precision_of(dtype, allow_tf32: bool) -> int:
    """The kernels' PREC: 0 the half type's own MMA; float32 1 (TF32) where allowed, else 2 (3xTF32)."""
    return 0 if np.dtype(dtype) != np.float32 else (1 if allow_tf32 else 2)


def tile_computes(tile, precision: int) -> bool:
    """Whether a tile multiplies in ``precision`` (0 half, 1 TF32, 2 3xTF32): every engine but
    ENGINE 1 (wgmma, not warp-specialised) in 3xTF32."""
    return not (tile[4] == 1 and precision == 2)


#: ENGINE 3's samplers per block from which the kernel gives them 72 registers
#: (``DCN_FUSED_WIDE_SAMPLER_REGS``) and the MMA warpgroups the rest: enough for 1D and 2D
#: corners, while 3D's spill (ptxas: 100-360 bytes a thread), so these tiles have no 3D kernels.
WIDE_SAMPLERS = 512


def tile_builds(dtype, ndim: int, tile, precision: int) -> bool:
    """Whether a tile has a kernel in ``precision`` and N = ``ndim``: it computes that precision,
    its ring fits shared memory (3xTF32 stages are twice as long), and (ENGINE 3's wide tiles) its
    samplers' corners fit their registers."""
    return (tile_computes(tile, precision) and pipeline_depth(dtype, ndim, tile, precision) > 0
            and not (ndim == 3 and tile_samplers(tile) >= WIDE_SAMPLERS))


def _tiles(dtype, index64: bool = False) -> tuple:
    """The tiles of a dtype; with 64-bit indices (huge problems) only the first of engines 0, 1 and 3."""
    tiles = TILES["float" if np.dtype(dtype) == np.float32 else "half"]
    if index64:
        tiles = tuple(tile for i, tile in enumerate(tiles)
                      if tile[4] != 2 and all(t[4] != tile[4] for t in tiles[:i]))
    return tiles


#: Shared memory an ENGINE 2 (corner pipeline) kernel may take; its ring depth is the largest
#: (at most MAX_DEPTH) that fits. Hopper allows 227 KiB per block.
PIPELINE_SMEM_BYTES = 220 * 1024
#: Shared memory of a Hopper multiprocessor, and what each block on it reserves besides its own
#: (the system's 1 KiB, and a margin for the kernel's static mbarriers): a ring of a tile asking
#: MINB blocks per multiprocessor fits (SM_SMEM_BYTES / MINB - BLOCK_SMEM_RESERVE).
SM_SMEM_BYTES = 228 * 1024
BLOCK_SMEM_RESERVE = 2 * 1024
MAX_DEPTH = 4


def warp_corner_bytes(ndim: int, tile: tuple, index64: bool) -> int:
    """Shared memory of the sampling warps' corner batches (PLAN 2): per sampling warp two
    batches of 32 corner sets (a lane's), 2^N corners each, a row offset (4 or 8 bytes) and a
    float32 weight a corner."""
    return tile_samplers(tile) // 32 * 2 * 32 * (1 << ndim) * ((8 if index64 else 4) + 4)


#: Bytes a row-phase kernel may move its dynamic shared memory up by, to the 1024-byte boundary
#: where wgmma's 128-byte swizzle starts over (``row_phases``).
SWIZZLE_ALIGN = 1024


def loads_ahead_serves(dtype, ndim: int, tile: tuple) -> bool:
    """Whether ``tile`` has an N-d kernel with two steps of corner loads in flight (PLAN 3:
    ``LOADS_AHEAD_TILES``, float32, 1D and 2D)."""
    return np.dtype(dtype) == np.float32 and ndim < 3 and tuple(tile) in LOADS_AHEAD_TILES


def row_phases(dtype, tile: tuple, precision: int, warp_corners: bool, loads_ahead: bool = False) -> bool:
    """Whether a forward kernel samples by row phases (cuda/deform_fused.cu, ROW_PHASES): ENGINE 3
    with the sampling warps' corner batches, chunk rows of 128 bytes (BK of 64 half-type or 32
    float32 channels) and not 3xTF32. Each 8-lane phase of a sampling warp then loads one
    position's chunk row, into a sampled tile in wgmma's 128-byte swizzle; its dynamic shared
    memory starts at the next 1024-byte boundary (``SWIZZLE_ALIGN`` more bytes). Not with two
    steps of loads in flight (``loads_ahead``)."""
    return (tile[4] == 3 and bool(warp_corners) and tile[2] * np.dtype(dtype).itemsize == 128
            and precision != 2 and not loads_ahead)


def smem_bytes(dtype, ndim: int, tile: tuple, depth: int = 0, precision: int = 0, table: int = 0) -> int:
    """Dynamic shared memory of a tile (engine 2: with a ring of ``depth`` corner stages; engine 3: its
    ring of ``depth`` stages of weight and sampled tiles, big and small parts of each in 3xTF32),
    plus ``table`` bytes of the sampling warps' corner batches (engines 0 and 3)."""
    bm, bn, bk, _, engine = tile[:5]
    item, vec = np.dtype(dtype).itemsize, _VEC[np.dtype(dtype)]
    if engine == 3:
        return depth * (2 if precision == 2 else 1) * (bm + bn) * bk * item + table
    if engine != 2:
        return 2 * (bm + bn) * (bk + (vec if engine == 0 else 0)) * item + table
    return ((depth + 1) * bm + 2 * bn) * (bk + vec) * item + depth * (1 << ndim) * (bn * bk * item + _THREADS * 4)


def pipeline_depth(dtype, ndim: int, tile: tuple, precision: int = 0) -> int:
    """The ring depth (the DEPTH template argument) of an engine 2 tile (corner stages, at most
    MAX_DEPTH) or an engine 3 tile (3 to RING_STAGES: with 2 its samplers and MMA warps would wait
    on each other): the most stages that fit PIPELINE_SMEM_BYTES, and MINB blocks a multiprocessor
    (0: too few fit); 1 for the other engines."""
    if tile[4] not in (2, 3):
        return 1
    least, most = (3, RING_STAGES) if tile[4] == 3 else (1, MAX_DEPTH)
    budget = min(PIPELINE_SMEM_BYTES, SM_SMEM_BYTES // tile[3] - BLOCK_SMEM_RESERVE)
    return max((d for d in range(least, most + 1)
                if smem_bytes(dtype, ndim, tile, d, precision) <= budget), default=0)


def kernel_name(dtype, index64: bool, ndim: int, prec: int, tile: tuple, uniform: bool, plan: int = 0,
                persist: bool = False) -> str:
    """The forward kernel's name expression; ``plan`` its PLAN: 0 each sampling thread computes its
    corners, 1 from the sampling plan in global memory, 2 from its warp's corner batches;
    ``persist`` its PERSIST (persistent blocks, where ``tile_persists``)."""
    t = _cuda._CTYPES[np.dtype(dtype)]
    i = "long long" if index64 else "int"
    bm, bn, bk, minb, engine = tile[:5]
    threads = tile_threads(tile)
    depth = pipeline_depth(dtype, ndim, tile, prec)
    if persist:
        rest = f", {depth}, {threads}, {int(plan)}, true"
    elif plan:
        rest = f", {depth}, {threads}, {int(plan)}"
    else:
        rest = f", {depth}" if engine in (2, 3) else (", 1" if threads != _THREADS else "")
        rest += f", {threads}" if threads != _THREADS else ""
    return (f"deform_fused_forward<{t}, {i}, {ndim}, {prec}, {bm}, {bn}, {bk}, {minb}, "
            f"{'true' if uniform else 'false'}, {engine}{rest}>")


def name_expressions(dtype, ndim: int, index64: bool, engine: int = 0) -> tuple:
    """Every kernel instantiation of one module (one dtype, one N, one index width, one engine:
    0 mma.sync, built for the device's architecture; 1 and 3 wgmma, built for sm_90a); the 16-byte
    sampler of engines 0, 1 and 3 with and without the sampling plan; ENGINE 3's in persistent
    blocks too where ``tile_persists`` (32-bit indices), and with two steps of loads in flight
    (PLAN 3) where ``loads_ahead_serves``."""
    t = _cuda._CTYPES[np.dtype(dtype)]
    i = "long long" if index64 else "int"
    names = [kernel_name(dtype, index64, ndim, prec, tile, uniform, plan, persist)
             for prec in _precisions(dtype) for tile in _tiles(dtype, index64) for uniform in (True, False)
             for plan in (0, 1, 2, 3) for persist in (False, True)
             if tile[4] == engine and tile_builds(dtype, ndim, tile, prec)
             and (uniform or tile == _per_channel_tile(dtype, engine))
             and not (plan and (not uniform or engine == 2)) and not (plan == 2 and engine not in (0, 3))
             and not (plan == 3 and (persist or not loads_ahead_serves(dtype, ndim, tile)))
             and not (persist and (index64 or not uniform or not tile_persists(tile, prec)))]
    names += [f"fused_channels_last<{t}, {i}>", f"fused_channels_last_vectors<{t}, {i}>",
              f"fused_weight_rows<{t}, {i}>", f"fused_weight_tiles<{t}, {i}>",
              f"fused_sampling_plan<{t}, {i}, {ndim}>", f"fused_channel_totals<{t}, {i}>"]
    names += [f"fused_columns<{t}, {i}, {ndim}, {vectors}, {lanes}>" for vectors, lanes in COLUMN_SHAPES]
    return tuple(names)


def all_module_keys():
    """(dtype, ndim, index64, engine) of every module this algorithm can build."""
    return [(dtype, ndim, index64, engine) for dtype in DTYPES for ndim in (1, 2, 3) for index64 in (False, True)
            for engine in (0, 1, 2, 3) if any(tile[4] == engine for tile in _tiles(dtype, index64))]


#: NVRTC options of the wgmma modules (CuPy's RawModule names the device's plain architecture).
SM90A = "-arch=sm_90a"


def kernel_cache_folder() -> str:
    """CuPy's kernel cache (``CUPY_CACHE_DIR``, or its default), where the sm_90a modules are
    cached beside CuPy's own."""
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


class _Sm90aModule:
    """Kernels compiled by NVRTC for sm_90a and loaded as a CUDA module (cached on disk next to
    CuPy's kernel cache, keyed by the source, options, names and NVRTC version): of
    ``deform_fused.cu``, or of the module text ``source`` named ``filename``."""

    def __init__(self, names, source=None, filename=_SOURCE):
        import hashlib
        import json
        from cupy_backends.cuda.libs import nvrtc
        options = tuple(_cuda.compile_options()) + (SM90A,)
        source = module_source() if source is None else source
        key = hashlib.sha256(repr((source, options, tuple(names), nvrtc.getVersion())).encode()).hexdigest()[:32]
        folder = kernel_cache_folder()
        path = os.path.join(folder, f"dcn_fused_sm90a_{key}")
        try:
            with open(path + ".cubin", "rb") as fh:
                cubin = fh.read()
            with open(path + ".json") as fh:
                lowered = json.load(fh)
        except OSError:
            program = nvrtc.createProgram(source, filename, (), ())
            try:
                for name in names:
                    nvrtc.addNameExpression(program, name)
                try:
                    nvrtc.compileProgram(program, options)
                except nvrtc.NVRTCError:
                    raise RuntimeError(f"NVRTC failed on cuda/{filename} (sm_90a):\n"
                                       + nvrtc.getProgramLog(program)) from None
                lowered = {name: nvrtc.getLoweredName(program, name) for name in names}
                cubin = nvrtc.getCUBIN(program)
            finally:
                nvrtc.destroyProgram(program)
            try:
                os.makedirs(folder, exist_ok=True)
                with open(path + ".json", "w") as fh:
                    json.dump(lowered, fh)
                with open(path + ".cubin", "wb") as fh:
                    fh.write(cubin)
            except OSError:
                pass
        self.module = cupy.cuda.function.Module()
        self.module.load(cubin)
        self.lowered = lowered

    def get_function(self, name):
        return self.module.get_function(self.lowered[name])


_modules = {}
_functions = {}


def _function(name: str, dtype, ndim: int, index64: bool, engine: int = 0, names: tuple = None):
    """The kernel ``name`` on the current device, from the module of ``names`` (default: the
    whole module of its dtype, N, index width and engine), compiled once per device."""
    device = cupy.cuda.runtime.getDevice()
    switches = (POSITION_ROWS,) if engine == 3 else ()   # (module_source's, for ENGINE 3's modules)
    fn = _functions.get((device, name, switches))
    if fn is None:
        names = names or name_expressions(dtype, ndim, index64, engine)
        if name not in names:       # a tile outside TILES (benchmarks): a module of its own
            names = (name,)
        mkey = (device, names, switches)
        module = _modules.get(mkey)
        if module is None:
            if engine in WGMMA_ENGINES:
                module = _Sm90aModule(names, module_source(engine))
            else:
                module = cupy.RawModule(code=module_source(engine), options=_cuda.compile_options(),
                                        name_expressions=names)
            _modules[mkey] = module
        fn = _functions[(device, name, switches)] = module.get_function(name)
    return fn


#: The layout changes between channels-first and channels-last move 16-byte vectors (the
#: ``_vectors`` kernels) where they serve (``whole_vectors``), the channels fill at least one
#: 64-channel tile and a sample has at least this many positions (``vectors_pay``); else one
#: element a thread. H200, ``fused_channels_last`` alone, elements / vectors us (NOTES-gpu.md,
#: session 41): B=8 C256 56x56 fp16 10.2 / 9.3, float32 17.9 / 14.6; B=16 C256 L4096 fp16 36.4 /
#: 23.3, float32 45.1 / 35.3; but B=16 C512 14x14 float32 with the bias sums 6.9 / 7.5, B=2 C32
#: 32^3 float32 7.1 / 7.8.
VECTOR_COPY_POSITIONS = 1024


def whole_vectors(dtype, extents, addresses) -> bool:
    """Whether 16-byte vectors of ``dtype`` tile each of ``extents`` (elements) and every
    non-zero address of ``addresses`` is 16-byte aligned."""
    vec = _VEC[np.dtype(dtype)]
    return all(int(e) % vec == 0 for e in extents) and all(int(a) % 16 == 0 for a in addresses)


def vectors_pay(positions: int, channels: int) -> bool:
    """The rule of the vector layout kernels (``VECTOR_COPY_POSITIONS``)."""
    return channels >= _LAYOUT_TILE and positions >= VECTOR_COPY_POSITIONS


def copy_kernel(dtype, positions: int, channels: int, sample_stride: int, addresses, tf32: bool = False,
                split: bool = False) -> str:
    """The channels-last copy's kernel for one launch over ``positions`` a sample and
    ``channels`` (padded) channels of ``dtype``: ``fused_channels_last_vectors`` where every
    16-byte vector of a channel's positions is whole and aligned (``positions``, ``channels`` and
    ``sample_stride``, in elements, multiples of a vector; ``addresses``, those of the source and
    the destinations, 16-byte aligned) and the rule takes it (``vectors_pay``), else
    ``fused_channels_last``; with ``tf32`` (float32), its ``_tf32`` form, which rounds the copy
    to TF32; with ``split`` (float32), its ``_split`` form, which writes rows of 2 * ``channels``:
    the values' 3xTF32 big parts, then their small parts (the rule then weighs the row's length)."""
    whole = whole_vectors(dtype, (positions, channels, sample_stride), addresses)
    pays = vectors_pay(positions, 2 * channels if split else channels)
    name = "fused_channels_last_vectors" if whole and pays else "fused_channels_last"
    return name + "_tf32" if tf32 else name + "_split" if split else name


def layout_grid(samples: int, channels: int, positions: int) -> tuple:
    """The grid of fused_channels_last / fused_channels_first over ``samples`` x ``channels`` x
    ``positions``: one block of _THREADS threads per 64 x 64 tile, grid-stride beyond _MAX_GRID."""
    return (min(samples * -(-channels // 64) * -(-positions // 64), _MAX_GRID),)


#: fused_columns' (vectors of channels per thread, threads per position), its (VPT, LANES): those
#: ``cuda._column_shape`` takes at the default ``cuda.COLUMN_MIN_LANES``, one instantiation each
#: (other values compile theirs when used).
COLUMN_SHAPES = ((4, 8), (4, 4), (4, 2), (2, 4), (2, 2), (1, 2), (1, 8))


def column_kernels(dtype, ndim: int, index64: bool, vectors: int, lanes: int) -> tuple:
    """``(fused_channels_last, fused_columns)`` of one dtype, N, index width, vectors per thread
    and threads per position: cuda/im2col's channels-last sampler (``cuda._Executable``), from a
    module of these two kernels alone, so that cuda/im2col does not compile the fused forward's
    tiles for them."""
    t = _cuda._CTYPES[np.dtype(dtype)]
    i = "long long" if index64 else "int"
    names = (f"fused_channels_last<{t}, {i}>", f"fused_columns<{t}, {i}, {ndim}, {vectors}, {lanes}>")
    return tuple(_function(name, dtype, ndim, index64, names=names) for name in names)


def _allow_shared_memory(fn, nbytes: int) -> None:
    """Let ``fn`` (a RawModule kernel or a raw Module function) use ``nbytes`` of dynamic shared memory."""
    if hasattr(fn, "max_dynamic_shared_size_bytes"):
        if fn.max_dynamic_shared_size_bytes < nbytes:
            fn.max_dynamic_shared_size_bytes = nbytes
    else:
        from cupy_backends.cuda.api import driver
        driver.funcSetAttribute(fn.ptr, 8, nbytes)   # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def num_registers(fn) -> int:
    if hasattr(fn, "num_regs"):
        return fn.num_regs
    from cupy_backends.cuda.api import driver
    return driver.funcGetAttribute(4, fn.ptr)        # CU_FUNC_ATTRIBUTE_NUM_REGS


def wgmma_available() -> bool:
    """Whether the current device runs sm_90a code (compute capability 9.0)."""
    return cupy.cuda.Device().compute_capability == "90"


def _multiprocessors() -> int:
    return int(cupy.cuda.Device().attributes["MultiProcessorCount"])


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _segment(geom) -> int:
    """The largest channel run that never crosses a conv, offset or mask group boundary."""
    C = geom.in_channels
    segment = C // geom.groups
    if geom.has_offset:
        segment = math.gcd(segment, C // geom.offset_groups)
    if geom.has_mask:
        segment = math.gcd(segment, C // geom.mask_groups)
    return segment


def plan_segments(geom) -> tuple:
    """(channels per segment, segments) of a sampling plan: runs of input channels that share
    their offset and mask group (gcd of C/G_o and C/G_m; C_in where neither is given), each with
    its own corners per (tap, position)."""
    C = geom.in_channels
    seg_len = math.gcd(C // geom.offset_groups if geom.has_offset else C,
                       C // geom.mask_groups if geom.has_mask else C)
    return seg_len, C // seg_len


def _warp_corners_serve(geom, tile) -> bool:
    """Whether the sampling warps' corner batches (PLAN 2) can serve: engines 0 and 3, one offset
    and one mask group (a position's corners depend on the tap alone), and a power-of-two count of
    sampling threads a position that divides a warp."""
    tpp = tile_samplers(tile) // tile[1]
    return tile[4] in (0, 3) and plan_segments(geom)[1] == 1 and 1 <= tpp <= 32 and 32 % tpp == 0


def _uniform(geom, tile) -> bool:
    """Whether ``tile``'s threads each sample a channel slice within one segment (16-byte vectors);
    ENGINE 3 interleaves its threads' vectors over the step's chunk: the whole chunk."""
    if tile[4] == 3:
        return _segment(geom) % tile[2] == 0
    return _segment(geom) % (tile[2] * tile[1] // tile_samplers(tile)) == 0


def tile_serves(geom, dtype, tile) -> bool:
    """Whether ``tile`` can compute ``geom``: its 16-byte sampler serves it, or it is its engine's
    per-channel tile."""
    return _uniform(geom, tile) or tuple(tile) == _per_channel_tile(dtype, tile[4])


def _per_channel_tile(dtype, engine: int) -> tuple:
    """The one tile per engine instantiated with the per-channel sampler (and 64-bit indices):
    the first of TILES (engines 2 and 3, whose threads' vectors are 16-byte only, have none:
    engine 0's)."""
    return next(tile for tile in _tiles(dtype) if tile[4] == (0 if engine in (2, 3) else engine))


def _serving(geom, dtype, wgmma: bool, index64: bool, precision: int) -> list:
    """The tiles of TILES that can compute a shape here: wgmma ones only where the device allows,
    those built in the precision, and of the tiles whose threads would cross a group boundary
    only the per-channel one of each engine. In 3xTF32, only ENGINE 3's where one serves:
    mma.sync's 3xTF32 measured 2.4x slower than them, and slower than cuda/im2col (H200, whole
    forward: B=8 C256 56x56 1.38 ms against 0.57 and im2col's 0.92; B=16 C512 14x14 0.90 against
    0.36 and 0.45; NOTES-gpu.md, session 15)."""
    tiles = [tile for tile in _tiles(dtype, index64) if (not is_wgmma(tile) or wgmma)
             and tile_builds(dtype, geom.ndim, tile, precision) and tile_serves(geom, dtype, tile)]
    if precision == 2:
        tiles = [tile for tile in tiles if tile[4] == 3] or tiles
    return tiles


def _candidates(geom, dtype, wgmma: bool, index64: bool = False, precision: int = 0) -> list:
    """The tiles worth trying for a shape: those of ``_serving`` no taller than C_out/groups
    rounded up to 64 (else the shortest)."""
    Cog = geom.out_channels // geom.groups
    tiles = _serving(geom, dtype, wgmma, index64, precision)
    limit = max(64, _round_up(Cog, 64))
    fitting = [tile for tile in tiles if tile[0] <= limit]
    return fitting or [min(tiles)]


def persists_by_rule(config, multiprocessors: int) -> bool:
    """The untuned choice of persistent blocks (``PERSISTENT``): where they may, in the half types."""
    return config.can_persist and config.fills_more_than_once(multiprocessors) and config.precision == 0


def _choose_tile(geom, dtype, positions: int, multiprocessors: int, wgmma: bool, index64: bool = False,
                 precision: int = 0) -> tuple:
    """The tile of a shape without timing: among the candidates, wgmma ones first where allowed
    (the warp-specialised ones first of all, unless shorter than C_out/groups and 128 rows: each
    of a shorter tile's blocks samples its positions again), then the tallest and widest, the
    first that gives at least two blocks per multiprocessor; else the one with the most blocks."""
    groups = geom.groups
    Cog = geom.out_channels // groups
    preferred = lambda tile: tile[4] == 3 and tile[0] >= min(Cog, 128)  # noqa: E731
    candidates = sorted(_candidates(geom, dtype, wgmma, index64, precision),
                        key=lambda tile: (-preferred(tile), -(tile[4] == 1), -tile[4], -tile[0], -tile[1]))
    blocks = lambda tile: -(-positions // tile[1]) * -(-Cog // tile[0]) * groups  # noqa: E731
    for tile in candidates:
        if blocks(tile) >= 2 * multiprocessors:
            return tile
    return max(candidates, key=blocks)


class LaunchConfig:
    """What one forward of one geometry and dtype launches (chosen once per plan).

    ``tile``: (BM output channels, BN positions, BK channels per step, MINB, ENGINE[, THREADS]);
    ``uniform``: the 16-byte-vector sampler; ``precision``: 0 (fp16/bf16), 1 (TF32) or
    2 (3xTF32); ``chunk``: samples per channels-last copy; ``index64``: 64-bit indices.
    ``wgmma``: whether the device runs the sm_90a kernels (None: ask the current device).
    ``sampling_plan``: the corners from the chunk's sampling plan (None: the rule,
    ``SAMPLING_PLAN``); ``warp_corners``: from the sampling warps' corner batches (``PLAN`` 2),
    where asked and they serve (engines 0 and 3, one offset and one mask group, no sampling plan);
    ``loads_ahead``: with them, two steps of corner loads in flight a sampler (``PLAN`` 3), where
    asked and the tile has that kernel (``loads_ahead_serves``; one tile a block).
    ``persistent``: ENGINE 3 in persistent blocks (None: the rule, ``PERSISTENT``).
    """

    def __init__(self, geom, dtype, allow_tf32: bool, multiprocessors: int = 132, tile=None, wgmma=False,
                 taps_inner: bool = False, sampling_plan=None, warp_corners: bool = False, persistent=None,
                 loads_ahead: bool = False):
        dtype = np.dtype(dtype)
        if dtype not in _VEC:
            raise ValueError(f"cuda/fused serves float16, bfloat16 and float32, got {dtype}")
        self.geom, self.dtype = geom, dtype
        self.itemsize = dtype.itemsize
        C, Co, G = geom.in_channels, geom.out_channels, geom.groups
        self.Cg, self.Cog = C // G, Co // G
        self.K, self.Q, self.S = geom.kernel_volume, geom.output_size, geom.input_size
        vec = _VEC[dtype]
        self.precision = precision_of(dtype, allow_tf32)
        self.Cp = _round_up(C, vec)
        self.seg_len, self.segments = plan_segments(geom)
        if sampling_plan is None:
            sampling_plan = SAMPLING_PLAN
        # the plan's entries per position (its corners for every segment and tap), where it may be
        # used: the 16-byte sampler (decided below with the tile) and at most MAX_PLAN_SEGMENTS
        corners = 1 << geom.ndim
        wanted = bool(sampling_plan) and self.segments <= MAX_PLAN_SEGMENTS
        plan_entries = self.segments * self.K * corners if wanted else 0
        copy_bytes, plan_bytes = self.S * self.Cp * self.itemsize, self.Q * plan_entries * 8   # a sample's
        self.chunk = max(1, min(geom.batch, int(WORKSPACE_LIMIT_BYTES) // max(copy_bytes + plan_bytes, 1)))
        if plan_bytes:
            # the plan no larger than the whole batch's channels-last copy (or one sample's plan;
            # B=32 C64 56x56: the plan is 2.25x a sample's fp16 copy, which took the forward past
            # a quarter of torchvision's memory), in chunks of balanced sizes
            self.chunk = min(self.chunk, max(1, geom.batch * copy_bytes // plan_bytes))
            self.chunk = -(-geom.batch // -(-geom.batch // self.chunk))
        # 64-bit indices where any extent can pass 2^30 (bounds for every tile: BN <= 128,
        # BM >= 64, Cgp <= C/G + 63); those kernels exist for the first tile of each engine only
        n = self.chunk
        self.index64 = max(
            n * self.S * self.Cp, n * Co * self.Q + 128 * Co,
            n * max(geom.offset_groups, 1) * self.K * geom.ndim * self.Q, n * max(geom.mask_groups, 1) * self.K * self.Q,
            Co * self.K * (self.Cg + 63), C * self.S * n, (n * self.Q + 128) * -(-self.Cog // 64) * G,
            n * self.Q * plan_entries,
        ) > _INT32_SAFE
        if tile is None:
            tile = _choose_tile(geom, dtype, n * self.Q, multiprocessors, bool(wgmma), self.index64, self.precision)
        if self.index64 and tuple(tile) not in _tiles(dtype, True):
            tile = _per_channel_tile(dtype, tile[4])
        self.tile = tuple(tile)
        bm, bn, bk, _, engine = self.tile[:5]
        self.threads = tile_threads(self.tile)
        if not tile_computes(self.tile, self.precision):
            raise ValueError(f"tile {self.tile} (ENGINE 1, wgmma) computes in TF32 or the half types, not 3xTF32")
        self.Cgp = _round_up(self.Cg, bk)
        self.taps_inner = bool(taps_inner)    # measured slower for every tile at 56x56 (NOTES-gpu.md)
        self.struct = _cuda._geom_struct(geom)
        self.uniform = _uniform(geom, self.tile)
        if not tile_serves(geom, dtype, self.tile):
            raise ValueError(f"tile {self.tile} has no per-channel sampler; this geometry needs one "
                             f"(the per-channel tile is {_per_channel_tile(dtype, engine)})")
        self.sampling_plan = wanted and self.uniform and engine != 2
        # the sampling warps' corner batches instead, where asked and they serve
        self.warp_corners = bool(warp_corners) and not self.sampling_plan and self.uniform and \
            _warp_corners_serve(geom, self.tile)
        self.loads_ahead = bool(loads_ahead) and self.warp_corners and loads_ahead_serves(dtype, geom.ndim, self.tile)
        self.plan_elems = n * self.Q * plan_entries if self.sampling_plan else 0
        self.m_tiles = -(-self.Cog // bm)
        self.steps = self.K * -(-self.Cg // bk)   # a tile's (tap, channel chunk) steps
        if persistent is None:
            persistent = persists_by_rule(self, multiprocessors) if PERSISTENT is None else PERSISTENT
        self.persistent = self.can_persist and bool(persistent)
        self._resident = None   # blocks the device holds at once (persistent grids; at the first launch)
        self.depth = pipeline_depth(dtype, geom.ndim, self.tile, self.precision)
        if not self.depth:
            raise ValueError(f"tile {self.tile} does not fit shared memory for {geom.ndim}-d sampling")
        if not tile_builds(dtype, geom.ndim, self.tile, self.precision):
            raise ValueError(f"tile {self.tile} has no {geom.ndim}-d kernel: its {tile_samplers(self.tile)} samplers "
                             f"(WIDE_SAMPLERS = {WIDE_SAMPLERS} or more) get too few registers for "
                             f"{geom.ndim}-d corners")
        table = warp_corner_bytes(geom.ndim, self.tile, self.index64) if self.warp_corners else 0
        self.row_phases = row_phases(dtype, self.tile, self.precision, self.warp_corners, self.loads_ahead)
        self.smem_bytes = (smem_bytes(dtype, geom.ndim, self.tile, self.depth, self.precision, table)
                           + (SWIZZLE_ALIGN if self.row_phases else 0))
        # the weights' re-layout: ENGINE 3 whole tiles of BM rows (one bulk copy each; in 3xTF32
        # each tile's big parts, then its small parts); else rows
        self.weight_kernel = "fused_weight_tiles" if engine == 3 else "fused_weight_rows"
        parts = 2 if engine == 3 and self.precision == 2 else 1
        self.weight_elems = (G * self.m_tiles * bm * parts if engine == 3 else Co) * self.K * self.Cgp
        self.xcl_elems = (n * self.S + 1) * self.Cp   # the chunk's rows, then the zero row
        # the channels-last chunk, the weight rows, then the plan's rows and weights
        self.plan_offset = (_round_up(self.xcl_elems * self.itemsize, _ALIGN)
                            + _round_up(self.weight_elems * self.itemsize, _ALIGN))
        self.plan_row_bytes = 8 if self.index64 else 4
        self.workspace_bytes = (self.plan_offset + _round_up(self.plan_elems * self.plan_row_bytes, _ALIGN)
                                + self.plan_elems * 4) if self.sampling_plan else \
            _round_up(self.xcl_elems * self.itemsize, _ALIGN) + self.weight_elems * self.itemsize
        # where asked (forward_launches' input_sums: a transposed convolution's bias gradient),
        # the copy also sums x per channel: a float32 sum per 64-position tile and channel after
        # the workspace, then a running sum between chunks
        self.sum_rows = -(-self.S // _LAYOUT_TILE)       # per sample
        self.sums_offset = _round_up(self.workspace_bytes, _ALIGN)
        self.sums_acc_offset = self.sums_offset + _round_up(n * self.sum_rows * C * 4, _ALIGN)
        self.summing_workspace_bytes = self.sums_acc_offset + (C * 4 if n < geom.batch else 0)

    @property
    def description(self) -> str:
        prec = {0: str(self.dtype), 1: "tf32", 2: "3xtf32"}[self.precision]
        bm, bn, bk, minb, engine = self.tile[:5]
        engine_name = ("mma.sync", "wgmma", f"mma.sync, {self.depth}-step corner pipeline",
                       f"warp-specialised wgmma, {self.depth}-stage ring")[engine]
        # (blocks per SM: TILES holds tiles that differ in it alone)
        return (f"cuda/fused: {prec} {engine_name}, tile {bm}x{bn}x{bk} ({self.threads} threads, "
                f"{minb} block{'s' if minb > 1 else ''} per SM), "
                f"{'16-byte vector' if self.uniform else 'per-channel'} sampling"
                f"{' from a sampling plan' if self.sampling_plan else ''}"
                f"{', corners a batch of taps ahead per warp' if self.warp_corners else ''}"
                f"{', two steps of corner loads in flight' if self.loads_ahead else ''}"
                f"{' (by row phases, into a swizzled tile)' if self.row_phases else ''}"
                f"{', persistent blocks' if self.persistent else ''}, "
                f"taps {'inner' if self.taps_inner else 'outer'}, "
                f"chunks of {self.chunk} samples, {'64' if self.index64 else '32'}-bit index")

    @property
    def can_persist(self) -> bool:
        """Whether this launch has a kernel in persistent blocks (``tile_persists``, 32-bit indices)."""
        return (tile_persists(self.tile, self.precision) and not self.index64 and self.uniform
                and not self.loads_ahead)

    def fills_more_than_once(self, multiprocessors: int) -> bool:
        """Whether a chunk has more tiles than ``multiprocessors`` hold at once (tile[3] blocks
        each): where a persistent grid differs from one block a tile."""
        return self.blocks(self.chunk) > multiprocessors * self.tile[3]

    def blocks(self, n: int) -> int:
        """Output tiles of the fused kernel for a chunk of n samples (one block each unless persistent)."""
        return -(-n * self.Q // self.tile[1]) * self.m_tiles * self.geom.groups

    def grid(self, n: int, function) -> int:
        """Blocks of the fused kernel (``function``) for a chunk of n samples: one a tile, or
        (persistent) as many as the device holds at once, where that is fewer and a block's
        steps stay within the kernel's 32-bit step count."""
        tiles = self.blocks(n)
        if not self.persistent:
            return tiles
        cap = PERSISTENT_BLOCKS
        if cap is None:
            if self._resident is None:
                from cupy.cuda import driver
                function = function.kernel if hasattr(function, "kernel") else function   # (a RawKernel's)
                per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, self.threads, self.smem_bytes)
                self._resident = per_sm * _multiprocessors()
            cap = self._resident
        grid = min(tiles, cap)
        if grid < 1 or -(-tiles // grid) * self.steps >= 2**31:
            return tiles
        return grid

    def kernel(self, name: str):
        g = self.geom
        i = "long long" if self.index64 else "int"
        if name == "forward":
            expr = kernel_name(self.dtype, self.index64, g.ndim, self.precision, self.tile, self.uniform,
                               3 if self.loads_ahead else 2 if self.warp_corners else int(self.sampling_plan),
                               self.persistent)
            fn = _function(expr, self.dtype, g.ndim, self.index64, self.tile[4])
            # static shared memory (ENGINE 3's mbarriers) counts towards the 48 KiB allowed
            # without the attribute: it is set for any dynamic size
            if self.smem_bytes > 0:
                _allow_shared_memory(fn, self.smem_bytes)
            return fn
        n = f", {g.ndim}" if name == "fused_sampling_plan" else ""
        return _function(f"{name}<{_cuda._CTYPES[self.dtype]}, {i}{n}>", self.dtype, g.ndim, self.index64)


def _batch_stride(array) -> int:
    """Elements between samples (0 for a broadcast batch)."""
    return 0 if array.shape[0] <= 1 else array.strides[0] // array.itemsize


def _workspace_offsets(config: LaunchConfig) -> tuple:
    """Byte offsets in the workspace of the channels-last buffer, the weight rows and the
    sampling plan's rows and weights (the last two None without a plan)."""
    wr_at = _round_up(config.xcl_elems * config.itemsize, _ALIGN)
    if not config.sampling_plan:
        return 0, wr_at, None, None
    rows_at = config.plan_offset
    return 0, wr_at, rows_at, rows_at + _round_up(config.plan_elems * config.plan_row_bytes, _ALIGN)


def _checked_workspace(config: LaunchConfig, workspace, need=None):
    """``workspace`` (or one allocated), checked to hold ``need`` bytes (``config.workspace_bytes``
    by default)."""
    need = config.workspace_bytes if need is None else need
    if workspace is None:
        workspace = cupy.empty(need, dtype=np.uint8)
    nbytes = workspace.size * workspace.itemsize
    if nbytes < need:
        raise ValueError(f"workspace must hold at least {need} bytes, got {nbytes}")
    return workspace


def _views(config: LaunchConfig, workspace):
    """The channels-last buffer, the weight rows and the sampling plan's rows and weights (None
    without a plan), carved from ``workspace`` (or allocated)."""
    base = _checked_workspace(config, workspace).data
    xcl_at, wr_at, rows_at, weights_at = _workspace_offsets(config)
    xcl = cupy.ndarray((config.xcl_elems,), dtype=config.dtype, memptr=base + xcl_at)
    wr = cupy.ndarray((config.weight_elems,), dtype=config.dtype, memptr=base + wr_at)
    if not config.sampling_plan:
        return xcl, wr, None, None
    rows = cupy.ndarray((config.plan_elems,), dtype=np.int64 if config.index64 else np.int32, memptr=base + rows_at)
    weights = cupy.ndarray((config.plan_elems,), dtype=np.float32, memptr=base + weights_at)
    return xcl, wr, rows, weights


def _relayout_launch(config: LaunchConfig, weight: int, wr: int, overlap: bool = False):
    """The weights' re-layout into the forward kernel's order (recorded, ``cuda._kernel_op``):
    ENGINE 3's whole tiles (one thread per 16-byte vector of channels and tap), else rows of
    ``Cgp`` channels per (output channel, tap). ``overlap``: it may run beside the kernel before
    it (programmatic dependent launch; it waits for that kernel before it exits, so that its
    completion implies that kernel's)."""
    g, i32 = config.geom, np.int32
    kernel = config.kernel(config.weight_kernel)
    if config.weight_kernel == "fused_weight_tiles":
        bm, _, bk = config.tile[:3]
        # one thread per vector of channels (both parts in 3xTF32) and tap
        threads = g.groups * config.m_tiles * bm * config.Cgp // _VEC[np.dtype(config.dtype)] * config.K
        return _cuda._kernel_op(kernel, (min(-(-threads // _THREADS), _MAX_GRID),), (_THREADS,), (
            _cuda._u64(weight), _cuda._u64(wr), i32(config.Cog), i32(g.groups), i32(config.Cg), i32(config.K),
            i32(bm), i32(bk), i32(config.precision)), overlap=overlap)
    rows = g.out_channels * config.Cgp
    return _cuda._kernel_op(kernel, (min(-(-rows // _THREADS), _MAX_GRID),), (_THREADS,), (
        _cuda._u64(weight), _cuda._u64(wr), i32(g.out_channels), i32(config.Cg), i32(config.Cgp), i32(config.K),
        i32(config.precision == 1)), overlap=overlap)


def channel_totals_op(op, kernel, channels: int, sums: int, acc: int, dst: int, rows, start: int, n: int,
                      batch: int):
    """The launch (through ``op``) of ``fused_channel_totals`` after the chunk of ``n`` samples
    from ``start``: it adds that chunk's ``rows`` tile sums a channel into ``acc``, and at the
    last chunk writes the totals to ``dst`` (the forward's input sums, the backward's bias
    gradient)."""
    return op(kernel, (channels,), (_THREADS,), (_cuda._u64(sums), _cuda._u64(acc), _cuda._u64(dst), rows,
                                                 np.int32(start == 0), np.int32(start + n >= batch)))


def forward_launches(config: LaunchConfig, inputs, strides, out: int, workspace: int, input_sums: int = 0) -> list:
    """The launches of one forward, recorded (``cuda._kernel_op``) for ``cuda._replay``:
    ``inputs`` the addresses of (x, w, offset, mask, bias) (0 for an absent one), ``strides`` the
    sample strides in elements of (x, offset, mask) (0 for a broadcast batch), ``out`` the
    address of a C-contiguous output, ``workspace`` of ``config.workspace_bytes``. Per batch
    chunk: the channels-last copy (the first chunk's followed by the weights' re-layout, which
    runs beside it), the sampling plan where the config has one, the kernel. ``input_sums``: the
    address of a contiguous ``(C_in,)`` array that gets x summed over all but the channel axis
    (a transposed convolution's bias gradient), from the copy's tile sums added in a fixed order
    (``fused_channel_totals`` after each chunk's copy; ``workspace`` then of
    ``config.summing_workspace_bytes``). Every launch but the first and the sampling plans' is a
    programmatic dependent launch (``cuda.PDL``): it starts
    while the kernel before it finishes, and waits for it where it needs its output (the kernel's
    preamble runs before). The sampling plan launched so measured 3-4% slower (H200, B=8 C256
    56x56 and 1D TF32 whole forward; NOTES-gpu.md, session 29), and the kernel after it gained
    as much as after the copy."""
    g = config.geom
    x, w, offset, mask, bias = inputs
    x_bs, off_bs, msk_bs = strides
    it, i32, u64, at = config.itemsize, np.int32, _cuda._u64, _cuda._at
    index = np.int64 if config.index64 else np.int32
    xcl, wr, rows, weights = (None if o is None else workspace + o for o in _workspace_offsets(config))
    ops = []

    def op(function, grid, block, args, shared_mem=0, overlap=True):
        return _cuda._kernel_op(function, grid, block, args, shared_mem,
                                overlap=overlap and _cuda._follows_kernel(ops))

    layout = config.kernel(copy_kernel(config.dtype, config.S, config.Cp, x_bs, (x, xcl)))
    forward = config.kernel("forward")
    struct = config.struct
    for start in range(0, g.batch, config.chunk):
        n = min(config.chunk, g.batch - start)
        sums = workspace + config.sums_offset if input_sums else None
        ops.append(op(layout, layout_grid(n, config.Cp, config.S), (_THREADS,), (
            u64(x + start * x_bs * it), u64(xcl), i32(n), i32(g.in_channels), i32(config.Cp), index(config.S),
            index(x_bs), None if sums is None else u64(sums), None, index(0), i32(0))))
        if input_sums:
            ops.append(channel_totals_op(op, config.kernel("fused_channel_totals"), g.in_channels, sums,
                                         workspace + config.sums_acc_offset, input_sums, index(n * config.sum_rows),
                                         start, n, g.batch))
        if start == 0:
            ops.append(_relayout_launch(config, w, wr, overlap=_cuda._follows_kernel(ops)))
        offset_n, mask_n = at(offset, start * off_bs * it), at(mask, start * msk_bs * it)
        if config.sampling_plan:
            entries = n * config.Q * config.K * config.segments
            ops.append(op(config.kernel("fused_sampling_plan"), (min(-(-entries // _THREADS), _MAX_GRID),),
                          (_THREADS,), (offset_n, mask_n, u64(rows), u64(weights), struct, i32(n),
                                        i32(g.in_channels), i32(max(g.offset_groups, 1)),
                                        i32(max(g.mask_groups, 1)), i32(config.seg_len), i32(config.segments),
                                        index(off_bs), index(msk_bs)), overlap=False))
        ops.append(op(forward, (config.grid(n, forward),), (config.threads,), (
            u64(xcl), u64(wr), offset_n, mask_n, at(bias, 0), u64(out + start * g.out_channels * config.Q * it),
            struct, i32(n), i32(g.in_channels), i32(config.Cp), i32(g.out_channels), i32(g.groups),
            i32(max(g.offset_groups, 1)), i32(max(g.mask_groups, 1)), i32(config.Cgp), index(off_bs),
            index(msk_bs), i32(config.taps_inner), None if rows is None else u64(rows),
            None if weights is None else u64(weights), i32(config.seg_len)), config.smem_bytes))
    return ops


def _address(array) -> int:
    return 0 if array is None else array.data.ptr


def run_forward(config: LaunchConfig, x, weight, offset, mask, bias, out, workspace=None, input_sums=None) -> None:
    """``out`` (C-contiguous) ``= deform_conv(x) (+ bias)`` with the kernels of ``config``, on the
    current stream; x, offset and mask contiguous within each sample, any batch stride;
    ``input_sums`` (contiguous, or None) as ``forward_launches``' (the workspace then of
    ``config.summing_workspace_bytes``)."""
    workspace = _checked_workspace(config, workspace, None if input_sums is None else config.summing_workspace_bytes)
    strides = tuple(0 if a is None else _batch_stride(a) for a in (x, offset, mask))
    ops = forward_launches(config, tuple(_address(a) for a in (x, weight, offset, mask, bias)), strides,
                           out.data.ptr, workspace.data.ptr, _address(input_sums))
    _cuda._replay(ops, None, cupy.cuda.get_current_stream().ptr)


#: Time the candidate tiles once per (device, geometry, dtype, precision) when a forward is first
#: planned (never during a CUDA-graph capture), and keep the fastest; "0" uses _choose_tile.
TUNE = os.environ.get("DCN_CUPY_FUSED_TUNE", "1") != "0"
_tuned = {}


def _capturing() -> bool:
    try:
        return bool(cupy.cuda.runtime.streamIsCapturing(cupy.cuda.get_current_stream().ptr))
    except Exception:
        return True


@contextlib.contextmanager
def private_pool():
    """CuPy allocations go to a private memory pool, emptied on leaving: the measurements made
    while building a plan leave nothing in CuPy's pool (or the caller's allocator). Arrays made
    inside must be gone by then: keep them in a function called inside."""
    pool = cupy.cuda.MemoryPool()
    try:
        with cupy.cuda.using_allocator(pool.malloc):
            yield
    finally:
        pool.free_all_blocks()


def _best_times(runs: list, rounds: int = 2, repeats: int = 2) -> list:
    """The best time (ms) of each callable: every one run once first (module load, the GPU's
    clocks up), then ``rounds`` passes over all of them, so that none is favoured by running
    later."""
    for run in runs:
        run()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    best = [math.inf] * len(runs)
    for _ in range(rounds):
        for i, run in enumerate(runs):
            for _ in range(repeats):
                start.record()
                run()
                stop.record()
                stop.synchronize()
                best[i] = min(best[i], cupy.cuda.get_elapsed_time(start, stop))
    return best


def _time_configs(configs: list, args: tuple, out, rounds: int = 2, repeats: int = 2) -> list:
    """The best time (ms) of each launch configuration's forward (:func:`_best_times`), run as
    plans run it (recorded launches)."""
    workspaces = [cupy.empty(config.workspace_bytes, dtype=np.uint8) for config in configs]
    named = dict(zip(("input", "weight", "offset", "mask", "bias"), args))
    return _best_times([functools.partial(FusedForward(config).run, named, out, ws)
                        for config, ws in zip(configs, workspaces)], rounds, repeats)


def _random_arguments(g, dtype):
    """(x, weight, offset, mask, bias=None) of geometry ``g`` on random data, and an output."""
    rng = cupy.random.default_rng(0)
    rand = lambda shape, scale=1.0: (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)  # noqa: E731
    args = (rand(g.x_shape), rand(g.weight_shape, 1.0 / math.sqrt(g.in_channels_per_group * g.kernel_volume)),
            rand(g.offset_shape) if g.has_offset else None,
            rng.random(g.mask_shape, dtype=np.float32).astype(dtype) if g.has_mask else None, None)
    return args, cupy.empty(g.y_shape, dtype=dtype)


#: (device, geometry, dtype, precision) -> (fused ms, im2col ms), measured once per key.
_versus = {}
#: The automatic choice takes cuda/im2col's forward only where it measured faster than this
#: fraction of the fused forward's time: the fused one needs no columns buffer (at B=8 C256
#: 56x56 fp16 a peak of 33 MiB of forward memory against 167). Both are timed as plans run
#: them, recorded launches (until session 12 the fused one went through CuPy's launches, ~100 µs
#: of host time a call that the GPU waited for, and this was 0.6). H200, fp16, one process:
#: B=16 C512 14x14 im2col 0.071 ms against fused 0.107 (taken); B=8 C256 56x56 0.191 against
#: 0.172 (not taken).
IM2COL_MARGIN = 0.85


def fused_versus_im2col(geom, dtype, allow_tf32: bool):
    """``(fused ms, im2col ms)``: the whole forward of one batch chunk on random data, fused with
    its tuned launch configuration against ``cuda/im2col``'s executable, timed alike (each run
    once first, then the best of interleaved repeats); None when ``TUNE`` is off or a CUDA
    graph is being captured. Cached per device, geometry, dtype and precision."""
    dtype = np.dtype(dtype)
    config = plan_config(geom, dtype, allow_tf32)
    key = (cupy.cuda.runtime.getDevice(), geom, dtype.str, config.precision)
    found = _versus.get(key)
    if found is not None or not TUNE or _capturing():
        return found
    with private_pool():
        found = _versus[key] = _time_versus(geom.with_batch(config.chunk), dtype, allow_tf32, config)
    return found


def _time_versus(g, dtype, allow_tf32: bool, config) -> tuple:
    """(fused ms, im2col ms) of one batch chunk ``g`` (:func:`fused_versus_im2col`)."""
    args, out = _random_arguments(g, dtype)
    fused = LaunchConfig(g, dtype, allow_tf32, _multiprocessors(), tile=config.tile, taps_inner=config.taps_inner,
                         sampling_plan=config.sampling_plan, warp_corners=config.warp_corners,
                         persistent=config.persistent, loads_ahead=config.loads_ahead)
    fused_ws = cupy.empty(fused.workspace_bytes, dtype=np.uint8)
    im2col = _cuda._Forward(_cuda._spec(g, dtype, allow_tf32))
    im2col_ws = cupy.empty(im2col.workspace_bytes, dtype=np.uint8)
    named = dict(zip(("input", "weight", "offset", "mask", "bias"), args))
    fused_run = FusedForward(fused).run   # both as plans run them: recorded launches
    # 5 rounds of 2: the first rounds of a process ran fused up to 25% slow (H200, fused4)
    best = _best_times([lambda: fused_run(named, out, fused_ws), lambda: im2col.run(named, out, im2col_ws)],
                       rounds=5, repeats=2)
    cupy.cuda.get_current_stream().synchronize()
    return tuple(best)


def plan_config(geom, dtype, allow_tf32: bool) -> LaunchConfig:
    """The launch configuration of a forward: its tile and step order (taps inner or outer)
    chosen by timing the candidates once on random data of one batch chunk (cached per device,
    geometry, dtype and precision), or by ``_choose_tile`` (taps outer) when ``TUNE`` is off or
    a CUDA graph is being captured."""
    dtype = np.dtype(dtype)
    sms, wgmma = _multiprocessors(), wgmma_available()
    static = LaunchConfig(geom, dtype, allow_tf32, sms, wgmma=wgmma)
    key = (cupy.cuda.runtime.getDevice(), geom, dtype.str, static.precision, LOADS_AHEAD, POSITION_ROWS)
    choice = _tuned.get(key)
    if choice is None:
        if not TUNE or _capturing():
            return static
        with private_pool():
            choice = _tuned[key] = _fastest_choice(geom, dtype, allow_tf32, static, sms, wgmma)
    tile, taps_inner, sampling_plan, warp_corners, loads_ahead, persistent = choice
    return LaunchConfig(geom, dtype, allow_tf32, sms, tile=tile, taps_inner=taps_inner, sampling_plan=sampling_plan,
                        warp_corners=warp_corners, persistent=persistent, loads_ahead=loads_ahead)


def _fastest_choice(geom, dtype, allow_tf32: bool, static, sms: int, wgmma: bool) -> tuple:
    """(tile, taps_inner, sampling_plan, warp_corners, loads_ahead, persistent) of the candidate
    whose forward of one batch chunk is fastest: each tile with its threads' own corners, from the
    sampling plan where it can serve, and from its warps' corner batches where they serve, with
    two steps of loads in flight too where the tile has that kernel and LOADS_AHEAD is on (unless
    SAMPLING_PLAN forces the plan on or off; with the plan, that chunk may take several of the
    plan's smaller chunks); in TF32 each in one block a tile and, where it can and the chunk's
    tiles outnumber the blocks the device holds, in persistent blocks too; in the half types as
    the rule takes them (``persists_by_rule``; unless PERSISTENT forces them on or off)."""
    g = geom.with_batch(static.chunk)
    args, out = _random_arguments(g, dtype)
    orders = (True, False) if g.kernel_volume > 1 and g.in_channels_per_group > 32 else (True,)
    forced = SAMPLING_PLAN is not None   # forced on: wherever the tile can serve it (LaunchConfig)
    sources = (((bool(SAMPLING_PLAN), False, False),) if forced else
               ((False, False, False), (True, False, False), (False, True, False), (False, True, True)))
    choices = [(tile, taps_inner, plan, warp, ahead)
               for tile in _candidates(geom, dtype, wgmma, static.index64, static.precision)
               for taps_inner in orders for plan, warp, ahead in sources
               if (not plan or forced or (_uniform(geom, tile) and tile[4] != 2
                                          and plan_segments(geom)[1] <= MAX_PLAN_SEGMENTS))
               and (not warp or (_uniform(geom, tile) and _warp_corners_serve(geom, tile)))
               and (not ahead or (LOADS_AHEAD and loads_ahead_serves(dtype, geom.ndim, tile)))]
    configs, picks = [], []
    # persistent blocks: the rule in the half types (None), both timed in TF32 (PERSISTENT's numbers)
    persistence = (PERSISTENT,) if PERSISTENT is not None else (None,) if static.precision == 0 else (False, True)
    for tile, taps_inner, plan, warp, ahead in choices:
        for persistent in persistence:
            config = LaunchConfig(g, dtype, allow_tf32, sms, tile=tile, taps_inner=taps_inner, sampling_plan=plan,
                                  warp_corners=warp, persistent=persistent, loads_ahead=ahead)
            if persistent and PERSISTENT is None and not (config.persistent and config.fills_more_than_once(sms)):
                continue   # (the same grid as without)
            if ahead and not config.loads_ahead:
                continue   # (the warps' batches did not serve: the same kernel as without)
            configs.append(config)
            picks.append((tile, taps_inner, plan, warp, config.loads_ahead, config.persistent))
    # 3 rounds of 3 (a pick of one run of gpu.py was 1.5x the best candidate with 2 of 2)
    times = _time_configs(configs, args, out, rounds=3, repeats=3)
    cupy.cuda.get_current_stream().synchronize()
    return picks[times.index(min(times))]


def fused_conv_forward(x, weight, offset, mask, bias, geom, out, *, allow_tf32: bool, workspace=None) -> None:
    """Write the deformable convolution of ``x`` (+ ``bias``) into ``out`` with the fused kernel.

    Args:
        x (cupy.ndarray): input ``(B, C_in, *S)``, float16 / bfloat16 / float32, C-contiguous
            within each sample (any batch stride).
        weight (cupy.ndarray): ``(C_out, C_in/groups, *k)``, C-contiguous.
        offset (cupy.ndarray or None): ``(B, G_o*K*N, *Q)``.
        mask (cupy.ndarray or None): ``(B, G_m*K, *Q)``.
        bias (cupy.ndarray or None): ``(C_out,)``.
        geom (ConvGeometry): the convolution's geometry.
        out (cupy.ndarray): ``geom.y_shape``, same dtype, C-contiguous; overwritten.
        allow_tf32 (bool): float32 through TF32 (else 3xTF32, float32-accurate).
        workspace (cupy.ndarray, optional): at least ``LaunchConfig(...).workspace_bytes`` bytes.
    """
    if geom.batch == 0:
        return
    config = plan_config(geom, x.dtype, allow_tf32)
    run_forward(config, x, weight, offset, mask, bias, out, workspace)


# ---------------------------------------------------------------------------------------------
# The backend contract (dcn_cupy/_backends/__init__.py; PlanSpec and the registry are duck-typed)


class FusedForward:
    """The executable of one plan's forward. Calls on C-contiguous arrays replay launches
    recorded per set of addresses (``run_pointers``: ~5 µs of host time a launch against CuPy's
    argument processing of every launch)."""

    pointer_path = True

    def __init__(self, config: LaunchConfig):
        self.config = config
        self.workspace_bytes = config.workspace_bytes
        # the workspace where a call also sums its input per channel (``input_sums``): a
        # transposed convolution's plan takes its bias gradient so (Plan._folds_bias)
        self.summing_workspace_bytes = config.summing_workspace_bytes
        self.description = config.description
        self._recordings = _cuda.Recordings()
        g = config.geom
        offsets = max(g.offset_groups, 1) * config.K * g.ndim
        self._strides = (g.in_channels * config.S, offsets * config.Q, max(g.mask_groups, 1) * config.K * config.Q)

    def run(self, args: dict, out, workspace) -> None:
        """``args["input_sums"]`` (optional, contiguous ``(C_in,)``): x summed over all but the
        channel axis from the copy (a transposed convolution's bias gradient; the workspace then
        of ``summing_workspace_bytes``)."""
        if self.config.geom.batch == 0:
            return
        arrays = tuple(args.get(k) for k in ("input", "weight", "offset", "mask", "bias"))
        sums = args.get("input_sums")
        if _cuda.REPLAY and _cuda._plain_batch(*arrays, out):
            self.run_pointers(tuple(_address(a) for a in arrays), out.data.ptr, workspace.data.ptr,
                              cupy.cuda.get_current_stream().ptr, input_sums=_address(sums))
            return
        run_forward(self.config, *arrays, out, workspace, input_sums=sums)

    def run_pointers(self, inputs, out: int, workspace: int, stream: int, input_sums: int = 0) -> None:
        """``run`` on raw device addresses of C-contiguous batched arrays (inputs: x, w, offset,
        mask, bias; 0 for an absent one), on ``stream``: the launches recorded once per set of
        addresses, then replayed."""
        key = inputs + (out, workspace, input_sums)
        ops = self._recordings.get(key)
        if ops is None:
            ops = self._recordings.put(key, self.record(inputs, out, workspace, input_sums))
        _cuda._replay(ops, None, stream)

    def record(self, inputs, out: int, workspace: int, input_sums: int = 0) -> list:
        """``run_pointers``' launches, recorded and not run (``cuda._replay``'s ops): for a plan
        that replays them in one list with another executable's."""
        return forward_launches(self.config, inputs, self._strides, out, workspace, input_sums)

    def channels_last_input(self):
        """What a call leaves at the workspace's start: its whole input channels-last, as
        ``(channels padded, rows)`` (a zero row last), or None where the batch is cut into
        chunks (the workspace then holds the last chunk's)."""
        c = self.config
        if c.chunk < c.geom.batch:
            return None
        return c.Cp, c.geom.batch * c.S + 1


#: The dtypes the plan layer considers cuda/fused for on its own; float32 too on compute
#: capability 9.0, the warp-specialised wgmma tiles (H200, B=8 C256 56x56: TF32 kernel 0.26 ms
#: against cuda/im2col's whole TF32 forward 0.46, NOTES-gpu.md session 12; 3xTF32 whole forward
#: 0.54 against 0.91, session 13). On mma.sync, 3xTF32 (1.15 against 1.00 ms) and TF32 (0.61
#: against 0.47) measured slower and stay on cuda/im2col unless forced (``algorithm="cuda/fused"``).
PREFERRED_DTYPES = (np.dtype(np.float16), BFLOAT16)
SERVED_DTYPES = PREFERRED_DTYPES + (np.dtype(np.float32),)


def _compute_capability(device_id: int) -> int:
    return int(cupy.cuda.Device(device_id).compute_capability)


def _not_preferred(spec):
    """Why the automatic choice does not consider cuda/fused for ``spec`` (None: it does)."""
    dtype = np.dtype(spec.dtype)
    if dtype in PREFERRED_DTYPES:
        return None
    how = "TF32" if spec.allow_tf32 else "3xTF32 (strict float32)"
    try:
        capability = _compute_capability(spec.device_id)
    except Exception as error:  # no driver or no such device
        return f"no CUDA device {spec.device_id} to run the {how} wgmma tile on ({type(error).__name__})"
    if capability != 90:
        return (f"float32 through {how} measured slower than cuda/im2col below compute capability 9.0 (got "
                f"{capability / 10}; force algorithm='cuda/fused' to use it)")
    if not spec.allow_tf32 and LaunchConfig(spec.geom, dtype, False, wgmma=True).tile[4] != 3:
        return ("strict float32 runs fast only on the warp-specialised tiles, and none serves this configuration "
                "(its channel groups, or 64-bit sizes): mma.sync's 3xTF32 measured slower than cuda/im2col; force "
                "algorithm='cuda/fused' to use it")
    return None


class FusedBackend:
    """``cuda/fused``: computes the forward for float16, bfloat16 and float32 (TF32 or 3xTF32)
    on CUDA devices of compute capability 8.0 or more, and is chosen automatically for float16
    and bfloat16, and for float32 (TF32 or 3xTF32) on compute capability 9.0; float64 stays on
    ``cuda/im2col``."""

    device = "cuda"
    algorithm = "fused"
    priority = 20              # above cuda/im2col wherever it serves
    primitives = ("conv_forward",)

    def serves(self, spec, primitive: str):
        if primitive != "conv_forward":
            return f"cuda/fused computes only the forward (conv_forward), not {primitive}"
        if spec.device != "cuda":
            return f"cuda/fused runs on CUDA devices, not {spec.device}"
        dtype = np.dtype(spec.dtype)
        if dtype not in SERVED_DTYPES:
            return f"cuda/fused serves float16, bfloat16 and float32; {dtype} stays on cuda/im2col"
        try:
            capability = _compute_capability(spec.device_id)
        except Exception as error:  # no driver or no such device: nothing to run on
            return f"cuda/fused found no CUDA device {spec.device_id} ({type(error).__name__})"
        if capability < 80:
            return f"cuda/fused needs compute capability 8.0 or more (cp.async, bf16 mma.sync), got {capability / 10}"
        return None

    def recommends(self, spec, primitive: str):
        """None where the automatic choice should take cuda/fused; else why not. For the half
        types (and float32, TF32 or 3xTF32, on compute capability 9.0: ``_not_preferred``) the fused
        forward (its tuned tile) and cuda/im2col's are timed once on one batch chunk of the
        configuration (:func:`fused_versus_im2col`), and cuda/im2col is taken where it measured
        faster than ``IM2COL_MARGIN`` (0.85) times the fused forward's time; without a
        measurement (``DCN_CUPY_FUSED_TUNE=0``, or a CUDA-graph capture) the fused kernel is."""
        reason = _not_preferred(spec)
        if reason is not None:
            return reason
        try:
            with cupy.cuda.Device(spec.device_id):
                timed = fused_versus_im2col(spec.geom, spec.dtype, bool(spec.allow_tf32))
        except cupy.cuda.runtime.CUDARuntimeError:   # no usable device here: the rule (fused)
            timed = None
        if timed is not None and timed[1] < IM2COL_MARGIN * timed[0]:
            return (f"cuda/im2col measured faster for this configuration ({timed[1]:.3f} ms against "
                    f"{timed[0]:.3f} ms on one batch chunk, below {IM2COL_MARGIN} of it)")
        return None

    def build(self, spec, primitive: str) -> FusedForward:
        reason = self.serves(spec, primitive)
        if reason is not None:
            raise ValueError(reason)
        with cupy.cuda.Device(spec.device_id):
            config = plan_config(spec.geom, spec.dtype, bool(spec.allow_tf32))
            for name in (config.weight_kernel, "fused_channels_last", "fused_channels_last_vectors", "forward") + (
                    ("fused_sampling_plan",) if config.sampling_plan else ()):
                config.kernel(name)   # compile now, never during a CUDA-graph capture
        return FusedForward(config)


BACKEND = FusedBackend()

try:  # the registry arrives with the plan layer
    from . import register as _register
except ImportError:
    _register = None
if _register is not None:
    _register(BACKEND)
