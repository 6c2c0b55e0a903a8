"""CPU backend, channels-last algorithm (``cpu/channels-last``): the loops run along channels.

The input is copied channels-last, ``(B, S, C)``, so that one corner of one sampling point is
a contiguous row of channels. Each (sample, position, tap, offset group)'s corners and weights
are read once from the sampling plan (``cpu._Plan``, shared with ``cpu/numba``) and applied to a
whole run of channels by loops that vectorise: the coordinates are computed once per sampling
point and reused across channels, as in DCNv4's kernels. The columns and column gradients are
laid out to match, ``(B, G, P, K, C_in/G)`` (position, then tap, then channel of the conv group),
and the weights are reordered to ``(G, C_out/G, K, C_in/G)`` for the GEMMs:

* forward:   columns[b, g, q, t, :] = mask * sum_corners weight * x_cl[b, index, channels of g];
  y[b, g]^T = columns[b, g] @ W'_g^T, transposed into place with the bias added. A sample's
  positions go in parts of a few hundred, each part's columns, GEMM and store run in a row on
  one thread while its columns are still in the caches (the columns of a whole sample are not
  made)
* to input:  column grads[b, g] = grad_y[b, g]^T @ W'_g, scattered back into a channels-last
  input gradient (each job owns a block of channels), then transposed into place
* weight:    grad_W'_g = sum_b grad_y[b, g] @ columns[b, g]
* offset, mask: per (sample, tap, position), sums over channels of column grads times the
  sampled value (mask) or its corners (offset)

A corner of weight zero is skipped, which gives the exact rule of the reference (it reads
nothing, so no 0 * inf) with no test of the values: an accumulator that starts at +0 is the same
with or without a zero term. Every job owns what it writes, and each value is summed in an
order fixed by the shape alone, so results are bitwise the same at any thread count. They may
differ in the last bits from ``cpu/numba``'s: a sample of four (two) corners of non-zero weight
is summed in the compute dtype (float64 in ``cpu/numba``), the GEMMs reduce over (tap, channel)
rather than (channel, tap), and the offset and mask gradients' sums over channels are
re-associated to vectorise (so they may also differ between CPUs of different vector widths).

Where it serves: every configuration; a call whose sample's channels-last copies (input, and
input gradient) do not fit ``DCN_CUPY_CPU_WORKSPACE_BYTES`` with one position's work runs
``cpu/numba``'s loops instead. Where it is chosen (``recommends``): where every run of channels
that shares an offset group, a mask group and a conv group has at least ``MIN_CHANNELS``
channels; shorter runs leave its loops along channels mostly empty, and ``cpu/numba``'s loops
along positions are faster there (benchmarks/README.md, "CPU algorithms").
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit

from . import cpu
from .cpu import _kernel, _parallel_for

#: Shortest run of channels (one offset group, one mask group, one conv group) for which plans
#: choose this algorithm over ``cpu/numba`` (measured, benchmarks/README.md "CPU algorithms").
MIN_CHANNELS = 16

#: Output positions of one job of the sampling kernels.
POSITION_BLOCK = 64

#: Fewest jobs of the columns kernel in one part of the forward (256 positions): GEMMs of fewer
#: rows run slower in BLAS (52 parts of 64 rows took 1.2x the time of 16 of 196 at C=128, 28x28).
_PART_UNITS = 4

#: Fewest channels of the input gradient one scatter job owns (a 64-byte line of float32).
CHANNEL_BLOCK = 16


def channel_run(geom) -> int:
    """The length every run of input channels with one offset group, one mask group and one
    conv group is a multiple of (the runs' boundaries are multiples of each group's size)."""
    c = geom.in_channels
    return math.gcd(c // max(geom.offset_groups, 1), c // max(geom.mask_groups, 1), c // geom.groups)


@functools.lru_cache(maxsize=64)
def _channel_runs(channels, n_offset_groups, n_mask_groups, n_groups):
    """The runs of channels that share an offset, a mask and a conv group, the kernels' ``runs``
    (no divisions in their loops): rows of (first channel, end, conv group, offset group, mask
    group, the conv group's first channel). A run ends at every multiple of each group's size.
    Unsigned, so that an index computed from them is known to be non-negative: a signed one is
    tested for Python's negative indices at every element, which keeps the loops along channels
    from vectorising (4x slower). Made here rather than in the kernels: in them, it cost 0.3 s
    of the cold compilation. Cached (13 us to make), so read-only."""
    sizes = (channels // n_offset_groups, channels // n_mask_groups, channels // n_groups)
    first = np.unique(np.concatenate([np.arange(0, channels, size) for size in sizes]))
    end = np.append(first[1:], channels)
    group = first // sizes[2]
    rows = (first, end, group, first // sizes[0], first // sizes[1], group * sizes[2])
    runs = np.ascontiguousarray(np.stack(rows, axis=1), dtype=np.uint64)
    runs.flags.writeable = False
    return runs


# ---------------------------------------------------------------------------------------------
# Numba kernels (signatures in cpu._signature). Each runs the jobs [start, stop) of its loop.


@_kernel
def _im2col_cl(x, mask, has_mask, runs, index, weight, columns, b_first, q_first, start, stop):
    taps, positions, corners = index.shape[2], index.shape[3], index.shape[4]
    blocks = (positions + POSITION_BLOCK - 1) // POSITION_BLOCK
    # float64 sums, corner by corner, where a corner's weight is 0 (its own array, not the
    # caller's: one the compiler cannot tell apart from the others made the loops 3% slower)
    values = np.empty(x.shape[2])
    # columns[b - b_first, :, q - q_first] holds sample b's position q: all of them, or a part's
    for job in range(start, stop):  # jobs: batch * blocks, each owns the columns of a block
        b = job // blocks
        q0 = (job % blocks) * POSITION_BLOCK
        cb = b - b_first
        for q in range(q0, min(q0 + POSITION_BLOCK, positions)):
            cq = q - q_first
            for t in range(taps):
                for r in range(runs.shape[0]):
                    c0, c1, o = runs[r, 0], runs[r, 1], runs[r, 5]
                    g, go, m_row = np.int64(runs[r, 2]), np.int64(runs[r, 3]), np.int64(runs[r, 4]) * taps + t
                    m = mask[b, m_row, q] if has_mask else mask[0, 0, 0]
                    # The sum over the corners of non-zero weight, in corner order, in the compute
                    # dtype where every corner counts (float64 in the rest).
                    w0, w1 = weight[b, go, t, q, 0], weight[b, go, t, q, 1]
                    if corners == 4:
                        w2, w3 = weight[b, go, t, q, 2], weight[b, go, t, q, 3]
                        if w0 != 0.0 and w1 != 0.0 and w2 != 0.0 and w3 != 0.0:
                            i0, i1 = index[b, go, t, q, 0], index[b, go, t, q, 1]
                            i2, i3 = index[b, go, t, q, 2], index[b, go, t, q, 3]
                            for j in range(c0, c1):
                                value = ((w0 * x[b, i0, j] + w1 * x[b, i1, j]) + w2 * x[b, i2, j]) + w3 * x[b, i3, j]
                                columns[cb, g, cq, t, j - o] = value * m
                            continue
                    elif corners == 2 and w0 != 0.0 and w1 != 0.0:
                        i0, i1 = index[b, go, t, q, 0], index[b, go, t, q, 1]
                        for j in range(c0, c1):
                            value = w0 * x[b, i0, j] + w1 * x[b, i1, j]
                            columns[cb, g, cq, t, j - o] = value * m
                        continue
                    values[c0:c1] = 0.0
                    for k in range(corners):
                        w = weight[b, go, t, q, k]
                        if w != 0.0:
                            i = index[b, go, t, q, k]
                            for j in range(c0, c1):
                                values[j] += w * x[b, i, j]
                    for j in range(c0, c1):
                        columns[cb, g, cq, t, j - o] = values[j] * m


@_kernel
def _col2im_cl(column_grads, mask, has_mask, runs, index, weight, channel_block, grad_x, start, stop):
    channels = grad_x.shape[2]
    taps, positions, corners = index.shape[2], index.shape[3], index.shape[4]
    blocks = (channels + channel_block - 1) // channel_block
    for job in range(start, stop):  # jobs: batch * blocks, each owns grad_x[b, :, block of channels]
        b = job // blocks
        block0 = np.uint64((job % blocks) * channel_block)
        block1 = np.uint64(min((job % blocks) * channel_block + channel_block, channels))
        for t in range(taps):  # in the sampling plan's order
            for q in range(positions):
                for r in range(runs.shape[0]):
                    c0, c1 = max(runs[r, 0], block0), min(runs[r, 1], block1)
                    if c0 >= c1:
                        continue
                    o = runs[r, 5]
                    g, go, m_row = np.int64(runs[r, 2]), np.int64(runs[r, 3]), np.int64(runs[r, 4]) * taps + t
                    m = mask[b, m_row, q] if has_mask else mask[0, 0, 0]
                    # Only the corners of non-zero weight: a non-finite gradient reaches nothing else.
                    for k in range(corners):
                        w = weight[b, go, t, q, k]
                        if w != 0.0:
                            i = index[b, go, t, q, k]
                            for j in range(c0, c1):
                                grad_x[b, i, j] += (column_grads[b, g, q, t, j - o] * m) * w


@_kernel
def _offset_mask_grads_cl(x, column_grads, mask, has_mask, runs, index, weight, dweight, ndim, want_offset,
                          want_mask, grad_offset, grad_mask, start, stop):
    taps, positions, corners = index.shape[2], index.shape[3], index.shape[4]
    blocks = (positions + POSITION_BLOCK - 1) // POSITION_BLOCK
    sums = np.empty(corners)  # per corner: the offset group's sum over channels of mask * grad * x
    terms = np.empty(corners)  # per corner: the run's sum over channels of grad * x
    for job in range(start, stop):  # jobs: batch * blocks, each owns the gradients' entries of a block
        b = job // blocks
        q0 = (job % blocks) * POSITION_BLOCK
        for q in range(q0, min(q0 + POSITION_BLOCK, positions)):
            for t in range(taps):
                sums[:] = 0.0
                for r in range(runs.shape[0]):
                    c0, c1, o = runs[r, 0], runs[r, 1], runs[r, 5]
                    g, go, m_row = np.int64(runs[r, 2]), np.int64(runs[r, 3]), np.int64(runs[r, 4]) * taps + t
                    m = mask[b, m_row, q] if has_mask else mask[0, 0, 0]
                    _run_sums(x, column_grads, b, g, q, t, o, c0, c1, index, weight, go, m, sums, terms)
                    if want_mask:
                        # sum_j grad_j * sample_j = sum_k w_k * sum_j grad_j x_kj over the corners of
                        # non-zero weight (0 where there are none: the tap samples nothing)
                        term = 0.0
                        for k in range(corners):
                            w = weight[b, go, t, q, k]
                            if w != 0.0:
                                term += w * terms[k]
                        grad_mask[b, m_row, q] += term
                    if want_offset and (r + 1 == runs.shape[0] or np.int64(runs[r + 1, 3]) != go):  # group's last run
                        o_row = (go * taps + t) * ndim
                        for a in range(ndim):
                            total = 0.0
                            for k in range(corners):
                                total += dweight[b, go, t, q, k, a] * sums[k]
                            if not math.isfinite(total):  # outside and zero-slope corners add nothing
                                total = 0.0
                                for k in range(corners):
                                    slope = dweight[b, go, t, q, k, a]
                                    if slope != 0.0:
                                        total += slope * sums[k]
                            grad_offset[b, o_row + a, q] = total
                        sums[:] = 0.0


@njit(nogil=True, error_model="numpy", fastmath={"reassoc"})
def _run_sums(x, column_grads, b, g, q, t, o, c0, c1, index, weight, go, m, sums, terms):
    """Over the channels [c0, c1) of one run, per corner k: ``sums[k] += sum_j (m * grad_j) *
    x_kj`` (every corner: its slope may be non-zero where its weight is 0) and ``terms[k] =
    sum_j grad_j * x_kj``, in float64, re-associated so that the loops vectorise."""
    corners = index.shape[4]
    if corners == 4:
        i0, i1, i2, i3 = index[b, go, t, q, 0], index[b, go, t, q, 1], index[b, go, t, q, 2], index[b, go, t, q, 3]
        s0 = s1 = s2 = s3 = 0.0
        d0 = d1 = d2 = d3 = 0.0
        for j in range(c0, c1):
            grad = column_grads[b, g, q, t, j - o]
            scaled = grad * m
            v0, v1, v2, v3 = x[b, i0, j], x[b, i1, j], x[b, i2, j], x[b, i3, j]
            s0 += scaled * v0
            s1 += scaled * v1
            s2 += scaled * v2
            s3 += scaled * v3
            d0 += grad * v0
            d1 += grad * v1
            d2 += grad * v2
            d3 += grad * v3
        sums[0] += s0
        sums[1] += s1
        sums[2] += s2
        sums[3] += s3
        terms[0], terms[1], terms[2], terms[3] = d0, d1, d2, d3
        return
    for k in range(corners):
        i = index[b, go, t, q, k]
        s = d = 0.0
        for j in range(c0, c1):
            grad = column_grads[b, g, q, t, j - o]
            scaled = grad * m
            s += scaled * x[b, i, j]
            d += grad * x[b, i, j]
        sums[k] += s
        terms[k] = d


#: Positions of one job of the layout copies (a tile of them by TRANSPOSE_CHANNELS channels
#: stays in L1).
TRANSPOSE_POSITIONS = 64
TRANSPOSE_CHANNELS = 16


@_kernel
def _to_channels_last(x, out, start, stop):
    batch, channels, size = x.shape
    blocks = (size + TRANSPOSE_POSITIONS - 1) // TRANSPOSE_POSITIONS
    for job in range(start, stop):  # jobs: batch * blocks, each owns out[b, block, :]
        b = job // blocks
        s0 = np.uint64((job % blocks) * TRANSPOSE_POSITIONS)
        s1 = np.uint64(min((job % blocks) * TRANSPOSE_POSITIONS + TRANSPOSE_POSITIONS, size))
        for c0 in range(0, channels, TRANSPOSE_CHANNELS):  # tiles: numpy's whole-plane strides thrash the caches
            c1 = np.uint64(min(c0 + TRANSPOSE_CHANNELS, channels))
            for s_ in range(s0, s1):
                for c in range(np.uint64(c0), c1):
                    out[b, s_, c] = x[b, c, s_]


@_kernel
def _add_channels_first(x, out, start, stop):
    batch, size, channels = x.shape
    blocks = (size + TRANSPOSE_POSITIONS - 1) // TRANSPOSE_POSITIONS
    for job in range(start, stop):  # jobs: batch * blocks, each owns out[b, :, block]
        b = job // blocks
        s0 = np.uint64((job % blocks) * TRANSPOSE_POSITIONS)
        s1 = np.uint64(min((job % blocks) * TRANSPOSE_POSITIONS + TRANSPOSE_POSITIONS, size))
        for c0 in range(0, channels, TRANSPOSE_CHANNELS):
            c1 = np.uint64(min(c0 + TRANSPOSE_CHANNELS, channels))
            for c in range(np.uint64(c0), c1):
                for s_ in range(s0, s1):
                    out[b, c, s_] += x[b, s_, c]


# ---------------------------------------------------------------------------------------------
# Driver


#: The layout copies read no sampling plan: one compilation whatever the plans' index dtype.
_NO_INDEX = np.uint32


def _channels_last(part, dtype):
    """The staged chunk ``part`` (Bc, C, S) in ``dtype`` as a C-contiguous (Bc, S, C) copy."""
    out = np.empty((part.shape[0], part.shape[2], part.shape[1]), dtype=dtype)
    _parallel_for("_to_channels_last", dtype, _NO_INDEX, (part, out), part.shape[0] * _transpose_blocks(part.shape[2]))
    return out


def _add_channels_first(part, out, dtype):
    """``out`` (Bc, C, S) += ``part`` (Bc, S, C)."""
    _parallel_for("_add_channels_first", dtype, _NO_INDEX, (part, out), part.shape[0] * _transpose_blocks(part.shape[1]))


def _position_blocks(positions):
    return -(-positions // POSITION_BLOCK)


def _transpose_blocks(size):
    return -(-size // TRANSPOSE_POSITIONS)


def _reordered_weight(weight, geom, dtype):
    """(C_out, C_in/G, *k) -> (G, C_out/G, K, C_in/G): the GEMMs' order of the columns."""
    w = np.asarray(weight, dtype=dtype).reshape(geom.groups, geom.out_channels_per_group,
                                                geom.in_channels_per_group, geom.kernel_volume)
    return np.ascontiguousarray(w.transpose(0, 1, 3, 2))


def _layout(geom, batch, positions, dtype):
    """An empty (Bc, G, P, K, C_in/G) array: the columns or column gradients of a chunk."""
    return np.empty((batch, geom.groups, positions, geom.kernel_volume, geom.in_channels_per_group), dtype=dtype)


def _gemm_view(a, geom):
    """A (Bc, G, P, K, C_in/G) array as (Bc, G, K * C_in/G, P): the GEMMs' transposed operand."""
    return a.reshape(a.shape[0], geom.groups, a.shape[2], -1).transpose(0, 1, 3, 2)


def _channel_block(channels, batch):
    """The channels of one scatter job: as many as leave about one job a thread (every job walks
    the whole sampling plan), a multiple of CHANNEL_BLOCK. Each input-gradient element gets its
    additions in the same order whatever the blocks, so this may follow the thread count."""
    per_sample = max(1, -(-cpu.num_threads() // batch))
    return -(-(-(-channels // per_sample)) // CHANNEL_BLOCK) * CHANNEL_BLOCK


def _columns(xcl, mask, plan, geom, dtype):
    batch, positions = plan.index.shape[0], plan.index.shape[3]
    columns = _layout(geom, batch, positions, dtype)
    m, has_mask, runs = _mask_runs(mask, plan, geom, dtype)
    _parallel_for("_im2col_cl", dtype, plan.index.dtype,
                  (xcl, m, has_mask, runs, plan.index, plan.weight, columns, 0, 0), batch * _position_blocks(positions))
    return columns


def _mask_runs(mask, plan, geom, dtype):
    """``cpu._mask_args``' mask (1 without one: the kernels multiply by it whether or not there is
    one) and flag, and the channel runs (``_channel_runs``) of ``plan``'s offset groups and of the
    mask's groups (one without a mask)."""
    m, has_mask, mask_groups = cpu._mask_args(mask, geom, dtype)
    return m, has_mask, _channel_runs(geom.in_channels, plan.index.shape[1], mask_groups, geom.groups)


def _workspace(geom, dtype, *, columns, column_grads, dweight, grads, input_copy, grad_copy):
    """cpu/numba's chunking, with this algorithm's per-sample copies: ``input_copy`` of the input
    (the channels-last one, and the staged one where the staging converts or gathers first) and
    the channels-last input gradient where ``grad_copy``. None where one sample's copies and one
    position's work exceed the limit."""
    copies = int(input_copy) + int(grad_copy)
    try:
        return cpu._Workspace(geom, dtype, columns=columns, column_grads=column_grads, dweight=dweight,
                              grads=grads, input_copy=bool(input_copy), copies=copies)
    except MemoryError:
        return None


def _forward_parts(xcl, mask, plan, w_t, bias_row, geom, chunk, y, dtype):
    """A chunk's forward in parts of a sample's positions, each part's columns, GEMM and output
    store in a row on one thread, while its columns are still in the caches."""
    batch, positions = chunk.batch, chunk.positions
    units = _position_blocks(positions)
    # By the positions alone, not the batch: BLAS's bits may depend on the GEMM's rows, and a
    # sample's result does not depend on the samples beside it. So a sample of fewer than
    # 2 * _PART_UNITS blocks is one part, on one thread (smaller parts made 14x14, C=256 1.29x
    # slower at batch 8 and 0.86x at batch 1).
    edges = cpu._blocks(units, least=_PART_UNITS)
    parts = len(edges) - 1
    m, has_mask, runs = _mask_runs(mask, plan, geom, dtype)
    im2col = cpu._compiled_kernel("_im2col_cl", dtype, plan.index.dtype)

    def part(i):
        b, k = divmod(i, parts)
        q0, q1 = edges[k] * POSITION_BLOCK, min(edges[k + 1] * POSITION_BLOCK, positions)
        columns = _layout(geom, 1, q1 - q0, dtype)  # a part's own: it stays in the caches
        im2col(xcl, m, has_mask, runs, plan.index, plan.weight, columns, b, q0, b * units + edges[k],
               b * units + edges[k + 1])
        y_t = np.matmul(columns[0].reshape(geom.groups, q1 - q0, -1), w_t)  # (G, rows, C_out/G)
        # Transposed into place with the bias (numpy's strided copy of a part still in the caches
        # was as fast as a Numba kernel's, and compiles nothing)
        target = y[chunk.b0 + b, :, :, chunk.q0 + q0:chunk.q0 + q1]
        if bias_row is not None:
            np.add(y_t.transpose(0, 2, 1), bias_row.reshape(geom.groups, -1, 1), out=target)
        else:  # a copy, not + 0: that would turn -0 into +0
            target[...] = y_t.transpose(0, 2, 1)

    cpu._run_parts(part, batch * parts)


def conv_forward(x, weight, offset, mask, bias, geom, out=None):
    """``cpu.conv_forward``'s contract, computed channels-last."""
    with cpu._single_threaded_blas:
        return _conv_forward(x, weight, offset, mask, bias, geom, out)


def _conv_forward(x, weight, offset, mask, bias, geom, out):
    dtype = cpu.compute_dtype(x.dtype)
    space = _workspace(geom, dtype, columns=True, column_grads=False, dweight=False, grads=False,
                       input_copy=1 + cpu._needs_copy(x, dtype), grad_copy=False)
    if space is None:  # a sample's channels-last copy does not fit: cpu/numba's loops, without it
        return cpu._conv_forward(x, weight, offset, mask, bias, geom, out)
    # The GEMM's output is (P, C_out/G) per conv group, rows of the columns times the weight's
    # transpose: OpenBLAS took 2.6-2.8 ms for it where the (C_out/G, P) product through the
    # columns' transpose took 3.2-3.3 (benchmarks/README.md, "CPU algorithms").
    w_t = _reordered_weight(weight, geom, dtype).reshape(geom.groups, geom.out_channels_per_group, -1).transpose(0, 2, 1)
    bias_row = None if bias is None else np.asarray(bias, dtype=dtype).reshape(-1)
    y, into_out = cpu._output(out, geom, dtype, (x, weight, offset, mask, bias))
    staged = None
    for chunk in space.chunks():
        if staged is None or staged[0] != (chunk.b0, chunk.b1):
            staged = None  # free the last copy first
            staged = ((chunk.b0, chunk.b1), _channels_last(cpu._stage(x, chunk, dtype, positions=False), dtype))
        off = None if offset is None else cpu._stage(offset, chunk, dtype)
        msk = None if mask is None else cpu._stage(mask, chunk, dtype)
        plan = cpu._Plan(geom, chunk, off, False, dtype)
        _forward_parts(staged[1], msk, plan, w_t, bias_row, geom, chunk, y, dtype)
        del plan, off, msk  # before the next chunk allocates its own
    y = y.reshape(geom.y_shape)
    return out if into_out else y.astype(x.dtype, copy=False)


def conv_backward(grad_output, x, weight, offset, mask, geom, wanted, bias=None):
    """``cpu.conv_backward``'s contract, computed channels-last."""
    with cpu._single_threaded_blas:
        return _conv_backward(grad_output, x, weight, offset, mask, geom, wanted, bias)


def _conv_backward(grad_output, x, weight, offset, mask, geom, wanted, bias):
    dtype = cpu.compute_dtype(grad_output.dtype)
    out_dtype = grad_output.dtype
    need_input, need_weight = "input" in wanted, "weight" in wanted
    need_offset = "offset" in wanted and offset is not None
    need_mask = "mask" in wanted and mask is not None
    need_grads = need_input or need_offset or need_mask
    need_x = need_weight or need_offset or need_mask
    space = _workspace(geom, dtype, columns=need_weight, column_grads=need_grads, dweight=need_offset,
                       grads=need_offset or need_mask, input_copy=need_x and 1 + cpu._needs_copy(x, dtype),
                       grad_copy=need_input)
    if space is None:  # a sample's channels-last copies do not fit: cpu/numba's loops, without them
        return cpu._conv_backward(grad_output, x, weight, offset, mask, geom, wanted, bias)
    w = _reordered_weight(weight, geom, dtype).reshape(geom.groups, geom.out_channels_per_group, -1)
    grad_x = np.zeros((geom.batch, geom.in_channels, geom.input_size), dtype=dtype) if need_input else None
    grad_w = np.zeros(w.shape, dtype=np.float64) if need_weight else None
    grad_off, grad_m = cpu._offset_mask_accumulators(geom, need_offset, need_mask)
    staged = None
    for chunk in space.chunks():
        batch, positions = chunk.batch, chunk.positions
        if need_x and (staged is None or staged[0] != (chunk.b0, chunk.b1)):
            staged = None  # free the last copy first
            staged = ((chunk.b0, chunk.b1), _channels_last(cpu._stage(x, chunk, dtype, positions=False), dtype))
        xcl = None if staged is None else staged[1]
        off = None if offset is None else cpu._stage(offset, chunk, dtype)
        msk = None if mask is None else cpu._stage(mask, chunk, dtype)
        gy = cpu._stage(grad_output, chunk, dtype).reshape(batch, geom.groups, geom.out_channels_per_group, positions)
        plan = cpu._Plan(geom, chunk, off, need_offset, dtype)
        if need_weight:
            columns = _columns(xcl, msk, plan, geom, dtype)
            cpu._add_weight_gradient(grad_w, gy, _gemm_view(columns, geom))
            del columns
        if not need_grads:
            del plan, off, msk, gy
            continue
        column_grads = _layout(geom, batch, positions, dtype)
        cpu._matmul(gy.transpose(0, 1, 3, 2), w[None],
                    column_grads.reshape(batch, geom.groups, positions, -1))
        m, has_mask, runs = _mask_runs(msk, plan, geom, dtype)
        if need_input:
            gxcl = np.zeros((batch, geom.input_size, geom.in_channels), dtype=dtype)
            block = _channel_block(geom.in_channels, batch)
            _parallel_for("_col2im_cl", dtype, plan.index.dtype,
                          (column_grads, m, has_mask, runs, plan.index, plan.weight, block, gxcl),
                          batch * -(-geom.in_channels // block))
            _add_channels_first(gxcl, grad_x[chunk.b0:chunk.b1], dtype)
            del gxcl
        if need_offset or need_mask:
            g_off, g_m = cpu._chunk_rows(grad_off, chunk), cpu._chunk_rows(grad_m, chunk)
            _parallel_for("_offset_mask_grads_cl", dtype, plan.index.dtype, (
                xcl, column_grads, m, has_mask, runs, plan.index, plan.weight, plan.dweight, geom.ndim, need_offset,
                need_mask, g_off, g_m), batch * _position_blocks(positions))
            cpu._store_chunk_rows(grad_off, g_off, chunk)
            cpu._store_chunk_rows(grad_m, g_m, chunk)
            del g_off, g_m
        del plan, column_grads, off, msk, gy  # before the next chunk allocates its own
    if need_weight:  # (G, C_out/G, K, C_in/G) -> the weight's own order
        grad_w = grad_w.reshape(geom.groups, geom.out_channels_per_group, geom.kernel_volume,
                                geom.in_channels_per_group).transpose(0, 1, 3, 2)
    return cpu._gradients(grad_x, grad_w, grad_off, grad_m, geom, bias, out_dtype)
