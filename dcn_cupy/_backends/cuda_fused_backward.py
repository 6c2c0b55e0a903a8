"""CUDA algorithm ``cuda/fused-backward``: the gradients of a deformable convolution as implicit
GEMMs on tensor cores, with no columns or column-gradient buffer.

``cuda/deform_fused_backward.cu`` has three kernels (fp16/bf16 in their format, float32 as TF32
when TF32 is allowed, else 3xTF32; float32 accumulation, in 3xTF32 each k8's three products
summed apart and added in float32, so that strict float32 keeps float32 accuracy over any
reduction):

* ``deform_fused_backward_data``: per block a tile of the column gradients ``W^T . grad_output``
  for one tap (input channels x positions), consumed at once: the input gradient is scattered
  with 4-channel vector reductions into a channels-last float32 accumulator, and the offset and
  mask gradients are summed over each group's channels (per corner, then weighted by the
  corner's weight and slopes; added per group in shared memory or by shuffles, then one float32
  atomic per group, position and tap). In 3xTF32 its operands (the weight's and grad_output's
  channels-last rows) are split into big and small parts once, by their copies
  (``fused_channels_last_split``), not in every warp that reads them. Its 64-row tiles have a
  second main loop on wgmma (sm_90a, each warpgroup a half of the positions; ``WGMMA_DATA``),
  which the rule takes on such devices: same copies, staging and epilogue; in deterministic
  mode its products are added in the mma.sync loop's order, so that both loops give the same
  bits;
* ``deform_fused_backward_weight``: ``grad_output . sampled^T`` over the positions, the sampled
  tile built in shared memory by the fused forward's sampler; the positions are split over
  blocks and the splits' float32 partial sums added in a fixed order (bitwise repeatable), or,
  in the default mode, reduced into one float32 sum by global reductions (``REDUCED_SPLITS``:
  one copy of the weight gradient in the workspace, not one a split).
  Its tiles: ``WEIGHT_TILES``, per N and precision. Where a tile's channels lie in one group, a
  position's sampling threads are adjacent lanes reading interleaved 16-byte vectors of its
  corners (a warp's load touches 8 rows, not 32: the loads' L1 wavefronts bound the kernel), and
  the sampled tile's chunks are swizzled so that their transposed stores do not conflict.
  In 1D and 2D, and in 3D where several of its blocks sample each position (channel tiles), the
  corners come from a sampling plan computed once per batch chunk (``fused_sampling_plan``: rows
  and weights per segment of channels, tap and position) instead of from the offsets and mask by
  every sampling thread of every block;
* ``deform_fused_backward_weight_ws`` (sm_90a; fp16, bf16, TF32 and 3xTF32): the same GEMM, splits
  and partial sums (bitwise in fp16, bf16 and TF32, at equal splits) on the forward's
  warp-specialised design: two MMA warpgroups multiply with wgmma from a ring of shared-memory
  stages that 512 sampling threads fill (256 in 3xTF32), grad_output's tile by one bulk copy a
  stage from ``fused_position_segments``'s segment-major, swizzled (TF32: rounded; 3xTF32: split
  into big and small parts) copy, the sampled tile transposed by the samplers.
  Taken where it serves (:func:`ws_weight_unsupported`) and C_out/groups fills its 256 rows, or
  half of them in strict float32 and in 2D (``WS_MIN_ROWS``; measured faster there, slower at
  C_out 64); its tile then has 128 rows (one MMA warpgroup) where they hold C_out/groups
  (``WS_NARROW_ROWS``). Where its units (tile and split) outnumber the multiprocessors it runs in
  persistent blocks, one an SM, each unit's stages filled while the unit before is stored
  (``WS_PERSISTENT``).

Deterministic plans (``deterministic=True``) run the data kernel's ``DET`` instantiation: the input
gradient is added in 64-bit fixed point (``cuda/fixed_point.cuh``, the exponents from bounds
computed on the device: the weight's by cuda/im2col-deterministic's ``det_weight_bound``, the
samples' by ``fused_sample_bound``; non-finite values as sticky flags) into a channels-last
integer accumulator, which ``fused_channels_first[_vectors]<T, I, true>`` turns back into the
gradient's dtype and layout; the offset and mask gradients are stored as
one partial sum per segment of channels and added in a fixed order, and the weight gradient's
splits keep a partial sum each, summed in a fixed order: every gradient is bitwise the same from
run to run, whatever the order of the atomics.

In 2D and 3D, and in 1D for float32, the data kernel likewise reads each position's corners,
slopes and mask from a plan of its own (``fused_gradient_plan``) where that plan fits
(``SAMPLING_PLAN`` says when). Where both plans would be made, the weight kernel reads the data
kernel's instead (the same corners, the mask kept apart; ``BackwardConfig.plan_shared``), and no
sampling plan is made.

Per call, one batch chunk at a time (the chunk bounds the workspace by
``cuda_fused.WORKSPACE_LIMIT_BYTES``): grad_output copied channels-last, ``(Bc*Q, Cop)``, and as
rows over the positions, ``(C_out, Pp)``; the input channels-last, ``(Bc*S, Cp)``, when the
offset, mask or weight gradient is wanted (the corner values; for the warp-specialised weight
kernel, grad_output in segments of 128 bytes instead of rows); the weight re-laid channels-last
per conv group as ``(G, C_in/G, K, Cogp)`` (``fused_channels_last``; in strict float32 both
channels-last rows twice as long, split by their copies into the values' big and small parts,
``fused_channels_last_split``; in TF32 both rounded to TF32 by their copies,
``fused_channels_last_tf32``: once, where the data kernel would round every fragment it loads);
the accumulators cleared, the kernels run, the gradients written out in their dtype and layout
(the input gradient plus the C_in-long ``bias`` of the transposed forward,
``fused_channels_first``; float32 offset and mask gradients whose samples lie back to back are
the data kernel's accumulators themselves, with no copy). The layout changes move 16-byte
vectors where they are whole and aligned and the rule takes them (``cuda_fused.copy_kernel``,
:func:`channels_first_kernel`). The launches are recorded once per
set of addresses and replayed (``FusedBackward.run_pointers``, the plan's raw-address path), as
cuda/im2col's are.

Where the fused weight gradient cannot serve (:func:`weight_unsupported`) or measured slower,
``cuda/im2col``'s (columns and a cuBLAS GEMM) runs after the fused part, on the same
workspace: past the fused part's channels-last copy of x, which its columns' sampler reads
(``weight_through_im2col``) where that holds the whole batch. The transposed convolution's
forward is this backward's input gradient (duality), so it runs here too.

Served (``FusedBackwardBackend.serves``): float16, bfloat16 and float32 on CUDA devices of
compute capability 8.0 or more, ``deterministic`` or not, when every lane's
4 channels lie in one conv, offset and mask group (C_in/groups, C_in/offset_groups and
C_in/mask_groups multiples of 4) and, with several conv groups, C_out/groups is a multiple of
the 16-byte vector (8 half / 4 float32 channels). Chosen automatically where it measured faster
than cuda/im2col on one batch chunk (``fused_versus_im2col``). Elsewhere ``cuda/im2col``
computes the backward.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

import cupy

from . import cuda as _cuda
from . import cuda_deterministic as _deterministic
from . import cuda_fused as _fused

_SOURCE = "deform_fused_backward.cu"
_THREADS = 256
_VEC = _fused._VEC
#: The tiles (BM input channels, BN positions, BK output channels per step, MINB blocks per SM
#: asked of the register allocator), per dtype. The rule (``_choose_tile``) takes the first or the
#: second. 64x64 was the fastest or within 2% at B=8 C256 56x56, B=32 C64 56x56 and B=16 C512
#: 14x14 in every precision (H200, NOTES-gpu.md "fused backward"; 256x64x32 was 1.3-3.5x slower:
#: the scatter epilogue, not the MMA, takes the time, and taller tiles give fewer blocks).
#: 64x128 gives each warp two MMA rows (MT 2: every B fragment used twice) and reads the weight
#: tile once per 128 positions: ncu, B=8 C256 56x56 TF32, 358.8 M -> 275.9 M warp instructions at
#: 71% -> 61% of issue slots. It wins where the reduction is long (C_out/groups >= DATA_WIDE_MIN_ROWS)
#: and in 3D, and loses where it is short. H200, data gradients alone, 64x64 -> 64x128
#: (NOTES-gpu.md, session 44): B=8 C256 56x56 TF32 0.603 -> 0.555 ms, fp16 0.410 -> 0.389, strict
#: float32 1.098 -> 1.069; B=16 C512 14x14 TF32 0.253 -> 0.223, fp16 0.146 -> 0.138; 1D B=16 C256
#: L4096 TF32 0.579 -> 0.552, fp16 0.377 -> 0.368; 3D B=2 C32 32^3 (MINB 2) TF32 1.267 -> 1.088,
#: fp16 1.315 -> 1.088, strict 1.313 -> 1.133; but B=32 C64 56x56 (C_out/groups 64: two steps)
#: TF32 0.459 -> 0.466, fp16 0.395 -> 0.400, strict 0.622 -> 0.662. 128x64 (never the rule) is
#: kept for its 32-lane epilogue.
TILES = {
    "half": ((64, 64, 64, 2), (64, 128, 64, 2), (128, 64, 64, 1)),
    "float": ((64, 64, 32, 2), (64, 128, 32, 2), (128, 64, 32, 1)),
}
#: The rule takes the 64x128 tile in 1D and 2D where C_out/groups is at least this (the data
#: kernel's reduction: 8 steps of 32 in float32), in 3D always (above).
DATA_WIDE_MIN_ROWS = 256
#: Blocks per multiprocessor asked of the data kernel's MINB 2 tiles in 1D and 2D, default and
#: deterministic, per tile width BN. 64x64: 63-64 registers (ptxas, sm_90: 0-36 bytes of spill,
#: 3xTF32 28-116), 4 blocks per SM where MINB 2 gave 3 at 80 registers (the deterministic epilogue
#: 2 at 88-94, hence MINB 3 there since session 8; 3xTF32 2 at 128). The kernel is latency-bound
#: (ncu, B=8 C256 56x56 fp16: 6 warps per scheduler, 9.6 cycles between issues, long-scoreboard and
#: fixed-latency waits first), so the fourth block pays. H200, one process each (NOTES-gpu.md,
#: session 19): default f+b 0.86-0.99x at the 2D, 1D and 2D transposed benchmark shapes in fp16,
#: TF32 and fp32; deterministic backward 0.87-0.98x against MINB 3 (3xTF32: 2), bitwise equal. 3D
#: spills 220-400 bytes at 64 registers and keeps 2. 64x128: 3 (80 registers; 0-8 bytes of spill,
#: 3xTF32 68, whose shared memory allows 2 blocks anyway); at MINB 2 (117-128 registers) its data
#: gradients were 0.96-1.36x slower in 2D and 1D but for 1D fp16 (H200, session 44). In 3D MINB 3
#: lost (1.07-1.15x) and 2 is kept. 64x128 at MINB 4 (64 registers, 64 bytes of spill) was 1.7-10%
#: slower in TF32, fp16 and deterministic mode but for 1D fp16 (level; H200, session 45).
DATA_MINB = {64: 4, 128: 3}
#: Blocks per multiprocessor asked of the 64 x 64 data tile's 3xTF32 wgmma kernels in 1D and 2D
#: (the 64 x 128 tile's stay at 2: they spilled at 3, and their split operands' shared memory
#: holds two blocks anyway). At 2 the deterministic kernels had 89-91 registers, so 2 blocks per
#: SM; at 3, 77-79 and 3 blocks (66 KiB of shared memory each), with no spills (64-bit index:
#: 80, 0-64 bytes); the default ones 70-72 either way (ptxas, sm_90a). H200, f+b, MINB 2 -> 3
#: (NOTES-gpu.md, session 53): deterministic B=32 C64 56x56 strict 1.725 -> 1.606 ms, 2D
#: transposed B=8 C128 28x28 s2 0.444 -> 0.430; default level (0.996-1.001x).
WGMMA_SPLIT_NARROW_MINB = 3
#: Channels per lane of the data kernel's epilogue (``epilogue_lane_channels`` chooses): 8 pays each
#: position's corners, weights and branches once for twice the channels of 4, at the cost of
#: registers (2D fp16 64x64x64: 101 against 80, 2 blocks per SM instead of 3). H200, data
#: gradients alone, ms, 4 -> 8 channels a lane: 3D B=2 C32 32^3 fp16 2.10 -> 1.73, tf32 1.92 ->
#: 1.64 (8 corners a position); B=8 C256 56x56 fp16 0.60 -> 0.78, tf32 0.98 -> 1.05; B=16 C512
#: 14x14 equal; 1D C256 L4096 fp16 0.55 -> 0.57 (NOTES-gpu.md, session 10). So 8 in 3D only.
LANE_CHANNELS = (4, 8)
#: Data tiles (BM) with a second epilogue instantiation at half the lanes per position, taken where
#: a conv group's input channels fit half the tile (``epilogue_lanes``): C_in/groups = 32 under the
#: 64-channel tiles, the 3D and transposed benchmark shapes', would otherwise leave half the lanes
#: idle in every pass (NOTES-gpu.md, session 17).
NARROW_TILE_ROWS = (64,)
#: The weight gradient's tiles per N and precision ("half": fp16 / bf16, "tf32", "3xtf32": strict
#: float32) as (BM output channels, BN input channels, BK positions per step, MINB), 256 / BK
#: sampling threads per position: the tallest no taller than C_out/groups is taken
#: (``_weight_tile``; of two as tall, the first), since each output-channel tile samples the
#: input again; a deeper step gives each sampling thread more channels per corner computation.
#: 2D, H200, fp16, B=8 C256 56x56 (NOTES-gpu.md "fused backward"): 64x64x64 1.24 ms, 256x64x32
#: 0.75, 256x64x64 0.52 (cuda/im2col's 0.48); in a later run 256x64x64 0.58 against 256x64x128
#: 0.53 (im2col 0.45; the fused calls re-recorded their launches each time there). B=32 C64
#: 56x56: 64x64x64 0.30 (im2col 0.43).
#: 2D TF32 steps of 64 positions (128 registers, no spill with the sampling plan): B=32 C64 56x56
#: f+b 1.082 -> 1.067 ms, weight gradient alone 0.394 -> 0.377 (H200, session 23; 1.6-2.3% in
#: session 22). 3xTF32 keeps 32 (64 spills 48-124 bytes, and lost 4%), and so does 3D, where 8
#: corners of 16 float32 channels a thread spill 460-790 bytes; TF32's 64x64x32 stays as the
#: fallback where a group's channels are a multiple of 8, not 16 (:func:`weight_unsupported`).
#: 1D, where a sample is two corners: re-sampling each position once more per 128 output channels
#: costs less than the 256-row tile's one block per SM (255 registers, 174 KB of shared memory;
#: 128x64x64 fp16: 128 registers, no spill, 2 blocks). One process each, B=16 C256 L4096 f+b, 256
#: -> 128 rows: NVIDIA H200 fp16 0.966 -> 0.948 ms, fp32 (3xTF32: 144-160 bytes of spill) 3.416 ->
#: 3.161, TF32 1.600 -> 1.549 (where cuda/im2col's weight gradient in the fused backward measured
#: 1.501: the plan times both, takes the faster); NVIDIA H100 fp16 1.024 -> 0.990, TF32 1.663 ->
#: 1.600. In 2D the same tiles lose (H100, B=8 C256 56x56, weight gradient alone: fp16 0.297 ->
#: 0.472 ms, TF32 0.559 -> 0.888; NOTES-gpu.md, session 20). 1D TF32 steps of 64 lost: f+b 1.430
#: (128x64x32) against 1.439 (128x64x64) and 1.648 (64x64x64) ms (H200, session 23).
#: With the interleaved sampler (session 24, measured before its swizzle) these stayed the fastest
#: fused tiles, or within 0.3%, at B=32 C64, B=8 C256, B=16 C512 14x14 and 1D C256, in each of
#: fp16, TF32 and 3xTF32 measured there (NOTES-gpu.md, session 24).
WEIGHT_TILES = {
    1: {"half": ((64, 64, 64, 2), (128, 64, 64, 2)), "tf32": ((64, 64, 32, 2), (128, 64, 32, 2)),
        "3xtf32": ((64, 64, 32, 2), (128, 64, 32, 2))},
    2: {"half": ((64, 64, 64, 2), (256, 64, 128, 1)), "tf32": ((64, 64, 64, 2), (256, 64, 64, 1), (64, 64, 32, 2)),
        "3xtf32": ((64, 64, 32, 2), (256, 64, 64, 1))},
    3: {"half": ((64, 64, 64, 2), (256, 64, 128, 1)), "tf32": ((64, 64, 32, 2), (256, 64, 64, 1)),
        "3xtf32": ((64, 64, 32, 2), (256, 64, 64, 1))},
}
#: The weight gradient reads its corners from a sampling plan (``fused_sampling_plan``: rows and
#: weights per segment, tap and position, computed once per batch chunk) where the channels form
#: at most this many segments of one offset and mask group (beyond, the plan's 8 bytes per
#: corner, segment, tap and position outgrow the chunk's other buffers), and either more than one
#: of its blocks samples each position and tap (several input- or output-channel tiles: each
#: block would compute the same corners again) or the problem is 1D or 2D. H200, weight gradient
#: alone, fp16: B=8 C256 56x56 0.384 -> 0.324 ms, B=16 C512 14x14 0.221 -> 0.193, 1D C256 L4096
#: 0.432 -> 0.390 (session 6). With one block per position the block's THREADS / BK sampling
#: threads of a position each computed its corners (8 of them at BK = 32): weight kernel per
#: B=32 C64 56x56 f+b, H200, in place -> plan (+ the plan's kernel, 19 us in float32): TF32 404 ->
#: 336 us, 3xTF32 603 -> 554, fp16 200 -> 170 (+ 17); f+b 1.145 -> 1.086 ms, 1.60 -> 1.57, 0.85
#: -> 0.84 (session 22). In 3D the plan of 27 taps halved the chunk (C32: 0.450 -> 0.462 ms,
#: session 6), so there the rule keeps the first condition alone.
MAX_PLAN_SEGMENTS = 8
#: The weight gradient warp-specialised on wgmma (``deform_fused_backward_weight_ws``, sm_90a; fp16,
#: bf16, TF32 and 3xTF32): its tile (BM output channels, BN input channels, BK positions a step:
#: rows of 128 bytes, one block an SM) per precision key, and its ring (stages, sampling threads
#: beside the two MMA warpgroups). It reads the corners from a plan (the sampling plan, or the data
#: kernel's), so it serves where the plan can be made (``ws_weight_unsupported``). 3xTF32's stages
#: hold two planes of each tile (big and small parts: 80 KiB), so two fit; its MMA warpgroups keep
#: a second set of accumulators (160 registers), which leaves registers for 256 samplers. H200,
#: strict float32 weight gradient alone, mma.sync -> warp-specialised (NOTES-gpu.md, session 43):
#: B=8 C256 56x56 1.406 -> 0.613 ms, B=16 C512 14x14 0.761 -> 0.362, 1D B=16 C256 L4096 1.181 ->
#: 0.577; at B=32 C64 (forced) slower, 0.491 -> 0.649, as in the other precisions (WS_MIN_ROWS).
WS_WEIGHT_TILES = {"half": (256, 64, 64, 1), "tf32": (256, 64, 32, 1), "3xtf32": (256, 64, 32, 1)}
WS_RINGS = {"half": (4, 512), "tf32": (4, 512), "3xtf32": (2, 256)}
#: Where C_out/groups is at most this, the tile has these rows (one MMA warpgroup), not 256: half
#: the MMAs on rows past the group's. H200, f+b, 256 -> 128 rows (NOTES-gpu.md, session 53): 2D
#: transposed B=8 C128 28x28 s2 strict 0.3269 -> 0.3142 ms, TF32 0.979x, fp16 0.986x; B=8 C128
#: 56x56 strict 0.944x, TF32 0.972x, fp16 0.982x; B=32 C128 28x28 strict 0.940x; 1D B=16 C128
#: L4096 strict 0.939x. It does not move WS_MIN_ROWS: forced at B=32 C64 against the mma.sync
#: kernel, strict 1.033x, TF32 1.164x, fp16 1.112x; 1D C128 TF32 1.052x, fp16 1.050x.
WS_NARROW_ROWS = 128
#: True: the narrow tile where it fits (the rule); False: always 256 rows (tests, benchmarks).
WS_NARROW_TILE = True
#: The rule takes it where it serves and C_out/groups reaches WS_MIN_ROWS[0] in strict float32
#: and in 2D, WS_MIN_ROWS[1] otherwise. H200, weight gradient alone, mma.sync kernel ->
#: warp-specialised (NOTES-gpu.md, session 42): B=8 C256 56x56 fp16 0.241 -> 0.208 ms, TF32 0.424
#: -> 0.351; B=16 C512 14x14 fp16 0.189 -> 0.158, TF32 0.293 -> 0.220; 1D B=16 C256 L4096 fp16
#: 0.216 -> 0.172, TF32 0.392 -> 0.319. At B=32 C64 (a 64-row tile) it loses: fp16 0.164 -> 0.206,
#: TF32 0.249 -> 0.347; f+b strict 1.108x (session 53). Half the tile's rows, f+b, rule 256 -> 128
#: (the mma.sync kernel's 64-row tiles -> ws; NOTES-gpu.md, session 53): strict float32 B=8 C128
#: 56x56 0.864x, B=32 C128 28x28 0.868x, 1D B=16 C128 L4096 0.921x, 2D transposed B=8 C128 28x28
#: s2 0.898x, B=8 C192 56x56 0.753x; 2D TF32 0.963-1.005x, fp16 and bf16 0.893-0.996x; but 1D
#: TF32 1.080x, fp16 1.057x; 3D B=2 C128 16^3 level.
WS_MIN_ROWS = (128, 256)
#: None: the rule; True / False: forced on (where it serves) or off (tests, benchmarks).
WS_WEIGHT = None
#: The data kernel's main loop on wgmma (sm_90a: its WG instantiations, each warpgroup a half of
#: the tile's positions, in the sm_90a module) where its tile is 64 x 128 (64 x 64 too where
#: ``WGMMA_DATA_NARROW``), deterministic too where ``WGMMA_DATA_DETERMINISTIC``. None: the rule,
#: every precision there; True / False: forced on (where it serves) or off (tests, benchmarks).
#: H200, f+b, mma.sync -> wgmma
#: (NOTES-gpu.md, session 51): strict float32 1D B=16 C256 L4096 1.951 -> 1.710 ms, B=8 C256
#: 56x56 2.139 -> 1.827, B=16 C512 14x14 1.098 -> 0.933, 3D 2.131 -> 2.113; TF32 0.945-0.969x
#: at those 2D and 1D shapes, fp16 0.952-0.979x; 3D TF32 and fp16 level (0.997, 1.002). Then
#: the 64 x 64 tile too (``WGMMA_DATA_NARROW``; m64n32 a warpgroup), f+b: 2D transposed B=8 C128
#: 28x28 s2 strict 0.4105 -> 0.3656 ms, TF32 0.982x, fp16 0.987x; B=32 C64 56x56 strict 1.3365 ->
#: 1.2708, TF32 and fp16 level (1.001, 0.997); 3D transposed and 1D fp16 0.993-0.999x.
WGMMA_DATA = None
WGMMA_DATA_NARROW = True
#: Deterministic mode on the wgmma loop too: its 3xTF32 products summed apart per k8 and added
#: in k order (on the 64 x 64 tile two k8 groups in flight), the mma.sync loop's order, so that
#: every tile on either loop gives the same bits (fp16, bf16 and TF32 accumulate as mma.sync
#: does; test_fused_deterministic_bitwise_on_wgmma_and_mma_sync). H200, deterministic f+b,
#: mma.sync -> wgmma (NOTES-gpu.md, session 52): strict float32 B=8 C256 56x56 2.546 -> 2.227 ms,
#: B=16 C512 14x14 1.227 -> 1.067, 1D B=16 C256 L4096 2.295 -> 2.062, 2D transposed 0.473 ->
#: 0.440, 3D transposed 0.514 -> 0.504, 3D 0.993x; TF32 0.953-0.975x, fp16 0.972-0.991x; B=32
#: C64 56x56 strict 1.657 -> 1.716 (1.035x, its 64 x 64 tile at 2 blocks per SM where mma.sync
#: runs 4). False: deterministic plans keep mma.sync (the A/B).
WGMMA_DATA_DETERMINISTIC = True
#: The data kernel reads each (position, tap)'s corners, their slopes and the mask from a plan of
#: its own (``fused_gradient_plan``, per batch chunk: 68 bytes per tap and position in 2D) instead of
#: computing them in each of its C_in/64 channel-tile blocks, in 2D and 3D, and in 1D for float32,
#: where that plan is no larger than a sample's other buffers and the weight kernel's sampling plan,
#: which it then replaces. H200, data gradients alone, fp16: B=8 C256 56x56 0.655 -> 0.576 ms, B=8
#: C128 0.314 -> 0.281, 512@14x14 0.230 -> 0.219, B=32 C64 0.594 -> 0.571, 3D C32 2.06 -> 1.76
#: (larger than the buffers: not taken, ~150 MB per sample); 1D C256 0.526 -> 0.554, where two
#: corners are cheaper to compute than to load (NOTES-gpu.md, session 6). B=32 C64 fp16 was not
#: taken either until the rule counted the sampling plan it replaces: data kernel 388 -> 328 us per
#: f+b, f+b 0.836 -> 0.807 ms with the equal chunks (session 23). In 1D float32 the plan gains:
#: B=16 C256 L4096 TF32 backward 0.988 -> 0.973 ms, input gradient alone 0.529 -> 0.511,
#: transposed forward 0.620 -> 0.602; strict float32 input alone 1.352 -> 1.325. In 1D fp16 it
#: stays level or loses (B=32 C64 input alone 0.138 -> 0.145; NOTES-gpu.md, session 32).
#: None: the rules above decide; True / False: both plans forced on / off (tests, benchmarks).
SAMPLING_PLAN = None
#: Where the data gradients are wanted beside the fused weight gradient, their channels-last copy
#: of grad_output also writes the weight gradient's rows of it (gyr), so that grad_output is read
#: once; False: fused_position_rows reads it again, as it does for the weight gradient alone.
#: H200, f+b with a bias, with the bias gradient folded too against neither: 1D C256 L4096 TF32
#: 1.265 -> 1.226 ms, B=32 C64 56x56 TF32 0.880 -> 0.855, B=8 C256 TF32 1.317 -> 1.298, the
#: weight gradient bitwise the same (NOTES-gpu.md, session 31).
ROWS_FROM_COPY = True
#: The warp-specialised weight kernel's rows of grad_output (gyr, written by
#: fused_position_segments) over the data kernel's channels-last copy of it (gycl) in the
#: workspace, not beside it: the data kernel has finished with the copy by then (the kernels after
#: it wait for it; the next chunk's copy waits for the weight kernel), so that a sample takes one
#: grad_output buffer fewer and a chunk holds more samples. B=8 C256 56x56 strict float32: 17.9 ->
#: 14.9 MiB a sample, one chunk of 8 where the 128 MiB bound gave two of 4 (measured through the
#: bound alone: f+b 0.949x, NOTES-gpu.md, session 66). H200, f+b (session 67): B=8 C256 strict
#: 1.679 -> 1.593 ms (for 33 MiB more workspace), 1D TF32 0.943 -> 0.919 (chunks of 8, not 6);
#: 1D strict, 1D fp16, C256 TF32 and 14x14 strict level, on less workspace (1D strict 157 -> 109
#: MiB). False: rows of their own (the A/B).
ROWS_OVER_COPY = True
#: The list's leading channels-last copies of the call's inputs (the weight's rows, x, grad_output
#: of the first chunk) start beside the kernel before them (``channels_last_copy``'s ``early``),
#: not after it; False: each waits for the one before (the A/B). H200, f+b: 2D transposed strict
#: 0.4125 -> 0.4079 ms, 3D transposed TF32 0.3546 -> 0.3501, B=8 C256 fp16 0.7063 -> 0.7042; 3D
#: transposed strict 0.4334 -> 0.4368, its cause not found (NOTES-gpu.md, session 49).
EARLY_COPIES = True
#: Deterministic mode: float32 offset and mask gradients of one partial-sum slot stored by the data
#: kernel where they go (their samples back to back), not in the workspace and then copied by
#: ``fused_store``; False: the latter (the A/B). H200, B=32 C64 56x56 strict, deterministic
#: backward 1.3182 -> 1.3097 ms (NOTES-gpu.md, session 54).
DETERMINISTIC_IN_PLACE = True
#: Deterministic mode: the data kernel's fast path where a position's scattered values are finite
#: (each scaled by 2^E once, a corner's 64-bit reductions issued together behind one branch, where
#: the general loop took ldexpf, a test and a branch per contribution); the same integers, so the
#: same bits. H200, deterministic backward: B=32 C64 56x56 strict 1.3272 -> 1.2587 ms, B=8 C256
#: fp16 0.8660 -> 0.8232, 3D strict 2.1358 -> 2.0168 (NOTES-gpu.md, session 55). False: builds the
#: kernels without (``DCN_DET_FAST_PATH 0``, the A/B; a module of its own).
DETERMINISTIC_FAST_PATH = True
#: The warp-specialised weight kernel's samplers load step s + 1's corners of an item as soon as
#: they have blended step s's (the registers free), so that the loads stay in flight across the
#: stage's stores and barriers; the same values. False: each step's loads at its start (``DCN_WS_LOADS_AHEAD
#: 0``, the A/B; a module of its own).
WS_LOADS_AHEAD = True
#: The warp-specialised weight kernel's MMAs with the operands' roles swapped: the sampled tile's
#: 64 input channels the wgmma's M and each MMA warpgroup's 128 rows of grad_output its N (one
#: m64n128 a k step for two m64n64: fewer shared-memory bytes a product). The same products. Where
#: the tile's threads have the registers for an m64n128's 64 accumulators: not the 768-thread
#: 256-row tiles (fp16, bf16, TF32), whose 80 are too few. H200, f+b, m64n64 -> m64n128
#: (NOTES-gpu.md, session 63): B=16 C512 14x14 strict 0.8911 -> 0.8748 ms, 1D strict 0.991x, B=8
#: C256 strict 0.998x; 2D transposed (128-row tile) strict 0.992x, TF32 0.990x, fp16 0.999x. False:
#: the m64n64 order (``DCN_WS_CHANNEL_ROWS 0``, the A/B; a module of its own).
WS_CHANNEL_ROWS = True
#: The warp-specialised weight kernel's epilogue, in every chunk but the first (where it adds to
#: the partial sums before): each sum added by a global reduction, issued and not waited for, where
#: the compiler otherwise waits for each pair of loads after the store before it (32 round trips a
#: unit in 3xTF32). A launch of such a chunk cost about 27 us more than its steps (1D B=16 C256
#: L4096 strict, ncu: the weight kernel 417 us in three chunks, 359 in one; NOTES-gpu.md, session
#: 66). The same sums, but subnormal ones flushed to zero. H200 (NOTES-gpu.md, session 67): the
#: weight kernel 415 -> 386 us (1D strict) and 499 -> 455 (B=8 C256 strict); f+b 1D strict
#: 1.567 -> 1.537 ms, B=8 C256 strict 1.678 -> 1.633, 1D TF32, 1D fp16 and C256 TF32 level (0.999-1.002x).
#: False: the loads and stores (``DCN_WS_EPILOGUE_RED 0``, the A/B; a module of its own).
WS_EPILOGUE_RED = True
#: The same for the mma.sync weight kernel (``deform_fused_backward_weight``, the sm_90 module's;
#: B=32 C64 56x56 runs it in two chunks). H200, f+b: C64 strict 1.2524 -> 1.2493 ms, TF32 0.8016 ->
#: 0.7987 (0.998x, 0.996x: within two runs' spread; NOTES-gpu.md, session 67): off
#: (``DCN_WEIGHT_EPILOGUE_RED 1`` builds it).
WEIGHT_EPILOGUE_RED = False
#: The warp-specialised weight kernel in persistent blocks: a grid of one block a multiprocessor
#: (the kernel's registers hold one block an SM), each computing units (tile and split)
#: blockIdx.x, blockIdx.x + gridDim.x, ... through one ring, so that its samplers fill the next
#: unit's stages while its MMA warpgroups finish a unit and store it. The same kernel, the same
#: values. H200, f+b, a block a unit -> persistent (NOTES-gpu.md, session 60): B=16 C512 14x14
#: strict 0.9029 -> 0.8914 ms, B=8 C256 56x56 strict 1.8459 -> 1.8303; TF32, fp16 and the 2D
#: transposed strict level (0.997-1.002); 1D level, its 132 units one wave. False: a block a unit
#: (the A/B).
WS_PERSISTENT = True
#: None: one persistent block a multiprocessor; a number: at most that many blocks (tests and
#: sanitizers: several units a block at small shapes).
WS_PERSISTENT_BLOCKS = None
#: Position splits of the weight gradient (partial sums added in a fixed order), at most this
#: many: ``weight_splits`` picks the count.
MAX_SPLITS = 64
#: The default mode's position splits of the weight gradient all add their sums into one float32
#: slot by global reductions (red.global.add; the slot cleared before the first chunk) in place of
#: a slot a split summed in a fixed order (``fused_weight_sum``): the workspace's partial sums
#: shrink from ``splits`` copies of the float32 weight gradient to one (7 x 9 MiB at B=16 C512
#: 14x14, 11 x 2.25 MiB at B=8 C256), the sums no longer bitwise repeatable. H200, f+b (NOTES-gpu.md,
#: session 73): time 0.984-1.005x at every shape A/B'd; peak MiB B=8 C256 fp16 119 -> 97, TF32
#: 172 -> 149, strict 199 -> 176; 14x14 strict 129 -> 75 (below torchvision's 84); 1D 7-8 less, C64
#: 4 (14x14 fp16 and TF32 take cuda/im2col's weight gradient, whose columns set their peak).
#: Deterministic mode keeps a slot a split. False: a slot a split in every mode (the A/B).
REDUCED_SPLITS = True
#: The weight kernels' ``sum_mode`` (``fused_bwd::WeightSums``): the unit's sums stored in its
#: split's slot, added to it, or reduced into the one slot every split shares.
SUMS_STORE, SUMS_ADD, SUMS_REDUCE = 0, 1, 2
_INT32_SAFE = 2**30
_MAX_GRID = 1 << 20
_ALIGN = 256


#: The value each ``WS_*`` switch has in ``deform_fused_backward.cu`` when nothing defines it:
#: ``module_source`` prefixes a ``#define`` only where the module's setting differs, so that the
#: default build's text (and NVRTC's cache key) stays the source's.
_WS_SOURCE_DEFAULTS = {"WS_LOADS_AHEAD": True, "WS_CHANNEL_ROWS": True, "WS_EPILOGUE_RED": True}


def _switches(sm90a: bool = True) -> tuple:
    """The source switches of a module, part of its key: the warp-specialised weight kernel's
    (``WS_*``) only in the sm_90a module, the one that instantiates it (so that switching them
    rebuilds no other module), the mma.sync weight kernel's (``WEIGHT_EPILOGUE_RED``) only in the
    other one."""
    ws = tuple(globals()[switch] for switch in _WS_SOURCE_DEFAULTS) if sm90a else (WEIGHT_EPILOGUE_RED,)
    return (DETERMINISTIC_FAST_PATH,) + ws


def module_source(sm90a: bool = True) -> str:
    """``deform_fused_backward.cu`` with its local headers inlined (#line directives kept); without
    the deterministic scatter's fast path where ``DETERMINISTIC_FAST_PATH`` is off; for the sm_90a
    module (``sm90a``), without the weight samplers' loads ahead where ``WS_LOADS_AHEAD`` is off,
    nor the ws MMAs' swapped operands where ``WS_CHANNEL_ROWS`` is, and with the epilogue's
    reductions where ``WS_EPILOGUE_RED`` is on; for the other module, with the mma.sync weight
    kernel's epilogue reductions where ``WEIGHT_EPILOGUE_RED`` is on."""
    text = _cuda.module_text(_SOURCE)
    for switch, default in _WS_SOURCE_DEFAULTS.items() if sm90a else ():
        if bool(globals()[switch]) != default:
            text = f"#define DCN_{switch} {int(bool(globals()[switch]))}\n" + text
    if not sm90a and WEIGHT_EPILOGUE_RED:
        text = "#define DCN_WEIGHT_EPILOGUE_RED 1\n" + text
    return text if DETERMINISTIC_FAST_PATH else "#define DCN_DET_FAST_PATH 0\n" + text


def _tiles(dtype) -> tuple:
    return TILES["float" if np.dtype(dtype) == np.float32 else "half"]


def data_tile(tile: tuple, ndim: int, precision: int = 0, wgmma: bool = False) -> tuple:
    """The data kernel's instantiation of ``tile``: a MINB 2 tile in 1D and 2D asks for
    DATA_MINB[BN] blocks per SM, but on ``wgmma`` in 3xTF32 (``precision`` 2), where the shared
    memory of its split operands holds fewer blocks: WGMMA_SPLIT_NARROW_MINB for 64 x 64, 2 for
    64 x 128 (80 registers spilled)."""
    if tile[3] != 2 or ndim > 2:
        return tile
    if wgmma and precision == 2:
        return tile[:3] + (WGMMA_SPLIT_NARROW_MINB if tile[1] == 64 else 2,)
    return tile[:3] + (DATA_MINB[tile[1]],)


def weight_tile_key(dtype, precision=None) -> str:
    """The key of ``WEIGHT_TILES[N]`` for a dtype and precision (0 half, 1 TF32, 2 3xTF32;
    None: the dtype's own, 3xTF32 for float32)."""
    if np.dtype(dtype) != np.float32:
        return "half"
    return "tf32" if precision == 1 else "3xtf32"


def _weight_tiles(dtype, ndim: int = 2, precision=None) -> tuple:
    return WEIGHT_TILES[ndim][weight_tile_key(dtype, precision)]


def _weight_tile(geom, dtype, precision=None) -> tuple:
    """The tallest weight tile no taller than C_out/groups (the shortest where none is; of two as
    tall, the first listed) among those whose sampling threads' channels lie in one group
    (:func:`weight_unsupported`), so that a geometry the tallest tile cannot serve still gets a
    fused weight gradient; where none can, the tallest (and ``weight_unsupported`` says why)."""
    cog = geom.out_channels // geom.groups
    tiles = _weight_tiles(dtype, geom.ndim, precision)
    shortest = min(tile[0] for tile in tiles)
    fitting = [tile for tile in tiles if tile[0] <= max(cog, shortest)]
    served = [tile for tile in fitting if weight_unsupported(geom, dtype, tile) is None]
    return max(served or fitting, key=lambda tile: tile[0])


def _bool(value: bool) -> str:
    return "true" if value else "false"


def full_lanes(bm: int, lane_channels: int) -> int:
    """Lanes per position of the data kernel's epilogue that cover the tile's BM channels in one
    pass (at most a warp's 32)."""
    return min(32, bm // lane_channels)


def kernel_name(dtype, index64: bool, ndim: int, prec: int, tile: tuple, kernel: str = "data",
                plan: bool = False, deterministic: bool = False, lane_channels: int = 4, lanes=None,
                wgmma: bool = False) -> str:
    """A data or (``kernel="weight"``) weight kernel, reading its plan (``plan``) or not; the
    data kernel ``deterministic`` (fixed-point scatter) or not, with ``lane_channels`` channels
    per epilogue lane and ``lanes`` lanes per position (default ``full_lanes``), its main loop on
    ``wgmma`` (an sm_90a kernel) or mma.sync."""
    t = _cuda._CTYPES[np.dtype(dtype)]
    i = "long long" if index64 else "int"
    bm, bn, bk, minb = tile
    lanes = full_lanes(bm, lane_channels) if lanes is None else lanes
    det = f", {_bool(deterministic)}, {lane_channels}, {lanes}" if kernel == "data" else ""
    det += ", true" if kernel == "data" and wgmma else ""
    return f"deform_fused_backward_{kernel}<{t}, {i}, {ndim}, {prec}, {bm}, {bn}, {bk}, {minb}, {_bool(plan)}{det}>"


def ws_tiles(dtype, precision: int) -> tuple:
    """The warp-specialised weight kernel's tiles of a dtype and precision (its instantiations):
    WS_NARROW_ROWS rows, then WS_WEIGHT_TILES's."""
    tile = WS_WEIGHT_TILES[weight_tile_key(dtype, precision)]
    return ((WS_NARROW_ROWS,) + tile[1:], tile)


def ws_weight_tile(dtype, precision: int, out_rows: int) -> tuple:
    """The warp-specialised weight kernel's tile for ``out_rows`` output channels a group: the
    narrow one where it holds them (and WS_NARROW_TILE), else WS_WEIGHT_TILES's."""
    narrow, tile = ws_tiles(dtype, precision)
    return narrow if WS_NARROW_TILE and out_rows <= narrow[0] else tile


def ws_threads(dtype, precision: int, tile: tuple) -> int:
    """Threads of the warp-specialised weight kernel of a dtype and precision at ``tile``: its MMA
    warpgroups (one per 128 rows, at least one), then its samplers (WS_RINGS)."""
    return 128 * max(1, tile[0] // 128) + WS_RINGS[weight_tile_key(dtype, precision)][1]


def ws_kernel_name(dtype, index64: bool, ndim: int, prec: int, tile: tuple) -> str:
    """The warp-specialised weight kernel of a dtype, N, index width and precision (0, 1 or 2) at
    ``tile`` (one of :func:`ws_tiles`)."""
    t = _cuda._CTYPES[np.dtype(dtype)]
    i = "long long" if index64 else "int"
    bm, bn, bk, _ = tile
    return (f"deform_fused_backward_weight_ws<{t}, {i}, {ndim}, {prec}, {bm}, {bn}, {bk}, "
            f"{WS_RINGS[weight_tile_key(dtype, prec)][0]}, {ws_threads(dtype, prec, tile)}>")


#: Kernels of float32 rows alone (no dtype parameter; in every module, as the source defines
#: them): the 3xTF32 operands' split copies and the TF32 operands' rounded ones.
FLOAT32_KERNELS = ("fused_channels_last_split", "fused_channels_last_vectors_split", "fused_channels_last_tf32",
                   "fused_channels_last_vectors_tf32")


def wgmma_data_tiles(dtype) -> tuple:
    """The data tiles that have a wgmma main loop: 64 x 64 and 64 x 128."""
    return tuple(tile for tile in _tiles(dtype) if tile[0] == 64)


def ws_name_expressions(dtype, ndim: int, index64: bool) -> tuple:
    """The sm_90a module's kernels: the warp-specialised weight kernel in each precision, and the
    data kernel's wgmma instantiations (deterministic too, with 4 channels a lane)."""
    names = [ws_kernel_name(dtype, index64, ndim, prec, tile) for prec in _fused._precisions(dtype)
             for tile in ws_tiles(dtype, prec)]
    names += [kernel_name(dtype, index64, ndim, prec, data_tile(tile, ndim, prec, True), "data", plan, det, cpl,
                          lanes, True)
              for prec in _fused._precisions(dtype) for tile in wgmma_data_tiles(dtype) for plan in (False, True)
              for det in (False, True) for cpl in LANE_CHANNELS if cpl == 4 or (ndim == 3 and not det)
              for lanes in _lane_choices(tile[0], cpl)]
    return tuple(names)


def _is_sm90a(name: str) -> bool:
    """Whether kernel ``name`` lives in the sm_90a module (:func:`ws_name_expressions`)."""
    # (a data kernel's last template argument is WG where it has one, else LANES, a number)
    return name.startswith("deform_fused_backward_weight_ws<") or (
        name.startswith("deform_fused_backward_data<") and name.endswith(", true>"))


def name_expressions(dtype, ndim: int, index64: bool) -> tuple:
    """Every kernel instantiation of one module (one dtype, one N, one index width)."""
    t = _cuda._CTYPES[np.dtype(dtype)]
    i = "long long" if index64 else "int"
    names = [kernel_name(dtype, index64, ndim, prec, data_tile(tile, ndim), "data", plan, det, cpl, lanes)
             for prec in _fused._precisions(dtype) for tile in _tiles(dtype) for plan in (False, True)
             for det in (False, True) for cpl in LANE_CHANNELS if cpl == 4 or (ndim == 3 and not det)
             for lanes in _lane_choices(tile[0], cpl)]
    names += [kernel_name(dtype, index64, ndim, prec, tile, "weight", plan)
              for prec in _fused._precisions(dtype) for tile in _weight_tiles(dtype, ndim, prec)
              for plan in (False, True)]
    names += [f"{kernel}<{t}, {i}>" for kernel in
              ("fused_channels_last", "fused_channels_last_vectors", "fused_store", "fused_position_rows",
               "fused_weight_sum", "fused_channel_totals", "fused_position_segments")]
    names += [f"{kernel}<{t}, {i}, {_bool(fixed)}>" for kernel in ("fused_channels_first", "fused_channels_first_vectors")
              for fixed in (False, True)]
    names += [f"fused_sample_bound<{t}, {i}>"] + [f"{kernel}<{i}>" for kernel in FLOAT32_KERNELS]
    names += [f"fused_sampling_plan<{t}, {i}, {ndim}>", f"fused_gradient_plan<{t}, {i}, {ndim}>"]
    return tuple(names)


def all_module_keys():
    """(dtype, ndim, index64) of every module this algorithm can build."""
    return [(dtype, ndim, index64) for dtype in _fused.DTYPES for ndim in (1, 2, 3) for index64 in (False, True)]


_modules = {}
_functions = {}
_lock = threading.Lock()


def _function(name: str, dtype, ndim: int, index64: bool):
    """The kernel ``name`` on the current device; its module (the sm_90a one for the warp-specialised
    weight kernel) is compiled once per device and value of the source switches (``_switches``)."""
    device = cupy.cuda.runtime.getDevice()
    sm90a = _is_sm90a(name)
    fkey = (device, name, _switches(sm90a))
    fn = _functions.get(fkey)
    if fn is None:
        with _lock:
            fn = _functions.get(fkey)
            if fn is None:
                names = (ws_name_expressions if sm90a else name_expressions)(dtype, ndim, index64)
                mkey = (device, names, _switches(sm90a))
                module = _modules.get(mkey)
                if module is None and sm90a:
                    module = _modules[mkey] = _fused._Sm90aModule(names, module_source(), _SOURCE)
                elif module is None:
                    module = _modules[mkey] = cupy.RawModule(code=module_source(sm90a=False),
                                                             options=_cuda.compile_options(), name_expressions=names)
                fn = _functions[fkey] = module.get_function(name)
    return fn


def smem_bytes(dtype, tile: tuple, padded: bool = True) -> int:
    """Shared memory of a data tile's operands: the two buffers of both operand tiles (rows of BK,
    plus a 16-byte pad where ``padded``). :func:`data_smem_bytes` adds the epilogue's reuse."""
    bm, bn, bk, _ = tile
    item, vec = np.dtype(dtype).itemsize, _VEC[np.dtype(dtype)]
    return 2 * (bm + bn) * (bk + (vec if padded else 0)) * item


def data_rows_padded(precision: int, ndim: int) -> bool:
    """Whether the data kernel's operand tiles have padded rows (its ``TILE_PADDED``: strict
    float32 in 1D and 2D) rather than swizzled 128-byte ones (``TILE_XOR``, which fetch no L2
    sector twice; cuda/deform_fused_backward.cu, DCN_DATA_TILE_LAYOUT)."""
    return precision == 2 and ndim < 3


def weight_smem_bytes(dtype, tile: tuple, precision: int) -> int:
    """Dynamic shared memory of the weight kernel: two buffers each of the grad_output tile (BM
    rows of BK, swizzled: its ``TILE_XOR_A``; in strict float32, ``precision`` 2, padded by 16
    bytes) and of the sampled tile (BN rows of BK plus a 16-byte pad)."""
    bm, bn, bk, _ = tile
    item, vec = np.dtype(dtype).itemsize, _VEC[np.dtype(dtype)]
    return 2 * (bm * (bk + (vec if precision == 2 else 0)) + bn * (bk + vec)) * item


def operand_planes(precision: int) -> int:
    """Planes of a split operand: 2 in strict float32 (3xTF32: split_tf32's big parts, then the
    small ones), else 1."""
    return 2 if precision == 2 else 1


def ws_weight_smem_bytes(dtype, precision: int, tile: tuple) -> int:
    """Dynamic shared memory of the warp-specialised weight kernel of a dtype and precision at
    ``tile``: its ring's stages of both tiles (rows of 128 bytes; 3xTF32: two planes each) and
    their mbarriers, and 1 KiB to lift the ring to the 128-byte swizzle's 1024-byte period."""
    bm, bn = tile[:2]
    return WS_RINGS[weight_tile_key(dtype, precision)][0] * (operand_planes(precision) * (bm + bn) * 128 + 8) + 1024


def _wgmma_device(wgmma=None) -> bool:
    """``wgmma``, or where it is None whether the current device runs sm_90a code (False without
    a driver or a device)."""
    if wgmma is not None:
        return bool(wgmma)
    try:
        return _fused.wgmma_available()
    except Exception:   # no driver or no device
        return False


def ws_weight_unsupported(geom, dtype, precision: int, wgmma=None):
    """Why the warp-specialised weight kernel cannot serve ``geom`` in ``precision`` (None when
    it can): wgmma (an sm_90a device; ``wgmma`` None: ask the current one);
    every tile's BN channels within one conv group and one plan segment (a run of channels that
    share their offset and mask group), at most MAX_PLAN_SEGMENTS of them (its corners come from
    a plan)."""
    if not _wgmma_device(wgmma):
        return "the warp-specialised weight kernel needs an sm_90a device (wgmma)"
    bn = WS_WEIGHT_TILES[weight_tile_key(dtype, precision)][1]
    seg_len, segments = plan_segments(geom)
    for count, what in ((geom.in_channels // geom.groups, "C_in/groups"), (seg_len, "a plan segment's channels")):
        if count % bn:
            return f"{what} = {count} is not a multiple of {bn} (the warp-specialised weight tile's channels)"
    if segments > MAX_PLAN_SEGMENTS:
        return f"{segments} plan segments, more than {MAX_PLAN_SEGMENTS}"
    return None


def lane_sums_in_smem(lanes: int, deterministic: bool) -> bool:
    """Whether the data kernel's epilogue lanes leave their offset and mask partial sums in shared
    memory, summed per segment after the passes (the kernel's ``SMEM_SUMS``), instead of adding
    them by shuffles: at 8 lanes a position or more, and always when deterministic (one order of
    the sums for every tile and lane count)."""
    return deterministic or lanes >= 8


def data_smem_bytes(dtype, tile: tuple, ndim: int, lane_channels: int, lanes: int, deterministic: bool,
                    precision: int, wgmma: bool = False) -> int:
    """Dynamic shared memory of the data kernel: :func:`smem_bytes` (rows padded per
    :func:`data_rows_padded`; twice that in strict float32, ``precision`` 2, whose operands come
    as big and small parts), reused after the main loop by the epilogue's float32 column
    gradients (BN rows of BM + 4), followed (:func:`lane_sums_in_smem`) by every lane's N + 1
    offset and mask partial sums (a row of BM / lane_channels + 1 floats per position and
    value). On ``wgmma``: swizzled rows always, and 1 KiB to lift them to the swizzle's 1024-byte
    period."""
    bm, bn = tile[:2]
    epilogue = bn * (bm + 4) * 4
    if lane_sums_in_smem(lanes, deterministic):
        epilogue += (ndim + 1) * bn * (bm // lane_channels + 1) * 4
    padded = data_rows_padded(precision, ndim) and not wgmma
    return max(operand_planes(precision) * smem_bytes(dtype, tile, padded), epilogue) + (1024 if wgmma else 0)


def _per_group(geom):
    """Input channels per conv, offset and mask group (C_in where the argument is absent)."""
    C = geom.in_channels
    return (C // geom.groups, C // geom.offset_groups if geom.has_offset else C,
            C // geom.mask_groups if geom.has_mask else C)


def unsupported(geom, dtype):
    """Why the fused backward cannot serve ``geom`` (None when it can)."""
    per = _per_group(geom)
    for count, what in zip(per, ("C_in/groups", "C_in/offset_groups", "C_in/mask_groups")):
        if count % 4:
            return f"{what} = {count} is not a multiple of 4 (a lane's 4 channels must share their groups)"
    vec = _VEC[np.dtype(dtype)]
    cog = geom.out_channels // geom.groups
    if geom.groups > 1 and cog % vec:
        return f"C_out/groups = {cog} is not a multiple of {vec} with {geom.groups} groups (16-byte copies)"
    return None


def weight_unsupported(geom, dtype, tile=None, precision=None):
    """Why the fused weight gradient cannot serve ``geom`` (None when it can): each sampling
    thread's channels (BN / (256 / BK) of its tile, by default ``_weight_tile``'s in
    ``precision``) must lie in one conv, offset and mask group."""
    bm, bn, bk, _ = tile if tile is not None else _weight_tile(geom, dtype, precision)
    per_thread = bn // (_THREADS // bk)
    for count, what in zip(_per_group(geom), ("C_in/groups", "C_in/offset_groups", "C_in/mask_groups")):
        if count % per_thread:
            return f"{what} = {count} is not a multiple of {per_thread} (one sampling thread's channels)"
    return None


def weight_splits(tiles: int, steps: int, slots: int, max_splits=None) -> int:
    """The position splits of the weight gradient: the count that minimises waves x (steps per
    split + 1), where the launch has ``tiles`` blocks per split, a split ``ceil(steps / splits)``
    steps of BK positions (+ 1 for its pipeline's first step and its epilogue), and a wave
    ``slots`` resident blocks (the tile's MINB a multiprocessor times the multiprocessors); ties
    go to fewer splits (fewer partial sums to store and add). Every block does the same steps, so
    blocks past a whole number of waves add a wave of their own: 531 blocks on 264 slots (B=32
    C64, 59 splits of 9 tiles, the count before: ``ceil(4 waves x SMs / tiles)``) run three
    waves, the third of 3 blocks. The model predicted a third off the weight kernel there; H200,
    per f+b (NOTES-gpu.md, session 23): C64 TF32 335.7 -> 330.8 us, fp16 level, 1D fp16 238 ->
    221, and ``fused_weight_sum`` 7.8 -> 4.0 (fewer partial sums)."""
    max_splits = MAX_SPLITS if max_splits is None else max_splits     # read at call time: tests patch it
    best_cost, best = None, 1
    for splits in range(1, max(1, min(max_splits, steps)) + 1):
        cost = -(-tiles * splits // slots) * (-(-steps // splits) + 1)
        if best_cost is None or cost < best_cost:
            best_cost, best = cost, splits
    return best


def segment_lanes(geom, bm: int, lane_channels: int = 4) -> int:
    """Lanes whose offset/mask partial sums are added by shuffles before one atomic: the largest
    power of two, at most the lanes of one position, whose segments (``lane_channels`` channels a
    lane) never cross a conv, offset or mask group boundary."""
    lanes = full_lanes(bm, lane_channels)
    seg = 1
    while seg * 2 <= lanes and all(count % (2 * lane_channels * seg) == 0 for count in _per_group(geom)):
        seg *= 2
    return seg


def _lane_choices(bm: int, lane_channels: int) -> tuple:
    """The lanes per position instantiated for a BM-row data tile: all, and half on the
    ``NARROW_TILE_ROWS`` tiles."""
    full = full_lanes(bm, lane_channels)
    return (full, full // 2) if bm in NARROW_TILE_ROWS and full > 1 else (full,)


def epilogue_lanes(geom, bm: int, lane_channels: int) -> int:
    """The rule for the data kernel's lanes per position: ``full_lanes``, or half as many where the
    tile has that instantiation (``NARROW_TILE_ROWS``) and they still cover C_in/groups in one
    pass (no lane idles; twice the positions a warp). Segments (``segment_lanes``) never exceed
    C_in/groups channels, so they are the same either way, and so are the gradients' bits."""
    choices = _lane_choices(bm, lane_channels)
    cg = geom.in_channels // geom.groups
    return choices[-1] if choices[-1] * lane_channels >= cg else choices[0]


def epilogue_lane_channels(geom, deterministic: bool) -> int:
    """The rule for the data kernel's channels per epilogue lane: 8 in 3D (eight corners a
    position: measured faster, LANE_CHANNELS) where every conv, offset and mask group's channel
    count is a multiple of 8 (a lane's channels share their groups) and the backward is not
    deterministic (whose partial-sum trees assume 4); else 4."""
    if geom.ndim == 3 and not deterministic and all(count % 8 == 0 for count in _per_group(geom)):
        return 8
    return 4


#: (channels per segment, segments) of the weight gradient's sampling plan: the forward's.
plan_segments = _fused.plan_segments


def _choose_tile(geom, dtype) -> tuple:
    """The rule: the dtype's 64x128 tile in 3D and where C_out/groups >= DATA_WIDE_MIN_ROWS, else
    its 64x64 one (TILES)."""
    narrow, wide = _tiles(dtype)[:2]
    return wide if geom.ndim == 3 or geom.out_channels // geom.groups >= DATA_WIDE_MIN_ROWS else narrow


#: The data kernel launched for the input gradient alone (a transposed convolution's forward, or
#: a backward asked for that gradient only) takes the dtype's 64x64 tile in 3D, where the rule
#: takes 64x128 for the data gradients together: without the offset and mask gradients' reductions
#: the wide tile's reuse of the B fragments buys less than twice the blocks do. H200, 3D
#: transposed B=2 C32 16^3 s2, forward (f+b less backward, one process; NOTES-gpu.md, session 50):
#: strict float32 0.1665 -> 0.1563 ms, TF32 0.1587 -> 0.1469, fp16 0.1564 -> 0.1466, while its
#: backward (offset and mask gradients) is 3.5-6.4% slower at 64x64. The tiles differ only in BN:
#: the same workspace, epilogue and segments. False: one tile for every launch.
SCATTER_NARROW_3D = True


def _scatter_tile(geom, dtype, tile: tuple) -> tuple:
    """The data kernel's tile for the input gradient alone (``SCATTER_NARROW_3D``), where the
    rule's ``tile`` serves the rest."""
    narrow, wide = _tiles(dtype)[:2]
    return narrow if SCATTER_NARROW_3D and geom.ndim == 3 and tile == wide else tile


class BackwardConfig:
    """What one backward of one geometry and dtype launches (chosen once per plan)."""

    def __init__(self, geom, dtype, allow_tf32: bool, tile=None, multiprocessors: int = 132, fused_weight=None,
                 weight_tile=None, sampling_plan=None, gradient_plan=None, deterministic: bool = False,
                 lane_channels=None, ws_weight=None, wgmma=None, wgmma_data=None, reduced_splits=None):
        dtype = np.dtype(dtype)
        reason = unsupported(geom, dtype)
        if reason is not None:
            raise ValueError(f"cuda/fused-backward does not serve this geometry: {reason}")
        self.geom, self.dtype, self.itemsize = geom, dtype, dtype.itemsize
        vec = _VEC[dtype]
        C, Co, G = geom.in_channels, geom.out_channels, geom.groups
        self.Cg, self.Cog = C // G, Co // G
        self.K, self.Q, self.S = geom.kernel_volume, geom.output_size, geom.input_size
        self.Go, self.Gm = max(geom.offset_groups, 1), max(geom.mask_groups, 1)
        self.precision = _fused.precision_of(dtype, allow_tf32)
        self.tile = tuple(tile) if tile is not None else _choose_tile(geom, dtype)
        bm, bn, bk, _ = self.tile
        # the data kernel's tile where it computes the input gradient alone (a forced tile, and
        # the deterministic kernels, keep one tile)
        self.scatter_tile = (self.tile if tile is not None or deterministic
                             else _scatter_tile(geom, dtype, self.tile))
        assert self.scatter_tile[0] == bm and self.scatter_tile[2] == bk   # (only BN differs)
        self.Cp, self.Cop, self.Cpa = _fused._round_up(C, vec), _fused._round_up(Co, vec), _fused._round_up(C, 4)
        self.Cogp = _fused._round_up(self.Cog, bk)
        # the data kernel's operand rows (wt, gycl): in strict float32 (3xTF32) twice as long, the
        # values' big parts, then their small ones (fused_channels_last_split)
        planes = operand_planes(self.precision)
        self.wt_row, self.gy_row = self.Cogp * planes, self.Cop * planes
        self.off_ch, self.m_ch = self.Go * self.K * geom.ndim, self.Gm * self.K
        it = self.itemsize
        # deterministic: the input gradient in 64-bit fixed point (8 bytes and 2 flag bits per
        # element), the offset and mask gradients as one partial sum per segment of channels
        self.deterministic = bool(deterministic)
        # (deterministic: segments of at most 16 lanes, the 64-channel tile's, so that every tile
        # adds the same partial sums in the same tree: bitwise the same gradients)
        # channels per epilogue lane (lane_channels: the rule, or forced to 4 or 8)
        rule = epilogue_lane_channels(geom, self.deterministic)
        self.lane_channels = rule if lane_channels is None else int(lane_channels)
        if self.lane_channels not in LANE_CHANNELS or (self.lane_channels != rule and self.lane_channels == 8):
            raise ValueError(f"lane_channels={lane_channels} is not served here (the rule gives {rule})")
        self.seg = segment_lanes(geom, min(bm, 64) if self.deterministic else bm, self.lane_channels)
        self.lanes = epilogue_lanes(geom, bm, self.lane_channels)
        _, per_go, per_gm = _per_group(geom)
        self.slots = (per_go // (4 * self.seg), per_gm // (4 * self.seg)) if self.deterministic else (1, 1)
        self.log2_count = int(max(self.Q * self.K if geom.has_offset else self.K, 1) - 1).bit_length()
        gx_bytes = self.S * self.Cpa * (8 + 0.25 if self.deterministic else 4)
        # the weight gradient: fused where each sampling thread's channels share their groups
        # (unless fused_weight is False: cuda/im2col's then, FusedBackward.run)
        self.weight_tile = (tuple(weight_tile) if weight_tile is not None
                            else _weight_tile(geom, dtype, self.precision))
        self.fused_weight = (weight_unsupported(geom, dtype, self.weight_tile) is None) and fused_weight is not False
        # warp-specialised on wgmma where it serves (ws_weight / WS_WEIGHT: None the rule, at least
        # WS_MIN_ROWS output channels a group; True forced; False off), its tile then the weight
        # tile, its corners from a plan
        ws = WS_WEIGHT if ws_weight is None else ws_weight
        ws = self.Cog >= WS_MIN_ROWS[0 if self.precision == 2 or geom.ndim == 2 else 1] if ws is None else bool(ws)
        self.ws_weight = (ws and fused_weight is not False and weight_tile is None
                          and (SAMPLING_PLAN if sampling_plan is None else sampling_plan) is not False
                          and ws_weight_unsupported(geom, dtype, self.precision, wgmma) is None)
        if self.ws_weight:
            self.weight_tile, self.fused_weight = ws_weight_tile(dtype, self.precision, self.Cog), True
        # its corners from a sampling plan computed once per chunk (the rule: at most
        # MAX_PLAN_SEGMENTS segments of channels, and several blocks sampling each position and tap
        # or N <= 2), else in every block that samples a position
        wbm, wbn, wbk, _ = self.weight_tile
        self.seg_len, self.segments = plan_segments(geom)
        self.sampled_by = -(-self.Cg // wbn) * -(-self.Cog // wbm)
        if sampling_plan is None:
            sampling_plan = SAMPLING_PLAN
        rule = (self.sampled_by > 1 or geom.ndim <= 2) and self.segments <= MAX_PLAN_SEGMENTS
        # (the warp-specialised kernel always reads a plan)
        self.sampling_plan = self.ws_weight or (self.fused_weight and (rule if sampling_plan is None
                                                                       else bool(sampling_plan)))
        corners = 1 << geom.ndim
        plan_entries = self.segments * self.K * corners if self.sampling_plan else 0   # per position
        buffers = int(self.S * self.Cp * it + self.Q * self.gy_row * it + gx_bytes
                      + (self.off_ch * self.slots[0] + self.m_ch * self.slots[1]) * self.Q * 4
                      + (self.Q * Co * it if self.fused_weight else 0))
        # the data kernel's corners, slopes and mask from a plan per chunk (the rule: in 2D and 3D,
        # and in 1D for float32 (TF32 or strict), at most MAX_PLAN_SEGMENTS segments, the plan no
        # larger than a sample's other buffers and the sampling plan it replaces)
        if gradient_plan is None:
            gradient_plan = SAMPLING_PLAN
        self.m_tiles = -(-self.Cg // bm)
        entry_bytes = corners * (8 + 4 + 4 * geom.ndim) + 4       # rows, weights, slopes, mask
        rule = ((geom.ndim >= 2 or it == 4) and self.segments <= MAX_PLAN_SEGMENTS
                and self.segments * self.K * self.Q * entry_bytes <= buffers + plan_entries * self.Q * 8)
        self.gradient_plan = rule if gradient_plan is None else bool(gradient_plan)
        # where both plans are made, the weight kernel reads the data kernel's (the same entries:
        # rows and weights, the mask apart) and the sampling plan is not made
        self.plan_shared = self.sampling_plan and self.gradient_plan
        if self.plan_shared:
            plan_entries = 0
        # the workspace buffers the weight kernel reads its corners from: (rows, weights, masks)
        self.weight_plan = (("gradient_rows", "gradient_weights", "gradient_masks") if self.plan_shared else
                            ("plan_rows", "plan_weights", None) if self.sampling_plan else (None, None, None))
        gradient_entries = self.segments * self.K if self.gradient_plan else 0      # per position
        # the bias gradient folded into the copy of grad_output: a float32 sum per channel and
        # 64-position tile (fused_channels_last), added by fused_channel_totals
        self.bias_rows = -(-self.Q // _fused._LAYOUT_TILE)          # per sample
        # the warp-specialised kernel's rows of grad_output over its copy (ROWS_OVER_COPY): a
        # sample's bytes without them (the plan's rule above still counts them)
        self.rows_over_copy = bool(ROWS_OVER_COPY) and self.ws_weight
        per_sample = (buffers - (self.Q * Co * it if self.rows_over_copy else 0) + plan_entries * self.Q * 8
                      + gradient_entries * self.Q * entry_bytes + self.bias_rows * Co * 4)
        # as few chunks as the workspace bound allows, of equal size (but the last): 16 + 16, not 19 + 13
        most = max(1, min(geom.batch, int(_fused.WORKSPACE_LIMIT_BYTES) // max(per_sample, 1)))
        self.chunk = n = -(-geom.batch // -(-geom.batch // most))
        # grad_output's rows for the weight gradient: the warp-specialised kernel's in whole
        # segments of BK positions (fused_position_segments), else in vectors
        self.Pp = _fused._round_up(n * self.Q, wbk if self.ws_weight else vec)
        gy_planes = planes if self.ws_weight else 1   # (its segments: 3xTF32's big and small parts)
        self.weight_tiles = self.K * G * -(-self.Cog // wbm) * -(-self.Cg // wbn)
        self.splits = weight_splits(self.weight_tiles, -(-n * self.Q // wbk), self.weight_tile[3] * multiprocessors)
        # the splits' sums reduced into one slot (REDUCED_SPLITS / reduced_splits: None the rule, in
        # the default mode where there are several; True, False forced), else a slot a split
        rule = REDUCED_SPLITS and not self.deterministic and self.splits > 1
        self.reduced_splits = self.fused_weight and (rule if reduced_splits is None else bool(reduced_splits))
        self.part_slots = 1 if self.reduced_splits else self.splits
        # the weight kernel's grid: a block a unit (tile and split), or persistent blocks
        units = self.splits * self.weight_tiles
        self.weight_grid = units
        if self.ws_weight and WS_PERSISTENT:
            cap = multiprocessors if WS_PERSISTENT_BLOCKS is None else int(WS_PERSISTENT_BLOCKS)
            self.weight_grid = max(1, min(units, cap))
        det = self.deterministic
        sizes = {
            "xcl": ((n * self.S + 1) * self.Cp, dtype), "gycl": ((n * self.Q + 1) * self.gy_row, dtype),
            "gxcl": (0 if det else n * self.S * self.Cpa, np.float32),
            "gxq": (n * self.S * self.Cpa if det else 0, np.uint64),
            "gx_flags": (-(-n * self.S * self.Cpa // 16) if det else 0, np.uint32),
            "weight_bound": (1 if det else 0, np.uint64),
            "bounds": (2 * n if det else 0, np.uint64),        # per sample: grad_output's, then the mask's
            "goff": (n * self.off_ch * self.Q * self.slots[0], np.float32),
            "gmsk": (n * self.m_ch * self.Q * self.slots[1], np.float32),
            "wt": ((G * self.Cg * self.K + 1) * self.wt_row, dtype),
            "gyr": ((Co * self.Pp * gy_planes + (wbm * wbk if self.ws_weight else 0)) if self.fused_weight else 0,
                    dtype),
            "part": (self.part_slots * Co * self.K * self.Cg if self.fused_weight else 0, np.float32),
            "plan_weights": (n * self.Q * plan_entries, np.float32),
            "gradient_weights": (n * self.Q * gradient_entries * corners, np.float32),
            "gradient_slopes": (n * self.Q * gradient_entries * corners * geom.ndim, np.float32),
            "gradient_masks": (n * self.Q * gradient_entries, np.float32),
            "bias_sums": (n * self.bias_rows * Co, np.float32),
            "bias_acc": (Co if n < geom.batch else 0, np.float32),   # between chunks
        }
        self.index64 = max(max(count for count, _ in sizes.values()), geom.batch * C * self.S,
                           geom.batch * max(self.off_ch, self.m_ch) * self.Q,
                           (n * self.Q + bn) * self.gy_row, Co * (self.Pp * gy_planes + wbk)) > _INT32_SAFE
        sizes["plan_rows"] = (n * self.Q * plan_entries, np.int64 if self.index64 else np.int32)
        sizes["gradient_rows"] = (n * self.Q * gradient_entries * corners, np.int64 if self.index64 else np.int32)
        rows = sizes["gyr"]
        if self.rows_over_copy:   # (one region, as long as the longer of the two)
            sizes["gycl"] = (max(sizes["gycl"][0], rows[0]), dtype)
            sizes["gyr"] = (0, dtype)
        self.offsets, total = {}, 0
        for name, (count, dt) in sizes.items():
            self.offsets[name] = (total, count, np.dtype(dt))
            total = _fused._round_up(total + count * np.dtype(dt).itemsize, _ALIGN)
        if self.rows_over_copy:
            self.offsets["gyr"] = (self.offsets["gycl"][0], rows[0], np.dtype(dtype))
        self.workspace_bytes = total
        # the data kernel's main loop on wgmma (wgmma_data / WGMMA_DATA: None the rule, on; True
        # forced; False off) on its 64-row tiles, where the device has it (deterministic mode:
        # where WGMMA_DATA_DETERMINISTIC)
        wg = WGMMA_DATA if wgmma_data is None else wgmma_data
        self.wgmma_data = ((wg is None or bool(wg)) and (WGMMA_DATA_DETERMINISTIC or not self.deterministic)
                           and _wgmma_device(wgmma))
        self.smem_bytes = data_smem_bytes(dtype, self.tile, geom.ndim, self.lane_channels, self.lanes,
                                          self.deterministic, self.precision, self.data_on_wgmma(self.tile))
        self.scatter_smem_bytes = data_smem_bytes(dtype, self.scatter_tile, geom.ndim, self.lane_channels,
                                                  self.lanes, self.deterministic, self.precision,
                                                  self.data_on_wgmma(self.scatter_tile))
        self.weight_smem_bytes = (ws_weight_smem_bytes(dtype, self.precision, self.weight_tile) if self.ws_weight
                                  else weight_smem_bytes(dtype, self.weight_tile, self.precision))
        self.weight_threads = ws_threads(dtype, self.precision, self.weight_tile) if self.ws_weight else _THREADS
        self.struct = _cuda._geom_struct(geom)

    def data_on_wgmma(self, tile: tuple) -> bool:
        """Whether the data kernel at ``tile`` runs its wgmma main loop."""
        return self.wgmma_data and tile[0] == 64 and (tile[1] == 128 or (tile[1] == 64 and WGMMA_DATA_NARROW))

    @property
    def description(self) -> str:
        prec = {0: str(self.dtype), 1: "tf32", 2: "3xtf32"}[self.precision]
        bm, bn, bk, _ = self.tile
        plan = (", the data gradients' plan" if self.plan_shared else
                ", a sampling plan per chunk" if self.sampling_plan else "")
        ws = (f"warp-specialised wgmma, {self.weight_tile[0]} rows, "
              f"{'persistent blocks, ' if self.weight_grid < self.splits * self.weight_tiles else ''}"
              if self.ws_weight else "")
        ws += "grad_output's rows over its copy, " if self.rows_over_copy else ""
        summed = "reduced into one sum" if self.reduced_splits else "fixed-order sum"
        weight = (f"weight gradient fused ({ws}{self.splits} position splits, {summed}{plan})"
                  if self.fused_weight else "weight gradient through cuda/im2col")
        data_plan = " from a plan per chunk" if self.gradient_plan else ""
        scatter = ("deterministic: fixed-point 64-bit channels-last scatter, offset and mask gradients summed in a "
                   "fixed order" if self.deterministic else "channels-last vector scatter")
        tiles = f"tile {bm}x{bn}x{bk}"
        if self.scatter_tile != self.tile:
            tiles += " (the input gradient alone: {}x{}x{})".format(*self.scatter_tile[:3])
        mma = "wgmma" if self.data_on_wgmma(self.tile) else "mma.sync"
        return (f"cuda/fused-backward: {prec} {mma}, {tiles}, {scatter}{data_plan} "
                f"({self.lane_channels} channels a lane, {self.lanes} lanes a position), "
                f"{weight}, chunks of {self.chunk} samples, {'64' if self.index64 else '32'}-bit index")

    def blocks(self, n: int, scatter: bool = False) -> int:
        """The data kernel's blocks for n samples (``scatter``: at ``scatter_tile``)."""
        bn = (self.scatter_tile if scatter else self.tile)[1]
        return -(-n * self.Q // bn) * self.K * self.geom.groups * self.m_tiles

    def weight_sums(self, start: int) -> int:
        """The weight kernels' ``sum_mode`` for the chunk whose first sample is ``start``."""
        return SUMS_REDUCE if self.reduced_splits else SUMS_ADD if start > 0 else SUMS_STORE

    def weight_steps(self, n: int) -> int:
        """Steps (of BK positions) of each of the weight gradient's splits, for n samples."""
        total = -(-n * self.Q // self.weight_tile[2])
        return -(-total // self.splits)

    def kernel(self, name: str, scatter: bool = False):
        """The kernel function ``name`` (``scatter``: the data kernel at ``scatter_tile``)."""
        g = self.geom
        if name in ("data", "weight"):
            tile, smem = (self.tile, self.smem_bytes) if name == "data" else (self.weight_tile, self.weight_smem_bytes)
            if name == "data" and scatter:
                tile, smem = self.scatter_tile, self.scatter_smem_bytes
            plan = self.gradient_plan if name == "data" else self.sampling_plan
            wgmma = name == "data" and self.data_on_wgmma(tile)
            if name == "data":
                tile = data_tile(tile, g.ndim, self.precision, wgmma)
            full_name = (ws_kernel_name(self.dtype, self.index64, g.ndim, self.precision, self.weight_tile)
                         if name == "weight" and self.ws_weight else
                         kernel_name(self.dtype, self.index64, g.ndim, self.precision, tile, name, plan,
                                     self.deterministic, self.lane_channels, self.lanes, wgmma))
            fn = _function(full_name, self.dtype, g.ndim, self.index64)
            if smem > 48 * 1024:
                _fused._allow_shared_memory(fn, smem)
            return fn
        if name == "weight_bound":   # cuda/im2col-deterministic's (the samples' bounds: fused_sample_bound)
            return _deterministic._kernels(self.dtype, g.ndim, self.index64)[name]
        i = "long long" if self.index64 else "int"
        if name in FLOAT32_KERNELS:
            return _function(f"{name}<{i}>", self.dtype, g.ndim, self.index64)
        n = f", {g.ndim}" if name in ("fused_sampling_plan", "fused_gradient_plan") else ""
        n = f", {_bool(self.deterministic)}" if name.startswith("fused_channels_first") else n
        return _function(f"{name}<{_cuda._CTYPES[self.dtype]}, {i}{n}>", self.dtype, g.ndim, self.index64)

    def view(self, workspace, name: str):
        start, count, dtype = self.offsets[name]
        return cupy.ndarray((count,), dtype=dtype, memptr=workspace.data + start)


def channels_first_kernel(config, sample_stride: int, addresses) -> str:
    """The kernel that takes the input gradient back from its channels-last accumulator to
    (B, C, S) at ``addresses`` (gx, and the accumulator: float32, or the deterministic mode's
    fixed-point sums): ``fused_channels_first_vectors`` where its 16-byte vectors of positions
    are whole and aligned (``S`` and ``sample_stride`` multiples of a vector) and the rule takes it
    (``cuda_fused.vectors_pay``), else ``fused_channels_first``."""
    whole = _fused.whole_vectors(config.dtype, (config.S, sample_stride), addresses)
    pays = _fused.vectors_pay(config.S, config.geom.in_channels)
    return "fused_channels_first_vectors" if whole and pays else "fused_channels_first"


#: The workspace buffers of the data gradients' plan (``fused_gradient_plan``'s outputs).
GRADIENT_PLAN = ("gradient_rows", "gradient_weights", "gradient_slopes", "gradient_masks")


def _launches(config: BackwardConfig, inputs, strides, outs, workspace: int, input_copied: bool = False) -> list:
    """The launches of one backward, recorded (``cuda._kernel_op``, memsets as ``(2, ptr,
    bytes)``) for ``cuda._replay``: ``inputs`` the addresses of (grad_output, x, w, offset, mask,
    bias), ``strides`` the sample strides in elements of (grad_output, x, offset, mask, grad_x,
    grad_offset, grad_mask) (0 for a broadcast batch), ``outs`` the addresses of (grad_x,
    grad_w, grad_offset, grad_mask) and optionally grad_bias (0: not wanted; grad_w only where
    ``config.fused_weight``; grad_bias contiguous). The first chunk's accumulators are cleared
    first, so that every kernel after the first follows another kernel: H200, forward+backward
    1-5% faster with programmatic dependent launch at the transposed, 1D and C64 benchmark shapes
    (NOTES-gpu.md, session 29).
    ``input_copied``: the workspace already holds x channels-last (one chunk; ``FusedBackward.
    record``), its copy is left out."""
    g = config.geom
    gy, x, w, offset, mask, bias = inputs
    gy_bs, x_bs, off_bs, msk_bs, gx_bs, goff_bs, gm_bs = strides
    gx, gw, g_off, g_m, *rest = outs
    gb = rest[0] if rest else 0   # the bias gradient (FusedBackward.bias_gradient)
    g_off, g_m = (g_off if offset else 0), (g_m if mask else 0)
    gw = gw if config.fused_weight else 0
    data = bool(gx or g_off or g_m)
    scatter = bool(gx) and not g_off and not g_m   # the input gradient alone (config.scatter_tile)
    it = config.itemsize
    index = np.int64 if config.index64 else np.int32
    i32, u64, at = np.int32, _cuda._u64, _cuda._at
    kernel = config.kernel
    view = {name: workspace + start for name, (start, _, _) in config.offsets.items()}
    grid = lambda count: (min(-(-count // _THREADS), _MAX_GRID),)  # noqa: E731
    ops = []

    def op(function, grid, block, args, shared_mem=0, waits=True):
        # A kernel that begins with fused::start_after_prerequisites (``waits``) and follows
        # another kernel of the list starts while that one finishes (programmatic dependent
        # launch, ``cuda.PDL``).
        return _cuda._kernel_op(function, grid, block, args, shared_mem,
                                overlap=waits and _cuda._follows_kernel(ops))

    def layout(positions, channels, sample_stride, *addresses, tf32=False, split=False):   # the copy's kernel
        return kernel(_fused.copy_kernel(config.dtype, positions, channels, sample_stride, addresses, tf32, split))

    # The list's leading copies of the call's inputs (the first chunk's, before any other kernel)
    # start beside the kernel before them (EARLY_COPIES): none reads another's output or writes
    # what another touches, and the list's first kernel waited for all before it. Later ones
    # overwrite what the chunk before read.
    copies = 0

    def copy_op(function, grid, args):
        nonlocal copies
        early = EARLY_COPIES and copies == sum(o[0] == 0 for o in ops)
        copies += 1
        ops.append(op(function, grid, (_THREADS,), args + (i32(early),)))

    # the data kernel's operand rows (wt, gycl), by their copies, once: in TF32 rounded, where its
    # MMAs would round every fragment they load; in strict float32 split into 3xTF32's big and
    # small parts, where its warps would split them (the input's xcl keeps its values: corner values)
    rounded, split = config.precision == 1, config.precision == 2

    cols = config.Cg * config.K   # a row of the weight (C_out, C/G, K)
    # the offset and mask gradients: accumulator -> (output, its sample stride, elements a sample,
    # partial-sum slots)
    summed = {"goff": (g_off, goff_bs, config.off_ch * config.Q, config.slots[0]),
              "gmsk": (g_m, gm_bs, config.m_ch * config.Q, config.slots[1])}
    # float32 ones whose samples lie back to back are accumulated in place (the data kernel's
    # float32 atomics straight into them, each chunk's part cleared first; deterministic, with one
    # partial-sum slot, its stores of the sums), not in the workspace and then copied
    # (fused_store): one pass over them fewer
    in_place = {name for name, (target, bs, per_sample, slots) in summed.items()
                if target and config.dtype == np.float32
                and (not config.deterministic or (slots == 1 and DETERMINISTIC_IN_PLACE))
                and (bs == per_sample or g.batch == 1)}
    # the accumulators cleared (the deterministic ones' partial sums are stored, not added):
    # the first chunk's before everything else, so that its kernels follow one another
    cleared = ((("gxq", gx), ("gx_flags", gx), ("bounds", gx)) if config.deterministic else
               (("gxcl", gx), ("goff", g_off), ("gmsk", g_m)))

    def accumulated_at(name, start):   # where the data kernel adds a gradient (the chunk at `start`)
        if name not in in_place:
            return view[name]
        target, bs, _, _ = summed[name]
        return target + start * bs * it

    def clear(start, n):
        for name, target in cleared:
            if target:
                _, count, dt = config.offsets[name]
                if name in in_place:   # the chunk's n samples of the gradient itself
                    count = n * summed[name][2]
                ops.append((2, accumulated_at(name, start), count * dt.itemsize))

    if data:
        clear(0, min(config.chunk, g.batch))
    if gw and config.reduced_splits:   # the one slot every chunk's splits reduce their sums into
        _, count, dt = config.offsets["part"]
        ops.append((2, view["part"], count * dt.itemsize))

    def gradient_plan_op(n, off_n, msk_n):   # the data gradients' plan of a chunk of n samples
        return op(kernel("fused_gradient_plan"), grid(n * config.Q * config.K * config.segments), (_THREADS,), (
            off_n, msk_n, *(u64(view[name]) for name in GRADIENT_PLAN), config.struct, i32(n), i32(g.in_channels),
            i32(config.Go), i32(config.Gm), i32(config.seg_len), i32(config.segments), index(off_bs), index(msk_bs)))

    if data:
        # wt[g, c, t, o]: the weight seen as G samples of C_out/G channels over C/G * K positions,
        # laid out channels-last (zero past C_out/G, then a zero row): the data kernel's A rows
        copy_op(layout(cols, config.Cogp, config.Cog * cols, w, view["wt"], tf32=rounded, split=split),
                _fused.layout_grid(g.groups, config.Cogp, cols), (
            u64(w), u64(view["wt"]), i32(g.groups), i32(config.Cog), i32(config.Cogp), index(cols),
            index(config.Cog * cols), None, None, index(0)))
    det = config.deterministic and bool(gx)
    if det:   # the weight's bound of the fixed-point exponents (fixed_point.cuh)
        ops.append((2, view["weight_bound"], 8))
        # (32 columns a block: det_weight_bound's warps each sum a run of its rows)
        ops.append(op(kernel("weight_bound"), grid(g.groups * cols * (_THREADS // 32)), (_THREADS,), (
            u64(w), i32(g.groups), i32(config.Cog), index(cols), u64(view["weight_bound"])), waits=False))
        gy_bounds = view["bounds"]
        mask_bounds = gy_bounds + 8 * config.chunk if mask else 0
    for start in range(0, g.batch, config.chunk):
        n = min(config.chunk, g.batch - start)
        off_n, msk_n = at(offset, start * off_bs * it), at(mask, start * msk_bs * it)
        gy_n = u64(gy + start * gy_bs * it)
        # the weight gradient's rows of grad_output (gyr), from the copy where there is one
        pp = _fused._round_up(n * config.Q, _VEC[config.dtype])
        rows_copied = data and gw and ROWS_FROM_COPY and not config.ws_weight
        if (g_off or g_m or gw) and not input_copied:   # the corner values
            copy_op(layout(config.S, config.Cp, x_bs, x, view["xcl"]), _fused.layout_grid(n, config.Cp, config.S), (
                u64(x + start * x_bs * it), u64(view["xcl"]), i32(n), i32(g.in_channels), i32(config.Cp),
                index(config.S), index(x_bs), None, None, index(0)))
        if data or gb:   # grad_output channels-last, with its tile sums for the bias gradient
            copy_op(layout(config.Q, config.Cop, gy_bs, gy, view["gycl"], view["gyr"] if rows_copied else 0,
                           tf32=rounded, split=split),
                    _fused.layout_grid(n, config.Cop, config.Q), (
                gy_n, u64(view["gycl"]), i32(n), i32(g.out_channels), i32(config.Cop), index(config.Q),
                index(gy_bs), u64(view["bias_sums"]) if gb else None, u64(view["gyr"]) if rows_copied else None,
                index(pp)))
        if gb:
            ops.append(_fused.channel_totals_op(op, kernel("fused_channel_totals"), g.out_channels, view["bias_sums"],
                                                view["bias_acc"], gb, index(n * config.bias_rows), start, n, g.batch))
        if data:
            if start > 0:
                clear(start, n)
            if det:   # the samples' bounds: max |grad_output[b]| and max |mask[b]|
                bound = kernel("fused_sample_bound")
                for array, per_sample, bs, bounds in ((gy_n, g.out_channels * config.Q, gy_bs, gy_bounds),
                                                      (msk_n, config.m_ch * config.Q, msk_bs, mask_bounds)):
                    if bounds:   # a block a slice of a sample: 4 vectors a thread
                        slices = max(1, min(-(-per_sample // (4 * _VEC[config.dtype] * _THREADS)), 1024))
                        ops.append(op(bound, (n * slices,), (_THREADS,), (
                            array, index(per_sample), index(bs), i32(n), i32(slices), u64(bounds)), waits=False))
            fixed = (u64(view["gxq"]), u64(view["gx_flags"]), u64(view["weight_bound"]), u64(gy_bounds),
                     at(mask_bounds, 0)) if det else (None,) * 5
            accumulators = [u64(accumulated_at(name, start)) if target else None for name, target in (
                ("gxcl", 0 if config.deterministic else gx), ("goff", g_off), ("gmsk", g_m))]
            if config.gradient_plan:
                ops.append(gradient_plan_op(n, off_n, msk_n))
            ops.append(op(kernel("data", scatter), (config.blocks(n, scatter),), (_THREADS,), (
                u64(view["gycl"]), u64(view["wt"]), u64(view["xcl"]), off_n, msk_n,
                *accumulators, config.struct, i32(n),
                i32(g.in_channels), i32(config.Cp), i32(config.Cpa), i32(g.out_channels), i32(config.gy_row),
                i32(g.groups), i32(config.Go), i32(config.Gm), i32(config.wt_row), index(off_bs), index(msk_bs),
                i32(config.seg), *(u64(view[name]) if config.gradient_plan else None for name in GRADIENT_PLAN),
                i32(config.seg_len), *fixed, i32(config.log2_count)),
                config.scatter_smem_bytes if scatter else config.smem_bytes))
            if gx:
                accumulator = view["gxq"] if det else view["gxcl"]
                ops.append(op(kernel(channels_first_kernel(config, gx_bs, (gx, accumulator))),
                              _fused.layout_grid(n, g.in_channels, config.S),
                              (_THREADS,), (
                    None if det else u64(view["gxcl"]), *fixed, i32(config.log2_count), at(bias, 0),
                    u64(gx + start * gx_bs * it), i32(n), i32(g.in_channels), i32(config.Cpa), index(config.S),
                    index(gx_bs))))
            for name, (target, bs, per_sample, slots) in summed.items():
                if target and name not in in_place:
                    ops.append(op(kernel("fused_store"), grid(n * per_sample), (_THREADS,), (
                        u64(view[name]), u64(target + start * bs * it), i32(n), index(per_sample), index(bs),
                        i32(slots))))
        if gw:
            if config.ws_weight:   # in segments of BK positions, segment-major
                segments = -(-n * config.Q // config.weight_tile[2])
                ops.append(op(kernel("fused_position_segments"), grid(segments * g.out_channels * 8), (_THREADS,), (
                    gy_n, u64(view["gyr"]), i32(n), i32(g.out_channels), i32(config.Cog), index(config.Q),
                    index(segments), index(gy_bs), i32(config.precision))))
            elif not rows_copied:
                ops.append(op(kernel("fused_position_rows"), grid(g.out_channels * pp // _VEC[config.dtype]),
                              (_THREADS,), (gy_n, u64(view["gyr"]), i32(n), i32(g.out_channels), index(config.Q),
                                            index(pp), index(gy_bs))))
            plan_rows, plan_weights, plan_masks = (u64(view[name]) if name else None for name in config.weight_plan)
            if config.plan_shared and not data:   # the data kernel's plan, made here for the weight kernel
                ops.append(gradient_plan_op(n, off_n, msk_n))
            if config.sampling_plan and not config.plan_shared:
                ops.append(op(kernel("fused_sampling_plan"), grid(n * config.Q * config.K * config.segments),
                              (_THREADS,), (off_n, msk_n, plan_rows, plan_weights, config.struct, i32(n),
                                            i32(g.in_channels), i32(config.Go), i32(config.Gm), i32(config.seg_len),
                                            i32(config.segments), index(off_bs), index(msk_bs))))
            if config.ws_weight:
                args = (u64(view["gyr"]), u64(view["xcl"]), plan_rows, plan_weights, plan_masks, u64(view["part"]),
                        config.struct, i32(n), i32(g.in_channels), i32(config.Cp), i32(g.out_channels),
                        i32(g.groups), i32(config.seg_len), i32(config.weight_steps(n)),
                        i32(config.weight_sums(start)),
                        i32(config.splits * config.weight_tiles))
            else:
                args = (u64(view["gyr"]), u64(view["xcl"]), off_n, msk_n, plan_rows, plan_weights, plan_masks,
                        u64(view["part"]), config.struct, i32(n), i32(g.in_channels), i32(config.Cp),
                        i32(g.out_channels), i32(g.groups), i32(config.Go), i32(config.Gm), i32(config.seg_len),
                        index(pp), index(off_bs), index(msk_bs), i32(config.splits), i32(config.weight_steps(n)),
                        i32(config.weight_sums(start)))
            ops.append(op(kernel("weight"), (config.weight_grid,), (config.weight_threads,), args,
                          config.weight_smem_bytes))
    if gw:
        ops.append(op(kernel("fused_weight_sum"), grid(g.out_channels * config.Cg * config.K), (_THREADS,), (
            u64(view["part"]), u64(gw), i32(config.part_slots), i32(g.out_channels), i32(config.Cg), i32(config.K))))
    return ops


def _address(array) -> int:
    return 0 if array is None else array.data.ptr


def run_gradients(config: BackwardConfig, args: dict, out: dict, workspace) -> None:
    """The wanted ones of the input, offset and mask gradients, and the weight gradient where
    ``config.fused_weight``, into ``out`` (``args`` and ``out`` as the ``conv_backward``
    primitive's: any batch strides), on CuPy's current stream."""
    _cuda._replay(gradient_launches(config, args, out, workspace), None, cupy.cuda.get_current_stream().ptr)


def gradient_launches(config: BackwardConfig, args: dict, out: dict, workspace) -> list:
    """``run_gradients``' launches, recorded (``_launches``) and not run."""
    wanted = args["wanted"]
    outs = tuple(out.get(name) if name in wanted else None for name in ("input", "weight", "offset", "mask", "bias"))
    bs = _fused._batch_stride
    arrays = (args["grad_output"], args["input"], args["offset"], args["mask"], outs[0], outs[2], outs[3])
    strides = tuple(0 if a is None else bs(a) for a in arrays)
    inputs = tuple(_address(args.get(name)) for name in ("grad_output", "input", "weight", "offset", "mask", "bias"))
    return _launches(config, inputs, strides, tuple(_address(a) for a in outs), workspace.data.ptr)


# ---------------------------------------------------------------------------------------------
# The backend contract (dcn_cupy/_backends/__init__.py)


class FusedBackward:
    """The executable of one plan's backward: the fused gradients; the weight gradient through
    cuda/im2col (on the same workspace, after the fused kernels) where it is not fused; the bias
    gradient (``bias_gradient``) from the sums its copy of grad_output takes per tile. Calls on
    C-contiguous arrays replay launches recorded per set of addresses (``run_pointers``)."""

    # The plan puts "bias" in wanted (a contiguous output after the other four) beside a data
    # gradient: grad_output is then read once for the channels-last copy and the bias gradient.
    # H200, f+b with a bias 0.4-2.0% faster (B=16 C256 L4096 TF32 1.253 -> 1.237 ms, B=8 C256
    # 56x56 TF32 1.323 -> 1.311); the bias gradient alone or beside the weight's alone, where the
    # copy is not made anyway, stays the plan's channel_sum (1D TF32 0.028 ms against 0.053 for a
    # copy made for it; NOTES-gpu.md, session 31).
    bias_gradient = True
    bias_gradient_with = frozenset(("input", "offset", "mask"))

    def __init__(self, config: BackwardConfig, weight_gradient=None):
        self.config = config
        self._weight = weight_gradient
        # cuda/im2col's weight gradient sampling its columns from this backward's channels-last
        # copy of x (``weight_through_im2col``) runs on the workspace past that copy
        self._weight_at = 0
        if weight_gradient is not None and weight_gradient.copy_given:
            if not copy_shareable(config):
                raise ValueError("cuda/im2col's weight gradient can take the fused backward's channels-last copy "
                                 "only where that holds the whole batch unpadded at the workspace's start")
            _, count, dt = config.offsets["xcl"]
            self._weight_at = _fused._round_up(count * dt.itemsize, _ALIGN)
        self.workspace_bytes = max(config.workspace_bytes,
                                   self._weight_at + weight_gradient.workspace_bytes if weight_gradient else 0)
        self.description = config.description
        if weight_gradient is not None:   # what that weight gradient does: its panels, split GEMM
            self.description += (f" ({weight_gradient.description}"
                                 + (", its columns from the channels-last copy of the input" if self._weight_at else "")
                                 + ")")
        # the raw-address path: ours always; cuda/im2col's weight gradient where it has one
        self.pointer_path = weight_gradient is None or bool(getattr(weight_gradient, "pointer_path", False))
        self._recordings = _cuda.Recordings()
        g = config.geom
        self._strides = (g.out_channels * config.Q, g.in_channels * config.S, config.off_ch * config.Q,
                         config.m_ch * config.Q, g.in_channels * config.S, config.off_ch * config.Q,
                         config.m_ch * config.Q)

    def run(self, args: dict, out: dict, workspace) -> None:
        if self.config.geom.batch == 0:
            return
        wanted = args["wanted"]
        arrays = [args.get(k) for k in ("grad_output", "input", "weight", "offset", "mask", "bias")]
        outs = [out.get(k) if k in wanted else None for k in ("input", "weight", "offset", "mask", "bias")]
        if self.pointer_path and _cuda._plain_batch(*arrays, *outs):
            self.run_pointers(tuple(_address(a) for a in arrays), wanted, tuple(_address(a) for a in outs),
                              workspace.data.ptr, cupy.cuda.get_current_stream().ptr)
            return
        run_gradients(self.config, args, out, workspace)
        if "weight" in wanted and not self.config.fused_weight:
            copy = self._weight_copy(self.config.view(workspace, "xcl") if self._weight_at else None,
                                     args["offset"] is not None and "offset" in wanted,
                                     args["mask"] is not None and "mask" in wanted)
            self._weight.run(dict(args, wanted=frozenset(("weight",))), {"weight": out["weight"]},
                             workspace[self._weight_at:], copy)

    def _weight_copy(self, xcl, offset_gradient: bool, mask_gradient: bool, input_copied: bool = False):
        """``copy`` for cuda/im2col's weight gradient (``_cuda._Backward``): ``(xcl, made)``, the
        channels-last copy of x (array or address) and whether this call's launches leave it made
        (``_launches`` copies it for the offset and mask gradients, or found it there:
        ``input_copied``); None where it makes its own."""
        if not self._weight_at:
            return None
        return xcl, input_copied or offset_gradient or mask_gradient

    def run_pointers(self, inputs, wanted, outs, workspace: int, stream: int) -> None:
        """``run`` on raw device addresses of C-contiguous batched arrays: inputs (grad_output, x,
        w, offset, mask, bias), outputs (input, weight, offset, mask, and the bias where wanted;
        0 where not wanted), on ``stream`` (launches recorded once per set of addresses, then
        replayed)."""
        key = inputs + outs + (workspace,)
        ops = self._recordings.get(key)
        if ops is None:
            ops = self._recordings.put(key, _launches(self.config, inputs, self._strides, outs, workspace))
        _cuda._replay(ops, None, stream)
        if outs[1] and not self.config.fused_weight:
            self._weight.run_pointers(inputs, frozenset(("weight",)), (0, outs[1], 0, 0), workspace + self._weight_at,
                                      stream, self._weight_copy(workspace, bool(inputs[3] and outs[2]),
                                                                bool(inputs[4] and outs[3])))

    def record(self, inputs, wanted, outs, workspace: int, input_channels_last=None):
        """``run_pointers``' launches, recorded and not run (``cuda._replay``'s ops), for a plan
        that replays them in one list with another executable's; None where they are not all
        recordable (a weight gradient through cuda/im2col that makes its own channels-last copy).
        ``input_channels_last``: what the launches before these left at the workspace's start
        (``FusedForward.channels_last_input``); where that is this backward's channels-last
        input, its copy is left out."""
        c = self.config
        through = outs[1] and not c.fused_weight
        if through and not self._weight_at:
            return None
        copied = (input_channels_last is not None and c.chunk >= c.geom.batch and c.offsets["xcl"][0] == 0
                  and tuple(input_channels_last) == (c.Cp, c.geom.batch * c.S + 1))
        ops = _launches(c, inputs, self._strides, outs, workspace, input_copied=copied)
        if through:
            copy = self._weight_copy(workspace, bool(inputs[3] and outs[2]), bool(inputs[4] and outs[3]), copied)
            ops += self._weight.record_led_by_handle(inputs, frozenset(("weight",)), (0, outs[1], 0, 0),
                                                     workspace + self._weight_at, copy)
        return ops


SERVED_DTYPES = _fused.SERVED_DTYPES
#: (device, geometry, dtype, precision) -> (fused ms, im2col ms) and -> whether the fused
#: backward's weight gradient is its own (else cuda/im2col's): measured once per key.
_versus = {}
_fused_weight = {}
#: The fused backward leaves the weight gradient to cuda/im2col only where that measured faster
#: than this fraction of its own weight gradient's time: its own needs no columns buffer. At B=8
#: C256 56x56 the two measured within 3% either way (H200, own / through: fp16 0.974 and 1.004,
#: TF32 1.004 and 0.999 in two rounds of one process), and the choice flipped between runs, with
#: the f+b peak between 131 and 275 MiB in fp16 (NOTES-gpu.md, sessions 26 and 27). B=16 C512
#: 14x14 still takes cuda/im2col's (own 1.31x slower), B=32 C64 56x56 its own (0.73x).
WEIGHT_COLUMNS_MARGIN = 0.95


#: Where the weight gradient goes through cuda/im2col with columns from its channels-last
#: sampler, that samples the fused backward's channels-last copy of x (made for the offset and
#: mask gradients, or left by the transposed backward's input gradient) rather than a copy of its
#: own; False: its own copy (the A/B).
SHARED_COPY = True


#: cuda/im2col's weight gradient beside the fused data gradients lays out only what the weight
#: gradient needs (``_cuda._Backward(weight_only=True)``): not the whole backward's column grads
#: and float32 input-gradient accumulator, which it never touches. The backward's workspace (132
#: SMs): B=16 C512 14x14, where the plans take it in fp16 and TF32, 111.9 -> 50.7 MiB in fp16 and
#: 130.5 -> 75.4 in TF32; 3D B=2 C32 32^3 in one chunk of the batch, not two, sharing the fused
#: backward's channels-last copy of x: 178.9 -> 124.9 MiB in fp16, 232.8 -> 240.8 in TF32 (within
#: the 256 MiB limit). H100, session 78 (panels and one GEMM off): f+b peak 122.7 -> 61.5 MiB in
#: fp16, 152.1 -> 97.0 in TF32, times level (f+b 1.002x, 1.000x); 3D 200.5 -> 146.5 in fp16 and
#: 276.0 -> 284.0 in TF32, f+b 0.979x and 0.982x. False: the whole backward's
#: workspace (the A/B).
WEIGHT_ONLY_WORKSPACE = True


#: That weight gradient's columns in panels of input channels (``_cuda.column_panels``), sampled
#: and multiplied in turn: the fewest whose columns are no larger than the fused part's
#: workspace, so that they no longer set the backward's. Computed (132 SMs, weight-only), B=16
#: C512 14x14: two panels of 256 channels, the backward's workspace 50.7 -> 36.9 MiB in fp16 and
#: 75.4 -> 47.8 in TF32; 3D B=2 C32 keeps one (its sampler's tile is all 32 channels). H100,
#: session 78: f+b peak 52.5 -> 38.7 MiB in fp16 and 97.0 -> 69.4 in TF32 (below torchvision's 42
#: and 84), for f+b 3.2% and 5.6% slower (a second sampling launch, two half-width GEMMs): on for
#: the memory. False: whole columns (the A/B).
WEIGHT_COLUMN_PANELS = True


def copy_shareable(config: BackwardConfig) -> bool:
    """Whether ``config``'s channels-last copy of x is what cuda/im2col's sampler reads: the whole
    batch, unpadded, at the workspace's start."""
    return (config.chunk >= config.geom.batch and config.Cp == config.geom.in_channels
            and config.offsets["xcl"][0] == 0)


def weight_through_im2col(config: BackwardConfig, spec):
    """cuda/im2col's backward for the weight gradient beside ``config``'s fused gradients: taking
    their channels-last copy of x (``SHARED_COPY``) where it can (``copy_shareable``), with a
    workspace for the weight gradient alone (``WEIGHT_ONLY_WORKSPACE``), its columns in panels
    no larger than the fused part's workspace (``WEIGHT_COLUMN_PANELS``)."""
    lean = WEIGHT_ONLY_WORKSPACE
    return _cuda._Backward(spec, shared_copy=SHARED_COPY and copy_shareable(config), weight_only=lean,
                           column_bytes=config.workspace_bytes if lean and WEIGHT_COLUMN_PANELS else None)


def _key(geom, dtype, allow_tf32: bool) -> tuple:
    return (cupy.cuda.runtime.getDevice(), geom, np.dtype(dtype).str, bool(allow_tf32) and np.dtype(dtype) == np.float32)


def fused_versus_im2col(geom, dtype, allow_tf32: bool):
    """``(fused ms, im2col ms, fused split ms, im2col split ms)`` on one batch chunk of random
    data, the fused backward against cuda/im2col's, timed alike (``cuda_fused._best_times``):
    every gradient in one call (a convolution's backward), and split as a transposed
    convolution uses the backward (the input gradient alone: its forward; then the weight,
    offset and mask gradients). The fused one takes, per use, its own weight gradient unless
    cuda/im2col's measured faster than ``WEIGHT_COLUMNS_MARGIN`` of its time (kept for the plan:
    ``fused_weight_choice``). None when tuning is off or a CUDA graph is being captured. Cached
    per device, geometry, dtype and precision."""
    dtype = np.dtype(dtype)
    key = _key(geom, dtype, allow_tf32)
    found = _versus.get(key)
    if found is not None or not _fused.TUNE or _fused._capturing():
        return found
    chunk = BackwardConfig(geom, dtype, allow_tf32).chunk
    with _fused.private_pool():
        times = _time_one_chunk(geom.with_batch(chunk), dtype, allow_tf32)
    (own, own_split), (through, through_split), (im2col, im2col_split) = times
    # the weight gradient's path per use: every gradient in one call (a convolution's backward),
    # or split (a transposed convolution's); its own unless cuda/im2col's is clearly faster
    mine = _fused_weight[key + (False,)] = not through < WEIGHT_COLUMNS_MARGIN * own
    mine_split = _fused_weight[key + (True,)] = not through_split < WEIGHT_COLUMNS_MARGIN * own_split
    found = _versus[key] = (own if mine else through, im2col, own_split if mine_split else through_split,
                            im2col_split)
    return found


def fused_weight_choice(geom, dtype, allow_tf32: bool, transposed: bool = False):
    """Whether the fused backward computes the weight gradient itself (True), leaves it to
    cuda/im2col (False), or None: not measured (the rule: itself where it can); for the
    backward of a convolution, or (``transposed``) of a transposed convolution."""
    return _fused_weight.get(_key(geom, dtype, allow_tf32) + (bool(transposed),))


def _time_one_chunk(g, dtype, allow_tf32: bool) -> tuple:
    """((all, split) ms) of the fused backward with its own weight gradient (inf where it has
    none), with cuda/im2col's, and of cuda/im2col's backward."""
    spec = _cuda._spec(g, dtype, allow_tf32)
    sms = _fused._multiprocessors()
    im2col = _cuda._Backward(spec)
    own = BackwardConfig(g, dtype, allow_tf32, multiprocessors=sms)
    through = BackwardConfig(g, dtype, allow_tf32, multiprocessors=sms, fused_weight=False)
    executables = [FusedBackward(own), FusedBackward(through, weight_through_im2col(through, spec)), im2col]
    if not own.fused_weight:
        executables = executables[1:]
    (x, w, offset, mask, _), _ = _fused._random_arguments(g, dtype)
    gy = cupy.random.default_rng(1).standard_normal(g.y_shape, dtype=np.float32).astype(dtype)
    args = {"grad_output": gy, "input": x, "weight": w, "offset": offset, "mask": mask, "bias": None}
    every = frozenset(name for name, a in (("input", x), ("weight", w), ("offset", offset), ("mask", mask))
                      if a is not None)
    out = {name: cupy.empty_like(args[name]) for name in every}
    params = every - {"input"}

    def split(e, ws):
        e.run(dict(args, input=None, wanted=frozenset(("input",))), {"input": out["input"]}, ws)
        e.run(dict(args, wanted=params), {name: out[name] for name in params}, ws)

    spaces = [cupy.empty(e.workspace_bytes, dtype=np.uint8) for e in executables]
    runs = [functools.partial(e.run, dict(args, wanted=every), out, ws) for e, ws in zip(executables, spaces)]
    runs += [functools.partial(split, e, ws) for e, ws in zip(executables, spaces)]
    best = _fused._best_times(runs, rounds=3, repeats=2)
    cupy.cuda.get_current_stream().synchronize()
    pairs = list(zip(best[:len(executables)], best[len(executables):]))
    return tuple(pairs) if own.fused_weight else ((float("inf"), float("inf")),) + tuple(pairs)


class FusedBackwardBackend:
    """``cuda/fused-backward``: ``conv_backward`` for float16, bfloat16 and float32 (TF32 or
    3xTF32) on CUDA devices of compute capability 8.0 or more, for the geometries of
    :func:`unsupported`; chosen automatically where it measured faster than cuda/im2col."""

    device = "cuda"
    algorithm = "fused-backward"
    priority = 20              # above cuda/im2col wherever it serves
    primitives = ("conv_backward",)

    def serves(self, spec, primitive: str):
        if primitive != "conv_backward":
            return f"cuda/fused-backward computes only conv_backward, not {primitive}"
        if spec.device != "cuda":
            return f"cuda/fused-backward runs on CUDA devices, not {spec.device}"
        dtype = np.dtype(spec.dtype)
        if dtype not in SERVED_DTYPES:
            return f"cuda/fused-backward serves float16, bfloat16 and float32; {dtype} stays on cuda/im2col"
        reason = unsupported(spec.geom, dtype)
        if reason is not None:
            return reason
        try:
            capability = int(cupy.cuda.Device(spec.device_id).compute_capability)
        except Exception as error:  # no driver or no such device: nothing to run on
            return f"cuda/fused-backward found no CUDA device {spec.device_id} ({type(error).__name__})"
        if capability < 80:
            return f"cuda/fused-backward needs compute capability 8.0 or more (cp.async, mma.sync), got {capability / 10}"
        return None

    def recommends(self, spec, primitive: str):
        """None where the automatic choice should take it; else why not: cuda/im2col measured
        faster on one batch chunk of the configuration, used as the plan uses it: every gradient
        in one call, or split as a transposed convolution's (without a measurement, the fused
        one). Deterministic plans follow the same measurement (the default mode's); where it
        says cuda/im2col, cuda/im2col-deterministic serves them."""
        try:
            with cupy.cuda.Device(spec.device_id):
                timed = fused_versus_im2col(spec.geom, spec.dtype, bool(spec.allow_tf32))
        except cupy.cuda.runtime.CUDARuntimeError:   # no usable device here: the rule (fused)
            timed = None
        if timed is not None:
            fused, im2col = timed[2:] if getattr(spec, "transposed", False) else timed[:2]
            if im2col < fused:
                use = "as a transposed convolution's" if getattr(spec, "transposed", False) else "every gradient in one call"
                return (f"cuda/im2col measured faster for this configuration ({im2col:.3f} ms against "
                        f"{fused:.3f} ms on one batch chunk, {use})")
        return None

    def build(self, spec, primitive: str) -> FusedBackward:
        reason = self.serves(spec, primitive)
        if reason is not None:
            raise ValueError(reason)
        with cupy.cuda.Device(spec.device_id):
            config = BackwardConfig(spec.geom, spec.dtype, bool(spec.allow_tf32),
                                    multiprocessors=_fused._multiprocessors(),
                                    fused_weight=fused_weight_choice(spec.geom, spec.dtype, spec.allow_tf32,
                                                                     getattr(spec, "transposed", False)),
                                    deterministic=spec.deterministic)
            names = ["fused_channels_last", "fused_channels_last_vectors", "fused_channels_first",
                     "fused_channels_first_vectors", "fused_store", "fused_channel_totals",
                     "fused_position_rows", "fused_position_segments", "fused_weight_sum", "fused_sampling_plan",
                     "fused_gradient_plan",
                     "data", "weight"]
            if config.deterministic:
                names += ["weight_bound", "fused_sample_bound"]
            for name in names:
                config.kernel(name)   # compile now, never during a CUDA-graph capture
            config.kernel("data", scatter=True)
            weight = None if config.fused_weight else weight_through_im2col(config, spec)
        return FusedBackward(config, weight)


BACKEND = FusedBackwardBackend()
