"""Plans: one configuration of a deformable convolution, validated once, executed many times.

A :class:`Plan` holds everything that does not change between calls: the geometry, the
executables the backends built for it (kernels, launch configurations, GEMM descriptors,
chunking, workspace size) and the expected shape, dtype and device of every argument. A call
only compares its arrays with those and runs the executables.

The transposed convolution is composed from the convolution's two primitives by duality
(design section 1):

* transposed forward            = ``conv_backward`` to the input (+ bias);
* transposed backward-to-input  = ``conv_forward`` with the same offsets and mask;
* transposed weight/offset/mask = ``conv_backward``'s, with ``x`` and ``grad_output`` swapped.

The functional API finds its plans in a bounded, thread-safe LRU cache (:func:`cached_plan`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple, Optional

import numpy as np

from . import _backends, _geometry
from ._interop import (_DLPACK, _by_type, bfloat16, check_dtype, compute_dtype, cupy_or_none, library_of,
                       torch_dtype)

__all__ = ["Gradients", "Plan", "plan", "cached_plan", "clear_plan_cache", "PLAN_CACHE_SIZE"]

_NAMES = ("input", "weight", "offset", "mask", "bias")
_BACKWARD_NAMES = ("grad_output",) + _NAMES
_CORE = frozenset(("input", "weight", "offset", "mask"))
_PARAMS = frozenset(("weight", "offset", "mask"))
_ONLY_INPUT = frozenset(("input",))
#: The transposed backward's parts replayed as one recorded list (``Plan._replay_chain``); False:
#: each part's own list, as before (kept for the A/B and the tests that compare the two).
CHAIN_TRANSPOSED_BACKWARD = True


class Gradients(NamedTuple):
    """Gradients of a deformable convolution; an entry is None when it was not computed."""

    input: object = None
    weight: object = None
    offset: object = None
    mask: object = None
    bias: object = None


def _unavailable(reason):
    """Raise why a primitive has no executable: its MemoryError, or a ValueError."""
    if isinstance(reason, BaseException):
        raise type(reason)(*reason.args)
    raise ValueError(reason)


def _xp(device: str):
    if device == "cpu":
        return np
    return cupy_or_none()


def _sample_contiguous(xp, a):
    """``a`` itself when every sample (axes 1..) is C-contiguous (any batch stride), else a copy."""
    if a.flags.c_contiguous:
        return a
    expected = a.itemsize
    shape, strides = a.shape, a.strides
    for axis in range(len(shape) - 1, 0, -1):
        if shape[axis] != 1 and strides[axis] != expected:
            return xp.ascontiguousarray(a)
        expected *= shape[axis]
    return a


def _contiguous(xp, a):
    return a if a.flags.c_contiguous else xp.ascontiguousarray(a)


def _channel_sum(xp, grad_output, dtype, out=None):
    """Sum over batch and spatial axes (the bias gradient), accumulated in float32 or better."""
    axes = (0,) + tuple(range(2, grad_output.ndim))
    total = xp.sum(grad_output, axis=axes, dtype=compute_dtype(dtype))
    if out is None:
        return total.astype(dtype)
    out[...] = total
    return out


class Plan:
    """One configuration of :func:`dcn_cupy.deform_conv` (or its transpose), validated once.

    Built by :func:`dcn_cupy.plan`. ``forward``/``backward`` take arrays of exactly the shapes,
    dtype and device the plan was built for (a ``ValueError`` naming the argument otherwise)
    and return results in ``input``'s library.

    Attributes:
        output_shape (tuple): the shape of the forward's result.
        workspace_bytes (int): the size of a scratch buffer that serves every call (0: none),
            the larger of ``forward_workspace_bytes`` and ``backward_workspace_bytes``. Pass
            ``workspace=`` a buffer at least as large as the call's own size to keep every
            allocation in the caller's hands; otherwise each call allocates its own size from
            the current allocator.
        forward_workspace_bytes (int), backward_workspace_bytes (int): what ``forward`` and
            ``backward`` need.
        algorithm (str): the algorithms chosen, e.g. ``"forward: cuda/im2col, backward: cuda/im2col"``.
    """

    def __init__(self, transposed: bool, geom, batched: bool, shapes: dict, dtype, device: str,
                 device_id: int, deterministic: bool, allow_tf32: bool, algorithm: Optional[str]):
        self.transposed = transposed
        self.geom = geom
        self.batched = batched
        self.dtype = np.dtype(dtype)
        self.device = device
        self.device_id = device_id
        self.deterministic = deterministic
        self.allow_tf32 = allow_tf32
        self.forced = algorithm
        self._xp = _xp(device)
        self._shapes = shapes
        self._forward_shapes = tuple(shapes[n] for n in _NAMES)
        out = geom.x_shape if transposed else geom.y_shape
        self.output_shape = out if batched else out[1:]
        self._batched_output = out
        self._backward_shapes = (self.output_shape,) + self._forward_shapes
        self._given = {name: shapes[name] is not None for name in _geometry.GRADIENT_NAMES}
        self._default_wanted = _geometry.normalise_wrt(None, self._given)
        self._wanted_cache = {}
        self._device_ctx = None
        if device == "cuda":
            self._device_ctx = self._xp.cuda.Device(device_id)
        self.spec = _backends.PlanSpec(geom, self.dtype, device, device_id, deterministic, allow_tf32, transposed)
        # executables: primitive -> (backend name, executable) or (None, reason)
        self._exec = {}
        if geom.batch > 0:
            needed = "conv_backward" if transposed else "conv_forward"
            for primitive in _backends.PRIMITIVES:
                backend, reason = _backends.choose(self.spec, primitive, algorithm)
                if backend is None:
                    if primitive == needed:
                        raise ValueError(reason)
                    self._exec[primitive] = (None, reason)
                    continue
                try:
                    executable = backend.build(self.spec, primitive)
                except MemoryError as error:
                    if primitive == needed:
                        raise
                    # the forward fits, the backward does not: refused when it is called
                    self._exec[primitive] = (None, error)
                    continue
                self._exec[primitive] = (f"{backend.device}/{backend.algorithm}", executable)
        fwd, bwd = ("conv_backward", "conv_forward") if transposed else ("conv_forward", "conv_backward")
        self._fwd = self._exec.get(fwd, (None, None))[1]
        self._bwd = self._exec.get("conv_backward", (None, None))
        self._bwd_input = self._exec.get(bwd, (None, None)) if transposed else None

        def size(*entries):  # the largest workspace of the built executables among entries
            return max([int(e.workspace_bytes) for n, e in entries if n is not None], default=0)

        # The transposed backward's executables, where each can record its launches without
        # running them: one list of all of them per set of addresses, replayed as one CUDA graph.
        self._chain = None
        if transposed and device == "cuda" and all(callable(getattr(e, "record", None))
                                                   for _, e in (self._bwd, self._bwd_input)):
            from ._backends import cuda as _cuda_backend
            self._chain = _cuda_backend.Recordings()
        # On CUDA the bias gradient is one or two kernel launches, compiled with the plan; None:
        # the array library's sum (CPU, or no CUDA compiler/device where the plan was built).
        self._bias_sum = self._bias_sum_pointers = None
        # A convolution's backward executable may compute the bias gradient in its own launches,
        # always or beside some other gradient (_folds_bias).
        self._fold_bias = (not transposed and geom.batch > 0 and shapes["bias"] is not None
                           and bool(getattr(self._bwd[1], "bias_gradient", False)))
        self._fold_bias_with = getattr(self._bwd[1], "bias_gradient_with", None) if self._fold_bias else None
        # A transposed convolution's bias gradient sums its grad_output, the input of the
        # convolution forward that gives its input gradient: where that executable can sum its
        # input as it copies it, the plan takes the bias gradient from there beside the input's.
        self._fold_transposed_bias = (transposed and geom.batch > 0 and shapes["bias"] is not None
                                      and getattr(self._bwd_input[1], "summing_workspace_bytes", None) is not None)
        if (device == "cuda" and geom.batch > 0 and shapes["bias"] is not None
                and (not self._fold_bias or self._fold_bias_with is not None)):
            try:
                from ._backends import cuda as _cuda_backend
                with self._device_ctx:
                    kernel = _cuda_backend.channel_sum_kernel(self.dtype)
            except Exception:
                kernel = None
            if kernel is not None:
                self._bias_sum = (kernel, _cuda_backend.channel_sum)
                batch, channels, *spatial = out      # the bias gradient sums grad_output over all but C
                self._bias_sum_pointers = _cuda_backend.ChannelSum(kernel, batch, channels,
                                                                   int(np.prod(spatial, dtype=np.int64)), self.dtype)
        self.forward_workspace_bytes = size(self._exec.get(fwd, (None, None)))
        # the bias gradient's partial sums use the backward's workspace after the other gradients
        self.backward_workspace_bytes = max(size(self._bwd, *([self._bwd_input] if transposed else [])),
                                            getattr(self._bias_sum_pointers, "workspace_bytes", 0),
                                            self._bwd_input[1].summing_workspace_bytes
                                            if self._fold_transposed_bias else 0)
        self.workspace_bytes = max(self.forward_workspace_bytes, self.backward_workspace_bytes)

    # -----------------------------------------------------------------------------------------
    # description

    def _name_of(self, primitive: str) -> str:
        name, what = self._exec.get(primitive, (None, "empty batch: nothing runs"))
        return name if name is not None else f"none ({what})"

    @property
    def algorithm(self) -> str:
        if self.geom.batch == 0:
            return "forward: none, backward: none (empty batch)"
        if self.transposed:
            forward = self._name_of("conv_backward")
            parts = {self._name_of("conv_forward"), self._name_of("conv_backward")}
            backward = " + ".join(sorted(parts))
        else:
            forward, backward = self._name_of("conv_forward"), self._name_of("conv_backward")
        return f"forward: {forward}, backward: {backward}"

    def __str__(self) -> str:
        g = self.geom
        op = "deform_conv_transpose" if self.transposed else "deform_conv"
        where = "cpu" if self.device == "cpu" else f"cuda:{self.device_id}"
        args = ", ".join(f"{n}={self._shapes[n]}" for n in _NAMES if self._shapes[n] is not None)
        lines = [
            f"dcn_cupy.Plan {op}{g.ndim}d on {where}, {self.dtype.name}: {args} -> {self.output_shape}",
            f"  stride={g.stride} padding={g.padding} dilation={g.dilation} groups={g.groups} "
            f"offset_groups={g.offset_groups} mask_groups={g.mask_groups}"
            + (" deterministic" if self.deterministic else "") + (" tf32" if self.allow_tf32 else ""),
            f"  {self.algorithm}" + (f" (forced: {self.forced})" if self.forced else " (automatic: the "
                                     "highest-priority algorithm that serves and recommends itself)"),
        ]
        # By duality the transposed forward is the conv's backward to its input.
        roles = ({"conv_backward": "forward; weight/offset/mask gradients", "conv_forward": "input gradient"}
                 if self.transposed else {"conv_forward": "forward", "conv_backward": "backward"})
        for primitive, (name, what) in self._exec.items():
            role = roles[primitive]
            if name is None:
                lines.append(f"  {primitive}: unavailable: {what}")
            else:
                lines.append(f"  {primitive} ({role}): {what.description}")
        lines.append(f"  workspace: {self.workspace_bytes} bytes")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<{str(self).splitlines()[0]}; {self.algorithm}>"

    # -----------------------------------------------------------------------------------------
    # per-call checks (shapes, dtype, device and presence only)

    def _natives(self, names, arrays, shapes):
        natives = []
        lib0 = None
        first = None
        dtype, device, device_id = self.dtype, self.device, self.device_id
        for name, array, shape in zip(names, arrays, shapes):
            if array is None:
                if shape is not None and name not in ("input",):
                    raise ValueError(f"{name} is missing: this plan was built with a {name} of shape {shape}")
                natives.append(None)
                continue
            if shape is None:
                raise ValueError(f"{name} must be None: this plan was built without {name}")
            lib = _by_type.get(type(array)) or library_of(array)
            native, dev, dev_id = lib.to_native(array, name)
            if native.shape != shape:
                raise ValueError(f"{name} must have the plan's shape {shape}, got {tuple(native.shape)}")
            if native.dtype is not dtype and native.dtype != dtype:
                raise ValueError(f"{name} must have the plan's dtype {dtype.name}, got {np.dtype(native.dtype).name}")
            if dev != device or dev_id != device_id:
                where = "cpu" if device == "cpu" else f"cuda:{device_id}"
                got = "cpu" if dev == "cpu" else f"cuda:{dev_id}"
                raise ValueError(f"{name} must be on the plan's device {where}, got {got}")
            if lib0 is None or lib0 is _DLPACK:
                lib0, first = lib, name
            elif lib is not lib0 and lib is not _DLPACK:
                raise TypeError(f"{name} must come from the same library as {first} ({lib0.name}), got {lib.name}")
            natives.append(native)
        return natives, lib0

    def _buffer(self, array, name: str, nbytes: int, what: str = ""):
        """A caller's buffer (out= or workspace=) as a native array, checked."""
        lib = _by_type.get(type(array)) or library_of(array)
        native, dev, dev_id = lib.to_native(array, name)
        if dev != self.device or dev_id != self.device_id:
            where = "cpu" if self.device == "cpu" else f"cuda:{self.device_id}"
            raise ValueError(f"{name} must be on the plan's device {where}, got {dev if dev == 'cpu' else f'cuda:{dev_id}'}")
        if not (native._c_contiguous if self.device == "cuda" else native.flags.c_contiguous):
            raise ValueError(f"{name} must be C-contiguous")
        if nbytes is not None and native.nbytes < nbytes:
            raise ValueError(f"{name} must hold at least {nbytes} bytes ({what}), got {native.nbytes}")
        return native

    def _out(self, out, name: str, shape):
        native = self._buffer(out, name, None)
        if native.shape != shape or native.dtype != self.dtype:
            raise ValueError(f"{name} must be a C-contiguous array of shape {shape} and dtype {self.dtype.name}, "
                             f"got shape {tuple(native.shape)} and dtype {np.dtype(native.dtype).name}")
        return native

    def _workspace(self, workspace, size: int, what: str):
        """The call's workspace: the caller's (checked against ``size``, the call's need, named
        ``what``) or a new one of ``size`` bytes."""
        if workspace is None:
            return self._xp.empty(size, dtype=np.uint8) if size else None
        native = self._buffer(workspace, "workspace", size, what)
        if native.ndim == 1 and native.dtype == np.uint8:
            return native
        return native.reshape(-1).view(np.uint8)

    def _context(self, lib):
        if self._device_ctx is None:
            return None
        stream = getattr(lib, "stream", None)
        return stream(self.device_id) if stream is not None else None

    def _wanted(self, wrt):
        if wrt is None:
            return self._default_wanted
        key = wrt if isinstance(wrt, (str, frozenset, tuple)) else None
        if key is not None:
            found = self._wanted_cache.get(key)
            if found is not None:
                return found
        wanted = _geometry.normalise_wrt(wrt, self._given)
        if key is not None and len(self._wanted_cache) < 64:
            self._wanted_cache[key] = wanted
        return wanted

    # -----------------------------------------------------------------------------------------
    # public calls

    def forward(self, input, weight, offset=None, mask=None, bias=None, *, out=None, workspace=None):
        """Run the operation; the result in ``input``'s library (or ``out``, filled and returned).

        Args:
            input, weight, offset, mask, bias: arrays of the plan's shapes, dtype and device;
                offset/mask/bias exactly when the plan was built with them.
            out (array, optional): receives the result (``plan.output_shape``, the plan's dtype
                and device, C-contiguous).
            workspace (array, optional): a C-contiguous buffer on the device of at least
                ``plan.workspace_bytes`` bytes (any dtype).
        """
        if input is None:
            raise ValueError(f"input is missing: this plan was built with an input of shape {self._shapes['input']}")
        natives, lib = self._natives(_NAMES, (input, weight, offset, mask, bias), self._forward_shapes)
        out_native = None if out is None else self._out(out, "out", self.output_shape)
        device = self._device_ctx
        if device is None:
            y = self._forward(natives, out_native, workspace)
        else:
            stream = self._context(lib)
            with device:
                if stream is None:
                    y = self._forward(natives, out_native, workspace)
                else:
                    with stream:
                        y = self._forward(natives, out_native, workspace)
        if out is not None:
            return out
        return lib.from_native(y, None) if lib is not _DLPACK else y

    def backward(self, grad_output, input, weight, offset=None, mask=None, bias=None, *, wrt=None, out=None,
                 workspace=None) -> Gradients:
        """Gradients of the operation with respect to the arguments named in ``wrt``.

        Args:
            grad_output: gradient of the loss with respect to the output (``plan.output_shape``).
            input, weight, offset, mask, bias: as in :meth:`forward`; ``input`` may be None when
                only the input and bias gradients are wanted.
            wrt (collection of str, optional): a subset of ``{"input", "weight", "offset", "mask",
                "bias"}``; None: every argument the plan was built with.
            out (mapping, optional): name -> array receiving that gradient (shaped like its
                argument, C-contiguous); gradients not named are allocated.
            workspace (array, optional): as in :meth:`forward`.

        Returns:
            Gradients: a named tuple ``(input, weight, offset, mask, bias)``; an entry is None
            when not requested or when its argument was None.
        """
        wanted = self._wanted(wrt)
        if input is None and wanted & _PARAMS:
            raise ValueError(f"input is required for the gradients {sorted(wanted & _PARAMS)}, got None")
        if grad_output is None:
            raise ValueError(f"grad_output is missing: expected an array of shape {self.output_shape}")
        natives, lib = self._natives(_BACKWARD_NAMES, (grad_output, input, weight, offset, mask, bias),
                                     self._backward_shapes)
        outs = None
        if out is not None:
            items = out._asdict().items() if isinstance(out, Gradients) else dict(out).items()
            outs = {}
            for name, array in items:
                if array is None:
                    continue
                if name not in wanted:
                    raise ValueError(f"out[{name!r}] given for a gradient that is not computed (wanted: {sorted(wanted)})")
                outs[name] = self._out(array, f"out[{name!r}]", self._shapes[name])
        device = self._device_ctx
        if device is None:
            grads = self._backward(natives, wanted, outs, workspace)
        else:
            stream = self._context(lib)
            with device:
                if stream is None:
                    grads = self._backward(natives, wanted, outs, workspace)
                else:
                    with stream:
                        grads = self._backward(natives, wanted, outs, workspace)
        result = {}
        for name, value in grads.items():
            if value is None:
                result[name] = None
            elif out is not None and outs.get(name) is not None:
                result[name] = out[name] if not isinstance(out, Gradients) else getattr(out, name)
            else:
                result[name] = value if lib is _DLPACK else lib.from_native(value, None)
        return Gradients(**result)

    # -----------------------------------------------------------------------------------------
    # raw device addresses (adapters that hold C-contiguous arrays of exactly the plan's shapes,
    # dtype and device, e.g. torch tensors of the configuration the plan was built for)

    def _folds_bias(self, wanted) -> bool:
        """Whether a backward executable computes the wanted bias gradient itself: the
        convolution's backward, or a transposed convolution's convolution forward to the input."""
        if "bias" not in wanted:
            return False
        if self.transposed:
            return self._fold_transposed_bias and "input" in wanted
        return self._fold_bias and (self._fold_bias_with is None or bool(wanted & self._fold_bias_with))

    def _pointer_ready(self, *executables) -> bool:
        return self.geom.batch > 0 and all(e is not None and getattr(e, "pointer_path", False) for e in executables)

    def launch_forward(self, pointers, out: int, workspace: int, stream: int) -> bool:
        """The forward on raw device addresses, with nothing checked: ``pointers`` = (input,
        weight, offset, mask, bias) (0 for an absent one), ``out`` the result's, ``workspace``
        at least ``forward_workspace_bytes`` (0 when that is 0), ``stream`` a ``cudaStream_t``; the
        plan's device must be current. False (and nothing run) where the chosen algorithm has
        no raw-address path: call :meth:`forward` then."""
        return self._forward_addresses(pointers, out, workspace, stream)

    def launch_backward(self, grad_output: int, pointers, wanted, outs, workspace: int, stream: int) -> bool:
        """:meth:`backward` on raw device addresses, as :meth:`launch_forward` (``workspace``
        at least ``backward_workspace_bytes``): ``wanted`` a frozenset of gradient names (as
        :meth:`_wanted` normalises them), ``outs`` name -> address of each wanted gradient."""
        return self._backward_addresses(grad_output, pointers, wanted, outs, workspace, stream)

    def _forward_addresses(self, pointers, out, workspace, stream) -> bool:
        exe = self._fwd
        if not self._pointer_ready(exe):
            return False
        if self.transposed:
            x, w, off, msk, b = pointers
            exe.run_pointers((x, 0, w, off, msk, b), _ONLY_INPUT, (out, 0, 0, 0), workspace, stream)
        else:
            exe.run_pointers(tuple(pointers), out, workspace, stream)
        return True

    def _backward_addresses(self, grad_output, pointers, wanted, outs, workspace, stream) -> bool:
        x, w, off, msk, _ = pointers
        core = wanted & _CORE
        params = core & _PARAMS
        fold = self._folds_bias(wanted)
        if "bias" in wanted and not fold and self._bias_sum_pointers is None:
            return False
        gx, gw, goff, gm = (outs.get(n, 0) for n in ("input", "weight", "offset", "mask"))
        if not self.transposed:
            if core or fold:
                exe = self._bwd[1]
                if not self._pointer_ready(exe):
                    return False
                inputs = (grad_output, x if params else 0, w, off, msk, 0)
                if fold:
                    exe.run_pointers(inputs, wanted, (gx, gw, goff, gm, outs["bias"]), workspace, stream)
                else:
                    exe.run_pointers(inputs, core, (gx, gw, goff, gm), workspace, stream)
        elif core:
            # z (the transposed op's input) is the convolution's grad_output; grad_output its input.
            to_input = self._bwd_input[1] if "input" in core else None
            to_params = self._bwd[1] if params else None
            if not self._pointer_ready(*(e for e in (to_input, to_params) if e is not None)):
                return False
            if self._chain is not None and CHAIN_TRANSPOSED_BACKWARD and self._replay_chain(
                    grad_output, pointers, wanted, (gx, gw, goff, gm), outs.get("bias", 0), workspace, stream):
                return True
            if to_input is not None:
                sums = {"input_sums": outs["bias"]} if fold else {}   # the bias gradient (_folds_bias)
                to_input.run_pointers((grad_output, w, off, msk, 0), gx, workspace, stream, **sums)
            if to_params is not None:
                to_params.run_pointers((x, grad_output, w, off, msk, 0), params, (0, gw, goff, gm), workspace, stream)
        if "bias" in wanted and not fold:
            self._bias_sum_pointers(grad_output, outs["bias"], workspace, stream)
        return True

    def _replay_chain(self, grad_output, pointers, wanted, grads, grad_bias, workspace, stream) -> bool:
        """The transposed backward as one recorded list (``_chain``): the convolution forward to
        the input, the parameter gradients, the bias gradient, recorded once per set of addresses
        and replayed as one CUDA graph, where each executable's own list would be a graph of its
        own. False (nothing run) where a part cannot be recorded so."""
        from ._backends import cuda as _cuda_backend
        x, w, off, msk, _ = pointers
        gx, gw, goff, gm = grads
        key = (grad_output, x, w, off, msk, wanted, gx, gw, goff, gm, grad_bias, workspace)
        ops = self._chain.get(key)
        if ops is None:
            ops, copied, part = [], None, []
            folded = self._folds_bias(wanted)
            if gx:
                to_input = self._bwd_input[1]
                sums = {"input_sums": grad_bias} if folded else {}
                ops += to_input.record((grad_output, w, off, msk, 0), gx, workspace, **sums)
                copied = to_input.channels_last_input()
            params = wanted & _PARAMS
            if params:
                # grad_output channels-last, as the input gradient's launches left it, is the
                # parameter gradients' input: not copied twice
                part = self._bwd[1].record((x, grad_output, w, off, msk, 0), params, (0, gw, goff, gm), workspace,
                                           input_channels_last=copied)
            if part is None:
                ops = False   # remembered: the parts run as their own lists
            else:
                ops += part
                if grad_bias and not folded:
                    ops += self._bias_sum_pointers.record(grad_output, grad_bias, workspace)
            ops = self._chain.put(key, ops)
        if ops is False:
            return False
        _cuda_backend._replay(ops, None, stream)
        return True

    # -----------------------------------------------------------------------------------------
    # native execution (arrays checked; the device and stream are current)

    def _batched(self, a):
        return a if a is None or self.batched else a[None]

    def _all_contiguous(self, natives) -> bool:
        """CUDA arrays (CuPy), each C-contiguous: the raw-address path takes them as they are."""
        if self.device != "cuda":
            return False
        for a in natives:
            if a is not None and not a._c_contiguous:
                return False
        return True

    @staticmethod
    def _address(a) -> int:
        return 0 if a is None else a.data.ptr

    def _forward(self, natives, out=None, workspace=None):
        xp = self._xp
        x, w, off, msk, b = natives
        y = out if out is not None else xp.empty(self.output_shape, dtype=self.dtype)
        if self.geom.batch == 0:
            return y
        if self._pointer_ready(self._fwd) and self._all_contiguous(natives):
            # one pass: no per-executable re-checks, views or batch axes
            ws = self._workspace(workspace, self.forward_workspace_bytes, "plan.forward_workspace_bytes")
            address = self._address
            self._forward_addresses((address(x), address(w), address(off), address(msk), address(b)), y.data.ptr,
                                    address(ws), xp.cuda.get_current_stream().ptr)
            return y
        batched = self.batched
        yb = y if batched else y[None]
        x = _sample_contiguous(xp, x if batched else x[None])
        w = _contiguous(xp, w)
        if off is not None:
            off = _sample_contiguous(xp, off if batched else off[None])
        if msk is not None:
            msk = _sample_contiguous(xp, msk if batched else msk[None])
        if b is not None:
            b = _contiguous(xp, b)
        ws = self._workspace(workspace, self.forward_workspace_bytes, "plan.forward_workspace_bytes")
        if self.transposed:
            self._fwd.run({"grad_output": x, "input": None, "weight": w, "offset": off, "mask": msk, "bias": b,
                           "wanted": _ONLY_INPUT}, {"input": yb}, ws)
        else:
            self._fwd.run({"input": x, "weight": w, "offset": off, "mask": msk, "bias": b}, yb, ws)
        return y

    def _backward(self, natives, wanted, outs=None, workspace=None) -> dict:
        xp, dtype, geom = self._xp, self.dtype, self.geom
        gy, x, w, off, msk, _ = natives
        grads = dict.fromkeys(_geometry.GRADIENT_NAMES)
        outs = outs or {}
        if geom.batch == 0:
            grads.update(self._empty_batch_gradients(wanted, outs))
            return grads
        fold = self._folds_bias(wanted)
        for name in wanted:
            if name == "bias" and not fold and self._bias_sum is None:
                continue   # the array library's sum allocates it
            target = outs.get(name)
            if target is None:
                target = xp.empty(self._shapes[name], dtype=dtype)
            grads[name] = target
        core = wanted & _CORE
        if self._all_contiguous(natives):
            address = self._address
            targets = {name: address(grads[name]) for name in wanted if grads[name] is not None}
            if "bias" not in wanted or "bias" in targets:
                # the bias gradient alone needs only its partial sums' part of the workspace
                bias_bytes = self._bias_sum_pointers.workspace_bytes if "bias" in wanted and not fold else 0
                need = self.backward_workspace_bytes if core or fold else bias_bytes
                ws = self._workspace(workspace, need, "plan.backward_workspace_bytes") if need else None
                if self._backward_addresses(address(gy), (address(x), address(w), address(off), address(msk), 0),
                                            wanted, targets, address(ws), xp.cuda.get_current_stream().ptr):
                    return grads
        batched = self.batched
        if not batched:
            gy = gy[None]
            x = None if x is None else x[None]
            off = None if off is None else off[None]
            msk = None if msk is None else msk[None]
        gy = _sample_contiguous(xp, gy)
        w = _contiguous(xp, w)
        if off is not None:
            off = _sample_contiguous(xp, off)
        if msk is not None:
            msk = _sample_contiguous(xp, msk)
        ws = (self._workspace(workspace, self.backward_workspace_bytes, "plan.backward_workspace_bytes")
              if core or fold else None)

        def view(name):  # the batched view of a per-sample gradient
            g = grads[name]
            return g if batched or name in ("weight", "bias") else g[None]

        if not self.transposed:
            if core or fold:
                name, executable = self._bwd
                if name is None:
                    _unavailable(executable)
                if core & _PARAMS:
                    x = _sample_contiguous(xp, x)
                else:
                    x = None
                computed = wanted if fold else core
                executable.run({"grad_output": gy, "input": x, "weight": w, "offset": off, "mask": msk, "bias": None,
                                "wanted": computed}, {n: view(n) for n in computed}, ws)
        else:
            # z (the transposed op's input) is the convolution's grad_output; gy its input.
            if "input" in core:
                name, executable = self._bwd_input
                if name is None:
                    _unavailable(executable)
                sums = {"input_sums": grads["bias"]} if fold else {}
                executable.run({"input": gy, "weight": w, "offset": off, "mask": msk, "bias": None, **sums},
                               view("input"), ws)
            params = core & _PARAMS
            if params:
                name, executable = self._bwd
                if name is None:
                    _unavailable(executable)
                z = _sample_contiguous(xp, x)
                executable.run({"grad_output": z, "input": gy, "weight": w, "offset": off, "mask": msk, "bias": None,
                                "wanted": params}, {n: view(n) for n in params}, ws)
        if "bias" in wanted and not fold:
            if self._bias_sum is not None:
                kernel, channel_sum = self._bias_sum
                channel_sum(kernel, gy, grads["bias"])
            else:
                grads["bias"] = _channel_sum(xp, gy, dtype, outs.get("bias"))
        return grads

    def _empty_batch_gradients(self, wanted, outs) -> dict:
        """Gradients for a batch of 0: empty per-sample ones, zero parameter ones."""
        xp, grads = self._xp, {}
        for name in wanted:
            target = outs.get(name)
            if target is None:
                target = xp.empty(self._shapes[name], dtype=self.dtype)
            if name in ("weight", "bias"):
                target[...] = 0
            grads[name] = target
        return grads


# ---------------------------------------------------------------------------------------------
# building plans


def _is_array(a) -> bool:
    if isinstance(a, np.ndarray) or type(a).__name__ == "PyCapsule":
        return True
    if not hasattr(a, "__dlpack__"):
        return False
    device = getattr(a, "device", None)
    return getattr(device, "type", None) != "meta"  # a torch meta tensor is a spec


def _spec_dtype(dtype, name: str) -> np.dtype:
    found = torch_dtype(str(dtype))
    if found is not None:
        return found
    if str(dtype) == "bfloat16":
        return bfloat16()
    try:
        return check_dtype(np.dtype(dtype), name)
    except TypeError:
        raise
    except Exception:
        raise TypeError(f"{name} must have dtype float16, bfloat16, float32 or float64, got {dtype}") from None


def _parse_device(device) -> tuple:
    text = str(device)
    if text == "cpu":
        return "cpu", 0
    if text == "cuda":
        cupy = cupy_or_none()
        return "cuda", (cupy.cuda.runtime.getDevice() if cupy is not None else 0)
    if text.startswith("cuda:") and text[5:].isdigit():
        return "cuda", int(text[5:])
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


_linalg = None   # cupy._core._routines_linalg, imported on first use (an import statement per call costs ~2 µs)


def default_allow_tf32(dtype, device: str) -> bool:
    """CuPy's setting for float32 GEMMs (TF32 when ``CUPY_TF32=1`` or set_compute_type)."""
    global _linalg
    if device != "cuda" or dtype != np.float32:
        return False
    try:
        if _linalg is None:
            from cupy._core import _routines_linalg
            _linalg = _routines_linalg
        return _linalg.get_compute_type(np.float32) == getattr(_linalg, "COMPUTE_TYPE_TF32", 7)
    except Exception:
        return False


def _geometry_of(transposed, ndim, shapes, stride, padding, dilation, groups, output_padding):
    if transposed:
        return _geometry.conv_transpose_geometry(
            shapes["input"], shapes["weight"], shapes["offset"], shapes["mask"], shapes["bias"],
            stride, padding, output_padding, dilation, groups, ndim=ndim)
    return _geometry.conv_geometry(
        shapes["input"], shapes["weight"], shapes["offset"], shapes["mask"], shapes["bias"],
        stride, padding, dilation, groups, ndim=ndim)


def build_plan(transposed, ndim, shapes, dtype, device, device_id, stride=1, padding=0, dilation=1, groups=1,
               output_padding=0, deterministic=False, allow_tf32=None, algorithm=None) -> Plan:
    """A plan from argument shapes (validated here, once)."""
    geom, batched = _geometry_of(transposed, ndim, shapes, stride, padding, dilation, groups, output_padding)
    if allow_tf32 is None:
        allow_tf32 = default_allow_tf32(dtype, device)
    return Plan(transposed, geom, batched, shapes, dtype, device, device_id, bool(deterministic), bool(allow_tf32),
                algorithm)


def plan(input, weight, offset=None, mask=None, bias=None, stride=1, padding=0, dilation=1, groups=1, *,
         transposed=False, output_padding=0, deterministic=False, device=None, algorithm=None,
         allow_tf32=None) -> Plan:
    """Validate one configuration of a deformable convolution once; run it many times.

    Args:
        input, weight, offset, mask, bias: arrays (NumPy, CuPy, torch, JAX, any DLPack producer)
            or shape/dtype specs (any object with ``.shape`` and ``.dtype``, e.g.
            ``jax.ShapeDtypeStruct`` or a torch meta tensor). ``None`` means the argument is
            absent in every call of the plan. Shapes are those of :func:`dcn_cupy.deform_conv`
            (or :func:`dcn_cupy.deform_conv_transpose` with ``transposed=True``), batched or not.
        stride, padding, dilation, groups, output_padding: as in the functional API
            (``output_padding`` only with ``transposed=True``).
        transposed (bool): plan the transposed convolution. Default: False.
        deterministic (bool): only algorithms whose results are bitwise identical from run to
            run. On CUDA the backward (and the transposed forward) then add the input gradient
            in 64-bit fixed point: ``cuda/fused-backward``'s deterministic kernels where the
            fused backward measured faster than ``cuda/im2col``, else
            ``cuda/im2col-deterministic``; the CPU backend is deterministic as it is.
            Default: False.
        device (str, optional): ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; read off the arrays when
            they are arrays, default ``"cpu"`` for specs.
        algorithm (str, optional): force an algorithm, e.g. ``"cuda/im2col"`` or ``"cpu/numba"``
            (a ``ValueError`` says why when it does not serve the configuration). None: the
            highest-priority algorithm that serves it.
        allow_tf32 (bool, optional): float32 GEMMs may use TF32. None: CuPy's setting at build
            time (``CUPY_TF32=1``).

    Returns:
        Plan: with ``forward(...)``, ``backward(...)``, ``output_shape``, ``workspace_bytes``,
        ``algorithm`` and a readable ``str(plan)``.

    Example::

        >>> import numpy as np, dcn_cupy
        >>> x = np.zeros((2, 4, 8, 8), np.float32); w = np.zeros((6, 4, 3, 3), np.float32)
        >>> p = dcn_cupy.plan(x, w, padding=1)
        >>> p.output_shape
        (2, 6, 8, 8)
        >>> p.forward(x, w).shape
        (2, 6, 8, 8)
    """
    arrays = dict(zip(_NAMES, (input, weight, offset, mask, bias)))
    for name in ("input", "weight"):
        if arrays[name] is None:
            raise TypeError(f"{name} must be an array or a shape/dtype spec, got None")
    shapes, dtypes, devices = {}, {}, {}
    for name, a in arrays.items():
        if a is None:
            shapes[name] = None
            continue
        if _is_array(a):
            lib = library_of(a)
            native, dev, dev_id = lib.to_native(a, name)
            shapes[name] = tuple(native.shape)
            dtypes[name] = check_dtype(native.dtype, name)
            devices[name] = (dev, dev_id)
        else:
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                raise TypeError(f"{name} must be an array or an object with .shape and .dtype, "
                                f"got {type(a).__module__}.{type(a).__name__}")
            shapes[name] = tuple(int(d) for d in a.shape)
            dtypes[name] = _spec_dtype(a.dtype, name)
    dtype = dtypes["input"]
    for name, d in dtypes.items():
        if d != dtype:
            raise TypeError(f"{name} must have the same dtype as input ({dtype.name}), got {d.name}")
    if device is not None:
        where = _parse_device(device)
    elif devices:
        where = devices.get("input") or next(iter(devices.values()))
    else:
        where = ("cpu", 0)
    for name, d in devices.items():
        if d != where:
            raise ValueError(f"{name} must be on the plan's device {where[0]}"
                             f"{'' if where[0] == 'cpu' else ':' + str(where[1])}, got {d[0]}"
                             f"{'' if d[0] == 'cpu' else ':' + str(d[1])}")
    if not transposed and output_padding not in (0, None) and output_padding != (0,) * len(shapes["weight"][2:]):
        raise ValueError(f"output_padding applies to transposed=True only, got {output_padding!r}")
    return build_plan(bool(transposed), None, shapes, dtype, where[0], where[1], stride, padding, dilation, groups,
                      output_padding, deterministic, allow_tf32, algorithm)


# ---------------------------------------------------------------------------------------------
# the functional API's cache

#: Most plans the functional API keeps (least recently used ones are dropped).
PLAN_CACHE_SIZE = 256

_cache: "OrderedDict" = OrderedDict()
_cache_lock = threading.Lock()


def cached_plan(key, build) -> Plan:
    """The plan of ``key``, built by ``build()`` on a miss (outside the lock: building may
    compile kernels); concurrent first uses agree on one plan."""
    with _cache_lock:
        found = _cache.get(key)
        if found is not None:
            _cache.move_to_end(key)
            return found
    built = build()
    with _cache_lock:
        found = _cache.get(key)
        if found is not None:
            return found
        _cache[key] = built
        while len(_cache) > PLAN_CACHE_SIZE:
            _cache.popitem(last=False)
    return built


def clear_plan_cache() -> None:
    with _cache_lock:
        _cache.clear()


def plan_cache_size() -> int:
    return len(_cache)
