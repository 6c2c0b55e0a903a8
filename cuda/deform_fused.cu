// dcn_cupy: the fused deformable convolution forward (implicit GEMM on tensor cores).
//
// y[b, o, q] = bias[o] + sum_{t, c in group(o)} W[o, c, t] * m * sample(x[b, c], P(q, t))
// computed without a columns buffer in global memory. Per block an output tile of BM output
// channels (of one conv group) x BN positions p = b*Q + q (positions may span samples).
// The reduction runs over steps (tap t, chunk of BK input channels of the group):
//   * the weight tile (BM x BK, from the re-laid weights wr[o, t, c]) is copied to shared
//     memory with cp.async (zero-filled past C_out/G);
//   * the sampled tile (BK x BN) is built straight into shared memory from the CHANNELS-LAST
//     input xcl[b, s, c] (row stride Cp, a multiple of the vector width): THREADS/BN threads
//     per position, each owning CPT = BK*BN/THREADS consecutive channels; the 2^N corner rows
//     and weights (mask included) of its (position, tap, offset group, mask group) live in
//     registers and are recomputed only when that key changes (the next key's offsets and mask
//     are fetched a step ahead); each corner is one 16-byte load of consecutive channels, a
//     corner not read loading the zero row after the input's rows instead, with weight 0, so
//     that no load branches ("uniform" kernels, chosen when no thread's channels cross a conv /
//     offset / mask group boundary), else one load per channel with the key checked per channel;
//   * the tiles are multiplied on tensor cores with float32 accumulation: ENGINE 0, mma.sync
//     (fp16 / bf16 m16n8k16 in their own format, float32 as TF32 m16n8k8 (PREC 1) or 3xTF32
//     (PREC 2: a = big + small, three products, float32 accuracy)); ENGINE 1, wgmma (sm_90a,
//     two warpgroups, m64nBNk16 / k8 from shared-memory descriptors; fp16, bf16, TF32), which
//     runs asynchronously while the threads sample the next step; ENGINE 3, wgmma with the warps
//     specialised (sm_90a): two warpgroups (one for a 64-row tile) only multiply, the other
//     threads only sample, into a ring of DEPTH stages paced by named barriers, each stage's
//     weight tile one bulk copy (cp.async.bulk on an mbarrier) of fused_weight_tiles' layout, so
//     that sampling runs up to DEPTH steps ahead of the MMAs and neither waits on the other's
//     latency; fp16, bf16, TF32 and 3xTF32 (each tile stored as big and small parts,
//     fused::split_tf32, and multiplied as a_small*b_big + a_big*b_small + a_big*b_big).
// The next step's weight copy and corner loads are issued before this step's MMAs complete
// (two shared-memory buffers, one barrier per step). ENGINE 2 (benchmarks only, not in the
// host's TILES: measured slower, NOTES-gpu.md) is ENGINE 0 with the corners copied by cp.async
// DEPTH steps ahead into a shared-memory ring and blended from there.
//
// Semantics (DESIGN.md section 1): a position with a coordinate <= -1, >= S_a or non-finite
// samples 0; a corner outside the grid or of N-linear weight exactly 0 is not read.
//
// The step order is a launch argument (taps_inner): chunk-major keeps a chunk's corners in L1
// across the taps (corner sets computed per tap and chunk); tap-major computes each corner set
// once per tap for all the thread's chunks.
//
// PLAN (16-byte sampler, engines 0 and 1): the corner rows and weights of each (tap, segment of
// channels sharing an offset and a mask group) are read from the chunk's sampling plan
// (fused_sampling_plan, fused_common.cuh: plan_rows / plan_weights, segments of seg_len
// channels), computed once per position instead of by each thread of the position. PLAN 2
// (engines 0 and 3, one offset and one mask group): each sampling warp computes its own
// positions' corners for a batch of taps at once, every lane one (position, tap), into
// warp-private shared memory, a batch ahead of its samplers, which read them from there: the
// TPP threads of a position no longer each compute the same corners (PPW = 32 / TPP positions a
// warp, TPP taps a batch; the offsets and mask of the next batch are prefetched). PLAN 3 (ENGINE
// 3, one tile a block): PLAN 2 with two steps of corner loads in flight a sampler (AHEAD), each
// step's loads issued two steps before its blend; chosen by the tuner where cuda_fused lists the
// tile (LOADS_AHEAD_TILES).
//
// Template parameters: T storage type, I index type (int or long long), N spatial dims,
// PREC (0: T's own tensor-core format; 1: TF32; 2: 3xTF32), the tile BM x BN x BK, MINB (blocks
// per multiprocessor asked of the register allocator), UNIFORM (16-byte-vector sampler), ENGINE,
// DEPTH (ENGINE 2's and ENGINE 3's rings), THREADS (per block: 256, or 512 for mma.sync tiles,
// which halves each thread's accumulators and sampling for a tile as tall as 256 rows; ENGINE 3:
// 256 MMA threads, 128 for a 64-row tile, plus the samplers), PLAN, PERSIST (ENGINE 3 with two
// MMA warpgroups: a block computes tiles blockIdx.x, blockIdx.x + gridDim.x, ... through one
// ring, the samplers filling the next tile's stages while the MMA warps finish and store a tile;
// persistent grids of the blocks the device holds at once). Dynamic shared memory:
// 2 * (BM + BN) * (BK + PAD) elements of T (PAD = 0 for wgmma); ENGINE 3: DEPTH * (BM + BN) * BK,
// twice that in 3xTF32; ENGINE 2: cuda_fused.smem_bytes.

#include "fused_common.cuh"
#include "wgmma.cuh"

// Experiment switch of ENGINE 3 (benchmarks/fused_variants.py builds modules with it set):
// DCN_FUSED_WS_EXPERIMENT 1 skips the MMAs, 2 the corner loads and blends (timing only: wrong
// results), so that each side of the ring can be timed alone.
#ifndef DCN_FUSED_WS_EXPERIMENT
#define DCN_FUSED_WS_EXPERIMENT 0
#endif
// ENGINE 3 in 3xTF32: the sampling warpgroups' registers per thread once the roles split (0: the
// launch's, for all). The MMA warpgroups take what they give back: the promoted accumulators (d
// and p) then fit without spills.
#ifndef DCN_FUSED_SAMPLER_REGS
#define DCN_FUSED_SAMPLER_REGS 96
#endif
// The same split for ENGINE 3's other precisions where 512 or more threads sample (the 768-thread
// tiles: at the launch's 80 registers their MMA warpgroups spill 740-870 bytes; with 72 for the
// samplers, none in 1D and 2D, while 3D's samplers spill, so cuda_fused builds no 3D kernel of
// them). H200, 256x64 whole forward with 512 samplers at 72 registers against 256 samplers
// (NOTES-gpu.md sessions 38 and 39): B=8 C256 56x56 fp16 125.0 -> 119.9 us, TF32 224.7 -> 215.7
// (at 64 registers TF32 261.5). Experiment switch: 0 splits nothing there.
#ifndef DCN_FUSED_WIDE_SAMPLER_REGS
#define DCN_FUSED_WIDE_SAMPLER_REGS 72
#endif
// ENGINE 3 with the warps' corner batches and 128-byte chunk rows: each 8-lane phase of a
// sampling warp loads and stores one position's chunk row, into a sampled tile in wgmma's
// 128-byte swizzle (1, the default), or 4-thread slices of two positions, into the unswizzled
// core-matrix tile (0: the layout before session 35, kept for A/B timing).
#ifndef DCN_FUSED_ROW_PHASES
#define DCN_FUSED_ROW_PHASES 1
#endif
// Experiment switch of ENGINE 3 (benchmarks/fused_variants.py): the steps of corner loads a
// sampler keeps in flight, 1 (the default) or 2: each step's loads issued two steps before its
// blend, in registers of their own (the C64 forward waits on them; with 2, B=32 C64 fp16's
// 64x64x32 tile measured 6% faster, still behind the default 64x64x64: NOTES-gpu.md session 28).
// With 2, PLAN 0 and 1 of a 256-row tile are wrong: the samplers' step cursor runs past the step
// whose weights their first thread copies next (NOTES-gpu.md session 58); PLAN 3 is PLAN 2 at 2.
#ifndef DCN_FUSED_LOADS_AHEAD
#define DCN_FUSED_LOADS_AHEAD 1
#endif
// ENGINE 3's samplers with their last step peeled off their loop (no branch at the loop's head),
// in the half types. Where ptxas waited on a step's corner loads before the barrier on the next
// free slot (PLAN 0's 256-row tiles), it then waits after it. Kernel time peeled / not, H200
// (NOTES-gpu.md session 37): fp16 with the warps' corner batches 0.99x (C256, 256x64x64) to 0.96x
// (C64, 64x64x64); TF32 256x64x32 1.06x at C256, so float keeps the loop. Experiment switch: 1
// peels every dtype, 0 none, -1 (default) the half types.
#ifndef DCN_FUSED_PEEL_LAST_STEP
#define DCN_FUSED_PEEL_LAST_STEP -1
#endif
// ENGINE 3 in 3xTF32 (DCN_PROMOTE_3XTF32): the channels of K whose products p sums before it
// joins d in float32, in whole steps (at least one). Each promotion drains the MMA warpgroup's
// wgmmas; a longer run drains less often but spans more of the tensor cores' truncating
// accumulation. H200, strict float32 whole forward, 256x64x16 (4 steps a run against 1): B=16
// C512 14x14 327 -> 311 us, relative error 6.0e-7 -> 7.6e-7 (float32 FMAs: 6.4e-7); B=8 C256
// 56x56 511 -> 490 us, 1.94e-6 -> 2.00e-6 (NOTES-gpu.md session 38). 16 promotes every step of
// those tiles, as before.
#ifndef DCN_FUSED_PROMOTE_CHANNELS
#define DCN_FUSED_PROMOTE_CHANNELS 64
#endif
// With 2, the samplers' registers per thread once the roles split (0: the launch's): the MMA
// warpgroups drop to what is left (at least 48), as 3xTF32's split does the other way round.
#ifndef DCN_FUSED_AHEAD_REGS
#define DCN_FUSED_AHEAD_REGS 0
#endif
// ENGINE 3's MMAs with the operands' roles swapped in 3xTF32: the sampled tile's 64 positions as
// the wgmma's M and each MMA warpgroup's 128 rows of weights as its N, one m64n128 a k step where
// the other order issues two m64n64 (as the warp-specialised weight kernel's DCN_WS_CHANNEL_ROWS:
// 6 KiB of operands read a k step for 8; the same products in the same order). Taken by 3xTF32's
// 64-position tiles of two 128-row MMA warpgroups whose launch gives a thread 96 registers or more
// (ptxas: an m64n128's 64 accumulators do not fit 80). The epilogue then stores one value a store,
// 8 lanes' positions consecutive. H200 (NOTES-gpu.md, session 64): strict f+b B=8 C256 56x56 0.982x,
// 1D 0.987x; TF32 and fp16, whose single MMA a k step leaves the shared-memory reads less of the
// time, level or slower (1D TF32 1.012x), so they keep the other order. 0: the other order (the A/B).
#ifndef DCN_FUSED_POSITION_ROWS
#define DCN_FUSED_POSITION_ROWS 1
#endif

namespace fused {

// Threads per block of the fused forward unless a tile says otherwise (mma.sync tiles may take
// 512): BN/32 warps along the positions x the rest along the output channels.
constexpr int THREADS = 256;

// Element offset of 16-byte vector kv of row `row` in a shared tile of rows of BK elements:
// ENGINE 0 (mma.sync): rows padded to LD; ENGINE 1 (wgmma, no swizzle, K-major): 8x16-byte
// "core matrices" of 8 consecutive rows, contiguous (128 bytes), the BK/VEC core matrices of an
// 8-row group next to each other (leading byte offset 128, stride byte offset BK/VEC*128).
template <int ENGINE, int LD, int BK, int VEC>
__device__ __forceinline__ int tile_offset(int row, int kv) {
    if constexpr (ENGINE != 1 && ENGINE != 3) {
        return row * LD + kv * VEC;
    } else {
        return ((row >> 3) * (BK / VEC) + kv) * (8 * VEC) + (row & 7) * VEC;
    }
}

}  // namespace fused

// w (C_out, C/G, K) -> wr (C_out, K, Cgp): the GEMM's A operand, rows contiguous along the
// input channels of one tap; channels >= C/G zero; float32 values rounded to TF32 when
// round_tf32 (the TF32 wgmma reads A unrounded). One thread per (o, c), taps in a loop.
template <typename T, typename I>
__global__ void fused_weight_rows(const T* __restrict__ w, T* __restrict__ wr, const int out_channels,
                                  const int Cg, const int Cgp, const int K, const int round_tf32) {
    const I total = (I)out_channels * Cgp;
    fused::launch_dependents();
    for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
        const int c = (int)(idx % Cgp);
        const I o = idx / Cgp;
        for (int t = 0; t < K; ++t) {
            const T v = c < Cg ? maybe_tf32(w[(o * Cg + c) * K + t], round_tf32) : Traits<T>::store(0.0f);
            wr[(o * K + t) * Cgp + c] = v;
        }
    }
    fused::wait_prerequisites();   // (launched overlapping the channels-last copy: done only after it)
}

// The 3xTF32 parts of a weight (fused::split_tf32); the half types have none.
template <typename T>
__device__ __forceinline__ void weight_parts(T v, T& big, T& small) { big = v; small = v; }
template <>
__device__ __forceinline__ void weight_parts<float>(float v, float& big, float& small) {
    unsigned b, s;
    fused::split_tf32(v, b, s);
    big = __uint_as_float(b);
    small = __uint_as_float(s);
}

// w (C_out, C/G, K) -> ENGINE 3's weight tiles: for each (group g, tile of BM output channels
// mt, tap t, chunk of BK channels ch), tile ((g * m_tiles + mt) * K + t) * chunks + ch, its
// BM x BK values in the shared tile's own order (8-row x 16-byte core matrices, fused::tile_offset
// for ENGINE 3), zero past C_out/G and C/G: one contiguous block a stage, for one bulk copy.
// precision: 0 the values, 1 TF32-rounded, 2 (3xTF32) the big parts' tile then the small parts'
// (split_tf32), the block twice as long.
// One thread per (group, row, vector of VEC channels, tap) writes one 16-byte vector: 8
// consecutive threads take the 8 rows of a core matrix (128 contiguous bytes), the taps next, so
// that the K threads of a vector read its VEC x K values, which lie together in w, at once (one
// thread looping over the taps waited on its loads K times). H200, whole forward: B=8 C256 56x56
// fp16 131 -> 126 us, TF32 228 -> 226; B=16 C512 14x14 3xTF32 323 -> 325 (NOTES-gpu.md session 36).
template <typename T, typename I>
__global__ void fused_weight_tiles(const T* __restrict__ w, T* __restrict__ wt, const int Cog, const int groups,
                                   const int Cg, const int K, const int BM, const int BK, const int precision) {
    constexpr int VEC = fused::Tile<T>::VEC;
    const int m_tiles = (Cog + BM - 1) / BM, chunks = (Cg + BK - 1) / BK;
    const int kvs = BK / VEC;                    // vectors per tile row
    const int cvecs = chunks * kvs;              // vectors per (zero-padded) row of the group
    const int row_groups = m_tiles * BM / 8;     // 8-row groups per (zero-padded) group
    const I per_tile = (I)BM * BK;
    const I tile_stride = precision == 2 ? 2 * per_tile : per_tile;
    const I total = (I)groups * row_groups * 8 * cvecs * K;
    fused::launch_dependents();
    for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
        const int r8 = (int)(idx & 7);
        const I rest = idx >> 3;
        const int t = (int)(rest % K);
        const I rest2 = rest / K;
        const int cv = (int)(rest2 % cvecs);
        const I rest3 = rest2 / cvecs;
        const int rg = (int)(rest3 % row_groups);
        const int grp = (int)(rest3 / row_groups);
        const int o = rg * 8 + r8;               // row within the group
        const int mt = o / BM, r = o % BM;
        const int ch = cv / kvs, kv = cv % kvs, c0 = cv * VEC;
        const int valid = o < Cog ? min(VEC, Cg - c0) : 0;   // channels of the vector inside w
        const T* src = w + (((I)grp * Cog + o) * Cg + c0) * K + t;
        T* const out = wt + (((I)(grp * m_tiles + mt) * K + t) * chunks + ch) * tile_stride +
                       ((r >> 3) * kvs + kv) * (8 * VEC) + (r & 7) * VEC;
        __align__(16) T v[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            v[j] = j < valid ? maybe_tf32(src[(I)j * K], precision == 1) : Traits<T>::store(0.0f);
        if (precision == 2) {
            __align__(16) T small[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) weight_parts(v[j], v[j], small[j]);
            *reinterpret_cast<uint4*>(out + per_tile) = *reinterpret_cast<const uint4*>(small);
        }
        *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(v);
    }
    fused::wait_prerequisites();   // (launched overlapping the channels-last copy: done only after it)
}

template <typename T, typename I, int N, int PREC, int BM, int BN, int BK, int MINB, bool UNIFORM, int ENGINE,
          int DEPTH = 1, int THREADS = fused::THREADS, int PLAN = 0, bool PERSIST = false>
__global__ void __launch_bounds__(THREADS, MINB)
deform_fused_forward(const T* __restrict__ xcl, const T* __restrict__ wr, const T* __restrict__ offset,
                     const T* __restrict__ mask, const T* __restrict__ bias, T* __restrict__ y,
                     const Geom<N> g, const int batch, const int channels, const int Cp,
                     const int out_channels, const int groups, const int offset_groups,
                     const int mask_groups, const int Cgp, const I offset_bstride, const I mask_bstride,
                     const int taps_inner, const I* __restrict__ plan_rows, const float* __restrict__ plan_weights,
                     const int seg_len) {
    using namespace fused;
    constexpr int VEC = Tile<T>::VEC;
    constexpr bool WGMMA = ENGINE == 1 || ENGINE == 3;
    // The warpgroups that multiply, each BM / MMA_WGS rows in m64 instructions: two (ENGINE 3:
    // one for a 64-row tile). ENGINE 3: they only multiply (warps 0-7, or 0-3), the others only sample.
    constexpr int MMA_WGS = ENGINE == 3 && BM == 64 ? 1 : 2;
    constexpr int WG_ROWS = BM / MMA_WGS;
    constexpr int MMA_THREADS = ENGINE == 3 ? 128 * MMA_WGS : 0;
    constexpr int SAMPLERS = THREADS - MMA_THREADS;   // threads that sample (engines 0-2: and copy the weights)
    constexpr int TPP = SAMPLERS / BN;           // sampling threads per position
    constexpr int LD = WGMMA ? BK : BK + Tile<T>::PAD;  // shared row length (A: per output channel, B: per position)
    constexpr int CPT = BK / TPP;                // channels per sampling thread
    constexpr int NV = CPT / VEC;                // 16-byte vectors per sampling thread
    constexpr int NC = 1 << N;
    constexpr int WARPS_N = BN / 32, WARPS_M = (ENGINE == 3 ? MMA_THREADS : THREADS) / 32 / WARPS_N;
    constexpr int WM = BM / WARPS_M, WN = 32;    // warp tile
    constexpr int MT = WM / 16, NT = WN / 8;     // mma tiles per warp
    constexpr int A_VECS = BM * BK / VEC / SAMPLERS;  // weight vectors copied per sampling thread and step
    static_assert((ENGINE == 3 || (A_VECS >= 1 && BM * BK % (VEC * SAMPLERS) == 0)) && NV >= 1 && MT >= 1 &&
                  NT % 2 == 0 && SAMPLERS % BN == 0, "tile shape");
    static_assert(ENGINE != 2 || (UNIFORM && DEPTH >= 1), "corner pipeline: 16-byte sampler only");
    static_assert(THREADS == fused::THREADS || ENGINE == 0 || ENGINE == 3,
                  "blocks of other than 256 threads: mma.sync, or the warp-specialised wgmma");
    static_assert(!WGMMA || (WG_ROWS % 64 == 0 && (BN == 64 || BN == 128 || (ENGINE == 3 && BN == 48)) &&
                             (PREC != 2 || ENGINE == 3)),
                  "wgmma: MMA_WGS warpgroups of BM/MMA_WGS rows (m64 instructions) x BN positions; 3xTF32 on ENGINE 3");
    // (3 stages at least: the samplers fill a stage one step ahead, and the MMA warps free a
    // stage one step late, keeping one step's MMAs in flight; in 3xTF32 with DCN_PROMOTE_3XTF32
    // they free the last stage of each promoted run at once, but keep the same ring)
    static_assert(ENGINE != 3 || (SAMPLERS >= 128 && DEPTH >= 3 && 2 * DEPTH <= 15),
                  "warp-specialised ring: a warpgroup or more of samplers, 3 to 7 stages, 2 named barriers a stage");
    static_assert(!PLAN || (UNIFORM && ENGINE != 2), "the sampling plan: 16-byte sampler, engines 0 and 1");
    static_assert(!PERSIST || ENGINE == 3, "persistent blocks: ENGINE 3");
    constexpr bool WARP_CORNERS = PLAN == 2 || PLAN == 3;
    static_assert(PLAN != 3 || (ENGINE == 3 && !PERSIST), "two steps of loads in flight: ENGINE 3, one tile a block");
    // ENGINE 3 keeps AHEAD steps of loads in flight, each in a slot of raw (and of raw_weight,
    // its corners' weights, where AHEAD > 1: smp then already holds a later step's)
    constexpr int AHEAD = ENGINE == 3 ? (PLAN == 3 ? 2 : DCN_FUSED_LOADS_AHEAD) : 1;
    static_assert(AHEAD == 1 || AHEAD == 2, "DCN_FUSED_LOADS_AHEAD: 1 or 2");
    static_assert(!WARP_CORNERS || ((ENGINE == 0 || ENGINE == 3) && 32 % TPP == 0 && SAMPLERS % 32 == 0),
                  "corner batches per warp: engines 0 and 3, a warp's lanes a whole number of positions");
    constexpr int PPW = 32 / TPP;   // (PLAN 2) positions a sampling warp samples; taps a batch: TPP

    // Buffers of the weight tile (BM rows of LD; ENGINE 2: DEPTH + 1 of them) and two of the
    // sampled tile (BN rows of LD); ENGINE 2 then the ring of raw corner vectors (DEPTH stages
    // of NC x NV x THREADS, thread-fastest) and of the corner weights (DEPTH x NC x THREADS).
    // ENGINE 3: a ring of DEPTH stages, each a weight tile and a sampled tile.
    // ENGINE 3 in 3xTF32: each buffer holds the tile's big parts, then its small parts (split_tf32).
    constexpr int A_BUFS = ENGINE == 2 ? DEPTH + 1 : (ENGINE == 3 ? DEPTH : 2);
    constexpr int B_BUFS = ENGINE == 3 ? DEPTH : 2;
    constexpr int SPLIT = WGMMA && PREC == 2 ? 2 : 1;
    constexpr int A_BUF = SPLIT * BM * LD, B_BUF = SPLIT * BN * LD;   // elements of one buffer
    // ROW_PHASES: each 8-lane phase of a sampling warp samples one position's whole chunk row (BK
    // elements, 128 bytes; lane & 7 its 16-byte vector): its corner loads touch one 128-byte line
    // a phase, where 4-thread slices of two positions touched two, and its stores go to the
    // sampled tile in wgmma's 128-byte swizzle (vector c of row r at c ^ (r & 7)), one line a
    // phase without bank conflicts, where the unswizzled core matrices took 4-way conflicts (ncu,
    // H200, B=8 C256 fp16: 16 shared wavefronts a store, 8 a corner load; NOTES-gpu.md session
    // 35). A thread then samples NV positions, v * 4 + lane / 8 of its warp's PPW, one vector
    // each, from the warp's corner batches. The swizzle repeats every 1024 bytes: the dynamic
    // shared memory is lifted to the next such boundary (cuda_fused.LaunchConfig asks for the
    // 1 KiB more, SWIZZLE_ALIGN).
    constexpr bool ROW_PHASES = ENGINE == 3 && WARP_CORNERS && BK * (int)sizeof(T) == 128 && SPLIT == 1 &&
                                AHEAD == 1 && DCN_FUSED_ROW_PHASES;
    extern __shared__ __align__(128) unsigned char fused_smem[];
    const unsigned smem_lift = ROW_PHASES ? (1024u - (smem_address(fused_smem) & 1023u)) & 1023u : 0u;
    T* const As0 = reinterpret_cast<T*>(fused_smem + smem_lift);
    T* const Bs0 = As0 + A_BUFS * A_BUF;
    uint4* const Raw0 = reinterpret_cast<uint4*>(Bs0 + B_BUFS * B_BUF);
    float* const Wts0 = reinterpret_cast<float*>(Raw0 + (ENGINE == 2 ? DEPTH * NC * NV * THREADS : 0));
    // PLAN 2: after the tiles (ENGINE 3: its ring), per sampling warp two batches of 32 corner
    // sets, [warp][batch][lane][corner]: the rows' offsets in xcl (row * Cp, the zero row's for a
    // corner not read), then (after every warp's) the weights
    I* const BatchRows0 = reinterpret_cast<I*>(Raw0);
    float* const BatchWeights0 = reinterpret_cast<float*>(BatchRows0 + SAMPLERS / 32 * 2 * 32 * NC);

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;

    const I Q = dcn::prod_size<N, I>(g.out_size);
    const I S = dcn::prod_size<N, I>(g.in_size);
    const int K = (int)dcn::prod_size<N, I>(g.ksize);
    const I BQ = (I)batch * Q;
    const I zero_row = (I)batch * S;   // the zero row after the chunk's rows (fused_channels_last)
    // (no division where a divisor is 1, the common case: each is ~20 instructions of every
    // warp, and a C64 block does only 9 steps)
    auto divide = [](int a, int b) { return b == 1 ? a : a / b; };
    const int Cg = divide(channels, groups);
    const int Cog = divide(out_channels, groups);
    const int per_go = offset == nullptr ? channels : divide(channels, offset_groups);
    const int per_gm = mask == nullptr ? channels : divide(channels, mask_groups);
    const int m_tiles = (Cog + BM - 1) / BM;
    const int tiles_mg = m_tiles * groups;   // tiles of one position tile
    // Output tile `tile`: positions p0.. (position tile pt), group grp, its output channels m0...
    // A block computes tile blockIdx.x; ENGINE 3 in a grid of fewer blocks than tiles (persistent
    // blocks, cuda_fused.LaunchConfig.persistent) then tiles blockIdx.x + gridDim.x, ... too.
    I p0;
    int grp, m0;
    auto enter_tile = [&](I tile) {
        const I pt = tiles_mg == 1 ? tile : tile / tiles_mg;
        grp = divide((int)(tile - pt * tiles_mg), m_tiles);
        m0 = ((int)(tile - pt * tiles_mg) - grp * m_tiles) * BM;
        p0 = pt * BN;
    };
    enter_tile(blockIdx.x);
    const I tiles = (BQ + BN - 1) / BN * tiles_mg;   // (ENGINE 3's persistent blocks)
    const int chunks = (Cg + BK - 1) / BK;
    const int steps = K * chunks;
    // Step order: taps inner (a chunk of channels for every tap, then the next chunk: the
    // corners of one chunk stay in L1 across the taps; corner sets computed per tap and chunk)
    // or taps outer (every chunk of one tap, then the next tap: corner sets computed per tap).
    // Steps are located in non-decreasing order: a cursor advanced one step at a time replaces
    // the divisions by the runtime K and chunks (the kernel is bound by issued instructions).
    // Every call advances it by one step at most, so the loop is not unrolled: unrolled by 4 it
    // cost ~30 instructions and 4 branches a call for its remainder logic.
    int cur_step = 0, cur_tap = 0, cur_chunk = 0;
    auto locate = [&](int step) {
#pragma unroll 1
        while (cur_step < step) {
            ++cur_step;
            if (taps_inner) {
                if (++cur_tap == K) { cur_tap = 0; ++cur_chunk; }
            } else {
                if (++cur_chunk == chunks) { cur_chunk = 0; ++cur_tap; }
            }
        }
    };
    auto step_tap = [&](int step) { locate(step); return cur_tap; };
    auto step_chunk = [&](int step) { locate(step); return cur_chunk; };
    // Offset / mask group of an absolute channel (no division where there is one group).
    auto offset_group = [&](int c) { return per_go >= channels ? 0 : c / per_go; };
    auto mask_group = [&](int c) { return per_gm >= channels ? 0 : c / per_gm; };

    // This thread's sampling position and channel slice (ENGINE 3: sampler tid - 256). ENGINE 3
    // interleaves the slices: vector v of the thread's NV is vector v * TPP + tid % TPP of the
    // chunk, so that one load instruction of the TPP threads of a position reads TPP whole
    // consecutive vectors (full 32-byte sectors, not half of each); its uniform sampler needs
    // each chunk within one offset and mask group (cuda_fused._uniform).
    constexpr bool INTERLEAVED = ENGINE == 3;
    constexpr int VSTRIDE = INTERLEAVED ? TPP : 1;   // vectors between a thread's vectors
    static_assert(!INTERLEAVED || UNIFORM, "interleaved slices: the 16-byte sampler only");
    const int ptid = tid - MMA_THREADS;
    static_assert(!ROW_PHASES || (BK / VEC == 8 && PPW == 4 * NV),
                  "row phases: 8 vectors a chunk row, 4 rows a warp instruction");
    // (ROW_PHASES: sn is the position of v = 0)
    const int sn = ROW_PHASES ? (ptid >> 5) * PPW + (lane >> 3) : ptid / TPP;
    const int sh = ROW_PHASES ? (lane & 7) * VEC : (ptid % TPP) * (INTERLEAVED ? VEC : CPT);
    // the position whose offsets and mask this thread reads: its sampling position, or (PLAN 2)
    // position lane % PPW of its warp's, whose corners it computes for tap lane / PPW of a batch
    const int sp_in_tile = WARP_CORNERS ? (ptid >> 5) * PPW + (lane % PPW) : sn;
    I sp;
    bool svalid;
    int qc[N];
    const T* off_q;
    const T* msk_q;
    I sample_row;
    fused::Sampler<I, N> smp;
    // (per tile: the position's coordinates, offset and mask pointers and sample row, the
    // sampler's corner set forgotten)
    auto enter_position = [&]() {
        sp = p0 + sp_in_tile;
        svalid = sp < BQ;
        const I b = svalid ? sp / Q : 0;
        const I q = svalid ? sp % Q : 0;
        dcn::unravel_in_range<N, I>(q, g.out_size, qc);
        off_q = offset == nullptr ? nullptr : offset + b * offset_bstride + q;
        msk_q = mask == nullptr ? nullptr : mask + b * mask_bstride + q;
        sample_row = b * S;
        smp.reset();
    };
    enter_position();
    uint4 raw[AHEAD][UNIFORM && ENGINE != 2 ? NC : 1][NV];   // uniform: the corners' vectors; else the finished values
    [[maybe_unused]] float raw_weight[AHEAD][NC];

    // PLAN: the corners of (tap, segment) come from the chunk's sampling plan (fused_sampling_plan)
    // instead of the offsets and mask; the sampler's key is (tap, segment), its prefetch (a step
    // ahead) the plan entry itself. A uniform thread's channels lie in one segment.
    [[maybe_unused]] I plan_row[PLAN == 1 ? NC : 1];
    [[maybe_unused]] float plan_weight[PLAN == 1 ? NC : 1];
    auto plan_segment = [&](int c) { return seg_len >= channels ? 0 : c / seg_len; };
    auto plan_fetch = [&](int t, int seg) {
        if constexpr (PLAN == 1) {
            const I e = (((I)seg * K + t) * BQ + sp) * NC;
            fused::load_words(plan_rows + e, plan_row);
            fused::load_words(plan_weights + e, plan_weight);
            smp.pf_t = t;
            smp.pf_go = seg;
        }
    };
    auto plan_prefetch = [&](int t, int c) {
        const int seg = plan_segment(c);
        if (!svalid || (t == smp.key_t && seg == smp.key_go) || (t == smp.pf_t && seg == smp.pf_go)) return;
        plan_fetch(t, seg);
    };
    auto plan_update = [&](int t, int c) {
        const int seg = plan_segment(c);
        if (t == smp.key_t && seg == smp.key_go) return;
        smp.key_t = t;
        smp.key_go = seg;
        if (!svalid) {
#pragma unroll
            for (int k = 0; k < NC; ++k) { smp.row[k] = (I)-1; smp.weight[k] = 0.0f; }
            return;
        }
        if (!(t == smp.pf_t && seg == smp.pf_go)) plan_fetch(t, seg);
        if constexpr (PLAN == 1) {
#pragma unroll
            for (int k = 0; k < NC; ++k) { smp.row[k] = plan_row[k]; smp.weight[k] = plan_weight[k]; }
        }
    };

    // PLAN 2: the warp's corner batches. Keys (the tap: one offset and one mask group) are counted
    // in step order: taps outer, key k is tap k; taps inner, key k is step k, tap k % K. Batch b
    // holds keys b * TPP ..., lane l the corners of key b * TPP + l / PPW at position l % PPW of
    // the warp's, in slot b & 1. A sampler reaching the first key of batch b has the warp compute
    // batch b + 1 (its offsets and mask prefetched when batch b was computed) into the other slot,
    // whose last reads (batch b - 1) are behind it; __syncwarp orders the lanes' reads and writes.
    [[maybe_unused]] fused::Sampler<I, N> batch_smp;
    batch_smp.reset();
    [[maybe_unused]] const int keys = taps_inner ? steps : K;
    [[maybe_unused]] int batch_key = -1;   // the sampler's last key
    auto key_tap = [&](int k) { return taps_inner && k >= K ? k % K : k; };   // (one chunk: no division)
    auto corner_batch = [&](int b) {
        if constexpr (WARP_CORNERS) {
            __syncwarp();
            const int k = b * TPP + lane / PPW;
            if (k < keys) {
                batch_smp.update(key_tap(k), 0, 0, svalid, g, qc, off_q, msk_q, K, Q, sample_row);
                I at[NC];
#pragma unroll
                for (int c = 0; c < NC; ++c) at[c] = (batch_smp.row[c] >= 0 ? batch_smp.row[c] : zero_row) * Cp;
                const int e = (((ptid >> 5) * 2 + (b & 1)) * 32 + lane) * NC;
                fused::store_words(BatchRows0 + e, at);
                fused::store_words(BatchWeights0 + e, batch_smp.weight);
                if (k + TPP < keys) batch_smp.prefetch(key_tap(k + TPP), 0, 0, svalid, off_q, msk_q, K, Q);
            }
            __syncwarp();
        }
    };
    // PLAN 2: this sampler's corners of `step` (row offsets into smp.row), and its warp's next
    // batch where `step` starts one. batch_slot0: its corner set of key 0 (the warp's slot 0).
    // ROW_PHASES: its corner sets of v = 0 (those of v at v * 4 slots on), in rrow and rweight
    [[maybe_unused]] const int batch_slot0 = ((ptid >> 5) * 2 * 32 + (ROW_PHASES ? lane >> 3 : lane / TPP)) * NC;
    [[maybe_unused]] I rrow[ROW_PHASES ? NV : 1][NC];
    [[maybe_unused]] float rweight[ROW_PHASES ? NV : 1][NC];
    auto corner_read = [&](int step, bool past_group) {
        if constexpr (WARP_CORNERS) {
            const int k = taps_inner ? step : step_tap(step);
            if (k != batch_key) {
                batch_key = k;
                if (k % TPP == 0 && k + TPP < keys) corner_batch(k / TPP + 1);
            }
            if (past_group) {   // channels past the group's: the zero row, weight 0
                if constexpr (ROW_PHASES) {
#pragma unroll
                    for (int v = 0; v < NV; ++v)
#pragma unroll
                        for (int c = 0; c < NC; ++c) { rrow[v][c] = zero_row * Cp; rweight[v][c] = 0.0f; }
                } else {
#pragma unroll
                    for (int c = 0; c < NC; ++c) { smp.row[c] = zero_row * Cp; smp.weight[c] = 0.0f; }
                }
                return;
            }
            const unsigned uk = k;   // (>= 0: shifts and masks for the power-of-two TPP)
            const int e = batch_slot0 + (int)(((uk / TPP) & 1) * 32 + (uk % TPP) * PPW) * NC;
            if constexpr (ROW_PHASES) {
#pragma unroll
                for (int v = 0; v < NV; ++v) {
                    fused::load_words<false>(BatchRows0 + e + v * 4 * NC, rrow[v]);
                    fused::load_words<false>(BatchWeights0 + e + v * 4 * NC, rweight[v]);
                }
            } else {
                fused::load_words<false>(BatchRows0 + e, smp.row);
                fused::load_words<false>(BatchWeights0 + e, smp.weight);
            }
        }
    };

    // This thread's weight vectors (engines 0-2): row w_r0 + j * W_RSTEP of the tile, channels
    // w_cv.. of the chunk.
    constexpr int KV = BK / VEC;
    static_assert(SAMPLERS % KV == 0, "weight copy rows");
    constexpr int W_RSTEP = SAMPLERS / KV;
    const int w_r0 = ptid / KV;
    const int w_cv = (ptid % KV) * VEC;
    const T* const w_row0 = wr + ((I)(grp * Cog + m0 + w_r0) * K * Cgp + w_cv);
    auto weight_issue = [&](int step, int buf) {
        const int t = step_tap(step);
        const int c0 = step_chunk(step) * BK;
        const T* const src0 = w_row0 + ((I)t * Cgp + c0);
#pragma unroll
        for (int j = 0; j < A_VECS; ++j) {
            const int r = w_r0 + j * W_RSTEP;
            const bool full = m0 + r < Cog;
            const T* src = full ? src0 + (I)j * W_RSTEP * K * Cgp : wr;
            copy16_async(As0 + buf * A_BUF + tile_offset<ENGINE, LD, BK, VEC>(r, w_cv / VEC), src, full);
        }
    };
    auto weight_copy = [&](int step, int buf) {
        weight_issue(step, buf);
        copy_commit();
    };

    // ENGINE 2: issue this thread's corner vectors of `step` as cp.async copies into ring stage
    // step % DEPTH (zero-filled for corners not read, whose weight is stored as 0), with the
    // weight tile into A buffer step % (DEPTH + 1); nothing waits on them here.
    auto corner_issue = [&](int step) {
        const int stage = step % DEPTH;
        weight_issue(step, step % A_BUFS);
        const int t = step_tap(step);
        const int cl = step_chunk(step) * BK + sh;
        int cabs = 0;
        if (cl >= Cg) {
            smp.clear();
        } else {
            cabs = grp * Cg + cl;
            smp.update(t, offset_group(cabs), mask_group(cabs), svalid, g, qc, off_q, msk_q, K, Q, sample_row);
        }
        uint4* const raw_s = Raw0 + stage * NC * NV * THREADS + tid;
        float* const wts_s = Wts0 + stage * NC * THREADS + tid;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const bool read = smp.row[c] >= 0;
            wts_s[c * THREADS] = read ? smp.weight[c] : 0.0f;
            const T* src = read ? xcl + smp.row[c] * Cp + cabs : xcl;
#pragma unroll
            for (int v = 0; v < NV; ++v) copy16_async(raw_s + (c * NV + v) * THREADS, src + (read ? v * VEC : 0), read);
        }
        if (step + 1 < steps) {
            const int t2 = step_tap(step + 1);
            const int cl2 = step_chunk(step + 1) * BK + sh;
            if (cl2 < Cg) {
                const int cabs2 = grp * Cg + cl2;
                smp.prefetch(t2, offset_group(cabs2), mask_group(cabs2), svalid, off_q, msk_q, K, Q);
            }
        }
    };

    // ENGINE 2: blend the corners of `step` (ring stage step % DEPTH, this thread's own copies,
    // complete) into B buffer step & 1.
    auto corner_blend = [&](int step) {
        const int stage = step % DEPTH;
        const uint4* const raw_s = Raw0 + stage * NC * NV * THREADS + tid;
        const float* const wts_s = Wts0 + stage * NC * THREADS + tid;
        float acc[CPT];
#pragma unroll
        for (int j = 0; j < CPT; ++j) acc[j] = 0.0f;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const float w = wts_s[c * THREADS];
#pragma unroll
            for (int v = 0; v < NV; ++v) Vec<T>::add(acc + v * VEC, w, raw_s[(c * NV + v) * THREADS]);
        }
        if constexpr (PREC == 1) {
#pragma unroll
            for (int j = 0; j < CPT; ++j) acc[j] = __uint_as_float(to_tf32(acc[j]));
        }
        T* const bt = Bs0 + (step & 1) * B_BUF;
#pragma unroll
        for (int v = 0; v < NV; ++v)
            *reinterpret_cast<uint4*>(bt + tile_offset<ENGINE, LD, BK, VEC>(sn, sh / VEC + v)) = Vec<T>::pack(acc + v * VEC);
    };

    // Issue this thread's loads for `step` (uniform: raw corner vectors; otherwise the whole
    // sample, one channel at a time).
    auto sample_load = [&](int step, int slot = 0) {
        const int t = step_tap(step);
        const int cl = step_chunk(step) * BK + sh;   // first channel within the group
        if constexpr (UNIFORM) {
            // channels past the group's (a partial last chunk): every corner the zero row, so
            // that the blend reads loaded registers (weight 0 times stale bits could be NaN)
            int cabs = 0;
            if constexpr (WARP_CORNERS) {
                cabs = cl >= Cg ? 0 : grp * Cg + cl;
                corner_read(step, cl >= Cg);
            } else if (cl >= Cg) {
                smp.clear();
            } else {
                cabs = grp * Cg + cl;
                if constexpr (PLAN) {
                    plan_update(t, cabs);
                } else {
                    smp.update(t, offset_group(cabs), mask_group(cabs), svalid, g, qc, off_q, msk_q, K, Q,
                               sample_row);
                }
            }
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                if constexpr (ROW_PHASES) {   // vector v: its own position's corner, the same channels
#pragma unroll
                    for (int v = 0; v < NV; ++v)
                        raw[slot][c][v] = __ldg(reinterpret_cast<const uint4*>(fused::offset_by(xcl, rrow[v][c] + cabs)));
                    continue;
                }
                // a corner not read loads the zero row instead (weight 0): no branch, no
                // divergence (4-7% faster than skipping it, NOTES-gpu.md fused4)
                const uint4* src = reinterpret_cast<const uint4*>(fused::offset_by(
                    xcl, (WARP_CORNERS ? smp.row[c] : (smp.row[c] >= 0 ? smp.row[c] : zero_row) * Cp) + cabs));
#pragma unroll
                for (int v = 0; v < NV; ++v) raw[slot][c][v] = __ldg(src + v * VSTRIDE);
            }
            if constexpr (AHEAD > 1) {
#pragma unroll
                for (int c = 0; c < NC; ++c) raw_weight[slot][c] = smp.weight[c];
            }
            // the offset and mask of the step after, if they change then (PLAN 2: the warp's batches)
            if (!WARP_CORNERS && step + 1 < steps) {
                const int t2 = step_tap(step + 1);
                const int cl2 = step_chunk(step + 1) * BK + sh;
                if (cl2 < Cg) {
                    const int cabs2 = grp * Cg + cl2;
                    if constexpr (PLAN) {
                        plan_prefetch(t2, cabs2);
                    } else {
                        smp.prefetch(t2, offset_group(cabs2), mask_group(cabs2), svalid, off_q, msk_q, K, Q);
                    }
                }
            }
        } else {
            float val[CPT];
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                val[j] = 0.0f;
                const int c = cl + j;
                if (c < Cg) {
                    const int cabs = grp * Cg + c;
                    smp.update(t, offset_group(cabs), mask_group(cabs), svalid, g, qc, off_q, msk_q, K, Q, sample_row);
#pragma unroll
                    for (int k = 0; k < NC; ++k) {
                        if (smp.row[k] >= 0) val[j] += smp.weight[k] * Traits<T>::load(xcl[smp.row[k] * Cp + cabs]);
                    }
                }
            }
#pragma unroll
            for (int v = 0; v < NV; ++v) raw[slot][0][v] = Vec<T>::pack(val + v * VEC);
        }
    };

    // Finish the sample and store it into B buffer `buf` (row sn, channels sh..sh+CPT).
    auto sample_store = [&](int buf, int slot = 0) {
        T* const bt = Bs0 + buf * B_BUF;
        // the weights of the corners in raw[slot]
        const float* const weight = AHEAD > 1 ? raw_weight[slot] : smp.weight;
        auto dst = [&](int v, int part = 0) -> uint4& {   // part 1: the small parts' tile (3xTF32)
            return *reinterpret_cast<uint4*>(bt + part * BN * LD + tile_offset<ENGINE, LD, BK, VEC>(sn, sh / VEC + v * VSTRIDE));
        };
        if constexpr (ROW_PHASES) {
            // vector v: row sn + 4 v, its 16-byte chunk lane & 7 at (lane & 7) ^ (row & 7)
#pragma unroll
            for (int v = 0; v < NV; ++v) {
                const int r = sn + 4 * v;
                uint4& out = *reinterpret_cast<uint4*>(bt + r * BK + (((lane & 7) ^ (r & 7)) * VEC));
                if constexpr (Packed<T>::value) {
                    uint4 a = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                    for (int c = 0; c < NC; ++c) Packed<T>::fma(a, Packed<T>::weight(rweight[v][c]), raw[slot][c][v]);
                    out = a;
                } else {
                    float acc[VEC];
#pragma unroll
                    for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
#pragma unroll
                    for (int c = 0; c < NC; ++c) Vec<T>::add(acc, rweight[v][c], raw[slot][c][v]);
                    if constexpr (PREC == 1) {
#pragma unroll
                        for (int j = 0; j < VEC; ++j) acc[j] = __uint_as_float(to_tf32(acc[j]));
                    }
                    out = Vec<T>::pack(acc);
                }
            }
        } else if constexpr (UNIFORM && Packed<T>::value) {
            // half types: the corners blended in packed pairs (fused::Packed), corner by corner
            unsigned w2[NC];
#pragma unroll
            for (int c = 0; c < NC; ++c) w2[c] = Packed<T>::weight(weight[c]);
#pragma unroll
            for (int v = 0; v < NV; ++v) {
                uint4 a = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                for (int c = 0; c < NC; ++c) Packed<T>::fma(a, w2[c], raw[slot][c][v]);
                dst(v) = a;
            }
        } else if constexpr (UNIFORM) {
            float acc[CPT];
#pragma unroll
            for (int j = 0; j < CPT; ++j) acc[j] = 0.0f;
#pragma unroll
            for (int c = 0; c < NC; ++c) {   // every corner: one not read is the zero row, weight 0
#pragma unroll
                for (int v = 0; v < NV; ++v) Vec<T>::add(acc + v * VEC, weight[c], raw[slot][c][v]);
            }
            if constexpr (SPLIT == 2) {
                // 3xTF32 (wgmma): the big parts into the buffer's first tile, the small into its second
#pragma unroll
                for (int v = 0; v < NV; ++v) {
                    unsigned big[4], small[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) split_tf32(acc[v * VEC + e], big[e], small[e]);
                    dst(v) = make_uint4(big[0], big[1], big[2], big[3]);
                    dst(v, 1) = make_uint4(small[0], small[1], small[2], small[3]);
                }
            } else {
                if constexpr (PREC == 1) {
#pragma unroll
                    for (int j = 0; j < CPT; ++j) acc[j] = __uint_as_float(to_tf32(acc[j]));
                }
#pragma unroll
                for (int v = 0; v < NV; ++v) dst(v) = Vec<T>::pack(acc + v * VEC);
            }
        } else {
#pragma unroll
            for (int v = 0; v < NV; ++v) {
                uint4 r = raw[slot][0][v];
                if constexpr (PREC == 1) {
                    r.x = to_tf32(__uint_as_float(r.x)); r.y = to_tf32(__uint_as_float(r.y));
                    r.z = to_tf32(__uint_as_float(r.z)); r.w = to_tf32(__uint_as_float(r.w));
                }
                dst(v) = r;
            }
        }
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    auto multiply = [&](int abuf, int bbuf) {
        // PREC 1: the sampler stored TF32-rounded values already, and fused_weight_rows the weights
        warp_mma<T, PREC, ROUNDED_A | ROUNDED_B, MT, NT, LD, BK, WM, WN>(acc, As0 + abuf * A_BUF, Bs0 + bbuf * B_BUF, wm,
                                                                        wn, lane);
    };

    if constexpr (ENGINE == 2) {
        // Corner pipeline: the copies of steps s+1 .. s+DEPTH are in flight while step s
        // multiplies (one cp.async group per step, empty past the last step).
        fused::wait_prerequisites();   // xcl and wr written (programmatic dependent launch)
#pragma unroll
        for (int s = 0; s < DEPTH; ++s) {
            if (s < steps) corner_issue(s);
            copy_commit();
        }
        copy_wait_pending<DEPTH - 1>();
        corner_blend(0);
        __syncthreads();
    } else if constexpr (ENGINE != 3) {
        // Prologue: step 0 into buffer 0 (PLAN 2: the warp's first corner batch before).
        corner_batch(0);
        fused::wait_prerequisites();   // xcl, wr and the sampling plan written
        weight_copy(0, 0);
        sample_load(0);
        sample_store(0);
        copy_wait_all();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        if constexpr (ENGINE == 1) proxy_fence();   // generic-proxy writes, read by wgmma next
#endif
        __syncthreads();
    }
    if constexpr (!WGMMA) {
        if constexpr (ENGINE == 2) {
            for (int s = 0; s < steps; ++s) {
                if (s + DEPTH < steps) corner_issue(s + DEPTH);
                copy_commit();
                multiply(s % A_BUFS, s & 1);
                copy_wait_pending<DEPTH - 1>();   // this thread's copies of step s + 1 are done
                if (s + 1 < steps) corner_blend(s + 1);
                __syncthreads();
            }
        } else {
            for (int s = 0; s < steps; ++s) {
                const int cur = s & 1;
                const bool more = s + 1 < steps;
                if (more) {
                    weight_copy(s + 1, cur ^ 1);
                    sample_load(s + 1);
                }
                multiply(cur, cur);
                if (more) sample_store(cur ^ 1);
                copy_wait_all();
                __syncthreads();
            }
        }

        // Epilogue: accumulators (+ bias) -> y[b, grp*Cog + o, q], straight from the fragments.
        const int gq = lane >> 2, tq = lane & 3;
        I ybase[NT][2];
        fused::output_offsets<I, NT>(ybase, p0 + wn * WN + 2 * tq, Q, BQ, out_channels);
        const bool pairs = fused::pairs_aligned(y, ybase, Q);
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int o = m0 + wm * WM + i * 16 + gq + h * 8;
                if (o >= Cog) continue;
                const int oc = grp * Cog + o;
                const float bv = bias == nullptr ? 0.0f : Traits<T>::load(bias[oc]);
                fused::store_row(y + (I)oc * Q, ybase, pairs, [&](int j, int e) { return acc[i][j][h * 2 + e] + bv; });
            }
    } else {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        // Warpgroup wg computes rows WG_ROWS*wg.. of the tile (MI m64 instructions); the MMA of a
        // step runs asynchronously while the threads (ENGINE 3: the sampling warps) sample the
        // next step into another buffer.
        constexpr int KSTEP = PREC == 0 ? 16 : 8;          // wgmma K
        // (DCN_FUSED_POSITION_ROWS: the positions the wgmma's M, the warpgroup's rows its N)
        constexpr bool POSITION_ROWS = ENGINE == 3 && DCN_FUSED_POSITION_ROWS && SPLIT == 2 && BN == 64 &&
                                       WG_ROWS == 128 && holds_m64n128(MINB * THREADS);
        constexpr int MI = POSITION_ROWS ? 1 : WG_ROWS / 64;
        constexpr int MMA_N = POSITION_ROWS ? WG_ROWS : BN;  // the instructions' N
        constexpr int NACC = MMA_N / 2;                      // accumulators per thread and instruction
        constexpr unsigned CORE = 128;                      // bytes of one 8x16-byte core matrix
        constexpr unsigned SBO = (BK / VEC) * CORE;
        const int wg = warp >> 2;
        float d[MI][NACC];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int i = 0; i < NACC; ++i) d[mi][i] = 0.0f;
        // ENGINE 3 in 3xTF32: the products of a run of steps (DCN_FUSED_PROMOTE_CHANNELS) go to
        // registers of their own (p), added to d in float32 once they complete: the tensor cores'
        // accumulation truncates, so that summing a whole K of 3 products a k8 into d drifts with
        // K (H200, B=16 C512 14x14: 2.9e-5 relative against 6.4e-7 for float32 FMAs; NOTES-gpu.md,
        // session 14).
        constexpr bool PROMOTE = ENGINE == 3 && SPLIT == 2 && DCN_PROMOTE_3XTF32;
        float p[MI][NACC];   // (unused, so allocated no registers, without PROMOTE)
        // The MMAs of one step (buffer `buf`) into `acc` (d, or p overwritten: fresh), committed as one
        // wgmma group; 3xTF32: the small products first, a_small*b_big + a_big*b_small + a_big*b_big.
        // Descriptors of buffer 0's tiles (A: this warpgroup's rows), computed once; a step's are
        // these at byte offsets (wgmma_descriptor_at).
        const unsigned long long a_desc0 = wgmma_descriptor(As0 + wg * WG_ROWS * BK, CORE, SBO);
        // (ROW_PHASES: B in the 128-byte swizzle, 8-row groups 1024 bytes apart; an instruction's K is
        // the next 32 bytes of each row, the hardware applying the swizzle to the address)
        const unsigned long long b_desc0 = ROW_PHASES ? wgmma_descriptor(Bs0, 16, 1024) | (1ull << 62)
                                                      : wgmma_descriptor(Bs0, CORE, SBO);
        constexpr unsigned K_BYTES = 2 * 8 * VEC * sizeof(T);   // one instruction's K: two core matrices
        constexpr unsigned B_K_BYTES = ROW_PHASES ? KSTEP * sizeof(T) : K_BYTES;
        auto mma_issue = [&](int buf, float (&acc)[MI][NACC], bool fresh) {
            const unsigned a_buf = buf * (A_BUF * (unsigned)sizeof(T)), b_buf = buf * (B_BUF * (unsigned)sizeof(T));
            register_fence(acc);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < BK / KSTEP; ++ks) {
                const unsigned long long db = wgmma_descriptor_at(b_desc0, b_buf + ks * B_K_BYTES);
                // (the step's first product into p overwrites it)
                const int keep = fresh && ks == 0 ? 0 : 1;
                if constexpr (POSITION_ROWS) {
                    // the same products, the operands' roles swapped
                    const unsigned long long da = wgmma_descriptor_at(a_desc0, a_buf + ks * K_BYTES);
                    if constexpr (SPLIT == 2) {
                        Wgmma<T, MMA_N>::run(acc[0], db, wgmma_descriptor_at(da, BM * LD * (unsigned)sizeof(T)), keep);
                        Wgmma<T, MMA_N>::run(acc[0], wgmma_descriptor_at(db, BN * LD * (unsigned)sizeof(T)), da);
                        Wgmma<T, MMA_N>::run(acc[0], db, da);
                    } else {
                        Wgmma<T, MMA_N>::run(acc[0], db, da, keep);
                    }
                } else {
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi) {
                        const unsigned long long da =
                            wgmma_descriptor_at(a_desc0, a_buf + mi * (64 * BK * (unsigned)sizeof(T)) + ks * K_BYTES);
                        if constexpr (SPLIT == 2) {
                            // the small parts: each buffer's second tile
                            Wgmma<T, BN>::run(acc[mi], wgmma_descriptor_at(da, BM * LD * (unsigned)sizeof(T)), db, keep);
                            Wgmma<T, BN>::run(acc[mi], da, wgmma_descriptor_at(db, BN * LD * (unsigned)sizeof(T)));
                            Wgmma<T, BN>::run(acc[mi], da, db);
                        } else {
                            Wgmma<T, BN>::run(acc[mi], da, db, keep);
                        }
                    }
                }
            }
            wgmma_commit();
            register_fence(acc);
        };
        // Epilogue: d[mi][4j + e] is row 64*mi + 16*(warp%4) + lane/4 + 8*(e/2) of the
        // warpgroup's rows, position 8j + 2*(lane%4) + e%2. The output offsets of the thread's
        // positions first, with one division (one a stored value was 32 divisions a thread).
        auto epilogue = [&]() {
            const int gq = lane >> 2, tq = lane & 3;
            if constexpr (POSITION_ROWS) {
                // d[0][4j + 2h + e] is position 16*(warp%4) + lane/4 + 8h of the tile, row 8j +
                // 2*(lane%4) + e of the warpgroup's: each of the thread's 2 positions located once
                I yoff[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const I pos = p0 + (warp & 3) * 16 + gq + 8 * h;
                    const I b = pos / Q;
                    yoff[h] = pos < BQ ? b * out_channels * Q + (pos - b * Q) : (I)-1;
                }
#pragma unroll
                for (int j = 0; j < MMA_N / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int o = m0 + wg * WG_ROWS + 8 * j + 2 * tq + e;
                        if (o >= Cog) continue;
                        const int oc = grp * Cog + o;
                        const float bv = bias == nullptr ? 0.0f : Traits<T>::load(bias[oc]);
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            if (yoff[h] >= 0) y[yoff[h] + (I)oc * Q] = Traits<T>::store(d[0][4 * j + 2 * h + e] + bv);
                    }
                return;
            }
            I ybase[BN / 8][2];
            fused::output_offsets<I, BN / 8>(ybase, p0 + 2 * tq, Q, BQ, out_channels);
            const bool pairs = fused::pairs_aligned(y, ybase, Q);
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int o = m0 + wg * WG_ROWS + mi * 64 + (warp & 3) * 16 + gq + h * 8;
                    if (o >= Cog) continue;
                    const int oc = grp * Cog + o;
                    const float bv = bias == nullptr ? 0.0f : Traits<T>::load(bias[oc]);
                    fused::store_row(y + (I)oc * Q, ybase, pairs,
                                     [&](int j, int e) { return d[mi][4 * j + 2 * h + e] + bv; });
                }
        };
        if constexpr (ENGINE == 1) {
            for (int s = 0; s < steps; ++s) {
                const int cur = s & 1;
                mma_issue(cur, d, false);
                if (s + 1 < steps) {
                    weight_copy(s + 1, cur ^ 1);
                    sample_load(s + 1);
                    sample_store(cur ^ 1);
                }
                wgmma_wait_all();
                register_fence(d);
                copy_wait_all();
                proxy_fence();
                __syncthreads();
            }
            epilogue();
        } else {
            // ENGINE 3, warp-specialised: the samplers fill a ring of DEPTH stages (weight tile by a
            // bulk copy, sampled tile by their own stores) as far ahead as it allows, while the MMA
            // warps multiply. Stage k has barrier 1 + k ("full": the samplers arrive once their
            // writes are visible to wgmma; the MMA warps wait) and 1 + DEPTH + k ("empty": the
            // MMA warps arrive once the wgmma reading it has completed; the samplers wait before
            // overwriting it). Every arrival is matched by a wait.
            // The weight tile of a stage is one contiguous block of wr (fused_weight_tiles), copied
            // by the copy engine (cp.async.bulk) and waited for by the MMA warps on the stage's
            // mbarrier. With one MMA warpgroup (64-row tiles), its first thread issues the copy for
            // step s + DEPTH as soon as its MMAs of step s have read the stage (the first DEPTH at
            // the start), so that the samplers, the block's bottleneck, only sample; with two, the
            // first sampler issues it a step ahead, once the stage is empty (each warpgroup
            // copying its own rows measured 5-10% slower at B=8 C256 TF32 and float32, NOTES-gpu.md
            // session 28). A sampler keeps one step in flight: step s + 1's corner loads are issued
            // before step s's stage is stored (its blend waits on its loads).
            // Persistent blocks (a grid of fewer blocks than tiles): the block's tiles run through
            // one ring, their steps counted on from one tile to the next (the block's step u is in
            // stage u % DEPTH), so that the samplers fill the next tile's stages while the MMA
            // warps finish a tile and store it; a sampler's loads run one step ahead within a tile.
            constexpr bool MMA_WEIGHTS = MMA_WGS == 1;   // who issues the weight copies
            // PERSIST (instantiated where cuda_fused.tile_persists): two MMA warpgroups, not 3xTF32.
            // The one MMA warpgroup's weight copies and 3xTF32's second accumulators left no
            // registers for the tile loop's state (ptxas: spills of 20-160 bytes grew to
            // 500-1700). Without it, the kernel is the one-tile-a-block kernel it was.
            static_assert(!PERSIST || (MMA_WGS == 2 && SPLIT == 1 && !MMA_WEIGHTS),
                          "persistent blocks: two MMA warpgroups (the first sampler copies the weights), not 3xTF32");
            constexpr bool PERSISTENT = PERSIST;
            __shared__ __align__(8) unsigned long long weight_full[DEPTH];
            const int block_steps = PERSISTENT ? ((int)((tiles - 1 - blockIdx.x) / gridDim.x) + 1) * steps
                                               : steps;   // (cuda_fused.LaunchConfig.grid: below 2^31)
            // The weight tile of step `step` of the tile of group grp_ and first row m0_ into the
            // stage of the block's step u (free by then), by the thread named above. Its tap and
            // chunk from the thread's step cursor (a sampler's reset with each tile).
            auto weight_bulk = [&](int grp_, int m0_, int step, int u) {
                if (tid != (MMA_WEIGHTS ? 0 : MMA_THREADS)) return;
                const T* const w_tiles = wr + ((I)grp_ * m_tiles + m0_ / BM) * K * chunks * (SPLIT * BM * BK);
                constexpr unsigned WEIGHT_BYTES = SPLIT * BM * BK * sizeof(T);
                const int stage = u % DEPTH, t = step_tap(step), ch = step_chunk(step);
                mbarrier_expect(&weight_full[stage], WEIGHT_BYTES);
                bulk_copy(As0 + stage * A_BUF, w_tiles + ((I)t * chunks + ch) * (SPLIT * BM * BK), WEIGHT_BYTES,
                          &weight_full[stage]);
            };
            if (tid == 0) {
#pragma unroll
                for (int k = 0; k < DEPTH; ++k) mbarrier_init(&weight_full[k]);
                mbarrier_init_fence();
            }
            __syncthreads();
            // Registers: the launch gives every thread LAUNCH_REGS (ptxas's cap for THREADS x MINB
            // blocks an SM); in 3xTF32, where a sampler holds one 16-byte vector a corner (NV 1),
            // the samplers drop to SAMPLER_REGS and the MMA warpgroups rise by what that frees
            // (multiples of 8, at most 256). H200, 256x64x16: spills 84/128 bytes -> 0, whole
            // forward 12% faster at B=8 C256 56x56, 15% at B=16 C512 14x14; with 4 vectors a corner
            // (128x128x32) the samplers spill instead, 12% slower (NOTES-gpu.md, session 15). The
            // other precisions split where 512 or more threads sample (DCN_FUSED_WIDE_SAMPLER_REGS).
            constexpr int LAUNCH_REGS = (65536 / (MINB * THREADS) > 255 ? 255 : 65536 / (MINB * THREADS)) / 8 * 8;
            constexpr int ASKED_REGS = SPLIT == 2 ? DCN_FUSED_SAMPLER_REGS
                                                  : (SAMPLERS >= 512 ? DCN_FUSED_WIDE_SAMPLER_REGS : 0);
            constexpr int SAMPLER_REGS = ASKED_REGS < LAUNCH_REGS ? ASKED_REGS : LAUNCH_REGS;
            constexpr int MMA_REGS_FREED = LAUNCH_REGS + (LAUNCH_REGS - SAMPLER_REGS) * SAMPLERS / MMA_THREADS;
            constexpr int MMA_REGS = (MMA_REGS_FREED > 256 ? 256 : MMA_REGS_FREED) / 8 * 8;
            // (setmaxnreg is per warpgroup: samplers of whole warpgroups only)
            constexpr bool WHOLE_WARPGROUPS = SAMPLERS % 128 == 0;
            constexpr bool RESPLIT = NV == 1 && ASKED_REGS > 0 && SAMPLER_REGS >= 24 && SAMPLER_REGS < LAUNCH_REGS &&
                                     WHOLE_WARPGROUPS;
            // (experiment: two steps of loads in flight, the samplers given more)
            constexpr int AHEAD_REGS = DCN_FUSED_AHEAD_REGS / 8 * 8;
            constexpr int MMA_LEFT = (LAUNCH_REGS * THREADS - AHEAD_REGS * SAMPLERS) / MMA_THREADS / 8 * 8;
            constexpr bool GROW = AHEAD > 1 && !RESPLIT && AHEAD_REGS > LAUNCH_REGS && AHEAD_REGS <= 256 &&
                                  MMA_LEFT >= 48 && WHOLE_WARPGROUPS;
            if (tid >= MMA_THREADS) {
                if constexpr (RESPLIT) setmaxnreg_dec<SAMPLER_REGS>();
                if constexpr (GROW) setmaxnreg_inc<AHEAD_REGS>();
                constexpr bool SAMPLE = DCN_FUSED_WS_EXPERIMENT != 2;
                constexpr bool PEEL = DCN_FUSED_PEEL_LAST_STEP < 0 ? sizeof(T) == 2 : DCN_FUSED_PEEL_LAST_STEP != 0;
                I tile = blockIdx.x;
                for (int u0 = 0;;) {   // u0: the block's step of the tile's first
                    corner_batch(0);   // (offsets and mask only: before the wait)
                    if (u0 == 0) fused::wait_prerequisites();   // xcl, wr and the sampling plan written
                    if (u0 >= DEPTH) barrier_sync(1 + DEPTH + u0 % DEPTH, THREADS);   // (the tile's first stage)
                    if constexpr (!MMA_WEIGHTS) weight_bulk(grp, m0, 0, u0);
                    if (SAMPLE) sample_load(0);
                    if constexpr (AHEAD == 1) {
                        // step s; `more`: a step of the tile follows (its slot awaited, its weights
                        // and loads issued)
                        auto sampler_step = [&](int s, bool more) {
                            const int u = u0 + s;
                            if (more) {
                                if (u + 1 >= DEPTH) barrier_sync(1 + DEPTH + (u + 1) % DEPTH, THREADS);
                                if constexpr (!MMA_WEIGHTS) weight_bulk(grp, m0, s + 1, u + 1);
                            }
                            if (SAMPLE) sample_store(u % DEPTH);
                            if (more && SAMPLE) sample_load(s + 1);
                            barrier_arrive(1 + u % DEPTH, THREADS);
                        };
                        if constexpr (PEEL) {   // (steps >= 1: C_in and K are at least 1)
                            for (int s = 0; s + 1 < steps; ++s) sampler_step(s, true);
                            sampler_step(steps - 1, false);
                        } else {
                            for (int s = 0; s < steps; ++s) sampler_step(s, s + 1 < steps);
                        }
                    } else {
                        // step s's loads in slot s & 1, issued two steps ahead; the loop unrolled by
                        // two so that every slot index is a constant once inlined (registers, not
                        // local memory)
                        if (SAMPLE && steps > 1) sample_load(1, 1);
                        auto sampler_step = [&](int s, int k) {
                            const int u = u0 + s;
                            if (s + 1 < steps) {
                                if (u + 1 >= DEPTH) barrier_sync(1 + DEPTH + (u + 1) % DEPTH, THREADS);
                                if constexpr (!MMA_WEIGHTS) weight_bulk(grp, m0, s + 1, u + 1);
                            }
                            if (SAMPLE) sample_store(u % DEPTH, k);
                            if (SAMPLE && s + 2 < steps) sample_load(s + 2, k);
                            barrier_arrive(1 + u % DEPTH, THREADS);
                        };
                        for (int s = 0; s < steps; s += 2) {
                            sampler_step(s, 0);
                            if (s + 1 < steps) sampler_step(s + 1, 1);
                        }
                    }
                    u0 += steps;
                    tile += gridDim.x;
                    if (!PERSISTENT || tile >= tiles) break;
                    enter_tile(tile);
                    enter_position();
                    batch_smp.reset();
                    batch_key = -1;
                    cur_step = cur_tap = cur_chunk = 0;   // (the step cursor)
                }
                return;
            }
            if constexpr (RESPLIT) setmaxnreg_inc<MMA_REGS>();
            if constexpr (GROW) setmaxnreg_dec<(GROW ? MMA_LEFT : 256)>();
            // MMA_WEIGHTS (one tile a block): the next step whose weight tile is to be copied,
            // issued in step order, DEPTH ahead of the MMAs
            int w_next = 0;
            auto weight_ahead = [&]() {
                if (w_next >= block_steps) return;
                weight_bulk(grp, m0, w_next, w_next);
                ++w_next;
            };
            // the MMAs of the block's step u done: its stage to the samplers, whose wait for the
            // block's step u + DEPTH this arrival matches (MMA_WEIGHTS: with that step's weights)
            auto free_stage = [&](int u) {
                if (u + DEPTH < block_steps) barrier_arrive(1 + DEPTH + u % DEPTH, THREADS);
                if constexpr (MMA_WEIGHTS) weight_ahead();
            };
            fused::wait_prerequisites();   // wr written
            if constexpr (MMA_WEIGHTS) {
#pragma unroll 1
                for (int s = 0; s < DEPTH; ++s) weight_ahead();
            }
            I tile = blockIdx.x;
            for (int u0 = 0;;) {   // u0: the block's step of the tile's first
                for (int s = 0; s < steps; ++s) {
                    const int u = u0 + s;
                    barrier_sync(1 + u % DEPTH, THREADS);
                    mbarrier_wait(&weight_full[u % DEPTH], (u / DEPTH) & 1);
                    // the samplers' generic-proxy stores, ordered by the barrier, made visible to this
                    // thread's wgmma (async proxy)
                    proxy_fence();
                    if constexpr (PROMOTE) {
                        // p sums the products of a run of PROMOTE_STEPS steps (the first overwrites
                        // it); once the run's last step completes, p joins d. Each stage is freed once
                        // its MMAs are done: within a run, the previous step's after this one is issued.
                        constexpr int PROMOTE_STEPS = DCN_FUSED_PROMOTE_CHANNELS / BK > 1 ? DCN_FUSED_PROMOTE_CHANNELS / BK : 1;
                        const bool first = s % PROMOTE_STEPS == 0;
                        const bool last = PROMOTE_STEPS == 1 || (s + 1) % PROMOTE_STEPS == 0 || s + 1 == steps;
                        if (DCN_FUSED_WS_EXPERIMENT != 1) mma_issue(u % DEPTH, p, first);
                        if constexpr (PROMOTE_STEPS > 1) {
                            wgmma_wait_pending<1>();   // step u - 1's MMAs done
                            if (!first) free_stage(u - 1);
                            if (!last) continue;
                        }
                        wgmma_wait_all();
                        register_fence(p);
                        free_stage(u);
                        if (DCN_FUSED_WS_EXPERIMENT != 1) {
#pragma unroll
                            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                                for (int i = 0; i < NACC; ++i) d[mi][i] += p[mi][i];
                        }
                    } else {
                        if (DCN_FUSED_WS_EXPERIMENT != 1) mma_issue(u % DEPTH, d, false);
                        wgmma_wait_pending<1>();   // step u - 1's MMAs have read their stage
                        register_fence(d);
                        if (s >= 1) free_stage(u - 1);
                    }
                }
                wgmma_wait_all();
                register_fence(d);
                if constexpr (PERSISTENT && !PROMOTE) free_stage(u0 + steps - 1);   // (the tile's last stage)
                epilogue();
                u0 += steps;
                tile += gridDim.x;
                if (!PERSISTENT || tile >= tiles) break;
                enter_tile(tile);
                // (p too: its last value dead during the epilogue, not carried to the next tile's
                // first wgmma, whose runtime scale-d reads it)
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int i = 0; i < NACC; ++i) {
                        d[mi][i] = 0.0f;
                        if constexpr (PROMOTE) p[mi][i] = 0.0f;
                    }
            }
        }
#else
        __trap();   // wgmma kernels are built for sm_90a only
#endif
    }
}

// cuda/im2col's columns sampled from the channels-last input (the columns of the unfused path,
// in its layout, for its GEMMs):
//   columns[c*K + t, p] = m * sample(x[b, c], P(q, t)),  p = b*Q + q,
// with each corner one 16-byte load of VEC consecutive channels of xcl (fused_channels_last's
// copy, its zero row read for a corner not read) in place of deform_im2col's 2-byte gathers
// from the channel's plane. Per block a tile of 256 / LANES positions x CH channels and a
// run of taps_per_block taps: the positions are decoded once (the divisions by the grid's sizes
// were a fifth of a one-tap block's instructions), then per tap LANES threads per position each
// sample VPT vectors of VEC channels (the LANES threads' vectors adjacent: 128 contiguous bytes
// per corner row at 8 lanes), with the corners and weights (mask included) of its (position, tap,
// offset group, mask group) computed once per group (fused::Sampler's key; the next tap's offsets
// and mask fetched while this tap is sampled). The half types blend in packed pairs (fused::Packed, as the fused
// forward), float32 in float32. Fewer lanes per position share one corner computation among
// more vectors (few channels: the 3D sampler's 8 corners cost more than its loads). The tile is
// transposed through shared memory and stored two consecutive positions per thread (one 4- or
// 8-byte store) where the row length n*Q is even, consecutive threads along a row.
constexpr int COLUMN_THREADS = 256;
// Blocks per multiprocessor asked of the register allocator: 4 (64 registers, 32 warps) hides
// the corner loads' latency best (H200, B=8 C256 56x56 fp16: 0.112 ms against 0.122 at 3 and
// 0.143 with every vector's loads issued before the blends at 2; NOTES-gpu.md, session 9).
constexpr int COLUMN_MIN_BLOCKS = 4;

template <typename T, typename I, int N, int VPT, int LANES>
__global__ void __launch_bounds__(COLUMN_THREADS, COLUMN_MIN_BLOCKS)
fused_columns(const T* __restrict__ xcl, const T* __restrict__ offset, const T* __restrict__ mask,
              T* __restrict__ columns, const Geom<N> g, const int batch, const int channels, const int Cp,
              const int offset_groups, const int mask_groups, const int taps_per_block) {
    constexpr int VEC = fused::Tile<T>::VEC;
    constexpr int POSITIONS = COLUMN_THREADS / LANES;           // positions per tile
    constexpr int CH = LANES * VEC * VPT;                       // channels per tile
    constexpr int ROW = POSITIONS + 2;                          // even (paired loads), 2-way bank conflicts at most
    constexpr int PAIRS = POSITIONS / 2;                        // stores per tile row
    static_assert(COLUMN_THREADS % LANES == 0 && POSITIONS % 2 == 0, "fused_columns: lanes per position");
    typedef typename fused::Pair<T>::bits Bits;                 // one value
    typedef typename fused::Pair<T>::type Pair;                 // two consecutive positions of one row
    constexpr int PER_WORD = 4 / (int)sizeof(T) > 0 ? 4 / (int)sizeof(T) : 1;   // values per 32-bit word
    __shared__ __align__(16) Bits tile[CH][ROW];
    const I Q = dcn::prod_size<N, I>(g.out_size);
    const I S = dcn::prod_size<N, I>(g.in_size);
    const int K = (int)dcn::prod_size<N, I>(g.ksize);
    const I BQ = (I)batch * Q;
    const I zero_row = (I)batch * S;   // the row of zeros after the chunk's rows
    const bool paired = (BQ & 1) == 0;  // every row's start even: pairs of positions aligned
    const int per_go = offset == nullptr ? channels : channels / offset_groups;
    const int per_gm = mask == nullptr ? channels : channels / mask_groups;
    auto offset_group = [&](int c) { return per_go >= channels ? 0 : c / per_go; };
    auto mask_group = [&](int c) { return per_gm >= channels ? 0 : c / per_gm; };
    const int c_tiles = (channels + CH - 1) / CH;
    const int tap_runs = (K + taps_per_block - 1) / taps_per_block;
    const I p_tiles = (BQ + POSITIONS - 1) / POSITIONS;
    const I blocks = p_tiles * tap_runs * c_tiles;
    const int lane_v = threadIdx.x % LANES, lane_p = threadIdx.x / LANES;   // sampling
    // block -> (channel tile, run of taps, position tile), channel tiles fastest: blocks running
    // together read the same corner rows
    for (I blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
        const int ct = (int)(blk % c_tiles);
        const I rest = blk / c_tiles;
        const int t0 = (int)(rest % tap_runs) * taps_per_block;
        const int t1 = min(K, t0 + taps_per_block);
        const I p0 = rest / tap_runs * POSITIONS;
        const I p = p0 + lane_p;
        const bool position = p < BQ;
        const I b = position ? p / Q : 0, q = position ? p % Q : 0;
        int qc[N];
        dcn::unravel<N, I>(q, g.out_size, qc);
        const T* off_q = offset == nullptr ? nullptr : offset + b * offset_groups * K * N * Q + q;
        const T* msk_q = mask == nullptr ? nullptr : mask + b * mask_groups * K * Q + q;
        const int first_c = ct * CH + lane_v * VEC;   // this thread's first vector: the key it prefetches
        const int first_go = offset_group(min(first_c, channels - 1));
        const int first_gm = mask_group(min(first_c, channels - 1));
        fused::Sampler<I, N> smp;
        smp.reset();
        for (int t = t0; t < t1; ++t) {
#pragma unroll
            for (int v = 0; v < VPT; ++v) {
                const int cl = (v * LANES + lane_v) * VEC;   // channel within the tile
                const int c0 = ct * CH + cl;
                uint4 out = make_uint4(0u, 0u, 0u, 0u);
                if (position && c0 < channels) {
                    smp.update(t, offset_group(c0), mask_group(c0), true, g, qc, off_q, msk_q, K, Q, b * S);
                    if (v == 0 && t + 1 < t1) smp.prefetch(t + 1, first_go, first_gm, true, off_q, msk_q, K, Q);
                    uint4 x[1 << N];
#pragma unroll
                    for (int k = 0; k < (1 << N); ++k) {
                        x[k] = __ldg(reinterpret_cast<const uint4*>(
                            xcl + (smp.row[k] >= 0 ? smp.row[k] : zero_row) * Cp + c0));
                    }
                    if constexpr (fused::Packed<T>::value) {
#pragma unroll
                        for (int k = 0; k < (1 << N); ++k)
                            fused::Packed<T>::fma(out, fused::Packed<T>::weight(smp.weight[k]), x[k]);
                    } else {
                        float acc[VEC];
#pragma unroll
                        for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
#pragma unroll
                        for (int k = 0; k < (1 << N); ++k) fused::Vec<T>::add(acc, smp.weight[k], x[k]);
                        out = fused::Vec<T>::pack(acc);
                    }
                }
                const unsigned words[4] = {out.x, out.y, out.z, out.w};
#pragma unroll
                for (int j = 0; j < VEC; ++j)
                    tile[cl + j][lane_p] = (Bits)(words[j / PER_WORD] >> (32 / PER_WORD * (j % PER_WORD)));
            }
            __syncthreads();
            // (row, pair of positions) by thread, consecutive threads along a row
#pragma unroll 4
            for (int i = threadIdx.x; i < CH * PAIRS; i += COLUMN_THREADS) {
                const int r = i / PAIRS, pair = 2 * (i % PAIRS);
                const I pp = p0 + pair;
                const int c = ct * CH + r;
                if (c >= channels || pp >= BQ) continue;
                Bits* dst = reinterpret_cast<Bits*>(columns + ((I)c * K + t) * BQ + pp);
                if (paired) {   // BQ even: pp + 1 < BQ too, and dst is aligned to the pair
                    *reinterpret_cast<Pair*>(dst) = *reinterpret_cast<const Pair*>(&tile[r][pair]);
                } else {
                    dst[0] = tile[r][pair];
                    if (pp + 1 < BQ) dst[1] = tile[r][pair + 1];
                }
            }
            __syncthreads();
        }
    }
}
