"""Validation of dcn_cupy.reference, the float64 NumPy spec of DESIGN.md section 1.

Ground truths: torch.nn.functional.conv*/conv_transpose* (zero offsets), integer-offset shifts,
the documented boundary rule, a literal scalar-loop transcription of the formula, and the
adjoint identity between deform_conv and deform_conv_transpose.
"""

import itertools
import math

import numpy as np
import pytest

from dcn_cupy import reference as ref


def _tuple(v, n):
    return (v,) * n if isinstance(v, int) else tuple(v)


def _rand(rng, *shape):
    return rng.standard_normal(shape)


def _q(S, k, s, p, d):
    return tuple((S[a] + 2 * p[a] - d[a] * (k[a] - 1) - 1) // s[a] + 1 for a in range(len(S)))


# --------------------------------------------------------------------------- torch, zero offsets

# (N, B, C_in, C_out, G, S, k, stride, padding, dilation)
CONV_CASES = [
    (1, 2, 3, 4, 1, (9,), (3,), 1, 0, 1),
    (1, 1, 4, 6, 2, (11,), (4,), 2, 3, 2),
    (1, 2, 6, 3, 3, (8,), (1,), 3, 0, 1),
    (2, 2, 3, 5, 1, (7, 6), (3, 3), 1, 1, 1),
    (2, 1, 4, 4, 2, (9, 8), (3, 2), (2, 1), (1, 0), (1, 2)),
    (2, 2, 6, 6, 6, (8, 9), (2, 3), 2, (0, 2), (3, 1)),
    (2, 1, 2, 3, 1, (5, 5), (5, 5), 1, 2, 1),
    (3, 1, 2, 3, 1, (5, 6, 4), (3, 2, 2), 1, 1, 1),
    (3, 2, 4, 2, 2, (7, 5, 6), (2, 3, 1), (2, 1, 3), (1, 0, 2), (2, 1, 1)),
]


def _torch_conv(n, x, w, b, s, p, d, g):
    torch = pytest.importorskip("torch")
    f = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d,
         3: torch.nn.functional.conv3d}[n]
    bt = None if b is None else torch.from_numpy(b)
    return f(torch.from_numpy(x), torch.from_numpy(w), bt, stride=s, padding=p, dilation=d,
             groups=g).numpy()


def _torch_conv_t(n, z, w, b, s, p, op, d, g):
    torch = pytest.importorskip("torch")
    f = {1: torch.nn.functional.conv_transpose1d, 2: torch.nn.functional.conv_transpose2d,
         3: torch.nn.functional.conv_transpose3d}[n]
    bt = None if b is None else torch.from_numpy(b)
    return f(torch.from_numpy(z), torch.from_numpy(w), bt, stride=s, padding=p,
             output_padding=op, dilation=d, groups=g).numpy()


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("zero_offset", [False, True])
def test_conv_matches_torch(case, zero_offset):
    pytest.importorskip("torch")
    n, B, ci, co, G, S, k, s, p, d = case
    rng = np.random.default_rng(hash(case) % 2**32)
    x = _rand(rng, B, ci, *S)
    w = _rand(rng, co, ci // G, *k)
    b = _rand(rng, co)
    Q = _q(S, k, _tuple(s, n), _tuple(p, n), _tuple(d, n))
    K = math.prod(k)
    G_o, G_m = (2 if ci % 2 == 0 else 1), ci
    offset = np.zeros((B, G_o * K * n, *Q)) if zero_offset else None
    mask = np.ones((B, G_m * K, *Q)) if zero_offset else None
    y = ref.deform_conv(x, w, offset, mask, b, stride=s, padding=p, dilation=d, groups=G)
    expected = _torch_conv(n, x, w, b, s, p, d, G)
    assert y.dtype == np.float64
    assert y.shape == expected.shape
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


# (N, B, C_in, C_out, G, S, k, stride, padding, output_padding, dilation)
CONV_T_CASES = [
    (1, 2, 3, 4, 1, (6,), (3,), 1, 0, 0, 1),
    (1, 1, 4, 6, 2, (5,), (4,), 2, 1, 1, 1),
    (1, 2, 2, 3, 1, (5,), (3,), 1, 0, 1, 2),          # dilation > stride, op >= stride
    (1, 1, 6, 3, 3, (4,), (2,), 3, 2, 2, 1),
    (2, 2, 3, 5, 1, (4, 5), (3, 3), 1, 1, 0, 1),
    (2, 1, 4, 4, 2, (5, 4), (3, 2), (2, 1), (1, 0), (1, 0), (1, 2)),
    (2, 1, 2, 4, 2, (4, 4), (3, 2), (1, 2), (2, 0), (2, 1), (3, 1)),  # op >= s on axis 0
    (2, 2, 6, 6, 6, (4, 3), (2, 3), 2, (0, 2), 1, (3, 1)),
    (3, 1, 2, 3, 1, (3, 4, 3), (3, 2, 2), 1, 1, 0, 1),
    (3, 2, 4, 2, 2, (3, 3, 2), (2, 3, 1), (2, 1, 3), (1, 0, 0), (1, 0, 2), (2, 2, 1)),
]


@pytest.mark.parametrize("case", CONV_T_CASES)
@pytest.mark.parametrize("zero_offset", [False, True])
def test_conv_transpose_matches_torch(case, zero_offset):
    pytest.importorskip("torch")
    n, B, ci, co, G, S, k, s, p, op, d = case
    rng = np.random.default_rng(hash(case) % 2**32)
    z = _rand(rng, B, ci, *S)
    w = _rand(rng, ci, co // G, *k)
    b = _rand(rng, co)
    K = math.prod(k)
    G_o, G_m = (2 if co % 2 == 0 else 1), co  # groups partition the output channels
    offset = np.zeros((B, G_o * K * n, *S)) if zero_offset else None
    mask = np.ones((B, G_m * K, *S)) if zero_offset else None
    y = ref.deform_conv_transpose(z, w, offset, mask, b, stride=s, padding=p, output_padding=op,
                                  dilation=d, groups=G)
    expected = _torch_conv_t(n, z, w, b, s, p, op, d, G)
    assert y.dtype == np.float64
    assert y.shape == expected.shape
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- integer offsets

def _shift2d(x, dy, dx, p):
    """Zero-pad x by p, then xs[..., i, j] = xp[..., i + dy, j + dx], zero outside.

    Shifting the padded image (not x itself) keeps samples that a shift brings from the padding
    into the image; convolve the result with padding 0.
    """
    x = np.pad(x, [(0, 0)] * (x.ndim - 2) + [(p[0], p[0]), (p[1], p[1])])
    H, W = x.shape[-2:]
    xs = np.zeros_like(x)
    for i in range(H):
        for j in range(W):
            if 0 <= i + dy < H and 0 <= j + dx < W:
                xs[..., i, j] = x[..., i + dy, j + dx]
    return xs


@pytest.mark.parametrize("dy,dx", [(1, -2), (-1, 0), (0, 3), (2, 2)])
@pytest.mark.parametrize("s,p,d", [(1, 1, 1), ((2, 1), (0, 2), (1, 2))])
def test_constant_integer_offset_is_shift(dy, dx, s, p, d):
    pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    B, ci, co, G, S, k = 2, 4, 6, 2, (7, 8), (3, 2)
    x = _rand(rng, B, ci, *S)
    w = _rand(rng, co, ci // G, *k)
    Q = _q(S, k, _tuple(s, 2), _tuple(p, 2), _tuple(d, 2))
    K = math.prod(k)
    G_o = 2
    offset = np.zeros((B, G_o, K, 2, *Q))
    offset[:, :, :, 0] = dy
    offset[:, :, :, 1] = dx
    y = ref.deform_conv(x, w, offset.reshape(B, -1, *Q), stride=s, padding=p, dilation=d,
                        groups=G)
    expected = _torch_conv(2, _shift2d(x, dy, dx, _tuple(p, 2)), w, None, s, 0, d, G)
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tap", [0, 4, 5])
def test_integer_offset_on_one_tap_moves_only_that_tap(tap):
    pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    B, ci, co, S, k = 2, 3, 4, (6, 7), (2, 3)
    dy, dx = 1, -2
    x = _rand(rng, B, ci, *S)
    w = _rand(rng, co, ci, *k)
    Q = _q(S, k, (1, 1), (1, 1), (1, 1))
    K = math.prod(k)
    offset = np.zeros((B, K, 2, *Q))
    offset[:, tap, 0] = dy
    offset[:, tap, 1] = dx
    y = ref.deform_conv(x, w, offset.reshape(B, -1, *Q), padding=1)
    only = np.zeros(K)
    only[tap] = 1
    w_tap = w * only.reshape(k)
    expected = (_torch_conv(2, x, w - w_tap, None, 1, 1, 1, 1)
                + _torch_conv(2, _shift2d(x, dy, dx, (1, 1)), w_tap, None, 1, 0, 1, 1))
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- boundary rule

def _sample_1d(x, position):
    """deform_conv with a 1x1 kernel of weight 1 samples x at `position` (one output)."""
    x = np.asarray(x, dtype=np.float64).reshape(1, 1, -1)
    w = np.ones((1, 1, 1))
    offset = np.zeros((1, 1, x.shape[-1]))
    offset[0, 0, 0] = position  # output 0 samples at 0 + offset
    return ref.deform_conv(x, w, offset)[0, 0, 0]


def test_boundary_rule_1d():
    x = np.array([2.0, -3.0, 5.0, 7.0])
    # Inside: linear interpolation.
    assert _sample_1d(x, 1.25) == pytest.approx(0.75 * -3.0 + 0.25 * 5.0, abs=1e-15)
    assert _sample_1d(x, 2.0) == 5.0
    # In (-1, 0): between the zero at -1 and x[0].
    for frac in [0.1, 0.5, 0.9]:
        assert _sample_1d(x, -frac) == pytest.approx((1 - frac) * x[0], abs=1e-15)
    # In (S-1, S): between x[S-1] and the zero at S.
    assert _sample_1d(x, 3.4) == pytest.approx(0.6 * x[3], abs=1e-15)
    # <= -1 or >= S: zero.
    for pos in [-1.0, -1.5, -7.0, 4.0, 4.2, 100.0]:
        assert _sample_1d(x, pos) == 0.0
    assert _sample_1d(x, -1 + 1e-9) == pytest.approx(1e-9 * x[0], rel=1e-6)
    # Non-finite: zero.
    for pos in [np.nan, np.inf, -np.inf]:
        assert _sample_1d(x, pos) == 0.0


def test_boundary_rule_2d_corner():
    # Position (-0.25, 2.5) in a 3x3 image: row -1 is outside, row 0 weight 0.75.
    x = np.arange(9.0).reshape(1, 1, 3, 3) + 1
    w = np.ones((1, 1, 1, 1))
    offset = np.zeros((1, 2, 3, 3))
    offset[0, :, 0, 0] = (-0.25, 2.5)
    y = ref.deform_conv(x, w, offset)
    assert y[0, 0, 0, 0] == pytest.approx(0.75 * 0.5 * x[0, 0, 0, 2], abs=1e-15)
    np.testing.assert_array_equal(y.ravel()[1:], x.ravel()[1:])


def test_non_finite_offsets_give_zero_contribution():
    rng = np.random.default_rng(3)
    B, ci, co, S, k = 1, 2, 3, (5, 6), (3, 3)
    x = _rand(rng, B, ci, *S)
    w = _rand(rng, co, ci, *k)
    b = _rand(rng, co)
    Q = _q(S, k, (1, 1), (1, 1), (1, 1))
    K = 9
    offset = rng.uniform(-1, 1, (B, K, 2, *Q))
    mask = rng.uniform(0, 1, (B, K, *Q))
    bad = offset.copy()
    bad[0, 2, 0, 1, 1] = np.nan
    bad[0, 5, 1, 3, 4] = np.inf
    bad[0, 7, 0, 0, 0] = -np.inf
    bad[0, 7, 1, 0, 0] = np.nan
    masked = mask.copy()
    masked[0, 2, 1, 1] = 0
    masked[0, 5, 3, 4] = 0
    masked[0, 7, 0, 0] = 0
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        y = ref.deform_conv(x, w, bad.reshape(B, -1, *Q), mask, b, padding=1)
    assert np.all(np.isfinite(y))
    expected = ref.deform_conv(x, w, offset.reshape(B, -1, *Q), masked, b, padding=1)
    np.testing.assert_allclose(y, expected, rtol=1e-13, atol=1e-13)
    # Transposed: a non-finite position scatters nothing.
    z = _rand(rng, B, co, *Q)
    wt = _rand(rng, co, ci, *k)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        yt = ref.deform_conv_transpose(z, wt, bad.reshape(B, -1, *Q), mask, padding=1)
    assert np.all(np.isfinite(yt))
    expected_t = ref.deform_conv_transpose(z, wt, offset.reshape(B, -1, *Q), masked, padding=1)
    np.testing.assert_allclose(yt, expected_t, rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------- literal formula

def _literal_deform_conv2d(x, w, offset, mask, bias, s, p, d, G):
    """Scalar loops straight from DESIGN.md section 1, 2D only."""
    B, ci, H, W = x.shape
    co, _, kh, kw = w.shape
    K = kh * kw
    Qh = (H + 2 * p[0] - d[0] * (kh - 1) - 1) // s[0] + 1
    Qw = (W + 2 * p[1] - d[1] * (kw - 1) - 1) // s[1] + 1
    G_o = offset.shape[1] // (2 * K)
    G_m = mask.shape[1] // K

    def at(b, c, i, j):
        return x[b, c, i, j] if 0 <= i < H and 0 <= j < W else 0.0

    def sample(b, c, py, px):
        if not (math.isfinite(py) and math.isfinite(px)):
            return 0.0
        if py <= -1 or py >= H or px <= -1 or px >= W:
            return 0.0
        y0, x0 = math.floor(py), math.floor(px)
        fy, fx = py - y0, px - x0
        return ((1 - fy) * (1 - fx) * at(b, c, y0, x0) + (1 - fy) * fx * at(b, c, y0, x0 + 1)
                + fy * (1 - fx) * at(b, c, y0 + 1, x0) + fy * fx * at(b, c, y0 + 1, x0 + 1))

    y = np.zeros((B, co, Qh, Qw))
    for b, o, qh, qw in itertools.product(range(B), range(co), range(Qh), range(Qw)):
        g = o // (co // G)
        acc = bias[o]
        for c in range(g * (ci // G), (g + 1) * (ci // G)):
            go, gm = c // (ci // G_o), c // (ci // G_m)
            for th, tw in itertools.product(range(kh), range(kw)):
                t = th * kw + tw
                py = qh * s[0] - p[0] + th * d[0] + offset[b, (go * K + t) * 2 + 0, qh, qw]
                px = qw * s[1] - p[1] + tw * d[1] + offset[b, (go * K + t) * 2 + 1, qh, qw]
                acc += (w[o, c - g * (ci // G), th, tw] * mask[b, gm * K + t, qh, qw]
                        * sample(b, c, py, px))
        y[b, o, qh, qw] = acc
    return y


@pytest.mark.parametrize("G,G_o,G_m", [(1, 1, 1), (2, 4, 1), (2, 1, 2), (1, 2, 4)])
def test_matches_literal_formula_2d(G, G_o, G_m):
    rng = np.random.default_rng(10 + G * 100 + G_o * 10 + G_m)
    B, ci, co, S, k, s, p, d = 2, 4, 4, (5, 6), (2, 3), (2, 1), (1, 2), (2, 1)
    Q = _q(S, k, s, p, d)
    K = math.prod(k)
    x = _rand(rng, B, ci, *S)
    w = _rand(rng, co, ci // G, *k)
    b = _rand(rng, co)
    offset = rng.uniform(-2.5, 2.5, (B, G_o * K * 2, *Q))
    mask = rng.uniform(-1, 1, (B, G_m * K, *Q))
    y = ref.deform_conv(x, w, offset, mask, b, stride=s, padding=p, dilation=d, groups=G)
    expected = _literal_deform_conv2d(x, w, offset, mask, b, s, p, d, G)
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- adjoint identity

# (N, B, C_x, C_z, G, G_o, G_m, S_z, k, stride, padding, output_padding, dilation)
# C_x: channels of deform_conv's input (= transposed output); C_z: its output (= transposed
# input); S_z: the transposed input grid (= deform_conv's output grid). output_padding < stride.
ADJOINT_CASES = [
    (1, 2, 4, 2, 1, 2, 1, (7,), (3,), 1, 1, 0, 1),
    (1, 3, 6, 4, 2, 3, 2, (5,), (4,), 2, 2, 1, 2),
    (2, 2, 4, 6, 2, 4, 2, (4, 7), (3, 2), (2, 1), (1, 0), (1, 0), (1, 2)),
    (2, 1, 6, 3, 3, 2, 3, (5, 5), (2, 3), 1, (0, 2), 0, (2, 1)),
    (2, 2, 4, 4, 4, 1, 4, (3, 4), (3, 3), (3, 2), 1, (2, 1), 1),
    (3, 1, 4, 2, 2, 2, 4, (4, 3, 4), (2, 3, 2), (1, 2, 1), (1, 0, 1), (0, 1, 0), (2, 1, 1)),
    (3, 2, 2, 4, 1, 1, 2, (2, 3, 3), (3, 2, 2), 2, (1, 1, 0), 1, (1, 2, 1)),
]


@pytest.mark.parametrize("case", ADJOINT_CASES)
def test_adjoint_identity(case):
    n, B, cx, cz, G, G_o, G_m, S_z, k, s, p, op, d = case
    s, p, op, d = (_tuple(v, n) for v in (s, p, op, d))
    rng = np.random.default_rng(hash(case) % 2**32)
    K = math.prod(k)
    # The transposed output grid S is the conv input grid; the conv maps it back onto S_z.
    S = tuple((S_z[a] - 1) * s[a] - 2 * p[a] + d[a] * (k[a] - 1) + 1 + op[a] for a in range(n))
    assert _q(S, k, s, p, d) == S_z
    x = _rand(rng, B, cx, *S)
    z = _rand(rng, B, cz, *S_z)
    w = _rand(rng, cz, cx // G, *k)
    # Non-integer offsets, some of them pushing samples outside the image.
    offset = rng.uniform(-2.0, 2.0, (B, G_o * K * n, *S_z))
    mask = rng.uniform(-1.5, 1.5, (B, G_m * K, *S_z))
    y = ref.deform_conv(x, w, offset, mask, None, stride=s, padding=p, dilation=d, groups=G)
    assert y.shape == z.shape
    xt = ref.deform_conv_transpose(z, w, offset, mask, None, stride=s, padding=p,
                                   output_padding=op, dilation=d, groups=G)
    assert xt.shape == x.shape
    lhs, rhs = np.vdot(y, z), np.vdot(x, xt)
    assert abs(lhs - rhs) <= 1e-10 * max(abs(lhs), np.abs(y).sum() * np.abs(z).max())
    # Bias is simply added afterwards.
    bias = _rand(rng, cx)
    xtb = ref.deform_conv_transpose(z, w, offset, mask, bias, stride=s, padding=p,
                                    output_padding=op, dilation=d, groups=G)
    np.testing.assert_allclose(xtb, xt + bias.reshape((1, cx) + (1,) * n), rtol=1e-13,
                               atol=1e-13)


def test_adjoint_identity_output_padding_beyond_stride():
    # d > s allows op >= s: the conv over the padded output then has extra output positions that
    # the transposed input does not have; the transposed conv is the adjoint of the conv
    # restricted to the first S_z positions.
    rng = np.random.default_rng(7)
    B, cx, cz, k, s, p, op, d = 2, 2, 3, (3, 2), (1, 2), (1, 0), (1, 2), (2, 3)
    S_z = (4, 3)
    out = tuple((S_z[a] - 1) * s[a] - 2 * p[a] + d[a] * (k[a] - 1) + 1 + op[a] for a in range(2))
    Q = _q(out, k, s, p, d)
    assert Q[0] > S_z[0] and Q[1] > S_z[1]
    K = math.prod(k)
    x = _rand(rng, B, cx, *out)
    z = _rand(rng, B, cz, *S_z)
    w = _rand(rng, cz, cx, *k)
    offset = rng.uniform(-2.0, 2.0, (B, K * 2, *Q))
    mask = rng.uniform(-1.5, 1.5, (B, K, *Q))
    sub = (slice(None), slice(None), slice(0, S_z[0]), slice(0, S_z[1]))
    y = ref.deform_conv(x, w, offset, mask, stride=s, padding=p, dilation=d)[sub]
    xt = ref.deform_conv_transpose(z, w, offset[sub], mask[sub], stride=s, padding=p,
                                   output_padding=op, dilation=d)
    assert xt.shape == x.shape
    lhs, rhs = np.vdot(y, z), np.vdot(x, xt)
    assert abs(lhs - rhs) <= 1e-10 * max(abs(lhs), np.abs(y).sum() * np.abs(z).max())


# --------------------------------------------------------------------------- mask activations

@pytest.mark.parametrize("kernel_size,G_m,Q", [(3, 2, (4, 5)), ((2, 3), 3, (3, 3)), (5, 1, (7,)),
                                               ((2, 2, 1), 2, (2, 3, 2))])
def test_mask_softmax(kernel_size, G_m, Q):
    scipy_special = pytest.importorskip("scipy.special")
    rng = np.random.default_rng(4)
    K = math.prod(kernel_size) if isinstance(kernel_size, tuple) else kernel_size ** len(Q)
    B = 2
    m = rng.standard_normal((B, G_m * K, *Q)) * 5
    m[0, 0] += 800.0  # would overflow a naive exp
    y = ref.mask_softmax(m, kernel_size)
    assert y.shape == m.shape and y.dtype == np.float64
    assert np.all(np.isfinite(y))
    v = y.reshape(B, G_m, K, *Q)
    np.testing.assert_allclose(v.sum(axis=2), 1.0, rtol=1e-13)
    expected = scipy_special.softmax(m.reshape(B, G_m, K, *Q), axis=2).reshape(m.shape)
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("scale", [2.0, 1.0, 0.5])
def test_mask_sigmoid(scale):
    rng = np.random.default_rng(5)
    m = rng.standard_normal((2, 9, 3, 4)) * 4
    y = ref.mask_sigmoid(m, scale) if scale != 2.0 else ref.mask_sigmoid(m)
    np.testing.assert_allclose(y, scale / (1 + np.exp(-m)), rtol=1e-14)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        extreme = ref.mask_sigmoid(np.array([-1e4, -800.0, 0.0, 800.0, 1e4]), scale)
    np.testing.assert_allclose(extreme, [0.0, 0.0, scale / 2, scale, scale], atol=1e-300)


# --------------------------------------------------------------------------- shapes

@pytest.mark.parametrize("n", [1, 2, 3])
def test_batch_zero(n):
    rng = np.random.default_rng(6)
    S, k = (5,) * n, (3,) * n
    K = 3 ** n
    Q = _q(S, k, (2,) * n, (1,) * n, (1,) * n)
    x = np.zeros((0, 4, *S))
    w = _rand(rng, 6, 2, *k)
    y = ref.deform_conv(x, w, np.zeros((0, 2 * K * n, *Q)), np.zeros((0, 4 * K, *Q)),
                        _rand(rng, 6), stride=2, padding=1, groups=2)
    assert y.shape == (0, 6, *Q) and y.dtype == np.float64
    assert ref.deform_conv(x, w, stride=2, padding=1, groups=2).shape == (0, 6, *Q)
    z = np.zeros((0, 6, *Q))
    wt = _rand(rng, 6, 2, *k)
    out = tuple((Q[a] - 1) * 2 - 2 + 2 + 1 + 1 for a in range(n))
    yt = ref.deform_conv_transpose(z, wt, np.zeros((0, 2 * K * n, *Q)), np.zeros((0, K, *Q)),
                                   _rand(rng, 4), stride=2, padding=1, output_padding=1,
                                   groups=2)
    assert yt.shape == (0, 4, *out) and yt.dtype == np.float64
    assert ref.mask_softmax(np.zeros((0, 2 * K, *Q)), 3).shape == (0, 2 * K, *Q)
    assert ref.mask_sigmoid(np.zeros((0, K, *Q))).shape == (0, K, *Q)


def test_unbatched_and_dtype_casting():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 6, 5)).astype(np.float32)
    w = rng.standard_normal((2, 3, 3, 2)).astype(np.float32)
    Q = _q((6, 5), (3, 2), (1, 1), (0, 0), (1, 1))
    offset = rng.uniform(-1, 1, (12, *Q)).astype(np.float32)
    mask = rng.uniform(0, 1, (6, *Q)).astype(np.float32)
    y = ref.deform_conv(x, w, offset, mask)
    assert y.dtype == np.float64 and y.shape == (2, *Q)
    yb = ref.deform_conv(x[None], w, offset[None], mask[None])
    np.testing.assert_array_equal(y, yb[0])
    z = rng.standard_normal((3, *Q)).astype(np.float32)
    wt = rng.standard_normal((3, 2, 3, 2)).astype(np.float32)
    yt = ref.deform_conv_transpose(z, wt, offset, mask)
    assert yt.dtype == np.float64 and yt.shape == (2, 6, 5)
    np.testing.assert_array_equal(yt, ref.deform_conv_transpose(z[None], wt, offset[None],
                                                                 mask[None])[0])


# --------------------------------------------------------------------------- non-finite inputs

def _poisoned(rng, shape, count=3):
    """A random array with `count` elements set to inf, -inf and nan."""
    a = _rand(rng, *shape)
    picks = rng.choice(a.size, size=count, replace=False)
    a.reshape(-1)[picks] = np.resize([np.inf, np.nan, -np.inf], count)
    return a


def test_one_inf_with_1x1_kernel_and_padding_spreads_nowhere():
    # Issue 11: padding taps read the edge element and multiplied it by 0 (28 / 21 outputs
    # non-finite where the dense convolution has 1 per output channel).
    x = np.arange(30.0).reshape(1, 1, 5, 6)
    x[0, 0, 2, 3] = np.inf
    w = np.full((4, 1, 1, 1), 0.5)
    y = ref.deform_conv(x, w, padding=1)
    bad = np.argwhere(~np.isfinite(y))
    np.testing.assert_array_equal(bad, [[0, o, 3, 4] for o in range(4)])
    K = 1
    y0 = ref.deform_conv(x, w, np.zeros((1, 2 * K, 7, 8)), np.ones((1, K, 7, 8)), padding=1)
    np.testing.assert_array_equal(np.argwhere(~np.isfinite(y0)), bad)


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("zero_offset", [False, True])
def test_non_finite_pattern_matches_torch(case, zero_offset):
    """Non-finite input and grad_output elements reach exactly what they reach in the dense conv."""
    torch = pytest.importorskip("torch")
    n, B, ci, co, G, S, k, s, p, d = case
    rng = np.random.default_rng(hash(case) % 2**32 + 1)
    x = _poisoned(rng, (B, ci, *S))
    w = _rand(rng, co, ci // G, *k)
    b = _rand(rng, co)
    Q = _q(S, k, _tuple(s, n), _tuple(p, n), _tuple(d, n))
    K = math.prod(k)
    offset = np.zeros((B, K * n, *Q)) if zero_offset else None
    mask = np.ones((B, ci * K, *Q)) if zero_offset else None
    gy = _poisoned(rng, (B, co, *Q), count=1)
    with np.errstate(invalid="ignore"):
        y = ref.deform_conv(x, w, offset, mask, b, stride=s, padding=p, dilation=d, groups=G)
        grads = ref.deform_conv_backward(gy, x, w, offset, mask, b, stride=s, padding=p, dilation=d, groups=G)
    leaves = [torch.from_numpy(a).requires_grad_(True) for a in (x, w, b)]
    f = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}[n]
    expected = f(*leaves, stride=s, padding=p, dilation=d, groups=G)
    expected.backward(torch.from_numpy(gy))
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(expected.detach().numpy()))
    for got, leaf in zip((grads[0], grads[1], grads[4]), leaves):
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(leaf.grad.numpy()))


@pytest.mark.parametrize("case", CONV_T_CASES)
def test_non_finite_pattern_matches_torch_transposed(case):
    torch = pytest.importorskip("torch")
    n, B, ci, co, G, S, k, s, p, op, d = case
    rng = np.random.default_rng(hash(case) % 2**32 + 2)
    z = _poisoned(rng, (B, ci, *S))
    w = _rand(rng, ci, co // G, *k)
    K = math.prod(k)
    offset, mask = np.zeros((B, K * n, *S)), np.ones((B, co * K, *S))
    with np.errstate(invalid="ignore"):
        y = ref.deform_conv_transpose(z, w, offset, mask, stride=s, padding=p, output_padding=op, dilation=d,
                                      groups=G)
    f = {1: torch.nn.functional.conv_transpose1d, 2: torch.nn.functional.conv_transpose2d,
         3: torch.nn.functional.conv_transpose3d}[n]
    expected = f(torch.from_numpy(z), torch.from_numpy(w), stride=s, padding=p, output_padding=op, dilation=d,
                 groups=G).numpy()
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(expected))


def test_zero_weight_corners_read_nothing():
    # Integer positions have one corner of weight 1 and others of weight 0: those must not be
    # read (0 * inf); a non-integer position must read all its corners.
    x = np.zeros((1, 1, 4))
    x[0, 0, 2] = np.inf
    w = np.ones((1, 1, 1))
    y = ref.deform_conv(x, w, np.array([[[0.0, 0.0, 0.0, 0.0]]]))
    np.testing.assert_array_equal(y, [[[0.0, 0.0, np.inf, 0.0]]])
    y = ref.deform_conv(x, w, np.array([[[1.5, 0.5, 1.0, -2.0]]]))  # positions 1.5, 1.5, 3, 1
    np.testing.assert_array_equal(np.isfinite(y), [[[False, False, True, True]]])


# --------------------------------------------------------------------------- backward

@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_backward_matches_finite_differences(n, transposed):
    import cases

    rng = np.random.default_rng(40 + n + 10 * transposed)
    case = cases.random_case(rng, n, transposed)
    grad_output = rng.standard_normal(case.reference().shape)
    backward = ref.deform_conv_transpose_backward if transposed else ref.deform_conv_backward
    grads = backward(grad_output, **case.arrays_, **case.params)
    for name, grad in zip(cases.ARGUMENTS, grads):
        assert grad.shape == case.arrays_[name].shape and grad.dtype == np.float64
        direction = rng.standard_normal(grad.shape)
        expected = cases.directional_derivative(case, name, grad_output, direction)
        assert float(np.vdot(grad, direction)) == pytest.approx(expected, rel=1e-6, abs=1e-8), name


def test_backward_of_absent_arguments_is_none_and_unbatched_works():
    rng = np.random.default_rng(41)
    x, w = _rand(rng, 3, 6, 5), _rand(rng, 2, 3, 3, 2)
    y = ref.deform_conv(x, w, padding=1)
    g = ref.deform_conv_backward(np.ones(y.shape), x, w, padding=1)
    assert g[0].shape == x.shape and g[1].shape == w.shape and g[2:] == (None, None, None)
    gb = ref.deform_conv_backward(np.ones((1,) + y.shape), x[None], w, padding=1)
    np.testing.assert_allclose(g[0], gb[0][0], rtol=1e-14)


def _torchvision_offset_grad_2d(x, w, offset, grad_output, p):
    """The offset gradient of torchvision's kernels, as scalar loops (stride 1, dilation 1, G 1,
    one offset group, no mask): d sample / d P from the corners floor(P) and floor(P)+1 with
    out-of-grid corners read as 0 and no range cut on P at all (torchvision's coordinate
    weight)."""
    B, C, H, W = x.shape
    co, _, kh, kw = w.shape
    _, _, Qh, Qw = grad_output.shape
    grad = np.zeros(offset.shape)

    def at(b, c, i, j):
        return x[b, c, i, j] if 0 <= i < H and 0 <= j < W else 0.0

    for b, qh, qw, th, tw in itertools.product(range(B), range(Qh), range(Qw), range(kh), range(kw)):
        t = th * kw + tw
        py = qh - p + th + offset[b, 2 * t, qh, qw]
        px = qw - p + tw + offset[b, 2 * t + 1, qh, qw]
        y0, x0 = math.floor(py), math.floor(px)
        fy, fx = py - y0, px - x0
        for c in range(C):
            cg = sum(w[o, c, th, tw] * grad_output[b, o, qh, qw] for o in range(co))
            dy = fx * (at(b, c, y0 + 1, x0 + 1) - at(b, c, y0, x0 + 1)) + (1 - fx) * (
                at(b, c, y0 + 1, x0) - at(b, c, y0, x0))
            dx = fy * (at(b, c, y0 + 1, x0 + 1) - at(b, c, y0 + 1, x0)) + (1 - fy) * (
                at(b, c, y0, x0 + 1) - at(b, c, y0, x0))
            grad[b, 2 * t, qh, qw] += cg * dy
            grad[b, 2 * t + 1, qh, qw] += cg * dx
    return grad


@pytest.mark.parametrize("shift", [0.0, 0.5, -1.0, 1.0])
def test_offset_gradient_at_integer_positions_follows_torchvision(shift):
    # Zero offsets with padding 1 put every border tap at exactly -1 (and the far border at S):
    # the offset gradient there is torchvision's one-sided derivative from corners -1 and 0.
    rng = np.random.default_rng(42)
    x, w = _rand(rng, 2, 3, 5, 4), _rand(rng, 2, 3, 3, 3)
    offset = np.full((2, 18, 5, 4), shift)
    offset[:, 1::2] = 0.0  # shift only along the rows
    y = ref.deform_conv(x, w, offset, padding=1)
    grad_output = _rand(rng, *y.shape)
    g = ref.deform_conv_backward(grad_output, x, w, offset, padding=1)
    expected = _torchvision_offset_grad_2d(x, w, offset, grad_output, 1)
    np.testing.assert_allclose(g[2], expected, rtol=1e-12, atol=1e-12)
    # Output row 0 samples the kernel's top row at row -1 + shift: at shift 0 the row gradient
    # of its centre tap (channel 2; its columns lie inside) is the derivative from the right,
    # not 0.
    if shift == 0.0:
        assert np.abs(g[2][:, 2, 0]).min() > 0


def test_offset_gradient_at_minus_one_is_the_right_derivative():
    x = np.array([[[3.0, -2.0, 5.0]]])
    w = np.ones((1, 1, 1))
    for pos, right in [(-1.0, 3.0), (0.0, -5.0), (1.0, 7.0), (2.0, -5.0), (3.0, 0.0), (-1.5, 0.0)]:
        offset = np.array([[[pos, 0.0, 0.0]]])
        g = ref.deform_conv_backward(np.array([[[1.0, 0.0, 0.0]]]), x, w, offset)
        assert g[2][0, 0, 0] == right, pos
        h = 1e-7
        up = ref.deform_conv(x, w, offset + [[[h, 0, 0]]])[0, 0, 0]
        assert (up - ref.deform_conv(x, w, offset)[0, 0, 0]) / h == pytest.approx(right, abs=1e-6)
