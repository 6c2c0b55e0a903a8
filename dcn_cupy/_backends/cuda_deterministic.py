"""CUDA backend ``cuda/im2col-deterministic``: the im2col backward with a fixed-point scatter.

It serves ``conv_backward`` (the convolution's gradients and, by the duality, the transposed
convolution's forward) with results that are bitwise identical from run to run and do not
depend on the scatter's launch configuration (grid, block, tile, shared-memory box). Plans
built with ``deterministic=True`` choose it; ``cuda/im2col`` refuses those plans.

What is deterministic, and why:

* column gradients ``W^T @ grad_y`` and the weight gradient ``grad_y @ columns^T``: cuBLAS
  GEMMs, bitwise reproducible for a fixed problem on one GPU model with one stream active
  (cuBLAS's documented guarantee; its atomics mode is off by default); the weight gradient
  accumulates over the chunks in their fixed order (``beta = 1``);
* offset and mask gradients: the grouped kernel of ``deform_conv.cu``, one thread per output
  element summing over channels in a fixed order, no atomics;
* the input gradient (col2im), the only float-atomic scatter of the im2col path: here every
  contribution ``v`` is rounded to a multiple of ``2^-E_b`` and added as a 64-bit integer
  (integer addition is associative, so the order of the atomics does not matter), then
  converted back once (``cuda/deform_deterministic.cu``). ``E_b`` (per sample) is derived on
  the device from a bound of every contribution: ``beta_b = max_{g,j} sum_o |W[g,o,j]| *
  max |grad_output[b]| * max |mask[b]|``, so that the sum of ``2^L`` contributions of size
  ``beta_b`` (``2^L >= prod(Q) * K`` with offsets, ``>= K`` without) stays below ``2^63``.

Precision: each contribution is rounded with an absolute error of at most
``2^(L - 60) * beta_b`` (``beta_b`` bounds the largest contribution of sample ``b``): 2^-45
``beta_b`` at 56x56 with a 3x3 kernel and offsets (``L = 15``), 2^-56 ``beta_b`` without
offsets (``L = 4``). That is far below float32's (and so the half types') rounding; float64
results keep about 45 bits relative to the largest possible contribution at that size (float64
atomics: 53 bits relative to the running sums; the float64 tests' 1e-10 holds). The conversion
back rounds once.
Non-finite contributions set sticky per-element flags (+inf, -inf, both = NaN), applied by the
finalize, so non-finite results are order-independent too. Limitation: a bound ``beta_b``
beyond float64's range (float64 inputs whose maxima multiply past ~1e308) puts the
contributions below the quantum ``2^-E_b``, and they are lost.

Bitwise equality holds for one plan: its chunking (``WORKSPACE_LIMIT_BYTES``, part of the plan
key) fixes the GEMMs' shapes and the weight gradient's order of summation; the scatter's launch
configuration (grid, block, tile, shared-memory box and halo) does not change a bit.

Cost against ``cuda/im2col``'s backward: two bound reductions (one read of grad_output and
of the mask), 64-bit shared and global atomics instead of 32-bit float ones, and an 8-byte
accumulator per input element (float64 reuses the output array) read once by the finalize.
"""

from __future__ import annotations

import threading

import numpy as np

import cupy

from . import cuda as _cuda
from .cuda import _BLOCK, _CTYPES, _MAX_GRID, _TILE, _Layout, _index64

_SOURCE = "deform_deterministic.cu"
_modules = {}
_lock = threading.Lock()


def module_source() -> str:
    """``deform_deterministic.cu`` with its local headers inlined (#line directives kept)."""
    return _cuda.module_text(_SOURCE)


def name_expressions(dtype, ndim: int, index64: bool) -> tuple:
    """Every kernel instantiation of one module (one dtype, one N, one index width)."""
    t = _CTYPES[np.dtype(dtype)]
    i = "long long" if index64 else "int"
    return (f"det_col2im<{t}, {i}, {ndim}>", f"det_finalize<{t}, {i}>", f"det_weight_bound<{t}, {i}>",
            f"det_sample_bound<{t}, {i}>")


def _kernels(dtype, ndim: int, index64: bool) -> dict:
    """The module's kernels on the current device (compiled once per device and key)."""
    key = (cupy.cuda.runtime.getDevice(), np.dtype(dtype).str, ndim, index64)
    found = _modules.get(key)
    if found is None:
        with _lock:
            found = _modules.get(key)
            if found is None:
                names = name_expressions(dtype, ndim, index64)
                module = cupy.RawModule(code=module_source(), options=_cuda.compile_options(), name_expressions=names)
                found = dict(zip(("col2im", "finalize", "weight_bound", "sample_bound"),
                                 (module.get_function(n) for n in names)))
                _modules[key] = found
    return found


def _memset(ptr: int, nbytes: int) -> None:
    if nbytes > 0:
        cupy.cuda.runtime.memsetAsync(ptr, 0, nbytes, cupy.cuda.get_current_stream().ptr)


class _DeterministicBackward(_cuda._Backward):
    """``conv_backward`` of ``cuda/im2col`` with the fixed-point input-gradient scatter."""

    needs_scatter = False   # the box capacity is counted in 64-bit integers here
    pointer_path = False    # run_pointers would replay _Backward's (atomic) launches: run() only

    def __init__(self, spec):
        _cuda._Executable.__init__(self, spec)
        self.channels_last = False     # its columns through deform_im2col (no channels-last copy here)
        it, acc = self.dtype.itemsize, self.acc.itemsize
        geom = self.geom
        self.off_ch = geom.offset_groups * self.K * geom.ndim
        self.m_ch = geom.mask_groups * self.K
        half = self.acc != self.dtype
        self.in_place = self.dtype == np.float64     # the float64 output holds the integers
        per_position = self.Co * it + self.C * self.K * (it + acc)
        fixed = (self.G * self.Cog * self.Cg * self.K * acc if half else 0) + 16 * _cuda._ALIGN
        # 64-bit accumulator (not for float64), 2 flag bits, 2 bounds per sample
        per_sample = self.C * self.S * (0 if self.in_place else 8) + -(-self.C * self.S // 16) * 4 + 16
        n, rows = _cuda._plan_chunks(geom, per_position, fixed, per_sample, self.limit, "backward")
        if rows is not None:
            per_position += 2 * (self.off_ch + self.m_ch) * it
            n, rows = _cuda._plan_chunks(geom, per_position, fixed, per_sample, self.limit, "backward")
        nq = n * self.Q if rows is None else rows * self.inner
        self.n = n
        layout = self.layout = _Layout()
        layout.add("gy", self.Co * nq, self.dtype)
        layout.add("cols", self.C * self.K * nq, self.dtype)
        layout.add("cgrad", self.C * self.K * nq, self.acc)
        if half:
            layout.add("grad_w", self.G * self.Cog * self.Cg * self.K, self.acc)
        layout.add("weight_bound", 1, np.uint64)
        # zeroed together (adjacent slots) when a chunk starts new samples
        if not self.in_place:
            layout.add("acc", n * self.C * self.S, np.uint64)
        layout.add("flags", -(-n * self.C * self.S // 16), np.uint32)
        layout.add("bounds", 2 * n, np.uint64)
        if rows is not None:
            for name, ch in (("offset", self.off_ch), ("mask", self.m_ch), ("grad_offset", self.off_ch),
                             ("grad_mask", self.m_ch)):
                layout.add(name, ch * nq, self.dtype)
        self.workspace_bytes = layout.size
        first = layout.slots["flags" if self.in_place else "acc"][0]
        bounds_at, bounds_count, _ = layout.slots["bounds"]
        self.zero_span = (first, bounds_at + bounds_count * 8 - first)
        Q_all = self.Q
        self.log2_count = np.int32(int(max(Q_all * self.K if geom.offset_groups else self.K, 1) - 1).bit_length())
        self.w_index64 = _index64(self.G * self.Cog * self.Cg * self.K)
        self.gy_index64 = _index64(self.Co * self.Q)
        self.m_index64 = _index64(max(self.m_ch, 1) * self.Q)
        with cupy.cuda.Device(self.device_id):
            self.chunks = self._chunks(n, rows)
            self.caps = {}
            for c in self.chunks:
                sub = (_cuda._sub_geometry(geom, c.n, c.lo, c.hi) if c.rows else geom.with_batch(c.n))
                cap = min(_cuda._max_box_volume(sub, _TILE, self.halo), self.smem // 8)
                self.caps[id(c)] = np.int32(max(int(cap), 0))
            self.w_bound = self.det_kernels(self.w_index64)["weight_bound"]
            self.gy_bound = self.det_kernels(self.gy_index64)["sample_bound"]
            self.m_bound = self.det_kernels(self.m_index64)["sample_bound"]
        self.gemms = {}
        for c in self.chunks:
            q = c.n * c.Q
            if q not in self.gemms:
                self.gemms[q] = (
                    _cuda._Gemm(self.G, self.Cog, self.Cg * self.K, q, self.dtype, self.acc, trans_b=True, beta=1.0,
                                allow_tf32=spec.allow_tf32),
                    _cuda._Gemm(self.G, self.Cg * self.K, q, self.Cog, self.dtype, self.acc, trans_a=True,
                                allow_tf32=spec.allow_tf32),
                )
        self.final = None
        self.description = self._describe("backward", n, rows).replace(
            "cuda/im2col backward", "cuda/im2col-deterministic backward (fixed-point 64-bit input-gradient scatter)")

    def kernels(self, index64: bool) -> dict:
        found = self._kernels.get(index64)
        if found is None:
            found = dict(super().kernels(index64))
            for name, fn in self.det_kernels(index64).items():
                found["det_" + name] = fn
            self._kernels[index64] = found
        return found

    def det_kernels(self, index64: bool) -> dict:
        return _kernels(self.dtype, self.geom.ndim, index64)

    def _sample_bound(self, kernel, index64, array, chunk, per_sample, bounds):
        """bounds[0:n] = max |array[b]| of the chunk's samples (whole samples, any batch stride)."""
        part = array[chunk.start:chunk.stop]
        stride = part.strides[0] // part.itemsize
        blocks = max(1, min(-(-per_sample // (4 * _BLOCK)), max(1, 1024 // chunk.n)))
        index = np.int64 if index64 else np.int32
        kernel((blocks, min(chunk.n, 65535)), (_BLOCK,), (part, index(per_sample), np.int64(stride),
                                                           np.int32(chunk.n), bounds))

    def run(self, args, out, ws):
        gy_all, x, w = args["grad_output"], args["input"], args["weight"]
        offset, mask, bias, wanted = args["offset"], args["mask"], args.get("bias"), args["wanted"]
        need_input = "input" in wanted
        need_weight = "weight" in wanted
        need_offset = "offset" in wanted and offset is not None
        need_mask = "mask" in wanted and mask is not None
        need_cgrad = need_input or need_offset or need_mask
        layout, geom, C, G, K = self.layout, self.geom, self.C, self.G, self.K
        half = self.acc != self.dtype
        grad_x = out.get("input") if need_input else None
        grad_w = out.get("weight") if need_weight else None
        grad_off = out.get("offset") if need_offset else None
        grad_m = out.get("mask") if need_mask else None
        if grad_w is not None:
            w_acc = layout.view(ws, "grad_w", (G, self.Cog, self.Cg * K)) if half else grad_w.reshape(
                G, self.Cog, self.Cg * K)
            w_acc.fill(0)
        base = ws.data.ptr
        if grad_x is not None:
            w_bound = layout.view(ws, "weight_bound", (1,))
            _memset(w_bound.data.ptr, 8)
            total = G * self.Cg * K
            index = np.int64 if self.w_index64 else np.int32
            self.w_bound((min(-(-total // 32), _MAX_GRID),), (_BLOCK,),   # 32 columns a block
                         (w, np.int32(G), np.int32(self.Cog), index(self.Cg * K), w_bound))
            bounds = layout.view(ws, "bounds", (2 * self.n,))
            flags = layout.view(ws, "flags", (layout.slots["flags"][1],))
            has_mask = np.int32(mask is not None)
            bounds_batch = np.int32(self.n)
        handle = _cuda._prepare_cublas(self.device_id, 0, 0)   # no cuBLAS workspace slot here
        w_ptr = w.data.ptr
        spatial = tuple(geom.output_shape[1:])
        for c in self.chunks:
            q = c.n * c.Q
            k = c.kernels
            gemm_w, gemm_cgrad = self.gemms[q]
            gy = layout.view(ws, "gy", (G, self.Cog, q))
            if c.rows:
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
                cols = layout.view(ws, "cols", (G, self.Cg * K, q))
                self._launch(k["im2col"], C * q, (x_part, off, msk, cols, c.struct, c.i_n, self.i_C, self.i_Go,
                                                  self.i_Gm))
                gemm_w(handle, gy.data.ptr, cols.data.ptr, w_acc.data.ptr)
            if not need_cgrad:
                continue
            cgrad = layout.view(ws, "cgrad", (G, self.Cg * K, q))
            gemm_cgrad(handle, w_ptr, gy.data.ptr, cgrad.data.ptr)
            if need_input:
                target = grad_x[c.start:c.stop]
                acc = target.view(np.uint64) if self.in_place else layout.view(ws, "acc", (c.n, C, self.S))
                if c.first:   # a new sample (or samples): zero its accumulator, flags and bounds
                    _memset(base + self.zero_span[0], self.zero_span[1])
                    if self.in_place:
                        _memset(acc.data.ptr, acc.nbytes)
                    self._sample_bound(self.gy_bound, self.gy_index64, gy_all, c, self.Co * self.Q, bounds)
                    if mask is not None:
                        self._sample_bound(self.m_bound, self.m_index64, mask, c, self.m_ch * self.Q,
                                           bounds[self.n:])
                blocks = -(-c.Q // _TILE) * C * c.n
                cap = self.caps[id(c)]
                k["det_col2im"]((min(blocks, _MAX_GRID),), (_TILE,), (
                    cgrad, off, msk, acc, flags, w_bound, bounds, c.struct, c.i_n, self.i_C, self.i_Go, self.i_Gm,
                    np.int32(self.halo), cap, self.log2_count, has_mask, bounds_batch), shared_mem=int(cap) * 8)
                if c.last:
                    total = c.n * C * self.S
                    self._launch(k["det_finalize"], total, (acc, flags, w_bound, bounds, bias, target, c.i_n,
                                                            self.i_C, c.index(self.S), self.log2_count, has_mask,
                                                            bounds_batch))
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
        if grad_w is not None and half:
            final = self.kernels(_index64(grad_w.size))["finalize"]
            total = grad_w.size
            index = np.int64 if _index64(total) else np.int32
            self._launch(final, total, (w_acc, None, grad_w, index(total), np.int32(1), index(1)))


class _DeterministicBackend:
    """``cuda/im2col-deterministic``: ``conv_backward`` only (the forward is deterministic as it is).

    Priority -1: the automatic choice takes it for ``deterministic=True`` plans, which
    ``cuda/im2col`` refuses; forcing it serves any plan.
    """

    device = "cuda"
    algorithm = "im2col-deterministic"
    priority = -1
    primitives = ("conv_backward",)

    def serves(self, spec, primitive):
        if primitive != "conv_backward":
            return f"it implements conv_backward only, got {primitive}"
        if spec.dtype not in _CTYPES:
            return f"dtype {spec.dtype} is not supported"
        return None

    def build(self, spec, primitive):
        return _DeterministicBackward(spec)


BACKEND = _DeterministicBackend()


def conv_backward(grad_output, x, weight, offset, mask, geom, wanted, bias=None, allow_tf32=None):
    """``cuda.conv_backward`` through this backend (tests and benchmarks; the library goes through plans)."""
    from . import PlanSpec
    tf32 = _cuda.cupy_allows_tf32() if allow_tf32 is None else allow_tf32
    spec = PlanSpec(geom, np.dtype(grad_output.dtype), "cuda", cupy.cuda.runtime.getDevice(), True, bool(tf32))
    exe = _DeterministicBackward(spec)
    shapes = {"input": geom.x_shape, "weight": geom.weight_shape, "offset": geom.offset_shape,
              "mask": geom.mask_shape}
    wanted = frozenset(n for n in wanted if not (n == "offset" and offset is None) and not (n == "mask" and mask is None))
    out = {name: cupy.empty(shapes[name], dtype=grad_output.dtype) for name in wanted}
    ws = cupy.empty(exe.workspace_bytes, dtype=np.uint8)
    exe.run({"grad_output": grad_output, "input": x, "weight": weight, "offset": offset, "mask": mask,
             "bias": bias, "wanted": wanted}, out, ws)
    return tuple(out.get(name) for name in ("input", "weight", "offset", "mask"))
