"""The plan of each configuration the torch ops meet, built once and kept in a bounded cache.

The key is everything a plan depends on: operation, argument shapes (``None`` for an absent
argument), dtype, device, hyper-parameters, ``torch.are_deterministic_algorithms_enabled()``
and, for float32 on CUDA, ``torch.backends.cuda.matmul.allow_tf32``. Kernels are compiled when
the plan is built, i.e. on the first (eager or warm-up) call of a configuration, never while a
CUDA graph is being captured from an already warmed-up model.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from . import _runtime

#: Most plans the torch ops keep (least recently used ones are dropped).
PLAN_CACHE_SIZE = 256


class _Spec(NamedTuple):
    """A shape/dtype spec, what ``dcn_cupy.plan`` takes in place of an array."""

    shape: tuple
    dtype: np.dtype


def plan_for(transposed: bool, tensors: Sequence[Optional[Tensor]], hyper, deterministic: Optional[bool] = None):
    """The plan of a call (``tensors`` = input, weight, offset, mask, bias); ``deterministic``
    None follows ``torch.are_deterministic_algorithms_enabled()``."""
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    input = tensors[0]
    stride, padding, output_padding, dilation, groups = hyper
    where = "cpu" if input.device.type == "cpu" else f"cuda:{_runtime.device_index(input)}"
    shapes = tuple(None if t is None else tuple(t.shape) for t in tensors)
    return _plan(transposed, shapes, input.dtype, where, tuple(stride), tuple(padding), tuple(output_padding),
                 tuple(dilation), groups, deterministic, _runtime.allow_tf32(input))


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _plan(transposed, shapes, dtype, where, stride, padding, output_padding, dilation, groups, deterministic,
          allow_tf32):
    import dcn_cupy

    if not hasattr(dcn_cupy, "plan"):  # TEMPORARY until the plans branch is merged
        return _ApiPlan(transposed, shapes, stride, padding, output_padding, dilation, groups)
    specs = [None if s is None else _Spec(s, _runtime.numpy_dtype(dtype)) for s in shapes]
    kwargs = dict(transposed=True, output_padding=output_padding) if transposed else {}
    return dcn_cupy.plan(*specs, stride, padding, dilation, groups, device=where, deterministic=deterministic,
                         allow_tf32=allow_tf32, **kwargs)


def clear_plan_cache() -> None:
    _plan.cache_clear()


class _ApiPlan:  # TEMPORARY stand-in for dcn_cupy.plan until the plans branch is merged
    workspace_bytes = 0

    def __init__(self, transposed, shapes, stride, padding, output_padding, dilation, groups):
        from .. import _api, _geometry
        self.api = _api
        self.transposed = transposed
        self.kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
        if transposed:
            self.kw["output_padding"] = output_padding
            geom, batched = _geometry.conv_transpose_geometry(*shapes, stride, padding, output_padding, dilation,
                                                              groups)
            out = geom.x_shape
        else:
            geom, batched = _geometry.conv_geometry(*shapes, stride, padding, dilation, groups)
            out = geom.y_shape
        self.output_shape = out if batched else out[1:]

    def forward(self, *args, out, workspace=None):
        f = self.api.deform_conv_transpose if self.transposed else self.api.deform_conv
        out[...] = f(*args, **self.kw)

    def backward(self, *args, wrt, out, workspace=None):
        f = self.api.deform_conv_transpose_backward if self.transposed else self.api.deform_conv_backward
        grads = f(*args, wrt=wrt, **self.kw)
        for name, array in out.items():
            array[...] = getattr(grads, name)
