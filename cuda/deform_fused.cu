// dcn_cupy: the fused deformable convolution forward (implicit GEMM on tensor cores).
//
// y[b, o, q] = bias[o] + sum_{t, c in group(o)} W[o, c, t] * m * sample(x[b, c], P(q, t))
// computed without a columns buffer in global memory. Per block an output tile of BM output
// channels (of one conv group) x BN = 128 positions p = b*Q + q (positions may span samples).
// The reduction runs over steps (tap t, chunk of BK input channels of the group):
//   * the weight tile (BM x BK, from the re-laid weights wr[o, t, c]) is copied to shared
//     memory with cp.async (zero-filled past C_out/G);
//   * the sampled tile (BK x BN) is built straight into shared memory from the CHANNELS-LAST
//     input xcl[b, s, c] (row stride Cp, a multiple of the vector width): two threads per
//     position, each owning CPT consecutive channels; the 2^N corner indices and weights (mask
//     included) of its (position, tap, offset group, mask group) live in registers and are
//     recomputed only when that key changes; each corner is one 16-byte load of consecutive
//     channels ("uniform" kernels, chosen when no thread's channels cross a conv / offset / mask
//     group boundary), else one load per channel with the key checked per channel;
//   * the tiles are multiplied with mma.sync: fp16 / bf16 m16n8k16 in their own format, float32
//     as TF32 m16n8k8 (PREC 1) or 3xTF32 (PREC 2: a = big + small, three products, float32
//     accuracy); float32 accumulation always.
// The next step's weight copy and corner loads are issued before this step's MMAs (two
// shared-memory buffers, one barrier per step).
//
// Semantics (DESIGN.md section 1): a position with a coordinate <= -1, >= S_a or non-finite
// samples 0; a corner outside the grid or of N-linear weight exactly 0 is not read.
//
// Template parameters: T storage type, I index type (int or long long), N spatial dims,
// PREC (0: T's own tensor-core format; 1: TF32; 2: 3xTF32), BM (64 or 128), UNIFORM.

#include "dcn_common.cuh"

using dcn::Geom;
using dcn::Traits;

namespace fused {

constexpr int THREADS = 256;   // 8 warps: 2 along the output channels x 4 along the positions
constexpr int BN = 128;        // positions per block
constexpr int TPP = THREADS / BN;  // sampling threads per position

// Channels per step (BK), per 16-byte vector (VEC) and the shared-memory row padding (PAD,
// one vector: rows 80 bytes apart hit distinct banks for ldmatrix and the TF32 fragment loads).
template <typename T> struct Tile { static const int BK = 32; static const int VEC = 8; static const int PAD = 8; };
template <> struct Tile<float> { static const int BK = 16; static const int VEC = 4; static const int PAD = 4; };

__device__ __forceinline__ unsigned smem_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16-byte global -> shared copy; zero-fills when !full (nothing is read then).
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool full) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_address(dst)), "l"(src), "r"(full ? 16 : 0));
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void copy_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_address(p)));
}

__device__ __forceinline__ unsigned to_tf32(float v) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
    return r;
}

// D += A * B for one m16n8k16 (half types) tile.
template <typename T> struct Mma16;
template <> struct Mma16<__half> {
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct Mma16<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// D += A * B for one m16n8k8 TF32 tile.
__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A vector of VEC values of T in 16 bytes, to and from float.
template <typename T> struct Vec;
template <> struct Vec<__half> {
    static __device__ __forceinline__ void add(float* acc, float w, uint4 v) {
        const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = __half22float2(h[j]);
            acc[2 * j] += w * f.x;
            acc[2 * j + 1] += w * f.y;
        }
    }
    static __device__ __forceinline__ uint4 pack(const float* v) {
        uint4 r;
        __half2* h = reinterpret_cast<__half2*>(&r);
#pragma unroll
        for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
        return r;
    }
};
template <> struct Vec<__nv_bfloat16> {
    static __device__ __forceinline__ void add(float* acc, float w, uint4 v) {
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = __bfloat1622float2(h[j]);
            acc[2 * j] += w * f.x;
            acc[2 * j + 1] += w * f.y;
        }
    }
    static __device__ __forceinline__ uint4 pack(const float* v) {
        uint4 r;
        __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
        for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
        return r;
    }
};
template <> struct Vec<float> {
    static __device__ __forceinline__ void add(float* acc, float w, uint4 v) {
        acc[0] += w * __uint_as_float(v.x);
        acc[1] += w * __uint_as_float(v.y);
        acc[2] += w * __uint_as_float(v.z);
        acc[3] += w * __uint_as_float(v.w);
    }
    static __device__ __forceinline__ uint4 pack(const float* v) {
        return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
    }
};

// The 2^N corners of one (position, tap, offset group, mask group): the channels-last row of
// each corner that is read (-1: outside, zero weight, or the position samples 0) and its
// weight times the mask.
template <typename I, int N>
struct Sampler {
    static const int NC = 1 << N;
    I row[NC];
    float weight[NC];
    int key_t, key_go, key_gm;

    __device__ __forceinline__ void reset() { key_t = -1; key_go = -1; key_gm = -1; }

    template <typename T>
    __device__ __forceinline__ void update(int t, int go, int gm, bool valid_position, const Geom<N>& g,
                                           const int (&qc)[N], const T* off_q, const T* msk_q, int K, I Q,
                                           I sample_row) {
        if (t == key_t && go == key_go && gm == key_gm) return;
        key_t = t; key_go = go; key_gm = gm;
#pragma unroll
        for (int c = 0; c < NC; ++c) row[c] = (I)-1;
        if (!valid_position) return;
        int tc[N];
        dcn::unravel<N, int>(t, g.ksize, tc);
        float pos[N];
        const T* off = off_q == nullptr ? nullptr : off_q + ((I)go * K + t) * (I)N * Q;
        dcn::tap_position<T, float, I, N>(g, qc, tc, off, Q, pos);
        const float m = msk_q == nullptr ? 1.0f : Traits<T>::load(msk_q[((I)gm * K + t) * Q]);
        int lo[N];
        float frac[N];
        if (!dcn::locate<float, N>(pos, g.in_size, lo, frac)) return;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            int coord[N];
            float w;
            if (dcn::corner<float, N>(c, lo, frac, g.in_size, coord, w) && w != 0.0f) {
                row[c] = sample_row + dcn::flat_index<N, I>(coord, g.in_size);
                weight[c] = w * m;
            }
        }
    }
};

}  // namespace fused

// x (B, C, S), sample stride `x_bstride` -> xcl (B, S, Cp), channels >= C zero.
// A 32x32 (channel x position) tile through shared memory per block iteration.
template <typename T, typename I>
__global__ void fused_channels_last(const T* __restrict__ x, T* __restrict__ xcl, const int batch,
                                    const int channels, const int Cp, const I S, const I x_bstride) {
    __shared__ T tile[32][33];
    const I s_tiles = (S + 31) / 32;
    const int c_tiles = (Cp + 31) / 32;
    const I blocks = (I)batch * c_tiles * s_tiles;
    for (I blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
        const I st = blk % s_tiles;
        const I rest = blk / s_tiles;
        const int ct = (int)(rest % c_tiles);
        const int b = (int)(rest / c_tiles);
        const I s0 = st * 32;
        const int c0 = ct * 32;
        // read: threadIdx.x along positions (coalesced in x)
        for (int r = threadIdx.y; r < 32; r += blockDim.y) {
            const int c = c0 + r;
            const I s = s0 + threadIdx.x;
            T v = Traits<T>::store(0.0f);
            if (c < channels && s < S) v = x[(I)b * x_bstride + (I)c * S + s];
            tile[r][threadIdx.x] = v;
        }
        __syncthreads();
        // write: threadIdx.x along channels (coalesced in xcl)
        for (int r = threadIdx.y; r < 32; r += blockDim.y) {
            const I s = s0 + r;
            const int c = c0 + threadIdx.x;
            if (s < S && c < Cp) xcl[((I)b * S + s) * Cp + c] = tile[threadIdx.x][r];
        }
        __syncthreads();
    }
}

// w (C_out, C/G, K) -> wr (C_out, K, Cgp): the GEMM's A operand, rows contiguous along the
// input channels of one tap; channels >= C/G zero.
template <typename T, typename I>
__global__ void fused_weight_rows(const T* __restrict__ w, T* __restrict__ wr, const int out_channels,
                                  const int Cg, const int Cgp, const int K) {
    const I total = (I)out_channels * K * Cgp;
    for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
        const int c = (int)(idx % Cgp);
        const I rest = idx / Cgp;
        const int t = (int)(rest % K);
        const I o = rest / K;
        wr[idx] = c < Cg ? w[(o * Cg + c) * K + t] : Traits<T>::store(0.0f);
    }
}

template <typename T, typename I, int N, int PREC, int BM, bool UNIFORM>
__global__ void __launch_bounds__(fused::THREADS)
deform_fused_forward(const T* __restrict__ xcl, const T* __restrict__ wr, const T* __restrict__ offset,
                     const T* __restrict__ mask, const T* __restrict__ bias, T* __restrict__ y,
                     const Geom<N> g, const int batch, const int channels, const int Cp,
                     const int out_channels, const int groups, const int offset_groups,
                     const int mask_groups, const int Cgp, const I offset_bstride, const I mask_bstride) {
    using namespace fused;
    constexpr int BK = Tile<T>::BK;
    constexpr int VEC = Tile<T>::VEC;
    constexpr int LD = BK + Tile<T>::PAD;        // shared row length (A: per output channel, B: per position)
    constexpr int CPT = BK / TPP;                // channels per sampling thread
    constexpr int NV = CPT / VEC;                // 16-byte vectors per sampling thread
    constexpr int NC = 1 << N;
    constexpr int WM = BM / 2, WN = BN / 4;      // warp tile
    constexpr int MT = WM / 16, NT = WN / 8;     // mma tiles per warp
    constexpr int A_VECS = BM * BK / VEC / THREADS;  // weight vectors copied per thread and step
    static_assert(A_VECS >= 1 && NV >= 1 && NT % 2 == 0, "tile shape");

    __shared__ __align__(128) T As[2][BM * LD];
    __shared__ __align__(128) T Bs[2][BN * LD];

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 1, wn = warp >> 1;

    const I Q = dcn::prod_size<N, I>(g.out_size);
    const I S = dcn::prod_size<N, I>(g.in_size);
    const int K = (int)dcn::prod_size<N, I>(g.ksize);
    const I BQ = (I)batch * Q;
    const int Cg = channels / groups;
    const int Cog = out_channels / groups;
    const int per_go = offset == nullptr ? channels : channels / offset_groups;
    const int per_gm = mask == nullptr ? channels : channels / mask_groups;
    const int m_tiles = (Cog + BM - 1) / BM;
    const I bid = blockIdx.x;
    const int grp = (int)((bid % ((I)m_tiles * groups)) / m_tiles);
    const int m0 = (int)(bid % m_tiles) * BM;
    const I p0 = (bid / ((I)m_tiles * groups)) * BN;
    const int chunks = (Cg + BK - 1) / BK;
    const int steps = K * chunks;

    // This thread's sampling position and channel slice.
    const int sn = tid / TPP;
    const int sh = (tid % TPP) * CPT;
    const I sp = p0 + sn;
    const bool svalid = sp < BQ;
    int qc[N];
    const T* off_q = nullptr;
    const T* msk_q = nullptr;
    I sample_row = 0;
    {
        const I b = svalid ? sp / Q : 0;
        const I q = svalid ? sp % Q : 0;
        dcn::unravel<N, I>(q, g.out_size, qc);
        if (offset != nullptr) off_q = offset + b * offset_bstride + q;
        if (mask != nullptr) msk_q = mask + b * mask_bstride + q;
        sample_row = b * S;
    }
    fused::Sampler<I, N> smp;
    smp.reset();
    uint4 raw[UNIFORM ? NC : 1][NV];   // uniform: the corners' vectors; else the finished values

    auto weight_copy = [&](int step, int buf) {
        const int t = step / chunks;
        const int c0 = (step % chunks) * BK;
#pragma unroll
        for (int j = 0; j < A_VECS; ++j) {
            const int v = tid + j * THREADS;
            const int r = v / (BK / VEC);
            const int cv = (v % (BK / VEC)) * VEC;
            const int o = m0 + r;
            const bool full = o < Cog;
            const T* src = wr + (((I)(grp * Cog + (full ? o : 0)) * K + t) * Cgp + c0 + cv);
            copy16_async(&As[buf][r * LD + cv], src, full);
        }
        copy_commit();
    };

    // Issue this thread's loads for `step` (uniform: raw corner vectors; otherwise the whole
    // sample, one channel at a time).
    auto sample_load = [&](int step) {
        const int t = step / chunks;
        const int cl = (step % chunks) * BK + sh;   // first channel within the group
        if constexpr (UNIFORM) {
            if (cl >= Cg) {
                smp.reset();
#pragma unroll
                for (int c = 0; c < NC; ++c) smp.row[c] = (I)-1;
                return;
            }
            const int cabs = grp * Cg + cl;
            smp.update(t, cabs / per_go, cabs / per_gm, svalid, g, qc, off_q, msk_q, K, Q, sample_row);
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                if (smp.row[c] >= 0) {
                    const uint4* src = reinterpret_cast<const uint4*>(xcl + smp.row[c] * Cp + cabs);
#pragma unroll
                    for (int v = 0; v < NV; ++v) raw[c][v] = __ldg(src + v);
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
                    smp.update(t, cabs / per_go, cabs / per_gm, svalid, g, qc, off_q, msk_q, K, Q, sample_row);
#pragma unroll
                    for (int k = 0; k < NC; ++k) {
                        if (smp.row[k] >= 0) val[j] += smp.weight[k] * Traits<T>::load(xcl[smp.row[k] * Cp + cabs]);
                    }
                }
            }
#pragma unroll
            for (int v = 0; v < NV; ++v) raw[0][v] = Vec<T>::pack(val + v * VEC);
        }
    };

    // Finish the sample and store it into B buffer `buf` (row sn, channels sh..sh+CPT).
    auto sample_store = [&](int buf) {
        uint4* dst = reinterpret_cast<uint4*>(&Bs[buf][sn * LD + sh]);
        if constexpr (UNIFORM) {
            float acc[CPT];
#pragma unroll
            for (int j = 0; j < CPT; ++j) acc[j] = 0.0f;
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                if (smp.row[c] >= 0) {
#pragma unroll
                    for (int v = 0; v < NV; ++v) Vec<T>::add(acc + v * VEC, smp.weight[c], raw[c][v]);
                }
            }
            if constexpr (PREC == 1) {
#pragma unroll
                for (int j = 0; j < CPT; ++j) acc[j] = __uint_as_float(to_tf32(acc[j]));
            }
#pragma unroll
            for (int v = 0; v < NV; ++v) dst[v] = Vec<T>::pack(acc + v * VEC);
        } else {
#pragma unroll
            for (int v = 0; v < NV; ++v) {
                uint4 r = raw[0][v];
                if constexpr (PREC == 1) {
                    r.x = to_tf32(__uint_as_float(r.x)); r.y = to_tf32(__uint_as_float(r.y));
                    r.z = to_tf32(__uint_as_float(r.z)); r.w = to_tf32(__uint_as_float(r.w));
                }
                dst[v] = r;
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

    auto multiply = [&](int buf) {
        const T* A = As[buf];
        const T* B = Bs[buf];
        if constexpr (PREC == 0) {
#pragma unroll
            for (int kk = 0; kk < BK; kk += 16) {
                unsigned af[MT][4];
                unsigned bf[NT][2];
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    const int r = wm * WM + i * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    ldmatrix_x4(af[i], A + r * LD + kk + (lane >> 4) * 8);
                }
#pragma unroll
                for (int j = 0; j < NT; j += 2) {
                    unsigned r4[4];
                    const int n = wn * WN + j * 8 + (lane & 7) + (lane >> 4) * 8;
                    ldmatrix_x4(r4, B + n * LD + kk + ((lane >> 3) & 1) * 8);
                    bf[j][0] = r4[0]; bf[j][1] = r4[1]; bf[j + 1][0] = r4[2]; bf[j + 1][1] = r4[3];
                }
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int j = 0; j < NT; ++j) Mma16<T>::run(acc[i][j], af[i], bf[j][0], bf[j][1]);
            }
        } else {
            const float* Af = reinterpret_cast<const float*>(A);
            const float* Bf = reinterpret_cast<const float*>(B);
            const int gq = lane >> 2, tq = lane & 3;
#pragma unroll
            for (int kk = 0; kk < BK; kk += 8) {
                unsigned ab[MT][4], bb[NT][2];
                unsigned as[MT][4], bsm[NT][2];
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    const int r = wm * WM + i * 16 + gq;
                    const float a[4] = {Af[r * LD + kk + tq], Af[(r + 8) * LD + kk + tq],
                                        Af[r * LD + kk + tq + 4], Af[(r + 8) * LD + kk + tq + 4]};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        ab[i][e] = to_tf32(a[e]);
                        if (PREC == 2) as[i][e] = to_tf32(a[e] - __uint_as_float(ab[i][e]));
                    }
                }
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const int n = wn * WN + j * 8 + gq;
                    const float bv[2] = {Bf[n * LD + kk + tq], Bf[n * LD + kk + tq + 4]};
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        // PREC 1: the sampler stored TF32-rounded values already.
                        bb[j][e] = PREC == 1 ? __float_as_uint(bv[e]) : to_tf32(bv[e]);
                        if (PREC == 2) bsm[j][e] = to_tf32(bv[e] - __uint_as_float(bb[j][e]));
                    }
                }
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        if (PREC == 2) {
                            mma_tf32(acc[i][j], as[i], bb[j][0], bb[j][1]);
                            mma_tf32(acc[i][j], ab[i], bsm[j][0], bsm[j][1]);
                        }
                        mma_tf32(acc[i][j], ab[i], bb[j][0], bb[j][1]);
                    }
            }
        }
    };

    // Prologue: step 0 into buffer 0.
    weight_copy(0, 0);
    sample_load(0);
    sample_store(0);
    copy_wait_all();
    __syncthreads();
    for (int s = 0; s < steps; ++s) {
        const int cur = s & 1;
        const bool more = s + 1 < steps;
        if (more) {
            weight_copy(s + 1, cur ^ 1);
            sample_load(s + 1);
        }
        multiply(cur);
        if (more) sample_store(cur ^ 1);
        copy_wait_all();
        __syncthreads();
    }

    // Epilogue: accumulators (+ bias) -> y[b, grp*Cog + o, q], straight from the fragments.
    const int gq = lane >> 2, tq = lane & 3;
    I ybase[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const I p = p0 + wn * WN + j * 8 + 2 * tq + e;
            ybase[j][e] = p < BQ ? (p / Q) * out_channels * Q + p % Q : (I)-1;
        }
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int o = m0 + wm * WM + i * 16 + gq + h * 8;
            if (o >= Cog) continue;
            const int oc = grp * Cog + o;
            const float bv = bias == nullptr ? 0.0f : Traits<T>::load(bias[oc]);
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (ybase[j][e] >= 0) y[ybase[j][e] + (I)oc * Q] = Traits<T>::store(acc[i][j][h * 2 + e] + bv);
                }
        }
}
