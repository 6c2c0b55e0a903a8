"""DLPack in and out: which library and device an array comes from, and the dtype rules.

Arrays are turned into *native* arrays, NumPy on the CPU and CuPy on CUDA devices, through
the DLPack protocol (zero-copy), and results are handed back to the caller's library the
same way. bfloat16 is ``ml_dtypes.bfloat16`` natively; where a producer or consumer cannot
exchange bfloat16 through DLPack, its bits travel as 16-bit integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import ml_dtypes
import numpy as np

__all__ = ["ArrayOrigin", "to_native", "from_native", "check_same_origin", "SUPPORTED_DTYPES",
           "compute_dtype", "cupy_or_none"]

# DLPack device types (dlpack.h).
_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_HOST = 3
_DL_CUDA_MANAGED = 13

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
SUPPORTED_DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype arithmetic is carried out in: float32 for the half types."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


@dataclass(frozen=True)
class ArrayOrigin:
    """Where an argument came from: its library, device and dtype."""

    library: str          # "numpy", "cupy", "torch", "jax" or "dlpack" (any other producer)
    device: str           # "cpu" or "cuda"
    device_id: int
    dtype: np.dtype

    def describe(self) -> str:
        where = "cpu" if self.device == "cpu" else f"cuda:{self.device_id}"
        return f"{self.library} array on {where} of dtype {self.dtype.name}"


_cupy = None


def cupy_or_none():
    """CuPy, imported on first use; None where it is not installed or cannot load."""
    global _cupy
    if _cupy is None:
        try:
            import cupy  # noqa: F401
            _cupy = cupy
        except Exception:  # ImportError, or a broken CUDA installation
            _cupy = False
    return _cupy or None


def _library_of(array) -> str:
    module = type(array).__module__.split(".")[0]
    if module in ("jax", "jaxlib"):
        return "jax"
    if module in ("numpy", "cupy", "torch"):
        return module
    return "dlpack"


def _bits_as_uint16(array, library: str):
    """A 16-bit integer view of a bfloat16 array, for producers whose DLPack lacks bfloat16."""
    if library == "torch":
        import torch
        return array.view(torch.int16)
    if library == "jax":
        import jax
        import jax.numpy as jnp
        return jax.lax.bitcast_convert_type(array, jnp.int16)
    return None


def to_native(array, name: str):
    """``(native_array, ArrayOrigin)`` for an argument; ``native_array`` is NumPy or CuPy.

    The native array shares memory with ``array`` wherever the producer allows it.
    """
    if array is None:
        return None, None
    library = _library_of(array)
    if library == "torch" and getattr(array, "requires_grad", False):
        raise TypeError(
            f"{name} is a torch.Tensor that requires grad; dcn_cupy's functions do not record "
            f"autograd history: use dcn_cupy.torch for autograd, or pass {name}.detach()"
        )
    if library == "numpy":
        if not isinstance(array, np.ndarray):
            raise TypeError(f"{name} must be an array, got a NumPy scalar {array!r}")
        native, device, device_id = array, "cpu", 0
    else:
        if not hasattr(array, "__dlpack__") or not hasattr(array, "__dlpack_device__"):
            raise TypeError(
                f"{name} must be an array that supports DLPack (NumPy, CuPy, PyTorch, JAX, ...), "
                f"got {type(array).__module__}.{type(array).__name__}"
            )
        device_type, device_id = (int(v) for v in array.__dlpack_device__())
        if device_type in (_DL_CPU, _DL_CUDA_HOST):
            native, device = _import(np, array, library, name), "cpu"
            device_id = 0
        elif device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
            cupy = cupy_or_none()
            if cupy is None:
                raise TypeError(
                    f"{name} lives on CUDA device {device_id}, which needs CuPy: "
                    f"install dcn_cupy[cuda12] or dcn_cupy[cuda13]"
                )
            with cupy.cuda.Device(device_id):
                native = _import(cupy, array, library, name)
            device = "cuda"
        else:
            raise TypeError(
                f"{name} lives on an unsupported DLPack device type {device_type}; "
                f"expected a CPU or CUDA device"
            )
    dtype = np.dtype(native.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} must have dtype float16, bfloat16, float32 or float64, got {dtype.name}"
        )
    return native, ArrayOrigin(library, device, device_id, dtype)


def _import(xp, array, library: str, name: str):
    if library == "torch":
        # DLPack carries no lazy negation/conjugation bits: materialise them first.
        array = array.resolve_neg().resolve_conj()
    try:
        return xp.from_dlpack(array)
    except (BufferError, TypeError, ValueError, RuntimeError) as error:
        bits = _bits_as_uint16(array, library) if _is_bfloat16(array) else None
        if bits is None:
            raise TypeError(f"{name} could not be imported through DLPack: {error}") from error
        return xp.from_dlpack(bits).view(BFLOAT16)


def _is_bfloat16(array) -> bool:
    return "bfloat16" in str(getattr(array, "dtype", ""))


def from_native(native, origin: Optional[ArrayOrigin]):
    """Hand a native result back to the library ``origin`` came from (zero-copy)."""
    if native is None or origin is None:
        return native
    library = origin.library
    if library in ("numpy", "cupy", "dlpack"):
        return native
    bfloat = np.dtype(native.dtype) == BFLOAT16
    if library == "torch":
        import torch
        if bfloat:
            return torch.from_dlpack(native.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(native)
    if library == "jax":
        import jax
        import jax.numpy as jnp
        if bfloat:
            return jax.lax.bitcast_convert_type(jnp.from_dlpack(native.view(np.int16)), jnp.bfloat16)
        return jnp.from_dlpack(native)
    return native


def check_same_origin(origins: dict, reference: str = "input") -> ArrayOrigin:
    """All arguments share the reference argument's library, device and dtype."""
    ref = origins[reference]
    for name, origin in origins.items():
        if origin is None or name == reference:
            continue
        if origin.library != ref.library:
            raise TypeError(
                f"{name} must come from the same library as {reference} ({ref.library}), got {origin.library}"
            )
        if (origin.device, origin.device_id) != (ref.device, ref.device_id):
            raise ValueError(
                f"{name} must be on the same device as {reference} ({ref.describe()}), got {origin.describe()}"
            )
        if origin.dtype != ref.dtype:
            raise TypeError(
                f"{name} must have the same dtype as {reference} ({ref.dtype.name}), got {origin.dtype.name}"
            )
    return ref


def is_torch_tensor(obj: Any) -> bool:
    return _library_of(obj) == "torch"
