"""Slow, obviously-correct float64 NumPy reference: the semantics of DESIGN.md section 1 in code.

Every function casts its array arguments to float64 and returns float64. Inputs are assumed
valid (shapes are not checked beyond what NumPy itself checks). Nothing here imports the rest
of dcn_cupy, so the backends can be validated against it independently.
"""

import itertools

import numpy as np

__all__ = ["deform_conv", "deform_conv_transpose", "deform_conv_backward",
           "deform_conv_transpose_backward", "mask_softmax", "mask_sigmoid"]


def _ntuple(value, n):
    """An int or an n-sequence of ints as an n-tuple of ints."""
    if np.ndim(value) == 0:
        return (int(value),) * n
    value = tuple(int(v) for v in value)
    if len(value) != n:
        raise ValueError(f"expected an int or a {n}-tuple, got {value}")
    return value


def _as_f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def _batched(n, x, offset, mask):
    """Add a batch axis to x, offset and mask when x is unbatched; returns them and the flag."""
    if x.ndim == n + 1:
        return (x[None], None if offset is None else offset[None],
                None if mask is None else mask[None], True)
    return x, offset, mask, False


def _corners(pos, size):
    """N-linear interpolation corners of positions `pos` (a list of N same-shaped float arrays).

    Yields (indices, weight, slopes) for each of the 2^N corners floor(P) + bits: `indices` is
    a list of N integer arrays (clipped into range so they can always be used for indexing),
    `weight` the interpolation weight and `slopes[a]` its derivative along axis a. Both are 0
    for a corner outside [0, S_a-1] and for a position with a non-finite coordinate or a
    coordinate outside [-1, S_a). A coordinate of exactly -1 keeps its corners -1 (outside)
    and 0 (weight 0, slope 1): the value there is 0 and the derivative the one-sided one, as
    in torchvision's kernels; below -1 or from S_a on both corners are outside anyway.

    A corner whose weight (slope) is exactly 0 must contribute nothing, not 0 * value: use
    `_weighted` to apply them.
    """
    inside = np.ones(np.shape(pos[0]), dtype=bool)
    for p, s in zip(pos, size):
        with np.errstate(invalid="ignore"):
            inside &= np.isfinite(p) & (p >= -1) & (p < s)
    safe = [np.where(inside, p, 0.0) for p in pos]
    low = [np.floor(p) for p in safe]
    frac = [p - lo for p, lo in zip(safe, low)]
    for bits in itertools.product((0, 1), repeat=len(pos)):
        on_grid = inside.copy()
        factors, indices = [], []
        for a, bit in enumerate(bits):
            i = low[a] + bit
            on_grid &= (i >= 0) & (i <= size[a] - 1)
            factors.append(frac[a] if bit else 1.0 - frac[a])
            indices.append(np.clip(i, 0, size[a] - 1).astype(np.intp))
        weight = np.where(on_grid, np.prod(factors, axis=0), 0.0)
        slopes = []
        for a, bit in enumerate(bits):
            others = [f for b, f in enumerate(factors) if b != a]
            slope = (1.0 if bit else -1.0) * (np.prod(others, axis=0) if others else 1.0)
            slopes.append(np.where(on_grid, slope, 0.0))
        yield indices, weight, slopes


def _product_where(a, b, where):
    """a * b where `where` holds, exactly 0 elsewhere (never 0 * inf = nan there)."""
    a, b, where = np.broadcast_arrays(a, b, where)
    return np.multiply(a, b, out=np.zeros(a.shape), where=where)


def _weighted(weight, value):
    """weight * value where weight != 0, exactly 0 elsewhere: a zero weight reads nothing."""
    return _product_where(weight, value, weight != 0)


def _grid(axis, n, values):
    """`values` (1-D, along spatial axis `axis`) reshaped to broadcast against (B, C, *spatial)."""
    shape = [1] * (2 + n)
    shape[2 + axis] = len(values)
    return np.asarray(values, dtype=np.float64).reshape(shape)


def _conv_forward_on_grid(x, w, off, m, s, p, d, groups, Q):
    """The (batched) deformable convolution of x evaluated on the output grid Q, no bias."""
    n = w.ndim - 2
    B, C_in, S = x.shape[0], x.shape[1], x.shape[2:]
    C_out, k = w.shape[0], w.shape[2:]
    K = int(np.prod(k))

    # Per-input-channel offset and mask groups.
    chan = np.arange(C_in)
    if off is not None:
        G_o = off.shape[1] // (K * n)
        off = off.reshape((B, G_o, K, n) + Q)
        go = chan // (C_in // G_o)
    if m is not None:
        G_m = m.shape[1] // K
        m = m.reshape((B, G_m, K) + Q)
        gm = chan // (C_in // G_m)

    b_idx = np.arange(B).reshape((B, 1) + (1,) * n)
    c_idx = chan.reshape((1, C_in) + (1,) * n)

    # cols[b, c, t, q] = m[b, gm(c), t, q] * sample(x[b, c], position of tap t at q)
    cols = np.zeros((B, C_in, K) + Q)
    for t, tap in enumerate(np.ndindex(*k)):
        pos = []
        for a in range(n):
            base = _grid(a, n, np.arange(Q[a]) * s[a] - p[a] + tap[a] * d[a])
            shift = off[:, go, t, a] if off is not None else 0.0  # (B, C_in, *Q)
            pos.append(np.broadcast_to(base + shift, (B, C_in) + Q))
        sampled = np.zeros((B, C_in) + Q)
        for indices, cw, _ in _corners(pos, S):
            sampled += _weighted(cw, x[(b_idx, c_idx) + tuple(indices)])
        if m is not None:
            sampled = sampled * m[:, gm, t]
        cols[:, :, t] = sampled

    # y[b, o, q] = sum over c in group(o), t of w[o, c - c0(o), t] * cols[b, c, t, q]
    wk = w.reshape(C_out, C_in // groups, K)
    y = np.zeros((B, C_out) + Q)
    ci, co = C_in // groups, C_out // groups
    for g in range(groups):
        y[:, g * co:(g + 1) * co] = np.einsum(
            "ock,bck...->bo...", wk[g * co:(g + 1) * co], cols[:, g * ci:(g + 1) * ci])
    return y


def deform_conv(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                dilation=1, groups=1):
    """Deformable convolution (N = weight.ndim - 2), see DESIGN.md section 1.

    input (B, C_in, *S) [or unbatched (C_in, *S)], weight (C_out, C_in/G, *k),
    offset (B, G_o*K*N, *Q), mask (B, G_m*K, *Q), bias (C_out,). Returns (B, C_out, *Q).
    """
    w = _as_f64(weight)
    n = w.ndim - 2
    x, off, m, unbatched = _batched(n, _as_f64(input), _as_f64(offset), _as_f64(mask))
    s, p, d = _ntuple(stride, n), _ntuple(padding, n), _ntuple(dilation, n)
    S, C_out, k = x.shape[2:], w.shape[0], w.shape[2:]
    Q = tuple((S[a] + 2 * p[a] - d[a] * (k[a] - 1) - 1) // s[a] + 1 for a in range(n))
    y = _conv_forward_on_grid(x, w, off, m, s, p, d, groups, Q)
    if bias is not None:
        y += _as_f64(bias).reshape((1, C_out) + (1,) * n)
    return y[0] if unbatched else y


def deform_conv_transpose(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                          output_padding=0, dilation=1, groups=1):
    """Transposed deformable convolution: the adjoint of deform_conv (plus bias), as a scatter.

    input z (B, C_in, *S) [or unbatched], weight (C_in, C_out/G, *k), offset (B, G_o*K*N, *S),
    mask (B, G_m*K, *S) on the input grid; offset/mask groups partition the output channels.
    Returns (B, C_out, *out) with out_a = (S_a-1)s_a - 2p_a + d_a(k_a-1) + 1 + op_a.
    """
    w = _as_f64(weight)
    n = w.ndim - 2
    z, off, m, unbatched = _batched(n, _as_f64(input), _as_f64(offset), _as_f64(mask))
    s, p, d = _ntuple(stride, n), _ntuple(padding, n), _ntuple(dilation, n)
    op = _ntuple(output_padding, n)
    B, C_in, S = z.shape[0], z.shape[1], z.shape[2:]
    k = w.shape[2:]
    K = int(np.prod(k))
    C_out = w.shape[1] * groups
    out = tuple((S[a] - 1) * s[a] - 2 * p[a] + d[a] * (k[a] - 1) + 1 + op[a] for a in range(n))

    # Per-output-channel offset and mask groups.
    chan = np.arange(C_out)
    if off is not None:
        G_o = off.shape[1] // (K * n)
        off = off.reshape((B, G_o, K, n) + S)
        go = chan // (C_out // G_o)
    if m is not None:
        G_m = m.shape[1] // K
        m = m.reshape((B, G_m, K) + S)
        gm = chan // (C_out // G_m)

    b_idx = np.arange(B).reshape((B, 1) + (1,) * n)
    c_idx = chan.reshape((1, C_out) + (1,) * n)
    wk = w.reshape(C_in, C_out // groups, K)
    ci, co = C_in // groups, C_out // groups

    y = np.zeros((B, C_out) + out)
    for t, tap in enumerate(np.ndindex(*k)):
        # v[b, c, s] = m[b, gm(c), t, s] * sum over i in group(c) of w[i, c - c0(c), t] * z[b, i, s]
        v = np.zeros((B, C_out) + S)
        for g in range(groups):
            v[:, g * co:(g + 1) * co] = np.einsum(
                "io,bi...->bo...", wk[g * ci:(g + 1) * ci, :, t], z[:, g * ci:(g + 1) * ci])
        if m is not None:
            v = v * m[:, gm, t]
        pos = []
        for a in range(n):
            base = _grid(a, n, np.arange(S[a]) * s[a] - p[a] + tap[a] * d[a])
            shift = off[:, go, t, a] if off is not None else 0.0  # (B, C_out, *S)
            pos.append(np.broadcast_to(base + shift, (B, C_out) + S))
        for indices, cw, _ in _corners(pos, out):
            np.add.at(y, (b_idx, c_idx) + tuple(indices), _weighted(cw, v))
    if bias is not None:
        y += _as_f64(bias).reshape((1, C_out) + (1,) * n)
    return y[0] if unbatched else y


def _conv_gradients(grad_output, x, w, off, m, s, p, d, groups, Q):
    """Exact gradients of the (batched) deformable convolution onto the output grid Q.

    grad_output (B, C_out, *Q), x (B, C_in, *S), w (C_out, C_in/G, *k), off (B, G_o*K*N, *Q)
    or None, m (B, G_m*K, *Q) or None. Returns float64 (input, weight, offset, mask) gradients
    (offset / mask None when absent), following DESIGN.md section 1 term by term:

        column grad  cg[b,c,t,q]  = sum over o in group(c) of w[o, c - c0, t] * grad_output[b,o,q]
        input        grad_x[b,c,corner] += weight * m * cg        (corners with weight != 0)
        weight       grad_w[o,c-c0,t] = sum over b,q of grad_output * m * sample
        mask         grad_m[b,gm,t,q] = sum over c in gm of cg * sample
        offset       grad_off[b,go,t,a,q] = sum over c in go of m * cg * sum_corners slope_a * x

    A term with no corner of non-zero weight (slope) is exactly 0: a padding tap or a
    non-finite position has zero gradients whatever grad_output holds.
    """
    n = w.ndim - 2
    B, C_in, S = x.shape[0], x.shape[1], x.shape[2:]
    C_out, k = w.shape[0], w.shape[2:]
    K = int(np.prod(k))
    ci, co = C_in // groups, C_out // groups
    chan = np.arange(C_in)
    G_o = off.shape[1] // (K * n) if off is not None else 1
    G_m = m.shape[1] // K if m is not None else 1
    go, gm = chan // (C_in // G_o), chan // (C_in // G_m)
    off = None if off is None else off.reshape((B, G_o, K, n) + Q)
    m = None if m is None else m.reshape((B, G_m, K) + Q)
    wk = w.reshape(C_out, ci, K)
    b_idx = np.arange(B).reshape((B, 1) + (1,) * n)
    c_idx = chan.reshape((1, C_in) + (1,) * n)

    grad_x = np.zeros(x.shape)
    grad_w = np.zeros(wk.shape)
    grad_off = None if off is None else np.zeros(off.shape)
    grad_m = None if m is None else np.zeros(m.shape)
    for t, tap in enumerate(np.ndindex(*k)):
        pos = []
        for a in range(n):
            base = _grid(a, n, np.arange(Q[a]) * s[a] - p[a] + tap[a] * d[a])
            shift = off[:, go, t, a] if off is not None else 0.0
            pos.append(np.broadcast_to(base + shift, (B, C_in) + Q))
        mt = m[:, gm, t] if m is not None else np.ones((B, C_in) + Q)
        cg = np.zeros((B, C_in) + Q)
        for g in range(groups):
            cg[:, g * ci:(g + 1) * ci] = np.einsum(
                "oc,bo...->bc...", wk[g * co:(g + 1) * co, :, t], grad_output[:, g * co:(g + 1) * co])
        scaled = mt * cg
        sampled = np.zeros((B, C_in) + Q)
        used = np.zeros((B, C_in) + Q, dtype=bool)
        slope_sum = [np.zeros((B, C_in) + Q) for _ in range(n)]
        slope_used = [np.zeros((B, C_in) + Q, dtype=bool) for _ in range(n)]
        for indices, cw, slopes in _corners(pos, S):
            where = (b_idx, c_idx) + tuple(indices)
            value = x[where]
            sampled += _weighted(cw, value)
            used |= cw != 0
            np.add.at(grad_x, where, _weighted(cw, scaled))
            for a in range(n):
                slope_sum[a] += _weighted(slopes[a], value)
                slope_used[a] |= slopes[a] != 0
        cols = mt * sampled
        for g in range(groups):
            grad_w[g * co:(g + 1) * co, :, t] = np.einsum(
                "boq,bcq->oc", grad_output[:, g * co:(g + 1) * co].reshape(B, co, -1),
                cols[:, g * ci:(g + 1) * ci].reshape(B, ci, -1))
        if grad_m is not None:
            term = _product_where(cg, sampled, used)
            grad_m[:, :, t] = term.reshape((B, G_m, C_in // G_m) + Q).sum(axis=2)
        if grad_off is not None:
            for a in range(n):
                term = _product_where(scaled, slope_sum[a], slope_used[a])
                grad_off[:, :, t, a] = term.reshape((B, G_o, C_in // G_o) + Q).sum(axis=2)
    return (grad_x, grad_w.reshape(w.shape),
            None if grad_off is None else grad_off.reshape(B, -1, *Q),
            None if grad_m is None else grad_m.reshape(B, -1, *Q))


def deform_conv_backward(grad_output, input, weight, offset=None, mask=None, bias=None, stride=1,
                         padding=0, dilation=1, groups=1):
    """Exact gradients of deform_conv: a tuple (input, weight, offset, mask, bias), float64.

    The gradient of an argument that is None is None. At integer sampling positions the
    offset gradient uses the corners that floor selects (one-sided), including a coordinate of
    exactly -1 (corners -1 and 0), as torchvision's kernels do; see _corners.
    """
    w = _as_f64(weight)
    n = w.ndim - 2
    x, off, m, unbatched = _batched(n, _as_f64(input), _as_f64(offset), _as_f64(mask))
    gy = _as_f64(grad_output)
    gy = gy[None] if unbatched else gy
    s, p, d = _ntuple(stride, n), _ntuple(padding, n), _ntuple(dilation, n)
    gx, gw, goff, gm = _conv_gradients(gy, x, w, off, m, s, p, d, groups, gy.shape[2:])
    gb = None if bias is None else gy.sum(axis=(0,) + tuple(range(2, n + 2)))
    if unbatched:
        gx, goff, gm = gx[0], None if goff is None else goff[0], None if gm is None else gm[0]
    return gx, gw, goff, gm, gb


def deform_conv_transpose_backward(grad_output, input, weight, offset=None, mask=None, bias=None,
                                   stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    """Exact gradients of deform_conv_transpose: a tuple (input, weight, offset, mask, bias).

    By the duality of DESIGN.md section 1: the transposed op is z -> A^T z for the deformable
    convolution A on the transposed output grid, so its input gradient is A(grad_output) and
    its weight / offset / mask gradients are A's with input := grad_output and
    grad_output := z.
    """
    w = _as_f64(weight)
    n = w.ndim - 2
    z, off, m, unbatched = _batched(n, _as_f64(input), _as_f64(offset), _as_f64(mask))
    gy = _as_f64(grad_output)
    gy = gy[None] if unbatched else gy
    s, p, d = _ntuple(stride, n), _ntuple(padding, n), _ntuple(dilation, n)
    Q = z.shape[2:]
    # A's gradients with input := grad_output (the conv input grid) and grad_output := z.
    _, gw, goff, gm = _conv_gradients(z, gy, w, off, m, s, p, d, groups, Q)
    # A(grad_output) on the grid Q (which output_padding >= stride makes shorter than A's own).
    gz = _conv_forward_on_grid(gy, w, off, m, s, p, d, groups, Q)
    gb = None if bias is None else gy.sum(axis=(0,) + tuple(range(2, n + 2)))
    if unbatched:
        gz, goff, gm = gz[0], None if goff is None else goff[0], None if gm is None else gm[0]
    return gz, gw, goff, gm, gb


def mask_softmax(mask, kernel_size):
    """Softmax over the K taps of each mask group: view (B, G_m, K, *Q), softmax on axis 2."""
    m = _as_f64(mask)
    if np.ndim(kernel_size) == 0:
        K = int(kernel_size) ** (m.ndim - 2)
    else:
        K = int(np.prod(kernel_size))
    v = m.reshape((m.shape[0], m.shape[1] // K, K) + m.shape[2:])
    top = np.max(v, axis=2, keepdims=True) if K else 0.0
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(v - top)
    return (e / np.sum(e, axis=2, keepdims=True)).reshape(m.shape)


def mask_sigmoid(mask, scale=2.0):
    """scale * sigmoid(mask), computed without overflow."""
    m = _as_f64(mask)
    e = np.exp(-np.abs(m))
    return scale * np.where(m >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
