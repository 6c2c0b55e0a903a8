"""Test helpers shared by the test suite, ``python -m dcn_cupy check`` and the benchmarks.

Seeded configurations of a deformable convolution (or transposed one) as float64 NumPy arrays,
offsets kept away from the kinks of N-linear interpolation, and float64 finite differences of
:mod:`dcn_cupy.reference`. Public so that a user can check a backend or adapter of their own
the way the project checks its own::

    from dcn_cupy.testing import random_case, directional_derivative
    case = random_case(np.random.default_rng(0), ndim=2, transposed=False)
    grads = case.backward(grad_output, **case.arrays(), **case.params)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import numpy as np


__all__ = [
    "ARGUMENTS", "Case", "fractional_offsets", "random_case", "fixed_case", "numpy_dtype", "rounded",
    "tf32_rounded", "relative_error", "max_relative_error", "directional_derivative", "directional_error",
]

#: The array arguments of a deformable convolution, in signature order.
ARGUMENTS = ("input", "weight", "offset", "mask", "bias")


@dataclasses.dataclass
class Case:
    """One deformable convolution (or transposed one): float64 arrays and hyper-parameters."""

    ndim: int
    transposed: bool
    arrays_: dict           # name -> float64 array or None
    params: dict            # stride, padding, dilation, groups (+ output_padding)
    label: str

    def arrays(self, convert: Callable = lambda a: a) -> dict:
        """The arguments, each passed through ``convert`` (e.g. to a device or dtype)."""
        return {name: None if a is None else convert(a) for name, a in self.arrays_.items()}

    @property
    def name(self) -> str:
        """The public function's name, e.g. ``deform_conv_transpose2d``."""
        return f"deform_conv_transpose{self.ndim}d" if self.transposed else f"deform_conv{self.ndim}d"

    @property
    def forward(self):
        import dcn_cupy
        return getattr(dcn_cupy, self.name)

    @property
    def backward(self):
        import dcn_cupy
        return getattr(dcn_cupy, self.name + "_backward")

    def reference(self, arrays: Optional[dict] = None):
        """The float64 reference forward of ``arrays`` (default: the case's own)."""
        from . import reference

        arrays = self.arrays_ if arrays is None else arrays
        if self.transposed:
            return reference.deform_conv_transpose(**arrays, **self.params)
        return reference.deform_conv(**arrays, **self.params)


def fractional_offsets(rng, shape, spread=2.0):
    """Offsets whose fractional part lies in [0.2, 0.8]: sample positions stay off the kinks,
    where finite differences of N-linear interpolation are not the derivative."""
    whole = rng.integers(-int(spread), int(spread) + 1, size=shape)
    return whole + rng.uniform(0.2, 0.8, size=shape)


def _output_grid(size, kernel, stride, padding, dilation) -> tuple:
    return tuple((s + 2 * p - d * (k - 1) - 1) // st + 1
                 for s, k, st, p, d in zip(size, kernel, stride, padding, dilation))


def random_case(rng, ndim: int, transposed: bool, *, batch=None, offset=True, mask=True, bias=True,
                channels_scale=1) -> Case:
    """A random valid configuration covering groups, offset/mask groups and per-axis hyper-parameters."""
    groups = int(rng.choice([1, 2]))
    offset_groups = int(rng.choice([1, 2]))
    mask_groups = int(rng.choice([1, 2, 4]))
    # In the transposed op, offset/mask groups partition the output channels.
    lcm = math.lcm(groups, offset_groups, mask_groups)
    c_in = lcm * int(rng.integers(1, 3)) * channels_scale
    c_out = groups * int(rng.integers(1, 3)) * channels_scale
    if transposed:
        c_out = lcm * int(rng.integers(1, 3)) * channels_scale
        c_in = groups * int(rng.integers(1, 3)) * channels_scale
    kernel = tuple(int(v) for v in rng.integers(1, 4, size=ndim))
    stride = tuple(int(v) for v in rng.integers(1, 3, size=ndim))
    padding = tuple(int(v) for v in rng.integers(0, 2, size=ndim))
    dilation = tuple(int(v) for v in rng.integers(1, 3, size=ndim))
    size = {1: (5, 9), 2: (4, 7), 3: (3, 5)}[ndim]
    spatial = []
    for a in range(ndim):
        span = dilation[a] * (kernel[a] - 1) + 1
        spatial.append(max(int(rng.integers(*size)), span - 2 * padding[a]))
    spatial = tuple(spatial)
    batch = int(rng.integers(1, 4)) if batch is None else batch
    K = math.prod(kernel)
    params = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    if transposed:
        out_pad = tuple(int(rng.integers(0, max(s, d))) for s, d in zip(stride, dilation))
        params["output_padding"] = out_pad
        grid = spatial
        x = rng.standard_normal((batch, c_in) + spatial)
        w = rng.standard_normal((c_in, c_out // groups) + kernel)
    else:
        grid = _output_grid(spatial, kernel, stride, padding, dilation)
        x = rng.standard_normal((batch, c_in) + spatial)
        w = rng.standard_normal((c_out, c_in // groups) + kernel)
    arrays = {
        "input": x,
        "weight": w,
        "offset": fractional_offsets(rng, (batch, offset_groups * K * ndim) + grid) if offset else None,
        "mask": rng.uniform(0.1, 1.5, size=(batch, mask_groups * K) + grid) if mask else None,
        "bias": rng.standard_normal(c_out) if bias else None,
    }
    label = (f"{'T' if transposed else ''}{ndim}d B{batch} {c_in}->{c_out} G{groups} "
             f"Go{offset_groups if offset else 0} Gm{mask_groups if mask else 0} k{kernel} s{stride} "
             f"p{padding} d{dilation}" + (f" op{params['output_padding']}" if transposed else ""))
    return Case(ndim, transposed, arrays, params, label)


# (C_in, C_out, groups, offset_groups, mask_groups, S, k, stride, padding, dilation[, output_padding]):
# every hyper-parameter differs per axis and offset groups differ from mask groups.
_CONV_SPECS = {
    1: (4, 6, 2, 4, 2, (9,), (3,), (2,), (1,), (2,)),
    2: (4, 6, 2, 2, 1, (7, 6), (3, 2), (2, 1), (1, 0), (1, 2)),
    3: (4, 4, 2, 1, 2, (4, 5, 4), (2, 3, 2), (1, 2, 1), (0, 1, 1), (2, 1, 1)),
}
_TRANSPOSE_SPECS = {
    1: (4, 6, 2, 3, 2, (5,), (3,), (2,), (1,), (1,), (1,)),
    2: (4, 4, 2, 2, 4, (4, 3), (2, 3), (2, 1), (0, 1), (1, 2), (1, 0)),
    3: (2, 4, 2, 1, 2, (3, 3, 2), (2, 2, 3), (1, 2, 1), (0, 0, 1), (1, 1, 1), (0, 1, 0)),
}


def fixed_case(rng, ndim: int, transposed: bool, batch: int = 2) -> Case:
    """A fixed configuration per (N, transposed), with random values: what ``check`` runs."""
    if transposed:
        c_in, c_out, groups, g_o, g_m, size, kernel, stride, padding, dilation, out_pad = _TRANSPOSE_SPECS[ndim]
        grid = size  # offsets and masks live on the input grid
        weight_shape = (c_in, c_out // groups) + kernel
    else:
        c_in, c_out, groups, g_o, g_m, size, kernel, stride, padding, dilation = _CONV_SPECS[ndim]
        grid = _output_grid(size, kernel, stride, padding, dilation)
        weight_shape = (c_out, c_in // groups) + kernel
    volume = math.prod(kernel)
    arrays = {
        "input": rng.standard_normal((batch, c_in) + size),
        "weight": rng.standard_normal(weight_shape),
        "offset": fractional_offsets(rng, (batch, g_o * volume * ndim) + grid),
        "mask": rng.uniform(-1.0, 2.0, (batch, g_m * volume) + grid),
        "bias": rng.standard_normal(c_out),
    }
    params = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    if transposed:
        params["output_padding"] = out_pad
    case = Case(ndim, transposed, arrays, params, "")
    case.label = case.name
    return case


def numpy_dtype(name: str) -> np.dtype:
    """``np.dtype(name)``, with ``"bfloat16"`` as ``ml_dtypes.bfloat16``."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def rounded(arrays: dict, dtype: str) -> dict:
    """The float64 values the arrays take after a round trip through ``dtype``."""
    return {k: None if a is None else np.asarray(a).astype(numpy_dtype(dtype)).astype(np.float64)
            for k, a in arrays.items()}


def tf32_rounded(values) -> np.ndarray:
    """Finite float32 ``values`` rounded to TF32 as the GPU's ``cvt.rna.tf32.f32`` rounds them:
    to nearest, ties away from zero, 10 mantissa bits (the low 13 cleared), kept as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def relative_error(actual, expected) -> float:
    """``||actual - expected|| / ||expected||`` (Frobenius norms, in float64)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(np.linalg.norm(expected.ravel()), 1e-300)
    return float(np.linalg.norm((actual - expected).ravel()) / scale)


def max_relative_error(actual, expected) -> float:
    """``max|actual - expected| / max|expected|``; inf where ``actual`` is not finite."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {actual.shape}, expected {expected.shape}")
    if expected.size == 0:
        return 0.0
    if not np.all(np.isfinite(actual)):
        return math.inf
    scale = max(float(np.max(np.abs(expected))), 1e-300)
    return float(np.max(np.abs(actual - expected))) / scale


def directional_derivative(case: Case, name: str, grad_output, direction, h=1e-6) -> float:
    """d/dh <reference(args with name += h*direction), grad_output>, by central differences."""
    def loss(step):
        arrays = dict(case.arrays_)
        arrays[name] = arrays[name] + step * direction
        return float(np.vdot(case.reference(arrays), grad_output))
    return (loss(h) - loss(-h)) / (2 * h)


def directional_error(analytic: float, fd: float, grad, direction) -> float:
    """|<grad, v> - FD| relative to |FD|, floored at a typical size of <grad, v> (so that a
    directional derivative that happens to be near 0 does not blow the error up)."""
    typical = float(np.linalg.norm(grad) * np.linalg.norm(direction)) / math.sqrt(max(np.size(direction), 1))
    scale = max(abs(fd), 0.01 * typical, 1e-300)
    if not math.isfinite(analytic):
        return math.inf
    return abs(analytic - fd) / scale
