"""Functional forms: argument checks, autocast, then the ``torch.ops.dcn_cupy`` custom ops.

The public functions keep the core's argument order (weight second, as
``torch.nn.functional.conv2d``)::

    y = dcn_cupy.torch.deform_conv2d(x, weight, offset, mask, bias, stride=1, padding=1)

They are generated here, one factory per family, with their signatures and annotations.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import Tensor

from .. import _api, _geometry
from . import _ops  # noqa: F401  (registers torch.ops.dcn_cupy.*)

__all__ = [
    "deform_conv", "deform_conv1d", "deform_conv2d", "deform_conv3d",
    "deform_conv_transpose", "deform_conv_transpose1d", "deform_conv_transpose2d", "deform_conv_transpose3d",
    "mask_softmax", "mask_softmax1d", "mask_softmax2d", "mask_softmax3d", "mask_sigmoid",
]

IntOrTuple = Union[int, Sequence[int]]


def _check_tensor(t, name: str, optional: bool = True) -> None:
    if t is None and optional:
        return
    if not isinstance(t, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(t).__module__}.{type(t).__name__}; "
            f"for other array libraries use the dcn_cupy.* functions"
        )


def _check_tensors(input, weight, offset, mask, bias) -> None:
    _check_tensor(input, "input", optional=False)
    _check_tensor(weight, "weight", optional=False)
    _check_tensor(offset, "offset")
    _check_tensor(mask, "mask")
    _check_tensor(bias, "bias")


try:
    _any_autocast = torch._C._is_any_autocast_enabled
except AttributeError:  # pragma: no cover - a torch without it
    def _any_autocast() -> bool:
        return True


def _autocast(tensors: List[Optional[Tensor]]) -> List[Optional[Tensor]]:
    """Under torch.autocast, floating arguments other than float64 become the autocast dtype
    (as for F.conv2d)."""
    if not _any_autocast():   # the usual case, in one call (~2 µs less than the per-device check)
        return tensors
    first = tensors[0]
    device_type = "cuda" if first.is_cuda else first.device.type   # is_cuda: no device object
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return [t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
            for t in tensors]


_PLAIN = (Tensor, torch.nn.Parameter)

#: How a convolution call runs (_route).
_OP, _NO_GRAPH, _GRAPH = 0, 1, 2


def _route(tensors) -> int:
    """``_OP``: through the registered custom op (tracing: torch.compile, torch.export,
    torch.jit.trace; or a tensor subclass such as a fake tensor). Otherwise eagerly, skipping
    the dispatcher: ``_GRAPH`` through the autograd Function when autograd records the call
    (grad mode on and some argument requires grad), else ``_NO_GRAPH`` (no node to build:
    ~10 µs of host time less). One pass over the tensors."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return _OP
    grad = False
    for t in tensors:
        if t is not None:
            if type(t) not in _PLAIN:
                return _OP
            grad = grad or t.requires_grad
    return _GRAPH if grad and torch.is_grad_enabled() else _NO_GRAPH


def _plain_ints(*values) -> bool:
    """Whether each value is an int or a tuple of ints (hashable, and no bool that would
    compare equal to an int)."""
    for v in values:
        if type(v) is not int and not (type(v) is tuple and all(type(e) is int for e in v)):
            return False
    return True


#: Checked hyper-parameters by (N, *the arguments as given): a module passes the same ones at
#: every call, and their checks (~6 µs) then run once. Only plain ints and tuples of ints are
#: kept; other values are checked at every call.
_hyper_cache: dict = {}
_MAX_HYPER = 256


def _conv_hyper(n, stride, padding, output_padding, dilation, groups):
    """((stride, padding, output_padding, dilation) as n-tuples, groups) checked; output_padding
    None for a convolution (then () in the result)."""
    cacheable = _plain_ints(stride, padding, output_padding, dilation, groups) if output_padding is not None \
        else _plain_ints(stride, padding, dilation, groups)
    key = (n, stride, padding, output_padding, dilation, groups) if cacheable else None
    found = _hyper_cache.get(key) if cacheable else None
    if found is not None:
        return found
    hyper = (_geometry.fix_sequence_arg(stride, n, "stride", 1),
             _geometry.fix_sequence_arg(padding, n, "padding", 0),
             () if output_padding is None else _geometry.fix_sequence_arg(output_padding, n, "output_padding", 0),
             _geometry.fix_sequence_arg(dilation, n, "dilation", 1),
             _geometry.check_groups(groups))
    if cacheable:
        if len(_hyper_cache) >= _MAX_HYPER:
            _hyper_cache.clear()
        _hyper_cache[key] = hyper
    return hyper


def _convolve(transposed: bool, tensors: List[Optional[Tensor]], hyper) -> Tensor:
    """Run a checked call: autocast, then the eager path or the registered op (``_route``)."""
    tensors = _autocast(tensors)
    route = _route(tensors)
    if route == _GRAPH:
        return _ops.eager_conv(transposed, hyper, *tensors)
    if route == _NO_GRAPH:
        return _ops._forward(transposed, tensors, hyper)
    stride, padding, output_padding, dilation, groups = hyper   # the ops' int[] arguments: lists
    if transposed:
        return torch.ops.dcn_cupy.deform_conv_transpose(*tensors, list(stride), list(padding), list(output_padding),
                                                        list(dilation), groups)
    return torch.ops.dcn_cupy.deform_conv(*tensors, list(stride), list(padding), list(dilation), groups)


def _deform_conv(ndim, input, weight, offset, mask, bias, stride, padding, dilation, groups) -> Tensor:
    _check_tensors(input, weight, offset, mask, bias)
    n = _geometry.spatial_ndim(tuple(weight.shape), ndim)
    hyper = _conv_hyper(n, stride, padding, None, dilation, groups)
    return _convolve(False, [input, weight, offset, mask, bias], hyper)


def _deform_conv_transpose(ndim, input, weight, offset, mask, bias, stride, padding, output_padding,
                           dilation, groups) -> Tensor:
    _check_tensors(input, weight, offset, mask, bias)
    n = _geometry.spatial_ndim(tuple(weight.shape), ndim, "(C_in, C_out/groups, *kernel_size)",
                               "transposed convolution")
    hyper = _conv_hyper(n, stride, padding, output_padding, dilation, groups)
    return _convolve(True, [input, weight, offset, mask, bias], hyper)


def _mask_softmax(ndim, mask, kernel_size) -> Tensor:
    _check_tensor(mask, "mask", optional=False)
    ndim = _api._mask_ndim(tuple(mask.shape), kernel_size, ndim)
    kernel = list(_geometry.normalise_kernel_size(kernel_size, ndim))
    (mask,) = _autocast([mask])
    return torch.ops.dcn_cupy.mask_softmax(mask, kernel)


def mask_sigmoid(mask: Tensor, scale: float = 2.0) -> Tensor:
    """``scale * sigmoid(mask)``, differentiable; see :func:`dcn_cupy.mask_sigmoid`."""
    _check_tensor(mask, "mask", optional=False)
    scale = _api._check_scale(scale)
    (mask,) = _autocast([mask])
    return torch.ops.dcn_cupy.mask_sigmoid(mask, scale)


# ---------------------------------------------------------------------------------------------
# the generated public forms


def _named(function: Callable, name: str, doc: str) -> Callable:
    function.__name__ = function.__qualname__ = name
    function.__doc__ = doc
    return function


def _conv_function(ndim: Optional[int], doc: str) -> Callable[..., Tensor]:
    def function(input: Tensor, weight: Tensor, offset: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                 bias: Optional[Tensor] = None, stride: IntOrTuple = 1, padding: IntOrTuple = 0,
                 dilation: IntOrTuple = 1, groups: int = 1) -> Tensor:
        return _deform_conv(ndim, input, weight, offset, mask, bias, stride, padding, dilation, groups)

    return _named(function, "deform_conv" if ndim is None else f"deform_conv{ndim}d", doc)


def _transpose_function(ndim: Optional[int], doc: str) -> Callable[..., Tensor]:
    def function(input: Tensor, weight: Tensor, offset: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                 bias: Optional[Tensor] = None, stride: IntOrTuple = 1, padding: IntOrTuple = 0,
                 output_padding: IntOrTuple = 0, dilation: IntOrTuple = 1, groups: int = 1) -> Tensor:
        return _deform_conv_transpose(ndim, input, weight, offset, mask, bias, stride, padding, output_padding,
                                      dilation, groups)

    return _named(function, "deform_conv_transpose" if ndim is None else f"deform_conv_transpose{ndim}d", doc)


def _mask_softmax_function(ndim: Optional[int], doc: str) -> Callable[..., Tensor]:
    def function(mask: Tensor, kernel_size: IntOrTuple) -> Tensor:
        return _mask_softmax(ndim, mask, kernel_size)

    return _named(function, "mask_softmax" if ndim is None else f"mask_softmax{ndim}d", doc)


deform_conv = _conv_function(None, """Deformable convolution of any N (``N = weight.dim() - 2``), differentiable; see
    :func:`dcn_cupy.deform_conv` for shapes and semantics.""")
deform_conv1d = _conv_function(1, "1D deformable convolution, differentiable; see :func:`dcn_cupy.deform_conv1d`.")
deform_conv2d = _conv_function(2, """2D deformable convolution (DCNv1, v2 with ``mask``), differentiable; see
    :func:`dcn_cupy.deform_conv2d`. Note the argument order: weight second, as in
    ``torch.nn.functional.conv2d`` (torchvision puts offset second).""")
deform_conv3d = _conv_function(3, "3D deformable convolution, differentiable; see :func:`dcn_cupy.deform_conv3d`.")

deform_conv_transpose = _transpose_function(None, """Transposed deformable convolution of any N, differentiable; see
    :func:`dcn_cupy.deform_conv_transpose`.""")
deform_conv_transpose1d = _transpose_function(
    1, "1D transposed deformable convolution; see :func:`dcn_cupy.deform_conv_transpose1d`.")
deform_conv_transpose2d = _transpose_function(
    2, "2D transposed deformable convolution; see :func:`dcn_cupy.deform_conv_transpose2d`.")
deform_conv_transpose3d = _transpose_function(
    3, "3D transposed deformable convolution; see :func:`dcn_cupy.deform_conv_transpose3d`.")

mask_softmax = _mask_softmax_function(
    None, "Softmax over the ``K`` taps of each mask group, differentiable; see :func:`dcn_cupy.mask_softmax`.")
mask_softmax1d = _mask_softmax_function(1, "1D :func:`mask_softmax`: ``mask`` is ``(B, G_m*K, L)``.")
mask_softmax2d = _mask_softmax_function(2, "2D :func:`mask_softmax`: ``mask`` is ``(B, G_m*K, H, W)``.")
mask_softmax3d = _mask_softmax_function(3, "3D :func:`mask_softmax`: ``mask`` is ``(B, G_m*K, D, H, W)``.")
