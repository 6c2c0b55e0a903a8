// dcn_cupy: the fused deformable convolution backward to the input, the offset and the mask
// (implicit GEMM on tensor cores, scatter epilogue, no column-gradient buffer).
//
// Column gradients G[(t, c), p] = sum_{o in group} W[o, c, t] * gy[b, o, q] (p = b*Q + q, c an
// input channel of the group). Per block a tile of them for ONE tap t: BM input channels of one
// conv group x BN positions of the flattened batch, reduced over the group's output channels in
// steps of BK on tensor cores (fused::warp_mma, float32 accumulation) from two tiles copied with
// cp.async (double-buffered; rows of 128 bytes swizzled, fused::TILE_XOR, but in strict float32
// in 1D and 2D, see DCN_DATA_TILE_LAYOUT): the weight columns wt[g, c, t, o] (A: rows c, a step
// of K * Cogp apart, K = o contiguous; fused_channels_last of the weight) and the channels-last
// grad_output gycl[p, o] (B: rows p); in TF32 both rounded to TF32 by their copies
// (fused_channels_last_tf32), so that warp_mma takes its fragments as loaded. The tile then goes
// to shared memory (float32) and, in the epilogue, one warp per position (lanes along the
// channels, CPL per lane):
//   * grad_input: G * mask * w_corner is added to the CHANNELS-LAST float32 accumulator
//     gxcl[b, s, c] with 4-channel vector reductions (REDG.ADD.F32x4 on sm_90), CPL/4 per corner
//     and lane, where col2im needs a scalar atomic per channel;
//   * grad_offset / grad_mask: each lane sums, over its channels, G * mask * d sample / d P_a
//     and G * sample (corner values read channels-last from xcl): per corner k first, G . x[k]
//     over its channels, then weighted by the corner's weight and slopes (a non-finite G or
//     mask: channel by channel); the sums of the `seg` lanes of one offset / mask group (a power
//     of two, no segment crossing a group) are added, and the segment's sum goes to the float32
//     accumulators goff / gmsk with one atomic: at 8 lanes a position or more (not DET) each
//     lane leaves its sums in shared memory, and after the block's passes one thread a
//     (position, segment) adds them up (SMEM_SUMS); otherwise shuffles, then the segment's
//     first lane.
// Corners, weights and slopes are computed per (position, tap, lane) with the rules of
// dcn::Corners (DESIGN.md section 1), so that every case is exact as in the im2col path: a
// position outside [-1, S_a) or non-finite samples 0 and gets no gradient; corners of weight
// (slope) exactly 0 are skipped, never multiplied.
//
// Strict float32 (3xTF32): both operands arrive split (fused_channels_last_split: each row of wt and
// gycl twice as long, split_tf32's big parts, then the small ones), each part copied to a tile of its
// own and multiplied by fused::warp_mma_planes, no value split in the loop.
//
// WG (sm_90a, the 64-row tiles): the same copies into swizzled rows (TILE_XOR is the 128-byte
// swizzle wgmma reads), multiplied by wgmma instead of mma.sync, each warpgroup a half of the
// positions; 3xTF32's products of a step summed apart, then added in float32 (DET: per k8, as
// mma.sync adds them, so that both loops give the same bits).
//
// Template parameters: T storage type, I index type, N spatial dims, PREC (0: T's own MMA; 1:
// TF32; 2: 3xTF32), the tile BM x BN x BK, MINB (blocks per multiprocessor asked of the register
// allocator), PLAN (the epilogue reads each (position, tap, segment)'s corners, slopes and mask
// from the chunk's plan, fused_gradient_plan, instead of computing them in every channel-tile
// block), DET (deterministic: the input gradient added in 64-bit fixed point to gxq, with the
// flags and the bounds of fixed_point.cuh, where gxcl is null; the offset and mask gradients
// stored, not added, as one partial sum per segment of channels, slot (channel within its
// group) / (4 * seg) of goff / gmsk, which fused_store adds in a fixed order), CPL (channels per
// epilogue lane: 4, or 8 where every group's channels are a multiple of 8, not DET; the rule,
// cuda_fused_backward.epilogue_lane_channels, takes 8 in 3D only), WG (the wgmma main loop,
// cuda_fused_backward.WGMMA_DATA). 256 threads.
// Dynamic shared memory: cuda_fused_backward.smem_bytes.

#include "fused_common.cuh"
#include "fixed_point.cuh"
#include "wgmma.cuh"

// The data kernel's operand tiles in shared memory (fused::TILE_*): swizzled 128-byte rows
// (TILE_XOR), but strict float32 in 1D and 2D, which keeps the padded rows (TILE_PADDED). H200,
// one process, input gradient (NOTES-gpu.md session 34): fp16, bf16 and TF32 B=8 C256 56x56 8%
// faster, B=16 C512 14x14 fp16 11%, 1D fp16 4%, 3D fp16 1%; strict float32 swizzled (3xTF32 by
// ldmatrix) 0.1-1.3% slower in 2D, 5.5% faster in 3D. Defining DCN_DATA_TILE_LAYOUT (a TILE_*)
// builds one layout for every instantiation, for timing the difference.
#ifndef DCN_DATA_TILE_LAYOUT
#define DCN_DATA_TILE_LAYOUT -1
#endif
// The deterministic scatter's fast path (in the epilogue: a position's values finite, each scaled
// by 2^E once, a corner's reductions issued together). Defining DCN_DET_FAST_PATH 0 builds the
// kernels without it (cuda_fused_backward.DETERMINISTIC_FAST_PATH, the A/B).
#ifndef DCN_DET_FAST_PATH
#define DCN_DET_FAST_PATH 1
#endif
// The weight kernel's: its grad_output tile in swizzled rows of BK, its sampled tile padded and
// b_swizzled (TILE_XOR_A), but in strict float32, which keeps the padded grad_output rows
// (TILE_SWIZZLED_B; its 3xTF32 reads of a swizzled tile would be by ldmatrix, untimed). H200, one
// process, weight gradient alone (NOTES-gpu.md session 34): B=8 C256 56x56 fp16 and TF32 8-9%
// faster, B=16 C512 14x14 fp16 11%, 1D 2-3%, B=32 C64 1-2%, 3D fp16 level. DCN_WEIGHT_TILE_LAYOUT 1
// (TILE_SWIZZLED_B) builds the padded rows everywhere, for timing.
#ifndef DCN_WEIGHT_TILE_LAYOUT
#define DCN_WEIGHT_TILE_LAYOUT -1
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace fused {
// wgmma's N = 32: the data kernel's 64 x 64 tile, a 64 x 32 half per warpgroup (here, not in
// wgmma.cuh, so that the fused forward's module text stays as it was built and tested).
template <> struct Wgmma<__half, 32> {
    static __device__ __forceinline__ void run(float (&d)[16], unsigned long long da, unsigned long long db,
                                               int accumulate = 1) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
            : "l"(da), "l"(db), "r"(accumulate));
    }
};
template <> struct Wgmma<__nv_bfloat16, 32> {
    static __device__ __forceinline__ void run(float (&d)[16], unsigned long long da, unsigned long long db,
                                               int accumulate = 1) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
            : "l"(da), "l"(db), "r"(accumulate));
    }
};
template <> struct Wgmma<float, 32> {
    static __device__ __forceinline__ void run(float (&d)[16], unsigned long long da, unsigned long long db,
                                               int accumulate = 1) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
            : "l"(da), "l"(db), "r"(accumulate));
    }
};
}  // namespace fused
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

namespace fused_bwd {

constexpr int THREADS = 256;

// Four consecutive float32 channels added to global memory (one vector reduction on sm_90).
__device__ __forceinline__ void add4(float* p, float4 v) {
#if __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(p), v);
#else
    atomicAdd(p, v.x);
    atomicAdd(p + 1, v.y);
    atomicAdd(p + 2, v.z);
    atomicAdd(p + 3, v.w);
#endif
}

// (DET) r added to *p by a 64-bit reduction, whatever r (atomicAdd's test of r, a branch, is left
// to the caller).
__device__ __forceinline__ void add_u64(dcn_u64* p, long long r) {
    asm volatile("red.global.add.u64 [%0], %1;\n" :: "l"(p), "l"(r) : "memory");
}

// Four consecutive channels of T from global memory, as float32.
template <typename T> struct Load4;
template <> struct Load4<float> {
    static __device__ __forceinline__ float4 run(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
};
template <> struct Load4<__half> {
    static __device__ __forceinline__ float4 run(const __half* p) {
        const uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&r.x));
        const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&r.y));
        return make_float4(a.x, a.y, b.x, b.y);
    }
};
template <> struct Load4<__nv_bfloat16> {
    static __device__ __forceinline__ float4 run(const __nv_bfloat16* p) {
        const uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
        const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.x));
        const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.y));
        return make_float4(a.x, a.y, b.x, b.y);
    }
};

// A weight-gradient block's tile (both weight kernels): blockIdx.x -> (split, tap t, group grp,
// output-channel tile m0, input-channel tile n0), the last fastest.
struct WeightBlock { int n0, m0, grp, t, split; };
template <typename I>
__device__ __forceinline__ WeightBlock weight_block(I bid, int n_tiles, int m_tiles, int groups, int K, int BM,
                                                    int BN) {
    WeightBlock w;
    w.n0 = (int)(bid % n_tiles) * BN;
    bid /= n_tiles;
    w.m0 = (int)(bid % m_tiles) * BM;
    bid /= m_tiles;
    w.grp = (int)(bid % groups);
    bid /= groups;
    w.t = (int)(bid % K);
    w.split = (int)(bid / K);
    return w;
}

__device__ __forceinline__ float component(const float4& v, int j) {
    return j == 0 ? v.x : (j == 1 ? v.y : (j == 2 ? v.z : v.w));
}

// The sampling position P(q, t) + offset of output position q (coordinates qc) of sample b for
// tap t (coordinates tc) and offset group go; returns the mask value of mask group gm (1 without
// a mask). offset / mask: the arrays (null where absent), their sample strides.
template <typename T, typename I, int N>
__device__ __forceinline__ float sampling_position(const Geom<N>& g, const int (&qc)[N], const int (&tc)[N],
                                                   const T* __restrict__ offset, const T* __restrict__ mask,
                                                   I b, I q, I Q, int K, int t, int go, int gm, I offset_bstride,
                                                   I mask_bstride, float (&pos)[N]) {
#pragma unroll
    for (int a = 0; a < N; ++a) {
        pos[a] = (float)(qc[a] * g.stride[a] - g.pad[a] + tc[a] * g.dil[a]);
        if (offset != nullptr) pos[a] += Traits<T>::load(offset[b * offset_bstride + (((I)go * K + t) * N + a) * Q + q]);
    }
    return mask == nullptr ? 1.0f : Traits<T>::load(mask[b * mask_bstride + ((I)gm * K + t) * Q + q]);
}

// How a weight kernel's epilogue leaves its unit's sums in part (its sum_mode argument,
// cuda_fused_backward.SUMS_*): STORE them in the slot of the unit's split (the first chunk), ADD
// them to it (the chunks after), or REDUCE them (red.global.add) into slot 0, which every split
// shares and which the launches cleared before the first chunk: one slot in place of one a split,
// the splits' sums added in no fixed order (the default mode; cuda_fused_backward.REDUCED_SPLITS).
enum WeightSums { SUMS_STORE = 0, SUMS_ADD = 1, SUMS_REDUCE = 2 };

}  // namespace fused_bwd

// The staged value of fused_channels_first: float32, or (FIXED) the fixed-point sum's double.
template <bool FIXED> struct StagedValue { typedef float type; };
template <> struct StagedValue<true> { typedef double type; };

// gxcl (B, S, Cpa) float32 -> gx (B, C, S) in T (sample stride gx_bstride), plus bias[c] when
// given (the transposed convolution's forward). A 64x64 tile through shared memory per block
// iteration (256 threads as 32 x 8), as fused_channels_last the other way. FIXED: the source is
// the deterministic scatter's fixed-point accumulator gxq with its flags (fixed_point.cuh; the
// sample's exponent from the bounds, as in the scatter) instead of gxcl.
// fused_channels_first_vectors: the same in 16-byte vectors where every vector of a channel's
// positions of gx is whole and aligned (S and gx_bstride multiples of a vector, gx and the source
// aligned; else it too moves elements): in, a float4 of channels a thread (a warp's 8 channel
// quads of 4 positions, each stored as 4 floats to distinct banks), or (FIXED) a 16-byte pair of
// fixed-point sums (a warp's 32 pairs of one position, both flags in one word: Cpa even); out, a
// vector of positions a thread; each value rounded as the element path rounds it.
template <typename T, typename I, bool FIXED, bool VECTORS>
__device__ __forceinline__ void channels_first_copy(
    const float* __restrict__ gxcl, const dcn_u64* __restrict__ gxq, const unsigned* __restrict__ flags,
    const dcn_u64* __restrict__ weight_bound, const dcn_u64* __restrict__ gy_bounds,
    const dcn_u64* __restrict__ mask_bounds, const int log2_count, const T* __restrict__ bias, T* __restrict__ gx,
    const int batch, const int channels, const int Cpa, const I S, const I gx_bstride) {
    fused::start_after_prerequisites();
    typedef typename StagedValue<FIXED>::type V;
    constexpr int TILE = 64;
    __shared__ V tile[TILE][TILE + 1];
    const I s_tiles = (S + TILE - 1) / TILE;
    const int c_tiles = (channels + TILE - 1) / TILE;
    const I blocks = (I)batch * c_tiles * s_tiles;
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;   // 256 threads: 32 x 8
    constexpr int VEC = 16 / (int)sizeof(T);   // positions of a 16-byte vector of gx
    const void* const source = FIXED ? (const void*)gxq : (const void*)gxcl;
    const bool vectors = VECTORS && S % VEC == 0 && gx_bstride % VEC == 0 && Cpa % (FIXED ? 2 : 4) == 0
                         && ((unsigned long long)gx & 15) == 0 && ((unsigned long long)source & 15) == 0;
    for (I blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
        const I st = blk % s_tiles;
        const I rest = blk / s_tiles;
        const int ct = (int)(rest % c_tiles);
        const int b = (int)(rest / c_tiles);
        const I s0 = st * TILE;
        const int c0 = ct * TILE;
        if constexpr (VECTORS) {
            if (vectors) {
                // the tile as floats: FIXED rounds each value plus bias to float as it reads it (the
                // element path's rounding; a tile of doubles read 64 bytes a thread conflicts 8-way)
                float (*const ft)[TILE + 1] = reinterpret_cast<float (*)[TILE + 1]>(&tile[0][0]);
                if constexpr (FIXED) {
                    const int E = dcn_det::exponent(weight_bound, gy_bounds + b,
                                                    mask_bounds == nullptr ? nullptr : mask_bounds + b, log2_count);
                    // read: a warp's 32 channel pairs of one position (512 bytes of gxq); pair
                    // q's values to rows 2q and 2q + 1 (unrolled 4 deep: 64 registers, no spill)
#pragma unroll 4
                    for (int i = 0; i < TILE * TILE / 2 / 256; ++i) {
                        const int e = (int)threadIdx.x + i * 256;
                        const int q = e % (TILE / 2), p = e / (TILE / 2);
                        const I s = s0 + p;
                        const int c = c0 + 2 * q;
                        float v0 = 0.0f, v1 = 0.0f;
                        if (s < S && c < channels) {
                            const I el = ((I)b * S + s) * Cpa + c;   // even: both flags in one word
                            const ulonglong2 sums = *reinterpret_cast<const ulonglong2*>(gxq + el);
                            const unsigned f = flags[el >> 4] >> (2 * (int)(el & 15));
                            const double b0 = bias == nullptr ? 0.0 : (double)Traits<T>::load(bias[c]);
                            const double b1 = bias == nullptr || c + 1 >= channels ? 0.0
                                              : (double)Traits<T>::load(bias[c + 1]);
                            v0 = (float)(dcn_det::value_of(sums.x, f & 3u, E) + b0);
                            v1 = (float)(dcn_det::value_of(sums.y, (f >> 2) & 3u, E) + b1);
                        }
                        ft[2 * q][p] = v0;
                        ft[2 * q + 1][p] = v1;
                    }
                } else {
                    // read: a warp's 8 channel quads of 4 consecutive positions (128 bytes a
                    // position in gxcl); quad q's 4 floats to rows 4q..4q+3, banks 4q + j +
                    // position (mod 32)
#pragma unroll
                    for (int i = 0; i < TILE * TILE / 4 / 256; ++i) {
                        const int e = (int)threadIdx.x + i * 256;
                        const int q = e % 8 + 8 * (e / (8 * TILE)), p = (e / 8) % TILE;
                        const I s = s0 + p;
                        const int c = c0 + 4 * q;
                        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                        if (s < S && c < channels) v = *reinterpret_cast<const float4*>(gxcl + ((I)b * S + s) * Cpa + c);
                        ft[4 * q][p] = v.x;
                        ft[4 * q + 1][p] = v.y;
                        ft[4 * q + 2][p] = v.z;
                        ft[4 * q + 3][p] = v.w;
                    }
                }
                __syncthreads();
                // write: a vector of VEC positions of one channel a thread (coalesced in gx)
                constexpr int CHUNKS = TILE / VEC;
#pragma unroll
                for (int i = 0; i < TILE * CHUNKS / 256; ++i) {
                    const int e = (int)threadIdx.x + i * 256;
                    const int r = e / CHUNKS, k = e % CHUNKS;
                    const int c = c0 + r;
                    const I s = s0 + k * VEC;
                    if (c < channels && s < S) {   // (s < S: the whole vector, S a multiple of VEC)
                        const float bv = FIXED || bias == nullptr ? 0.0f : Traits<T>::load(bias[c]);
                        T out[VEC];
#pragma unroll
                        for (int j = 0; j < VEC; ++j) {
                            out[j] = Traits<T>::store(FIXED ? ft[r][k * VEC + j] : (float)(ft[r][k * VEC + j] + bv));
                        }
                        uint4 bits;
                        memcpy(&bits, out, 16);
                        *reinterpret_cast<uint4*>(gx + (I)b * gx_bstride + (I)c * S + s) = bits;
                    }
                }
                __syncthreads();
                continue;
            }
        }
        int E = 0;
        if constexpr (FIXED) E = dcn_det::exponent(weight_bound, gy_bounds + b, mask_bounds == nullptr ? nullptr : mask_bounds + b,
                                                   log2_count);
        // read: threadIdx.x along channels (coalesced in gxcl / gxq)
#pragma unroll
        for (int r = ty; r < TILE; r += 8) {
            const I s = s0 + r;
#pragma unroll
            for (int h = 0; h < TILE; h += 32) {
                const int c = c0 + tx + h;
                V v = V(0);
                if (s < S && c < channels) {
                    const I e = ((I)b * S + s) * Cpa + c;
                    if constexpr (FIXED) {
                        v = dcn_det::value(gxq, flags, (long long)e, E);
                    } else {
                        v = gxcl[e];
                    }
                }
                tile[tx + h][r] = v;
            }
        }
        __syncthreads();
        // write: threadIdx.x along positions (coalesced in gx)
#pragma unroll
        for (int r = ty; r < TILE; r += 8) {
            const int c = c0 + r;
            if (c >= channels) continue;
            const V bv = bias == nullptr ? V(0) : V(Traits<T>::load(bias[c]));
#pragma unroll
            for (int h = 0; h < TILE; h += 32) {
                const I s = s0 + tx + h;
                if (s < S) gx[(I)b * gx_bstride + (I)c * S + s] = Traits<T>::store((float)(tile[r][tx + h] + bv));
            }
        }
        __syncthreads();
    }
}

template <typename T, typename I, bool FIXED>
__global__ void fused_channels_first(
    const float* __restrict__ gxcl, const dcn_u64* __restrict__ gxq, const unsigned* __restrict__ flags,
    const dcn_u64* __restrict__ weight_bound, const dcn_u64* __restrict__ gy_bounds,
    const dcn_u64* __restrict__ mask_bounds, const int log2_count, const T* __restrict__ bias, T* __restrict__ gx,
    const int batch, const int channels, const int Cpa, const I S, const I gx_bstride) {
    channels_first_copy<T, I, FIXED, false>(gxcl, gxq, flags, weight_bound, gy_bounds, mask_bounds, log2_count, bias,
                                            gx, batch, channels, Cpa, S, gx_bstride);
}

// (At most 64 registers, as fused_channels_last_vectors.)
template <typename T, typename I, bool FIXED>
__global__ void __launch_bounds__(256, 4) fused_channels_first_vectors(
    const float* __restrict__ gxcl, const dcn_u64* __restrict__ gxq, const unsigned* __restrict__ flags,
    const dcn_u64* __restrict__ weight_bound, const dcn_u64* __restrict__ gy_bounds,
    const dcn_u64* __restrict__ mask_bounds, const int log2_count, const T* __restrict__ bias, T* __restrict__ gx,
    const int batch, const int channels, const int Cpa, const I S, const I gx_bstride) {
    channels_first_copy<T, I, FIXED, true>(gxcl, gxq, flags, weight_bound, gy_bounds, mask_bounds, log2_count, bias,
                                           gx, batch, channels, Cpa, S, gx_bstride);
}

// bounds[b] = max |a[b, :]| over the finite entries of each of `batch` samples of `per_sample`
// elements, `sample_stride` elements apart (any stride, 0 included): the deterministic scatter's
// bounds of grad_output and the mask (fixed_point.cuh), as cuda/im2col-deterministic's
// det_sample_bound, but one sample a block: block k takes sample k / slices, its slice k % slices,
// in 16-byte vectors where the samples are whole and aligned ones. Maxima of float values are
// exact, so the bound is that kernel's, bitwise. `bounds` must be zero before the launch. (H200,
// B=8 C256 56x56 fp16, grad_output and mask: 34 us as det_sample_bound, NOTES-gpu.md session 46.)
template <typename T, typename I>
__global__ void fused_sample_bound(const T* __restrict__ a, const I per_sample, const I sample_stride,
                                   const int batch, const int slices, dcn_u64* __restrict__ bounds) {
    fused::start_after_prerequisites();
    constexpr int VEC = 16 / (int)sizeof(T);
    const int b = (int)(blockIdx.x / slices);
    if (b >= batch) return;
    const T* const p = a + (I)b * sample_stride;
    const I first = (I)(blockIdx.x % slices) * blockDim.x + threadIdx.x, step = (I)slices * blockDim.x;
    float local = 0.0f;
    if (per_sample % VEC == 0 && sample_stride % VEC == 0 && ((unsigned long long)a & 15) == 0) {
        for (I i = first; i < per_sample / VEC; i += step) {
            const uint4 bits = __ldg(reinterpret_cast<const uint4*>(p) + i);
            T v[VEC];
            memcpy(v, &bits, 16);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float m = fabsf(Traits<T>::load(v[j]));
                if (isfinite(m)) local = fmaxf(local, m);   // finite entries only
            }
        }
    } else {
        for (I i = first; i < per_sample; i += step) {
            const float m = fabsf(Traits<T>::load(p[i]));
            if (isfinite(m)) local = fmaxf(local, m);
        }
    }
    const double top = dcn_det::block_max((double)local);
    if (threadIdx.x == 0) dcn_det::atomic_max_bound(bounds + b, top);
}

// src (slots, B, per_sample) float32 -> dst in T (sample stride dst_bstride): the offset and mask
// gradients out of their accumulators, the slots (the deterministic data kernel's partial sums
// per segment of channels; 1 slot otherwise) added in their order.
template <typename T, typename I>
__global__ void fused_store(const float* __restrict__ src, T* __restrict__ dst, const int batch,
                            const I per_sample, const I dst_bstride, const int slots) {
    fused::start_after_prerequisites();
    const I total = (I)batch * per_sample;
    for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
        const I b = idx / per_sample;
        float v = src[idx];
        for (int k = 1; k < slots; ++k) v += src[idx + (I)k * total];
        dst[b * dst_bstride + idx % per_sample] = Traits<T>::store(v);
    }
}

// The data kernel's operands in strict float32 (3xTF32), split once by their channels-last copies
// instead of in every warp that reads them: rows of 2 * Cp floats, split_tf32's big parts of the
// values, then their small parts (channels_last_copy's SPLIT). The 2D data kernel, 64x64x32:
// 2416 -> 1824 instructions; H200, data gradients alone, B=8 C256 56x56 1.537 -> 1.080 ms, B=16
// C512 14x14 0.735 -> 0.483, 1D B=16 C256 L4096 1.384 -> 1.032, B=32 C64 0.652 -> 0.626, 3D level
// (NOTES-gpu.md, session 43; then by a pass of its own over the copy, fused_split_planes, folded
// into the copies in session 47). float32 alone, hence no dtype parameter.
template <typename I>
__global__ void fused_channels_last_split(const float* __restrict__ x, float* __restrict__ xcl, const int batch,
                                          const int channels, const int Cp, const I S, const I x_bstride,
                                          float* __restrict__ sums, float* __restrict__ xr, const I Pp,
                                          const int early) {
    channels_last_copy<float, I, false, false, true>(x, xcl, batch, channels, Cp, S, x_bstride, sums, xr, Pp,
                                                     early);
}

template <typename I>
__global__ void __launch_bounds__(256, DCN_LAYOUT_MIN_BLOCKS)
fused_channels_last_vectors_split(const float* __restrict__ x, float* __restrict__ xcl, const int batch,
                                  const int channels, const int Cp, const I S, const I x_bstride,
                                  float* __restrict__ sums, float* __restrict__ xr, const I Pp,
                                  const int early) {
    channels_last_copy<float, I, true, false, true>(x, xcl, batch, channels, Cp, S, x_bstride, sums, xr, Pp,
                                                    early);
}

// The TF32 data kernel's operand rows (wt, gycl): fused_channels_last and
// fused_channels_last_vectors with xcl rounded to TF32 (cvt.rna once here, where warp_mma would
// round every fragment it loads; the sums and xr keep the values). float32 alone, as
// fused_channels_last_split. H200, TF32 data gradients alone, B=8 C256 56x56 0.557 -> 0.504 ms,
// B=16 C512 14x14 0.224 -> 0.194, 1D 0.554 -> 0.499 (NOTES-gpu.md, session 45).
template <typename I>
__global__ void fused_channels_last_tf32(const float* __restrict__ x, float* __restrict__ xcl, const int batch,
                                         const int channels, const int Cp, const I S, const I x_bstride,
                                         float* __restrict__ sums, float* __restrict__ xr, const I Pp,
                                         const int early) {
    channels_last_copy<float, I, false, true>(x, xcl, batch, channels, Cp, S, x_bstride, sums, xr, Pp,
                                              early);
}

template <typename I>
__global__ void __launch_bounds__(256, DCN_LAYOUT_MIN_BLOCKS)
fused_channels_last_vectors_tf32(const float* __restrict__ x, float* __restrict__ xcl, const int batch,
                                 const int channels, const int Cp, const I S, const I x_bstride,
                                 float* __restrict__ sums, float* __restrict__ xr, const I Pp,
                                 const int early) {
    channels_last_copy<float, I, true, true>(x, xcl, batch, channels, Cp, S, x_bstride, sums, xr, Pp,
                                             early);
}

// The data gradients' plan of a batch chunk: per (segment j of seg_len channels sharing an
// offset and a mask group, tap t, position p = b*Q + q), entry e = (j * K + t) * B*Q + p, what
// the data kernel's epilogue otherwise computes in each of its C_in/BM channel-tile blocks: the
// corners of dcn::Corners (rows[e][k] = b*S + the corner's flat index, -1 where the corner is
// off the grid or the position samples 0; weights[e][k]; slopes[e][k][a] = d weight / d P_a)
// and the mask value masks[e]. One thread per entry, positions fastest.
template <typename T, typename I, int N>
__global__ void fused_gradient_plan(const T* __restrict__ offset, const T* __restrict__ mask, I* __restrict__ rows,
                                    float* __restrict__ weights, float* __restrict__ slopes,
                                    float* __restrict__ masks, const Geom<N> g, const int batch, const int channels,
                                    const int offset_groups, const int mask_groups, const int seg_len,
                                    const int segments, const I offset_bstride, const I mask_bstride) {
    fused::start_after_prerequisites();
    constexpr int NC = 1 << N;
    const fused::PlanEntries<I, N> pe(g, batch, channels, offset != nullptr, offset_groups, mask != nullptr,
                                      mask_groups, seg_len, segments);
    for (I e = dcn::global_thread_index<I>(); e < pe.total; e += dcn::global_thread_stride<I>()) {
        I b, q;
        int qc[N], t, go, gm, tc[N];
        pe.decode(e, g, b, q, qc, t, go, gm);
        dcn::unravel<N, int>(t, g.ksize, tc);
        // as the data kernel's epilogue (deform_fused_backward_data, PLAN false)
        float pos[N];
        masks[e] = fused_bwd::sampling_position(g, qc, tc, offset, mask, b, q, pe.Q, pe.K, t, go, gm,
                                                offset_bstride, mask_bstride, pos);
        dcn::Corners<float, I, N> cr;
        cr.compute(pos, g.in_size);
        // (a corner off the grid, or of a position that samples 0, has weight and slopes 0)
        I row[NC];
        float slope[NC * N];
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            row[k] = cr.ok[k] ? b * pe.S + cr.index[k] : (I)-1;
#pragma unroll
            for (int a = 0; a < N; ++a) slope[k * N + a] = cr.dweight[k][a];
        }
        fused::store_words(rows + e * NC, row);
        fused::store_words(weights + e * NC, cr.weight);
        fused::store_words(slopes + e * NC * N, slope);
    }
}

// WG (sm_90a): the main loop on wgmma, each warpgroup a half of the 64 x 64 or 64 x 128 tile
// (m64n32 / m64n64, K-major operands in the swizzled rows of TILE_XOR, the shared memory lifted
// to their 1024-byte period: cuda_fused_backward asks 1 KiB more), same copies, staging and
// epilogue; in 3xTF32 each step's products summed apart and added to the accumulators in float32
// (as warp_mma_planes does per k8). Else (false) the mma.sync main loop.
template <typename T, typename I, int N, int PREC, int BM, int BN, int BK, int MINB, bool PLAN, bool DET, int CPL,
          int LANES, bool WG = false>
__global__ void __launch_bounds__(fused_bwd::THREADS, MINB)
deform_fused_backward_data(const T* __restrict__ gycl, const T* __restrict__ wt, const T* __restrict__ xcl,
                           const T* __restrict__ offset, const T* __restrict__ mask,
                           float* __restrict__ gxcl, float* __restrict__ goff, float* __restrict__ gmsk,
                           const Geom<N> g, const int batch, const int channels, const int Cp, const int Cpa,
                           const int out_channels, const int Cop, const int groups, const int offset_groups,
                           const int mask_groups, const int Cogp, const I offset_bstride, const I mask_bstride,
                           const int seg, const I* __restrict__ plan_rows, const float* __restrict__ plan_weights,
                           const float* __restrict__ plan_slopes, const float* __restrict__ plan_masks,
                           const int seg_len, dcn_u64* __restrict__ gxq, unsigned* __restrict__ gx_flags,
                           const dcn_u64* __restrict__ weight_bound, const dcn_u64* __restrict__ gy_bounds,
                           const dcn_u64* __restrict__ mask_bounds, const int log2_count) {
    using namespace fused;
    start_after_prerequisites();
    using fused_bwd::THREADS;
    constexpr int VEC = Tile<T>::VEC;
    constexpr int LAYOUT = WG ? TILE_XOR : DCN_DATA_TILE_LAYOUT >= 0 ? DCN_DATA_TILE_LAYOUT
                           : PREC == 2 && N < 3 ? TILE_PADDED : TILE_XOR;   // (above the kernels)
    static_assert(LAYOUT == TILE_PADDED || (LAYOUT == TILE_XOR && BK * sizeof(T) == 128), "tile layout");
    // shared row length (A: per input channel, B: per position)
    constexpr int LD = LAYOUT == TILE_XOR ? BK : BK + Tile<T>::PAD;
    constexpr int WARPS = THREADS / 32;
    constexpr int WARPS_N = BN / 32, WARPS_M = WARPS / WARPS_N;
    constexpr int WM = BM / WARPS_M, WN = 32;        // warp tile
    constexpr int MT = WM / 16, NT = WN / 8;         // mma tiles per warp
    constexpr int A_VECS = BM * BK / VEC / THREADS;  // 16-byte vectors copied per thread and step
    constexpr int B_VECS = BN * BK / VEC / THREADS;
    constexpr int GLD = BM + 4;                      // row of the staged column-gradient tile (floats)
    constexpr int NC = 1 << N;
    constexpr int PPW = 32 / LANES;                  // positions per warp and pass of the epilogue
    constexpr int V4 = CPL / 4;                      // a lane's channels, in fours
    constexpr int PLANES = PREC == 2 ? 2 : 1;        // 3xTF32: each operand tile's big, then small parts
    static_assert(A_VECS >= 1 && B_VECS >= 1 && MT >= 1 && NT % 2 == 0 && BM % 64 == 0, "tile shape");
    static_assert((CPL == 4 || CPL == 8) && (!DET || CPL == 4), "channels per lane: 4, or 8 (not deterministic)");
    static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0 && LANES * CPL <= BM, "epilogue lanes");

    extern __shared__ __align__(128) unsigned char fused_smem[];
    unsigned char* const smem = WG ? fused_smem + ((1024u - (smem_address(fused_smem) & 1023u)) & 1023u) : fused_smem;
    T* const As0 = reinterpret_cast<T*>(smem);
    T* const Bs0 = As0 + 2 * PLANES * BM * LD;
    float* const Gs = reinterpret_cast<float*>(smem);   // after the main loop: G[BN][GLD]
    // (not DET) after G: each lane's offset and mask partial sums, Ps[a][n][slot] (a < N: offset
    // dimension a, a = N: mask; slot: the lane's channel quad (octet) within the tile), summed per
    // segment after the passes
    // (four lanes a position or fewer keep the shuffles: two levels cost less than the sums' pass,
    // H200 3D transposed fp16 206 -> 212 us, NOTES-gpu.md session 21; DET always sums here, so
    // that every tile and lane count adds a segment's partial sums in the same order)
    constexpr bool SMEM_SUMS = DET || LANES >= 8;
    constexpr int SLOTS = BM / CPL;
    constexpr int PLD = SLOTS + 1;                   // odd: the sums' reads by position are conflict-free
    float* const Ps = Gs + BN * GLD;

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;

    const I Q = dcn::prod_size<N, I>(g.out_size);
    const I S = dcn::prod_size<N, I>(g.in_size);
    const int K = (int)dcn::prod_size<N, I>(g.ksize);
    const I BQ = (I)batch * Q;
    const int Cg = channels / groups;
    const int Cog = out_channels / groups;
    const int per_go = offset == nullptr ? channels : channels / offset_groups;
    const int per_gm = mask == nullptr ? channels : channels / mask_groups;
    const int m_tiles = (Cg + BM - 1) / BM;
    // block -> (position tile, tap, group, channel tile), channel tiles fastest: the blocks of one
    // position tile run together and share its grad_output rows in L2
    I bid = blockIdx.x;
    const int m0 = (int)(bid % m_tiles) * BM;
    bid /= m_tiles;
    const int grp = (int)(bid % groups);
    bid /= groups;
    const int t = (int)(bid % K);
    const I p0 = (bid / K) * BN;
    const int steps = (Cog + BK - 1) / BK;
    // the tile's first position as (sample, position within it): a position's own (b, q) then
    // follows without a division per position where the tile lies within one or two samples
    const I b0 = p0 / Q;
    const I q0 = p0 - b0 * Q;

    // This thread's copies: A rows a_r0 + j * R_STEP, B rows likewise, vector kv of the step.
    constexpr int R_STEP = THREADS / (BK / VEC);
    const int r0 = tid / (BK / VEC);
    const int kv = (tid % (BK / VEC)) * VEC;
    const I a_step = (I)K * Cogp;   // wt[g, c, t, o]: one input channel's row per K * Cogp
    const T* const a_row0 = wt + (((I)grp * Cg + m0 + r0) * K + t) * Cogp + kv;
    // 3xTF32: each row of wt and gycl holds its big parts, then its small ones (fused_channels_last_split;
    // Cogp and Cop the rows' whole lengths), copied to tiles of their own
    const int a_plane = PLANES == 2 ? Cogp / 2 : 0, b_plane = PLANES == 2 ? Cop / 2 : 0;
    auto copy_step = [&](int step, int buf) {
        const int o0 = step * BK;
#pragma unroll
        for (int h = 0; h < PLANES; ++h) {
#pragma unroll
            for (int j = 0; j < A_VECS; ++j) {
                const int r = r0 + j * R_STEP;
                const bool full = m0 + r < Cg;
                copy16_async(As0 + (buf * PLANES + h) * BM * LD + tile_offset<T, LAYOUT == TILE_XOR, LD>(r, kv),
                             full ? a_row0 + j * R_STEP * a_step + o0 + h * a_plane : wt, full);
            }
#pragma unroll
            for (int j = 0; j < B_VECS; ++j) {
                const int r = r0 + j * R_STEP;
                const I p = p0 + r;
                const bool full = p < BQ && o0 + kv < Cog;
                copy16_async(Bs0 + (buf * PLANES + h) * BN * LD + tile_offset<T, LAYOUT == TILE_XOR, LD>(r, kv),
                             full ? gycl + p * Cop + grp * Cog + o0 + kv + h * b_plane : gycl, full);
            }
        }
        copy_commit();
    };
    // Step s's tiles landed (in buffer s & 1): the next step's copy issued first, into the other.
    auto await_step = [&](int s) {
        if (s + 1 < steps) {
            copy_step(s + 1, (s & 1) ^ 1);
            copy_wait_pending<1>();
        } else {
            copy_wait_all();
        }
    };

    if constexpr (WG) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        static_assert(BM == 64 && (BN == 64 || BN == 128) && LAYOUT == TILE_XOR && THREADS == 256,
                      "wgmma data tile: 64 x 64 or 64 x 128");
        constexpr int KSTEP = PREC == 0 ? 16 : 8;                 // wgmma K
        constexpr int WG_N = BN / 2, NACC = WG_N / 2;             // a warpgroup's positions, accumulators
        constexpr unsigned A_PLANE = BM * LD * sizeof(T), B_PLANE = BN * LD * sizeof(T);
        const int wg = warp >> 2;                                 // positions wg * WG_N ...
        // (DET 3xTF32: each k8's products summed apart and added in k order, as warp_mma_planes
        // does, so that every tile gives the same bits; on the 64 x 64 tile, whose accumulators
        // leave room, two k8 groups in flight, PB. Else a step's products at once.)
        constexpr int KS = BK / KSTEP, GROUP = PLANES == 2 && DET ? 1 : KS;
        constexpr int PB = PLANES == 2 && DET && NACC <= 16 ? 2 : 1;
        float d[1][NACC], p[PB][1][NACC];   // (p: 3xTF32's products of a group; else unused, no registers)
#pragma unroll
        for (int i = 0; i < NACC; ++i) d[0][i] = 0.0f;
        // (128-byte swizzle, K-major: 8-row groups 1024 bytes apart; a k step is the next KSTEP
        // elements of each row, the hardware applying the swizzle to the address)
        const unsigned long long a_desc0 = wgmma_descriptor(As0, 16, 1024) | (1ull << 62);
        const unsigned long long b_desc0 = wgmma_descriptor(Bs0 + wg * WG_N * LD, 16, 1024) | (1ull << 62);
        auto add_products = [&](float (&q)[1][NACC]) {
            register_fence(q);
#pragma unroll
            for (int i = 0; i < NACC; ++i) d[0][i] += q[0][i];
        };
        copy_step(0, 0);
        for (int s = 0; s < steps; ++s) {
            const int cur = s & 1;
            await_step(s);
            proxy_fence();   // the copies' writes, seen by the wgmmas' (async proxy) reads
            __syncthreads();
#pragma unroll
            for (int k0 = 0; k0 < KS; k0 += GROUP) {
                float (&acc)[1][NACC] = PLANES == 2 ? p[k0 / GROUP % PB] : d;
                register_fence(acc);
                wgmma_fence();
#pragma unroll
                for (int ks = k0; ks < k0 + GROUP; ++ks) {
                    const unsigned long long da = wgmma_descriptor_at(a_desc0, cur * PLANES * A_PLANE + ks * KSTEP * sizeof(T));
                    const unsigned long long db = wgmma_descriptor_at(b_desc0, cur * PLANES * B_PLANE + ks * KSTEP * sizeof(T));
                    if constexpr (PLANES == 2) {
                        Wgmma<T, WG_N>::run(acc[0], wgmma_descriptor_at(da, A_PLANE), db, ks == k0 ? 0 : 1);
                        Wgmma<T, WG_N>::run(acc[0], da, wgmma_descriptor_at(db, B_PLANE));
                        Wgmma<T, WG_N>::run(acc[0], da, db);
                    } else {
                        Wgmma<T, WG_N>::run(acc[0], da, db);
                    }
                }
                wgmma_commit();
                if constexpr (PB == 2) {
                    if (k0 > 0) {   // the group before landed: its products added
                        wgmma_wait_pending<1>();
                        add_products(p[(k0 / GROUP + 1) % 2]);
                    }
                } else {
                    wgmma_wait_all();
                    register_fence(acc);
                    if constexpr (PLANES == 2) add_products(p[0]);
                }
            }
            if constexpr (PB == 2) {
                wgmma_wait_all();
                add_products(p[(KS / GROUP - 1) % 2]);
            }
            __syncthreads();   // (the next step's copy overwrites the other buffer)
        }
        // Stage the tile: Gs[position][channel], from the m64n(WG_N) fragments (warp w of the
        // warpgroup: rows 16w ..; register i: row + 8 * (i / 2 % 2), column 8 * (i / 4) + i % 2).
        {
            const int w4 = warp & 3, gq = lane >> 2, tq = lane & 3;
#pragma unroll
            for (int i = 0; i < NACC; ++i) {
                const int row = w4 * 16 + gq + ((i >> 1) & 1) * 8;
                const int n = wg * WG_N + (i >> 2) * 8 + 2 * tq + (i & 1);
                Gs[n * GLD + row] = d[0][i];
            }
        }
#else
        __trap();   // (instantiated for sm_90a alone)
#endif
    } else {
        float acc[MT][NT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

        copy_step(0, 0);
        for (int s = 0; s < steps; ++s) {
            const int cur = s & 1;
            await_step(s);
            __syncthreads();
            if constexpr (PLANES == 2) {
                const float* const a = reinterpret_cast<const float*>(As0 + cur * 2 * BM * LD);
                const float* const b = reinterpret_cast<const float*>(Bs0 + cur * 2 * BN * LD);
                warp_mma_planes<MT, NT, LD, BK, WM, WN, LAYOUT>(acc, a, a + BM * LD, b, b + BN * LD, wm, wn, lane);
            } else {
                // (TF32: both operands' rows rounded by their copies, fused_channels_last_tf32)
                warp_mma<T, PREC, ROUNDED_A | ROUNDED_B, MT, NT, LD, BK, WM, WN, LAYOUT>(acc, As0 + cur * BM * LD,
                                                                                       Bs0 + cur * BN * LD, wm, wn, lane);
            }
            __syncthreads();
        }

        // Stage the tile: Gs[position][channel], from the fragments (row = channel, column = position).
        {
            const int gq = lane >> 2, tq = lane & 3;
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = wm * WM + i * 16 + gq + (e >> 1) * 8;
                        const int n = wn * WN + j * 8 + 2 * tq + (e & 1);
                        Gs[n * GLD + row] = acc[i][j][e];
                    }
        }
    }
    __syncthreads();

    // Epilogue: warp w takes positions w*PPW + pass*WARPS*PPW ..., LANES lanes per position, each
    // lane CPL channels at a time (BM/CPL/LANES passes over the tile's channels of the group). A
    // position's corners, weights and branches are the same for all its lanes: 8 channels per
    // lane pay them once for twice the channels (all group sizes multiples of 8), in more
    // registers. LANES is min(32, BM/CPL), or half that where a group's channels fit half the
    // tile (C_in/groups = 32 under BM = 64): no lane then idles, and a warp takes twice the
    // positions; the passes stop at the group's last channel (the full tile's single pass is
    // left as it was: a runtime bound there costs registers, NOTES-gpu.md session 17).
    const int sub = lane / LANES;             // which of the warp's PPW positions
    const int lane_c = (lane % LANES) * CPL;  // this lane's first channel within a pass
    // (DET) a pass's channels share their groups, and so its lanes their corners: every lane is
    // active or none (C_in/groups and the group sizes are multiples of 4 * seg)
    const bool uniform = seg == LANES;
    int tc[N];
    dcn::unravel<N, int>(t, g.ksize, tc);
    for (int n0 = warp * PPW; n0 < BN; n0 += WARPS * PPW) {
        const int n = n0 + sub;
        const I p = p0 + n;
        const bool pvalid = p < BQ;
        I b = 0, q = 0;
        if (pvalid) {
            b = b0;
            q = q0 + n;
            if (q >= Q) {   // a later sample: one division, only where the tile crosses samples
                const I d = q / Q;
                b += d;
                q -= d * Q;
            }
        }
        int qc[N];
        dcn::unravel<N, I>(q, g.out_size, qc);
        [[maybe_unused]] int E = 0;   // (DET) the sample's fixed-point exponent
        if constexpr (DET) {
            if (pvalid && gxq != nullptr) {
                E = dcn_det::exponent(weight_bound, gy_bounds + b, mask_bounds == nullptr ? nullptr : mask_bounds + b,
                                      log2_count);
            }
        }
#pragma unroll 1
        for (int cpass = 0; cpass < BM && (LANES * CPL == BM || m0 + cpass < Cg); cpass += LANES * CPL) {
            const int c = m0 + cpass + lane_c;          // channel within the group
            const bool active = pvalid && c < Cg;
            const int cabs = grp * Cg + c;
            float goff_part[N];
#pragma unroll
            for (int a = 0; a < N; ++a) goff_part[a] = 0.0f;
            float gmask_part = 0.0f;
            int go = 0, gm = 0;
            if (active) {
                go = per_go >= channels ? 0 : cabs / per_go;
                gm = per_gm >= channels ? 0 : cabs / per_gm;
                float m;
                dcn::Corners<float, I, N> cr;
                I crow[NC];   // the corners' rows b * S + index of xcl, gxcl and gxq
                if constexpr (PLAN) {
                    // the plan's corners (fused_gradient_plan): rows b*S + index, -1 where not on
                    // the grid or where the position samples 0 (then every weight and slope is 0)
                    const I e = ((I)(seg_len >= channels ? 0 : cabs / seg_len) * K + t) * BQ + p;
                    I row[NC];
                    float slope[NC * N];
                    fused::load_words(plan_rows + e * NC, row);
                    fused::load_words(plan_weights + e * NC, cr.weight);
                    fused::load_words(plan_slopes + e * NC * N, slope);
                    m = __ldg(plan_masks + e);
                    cr.valid = true;
#pragma unroll
                    for (int k = 0; k < NC; ++k) {
                        cr.ok[k] = row[k] >= 0;
                        crow[k] = row[k];
#pragma unroll
                        for (int a = 0; a < N; ++a) cr.dweight[k][a] = slope[k * N + a];
                    }
                } else {
                    float pos[N];
                    m = fused_bwd::sampling_position(g, qc, tc, offset, mask, b, q, Q, K, t, go, gm, offset_bstride,
                                                     mask_bstride, pos);
                    cr.compute(pos, g.in_size);
#pragma unroll
                    for (int k = 0; k < NC; ++k) crow[k] = (I)b * S + cr.index[k];
                }
                if (cr.valid) {
                    float4 gc[V4];
#pragma unroll
                    for (int v = 0; v < V4; ++v) gc[v] = *reinterpret_cast<const float4*>(Gs + n * GLD + cpass + lane_c + 4 * v);
                    if constexpr (DET) {
                        if (gxq != nullptr) {
                            // exact integer sums, in any order. Where the lanes share their corners,
                            // lane i adds channels i, i + LANES, ...: each reduction instruction then
                            // covers consecutive 8-byte words (a lane's 4 consecutive channels would
                            // touch twice the sectors: H200, 2x slower alone)
                            const int lane_first = uniform ? lane % LANES : lane_c;   // channel in the pass
                            const int lane_step = uniform ? LANES : 1;
                            const I first = (I)grp * Cg + m0 + cpass + lane_first;    // its channel j: + step * j
                            float value[4];
                            bool fast = DCN_DET_FAST_PATH && E >= -126 && E <= 100;
#pragma unroll
                            for (int j = 0; j < 4; ++j) {
                                value[j] = Gs[n * GLD + cpass + lane_first + lane_step * j] * m;
                                fast = fast && isfinite(value[j]);
                            }
                            if (fast) {
                                // Fast path: every value finite (so is every w * v, |w| <= 1) and 2^E a
                                // normal float <= 2^100. Each value is scaled by 2^E once and each
                                // corner's w * v * 2^E rounded to an integer: ldexpf(w * v, E)'s integers
                                // (a power of two scales a normal float exactly and commutes with the
                                // product's rounding; where either product is subnormal both integers
                                // are 0, as |w * v * 2^E| < 2^-26). A corner's 4 reductions go out
                                // together behind one branch, zeros included. The general loop (ldexpf's
                                // 4 multiplies, a test and a branch a contribution) kept the kernel
                                // waiting on dependent chains (H200, NOTES-gpu.md session 55).
                                const float scale = __int_as_float((E + 127) << 23);
#pragma unroll
                                for (int j = 0; j < 4; ++j) value[j] *= scale;
#pragma unroll
                                for (int k = 0; k < NC; ++k) {
                                    const float w = cr.weight[k];
                                    if (cr.ok[k] && w != 0.0f) {
                                        dcn_u64* const dst = gxq + crow[k] * Cpa + first;
                                        long long r[4];
#pragma unroll
                                        for (int j = 0; j < 4; ++j) r[j] = __float2ll_rn(w * value[j]);
#pragma unroll
                                        for (int j = 0; j < 4; ++j) fused_bwd::add_u64(dst + lane_step * j, r[j]);
                                    }
                                }
                            } else {
                                // the general loop: a non-finite value (flagged) or E out of that range
#pragma unroll
                                for (int j = 0; j < 4; ++j) {
#pragma unroll
                                    for (int k = 0; k < NC; ++k) {
                                        const float w = cr.weight[k];
                                        if (cr.ok[k] && w != 0.0f) {
                                            dcn_det::accumulate_float(gxq, gx_flags,
                                                                      (long long)(crow[k] * Cpa + first + lane_step * j),
                                                                      w * value[j], E);
                                        }
                                    }
                                }
                            }
                        }
                    } else if (gxcl != nullptr) {
                        float4 v[V4];
#pragma unroll
                        for (int u = 0; u < V4; ++u) v[u] = make_float4(gc[u].x * m, gc[u].y * m, gc[u].z * m, gc[u].w * m);
#pragma unroll
                        for (int k = 0; k < NC; ++k) {
                            const float w = cr.weight[k];
                            if (cr.ok[k] && w != 0.0f) {
                                float* const dst = gxcl + crow[k] * Cpa + cabs;
#pragma unroll
                                for (int u = 0; u < V4; ++u)
                                    fused_bwd::add4(dst + 4 * u, make_float4(w * v[u].x, w * v[u].y, w * v[u].z, w * v[u].w));
                            }
                        }
                    }
                    if (goff != nullptr || gmsk != nullptr) {
                        float4 xv[NC][V4];
#pragma unroll
                        for (int k = 0; k < NC; ++k) {
                            const T* const src = xcl + crow[k] * Cp + cabs;
#pragma unroll
                            for (int u = 0; u < V4; ++u)
                                xv[k][u] = cr.ok[k] ? fused_bwd::Load4<T>::run(src + 4 * u) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                        }
                        // Per corner first: dot[k] = sum over the lane's channels of cg * x[k], then
                        // the mask term sum_k w_k dot[k] and the offset terms m sum_k slope_ka dot[k],
                        // a corner of zero weight (slope) skipped as channel by channel. The same sums
                        // in another order, in about half the instructions: the per-channel form
                        // tested each corner's weight and slopes again for every channel (ALU-bound
                        // at 64 registers). The same result only for finite cg and m: an infinite cg
                        // times a zero x inside dot[k] would give NaN where the per-channel sum
                        // w * 0 + w' * x' is finite; so a non-finite one takes the per-channel form.
                        // H200, data kernel, 2D fp16 B=8 C256 56x56 453 -> 418 us, 3D transposed
                        // 223 -> 206 us (NOTES-gpu.md, session 20).
                        float probe = m;
#pragma unroll
                        for (int u = 0; u < V4; ++u) probe += (gc[u].x + gc[u].y) + (gc[u].z + gc[u].w);
                        if (isfinite(probe)) {
                            float dot[NC];
#pragma unroll
                            for (int k = 0; k < NC; ++k) {
                                dot[k] = 0.0f;
#pragma unroll
                                for (int jj = 0; jj < CPL; ++jj)
                                    dot[k] = fmaf(fused_bwd::component(gc[jj / 4], jj % 4),
                                                  fused_bwd::component(xv[k][jj / 4], jj % 4), dot[k]);
                            }
                            const auto corner_dot = [&](int k) { return dot[k]; };
                            float sv, d;
                            if (gmsk != nullptr &&
                                dcn::nonzero_corner_sum<NC>([&](int k) { return cr.weight[k]; }, corner_dot, sv))
                                gmask_part += sv;
                            if (goff != nullptr) {
#pragma unroll
                                for (int a = 0; a < N; ++a)
                                    if (dcn::nonzero_corner_sum<NC>([&](int k) { return cr.dweight[k][a]; },
                                                                    corner_dot, d))
                                        goff_part[a] += m * d;
                            }
                        } else {
                            // a non-finite column gradient or mask: channel by channel, as
                            // dcn::accumulate_position_gradients
#pragma unroll
                            for (int jj = 0; jj < CPL; ++jj) {
                                const int u = jj / 4, j = jj % 4;
                                const float cg = fused_bwd::component(gc[u], j);
                                const auto corner_value = [&](int k) { return fused_bwd::component(xv[k][u], j); };
                                float sv, d;
                                if (gmsk != nullptr &&
                                    dcn::nonzero_corner_sum<NC>([&](int k) { return cr.weight[k]; }, corner_value, sv))
                                    gmask_part += cg * sv;
                                if (goff != nullptr) {
                                    const float scale = cg * m;
#pragma unroll
                                    for (int a = 0; a < N; ++a)
                                        if (dcn::nonzero_corner_sum<NC>(
                                                [&](int k) { return cr.dweight[k][a]; }, corner_value, d))
                                            goff_part[a] += scale * d;
                                }
                            }
                        }
                    }
                }
            }
            if (goff == nullptr && gmsk == nullptr) continue;
            if constexpr (SMEM_SUMS) {
                // the lane's sums wait in shared memory for the segment's (after the passes): a
                // few stores here, where shuffles and one lane's atomics cost ~85 instructions a
                // pass at 16 lanes (NOTES-gpu.md, session 21)
                if (active) {
                    float* const ps = Ps + n * PLD + (cpass + lane_c) / CPL;
#pragma unroll
                    for (int a = 0; a < N; ++a) ps[a * BN * PLD] = goff_part[a];
                    ps[N * BN * PLD] = gmask_part;
                }
            } else {
                // the lanes of one segment share the position, the offset group and the mask
                // group (seg, a power of two, is the same for the whole warp: an unrolled loop of
                // predicated shuffles, and a mask for the segment's first lane, where a loop over
                // a runtime bound and a remainder cost ~40 instructions per position,
                // NOTES-gpu.md)
#pragma unroll
                for (int d = 1; d < LANES; d <<= 1) {
                    if (d < seg) {
#pragma unroll
                        for (int a = 0; a < N; ++a) goff_part[a] += __shfl_xor_sync(0xffffffffu, goff_part[a], d);
                        gmask_part += __shfl_xor_sync(0xffffffffu, gmask_part, d);
                    }
                }
                if (active && (lane & (seg - 1)) == 0) {
                    if (goff != nullptr) {
                        float* const dst = goff + ((I)b * offset_groups + go) * K * N * Q + (I)t * N * Q + q;
#pragma unroll
                        for (int a = 0; a < N; ++a) atomicAdd(dst + (I)a * Q, goff_part[a]);
                    }
                    if (gmsk != nullptr) atomicAdd(gmsk + (((I)b * mask_groups + gm) * K + t) * Q + q, gmask_part);
                }
            }
        }
    }
    if constexpr (SMEM_SUMS) {
        if (goff == nullptr && gmsk == nullptr) return;
        // Each (position, segment): the sum of its seg lanes' partial sums, in slot order, added
        // to goff / gmsk (DET: stored in the segment's slot, one writer per element, which
        // fused_store adds in a fixed order). Positions fastest across the threads (PLD odd: no
        // bank conflicts).
        __syncthreads();
        const int segs = SLOTS / seg;
        for (int it = tid; it < BN * segs; it += THREADS) {
            const int n = it % BN, s0 = (it / BN) * seg;
            const I p = p0 + n;
            const int c = m0 + s0 * CPL;   // the segment's first channel within the group
            if (p >= BQ || c >= Cg) continue;
            I b = b0, q = q0 + n;
            if (q >= Q) {
                const I d = q / Q;
                b += d;
                q -= d * Q;
            }
            const int cabs = grp * Cg + c;
            const float* const ps = Ps + n * PLD + s0;
            if (goff != nullptr) {
                const int go = per_go >= channels ? 0 : cabs / per_go;
                float* dst = goff + ((I)b * offset_groups + go) * K * N * Q + (I)t * N * Q + q;
                if constexpr (DET) dst += (I)((cabs % per_go) / (CPL * seg)) * ((I)batch * offset_groups * K * N * Q);
#pragma unroll
                for (int a = 0; a < N; ++a) {
                    float sum = 0.0f;
#pragma unroll
                    for (int j = 0; j < SLOTS; ++j)   // seg <= SLOTS
                        if (j < seg) sum += ps[a * BN * PLD + j];
                    if constexpr (DET) {
                        dst[(I)a * Q] = sum;
                    } else {
                        atomicAdd(dst + (I)a * Q, sum);
                    }
                }
            }
            if (gmsk != nullptr) {
                const int gm = per_gm >= channels ? 0 : cabs / per_gm;
                float* dst = gmsk + (((I)b * mask_groups + gm) * K + t) * Q + q;
                if constexpr (DET) dst += (I)((cabs % per_gm) / (CPL * seg)) * ((I)batch * mask_groups * K * Q);
                float sum = 0.0f;
#pragma unroll
                for (int j = 0; j < SLOTS; ++j)   // seg <= SLOTS
                    if (j < seg) sum += ps[N * BN * PLD + j];
                if constexpr (DET) {
                    *dst = sum;
                } else {
                    atomicAdd(dst, sum);
                }
            }
        }
    }
}

// Whether the position loads below may read 16-byte vectors of gy (B, C_out, Q), sample stride
// gy_bstride: every sample's rows start on 16 bytes (Q and the sample stride multiples of VEC,
// gy aligned), so that no aligned vector of positions crosses a sample.
template <typename T, typename I>
__device__ __forceinline__ bool positions_by_vectors(const T* gy, I Q, I gy_bstride) {
    constexpr int VEC = 16 / sizeof(T);
    return Q % VEC == 0 && gy_bstride % VEC == 0 && (reinterpret_cast<size_t>(gy) & 15) == 0;
}

// The VEC = 16 / sizeof(T) consecutive positions p0.. (p = b*Q + q, p0 a multiple of VEC; zero
// from B*Q = BQ on) of output channel o of gy: one 16-byte load where `vector`
// (positions_by_vectors) and they all lie before BQ, else element by element.
template <typename T, typename I>
__device__ __forceinline__ uint4 load_positions(const T* __restrict__ gy, I o, I p0, I Q, I BQ, I gy_bstride,
                                                bool vector) {
    constexpr int VEC = 16 / sizeof(T);
    if (vector && p0 + VEC <= BQ) {
        const I b = p0 / Q;
        return __ldg(reinterpret_cast<const uint4*>(gy + b * gy_bstride + o * Q + (p0 - b * Q)));
    }
    uint4 r;
    T* const v = reinterpret_cast<T*>(&r);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        const I p = p0 + k;
        v[k] = p < BQ ? gy[(p / Q) * gy_bstride + o * Q + p % Q] : Traits<T>::store(0.0f);
    }
    return r;
}

// gy (B, C_out, Q), sample stride gy_bstride -> gyr (C_out, Pp): each output channel's row over
// the chunk's positions p = b*Q + q, zero from B*Q to Pp (a multiple of the 16-byte vector): the
// A operand of the weight gradient. A thread copies VEC consecutive positions of one row
// (load_positions), stored as one 16-byte vector.
template <typename T, typename I>
__global__ void fused_position_rows(const T* __restrict__ gy, T* __restrict__ gyr, const int batch,
                                    const int channels, const I Q, const I Pp, const I gy_bstride) {
    fused::start_after_prerequisites();
    constexpr int VEC = 16 / sizeof(T);
    const bool vector = positions_by_vectors(gy, Q, gy_bstride);
    const I row_vectors = Pp / VEC;
    const I total = (I)channels * row_vectors;
    const I BQ = (I)batch * Q;
    for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
        const I o = idx / row_vectors;
        const I p0 = (idx - o * row_vectors) * VEC;
        *reinterpret_cast<uint4*>(gyr + o * Pp + p0) = load_positions(gy, o, p0, Q, BQ, gy_bstride, vector);
    }
}

// The weight kernel's epilogue (deform_fused_backward_weight), where it adds to the partial sums
// of the chunks before (SUMS_ADD): each sum added by a global reduction, not loaded, added and
// stored, where each load waits for the store before it (as in the warp-specialised kernel:
// DCN_WS_EPILOGUE_RED below). The same sums but subnormal ones, which red flushes to zero.
// Defining DCN_WEIGHT_EPILOGUE_RED 1 builds it (cuda_fused_backward.WEIGHT_EPILOGUE_RED).
#ifndef DCN_WEIGHT_EPILOGUE_RED
#define DCN_WEIGHT_EPILOGUE_RED 0
#endif

// The weight gradient, an implicit GEMM over the positions with the fused forward's sampler:
//   part[split, o, t, c] (+)= sum_{p in the split's share of the chunk} gy[o, p] * m * sample(x[b, c], P(q, t))
// Per block a tile of BM output channels x BN input channels of one conv group and ONE tap, for
// one split of the chunk's positions, in steps of BK positions: the grad_output rows gyr (A: rows
// o, K = p contiguous) copied with cp.async (swizzled, fused::TILE_XOR_A, but in strict float32;
// see DCN_WEIGHT_TILE_LAYOUT), the sampled tile (B: rows c, K = p) built straight
// into shared memory by THREADS/BK threads per position (CPT channels each: one 16-byte load per
// corner and vector, a corner not read loading the zero row with weight 0; interleaved vectors
// where the tile lies in one group, see below; its 16-byte chunks swizzled, fused::b_swizzle),
// double-buffered, multiplied by fused::warp_mma (float32 accumulation). Each (split, o, t, c)
// belongs to one block per launch: the partial sums are stored (first chunk) or added (later
// chunks) without atomics, and fused_weight_sum adds the splits in a fixed order: the weight
// gradient is bitwise repeatable. Or (SUMS_REDUCE, the default mode) every split adds its sums to
// one shared slot by reductions (fused_bwd::WeightSums). Served where no thread's channels cross a
// group boundary (cuda_fused_backward.weight_unsupported). PLAN: the corners are read from the
// chunk's sampling plan (fused_sampling_plan: plan_rows / plan_weights, segments of seg_len
// channels), fetched a step ahead, instead of computed from the offsets and mask here; or, where
// plan_masks is not null, from the data kernel's plan (fused_gradient_plan: the same entries, but a
// row for every corner on the grid, weights without the mask, and the mask apart), read as the
// sampling plan (a corner of weight 0 not read, the others' weights times the mask: Sampler's
// values, bitwise).
template <typename T, typename I, int N, int PREC, int BM, int BN, int BK, int MINB, bool PLAN>
__global__ void __launch_bounds__(fused_bwd::THREADS, MINB)
deform_fused_backward_weight(const T* __restrict__ gyr, const T* __restrict__ xcl, const T* __restrict__ offset,
                             const T* __restrict__ mask, const I* __restrict__ plan_rows,
                             const float* __restrict__ plan_weights, const float* __restrict__ plan_masks,
                             float* __restrict__ part, const Geom<N> g,
                             const int batch, const int channels, const int Cp, const int out_channels,
                             const int groups, const int offset_groups, const int mask_groups, const int seg_len,
                             const I Pp, const I offset_bstride, const I mask_bstride, const int splits,
                             const int steps_per_split, const int sum_mode) {
    using namespace fused;
    start_after_prerequisites();
    using fused_bwd::THREADS;
    constexpr int VEC = Tile<T>::VEC;
    constexpr int LD = BK + Tile<T>::PAD;         // the sampled tile's rows
    constexpr int LAYOUT = DCN_WEIGHT_TILE_LAYOUT >= 0 ? DCN_WEIGHT_TILE_LAYOUT
                           : PREC == 2 ? TILE_SWIZZLED_B : TILE_XOR_A;   // (above the kernels)
    constexpr int A_ROW_BYTES = BK * sizeof(T);
    static_assert(LAYOUT == TILE_SWIZZLED_B || (LAYOUT == TILE_XOR_A && (A_ROW_BYTES == 128 || A_ROW_BYTES == 256)),
                  "tile layout: swizzled rows of 128 or 256 bytes (fused_weight_smem's alignment)");
    constexpr int LDA = LAYOUT == TILE_XOR_A ? BK : LD;   // the grad_output tile's rows
    constexpr int TPP = THREADS / BK;             // sampling threads per position
    constexpr int CPT = BN / TPP;                 // channels per sampling thread
    static_assert(BK <= THREADS && THREADS % BK == 0, "sampling threads");
    constexpr int NV = CPT / VEC;                 // 16-byte vectors per sampling thread and corner
    constexpr int NC = 1 << N;
    constexpr int WARPS_N = BN / 32, WARPS_M = THREADS / 32 / WARPS_N;
    constexpr int WM = BM / WARPS_M, WN = 32;
    constexpr int MT = WM / 16, NT = WN / 8;
    constexpr int A_VECS = BM * BK / VEC / THREADS;
    static_assert(A_VECS >= 1 && NV >= 1 && MT >= 1 && NT % 2 == 0 && BM * BK % (VEC * THREADS) == 0, "tile shape");

    // 256-byte aligned: a TILE_XOR_A row of 256 bytes (fp16 BK = 128, TF32 BK = 64) has its k
    // steps' chunks XORed into the address bits 4-7 (fused::ldmatrix_x4_xor). A name of its own:
    // the module's extern shared arrays of one name share the first declaration's alignment.
    extern __shared__ __align__(256) unsigned char fused_weight_smem[];
    T* const As0 = reinterpret_cast<T*>(fused_weight_smem);
    T* const Bs0 = As0 + 2 * BM * LDA;

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;

    const I Q = dcn::prod_size<N, I>(g.out_size);
    const I S = dcn::prod_size<N, I>(g.in_size);
    const int K = (int)dcn::prod_size<N, I>(g.ksize);
    const I BQ = (I)batch * Q;
    const I zero_row = (I)batch * S;
    const int Cg = channels / groups;
    const int Cog = out_channels / groups;
    const int per_go = offset == nullptr ? channels : channels / offset_groups;
    const int per_gm = mask == nullptr ? channels : channels / mask_groups;
    const int n_tiles = (Cg + BN - 1) / BN;
    const int m_tiles = (Cog + BM - 1) / BM;
    const fused_bwd::WeightBlock blk = fused_bwd::weight_block<I>(blockIdx.x, n_tiles, m_tiles, groups, K, BM, BN);
    const int n0 = blk.n0, m0 = blk.m0, grp = blk.grp, t = blk.t, split = blk.split;
    const I first = (I)split * steps_per_split * BK;
    const I total_steps = (BQ + BK - 1) / BK;
    const I left = total_steps - (I)split * steps_per_split;
    const int steps = left <= 0 ? 0 : (int)(left < steps_per_split ? left : steps_per_split);

    // This thread's grad_output copies: rows r0 + j * R_STEP of the A tile, vector kv.
    constexpr int R_STEP = THREADS / (BK / VEC);
    const int r0 = tid / (BK / VEC);
    const int kv = (tid % (BK / VEC)) * VEC;
    auto copy_step = [&](int step, int buf) {
        const I p = first + (I)step * BK + kv;
#pragma unroll
        for (int j = 0; j < A_VECS; ++j) {
            const int r = r0 + j * R_STEP;
            const bool full = m0 + r < Cog && p < Pp;
            // (the padded rows' address written as before TILE_XOR_A: the strict float32 kernels
            // keep their SASS)
            copy16_async(LAYOUT == TILE_XOR_A ? As0 + buf * BM * LDA + tile_offset<T, true, LDA>(r, kv)
                                              : As0 + buf * BM * LD + r * LD + kv,
                         full ? gyr + (I)(grp * Cog + m0 + r) * Pp + p : gyr, full);
        }
        copy_commit();
    };

    // This thread's sampling position (within the step) and channel vectors. Where the tile's BN
    // channels lie within the conv group and in one offset group, one mask group and (PLAN) one
    // plan segment, a position's TPP threads are adjacent lanes taking interleaved vectors
    // (thread k: vectors k, k + TPP, ...): a warp's load then reads 8 positions' TPP * 16
    // contiguous bytes, 8 L1 wavefronts where 32 positions' own vectors took 32 (the loads, not
    // the MMAs, bound this kernel: TF32 twice the vectors of fp16, nearly twice the time); their
    // transposed stores would conflict 2-way (TF32; fp16 4-way) but for the tile's swizzle
    // (sample_at). Elsewhere positions run fastest along the threads and each takes CPT
    // consecutive channels, so that no thread's channels cross a group.
    const int tile0 = grp * Cg + n0;
    const int tile1 = tile0 + BN - 1;
    const bool interleave = n0 + BN <= Cg && (per_go >= channels || tile0 / per_go == tile1 / per_go) &&
                            (per_gm >= channels || tile0 / per_gm == tile1 / per_gm) &&
                            (!PLAN || tile0 / seg_len == tile1 / seg_len);
    const int sk = interleave ? tid % TPP : tid / BK;   // which of its position's threads
    const int sn = interleave ? tid / TPP : tid % BK;
    const int sh = interleave ? sk * VEC : sk * CPT;    // its first channel within the tile
    const int vstep = interleave ? TPP * VEC : VEC;     // channels from one of its vectors to the next
    const int cl = n0 + sh;                 // first channel within the group
    const bool channels_valid = cl < Cg;
    const int cabs = channels_valid ? grp * Cg + cl : 0;
    const int go = per_go >= channels ? 0 : cabs / per_go;
    const int gm = per_gm >= channels ? 0 : cabs / per_gm;
    fused::Sampler<I, N> smp;
    smp.reset();
    uint4 raw[NC][NV];
    // PLAN: this thread's plan entries (segment, tap t) start here; the next step's, fetched a step ahead
    [[maybe_unused]] const I plan_first = PLAN ? ((I)(cabs / seg_len) * K + t) * BQ : (I)0;
    [[maybe_unused]] I plan_row[PLAN ? NC : 1];
    [[maybe_unused]] float plan_weight[PLAN ? NC : 1];
    [[maybe_unused]] float plan_mask = 1.0f;   // (the data kernel's plan) the position's mask
    // The offsets and mask of this thread's position in the next step (PLAN: its corners),
    // fetched a step ahead so that their latency hides behind a step's MMA (handed to the
    // sampler as its prefetch).
    auto fetch_ahead = [&](int step) {
        const I p = first + (I)step * BK + sn;
        if constexpr (PLAN) {
            if (step < steps && p < BQ && channels_valid) {
                fused::load_words(plan_rows + (plan_first + p) * NC, plan_row);
                fused::load_words(plan_weights + (plan_first + p) * NC, plan_weight);
                if (plan_masks != nullptr) plan_mask = __ldg(plan_masks + plan_first + p);
            } else {
#pragma unroll
                for (int c = 0; c < NC; ++c) { plan_row[c] = zero_row; plan_weight[c] = 0.0f; }
            }
            return;
        }
        smp.pf_t = -1;
        if (step < steps && p < BQ && channels_valid) {
            const I b = p / Q;
            const I q = p % Q;
            fused::Sampler<I, N>::fetch(t, go, gm, offset == nullptr ? nullptr : offset + b * offset_bstride + q,
                                        mask == nullptr ? nullptr : mask + b * mask_bstride + q, K, Q,
                                        smp.pf_off, smp.pf_m);
            smp.pf_t = t; smp.pf_go = go; smp.pf_gm = gm;
        }
    };
    auto sample_load = [&](int step) {
        if constexpr (PLAN) {
            if (plan_masks != nullptr) {   // the data kernel's plan, read as Sampler would compute it
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    const bool read = plan_row[c] >= 0 && plan_weight[c] != 0.0f;
                    smp.row[c] = read ? plan_row[c] : zero_row;
                    smp.weight[c] = read ? plan_weight[c] * plan_mask : 0.0f;
                }
            } else {
#pragma unroll
                for (int c = 0; c < NC; ++c) { smp.row[c] = plan_row[c]; smp.weight[c] = plan_weight[c]; }
            }
        } else {
            const I p = first + (I)step * BK + sn;
            if (!(p < BQ && channels_valid)) {
                smp.clear();
            } else {
                const I b = p / Q;
                const I q = p % Q;
                int qc[N];
                dcn::unravel<N, I>(q, g.out_size, qc);
                smp.key_t = -1;   // a new position: recompute (with the values fetched ahead)
                smp.update(t, go, gm, true, g, qc, offset == nullptr ? nullptr : offset + b * offset_bstride + q,
                           mask == nullptr ? nullptr : mask + b * mask_bstride + q, K, Q, b * S);
            }
        }
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const T* src = xcl + (smp.row[c] >= 0 ? smp.row[c] : zero_row) * Cp + cabs;
#pragma unroll
            for (int v = 0; v < NV; ++v) raw[c][v] = __ldg(reinterpret_cast<const uint4*>(src + v * vstep));
        }
        fetch_ahead(step + 1);
    };
    // Blend the corners and store the sample transposed: B[channel][position].
    static_assert(BK / VEC % 4 == 0, "the sampled tile's swizzle (fused::b_swizzle)");
    // Vector v's row (channel sh + v * vstep) and this position's column in it, swizzled.
    auto sample_at = [&](T* bt, int v) {
        const int row = sh + v * vstep;
        return bt + row * LD + (sn ^ (b_swizzle<T>(row) * VEC));
    };
    auto sample_store = [&](int buf) {
        T* const bt = Bs0 + buf * BN * LD;
        if constexpr (Packed<T>::value) {
            // half types: the corners blended in packed pairs (fused::Packed)
            unsigned w2[NC];
#pragma unroll
            for (int c = 0; c < NC; ++c) w2[c] = Packed<T>::weight(smp.weight[c]);
#pragma unroll
            for (int v = 0; v < NV; ++v) {
                uint4 a = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                for (int c = 0; c < NC; ++c) Packed<T>::fma(a, w2[c], raw[c][v]);
                const T* e = reinterpret_cast<const T*>(&a);
                T* const at = sample_at(bt, v);
#pragma unroll
                for (int j = 0; j < VEC; ++j) at[j * LD] = e[j];
            }
        } else {
            float acc[CPT];
#pragma unroll
            for (int j = 0; j < CPT; ++j) acc[j] = 0.0f;
#pragma unroll
            for (int c = 0; c < NC; ++c) {
#pragma unroll
                for (int v = 0; v < NV; ++v) Vec<T>::add(acc + v * VEC, smp.weight[c], raw[c][v]);
            }
#pragma unroll
            for (int v = 0; v < NV; ++v) {
                T* const at = sample_at(bt, v);
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    float a = acc[v * VEC + j];
                    if constexpr (PREC == 1) a = __uint_as_float(to_tf32(a));
                    at[j * LD] = Traits<T>::store(a);
                }
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

    if (steps > 0) {
        copy_step(0, 0);
        fetch_ahead(0);
        sample_load(0);
        sample_store(0);
        copy_wait_all();
        __syncthreads();
        for (int s = 0; s < steps; ++s) {
            const int cur = s & 1;
            const bool more = s + 1 < steps;
            if (more) {
                copy_step(s + 1, cur ^ 1);
                sample_load(s + 1);
            }
            warp_mma<T, PREC, ROUNDED_B, MT, NT, LD, BK, WM, WN, LAYOUT>(acc, As0 + cur * BM * LDA,
                                                                         Bs0 + cur * BN * LD, wm, wn, lane);
            if (more) sample_store(cur ^ 1);
            copy_wait_all();
            __syncthreads();
        }
    }

    // Epilogue: part[split, o, t, c] from the fragments (row = output channel, column = channel),
    // as sum_mode says (fused_bwd::WeightSums); where a chunk adds to the sums before, by
    // reductions where DCN_WEIGHT_EPILOGUE_RED (above).
    const int gq = lane >> 2, tq = lane & 3;
    const bool reduce =
        sum_mode == fused_bwd::SUMS_REDUCE || (DCN_WEIGHT_EPILOGUE_RED && sum_mode == fused_bwd::SUMS_ADD);
    const int slot = sum_mode == fused_bwd::SUMS_REDUCE ? 0 : split;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int o = m0 + wm * WM + i * 16 + gq + h * 8;
            if (o >= Cog) continue;
            float* row = part + (((I)slot * out_channels + grp * Cog + o) * K + t) * Cg;
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = n0 + wn * WN + j * 8 + 2 * tq + e;
                    if (c < Cg) {
                        const float v = acc[i][j][h * 2 + e];
                        if (reduce)
                            atomicAdd(row + c, v);   // (its result unused: a reduction)
                        else
                            row[c] = sum_mode == fused_bwd::SUMS_ADD ? row[c] + v : v;
                    }
                }
        }
}

// gy (B, C_out, Q), sample stride gy_bstride -> gys (P / BK, SPLIT, C_out, BK): grad_output in
// segments of BK positions (128 bytes; p = b*Q + q, zero from B*Q on), segment-major, so that the
// BM rows of an output-channel tile in one segment are one contiguous block (the warp-specialised
// weight kernel's A tile of a stage, one bulk copy a plane); within a row, 16-byte chunk c stored
// at chunk c ^ (r & 7), r = o % (C_out / groups) (its row within its tile: tiles start on
// multiples of 8), which is wgmma's 128-byte swizzle. precision (float32 only): 1, values rounded
// to TF32 (as warp_mma rounds its A fragments: the TF32 wgmma would truncate them); 2 (3xTF32),
// SPLIT = 2 planes a segment, split_tf32's big parts, then the small ones. One thread a 16-byte
// chunk (load_positions). (The buffer has BM rows more: the kernel's tile rows past C_out/groups
// read the next group's rows, the next plane's or those, into accumulator rows it never stores.)
template <typename T, typename I>
__global__ void fused_position_segments(const T* __restrict__ gy, T* __restrict__ gys, const int batch,
                                        const int out_channels, const int Cog, const I Q, const I segments,
                                        const I gy_bstride, const int precision) {
    fused::start_after_prerequisites();
    constexpr int VEC = 16 / sizeof(T);
    constexpr int CHUNKS = 128 / 16;
    const bool vector = positions_by_vectors(gy, Q, gy_bstride);
    const int planes = sizeof(T) == 4 && precision == 2 ? 2 : 1;
    const I total = segments * out_channels * CHUNKS;
    const I BQ = (I)batch * Q;
    for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
        const int c = (int)(idx % CHUNKS);
        const I row = idx / CHUNKS;                        // seg * C_out + o
        const int o = (int)(row % out_channels);
        const I seg = row / out_channels;
        const I p0 = seg * (CHUNKS * VEC) + c * VEC;
        uint4 r = load_positions(gy, (I)o, p0, Q, BQ, gy_bstride, vector);
        T* const at = gys + ((seg * planes) * out_channels + o) * (CHUNKS * VEC) + ((c ^ ((o % Cog) & 7)) * VEC);
        if constexpr (sizeof(T) == 4) {
            if (planes == 2) {
                uint4 big, small;
                fused::split_tf32(r, big, small);
                *reinterpret_cast<uint4*>(at) = big;
                *reinterpret_cast<uint4*>(at + (I)out_channels * (CHUNKS * VEC)) = small;
                continue;
            }
        }
        T* const v = reinterpret_cast<T*>(&r);
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[k] = maybe_tf32(v[k], precision == 1);
        *reinterpret_cast<uint4*>(at) = r;
    }
}

// The warp-specialised weight kernel in 3xTF32: the positions whose products p sums before they
// join the accumulators in float32, in whole steps (at least one). Each run's end drains the MMA
// warpgroup's wgmmas; a longer run drains less often but spans more of the tensor cores'
// truncating accumulation (as DCN_FUSED_PROMOTE_CHANNELS in the forward, whose 64 channels this
// follows; other lengths are untimed here). H200, B=8 C256 56x56: weight gradient relative error
// 2.01e-6 against float64 (the mma.sync kernel's 1.95e-6, cuda/im2col's 1.97e-6).
#ifndef DCN_WS_PROMOTE_POSITIONS
#define DCN_WS_PROMOTE_POSITIONS 64
#endif

// The warp-specialised weight kernel's samplers keep their corner loads in flight across the
// stage's stores and barriers: item u of step s + 1 is loaded as soon as item u of step s is
// blended (its registers free), not when step s + 1 begins. The same values. Defining
// DCN_WS_LOADS_AHEAD 0 builds the loads at the start of each step (cuda_fused_backward.WS_LOADS_AHEAD,
// the A/B).
#ifndef DCN_WS_LOADS_AHEAD
#define DCN_WS_LOADS_AHEAD 1
#endif

// The warp-specialised weight kernel's MMAs with the roles of the operands swapped: the sampled
// tile's BN = 64 input channels are the wgmma's M (m64) and each MMA warpgroup's WG_ROWS rows of
// grad_output its N (n128), one m64n128 a k step where the other order issues WG_ROWS / 64
// m64n64s. The same tiles in shared memory, the same products; shared-memory reads a k step per
// warpgroup (TF32) 6 KiB where m64n64's two read 8. Defining DCN_WS_CHANNEL_ROWS 0 builds the other
// order (cuda_fused_backward.WS_CHANNEL_ROWS, the A/B).
#ifndef DCN_WS_CHANNEL_ROWS
#define DCN_WS_CHANNEL_ROWS 1
#endif

// The warp-specialised weight kernel's epilogue, where it adds to the partial sums of the chunks
// before (SUMS_ADD): each sum added by a global reduction (red.global.add, issued and not
// waited for), not loaded, added and stored. The compiler may not move a load above a store to
// `part` (it cannot tell them apart), so each pair of loads waits for the store before it: 32
// round trips a unit in SASS (3xTF32, 1D 256-row tile), about 27 us a launch of every chunk but
// the first (NOTES-gpu.md, session 66). Loading a group of sums first spills the MMA warpgroups'
// registers. One thread adds to a sum in a launch, so the sums are those of the loads and stores
// (red.add.f32 rounds to nearest even, as the add does), but where an input or result is
// subnormal: red flushes it to zero. H200, ncu: the weight kernel 415 -> 386 us in 1D strict
// (three chunks), 499 -> 455 in B=8 C256 strict (two; NOTES-gpu.md, session 67). Defining
// DCN_WS_EPILOGUE_RED 0 builds the loads and stores (cuda_fused_backward.WS_EPILOGUE_RED, the A/B).
#ifndef DCN_WS_EPILOGUE_RED
#define DCN_WS_EPILOGUE_RED 1
#endif

// The weight gradient warp-specialised on wgmma (sm_90a; fp16, bf16, TF32, 3xTF32): the GEMM, the
// block mapping, the plan's corners and the partial sums of deform_fused_backward_weight (PLAN),
// but the block's warps split into roles as in the forward's ENGINE 3. MMA_WGS warpgroups
// (warps 0 .. 4 * MMA_WGS - 1) only multiply: each its BM / MMA_WGS output channels of the tile,
// m64nBNk16 (k8 in TF32) from shared-memory descriptors, float32 accumulators in registers (where
// the threads have the registers, the operands' roles swapped: the tile's 64 input channels as M,
// the warpgroup's 128 output channels as N, one m64n128 a k step; DCN_WS_CHANNEL_ROWS). The
// other THREADS - 128 * MMA_WGS threads sample, filling a ring of DEPTH stages as far ahead as it
// allows, each stage a tile pair in wgmma's 128-byte swizzle (rows of 128 bytes: BK positions,
// K-major both):
//   * A, BM rows of grad_output: one bulk copy (cp.async.bulk, the copy engine) of a block of gys
//     (fused_position_segments: segment-major, swizzled, TF32-rounded or split) a plane, issued by
//     the first sampler once the stage is free and completing on the stage's mbarrier;
//   * B, BN rows of input channels: the sampled tile transposed, B[channel][position]. A warp
//     samples 4 positions x 8 16-byte vectors (one 128-byte line of channels a position and
//     corner: 4 lines a load); a thread blends its vector's corners (Sampler's order and
//     rounding: the values of deform_fused_backward_weight, bitwise) and stores its VEC channels
//     one element a row. Its k-th vector's rows are rotated by k (TF32: by k / 2), so that the 8
//     lanes of a position write rows of 8 distinct (row & 7) in each store: with the 4 positions'
//     columns, 32 distinct banks (half types: 16 words, 2 halves each).
// 3xTF32 (PREC 2): each tile a pair of planes, the big parts then the small ones (split_tf32, as
// ENGINE 3 splits its tiles), multiplied as a_small*b_big + a_big*b_small + a_big*b_big into
// registers of their own (p) for a run of DCN_WS_PROMOTE_POSITIONS positions, then added to the
// accumulators in float32: the tensor cores' accumulation truncates, and a whole split's positions
// summed into one accumulator drifts with their count (NOTES-gpu.md, session 15).
// Stage k has named barrier 1 + k ("full": the samplers arrive once their writes are visible to
// the async proxy; the MMA warps wait, then wait for the A copy on the stage's mbarrier) and
// 1 + DEPTH + k ("empty": the MMA warps arrive once the wgmmas reading it completed, one step
// late; the samplers wait before refilling it). Every arrival is matched by a wait. Served where
// every block's BN channels lie in one conv group and one plan segment
// (cuda_fused_backward.ws_weight_unsupported). THREADS: the MMA warpgroups' 128 * MMA_WGS, then
// the samplers. In fp16, bf16 and TF32 bitwise the partial sums of deform_fused_backward_weight
// with the same splits where they are stored or added (reduced into one slot: in no fixed order).
template <typename T, typename I, int N, int PREC, int BM, int BN, int BK, int DEPTH, int THREADS>
__global__ void __launch_bounds__(THREADS, 1)
deform_fused_backward_weight_ws(const T* __restrict__ gys, const T* __restrict__ xcl,
                                const I* __restrict__ plan_rows, const float* __restrict__ plan_weights,
                                const float* __restrict__ plan_masks, float* __restrict__ part, const Geom<N> g,
                                const int batch, const int channels, const int Cp, const int out_channels,
                                const int groups, const int seg_len, const int steps_per_split,
                                const int sum_mode, const int units) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace fused;
    start_after_prerequisites();
    constexpr int VEC = Tile<T>::VEC;
    constexpr int MMA_WGS = BM >= 128 ? BM / 128 : 1;
    constexpr int WG_ROWS = BM / MMA_WGS;
    // the sampled channels the wgmma's M where a thread's launch registers hold an m64n128
    constexpr bool CHANNEL_ROWS = DCN_WS_CHANNEL_ROWS && holds_m64n128(THREADS);
    constexpr int MI = CHANNEL_ROWS ? 1 : WG_ROWS / 64;  // m64 instructions per warpgroup and k step
    constexpr int MMA_N = CHANNEL_ROWS ? WG_ROWS : BN;   // their N
    constexpr int NACC = MMA_N / 2;                      // accumulators per thread and m64 instruction
    constexpr int MMA_THREADS = 128 * MMA_WGS;
    constexpr int SAMPLERS = THREADS - MMA_THREADS;
    constexpr int ROW = 128;                          // bytes of a tile row: BK positions
    constexpr int KSTEP = PREC == 0 ? 16 : 8;         // wgmma K
    constexpr int SPLIT = PREC == 2 ? 2 : 1;          // planes of a tile (3xTF32: big, small)
    constexpr int NC = 1 << N;
    constexpr int LINE = ROW / (int)sizeof(T);        // channels of one 128-byte line: a warp's vectors
    constexpr int QUADS = BK / 4;                     // 4-position groups of a step
    constexpr int ITEMS = QUADS * (BN / LINE);        // (quad, line of channels) a step, one a warp each
    constexpr int SAMPLER_WARPS = SAMPLERS / 32;
    constexpr int U = ITEMS / SAMPLER_WARPS;          // items per sampling warp and step
    constexpr int A_PLANE = BM * ROW, B_PLANE = BN * ROW;
    constexpr int A_BYTES = SPLIT * A_PLANE, B_BYTES = SPLIT * B_PLANE, STAGE_BYTES = A_BYTES + B_BYTES;
    constexpr int PROMOTE_STEPS = PREC == 2 ? (DCN_WS_PROMOTE_POSITIONS + BK - 1) / BK : 1;   // steps a run of p
    static_assert(BK * (int)sizeof(T) == ROW && WG_ROWS % 64 == 0 && WG_ROWS <= 128 &&
                  (BN == 64 || BN == 128) && BN % LINE == 0, "tile: rows of 128 bytes, m64 x n64 / n128");
    static_assert(!CHANNEL_ROWS || BN == 64, "the sampled channels as the wgmma's M: one m64");
    static_assert(ITEMS % SAMPLER_WARPS == 0 && U >= 1 && SAMPLERS % 128 == 0,
                  "sampling warpgroups: a whole number of items a warp");
    static_assert(DEPTH >= 2 && 2 * DEPTH <= 15, "2 named barriers a stage");
    static_assert((PREC == 0 && sizeof(T) == 2) || (PREC >= 1 && sizeof(T) == 4), "the half types' MMA, or TF32");

    // The ring, 1024-byte aligned (the 128-byte swizzle repeats every 8 rows; cuda_fused_backward
    // asks for the 1 KiB more): stage k's A tile, then its B tile (3xTF32: each its big plane, then
    // its small one); then the stages' mbarriers.
    extern __shared__ __align__(128) unsigned char fused_ws_smem[];
    const unsigned lift = (1024u - (smem_address(fused_ws_smem) & 1023u)) & 1023u;
    unsigned char* const ring = fused_ws_smem + lift;
    unsigned long long* const a_full = reinterpret_cast<unsigned long long*>(ring + DEPTH * STAGE_BYTES);
    auto full_barrier = [](int stage) { return 1 + stage; };
    auto empty_barrier = [](int stage) { return 1 + DEPTH + stage; };

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;

    const I Q = dcn::prod_size<N, I>(g.out_size);
    const I S = dcn::prod_size<N, I>(g.in_size);
    const int K = (int)dcn::prod_size<N, I>(g.ksize);
    const I BQ = (I)batch * Q;
    const I zero_row = (I)batch * S;
    const int Cg = channels / groups;
    const int Cog = out_channels / groups;
    const int n_tiles = Cg / BN;
    const int m_tiles = (Cog + BM - 1) / BM;
    const I total_steps = (BQ + BK - 1) / BK;
    // The block's units (tile and split): blockIdx.x, blockIdx.x + gridDim.x, ... below `units`
    // (one where the grid has a block a unit; persistent blocks, cuda_fused_backward.WS_PERSISTENT,
    // several). They run through one ring, their steps counted on from one unit to the next (the
    // block's step g in stage g % DEPTH), so that the samplers fill the next unit's stages while
    // the MMA warpgroups finish a unit and store it.
    fused_bwd::WeightBlock blk;
    I first_step;   // the unit's split's first segment of BK positions
    int steps;      // and its count of them
    auto enter_unit = [&](I unit) {
        blk = fused_bwd::weight_block<I>(unit, n_tiles, m_tiles, groups, K, BM, BN);
        first_step = (I)blk.split * steps_per_split;
        const I left = total_steps - first_step;
        steps = left <= 0 ? 0 : (int)(left < steps_per_split ? left : steps_per_split);
    };

    if (tid == 0) {
#pragma unroll
        for (int k = 0; k < DEPTH; ++k) mbarrier_init(a_full + k);
        mbarrier_init_fence();
    }
    __syncthreads();

    // Registers: the launch gives every thread LAUNCH_REGS (65536 / THREADS: one block an SM); the
    // MMA warpgroups take MMA_REGS (their accumulators, descriptors and addresses) and the
    // samplers the rest, each side giving back or taking what the other leaves: 32 registers above
    // the accumulators, but 24 in the 256-row 3xTF32 tile, whose 256 samplers need the 8 more for
    // their unit loop (ptxas, sm_90a, 2D 32-bit: 24 bytes of spill at 96, none at 104; at 24 the
    // other tiles' MMA warpgroups spill).
    constexpr int LAUNCH_REGS = (65536 / THREADS > 255 ? 255 : 65536 / THREADS) / 8 * 8;
    constexpr int MMA_MARGIN = SPLIT == 2 && MMA_WGS == 2 ? 24 : 32;
    constexpr int MMA_REGS = (NACC * MI * SPLIT + MMA_MARGIN + 7) / 8 * 8;   // (3xTF32: d and p)
    constexpr int SAMPLER_LEFT = (LAUNCH_REGS * THREADS - MMA_REGS * MMA_THREADS) / SAMPLERS / 8 * 8;
    constexpr int SAMPLER_REGS = SAMPLER_LEFT > 256 ? 256 : SAMPLER_LEFT;
    static_assert(SAMPLER_REGS >= 56, "registers: the samplers' corners");
    if (warp < MMA_THREADS / 32) {
        // ---- MMA warpgroups ----
        if constexpr (MMA_REGS < LAUNCH_REGS) setmaxnreg_dec<MMA_REGS>();
        if constexpr (MMA_REGS > LAUNCH_REGS) setmaxnreg_inc<MMA_REGS>();
        const int wg = warp >> 2;
        // (128-byte swizzle, K-major: 8-row groups 1024 bytes apart; a k step is the next
        // KSTEP elements of each row, the hardware applying the swizzle to the address)
        const unsigned long long a_desc0 = wgmma_descriptor(ring + wg * WG_ROWS * ROW, 16, 1024) | (1ull << 62);
        const unsigned long long b_desc0 = wgmma_descriptor(ring + A_BYTES, 16, 1024) | (1ull << 62);
        // the block's steps, all units (a stage freed only where the samplers will refill it)
        int block_steps = 0;
        for (I unit = blockIdx.x; unit < units; unit += gridDim.x) {
            enter_unit(unit);
            block_steps += steps;
        }
        float d[MI][NACC];
        float p[MI][NACC];   // 3xTF32's run of products (unused, so allocated no registers, otherwise)
        int u0 = 0;          // the block's step of the unit's first
        for (I unit = blockIdx.x; unit < units; unit += gridDim.x) {
            enter_unit(unit);
            // (p too: its last value dead during the epilogue, not carried into the next unit)
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int i = 0; i < NACC; ++i) d[mi][i] = p[mi][i] = 0.0f;
            for (int s = 0; s < steps; ++s) {
                const int g = u0 + s;
                const int stage = g % DEPTH;
                barrier_sync(full_barrier(stage), THREADS);
                mbarrier_wait(a_full + stage, (unsigned)(g / DEPTH) & 1u);
                float (&acc)[MI][NACC] = SPLIT == 2 ? p : d;
                const bool fresh = SPLIT == 2 && s % PROMOTE_STEPS == 0;   // the run's first step overwrites p
                register_fence(acc);
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < BK / KSTEP; ++ks) {
                    const unsigned long long db = wgmma_descriptor_at(b_desc0, stage * STAGE_BYTES + ks * KSTEP * sizeof(T));
                    if constexpr (CHANNEL_ROWS) {
                        // the same three products of a pair as below, the operands' roles swapped
                        const unsigned long long da = wgmma_descriptor_at(a_desc0, stage * STAGE_BYTES + ks * KSTEP * sizeof(T));
                        if constexpr (SPLIT == 2) {
                            Wgmma<T, MMA_N>::run(acc[0], db, wgmma_descriptor_at(da, A_PLANE), fresh && ks == 0 ? 0 : 1);
                            Wgmma<T, MMA_N>::run(acc[0], wgmma_descriptor_at(db, B_PLANE), da);
                            Wgmma<T, MMA_N>::run(acc[0], db, da);
                        } else {
                            Wgmma<T, MMA_N>::run(acc[0], db, da);
                        }
                    } else {
#pragma unroll
                        for (int mi = 0; mi < MI; ++mi) {
                            const unsigned long long da =
                                wgmma_descriptor_at(a_desc0, stage * STAGE_BYTES + mi * 64 * ROW + ks * KSTEP * sizeof(T));
                            if constexpr (SPLIT == 2) {
                                Wgmma<T, BN>::run(acc[mi], wgmma_descriptor_at(da, A_PLANE), db, fresh && ks == 0 ? 0 : 1);
                                Wgmma<T, BN>::run(acc[mi], da, wgmma_descriptor_at(db, B_PLANE));
                                Wgmma<T, BN>::run(acc[mi], da, db);
                            } else {
                                Wgmma<T, BN>::run(acc[mi], da, db);
                            }
                        }
                    }
                }
                wgmma_commit();
                register_fence(acc);
                if (SPLIT == 2 && (s % PROMOTE_STEPS == PROMOTE_STEPS - 1 || s == steps - 1)) {
                    // the run's products complete: into the accumulators in float32
                    wgmma_wait_all();
                    register_fence(p);
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                        for (int i = 0; i < NACC; ++i) d[mi][i] += p[mi][i];
                } else {
                    // step s - 1's wgmmas have read their stage
                    wgmma_wait_pending<1>();
                }
                // free step g - 1's stage where the samplers will refill it
                if (s >= 1 && g - 1 + DEPTH < block_steps) barrier_arrive(empty_barrier((g - 1) % DEPTH), THREADS);
            }
            wgmma_wait_all();
            register_fence(d);
            u0 += steps;
            // (the unit's last stage)
            if (steps > 0 && u0 - 1 + DEPTH < block_steps) barrier_arrive(empty_barrier((u0 - 1) % DEPTH), THREADS);
            enter_unit(unit);   // (again: its tile not held in registers through the steps)
            // Epilogue, as sum_mode says (fused_bwd::WeightSums).
            const int gq = lane >> 2, tq = lane & 3;
            const bool add = sum_mode == fused_bwd::SUMS_ADD;
            const bool reduce = sum_mode == fused_bwd::SUMS_REDUCE || (DCN_WS_EPILOGUE_RED && add);
            const I slot = sum_mode == fused_bwd::SUMS_REDUCE ? 0 : blk.split;
            if constexpr (CHANNEL_ROWS) {
                // d[0][4j + 2h + e] is input channel 16 (warp % 4) + lane / 4 + 8 h of the tile, output
                // channel 8 j + 2 (lane % 4) + e of the warpgroup's rows: a store a value, 8 lanes'
                // channels consecutive.
#pragma unroll
                for (int j = 0; j < MMA_N / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int o = blk.m0 + wg * WG_ROWS + 8 * j + 2 * tq + e;
                        if (o >= Cog) continue;
                        float* const row = part + ((slot * out_channels + blk.grp * Cog + o) * K + blk.t) * Cg +
                                           blk.n0 + (warp & 3) * 16 + gq;
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            float v = d[0][4 * j + 2 * h + e];
                            if (reduce) {
                                atomicAdd(row + 8 * h, v);   // (its result unused: a reduction)
                                continue;
                            }
                            if (add) v += row[8 * h];
                            row[8 * h] = v;
                        }
                    }
            } else {
                // d[mi][4j + 2h + e] is output channel 64 mi + 16 (warp % 4) + lane / 4 + 8 h of the
                // warpgroup's rows, input channel 8 j + 2 (lane % 4) + e of the tile: float2 stores (Cg
                // and the channel even).
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int o = blk.m0 + wg * WG_ROWS + mi * 64 + (warp & 3) * 16 + gq + h * 8;
                        if (o >= Cog) continue;
                        float* const row =
                            part + ((slot * out_channels + blk.grp * Cog + o) * K + blk.t) * Cg + blk.n0 + 2 * tq;
#pragma unroll
                        for (int j = 0; j < BN / 8; ++j) {
                            float2* const at = reinterpret_cast<float2*>(row + 8 * j);
                            float2 v = make_float2(d[mi][4 * j + 2 * h], d[mi][4 * j + 2 * h + 1]);
                            if (reduce) {
                                atomicAdd(at, v);   // (a vector reduction)
                                continue;
                            }
                            if (add) {
                                const float2 old = *at;
                                v.x += old.x;
                                v.y += old.y;
                            }
                            *at = v;
                        }
                    }
            }
        }
        return;
    }

    // ---- samplers ----
    if constexpr (SAMPLER_REGS > LAUNCH_REGS) setmaxnreg_inc<SAMPLER_REGS>();
    if constexpr (SAMPLER_REGS < LAUNCH_REGS) setmaxnreg_dec<SAMPLER_REGS>();
    const int stid = tid - MMA_THREADS;
    const int swarp = stid >> 5;
    const int k = lane >> 2;       // this lane's 16-byte vector of a 128-byte line of channels
    const int i4 = lane & 3;       // its position within the item's 4
    // The rotation of its vector's element stores (the rows 8 apart share banks)
    const int rot = sizeof(T) == 2 ? k : (k >> 1);
    // The unit's tile: its first channel, whose plan segment holds every channel of the tile (the
    // host's rule), that segment's plan entries for the tap, and the tile's A rows: BM rows from
    // row grp * Cog + m0 of each segment of gys
    int cabs0;
    I plan_first;
    const T* a_src;
    // The plan entries of this lane's positions in the next step, fetched a step ahead.
    I prow[U][NC];
    float pwt[U][NC];
    float pmask[U];
    auto item_quad = [&](int u) { return (swarp + SAMPLER_WARPS * u) % QUADS; };
    auto item_line = [&](int u) { return (swarp + SAMPLER_WARPS * u) / QUADS; };
    auto fetch_ahead = [&](int step) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const I p = (first_step + step) * BK + item_quad(u) * 4 + i4;
            pmask[u] = 1.0f;
            if (step < steps && p < BQ) {
                load_words(plan_rows + (plan_first + p) * NC, prow[u]);
                load_words(plan_weights + (plan_first + p) * NC, pwt[u]);
                if (plan_masks != nullptr) pmask[u] = __ldg(plan_masks + plan_first + p);
            } else {
#pragma unroll
                for (int c = 0; c < NC; ++c) { prow[u][c] = zero_row; pwt[u][c] = 0.0f; }
            }
        }
    };
    // B: the corners of this lane's positions (the plan entries in prow), their vector k of line
    // item_line(u), into raw[u] and their weights into wts[u]
    uint4 raw[U][NC];
    float wts[U][NC];
    auto load_item = [&](int u) {
        const int ch = item_line(u) * LINE + k * VEC;   // first channel of the vector in the tile
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const bool read = plan_masks == nullptr || (prow[u][c] >= 0 && pwt[u][c] != 0.0f);
            const I row = read ? prow[u][c] : zero_row;
            wts[u][c] = read ? pwt[u][c] * pmask[u] : 0.0f;
            raw[u][c] = __ldg(reinterpret_cast<const uint4*>(xcl + row * Cp + cabs0 + ch));
        }
    };
    int u0 = 0;   // the block's step of the unit's first
    for (I unit = blockIdx.x; unit < units; unit += gridDim.x) {
        enter_unit(unit);
        if (steps == 0) continue;
        cabs0 = blk.grp * Cg + blk.n0;
        plan_first = ((I)(cabs0 / seg_len) * K + blk.t) * BQ;
        a_src = gys + (I)(blk.grp * Cog + blk.m0) * BK;
        fetch_ahead(0);
        if (DCN_WS_LOADS_AHEAD) {   // step 0's corners, before the loop
#pragma unroll
            for (int u = 0; u < U; ++u) load_item(u);
            fetch_ahead(1);
        }
        for (int s = 0; s < steps; ++s) {
            const int g = u0 + s;
            const int stage = g % DEPTH;
            if (g >= DEPTH) barrier_sync(empty_barrier(stage), THREADS);
            unsigned char* const a_tile = ring + stage * STAGE_BYTES;
            unsigned char* const b_tile = a_tile + A_BYTES;
            if (stid == 0) {   // A: one bulk copy a plane, completing on the stage's mbarrier
                mbarrier_expect(a_full + stage, A_BYTES);
#pragma unroll
                for (int h = 0; h < SPLIT; ++h)
                    bulk_copy(a_tile + h * A_PLANE, a_src + ((first_step + s) * SPLIT + h) * out_channels * BK, A_PLANE,
                              a_full + stage);
            }
            if (!DCN_WS_LOADS_AHEAD) {
#pragma unroll
                for (int u = 0; u < U; ++u) load_item(u);
                fetch_ahead(s + 1);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                // blend (Sampler's order: corners 0..NC-1), into VEC elements of T as 32-bit words (3xTF32:
                // the big parts wv, the small ones ws)
                unsigned wv[4], ws[4];
                if constexpr (Packed<T>::value) {
                    uint4 a = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                    for (int c = 0; c < NC; ++c) Packed<T>::fma(a, Packed<T>::weight(wts[u][c]), raw[u][c]);
                    wv[0] = a.x; wv[1] = a.y; wv[2] = a.z; wv[3] = a.w;
                } else {
                    float acc[VEC];
#pragma unroll
                    for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
#pragma unroll
                    for (int c = 0; c < NC; ++c) Vec<T>::add(acc, wts[u][c], raw[u][c]);
                    if constexpr (SPLIT == 2) {
#pragma unroll
                        for (int j = 0; j < 4; ++j) split_tf32(acc[j], wv[j], ws[j]);
                    } else if constexpr (sizeof(T) == 4) {
#pragma unroll
                        for (int j = 0; j < 4; ++j) wv[j] = to_tf32(acc[j]);
                    } else {
                        const uint4 a = Vec<T>::pack(acc);
                        wv[0] = a.x; wv[1] = a.y; wv[2] = a.z; wv[3] = a.w;
                    }
                }
                // raw[u] blended: step s + 1's corners of item u go in flight before the stores
                if (DCN_WS_LOADS_AHEAD && s + 1 < steps) load_item(u);
                // element j of the rotated order is channel (j + rot) % VEC of the vector
                const int p = item_quad(u) * 4 + i4;                        // column (position in the step)
                const int row0 = item_line(u) * LINE + k * VEC;             // the vector's first row
                const int chunk = (p * (int)sizeof(T)) >> 4, within = (p * (int)sizeof(T)) & 15;
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const int jj = (j + rot) & (VEC - 1);
                    const int r = row0 + jj;
                    unsigned char* const at = b_tile + r * ROW + ((chunk ^ (r & 7)) << 4) + within;
                    if constexpr (sizeof(T) == 4) {
                        const unsigned lo = (jj & 1) ? wv[1] : wv[0], hi = (jj & 1) ? wv[3] : wv[2];
                        *reinterpret_cast<unsigned*>(at) = (jj & 2) ? hi : lo;
                        if constexpr (SPLIT == 2) {
                            const unsigned slo = (jj & 1) ? ws[1] : ws[0], shi = (jj & 1) ? ws[3] : ws[2];
                            *reinterpret_cast<unsigned*>(at + B_PLANE) = (jj & 2) ? shi : slo;
                        }
                    } else {
                        const int w = jj >> 1;
                        const unsigned lo = (w & 1) ? wv[1] : wv[0], hi = (w & 1) ? wv[3] : wv[2];
                        const unsigned word = (w & 2) ? hi : lo;
                        *reinterpret_cast<unsigned short*>(at) = (unsigned short)((jj & 1) ? word >> 16 : word);
                    }
                }
            }
            if (DCN_WS_LOADS_AHEAD) fetch_ahead(s + 2);
            proxy_fence();
            barrier_arrive(full_barrier(stage), THREADS);
        }
        u0 += steps;
    }
#endif
}

// gw[o, c, t] = sum over the splits, in order, of part[split, o, t, c] (in T).
template <typename T, typename I>
__global__ void fused_weight_sum(const float* __restrict__ part, T* __restrict__ gw, const int splits,
                                 const int out_channels, const int Cg, const int K) {
    fused::start_after_prerequisites();
    const I total = (I)out_channels * Cg * K;
    const I per_split = total;
    for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
        const int t = (int)(idx % K);
        const I oc = idx / K;
        const int c = (int)(oc % Cg);
        const I o = oc / Cg;
        const I at = (o * K + t) * Cg + c;
        float s = 0.0f;
        for (int sp = 0; sp < splits; ++sp) s += part[(I)sp * per_split + at];
        gw[idx] = Traits<T>::store(s);
    }
}
