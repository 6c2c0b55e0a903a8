"""TensorFlow adapter: every dcn_cupy operation as a differentiable TensorFlow function.

Each function is a ``tf.custom_gradient`` over dcn_cupy's explicit forward and backward, so
``tf.GradientTape`` (and Keras training) differentiates it with respect to every tensor argument.
Arguments may be ``tf.Tensor``s, ``tf.Variable``s or anything ``tf.convert_to_tensor`` takes
(NumPy arrays are converted to the input's dtype); results are ``tf.Tensor``s::

    import tensorflow as tf
    import dcn_cupy.tensorflow as dctf

    x = tf.random.normal((2, 4, 9, 9))
    w = tf.Variable(tf.random.normal((8, 4, 3, 3)))
    offset = tf.zeros((2, 18, 9, 9))
    with tf.GradientTape() as tape:
        y = dctf.deform_conv2d(x, w, offset, padding=1)
        loss = tf.reduce_sum(y ** 2)
    grad_w, grad_offset = tape.gradient(loss, [w, offset])

How the data reaches the kernels:

* eagerly, CPU tensors are viewed by NumPy and GPU tensors reach the CUDA kernels through
  DLPack, both zero-copy; results come back on the input's device;
* inside ``tf.function`` (graph mode) each call is a ``tf.numpy_function``: TensorFlow hands
  the operands to Python as NumPy arrays (on the host, copied from a GPU) and the CPU backend
  computes. Static shapes are propagated, so shapes stay known in the graph.

Layout is dcn_cupy's (channels first, DESIGN §1); :mod:`dcn_cupy.keras` has channels-last layers.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import tensorflow as tf

import dcn_cupy

from ._library import LIBRARY, register

__all__ = [
    "deform_conv", "deform_conv1d", "deform_conv2d", "deform_conv3d",
    "deform_conv_transpose", "deform_conv_transpose1d", "deform_conv_transpose2d", "deform_conv_transpose3d",
    "mask_softmax", "mask_softmax1d", "mask_softmax2d", "mask_softmax3d", "mask_sigmoid",
]

IntOrTuple = Union[int, Sequence[int]]
_ARGUMENTS = ("input", "weight", "offset", "mask", "bias")


# ---------------------------------------------------------------------------------------------
# running a dcn_cupy function on tensors, eagerly or inside a graph


def _eager(tensors) -> bool:
    return tf.executing_eagerly() and all(hasattr(t, "numpy") for t in tensors)


def _call(function, tensors: list, names: list, out_dtypes: list, out_shapes: list):
    """``function(*native arrays) -> tuple of native arrays`` applied to ``tensors`` (argument
    ``names``, for error messages).

    Eagerly: zero-copy views in and out. In a graph: one ``tf.numpy_function`` (host arrays).
    """
    if _eager(tensors):
        natives = [LIBRARY.to_native(t, name)[0] for t, name in zip(tensors, names)]
        return [LIBRARY.from_native(r) for r in function(*natives)]

    def host(*arrays):
        return tuple(np.ascontiguousarray(r) for r in function(*arrays))

    results = tf.numpy_function(host, tensors, out_dtypes, stateful=False)
    for result, shape in zip(results, out_shapes):
        result.set_shape(shape)
    return results


def _as_tensor(value, dtype=None, name: str = "input"):
    if value is None:
        return None
    if isinstance(value, tf.Tensor) and not isinstance(value, tf.Variable):
        return value
    # Variables (tf.Variable, Keras variables) are read here, outside the custom gradient, so
    # that the tape sees the read and their gradient flows through the op's inputs.
    try:
        return tf.convert_to_tensor(value, dtype=dtype)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be a tensor or array-like, got {type(value).__module__}."
                        f"{type(value).__name__} ({error})") from error


def _tuple(value, ndim: int) -> tuple:
    return (int(value),) * ndim if isinstance(value, (int, np.integer)) else tuple(int(v) for v in value)


def _conv_output_shape(x_shape, w_shape, ndim, transposed, params) -> tf.TensorShape:
    """The static output shape (None where unknown): the shape rules of DESIGN §1."""
    x_shape, w_shape = tf.TensorShape(x_shape), tf.TensorShape(w_shape)
    if x_shape.rank is None or w_shape.rank is None:
        return tf.TensorShape(None)
    batched = x_shape.rank == ndim + 2
    spatial = list(x_shape)[-ndim:]
    kernel = list(w_shape)[2:]
    stride, padding, dilation = (_tuple(params[k], ndim) for k in ("stride", "padding", "dilation"))
    groups = int(params["groups"])
    out = []
    for a in range(ndim):
        s, k = spatial[a], kernel[a]
        if s is None or k is None:
            out.append(None)
        elif transposed:
            op = _tuple(params["output_padding"], ndim)[a]
            out.append((s - 1) * stride[a] - 2 * padding[a] + dilation[a] * (k - 1) + 1 + op)
        else:
            out.append((s + 2 * padding[a] - dilation[a] * (k - 1) - 1) // stride[a] + 1)
    channels = w_shape[1] * groups if transposed and w_shape[1] is not None else (None if transposed else w_shape[0])
    return tf.TensorShape(([x_shape[0]] if batched else []) + [channels] + out)


# ---------------------------------------------------------------------------------------------
# the operations


def _deform_conv(ndim: Optional[int], transposed: bool, input, weight, offset, mask, bias, params: dict):
    x = _as_tensor(input, name="input")
    dtype = x.dtype
    given = {"input": x}
    for name, value in zip(_ARGUMENTS[1:], (weight, offset, mask, bias)):
        if value is not None:
            given[name] = _as_tensor(value, dtype, name)
    names = list(given)
    w = given["weight"]
    n = ndim if ndim is not None else (w.shape.rank - 2 if w.shape.rank is not None else None)
    if n is None:
        raise ValueError("weight must have a known rank to infer the number of spatial dimensions")
    generic = "deform_conv_transpose" if transposed else "deform_conv"
    forward = getattr(dcn_cupy, generic)
    backward = getattr(dcn_cupy, generic + "_backward")
    y_shape = _conv_output_shape(x.shape, w.shape, n, transposed, params)

    @tf.custom_gradient
    def op(*tensors):
        def run_forward(*arrays):
            return (forward(**dict(zip(names, arrays)), **params),)

        (y,) = _call(run_forward, list(tensors), names, [dtype], [y_shape])

        def grad(dy):
            def run_backward(g, *arrays):
                grads = backward(g, **dict(zip(names, arrays)), **params, wrt=set(names))
                return tuple(getattr(grads, name) for name in names)

            shapes = [t.shape for t in tensors]
            return _call(run_backward, [tf.convert_to_tensor(dy, dtype)] + list(tensors), ["grad_output"] + names,
                         [dtype] * len(names), shapes)

        return y, grad

    return op(*given.values())


def _mask_activation(forward, backward, mask, *args):
    m = _as_tensor(mask, name="mask")

    @tf.custom_gradient
    def op(t):
        (y,) = _call(lambda a: (forward(a, *args),), [t], ["mask"], [t.dtype], [t.shape])

        def grad(dy):
            (g,) = _call(lambda gy, out: (backward(gy, out, *args),),
                         [tf.convert_to_tensor(dy, t.dtype), y], ["grad_output", "output"], [t.dtype], [t.shape])
            return g

        return y, grad

    return op(m)


def _conv_function(ndim: Optional[int]):
    def deform_conv(input, weight, offset=None, mask=None, bias=None, stride: IntOrTuple = 1,
                    padding: IntOrTuple = 0, dilation: IntOrTuple = 1, groups: int = 1) -> tf.Tensor:
        params = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
        return _deform_conv(ndim, False, input, weight, offset, mask, bias, params)

    return _named(deform_conv, f"deform_conv{ndim}d" if ndim else "deform_conv")


def _transpose_function(ndim: Optional[int]):
    def deform_conv_transpose(input, weight, offset=None, mask=None, bias=None, stride: IntOrTuple = 1,
                              padding: IntOrTuple = 0, output_padding: IntOrTuple = 0,
                              dilation: IntOrTuple = 1, groups: int = 1) -> tf.Tensor:
        params = dict(stride=stride, padding=padding, output_padding=output_padding, dilation=dilation,
                      groups=groups)
        return _deform_conv(ndim, True, input, weight, offset, mask, bias, params)

    return _named(deform_conv_transpose, f"deform_conv_transpose{ndim}d" if ndim else "deform_conv_transpose")


def _softmax_function(ndim: Optional[int]):
    name = f"mask_softmax{ndim}d" if ndim else "mask_softmax"
    core = getattr(dcn_cupy, name)

    def mask_softmax(mask, kernel_size: IntOrTuple) -> tf.Tensor:
        return _mask_activation(core, dcn_cupy.mask_softmax_backward, mask, kernel_size)

    return _named(mask_softmax, name)


def _named(function, name: str):
    function.__name__ = function.__qualname__ = name
    core = getattr(dcn_cupy, name)
    summary = (core.__doc__ or "").strip().split("\n\n")[0]
    function.__doc__ = (f"{summary}\n\nDifferentiable TensorFlow version of :func:`dcn_cupy.{name}` "
                        f"(``tf.custom_gradient`` over its explicit backward); returns a ``tf.Tensor``.")
    function.__module__ = __name__
    return function


deform_conv = _conv_function(None)
deform_conv1d = _conv_function(1)
deform_conv2d = _conv_function(2)
deform_conv3d = _conv_function(3)
deform_conv_transpose = _transpose_function(None)
deform_conv_transpose1d = _transpose_function(1)
deform_conv_transpose2d = _transpose_function(2)
deform_conv_transpose3d = _transpose_function(3)
mask_softmax = _softmax_function(None)
mask_softmax1d = _softmax_function(1)
mask_softmax2d = _softmax_function(2)
mask_softmax3d = _softmax_function(3)


def mask_sigmoid(mask, scale: float = 2.0) -> tf.Tensor:
    """``scale * sigmoid(mask)``, differentiable; see :func:`dcn_cupy.mask_sigmoid`."""
    return _mask_activation(dcn_cupy.mask_sigmoid, dcn_cupy.mask_sigmoid_backward, mask, scale)


register()  # the core API then returns tf.Tensors for TensorFlow arguments (where the registry exists)
