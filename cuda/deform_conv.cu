// dcn_cupy: deformable convolution kernels (N-dimensional, any float type).
//
// Layouts (one batch chunk of Bc samples; Q = prod(out_size), S = prod(in_size), K = prod(k)):
//   x          (Bc, C, *S)                      storage type T
//   offset     (Bc, G_o*K*N, *Q)                channel (g*K + t)*N + a
//   mask       (Bc, G_m*K, *Q)                  channel g*K + t
//   columns    (C*K, Bc*Q)                      row c*K + t, column b*Q + q
// The GEMMs (cuBLAS, from Python) see the columns as (G, C/G*K, Bc*Q).
//
// Template parameters: T storage type, I index type (int or long long), N spatial dims.
// Arithmetic type A = Traits<T>::acc. Every kernel is a grid-stride loop over its outputs
// (deform_col2im_tiled: a block-stride loop over its (b, c, tile) blocks).
//
// Kernels: deform_im2col (forward and weight gradient), deform_col2im_tiled (input gradient),
// deform_backward_grouped (offset and mask gradients), and the layout/cast kernels
// batch_to_columns, columns_to_batch, finalize.

#include "dcn_common.cuh"

using dcn::Geom;
using dcn::Traits;

// columns[c*K + t, b*Q + q] = mask[b, gm(c), t, q] * sample(x[b, c], position(t, q))
// One thread per (c, b, q); taps in a loop (offsets of one tap are read once per thread).
template <typename T, typename I, int N>
__global__ void deform_im2col(const T* __restrict__ x, const T* __restrict__ offset,
                              const T* __restrict__ mask, T* __restrict__ columns,
                              const Geom<N> g, const int batch, const int channels,
                              const int offset_groups, const int mask_groups) {
    typedef typename Traits<T>::acc A;
    const I Q = dcn::prod_size<N, I>(g.out_size);
    const I S = dcn::prod_size<N, I>(g.in_size);
    const int K = (int)dcn::prod_size<N, I>(g.ksize);
    const I BQ = (I)batch * Q;
    const I total = (I)channels * BQ;
    for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
        const I q = idx % Q;
        const I bc = idx / Q;
        const int b = (int)(bc % batch);
        const int c = (int)(bc / batch);
        int qc[N];
        dcn::unravel<N, I>(q, g.out_size, qc);
        const T* plane = x + ((I)b * channels + c) * S;
        const T *off, *msk;
        dcn::channel_rows<T, I, N>(offset, mask, b, c, channels, offset_groups, mask_groups, K, Q, q, off, msk);
        T* col = columns + (I)c * K * BQ + (I)b * Q + q;
        int tc[N];
#pragma unroll
        for (int a = 0; a < N; ++a) tc[a] = 0;
        for (int t = 0; t < K; ++t) {
            A pos[N];
            dcn::tap_position<T, A, I, N>(g, qc, tc, off == nullptr ? nullptr : off + (I)t * N * Q, Q, pos);
            A v = dcn::sample_plane<T, A, I, N>(plane, pos, g.in_size);
            if (msk != nullptr) v *= Traits<T>::load(msk[(I)t * Q]);
            col[(I)t * BQ] = Traits<T>::store(v);
            dcn::next_tap<N>(tc, g.ksize);
        }
    }
}

// The adjoint of im2col: grad_x[b, c, corner] += weight * mask * column_grads[c*K + t, b*Q + q]
// (grad_x is float32 for float16/bfloat16/float32 and float64 for float64).
// One block per (b, c, tile of blockDim.x consecutive output positions). The channel's input
// box around the tile's sampling positions is staged in shared memory (`cap` elements of A at
// most; larger boxes use global memory directly): the block accumulates into it with
// shared-memory atomics and flushes it once, turning K*2^N global atomics per position into
// about one per box element; corners outside the box use global atomics.
template <typename T, typename I, int N>
__global__ void deform_col2im_tiled(const typename Traits<T>::acc* __restrict__ column_grads,
                                    const T* __restrict__ offset, const T* __restrict__ mask,
                                    typename Traits<T>::acc* __restrict__ grad_x, const Geom<N> g,
                                    const int batch, const int channels, const int offset_groups,
                                    const int mask_groups, const int halo, const int cap) {
    typedef typename Traits<T>::acc A;
    extern __shared__ __align__(16) unsigned char dcn_smem[];
    A* box = reinterpret_cast<A*>(dcn_smem);
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
        const I q_first = tile * L;
        const I q_last = min(Q, q_first + L) - 1;
        dcn::TileBox<N, I> tb;
        tb.compute(g, q_first, q_last, halo);
        const bool use_box = tb.volume > 0 && tb.volume <= (I)cap;
        A* plane = grad_x + ((I)b * channels + c) * S;
        if (use_box) {
            for (I e = threadIdx.x; e < tb.volume; e += L) box[e] = A(0);
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
                            if (dcn::corner<A, N>(k, lo, frac, g.in_size, cc, w)) {
                                const I e = use_box ? tb.offset_of(cc) : (I)-1;
                                if (e >= 0) {
                                    atomicAdd(box + e, w * v);
                                } else {
                                    dcn::atomic_accumulate(plane + dcn::flat_index<N, I>(cc, g.in_size), w * v);
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
                const A v = box[e];
                if (v != A(0)) dcn::atomic_accumulate(plane + tb.grid_index(e, g.in_size), v);
            }
        }
        __syncthreads();
    }
}

// Offset and mask gradients without atomics: one thread per (b, group, t, q) of the group
// partition `groups` (G_o when the offset gradient is wanted, else G_m; G_o == G_m when both
// are), summing over that group's channels
//   grad_offset[b, (go*K + t)*N + a, q] = sum_c cg * mask * d sample / d P_a
//   grad_mask[b, gm*K + t, q]           = sum_c cg * sample
// with cg = column_grads[c*K + t, b*Q + q]. Each channel samples at the position of ITS
// offset group and is weighted by ITS mask group, so G_o and G_m are independent.
template <typename T, typename I, int N, bool WANT_OFFSET, bool WANT_MASK>
__global__ void deform_backward_grouped(const typename Traits<T>::acc* __restrict__ column_grads,
                                        const T* __restrict__ x, const T* __restrict__ offset,
                                        const T* __restrict__ mask,
                                        T* __restrict__ grad_offset, T* __restrict__ grad_mask,
                                        const Geom<N> g, const int batch, const int channels,
                                        const int offset_groups, const int mask_groups,
                                        const int groups) {
    typedef typename Traits<T>::acc A;
    const I Q = dcn::prod_size<N, I>(g.out_size);
    const I S = dcn::prod_size<N, I>(g.in_size);
    const int K = (int)dcn::prod_size<N, I>(g.ksize);
    const I BQ = (I)batch * Q;
    const I total = (I)batch * groups * K * Q;
    const int per_group = channels / groups;
    const int per_offset_group = offset != nullptr ? channels / offset_groups : channels;
    const int per_mask_group = mask != nullptr ? channels / mask_groups : channels;
    for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
        const I q = idx % Q;
        I rest = idx / Q;
        const int t = (int)(rest % K);
        rest /= K;
        const int grp = (int)(rest % groups);
        const int b = (int)(rest / groups);
        int qc[N], tc[N];
        dcn::unravel<N, I>(q, g.out_size, qc);
        dcn::unravel<N, I>((I)t, g.ksize, tc);

        A goff[N];
#pragma unroll
        for (int a = 0; a < N; ++a) goff[a] = A(0);
        A gmask = A(0);

        dcn::Corners<A, I, N> cr;
        int current_go = -1;
        const int c_begin = grp * per_group;
        for (int c = c_begin; c < c_begin + per_group; ++c) {
            const int go = c / per_offset_group;
            if (go != current_go) {
                current_go = go;
                const T* off = nullptr;
                if (offset != nullptr) {
                    off = offset + (((I)b * offset_groups + go) * K + t) * (I)N * Q + q;
                }
                A pos[N];
                dcn::tap_position<T, A, I, N>(g, qc, tc, off, Q, pos);
                cr.compute(pos, g.in_size);
            }
            if (!cr.valid) continue;
            const A cg = column_grads[((I)c * K + t) * BQ + (I)b * Q + q];
            A m = A(1);
            if (mask != nullptr && WANT_OFFSET) {
                const int gm = c / per_mask_group;
                m = Traits<T>::load(mask[(((I)b * mask_groups + gm) * K + t) * Q + q]);
            }
            dcn::accumulate_position_gradients<WANT_OFFSET, WANT_MASK>(cr, x + ((I)b * channels + c) * S, cg, m,
                                                                      goff, gmask);
        }
        if (WANT_OFFSET) {
            // groups == offset_groups here
            T* out = grad_offset + (((I)b * groups + grp) * K + t) * (I)N * Q + q;
#pragma unroll
            for (int a = 0; a < N; ++a) out[(I)a * Q] = Traits<T>::store(goff[a]);
        }
        if (WANT_MASK) {
            // groups == mask_groups here
            grad_mask[(((I)b * groups + grp) * K + t) * Q + q] = Traits<T>::store(gmask);
        }
    }
}

// (Bc, C, Q) -> (C, Bc*Q): the layout the GEMMs want for grad_output.
template <typename T, typename I>
__global__ void batch_to_columns(const T* __restrict__ src, T* __restrict__ dst, const int batch,
                                 const int channels, const I Q) {
    const I total = (I)batch * channels * Q;
    for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
        const I q = idx % Q;
        const I bc = idx / Q;
        const int c = (int)(bc % channels);
        const int b = (int)(bc / channels);
        dst[((I)c * batch + b) * Q + q] = src[idx];
    }
}

// (C, Bc*Q) in the arithmetic type -> (Bc, C, Q) in T, plus bias[c] (bias may be null).
template <typename T, typename I>
__global__ void columns_to_batch(const typename Traits<T>::acc* __restrict__ src,
                                 const T* __restrict__ bias, T* __restrict__ dst, const int batch,
                                 const int channels, const I Q) {
    typedef typename Traits<T>::acc A;
    const I total = (I)batch * channels * Q;
    for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
        const I q = idx % Q;
        const I bc = idx / Q;
        const int c = (int)(bc % channels);
        const int b = (int)(bc / channels);
        A v = src[((I)c * batch + b) * Q + q];
        if (bias != nullptr) v += Traits<T>::load(bias[c]);
        dst[idx] = Traits<T>::store(v);
    }
}

// dst[i] = T(src[i] + bias[(i / inner) % channels]); bias may be null; src may alias dst
// (no __restrict__) when T is the arithmetic type.
template <typename T, typename I>
__global__ void finalize(const typename Traits<T>::acc* src, const T* __restrict__ bias, T* dst,
                         const I total, const int channels, const I inner) {
    typedef typename Traits<T>::acc A;
    for (I idx = dcn::global_thread_index<I>(); idx < total; idx += dcn::global_thread_stride<I>()) {
        A v = src[idx];
        if (bias != nullptr) v += Traits<T>::load(bias[(int)((idx / inner) % channels)]);
        dst[idx] = Traits<T>::store(v);
    }
}
