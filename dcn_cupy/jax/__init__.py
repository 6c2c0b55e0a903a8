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
    are launched on XLA's compute stream (``ctx.stream`` through
    ``cupy.cuda.Stream.from_external``), so they are ordered with the surrounding XLA work and
    nothing goes through the host. On CPU they are wrapped as NumPy arrays. A convolution's
    plan (:func:`dcn_cupy.plan`) is built when the function is traced and kept in the
    callback: an execution only checks the buffers against it and runs it, writing the
    results straight into XLA's output buffers. Costs: one Python call per execution
    (interpreter and GIL overhead). Workspaces and temporaries come from CuPy's memory pool,
    outside XLA's preallocated pool: on a GPU, leave CuPy room (e.g.
    ``XLA_PYTHON_CLIENT_MEM_FRACTION=.5`` or ``XLA_PYTHON_CLIENT_PREALLOCATE=false``).
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

Layout: :mod:`._ops` (the custom_vjp operations and their plans), :mod:`._callbacks`
(buffer_callback / pure_callback plumbing), :mod:`._batching` (vmap); the public functions
are generated here.
"""


from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import jax

from .. import _api
from ._callbacks import callback_mechanism, set_callback_mechanism
from ._ops import conv_entry, sigmoid_entry, softmax_entry

__all__ = [
    "deform_conv", "deform_conv1d", "deform_conv2d", "deform_conv3d",
    "deform_conv_transpose", "deform_conv_transpose1d", "deform_conv_transpose2d", "deform_conv_transpose3d",
    "mask_softmax", "mask_softmax1d", "mask_softmax2d", "mask_softmax3d", "mask_sigmoid",
    "callback_mechanism", "set_callback_mechanism",
]

IntOrTuple = Union[int, Sequence[int]]
Array = jax.Array

_PREAMBLE = """\
Differentiable JAX version of :func:`dcn_cupy.{name}` (a ``jax.custom_vjp``; works under
``jax.jit`` and ``jax.vmap``; see :mod:`dcn_cupy.jax` for how traced calls reach the kernels).
{static} are static Python values; array arguments are ``jax.Array``\\ s of one dtype.

"""


def _named(function: Callable, name: str, static: str) -> Callable:
    function.__name__ = function.__qualname__ = name
    function.__doc__ = _PREAMBLE.format(name=name, static=static) + (getattr(_api, name).__doc__ or "")
    return function


def _conv_function(ndim: Optional[int]) -> Callable[..., Array]:
    def function(input: Array, weight: Array, offset: Optional[Array] = None, mask: Optional[Array] = None,
                 bias: Optional[Array] = None, stride: IntOrTuple = 1, padding: IntOrTuple = 0,
                 dilation: IntOrTuple = 1, groups: int = 1) -> Array:
        return conv_entry(ndim, False, input, weight, offset, mask, bias, stride, padding, 0, dilation, groups)

    name = "deform_conv" if ndim is None else f"deform_conv{ndim}d"
    return _named(function, name, "Stride, padding, dilation and groups")


def _transpose_function(ndim: Optional[int]) -> Callable[..., Array]:
    def function(input: Array, weight: Array, offset: Optional[Array] = None, mask: Optional[Array] = None,
                 bias: Optional[Array] = None, stride: IntOrTuple = 1, padding: IntOrTuple = 0,
                 output_padding: IntOrTuple = 0, dilation: IntOrTuple = 1, groups: int = 1) -> Array:
        return conv_entry(ndim, True, input, weight, offset, mask, bias, stride, padding, output_padding,
                          dilation, groups)

    name = "deform_conv_transpose" if ndim is None else f"deform_conv_transpose{ndim}d"
    return _named(function, name, "Stride, padding, output_padding, dilation and groups")


def _mask_softmax_function(ndim: Optional[int]) -> Callable[..., Array]:
    def function(mask: Array, kernel_size: IntOrTuple) -> Array:
        return softmax_entry(ndim, mask, kernel_size)

    return _named(function, "mask_softmax" if ndim is None else f"mask_softmax{ndim}d", "Kernel_size")


def mask_sigmoid(mask: Array, scale: float = 2.0) -> Array:
    return sigmoid_entry(mask, scale)


_named(mask_sigmoid, "mask_sigmoid", "Scale")

deform_conv = _conv_function(None)
deform_conv1d = _conv_function(1)
deform_conv2d = _conv_function(2)
deform_conv3d = _conv_function(3)
deform_conv_transpose = _transpose_function(None)
deform_conv_transpose1d = _transpose_function(1)
deform_conv_transpose2d = _transpose_function(2)
deform_conv_transpose3d = _transpose_function(3)
mask_softmax = _mask_softmax_function(None)
mask_softmax1d = _mask_softmax_function(1)
mask_softmax2d = _mask_softmax_function(2)
mask_softmax3d = _mask_softmax_function(3)
