"""CPU backend: Numba-parallel sampling kernels and NumPy matmul (BLAS) GEMMs.

One code path serves N = 1, 2 and 3: spatial axes are padded in front to three with size-1
axes (kernel 1, stride 1, padding 0, dilation 1), which always sample at their single index,
and only the N real axes get two interpolation corners each.

The work of one batch chunk goes through a *sampling plan*: for every (sample, offset group,
tap, output position) the flat input indices and N-linear weights of its 2^N corners (and
their derivatives along each axis, when the offset gradient is wanted). The plan is shared by
the C_in / G_o channels of an offset group. Then

* forward:   columns[c*K + t, q] = mask * sum_corners weight * x[c, index]; y = W_g @ columns_g
* to input:  column grads = W_g^T @ grad_y_g, scattered back through the plan (col2im)
* weight:    grad_W_g = sum_b grad_y_g @ columns_g^T
* offset, mask: per (sample, tap), a sum over channels of column grads times the sampled
  value (mask) or its derivative (offset).

Every parallel loop owns the elements it writes (channels in col2im, taps in the offset and
mask gradients), so there are no data races and no atomics, and results do not depend on
the number of threads. Half types are computed in float32 and cast back.
"""

from __future__ import annotations

import contextlib
import os

import numba
import numpy as np
from numba import njit, prange

from .._interop import compute_dtype

xp = np

#: Upper bound, in bytes, of the per-chunk workspace (columns and sampling plan).
WORKSPACE_LIMIT_BYTES = int(os.environ.get("DCN_CUPY_CPU_WORKSPACE_BYTES", 512 * 2**20))


def device_context(device_id: int):
    return contextlib.nullcontext()


_blas_controller = None


def _single_threaded_blas():
    """Hold BLAS to one thread while the backend runs, where threadpoolctl is installed.

    The GEMMs run between Numba's parallel loops, whose worker threads are still spinning when
    a multi-threaded BLAS starts its own: the two pools fight over the cores (forward 44 ms
    against 21 ms, backward 118 ms against 44 ms, on 2 cores at B=2, C=64, 56x56).
    """
    global _blas_controller
    if _blas_controller is None:
        try:
            from threadpoolctl import ThreadpoolController
            _blas_controller = ThreadpoolController()
        except ImportError:  # an optional dependency: without it BLAS keeps its threads
            _blas_controller = False
    if not _blas_controller:
        return contextlib.nullcontext()
    return _blas_controller.limit(limits=1, user_api="blas")


# ---------------------------------------------------------------------------------------------
# Numba kernels. Spatial parameters are int64 arrays of length 3 (padded in front).


@njit(parallel=True, cache=True)
def _sampling_plan(offset, has_offset, n_offset_groups, ndim, in_shape, out_shape, kernel, stride,
                   padding, dilation, index, weight, dweight, want_dweight):
    batch = index.shape[0]
    taps = index.shape[2]
    positions = index.shape[3]
    corners = index.shape[4]
    for job in prange(batch * n_offset_groups * taps):
        b = job // (n_offset_groups * taps)
        g = (job // taps) % n_offset_groups
        t = job % taps
        t0 = t // (kernel[1] * kernel[2])
        t1 = (t // kernel[2]) % kernel[1]
        t2 = t % kernel[2]
        base = (g * taps + t) * ndim
        for q in range(positions):
            q0 = q // (out_shape[1] * out_shape[2])
            q1 = (q // out_shape[2]) % out_shape[1]
            q2 = q % out_shape[2]
            p0 = float(q0 * stride[0] - padding[0] + t0 * dilation[0])
            p1 = float(q1 * stride[1] - padding[1] + t1 * dilation[1])
            p2 = float(q2 * stride[2] - padding[2] + t2 * dilation[2])
            if has_offset:
                if ndim == 3:
                    p0 += offset[b, base, q]
                    p1 += offset[b, base + 1, q]
                    p2 += offset[b, base + 2, q]
                elif ndim == 2:
                    p1 += offset[b, base, q]
                    p2 += offset[b, base + 1, q]
                else:
                    p2 += offset[b, base, q]
            # NaN fails every comparison, +-inf fails the range: both sample zero. A coordinate
            # of exactly -1 stays: its corner 0 has weight 0 but slope 1 (torchvision's
            # one-sided offset derivative there); below -1 and from S on no corner is inside.
            valid = (p0 >= -1.0 and p0 < in_shape[0] and p1 >= -1.0 and p1 < in_shape[1]
                     and p2 >= -1.0 and p2 < in_shape[2])
            if not valid:
                for c in range(corners):
                    index[b, g, t, q, c] = 0
                    weight[b, g, t, q, c] = 0.0
                    if want_dweight:
                        for a in range(ndim):
                            dweight[b, g, t, q, c, a] = 0.0
                continue
            l0 = np.floor(p0)
            l1 = np.floor(p1)
            l2 = np.floor(p2)
            f0 = p0 - l0
            f1 = p1 - l1
            f2 = p2 - l2
            for c in range(corners):
                # Bit 0 of c picks the corner along the last axis, bit 1 the second last, bit 2 the first.
                i0 = int(l0)
                i1 = int(l1)
                i2 = int(l2)
                w0 = 1.0
                w1 = 1.0
                w2 = 1.0
                s0 = -1.0
                s1 = -1.0
                s2 = -1.0
                if ndim == 3:
                    if (c >> 2) & 1:
                        i0 += 1
                        w0 = f0
                        s0 = 1.0
                    else:
                        w0 = 1.0 - f0
                if ndim >= 2:
                    if (c >> 1) & 1:
                        i1 += 1
                        w1 = f1
                        s1 = 1.0
                    else:
                        w1 = 1.0 - f1
                if c & 1:
                    i2 += 1
                    w2 = f2
                    s2 = 1.0
                else:
                    w2 = 1.0 - f2
                inside = (0 <= i0 < in_shape[0] and 0 <= i1 < in_shape[1] and 0 <= i2 < in_shape[2])
                if inside:
                    index[b, g, t, q, c] = (i0 * in_shape[1] + i1) * in_shape[2] + i2
                    weight[b, g, t, q, c] = w0 * w1 * w2
                else:
                    index[b, g, t, q, c] = 0
                    weight[b, g, t, q, c] = 0.0
                if want_dweight:
                    # d weight / d position along each real axis (zero for corners outside).
                    for a in range(ndim):
                        axis = 3 - ndim + a
                        if not inside:
                            dweight[b, g, t, q, c, a] = 0.0
                        elif axis == 0:
                            dweight[b, g, t, q, c, a] = s0 * w1 * w2
                        elif axis == 1:
                            dweight[b, g, t, q, c, a] = w0 * s1 * w2
                        else:
                            dweight[b, g, t, q, c, a] = w0 * w1 * s2


@njit(cache=True, inline="always")
def _exact_sample(x, b, c, index, weight, g, t, q, corners):
    """The N-linear sample over the corners of non-zero weight only: a zero-weight corner
    reads nothing (no 0 * inf). The kernels sum every corner first, which is the same value
    whenever it is finite, and come here only when it is not."""
    value = 0.0
    for k in range(corners):
        w = weight[b, g, t, q, k]
        if w != 0.0:
            value += w * x[b, c, index[b, g, t, q, k]]
    return value


@njit(parallel=True, cache=True)
def _im2col(x, mask, has_mask, n_mask_groups, index, weight, columns):
    batch, channels, _ = x.shape
    n_offset_groups = index.shape[1]
    taps = index.shape[2]
    positions = index.shape[3]
    corners = index.shape[4]
    for job in prange(batch * channels):
        b = job // channels
        c = job % channels
        g = c // (channels // n_offset_groups)
        m_row = (c // (channels // n_mask_groups)) * taps if has_mask else 0
        for t in range(taps):
            row = c * taps + t
            for q in range(positions):
                value = 0.0
                for k in range(corners):
                    value += weight[b, g, t, q, k] * x[b, c, index[b, g, t, q, k]]
                if not np.isfinite(value):
                    value = _exact_sample(x, b, c, index, weight, g, t, q, corners)
                if has_mask:
                    value *= mask[b, m_row + t, q]
                columns[b, row, q] = value


@njit(parallel=True, cache=True)
def _col2im(column_grads, mask, has_mask, n_mask_groups, index, weight, grad_x):
    batch, channels, _ = grad_x.shape
    n_offset_groups = index.shape[1]
    taps = index.shape[2]
    positions = index.shape[3]
    corners = index.shape[4]
    for job in prange(batch * channels):  # each job owns grad_x[b, c]
        b = job // channels
        c = job % channels
        g = c // (channels // n_offset_groups)
        m_row = (c // (channels // n_mask_groups)) * taps if has_mask else 0
        for t in range(taps):
            row = c * taps + t
            for q in range(positions):
                value = column_grads[b, row, q]
                if has_mask:
                    value *= mask[b, m_row + t, q]
                if np.isfinite(value):
                    for k in range(corners):
                        grad_x[b, c, index[b, g, t, q, k]] += value * weight[b, g, t, q, k]
                else:  # zero-weight corners receive nothing, not 0 * inf
                    for k in range(corners):
                        w = weight[b, g, t, q, k]
                        if w != 0.0:
                            grad_x[b, c, index[b, g, t, q, k]] += value * w


@njit(parallel=True, cache=True)
def _offset_mask_grads(x, column_grads, mask, has_mask, n_mask_groups, index, weight, dweight, ndim,
                       want_offset, want_mask, grad_offset, grad_mask):
    batch, channels, _ = x.shape
    n_offset_groups = index.shape[1]
    taps = index.shape[2]
    positions = index.shape[3]
    corners = index.shape[4]
    for job in prange(batch * taps):  # each job owns the entries of tap t of sample b
        b = job // taps
        t = job % taps
        # corner_grads[g, q, k] = sum over the channels c of offset group g of
        # grad_column[c] * mask * x[c, corner k]; the offset gradient is then one dot product
        # with the corner weights' slopes per position, not one per channel.
        corner_grads = np.zeros((n_offset_groups if want_offset else 1, positions, corners))
        for c in range(channels):
            g = c // (channels // n_offset_groups)
            m_row = (c // (channels // n_mask_groups)) * taps + t if has_mask else 0
            row = c * taps + t
            for q in range(positions):
                grad = column_grads[b, row, q]
                scaled = grad * mask[b, m_row, q] if has_mask else grad
                value = 0.0
                for k in range(corners):
                    v = x[b, c, index[b, g, t, q, k]]
                    value += weight[b, g, t, q, k] * v
                    if want_offset:
                        corner_grads[g, q, k] += scaled * v
                if want_mask:
                    term = grad * value
                    if not np.isfinite(term):
                        # A tap that samples nothing has a zero gradient whatever grad holds.
                        used = False
                        for k in range(corners):
                            used = used or weight[b, g, t, q, k] != 0.0
                        value = _exact_sample(x, b, c, index, weight, g, t, q, corners)
                        term = grad * value if used else 0.0
                    grad_mask[b, m_row, q] += term
        if want_offset:
            for g in range(n_offset_groups):
                o_row = (g * taps + t) * ndim
                for q in range(positions):
                    for a in range(ndim):
                        total = 0.0
                        for k in range(corners):
                            total += dweight[b, g, t, q, k, a] * corner_grads[g, q, k]
                        if not np.isfinite(total):  # outside and zero-slope corners add nothing
                            total = 0.0
                            for k in range(corners):
                                slope = dweight[b, g, t, q, k, a]
                                if slope != 0.0:
                                    total += slope * corner_grads[g, q, k]
                        grad_offset[b, o_row + a, q] = total


# ---------------------------------------------------------------------------------------------
# Driver


def _padded(values, fill, ndim):
    return np.array((fill,) * (3 - ndim) + tuple(values), dtype=np.int64)


class _Plan:
    """The sampling plan of one batch chunk."""

    def __init__(self, geom, offset, want_dweight, dtype):
        n = geom.ndim
        batch = offset.shape[0] if offset is not None else geom.batch
        groups = max(geom.offset_groups, 1)
        corners = 1 << n
        shape = (batch, groups, geom.kernel_volume, geom.output_size, corners)
        self.index = np.empty(shape, dtype=np.int64)
        self.weight = np.empty(shape, dtype=dtype)
        self.dweight = np.empty(shape + (n,) if want_dweight else (1,) * 6, dtype=dtype)
        has_offset = offset is not None
        off = _flat(offset, batch, dtype) if has_offset else np.zeros((1, 1, 1), dtype)
        _sampling_plan(
            off, has_offset, groups, n, _padded(geom.input_shape, 1, n), _padded(geom.output_shape, 1, n),
            _padded(geom.kernel_size, 1, n), _padded(geom.stride, 1, n), _padded(geom.padding, 0, n),
            _padded(geom.dilation, 1, n), self.index, self.weight, self.dweight, want_dweight,
        )

    @staticmethod
    def bytes_per_sample(geom, want_dweight, itemsize):
        entries = max(geom.offset_groups, 1) * geom.kernel_volume * geom.output_size * (1 << geom.ndim)
        return entries * (8 + itemsize * (1 + (geom.ndim if want_dweight else 0)))


def _chunks(geom, itemsize, want_dweight=False):
    """Batch slices whose columns and plan fit in WORKSPACE_LIMIT_BYTES."""
    per_sample = (geom.in_channels * geom.kernel_volume * geom.output_size * itemsize
                  + _Plan.bytes_per_sample(geom, want_dweight, itemsize))
    size = max(1, min(geom.batch, WORKSPACE_LIMIT_BYTES // max(per_sample, 1)))
    return [slice(start, min(start + size, geom.batch)) for start in range(0, geom.batch, size)]


def _flat(array, batch, dtype):
    """(B, C, *grid) -> contiguous (B, C, prod(grid)) in the compute dtype."""
    return np.ascontiguousarray(array.reshape(batch, array.shape[1], -1), dtype=dtype)


def _mask_args(mask, geom, dtype):
    if mask is None:
        return np.zeros((1, 1, 1), dtype), False, 1
    return _flat(mask, mask.shape[0], dtype), True, geom.mask_groups


def _grouped_weight(weight, geom, dtype):
    """(C_out, C_in/G, *k) -> (G, C_out/G, C_in/G * K)."""
    return np.asarray(weight, dtype=dtype).reshape(
        geom.groups, geom.out_channels_per_group, geom.in_channels_per_group * geom.kernel_volume
    )


def _columns(x, mask, plan, geom, dtype):
    batch = x.shape[0]
    columns = np.empty((batch, geom.in_channels * geom.kernel_volume, geom.output_size), dtype=dtype)
    m, has_mask, mask_groups = _mask_args(mask, geom, dtype)
    _im2col(_flat(x, batch, dtype), m, has_mask, mask_groups, plan.index, plan.weight, columns)
    return columns


def _column_grads(grad_output, w_grouped, geom, dtype):
    """W_g^T @ grad_y_g for every sample and group: (B, C_in * K, Q)."""
    batch = grad_output.shape[0]
    gy = _flat(grad_output, batch, dtype).reshape(batch, geom.groups, geom.out_channels_per_group, -1)
    cols = np.matmul(w_grouped.transpose(0, 2, 1)[None], gy)
    return np.ascontiguousarray(cols.reshape(batch, geom.in_channels * geom.kernel_volume, geom.output_size))


def _add_bias(out, bias, ndim):
    if bias is not None:
        out += np.asarray(bias, dtype=out.dtype).reshape((1, -1) + (1,) * ndim)


def conv_forward(x, weight, offset, mask, bias, geom):
    with _single_threaded_blas():
        return _conv_forward(x, weight, offset, mask, bias, geom)


def _conv_forward(x, weight, offset, mask, bias, geom):
    dtype = compute_dtype(x.dtype)
    w = _grouped_weight(weight, geom, dtype)
    y = np.empty((geom.batch, geom.groups, geom.out_channels_per_group, geom.output_size), dtype=dtype)
    for part in _chunks(geom, dtype.itemsize):
        off = None if offset is None else offset[part]
        msk = None if mask is None else mask[part]
        plan = _Plan(geom.with_batch(part.stop - part.start), off, False, dtype)
        columns = _columns(x[part], msk, plan, geom, dtype)
        cols = columns.reshape(columns.shape[0], geom.groups, -1, geom.output_size)
        np.matmul(w[None], cols, out=y[part])
    y = y.reshape(geom.y_shape)
    _add_bias(y, bias, geom.ndim)
    return y.astype(x.dtype, copy=False)


def conv_backward(grad_output, x, weight, offset, mask, geom, wanted, bias=None):
    """Every requested gradient in one pass over the batch: the plan and the column gradients
    are shared by the input, offset and mask gradients. ``x`` may be None when only the input
    gradient is wanted; ``bias`` is added to the input gradient (the transposed forward)."""
    with _single_threaded_blas():
        return _conv_backward(grad_output, x, weight, offset, mask, geom, "input" in wanted, "weight" in wanted,
                              "offset" in wanted, "mask" in wanted, bias)


def _conv_backward(grad_output, x, weight, offset, mask, geom, need_input, need_weight, need_offset, need_mask,
                   bias):
    dtype = compute_dtype(grad_output.dtype)
    out_dtype = grad_output.dtype
    need_offset = need_offset and offset is not None
    need_mask = need_mask and mask is not None
    w = _grouped_weight(weight, geom, dtype)
    grad_x = np.zeros((geom.batch, geom.in_channels, geom.input_size), dtype=dtype) if need_input else None
    grad_w = np.zeros(w.shape, dtype=np.float64) if need_weight else None
    grad_off = np.zeros(geom.offset_shape[:2] + (geom.output_size,), np.float64) if need_offset else None
    grad_m = np.zeros(geom.mask_shape[:2] + (geom.output_size,), np.float64) if need_mask else None
    for part in _chunks(geom, dtype.itemsize, want_dweight=need_offset):
        batch = part.stop - part.start
        off = None if offset is None else offset[part]
        msk = None if mask is None else mask[part]
        plan = _Plan(geom.with_batch(batch), off, need_offset, dtype)
        m, has_mask, mask_groups = _mask_args(msk, geom, dtype)
        if need_weight:
            columns = _columns(x[part], msk, plan, geom, dtype)
            cols = columns.reshape(batch, geom.groups, -1, geom.output_size)
            gy = _flat(grad_output[part], batch, dtype).reshape(batch, geom.groups, geom.out_channels_per_group, -1)
            grad_w += np.matmul(gy, cols.transpose(0, 1, 3, 2)).sum(axis=0)
        if not (need_input or need_offset or need_mask):
            continue
        column_grads = _column_grads(grad_output[part], w, geom, dtype)
        if need_input:
            _col2im(column_grads, m, has_mask, mask_groups, plan.index, plan.weight, grad_x[part])
        if need_offset or need_mask:
            _offset_mask_grads(
                _flat(x[part], batch, dtype), column_grads, m, has_mask, mask_groups, plan.index, plan.weight,
                plan.dweight, geom.ndim, need_offset, need_mask,
                grad_off[part] if need_offset else np.zeros((1, 1, 1)),
                grad_m[part] if need_mask else np.zeros((1, 1, 1)),
            )
    if need_input:
        grad_x = grad_x.reshape(geom.x_shape)
        _add_bias(grad_x, bias, geom.ndim)
    return (
        None if grad_x is None else grad_x.astype(out_dtype, copy=False),
        None if grad_w is None else grad_w.reshape(geom.weight_shape).astype(out_dtype),
        None if grad_off is None else grad_off.reshape(geom.offset_shape).astype(out_dtype),
        None if grad_m is None else grad_m.reshape(geom.mask_shape).astype(out_dtype),
    )


def threading_layer() -> str:
    """Numba's threading layer and thread count, for ``python -m dcn_cupy info``."""
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        layer = "not yet chosen"
    return f"numba {numba.__version__}, {numba.get_num_threads()} threads, layer {layer}"
