// dcn_cupy: shared device helpers for the deformable convolution kernels.
//
// Everything here is templated on the storage type T (float16, bfloat16, float32, float64),
// the index type I (int or long long: 64-bit when an element count can exceed 2^31-1) and the
// number of spatial dimensions N (1, 2, 3). Arithmetic is done in Traits<T>::acc: float32 for
// the half types and float32 itself, float64 for float64.
//
// This header is inlined into the module text by dcn_cupy/_backends/cuda.py (CuPy's kernel
// cache key does not see -I headers), with #line directives so diagnostics name this file.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace dcn {

template <typename T> struct Traits;

template <> struct Traits<float> {
    typedef float acc;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
};

template <> struct Traits<double> {
    typedef double acc;
    static __device__ __forceinline__ double load(double v) { return v; }
    static __device__ __forceinline__ double store(double v) { return v; }
};

template <> struct Traits<__half> {
    typedef float acc;
    static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
    static __device__ __forceinline__ __half store(float v) { return __float2half_rn(v); }
};

template <> struct Traits<__nv_bfloat16> {
    typedef float acc;
    static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

// Hyper-parameters of one convolution, passed by value (a NumPy structured scalar of 6*N
// int32 on the host side, in this order).
template <int N> struct Geom {
    int in_size[N];    // S: the convolution's input grid
    int out_size[N];   // Q: the convolution's output grid (offset and mask live here)
    int ksize[N];      // k
    int stride[N];     // s
    int pad[N];        // p
    int dil[N];        // d
};

template <int N, typename I>
__device__ __forceinline__ I prod_size(const int (&v)[N]) {
    I r = 1;
#pragma unroll
    for (int a = 0; a < N; ++a) r *= (I)v[a];
    return r;
}

// Grid-stride loop bounds.
template <typename I>
__device__ __forceinline__ I global_thread_index() {
    return (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x;
}
template <typename I>
__device__ __forceinline__ I global_thread_stride() {
    return (I)blockDim.x * (I)gridDim.x;
}

// Flat output index q -> coordinates (row-major, last axis fastest).
template <int N, typename I>
__device__ __forceinline__ void unravel(I q, const int (&size)[N], int (&coord)[N]) {
#pragma unroll
    for (int a = N - 1; a >= 0; --a) {
        coord[a] = (int)(q % (I)size[a]);
        q /= (I)size[a];
    }
}

// unravel of an index known to lie in [0, prod(size)) (a tap, or a position within its
// sample): the first coordinate is the quotient left, one division fewer (none in 1D).
template <int N, typename I>
__device__ __forceinline__ void unravel_in_range(I q, const int (&size)[N], int (&coord)[N]) {
#pragma unroll
    for (int a = N - 1; a >= 1; --a) {
        coord[a] = (int)(q % (I)size[a]);
        q /= (I)size[a];
    }
    coord[0] = (int)q;
}

// The box of input positions reached by the regular (offset-free) sampling positions of the
// consecutive output positions [q_first, q_last], widened by `halo` on every side and clipped
// to the grid. The tiled col2im accumulates one channel's box in shared memory; corners outside
// it (offsets larger than the halo) go straight to global memory. dcn_cupy/_backends/cuda.py
// mirrors this computation (_max_box_volume) to size the shared memory.
template <int N, typename I>
struct TileBox {
    int lo[N];
    int size[N];
    I volume;

    __device__ __forceinline__ void compute(const Geom<N>& g, I q_first, I q_last, int halo) {
        int first[N], last[N];
        unravel<N, I>(q_first, g.out_size, first);
        unravel<N, I>(q_last, g.out_size, last);
        bool same = true;  // the axes before `a` agree: axis a spans [first, last], else all of it
        volume = 1;
#pragma unroll
        for (int a = 0; a < N; ++a) {
            const int qmin = same ? first[a] : 0;
            const int qmax = same ? last[a] : g.out_size[a] - 1;
            same = same && first[a] == last[a];
            const int l = max(qmin * g.stride[a] - g.pad[a] - halo, 0);
            const int h = min(qmax * g.stride[a] - g.pad[a] + (g.ksize[a] - 1) * g.dil[a] + 1 + halo,
                              g.in_size[a] - 1);
            lo[a] = l;
            size[a] = h >= l ? h - l + 1 : 0;
            volume *= (I)size[a];
        }
    }

    // Box offset of grid coordinates, or -1 outside the box.
    __device__ __forceinline__ I offset_of(const int (&coord)[N]) const {
        I e = 0;
#pragma unroll
        for (int a = 0; a < N; ++a) {
            const int r = coord[a] - lo[a];
            if (r < 0 || r >= size[a]) return (I)-1;
            e = e * (I)size[a] + (I)r;
        }
        return e;
    }

    // Flat grid index of box element e.
    __device__ __forceinline__ I grid_index(I e, const int (&in_size)[N]) const {
        int r[N];
#pragma unroll
        for (int a = N - 1; a >= 0; --a) {
            r[a] = (int)(e % (I)size[a]);
            e /= (I)size[a];
        }
        I idx = 0;
#pragma unroll
        for (int a = 0; a < N; ++a) idx = idx * (I)in_size[a] + (I)(lo[a] + r[a]);
        return idx;
    }
};

// Floor corner and fractions of a position; false (and nothing else set) when no corner is
// on the grid: a coordinate < -1, >= S_a or not finite. Range check before conversion. A
// coordinate of exactly -1 is located (corners -1 and 0): it samples 0, since corner 0 has
// weight 0, but its offset derivative is torchvision's one-sided one (corner 0's slope is 1).
template <typename A, int N>
__device__ __forceinline__ bool locate(const A (&pos)[N], const int (&size)[N], int (&lo)[N],
                                       A (&frac)[N]) {
#pragma unroll
    for (int a = 0; a < N; ++a) {
        if (!((pos[a] >= A(-1)) && (pos[a] < (A)size[a]))) return false;
    }
#pragma unroll
    for (int a = 0; a < N; ++a) {
        const A fl = floor(pos[a]);
        lo[a] = (int)fl;
        frac[a] = pos[a] - fl;
    }
    return true;
}

// Corner k of a located position: its coordinates, its weight, whether it is on the grid.
template <typename A, int N>
__device__ __forceinline__ bool corner_on_grid(int k, const int (&lo)[N], const A (&frac)[N],
                                               const int (&size)[N], int (&coord)[N], A& w) {
    bool inside = true;
    w = A(1);
#pragma unroll
    for (int a = 0; a < N; ++a) {
        const int bit = (k >> (N - 1 - a)) & 1;
        coord[a] = lo[a] + bit;
        inside = inside && coord[a] >= 0 && coord[a] < size[a];
        w *= bit ? frac[a] : A(1) - frac[a];
    }
    return inside;
}

// Whether corner k contributes to a sample (or receives a share of a scattered value): on the
// grid with a non-zero weight. A zero-weight corner is never read, so a non-finite input
// element reaches only the samples that weight it by a non-zero amount (never 0 * inf).
template <typename A, int N>
__device__ __forceinline__ bool corner(int k, const int (&lo)[N], const A (&frac)[N],
                                       const int (&size)[N], int (&coord)[N], A& w) {
    return corner_on_grid<A, N>(k, lo, frac, size, coord, w) && w != A(0);
}

template <int N, typename I>
__device__ __forceinline__ I flat_index(const int (&coord)[N], const int (&size)[N]) {
    I idx = 0;
#pragma unroll
    for (int a = 0; a < N; ++a) idx = idx * (I)size[a] + (I)coord[a];
    return idx;
}

// The 2^N interpolation corners of one sampling position, with everything needed both to
// sample (weights) and to differentiate with respect to the position (dweights).
//
// Rules (DESIGN.md section 1): a position with any coordinate < -1 or >= S_a, or a
// non-finite coordinate, samples 0 and has zero gradients; otherwise the corners floor(P_a)
// and floor(P_a)+1 are used and a corner outside [0, S_a-1] contributes 0. Users skip a
// corner whose weight (dweight) is exactly 0 rather than multiply by it. The range check
// comes before any float->int conversion, so huge or non-finite offsets are never converted.
template <typename A, typename I, int N>
struct Corners {
    static const int NC = 1 << N;
    bool valid;            // position inside the box [-1, S_a) on every axis
    bool ok[NC];           // corner inside the grid
    I index[NC];           // flat spatial index of the corner (0 where !ok)
    A weight[NC];          // interpolation weight
    A dweight[NC][N];      // d weight / d P_a

    __device__ __forceinline__ void compute(const A (&pos)[N], const int (&size)[N]) {
        int lo[N] = {};
        A frac[N] = {};  // stay 0 for a position that samples zero
        valid = locate<A, N>(pos, size, lo, frac);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            int coord[N];
            A w = A(0);
            const bool inside = valid && corner_on_grid<A, N>(c, lo, frac, size, coord, w);
            ok[c] = inside;
            index[c] = inside ? flat_index<N, I>(coord, size) : (I)0;
            weight[c] = inside ? w : A(0);
#pragma unroll
            for (int a = 0; a < N; ++a) {
                // d weight / d P_a: the other axes' weights times the sign of this axis' corner.
                A dw = A(1);
#pragma unroll
                for (int b = 0; b < N; ++b) {
                    const int bit = (c >> (N - 1 - b)) & 1;
                    if (b == a) {
                        dw *= bit ? A(1) : A(-1);
                    } else {
                        dw *= bit ? frac[b] : A(1) - frac[b];
                    }
                }
                dweight[c][a] = inside ? dw : A(0);
            }
        }
    }
};

// N-linear sample of one channel plane with zeros outside (forward only: no corner storage).
template <typename T, typename A, typename I, int N>
__device__ __forceinline__ A sample_plane(const T* __restrict__ plane, const A (&pos)[N],
                                          const int (&size)[N]) {
    int lo[N];
    A frac[N];
    if (!locate<A, N>(pos, size, lo, frac)) return A(0);
    A acc = A(0);
#pragma unroll
    for (int c = 0; c < (1 << N); ++c) {
        int coord[N];
        A w;
        if (corner<A, N>(c, lo, frac, size, coord, w)) {
            acc += w * Traits<T>::load(plane[flat_index<N, I>(coord, size)]);
        }
    }
    return acc;
}

// The offset and mask rows of channel c of sample b at output position q: offset[b, go(c), tap 0,
// axis 0, q] and mask[b, gm(c), tap 0, q], taps and axes following at stride Q; null where the
// argument is absent.
template <typename T, typename I, int N>
__device__ __forceinline__ void channel_rows(const T* offset, const T* mask, int b, int c, int channels,
                                             int offset_groups, int mask_groups, int K, I Q, I q,
                                             const T*& off, const T*& msk) {
    off = offset == nullptr ? nullptr
        : offset + ((I)b * offset_groups + c / (channels / offset_groups)) * (I)K * N * Q + q;
    msk = mask == nullptr ? nullptr
        : mask + ((I)b * mask_groups + c / (channels / mask_groups)) * (I)K * Q + q;
}

// Sampling position of tap `tap` (coordinates tc) at output coordinates qc, plus offsets.
// `off` points at offset[b, g, tap, axis 0, q] (stride `qstride` between axes) or is null.
template <typename T, typename A, typename I, int N>
__device__ __forceinline__ void tap_position(const Geom<N>& g, const int (&qc)[N],
                                             const int (&tc)[N], const T* __restrict__ off,
                                             I qstride, A (&pos)[N]) {
#pragma unroll
    for (int a = 0; a < N; ++a) {
        pos[a] = (A)(qc[a] * g.stride[a] - g.pad[a] + tc[a] * g.dil[a]);
        if (off != nullptr) pos[a] += Traits<T>::load(off[(I)a * qstride]);
    }
}

// Advance tap coordinates in row-major order (last axis fastest).
template <int N>
__device__ __forceinline__ void next_tap(int (&tc)[N], const int (&ksize)[N]) {
#pragma unroll
    for (int a = N - 1; a >= 0; --a) {
        if (++tc[a] < ksize[a]) return;
        tc[a] = 0;
    }
}

// The sum over the corners k with coef(k) != 0 of coef(k) * value(k), into `sum`; whether any
// corner was: a corner of weight (or slope) exactly 0 is skipped, never multiplied, so that a
// non-finite value there never reaches the sum (DESIGN.md section 1).
template <int NC, typename A, typename Coef, typename Value>
__device__ __forceinline__ bool nonzero_corner_sum(Coef coef, Value value, A& sum) {
    A s = A(0);
    bool used = false;
#pragma unroll
    for (int k = 0; k < NC; ++k) {
        const A c = coef(k);
        if (c != A(0)) {
            s += c * value(k);
            used = true;
        }
    }
    sum = s;
    return used;
}

// One channel's share of the offset and mask gradients at a valid position `cr` of `plane`:
// gmask += cg * sample, goff[a] += cg * m * d sample / d P_a. Corners of zero weight (slope) are
// skipped, not multiplied (no 0 * inf); a sum with no such corner adds nothing at all, whatever
// cg holds.
template <bool WANT_OFFSET, bool WANT_MASK, typename T, typename A, typename I, int N>
__device__ __forceinline__ void accumulate_position_gradients(const Corners<A, I, N>& cr,
                                                              const T* __restrict__ plane, A cg, A m,
                                                              A (&goff)[N], A& gmask) {
    A v[1 << N];
#pragma unroll
    for (int k = 0; k < (1 << N); ++k) {
        v[k] = cr.ok[k] ? Traits<T>::load(plane[cr.index[k]]) : A(0);
    }
    const auto corner_value = [&](int k) { return v[k]; };
    A s, d;
    if (WANT_MASK && nonzero_corner_sum<1 << N>([&](int k) { return cr.weight[k]; }, corner_value, s)) gmask += cg * s;
    if (WANT_OFFSET) {
        const A scale = cg * m;
#pragma unroll
        for (int a = 0; a < N; ++a)
            if (nonzero_corner_sum<1 << N>([&](int k) { return cr.dweight[k][a]; }, corner_value, d))
                goff[a] += scale * d;
    }
}

__device__ __forceinline__ void atomic_accumulate(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_accumulate(double* p, double v) { atomicAdd(p, v); }

}  // namespace dcn
