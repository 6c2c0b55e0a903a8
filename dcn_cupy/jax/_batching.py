"""vmap: running a callback's operation on operands that carry vmapped axes in front.

The callbacks use ``vmap_method="expand_dims"``: under ``jax.vmap`` every operand arrives with
the vmapped axes in front (size 1 for an operand that is not vmapped). When only per-sample
operands (input, offset, mask, grad_output) are vmapped and only per-sample results are wanted,
the vmapped axes are merged into the core's native batch axis (one core call; exact, since the
samples of a deformable convolution are independent). Otherwise the operation runs once per
vmapped element.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Tuple

import numpy as np


class Callee(NamedTuple):
    """What a callback runs on native operands (NumPy/CuPy, true dtypes).

    ``call(*operands) -> results`` computes; ``into(operands, outs)``, when given, writes the
    results straight into the output buffers (used when there are no vmapped axes).
    ``launch(device_id, addresses, out_addresses, stream) -> bool``, when given, runs the
    operation on raw CUDA addresses (no vmapped axes; False: it did nothing, use ``into``).
    """

    call: Callable
    into: Optional[Callable]
    in_ndims: Tuple[int, ...]          # ndim of each operand without vmapped axes
    in_per_sample: Tuple[bool, ...]    # operand has the batch axis first (can merge vmap axes)
    out_per_sample: Tuple[bool, ...]
    elementwise: bool                  # any shape goes: broadcast and call once
    dtypes: Tuple[np.dtype, ...]       # true dtype of each operand (bfloat16 travels as uint16)
    launch: Optional[Callable] = None


def array_module(array):
    if isinstance(array, np.ndarray):
        return np
    import cupy
    return cupy


def store(dst, src) -> None:
    """Copy a native result into a native output view (bit-casting bfloat16 to its uint16 wire)."""
    if src.dtype != dst.dtype:
        src = src.view(dst.dtype)
    dst[...] = src


def leading_shape(callee: Callee, ins) -> tuple:
    """The vmapped axes the operands carry (broadcast over the operands)."""
    lead = ins[0].ndim - callee.in_ndims[0]
    return tuple(np.broadcast_shapes(*(a.shape[:lead] for a in ins))) if lead else ()


def run(callee: Callee, ins: list, outs: list) -> None:
    """Run ``callee`` on native operands and store the results into ``outs``."""
    lead = ins[0].ndim - callee.in_ndims[0]
    if lead == 0:
        if callee.into is not None:
            callee.into(ins, outs)
            return
        for o, r in zip(outs, callee.call(*ins)):
            store(o, r)
        return
    leading = tuple(np.broadcast_shapes(*(a.shape[:lead] for a in ins)))
    xp = array_module(ins[0])
    if callee.elementwise:
        results = callee.call(*(xp.broadcast_to(a, leading + a.shape[lead:]) for a in ins))
        for o, r in zip(outs, results):
            store(o, r)
        return
    shared_fixed = all(math.prod(a.shape[:lead]) == 1 for a, ps in zip(ins, callee.in_per_sample) if not ps)
    if shared_fixed and all(callee.out_per_sample):
        # vmapped axes become part of the native batch axis: one core call.
        count = math.prod(leading)
        merged = []
        for a, per_sample in zip(ins, callee.in_per_sample):
            if per_sample:
                a = xp.broadcast_to(a, leading + a.shape[lead:])
                a = a.reshape((count * a.shape[lead],) + a.shape[lead + 1:])
            else:
                a = a.reshape(a.shape[lead:])
            merged.append(a)
        for o, r in zip(outs, callee.call(*merged)):
            store(o, r.reshape(o.shape))
        return
    for index in np.ndindex(*leading):
        args = [a[tuple(i if s > 1 else 0 for i, s in zip(index, a.shape[:lead]))] for a in ins]
        for o, r in zip(outs, callee.call(*args)):
            store(o[index], r)
