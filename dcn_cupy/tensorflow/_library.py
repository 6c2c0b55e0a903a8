"""TensorFlow as an array library of dcn_cupy's interop registry (``_interop.ArrayLibrary``).

Registered lazily, the first time the core sees a TensorFlow object, so that importing
dcn_cupy never imports TensorFlow. CPU tensors are viewed by NumPy (zero-copy), CUDA tensors
reach CuPy through DLPack (zero-copy); ``tf.Variable``s are read first. Results come back as
``tf.Tensor``s on the device of the argument they are returned for.
"""

from __future__ import annotations

import numpy as np

__all__ = ["TensorFlowLibrary", "LIBRARY", "register", "is_tensorflow", "to_native", "from_native"]


def is_tensorflow(array) -> bool:
    """A tf.Tensor, tf.Variable (or Keras variable backed by one): a cheap type test."""
    return type(array).__module__.split(".")[0] in ("tensorflow", "tf_keras")


def _device_of(tensor) -> tuple:
    """``("cpu"|"cuda", index)`` from a TensorFlow device string such as ``/job:.../device:GPU:1``."""
    name = (getattr(tensor, "device", "") or "").upper()
    if ":GPU:" in name:
        return "cuda", int(name.rsplit(":", 1)[1])
    return "cpu", 0


class TensorFlowLibrary:
    """The ArrayLibrary protocol of ``dcn_cupy._interop`` for TensorFlow."""

    name = "tensorflow"

    def owns(self, array) -> bool:
        return is_tensorflow(array)

    def to_native(self, array, name: str) -> tuple:
        import tensorflow as tf

        if isinstance(array, tf.Variable):
            array = array.read_value()
        if not tf.is_tensor(array) or not hasattr(array, "numpy"):
            raise TypeError(
                f"{name} is a symbolic TensorFlow tensor (inside tf.function), which has no data: "
                f"use dcn_cupy.tensorflow, whose functions work inside tf.function"
            )
        device, index = _device_of(array)
        if device == "cpu":
            return np.asarray(array), "cpu", 0
        from .._interop import cupy_or_none

        cupy = cupy_or_none()
        if cupy is None:
            raise TypeError(f"{name} lives on TensorFlow's GPU:{index}, which needs CuPy: "
                            f"install dcn_cupy[cuda12] or dcn_cupy[cuda13]")
        with cupy.cuda.Device(index):
            if array.dtype == tf.bfloat16:  # TensorFlow's DLPack export has no bfloat16
                bits = tf.bitcast(array, tf.int16)
                return cupy.from_dlpack(bits).view(_bfloat16()), "cuda", index
            return cupy.from_dlpack(array), "cuda", index

    def from_native(self, native, origin=None):
        """``native`` as a ``tf.Tensor``; a CuPy array stays on its GPU (zero-copy through DLPack)."""
        import tensorflow as tf

        if native is None:
            return None
        if isinstance(native, np.ndarray):
            with tf.device("/CPU:0"):
                return tf.convert_to_tensor(native)
        bfloat = np.dtype(native.dtype) == _bfloat16()
        if bfloat:
            tensor = tf.experimental.dlpack.from_dlpack(native.view(np.int16).__dlpack__())
            return tf.bitcast(tensor, tf.bfloat16)
        return tf.experimental.dlpack.from_dlpack(native.__dlpack__())


def _bfloat16() -> np.dtype:
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


LIBRARY = TensorFlowLibrary()


def to_native(array, name: str):
    """``LIBRARY.to_native`` for a TensorFlow object, else the array as it is."""
    if array is None or not is_tensorflow(array):
        return array
    return LIBRARY.to_native(array, name)[0]


def from_native(native):
    return LIBRARY.from_native(native)


_registered = False


def register() -> None:
    """Add TensorFlow to the core's interop registry (once), where the registry exists."""
    global _registered
    if _registered:
        return
    from .. import _interop

    register_library = getattr(_interop, "register_library", None)
    if register_library is not None:
        register_library(LIBRARY)
    _registered = True
