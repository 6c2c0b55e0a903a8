"""mask_softmax and mask_sigmoid, forward against the reference and backward against finite differences."""

import numpy as np
import pytest

import dcn_cupy
from dcn_cupy import reference
from dcn_cupy._interop import BFLOAT16

from dcn_cupy.testing import relative_error


def central_difference(f, x, v, g, h=1e-6):
    """d/dh <f(x + h v), g> by central differences."""
    return (np.vdot(f(x + h * v), g) - np.vdot(f(x - h * v), g)) / (2 * h)


@pytest.mark.parametrize("ndim, kernel_size", [(1, 3), (2, (3, 2)), (3, 2)])
def test_mask_softmax_forward_and_backward(ndim, kernel_size):
    rng = np.random.default_rng(ndim)
    K = int(np.prod(kernel_size if isinstance(kernel_size, tuple) else (kernel_size,) * ndim))
    mask = 3 * rng.standard_normal((2, 2 * K) + (4,) * ndim)
    fn = getattr(dcn_cupy, f"mask_softmax{ndim}d")
    y = fn(mask, kernel_size)
    assert relative_error(y, reference.mask_softmax(mask, kernel_size)) < 1e-12
    np.testing.assert_allclose(dcn_cupy.mask_softmax(mask, kernel_size), y, rtol=1e-14)
    g = rng.standard_normal(y.shape)
    grad = dcn_cupy.mask_softmax_backward(g, y, kernel_size)
    v = rng.standard_normal(mask.shape)
    fd = central_difference(lambda m: reference.mask_softmax(m, kernel_size), mask, v, g)
    assert np.vdot(grad, v) == pytest.approx(fd, rel=1e-6)


@pytest.mark.parametrize("scale", [2.0, 1.0, 0.5])
def test_mask_sigmoid_forward_and_backward(scale):
    rng = np.random.default_rng(4)
    mask = 4 * rng.standard_normal((2, 9, 5, 5))
    y = dcn_cupy.mask_sigmoid(mask, scale)
    assert relative_error(y, reference.mask_sigmoid(mask, scale)) < 1e-14
    g = rng.standard_normal(y.shape)
    grad = dcn_cupy.mask_sigmoid_backward(g, y, scale)
    v = rng.standard_normal(mask.shape)
    fd = central_difference(lambda m: reference.mask_sigmoid(m, scale), mask, v, g)
    assert np.vdot(grad, v) == pytest.approx(fd, rel=1e-6)


def test_mask_sigmoid_extremes_and_half_types():
    x = np.array([-1e4, -50.0, 0.0, 50.0, 1e4])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        y = dcn_cupy.mask_sigmoid(x)
    np.testing.assert_allclose(y, [0.0, 2 / (1 + np.exp(50)), 1.0, 2 / (1 + np.exp(-50)), 2.0], rtol=1e-12)
    for dtype in (np.float16, BFLOAT16):
        y = dcn_cupy.mask_sigmoid(np.zeros(3, dtype))
        assert y.dtype == dtype and np.all(y.astype(np.float32) == 1.0)


def test_mask_softmax_unbatched_and_large_logits():
    m = np.full((9, 2, 2), 800.0)
    y = dcn_cupy.mask_softmax2d(m, 3)
    assert y.shape == m.shape
    np.testing.assert_allclose(y, 1 / 9)
