"""Glue between torch and the core: zero-copy views, torch's stream, allocator and TF32 flag.

On a CUDA tensor's device, :func:`cuda_scope` makes CuPy use

* the device of the tensor (``cupy.cuda.Device``),
* torch's current stream of that device (``cupy.cuda.Stream.from_external``, CuPy 14's
  replacement of the deprecated ``ExternalStream``), so the kernels are ordered with torch's
  work and are captured by ``torch.cuda.graph``,
* torch's caching allocator for every CuPy allocation (a ``PythonFunctionAllocator`` over
  ``torch.cuda.caching_allocator_alloc/delete``), so that workspaces and temporaries are
  counted by ``torch.cuda.memory_allocated``, live in a CUDA graph's private pool while it is
  captured, and never touch CuPy's memory pool.

Tensors cross to CuPy/NumPy by :func:`native`, a view over ``data_ptr()`` (no DLPack).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import torch

from .._interop import BFLOAT16, cupy_or_none

_NUMPY_DTYPES = {
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: BFLOAT16,
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}


#: What native() also views: workspaces are uint8 tensors.
_VIEW_DTYPES = {**_NUMPY_DTYPES, torch.uint8: np.dtype(np.uint8)}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype of a supported torch dtype (TypeError otherwise)."""
    found = _NUMPY_DTYPES.get(dtype)
    if found is None:
        raise TypeError(f"tensors must have dtype float16, bfloat16, float32 or float64, got {dtype}")
    return found


def device_index(t: torch.Tensor) -> int:
    index = t.device.index
    return torch.cuda.current_device() if index is None else index


#: CuPy views of contiguous CUDA tensors by (address, shape, dtype, device). A view does not
#: own its memory (the tensor does; a call uses a view only while its tensor is alive): the
#: same address, shape and dtype make the same view, whichever tensor holds that memory now.
#: Parameters and the caching allocator's reused blocks hit it, saving ~5 µs per tensor.
_views: dict = {}
_MAX_VIEWS = 512


def native(t: Optional[torch.Tensor]):
    """A NumPy (CPU) or CuPy (CUDA) array sharing ``t``'s memory, strides kept.

    ``t`` may require grad (it is only read through the view); a lazily negated tensor is
    materialised first (its memory holds the un-negated values).
    """
    if t is None:
        return None
    if t.is_neg():
        t = t.resolve_neg()
    dtype = _VIEW_DTYPES.get(t.dtype) or numpy_dtype(t.dtype)
    if t.is_cuda and t.is_contiguous():  # the common case: a cached view, see _views
        key = (t.data_ptr(), t.shape, dtype, t.get_device())
        found = _views.get(key)
        if found is not None:
            return found
        numel = t.numel()
        cupy = cupy_or_none()
        if cupy is not None and numel:
            memory = cupy.cuda.UnownedMemory(key[0], numel * dtype.itemsize, None, key[3])
            view = cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(memory, 0))
            if len(_views) >= _MAX_VIEWS:
                _views.clear()
            _views[key] = view
            return view
    if t.device.type == "cpu":
        t = t.detach()
        if dtype == BFLOAT16:
            return t.view(torch.int16).numpy().view(BFLOAT16)
        return t.numpy()
    if t.device.type != "cuda":
        raise TypeError(f"tensors must be on a CPU or CUDA device, got {t.device}")
    cupy = cupy_or_none()
    if cupy is None:
        raise TypeError(f"a tensor on {t.device} needs CuPy: install dcn_cupy[cuda12] or dcn_cupy[cuda13]")
    index = device_index(t)
    shape = tuple(t.shape)
    if t.numel() == 0:
        with cupy.cuda.Device(index):
            return cupy.empty(shape, dtype)
    itemsize = dtype.itemsize
    stride = t.stride()
    extent = (sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * itemsize
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), extent, t, index)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), tuple(s * itemsize for s in stride))


try:
    _current_device = torch._C._cuda_getDevice
except AttributeError:  # pragma: no cover - a torch without it
    _current_device = torch.cuda.current_device


def launch_addresses(tensors) -> Optional[tuple]:
    """``(stream, addresses)`` when ``tensors`` (the first one present) can go to a plan as raw
    addresses: all CUDA, contiguous, of one dtype, on the current device, none lazily negated;
    then ``stream`` is torch's current stream (a ``cudaStream_t``) and ``addresses`` each
    tensor's ``data_ptr()`` (0 for None), in one pass. None otherwise (the caller takes the
    array path)."""
    first = tensors[0]
    if not first.is_cuda:
        return None
    index = first.get_device()
    stream = launch_stream(index)
    if stream is None:
        return None
    dtype = first.dtype
    addresses = []
    for t in tensors:
        if t is None:
            addresses.append(0)
        elif t.dtype != dtype or t.get_device() != index or not t.is_contiguous() or t.is_neg():
            return None
        else:
            addresses.append(t.data_ptr())
    return stream, tuple(addresses)


def launch_stream(index: int) -> Optional[int]:
    """torch's current stream (a ``cudaStream_t``) of CUDA device ``index`` when that is the
    current device (a plan's raw-address launches run on the current one); None otherwise."""
    return _current_raw_stream(index) if index == _current_device() else None


try:
    _cublas_allow_tf32 = torch._C._get_cublas_allow_tf32   # what torch.backends.cuda.matmul.allow_tf32 reads
except AttributeError:  # pragma: no cover - a torch without it
    def _cublas_allow_tf32() -> bool:
        return bool(torch.backends.cuda.matmul.allow_tf32)


def allow_tf32(t: torch.Tensor) -> bool:
    """Whether float32 GEMMs on ``t``'s device may use TF32: torch's own switch, as torchvision's op
    (read without the attribute lookup and device object: ~3 µs less per call)."""
    return t.is_cuda and t.dtype is torch.float32 and _cublas_allow_tf32()


# ---------------------------------------------------------------------------------------------
# CUDA: torch's stream and caching allocator as CuPy's


class _StreamHandle:
    """A raw stream pointer speaking the CUDA stream protocol (for ``Stream.from_external``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


try:
    _current_raw_stream = torch._C._cuda_getCurrentRawStream  # no Stream object per call
except AttributeError:  # pragma: no cover - a torch without it
    def _current_raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream

_streams: dict = {}      # (device, stream pointer) -> cupy.cuda.Stream
_allocator = None        # the PythonFunctionAllocator's malloc, made on first use


def _cupy_stream(cupy, index: int):
    ptr = _current_raw_stream(index)
    stream = _streams.get((index, ptr))
    if stream is None:
        if ptr == 0:  # torch's default stream is the legacy default stream, CuPy's null stream
            stream = cupy.cuda.Stream.null
        else:
            with cupy.cuda.Device(index):
                stream = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
        if len(_streams) > 64:  # streams come and go (e.g. one per CUDA-graph capture)
            _streams.clear()
        _streams[(index, ptr)] = stream
    return stream


def _torch_malloc(size: int, device_id: int) -> int:
    # CuPy calls this with device_id current and its current stream = torch's (cuda_scope).
    cupy = cupy_or_none()
    return torch.cuda.caching_allocator_alloc(size, device_id, cupy.cuda.get_current_stream().ptr)


def _torch_free(ptr: int, device_id: int) -> None:
    torch.cuda.caching_allocator_delete(ptr)


def _torch_allocator(cupy):
    global _allocator
    if _allocator is None:
        _allocator = cupy.cuda.memory.PythonFunctionAllocator(_torch_malloc, _torch_free).malloc
    return _allocator


class _Scope:
    """The device, torch's stream and torch's allocator entered as one context (a plain class:
    a generator-based context manager costs a few µs per call)."""

    __slots__ = ("contexts",)

    def __init__(self, cupy, index: int):
        self.contexts = (cupy.cuda.Device(index), _cupy_stream(cupy, index),
                         cupy.cuda.using_allocator(_torch_allocator(cupy)))

    def __enter__(self):
        entered = 0
        try:
            for context in self.contexts:
                context.__enter__()
                entered += 1
        except BaseException:
            for context in reversed(self.contexts[:entered]):
                context.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for context in reversed(self.contexts):
            context.__exit__(*exc)
        return False


def _cuda(cupy, index: int):
    return _Scope(cupy, index)


def cuda_scope(t: torch.Tensor):
    """For a CUDA tensor: its device, torch's current stream and torch's caching allocator
    made CuPy's. A null context (and no CuPy import) for other tensors."""
    if t.device.type != "cuda":
        return contextlib.nullcontext()
    cupy = cupy_or_none()
    if cupy is None:
        raise TypeError(f"a tensor on {t.device} needs CuPy: install dcn_cupy[cuda12] or dcn_cupy[cuda13]")
    return _cuda(cupy, device_index(t))
