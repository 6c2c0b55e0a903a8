// dcn_cupy: "direct" deformable convolution kernels for small problems (cuda/direct).
//
// One launch per primitive part, no workspace, no GEMM: each output element is computed by a
// few adjacent threads of one warp (a whole warp for the weight gradient) that split its
// reduction and add their parts with a fixed butterfly of shuffles. For small
// problems the host time of the im2col path's launches (im2col + cuBLAS + layout; backward:
// six launches, two GEMMs and two memsets) dominates; here a forward is one launch, a
// backward at most two (the input gradient's fill with the weight and bias gradients, then the
// data gradients).
//
// Layouts as in deform_conv.cu (the whole batch at once; Q = prod(out_size), S = prod(in_size),
// K = prod(k)):
//   x (B, C, *S), weight (C_out, C/G, *k), offset (B, G_o*K*N, *Q), mask (B, G_m*K, *Q),
//   y / grad_output (B, C_out, *Q).
// Template parameters: T storage type (float, double), I index type (int or long long), N
// spatial dims. Arithmetic type A = Traits<T>::acc (T itself for float and double).
//
// Semantics are those of deform_im2col + GEMM (forward, weight gradient),
// deform_col2im_tiled (input gradient) and deform_backward_grouped (offset and mask
// gradients): the same corner rules (dcn::locate / dcn::corner / dcn::Corners: positions
// outside [-1, S_a) or non-finite sample 0, zero-weight corners are never read, torchvision's
// offset derivative at -1), only the order of the floating-point sums differs.

#include "dcn_common.cuh"

using dcn::Geom;
using dcn::Traits;

namespace direct {

// The corners of one sampling position that contribute to a sample (on the grid, non-zero
// weight): what dcn::sample_plane reads, computed once and reused for every channel sampled at
// that position (the channels of one offset group).
template <typename A, typename I, int N>
struct SampleCorners {
    static const int NC = 1 << N;
    bool use[NC];
    I index[NC];
    A weight[NC];

    __device__ __forceinline__ void compute(const A (&pos)[N], const int (&size)[N]) {
        int lo[N];
        A frac[N];
        const bool valid = dcn::locate<A, N>(pos, size, lo, frac);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            int coord[N];
            A w = A(0);
            use[c] = valid && dcn::corner<A, N>(c, lo, frac, size, coord, w);
            index[c] = use[c] ? dcn::flat_index<N, I>(coord, size) : (I)0;
            weight[c] = use[c] ? w : A(0);
        }
    }

    // dcn::sample_plane of this position (same corners, same order of the sum).
    template <typename T>
    __device__ __forceinline__ A sample(const T* __restrict__ plane) const {
        A acc = A(0);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            if (use[c]) acc += weight[c] * Traits<T>::load(plane[index[c]]);
        }
        return acc;
    }
};

}  // namespace direct

// y[b, co, q] = bias[co] + sum_t sum_{c in group(co)} w[co, c - c0, t] * mask[b, gm(c), t, q]
//               * sample(x[b, c], position(t, q) + offset[b, go(c), t, :, q])
// `lanes` (a power of two <= 32) adjacent threads per output element (b, co, q) (q next fastest:
// a warp shares (b, co), so weight loads are broadcasts and offset/mask loads coalesce); lane r
// takes the taps t = r (mod lanes), channels inner, then a fixed butterfly sums the lanes
// (deterministic). A tap's position and corners are computed once per run of channels of one
// offset and mask group. Threads past the end mirror the last element (the warp stays whole for
// the shuffles) and store nothing.
template <typename T, typename I, int N>
__global__ void direct_forward(const T* __restrict__ x, const T* __restrict__ weight,
                               const T* __restrict__ offset, const T* __restrict__ mask,
                               const T* __restrict__ bias, T* __restrict__ y, const Geom<N> g,
                               const int batch, const int channels, const int out_channels,
                               const int groups, const int offset_groups, const int mask_groups,
                               const int lanes) {
    typedef typename Traits<T>::acc A;
    const I Q = dcn::prod_size<N, I>(g.out_size);
    const I S = dcn::prod_size<N, I>(g.in_size);
    const int K = (int)dcn::prod_size<N, I>(g.ksize);
    const int Cg = channels / groups;
    const int Cog = out_channels / groups;
    const int per_og = offset != nullptr ? channels / offset_groups : channels;
    const int per_mg = mask != nullptr ? channels / mask_groups : channels;
    const I outputs = (I)batch * out_channels * Q;
    const I total = outputs * lanes;
    const int lane = threadIdx.x & 31;
    const int r = lane & (lanes - 1);
    // the loop condition is that of the warp's first thread: every lane runs every shuffle
    for (I idx = dcn::global_thread_index<I>(); idx - lane < total; idx += dcn::global_thread_stride<I>()) {
        const bool active = idx < total;
        const I o = active ? idx / lanes : outputs - 1;
        const I q = o % Q;
        const I rest = o / Q;
        const int co = (int)(rest % out_channels);
        const int b = (int)(rest / out_channels);
        int qc[N];
        dcn::unravel<N, I>(q, g.out_size, qc);
        const int c0 = (co / Cog) * Cg;
        const int c1 = c0 + Cg;
        const T* wrow = weight + (I)co * Cg * K;
        A acc = A(0);
        for (int t = r; t < K; t += lanes) {
            int tc[N];
            dcn::unravel<N, I>((I)t, g.ksize, tc);
            int c = c0;
            while (c < c1) {
                const int go = c / per_og;
                const int gm = c / per_mg;
                const int run_end = min(c1, min((go + 1) * per_og, (gm + 1) * per_mg));
                const T* off = offset == nullptr ? nullptr
                    : offset + (((I)b * offset_groups + go) * K + t) * (I)N * Q + q;
                A pos[N];
                dcn::tap_position<T, A, I, N>(g, qc, tc, off, Q, pos);
                direct::SampleCorners<A, I, N> sc;
                sc.compute(pos, g.in_size);
                const A m = mask != nullptr ? Traits<T>::load(mask[(((I)b * mask_groups + gm) * K + t) * Q + q])
                                            : A(1);   // v * 1 == v exactly (inf and NaN included)
                const T* xc = x + ((I)b * channels + c) * S;
                const T* wc = wrow + (I)(c - c0) * K + t;
                const int n = run_end - c;
#pragma unroll 4
                for (int i = 0; i < n; ++i) {
                    const A v = sc.sample(xc + (I)i * S) * m;
                    acc += Traits<T>::load(wc[(I)i * K]) * v;
                }
                c = run_end;
            }
        }
        for (int s = lanes >> 1; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
        if (active && r == 0) {
            if (bias != nullptr) acc += Traits<T>::load(bias[co]);
            y[o] = Traits<T>::store(acc);
        }
    }
}

// The data gradients: `lanes` adjacent threads per (b, t, q) (q next fastest) sweep the input
// channels in chunks of `lanes` (lane r takes channel chunk + r; `lanes` divides the channel
// runs of the offset and of the mask groups, so a chunk never straddles a group). Per channel:
// cg = sum over the output channels co of c's conv group of w[co, c - c0, t] * grad_y[b, co, q]
// (the column gradient of the im2col path), then
//   WANT_X:      grad_x[b, c, corner] += corner weight * cg * mask   (atomics, after the fill)
//   WANT_OFFSET: grad_offset[b, go, t, a, q] = sum_{c in go} cg * mask * d sample / d P_a
//   WANT_MASK:   grad_mask[b, gm, t, q]      = sum_{c in gm} cg * sample
// Offset and mask groups are contiguous channel ranges: when a group's run ends, its lanes'
// sums are added by a fixed butterfly and lane 0 stores them (plain stores: deterministic, no
// zeroing needed). The position and corners of a tap are computed once per offset group.
// Threads past the end mirror the last element (the warp stays whole for the shuffles) and
// write nothing.
template <typename T, typename I, int N, bool WANT_X, bool WANT_OFFSET, bool WANT_MASK>
__global__ void direct_backward_data(const T* __restrict__ grad_y, const T* __restrict__ x,
                                     const T* __restrict__ weight, const T* __restrict__ offset,
                                     const T* __restrict__ mask, T* __restrict__ grad_x,
                                     T* __restrict__ grad_offset, T* __restrict__ grad_mask,
                                     const Geom<N> g, const int batch, const int channels,
                                     const int out_channels, const int groups,
                                     const int offset_groups, const int mask_groups, const int lanes) {
    typedef typename Traits<T>::acc A;
    constexpr bool GEOMETRY = WANT_OFFSET || WANT_MASK;   // needs samples and their derivatives
    const I Q = dcn::prod_size<N, I>(g.out_size);
    const I S = dcn::prod_size<N, I>(g.in_size);
    const int K = (int)dcn::prod_size<N, I>(g.ksize);
    const int Cg = channels / groups;
    const int Cog = out_channels / groups;
    const int per_og = offset != nullptr ? channels / offset_groups : channels;
    const int per_mg = mask != nullptr ? channels / mask_groups : channels;
    const I items = (I)batch * K * Q;
    const I total = items * lanes;
    const int lane = threadIdx.x & 31;
    const int r = lane & (lanes - 1);
    for (I idx = dcn::global_thread_index<I>(); idx - lane < total; idx += dcn::global_thread_stride<I>()) {
        const bool active = idx < total;
        const I item = active ? idx / lanes : items - 1;
        const I q = item % Q;
        const I rest = item / Q;
        const int t = (int)(rest % K);
        const int b = (int)(rest / K);
        int qc[N], tc[N];
        dcn::unravel<N, I>(q, g.out_size, qc);
        dcn::unravel<N, I>((I)t, g.ksize, tc);
        const T* gy = grad_y + (I)b * out_channels * Q + q;

        direct::SampleCorners<A, I, N> sc;   // WANT_X without the offset/mask gradients
        dcn::Corners<A, I, N> cr;            // with them (weights, slopes)
        A goff[N];
#pragma unroll
        for (int a = 0; a < N; ++a) goff[a] = A(0);
        A gmask = A(0);
        int current_go = -1, current_gm = -1;
        A m = A(1);
        for (int chunk = 0; chunk < channels; chunk += lanes) {
            const int c = chunk + r;
            const int go = c / per_og;    // the same for every lane of the chunk
            const int gm = c / per_mg;
            if (go != current_go) {
                current_go = go;
                const T* off = offset == nullptr ? nullptr
                    : offset + (((I)b * offset_groups + go) * K + t) * (I)N * Q + q;
                A pos[N];
                dcn::tap_position<T, A, I, N>(g, qc, tc, off, Q, pos);
                if (GEOMETRY) {
                    cr.compute(pos, g.in_size);
                } else {
                    sc.compute(pos, g.in_size);
                }
            }
            if (mask != nullptr && gm != current_gm) {
                current_gm = gm;
                m = Traits<T>::load(mask[(((I)b * mask_groups + gm) * K + t) * Q + q]);
            }
            if (WANT_X || !GEOMETRY || cr.valid) {
                // the column gradient of (c, t) at (b, q)
                const int grp = c / Cg;
                const T* wcol = weight + ((I)grp * Cog * Cg + (c - grp * Cg)) * K + t;
                const T* gyg = gy + (I)grp * Cog * Q;
                A cg = A(0);
#pragma unroll 4
                for (int j = 0; j < Cog; ++j) {
                    cg += Traits<T>::load(wcol[(I)j * Cg * K]) * Traits<T>::load(gyg[(I)j * Q]);
                }
                if (WANT_X && active) {
                    A v = cg;
                    if (mask != nullptr) v *= m;
                    if (v != A(0)) {
                        T* plane = grad_x + ((I)b * channels + c) * S;
#pragma unroll
                        for (int k = 0; k < (1 << N); ++k) {
                            if (GEOMETRY) {
                                if (cr.ok[k] && cr.weight[k] != A(0)) {
                                    dcn::atomic_accumulate(plane + cr.index[k], cr.weight[k] * v);
                                }
                            } else if (sc.use[k]) {
                                dcn::atomic_accumulate(plane + sc.index[k], sc.weight[k] * v);
                            }
                        }
                    }
                }
                if (GEOMETRY && cr.valid) {
                    dcn::accumulate_position_gradients<WANT_OFFSET, WANT_MASK>(cr, x + ((I)b * channels + c) * S,
                                                                              cg, m, goff, gmask);
                }
            }
            // the end of a group's run of channels (the same chunk for the whole warp): sum the
            // lanes, store, start the next group
            const int next = chunk + lanes;
            const bool last = next >= channels;
            if (WANT_OFFSET && (last || next / per_og != go)) {
                T* out = grad_offset + (((I)b * offset_groups + go) * K + t) * (I)N * Q + q;
#pragma unroll
                for (int a = 0; a < N; ++a) {
                    A v = goff[a];
                    for (int s = lanes >> 1; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
                    if (active && r == 0) out[(I)a * Q] = Traits<T>::store(v);
                    goff[a] = A(0);
                }
            }
            if (WANT_MASK && (last || next / per_mg != gm)) {
                A v = gmask;
                for (int s = lanes >> 1; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
                if (active && r == 0) grad_mask[(((I)b * mask_groups + gm) * K + t) * Q + q] = Traits<T>::store(v);
                gmask = A(0);
            }
        }
    }
}

// The parameter gradients and the input gradient's fill, in one launch (the data kernel, which
// scatters into grad_x, is launched after it):
//   fill (grad_x, when not null): grad_x[b, c, s] = fill_bias[c] (0 where fill_bias is null: the
//     transposed convolution's bias), a grid-stride loop over all B * C * S elements;
//   grad_w (when not null): grad_w[co, c - c0, t] = sum over b, q of grad_y[b, co, q]
//     * mask[b, gm(c), t, q] * sample(x[b, c], position(t, q) + offset[b, go(c), t, :, q]);
//   grad_bias (when not null): grad_bias[co] = sum over b, q of grad_y[b, co, q].
// One warp per weight or bias element (grid-stride over warps; blockDim a multiple of 32): lane l
// sums the positions p = b*Q + q with p = l (mod 32) in order, then a fixed butterfly reduction:
// deterministic, and the lanes' loads of grad_y, offset and mask coalesce.
template <typename T, typename I, int N>
__global__ void direct_backward_params(const T* __restrict__ grad_y, const T* __restrict__ x,
                                       const T* __restrict__ offset, const T* __restrict__ mask,
                                       T* __restrict__ grad_w, T* __restrict__ grad_bias,
                                       const T* __restrict__ fill_bias, T* __restrict__ grad_x,
                                       const Geom<N> g, const int batch,
                                       const int channels, const int out_channels, const int groups,
                                       const int offset_groups, const int mask_groups) {
    typedef typename Traits<T>::acc A;
    const I Q = dcn::prod_size<N, I>(g.out_size);
    const I S = dcn::prod_size<N, I>(g.in_size);
    if (grad_x != nullptr) {
        const I total = (I)batch * channels * S;
        for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
            const A v = fill_bias != nullptr ? Traits<T>::load(fill_bias[(int)((idx / S) % channels)]) : A(0);
            grad_x[idx] = Traits<T>::store(v);
        }
    }
    const int K = (int)dcn::prod_size<N, I>(g.ksize);
    const int Cg = channels / groups;
    const int Cog = out_channels / groups;
    const I weights = grad_w != nullptr ? (I)out_channels * Cg * K : (I)0;
    const I elements = weights + (grad_bias != nullptr ? out_channels : 0);
    const I BQ = (I)batch * Q;
    const int lane = threadIdx.x & 31;
    const I warp_stride = dcn::global_thread_stride<I>() / 32;
    for (I e = dcn::global_thread_index<I>() / 32; e < elements; e += warp_stride) {
        A acc = A(0);
        if (e >= weights) {  // a bias element
            const int co = (int)(e - weights);
            for (I p = lane; p < BQ; p += 32) {
                const I q = p % Q;
                const int b = (int)(p / Q);
                acc += Traits<T>::load(grad_y[((I)b * out_channels + co) * Q + q]);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0) grad_bias[co] = Traits<T>::store(acc);
            continue;
        }
        const int t = (int)(e % K);
        const I rest = e / K;
        const int cl = (int)(rest % Cg);
        const int co = (int)(rest / Cg);
        const int c = (co / Cog) * Cg + cl;
        const int go = offset != nullptr ? c / (channels / offset_groups) : 0;
        const int gm = mask != nullptr ? c / (channels / mask_groups) : 0;
        int tc[N];
        dcn::unravel<N, I>((I)t, g.ksize, tc);
        for (I p = lane; p < BQ; p += 32) {
            const I q = p % Q;
            const int b = (int)(p / Q);
            int qc[N];
            dcn::unravel<N, I>(q, g.out_size, qc);
            const T* off = offset == nullptr ? nullptr
                : offset + (((I)b * offset_groups + go) * K + t) * (I)N * Q + q;
            A pos[N];
            dcn::tap_position<T, A, I, N>(g, qc, tc, off, Q, pos);
            A v = dcn::sample_plane<T, A, I, N>(x + ((I)b * channels + c) * S, pos, g.in_size);
            if (mask != nullptr) v *= Traits<T>::load(mask[(((I)b * mask_groups + gm) * K + t) * Q + q]);
            acc += Traits<T>::load(grad_y[((I)b * out_channels + co) * Q + q]) * v;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) grad_w[e] = Traits<T>::store(acc);
    }
}
