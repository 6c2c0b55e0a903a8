"""The ``torch.ops.dcn_cupy`` custom ops: registration, fake (meta) kernels and autograd.

Each convolution op holds a plan per configuration (:mod:`._plans`); a call allocates its
output, gradients and workspace with torch (``torch.empty`` on the tensor's device) and runs
the plan on views of the tensors, on torch's current stream (:mod:`._runtime`). Nothing in
the op synchronises with the host, so the ops can be captured in CUDA graphs.

The mask activations are element-wise and are computed with torch's own operations (in
float32 for the half types, as the core does).
"""

from __future__ import annotations

import warnings
from typing import List, Optional, Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _api, _geometry
from . import _plans, _runtime

NAMES = _geometry.GRADIENT_NAMES  # ("input", "weight", "offset", "mask", "bias")
_CONTIGUOUS = torch.contiguous_format


def _shape(t: Optional[Tensor]):
    return None if t is None else tuple(t.shape)


def _static(*shapes) -> bool:
    """Whether every dimension is a plain int (no symbolic sizes from dynamic-shape tracing)."""
    return all(type(d) is int for s in shapes if s is not None for d in s)


# ---------------------------------------------------------------------------------------------
# running a plan on tensors


def _address(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _forward(transposed: bool, tensors: Sequence[Optional[Tensor]], hyper, plan=None, ctx=None) -> Tensor:
    """The forward; ``ctx`` (an autograd context) records in ``ctx.raw`` the tensors' addresses
    where they passed the raw-address checks, else None (the backward then checks only
    ``grad_output``, and reuses the addresses: autograd refuses saved tensors changed since)."""
    input = tensors[0]
    if plan is None:
        plan = _plans.plan_for(transposed, tensors, hyper)
    out = input.new_empty(plan.output_shape)
    launch = _runtime.launch_addresses(tensors)
    if ctx is not None:
        ctx.raw = None if launch is None else launch[1]
    if launch is not None:  # the plan's shapes hold by construction: its launches on raw addresses
        stream, addresses = launch
        workspace = _workspace_tensor(plan.forward_workspace_bytes, input)
        if plan.launch_forward(addresses, out.data_ptr(), _address(workspace), stream):
            return out
    with _runtime.cuda_scope(input):
        plan.forward(*(_runtime.native(t) for t in tensors), out=_runtime.native(out),
                     workspace=_workspace(plan.forward_workspace_bytes, input))
    return out


#: Per pattern of requested gradients and present tensors: which gradients are wanted (one bool
#: per NAMES entry), their names as a list and as a frozenset (built once, not at every backward).
_WANTED: dict = {}


def _wanted_names(wrt: Sequence[bool], tensors: Sequence[Optional[Tensor]]):
    key = (tuple(wrt), tensors[2] is None, tensors[3] is None, tensors[4] is None)
    found = _WANTED.get(key)
    if found is None:
        wanted = tuple(bool(w) and t is not None for w, t in zip(wrt, tensors))
        names = [name for name, w in zip(NAMES, wanted) if w]
        found = _WANTED[key] = (wanted, names, frozenset(names))
    return found


def _backward(transposed: bool, grad_output: Tensor, tensors: Sequence[Optional[Tensor]], hyper,
              wrt: Sequence[bool], plan=None, raw: Optional[tuple] = None, placeholders: bool = True):
    """The five gradients; one not computed is an empty tensor (custom-op schemas have no
    optional outputs), or None where ``placeholders`` is False. ``plan``: the forward's, when
    still the one to use; ``raw``: the addresses of the saved ``tensors``, which passed the
    raw-address checks in the forward (autograd refuses saved tensors changed in place since)."""
    input = tensors[0]
    wanted, names, name_set = _wanted_names(wrt, tensors)
    # empty_like: the cheapest allocation call (no shape, dtype or device to parse); a contiguous
    # tensor's own layout is contiguous (as raw's tensors are), and without the memory_format
    # keyword it costs ~1 µs less
    grads = [(torch.empty_like(t) if raw is not None or t.is_contiguous()
              else torch.empty_like(t, memory_format=_CONTIGUOUS))
             if w else (input.new_empty(0) if placeholders else None)
             for w, t in zip(wanted, tensors)]
    if not names:
        return tuple(grads)
    if (plan is None or plan.deterministic != torch.are_deterministic_algorithms_enabled()
            or plan.allow_tf32 != _runtime.allow_tf32(input)):
        plan = _plans.plan_for(transposed, tensors, hyper)
    contiguous = grad_output.is_contiguous()
    if not contiguous and not (grad_output.dim() > 1 and grad_output.shape[0] > 0 and grad_output[0].is_contiguous()):
        grad_output, contiguous = grad_output.contiguous(), True   # torch's copy: cheaper than CuPy's in the plan
    launch = None   # (stream, grad_output's address, the tensors' addresses)
    if raw is not None:   # the saved tensors passed launch_addresses: grad_output's checks alone, inline
        index = grad_output.get_device()
        stream = (_runtime.launch_stream(index) if contiguous and grad_output.dtype == input.dtype
                  and not grad_output.is_neg() and index == input.get_device() else None)
        if stream is not None:
            launch = (stream, grad_output.data_ptr(), raw)
    else:
        found = _runtime.launch_addresses((grad_output,) + tuple(tensors))
        if found is not None:
            launch = (found[0], found[1][0], found[1][1:])
    if launch is not None:
        stream, gy_address, addresses = launch
        workspace = _workspace_tensor(plan.backward_workspace_bytes, input)
        outs = {name: g.data_ptr() for name, g, w in zip(NAMES, grads, wanted) if w}
        if plan.launch_backward(gy_address, addresses, name_set, outs, _address(workspace), stream):
            return tuple(grads)
    args = [_runtime.native(grad_output)] + [_runtime.native(t) for t in tensors]
    out = {name: _runtime.native(g) for name, g, w in zip(NAMES, grads, wanted) if w}
    with _runtime.cuda_scope(input):
        try:
            plan.backward(*args, wrt=names, out=out, workspace=_workspace(plan.backward_workspace_bytes, input))
        except ValueError as error:
            if not plan.deterministic:
                raise
            # No deterministic algorithm serves this backward: torch's convention.
            op = "deform_conv_transpose_backward" if transposed else "deform_conv_backward"
            message = (f"dcn_cupy::{op} does not have a deterministic implementation for this configuration "
                       f"({error}), but you set 'torch.use_deterministic_algorithms(True)'")
            if not torch.is_deterministic_algorithms_warn_only_enabled():
                raise RuntimeError(message) from error
            warnings.warn(message)
            plan = _plans.plan_for(transposed, tensors, hyper, deterministic=False)
            plan.backward(*args, wrt=names, out=out, workspace=_workspace(plan.backward_workspace_bytes, input))
    return tuple(grads)


def _workspace_tensor(size: int, like: Tensor) -> Optional[Tensor]:
    """A workspace of ``size`` bytes from torch's caching allocator (None when 0)."""
    return like.new_empty(size, dtype=torch.uint8) if size else None


def _workspace(size: int, like: Tensor):
    return _runtime.native(_workspace_tensor(size, like))


def _wanted(needs_input_grad, tensors) -> List[bool]:
    return [bool(needs_input_grad[i]) and t is not None for i, t in enumerate(tensors)]


def _empty_to_none(grads, wanted):
    return tuple(g if w else None for g, w in zip(grads, wanted))


# ---------------------------------------------------------------------------------------------
# deformable convolution


@torch.library.custom_op(
    "dcn_cupy::deform_conv", mutates_args=(),
    schema="(Tensor input, Tensor weight, Tensor? offset, Tensor? mask, Tensor? bias, "
           "int[] stride, int[] padding, int[] dilation, int groups) -> Tensor",
)
def deform_conv(input, weight, offset, mask, bias, stride, padding, dilation, groups):
    return _forward(False, (input, weight, offset, mask, bias), (stride, padding, (), dilation, groups))


@deform_conv.register_fake
def _deform_conv_fake(input, weight, offset, mask, bias, stride, padding, dilation, groups):
    shapes = [_shape(t) for t in (input, weight, offset, mask, bias)]
    if _static(*shapes):  # full validation, with the core's messages
        geom, batched = _geometry.conv_geometry(*shapes, tuple(stride), tuple(padding), tuple(dilation), groups)
        return input.new_empty(geom.y_shape if batched else geom.y_shape[1:])
    n = weight.dim() - 2
    lead = [input.shape[0]] if input.dim() == n + 2 else []
    spatial = input.shape[input.dim() - n:]
    out = [_geometry.conv_output_size(spatial[a], weight.shape[2 + a], stride[a], padding[a], dilation[a])
           for a in range(n)]
    return input.new_empty(lead + [weight.shape[0]] + out)


@torch.library.custom_op(
    "dcn_cupy::deform_conv_backward", mutates_args=(),
    schema="(Tensor grad_output, Tensor input, Tensor weight, Tensor? offset, Tensor? mask, Tensor? bias, "
           "int[] stride, int[] padding, int[] dilation, int groups, bool[] wrt) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def deform_conv_backward(grad_output, input, weight, offset, mask, bias, stride, padding, dilation, groups, wrt):
    return _backward(False, grad_output, (input, weight, offset, mask, bias),
                     (stride, padding, (), dilation, groups), wrt)


def _backward_fake(grad_output, input, weight, offset, mask, bias, *rest):
    wrt = rest[-1]
    tensors = (input, weight, offset, mask, bias)
    return tuple(
        t.new_empty(t.shape) if (w and t is not None) else input.new_empty(0) for t, w in zip(tensors, wrt)
    )


deform_conv_backward.register_fake(_backward_fake)


def _conv_setup_context(ctx, inputs, output):
    input, weight, offset, mask, bias, *hyper = inputs
    ctx.save_for_backward(input, weight, offset, mask, bias)
    ctx.hyper = hyper


def _conv_autograd(ctx, grad_output):
    tensors = ctx.saved_tensors
    wanted = _wanted(ctx.needs_input_grad, tensors)
    grads = torch.ops.dcn_cupy.deform_conv_backward(grad_output, *tensors, *ctx.hyper, wanted)
    return _empty_to_none(grads, wanted) + (None,) * len(ctx.hyper)


deform_conv.register_autograd(_conv_autograd, setup_context=_conv_setup_context)


# ---------------------------------------------------------------------------------------------
# transposed deformable convolution


@torch.library.custom_op(
    "dcn_cupy::deform_conv_transpose", mutates_args=(),
    schema="(Tensor input, Tensor weight, Tensor? offset, Tensor? mask, Tensor? bias, "
           "int[] stride, int[] padding, int[] output_padding, int[] dilation, int groups) -> Tensor",
)
def deform_conv_transpose(input, weight, offset, mask, bias, stride, padding, output_padding, dilation, groups):
    return _forward(True, (input, weight, offset, mask, bias), (stride, padding, output_padding, dilation, groups))


@deform_conv_transpose.register_fake
def _deform_conv_transpose_fake(input, weight, offset, mask, bias, stride, padding, output_padding,
                                dilation, groups):
    shapes = [_shape(t) for t in (input, weight, offset, mask, bias)]
    if _static(*shapes):
        geom, batched = _geometry.conv_transpose_geometry(
            *shapes, tuple(stride), tuple(padding), tuple(output_padding), tuple(dilation), groups)
        return input.new_empty(geom.x_shape if batched else geom.x_shape[1:])
    n = weight.dim() - 2
    lead = [input.shape[0]] if input.dim() == n + 2 else []
    spatial = input.shape[input.dim() - n:]
    out = [_geometry.conv_transpose_output_size(spatial[a], weight.shape[2 + a], stride[a], padding[a],
                                                dilation[a], output_padding[a]) for a in range(n)]
    return input.new_empty(lead + [weight.shape[1] * groups] + out)


@torch.library.custom_op(
    "dcn_cupy::deform_conv_transpose_backward", mutates_args=(),
    schema="(Tensor grad_output, Tensor input, Tensor weight, Tensor? offset, Tensor? mask, Tensor? bias, "
           "int[] stride, int[] padding, int[] output_padding, int[] dilation, int groups, bool[] wrt) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def deform_conv_transpose_backward(grad_output, input, weight, offset, mask, bias, stride, padding,
                                   output_padding, dilation, groups, wrt):
    return _backward(True, grad_output, (input, weight, offset, mask, bias),
                     (stride, padding, output_padding, dilation, groups), wrt)


deform_conv_transpose_backward.register_fake(_backward_fake)


def _transpose_autograd(ctx, grad_output):
    tensors = ctx.saved_tensors
    wanted = _wanted(ctx.needs_input_grad, tensors)
    grads = torch.ops.dcn_cupy.deform_conv_transpose_backward(grad_output, *tensors, *ctx.hyper, wanted)
    return _empty_to_none(grads, wanted) + (None,) * len(ctx.hyper)


deform_conv_transpose.register_autograd(_transpose_autograd, setup_context=_conv_setup_context)


# ---------------------------------------------------------------------------------------------
# eager calls: the same implementation without the custom-op dispatcher


class EagerConv(torch.autograd.Function):
    """What an eager call of a convolution runs: ``_forward``/``_backward`` as an autograd
    Function, which skips the custom-op dispatcher's layers (tens of microseconds of host time
    per call). Tracing (``torch.compile``, ``torch.export``, ``torch.jit.trace``) and tensor
    subclasses (fake tensors) go through the registered ops instead.
    ``EagerConv.apply(transposed, hyper, input, weight, offset, mask, bias)``."""

    @staticmethod
    def forward(ctx, transposed, hyper, input, weight, offset, mask, bias):
        tensors = (input, weight, offset, mask, bias)
        ctx.save_for_backward(*tensors)
        ctx.transposed, ctx.hyper = transposed, hyper
        # the plan the backward uses too (unless torch's deterministic or TF32 flag changes meanwhile)
        ctx.plan = _plans.plan_for(transposed, tensors, hyper)
        return _forward(transposed, tensors, hyper, ctx.plan, ctx)

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled():  # create_graph=True: refuse a double backward, as once_differentiable
            return _backward_once(ctx, grad_output)
        return _eager_backward(ctx, grad_output)


def _eager_backward(ctx, grad_output):
    grads = _backward(ctx.transposed, grad_output, ctx.saved_tensors, ctx.hyper, ctx.needs_input_grad[2:],
                      ctx.plan, ctx.raw, placeholders=False)
    return (None, None) + grads


#: The backward when autograd records it (``create_graph=True``): torch's wrapper that makes a
#: second differentiation raise. Without recording (the usual case) its checks cost ~5 µs.
_backward_once = once_differentiable(_eager_backward)

#: ``EagerConv.apply`` below torch's Python ``Function.apply`` (the C++ apply it ends in, bound
#: to EagerConv), and the two checks that wrapper makes before it: functorch transforms (which
#: need that wrapper) and dead functorch wrappers among the tensors (unwrapped).
try:
    _eager_apply = super(torch.autograd.Function, EagerConv).apply
    _functorch_active = torch._C._are_functorch_transforms_active
    _unwrap_if_dead = torch._C._functorch.unwrap_if_dead
except AttributeError:  # pragma: no cover - a torch without them
    _eager_apply = None


def eager_conv(transposed: bool, hyper, input, weight, offset, mask, bias) -> Tensor:
    """``EagerConv.apply(transposed, hyper, input, weight, offset, mask, bias)``, skipping torch's
    Python wrapper of ``apply`` where no functorch transform is active (its argument binding and
    generator cost ~10 µs of host time per call: a third of the forward's own)."""
    if _eager_apply is None or _functorch_active():
        return EagerConv.apply(transposed, hyper, input, weight, offset, mask, bias)
    return _eager_apply(transposed, hyper, _unwrap_if_dead(input), _unwrap_if_dead(weight),
                        None if offset is None else _unwrap_if_dead(offset),
                        None if mask is None else _unwrap_if_dead(mask),
                        None if bias is None else _unwrap_if_dead(bias))


# ---------------------------------------------------------------------------------------------
# mask activations (element-wise: torch computes them, in float32 for the half types)


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _grouped(t: Tensor, kernel_size) -> Tensor:
    """``t`` viewed as ``(B, G_m, K, *Q)`` in the compute dtype."""
    view = _api._grouped_view(tuple(t.shape), tuple(kernel_size), len(kernel_size), "mask")
    return t.to(_compute_dtype(t)).reshape(view)


@torch.library.custom_op("dcn_cupy::mask_softmax", mutates_args=(),
                         schema="(Tensor mask, int[] kernel_size) -> Tensor")
def mask_softmax(mask, kernel_size):
    y = torch.softmax(_grouped(mask, kernel_size), dim=2)
    return y.to(mask.dtype).reshape(mask.shape).contiguous()


@mask_softmax.register_fake
def _mask_softmax_fake(mask, kernel_size):
    if _static(_shape(mask)):  # validation only
        _api._grouped_view(tuple(mask.shape), tuple(kernel_size), len(kernel_size), "mask")
    return torch.empty_like(mask, memory_format=torch.contiguous_format)


@torch.library.custom_op("dcn_cupy::mask_softmax_backward", mutates_args=(),
                         schema="(Tensor grad_output, Tensor output, int[] kernel_size) -> Tensor")
def mask_softmax_backward(grad_output, output, kernel_size):
    y, g = _grouped(output, kernel_size), _grouped(grad_output, kernel_size)
    gx = y * (g - (g * y).sum(dim=2, keepdim=True))
    return gx.to(output.dtype).reshape(output.shape).contiguous()


@mask_softmax_backward.register_fake
def _mask_softmax_backward_fake(grad_output, output, kernel_size):
    return torch.empty_like(output, memory_format=torch.contiguous_format)


def _save_output(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.argument = inputs[1]


def _mask_softmax_autograd(ctx, grad_output):
    (output,) = ctx.saved_tensors
    return torch.ops.dcn_cupy.mask_softmax_backward(grad_output, output, ctx.argument), None


mask_softmax.register_autograd(_mask_softmax_autograd, setup_context=_save_output)


@torch.library.custom_op("dcn_cupy::mask_sigmoid", mutates_args=(),
                         schema="(Tensor mask, float scale) -> Tensor")
def mask_sigmoid(mask, scale):
    y = scale * torch.sigmoid(mask.to(_compute_dtype(mask)))
    return y.to(mask.dtype).contiguous()


@mask_sigmoid.register_fake
def _mask_sigmoid_fake(mask, scale):
    return torch.empty_like(mask, memory_format=torch.contiguous_format)


@torch.library.custom_op("dcn_cupy::mask_sigmoid_backward", mutates_args=(),
                         schema="(Tensor grad_output, Tensor output, float scale) -> Tensor")
def mask_sigmoid_backward(grad_output, output, scale):
    compute = _compute_dtype(output)
    y, g = output.to(compute), grad_output.to(compute)
    return (g * y * (1 - y / scale)).to(output.dtype).contiguous()


@mask_sigmoid_backward.register_fake
def _mask_sigmoid_backward_fake(grad_output, output, scale):
    return torch.empty_like(output, memory_format=torch.contiguous_format)


def _mask_sigmoid_autograd(ctx, grad_output):
    (output,) = ctx.saved_tensors
    return torch.ops.dcn_cupy.mask_sigmoid_backward(grad_output, output, ctx.argument), None


mask_sigmoid.register_autograd(_mask_sigmoid_autograd, setup_context=_save_output)
