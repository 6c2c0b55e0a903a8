"""Public functions: arguments -> geometry -> backend -> results.

Each call turns its arrays into native ones (``_interop``), validates and normalises the
hyper-parameters (``_geometry``), runs the backend of the data's device and hands the
results back to the caller's library. The transposed convolution is built from the
convolution's primitives by duality (design section 1):

* transposed forward            = convolution backward-to-input (+ bias);
* transposed backward-to-input  = convolution forward with the same offsets and mask;
* transposed weight/offset/mask = the convolution's, with ``x`` and ``grad_output`` swapped.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from . import _geometry
from ._backends import get_backend
from ._interop import check_same_origin, compute_dtype, from_native, to_native

__all__ = [
    "Gradients",
    "deform_conv", "deform_conv1d", "deform_conv2d", "deform_conv3d",
    "deform_conv_backward", "deform_conv1d_backward", "deform_conv2d_backward", "deform_conv3d_backward",
    "deform_conv_transpose", "deform_conv_transpose1d", "deform_conv_transpose2d", "deform_conv_transpose3d",
    "deform_conv_transpose_backward", "deform_conv_transpose1d_backward",
    "deform_conv_transpose2d_backward", "deform_conv_transpose3d_backward",
    "mask_softmax", "mask_softmax1d", "mask_softmax2d", "mask_softmax3d", "mask_softmax_backward",
    "mask_sigmoid", "mask_sigmoid_backward",
]


class Gradients(NamedTuple):
    """Gradients of a deformable convolution; an entry is None when it was not computed."""

    input: object = None
    weight: object = None
    offset: object = None
    mask: object = None
    bias: object = None


class _Call:
    """The native arrays of one call, their common origin and the backend that serves them."""

    def __init__(self, arrays: dict):
        natives, origins = {}, {}
        for name, array in arrays.items():
            natives[name], origins[name] = to_native(array, name)
        reference = next(iter(arrays))
        self.origin = check_same_origin(origins, reference)
        self.backend = get_backend(self.origin.device)
        self.xp = self.backend.xp
        self.native = natives

    def device(self):
        return self.backend.device_context(self.origin.device_id)

    def contiguous(self, name: str, batched: bool):
        """The argument as a C-contiguous native array with a batch axis."""
        array = self.native[name]
        if array is None:
            return None
        if not batched:
            array = array[None]
        return self.xp.ascontiguousarray(array)

    def result(self, array, batched: bool = True):
        if array is None:
            return None
        if not batched:
            array = array[0]
        return from_native(array, self.origin)


def _channel_sum(xp, grad_output, dtype):
    """Sum over batch and spatial axes (the bias gradient), accumulated in float32 or better."""
    axes = (0,) + tuple(range(2, grad_output.ndim))
    return xp.sum(grad_output, axis=axes, dtype=compute_dtype(dtype)).astype(dtype)


# ---------------------------------------------------------------------------------------------
# deformable convolution


def _conv_forward(ndim, input, weight, offset, mask, bias, stride, padding, dilation, groups):
    call = _Call({"input": input, "weight": weight, "offset": offset, "mask": mask, "bias": bias})
    n = call.native
    geom, batched = _geometry.conv_geometry(
        n["input"].shape, n["weight"].shape, _shape(n["offset"]), _shape(n["mask"]), _shape(n["bias"]),
        stride, padding, dilation, groups, ndim=ndim,
    )
    xp, dtype = call.xp, call.origin.dtype
    with call.device():
        if geom.batch == 0:
            return call.result(xp.empty(geom.y_shape, dtype=dtype), batched)
        y = call.backend.conv_forward(
            call.contiguous("input", batched), xp.ascontiguousarray(n["weight"]),
            call.contiguous("offset", batched), call.contiguous("mask", batched),
            call.contiguous("bias", True), geom,
        )
    return call.result(y, batched)


def _conv_backward(ndim, grad_output, input, weight, offset, mask, bias, stride, padding, dilation,
                   groups, wrt):
    call = _Call({"input": input, "grad_output": grad_output, "weight": weight, "offset": offset,
                  "mask": mask, "bias": bias})
    n = call.native
    geom, batched = _geometry.conv_geometry(
        n["input"].shape, n["weight"].shape, _shape(n["offset"]), _shape(n["mask"]), _shape(n["bias"]),
        stride, padding, dilation, groups, ndim=ndim,
    )
    expected = geom.y_shape if batched else geom.y_shape[1:]
    _check_grad_output(n["grad_output"].shape, expected)
    wanted = _geometry.normalise_wrt(wrt, _given(n))
    xp, dtype = call.xp, call.origin.dtype
    with call.device():
        # x is read only by the parameter gradients.
        x = call.contiguous("input", batched) if wanted & {"weight", "offset", "mask"} else None
        w = xp.ascontiguousarray(n["weight"])
        off, msk = call.contiguous("offset", batched), call.contiguous("mask", batched)
        gy = call.contiguous("grad_output", batched)
        grads = dict.fromkeys(_geometry.GRADIENT_NAMES)
        if geom.batch == 0:
            grads.update(_empty_batch_gradients(xp, dtype, geom, wanted))
        else:
            if wanted & {"input", "weight", "offset", "mask"}:
                grads["input"], grads["weight"], grads["offset"], grads["mask"] = call.backend.conv_backward(
                    gy, x, w, off, msk, geom, wanted & {"input", "weight", "offset", "mask"},
                )
            if "bias" in wanted:
                grads["bias"] = _channel_sum(xp, gy, dtype)
    return _gradients(call, grads, batched)


# ---------------------------------------------------------------------------------------------
# transposed deformable convolution


def _transpose_forward(ndim, input, weight, offset, mask, bias, stride, padding, output_padding,
                       dilation, groups):
    call = _Call({"input": input, "weight": weight, "offset": offset, "mask": mask, "bias": bias})
    n = call.native
    geom, batched = _geometry.conv_transpose_geometry(
        n["input"].shape, n["weight"].shape, _shape(n["offset"]), _shape(n["mask"]), _shape(n["bias"]),
        stride, padding, output_padding, dilation, groups, ndim=ndim,
    )
    xp, dtype = call.xp, call.origin.dtype
    with call.device():
        if geom.batch == 0:
            return call.result(xp.empty(geom.x_shape, dtype=dtype), batched)
        y = call.backend.conv_backward(
            call.contiguous("input", batched), None, xp.ascontiguousarray(n["weight"]),
            call.contiguous("offset", batched), call.contiguous("mask", batched), geom,
            frozenset({"input"}), bias=call.contiguous("bias", True),
        )[0]
    return call.result(y, batched)


def _transpose_backward(ndim, grad_output, input, weight, offset, mask, bias, stride, padding,
                        output_padding, dilation, groups, wrt):
    call = _Call({"input": input, "grad_output": grad_output, "weight": weight, "offset": offset,
                  "mask": mask, "bias": bias})
    n = call.native
    geom, batched = _geometry.conv_transpose_geometry(
        n["input"].shape, n["weight"].shape, _shape(n["offset"]), _shape(n["mask"]), _shape(n["bias"]),
        stride, padding, output_padding, dilation, groups, ndim=ndim,
    )
    expected = geom.x_shape if batched else geom.x_shape[1:]
    _check_grad_output(n["grad_output"].shape, expected)
    wanted = _geometry.normalise_wrt(wrt, _given(n))
    xp, dtype = call.xp, call.origin.dtype
    with call.device():
        # z is read only by the parameter gradients.
        z = call.contiguous("input", batched) if wanted & {"weight", "offset", "mask"} else None
        w = xp.ascontiguousarray(n["weight"])
        off, msk = call.contiguous("offset", batched), call.contiguous("mask", batched)
        gy = call.contiguous("grad_output", batched)
        grads = dict.fromkeys(_geometry.GRADIENT_NAMES)
        if geom.batch == 0:
            grads.update(_empty_batch_gradients(xp, dtype, geom, wanted, transposed=True))
        else:
            if "input" in wanted:
                grads["input"] = call.backend.conv_forward(gy, w, off, msk, None, geom)
            if wanted & {"weight", "offset", "mask"}:
                _, grads["weight"], grads["offset"], grads["mask"] = call.backend.conv_backward(
                    z, gy, w, off, msk, geom, wanted & {"weight", "offset", "mask"},
                )
            if "bias" in wanted:
                grads["bias"] = _channel_sum(xp, gy, dtype)
    return _gradients(call, grads, batched)


# ---------------------------------------------------------------------------------------------
# helpers


def _shape(array) -> Optional[tuple]:
    return None if array is None else tuple(array.shape)


def _given(natives: dict) -> dict:
    return {name: natives[name] is not None for name in _geometry.GRADIENT_NAMES}


def _check_grad_output(shape, expected) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(f"grad_output must have the output's shape {tuple(expected)}, got {tuple(shape)}")


def _empty_batch_gradients(xp, dtype, geom, wanted, transposed=False) -> dict:
    """Gradients for a batch of 0: empty per-sample ones, zero parameter ones."""
    shapes = {
        "input": geom.y_shape if transposed else geom.x_shape,
        "offset": geom.offset_shape,
        "mask": geom.mask_shape,
    }
    grads = {name: xp.empty(shape, dtype=dtype) for name, shape in shapes.items() if name in wanted}
    if "weight" in wanted:
        grads["weight"] = xp.zeros(geom.weight_shape, dtype=dtype)
    if "bias" in wanted:
        channels = geom.in_channels if transposed else geom.out_channels
        grads["bias"] = xp.zeros((channels,), dtype=dtype)
    return grads


def _gradients(call: _Call, grads: dict, batched: bool) -> Gradients:
    per_sample = ("input", "offset", "mask")
    return Gradients(**{
        name: call.result(value, batched or name not in per_sample) for name, value in grads.items()
    })


# ---------------------------------------------------------------------------------------------
# mask activations


def _mask_ndim(mask_shape, kernel_size, ndim: Optional[int], name: str = "mask") -> int:
    """N of a mask activation: given, else len(kernel_size) for a tuple, else mask.ndim - 2."""
    if ndim is not None:
        return ndim
    if isinstance(kernel_size, (tuple, list)):
        return len(kernel_size)
    if len(mask_shape) not in (3, 4, 5):
        raise ValueError(f"{name} must be 3-D, 4-D or 5-D (B, G_m*K, *Q) with an int kernel_size "
                         f"(pass a tuple for an unbatched mask), got shape {tuple(mask_shape)}")
    return len(mask_shape) - 2


def _grouped_view(shape, kernel_size, ndim, name):
    """The shape ``(B, G_m, K, *Q)`` of a mask, batched or not."""
    kernel = _geometry.normalise_kernel_size(kernel_size, ndim)
    if len(shape) not in (ndim + 1, ndim + 2):
        raise ValueError(
            f"{name} must be {ndim + 2}-D (B, G_m*K, *Q) or {ndim + 1}-D (G_m*K, *Q), got shape {tuple(shape)}"
        )
    batched = len(shape) == ndim + 2
    full = tuple(shape) if batched else (1,) + tuple(shape)
    volume = int(np.prod(kernel))
    if full[1] == 0 or full[1] % volume:
        raise ValueError(f"{name}.shape[1] must be a positive multiple of K={volume}, got {full[1]}")
    return (full[0], full[1] // volume, volume) + full[2:]


def _mask_softmax(ndim, mask, kernel_size):
    call = _Call({"mask": mask})
    m = call.native["mask"]
    view = _grouped_view(m.shape, kernel_size, _mask_ndim(m.shape, kernel_size, ndim), "mask")
    xp, dtype = call.xp, call.origin.dtype
    with call.device():
        v = m.reshape(view).astype(compute_dtype(dtype))
        e = xp.exp(v - v.max(axis=2, keepdims=True)) if v.size else v
        y = (e / e.sum(axis=2, keepdims=True)).astype(dtype).reshape(m.shape)
    return call.result(y)


def mask_softmax_backward(grad_output, output, kernel_size):
    """Gradient of :func:`mask_softmax` with respect to its input.

    Args:
        grad_output: gradient of the loss with respect to the softmax output,
            shape ``(B, G_m*K, *Q)`` (or unbatched).
        output: the softmax output of the forward call, same shape.
        kernel_size (int or tuple): the kernel size used in the forward call. An int means
            ``N = output.ndim - 2`` (a batched mask); pass a tuple for an unbatched one.

    Returns:
        ``output * (grad_output - sum_taps(grad_output * output))``, same shape.
    """
    call = _Call({"output": output, "grad_output": grad_output})
    y, g = call.native["output"], call.native["grad_output"]
    if tuple(g.shape) != tuple(y.shape):
        raise ValueError(f"grad_output must have the output's shape {tuple(y.shape)}, got {tuple(g.shape)}")
    view = _grouped_view(y.shape, kernel_size, _mask_ndim(y.shape, kernel_size, None, "output"), "output")
    dtype = call.origin.dtype
    with call.device():
        yv = y.reshape(view).astype(compute_dtype(dtype))
        gv = g.reshape(view).astype(compute_dtype(dtype))
        gx = yv * (gv - (gv * yv).sum(axis=2, keepdims=True))
    return call.result(gx.astype(dtype).reshape(y.shape))


def _check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def mask_sigmoid(mask, scale=2.0):
    """``scale * sigmoid(mask)``, the modulation-mask activation of DCNv2 (scale 2 keeps 1 at 0).

    Args:
        mask: any-shaped array (typically ``(B, G_m*K, *Q)``).
        scale (float): the factor; default 2.0.

    Returns:
        An array of ``mask``'s shape, library and dtype.

    Example::

        >>> import numpy as np, dcn_cupy
        >>> dcn_cupy.mask_sigmoid(np.zeros(3, np.float32))
        array([1., 1., 1.], dtype=float32)
    """
    scale = _check_scale(scale)
    call = _Call({"mask": mask})
    m = call.native["mask"]
    xp, dtype = call.xp, call.origin.dtype
    with call.device():
        v = m.astype(compute_dtype(dtype))
        e = xp.exp(-xp.abs(v))  # never overflows
        s = xp.where(v >= 0, 1 / (1 + e), e / (1 + e))
        y = (scale * s).astype(dtype)
    return call.result(y)


def mask_sigmoid_backward(grad_output, output, scale=2.0):
    """Gradient of :func:`mask_sigmoid` from its output: ``grad * y * (1 - y / scale)``.

    Args:
        grad_output: gradient with respect to the output, the output's shape.
        output: the output of the forward call.
        scale (float): the scale used in the forward call.
    """
    scale = _check_scale(scale)
    call = _Call({"output": output, "grad_output": grad_output})
    y, g = call.native["output"], call.native["grad_output"]
    if tuple(g.shape) != tuple(y.shape):
        raise ValueError(f"grad_output must have the output's shape {tuple(y.shape)}, got {tuple(g.shape)}")
    xp, dtype = call.xp, call.origin.dtype
    with call.device():
        yv, gv = y.astype(compute_dtype(dtype)), g.astype(compute_dtype(dtype))
        gx = gv * yv * (1 - yv / scale) if scale != 0 else xp.zeros_like(yv)
    return call.result(gx.astype(dtype))


# ---------------------------------------------------------------------------------------------
# public functions (docstrings are filled in below from one template per operation)


def deform_conv(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv_forward(None, input, weight, offset, mask, bias, stride, padding, dilation, groups)


def deform_conv1d(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv_forward(1, input, weight, offset, mask, bias, stride, padding, dilation, groups)


def deform_conv2d(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv_forward(2, input, weight, offset, mask, bias, stride, padding, dilation, groups)


def deform_conv3d(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv_forward(3, input, weight, offset, mask, bias, stride, padding, dilation, groups)


def deform_conv_backward(grad_output, input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                         dilation=1, groups=1, *, wrt=None):
    return _conv_backward(None, grad_output, input, weight, offset, mask, bias, stride, padding, dilation,
                          groups, wrt)


def deform_conv1d_backward(grad_output, input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                           dilation=1, groups=1, *, wrt=None):
    return _conv_backward(1, grad_output, input, weight, offset, mask, bias, stride, padding, dilation,
                          groups, wrt)


def deform_conv2d_backward(grad_output, input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                           dilation=1, groups=1, *, wrt=None):
    return _conv_backward(2, grad_output, input, weight, offset, mask, bias, stride, padding, dilation,
                          groups, wrt)


def deform_conv3d_backward(grad_output, input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                           dilation=1, groups=1, *, wrt=None):
    return _conv_backward(3, grad_output, input, weight, offset, mask, bias, stride, padding, dilation,
                          groups, wrt)


def deform_conv_transpose(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                          output_padding=0, dilation=1, groups=1):
    return _transpose_forward(None, input, weight, offset, mask, bias, stride, padding, output_padding,
                              dilation, groups)


def deform_conv_transpose1d(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                            output_padding=0, dilation=1, groups=1):
    return _transpose_forward(1, input, weight, offset, mask, bias, stride, padding, output_padding,
                              dilation, groups)


def deform_conv_transpose2d(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                            output_padding=0, dilation=1, groups=1):
    return _transpose_forward(2, input, weight, offset, mask, bias, stride, padding, output_padding,
                              dilation, groups)


def deform_conv_transpose3d(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0,
                            output_padding=0, dilation=1, groups=1):
    return _transpose_forward(3, input, weight, offset, mask, bias, stride, padding, output_padding,
                              dilation, groups)


def deform_conv_transpose_backward(grad_output, input, weight, offset=None, mask=None, bias=None, stride=1,
                                   padding=0, output_padding=0, dilation=1, groups=1, *, wrt=None):
    return _transpose_backward(None, grad_output, input, weight, offset, mask, bias, stride, padding,
                               output_padding, dilation, groups, wrt)


def deform_conv_transpose1d_backward(grad_output, input, weight, offset=None, mask=None, bias=None, stride=1,
                                     padding=0, output_padding=0, dilation=1, groups=1, *, wrt=None):
    return _transpose_backward(1, grad_output, input, weight, offset, mask, bias, stride, padding,
                               output_padding, dilation, groups, wrt)


def deform_conv_transpose2d_backward(grad_output, input, weight, offset=None, mask=None, bias=None, stride=1,
                                     padding=0, output_padding=0, dilation=1, groups=1, *, wrt=None):
    return _transpose_backward(2, grad_output, input, weight, offset, mask, bias, stride, padding,
                               output_padding, dilation, groups, wrt)


def deform_conv_transpose3d_backward(grad_output, input, weight, offset=None, mask=None, bias=None, stride=1,
                                     padding=0, output_padding=0, dilation=1, groups=1, *, wrt=None):
    return _transpose_backward(3, grad_output, input, weight, offset, mask, bias, stride, padding,
                               output_padding, dilation, groups, wrt)


def mask_softmax(mask, kernel_size):
    return _mask_softmax(None, mask, kernel_size)


def mask_softmax1d(mask, kernel_size):
    return _mask_softmax(1, mask, kernel_size)


def mask_softmax2d(mask, kernel_size):
    return _mask_softmax(2, mask, kernel_size)


def mask_softmax3d(mask, kernel_size):
    return _mask_softmax(3, mask, kernel_size)


_SPATIAL = {1: ("L", "k_l"), 2: ("H, W", "k_h, k_w"), 3: ("D, H, W", "k_d, k_h, k_w")}

_CONV_DOC = """\
Performs {title} deformable convolution (DCN v1, or v2 when ``mask`` is given).

Each kernel tap samples the input at its regular position shifted by a learned offset,
with {interp} interpolation (zero outside the input), scales the sample by the mask and
multiplies it with the weight. Without offset and mask it is exactly a plain convolution.

Args:
    input (array[B, C_in, {S}]): input; unbatched ``(C_in, {S})`` gives an unbatched output.
    weight (array[C_out, C_in // groups, {k}]): convolution weights.
    offset (array[B, G_o * K * {n}, {Q}], optional): offsets; channel ``(g*K + t)*{n} + a`` shifts
        tap ``t`` (row-major over the kernel) of offset group ``g`` along spatial axis ``a``
        ({axes}). ``G_o`` is read off the channel count; input channel ``c`` uses offset group
        ``c // (C_in / G_o)``. None: the regular grid.
    mask (array[B, G_m * K, {Q}], optional): modulation masks, channel ``g*K + t``; ``G_m``
        is independent of ``G_o``. None: a mask of ones.
    bias (array[C_out], optional): added to every output position.
    stride (int or tuple): stride of the convolution. Default: 1.
    padding (int or tuple): zero padding on both sides of each spatial axis. Default: 0.
    dilation (int or tuple): spacing between kernel taps. Default: 1.
    groups (int): number of blocked connections from input to output channels. Default: 1.

Shapes: ``K = {K}`` and, per spatial axis, ``Q = (S + 2*padding - dilation*(k - 1) - 1) // stride + 1``.

Returns:
    array[B, C_out, {Q}]: the output, in ``input``'s library, device and dtype.

Example::

{example}
"""

_CONV_BACKWARD_DOC = """\
Gradients of :func:`{name}` with respect to its arguments.

Args:
    grad_output (array[B, C_out, {Q}]): gradient of the loss with respect to the output.
    input, weight, offset, mask, bias, stride, padding, dilation, groups: as in :func:`{name}`.
    wrt (collection of str, optional): the gradients to compute, a subset of
        ``{{"input", "weight", "offset", "mask", "bias"}}``. None: every argument that was
        given. Only the requested work is done.

Returns:
    Gradients: a named tuple ``(input, weight, offset, mask, bias)`` of arrays shaped like the
    arguments; an entry is None when not requested or when its argument was None.
"""

_TRANSPOSE_DOC = """\
Performs {title} transposed deformable convolution.

The adjoint of :func:`{conv}` with the same weight, offsets and mask: each input element is
scattered, weighted, to the {interp} corners of its shifted position. Without offset and mask
it equals ``torch.nn.functional.conv_transpose{dims}``.

Args:
    input (array[B, C_in, {S}]): input; unbatched ``(C_in, {S})`` gives an unbatched output.
    weight (array[C_in, C_out // groups, {k}]): weights (the same layout as torch's).
    offset (array[B, G_o * K * {n}, {S}], optional): offsets on the INPUT grid; channel
        ``(g*K + t)*{n} + a`` ({axes}); offset groups partition the output channels.
    mask (array[B, G_m * K, {S}], optional): modulation masks on the input grid.
    bias (array[C_out], optional): added to every output position.
    stride, padding, dilation (int or tuple): as in the convolution this is the adjoint of.
    output_padding (int or tuple): extra size added to one side of each output axis,
        ``0 <= output_padding < max(stride, dilation)``. Default: 0.
    groups (int): number of blocked connections. Default: 1.

Shapes: ``K = {K}`` and, per spatial axis,
``out = (S - 1)*stride - 2*padding + dilation*(k - 1) + 1 + output_padding``.

Returns:
    array[B, C_out, {out}]: the output, in ``input``'s library, device and dtype.
"""

_TRANSPOSE_BACKWARD_DOC = _CONV_BACKWARD_DOC.replace(
    "stride, padding, dilation, groups", "stride, padding, output_padding, dilation, groups"
)

_MASK_SOFTMAX_DOC = """\
Softmax of modulation masks over the ``K`` kernel taps of each mask group{where}.

Args:
    mask (array[B, G_m * K, {Q}]): mask logits (or unbatched ``(G_m * K, {Q})``).
    kernel_size (int or tuple): the convolution's kernel size; ``K`` is its product.

Returns:
    The softmax over the view ``(B, G_m, K, {Q})`` along the taps, in ``mask``'s shape.
"""

_INTERP = {1: "linear", 2: "bilinear", 3: "trilinear"}
_AXES = {1: "axis 0 = length", 2: "``(dy, dx)``", 3: "``(dz, dy, dx)``"}


def _example(n: int) -> str:
    shape = {1: "(4, 8, 32)", 2: "(4, 8, 32, 32)", 3: "(4, 8, 8, 8, 8)"}[n]
    wshape = {1: "(16, 8, 3)", 2: "(16, 8, 3, 3)", 3: "(16, 8, 3, 3, 3)"}[n]
    grid = {1: "30", 2: "30, 30", 3: "6, 6, 6"}[n]
    k = 3 ** n
    return (
        "    >>> import numpy as np, dcn_cupy\n"
        f"    >>> x = np.random.rand{shape}.astype(np.float32)\n"
        f"    >>> w = np.random.rand{wshape}.astype(np.float32)\n"
        f"    >>> offset = np.random.rand(4, {n * k}, {grid}).astype(np.float32)\n"
        f"    >>> mask = np.random.rand(4, {k}, {grid}).astype(np.float32)\n"
        f"    >>> dcn_cupy.deform_conv{n}d(x, w, offset, mask).shape\n"
        f"    (4, 16, {grid})"
    )


def _fill_docs():
    for n in (1, 2, 3):
        spatial, kernel = _SPATIAL[n]
        q = ", ".join(f"{s}_out" for s in spatial.split(", "))
        common = dict(title=f"{n}D", S=spatial, k=kernel, n=n, Q=q, K="*".join(kernel.split(", ")),
                      interp=_INTERP[n], axes=_AXES[n], dims=f"{n}d", out=q, conv=f"deform_conv{n}d")
        globals()[f"deform_conv{n}d"].__doc__ = _CONV_DOC.format(example=_example(n), **common)
        globals()[f"deform_conv{n}d_backward"].__doc__ = _CONV_BACKWARD_DOC.format(name=f"deform_conv{n}d", **common)
        globals()[f"deform_conv_transpose{n}d"].__doc__ = _TRANSPOSE_DOC.format(**common)
        globals()[f"deform_conv_transpose{n}d_backward"].__doc__ = _TRANSPOSE_BACKWARD_DOC.format(
            name=f"deform_conv_transpose{n}d", **common)
        globals()[f"mask_softmax{n}d"].__doc__ = _MASK_SOFTMAX_DOC.format(where=f" ({n}D)", Q=q)
    generic = dict(title="1D, 2D or 3D (N = weight.ndim - 2)", S="*S", k="*kernel_size", n="N", Q="*Q",
                   K="prod(kernel_size)", interp="N-linear", axes="axis 0 = first spatial axis", dims="Nd",
                   out="*out", conv="deform_conv")
    deform_conv.__doc__ = _CONV_DOC.format(example=_example(2).replace("deform_conv2d", "deform_conv"), **generic)
    deform_conv_backward.__doc__ = _CONV_BACKWARD_DOC.format(name="deform_conv", **generic)
    deform_conv_transpose.__doc__ = _TRANSPOSE_DOC.format(**generic)
    deform_conv_transpose_backward.__doc__ = _TRANSPOSE_BACKWARD_DOC.format(name="deform_conv_transpose", **generic)
    mask_softmax.__doc__ = _MASK_SOFTMAX_DOC.format(
        where=" (N = len(kernel_size) for a tuple, else mask.ndim - 2)", Q="*Q")


_fill_docs()
