// dcn_cupy: the deterministic input-gradient scatter (deterministic=True plans).
//
// The deformable col2im adds, for every (sample b, channel c), contributions
//     v = w_corner * mask * column_grads[c*K + t, b*Q + q]
// to grad_x[b, c, corner]. Floating-point atomics add them in a different order on every run,
// so the rounding changes. Here every contribution is turned into a 64-bit fixed-point integer
// first, llrint(v * 2^E_b), and added with integer atomics, which are exactly associative: the
// sum is the same whatever the order, the grid, the block or the tile. A finalize kernel turns
// the integers back (sum * 2^-E_b, + bias for the transposed convolution's forward).
//
// The exponent E_b of sample b, the bounds it follows from and the non-finite flags:
// fixed_point.cuh.
//
// Layouts: accumulators (Bc, C, S) as 64-bit integers; flags 2 bits per element (16 per word);
// bounds: one weight bound, then per sample of the chunk the grad_output bound, then the mask
// bound.

#include "dcn_common.cuh"
#include "fixed_point.cuh"

using dcn::Geom;
using dcn::Traits;

namespace dcn_det {

// The fixed-point exponent E of sample b: bounds laid out as the weight's, then per sample of the
// chunk the grad_output's, then the mask's.
__device__ __forceinline__ int sample_exponent(const dcn_u64* __restrict__ weight_bound,
                                               const dcn_u64* __restrict__ sample_bounds, int bounds_batch,
                                               int b, int log2_count, int has_mask) {
    return exponent(weight_bound, sample_bounds + b, has_mask ? sample_bounds + bounds_batch + b : nullptr, log2_count);
}

}  // namespace dcn_det

// bound[0] = max over (g, j) of sum_o |W[g, o, j]| (finite entries), W seen as (G, Cog, Cg*K).
// A block takes 32 columns (g, j) at a time (lanes along j: coalesced); each column's rows in 8
// runs of out_per_group / 8, each summed in order by a warp (warp w: runs w, w + warps, ...),
// then the 8 runs added in order by warp 0. The orders do not depend on the launch: the bound is
// the same on every run and for every grid and block size (a multiple of 32 threads). One thread
// a column, as before, kept 18 blocks busy for 15 us on the B=8 C256 3x3 weight (H200, NOTES-gpu.md
// session 46). `bound` must be zero before the launch.
template <typename T, typename I>
__global__ void det_weight_bound(const T* __restrict__ weight, const int groups, const int out_per_group,
                                 const I cols, dcn_u64* __restrict__ bound) {
    constexpr int RUNS = 8;
    __shared__ double runs[RUNS][32];
    const I total = (I)groups * cols;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int run_rows = (out_per_group + RUNS - 1) / RUNS;
    double local = 0.0;
    for (I base = (I)blockIdx.x * 32; base < total; base += (I)gridDim.x * 32) {
        const I idx = base + lane;
        for (int run = warp; run < RUNS; run += warps) {
            double s = 0.0;
            if (idx < total) {
                const I g = idx / cols;
                const I j = idx % cols;
                const T* w = weight + g * out_per_group * cols + j;
                const int o1 = min((run + 1) * run_rows, out_per_group);
                for (int o = run * run_rows; o < o1; ++o) {
                    const double a = fabs((double)Traits<T>::load(w[(I)o * cols]));
                    if (isfinite(a)) s += a;
                }
            }
            runs[run][lane] = s;
        }
        __syncthreads();
        if (warp == 0) {
            double column = 0.0;
#pragma unroll
            for (int k = 0; k < RUNS; ++k) column += runs[k][lane];
            local = fmax(local, column);
        }
        __syncthreads();
    }
    local = dcn_det::block_max(local);
    if (threadIdx.x == 0) dcn_det::atomic_max_bound(bound, local);
}

// bounds[b] = max |a[b, :]| over the finite entries of each of `batch` samples of `per_sample`
// contiguous elements, `sample_stride` elements apart (any stride, 0 included). `bounds` must
// be zero before the launch. Grid: x over a sample's elements, y over the samples.
template <typename T, typename I>
__global__ void det_sample_bound(const T* __restrict__ a, const I per_sample, const long long sample_stride,
                                 const int batch, dcn_u64* __restrict__ bounds) {
    for (int b = blockIdx.y; b < batch; b += gridDim.y) {
        const T* p = a + (long long)b * sample_stride;
        double local = 0.0;
        for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < per_sample; i += (I)blockDim.x * gridDim.x) {
            const double v = fabs((double)Traits<T>::load(p[i]));
            if (isfinite(v)) local = fmax(local, v);
        }
        local = dcn_det::block_max(local);
        if (threadIdx.x == 0) dcn_det::atomic_max_bound(bounds + b, local);
    }
}

// The fixed-point col2im: deform_col2im_tiled's walk (deform_conv.cu), with 64-bit integer
// accumulation in the shared-memory box and in global memory. acc (batch, C, S) and flags must
// be zero before the first chunk of a sample; corners of weight exactly 0 add nothing.
template <typename T, typename I, int N>
__global__ void det_col2im(const typename Traits<T>::acc* __restrict__ column_grads,
                           const T* __restrict__ offset, const T* __restrict__ mask,
                           dcn_u64* __restrict__ acc, unsigned* __restrict__ flags,
                           const dcn_u64* __restrict__ weight_bound, const dcn_u64* __restrict__ sample_bounds,
                           const Geom<N> g, const int batch, const int channels, const int offset_groups,
                           const int mask_groups, const int halo, const int cap, const int log2_count,
                           const int has_mask, const int bounds_batch) {
    typedef typename Traits<T>::acc A;
    extern __shared__ __align__(16) unsigned char dcn_smem[];
    dcn_u64* box = reinterpret_cast<dcn_u64*>(dcn_smem);
    const I Q = dcn::prod_size<N, I>(g.out_size);
    const I S = dcn::prod_size<N, I>(g.in_size);
    const int K = (int)dcn::prod_size<N, I>(g.ksize);
    const I BQ = (I)batch * Q;
    const I L = (I)blockDim.x;
    const I tiles = (Q + L - 1) / L;
    const I blocks = tiles * channels * batch;
    for (I blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
        const I tile = blk % tiles;
        const I rest = blk / tiles;
        const int c = (int)(rest % channels);
        const int b = (int)(rest / channels);
        const int E = dcn_det::sample_exponent(weight_bound, sample_bounds, bounds_batch, b, log2_count, has_mask);
        const I q_first = tile * L;
        const I q_last = min(Q, q_first + L) - 1;
        dcn::TileBox<N, I> tb;
        tb.compute(g, q_first, q_last, halo);
        const bool use_box = tb.volume > 0 && tb.volume <= (I)cap;
        const long long plane = ((long long)b * channels + c) * (long long)S;
        if (use_box) {
            for (I e = threadIdx.x; e < tb.volume; e += L) box[e] = 0ull;
        }
        __syncthreads();
        const I q = q_first + threadIdx.x;
        if (q <= q_last) {
            int qc[N];
            dcn::unravel<N, I>(q, g.out_size, qc);
            const T *off, *msk;
            dcn::channel_rows<T, I, N>(offset, mask, b, c, channels, offset_groups, mask_groups, K, Q, q, off, msk);
            const A* col = column_grads + (I)c * K * BQ + (I)b * Q + q;
            int tc[N];
#pragma unroll
            for (int a = 0; a < N; ++a) tc[a] = 0;
            for (int t = 0; t < K; ++t) {
                A v = col[(I)t * BQ];
                if (msk != nullptr) v *= Traits<T>::load(msk[(I)t * Q]);
                if (v != A(0)) {
                    A pos[N];
                    dcn::tap_position<T, A, I, N>(g, qc, tc, off == nullptr ? nullptr : off + (I)t * N * Q, Q, pos);
                    int lo[N];
                    A frac[N];
                    if (dcn::locate<A, N>(pos, g.in_size, lo, frac)) {
#pragma unroll
                        for (int k = 0; k < (1 << N); ++k) {
                            int cc[N];
                            A w;
                            if (dcn::corner<A, N>(k, lo, frac, g.in_size, cc, w) && w != A(0)) {
                                const double contribution = (double)w * (double)v;  // exact for float
                                const I e = use_box ? tb.offset_of(cc) : (I)-1;
                                if (e >= 0 && isfinite(contribution)) {
                                    const long long r = llrint(ldexp(contribution, E));
                                    if (r != 0) atomicAdd(box + e, (dcn_u64)r);
                                } else {
                                    dcn_det::accumulate(acc, flags, plane + dcn::flat_index<N, I>(cc, g.in_size),
                                                        contribution, E);
                                }
                            }
                        }
                    }
                }
                dcn::next_tap<N>(tc, g.ksize);
            }
        }
        __syncthreads();
        if (use_box) {
            for (I e = threadIdx.x; e < tb.volume; e += L) {
                const dcn_u64 v = box[e];
                if (v != 0ull) atomicAdd(acc + plane + tb.grid_index(e, g.in_size), v);
            }
        }
        __syncthreads();
    }
}

// dst[b, c, s] = T(acc[b, c, s] * 2^-E_b (+ bias[c])), or the flagged non-finite value.
// acc may alias dst (float64: the output array holds the integers until here).
template <typename T, typename I>
__global__ void det_finalize(const dcn_u64* acc, const unsigned* __restrict__ flags,
                             const dcn_u64* __restrict__ weight_bound, const dcn_u64* __restrict__ sample_bounds,
                             const T* __restrict__ bias, T* dst, const int batch, const int channels, const I S,
                             const int log2_count, const int has_mask, const int bounds_batch) {
    typedef typename Traits<T>::acc A;
    const I total = (I)batch * channels * S;
    for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
        const I bc = idx / S;
        const int c = (int)(bc % channels);
        const int b = (int)(bc / channels);
        const int E = dcn_det::sample_exponent(weight_bound, sample_bounds, bounds_batch, b, log2_count, has_mask);
        double v = dcn_det::value(acc, flags, idx, E);
        if (bias != nullptr) v += (double)Traits<T>::load(bias[c]);
        dst[idx] = Traits<T>::store((A)v);
    }
}
