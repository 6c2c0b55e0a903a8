"""Seeded random configurations and a finite-difference check, shared by the backend tests.

A ``Case`` holds the arguments of one deformable convolution (or transposed one) as float64
NumPy arrays; ``Case.arrays(convert)`` hands them over to any backend or library.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import numpy as np

import dcn_cupy
from dcn_cupy import reference

ARGUMENTS = ("input", "weight", "offset", "mask", "bias")


@dataclasses.dataclass
class Case:
    ndim: int
    transposed: bool
    arrays_: dict           # name -> float64 array or None
    params: dict            # stride, padding, dilation, groups (+ output_padding)
    label: str

    def arrays(self, convert: Callable = lambda a: a) -> dict:
        return {name: None if a is None else convert(a) for name, a in self.arrays_.items()}

    @property
    def forward(self):
        name = f"deform_conv_transpose{self.ndim}d" if self.transposed else f"deform_conv{self.ndim}d"
        return getattr(dcn_cupy, name)

    @property
    def backward(self):
        name = f"deform_conv_transpose{self.ndim}d" if self.transposed else f"deform_conv{self.ndim}d"
        return getattr(dcn_cupy, name + "_backward")

    def reference(self, arrays: Optional[dict] = None):
        arrays = self.arrays_ if arrays is None else arrays
        if self.transposed:
            return reference.deform_conv_transpose(**arrays, **self.params)
        return reference.deform_conv(**arrays, **self.params)


def fractional_offsets(rng, shape, spread=2.0):
    """Offsets whose fractional part lies in [0.2, 0.8]: sample positions stay off the kinks."""
    whole = rng.integers(-int(spread), int(spread) + 1, size=shape)
    return whole + rng.uniform(0.2, 0.8, size=shape)


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
        bias_channels = c_out
    else:
        grid = tuple((s + 2 * p - d * (k - 1) - 1) // st + 1
                     for s, p, d, k, st in zip(spatial, padding, dilation, kernel, stride))
        x = rng.standard_normal((batch, c_in) + spatial)
        w = rng.standard_normal((c_out, c_in // groups) + kernel)
        bias_channels = c_out
    arrays = {
        "input": x,
        "weight": w,
        "offset": fractional_offsets(rng, (batch, offset_groups * K * ndim) + grid) if offset else None,
        "mask": rng.uniform(0.1, 1.5, size=(batch, mask_groups * K) + grid) if mask else None,
        "bias": rng.standard_normal(bias_channels) if bias else None,
    }
    label = (f"{'T' if transposed else ''}{ndim}d B{batch} {c_in}->{c_out} G{groups} "
             f"Go{offset_groups if offset else 0} Gm{mask_groups if mask else 0} k{kernel} s{stride} "
             f"p{padding} d{dilation}" + (f" op{params['output_padding']}" if transposed else ""))
    return Case(ndim, transposed, arrays, params, label)


def relative_error(actual, expected) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(np.linalg.norm(expected.ravel()), 1e-300)
    return float(np.linalg.norm((actual - expected).ravel()) / scale)


def directional_derivative(case: Case, name: str, grad_output, direction, h=1e-6) -> float:
    """d/dh <reference(args with name += h*direction), grad_output>, by central differences."""
    def loss(step):
        arrays = dict(case.arrays_)
        arrays[name] = arrays[name] + step * direction
        return float(np.vdot(case.reference(arrays), grad_output))
    return (loss(h) - loss(-h)) / (2 * h)
