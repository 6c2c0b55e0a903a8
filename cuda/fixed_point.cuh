// dcn_cupy: 64-bit fixed-point accumulation, the deterministic scatters' arithmetic (the im2col
// one, deform_deterministic.cu, and the fused backward's, deform_fused_backward.cu).
//
// A contribution v to an element is added as the integer llrint(v * 2^E): integer addition is
// exactly associative, so the sum does not depend on the order of the atomics. E (per sample)
// follows from a bound on every contribution, computed on the device before the scatter:
//     |column gradient| <= max_{g,j} sum_o |W[g, o, j]| * max |grad_output[b]|,
//     |mask| <= max |mask[b]|,  |corner weight| <= 1,
// so the sum of the |contributions| to one element stays below 2^(e_w + e_g + e_m + L), where
// 2^e bounds each factor (frexp) and 2^L >= the number of (position, tap) pairs that can reach
// one element (Q*K with offsets, K without). E = 62 - (e_w + e_g + e_m + L) keeps every sum below
// 2^63 (one spare bit absorbs the GEMM's rounding). Non-finite values are left out of the bounds;
// a non-finite contribution sets sticky flags (+inf, -inf; both = NaN) of its element, which the
// conversion back applies, so non-finite results do not depend on the order either.
//
// Bounds are the bit patterns of non-negative doubles (ordered like unsigned integers, so
// atomicMax on them is exact and order-free); flags are 2 bits per element, 16 per word.
#pragma once

typedef unsigned long long dcn_u64;

namespace dcn_det {

// Max over the block of a non-negative value; the result is valid in thread 0.
__device__ __forceinline__ double block_max(double v) {
    __shared__ double partial[32];
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v = fmax(v, __shfl_down_sync(0xffffffffu, v, d));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        v = lane < warps ? partial[lane] : 0.0;
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) v = fmax(v, __shfl_down_sync(0xffffffffu, v, d));
    }
    __syncthreads();  // partial[] is reused by the next call
    return v;
}

__device__ __forceinline__ void atomic_max_bound(dcn_u64* slot, double v) {
    if (v > 0.0) atomicMax(slot, (dcn_u64)__double_as_longlong(v));
}

__device__ __forceinline__ int exponent_of(dcn_u64 bits) {
    int e;
    frexp(__longlong_as_double((long long)bits), &e);  // 0 for a bound of 0
    return e;
}

// The fixed-point exponent E of one sample from its bounds: the weight's, the sample's
// grad_output's and (null without a mask) its mask's. The same arithmetic in every scatter and
// in the conversion back.
__device__ __forceinline__ int exponent(const dcn_u64* __restrict__ weight_bound, const dcn_u64* __restrict__ gy_bound,
                                        const dcn_u64* __restrict__ mask_bound, int log2_count) {
    const int em = mask_bound != nullptr ? exponent_of(*mask_bound) : 1;  // frexp(1) = 0.5 * 2^1
    return 62 - (exponent_of(*weight_bound) + exponent_of(*gy_bound) + em + log2_count);
}

// Flag bits of a non-finite value: 1 = +inf, 2 = -inf, 3 = NaN.
__device__ __forceinline__ unsigned nonfinite_bits(double v) {
    return v != v ? 3u : (v > 0.0 ? 1u : 2u);
}

__device__ __forceinline__ void flag(unsigned* __restrict__ flags, long long e, double v) {
    atomicOr(flags + (e >> 4), nonfinite_bits(v) << (2 * (int)(e & 15)));
}

// Adds v * 2^E to acc[e], or flags e where v is not finite.
__device__ __forceinline__ void accumulate(dcn_u64* __restrict__ acc, unsigned* __restrict__ flags, long long e,
                                           double v, int E) {
    if (!isfinite(v)) {
        flag(flags, e, v);
        return;
    }
    const long long r = llrint(ldexp(v, E));
    if (r != 0) atomicAdd(acc + e, (dcn_u64)r);
}

// accumulate for a float32 contribution, the fused backward's: v is the product the default
// mode adds (so the deterministic sums are as accurate), scaled by ldexpf (exact; E may lie
// outside float's exponent range where v is small, as v * 2^E < 2^62) and rounded to an integer
// in float32 arithmetic: the same integer for the same inputs, so the sums stay order-free.
// (Double-precision arithmetic here cost 1-4% of the deterministic backward: H200, session 33.)
__device__ __forceinline__ void accumulate_float(dcn_u64* __restrict__ acc, unsigned* __restrict__ flags, long long e,
                                                 float v, int E) {
    if (!isfinite(v)) {
        flag(flags, e, (double)v);
        return;
    }
    const long long r = __float2ll_rn(ldexpf(v, E));
    if (r != 0) atomicAdd(acc + e, (dcn_u64)r);
}

// The value of a sum: bits * 2^-E, or the non-finite value its flag bits f say.
__device__ __forceinline__ double value_of(dcn_u64 bits, unsigned f, int E) {
    if (f == 3u) return __longlong_as_double(0x7ff8000000000000ll);  // NaN
    if (f != 0u) {
        return f == 1u ? __longlong_as_double(0x7ff0000000000000ll) : __longlong_as_double((long long)0xfff0000000000000ull);
    }
    return ldexp((double)(long long)bits, -E);
}

// The value of element e: acc[e] * 2^-E, or the non-finite value its flags say.
__device__ __forceinline__ double value(const dcn_u64* acc, const unsigned* __restrict__ flags, long long e, int E) {
    return value_of(acc[e], (flags[e >> 4] >> (2 * (int)(e & 15))) & 3u, E);
}

}  // namespace dcn_det
