// dcn_cupy: what the fused forward (deform_fused.cu) and the fused backward
// (deform_fused_backward.cu) share: asynchronous global -> shared copies, the warp-level MMA
// of one shared-memory tile pair on tensor cores, the corner sampler of one (position, tap,
// offset group, mask group) with its 16-byte vectors, and the channels-last layout change.
#pragma once

#include "dcn_common.cuh"

using dcn::Geom;
using dcn::Traits;

namespace fused {

// Channels per 16-byte vector (VEC) and the shared-memory row padding (PAD, one vector: rows
// 16 (mod 128) bytes apart hit distinct banks for ldmatrix and the TF32 fragment loads).
template <typename T> struct Tile { static const int VEC = 8; static const int PAD = 8; };
template <> struct Tile<float> { static const int VEC = 4; static const int PAD = 4; };

// The bits of one value of T, and of two consecutive ones moved as one word (4 bytes for the
// half types, 8 for float32).
template <typename T> struct Pair { typedef unsigned short bits; typedef unsigned type; };
template <> struct Pair<float> { typedef unsigned bits; typedef uint2 type; };

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
// Wait until at most P of this thread's committed cp.async groups are pending.
template <int P>
__device__ __forceinline__ void copy_wait_pending() { asm volatile("cp.async.wait_group %0;\n" :: "n"(P) : "memory"); }

// Programmatic dependent launch (compute capability 9.0; no-ops where the launch did not ask for
// it, and below 9.0). launch_dependents: the next kernel of the stream, if launched with
// programmatic stream serialization, may start once every block of this one has passed here.
// wait_prerequisites: the kernel before this one in the stream has completed and its writes are
// visible. A kernel launched that way calls wait_prerequisites in every block before it reads
// what earlier kernels wrote and before it exits, so that its completion still implies theirs.
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_prerequisites() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// The start of a kernel that may be launched that way and needs the earlier kernels' output
// from its first instruction (the fused backward's): its successor may launch, then it waits.
__device__ __forceinline__ void start_after_prerequisites() {
    launch_dependents();
    wait_prerequisites();
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_address(p)));
}

__device__ __forceinline__ unsigned to_tf32(float v) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
    return r;
}

}  // namespace fused

// v, or (float32 where round_tf32) v rounded to TF32: an operand the TF32 wgmma reads from shared
// memory, which would truncate it, rounded as warp_mma rounds its fragments.
template <typename T>
__device__ __forceinline__ T maybe_tf32(T v, int) { return v; }
template <>
__device__ __forceinline__ float maybe_tf32<float>(float v, int round_tf32) {
    return round_tf32 ? __uint_as_float(fused::to_tf32(v)) : v;
}

namespace fused {

// 3xTF32: the TF32 rounding of v - big (v = big + small); 0 where big is not finite, so that an
// infinite operand stays infinite (inf - inf would make the small part NaN).
__device__ __forceinline__ unsigned split_small(float v, unsigned big) {
    const float b = __uint_as_float(big);
    return isfinite(b) ? to_tf32(v - b) : 0u;
}

// 3xTF32 for the wgmma tiles, which multiply stored tiles of big and small parts (no per-product
// choice of operands as in warp_mma): v = big + small, both TF32, both of v's sign and nonzero for a
// finite v != 0 (big the TF32 truncation of v, or one TF32 unit nearer 0 where that is v itself;
// small the rest, rounded); (v, v) for 0 and for a non-finite v. The three products a_big*b_big,
// a_small*b_big and a_big*b_small of one pair then share their sign: an infinite factor makes
// them infinite alike (never inf - inf), and 0 * inf arises only where a factor is 0 or NaN
// (where the exact product is NaN too). Branch-free: both results computed, then selected (a
// branch a value cost the samplers' loops 40 branches a step; H200, without them: B=16 C512 14x14
// strict forward 0.288 -> 0.249 ms, f+b 0.877 -> 0.805, NOTES-gpu.md session 63).
__device__ __forceinline__ void split_tf32(float v, unsigned& big, unsigned& small) {
    const unsigned bits = __float_as_uint(v);
    const bool special = v == 0.0f || !isfinite(v);   // (v, v)
    unsigned b = bits & 0xFFFFE000u;                  // truncated: magnitude towards 0
    b -= b == bits ? 0x2000u : 0u;                    // one unit of the last TF32 place nearer 0 (|v| >= that unit)
    const unsigned rest = to_tf32(v - __uint_as_float(b));   // exact difference, rounded: keeps its sign
    big = special ? bits : b;
    small = special ? bits : rest;
}

// split_tf32 of the four float32 words of a 16-byte vector.
__device__ __forceinline__ void split_tf32(uint4 v, uint4& big, uint4& small) {
    split_tf32(__uint_as_float(v.x), big.x, small.x);
    split_tf32(__uint_as_float(v.y), big.y, small.y);
    split_tf32(__uint_as_float(v.z), big.z, small.z);
    split_tf32(__uint_as_float(v.w), big.w, small.w);
}

// The TF32 bits `big` where finite, else 0 (the operand of a 3xTF32 cross term).
__device__ __forceinline__ unsigned finite_or_zero(unsigned big) {
    return isfinite(__uint_as_float(big)) ? big : 0u;
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

// Experiment switch (benchmarks build modules with it set to 0 to compare): half-type corners
// blended in their own packed arithmetic (1, the default) or in float32 (0).
#ifndef DCN_FUSED_PACKED_BLEND
#define DCN_FUSED_PACKED_BLEND 1
#endif

// The blend of a half type's corners in packed pairs: acc += w * v over the 8 channels of a
// 16-byte vector, as 4 HFMA2 (fp16x2, or bf16x2 on sm_80+) with no conversion to float: a
// quarter of the float32 blend's instructions (a conversion and an FFMA per channel). The
// sample is rounded to T for the MMA anyway; this adds the roundings of the corner products
// (as torchvision's half-precision interpolation has), within the half types' tolerances.
template <typename T> struct Packed { static const bool value = false; };
template <> struct Packed<__half> {
    static const bool value = DCN_FUSED_PACKED_BLEND != 0;
    static __device__ __forceinline__ unsigned weight(float w) {
        const __half2 w2 = __float2half2_rn(w);
        return *reinterpret_cast<const unsigned*>(&w2);
    }
    static __device__ __forceinline__ void fma(uint4& acc, unsigned w, const uint4& v) {
        const __half2 w2 = *reinterpret_cast<const __half2*>(&w);
        __half2* a = reinterpret_cast<__half2*>(&acc);
        const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
        for (int j = 0; j < 4; ++j) a[j] = __hfma2(w2, h[j], a[j]);
    }
};
template <> struct Packed<__nv_bfloat16> {
    static const bool value = DCN_FUSED_PACKED_BLEND != 0;
    static __device__ __forceinline__ unsigned weight(float w) {
        const __nv_bfloat162 w2 = __float2bfloat162_rn(w);
        return *reinterpret_cast<const unsigned*>(&w2);
    }
    static __device__ __forceinline__ void fma(uint4& acc, unsigned w, const uint4& v) {
        const __nv_bfloat162 w2 = *reinterpret_cast<const __nv_bfloat162*>(&w);
        __nv_bfloat162* a = reinterpret_cast<__nv_bfloat162*>(&acc);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int j = 0; j < 4; ++j) a[j] = __hfma2(w2, h[j], a[j]);
    }
};

// A value of T held as the bits it was loaded as, and those bits as float. A prefetched value is
// kept so: its conversion, the load's first use, then comes where the value is used, not right
// after the load, where the warp would wait for it (the half types: H200 ncu, B=32 C64 fp16
// forward, 11% of the stall samples on the prefetch's conversion; the whole forward then 7%
// faster in ENGINE 3's 64-row tile, 1-3% in the others, NOTES-gpu.md session 25).
__device__ __forceinline__ unsigned raw_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ unsigned raw_bits(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ unsigned raw_bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
template <typename T> __device__ __forceinline__ float from_bits(unsigned b);
template <> __device__ __forceinline__ float from_bits<float>(unsigned b) { return __uint_as_float(b); }
template <> __device__ __forceinline__ float from_bits<__half>(unsigned b) {
    return __half2float(__ushort_as_half((unsigned short)b));
}
template <> __device__ __forceinline__ float from_bits<__nv_bfloat16>(unsigned b) {
    return __bfloat162float(__ushort_as_bfloat16((unsigned short)b));
}

// The 2^N corners of one (position, tap, offset group, mask group): the channels-last row of
// each corner that is read (-1: outside, zero weight, or the position samples 0) and its
// weight times the mask (0 for a corner not read). The offset and mask values of the next key
// can be fetched a step ahead (prefetch, held as loaded: raw_bits), so that a new tap does not
// wait for them.
template <typename I, int N>
struct Sampler {
    static const int NC = 1 << N;
    I row[NC];
    float weight[NC];
    int key_t, key_go, key_gm;
    int pf_t, pf_go, pf_gm;
    unsigned pf_off[N], pf_m;   // raw_bits of the storage type

    __device__ __forceinline__ void reset() { key_t = -1; key_go = -1; key_gm = -1; pf_t = -1; }

    __device__ __forceinline__ void clear() {
        key_t = -1;
#pragma unroll
        for (int c = 0; c < NC; ++c) { row[c] = (I)-1; weight[c] = 0.0f; }
    }

    // The offsets and mask of key (t, go, gm) as loaded (raw_bits; 0 and 1 where absent).
    template <typename T>
    static __device__ __forceinline__ void fetch(int t, int go, int gm, const T* off_q, const T* msk_q, int K, I Q,
                                                 unsigned (&off)[N], unsigned& m) {
#pragma unroll
        for (int a = 0; a < N; ++a) off[a] = 0u;   // +0 in every storage type
        if (off_q != nullptr) {
            const T* o = off_q + ((I)go * K + t) * (I)N * Q;
#pragma unroll
            for (int a = 0; a < N; ++a) off[a] = raw_bits(o[(I)a * Q]);
        }
        m = raw_bits(msk_q == nullptr ? Traits<T>::store(1.0f) : msk_q[((I)gm * K + t) * Q]);
    }

    template <typename T>
    __device__ __forceinline__ void prefetch(int t, int go, int gm, bool valid_position, const T* off_q,
                                             const T* msk_q, int K, I Q) {
        if (!valid_position || (t == key_t && go == key_go && gm == key_gm) ||
            (t == pf_t && go == pf_go && gm == pf_gm)) return;
        pf_t = t; pf_go = go; pf_gm = gm;
        fetch(t, go, gm, off_q, msk_q, K, Q, pf_off, pf_m);
    }

    template <typename T>
    __device__ __forceinline__ void update(int t, int go, int gm, bool valid_position, const Geom<N>& g,
                                           const int (&qc)[N], const T* off_q, const T* msk_q, int K, I Q,
                                           I sample_row) {
        if (t == key_t && go == key_go && gm == key_gm) return;
        key_t = t; key_go = go; key_gm = gm;
#pragma unroll
        for (int c = 0; c < NC; ++c) { row[c] = (I)-1; weight[c] = 0.0f; }
        if (!valid_position) return;
        unsigned off_bits[N], m_bits;
        if (t == pf_t && go == pf_go && gm == pf_gm) {
#pragma unroll
            for (int a = 0; a < N; ++a) off_bits[a] = pf_off[a];
            m_bits = pf_m;
        } else {
            fetch(t, go, gm, off_q, msk_q, K, Q, off_bits, m_bits);
        }
        float off[N];
#pragma unroll
        for (int a = 0; a < N; ++a) off[a] = from_bits<T>(off_bits[a]);
        const float m = from_bits<T>(m_bits);
        int tc[N];
        dcn::unravel_in_range<N, int>(t, g.ksize, tc);   // 0 <= t < K
        float pos[N];
#pragma unroll
        for (int a = 0; a < N; ++a) pos[a] = (float)(qc[a] * g.stride[a] - g.pad[a] + tc[a] * g.dil[a]) + off[a];
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

// p + off for an element offset known to be >= 0: zero-extended where it is an int (one
// IMAD.WIDE.U32 an address, where a signed offset is sign-extended, scaled and added in four).
template <typename T>
__device__ __forceinline__ const T* offset_by(const T* p, int off) { return p + (unsigned)off; }
template <typename T>
__device__ __forceinline__ const T* offset_by(const T* p, long long off) { return p + off; }

// A thread's output offsets in an MMA epilogue: y[b, 0, q] of positions p = base + 8j + e
// (j < NJ, e < 2) is offsets[j][e] = b * out_channels * Q + q, or -1 past the batch (BQ
// positions). One division, for base; the others step from it: a tile's 8 NJ positions wrap into
// the next sample at most once where Q >= 8 NJ, else (a small output) each divides.
template <typename I, int NJ>
__device__ __forceinline__ void output_offsets(I (&offsets)[NJ][2], I base, I Q, I BQ, int out_channels) {
    const I b0 = base / Q, q0 = base - b0 * Q;
    const I sample = (I)out_channels * Q;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int d = 8 * j + e;
            I b = b0, q = q0 + d;
            if (Q >= 8 * NJ) {
                if (q >= Q) { q -= Q; ++b; }
            } else {
                b = (base + d) / Q;
                q = (base + d) - b * Q;
            }
            offsets[j][e] = base + d < BQ ? b * sample + q : (I)-1;
        }
}

// Two adjacent outputs as one 4- or 8-byte store (fused::output_offsets' pairs e = 0, 1).
template <typename T> struct PairStore;
template <> struct PairStore<__half> {
    typedef __half2 type;
    static __device__ __forceinline__ type pack(float a, float b) { return __floats2half2_rn(a, b); }
};
template <> struct PairStore<__nv_bfloat16> {
    typedef __nv_bfloat162 type;
    static __device__ __forceinline__ type pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <> struct PairStore<float> {
    typedef float2 type;
    static __device__ __forceinline__ type pack(float a, float b) { return make_float2(a, b); }
};

// Whether every pair of a thread's output offsets (output_offsets) is two adjacent outputs of
// one sample at an aligned address in every row (y + offset + o * Q for any o): then each pair is
// one store (PairStore), else each output is stored alone.
template <typename T, typename I, int NJ>
__device__ __forceinline__ bool pairs_aligned(const T* y, const I (&offsets)[NJ][2], I Q) {
    constexpr int P = sizeof(typename PairStore<T>::type) / sizeof(T);   // 2
    bool ok = (reinterpret_cast<unsigned long long>(y) % sizeof(typename PairStore<T>::type)) == 0 && Q % P == 0;
#pragma unroll
    for (int j = 0; j < NJ; ++j) ok = ok && offsets[j][0] >= 0 && offsets[j][1] == offsets[j][0] + 1 && offsets[j][0] % P == 0;
    return ok;
}

// One output row's values of a thread (value(j, e): position offsets[j][e]) into yrow (y at its
// channel): a pair a store where pairs_aligned holds, else each valid output alone.
template <typename T, typename I, int NJ, typename F>
__device__ __forceinline__ void store_row(T* yrow, const I (&offsets)[NJ][2], bool pairs, F value) {
    if (pairs) {
#pragma unroll
        for (int j = 0; j < NJ; ++j)
            *reinterpret_cast<typename PairStore<T>::type*>(yrow + offsets[j][0]) = PairStore<T>::pack(value(j, 0), value(j, 1));
    } else {
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (offsets[j][e] >= 0) yrow[offsets[j][e]] = Traits<T>::store(value(j, e));
    }
}

// The sampling plan's entry of one (segment, tap, position): the 2^N corner rows of the
// channels-last input (the zero row for a corner not read) and their weights (mask included),
// as Sampler computes them, moved as whole 8- or 16-byte words (rows: int or long long).
__device__ __forceinline__ void to_words(float v, unsigned* w) { w[0] = __float_as_uint(v); }
__device__ __forceinline__ void to_words(int v, unsigned* w) { w[0] = (unsigned)v; }
__device__ __forceinline__ void to_words(long long v, unsigned* w) {
    w[0] = (unsigned)v;
    w[1] = (unsigned)((unsigned long long)v >> 32);
}
__device__ __forceinline__ void from_words(const unsigned* w, float& v) { v = __uint_as_float(w[0]); }
__device__ __forceinline__ void from_words(const unsigned* w, int& v) { v = (int)w[0]; }
__device__ __forceinline__ void from_words(const unsigned* w, long long& v) {
    v = (long long)(((unsigned long long)w[1] << 32) | w[0]);
}

template <typename X, int COUNT>
__device__ __forceinline__ void store_words(X* dst, const X (&v)[COUNT]) {
    constexpr int PER = sizeof(X) / 4, WORDS = COUNT * PER;
    static_assert(WORDS % 4 == 0 || WORDS == 2, "8- or 16-byte words");
    unsigned w[WORDS];
#pragma unroll
    for (int i = 0; i < COUNT; ++i) to_words(v[i], w + i * PER);
    if constexpr (WORDS == 2) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
    } else {
#pragma unroll
        for (int k = 0; k < WORDS / 4; ++k)
            reinterpret_cast<uint4*>(dst)[k] = make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
    }
}

// (GLOBAL: through the read-only cache, src in global memory; else a plain load, e.g. shared)
template <bool GLOBAL = true, typename X, int COUNT>
__device__ __forceinline__ void load_words(const X* src, X (&v)[COUNT]) {
    constexpr int PER = sizeof(X) / 4, WORDS = COUNT * PER;
    static_assert(WORDS % 4 == 0 || WORDS == 2, "8- or 16-byte words");
    unsigned w[WORDS];
    if constexpr (WORDS == 2) {
        const uint2* p = reinterpret_cast<const uint2*>(src);
        uint2 r;
        if constexpr (GLOBAL) r = __ldg(p); else r = *p;
        w[0] = r.x; w[1] = r.y;
    } else {
#pragma unroll
        for (int k = 0; k < WORDS / 4; ++k) {
            const uint4* p = reinterpret_cast<const uint4*>(src) + k;
            uint4 r;
            if constexpr (GLOBAL) r = __ldg(p); else r = *p;
            w[4 * k] = r.x; w[4 * k + 1] = r.y; w[4 * k + 2] = r.z; w[4 * k + 3] = r.w;
        }
    }
#pragma unroll
    for (int i = 0; i < COUNT; ++i) from_words(w + i * PER, v[i]);
}

// 3xTF32 sums each step's products (a k8's in warp_mma below, a ring stage's in ENGINE 3 of
// deform_fused.cu) in registers of their own, then adds them to the accumulators in float32 (1),
// or straight into the accumulators (0: the old way, kept for timing the difference; both
// modules read it, fused_variants.py --defines DCN_PROMOTE_3XTF32=0 builds the forward's).
#ifndef DCN_PROMOTE_3XTF32
#define DCN_PROMOTE_3XTF32 1
#endif

// The A fragments (MT m16 tiles, rows wm * WM + 16 i) and B fragments (NT n8 tiles, rows wn * WN
// + 8 j) of the k step at kk, by ldmatrix.x4 from shared tiles with rows of LD elements of E,
// K contiguous. A 16-byte row of an 8x8 b16 matrix is 8 half values or 4 floats, and lane l
// receives word l % 4 of row l / 4: the m16n8k16 half layout, and for float the m16n8k8 TF32
// layout (A rows g, g + 8 at columns t, t + 4; B row n = g at k = t, t + 4).
// The fused weight gradient's sampled tile, B[channel n][position], is written by a position's
// threads with interleaved channel vectors in one store instruction: rows VEC apart, and rows 8
// apart start on the same bank (rows of BK + a 16-byte pad), so those stores would conflict 4-way
// (half types) or 2-way (float). Its 16-byte chunk c of row n is stored at chunk c ^ b_swizzle(n)
// instead, which spreads them over distinct banks; a ldmatrix matrix's 8 rows (aligned to 8) share
// one XOR and stay conflict-free. Needs BK / (16 / sizeof(E)) to be a multiple of 4.
template <typename E>
__device__ __forceinline__ int b_swizzle(int n) {
    return sizeof(E) == 2 ? (n >> 3) & 3 : ((n >> 3) & 1) << 1;
}

// The layouts of a tile pair in shared memory (rows of LD elements, K contiguous, 16-byte chunks):
//   TILE_PADDED: rows padded by a chunk (LD = BK + PAD), chunks in place;
//   TILE_SWIZZLED_B: A as TILE_PADDED, B's chunk c of row n at c ^ b_swizzle(n) (the weight
//     gradient's sampled tile, above);
//   TILE_XOR: unpadded rows of 8 chunks (LD = 8 * 16 / sizeof(E), 128 bytes), chunk c of row r at
//     c ^ (r & 7) in both tiles, CUTLASS's 128-byte swizzle. A cp.async row copy then fills one
//     aligned 128-byte line of shared memory: with padded rows (144 bytes apart at half BK = 64)
//     a warp's LDGSTS of 4 rows fetched 24 L2 sectors for its 16 (ncu, H200, the data kernel,
//     NOTES-gpu.md session 34). The 8 rows of a ldmatrix matrix (aligned to 8) get 8 distinct
//     XORs, so its reads stay conflict-free. The tiles must start 128-byte aligned in shared
//     memory (their buffers are multiples of 128 bytes from the aligned dynamic base);
//   TILE_XOR_A: A as TILE_XOR but in rows of BK elements (any power-of-two multiple of 8 chunks:
//     the XOR permutes each 8 chunks), aligned to a row's bytes; B as TILE_SWIZZLED_B (the weight
//     gradient's tiles).
constexpr int TILE_PADDED = 0, TILE_SWIZZLED_B = 1, TILE_XOR = 2, TILE_XOR_A = 3;

// Element offset of 16-byte chunk c of row r in a TILE_XOR tile of E with rows of ROW elements.
template <typename E, int ROW>
__device__ __forceinline__ int xor_chunk_offset(int r, int c) {
    return r * ROW + ((c ^ (r & 7)) * (16 / (int)sizeof(E)));
}

// Fragment reads of a TILE_XOR tile: `addr` is the shared byte address of the thread's chunk at
// k = 0, XORed already with its row's swizzle; the k step's chunk (an even chunk index, shifted
// to bytes) is XORed in here, inside the asm, so that it is issued with the load. Written as C++,
// the addresses of every k step were hoisted out of the main loop, one register each, and the data
// kernel spilled (ptxas, sm_90, 2D fp16 64x64x64: 0 -> 28 bytes) and lost up to 3.5% (H200,
// NOTES-gpu.md session 34).
__device__ __forceinline__ void ldmatrix_x4_xor(unsigned (&r)[4], unsigned addr, unsigned flip) {
    asm volatile("{\n.reg .b32 a;\nxor.b32 a, %4, %5;\n"
                 "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [a];\n}\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr), "r"(flip));
}

// Element offset of element k (a multiple of 16 / sizeof(E)) of row r in a tile with rows of LD
// elements, swizzled (XOR: TILE_XOR) or not.
template <typename E, bool XOR, int LD>
__device__ __forceinline__ int tile_offset(int r, int k) {
    if constexpr (XOR) return xor_chunk_offset<E, LD>(r, k / (16 / (int)sizeof(E)));
    return r * LD + k;
}

// Whether a layout's A tile is swizzled (TILE_XOR, TILE_XOR_A).
template <int LAYOUT>
__device__ __forceinline__ constexpr bool a_swizzled() { return LAYOUT == TILE_XOR || LAYOUT == TILE_XOR_A; }

// LDA: A's row length (LD but in TILE_XOR_A).
template <typename E, int MT, int NT, int LD, int WM, int WN, int LAYOUT = TILE_PADDED, int LDA = LD>
__device__ __forceinline__ void ldmatrix_fragments(unsigned (&af)[MT][4], unsigned (&bf)[NT][2], const E* A, const E* B,
                                                   int kk, int wm, int wn, int lane) {
    constexpr int V = 16 / sizeof(E);   // elements per 16 bytes
    static_assert(NT % 2 == 0, "B fragments in pairs of n8 tiles");
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const int r = wm * WM + i * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        if constexpr (a_swizzled<LAYOUT>()) {   // (kk / V is even: kk / V + h = kk / V ^ h)
            ldmatrix_x4_xor(af[i], smem_address(A + xor_chunk_offset<E, LDA>(r, lane >> 4)), (kk / V) << 4);
        } else {
            ldmatrix_x4(af[i], A + r * LD + kk + (lane >> 4) * V);
        }
    }
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
        unsigned r4[4];
        const int n = wn * WN + j * 8 + (lane & 7) + (lane >> 4) * 8;
        // (unswizzled, the address is written as before: in the chunk form the data kernel's SASS
        // changed, 1528 -> 1560 instructions at 2D fp16, and it measured 3% slower, H200 session 24)
        if constexpr (LAYOUT == TILE_SWIZZLED_B || LAYOUT == TILE_XOR_A) {
            ldmatrix_x4(r4, B + n * LD + ((kk / V + ((lane >> 3) & 1)) ^ b_swizzle<E>(n)) * V);
        } else if constexpr (LAYOUT == TILE_XOR) {
            ldmatrix_x4_xor(r4, smem_address(B + xor_chunk_offset<E, LD>(n, (lane >> 3) & 1)), (kk / V) << 4);
        } else {
            ldmatrix_x4(r4, B + n * LD + kk + ((lane >> 3) & 1) * V);
        }
        bf[j][0] = r4[0]; bf[j][1] = r4[1]; bf[j + 1][0] = r4[2]; bf[j + 1][1] = r4[3];
    }
}

// One m16n8k8 fragment's 3xTF32 products into acc: a_small*b_cross + a_cross*b_small + a_big*b_big
// (the cross terms' big parts as the caller takes them: warp_mma's finite ones, else the big
// parts). The tensor cores add into their accumulator with truncation: summed straight into acc
// over a long K, the error grows with K (2.9e-5 at C_in * K = 4608). So (DCN_PROMOTE_3XTF32) the
// three products go to p, which is added in float32, and the error is float32 FMAs'.
__device__ __forceinline__ void mma_3xtf32(float (&acc)[4], const unsigned (&a_small)[4], const unsigned (&a_cross)[4],
                                           const unsigned (&a_big)[4], unsigned b_cross0, unsigned b_cross1,
                                           unsigned b_small0, unsigned b_small1, unsigned b_big0, unsigned b_big1) {
    if (DCN_PROMOTE_3XTF32) {
        float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_tf32(p, a_small, b_cross0, b_cross1);
        mma_tf32(p, a_cross, b_small0, b_small1);
        mma_tf32(p, a_big, b_big0, b_big1);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] += p[e];
    } else {
        mma_tf32(acc, a_small, b_cross0, b_cross1);
        mma_tf32(acc, a_cross, b_small0, b_small1);
        mma_tf32(acc, a_big, b_big0, b_big1);
    }
}

// One warp's share of C += A * B^T for one step of a block tile, A (rows x BK) and B
// (positions x BK) in shared memory with rows of LD elements (K contiguous), the warp's tile
// WM x WN at (wm * WM, wn * WN): MT x NT m16n8 fragments in `acc` (float32). Half types: m16n8k16
// with ldmatrix; float32: m16n8k8 TF32 with ldmatrix (PREC 1; ROUNDED: which of A and B hold
// TF32-rounded values already, ROUNDED_A | ROUNDED_B) or 3xTF32 (PREC 2: a = big + small, three
// products, float32 accuracy) with scalar loads, or ldmatrix from swizzled A tiles. LAYOUT: the
// tiles' layout (TILE_*, above).
constexpr int ROUNDED_A = 1, ROUNDED_B = 2;
template <typename T, int PREC, int ROUNDED, int MT, int NT, int LD, int BK, int WM, int WN,
          int LAYOUT = TILE_PADDED>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][NT][4], const T* A, const T* B, int wm, int wn,
                                         int lane) {
    constexpr int LDA = LAYOUT == TILE_XOR_A ? BK : LD;
    if constexpr (PREC == 0) {
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            unsigned af[MT][4];
            unsigned bf[NT][2];
            ldmatrix_fragments<T, MT, NT, LD, WM, WN, LAYOUT, LDA>(af, bf, A, B, kk, wm, wn, lane);
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j) Mma16<T>::run(acc[i][j], af[i], bf[j][0], bf[j][1]);
        }
    } else {
        const float* Af = reinterpret_cast<const float*>(A);
        const float* Bf = reinterpret_cast<const float*>(B);
#pragma unroll
        for (int kk = 0; kk < BK; kk += 8) {
            // The fragments' float32 values: TF32 by ldmatrix, one instruction for four scalar
            // shared loads (1D TF32 data and weight kernels 6-8% faster); 3xTF32 keeps the scalar
            // loads on padded tiles, with which its data kernel was 1-2% faster, and takes
            // ldmatrix on TILE_XOR tiles, where a scalar load needs an XOR of its own (2D data
            // kernel 3-7% slower; H200, NOTES-gpu.md session 34).
            static_assert(!a_swizzled<LAYOUT>() || NT % 2 == 0, "swizzled tiles are read by ldmatrix");
            unsigned af[MT][4], bf[NT][2];
            if constexpr ((PREC == 1 || a_swizzled<LAYOUT>()) && NT % 2 == 0) {
                ldmatrix_fragments<float, MT, NT, LD, WM, WN, LAYOUT, LDA>(af, bf, Af, Bf, kk, wm, wn, lane);
            } else {
                const int gq = lane >> 2, tq = lane & 3;
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    const int r = wm * WM + i * 16 + gq;
                    af[i][0] = __float_as_uint(Af[r * LD + kk + tq]);
                    af[i][1] = __float_as_uint(Af[(r + 8) * LD + kk + tq]);
                    af[i][2] = __float_as_uint(Af[r * LD + kk + tq + 4]);
                    af[i][3] = __float_as_uint(Af[(r + 8) * LD + kk + tq + 4]);
                }
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const int n = wn * WN + j * 8 + gq;
                    if constexpr (LAYOUT == TILE_SWIZZLED_B) {
                        const int x = b_swizzle<float>(n) * 4;   // (chunks of 4 floats)
                        bf[j][0] = __float_as_uint(Bf[n * LD + ((kk + tq) ^ x)]);
                        bf[j][1] = __float_as_uint(Bf[n * LD + ((kk + tq + 4) ^ x)]);
                    } else {
                        bf[j][0] = __float_as_uint(Bf[n * LD + kk + tq]);
                        bf[j][1] = __float_as_uint(Bf[n * LD + kk + tq + 4]);
                    }
                }
            }
            // 3xTF32: a*b ~ a_small*b_big + a_big*b_small + a_big*b_big. The cross terms
            // take the big parts only where they are finite (else 0): 0 * inf would make
            // NaN where the exact product is infinite; a_big*b_big carries inf / NaN.
            unsigned ab[MT][4], bb[NT][2];
            unsigned as[MT][4], bsm[NT][2], abx[MT][4], bbx[NT][2];
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const float a[4] = {__uint_as_float(af[i][0]), __uint_as_float(af[i][1]), __uint_as_float(af[i][2]),
                                    __uint_as_float(af[i][3])};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    ab[i][e] = PREC == 1 && (ROUNDED & ROUNDED_A) ? __float_as_uint(a[e]) : to_tf32(a[e]);
                    if (PREC == 2) {
                        as[i][e] = split_small(a[e], ab[i][e]);
                        abx[i][e] = finite_or_zero(ab[i][e]);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const float bv[2] = {__uint_as_float(bf[j][0]), __uint_as_float(bf[j][1])};
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    bb[j][e] = PREC == 1 && (ROUNDED & ROUNDED_B) ? __float_as_uint(bv[e]) : to_tf32(bv[e]);
                    if (PREC == 2) {
                        bsm[j][e] = split_small(bv[e], bb[j][e]);
                        bbx[j][e] = finite_or_zero(bb[j][e]);
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    if (PREC == 2) {
                        mma_3xtf32(acc[i][j], as[i], abx[i], ab[i], bbx[j][0], bbx[j][1], bsm[j][0], bsm[j][1],
                                   bb[j][0], bb[j][1]);
                    } else {
                        mma_tf32(acc[i][j], ab[i], bb[j][0], bb[j][1]);
                    }
                }
        }
    }
}

// warp_mma's 3xTF32 on operands split beforehand (the data kernel's strict float32: rows of
// split_tf32's big parts and of its small ones, fused_channels_last_split): a warp's share of
// C += A * B^T for one step, the big and small tiles of A and B each in shared memory as
// warp_mma's (LD, LAYOUT), both parts' fragments by ldmatrix, three products a k8 (a_small*b_big + a_big*b_small +
// a_big*b_big), summed apart and added in float32 (DCN_PROMOTE_3XTF32). split_tf32 gives the three
// products of a pair one sign, so no cross term needs the finite test of warp_mma's split, and no
// value is split in the loop (where warp_mma splits every fragment value it loads: the 2D data
// kernel 2416 -> 1824 instructions, NOTES-gpu.md session 43).
template <int MT, int NT, int LD, int BK, int WM, int WN, int LAYOUT>
__device__ __forceinline__ void warp_mma_planes(float (&acc)[MT][NT][4], const float* A_big, const float* A_small,
                                                const float* B_big, const float* B_small, int wm, int wn, int lane) {
    constexpr int LDA = LAYOUT == TILE_XOR_A ? BK : LD;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 8) {
        unsigned ab[MT][4], bb[NT][2], as[MT][4], bs[NT][2];
        ldmatrix_fragments<float, MT, NT, LD, WM, WN, LAYOUT, LDA>(ab, bb, A_big, B_big, kk, wm, wn, lane);
        ldmatrix_fragments<float, MT, NT, LD, WM, WN, LAYOUT, LDA>(as, bs, A_small, B_small, kk, wm, wn, lane);
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
                mma_3xtf32(acc[i][j], as[i], ab[i], ab[i], bb[j][0], bb[j][1], bs[j][0], bs[j][1], bb[j][0], bb[j][1]);
    }
}

// The entries of a plan over (segment j, tap t, position p = b*Q + q), e = (j * K + t) * BQ + p,
// for a batch chunk of `batch` samples and segments of seg_len channels (one offset group and one
// mask group each), and the decoding of one entry.
template <typename I, int N>
struct PlanEntries {
    I Q, S, BQ, total;
    int K, seg_len, per_go, per_gm, channels;

    __device__ __forceinline__ PlanEntries(const Geom<N>& g, int batch, int channels_, bool offset,
                                           int offset_groups, bool mask, int mask_groups, int seg_len_,
                                           int segments)
        : seg_len(seg_len_), channels(channels_) {
        Q = dcn::prod_size<N, I>(g.out_size);
        S = dcn::prod_size<N, I>(g.in_size);
        K = (int)dcn::prod_size<N, I>(g.ksize);
        BQ = (I)batch * Q;
        per_go = offset ? channels / offset_groups : channels;
        per_gm = mask ? channels / mask_groups : channels;
        total = BQ * K * segments;
    }

    // Entry e: its sample b, position q (coordinates qc), tap t, and its segment's offset group
    // go and mask group gm.
    __device__ __forceinline__ void decode(I e, const Geom<N>& g, I& b, I& q, int (&qc)[N], int& t, int& go,
                                           int& gm) const {
        const I p = e % BQ;
        const I jt = e / BQ;
        t = (int)(jt % K);
        const int c0 = (int)(jt / K) * seg_len;
        b = p / Q;
        q = p % Q;
        dcn::unravel<N, I>(q, g.out_size, qc);
        go = per_go >= channels ? 0 : c0 / per_go;
        gm = per_gm >= channels ? 0 : c0 / per_gm;
    }
};

}  // namespace fused

// x (B, C, S), sample stride `x_bstride` -> xcl (B, S, Cp), channels >= C zero, followed by
// one row of Cp zeros (the "zero row", row B*S: what the forward reads for a corner it does not
// use, so that its loads need no branch). A 64x64 (channel x position) tile through shared
// memory per block iteration (256 threads): fused_channels_last moves one element per thread
// each way (32 x 8 threads); fused_channels_last_vectors, where every 16-byte vector of
// positions of x lies whole within a channel (S, x_bstride, Cp and Pp multiples of a vector,
// aligned pointers; else it too moves elements), 16-byte vectors both ways: in along positions,
// out along channels, the tile's rows swizzled by 16-byte chunk so that a warp's gather of a
// vector of channels hits distinct banks (fp16; two ways in float32).
// The fused backward's copy of grad_output may also give (each where its pointer is not null):
// - `sums`, the bias gradient's part: each tile's per-channel sums, sums[c * rows + b * s_tiles
//   + st] for c < C, rows = B * s_tiles, added in an order fixed by the tile (each thread its 8
//   positions in order, then the 8 threads of a channel in order), whatever the grid or path;
//   fused_channel_totals adds them;
// - `xr`, the weight gradient's rows (fused_position_rows' gyr): xr[c * Pp + b * S + s] for c < C,
//   zero from B*S to Pp.
// TF32 (float32): xcl's values rounded to TF32 (cvt.rna, as warp_mma rounds a fragment), so that
// the TF32 data kernel's MMAs take its operand tiles as they are; `sums` and `xr` keep the values.
// SPLIT (float32, strict: 3xTF32): xcl's rows 2 * Cp long, split_tf32's big parts of the values
// in the first Cp and their small parts in the second (what fused_split_planes made of a copy in
// a pass of its own), the zero row 2 * Cp zeros.
// `early` (programmatic dependent launch): the copy reads only what was ready before the kernel
// before it started and writes what no kernel since then touches (a backward's leading copies of
// its inputs), so it runs beside that kernel and waits for it only before it exits (its
// completion still implies that kernel's). H200, f+b: 2D transposed strict float32 and 3D
// transposed TF32 1% faster, B=8 C256 fp16 0.3%; 3D transposed strict float32 0.8% slower
// (NOTES-gpu.md, session 49).
template <typename T, typename I, bool VECTORS, bool TF32 = false, bool SPLIT = false>
__device__ __forceinline__ void
channels_last_copy(const T* __restrict__ x, T* __restrict__ xcl, const int batch, const int channels,
                   const int Cp, const I S, const I x_bstride, typename Traits<T>::acc* __restrict__ sums,
                   T* __restrict__ xr, const I Pp, const int early) {
    typedef typename Traits<T>::acc A;
    constexpr int TILE = 64;
    constexpr int VEC = sizeof(T) <= 4 ? 16 / (int)sizeof(T) : 1;   // elements of a 16-byte vector
    constexpr int CHUNKS = TILE / VEC;                                // 16-byte chunks of a tile row
    // element path: tile[c][s] at c * (TILE + 1) + s; vector path: at c * TILE + swizzled(c, s)
    __shared__ __align__(16) T tile[TILE * (TILE + 1)];
    __shared__ A part[8][TILE];
    const I s_tiles = (S + TILE - 1) / TILE;
    const int c_tiles = (Cp + TILE - 1) / TILE;
    const I blocks = (I)batch * c_tiles * s_tiles;
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;   // 256 threads: 32 x 8
    const int row = SPLIT ? 2 * Cp : Cp;                      // xcl's row length
    const auto aligned = [](const void* p) { return ((unsigned long long)p & 15) == 0; };
    const bool vectors = VECTORS && VEC > 1 && S % VEC == 0 && x_bstride % VEC == 0 && Cp % VEC == 0 && aligned(x)
                         && aligned(xcl) && (xr == nullptr || (Pp % VEC == 0 && aligned(xr)));
    // the vector path's element (channel row r, position p) of the tile: chunk p / VEC of row r
    // at chunk (p / VEC) ^ (r / VEC) (a bijection of a row's chunks, r < TILE)
    const auto at = [](int r, int p) { return r * TILE + (((p / VEC) ^ (r / VEC)) % CHUNKS) * VEC + p % VEC; };
    fused::launch_dependents();
    if (!early) fused::wait_prerequisites();
    for (I blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
        const I st = blk % s_tiles;
        const I rest = blk / s_tiles;
        const int ct = (int)(rest % c_tiles);
        const int b = (int)(rest / c_tiles);
        const I s0 = st * TILE;
        const int c0 = ct * TILE;
        const T* src = x + (I)b * x_bstride;
        if (vectors) {
            // read: a warp's threads along the vectors of consecutive channels' rows (coalesced in x)
#pragma unroll
            for (int i = 0; i < TILE * CHUNKS / 256; ++i) {
                const int e = (int)threadIdx.x + i * 256;
                const int r = e / CHUNKS, k = e % CHUNKS;
                const int c = c0 + r;
                const I s = s0 + k * VEC;
                uint4 v = make_uint4(0u, 0u, 0u, 0u);
                if (c < channels && s < S) {   // (s < S: the whole vector, S a multiple of VEC)
                    v = *reinterpret_cast<const uint4*>(src + (I)c * S + s);
                    if (xr != nullptr) *reinterpret_cast<uint4*>(xr + (I)c * Pp + (I)b * S + s) = v;
                }
                *reinterpret_cast<uint4*>(tile + at(r, k * VEC)) = v;
            }
            __syncthreads();
            // write: a warp's threads along the channel vectors of consecutive positions (coalesced in xcl)
#pragma unroll
            for (int i = 0; i < TILE * CHUNKS / 256; ++i) {
                const int e = (int)threadIdx.x + i * 256;
                const int p = e / CHUNKS, q = e % CHUNKS;
                const I s = s0 + p;
                const int c = c0 + q * VEC;
                if (s < S && c < Cp) {
                    // the vector's 4 words from its VEC channels' bits (half types: two per word)
                    unsigned w[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        if constexpr (VEC == 8) {
                            const unsigned short* bits = reinterpret_cast<const unsigned short*>(tile);
                            w[j] = bits[at(q * VEC + 2 * j, p)] | (unsigned)bits[at(q * VEC + 2 * j + 1, p)] << 16;
                        } else {
                            w[j] = reinterpret_cast<const unsigned*>(tile)[at(q * VEC + j, p)];
                            if constexpr (TF32) w[j] = fused::to_tf32(__uint_as_float(w[j]));
                        }
                    }
                    T* const to = xcl + ((I)b * S + s) * row + c;
                    if constexpr (SPLIT) {
                        uint4 big, small;
                        fused::split_tf32(make_uint4(w[0], w[1], w[2], w[3]), big, small);
                        *reinterpret_cast<uint4*>(to) = big;
                        *reinterpret_cast<uint4*>(to + Cp) = small;
                    } else {
                        *reinterpret_cast<uint4*>(to) = make_uint4(w[0], w[1], w[2], w[3]);
                    }
                }
            }
            if (sums != nullptr) {   // the element path's order, from the tile
                A sum[TILE / 32] = {};
#pragma unroll
                for (int r = ty; r < TILE; r += 8) {
#pragma unroll
                    for (int h = 0; h < TILE; h += 32) sum[h / 32] += Traits<T>::load(tile[at(tx + h, r)]);
                }
#pragma unroll
                for (int h = 0; h < TILE; h += 32) part[ty][tx + h] = sum[h / 32];
            }
        } else {
            T (*rows)[TILE + 1] = reinterpret_cast<T (*)[TILE + 1]>(tile);
            // read: threadIdx.x along positions (coalesced in x)
#pragma unroll
            for (int r = ty; r < TILE; r += 8) {
                const int c = c0 + r;
#pragma unroll
                for (int h = 0; h < TILE; h += 32) {
                    const I s = s0 + tx + h;
                    const bool inside = c < channels && s < S;
                    const T v = inside ? src[(I)c * S + s] : Traits<T>::store(0.0f);
                    rows[r][tx + h] = v;
                    if (xr != nullptr && inside) xr[(I)c * Pp + (I)b * S + s] = v;
                }
            }
            __syncthreads();
            // write: threadIdx.x along channels (coalesced in xcl)
            A sum[TILE / 32] = {};
#pragma unroll
            for (int r = ty; r < TILE; r += 8) {
                const I s = s0 + r;
#pragma unroll
                for (int h = 0; h < TILE; h += 32) {
                    const int c = c0 + tx + h;
                    const T v = rows[tx + h][r];
                    if (s < S && c < Cp) {
                        T* const to = xcl + ((I)b * S + s) * row + c;
                        if constexpr (SPLIT) {
                            unsigned big, small;
                            fused::split_tf32(Traits<T>::load(v), big, small);
                            to[0] = __uint_as_float(big);
                            to[Cp] = __uint_as_float(small);
                        } else {
                            *to = TF32 ? maybe_tf32(v, 1) : v;
                        }
                    }
                    sum[h / 32] += Traits<T>::load(v);   // zero past S and C
                }
            }
            if (sums != nullptr) {
#pragma unroll
                for (int h = 0; h < TILE; h += 32) part[ty][tx + h] = sum[h / 32];
            }
        }
        __syncthreads();
        if (sums != nullptr && threadIdx.x < TILE && c0 + (int)threadIdx.x < channels) {
            A total = part[0][threadIdx.x];
#pragma unroll
            for (int k = 1; k < 8; ++k) total += part[k][threadIdx.x];
            sums[(I)(c0 + threadIdx.x) * batch * s_tiles + (I)b * s_tiles + st] = total;
        }
    }
    if (blockIdx.x == 0) {
        for (int c = ty * 32 + tx; c < row; c += 32 * 8) xcl[(I)batch * S * row + c] = Traits<T>::store(0.0f);
        if (xr != nullptr) {
            const I pad = Pp - (I)batch * S;
            for (I e = threadIdx.x; e < (I)channels * pad; e += blockDim.x)
                xr[(e / pad) * Pp + (I)batch * S + e % pad] = Traits<T>::store(0.0f);
        }
    }
    if (early) fused::wait_prerequisites();
}

template <typename T, typename I>
__global__ void
fused_channels_last(const T* __restrict__ x, T* __restrict__ xcl, const int batch, const int channels,
                    const int Cp, const I S, const I x_bstride, typename Traits<T>::acc* __restrict__ sums,
                    T* __restrict__ xr, const I Pp, const int early) {
    channels_last_copy<T, I, false>(x, xcl, batch, channels, Cp, S, x_bstride, sums, xr, Pp, early);
}

// Experiment switch: blocks of fused_channels_last_vectors an SM must hold (its registers:
// unbounded, ptxas took 116-128 for the loads in flight; 4 gives 61-64, no spills).
#ifndef DCN_LAYOUT_MIN_BLOCKS
#define DCN_LAYOUT_MIN_BLOCKS 4
#endif
template <typename T, typename I>
__global__ void __launch_bounds__(256, DCN_LAYOUT_MIN_BLOCKS)
fused_channels_last_vectors(const T* __restrict__ x, T* __restrict__ xcl, const int batch, const int channels,
                            const int Cp, const I S, const I x_bstride, typename Traits<T>::acc* __restrict__ sums,
                            T* __restrict__ xr, const I Pp, const int early) {
    channels_last_copy<T, I, true>(x, xcl, batch, channels, Cp, S, x_bstride, sums, xr, Pp, early);
}

// The bias gradient from fused_channels_last's tile sums of a batch chunk: v = the sum of
// sums[c * rows + r] over r, one block of TOTALS_THREADS a channel (each thread its rows r =
// threadIdx.x + k * TOTALS_THREADS in order, then a fixed tree), plus acc[c] after the first
// chunk (`first` = 0); at the last chunk dst[c] = v, else acc[c] = v. The order is fixed by the
// shape and the chunks, so the bits repeat.
constexpr int TOTALS_THREADS = 256;
template <typename T, typename I>
__global__ void fused_channel_totals(const typename Traits<T>::acc* __restrict__ sums,
                                     typename Traits<T>::acc* __restrict__ acc, T* __restrict__ dst, const I rows,
                                     const int first, const int last) {
    typedef typename Traits<T>::acc A;
    __shared__ A part[TOTALS_THREADS];
    fused::start_after_prerequisites();
    const I c = blockIdx.x;
    A s = 0;
    for (I r = threadIdx.x; r < rows; r += TOTALS_THREADS) s += sums[c * rows + r];
    part[threadIdx.x] = s;
    __syncthreads();
#pragma unroll
    for (int h = TOTALS_THREADS / 2; h > 0; h >>= 1) {
        if ((int)threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const A v = first ? part[0] : acc[c] + part[0];
        if (last) dst[c] = Traits<T>::store(v);
        else acc[c] = v;
    }
}

// The sampling plan of a batch chunk, read by the fused forward and weight gradient in place of
// computing corners in every block (and every thread of a position) that samples a position:
// rows[e][c] and weights[e][c], e = (j * K + t) * B*Q + p, for each segment j of seg_len
// channels (one offset group and one mask group: seg_len divides C/G_o and C/G_m), tap t and
// position p = b*Q + q; exactly fused::Sampler's corners (the zero row after the input's rows
// for a corner not read, weight 0). One thread per entry, positions fastest.
template <typename T, typename I, int N>
__global__ void fused_sampling_plan(const T* __restrict__ offset, const T* __restrict__ mask, I* __restrict__ rows,
                                    float* __restrict__ weights, const Geom<N> g, const int batch,
                                    const int channels, const int offset_groups, const int mask_groups,
                                    const int seg_len, const int segments, const I offset_bstride,
                                    const I mask_bstride) {
    constexpr int NC = 1 << N;
    const fused::PlanEntries<I, N> pe(g, batch, channels, offset != nullptr, offset_groups, mask != nullptr,
                                      mask_groups, seg_len, segments);
    const I zero_row = (I)batch * pe.S;
    fused::start_after_prerequisites();
    for (I e = dcn::global_thread_index<I>(); e < pe.total; e += dcn::global_thread_stride<I>()) {
        I b, q;
        int qc[N], t, go, gm;
        pe.decode(e, g, b, q, qc, t, go, gm);
        fused::Sampler<I, N> smp;
        smp.reset();
        smp.update(t, go, gm, true, g, qc, offset == nullptr ? nullptr : offset + b * offset_bstride + q,
                   mask == nullptr ? nullptr : mask + b * mask_bstride + q, pe.K, pe.Q, b * pe.S);
        I row[NC];
#pragma unroll
        for (int c = 0; c < NC; ++c) row[c] = smp.row[c] >= 0 ? smp.row[c] : zero_row;
        fused::store_words(rows + e * NC, row);
        fused::store_words(weights + e * NC, smp.weight);
    }
}
