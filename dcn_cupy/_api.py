"""Public functions: arguments -> plan (cached) -> backend -> results.

Each call turns its arrays into native ones (``_interop``: NumPy and CuPy as they are, torch
zero-copy, DLPack for the rest), finds the plan of its configuration in a bounded, thread-safe
cache (``_plan``: the geometry is validated when a plan is built, once) and runs it on the
data's device and stream; results go back to the caller's library.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Collection, Optional, Sequence, Union

import numpy as np

from . import _backends, _geometry
from ._interop import (_DLPACK, _SUPPORTED, ArrayOrigin, _by_type, check_dtype, check_same_origin, compute_dtype,
                       cupy_or_none, from_native, library_of, to_native)
from ._plan import Gradients, build_plan, cached_plan, default_allow_tf32

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

#: Any array: NumPy, CuPy, torch, JAX, any DLPack producer or a raw DLPack capsule.
Array = Any
IntOrTuple = Union[int, Sequence[int]]

_FORWARD_NAMES = ("input", "weight", "offset", "mask", "bias")
_BACKWARD_NAMES = ("grad_output",) + _FORWARD_NAMES
_REQUIRED = frozenset(("input", "weight", "grad_output"))


# ---------------------------------------------------------------------------------------------
# arguments -> native arrays and the plan key


def _natives(names, arrays):
    """The native arrays of a call and their common origin (input's library, device, dtype)."""
    natives, seen = [], []
    first = None
    for name, array in zip(names, arrays):
        if array is None:
            if name in _REQUIRED:
                raise TypeError(f"{name} must be an array, got None")
            natives.append(None)
            continue
        lib = _by_type.get(type(array)) or library_of(array)
        native, device, device_id = lib.to_native(array, name)
        natives.append(native)
        where = (lib, device, device_id, native.dtype)
        seen.append((name, where))
        if first is None:
            first = where
        elif where != first:
            first = False  # a mixed call: the full check below names the argument
    if first is False or first[3] not in _SUPPORTED or first[0] is _DLPACK:
        origins = {}
        for name, (lib, device, device_id, dtype) in seen:
            check_dtype(dtype, name)
            origins[name] = ArrayOrigin(lib.name, device, device_id, np.dtype(dtype), lib)
        return natives, check_same_origin(origins, "input")
    lib, device, device_id, dtype = first
    return natives, ArrayOrigin(lib.name, device, device_id, dtype, lib)


def _plain(value) -> bool:
    t = type(value)
    if t is int:
        return True
    return (t is tuple or t is list) and all(type(v) is int for v in value)


def _hyper_key(transposed, ndim, weight_shape, stride, padding, dilation, groups, output_padding):
    """The hyper-parameters as hashable values; anything but plain ints (and tuples of them)
    is normalised first, with the geometry's messages for bad values."""
    if type(stride) is int and type(padding) is int and type(dilation) is int and type(groups) is int \
            and type(output_padding) is int:
        return stride, padding, dilation, output_padding, groups
    values = (stride, padding, dilation, output_padding)
    if type(groups) is int and all(_plain(v) for v in values):
        return tuple(tuple(v) if type(v) is list else v for v in values) + (groups,)
    if transposed:
        n = _geometry.spatial_ndim(weight_shape, ndim, "(C_in, C_out/groups, *kernel_size)", "transposed convolution")
    else:
        n = _geometry.spatial_ndim(weight_shape, ndim)
    groups = _geometry.check_groups(groups)
    return (_geometry.fix_sequence_arg(stride, n, "stride", 1), _geometry.fix_sequence_arg(padding, n, "padding", 0),
            _geometry.fix_sequence_arg(dilation, n, "dilation", 1),
            _geometry.fix_sequence_arg(output_padding, n, "output_padding", 0), groups)


def _plan_of(transposed, ndim, natives, origin, stride, padding, dilation, groups, output_padding):
    """The cached plan of a call's configuration (built, and so validated, on first use)."""
    x, w, off, msk, b = natives
    dtype, device = origin.dtype, origin.device
    hyper = _hyper_key(transposed, ndim, w.shape, stride, padding, dilation, groups, output_padding)
    if device == "cuda":
        tf32, settings = default_allow_tf32(dtype, device), _backends.cuda_settings()
    else:
        tf32 = settings = False
    forced = _backends.forced_algorithm()
    key = (transposed, ndim, x.shape, w.shape, None if off is None else off.shape, None if msk is None else msk.shape,
           None if b is None else b.shape, hyper, dtype, device, origin.device_id, tf32, forced, settings)

    def build():
        shapes = {"input": tuple(x.shape), "weight": tuple(w.shape), "offset": None if off is None else tuple(off.shape),
                  "mask": None if msk is None else tuple(msk.shape), "bias": None if b is None else tuple(b.shape)}
        return build_plan(transposed, ndim, shapes, dtype, device, origin.device_id, hyper[0], hyper[1], hyper[2],
                          hyper[4], hyper[3], False, tf32, forced)

    return cached_plan(key, build)


def _on_device(plan, origin):
    """The device (and the library's stream) current for a CUDA plan; None on the CPU."""
    device = plan._device_ctx
    if device is None:
        return None
    stream = origin.stream()
    if isinstance(stream, contextlib.nullcontext):
        return device
    stack = contextlib.ExitStack()
    stack.enter_context(device)
    stack.enter_context(stream)
    return stack


def _forward(transposed, ndim, input, weight, offset, mask, bias, stride, padding, dilation, groups,
             output_padding=0):
    natives, origin = _natives(_FORWARD_NAMES, (input, weight, offset, mask, bias))
    plan = _plan_of(transposed, ndim, natives, origin, stride, padding, dilation, groups, output_padding)
    context = _on_device(plan, origin)
    if context is None:
        y = plan._forward(natives)
    else:
        with context:
            y = plan._forward(natives)
    return from_native(y, origin)


def _backward(transposed, ndim, grad_output, input, weight, offset, mask, bias, stride, padding, dilation, groups,
              wrt, output_padding=0):
    natives, origin = _natives(_BACKWARD_NAMES, (grad_output, input, weight, offset, mask, bias))
    plan = _plan_of(transposed, ndim, natives[1:], origin, stride, padding, dilation, groups, output_padding)
    gy = natives[0]
    if gy.shape != plan.output_shape:
        raise ValueError(f"grad_output must have the output's shape {tuple(plan.output_shape)}, got {tuple(gy.shape)}")
    wanted = plan._wanted(wrt)
    context = _on_device(plan, origin)
    if context is None:
        grads = plan._backward(natives, wanted)
    else:
        with context:
            grads = plan._backward(natives, wanted)
    return Gradients(*(from_native(grads[name], origin) for name in _geometry.GRADIENT_NAMES))


# ---------------------------------------------------------------------------------------------
# mask activations


class _Call:
    """The native arrays of one element-wise call, their common origin and array module."""

    def __init__(self, arrays: dict):
        natives, origins = {}, {}
        for name, array in arrays.items():
            if array is None:
                raise TypeError(f"{name} must be an array, got None")
            natives[name], origins[name] = to_native(array, name)
        self.origin = check_same_origin(origins, next(iter(arrays)))
        self.xp = np if self.origin.device == "cpu" else cupy_or_none()
        self.native = natives

    def device(self):
        if self.origin.device == "cpu":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(self.xp.cuda.Device(self.origin.device_id))
        stack.enter_context(self.origin.stream())
        return stack

    def result(self, array):
        return from_native(array, self.origin)


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
# public functions: generated here, one factory per operation (docstrings from the templates below)


def _conv_function(ndim: Optional[int]):
    def deform_conv(input: Array, weight: Array, offset: Optional[Array] = None, mask: Optional[Array] = None,
                    bias: Optional[Array] = None, stride: IntOrTuple = 1, padding: IntOrTuple = 0,
                    dilation: IntOrTuple = 1, groups: int = 1) -> Array:
        return _forward(False, ndim, input, weight, offset, mask, bias, stride, padding, dilation, groups)
    return deform_conv


def _conv_backward_function(ndim: Optional[int]):
    def deform_conv_backward(grad_output: Array, input: Array, weight: Array, offset: Optional[Array] = None,
                             mask: Optional[Array] = None, bias: Optional[Array] = None, stride: IntOrTuple = 1,
                             padding: IntOrTuple = 0, dilation: IntOrTuple = 1, groups: int = 1, *,
                             wrt: Optional[Collection[str]] = None) -> Gradients:
        return _backward(False, ndim, grad_output, input, weight, offset, mask, bias, stride, padding, dilation,
                         groups, wrt)
    return deform_conv_backward


def _transpose_function(ndim: Optional[int]):
    def deform_conv_transpose(input: Array, weight: Array, offset: Optional[Array] = None,
                              mask: Optional[Array] = None, bias: Optional[Array] = None, stride: IntOrTuple = 1,
                              padding: IntOrTuple = 0, output_padding: IntOrTuple = 0, dilation: IntOrTuple = 1,
                              groups: int = 1) -> Array:
        return _forward(True, ndim, input, weight, offset, mask, bias, stride, padding, dilation, groups,
                        output_padding)
    return deform_conv_transpose


def _transpose_backward_function(ndim: Optional[int]):
    def deform_conv_transpose_backward(grad_output: Array, input: Array, weight: Array,
                                       offset: Optional[Array] = None, mask: Optional[Array] = None,
                                       bias: Optional[Array] = None, stride: IntOrTuple = 1,
                                       padding: IntOrTuple = 0, output_padding: IntOrTuple = 0,
                                       dilation: IntOrTuple = 1, groups: int = 1, *,
                                       wrt: Optional[Collection[str]] = None) -> Gradients:
        return _backward(True, ndim, grad_output, input, weight, offset, mask, bias, stride, padding, dilation,
                         groups, wrt, output_padding)
    return deform_conv_transpose_backward


def _mask_softmax_function(ndim: Optional[int]):
    def mask_softmax(mask: Array, kernel_size: IntOrTuple) -> Array:
        return _mask_softmax(ndim, mask, kernel_size)
    return mask_softmax


def _generate():
    factories = {
        "deform_conv{}": _conv_function, "deform_conv{}_backward": _conv_backward_function,
        "deform_conv_transpose{}": _transpose_function, "deform_conv_transpose{}_backward": _transpose_backward_function,
        "mask_softmax{}": _mask_softmax_function,
    }
    for pattern, factory in factories.items():
        for ndim in (None, 1, 2, 3):
            name = pattern.format("" if ndim is None else f"{ndim}d")
            function = factory(ndim)
            function.__name__ = function.__qualname__ = name
            function.__module__ = __name__
            globals()[name] = function


_generate()


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

Arrays may come from NumPy, CuPy, PyTorch, JAX or any DLPack producer (raw DLPack capsules
included: their result comes back as a NumPy/CuPy array unless another argument names a
library). The configuration is validated once and cached (see :func:`dcn_cupy.plan`).

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
