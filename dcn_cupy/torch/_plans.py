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


#: Plans by the call's own key (torch.Size shapes, torch dtype and device, the hyper-parameters
#: as given): found with one hash, without converting anything. A miss goes to :func:`_plan`.
_by_call: dict = {}


def plan_for(transposed: bool, tensors: Sequence[Optional[Tensor]], hyper, deterministic: Optional[bool] = None):
    """The plan of a call (``tensors`` = input, weight, offset, mask, bias; ``hyper`` = stride,
    padding, output_padding, dilation, groups); ``deterministic`` None follows
    ``torch.are_deterministic_algorithms_enabled()``."""
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    input = tensors[0]
    allow_tf32 = _runtime.allow_tf32(input)
    if type(hyper[0]) is not tuple:  # the custom ops' int[] arguments come as lists
        hyper = tuple(h if type(h) is int else tuple(h) for h in hyper)
    key = (transposed, hyper, deterministic, allow_tf32, input.dtype, input.device,
           *(None if t is None else t.shape for t in tensors))
    found = _by_call.get(key)
    if found is not None:
        return found
    stride, padding, output_padding, dilation, groups = hyper
    where = "cpu" if input.device.type == "cpu" else f"cuda:{_runtime.device_index(input)}"
    shapes = tuple(None if t is None else tuple(t.shape) for t in tensors)
    found = _plan(transposed, shapes, input.dtype, where, tuple(stride), tuple(padding), tuple(output_padding),
                  tuple(dilation), groups, deterministic, allow_tf32)
    if len(_by_call) >= PLAN_CACHE_SIZE:
        _by_call.clear()
    _by_call[key] = found
    return found


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _plan(transposed, shapes, dtype, where, stride, padding, output_padding, dilation, groups, deterministic,
          allow_tf32):
    import dcn_cupy

    specs = [None if s is None else _Spec(s, _runtime.numpy_dtype(dtype)) for s in shapes]
    kwargs = dict(transposed=True, output_padding=output_padding) if transposed else {}
    return dcn_cupy.plan(*specs, stride, padding, dilation, groups, device=where, deterministic=deterministic,
                         allow_tf32=allow_tf32, **kwargs)


def clear_plan_cache() -> None:
    _by_call.clear()
    _plan.cache_clear()

