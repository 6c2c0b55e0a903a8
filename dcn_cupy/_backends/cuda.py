"""CUDA backend ``cuda/im2col``: hand-written kernels (``cuda/*.cu``, CuPy ``RawModule``) and cuBLAS.

Per chunk (chunks bound the workspace by ``WORKSPACE_LIMIT_BYTES``):

* forward:   columns ``(G, C_in/G*K, n*Q)`` = deformable im2col (N-linear sample * mask);
             ``y_g = W_g @ columns_g`` for all groups in ONE strided-batched GEMM (batch = G);
             then ``(C_out, n*Q) -> (n, C_out, *Q)`` with the bias added.
* to input:  column grads ``= W_g^T @ grad_y_g`` (one batched GEMM), then col2im scatters them
             with atomics into a float32 (float64 for float64) buffer (through a shared-memory
             box per tile of output positions); this is also the transposed convolution's
             forward.
* weight:    ``grad_W_g += grad_y_g @ columns_g^T`` (GEMM accumulating across chunks, beta = 1;
             split along the positions into partial sums, added in order, where its output is
             too small to fill the device: ``gemm_splits``; for the weight gradient alone, the
             columns may come in panels of input channels, each multiplied into its columns of
             grad_W: ``column_panels``).
* offset, mask: one thread per (sample, group, tap, position) sums over the group's channels
             of column grads times the sample's derivative (offset) or the sample (mask).

A chunk is ``n`` whole samples, or, when one sample's columns do not fit the limit, a slab of
rows of the first output axis of one sample: the kernels see a sub-grid whose padding is
shifted (``p' = p - first_row * stride``), and the slab's offsets, mask and outputs are staged
through the workspace. A request whose smallest chunk does not fit is refused with a
``MemoryError`` when the plan is built, before anything is allocated.

Everything that does not change between calls is computed when the executable is built: the
chunks, their ``Geom`` structs, the kernel functions (compiled then, never during a CUDA-graph
capture), the tiled scatter's shared-memory box, the GEMM descriptors and the workspace
layout. A call carves its buffers out of ONE workspace (the caller's, or one allocation from
CuPy's current allocator), launches on CuPy's current stream (the cuBLAS handle is set to it
before the GEMMs) and never synchronises with the host.

Half types (float16, bfloat16) are stored as such in the columns and GEMM operands; the
GEMMs compute and write float32 (but a weight gradient that is one GEMM's, written in its dtype:
``WEIGHT_IN_ONE_GEMM``), every kernel computes in float32 and the buffers that take atomics are
float32, cast back once at the end. float32 GEMMs use TF32 exactly when the
plan's ``allow_tf32`` is set (the core API reads CuPy's setting when the plan is built; the
torch adapter passes ``torch.backends.cuda.matmul.allow_tf32``).

cuBLAS's own workspace: CuPy 14 does not expose ``cublasSetWorkspace``, so the GEMMs use
cuBLAS's default workspace of the handle (allocated by cuBLAS when the stream is first set,
outside a capture: the executable sets the stream of every call before its GEMMs, and a
warm-up call before capturing makes the capture allocation-free).
"""

from __future__ import annotations

import math
import os
import re
import threading
from pathlib import Path

import numpy as np

import cupy

from .._geometry import ConvGeometry
from .._interop import BFLOAT16, compute_dtype
from .._limits import size_from_env
from . import PRIMITIVES, cuda_source_dir

xp = cupy

#: Upper bound, in bytes, of an executable's workspace (columns, column grads, GEMM outputs,
#: staging). Read when a plan is built.
WORKSPACE_LIMIT_BYTES = size_from_env("DCN_CUPY_CUDA_WORKSPACE_BYTES", 256 * 2**20)  # "256M", "2G", bytes

_BLOCK = 256
_MAX_GRID = 1 << 20          # grid-stride loops cover the rest
#: Kernels use 32-bit indices while every element count is at most this (else 64-bit): an
#: index plus the grid stride (at most _MAX_GRID * _BLOCK = 2^28) then stays below 2^31.
_INT32_SAFE = 2**30 - _BLOCK
#: cuBLAS takes 32-bit sizes: the bound of every GEMM dimension (and so of a chunk's n*Q).
_INT32_MAX = 2**31 - 1

_CTYPES = {
    np.dtype(np.float16): "__half",
    BFLOAT16: "__nv_bfloat16",
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
}
# cudaDataType values (library_types.h; a stable ABI).
_CUDA_DTYPES = {
    np.dtype(np.float16): 2,    # CUDA_R_16F
    BFLOAT16: 14,               # CUDA_R_16BF
    np.dtype(np.float32): 0,    # CUDA_R_32F
    np.dtype(np.float64): 1,    # CUDA_R_64F
}
#: The (offset, mask) variants of the grouped offset/mask-gradient kernel.
_GRAD_VARIANTS = (("true", "false"), ("false", "true"), ("true", "true"))

# Sampling: deform_im2col, one thread per (channel, sample, position) (the x plane stays in
# L1). Scatter: deform_col2im_tiled, a block per (sample, channel, tile of output positions)
# accumulating into the channel's input box in shared memory, one global atomic per box
# element instead of K*2^N per position. Other variants measured slower (NOTES-gpu.md).
#: Halo (in input positions) of the tiled scatter's shared-memory box around the tile's
#: regular sampling positions; corners outside the box use global memory.
TILE_HALO = 3
#: Upper bound of the tiled scatter's shared memory per block.
TILE_SMEM_BYTES = 48 * 1024
_TILE = 256
_MAIN_SOURCE = "deform_conv.cu"

#: float16, bfloat16 and float32 columns in 1D and 2D are sampled from a channels-last copy of
#: the chunk's input (cuda/fused's fused_channels_last and fused_columns: one 16-byte load per
#: corner and 8 (4) channels, corners computed once per position, tap and group) where each
#: vector of channels lies in one offset and one mask group, on compute capability 8.0 or more;
#: the rest, and everything with False, through deform_im2col (2-byte gathers, one thread per
#: channel and position). H200, the im2col stage alone (NOTES-gpu.md, sessions 8 and 9): B=8 C256
#: 56x56 fp16 0.33 -> 0.112 ms, fp32 0.32 -> 0.184; B=16 C512 14x14 fp16 0.089 -> 0.035, fp32
#: 0.086 -> 0.058; 1D C256 L4096 fp16 0.28 -> 0.107. In 3D for the dtypes of
#: CHANNELS_LAST_COLUMNS_3D: float32 since session 47 (B=2 C32 32^3, the stage 0.554 -> 0.444), the
#: half types since session 50's block shapes (``_column_shape``; the forward of forced cuda/im2col
#: fp16 0.513 -> 0.228 ms, bf16 0.521 -> 0.228), which no longer leave half of the threads idle
#: at 32 channels (the stage was slower then: fp16 0.476 -> 0.498, session 8).
CHANNELS_LAST_COLUMNS = True
CHANNELS_LAST_COLUMNS_3D = frozenset({np.dtype(np.float32), np.dtype(np.float16), BFLOAT16})
#: Channels per 16-byte vector, the unit of the channels-last sampler.
_COLUMN_VEC = {np.dtype(np.float16): 8, BFLOAT16: 8, np.dtype(np.float32): 4}
_COLUMN_THREADS = 256   # fused_columns' block: (256 / lanes) positions x lanes threads per position
#: The fewest threads per position fused_columns' rule (``_column_shape``) may take: 8, 4 or 2.
COLUMN_MIN_LANES = 2


def _column_shape(channels: int, vec: int, ndim: int) -> tuple:
    """fused_columns' ``(vectors per thread, threads per position)``: the most vectors (4, 2,
    then 1), at the most lanes (8, 4, then 2, down to ``COLUMN_MIN_LANES``; in 3D 4 vectors at 4
    lanes or more), whose block tile of lanes * vec * vectors channels does not exceed
    ``channels``; else 1 x 8, with idle threads. The threads of one position each compute its
    corners, so more vectors a thread compute them fewer times. H200, forward of forced
    cuda/im2col (NOTES-gpu.md, session 50), against the 1 x 8 of sessions 9-49: B=32 C64 56x56 fp16
    4 x 2 0.838x (2 x 4 0.895x), float32 4 x 4 0.862x; B=2 C32 32^3 float32 2 x 4 0.862x (4 x 2,
    its eight corners of four vectors at 128 positions a block, 0.916x), fp16 2 x 2 0.529x (1 x 8
    left half of its threads idle); B=8 C256 56x56 float32 4 x 8 unchanged."""
    for vectors in (4, 2, 1):
        for lanes in (8, 4, 2):
            if lanes < COLUMN_MIN_LANES or (ndim == 3 and vectors == 4 and lanes < 4):
                continue
            if lanes * vec * vectors <= channels:
                return vectors, lanes
    return 1, 8


#: fused_columns' blocks per launch wanted at least (a few per multiprocessor): a block samples
#: a run of taps, the longest that keeps this many blocks, decoding its positions once for all.
COLUMN_BLOCKS = 2048


def _column_taps(tiles: int, taps: int) -> int:
    """Taps per fused_columns block, for a launch of ``tiles`` (position x channel) tiles."""
    runs = min(taps, max(1, -(-COLUMN_BLOCKS // max(tiles, 1))))
    return -(-taps // runs)


def settings() -> tuple:
    """The module settings an executable is built with (part of the functional API's plan key)."""
    return (WORKSPACE_LIMIT_BYTES, TILE_HALO, TILE_SMEM_BYTES, _INT32_SAFE, CHANNELS_LAST_COLUMNS,
            CHANNELS_LAST_COLUMNS_3D, COLUMN_MIN_LANES, WEIGHT_IN_ONE_GEMM)


def device_context(device_id: int):
    return cupy.cuda.Device(device_id)


# ---------------------------------------------------------------------------------------------
# Sources, compilation and module cache


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_source_text = None


def _inline(folder: Path, name: str, seen: set) -> list:
    """The lines of ``name`` with local ``#include "..."`` inlined once, with #line directives."""
    lines = [f'#line 1 "cuda/{name}"']
    for number, line in enumerate((folder / name).read_text().splitlines(), start=1):
        match = _INCLUDE.match(line)
        if match and (folder / match.group(1)).is_file():
            header = match.group(1)
            if header not in seen:
                seen.add(header)
                lines.extend(_inline(folder, header, seen))
            lines.append(f'#line {number + 1} "cuda/{name}"')
        elif line.strip() == "#pragma once":
            lines.append("")
        else:
            lines.append(line)
    return lines


def source_text(name: str, folder=None) -> str:
    """The CUDA source ``name`` of ``folder`` (default: the package's ``cuda/``) with its local
    headers inlined (#line directives kept), as NVRTC compiles it; read each call."""
    return "\n".join(_inline(cuda_source_dir() if folder is None else Path(folder), name, set())) + "\n"


_module_texts = {}


def module_text(name: str) -> str:
    """The module text of the CUDA source ``name`` (:func:`source_text`), read once."""
    text = _module_texts.get(name)
    if text is None:
        text = _module_texts[name] = source_text(name)
    return text


def module_source() -> str:
    """The full module text: ``deform_conv.cu`` with its local headers inlined."""
    global _source_text
    if _source_text is None:
        _source_text = source_text(_MAIN_SOURCE)
    return _source_text


def name_expressions(dtype, ndim: int, index64: bool) -> tuple:
    """Every kernel instantiation of one module (one dtype, one N, one index width)."""
    t = _CTYPES[np.dtype(dtype)]
    i = "long long" if index64 else "int"
    names = [f"{kernel}<{t}, {i}, {ndim}>" for kernel in ("deform_im2col", "deform_col2im_tiled")]
    names += [f"deform_backward_grouped<{t}, {i}, {ndim}, {o}, {m}>" for o, m in _GRAD_VARIANTS]
    names += [f"batch_to_columns<{t}, {i}>", f"columns_to_batch<{t}, {i}>", f"finalize<{t}, {i}>"]
    return tuple(names)


def all_module_keys():
    """(dtype, ndim, index64) of every module the backend can build."""
    return [(dtype, ndim, index64) for dtype in _CTYPES for ndim in (1, 2, 3) for index64 in (False, True)]


def cuda_include_dirs() -> list:
    """Folders holding cuda_fp16.h / cuda_bf16.h for NVRTC (CUDA wheels or a toolkit)."""
    found = []
    try:
        from cuda import pathfinder
        folder = pathfinder.find_nvidia_header_directory("cudart")
        if folder:
            found.append(str(folder))
    except Exception:
        pass
    roots = []
    try:
        from cupy import _environment
        roots.append(_environment.get_cuda_path())
    except Exception:
        pass
    roots += [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    for root in roots:
        if root and os.path.isfile(os.path.join(root, "include", "cuda_fp16.h")):
            found.append(os.path.join(root, "include"))
    unique = []
    for folder in found:
        if folder not in unique and os.path.isfile(os.path.join(folder, "cuda_fp16.h")):
            unique.append(folder)
    return unique[:1]


_options = None


def compile_options() -> tuple:
    global _options
    if _options is None:
        _options = ("-std=c++17",) + tuple(f"-I{folder}" for folder in cuda_include_dirs())
    return _options


_modules = {}
_functions = {}
_compile_lock = threading.Lock()


def _function(name: str, dtype, ndim: int, index64: bool):
    """The kernel ``name`` (a template instantiation) on the current device, compiled once."""
    device = cupy.cuda.runtime.getDevice()
    key = (device, name)
    fn = _functions.get(key)
    if fn is None:
        with _compile_lock:  # concurrent first use: one compilation per module
            fn = _functions.get(key)
            if fn is None:
                mkey = (device, np.dtype(dtype).str, ndim, index64)
                module = _modules.get(mkey)
                if module is None:
                    module = cupy.RawModule(code=module_source(), options=compile_options(),
                                            name_expressions=name_expressions(dtype, ndim, index64))
                    _modules[mkey] = module
                fn = _functions[key] = module.get_function(name)
    return fn




class _Kernels:
    """The kernels of one (dtype, N, index width) on the current device."""

    def __init__(self, dtype, ndim: int, index64: bool):
        self.dtype, self.ndim, self.index64 = np.dtype(dtype), ndim, index64
        self.t = _CTYPES[self.dtype]
        self.i = "long long" if index64 else "int"
        self.index = np.int64 if index64 else np.int32

    def get(self, name: str, spatial: bool = True, extra: str = ""):
        expr = f"{name}<{self.t}, {self.i}" + (f", {self.ndim}" if spatial else "") + extra + ">"
        return _function(expr, self.dtype, self.ndim, self.index64)


def _launch(kernel, total: int, args) -> None:
    if total <= 0:
        return
    grid = min((total + _BLOCK - 1) // _BLOCK, _MAX_GRID)
    kernel((grid,), (_BLOCK,), args)


def _max_box_volume(geom, tile: int, halo: int) -> int:
    """The largest shared-memory box of the tiled scatter (mirrors TileBox in dcn_common.cuh)."""
    Q = geom.output_size
    first = np.arange(0, Q, tile, dtype=np.int64)
    last = np.minimum(first + tile, Q) - 1
    first_c = np.unravel_index(first, geom.output_shape)
    last_c = np.unravel_index(last, geom.output_shape)
    same = np.ones(first.shape, dtype=bool)
    volume = np.ones(first.shape, dtype=np.int64)
    for a in range(geom.ndim):
        qmin = np.where(same, first_c[a], 0)
        qmax = np.where(same, last_c[a], geom.output_shape[a] - 1)
        same &= first_c[a] == last_c[a]
        lo = np.maximum(qmin * geom.stride[a] - geom.padding[a] - halo, 0)
        hi = np.minimum(qmax * geom.stride[a] - geom.padding[a] + (geom.kernel_size[a] - 1) * geom.dilation[a]
                        + 1 + halo, geom.input_shape[a] - 1)
        volume *= np.maximum(hi - lo + 1, 0)
    return int(volume.max())


def _geom_struct(geom):
    """The kernels' ``Geom<N>`` (6*N int32, passed by value)."""
    values = (tuple(geom.input_shape) + tuple(geom.output_shape) + tuple(geom.kernel_size)
              + tuple(geom.stride) + tuple(geom.padding) + tuple(geom.dilation))
    struct = np.dtype([("v", np.int32, (len(values),))])
    return np.array(values, dtype=np.int32).view(struct)


def _index64(*counts) -> bool:
    return max(counts) > _INT32_SAFE


# ---------------------------------------------------------------------------------------------
# GEMM: strided-batched over groups through cuBLAS, described once


def _cublas_module():
    # Imported on first use: loading cuBLAS needs its library, which compiling does not.
    from cupy_backends.cuda.libs import cublas
    return cublas


def cupy_allows_tf32() -> bool:
    """CuPy's compute type for float32 is TF32 (``CUPY_TF32=1`` or set_compute_type)."""
    try:
        from cupy._core import _routines_linalg as linalg
        return linalg.get_compute_type(np.float32) == getattr(linalg, "COMPUTE_TYPE_TF32", 7)
    except Exception:
        return False


def _compute_type(a_dtype, allow_tf32: bool) -> int:
    _cublas = _cublas_module()
    if a_dtype == np.float64:
        return _cublas.CUBLAS_COMPUTE_64F
    if a_dtype == np.float32 and allow_tf32:
        return _cublas.CUBLAS_COMPUTE_32F_FAST_TF32
    return _cublas.CUBLAS_COMPUTE_32F


_SCALARS = {(np.float64, 0.0): np.array(0.0), (np.float64, 1.0): np.array(1.0),
            (np.float32, 0.0): np.array(0.0, np.float32), (np.float32, 1.0): np.array(1.0, np.float32)}


#: Bytes of the plan's workspace handed to cuBLAS (cublasSetWorkspace) for its GEMMs, so that
#: cuBLAS never allocates, in a CUDA-graph capture included.
CUBLAS_WORKSPACE_BYTES = 8 * 2**20

_libcublas = None
_handles = threading.local()


def _cublas_library():
    """libcublas through ctypes: CuPy's binding refuses every cuBLAS call during a stream
    capture, and does not expose cublasSetWorkspace. Loaded as a ``PyDLL``: its calls keep the
    GIL (they only enqueue work), where a ``CDLL`` call releases it and must take it back, from
    another thread (torch's autograd runs backward on its own) if that one holds it."""
    global _libcublas
    if _libcublas is None:
        import ctypes
        _cublas_module()  # loads the library CuPy uses (so the soname below resolves to it)
        lib = None
        for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so", "cublas64_13.dll", "cublas64_12.dll"):
            try:
                lib = ctypes.PyDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            from cuda import pathfinder
            lib = ctypes.PyDLL(pathfinder.load_nvidia_dynamic_lib("cublas").abs_path)
        p, i, i64, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_size_t
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(p)]
        lib.cublasSetStream_v2.argtypes = [p, p]
        lib.cublasSetWorkspace_v2.argtypes = [p, p, u64]
        lib.cublasGemmStridedBatchedEx.argtypes = [p, i, i, i, i, i, p, p, i, i, i64, p, i, i, i64, p, p, i, i, i64, i,
                                                   i, i]
        for fn in (lib.cublasCreate_v2, lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2,
                   lib.cublasGemmStridedBatchedEx):
            fn.restype = i
        _libcublas = lib
    return _libcublas


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"cuBLAS {what} failed with status {status}")


def _own_handle(device_id: int) -> int:
    """dcn_cupy's cuBLAS handle of this thread and device (created once, outside any capture;
    CuPy's shared handle is left alone)."""
    table = getattr(_handles, "table", None)
    if table is None:
        table = _handles.table = {}
    handle = table.get(device_id)
    if handle is None:
        import ctypes
        raw = ctypes.c_void_p()
        with cupy.cuda.Device(device_id):
            _check(_cublas_library().cublasCreate_v2(ctypes.byref(raw)), "cublasCreate")
        handle = table[device_id] = raw.value
    return handle


def _prepare_cublas(device_id: int, workspace_ptr: int, workspace_bytes: int, stream=None) -> int:
    """The handle, on ``stream`` (default: CuPy's current stream), with the plan's workspace
    (set after the stream: cublasSetStream resets the workspace)."""
    handle = _own_handle(device_id)
    state = (cupy.cuda.get_current_stream().ptr if stream is None else stream, workspace_ptr, workspace_bytes)
    last = _handles.__dict__.setdefault("state", {})
    previous = last.get(handle)
    if previous != state:  # the handle is this thread's own: nothing else changes it
        lib = _cublas_library()
        if previous is None or previous[0] != state[0]:  # (resets the workspace to cuBLAS's own pool)
            _check(lib.cublasSetStream_v2(handle, state[0]), "cublasSetStream")
        _check(lib.cublasSetWorkspace_v2(handle, workspace_ptr, workspace_bytes), "cublasSetWorkspace")
        last[handle] = state
    return handle


class _Gemm:
    """``c[g] = op(a[g]) @ op(b[g]) + beta * c[g]`` over ``batch`` groups, C-contiguous row-major
    operands of fixed shapes: every cuBLAS argument but the pointers is fixed here."""

    def __init__(self, batch, m, n, k, a_dtype, c_dtype, trans_a=False, trans_b=False, beta=0.0, allow_tf32=False,
                 depth=None, ldc=None):
        # depth: the operands' row length along k where that exceeds k (a slice of k: each
        # batch entry then the next slice of ``k``, the split weight gradient's GEMM); ldc: C's
        # row length where that exceeds n (C a panel of columns of a wider matrix)
        if max(m, n, k) > _INT32_MAX:
            raise ValueError(
                f"a GEMM of size {m}x{n}x{k} exceeds cuBLAS's 32-bit sizes: one sample's output grid "
                f"(C_out/groups x prod(Q)) or columns (C_in/groups*K x prod(Q)) are too large"
            )
        ldc = n if ldc is None else int(ldc)
        if ldc < n:
            raise ValueError(f"a GEMM's C rows of {ldc} elements cannot hold its {n} columns")
        cublas = _cublas_module()
        self._call = _cublas_library().cublasGemmStridedBatchedEx
        compute = _compute_type(np.dtype(a_dtype), allow_tf32)
        scalar = np.float64 if compute == cublas.CUBLAS_COMPUTE_64F else np.float32
        alpha = _SCALARS[(scalar, 1.0)].ctypes.data
        beta_ = _SCALARS[(scalar, float(beta))].ctypes.data
        a_rows, a_cols = (k, m) if trans_a else (m, k)
        b_rows, b_cols = (n, k) if trans_b else (k, n)
        t = _CUDA_DTYPES[np.dtype(a_dtype)]
        # Row-major C (m x n) is column-major C^T (n x m) = op(B)^T op(A)^T.
        self._head = (cublas.CUBLAS_OP_T if trans_b else cublas.CUBLAS_OP_N,
                      cublas.CUBLAS_OP_T if trans_a else cublas.CUBLAS_OP_N, n, m, k, alpha)
        if depth is None:
            self._b = (t, b_cols, b_rows * b_cols)
            self._a = (t, a_cols, a_rows * a_cols)
        else:   # k along the rows of both (A = gy, B = columns^T): rows of ``depth``, slices k apart
            if trans_a or not trans_b or depth > _INT32_MAX:
                raise ValueError("a GEMM split along k takes A (m x depth) and B^T (n x depth)")
            self._b = (t, depth, k)
            self._a = (t, depth, k)
        self._beta = beta_
        self._c = (_CUDA_DTYPES[np.dtype(c_dtype)], ldc, m * ldc, batch, compute, cublas.CUBLAS_GEMM_DEFAULT)

    def __call__(self, handle, a_ptr, b_ptr, c_ptr) -> None:
        status = self._call(handle, *self._head, b_ptr, *self._b, a_ptr, *self._a, self._beta, c_ptr, *self._c)
        if status:
            _check(status, "cublasGemmStridedBatchedEx")


#: The weight gradient's GEMM (grad_w += gy @ columns^T, C_out/G x C_in/G*K over a chunk's
#: positions) split along its positions where its output has too few tiles to fill the device
#: (cuBLAS's grid is the output's tiles: 3D transposed B=2 C32, 32 x 864 over 8192 positions,
#: ran 27 blocks of 32x32 in strict float32): ``gemm_splits``. Each split's product goes to a
#: partial sum of the workspace (one strided-batched GEMM), the partial sums are added in order
#: by a second GEMM (a row of ones times them, strict float32 or float64) into the gradient, and
#: positions past the whole splits by a third. H200, f+b (NOTES-gpu.md, session 47): 3D
#: transposed strict float32 0.4965 -> 0.4855 ms at 8 splits (the GEMM 0.049 -> 0.035), TF32
#: 0.412 -> 0.402; 3D B=2 C32 32^3 TF32 2.144 -> 2.107; but 3D strict float32, 65536 positions
#: a chunk, 2.614 -> 2.655 (4 splits 2.895): cuBLAS's strict kernel does better unsplit there,
#: hence ``_GEMM_STRICT_DEPTH``. 1: never split.
GEMM_SPLITS = 8

#: Where the weight gradient is one GEMM's (one chunk, not split along the positions), that GEMM
#: writes it in its own dtype (beta 0): no float32 accumulator for the half types (B=16 C512
#: 14x14 fp16: 9 MiB of workspace), nothing cleared before and no cast after. H100, session 78,
#: B=16 C512 14x14 beside the fused backward: f+b 0.937x in fp16 and 0.938x in bf16, peak 47.7 ->
#: 38.7 MiB. False: accumulated from zero as over several chunks (the A/B).
WEIGHT_IN_ONE_GEMM = True
_GEMM_TILE = 64              # the output tile the rule assumes (cuBLAS's choice is its own)
_GEMM_SPLIT_DEPTH = 512      # positions a split takes at least
_GEMM_STRICT_DEPTH = 16384   # strict float32: positions a chunk beyond which it is not split


def gemm_splits(groups: int, m: int, n: int, k: int, multiprocessors: int, most=None, strict: bool = False) -> int:
    """The splits of the weight gradient's GEMM (``GEMM_SPLITS``): as many as keep the output's
    64x64 tiles times the splits within the multiprocessors, each at least ``_GEMM_SPLIT_DEPTH``
    positions deep, at most ``most`` (default ``GEMM_SPLITS``); 1 with several conv groups (their
    batch already fills cuBLAS's grid, and one strided batch cannot slice both), and in
    ``strict`` float32 (no TF32) over more than ``_GEMM_STRICT_DEPTH`` positions."""
    most = GEMM_SPLITS if most is None else most
    if groups > 1 or (strict and k > _GEMM_STRICT_DEPTH):
        return 1
    tiles = -(-m // _GEMM_TILE) * -(-n // _GEMM_TILE)
    return max(1, min(int(most), multiprocessors // tiles, k // _GEMM_SPLIT_DEPTH))


def column_panels(executable, column_bytes: int, multiprocessors: int, strict: bool = False) -> int:
    """Panels of input channels for a weight-only backward's columns (``_Backward``'s
    ``column_bytes``): the fewest, each a whole number of the channels-last sampler's channel
    tiles, whose columns over the whole batch take at most ``column_bytes`` (else the most that
    serve); 1 where they do not serve: deform_im2col's columns, conv groups, several offset or
    mask groups (the sampler's offsets and mask are indexed by all of them), or a panel whose
    weight GEMM ``gemm_splits`` would split along the positions (its partial sums are whole rows)."""
    e, geom = executable, executable.geom
    if (not e.channels_last or e.G > 1 or (geom.has_offset and e.Go > 1) or (geom.has_mask and e.Gm > 1)
            or e.C % e.column_tile):
        return 1
    tiles = e.C // e.column_tile
    positions = e.B * e.Q
    served = [p for p in range(1, tiles + 1) if tiles % p == 0 and (
        p == 1 or gemm_splits(1, e.Cog, e.C // p * e.K, positions, multiprocessors, strict=strict) == 1)]
    for p in served:
        if e.C // p * e.K * positions * e.dtype.itemsize <= column_bytes:
            return p
    return served[-1]


def _gemm(a, b, c, trans_a: bool = False, trans_b: bool = False, beta: float = 0.0, allow_tf32=None) -> None:
    """One GEMM of 3-D C-contiguous arrays (benchmarks and tests; executables hold _Gemm's)."""
    batch, m, n = c.shape
    k = a.shape[1] if trans_a else a.shape[2]
    tf32 = cupy_allows_tf32() if allow_tf32 is None else allow_tf32
    handle = _prepare_cublas(cupy.cuda.runtime.getDevice(), None, 0)
    _Gemm(batch, m, n, k, a.dtype, c.dtype, trans_a, trans_b, beta, tf32)(handle, a.data.ptr, b.data.ptr, c.data.ptr)


# ---------------------------------------------------------------------------------------------
# chunks and the workspace layout


_ALIGN = 256


class _Layout:
    """Named, aligned slices of one workspace."""

    def __init__(self):
        self.size = 0
        self.slots = {}

    def ptr(self, base: int, name: str) -> int:
        return base + self.slots[name][0]

    def add(self, name: str, count: int, dtype) -> None:
        dtype = np.dtype(dtype)
        self.slots[name] = (self.size, int(count), dtype)
        self.size += -(-int(count) * dtype.itemsize // _ALIGN) * _ALIGN

    def view(self, workspace, name: str, shape):
        offset, _, dtype = self.slots[name]
        count = math.prod(shape)
        return workspace[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)


def _sub_geometry(geom: ConvGeometry, n: int, lo: int, hi: int) -> ConvGeometry:
    """The geometry of ``n`` samples restricted to rows ``lo:hi`` of the first output axis: the
    padding shifts so that row ``lo`` becomes row 0 (it may go negative)."""
    padding = (geom.padding[0] - lo * geom.stride[0],) + tuple(geom.padding[1:])
    return ConvGeometry(geom.ndim, n, geom.in_channels, geom.out_channels, geom.groups, geom.offset_groups,
                        geom.mask_groups, geom.kernel_size, geom.stride, padding, geom.dilation, geom.input_shape,
                        (hi - lo,) + tuple(geom.output_shape[1:]))


class _Chunk:
    """One unit of work: samples ``start:stop`` (rows ``lo:hi`` of one sample when ``rows``)."""

    __slots__ = ("start", "stop", "n", "rows", "lo", "hi", "Q", "struct", "index", "kernels", "cap", "first", "last",
                 "i_n", "i_q")

    def __init__(self, exe, start, stop, lo=None, hi=None):
        geom = exe.geom
        self.start, self.stop, self.n = start, stop, stop - start
        self.rows = lo is not None
        self.lo, self.hi = lo, hi
        self.first = not self.rows or lo == 0
        self.last = not self.rows or hi == geom.output_shape[0]
        found = exe._grids.get((lo, hi))
        if found is None:  # the Geom struct and scatter box of a (sub-)grid, once per distinct one
            sub = _sub_geometry(geom, self.n, lo, hi) if self.rows else geom.with_batch(self.n)
            cap = 0
            if exe.needs_scatter:
                cap = max(int(min(_max_box_volume(sub, _TILE, int(exe.halo)), int(exe.smem) // exe.acc.itemsize)), 0)
            found = exe._grids[(lo, hi)] = (sub.output_size, _geom_struct(sub), cap)
        self.Q, self.struct, self.cap = found
        n, C, Co, K, S = self.n, geom.in_channels, geom.out_channels, geom.kernel_volume, geom.input_size
        index64 = _index64(n * C * S, C * K * n * self.Q, n * Co * self.Q,
                           n * max(geom.offset_groups, 1) * K * geom.ndim * self.Q,
                           n * max(geom.mask_groups, 1) * K * self.Q)
        self.index = np.int64 if index64 else np.int32
        self.kernels = exe.kernels(index64)
        self.i_n = np.int32(self.n)
        self.i_q = self.index(self.Q)


def _plan_chunks(geom, per_position: int, fixed: int, per_sample_fixed: int, limit: int, what: str):
    """``(samples per chunk, rows per chunk)``: whole samples while one fits the limit, else
    slabs of rows of the first output axis; a MemoryError when one row does not fit."""
    Q = geom.output_size
    per_sample = per_position * Q + per_sample_fixed
    if fixed + per_sample <= limit:
        n = min(geom.batch, (limit - fixed) // per_sample, _INT32_MAX // Q)
        return max(1, n), None
    inner = Q // geom.output_shape[0]
    row = per_position * inner
    need = fixed + per_sample_fixed + row
    if need > limit:
        raise MemoryError(
            f"deformable convolution ({what}) needs a workspace of at least {need} bytes for one row of output "
            f"positions of one sample, more than the limit of {limit} bytes (dcn_cupy._backends.cuda."
            f"WORKSPACE_LIMIT_BYTES, environment variable DCN_CUPY_CUDA_WORKSPACE_BYTES)"
        )
    return 1, max(1, min((limit - fixed - per_sample_fixed) // row, geom.output_shape[0]))


#: Replay the recorded launches of a call whose pointers equal the previous call's (the
#: common case: same buffers, or the allocator handing back the same blocks); False launches
#: through CuPy arrays every call.
REPLAY = True
_BLOCK1 = (_BLOCK,)


def _u64(pointer: int):
    return np.uint64(pointer)


def _ptr(array) -> int:
    return 0 if array is None else array.data.ptr


def _at(pointer: int, offset: int):
    """A device pointer argument ``pointer + offset``; None (a null pointer) for an absent array."""
    return None if not pointer else np.uint64(pointer + offset)


def _grid(total: int) -> tuple:
    return (min((total + _BLOCK - 1) // _BLOCK, _MAX_GRID),)


def _plain_batch(*arrays) -> bool:
    """Every array C-contiguous, batch axis included (pointer arithmetic over samples holds)."""
    for a in arrays:
        if a is not None and not a.flags.c_contiguous:
            return False
    return True


_PARAM_ALIGN = 16


def _param_bytes(value) -> bytes:
    """One kernel argument as cuLaunchKernel reads it: a pointer (None: null), a NumPy scalar or
    a NumPy structured value (the Geom struct)."""
    if value is None:
        return bytes(8)
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tobytes()
    raise TypeError(f"a recorded kernel argument must be None or a NumPy value, got {type(value).__name__}")


class _Params:
    """The argument block of one recorded launch, packed once: a buffer holding every argument
    (16-byte aligned slots) and the array of pointers to them that cuLaunchKernel takes."""

    __slots__ = ("storage", "pointers", "ptr")

    def __init__(self, args):
        blobs = [_param_bytes(a) for a in args]
        offsets, size = [], 0
        for blob in blobs:
            offsets.append(size)
            size += -(-max(len(blob), 1) // _PARAM_ALIGN) * _PARAM_ALIGN
        self.storage = np.zeros(max(size, _PARAM_ALIGN), dtype=np.uint8)
        for blob, offset in zip(blobs, offsets):
            self.storage[offset:offset + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        base = self.storage.ctypes.data
        self.pointers = np.array([base + o for o in offsets] or [0], dtype=np.uint64)
        self.ptr = self.pointers.ctypes.data


#: Programmatic dependent launch (compute capability 9.0 and above): launches recorded with
#: ``overlap`` may start while the kernel before them in the stream finishes (``DCN_CUPY_PDL=0``:
#: never).
PDL = os.environ.get("DCN_CUPY_PDL", "1") != "0"
_pdl_devices = {}   # device id -> whether it has programmatic dependent launch


def _pdl_device() -> bool:
    """Whether the current device has programmatic dependent launch (compute capability >= 9.0)."""
    device = cupy.cuda.runtime.getDevice()
    capable = _pdl_devices.get(device)
    if capable is None:
        capable = _pdl_devices[device] = int(cupy.cuda.Device(device).compute_capability) >= 90
    return capable


def _follows_kernel(ops) -> bool:
    """Whether a launch appended now to the recorded list ``ops`` follows one of its kernels: only
    then may it overlap that kernel (``_kernel_op``'s ``overlap``). Not the list's first launch
    (what came before it in the stream is unknown), nor one after a memset (a graph's
    programmatic edges join kernel nodes)."""
    return bool(ops) and ops[-1][0] == 0


def _kernel_op(kernel, grid, block, args, shared_mem=0, overlap=False):
    """A recorded launch of a RawKernel (on the current device): its CUfunction, launch
    configuration and argument block, launched by cuLaunchKernel on replay (a few µs less than
    CuPy's argument processing per launch). ``overlap``: launched with programmatic stream
    serialization (``PDL``, where the driver has cuLaunchKernelEx), so that its blocks may start
    once every block of the kernel before it has called ``fused::launch_dependents``; only for a
    kernel that calls ``fused::wait_prerequisites`` before it reads that kernel's output and
    before it exits."""
    params = _Params(args)
    function = kernel.kernel if hasattr(kernel, "kernel") else kernel   # a RawKernel, or a Function
    f, gx, bx, smem = function.ptr, int(grid[0]), int(block[0]), int(shared_mem)
    _launch_function()
    head = None if _prepare is None else _prepare(f, gx, bx, smem, params.ptr, overlap and PDL and _pdl_device())
    return (0, f, gx, bx, smem, params.ptr, params, head)


_INVALID_CONTEXT = 201   # CUDA_ERROR_INVALID_CONTEXT


def _make_context_current() -> bool:
    """Make the runtime's current device's primary context current on this thread. A thread
    that has made no runtime call has none, and CuPy's ``Device`` context skips
    ``cudaSetDevice`` when the device is already the current one (as device 0 is on a new
    thread): the first driver-API launch there fails with CUDA_ERROR_INVALID_CONTEXT."""
    runtime = cupy.cuda.runtime
    runtime.setDevice(runtime.getDevice())
    return True


def _driver_launch():
    """``cuLaunchKernel`` through a ``PyDLL`` of the driver (keeps the GIL: see
    _cublas_library), else CuPy's binding (which releases it): ``(launch, memset, prepare,
    launch_prepared, stream_arg)``, the last three None with CuPy's binding. ``prepare`` converts
    a recorded launch's function, grid, block, shared memory and argument block to ctypes values
    once, ``stream_arg`` a stream, and ``launch_prepared(head, stream)`` launches them: half of a
    ctypes call's cost is converting its arguments (~1.5 µs of the ~5.5 µs a launch takes on an
    H200's host)."""
    import ctypes
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.PyDLL(name)
            break
        except OSError:
            continue
    else:
        return cupy.cuda.driver.launchKernel, cupy.cuda.runtime.memsetAsync, None, None, None
    fn = lib.cuLaunchKernel
    p, u = ctypes.c_void_p, ctypes.c_uint
    fn.argtypes = [p, u, u, u, u, u, u, u, p, p, p]
    fn.restype = ctypes.c_int

    def launch(f, gx, gy, gz, bx, by, bz, shared_mem, stream, params, extra):
        status = fn(f, gx, gy, gz, bx, by, bz, shared_mem, stream, params, extra or None)
        if status == _INVALID_CONTEXT and _make_context_current():
            status = fn(f, gx, gy, gz, bx, by, bz, shared_mem, stream, params, extra or None)
        if status:
            raise RuntimeError(f"cuLaunchKernel failed with CUresult {status}")

    one = u(1)
    launch_ex = _launch_ex(lib, fn)

    def prepare(f, gx, bx, shared_mem, params, overlap=False):
        if overlap and launch_ex is not None:
            return launch_ex.prepare(f, gx, bx, shared_mem, params)
        return p(f), u(gx), u(bx), u(shared_mem), p(params)

    def launch_prepared(head, stream):
        if len(head) != 5:
            launch_ex.launch(head, stream)
            return
        f, gx, bx, shared_mem, params = head
        status = fn(f, gx, one, one, bx, one, one, shared_mem, stream, params, None)
        if status == _INVALID_CONTEXT and _make_context_current():
            status = fn(f, gx, one, one, bx, one, one, shared_mem, stream, params, None)
        if status:
            raise RuntimeError(f"cuLaunchKernel failed with CUresult {status}")

    zero = lib.cuMemsetD8Async
    zero.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, p]
    zero.restype = ctypes.c_int

    def memset(ptr, value, size, stream):
        status = zero(ptr, value, size, stream)
        if status == _INVALID_CONTEXT and _make_context_current():
            status = zero(ptr, value, size, stream)
        if status:
            raise RuntimeError(f"cuMemsetD8Async failed with CUresult {status}")

    global _graph_library
    _graph_library = lib
    return launch, memset, prepare, launch_prepared, p


class _LaunchEx:
    """``cuLaunchKernelEx`` with the attribute CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    set (programmatic dependent launch; a stream capture turns it into a programmatic edge of the
    graph). A prepared launch is ``(function, params, grid, block, shared memory, attribute)``;
    each launch builds its own CUlaunchConfig, so that threads replaying one recorded launch on
    their own streams share nothing mutable. A launch the driver refuses is made again with
    ``plain`` (cuLaunchKernel: the same kernel, in stream order), and later recordings launch
    plainly (``PDL`` off)."""

    _PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CUlaunchAttributeID

    def __init__(self, lib, plain):
        import ctypes
        p, u = ctypes.c_void_p, ctypes.c_uint

        class Attribute(ctypes.Structure):   # CUlaunchAttribute: id, padding, a 64-byte union
            _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                        ("rest", ctypes.c_char * 60)]

        class Config(ctypes.Structure):      # CUlaunchConfig
            _fields_ = [("gridDimX", u), ("gridDimY", u), ("gridDimZ", u), ("blockDimX", u),
                        ("blockDimY", u), ("blockDimZ", u), ("sharedMemBytes", u), ("hStream", p),
                        ("attrs", ctypes.POINTER(Attribute)), ("numAttrs", u)]

        assert ctypes.sizeof(Attribute) == 72 and Config.hStream.offset == 32 and ctypes.sizeof(Config) == 56
        self._fn = lib.cuLaunchKernelEx
        self._fn.argtypes = [ctypes.POINTER(Config), p, p, p]
        self._fn.restype = ctypes.c_int
        self._attribute, self._config, self._byref, self._pointer, self._p = \
            Attribute, Config, ctypes.byref, ctypes.pointer, p
        self._plain, self._one = plain, u(1)

    def prepare(self, f, gx, bx, shared_mem, params):
        attribute = self._attribute(self._PROGRAMMATIC_STREAM_SERIALIZATION, b"", 1)
        return self._p(f), self._p(params), gx, bx, shared_mem, self._pointer(attribute)

    def launch(self, head, stream):
        f, params, gx, bx, shared_mem, attribute = head
        stream = getattr(stream, "value", stream)   # a ctypes stream argument, or an address
        config = self._config(gx, 1, 1, bx, 1, 1, shared_mem, stream, attribute, 1)
        byref = self._byref(config)
        status = self._fn(byref, f, params, None)
        if status == _INVALID_CONTEXT and _make_context_current():
            status = self._fn(byref, f, params, None)
        if status:
            global PDL
            PDL = False
            one = self._one
            status = self._plain(f, gx, one, one, bx, one, one, shared_mem, stream, params, None)
            if status:
                raise RuntimeError(f"cuLaunchKernel failed with CUresult {status}")


def _launch_ex(lib, plain):
    """The driver's programmatic dependent launch (``_LaunchEx``, ``plain`` its fallback), or
    None (a driver without cuLaunchKernelEx)."""
    try:
        return _LaunchEx(lib, plain)
    except AttributeError:
        return None


_graph_library = None   # the driver's PyDLL once _driver_launch found it (CUDA graphs)
_launch_kernel = None
_memset = None
_prepare = None
_launch_prepared = None
_stream_arg = None


def _launch_function():
    global _launch_kernel, _memset, _prepare, _launch_prepared, _stream_arg
    if _launch_kernel is None:
        launch, _memset, _prepare, _launch_prepared, _stream_arg = _driver_launch()
        _launch_kernel = launch   # set last: other threads test it before using the rest
    return _launch_kernel


#: Recorded launch lists (their GEMMs, if any, on a handle op's handle), with at least this many kernel
#: launches, run as one CUDA graph from their second replay on: one cuGraphLaunch instead of a
#: cuLaunchKernel each (~5 µs of host time a launch on an H200's host; the 2D transposed
#: forward+backward's 50 launches took 0.24 ms of host time against 0.22 ms of kernels,
#: NOTES-gpu.md, session 16). ``DCN_CUPY_CUDA_GRAPHS=0`` replays every launch instead.
GRAPH_MIN_LAUNCHES = 3
GRAPHS = os.environ.get("DCN_CUPY_CUDA_GRAPHS", "1") != "0"


class _Ops(list):
    """A recorded launch list (``_replay``'s ops) and its CUDA graph: None until built (after
    ``replays`` replays), False where it has none (too few launches, a GEMM that takes the
    caller's handle, or a failed build)."""

    __slots__ = ("graph", "replays")

    def __init__(self, ops):
        super().__init__(ops)
        launches = sum(1 for op in self if op[0] == 0 and op[2])
        self.graph = None if GRAPHS and launches >= GRAPH_MIN_LAUNCHES and _self_contained(self) else False
        self.replays = 0


def _self_contained(ops) -> bool:
    """Whether every GEMM of ``ops`` follows a handle op (kind 3), which points the handle at
    the stream the list runs on: a capture stream included, so that the list can be a graph."""
    handle = False
    for op in ops:
        if op[0] == 3:
            handle = True
        elif op[0] == 1 and not handle:
            return False
    return True


def handle_op(device_id: int, workspace_ptr: int, workspace_bytes: int) -> tuple:
    """``_replay``'s kind 3: the GEMMs after it run on this thread's cuBLAS handle of
    ``device_id``, set to the replay's stream with this workspace (``_prepare_cublas``)."""
    return (3, device_id, workspace_ptr, workspace_bytes)


class _GraphExec:
    """An instantiated CUDA graph (CUgraphExec), destroyed with this object (the driver frees it
    once any launch in flight completes)."""

    __slots__ = ("handle", "_destroy")

    def __init__(self, handle: int, destroy):
        self.handle, self._destroy = handle, destroy

    def __del__(self):
        try:
            self._destroy(self.handle)
        except Exception:  # interpreter shutdown: the driver reclaims it with the context
            pass


class _Graphs:
    """The driver's graph functions (through the launches' ``PyDLL``, so calls keep the GIL) and
    each thread's private capture stream per device."""

    _CAPTURE_THREAD_LOCAL = 1   # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL

    def __init__(self, lib):
        import ctypes
        p, pp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        self._ctypes = ctypes
        self.begin, self.end = lib.cuStreamBeginCapture_v2, lib.cuStreamEndCapture
        self.instantiate, self.launch_exec = lib.cuGraphInstantiateWithFlags, lib.cuGraphLaunch
        self.destroy_graph, self.destroy_exec = lib.cuGraphDestroy, lib.cuGraphExecDestroy
        self.is_capturing = lib.cuStreamIsCapturing
        for fn, args in ((self.begin, [p, ctypes.c_int]), (self.end, [p, pp]),
                         (self.instantiate, [pp, p, ctypes.c_ulonglong]), (self.launch_exec, [p, p]),
                         (self.destroy_graph, [p]), (self.destroy_exec, [p]),
                         (self.is_capturing, [p, ctypes.POINTER(ctypes.c_int)])):
            fn.argtypes, fn.restype = args, ctypes.c_int
        self._status = ctypes.c_int()
        self._local = threading.local()

    def capturing(self, stream: int) -> bool:
        """Whether ``stream`` is being captured (then launches must join that capture); an error
        (such as no context yet on this thread) counts as capturing: the launches run as such."""
        status = self.is_capturing(stream, self._ctypes.byref(self._status))
        return status != 0 or self._status.value != 0

    def build(self, ops):
        """``ops`` captured on this thread's capture stream and instantiated: a _GraphExec, or
        False where the driver refused (the launches are then replayed one by one)."""
        ctypes = self._ctypes
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        device = cupy.cuda.runtime.getDevice()
        side = streams.get(device)
        if side is None:
            side = streams[device] = cupy.cuda.Stream(non_blocking=True)
        if self.begin(side.ptr, self._CAPTURE_THREAD_LOCAL):
            return False
        graph = ctypes.c_void_p()
        try:
            _launch_ops(ops, None, side.ptr)
            failed = False
        except Exception:   # a launch the capture refused: replay them one by one instead
            failed = True
        status = self.end(side.ptr, ctypes.byref(graph))
        if failed or status or not graph.value:
            if graph.value:
                self.destroy_graph(graph)
            return False
        executable = ctypes.c_void_p()
        status = self.instantiate(ctypes.byref(executable), graph, 0)
        self.destroy_graph(graph)
        if status or not executable.value:
            return False
        return _GraphExec(executable.value, self.destroy_exec)


_graphs = None   # _Graphs once needed; False where the driver has no graph functions


class Recordings:
    """The recorded launches of an executable for its last few sets of addresses (most recent
    last). A few, not one: callers alternate between buffer sets (XLA keeps the previous step's
    outputs alive; a caching allocator hands back one of two blocks), and a re-recording costs
    far more host time than a replay. Safe across threads: entries are only added and dropped
    whole (a lost race records twice). Lists of kernels and memsets become CUDA graphs
    (``GRAPHS``)."""

    SIZE = 8

    __slots__ = ("entries",)

    def __init__(self):
        self.entries = {}

    def get(self, key):
        return self.entries.get(key)

    def put(self, key, ops):
        entries = self.entries
        while len(entries) >= self.SIZE:
            try:
                entries.pop(next(iter(entries)), None)
            except (StopIteration, RuntimeError):  # emptied or changed by another thread meanwhile
                break
        ops = entries[key] = _Ops(ops) if type(ops) is list else ops
        return ops


def _replay(ops, handle, stream: int) -> None:
    """Run recorded launches on ``stream``: 0 kernel, 1 GEMM (on ``handle``, set to that stream,
    or on the handle of the last kind 3 before it), 2 memset, 3 the handle for the GEMMs after it
    (``handle_op``); as their CUDA graph where they have one (built on their second replay),
    unless ``stream`` is being captured (the launches then join that capture)."""
    if type(ops) is _Ops and ops.graph is not False and _replay_graph(ops, stream):
        return
    _launch_ops(ops, handle, stream)


def _replay_graph(ops, stream: int) -> bool:
    """Launch ``ops``' CUDA graph on ``stream``, building it on the second replay; False: the
    launches are to be replayed one by one (first replay, a capture in progress, no graph)."""
    global _graphs
    if _graphs is None:
        _launch_function()
        try:
            _graphs = _Graphs(_graph_library) if _graph_library is not None else False
        except AttributeError:   # a driver without the graph functions: launches, as before
            _graphs = False
    if _graphs is False:
        ops.graph = False
        return False
    if _graphs.capturing(stream):
        return False
    graph = ops.graph
    if graph is None:
        ops.replays += 1
        if ops.replays < 2:   # a list replayed once may never come back: no graph for it yet
            return False
        graph = ops.graph = _graphs.build(ops)
        if not graph:
            return False
    status = _graphs.launch_exec(graph.handle, stream)
    if status:
        raise RuntimeError(f"cuGraphLaunch failed with CUresult {status}")
    return True


def _launch_ops(ops, handle, stream: int) -> None:
    """``_replay``'s launches, one by one."""
    launch = _launch_kernel or _launch_function()
    stream_arg = None
    for op in ops:
        kind = op[0]
        if kind == 0:
            if op[2]:
                if op[7] is not None:
                    if stream_arg is None:
                        stream_arg = _stream_arg(stream)
                    _launch_prepared(op[7], stream_arg)
                else:
                    launch(op[1], op[2], 1, 1, op[3], 1, 1, op[4], stream, op[5], 0)
        elif kind == 1:
            op[1](handle, op[2], op[3], op[4])
        elif kind == 2:
            _memset(op[1], 0, op[2], stream)
        else:
            handle = _prepare_cublas(op[1], op[2], op[3], stream)


# ---------------------------------------------------------------------------------------------
# the bias gradient: one or two launches (CuPy's sum + astype cost ~45 µs of host time per backward)

_CHANNEL_SUM_SOURCE = r"""
// The bias gradient, deterministic: dst[c] = sum over b, q of src[b * batch_stride + c * inner + q],
// accumulated in Traits<T>::acc in an order fixed by the shape alone. Each sample's row of `inner`
// elements is cut into chunks of CHUNK = 16 bytes (the last one shorter); channel c's flattened
// (sample, chunk) sequence is cut into `splits` ranges of `per` chunks, one block each (block
// c * splits + p takes range p). Chunk i of a range belongs to thread i % blockDim.x, which adds
// its chunks in order, each chunk's elements in order; the block then adds its threads' sums as a
// fixed tree. One range: the block stores dst[c]; else partial[c * splits + p], which
// channel_sum_total adds in order of p. A chunk is one 16-byte load where it is whole and aligned,
// else element loads: the same sums, so the bits do not depend on the addresses. UNROLL chunks are
// loaded before they are added, so that enough loads are in flight.
template <typename T>
__global__ void channel_sum(const T* __restrict__ src, T* __restrict__ dst,
                            typename dcn::Traits<T>::acc* __restrict__ partial, const long long batch,
                            const long long batch_stride, const long long channels, const long long inner,
                            const long long splits) {
    typedef typename dcn::Traits<T>::acc A;
    constexpr int CHUNK = 16 / sizeof(T), UNROLL = 4;
    __shared__ A part[1024];
    const long long c = blockIdx.x / splits, p = blockIdx.x - c * splits;
    const long long row_chunks = (inner + CHUNK - 1) / CHUNK;
    const long long total = batch * row_chunks;
    const long long per = (total + splits - 1) / splits;
    const long long first = p * per, end = min(total, first + per);
    A s = 0;
    for (long long i0 = first + threadIdx.x; i0 < end; i0 += (long long)UNROLL * blockDim.x) {
        T v[UNROLL][CHUNK];
        int n[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long i = i0 + (long long)u * blockDim.x;
            n[u] = 0;
            if (i < end) {
                const long long b = i / row_chunks, q = (i - b * row_chunks) * CHUNK;
                const T* ptr = src + b * batch_stride + c * inner + q;
                n[u] = (int)min((long long)CHUNK, inner - q);
                if (n[u] == CHUNK && (reinterpret_cast<size_t>(ptr) & 15) == 0) {
                    const uint4 r = __ldg(reinterpret_cast<const uint4*>(ptr));
                    memcpy(v[u], &r, sizeof(r));
                } else {
#pragma unroll
                    for (int k = 0; k < CHUNK; ++k) if (k < n[u]) v[u][k] = ptr[k];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int k = 0; k < CHUNK; ++k)
                if (k < n[u]) s += dcn::Traits<T>::load(v[u][k]);
    }
    part[threadIdx.x] = s;
    __syncthreads();
    for (int h = blockDim.x / 2; h > 0; h >>= 1) {
        if (threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        if (splits == 1) dst[c] = dcn::Traits<T>::store(part[0]);
        else partial[blockIdx.x] = part[0];
    }
}

// dst[c] = the sum of channel_sum's partial[c * splits + p] over p = 0, 1, ... in order.
template <typename T>
__global__ void channel_sum_total(const typename dcn::Traits<T>::acc* __restrict__ partial, T* __restrict__ dst,
                                  const long long channels, const long long splits) {
    typedef typename dcn::Traits<T>::acc A;
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    A s = 0;
    for (long long p = 0; p < splits; ++p) s += partial[c * splits + p];
    dst[c] = dcn::Traits<T>::store(s);
}
"""
#: Threads of a channel_sum block (a power of two, at most 1024): part of the summation order,
#: so fixed for every launch.
_CHANNEL_SUM_BLOCK = 512
#: channel_sum cuts channels into ranges only where there are at most this many (H200, one
#: kernel against ranges and their sum, NOTES-gpu.md session 30: 32 channels 10.1 -> 5.7 µs
#: (float32, 8 MB) and 6.4 -> 4.3 (float16), 64 channels 9.0 -> 8.1; 128 and 256 channels
#: slower, 5.5 -> 7.4 and 7.6 -> 12.0), then aims at _CHANNEL_SUM_BLOCKS blocks, each at least
#: _CHANNEL_SUM_MIN_ROUNDS rounds of loads (UNROLL x _CHANNEL_SUM_BLOCK 16-byte chunks). Fixed
#: numbers, not the device's: the ranges, hence the bits, depend on the shape alone.
_CHANNEL_SUM_FEW_CHANNELS = 64
_CHANNEL_SUM_BLOCKS = 528
_CHANNEL_SUM_MIN_ROUNDS = 1


def channel_sum_splits(batch: int, channels: int, inner: int, itemsize: int) -> int:
    """Ranges per channel of :func:`channel_sum`: one (a block a channel) unless the channels
    are few, then enough for ``_CHANNEL_SUM_BLOCKS`` blocks of at least
    ``_CHANNEL_SUM_MIN_ROUNDS`` round of loads each."""
    if channels <= 0 or channels > _CHANNEL_SUM_FEW_CHANNELS:
        return 1
    chunks = batch * -(-inner // (16 // itemsize))
    rounds = chunks // (4 * _CHANNEL_SUM_BLOCK * _CHANNEL_SUM_MIN_ROUNDS)
    return int(max(1, min(-(-_CHANNEL_SUM_BLOCKS // channels), rounds)))


def channel_sum_source() -> str:
    """The bias-gradient module: the common header, ``channel_sum`` and ``channel_sum_total``."""
    return source_text("dcn_common.cuh") + _CHANNEL_SUM_SOURCE


def channel_sum_kernel(dtype):
    """The compiled ``channel_sum<T>`` and ``channel_sum_total<T>`` on the current device (built
    with the plan, never during a capture)."""
    names = tuple(f"{k}<{_CTYPES[np.dtype(dtype)]}>" for k in ("channel_sum", "channel_sum_total"))
    key = (cupy.cuda.runtime.getDevice(), names)
    fns = _functions.get(key)
    if fns is None:
        with _compile_lock:
            fns = _functions.get(key)
            if fns is None:
                module = cupy.RawModule(code=channel_sum_source(), options=compile_options(), name_expressions=names)
                fns = tuple(module.get_function(name) for name in names)
                for fn in fns:
                    fn.kernel  # load it now
                _functions[key] = fns
    return fns


def channel_sum(kernel, grad_output, out) -> None:
    """``out[c] = grad_output[:, c].sum()`` (batch and spatial axes) on CuPy's current stream
    (its partial sums, where there are several ranges a channel, from CuPy's pool);
    ``grad_output`` C-contiguous within each sample, ``out`` contiguous."""
    batch, channels = grad_output.shape[0], grad_output.shape[1]
    summing = ChannelSum(kernel, batch, channels, math.prod(grad_output.shape[2:]), grad_output.dtype,
                         grad_output.strides[0] // grad_output.itemsize)
    partial = cupy.empty(summing.workspace_bytes, dtype=np.uint8) if summing.workspace_bytes else None
    _launch_ops(summing.record(grad_output.data.ptr, out.data.ptr, _ptr(partial)), None,
                cupy.cuda.get_current_stream().ptr)


class ChannelSum:
    """:func:`channel_sum` of ``(batch, channels, *inner)`` arrays (C-contiguous within a sample,
    ``batch_stride`` elements apart; C-contiguous by default) on raw addresses:
    ``ChannelSum(kernels, batch, channels, inner, dtype)(src, dst, workspace, stream)``, the
    launches recorded per set of addresses and replayed. ``workspace_bytes``: the partial sums'
    (0 where each channel is one range)."""

    def __init__(self, kernels, batch: int, channels: int, inner: int, dtype, batch_stride=None):
        self.kernels, self.batch, self.channels, self.inner = kernels, batch, channels, inner
        self.batch_stride = channels * inner if batch_stride is None else batch_stride
        dtype = np.dtype(dtype)
        self.splits = channel_sum_splits(batch, channels, inner, dtype.itemsize)
        self.workspace_bytes = 0 if self.splits == 1 else channels * self.splits * (8 if dtype == np.float64 else 4)
        self._recordings = Recordings()

    def __call__(self, src: int, dst: int, workspace: int, stream: int) -> None:
        if self.channels == 0:
            return
        key = (src, dst, workspace)
        ops = self._recordings.get(key)
        if ops is None:
            ops = self._recordings.put(key, self.record(src, dst, workspace))
        _replay(ops, None, stream)

    def record(self, src: int, dst: int, workspace: int) -> list:
        """The launches, recorded and not run (``_replay``'s ops; none for no channels)."""
        if self.channels == 0:
            return []
        partial, total = self.kernels
        i64 = np.int64
        ops = [_kernel_op(partial, (self.channels * self.splits,), (_CHANNEL_SUM_BLOCK,), (
            i64(src), i64(dst), i64(workspace if self.splits > 1 else 0), i64(self.batch), i64(self.batch_stride),
            i64(self.channels), i64(self.inner), i64(self.splits)))]
        if self.splits > 1:
            ops.append(_kernel_op(total, (-(-self.channels // 128),), (128,), (
                i64(workspace), i64(dst), i64(self.channels), i64(self.splits))))
        return ops


class _Executable:
    """What forward and backward share: sizes, kernels, chunks and the workspace layout."""

    needs_scatter = False
    pointer_path = False      # whether run_pointers serves every call (set by the subclasses)
    copy_given = False        # whether the caller gives the input's channels-last copy (_Backward)
    panels = 1                # the columns' panels of input channels, sampled in turn (_Backward)

    def __init__(self, spec):
        geom = self.geom = spec.geom
        self.spec = spec
        self.dtype = np.dtype(spec.dtype)
        self.acc = compute_dtype(self.dtype)
        self.device_id = spec.device_id
        self.halo, self.smem, self.limit = int(TILE_HALO), int(TILE_SMEM_BYTES), int(WORKSPACE_LIMIT_BYTES)
        self.B, self.C, self.Co, self.G = geom.batch, geom.in_channels, geom.out_channels, geom.groups
        self.K, self.Q, self.S = geom.kernel_volume, geom.output_size, geom.input_size
        self.Cg, self.Cog = geom.in_channels_per_group, geom.out_channels_per_group
        self.Go, self.Gm = max(geom.offset_groups, 1), max(geom.mask_groups, 1)
        self.i_C, self.i_Co = np.int32(self.C), np.int32(self.Co)
        self.i_Go, self.i_Gm = np.int32(self.Go), np.int32(self.Gm)
        self.inner = self.Q // geom.output_shape[0]
        self._kernels = {}
        self._grids = {}
        # cuBLAS's workspace, carved from the plan's (a quarter of the limit at most)
        self.cublas_bytes = min(int(CUBLAS_WORKSPACE_BYTES), self.limit // 4) // _ALIGN * _ALIGN
        self._recordings = Recordings()
        self.channels_last = self._channels_last_columns()
        vec = _COLUMN_VEC.get(self.dtype, 1)
        # fused_columns' vectors per thread, threads per position, and its block tile
        self.column_vectors, self.column_lanes = _column_shape(self.C, vec, geom.ndim)
        self.column_tile = self.column_lanes * vec * self.column_vectors
        self.column_positions = _COLUMN_THREADS // self.column_lanes
        self._column_kernels = {}

    def _channels_last_columns(self) -> bool:
        """Whether this executable's columns come from the channels-last sampler
        (``CHANNELS_LAST_COLUMNS``); the chunking may still turn it off (rows of one sample)."""
        geom = self.geom
        vec = _COLUMN_VEC.get(self.dtype)
        if not CHANNELS_LAST_COLUMNS or vec is None or (geom.ndim > 2 and self.dtype not in CHANNELS_LAST_COLUMNS_3D):
            return False
        per_go = self.C // self.Go if geom.has_offset else self.C
        per_gm = self.C // self.Gm if geom.has_mask else self.C
        if per_go % vec or per_gm % vec:
            return False
        try:
            return int(cupy.cuda.Device(self.device_id).compute_capability) >= 80
        except Exception:   # no usable device: deform_im2col
            return False

    def _chunking(self, per_position: int, fixed: int, per_sample: int, staging: int, what: str):
        """``(samples per chunk, rows per chunk)`` (module ``_plan_chunks``), with the
        channels-last copy's bytes where the sampler uses it; where a sample does not fit, chunks
        of rows with ``staging`` more bytes per position and no copy (deform_im2col's columns)."""
        it = self.dtype.itemsize
        copy = (self.C * self.S * it, self.C * it) if self.channels_last else (0, 0)
        n, rows = _plan_chunks(self.geom, per_position, fixed + copy[1], per_sample + copy[0], self.limit, what)
        if rows is not None:
            self.channels_last = False
            n, rows = _plan_chunks(self.geom, per_position + staging, fixed, per_sample, self.limit, what)
        return n, rows

    def _column_layout(self, n: int) -> None:
        """The channels-last copy of ``n`` samples and its zero row, where the sampler uses it
        (and the caller does not give it)."""
        if self.channels_last and not self.copy_given:
            self.layout.add("xcl", (n * self.S + 1) * self.C, self.dtype)

    def _wide_columns(self, c) -> bool:
        return c.index is np.int64 or (c.n * self.S + 1) * self.C > _INT32_SAFE

    def column_kernels(self, wide: bool) -> tuple:
        """The channels-last sampler's kernels for one index width (compiled here)."""
        found = self._column_kernels.get(wide)
        if found is None:
            from . import cuda_fused
            found = self._column_kernels[wide] = cuda_fused.column_kernels(self.dtype, self.geom.ndim, wide,
                                                                           self.column_vectors, self.column_lanes)
        return found

    def _column_launches(self, c, x, offset, mask, cols, xcl, panel: int = 0) -> list:
        """The launches that fill chunk ``c``'s columns ``cols``, as ``(kernel, grid, block,
        args)``: deform_im2col, or the channels-last copy of ``x`` into ``xcl`` then
        fused_columns; with ``panels``, the columns of panel ``panel``'s channels alone (read
        from its first channel on in the copy's rows). The pointers come as the caller launches
        them (arrays or addresses)."""
        q = c.n * c.Q
        if not self.channels_last:
            return [(c.kernels["im2col"], _grid(self.C * q), _BLOCK1,
                     (x, offset, mask, cols, c.struct, c.i_n, self.i_C, self.i_Go, self.i_Gm))]
        wide = self._wide_columns(c)
        index = np.int64 if wide else np.int32
        copy, sample = self.column_kernels(wide)
        from . import cuda_fused   # (it imports this module)
        channels = self.C // self.panels
        first = panel * channels
        if first:   # (an address, or the copy's array)
            xcl = (np.uint64(int(xcl) + first * self.dtype.itemsize) if isinstance(xcl, (int, np.integer))
                   else xcl[first:])
        tiles = -(-q // self.column_positions) * -(-channels // self.column_tile)
        taps = _column_taps(tiles, self.K)
        sample_blocks = tiles * -(-self.K // taps)
        return [(copy, cuda_fused.layout_grid(c.n, self.C, self.S), (cuda_fused._THREADS,),
                 (x, xcl, c.i_n, self.i_C, self.i_C, index(self.S), index(self.C * self.S), None, None, index(0),
                  np.int32(0))),
                (sample, (min(sample_blocks, _MAX_GRID),), (_COLUMN_THREADS,),
                 (xcl, offset, mask, cols, c.struct, c.i_n, np.int32(channels), self.i_C, self.i_Go, self.i_Gm,
                  np.int32(taps)))]

    def kernels(self, index64: bool) -> dict:
        """Every kernel function of this executable for one index width (compiled here)."""
        found = self._kernels.get(index64)
        if found is None:
            kern = _Kernels(self.dtype, self.geom.ndim, index64)
            found = {
                "im2col": kern.get("deform_im2col"),
                "col2im": kern.get("deform_col2im_tiled"),
                "to_batch": kern.get("columns_to_batch", spatial=False),
                "to_columns": kern.get("batch_to_columns", spatial=False),
                "finalize": kern.get("finalize", spatial=False),
            }
            for o, m in _GRAD_VARIANTS:
                found[(o == "true", m == "true")] = kern.get("deform_backward_grouped", extra=f", {o}, {m}")
            self._kernels[index64] = found
        return found

    def _chunks(self, n, rows):
        chunks = []
        if rows is None:
            for start in range(0, self.B, n):
                chunks.append(_Chunk(self, start, min(start + n, self.B)))
        else:
            H = self.geom.output_shape[0]
            for b in range(self.B):
                for lo in range(0, H, rows):
                    chunks.append(_Chunk(self, b, b + 1, lo, min(lo + rows, H)))
        if self.channels_last:   # compiled here, never during a CUDA-graph capture
            for c in chunks:
                self.column_kernels(self._wide_columns(c))
        return chunks

    def _describe(self, name, n, rows):
        index = "64-bit" if any(c.index is np.int64 for c in self.chunks) else "32-bit"
        if rows is None:
            how = f"{len(self.chunks)} chunk(s) of up to {n} sample(s)"
        else:
            how = f"{len(self.chunks)} chunk(s) of up to {rows} output row(s) of one sample"
        return (f"cuda/im2col {name}: {how}, {index} index, workspace {self.workspace_bytes} bytes "
                f"(limit {self.limit})" + (", TF32 GEMMs" if self.spec.allow_tf32 and self.dtype == np.float32 else "")
                + (", columns sampled from a channels-last copy" if self.channels_last else ""))

    def _cublas(self, ws, stream=None):
        """The cuBLAS handle on ``stream`` (default: CuPy's current) with this call's workspace
        (``ws``: the workspace array or its address)."""
        base = ws if isinstance(ws, int) else ws.data.ptr
        return _prepare_cublas(self.device_id, base + self.layout.slots["cublas"][0], self.cublas_bytes, stream)

    @staticmethod
    def _samples(array, start, stop):
        """Samples start:stop, C-contiguous (a chunk-sized copy only for an unusual batch stride)."""
        part = array[start:stop]
        return part if part.flags.c_contiguous else cupy.ascontiguousarray(part)

    def _sample_columns(self, ws, c, x, offset, mask, cols, copy=None, panel: int = 0) -> None:
        """Chunk ``c``'s columns (of panel ``panel``'s channels) into ``cols`` (arrays; the
        channels-last copy in ``ws``, or ``copy``'s: ``_Backward.record``), the copy made by the
        first panel's launches."""
        if copy is not None:
            xcl, made = copy
        else:
            xcl, made = (self.layout.view(ws, "xcl", ((c.n * self.S + 1) * self.C,)) if self.channels_last
                         else None), False
        if c.n * c.Q > 0:
            launches = self._column_launches(c, x, offset, mask, cols, xcl, panel)
            for kernel, grid, block, args in launches[int(made or panel > 0):]:
                kernel(grid, block, args)

    def _launch(self, kernel, total, args):
        if total > 0:
            kernel((min((total + _BLOCK - 1) // _BLOCK, _MAX_GRID),), (_BLOCK,), args)

    def _stage(self, ws, name, array, chunk, channels):
        """A (1, channels, rows, ...) contiguous copy of one sample's rows lo:hi in the workspace."""
        if array is None:
            return None
        shape = (1, channels, chunk.hi - chunk.lo) + tuple(self.geom.output_shape[1:])
        staged = self.layout.view(ws, name, shape)
        staged[...] = array[chunk.start:chunk.stop, :, chunk.lo:chunk.hi]
        return staged


class _Forward(_Executable):
    """``conv_forward``: im2col + one batched GEMM + layout/bias, per chunk."""

    def __init__(self, spec):
        super().__init__(spec)
        it, acc = self.dtype.itemsize, self.acc.itemsize
        off_ch = self.geom.offset_groups * self.K * self.geom.ndim
        m_ch = self.geom.mask_groups * self.K
        per_position = self.C * self.K * it + self.Co * acc
        # rows: staging of offsets, mask and the output rows
        n, rows = self._chunking(per_position, self.cublas_bytes, 0, (off_ch + m_ch + self.Co) * it, "forward")
        self.rows = rows
        self.pointer_path = rows is None   # run_pointers serves every call (no staging)
        nq = n * self.Q if rows is None else rows * self.inner
        layout = self.layout = _Layout()
        layout.add("cublas", self.cublas_bytes, np.uint8)
        layout.add("cols", self.C * self.K * nq, self.dtype)
        layout.add("gemm", self.Co * nq, self.acc)
        self._column_layout(n)
        if rows is not None:
            layout.add("offset", off_ch * nq, self.dtype)
            layout.add("mask", m_ch * nq, self.dtype)
            layout.add("y", self.Co * nq, self.dtype)
        self.workspace_bytes = layout.size
        with cupy.cuda.Device(self.device_id):
            self.chunks = self._chunks(n, rows)
        self.gemms = {}
        for c in self.chunks:
            if c.Q * c.n not in self.gemms:
                self.gemms[c.Q * c.n] = _Gemm(self.G, self.Cog, c.n * c.Q, self.Cg * self.K, self.dtype, self.acc,
                                              allow_tf32=spec.allow_tf32)
        self.description = self._describe("forward", n, rows)

    def run(self, args, out, ws):
        x, w, offset, mask, bias = args["input"], args["weight"], args["offset"], args["mask"], args["bias"]
        if REPLAY and self.rows is None and _plain_batch(x, offset, mask):
            self.run_pointers((x.data.ptr, w.data.ptr, _ptr(offset), _ptr(mask), _ptr(bias)), out.data.ptr,
                              ws.data.ptr, cupy.cuda.get_current_stream().ptr)
        else:
            self._direct(x, w, offset, mask, bias, out, ws, self._cublas(ws))

    def run_pointers(self, inputs, out, ws, stream) -> None:
        """``run`` on raw device addresses (inputs: x, w, offset, mask, bias; 0 for an absent
        one) of C-contiguous batched arrays, on ``stream``: the recorded launches of these
        addresses, replayed (recorded on first use)."""
        key = inputs + (out, ws)
        ops = self._recordings.get(key)
        if ops is None:
            ops = self._recordings.put(key, self._record(*key))
        _replay(ops, self._cublas(ws, stream), stream)

    def _record(self, x, w, offset, mask, bias, out, ws):
        """The launches of a call on these pointers (contiguous batch, no staging)."""
        ops, it = [], self.dtype.itemsize
        C, Co, Q, S, K = self.C, self.Co, self.Q, self.S, self.K
        off_ch, m_ch = self.geom.offset_groups * K * self.geom.ndim, self.geom.mask_groups * K
        cols, gout = self.layout.ptr(ws, "cols"), self.layout.ptr(ws, "gemm")
        xcl = self.layout.ptr(ws, "xcl") if self.channels_last else 0
        for c in self.chunks:
            q, k = c.n * c.Q, c.kernels
            for kernel, grid, block, args in self._column_launches(
                    c, _u64(x + c.start * C * S * it), _at(offset, c.start * off_ch * Q * it),
                    _at(mask, c.start * m_ch * Q * it), _u64(cols), _u64(xcl)):
                ops.append(_kernel_op(kernel, grid, block, args, 0))
            ops.append((1, self.gemms[q], w, cols, gout))
            ops.append(_kernel_op(k["to_batch"], _grid(Co * q), _BLOCK1, (
                _u64(gout), _at(bias, 0), _u64(out + c.start * Co * Q * it), c.i_n, self.i_Co, c.i_q), 0))
        return ops

    def _direct(self, x, w, offset, mask, bias, out, ws, handle):
        layout, G, K = self.layout, self.G, self.K
        w_ptr = w.data.ptr
        for c in self.chunks:
            q = c.n * c.Q
            cols = layout.view(ws, "cols", (G, self.Cg * K, q))
            gout = layout.view(ws, "gemm", (G, self.Cog, q))
            if c.rows:
                off = self._stage(ws, "offset", offset, c, self.geom.offset_groups * K * self.geom.ndim)
                msk = self._stage(ws, "mask", mask, c, self.geom.mask_groups * K)
                target = layout.view(ws, "y", (1, self.Co, q))
            else:
                off = None if offset is None else self._samples(offset, c.start, c.stop)
                msk = None if mask is None else self._samples(mask, c.start, c.stop)
                target = out[c.start:c.stop]
            k = c.kernels
            self._sample_columns(ws, c, self._samples(x, c.start, c.stop), off, msk, cols)
            self.gemms[q](handle, w_ptr, cols.data.ptr, gout.data.ptr)
            self._launch(k["to_batch"], self.Co * q, (gout, bias, target, c.i_n, self.i_Co, c.i_q))
            if c.rows:
                out[c.start:c.stop, :, c.lo:c.hi] = target.reshape((1, self.Co, c.hi - c.lo)
                                                                   + tuple(self.geom.output_shape[1:]))


class _Backward(_Executable):
    """``conv_backward``: every requested gradient in one pass over the chunks."""

    needs_scatter = True

    def __init__(self, spec, shared_copy: bool = False, weight_only: bool = False, column_bytes=None):
        """``shared_copy``: the caller (the fused backward, for its weight gradient) gives the
        input's channels-last copy, the zero row included, in its own part of the workspace
        (``copy`` of ``run``, ``run_pointers`` and ``record``), where this executable's columns
        come from the channels-last sampler in one chunk (``copy_given``); else it makes its own.
        ``weight_only``: it computes the weight gradient alone (the fused backward's, beside its
        own data gradients), with no column grads or input-gradient accumulator in its workspace.
        ``column_bytes`` (weight-only): the columns in panels of input channels
        (``column_panels``), sampled and multiplied in turn, so that the whole batch's columns of
        one panel take at most that many bytes."""
        super().__init__(spec)
        it, acc = self.dtype.itemsize, self.acc.itemsize
        geom = self.geom
        self.off_ch = geom.offset_groups * self.K * geom.ndim
        self.m_ch = geom.mask_groups * self.K
        half = self.acc != self.dtype
        self.weight_only = bool(weight_only)
        data = not self.weight_only      # whether it computes the input, offset and mask gradients
        try:
            sms = int(cupy.cuda.Device(self.device_id).attributes["MultiProcessorCount"])
        except Exception:   # no usable device: no split
            sms = 0
        strict = self.dtype == np.float32 and not spec.allow_tf32
        if self.weight_only and column_bytes is not None:
            self.panels = column_panels(self, column_bytes, sms, strict)
        fixed = self.cublas_bytes + (self.G * self.Cog * self.Cg * self.K * acc if half else 0)
        per_sample = self.C * self.S * acc if half and data else 0     # grad_x accumulated in float32
        # rows: staging of offsets and mask, and of their gradients (data): name -> channels
        staged = {"offset": self.off_ch, "mask": self.m_ch}
        if data:
            staged.update(grad_offset=self.off_ch, grad_mask=self.m_ch)
        while True:
            # gy columns + columns (weight; a panel's) + column grads (data); grad_w in float32 for
            # the half types
            per_position = self.Co * it + self.C // self.panels * self.K * it + (self.C * self.K * acc if data else 0)
            n, rows = self._chunking(per_position, fixed, per_sample, sum(staged.values()) * it, "backward")
            if rows is None or self.panels == 1:
                break
            self.panels = 1   # rows of one sample: deform_im2col's columns, of every channel
        self.rows = rows
        self.pointer_path = rows is None   # run_pointers serves every call (no staging)
        self.copy_given = bool(shared_copy) and self.channels_last and rows is None and n >= self.B
        nq = n * self.Q if rows is None else rows * self.inner
        layout = self.layout = _Layout()
        layout.add("cublas", self.cublas_bytes, np.uint8)
        layout.add("gy", self.Co * nq, self.dtype)
        layout.add("cols", self.C // self.panels * self.K * nq, self.dtype)
        if data:
            layout.add("cgrad", self.C * self.K * nq, self.acc)
        # the weight gradient's GEMM split along the positions (gemm_splits): its partial sums
        # (never with panels: column_panels)
        self.gemm_splits = gemm_splits(self.G, self.Cog, self.Cg // self.panels * self.K, nq, sms, strict=strict)
        assert self.panels == 1 or self.gemm_splits == 1
        # the weight gradient written by its one GEMM (WEIGHT_IN_ONE_GEMM: one chunk of a
        # non-empty batch, not split), else accumulated (in float32 for the half types)
        self.weight_in_one_gemm = (bool(WEIGHT_IN_ONE_GEMM) and rows is None and 0 < self.B <= n and self.Q > 0
                                   and self.gemm_splits == 1)
        self.weight_dtype = self.dtype if self.weight_in_one_gemm else self.acc
        if half:
            if not self.weight_in_one_gemm:
                layout.add("grad_w", self.G * self.Cog * self.Cg * self.K, self.acc)
            if data:
                layout.add("grad_x", n * self.C * self.S, self.acc)
        if self.gemm_splits > 1:
            layout.add("w_split", self.gemm_splits * self.Cog * self.Cg * self.K, self.acc)
        self._column_layout(n)
        if rows is not None:
            for name, channels in staged.items():
                layout.add(name, channels * nq, self.dtype)
        self.workspace_bytes = layout.size
        final = _index64(self.B * self.C * self.S, self.G * self.Cog * self.Cg * self.K)
        with cupy.cuda.Device(self.device_id):
            self.chunks = self._chunks(n, rows)
            self.final = self.kernels(final)["finalize"]
        self.final_index = np.int64 if final else np.int32
        self.gemms, self.split_gemms = {}, {}
        for c in self.chunks:
            q = c.n * c.Q
            if q not in self.gemms:
                # (with panels, a panel's columns of grad_w, its rows Cg*K long)
                panel = {} if self.panels == 1 else {"ldc": self.Cg * self.K}
                self.gemms[q] = (
                    _Gemm(self.G, self.Cog, self.Cg // self.panels * self.K, q, self.dtype, self.weight_dtype,
                          trans_b=True, beta=0.0 if self.weight_in_one_gemm else 1.0, allow_tf32=spec.allow_tf32,
                          **panel),                                                       # grad_w (+)= gy @ cols^T
                    _Gemm(self.G, self.Cg * self.K, q, self.Cog, self.dtype, self.acc, trans_a=True,
                          allow_tf32=spec.allow_tf32) if data else None,                  # cgrad = W^T @ gy
                )
                self.split_gemms[q] = self._split_gemms(q, spec.allow_tf32)
        if self.gemm_splits > 1:   # the row of ones the partial sums' GEMM adds them with
            with cupy.cuda.Device(self.device_id):
                self._ones = cupy.ones(self.gemm_splits, dtype=self.acc)
        self.description = self._describe("backward", n, rows)
        if self.weight_only:
            self.description += ", the weight gradient alone"
        if self.panels > 1:
            self.description += f", its columns in {self.panels} panels of {self.C // self.panels} channels"
        if self.gemm_splits > 1:
            self.description += f", weight GEMM split {self.gemm_splits} ways along the positions"

    def _split_gemms(self, q: int, allow_tf32: bool):
        """The weight gradient's GEMMs over ``q`` positions split ``gemm_splits`` ways: (the
        splits' products into the partial sums, their sum into the gradient, the positions past the
        whole splits or None, the positions the splits take), or None where it is not split (one
        GEMM, ``gemms[q][0]``)."""
        splits = self.gemm_splits
        if splits < 2 or q < 8 * splits:
            return None
        # (each split a multiple of 8 positions deep: its operands' slices 16-byte aligned)
        m, n, depth = self.Cog, self.Cg * self.K, q // splits // 8 * 8
        rest = q - splits * depth
        return (_Gemm(splits, m, n, depth, self.dtype, self.acc, trans_b=True, allow_tf32=allow_tf32, depth=q),
                _Gemm(1, 1, m * n, splits, self.acc, self.acc, beta=1.0),          # strict: partial sums as they are
                _Gemm(1, m, n, rest, self.dtype, self.acc, trans_b=True, beta=1.0, allow_tf32=allow_tf32, depth=q)
                if rest else None, splits * depth)

    def _weight_gemm_ops(self, q: int, gy_cols: int, cols: int, w_acc: int, ws: int) -> list:
        """The GEMM ops (``_replay``'s kind 1) adding the weight gradient of ``q`` positions into
        ``w_acc``: one GEMM, or the split ones (``_split_gemms``) through the workspace's
        partial sums."""
        split = self.split_gemms[q]
        if split is None:
            return [(1, self.gemms[q][0], gy_cols, cols, w_acc)]
        products, total, rest, done = split
        partial = self.layout.ptr(ws, "w_split")
        ops = [(1, products, gy_cols, cols, partial), (1, total, self._ones.data.ptr, partial, w_acc)]
        if rest is not None:
            done *= self.dtype.itemsize
            ops.append((1, rest, gy_cols + done, cols + done, w_acc))
        return ops

    @property
    def _panel_bytes(self) -> int:
        """How far apart, in bytes, the panels' columns of the weight gradient's accumulator start."""
        return self.C // self.panels * self.K * self.weight_dtype.itemsize

    def _check_weight_only(self, data_gradients: bool) -> None:
        if data_gradients and self.weight_only:
            raise ValueError("this cuda/im2col backward computes the weight gradient alone (weight_only=True; its "
                             "workspace has no column grads), got a request for the input, offset or mask gradient")

    def _given(self, copy):
        if self.copy_given and copy is None:
            raise ValueError("this cuda/im2col backward samples its columns from a channels-last copy its caller "
                             "gives (copy=(its address or array, whether it is made)), got none")
        return copy if self.copy_given else None

    def run(self, args, out, ws, copy=None):
        """``copy``: ``(array, made)``, the channels-last copy of the input where ``copy_given``
        (``made``: it holds the input already; else the copy is written there)."""
        gy, x, w = args["grad_output"], args["input"], args["weight"]
        offset, mask, bias, wanted = args["offset"], args["mask"], args.get("bias"), args["wanted"]
        copy = self._given(copy)
        if REPLAY and self.rows is None and _plain_batch(gy, x, offset, mask):
            self.run_pointers((gy.data.ptr, _ptr(x), w.data.ptr, _ptr(offset), _ptr(mask), _ptr(bias)), wanted,
                              (_ptr(out.get("input")), _ptr(out.get("weight")), _ptr(out.get("offset")),
                               _ptr(out.get("mask"))), ws.data.ptr, cupy.cuda.get_current_stream().ptr,
                              None if copy is None else (copy[0].data.ptr, copy[1]))
        else:
            self._direct(args, out, ws, self._cublas(ws), copy)

    def run_pointers(self, inputs, wanted, outs, ws, stream, copy=None) -> None:
        """``run`` on raw device addresses: inputs (grad_output, x, w, offset, mask, bias), the
        gradients' outputs (input, weight, offset, mask; 0 where not wanted), of C-contiguous
        batched arrays, on ``stream`` (recorded launches, replayed); ``copy`` as ``run``'s, with
        an address."""
        copy = self._given(copy)
        key = inputs + (ws, wanted) + outs + (copy,)
        ops = self._recordings.get(key)
        if ops is None:
            ops = self._recordings.put(key, self._record(*inputs, ws, wanted, *outs, copy=copy))
        _replay(ops, self._cublas(ws, stream), stream)

    def record_led_by_handle(self, inputs, wanted, outs, ws, copy=None) -> list:
        """``run_pointers``' launches, recorded and not run, for a caller that replays them in a
        list of its own: led by the handle op (``handle_op``) its GEMMs run on. (Not ``record``:
        a plan's transposed chain takes the executables that have one, with its keywords, and
        this backward, whole, runs as its own list there.)"""
        return [handle_op(self.device_id, self.layout.ptr(ws, "cublas"), self.cublas_bytes)] + self._record(
            *inputs, ws, wanted, *outs, copy=self._given(copy))

    def _record(self, gy, x, w, offset, mask, bias, ws, wanted, grad_x, grad_w, grad_off, grad_m, copy=None):
        """The launches of a call on these pointers (contiguous batch, no staging)."""
        need_input, need_weight = bool(grad_x), bool(grad_w)
        need_offset, need_mask = bool(grad_off) and bool(offset), bool(grad_m) and bool(mask)
        need_cgrad = need_input or need_offset or need_mask
        self._check_weight_only(need_cgrad)
        ops, it, acc = [], self.dtype.itemsize, self.acc.itemsize
        half = self.acc != self.dtype
        B, C, Co, Q, S, K, G = self.B, self.C, self.Co, self.Q, self.S, self.K, self.G
        layout = self.layout
        gy_cols, cols = layout.ptr(ws, "gy"), layout.ptr(ws, "cols")
        cgrad = layout.ptr(ws, "cgrad") if need_cgrad else 0   # (none in a weight-only workspace)
        w_size = G * self.Cog * self.Cg * K
        if need_weight:
            w_acc = grad_w if self.weight_in_one_gemm or not half else layout.ptr(ws, "grad_w")
            if not self.weight_in_one_gemm:
                ops.append((2, w_acc, w_size * acc))
        if need_input and not half:
            ops.append((2, grad_x, B * C * S * it))
        for c in self.chunks:
            q, k = c.n * c.Q, c.kernels
            gemm_cgrad = self.gemms[q][1]
            ops.append(_kernel_op(k["to_columns"], _grid(Co * q), _BLOCK1, (
                _u64(gy + c.start * Co * Q * it), _u64(gy_cols), c.i_n, self.i_Co, c.i_q), 0))
            x_part = _at(x, c.start * C * S * it)
            off = _at(offset, c.start * self.off_ch * Q * it)
            msk = _at(mask, c.start * self.m_ch * Q * it)
            if need_weight:
                xcl, made = copy if copy is not None else (layout.ptr(ws, "xcl") if self.channels_last else 0, False)
                for panel in range(self.panels):   # (the copy made by the first panel's launches)
                    launches = self._column_launches(c, x_part, off, msk, _u64(cols), _u64(xcl), panel)
                    for kernel, grid, block, args in launches[int(made or panel > 0):]:
                        ops.append(_kernel_op(kernel, grid, block, args, 0))
                    ops += self._weight_gemm_ops(q, gy_cols, cols, w_acc + panel * self._panel_bytes, ws)
            if not need_cgrad:
                continue
            ops.append((1, gemm_cgrad, w, gy_cols, cgrad))
            if need_input:
                if half:
                    gx = layout.ptr(ws, "grad_x")
                    ops.append((2, gx, c.n * C * S * acc))
                else:
                    gx = grad_x + c.start * C * S * it
                blocks = -(-c.Q // _TILE) * C * c.n
                ops.append(_kernel_op(k["col2im"], (min(blocks, _MAX_GRID),), (_TILE,), (
                    _u64(cgrad), off, msk, _u64(gx), c.struct, c.i_n, self.i_C, self.i_Go, self.i_Gm,
                    np.int32(self.halo), np.int32(c.cap)), c.cap * self.acc.itemsize))
                if half:
                    total = c.n * C * S
                    ops.append(_kernel_op(self.final, _grid(total), _BLOCK1, (
                        _u64(gx), _at(bias, 0), _u64(grad_x + c.start * C * S * it), self.final_index(total),
                        self.i_C, self.final_index(S)), 0))
            if need_offset or need_mask:
                g_off = _at(grad_off if need_offset else None, c.start * self.off_ch * Q * it)
                g_m = _at(grad_m if need_mask else None, c.start * self.m_ch * Q * it)

                def grouped(want, groups, go, gm):
                    ops.append(_kernel_op(k[want], _grid(c.n * groups * K * c.Q), _BLOCK1, (
                        _u64(cgrad), x_part, off, msk, go, gm, c.struct, c.i_n, self.i_C, self.i_Go, self.i_Gm,
                        np.int32(groups)), 0))

                if need_offset:
                    with_mask = need_mask and self.Go == self.Gm
                    grouped((True, with_mask), self.Go, g_off, g_m if with_mask else None)
                    if need_mask and not with_mask:
                        grouped((False, True), self.Gm, None, g_m)
                else:
                    grouped((False, True), self.Gm, None, g_m)
        if need_input and not half and bias is not None:
            total = B * C * S
            ops.append(_kernel_op(self.final, _grid(total), _BLOCK1, (
                _u64(grad_x), _u64(bias), _u64(grad_x), self.final_index(total), self.i_C, self.final_index(S)), 0))
        if need_weight and half and not self.weight_in_one_gemm:
            ops.append(_kernel_op(self.final, _grid(w_size), _BLOCK1, (
                _u64(w_acc), None, _u64(grad_w), self.final_index(w_size), np.int32(1), self.final_index(1)), 0))
        return ops

    def _direct(self, args, out, ws, handle, copy=None):
        gy_all, x, w = args["grad_output"], args["input"], args["weight"]
        offset, mask, bias, wanted = args["offset"], args["mask"], args.get("bias"), args["wanted"]
        need_input = "input" in wanted
        need_weight = "weight" in wanted
        need_offset = "offset" in wanted and offset is not None
        need_mask = "mask" in wanted and mask is not None
        need_cgrad = need_input or need_offset or need_mask
        self._check_weight_only(need_cgrad)
        layout, geom, C, G, K = self.layout, self.geom, self.C, self.G, self.K
        half = self.acc != self.dtype
        grad_x = out.get("input") if need_input else None
        grad_w = out.get("weight") if need_weight else None
        grad_off = out.get("offset") if need_offset else None
        grad_m = out.get("mask") if need_mask else None
        if grad_w is not None:
            w_acc = (grad_w.reshape(G, self.Cog, self.Cg * K) if self.weight_in_one_gemm or not half
                     else layout.view(ws, "grad_w", (G, self.Cog, self.Cg * K)))
            if not self.weight_in_one_gemm:
                w_acc.fill(0)
        if grad_x is not None and not half:
            grad_x.fill(0)
        w_ptr = w.data.ptr
        spatial = tuple(geom.output_shape[1:])
        for c in self.chunks:
            q = c.n * c.Q
            k = c.kernels
            gemm_cgrad = self.gemms[q][1]
            gy = layout.view(ws, "gy", (G, self.Cog, q))
            if c.rows:
                # one sample: (1, Co, rows, ...) is already the (Co, q) column layout
                gy.reshape((1, self.Co, c.hi - c.lo) + spatial)[...] = gy_all[c.start:c.stop, :, c.lo:c.hi]
                off = self._stage(ws, "offset", offset, c, self.off_ch)
                msk = self._stage(ws, "mask", mask, c, self.m_ch)
            else:
                self._launch(k["to_columns"], self.Co * q, (self._samples(gy_all, c.start, c.stop), gy, c.i_n,
                                                            self.i_Co, c.i_q))
                off = None if offset is None else self._samples(offset, c.start, c.stop)
                msk = None if mask is None else self._samples(mask, c.start, c.stop)
            x_part = None if x is None else self._samples(x, c.start, c.stop)
            if need_weight:
                cols = layout.view(ws, "cols", (G, self.Cg // self.panels * K, q))
                for panel in range(self.panels):
                    self._sample_columns(ws, c, x_part, off, msk, cols, copy, panel)
                    for _, gemm, a, b, out_ptr in self._weight_gemm_ops(
                            q, gy.data.ptr, cols.data.ptr, w_acc.data.ptr + panel * self._panel_bytes, ws.data.ptr):
                        gemm(handle, a, b, out_ptr)
            if not need_cgrad:
                continue
            cgrad = layout.view(ws, "cgrad", (G, self.Cg * K, q))
            gemm_cgrad(handle, w_ptr, gy.data.ptr, cgrad.data.ptr)
            if need_input:
                if half:
                    gx = layout.view(ws, "grad_x", (c.n, C, self.S))
                    if c.first:
                        gx.fill(0)
                else:
                    gx = grad_x[c.start:c.stop]
                blocks = -(-c.Q // _TILE) * C * c.n
                k["col2im"]((min(blocks, _MAX_GRID),), (_TILE,), (
                    cgrad, off, msk, gx, c.struct, c.i_n, self.i_C, self.i_Go, self.i_Gm, np.int32(self.halo),
                    np.int32(c.cap)), shared_mem=c.cap * self.acc.itemsize)
                if half and c.last:
                    total = c.n * C * self.S
                    target = grad_x[c.start:c.stop]
                    self._launch(self.final, total, (gx, bias, target, self.final_index(total), self.i_C,
                                                     self.final_index(self.S)))
            if need_offset or need_mask:
                if c.rows:
                    g_off = layout.view(ws, "grad_offset", (1, self.off_ch, q)) if need_offset else None
                    g_m = layout.view(ws, "grad_mask", (1, self.m_ch, q)) if need_mask else None
                else:
                    g_off = None if grad_off is None else grad_off[c.start:c.stop]
                    g_m = None if grad_m is None else grad_m[c.start:c.stop]
                self._offset_mask(k, c, need_offset, need_mask, cgrad, x_part, off, msk, g_off, g_m)
                if c.rows:
                    rows = (1, None, c.hi - c.lo) + spatial
                    if need_offset:
                        grad_off[c.start:c.stop, :, c.lo:c.hi] = g_off.reshape(rows[:1] + (self.off_ch,) + rows[2:])
                    if need_mask:
                        grad_m[c.start:c.stop, :, c.lo:c.hi] = g_m.reshape(rows[:1] + (self.m_ch,) + rows[2:])
        if grad_x is not None and not half and bias is not None:
            total = self.B * C * self.S
            self._launch(self.final, total, (grad_x, bias, grad_x, self.final_index(total), self.i_C,
                                             self.final_index(self.S)))
        if grad_w is not None and half and not self.weight_in_one_gemm:
            total = grad_w.size
            self._launch(self.final, total, (w_acc, None, grad_w, self.final_index(total), np.int32(1),
                                             self.final_index(1)))

    def _offset_mask(self, k, c, need_offset, need_mask, cgrad, x, off, msk, g_off, g_m):
        """The grouped kernel over offset groups (with the mask when G_o == G_m), else mask groups."""
        def launch(want, groups, go, gm):
            self._launch(k[want], c.n * groups * self.K * c.Q, (
                cgrad, x, off, msk, go, gm, c.struct, c.i_n, self.i_C, self.i_Go, self.i_Gm, np.int32(groups)))

        if need_offset:
            with_mask = need_mask and self.Go == self.Gm
            launch((True, with_mask), self.Go, g_off, g_m if with_mask else None)
            if need_mask and not with_mask:
                launch((False, True), self.Gm, None, g_m)
        elif need_mask:
            launch((False, True), self.Gm, None, g_m)


# ---------------------------------------------------------------------------------------------
# the registered backend and module-level entry points


class _Im2colBackend:
    """``cuda/im2col``: deformable im2col/col2im kernels around cuBLAS GEMMs."""

    device = "cuda"
    algorithm = "im2col"
    priority = 0
    primitives = PRIMITIVES

    def serves(self, spec, primitive):
        if spec.dtype not in _CTYPES:
            return f"dtype {spec.dtype} is not supported"
        if primitive == "conv_backward" and spec.deterministic:
            return ("its input gradient is scattered with floating-point atomics, whose order (and so "
                    "rounding) varies from run to run")
        return None

    def build(self, spec, primitive):
        return _Forward(spec) if primitive == "conv_forward" else _Backward(spec)

    @staticmethod
    def settings():
        return settings()


BACKEND = _Im2colBackend()


def _spec(geom, dtype, allow_tf32=None):
    from . import PlanSpec
    tf32 = cupy_allows_tf32() if allow_tf32 is None else allow_tf32
    return PlanSpec(geom, np.dtype(dtype), "cuda", cupy.cuda.runtime.getDevice(), False, bool(tf32))


def conv_forward(x, weight, offset, mask, bias, geom):
    """``y = deform_conv(x) (+ bias)`` for batched C-contiguous CuPy arrays (builds an executable
    per call: tests and benchmarks; the library goes through plans)."""
    exe = _Forward(_spec(geom, x.dtype))
    y = cupy.empty(geom.y_shape, dtype=x.dtype)
    ws = cupy.empty(exe.workspace_bytes, dtype=np.uint8)
    exe.run({"input": x, "weight": weight, "offset": offset, "mask": mask, "bias": bias}, y, ws)
    return y


def conv_backward(grad_output, x, weight, offset, mask, geom, wanted, bias=None):
    """``(grad_x, grad_weight, grad_offset, grad_mask)`` for the names in ``wanted`` (None for
    the others, and for offset/mask when that argument is None)."""
    dtype = grad_output.dtype
    exe = _Backward(_spec(geom, dtype))
    shapes = {"input": geom.x_shape, "weight": geom.weight_shape, "offset": geom.offset_shape,
              "mask": geom.mask_shape}
    wanted = frozenset(n for n in wanted if not (n == "offset" and offset is None) and not (n == "mask" and mask is None))
    out = {name: cupy.empty(shapes[name], dtype=dtype) for name in wanted}
    ws = cupy.empty(exe.workspace_bytes, dtype=np.uint8)
    exe.run({"grad_output": grad_output, "input": x, "weight": weight, "offset": offset, "mask": mask,
             "bias": bias, "wanted": wanted}, out, ws)
    return tuple(out.get(name) for name in ("input", "weight", "offset", "mask"))
