"""Interop: which library and device an array comes from, native arrays in and results out.

Arrays are turned into *native* arrays, NumPy on the CPU and CuPy on CUDA devices, and
results are handed back to the caller's library. A registry of :class:`ArrayLibrary` objects
does it, so that a new framework is added by registering it, not by editing the core:

* NumPy and CuPy arrays are used as they are (no DLPack round trip);
* torch tensors are wrapped zero-copy: CPU tensors through ``Tensor.numpy()``, CUDA tensors
  from their data pointer (``cupy.cuda.UnownedMemory``), and their kernels run on torch's
  current stream of the tensor's device (as NVIDIA Warp's torch interop does);
* JAX arrays, any other producer with ``__dlpack__``, and raw DLPack capsules go through
  DLPack. A capsule's result comes back as a native NumPy/CuPy array unless another argument
  names a library.

bfloat16 is ``ml_dtypes.bfloat16`` natively; where a producer or consumer cannot exchange
bfloat16 through DLPack, its bits travel as 16-bit integers. ml_dtypes is imported where a
bfloat16 array or dtype first comes (``bfloat16()``), not with dcn_cupy: its import, 0.6-0.8 s,
was most of ``import dcn_cupy``'s time.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import sys
import threading
from typing import Any, NamedTuple, Optional, Protocol, runtime_checkable

import numpy as np

__all__ = ["ArrayLibrary", "ArrayOrigin", "register_library", "library_of", "to_native", "from_native",
           "check_same_origin", "check_dtype", "SUPPORTED_DTYPES", "BFLOAT16", "bfloat16", "is_bfloat16",
           "compute_dtype", "cupy_or_none", "is_torch_tensor"]

# DLPack device types (dlpack.h).
_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_HOST = 3
_DL_CUDA_MANAGED = 13

_FLOAT64 = np.dtype(np.float64)
_FLOAT32 = np.dtype(np.float32)
_FLOAT16 = np.dtype(np.float16)
#: The supported dtypes, bfloat16 among them once ``bfloat16()`` has made it (a set that only
#: grows, read on every call's fast path).
_SUPPORTED = {_FLOAT16, _FLOAT32, _FLOAT64}
_bfloat16 = None


def bfloat16() -> np.dtype:
    """``ml_dtypes.bfloat16``'s dtype, importing ml_dtypes on first use."""
    global _bfloat16
    if _bfloat16 is None:
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.bfloat16)
        _SUPPORTED.add(dtype)
        _bfloat16 = dtype
    return _bfloat16


def is_bfloat16(dtype) -> bool:
    """Whether ``dtype`` is bfloat16; ml_dtypes is imported only for a dtype of that name."""
    return getattr(dtype, "name", None) == "bfloat16" and dtype == bfloat16()


def __getattr__(name):
    """``BFLOAT16`` and ``SUPPORTED_DTYPES``, made on first use (they need ml_dtypes)."""
    if name == "BFLOAT16":
        return bfloat16()
    if name == "SUPPORTED_DTYPES":
        return (_FLOAT16, bfloat16(), _FLOAT32, _FLOAT64)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if "ml_dtypes" in sys.modules:  # already paid for (JAX, TensorFlow): bfloat16 on the fast path now
    bfloat16()


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype arithmetic is carried out in: float32 for the half types."""
    return _FLOAT64 if dtype == _FLOAT64 else _FLOAT32


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


def _need_cupy(name: str, device_id: int):
    cupy = cupy_or_none()
    if cupy is None:
        raise TypeError(
            f"{name} lives on CUDA device {device_id}, which needs CuPy: "
            f"install dcn_cupy[cuda12] or dcn_cupy[cuda13]"
        )
    return cupy


@runtime_checkable
class ArrayLibrary(Protocol):
    """What the core needs from an array library."""

    name: str

    def owns(self, array) -> bool:
        """Whether ``array`` belongs to this library (a cheap type test)."""

    def to_native(self, array, name: str) -> tuple:
        """``(native, device, device_id)``: a NumPy/CuPy view of ``array``, ``"cpu"``/``"cuda"``."""

    def from_native(self, native, origin: "ArrayOrigin"):
        """A native result as an array of this library, on ``origin``'s device."""


class ArrayOrigin(NamedTuple):
    """Where an argument came from: its library, device and dtype."""

    library: str            # "numpy", "cupy", "torch", "jax", "dlpack" (any other producer), ...
    device: str             # "cpu" or "cuda"
    device_id: int
    dtype: np.dtype
    owner: Any = None       # the ArrayLibrary

    def describe(self) -> str:
        where = "cpu" if self.device == "cpu" else f"cuda:{self.device_id}"
        return f"{self.library} array on {where} of dtype {self.dtype.name}"

    def stream(self):
        """A context manager making the library's current stream CuPy's (or a null context)."""
        streams = getattr(self.owner, "stream", None)
        if streams is None or self.device != "cuda":
            return contextlib.nullcontext()
        return streams(self.device_id)


# ---------------------------------------------------------------------------------------------
# the registry


_libraries: list = []
_by_type: dict = {}          # type(array) -> ArrayLibrary, filled on first sight
_lock = threading.Lock()


def register_library(library, *, first: bool = False) -> None:
    """Add an array library; ``first=True`` puts it before the built-in ones."""
    with _lock:
        # first: before the built-in ones; else just before the catch-all DLPack library
        _libraries.insert(0 if first else len(_libraries) - 1, library)
        _by_type.clear()
        _by_type[np.ndarray] = _NUMPY


#: Libraries registered on first sight of one of their objects (top-level module of the type ->
#: "module:function" that registers them), so that importing dcn_cupy imports none of them.
_LAZY_LIBRARIES = {
    "tensorflow": "dcn_cupy.tensorflow._library:register",
    "tf_keras": "dcn_cupy.tensorflow._library:register",
}


def _register_lazy_library(array) -> bool:
    """Register the library of ``array`` if it is one of ``_LAZY_LIBRARIES``; whether it was."""
    target = _LAZY_LIBRARIES.get(type(array).__module__.split(".")[0])
    if target is None:
        return False
    module, function = target.split(":")
    before = len(_libraries)
    getattr(importlib.import_module(module), function)()
    return len(_libraries) != before


def library_of(array):
    """The registered library that owns ``array`` (the DLPack catch-all when none claims it)."""
    t = type(array)
    lib = _by_type.get(t)
    if lib is None:
        lib = next((c for c in _libraries if c.owns(array)), None)
        if lib is None and _register_lazy_library(array):
            lib = next((c for c in _libraries if c.owns(array)), None)
        if lib is None:
            lib = _DLPACK
        if not _is_capsule(array):
            _by_type[t] = lib
    return lib


def check_dtype(dtype, name: str) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in _SUPPORTED and not is_bfloat16(dtype):
        if dtype.kind == "f" and dtype.byteorder == ">" and dtype.newbyteorder("=") in _SUPPORTED:
            raise TypeError(
                f"{name} must be a native-byte-order array of dtype float16, bfloat16, float32 or "
                f"float64, got the big-endian dtype {dtype.str!r}: convert it with "
                f"{name}.astype({dtype.newbyteorder('=').name!r})"
            )
        raise TypeError(f"{name} must have dtype float16, bfloat16, float32 or float64, got {dtype.name}")
    return dtype


def to_native(array, name: str, check: bool = True):
    """``(native_array, ArrayOrigin)`` for an argument; ``native_array`` is NumPy or CuPy.

    The native array shares memory with ``array``. ``check=False`` skips the dtype rule (for
    workspaces).
    """
    if array is None:
        return None, None
    lib = _by_type.get(type(array)) or library_of(array)
    native, device, device_id = lib.to_native(array, name)
    dtype = native.dtype
    if check and dtype not in _SUPPORTED:
        check_dtype(dtype, name)
    return native, ArrayOrigin(lib.name, device, device_id, dtype, lib)


def from_native(native, origin: Optional[ArrayOrigin]):
    """Hand a native result back to the library ``origin`` came from (zero-copy)."""
    if native is None or origin is None:
        return native
    return origin.owner.from_native(native, origin)


def check_same_origin(origins: dict, reference: str = "input") -> ArrayOrigin:
    """All arguments share the reference argument's library, device and dtype.

    A DLPack producer the registry does not know (or a raw capsule) agrees with any library;
    the result goes to the first argument's library that is not such a producer.
    """
    ref = origins[reference]
    result = ref
    for name, origin in origins.items():
        if origin is None or name == reference:
            continue
        if origin.owner is not ref.owner:
            if ref.owner is _DLPACK or origin.owner is _DLPACK:
                if result.owner is _DLPACK:
                    result = result._replace(library=origin.library, owner=origin.owner)
            else:
                raise TypeError(
                    f"{name} must come from the same library as {reference} ({ref.library}), got {origin.library}"
                )
        if origin.device != ref.device or origin.device_id != ref.device_id:
            raise ValueError(
                f"{name} must be on the same device as {reference} ({ref.describe()}), got {origin.describe()}"
            )
        if origin.dtype != ref.dtype:
            raise TypeError(
                f"{name} must have the same dtype as {reference} ({ref.dtype.name}), got {origin.dtype.name}"
            )
    return result


def is_torch_tensor(obj: Any) -> bool:
    return library_of(obj) is _TORCH


# ---------------------------------------------------------------------------------------------
# NumPy and CuPy: used as they are


class _NumPy:
    name = "numpy"

    def owns(self, array) -> bool:
        return isinstance(array, (np.ndarray, np.generic))

    def to_native(self, array, name):
        if type(array) is np.ndarray:
            return array, "cpu", 0
        if not isinstance(array, np.ndarray):
            raise TypeError(f"{name} must be an array, got a NumPy scalar {array!r}")
        if isinstance(array, np.ma.MaskedArray):
            raise TypeError(
                f"{name} is a numpy.ma.MaskedArray; dcn_cupy would ignore its mask, so it is refused: "
                f"pass {name}.filled(0) (masked elements as zeros) or {name}.data"
            )
        if type(array) is not np.ndarray:
            array = np.asarray(array)  # a subclass (e.g. np.matrix) as a plain array view
        return array, "cpu", 0

    def from_native(self, native, origin):
        return native


class _CuPy:
    name = "cupy"

    def owns(self, array) -> bool:
        return type(array).__module__.split(".")[0] == "cupy"

    def to_native(self, array, name):
        cupy = cupy_or_none()
        if cupy is None or not isinstance(array, cupy.ndarray):
            raise TypeError(f"{name} must be an array, got {type(array).__module__}.{type(array).__name__}")
        return array, "cuda", array.data.device_id

    def from_native(self, native, origin):
        return native


# ---------------------------------------------------------------------------------------------
# torch: zero-copy from the data pointer, on torch's current stream


class _StreamHandle:
    """An object speaking the CUDA stream protocol, for ``cupy.cuda.Stream.from_external``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


class _Torch:
    name = "torch"

    def __init__(self):
        self._streams = {}       # (device, stream pointer) -> CuPy Stream
        self._bfloat16 = None

    def owns(self, array) -> bool:
        return type(array).__module__.split(".")[0] == "torch"

    def to_native(self, array, name):
        import torch

        if not isinstance(array, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(array).__module__}.{type(array).__name__}")
        if array.requires_grad:
            raise TypeError(
                f"{name} is a torch.Tensor that requires grad; dcn_cupy's functions do not record "
                f"autograd history: use dcn_cupy.torch for autograd, or pass {name}.detach()"
            )
        device = array.device.type
        if device == "meta":
            raise TypeError(
                f"{name} is a torch meta tensor, which has no data to compute with; meta tensors are "
                f"handled by dcn_cupy.torch's fake kernels (torch.compile), not by the core functions"
            )
        if array.is_neg() or array.is_conj():
            # lazy negation/conjugation bits: materialise them first
            array = array.resolve_neg().resolve_conj()
        if device == "cpu":
            if array.dtype == torch.bfloat16:
                return array.view(torch.int16).numpy().view(bfloat16()), "cpu", 0
            try:
                return array.numpy(), "cpu", 0
            except TypeError as error:  # a dtype NumPy does not have
                raise TypeError(
                    f"{name} must have dtype float16, bfloat16, float32 or float64, got {array.dtype}"
                ) from error
        if device != "cuda":
            raise TypeError(f"{name} lives on torch device {array.device}; expected a CPU or CUDA tensor")
        index = array.device.index
        cupy = _need_cupy(name, index)
        dtype = torch_dtype(str(array.dtype))
        if dtype is None:
            raise TypeError(f"{name} must have dtype float16, bfloat16, float32 or float64, got {array.dtype}")
        itemsize = dtype.itemsize
        shape = tuple(array.shape)
        strides = tuple(s * itemsize for s in array.stride())
        extent = 0
        if array.numel():
            extent = (sum((n - 1) * s for n, s in zip(shape, array.stride())) + 1) * itemsize
        memory = cupy.cuda.UnownedMemory(array.data_ptr(), extent, array, index)
        native = cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), strides)
        return native, "cuda", index

    def stream(self, device_id: int):
        """torch's current stream of the device as CuPy's current stream."""
        import torch

        ptr = torch.cuda.current_stream(device_id).cuda_stream
        key = (device_id, ptr)
        stream = self._streams.get(key)
        if stream is None:
            cupy = cupy_or_none()
            with cupy.cuda.Device(device_id):
                stream = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
            if len(self._streams) > 64:
                self._streams.clear()
            self._streams[key] = stream
        return stream

    def from_native(self, native, origin):
        import torch

        if isinstance(native, np.ndarray):
            if is_bfloat16(native.dtype):
                return torch.from_numpy(native.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(native)
        if is_bfloat16(native.dtype):
            return torch.from_dlpack(native.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(native)


_TORCH_DTYPES = {"torch.float16": _FLOAT16, "torch.float32": _FLOAT32, "torch.float64": _FLOAT64}


def torch_dtype(name: str) -> Optional[np.dtype]:
    """The native dtype of the torch dtype named ``name`` (``str(torch.float16)``), or None."""
    found = _TORCH_DTYPES.get(name)
    if found is None and name == "torch.bfloat16":
        return bfloat16()
    return found


# ---------------------------------------------------------------------------------------------
# DLPack: JAX, every other producer, raw capsules


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensorHead(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice)]


def _capsule_device(capsule) -> tuple:
    """(device_type, device_id) of a raw DLPack capsule ("dltensor" or "dltensor_versioned")."""
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    cname = get_name(capsule)
    if cname not in (b"dltensor", b"dltensor_versioned"):
        raise TypeError(f"a PyCapsule named {cname!r} is not an unconsumed DLPack capsule")
    pointer = get_pointer(capsule, cname)
    # DLManagedTensorVersioned starts with a version (2 x uint32) and manager_ctx, deleter, flags.
    head = pointer + (8 + 3 * ctypes.sizeof(ctypes.c_void_p) if cname == b"dltensor_versioned" else 0)
    tensor = _DLTensorHead.from_address(head)
    return int(tensor.device.device_type), int(tensor.device.device_id)


class _Capsule:
    """A raw capsule as a DLPack producer (it can be consumed once)."""

    def __init__(self, capsule):
        self.capsule = capsule
        self.device = _capsule_device(capsule)

    def __dlpack__(self, *args, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


def _is_capsule(array) -> bool:
    return type(array).__name__ == "PyCapsule"


class _DLPack:
    """Any producer speaking DLPack; results come back as native arrays."""

    name = "dlpack"

    def owns(self, array) -> bool:
        return True

    def to_native(self, array, name):
        if _is_capsule(array):
            array = _Capsule(array)
        elif not hasattr(array, "__dlpack__") or not hasattr(array, "__dlpack_device__"):
            if array is None:
                raise TypeError(f"{name} must be an array, got None")
            raise TypeError(
                f"{name} must be an array that supports DLPack (NumPy, CuPy, PyTorch, JAX, ...), "
                f"got {type(array).__module__}.{type(array).__name__}"
            )
        return _import_dlpack(array, name, self._bits)

    @staticmethod
    def _bits(array):
        return None

    def from_native(self, native, origin):
        return native


def _import_dlpack(array, name, bits_as_uint16):
    device_type, device_id = (int(v) for v in array.__dlpack_device__())
    if device_type in (_DL_CPU, _DL_CUDA_HOST):
        xp, device, device_id = np, "cpu", 0
    elif device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        xp, device = _need_cupy(name, device_id), "cuda"
    else:
        raise TypeError(
            f"{name} lives on an unsupported DLPack device type {device_type}; expected a CPU or CUDA device"
        )
    try:
        if device == "cuda":
            with xp.cuda.Device(device_id):
                native = xp.from_dlpack(array)
        else:
            native = xp.from_dlpack(array)
    except (BufferError, TypeError, ValueError, RuntimeError) as error:
        bits = bits_as_uint16(array) if "bfloat16" in str(getattr(array, "dtype", "")) else None
        if bits is None:
            raise TypeError(f"{name} could not be imported through DLPack: {error}") from error
        native = xp.from_dlpack(bits).view(bfloat16())
    return native, device, device_id


class _Jax(_DLPack):
    name = "jax"

    def owns(self, array) -> bool:
        return type(array).__module__.split(".")[0] in ("jax", "jaxlib")

    @staticmethod
    def _bits(array):
        import jax
        import jax.numpy as jnp
        return jax.lax.bitcast_convert_type(array, jnp.int16)

    def from_native(self, native, origin):
        import jax
        import jax.numpy as jnp
        if is_bfloat16(native.dtype):
            return jax.lax.bitcast_convert_type(jnp.from_dlpack(native.view(np.int16)), jnp.bfloat16)
        return jnp.from_dlpack(native)


_NUMPY = _NumPy()
_CUPY = _CuPy()
_TORCH = _Torch()
_JAX = _Jax()
_DLPACK = _DLPack()
_libraries.extend([_NUMPY, _CUPY, _TORCH, _JAX, _DLPACK])
_by_type[np.ndarray] = _NUMPY
