"""Traced calls: staging an operation out of a jitted function as an XLA custom call to Python.

* ``jax.experimental.buffer_callback`` (recent JAX; the default where it exists): the callback
  receives XLA's own buffers, wrapped zero-copy as NumPy (CPU) or CuPy (GPU) arrays through
  ``__cuda_array_interface__`` without synchronising; CUDA kernels run on XLA's compute stream
  (``cupy.cuda.Stream.from_external``) and write their results straight into XLA's output
  buffers where the operation supports it (the convolutions' plans take ``out=``).
  The convolutions go faster still on CUDA when no vmapped axes are present: the trace's plan
  is launched on the buffers' raw device addresses and XLA's stream (``Plan.launch_forward`` /
  ``launch_backward``: no CuPy arrays, no per-call checks, no CuPy device or stream scopes),
  with a workspace kept per (device, stream); the array path remains the fallback.
* ``jax.pure_callback`` (the fallback, or ``set_callback_mechanism("pure")``): operands are
  copied to host memory, the CPU backend runs, results are copied back.

bfloat16 operands cross the boundary as their uint16 bits (a free bitcast in XLA).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .._interop import BFLOAT16
from . import _batching
from ._batching import Callee

try:  # recent JAX
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # pragma: no cover - older JAX
    _buffer_callback = None

try:
    from jax.core import Tracer
except ImportError:  # pragma: no cover - should jax.core stop exporting it
    from jax._src.core import Tracer

# "auto": buffer_callback where available, else pure_callback; "buffer" or "pure" force one
# (see set_callback_mechanism). Read when a function is traced.
_MECHANISM = "auto"


def set_callback_mechanism(mechanism: str = "auto") -> None:
    """Choose how traced calls reach the core: ``"auto"`` (buffer_callback where available),
    ``"buffer"`` or ``"pure"``. Takes effect for functions traced afterwards (jit caches keep
    what they compiled)."""
    global _MECHANISM
    if mechanism not in ("auto", "buffer", "pure"):
        raise ValueError(f"mechanism must be 'auto', 'buffer' or 'pure', got {mechanism!r}")
    if mechanism == "buffer" and _buffer_callback is None:
        raise RuntimeError("jax.experimental.buffer_callback is not available in this JAX version")
    _MECHANISM = mechanism


def callback_mechanism() -> str:
    """``"buffer_callback"`` or ``"pure_callback"``: how traced (jit/vmap) calls reach the core."""
    if _MECHANISM == "pure" or (_MECHANISM == "auto" and _buffer_callback is None):
        return "pure_callback"
    if _buffer_callback is None:
        raise RuntimeError("jax.experimental.buffer_callback is not available in this JAX version")
    return "buffer_callback"


def is_traced(arrays) -> bool:
    return any(isinstance(a, Tracer) for a in arrays if a is not None)


# ---------------------------------------------------------------------------------------------
# the wire: bfloat16 as uint16 bits


def _wire_dtype(dtype) -> np.dtype:
    return np.dtype(np.uint16) if np.dtype(dtype) == BFLOAT16 else np.dtype(dtype)


def _to_wire(a):
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if np.dtype(a.dtype) == BFLOAT16 else a


def _from_wire(a, dtype):
    return jax.lax.bitcast_convert_type(a, jnp.bfloat16) if np.dtype(dtype) == BFLOAT16 else a


# ---------------------------------------------------------------------------------------------
# pure_callback: host copies


def _pure_host(callee: Callee, out_shapes, dtype, *arrays):
    ins = [np.asarray(a).view(d) for a, d in zip(arrays, callee.dtypes)]
    # Under vmap the results carry the vmapped axes in front, like the operands.
    leading = _batching.leading_shape(callee, ins)
    outs = [np.empty(leading + tuple(s.shape), s.dtype) for s in out_shapes]
    _batching.run(callee, ins, [o.view(dtype) for o in outs])
    return tuple(outs)


# ---------------------------------------------------------------------------------------------
# buffer_callback: XLA's buffers, XLA's stream


_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3

#: Whether buffer_callback executions may hand XLA's CUDA buffers to a plan as raw addresses
#: (read at every execution; False: always the CuPy array path, e.g. for a baseline).
RAW_ADDRESSES = True


def _buffer_to_native(buffer, dtype=None):
    """A NumPy (CPU) or CuPy (CUDA) array over an XLA buffer, zero-copy, no synchronisation."""
    device_type, device_id = (int(v) for v in buffer.__dlpack_device__())
    if device_type in (_DL_CPU, _DL_CUDA_HOST):
        array = np.asarray(buffer)
    else:
        import cupy

        try:
            interface = buffer.__cuda_array_interface__
        except Exception:  # pragma: no cover - fall back to DLPack (may synchronise the stream)
            array = cupy.from_dlpack(buffer)
            return array.view(dtype) if dtype is not None and np.dtype(dtype) != array.dtype else array
        shape = tuple(int(v) for v in interface["shape"])
        wire = np.dtype(interface["typestr"])
        strides = interface.get("strides")
        nbytes = math.prod(shape) * wire.itemsize
        if nbytes == 0:
            with cupy.cuda.Device(device_id):
                array = cupy.empty(shape, wire)
        else:
            memory = cupy.cuda.UnownedMemory(int(interface["data"][0]), nbytes, buffer, device_id)
            array = cupy.ndarray(shape, wire, cupy.cuda.MemoryPointer(memory, 0),
                                 strides=None if strides is None else tuple(strides))
    if dtype is not None and np.dtype(dtype) != array.dtype:
        array = array.view(dtype)
    return array


class _StreamHandle:
    """A raw stream pointer speaking the CUDA stream protocol (for ``Stream.from_external``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


_streams: dict = {}   # (device, stream pointer) -> cupy.cuda.Stream


def _xla_stream(cupy, ptr: int, device_id: int):
    stream = _streams.get((device_id, ptr))
    if stream is None:
        with cupy.cuda.Device(device_id):
            stream = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
        if len(_streams) > 64:
            _streams.clear()
        _streams[(device_id, ptr)] = stream
    return stream


_workspaces: dict = {}   # (device, stream pointer) -> (cupy MemoryPointer, bytes)


def cuda_workspace(device_id: int, stream: int, nbytes: int) -> int:
    """The address of a workspace of at least ``nbytes`` for kernels queued on XLA's ``stream``
    (0 when ``nbytes`` is 0); ``device_id`` must be current.

    One buffer per (device, stream), grown when a larger one is asked for: the kernels that
    use it are ordered by the stream, so reusing it is safe. It comes from CuPy's allocator
    with ``stream`` current, so that a replaced buffer goes back to that stream's free list of
    CuPy's pool (reused only in the stream's order)."""
    if not nbytes:
        return 0
    key = (device_id, stream)
    found = _workspaces.get(key)
    if found is not None and found[1] >= nbytes:
        return found[0].ptr
    import cupy

    with _xla_stream(cupy, stream, device_id):
        memory = cupy.cuda.alloc(nbytes)
    if found is None and len(_workspaces) > 64:
        _workspaces.clear()
    _workspaces[key] = (memory, nbytes)
    return memory.ptr


def _address(buffer) -> int:
    """A CUDA buffer's device address; 0 when it cannot go as one (strided, or empty)."""
    interface = buffer.__cuda_array_interface__
    if interface.get("strides") is not None:   # XLA's buffers are dense row-major: never seen
        return 0
    return interface["data"][0]


def _launch(callee: Callee, device_id: int, ctx, outs, buffers) -> bool:
    """``callee.launch`` on the buffers' addresses, on XLA's stream, ``device_id`` current."""
    try:
        addresses = [_address(b) for b in buffers]
        out_addresses = [_address(o) for o in outs]
    except Exception:  # pragma: no cover - a buffer without __cuda_array_interface__
        return False
    if 0 in addresses or 0 in out_addresses:
        return False
    stream = int(ctx.stream)
    runtime = _cuda_runtime()
    if runtime.getDevice() == device_id:
        return callee.launch(device_id, addresses, out_addresses, stream)
    import cupy

    with cupy.cuda.Device(device_id):
        return callee.launch(device_id, addresses, out_addresses, stream)


_runtime = None


def _cuda_runtime():
    global _runtime
    if _runtime is None:
        import cupy

        _runtime = cupy.cuda.runtime
    return _runtime


def _buffer_host(callee: Callee, dtype, ctx, outs, *buffers):
    first = buffers[0]
    if callee.launch is not None and RAW_ADDRESSES and first.ndim == callee.in_ndims[0]:
        device_type, device_id = first.__dlpack_device__()
        if device_type == _DL_CUDA and _launch(callee, int(device_id), ctx, outs, buffers):
            return
    device_type, device_id = (int(v) for v in first.__dlpack_device__())
    ins = [_buffer_to_native(b, d) for b, d in zip(buffers, callee.dtypes)]
    out_arrays = [_buffer_to_native(o, dtype) for o in outs]
    if device_type in (_DL_CPU, _DL_CUDA_HOST):
        _batching.run(callee, ins, out_arrays)
        return
    import cupy

    with cupy.cuda.Device(device_id), _xla_stream(cupy, int(ctx.stream), device_id):
        _batching.run(callee, ins, out_arrays)


# ---------------------------------------------------------------------------------------------
# staging a call


def dispatch(call: Callable, args: list, per_sample: tuple, out_shapes: list, out_per_sample: tuple, dtype,
             elementwise: bool = False, into: Optional[Callable] = None, launch: Optional[Callable] = None) -> tuple:
    """Stage ``call(*args)`` (the core, with None for absent arguments) out of a trace.

    ``args`` must already be shaped as the traced path wants them (batch axis present); results
    are returned in the order of ``out_shapes``, all of ``dtype``. ``into(args, outs)``, when
    given, writes the results into native output arrays itself (no vmapped axes).
    ``launch(device_id, addresses, out_addresses, stream) -> bool``, when given, runs on CUDA
    buffers as raw addresses (0 for an absent argument; no vmapped axes; the device current);
    False sends the call to ``into``.
    """
    index = [i for i, a in enumerate(args) if a is not None]
    present = [args[i] for i in index]

    def full(natives, absent=None):
        result = [absent] * len(args)
        for i, a in zip(index, natives):
            result[i] = a
        return result

    def native_call(*natives):
        return call(*full(natives))

    native_into = None if into is None else (lambda natives, outs: into(full(natives), outs))

    def native_launch(device_id, addresses, out_addresses, stream):
        return launch(device_id, full(addresses, 0), out_addresses, stream)

    callee = Callee(native_call, native_into, tuple(a.ndim for a in present), tuple(per_sample[i] for i in index),
                    tuple(out_per_sample), elementwise, tuple(np.dtype(a.dtype) for a in present),
                    None if launch is None else native_launch)
    wire = _wire_dtype(dtype)
    result_types = tuple(jax.ShapeDtypeStruct(tuple(shape), wire) for shape in out_shapes)
    operands = [_to_wire(a) for a in present]
    if callback_mechanism() == "buffer_callback":
        outs = _buffer_callback(functools.partial(_buffer_host, callee, np.dtype(dtype)), result_types,
                                vmap_method="expand_dims")(*operands)
    else:
        host = functools.partial(_pure_host, callee, result_types, np.dtype(dtype))
        try:
            outs = jax.pure_callback(host, result_types, *operands, vmap_method="expand_dims")
        except TypeError:  # pragma: no cover - JAX < 0.4.34 has no vmap_method: sequential vmap
            outs = jax.pure_callback(host, result_types, *operands)
    return tuple(_from_wire(o, dtype) for o in outs)
