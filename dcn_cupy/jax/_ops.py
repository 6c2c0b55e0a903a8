"""The JAX operations: ``jax.custom_vjp``\\ s over the core's forward and backward functions.

Eagerly (concrete arrays) the core's functional API is called with the ``jax.Array``\\ s
(DLPack, zero-copy). Under tracing a convolution builds its plan at trace time from the traced
shapes (``jax.ShapeDtypeStruct``\\ s) and keeps it in the callback's closure: each execution
runs it, writing into XLA's output buffers: on CUDA buffers without vmapped axes straight on
their addresses (the trace fixed every shape and dtype, so nothing is checked), otherwise on
arrays over the buffers, which the plan checks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _api, _geometry
from .._interop import SUPPORTED_DTYPES
from ._callbacks import Tracer, callback_mechanism, cuda_workspace, dispatch, is_traced

try:
    from jax.custom_derivatives import SymbolicZero as _SymbolicZero
except ImportError:  # pragma: no cover
    from jax._src.ad_util import SymbolicZero as _SymbolicZero

_NAMES = _geometry.GRADIENT_NAMES  # ("input", "weight", "offset", "mask", "bias")


def _check_arrays(arrays: dict) -> tuple:
    """jnp arrays (None kept) of one supported dtype; the dtype."""
    out, dtype, first = {}, None, None
    for name, a in arrays.items():
        if a is None:
            out[name] = None
            continue
        if not isinstance(a, (jax.Array, Tracer)):
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


class _Spec(NamedTuple):
    """A traced argument's shape and dtype, what ``dcn_cupy.plan`` takes in place of an array."""

    shape: tuple
    dtype: np.dtype


def _trace_device() -> Optional[str]:
    """The device the callbacks of this trace will most likely run on (plans for any other
    device are built on first use); None when JAX's default device is neither."""
    if callback_mechanism() == "pure_callback":
        return "cpu"
    device = jax.devices()[0]
    if device.platform == "cpu":
        return "cpu"
    if device.platform in ("gpu", "cuda"):
        return f"cuda:{getattr(device, 'local_hardware_id', None) or 0}"
    return None


class _Plans:
    """The plans of one traced configuration, per device; the first built at trace time."""

    def __init__(self, cfg: "_ConvConfig", specs: tuple):
        import dcn_cupy

        kwargs = dict(transposed=True, output_padding=cfg.output_padding) if cfg.transposed else {}
        self._build = functools.partial(dcn_cupy.plan, *specs, cfg.stride, cfg.padding, cfg.dilation, cfg.groups,
                                        **kwargs)
        self._plans = {}
        self._cuda = {}   # CUDA device id -> plan (the same plans, found without a string)
        where = _trace_device()
        if where is not None:
            self._plans[where] = self._build(device=where)

    def _on(self, where: str):
        plan = self._plans.get(where)
        if plan is None:
            plan = self._plans[where] = self._build(device=where)
        return plan

    def of(self, native):
        """The plan for the device of a native (NumPy/CuPy) array."""
        return self._on("cpu" if isinstance(native, np.ndarray) else f"cuda:{native.device.id}")

    def cuda(self, device_id: int):
        """The plan for CUDA device ``device_id``."""
        plan = self._cuda.get(device_id)
        if plan is None:
            plan = self._cuda[device_id] = self._on(f"cuda:{device_id}")
        return plan


@functools.lru_cache(maxsize=256)
def _plans(cfg: "_ConvConfig", specs: tuple) -> _Plans:
    """Shared by the forward's and the backward's traces of a configuration."""
    return _Plans(cfg, specs)


def _specs(args) -> tuple:
    return tuple(None if a is None else _Spec(tuple(a.shape), np.dtype(a.dtype)) for a in args)


def _conv_forward_impl(cfg: _ConvConfig, x, w, off, m, b):
    forward = _api.deform_conv_transpose if cfg.transposed else _api.deform_conv
    kwargs = cfg.kwargs()
    if not is_traced((x, w, off, m, b)):
        return forward(x, w, off, m, b, **kwargs)
    out_shape, batched = _geometry_of(cfg, x, w, off, m, b)
    args = [_batch(x, batched), w, _batch(off, batched), _batch(m, batched), b]
    plans = _plans(cfg, _specs(args))

    def call(x, w, off, m, b):  # under vmap: the functional API, whose cache has the plans
        return (forward(x, w, off, m, b, **kwargs),)

    def into(natives, outs):
        plans.of(natives[0]).forward(*natives, out=outs[0])

    def launch(device_id, pointers, outs, stream):
        plan = plans.cuda(device_id)
        return plan.launch_forward(pointers, outs[0], cuda_workspace(device_id, stream, plan.workspace_bytes), stream)

    (y,) = dispatch(call, args, tuple(_PER_SAMPLE[n] for n in _NAMES), [out_shape], (True,), x.dtype, into=into,
                    launch=launch)
    return y if batched else y[0]


def _conv_backward_impl(cfg: _ConvConfig, g, x, w, off, m, b, wanted: tuple):
    backward = _api.deform_conv_transpose_backward if cfg.transposed else _api.deform_conv_backward
    kwargs = cfg.kwargs()
    values = dict(zip(_NAMES, (x, w, off, m, b)))
    if not is_traced((g, x, w, off, m, b)):
        grads = backward(g, x, w, off, m, b, wrt=wanted, **kwargs)
        return tuple(getattr(grads, n) if n in wanted else None for n in _NAMES)
    _, batched = _geometry_of(cfg, x, w, off, m, b)
    order = tuple(n for n in _NAMES if n in wanted)
    args = [_batch(g, batched), _batch(x, batched), w, _batch(off, batched), _batch(m, batched), b]
    plans = _plans(cfg, _specs(args[1:]))

    def call(g, x, w, off, m, b):
        grads = backward(g, x, w, off, m, b, wrt=wanted, **kwargs)
        return tuple(getattr(grads, n) for n in order)

    def into(natives, outs):
        plans.of(natives[0]).backward(*natives, wrt=order, out=dict(zip(order, outs)))

    wanted_set = frozenset(order)

    def launch(device_id, pointers, outs, stream):
        plan = plans.cuda(device_id)
        return plan.launch_backward(pointers[0], pointers[1:], wanted_set, dict(zip(order, outs)),
                                    cuda_workspace(device_id, stream, plan.workspace_bytes), stream)

    per_sample = tuple(_PER_SAMPLE[n] for n in ("grad_output",) + _NAMES)
    out_shapes = [(1,) + values[n].shape if (_PER_SAMPLE[n] and not batched) else values[n].shape for n in order]
    outs = dispatch(call, args, per_sample, out_shapes, tuple(_PER_SAMPLE[n] for n in order), x.dtype, into=into,
                    launch=launch)
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


def conv_entry(ndim, transposed, input, weight, offset, mask, bias, stride, padding, output_padding,
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
    if not is_traced((x, w, off, m, b)):  # no transformation is watching: skip custom_vjp's overhead
        return _conv_forward_impl(cfg, x, w, off, m, b)
    return _conv(cfg, x, w, off, m, b)


# ---------------------------------------------------------------------------------------------
# mask activations


def _mask_batched(shape, kernel) -> bool:
    return len(shape) == len(kernel) + 2


def _softmax_forward_impl(kernel, mask):
    if not is_traced((mask,)):
        return _api.mask_softmax(mask, kernel)
    batched = _mask_batched(mask.shape, kernel)
    call = lambda m: (_api.mask_softmax(m, kernel),)  # noqa: E731
    m = _batch(mask, batched)
    (y,) = dispatch(call, [m], (True,), [m.shape], (True,), mask.dtype)
    return y if batched else y[0]


def _softmax_backward_impl(kernel, g, y):
    if not is_traced((g, y)):
        return _api.mask_softmax_backward(g, y, kernel)
    batched = _mask_batched(y.shape, kernel)
    call = lambda g, y: (_api.mask_softmax_backward(g, y, kernel),)  # noqa: E731
    gb, yb = _batch(g, batched), _batch(y, batched)
    (gx,) = dispatch(call, [gb, yb], (True, True), [yb.shape], (True,), y.dtype)
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


def softmax_entry(ndim, mask, kernel_size):
    arrays, _ = _check_arrays(dict(mask=mask))
    m = arrays["mask"]
    ndim = _api._mask_ndim(m.shape, kernel_size, ndim)
    kernel = _geometry.normalise_kernel_size(kernel_size, ndim)
    _api._grouped_view(m.shape, kernel, ndim, "mask")  # validate
    # The kernel is passed on as an N-tuple so that the backward cannot misread N.
    return _softmax(kernel, m) if is_traced((m,)) else _softmax_forward_impl(kernel, m)


def _sigmoid_forward_impl(scale, mask):
    if not is_traced((mask,)):
        return _api.mask_sigmoid(mask, scale)
    call = lambda m: (_api.mask_sigmoid(m, scale),)  # noqa: E731
    (y,) = dispatch(call, [mask], (True,), [mask.shape], (True,), mask.dtype, elementwise=True)
    return y


def _sigmoid_backward_impl(scale, g, y):
    if not is_traced((g, y)):
        return _api.mask_sigmoid_backward(g, y, scale)
    call = lambda g, y: (_api.mask_sigmoid_backward(g, y, scale),)  # noqa: E731
    (gx,) = dispatch(call, [g, y], (True, True), [y.shape], (True,), y.dtype, elementwise=True)
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


def sigmoid_entry(mask, scale=2.0):
    arrays, _ = _check_arrays(dict(mask=mask))
    scale, m = _api._check_scale(scale), arrays["mask"]
    return _sigmoid(scale, m) if is_traced((m,)) else _sigmoid_forward_impl(scale, m)


