"""CUDA backend: hand-written kernels (``cuda/*.cu``, CuPy ``RawModule``) and cuBLAS GEMMs.

Per batch chunk of ``Bc`` samples (chunks bound the workspace by ``WORKSPACE_LIMIT_BYTES``):

* forward:   columns ``(G, C_in/G*K, Bc*Q)`` = deformable im2col (N-linear sample * mask);
             ``y_g = W_g @ columns_g`` for all groups in ONE strided-batched GEMM (batch = G);
             then ``(C_out, Bc*Q) -> (Bc, C_out, *Q)`` with the bias added.
* to input:  column grads ``= W_g^T @ grad_y_g`` (one batched GEMM), then col2im scatters them
             with atomics into a float32 (float64 for float64) buffer (through a shared-memory
             box per tile of output positions); this is also the transposed convolution's
             forward.
* weight:    ``grad_W_g += grad_y_g @ columns_g^T`` (GEMM accumulating in float32/float64
             across chunks, beta = 1).
* offset, mask: one thread per (sample, group, tap, position) sums over the group's channels
             of column grads times the sample's derivative (offset) or the sample (mask): no
             atomics. Offset groups and mask groups are independent.
* ``conv_backward`` does all of it in one pass over the batch, sharing the grad_output layout
  change and the column-grad GEMM between the gradients that are asked for.

Half types (float16, bfloat16) are stored as such in the columns and GEMM operands; the
GEMMs compute and write float32 (cuBLAS compute type 32F), every kernel computes in float32
and the gradient buffers that take atomics are float32, cast back once at the end.
float32 GEMMs use TF32 only where CuPy's compute type for float32 is TF32 (``CUPY_TF32=1`` or
``cupy._core._routines_linalg.set_compute_type``), or where ``ALLOW_TF32`` is set to True.

Kernels run on CuPy's current stream, on the current device (``_api`` makes the arrays'
device current through ``device_context``). Modules are compiled by NVRTC on first use, one
per (device, dtype, N, index width), and cached in memory here and on disk by CuPy.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np

import cupy

from .._interop import BFLOAT16, compute_dtype
from . import cuda_source_dir

xp = cupy

#: Upper bound, in bytes, of the per-chunk workspace (columns, column grads, GEMM outputs).
#: The batch is split into chunks that fit; a single sample is never split.
WORKSPACE_LIMIT_BYTES = int(os.environ.get("DCN_CUPY_CUDA_WORKSPACE_BYTES", 256 * 2**20))

#: None: float32 GEMMs follow CuPy's compute type for float32 (TF32 when CUPY_TF32=1);
#: True / False: force TF32 on / off.
ALLOW_TF32 = None

_BLOCK = 256
_MAX_GRID = 1 << 20          # grid-stride loops cover the rest
#: Kernels use 32-bit indices while every element count is at most this (else 64-bit): an
#: index plus the grid stride (at most _MAX_GRID * _BLOCK = 2^28) then stays below 2^31.
_INT32_SAFE = 2**30 - _BLOCK
#: cuBLAS takes 32-bit sizes: the bound of every GEMM dimension (and so of a chunk's Bc*Q).
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


def module_source() -> str:
    """The full module text: ``deform_conv.cu`` with its local headers inlined."""
    global _source_text
    if _source_text is None:
        _source_text = "\n".join(_inline(cuda_source_dir(), _MAIN_SOURCE, set())) + "\n"
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


def _function(name: str, dtype, ndim: int, index64: bool):
    device = cupy.cuda.runtime.getDevice()
    key = (device, name)
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
# GEMM: strided-batched over groups through cuBLAS


def _cublas_module():
    # Imported on first use: loading cuBLAS needs its library, which compiling does not.
    from cupy_backends.cuda.libs import cublas
    return cublas


def _compute_type(a_dtype) -> int:
    _cublas = _cublas_module()
    if a_dtype == np.float64:
        return _cublas.CUBLAS_COMPUTE_64F
    if a_dtype == np.float32:
        tf32 = ALLOW_TF32
        if tf32 is None:
            try:
                from cupy._core import _routines_linalg as linalg
                tf32 = linalg.get_compute_type(np.float32) == getattr(linalg, "COMPUTE_TYPE_TF32", 7)
            except Exception:
                tf32 = False
        if tf32:
            return _cublas.CUBLAS_COMPUTE_32F_FAST_TF32
    return _cublas.CUBLAS_COMPUTE_32F


def _gemm(a, b, c, trans_a: bool = False, trans_b: bool = False, beta: float = 0.0) -> None:
    """``c[g] = op(a[g]) @ op(b[g]) + beta * c[g]`` for C-contiguous 3-D arrays (batch = g).

    ``a``/``b`` share a dtype; ``c`` is that dtype or float32 (half operands accumulate and
    are written in float32).
    """
    batch, m, n = c.shape
    k = a.shape[1] if trans_a else a.shape[2]
    assert a.shape[0] == b.shape[0] == batch and a.dtype == b.dtype
    assert a.flags.c_contiguous and b.flags.c_contiguous and c.flags.c_contiguous
    if max(m, n, k) > _INT32_MAX:
        raise ValueError(
            f"a GEMM of size {m}x{n}x{k} exceeds cuBLAS's 32-bit sizes: one sample's output grid "
            f"(C_out/groups x prod(Q)) or columns (C_in/groups*K x prod(Q)) are too large"
        )
    _cublas = _cublas_module()
    compute = _compute_type(a.dtype)
    scalar = np.float64 if compute == _cublas.CUBLAS_COMPUTE_64F else np.float32
    alpha = np.array(1.0, dtype=scalar)
    beta_ = np.array(beta, dtype=scalar)
    handle = cupy.cuda.device.get_cublas_handle()
    # Row-major C (m x n) is column-major C^T (n x m) = op(B)^T op(A)^T.
    _cublas.gemmStridedBatchedEx(
        handle,
        _cublas.CUBLAS_OP_T if trans_b else _cublas.CUBLAS_OP_N,
        _cublas.CUBLAS_OP_T if trans_a else _cublas.CUBLAS_OP_N,
        n, m, k,
        alpha.ctypes.data,
        b.data.ptr, _CUDA_DTYPES[np.dtype(b.dtype)], b.shape[2], b.shape[1] * b.shape[2],
        a.data.ptr, _CUDA_DTYPES[np.dtype(a.dtype)], a.shape[2], a.shape[1] * a.shape[2],
        beta_.ctypes.data,
        c.data.ptr, _CUDA_DTYPES[np.dtype(c.dtype)], n, m * n,
        batch, compute, _cublas.CUBLAS_GEMM_DEFAULT,
    )


# ---------------------------------------------------------------------------------------------
# Building blocks over one batch chunk


class _Shape:
    """Sizes of a geometry, used by every operation."""

    def __init__(self, geom, dtype):
        self.geom = geom
        self.dtype = np.dtype(dtype)
        self.acc = compute_dtype(self.dtype)
        self.B, self.C, self.Co, self.G = geom.batch, geom.in_channels, geom.out_channels, geom.groups
        self.K, self.Q, self.S = geom.kernel_volume, geom.output_size, geom.input_size
        self.Cg, self.Cog = geom.in_channels_per_group, geom.out_channels_per_group
        self.Go, self.Gm = geom.offset_groups, geom.mask_groups
        self.struct = _geom_struct(geom)
        self._cap = None

    def chunk(self, per_sample_bytes: int) -> int:
        """Samples per chunk: the workspace limit, and Bc*Q within cuBLAS's 32-bit sizes."""
        limit = int(WORKSPACE_LIMIT_BYTES)
        size = min(self.B, limit // max(int(per_sample_bytes), 1), _INT32_MAX // self.Q)
        return max(1, size)

    def index64(self, n: int) -> bool:
        """Whether a chunk of n samples needs 64-bit indices in the kernels."""
        return _index64(
            n * self.C * self.S, self.C * self.K * n * self.Q, n * self.Co * self.Q,
            n * max(self.Go, 1) * self.K * self.geom.ndim * self.Q, n * max(self.Gm, 1) * self.K * self.Q,
        )

    def kernels(self, n: int) -> _Kernels:
        return _Kernels(self.dtype, self.geom.ndim, self.index64(n))

    def im2col(self, kern, x, offset, mask, columns, n: int) -> None:
        _launch(kern.get("deform_im2col"), self.C * n * self.Q, (
            x, offset, mask, columns, self.struct, np.int32(n), np.int32(self.C),
            np.int32(max(self.Go, 1)), np.int32(max(self.Gm, 1)),
        ))

    def col2im(self, kern, column_grads, offset, mask, grad_x, n: int) -> None:
        """The tiled scatter: a block per (b, c, tile), the box in dynamic shared memory."""
        if self._cap is None:
            cap = min(_max_box_volume(self.geom, _TILE, int(TILE_HALO)), int(TILE_SMEM_BYTES) // self.acc.itemsize)
            self._cap = max(int(cap), 0)
        blocks = -(-self.Q // _TILE) * self.C * n
        kern.get("deform_col2im_tiled")((min(blocks, _MAX_GRID),), (_TILE,), (
            column_grads, offset, mask, grad_x, self.struct, np.int32(n), np.int32(self.C),
            np.int32(max(self.Go, 1)), np.int32(max(self.Gm, 1)), np.int32(TILE_HALO), np.int32(self._cap),
        ), shared_mem=self._cap * self.acc.itemsize)

    def grouped(self, kern, want, groups, column_grads, x, offset, mask, grad_offset, grad_mask, n: int) -> None:
        """The offset and/or mask gradients (``want`` = (offset, mask)) over ``groups`` groups."""
        flags = ", " + ", ".join("true" if w else "false" for w in want)
        _launch(kern.get("deform_backward_grouped", extra=flags), n * groups * self.K * self.Q, (
            column_grads, x, offset, mask, grad_offset, grad_mask, self.struct, np.int32(n),
            np.int32(self.C), np.int32(max(self.Go, 1)), np.int32(max(self.Gm, 1)), np.int32(groups),
        ))

    def to_columns(self, kern, grad_y, out, n: int) -> None:
        _launch(kern.get("batch_to_columns", spatial=False), n * self.Co * self.Q, (
            grad_y, out, np.int32(n), np.int32(self.Co), kern.index(self.Q),
        ))


def _slice(array, start, stop):
    return None if array is None else array[start:stop]


def _buffer(size: int, dtype):
    return cupy.empty(int(size), dtype=dtype)


def _view(buffer, shape):
    return buffer[:math.prod(shape)].reshape(shape)


def _finalize(src, bias, dst, channels: int, inner: int, dtype, ndim: int) -> None:
    """dst = cast(src + bias per channel); src may be dst."""
    total = int(src.size)
    kern = _Kernels(dtype, ndim, _index64(total))
    _launch(kern.get("finalize", spatial=False), total, (
        src, bias, dst, kern.index(total), np.int32(channels), kern.index(inner),
    ))


# ---------------------------------------------------------------------------------------------
# The backend interface (see _backends/__init__.py)


def conv_forward(x, weight, offset, mask, bias, geom):
    sh = _Shape(geom, x.dtype)
    y = cupy.empty(geom.y_shape, dtype=sh.dtype)
    w = weight.reshape(sh.G, sh.Cog, sh.Cg * sh.K)
    per_sample = sh.C * sh.K * sh.Q * sh.dtype.itemsize + sh.Co * sh.Q * sh.acc.itemsize
    bc = sh.chunk(per_sample)
    cols_buf = _buffer(sh.C * sh.K * bc * sh.Q, sh.dtype)
    out_buf = _buffer(sh.Co * bc * sh.Q, sh.acc)
    for start in range(0, sh.B, bc):
        n = min(bc, sh.B - start)
        kern = sh.kernels(n)
        cols = _view(cols_buf, (sh.G, sh.Cg * sh.K, n * sh.Q))
        sh.im2col(kern, x[start:start + n], _slice(offset, start, start + n), _slice(mask, start, start + n),
                  cols, n)
        out = _view(out_buf, (sh.G, sh.Cog, n * sh.Q))
        _gemm(w, cols, out)
        _launch(kern.get("columns_to_batch", spatial=False), n * sh.Co * sh.Q, (
            out, bias, y[start:start + n], np.int32(n), np.int32(sh.Co), kern.index(sh.Q),
        ))
    return y


def conv_backward(grad_output, x, weight, offset, mask, geom, need_input=True, need_weight=True,
                  need_offset=True, need_mask=True, bias=None):
    """Every requested gradient of the convolution in one pass over the batch.

    Returns ``(grad_x, grad_weight, grad_offset, grad_mask)``, each None unless asked for
    (offset/mask gradients also None when that argument is None). ``bias`` (length C_in) is
    added to grad_x per channel: the transposed convolution's forward. Shares the grad_output
    layout change and the column-grad GEMM between the input and the offset/mask gradients;
    the tiled col2im kernel scatters the input gradient, the grouped kernel computes the
    offset/mask gradients from the same column grads.
    ``x`` may be None when neither the weight nor the offset/mask gradients are wanted.
    """
    sh = _Shape(geom, grad_output.dtype)
    need_offset = bool(need_offset) and offset is not None
    need_mask = bool(need_mask) and mask is not None
    need_om = need_offset or need_mask
    need_cgrad = need_input or need_om
    grad_x = cupy.zeros(geom.x_shape, dtype=sh.acc) if need_input else None
    grad_w = cupy.zeros((sh.G, sh.Cog, sh.Cg * sh.K), dtype=sh.acc) if need_weight else None
    grad_off = cupy.empty(geom.offset_shape, dtype=sh.dtype) if need_offset else None
    grad_m = cupy.empty(geom.mask_shape, dtype=sh.dtype) if need_mask else None
    if need_weight or need_cgrad:
        w = weight.reshape(sh.G, sh.Cog, sh.Cg * sh.K)
        cols_elems = sh.C * sh.K * sh.Q
        per_sample = (sh.Co * sh.Q * sh.dtype.itemsize
                      + (cols_elems * sh.dtype.itemsize if need_weight else 0)
                      + (cols_elems * sh.acc.itemsize if need_cgrad else 0))
        bc = sh.chunk(per_sample)
        gy_buf = _buffer(sh.Co * bc * sh.Q, sh.dtype)
        cols_buf = _buffer(cols_elems * bc, sh.dtype) if need_weight else None
        cgrad_buf = _buffer(cols_elems * bc, sh.acc) if need_cgrad else None
        for start in range(0, sh.B, bc):
            n = min(bc, sh.B - start)
            stop = start + n
            kern = sh.kernels(n)
            gy = _view(gy_buf, (sh.G, sh.Cog, n * sh.Q))
            sh.to_columns(kern, grad_output[start:stop], gy, n)
            off, msk = _slice(offset, start, stop), _slice(mask, start, stop)
            if need_weight:
                cols = _view(cols_buf, (sh.G, sh.Cg * sh.K, n * sh.Q))
                sh.im2col(kern, x[start:stop], off, msk, cols, n)
                _gemm(gy, cols, grad_w, trans_b=True, beta=1.0)
            if not need_cgrad:
                continue
            cgrad = _view(cgrad_buf, (sh.G, sh.Cg * sh.K, n * sh.Q))
            _gemm(w, gy, cgrad, trans_a=True)
            if need_input:
                sh.col2im(kern, cgrad, off, msk, grad_x[start:stop], n)
            x_part = _slice(x, start, stop)
            g_off, g_m = _slice(grad_off, start, stop), _slice(grad_m, start, stop)
            if need_offset:
                with_mask = need_mask and sh.Go == sh.Gm
                sh.grouped(kern, (True, with_mask), sh.Go, cgrad, x_part, off, msk, g_off,
                           g_m if with_mask else None, n)
                if need_mask and not with_mask:
                    sh.grouped(kern, (False, True), sh.Gm, cgrad, x_part, off, msk, None, g_m, n)
            elif need_mask:
                sh.grouped(kern, (False, True), sh.Gm, cgrad, x_part, off, msk, None, g_m, n)
    if grad_x is not None and (sh.acc != sh.dtype or bias is not None):
        out = grad_x if sh.acc == sh.dtype else cupy.empty(geom.x_shape, dtype=sh.dtype)
        _finalize(grad_x, bias, out, sh.C, sh.S, sh.dtype, geom.ndim)
        grad_x = out
    if grad_w is not None:
        if sh.acc != sh.dtype:
            out = cupy.empty(grad_w.shape, dtype=sh.dtype)
            _finalize(grad_w, None, out, 1, 1, sh.dtype, geom.ndim)
            grad_w = out
        grad_w = grad_w.reshape(geom.weight_shape)
    return grad_x, grad_w, grad_off, grad_m
