"""Slow, obviously-correct float64 NumPy reference: the semantics of DESIGN.md section 1 in code.

Every function casts its array arguments to float64 and returns float64. Inputs are assumed
valid (shapes are not checked beyond what NumPy itself checks). Nothing here imports the rest
of dcn_cupy, so the backends can be validated against it independently.
"""

import itertools

import numpy as np

__all__ = ["deform_conv", "deform_conv_transpose", "mask_softmax", "mask_sigmoid"]


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

    Yields (indices, weight) for each of the 2^N corners: `indices` is a list of N integer
    arrays (clipped into range so they can always be used for indexing) and `weight` the
    interpolation weight, which is 0 for a corner outside [0, S_a-1], for a position with a
    coordinate <= -1 or >= S_a, and for a position with a non-finite coordinate.
    """
    inside = np.ones(np.shape(pos[0]), dtype=bool)
    for p, s in zip(pos, size):
        with np.errstate(invalid="ignore"):
            inside &= np.isfinite(p) & (p > -1) & (p < s)
    safe = [np.where(inside, p, 0.0) for p in pos]
    low = [np.floor(p) for p in safe]
    frac = [p - lo for p, lo in zip(safe, low)]
    for bits in itertools.product((0, 1), repeat=len(pos)):
        weight = inside.astype(np.float64)
        indices = []
        for a, bit in enumerate(bits):
            i = low[a] + bit
            weight = weight * (frac[a] if bit else 1.0 - frac[a]) * ((i >= 0) & (i <= size[a] - 1))
            indices.append(np.clip(i, 0, size[a] - 1).astype(np.intp))
        yield indices, weight


def _grid(axis, n, values):
    """`values` (1-D, along spatial axis `axis`) reshaped to broadcast against (B, C, *spatial)."""
    shape = [1] * (2 + n)
    shape[2 + axis] = len(values)
    return np.asarray(values, dtype=np.float64).reshape(shape)


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
    B, C_in, S = x.shape[0], x.shape[1], x.shape[2:]
    C_out, k = w.shape[0], w.shape[2:]
    K = int(np.prod(k))
    Q = tuple((S[a] + 2 * p[a] - d[a] * (k[a] - 1) - 1) // s[a] + 1 for a in range(n))

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
        for indices, cw in _corners(pos, S):
            sampled += cw * x[(b_idx, c_idx) + tuple(indices)]
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
        for indices, cw in _corners(pos, out):
            np.add.at(y, (b_idx, c_idx) + tuple(indices), cw * v)
    if bias is not None:
        y += _as_f64(bias).reshape((1, C_out) + (1,) * n)
    return y[0] if unbatched else y


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
