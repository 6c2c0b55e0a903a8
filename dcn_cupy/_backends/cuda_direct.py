"""CUDA algorithm ``cuda/direct``: one SIMT launch per primitive part, for small problems.

For a small convolution the host time of the im2col path dominates: a forward is three launches
(im2col, a cuBLAS GEMM, the layout/bias kernel), a backward six launches, two GEMMs and two
memsets. ``cuda/deform_direct.cu`` computes each output element with one thread (one warp per
weight-gradient element) looping over the whole reduction, with no workspace:

* forward:  ``direct_forward``, a few lanes per output element ``(b, C_out, q)`` splitting the
  taps; one launch.
* backward: ``direct_backward_params`` (the input gradient's fill, from the C_in-long bias of
  the transposed convolution or 0, no memset; a warp per weight and per bias element), then
  ``direct_backward_data`` (a few lanes per ``(b, tap, q)`` splitting the input channels: the
  input gradient by atomics, the offset and mask gradients by plain stores, once per group);
  only the parts the wanted gradients need: at most two launches. The executable computes the
  bias gradient itself (``bias_gradient = True``), saving the plan's separate launch.

Lanes that split one reduction are adjacent threads of a warp, summed by a fixed butterfly of
shuffles: every result but the input gradient (atomics) is bitwise repeatable.

The semantics are those of ``cuda/im2col`` (the same corner rules of ``dcn_common.cuh``); only
the order of the floating-point sums differs.

Chosen automatically (priority 30, above ``cuda/fused`` and ``cuda/im2col``) exactly for small
problems: float32/float64, and ``MACs = B * prod(Q) * C_out * C_in/groups * K`` at most
``MAX_MACS`` (environment variable ``DCN_CUPY_DIRECT_MAX_MACS``), and ``C_in * C_out/groups``
(the serial work of one backward thread per tap) at most ``MAX_CHANNEL_PRODUCT``. Forcing it
(``algorithm="cuda/direct"``, ``dcn_cupy.use_algorithm``) serves any size.

Launches are recorded per set of pointers (``cuda._kernel_op``) and replayed by
``cuda._replay`` on the caller's stream: no allocation, no host synchronisation, every kernel
compiled when the executable is built (never during a CUDA-graph capture).
"""

from __future__ import annotations

import math
import os
import threading

import numpy as np

import cupy

from . import cuda as _cuda

_SOURCE = "deform_direct.cu"
#: The dtypes served: the kernels accumulate in the storage type (float32 / float64); the half
#: types need a float32 accumulator for the atomics of the input gradient.
_CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_BLOCK = 128
_BLOCK1 = (_BLOCK,)
_MAX_GRID = 1 << 20
#: The most lanes that split one output element's reduction (a power of two dividing 32).
MAX_LANES = 8
#: The (grad_x, grad_offset, grad_mask) variants of direct_backward_data.
_DATA_VARIANTS = tuple((x, o, m) for x in (False, True) for o in (False, True) for m in (False, True)
                       if x or o or m)


def _int_from_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return int(float(value))
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


#: Chosen automatically only when B * prod(Q) * C_out * C_in/groups * K is at most this.
#: From benchmarks/direct.py (H200, float32 DCNv2, max(GPU, host) µs per call against
#: cuda/im2col, two runs): direct is faster forward and forward+backward on every measured
#: shape up to 2.4M MACs that passes the channel rule below (0.34-0.84x); 3D B1 C16 8^3 (3.5M)
#: breaks even forward (0.92x / 1.03x) and wins forward+backward (0.56x / 0.87x); 2D B1 C64
#: 16x16 (9.4M) is 1.2-1.35x slower, 2D B2 C32 32x32 (18.9M) 2x.
MAX_MACS = _int_from_env("DCN_CUPY_DIRECT_MAX_MACS", 2**22)
#: ... and C_in * C_out/groups (the serial multiply-adds of one data-gradient thread, over
#: MAX_LANES lanes) at most this: 2D B1 C128 4x4 (2.4M MACs, 16384) is 1.8x slower than im2col
#: forward+backward, C32 (1024) 0.6x.
MAX_CHANNEL_PRODUCT = 2**12


def settings() -> tuple:
    """The limits of the automatic choice (part of the functional API's plan key)."""
    return (MAX_MACS, MAX_CHANNEL_PRODUCT)


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def module_source() -> str:
    """``deform_direct.cu`` with its local headers inlined (#line directives kept)."""
    return _cuda.module_text(_SOURCE)


def name_expressions(dtype, ndim: int, index64: bool) -> tuple:
    """Every kernel instantiation of one module (one dtype, one N, one index width)."""
    t = _CTYPES[np.dtype(dtype)]
    i = "long long" if index64 else "int"
    names = [f"direct_forward<{t}, {i}, {ndim}>", f"direct_backward_params<{t}, {i}, {ndim}>"]
    names += [f"direct_backward_data<{t}, {i}, {ndim}, {_b(x)}, {_b(o)}, {_b(m)}>" for x, o, m in _DATA_VARIANTS]
    return tuple(names)


def all_module_keys():
    """(dtype, ndim, index64) of every module this algorithm can build."""
    return [(dtype, ndim, index64) for dtype in _CTYPES for ndim in (1, 2, 3) for index64 in (False, True)]


_modules = {}
_lock = threading.Lock()


def _kernels(dtype, ndim: int, index64: bool) -> dict:
    """The module's kernels on the current device, compiled and loaded once per device and key:
    ``"forward"``, ``"params"`` and ``(want_x, want_offset, want_mask)``."""
    key = (cupy.cuda.runtime.getDevice(), np.dtype(dtype).str, ndim, index64)
    found = _modules.get(key)
    if found is None:
        with _lock:
            found = _modules.get(key)
            if found is None:
                names = name_expressions(dtype, ndim, index64)
                module = cupy.RawModule(code=module_source(), options=_cuda.compile_options(), name_expressions=names)
                functions = [module.get_function(n) for n in names]
                for fn in functions:
                    fn.kernel  # compile and load now (with the plan), never during a capture
                found = dict(zip(("forward", "params") + _DATA_VARIANTS, functions))
                _modules[key] = found
    return found


def _grid(total: int) -> tuple:
    return (min((total + _BLOCK - 1) // _BLOCK, _MAX_GRID),)


def _ptr(array) -> int:
    return 0 if array is None else array.data.ptr


def _contiguous(array):
    """The array itself when C-contiguous (batch axis included), else a contiguous copy (an
    unusual batch stride, 0 included: run() only; run_pointers takes contiguous arrays)."""
    if array is None or array.flags.c_contiguous:
        return array
    return cupy.ascontiguousarray(array)


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def forward_lanes(geom) -> int:
    """Lanes per output element of the forward: they split the K taps."""
    return min(MAX_LANES, _pow2_floor(geom.kernel_volume))


def backward_lanes(geom) -> int:
    """Lanes per (sample, tap, position) of the data gradients: they split the input channels in
    chunks that never straddle an offset or mask group (a power of two dividing both runs)."""
    C = geom.in_channels
    per_offset = C // geom.offset_groups if geom.offset_groups else C
    per_mask = C // geom.mask_groups if geom.mask_groups else C
    common = math.gcd(per_offset, per_mask)
    return min(MAX_LANES, common & -common)


def macs(geom) -> int:
    """Multiply-adds of the forward: B * prod(Q) * C_out * C_in/groups * K."""
    return (geom.batch * geom.output_size * geom.out_channels * geom.in_channels_per_group
            * geom.kernel_volume)


class _Executable:
    """What forward and backward share: sizes, the Geom struct, the kernels (compiled here)."""

    workspace_bytes = 0
    pointer_path = True        # run_pointers serves every call

    def __init__(self, spec, counts):
        geom = self.geom = spec.geom
        self.lanes = forward_lanes(geom)
        self.data_lanes = backward_lanes(geom)
        self.dtype = np.dtype(spec.dtype)
        self.B, self.C, self.Co, self.G = geom.batch, geom.in_channels, geom.out_channels, geom.groups
        self.K, self.Q, self.S, self.N = geom.kernel_volume, geom.output_size, geom.input_size, geom.ndim
        self.Cg = geom.in_channels_per_group
        self.off_ch = geom.offset_groups * self.K * self.N
        self.m_ch = geom.mask_groups * self.K
        self.index64 = _cuda._index64(self.B * self.C * self.S, self.B * self.Co * self.Q * self.lanes,
                                      self.B * max(self.off_ch, 1) * self.Q, self.B * max(self.m_ch, 1) * self.Q,
                                      *counts)
        self.index = np.int64 if self.index64 else np.int32
        self.struct = _cuda._geom_struct(geom)
        self.ints = tuple(np.int32(v) for v in (self.B, self.C, self.Co, self.G, max(geom.offset_groups, 1),
                                                max(geom.mask_groups, 1)))
        with cupy.cuda.Device(spec.device_id):
            self.kernels = _kernels(self.dtype, self.N, self.index64)
        self._recordings = _cuda.Recordings()

    def _describe(self, what: str) -> str:
        return f"cuda/direct {what}, {'64' if self.index64 else '32'}-bit index, no workspace"

    def _replay(self, key, stream) -> None:
        ops = self._recordings.get(key)
        if ops is None:
            ops = self._recordings.put(key, self._record(*key))
        _cuda._replay(ops, None, stream)


class _Forward(_Executable):
    """``conv_forward``: ``direct_forward``, one launch."""

    def __init__(self, spec):
        super().__init__(spec, ())
        self.description = self._describe(f"forward: one launch ({self.lanes} lane(s) per output element)")

    def run(self, args, out, workspace) -> None:
        x, offset, mask = (_contiguous(args[n]) for n in ("input", "offset", "mask"))
        self.run_pointers((x.data.ptr, args["weight"].data.ptr, _ptr(offset), _ptr(mask), _ptr(args["bias"])),
                          out.data.ptr, 0, cupy.cuda.get_current_stream().ptr)

    def run_pointers(self, inputs, out, workspace, stream) -> None:
        """``run`` on raw device addresses: inputs (x, w, offset, mask, bias; 0 for an absent one)
        and ``out``, C-contiguous batched arrays, on ``stream`` (a cudaStream_t)."""
        self._replay(tuple(inputs) + (out,), stream)

    def _record(self, x, w, offset, mask, bias, out):
        u = np.uint64
        return [_cuda._kernel_op(self.kernels["forward"], _grid(self.B * self.Co * self.Q * self.lanes), _BLOCK1, (
            u(x), u(w), _cuda._at(offset, 0), _cuda._at(mask, 0), _cuda._at(bias, 0), u(out), self.struct)
            + self.ints + (np.int32(self.lanes),), 0)]


class _Backward(_Executable):
    """``conv_backward``: the input gradient's fill with the weight and bias gradients, then the
    data gradients, each launch only when a wanted gradient needs it."""

    bias_gradient = True       # "bias" may be wanted: the sum of grad_output, in the params launch

    def __init__(self, spec):
        geom = spec.geom
        weight_threads = 32 * geom.out_channels * (geom.in_channels_per_group * geom.kernel_volume + 1)
        super().__init__(spec, (weight_threads,
                                geom.batch * geom.kernel_volume * geom.output_size * backward_lanes(geom)))
        self.description = self._describe(
            f"backward: up to 2 launches (input-gradient fill with the weight and bias gradients, a warp per "
            f"element; data gradients, {self.data_lanes} lane(s) per (sample, tap, position))")

    def run(self, args, out, workspace) -> None:
        gy, x, offset, mask = (_contiguous(args[n]) for n in ("grad_output", "input", "offset", "mask"))
        wanted = args["wanted"]
        outs = tuple(_ptr(out.get(n)) if n in wanted else 0 for n in ("input", "weight", "offset", "mask", "bias"))
        self.run_pointers((gy.data.ptr, _ptr(x), args["weight"].data.ptr, _ptr(offset), _ptr(mask),
                           _ptr(args.get("bias"))), wanted, outs, 0, cupy.cuda.get_current_stream().ptr)

    def run_pointers(self, inputs, wanted, outs, workspace, stream) -> None:
        """``run`` on raw device addresses: inputs (grad_output, x, w, offset, mask, bias), the
        gradients' outputs (input, weight, offset, mask[, bias]; 0 where not wanted), C-contiguous
        batched arrays, on ``stream``."""
        self._replay(tuple(inputs) + tuple(outs), stream)

    def _record(self, gy, x, w, offset, mask, bias, grad_x, grad_w, grad_off, grad_m, grad_b=0):
        u, at = np.uint64, _cuda._at
        want_x, want_o, want_m = bool(grad_x), bool(grad_off) and bool(offset), bool(grad_m) and bool(mask)
        ops = []
        if want_x or grad_w or grad_b:
            elements = (self.Co * self.Cg * self.K if grad_w else 0) + (self.Co if grad_b else 0)
            threads = max(self.B * self.C * self.S if want_x else 0, 32 * elements)
            ops.append(_cuda._kernel_op(self.kernels["params"], _grid(threads), _BLOCK1, (
                u(gy), at(x, 0), at(offset, 0), at(mask, 0), at(grad_w, 0), at(grad_b, 0), at(bias, 0),
                at(grad_x, 0), self.struct) + self.ints, 0))
        if want_x or want_o or want_m:
            ops.append(_cuda._kernel_op(self.kernels[(want_x, want_o, want_m)],
                                        _grid(self.B * self.K * self.Q * self.data_lanes), _BLOCK1, (
                                            u(gy), at(x, 0), u(w), at(offset, 0), at(mask, 0),
                                            at(grad_x if want_x else 0, 0), at(grad_off if want_o else 0, 0),
                                            at(grad_m if want_m else 0, 0), self.struct)
                                        + self.ints + (np.int32(self.data_lanes),), 0))
        return ops


class DirectBackend:
    """``cuda/direct``: single-launch SIMT kernels for small float32/float64 problems."""

    device = "cuda"
    algorithm = "direct"
    priority = 30
    primitives = ("conv_forward", "conv_backward")

    def serves(self, spec, primitive):
        if spec.dtype not in _CTYPES:
            return (f"dtype {spec.dtype} is not supported (float32 and float64 only: the half types need a "
                    f"float32 accumulator and stay on cuda/fused and cuda/im2col)")
        if primitive == "conv_backward" and spec.deterministic:
            return ("its input gradient is scattered with floating-point atomics, whose order (and so "
                    "rounding) varies from run to run")
        return None

    def recommends(self, spec, primitive):
        """None (choose it) for small problems; else why not."""
        geom = spec.geom
        work = macs(geom)
        if work > MAX_MACS:
            return (f"{work} multiply-adds is more than its limit for small problems ({MAX_MACS}, "
                    f"DCN_CUPY_DIRECT_MAX_MACS)")
        channels = geom.in_channels * geom.out_channels_per_group
        if channels > MAX_CHANNEL_PRODUCT:
            return (f"C_in * C_out/groups = {channels} (one backward thread's serial work per tap) is more than "
                    f"{MAX_CHANNEL_PRODUCT}")
        return None

    def build(self, spec, primitive):
        return _Forward(spec) if primitive == "conv_forward" else _Backward(spec)


BACKEND = DirectBackend()
