"""The adapter that serves the running Keras backend: dcn_cupy.tensorflow, .jax or .torch.

Each adapter gives the same functional API (the signatures of :mod:`dcn_cupy`) with autograd
in its framework, so a layer computes with whichever backend Keras runs on.
"""

from __future__ import annotations

import importlib

import keras

_ADAPTERS = {"tensorflow": "dcn_cupy.tensorflow", "jax": "dcn_cupy.jax", "torch": "dcn_cupy.torch"}


def adapter():
    """The dcn_cupy adapter module of ``keras.config.backend()``."""
    backend = keras.config.backend()
    name = _ADAPTERS.get(backend)
    if name is None:
        raise NotImplementedError(
            f"dcn_cupy.keras layers run on the TensorFlow, JAX and PyTorch Keras backends, "
            f"got the {backend!r} backend")
    return importlib.import_module(name)


def deform_conv(ndim: int, transposed: bool, input, weight, offset, mask, bias, **params):
    name = f"deform_conv_transpose{ndim}d" if transposed else f"deform_conv{ndim}d"
    return getattr(adapter(), name)(input, weight, offset, mask, bias, **params)


def mask_activation(name: str, ndim: int, mask, kernel_size):
    """``"sigmoid"`` (``sigmoid``, 0.5 at zero) or ``"softmax"`` (over each group's K taps)."""
    module = adapter()
    if name == "sigmoid":
        return module.mask_sigmoid(mask, 1.0)
    return getattr(module, f"mask_softmax{ndim}d")(mask, kernel_size)
