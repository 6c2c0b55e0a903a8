"""JAX adapter: every dcn_cupy operation as a differentiable, jit-able JAX function.

Each function here (``deform_conv{1,2,3}d``, ``deform_conv``, ``deform_conv_transpose{1,2,3}d``,
``deform_conv_transpose``, ``mask_softmax{1,2,3}d``, ``mask_softmax``, ``mask_sigmoid``) takes
and returns ``jax.Array``\\ s with the signature of its namesake in :mod:`dcn_cupy`. It is a
:func:`jax.custom_vjp` over the core's explicit forward and backward functions: ``jax.grad``,
``jax.vjp``, ``jax.jit``, ``jax.vmap`` and their compositions work. Hyper-parameters (stride,
padding, output_padding, dilation, groups, kernel_size, scale) are static Python values (the
custom_vjp's ``nondiff_argnums``); ``offset``, ``mask`` and ``bias`` may be None. The backward
computes only the gradients of the array arguments that were given *and* that JAX asks for
(``symbolic_zeros``: e.g. ``jax.grad(f, argnums=1)`` computes the weight gradient alone); the
gradient of a None argument is None. float16, bfloat16, float32 and float64 are supported and
kept (float64 needs ``jax.config.update("jax_enable_x64", True)``).

How the core is reached
-----------------------
* **Eagerly** (concrete arrays, e.g. ``jax.grad`` outside ``jit``): the core is called directly
  with the ``jax.Array``\\ s, which it exchanges zero-copy through DLPack; the result comes back
  as a ``jax.Array`` on the same device. No copy, no compilation. (Without any transformation
  the custom_vjp machinery is skipped as well.)
* **Under tracing** (``jax.jit``, ``jax.vmap``, ``lax.scan``, ...) the call is staged out as an
  XLA custom call to a Python callback:

  - ``jax.experimental.buffer_callback`` (recent JAX, e.g. 0.10 and 0.11; the default where it
    exists). The callback receives XLA's own buffers. On GPU they are wrapped zero-copy as CuPy
    arrays (through ``__cuda_array_interface__``, without synchronising) and the CUDA kernels
    are launched on XLA's compute stream (``ctx.stream`` as a ``cupy.cuda.ExternalStream``), so
    they are ordered with the surrounding XLA work and nothing goes through the host. On CPU
    they are wrapped as NumPy arrays. Costs: one Python call per execution (interpreter and
    GIL overhead) and one device-to-device copy of each result into XLA's output buffer. The
    core allocates its results and temporaries from CuPy's memory pool, outside XLA's
    preallocated pool: on a GPU, leave CuPy room (e.g. ``XLA_PYTHON_CLIENT_MEM_FRACTION=.5`` or
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false``).
  - ``jax.pure_callback`` (the fallback where buffer_callback does not exist, or chosen with
    ``set_callback_mechanism("pure")``, e.g. for multi-platform export, which buffer_callback
    cannot lower). The operands are copied to host memory as NumPy arrays, the operation runs
    on the CPU backend (Numba) and the results are copied back. On a GPU this means a
    device-to-host and a host-to-device copy of every operand and result, a synchronisation of
    the stream, and CPU speed: usable, not fast. :func:`callback_mechanism` tells which one
    traced calls use.

  Neither callback has a sharding rule: under ``jit`` with sharded operands XLA gathers them to
  each device first. bfloat16 operands cross the callback boundary as their uint16 bits (a free
  bitcast in XLA).
* Forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``) is not available: a
  ``custom_vjp`` function only has a reverse-mode rule.
* **vmap**: the callbacks use ``vmap_method="expand_dims"``: the callback sees the vmapped axes
  in front of every operand (size 1 for an operand that is not vmapped). When only per-sample
  operands (input, offset, mask, grad_output) are vmapped and only per-sample results are
  wanted (the forward, and the input/offset/mask gradients), the vmapped axes are merged into
  the core's native batch axis: one call for the whole vmapped batch, exactly equivalent since
  the batch samples of a deformable convolution are independent. Otherwise (a vmapped weight or
  bias, or weight/bias gradients, which must stay per vmapped element) the callback loops over
  the vmapped elements itself, one core call each.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _api, _geometry
from ._interop import BFLOAT16, SUPPORTED_DTYPES

try:  # recent JAX
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # pragma: no cover - older JAX
    _buffer_callback = None

try:
    from jax.custom_derivatives import SymbolicZero as _SymbolicZero
except ImportError:  # pragma: no cover
    from jax._src.ad_util import SymbolicZero as _SymbolicZero

try:
    from jax.core import Tracer as _Tracer
except ImportError:  # pragma: no cover - should jax.core stop exporting it
    from jax._src.core import Tracer as _Tracer

__all__ = [
    "deform_conv", "deform_conv1d", "deform_conv2d", "deform_conv3d",
    "deform_conv_transpose", "deform_conv_transpose1d", "deform_conv_transpose2d", "deform_conv_transpose3d",
    "mask_softmax", "mask_softmax1d", "mask_softmax2d", "mask_softmax3d", "mask_sigmoid",
    "callback_mechanism", "set_callback_mechanism",
]

_NAMES = _geometry.GRADIENT_NAMES  # ("input", "weight", "offset", "mask", "bias")

# "auto": buffer_callback where available, else pure_callback; "buffer" or "pure" force one
# (see set_callback_mechanism). Read when a function is traced.
_MECHANISM = "auto"


def set_callback_mechanism(mechanism: str = "auto") -> None:
    """Choose how traced calls reach the core: ``"auto"`` (buffer_callback where available),
    ``"buffer"`` or ``"pure"``. Takes effect for functions traced afterwards (jit caches keep
    what they compiled)."""
    global _MECHANISM
    if mechanism not in ("auto", "buffer", "pure"):
        raise ValueError(f"mechanism must be 'auto', 'buffer' or 'pure', got {mechanism!r}")
    if mechanism == "buffer" and _buffer_callback is None:
        raise RuntimeError("jax.experimental.buffer_callback is not available in this JAX version")
    _MECHANISM = mechanism


def callback_mechanism() -> str:
    """``"buffer_callback"`` or ``"pure_callback"``: how traced (jit/vmap) calls reach the core."""
    if _MECHANISM == "pure" or (_MECHANISM == "auto" and _buffer_callback is None):
        return "pure_callback"
    if _buffer_callback is None:
        raise RuntimeError("jax.experimental.buffer_callback is not available in this JAX version")
    return "buffer_callback"


# ---------------------------------------------------------------------------------------------
# dispatch: eager -> the core through DLPack; traced -> a callback


class _Plan(NamedTuple):
    """What a callback runs: ``call(*present_natives) -> results`` plus the vmap layout."""

    call: Callable
    in_ndims: Tuple[int, ...]          # ndim of each operand without vmapped axes
    in_per_sample: Tuple[bool, ...]    # operand has the batch axis first (can merge vmap axes)
    out_per_sample: Tuple[bool, ...]
    elementwise: bool                  # any shape goes: broadcast and call once
    dtypes: Tuple[np.dtype, ...]       # true dtype of each operand (bfloat16 travels as uint16)


def _is_traced(arrays) -> bool:
    return any(isinstance(a, _Tracer) for a in arrays if a is not None)


def _wire_dtype(dtype) -> np.dtype:
    return np.dtype(np.uint16) if np.dtype(dtype) == BFLOAT16 else np.dtype(dtype)


def _to_wire(a):
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if np.dtype(a.dtype) == BFLOAT16 else a


def _from_wire(a, dtype):
    return jax.lax.bitcast_convert_type(a, jnp.bfloat16) if np.dtype(dtype) == BFLOAT16 else a


def _xp_of(array):
    if isinstance(array, np.ndarray):
        return np
    import cupy
    return cupy


def _store(dst, src) -> None:
    """Copy a native result into a native output view (bit-casting bfloat16 to its uint16 wire)."""
    if src.dtype != dst.dtype:
        src = src.view(dst.dtype)
    dst[...] = src


def _run(plan: _Plan, ins: list, outs: list) -> None:
    """Run a plan on native operands (real dtypes) and store the results into ``outs``."""
    lead = ins[0].ndim - plan.in_ndims[0]
    if lead == 0:
        for o, r in zip(outs, plan.call(*ins)):
            _store(o, r)
        return
    leading = tuple(np.broadcast_shapes(*(a.shape[:lead] for a in ins)))
    xp = _xp_of(ins[0])
    if plan.elementwise:
        results = plan.call(*(xp.broadcast_to(a, leading + a.shape[lead:]) for a in ins))
        for o, r in zip(outs, results):
            _store(o, r)
        return
    shared_fixed = all(math.prod(a.shape[:lead]) == 1 for a, ps in zip(ins, plan.in_per_sample) if not ps)
    if shared_fixed and all(plan.out_per_sample):
        # vmapped axes become part of the native batch axis: one core call.
        count = math.prod(leading)
        merged = []
        for a, per_sample in zip(ins, plan.in_per_sample):
            if per_sample:
                a = xp.broadcast_to(a, leading + a.shape[lead:])
                a = a.reshape((count * a.shape[lead],) + a.shape[lead + 1:])
            else:
                a = a.reshape(a.shape[lead:])
            merged.append(a)
        for o, r in zip(outs, plan.call(*merged)):
            _store(o, r.reshape(o.shape))
        return
    for index in np.ndindex(*leading):
        args = [a[tuple(i if s > 1 else 0 for i, s in zip(index, a.shape[:lead]))] for a in ins]
        for o, r in zip(outs, plan.call(*args)):
            _store(o[index], r)


def _pure_host(plan: _Plan, out_shapes, *arrays):
    ins = [np.asarray(a).view(dtype) for a, dtype in zip(arrays, plan.dtypes)]
    # Under vmap the results carry the vmapped axes in front, like the operands.
    lead = ins[0].ndim - plan.in_ndims[0]
    leading = tuple(np.broadcast_shapes(*(a.shape[:lead] for a in ins))) if lead else ()
    outs = [np.empty(leading + tuple(s.shape), s.dtype) for s in out_shapes]
    _run(plan, ins, outs)
    return tuple(outs)


_DL_CPU, _DL_CUDA_HOST = 1, 3


def _buffer_to_native(buffer, dtype=None):
    """A NumPy (CPU) or CuPy (CUDA) array over an XLA buffer, zero-copy, no synchronisation."""
    device_type, device_id = (int(v) for v in buffer.__dlpack_device__())
    if device_type in (_DL_CPU, _DL_CUDA_HOST):
        array = np.asarray(buffer)
    else:
        import cupy

        try:
            interface = buffer.__cuda_array_interface__
        except Exception:  # pragma: no cover - fall back to DLPack (may synchronise the stream)
            array = cupy.from_dlpack(buffer)
            return array.view(dtype) if dtype is not None and np.dtype(dtype) != array.dtype else array
        shape = tuple(int(v) for v in interface["shape"])
        wire = np.dtype(interface["typestr"])
        strides = interface.get("strides")
        nbytes = math.prod(shape) * wire.itemsize
        if nbytes == 0:
            array = cupy.empty(shape, wire)
        else:
            memory = cupy.cuda.UnownedMemory(int(interface["data"][0]), nbytes, buffer, device_id)
            array = cupy.ndarray(shape, wire, cupy.cuda.MemoryPointer(memory, 0),
                                 strides=None if strides is None else tuple(strides))
    if dtype is not None and np.dtype(dtype) != array.dtype:
        array = array.view(dtype)
    return array


def _buffer_host(plan: _Plan, ctx, outs, *buffers):
    device_type, device_id = (int(v) for v in buffers[0].__dlpack_device__())
    ins = [_buffer_to_native(b, dtype) for b, dtype in zip(buffers, plan.dtypes)]
    out_arrays = [_buffer_to_native(o) for o in outs]
    if device_type in (_DL_CPU, _DL_CUDA_HOST):
        _run(plan, ins, out_arrays)
        return
    import cupy

    with cupy.cuda.Device(device_id), cupy.cuda.ExternalStream(int(ctx.stream), device_id):
        _run(plan, ins, out_arrays)


def _dispatch(call: Callable, args: list, per_sample: tuple, out_shapes: list, out_per_sample: tuple,
              dtype, elementwise: bool = False) -> tuple:
    """Run ``call(*args)`` (the core, with None for absent arguments) on JAX values.

    ``args`` must already be shaped as the traced path wants them (batch axis present); results
    are returned in the order of ``out_shapes``.
    """
    index = [i for i, a in enumerate(args) if a is not None]
    present = [args[i] for i in index]

    def native_call(*natives):
        full = [None] * len(args)
        for i, a in zip(index, natives):
            full[i] = a
        return call(*full)

    plan = _Plan(native_call, tuple(a.ndim for a in present), tuple(per_sample[i] for i in index),
                 tuple(out_per_sample), elementwise, tuple(np.dtype(a.dtype) for a in present))
    wire = _wire_dtype(dtype)
    result_types = tuple(jax.ShapeDtypeStruct(tuple(shape), wire) for shape in out_shapes)
    operands = [_to_wire(a) for a in present]
    if callback_mechanism() == "buffer_callback":
        outs = _buffer_callback(functools.partial(_buffer_host, plan), result_types,
                                vmap_method="expand_dims")(*operands)
    else:
        host = functools.partial(_pure_host, plan, result_types)
        try:
            outs = jax.pure_callback(host, result_types, *operands, vmap_method="expand_dims")
        except TypeError:  # pragma: no cover - JAX < 0.4.34 has no vmap_method: sequential vmap
            outs = jax.pure_callback(host, result_types, *operands)
    return tuple(_from_wire(o, dtype) for o in outs)


def _check_arrays(arrays: dict) -> tuple:
    """jnp arrays (None kept) of one supported dtype; the dtype."""
    out, dtype, first = {}, None, None
    for name, a in arrays.items():
        if a is None:
            out[name] = None
            continue
        if not isinstance(a, (jax.Array, _Tracer)):
            a = jnp.asarray(a)
        d = np.dtype(a.dtype)
        if d not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must have dtype float16, bfloat16, float32 or float64, got {d.name}")
        if dtype is None:
            dtype, first = d, name
        elif d != dtype:
            raise TypeError(f"{name} must have the same dtype as {first} ({dtype.name}), got {d.name}")
        out[name] = a
    return out, dtype


# ---------------------------------------------------------------------------------------------
# deformable convolution and its transpose


class _ConvConfig(NamedTuple):
    ndim: int
    transposed: bool
    stride: Tuple[int, ...]
    padding: Tuple[int, ...]
    output_padding: Tuple[int, ...]
    dilation: Tuple[int, ...]
    groups: int

    def kwargs(self) -> dict:
        kw = dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups)
        if self.transposed:
            kw["output_padding"] = self.output_padding
        return kw


_PER_SAMPLE = {"grad_output": True, "input": True, "weight": False, "offset": True, "mask": True, "bias": False}


def _geometry_of(cfg: _ConvConfig, x, w, off, m, b):
    shape = lambda a: None if a is None else tuple(a.shape)  # noqa: E731
    if cfg.transposed:
        geom, batched = _geometry.conv_transpose_geometry(
            x.shape, w.shape, shape(off), shape(m), shape(b), cfg.stride, cfg.padding, cfg.output_padding,
            cfg.dilation, cfg.groups, ndim=cfg.ndim)
        out = geom.x_shape
    else:
        geom, batched = _geometry.conv_geometry(
            x.shape, w.shape, shape(off), shape(m), shape(b), cfg.stride, cfg.padding, cfg.dilation,
            cfg.groups, ndim=cfg.ndim)
        out = geom.y_shape
    return tuple(out), batched


def _batch(a, batched):
    return a if a is None or batched else a[None]


def _conv_forward_impl(cfg: _ConvConfig, x, w, off, m, b):
    forward = _api.deform_conv_transpose if cfg.transposed else _api.deform_conv
    kwargs = cfg.kwargs()
    if not _is_traced((x, w, off, m, b)):
        return forward(x, w, off, m, b, **kwargs)
    out_shape, batched = _geometry_of(cfg, x, w, off, m, b)

    def call(x, w, off, m, b):
        return (forward(x, w, off, m, b, **kwargs),)

    args = [_batch(x, batched), w, _batch(off, batched), _batch(m, batched), b]
    (y,) = _dispatch(call, args, tuple(_PER_SAMPLE[n] for n in _NAMES), [out_shape], (True,), x.dtype)
    return y if batched else y[0]


def _conv_backward_impl(cfg: _ConvConfig, g, x, w, off, m, b, wanted: tuple):
    backward = _api.deform_conv_transpose_backward if cfg.transposed else _api.deform_conv_backward
    kwargs = cfg.kwargs()
    values = dict(zip(_NAMES, (x, w, off, m, b)))
    if not _is_traced((g, x, w, off, m, b)):
        grads = backward(g, x, w, off, m, b, wrt=wanted, **kwargs)
        return tuple(getattr(grads, n) if n in wanted else None for n in _NAMES)
    _, batched = _geometry_of(cfg, x, w, off, m, b)
    order = [n for n in _NAMES if n in wanted]

    def call(g, x, w, off, m, b):
        grads = backward(g, x, w, off, m, b, wrt=wanted, **kwargs)
        return tuple(getattr(grads, n) for n in order)

    args = [_batch(g, batched), _batch(x, batched), w, _batch(off, batched), _batch(m, batched), b]
    per_sample = tuple(_PER_SAMPLE[n] for n in ("grad_output",) + _NAMES)
    out_shapes = [(1,) + values[n].shape if (_PER_SAMPLE[n] and not batched) else values[n].shape for n in order]
    outs = _dispatch(call, args, per_sample, out_shapes, tuple(_PER_SAMPLE[n] for n in order), x.dtype)
    results = dict(zip(order, outs))
    return tuple(
        None if n not in results else (results[n] if batched or not _PER_SAMPLE[n] else results[n][0])
        for n in _NAMES
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(cfg, x, w, off, m, b):
    return _conv_forward_impl(cfg, x, w, off, m, b)


def _conv_fwd(cfg, x, w, off, m, b):
    primals = (x, w, off, m, b)
    wanted = {n: None for n, p in zip(_NAMES, primals) if p is not None and p.perturbed}
    values = tuple(None if p is None else p.value for p in primals)
    # The treedef of a dict of Nones carries the wanted names statically through the residuals.
    return _conv_forward_impl(cfg, *values), (values, wanted)


def _conv_bwd(cfg, residuals, g):
    values, wanted = residuals
    if isinstance(g, _SymbolicZero) or not wanted:
        return (None,) * 5
    return _conv_backward_impl(cfg, g, *values, tuple(n for n in _NAMES if n in wanted))


_conv.defvjp(_conv_fwd, _conv_bwd, symbolic_zeros=True)


def _conv_entry(ndim, transposed, input, weight, offset, mask, bias, stride, padding, output_padding,
                dilation, groups):
    arrays, _ = _check_arrays(dict(input=input, weight=weight, offset=offset, mask=mask, bias=bias))
    x, w, off, m, b = (arrays[n] for n in _NAMES)
    if ndim is None:
        what = "(C_in, C_out/groups, *kernel_size)" if transposed else "(C_out, C_in/groups, *kernel_size)"
        ndim = _geometry.spatial_ndim(tuple(w.shape), None, what)
    cfg = _ConvConfig(
        ndim, transposed,
        _geometry.fix_sequence_arg(stride, ndim, "stride", 1),
        _geometry.fix_sequence_arg(padding, ndim, "padding", 0),
        _geometry.fix_sequence_arg(output_padding, ndim, "output_padding", 0),
        _geometry.fix_sequence_arg(dilation, ndim, "dilation", 1),
        _geometry._as_int(groups, "groups"),
    )
    _geometry_of(cfg, x, w, off, m, b)  # validate now, with the core's messages, traced or not
    if not _is_traced((x, w, off, m, b)):  # no transformation is watching: skip custom_vjp's overhead
        return _conv_forward_impl(cfg, x, w, off, m, b)
    return _conv(cfg, x, w, off, m, b)


def deform_conv(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv_entry(None, False, input, weight, offset, mask, bias, stride, padding, 0, dilation, groups)


def deform_conv1d(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv_entry(1, False, input, weight, offset, mask, bias, stride, padding, 0, dilation, groups)


def deform_conv2d(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv_entry(2, False, input, weight, offset, mask, bias, stride, padding, 0, dilation, groups)


def deform_conv3d(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv_entry(3, False, input, weight, offset, mask, bias, stride, padding, 0, dilation, groups)


def deform_conv_transpose(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                          output_padding=0, dilation=1, groups=1):
    return _conv_entry(None, True, input, weight, offset, mask, bias, stride, padding, output_padding,
                       dilation, groups)


def deform_conv_transpose1d(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                            output_padding=0, dilation=1, groups=1):
    return _conv_entry(1, True, input, weight, offset, mask, bias, stride, padding, output_padding,
                       dilation, groups)


def deform_conv_transpose2d(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                            output_padding=0, dilation=1, groups=1):
    return _conv_entry(2, True, input, weight, offset, mask, bias, stride, padding, output_padding,
                       dilation, groups)


def deform_conv_transpose3d(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                            output_padding=0, dilation=1, groups=1):
    return _conv_entry(3, True, input, weight, offset, mask, bias, stride, padding, output_padding,
                       dilation, groups)


# ---------------------------------------------------------------------------------------------
# mask activations


def _mask_batched(shape, kernel) -> bool:
    return len(shape) == len(kernel) + 2


def _softmax_forward_impl(kernel, mask):
    if not _is_traced((mask,)):
        return _api.mask_softmax(mask, kernel)
    batched = _mask_batched(mask.shape, kernel)
    call = lambda m: (_api.mask_softmax(m, kernel),)  # noqa: E731
    m = _batch(mask, batched)
    (y,) = _dispatch(call, [m], (True,), [m.shape], (True,), mask.dtype)
    return y if batched else y[0]


def _softmax_backward_impl(kernel, g, y):
    if not _is_traced((g, y)):
        return _api.mask_softmax_backward(g, y, kernel)
    batched = _mask_batched(y.shape, kernel)
    call = lambda g, y: (_api.mask_softmax_backward(g, y, kernel),)  # noqa: E731
    gb, yb = _batch(g, batched), _batch(y, batched)
    (gx,) = _dispatch(call, [gb, yb], (True, True), [yb.shape], (True,), y.dtype)
    return gx if batched else gx[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _softmax(kernel, mask):
    return _softmax_forward_impl(kernel, mask)


def _softmax_fwd(kernel, mask):
    y = _softmax_forward_impl(kernel, mask)
    return y, y


def _softmax_bwd(kernel, y, g):
    return (_softmax_backward_impl(kernel, g, y),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _softmax_entry(ndim, mask, kernel_size):
    arrays, _ = _check_arrays(dict(mask=mask))
    m = arrays["mask"]
    ndim = _api._mask_ndim(m.shape, kernel_size, ndim)
    kernel = _geometry.normalise_kernel_size(kernel_size, ndim)
    _api._grouped_view(m.shape, kernel, ndim, "mask")  # validate
    # The kernel is passed on as an N-tuple so that the backward cannot misread N.
    return _softmax(kernel, m) if _is_traced((m,)) else _softmax_forward_impl(kernel, m)


def mask_softmax(mask, kernel_size):
    return _softmax_entry(None, mask, kernel_size)


def mask_softmax1d(mask, kernel_size):
    return _softmax_entry(1, mask, kernel_size)


def mask_softmax2d(mask, kernel_size):
    return _softmax_entry(2, mask, kernel_size)


def mask_softmax3d(mask, kernel_size):
    return _softmax_entry(3, mask, kernel_size)


def _sigmoid_forward_impl(scale, mask):
    if not _is_traced((mask,)):
        return _api.mask_sigmoid(mask, scale)
    call = lambda m: (_api.mask_sigmoid(m, scale),)  # noqa: E731
    (y,) = _dispatch(call, [mask], (True,), [mask.shape], (True,), mask.dtype, elementwise=True)
    return y


def _sigmoid_backward_impl(scale, g, y):
    if not _is_traced((g, y)):
        return _api.mask_sigmoid_backward(g, y, scale)
    call = lambda g, y: (_api.mask_sigmoid_backward(g, y, scale),)  # noqa: E731
    (gx,) = _dispatch(call, [g, y], (True, True), [y.shape], (True,), y.dtype, elementwise=True)
    return gx


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sigmoid(scale, mask):
    return _sigmoid_forward_impl(scale, mask)


def _sigmoid_fwd(scale, mask):
    y = _sigmoid_forward_impl(scale, mask)
    return y, y


def _sigmoid_bwd(scale, y, g):
    return (_sigmoid_backward_impl(scale, g, y),)


_sigmoid.defvjp(_sigmoid_fwd, _sigmoid_bwd)


def mask_sigmoid(mask, scale=2.0):
    arrays, _ = _check_arrays(dict(mask=mask))
    scale, m = _api._check_scale(scale), arrays["mask"]
    return _sigmoid(scale, m) if _is_traced((m,)) else _sigmoid_forward_impl(scale, m)


# ---------------------------------------------------------------------------------------------
# docstrings

_PREAMBLE = """\
Differentiable JAX version of :func:`dcn_cupy.{name}` (a ``jax.custom_vjp``; works under
``jax.jit`` and ``jax.vmap``; see :mod:`dcn_cupy.jax` for how traced calls reach the kernels).
{static} are static Python values; array arguments are ``jax.Array``\\ s of one dtype.

"""


def _fill_docs():
    conv_static = "stride, padding, dilation and groups"
    transpose_static = "stride, padding, output_padding, dilation and groups"
    for name in __all__:
        if name in ("callback_mechanism", "set_callback_mechanism"):
            continue
        if name.startswith("deform_conv_transpose"):
            static = transpose_static
        elif name.startswith("deform_conv"):
            static = conv_static
        elif name.startswith("mask_softmax"):
            static = "kernel_size"
        else:
            static = "scale"
        core = getattr(_api, name).__doc__ or ""
        globals()[name].__doc__ = _PREAMBLE.format(name=name, static=static.capitalize()) + core


_fill_docs()
