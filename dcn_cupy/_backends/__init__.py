"""Backends: the typed contract every algorithm implements, and the registry plans choose from.

A backend serves one kind of device (``"cpu"``, ``"cuda"``) with one algorithm (``"numba"``,
``"im2col"``, ``"fused"``, ...). For a :class:`PlanSpec` (geometry, dtype, device, flags) and
a *primitive*, it says whether it serves the configuration and builds an :class:`Executable`
holding everything that does not change between calls. Two primitives exist:

``"conv_forward"``
    ``y = deform_conv(x) (+ bias)``; ``run(args, out, workspace)`` with ``args`` keys
    ``input, weight, offset, mask, bias`` and ``out`` the output array (``geom.y_shape``).
``"conv_backward"``
    the gradients named in ``args["wanted"]`` (a frozenset of ``"input", "weight", "offset",
    "mask"``); ``args`` keys ``grad_output, input`` (None when only the input gradient is
    wanted), ``weight, offset, mask, bias`` (``bias``: C_in-long, added to the input gradient:
    the transposed convolution's forward) and ``out`` a dict name -> array to fill
    (``grad_input`` is ``out["input"]`` of shape ``geom.x_shape``, and so on).

The transposed convolution is composed from these two in ``_plan`` (design section 1).
Backends receive native arrays (NumPy / CuPy) that are validated, batched (``B >= 1``) and
C-contiguous within each sample (the batch axis may have any stride, 0 included); they never
re-validate and never write into their inputs. CUDA arrays are used on CuPy's current device
and stream. ``offset``/``mask``/``bias`` may be None.

A new algorithm is added by registering it, without editing the core::

    from dcn_cupy._backends import register
    register(MyFusedBackend())            # device "cuda", algorithm "fused", priority 10

Backends whose module imports an optional library (CuPy) are registered lazily with
:func:`register_lazy`.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import numpy as np

from .._geometry import ConvGeometry

__all__ = ["PlanSpec", "Backend", "Executable", "PRIMITIVES", "register", "register_lazy", "unregister",
           "candidates", "backend_named",
           "get_backend", "use_algorithm", "forced_algorithm", "choose", "cuda_source_dir"]

PRIMITIVES = ("conv_forward", "conv_backward")


@dataclass(frozen=True)
class PlanSpec:
    """What an executable is built for.

    ``geom`` is the CONVOLUTION geometry (a transposed op uses the geometry of the convolution
    it is the adjoint of). ``transposed``: the plan is of the transposed operation, which calls
    ``conv_backward`` for its forward (the input gradient alone) and for its backward (without
    it); a backend that times candidates may time that use.
    """

    geom: ConvGeometry
    dtype: np.dtype
    device: str              # "cpu" | "cuda"
    device_id: int
    deterministic: bool
    allow_tf32: bool
    transposed: bool = False


@runtime_checkable
class Executable(Protocol):
    """What a backend builds for one primitive of one plan.

    Optionally (CUDA), ``pointer_path = True`` and ``run_pointers``, the same computation on raw
    device addresses of C-contiguous batched arrays and an explicit ``cudaStream_t``, for the
    plan's one-pass and adapter paths (``Plan.launch_forward/launch_backward``):
    ``run_pointers((x, w, offset, mask, bias), out, workspace, stream)`` for ``conv_forward``,
    ``run_pointers((grad_output, x, w, offset, mask, bias), wanted, (grad_x, grad_w, grad_offset,
    grad_mask), workspace, stream)`` for ``conv_backward`` (0 for an absent or unwanted one).

    Optionally, a ``conv_backward`` executable with ``bias_gradient = True`` computes the bias
    gradient (the sum of grad_output over all but the channel axis) itself: the plan of a
    (non-transposed) convolution then puts ``"bias"`` in ``wanted`` and passes its output in
    ``out["bias"]`` (``run``) or as a fifth gradient address (``run_pointers``), and launches no
    separate reduction. With ``bias_gradient_with`` (a frozenset of gradient names) it does so
    only where one of those is wanted too; elsewhere the plan reduces grad_output itself.

    Optionally, a ``conv_forward`` executable with ``summing_workspace_bytes`` also sums its
    input over all but the channel axis where asked (``input_sums``: an address for
    ``run_pointers``/``record``, an array as ``args["input_sums"]`` for ``run``), given a
    workspace of that size: a transposed convolution's plan takes its bias gradient so, beside
    the input gradient that this forward computes.
    """

    workspace_bytes: int
    description: str         # one line, e.g. "cuda/im2col: 2 chunks of 4 samples, 32-bit index"

    def run(self, args: dict, out, workspace) -> None:
        """Compute the primitive into ``out``; ``workspace`` is a 1-D uint8 buffer of at least
        ``workspace_bytes`` bytes on the device, or None when ``workspace_bytes`` is 0."""


@runtime_checkable
class Backend(Protocol):
    device: str              # "cpu" | "cuda"
    algorithm: str           # "numba", "im2col", "fused", ...
    priority: int            # higher wins among those that serve a primitive

    def serves(self, spec: PlanSpec, primitive: str) -> Optional[str]:
        """None when it serves ``primitive`` for ``spec``; else a one-line reason why not."""

    def build(self, spec: PlanSpec, primitive: str) -> Executable:
        """The executable of ``primitive`` for ``spec``."""


# ---------------------------------------------------------------------------------------------
# registry


_registry: dict = {}         # "device/algorithm" -> backend
_lock = threading.Lock()


def register(backend) -> None:
    """Register (or replace) the backend ``backend.device/backend.algorithm``."""
    with _lock:
        _registry[f"{backend.device}/{backend.algorithm}"] = backend


def unregister(name: str) -> None:
    """Remove the backend registered as ``"device/algorithm"`` (if any)."""
    with _lock:
        _registry.pop(name, None)


class _Lazy:
    """A backend whose module is imported on first use (``module:attribute``)."""

    def __init__(self, device: str, algorithm: str, priority: int, target: str):
        self.device, self.algorithm, self.priority, self._target = device, algorithm, priority, target
        self._backend = None

    def _load(self):
        if self._backend is None:
            module, attribute = self._target.split(":")
            self._backend = getattr(importlib.import_module(module), attribute)
        return self._backend

    @property
    def primitives(self):
        return getattr(self._load(), "primitives", PRIMITIVES)

    def serves(self, spec, primitive):
        return self._load().serves(spec, primitive)

    def recommends(self, spec, primitive):
        recommends = getattr(self._load(), "recommends", None)
        return None if recommends is None else recommends(spec, primitive)

    def build(self, spec, primitive):
        return self._load().build(spec, primitive)


def register_lazy(device: str, algorithm: str, priority: int, target: str) -> None:
    """Register a backend object ``target`` (``"package.module:attribute"``) imported on first use."""
    register(_Lazy(device, algorithm, priority, target))


def candidates(device: str) -> list:
    """The backends of ``device``, highest priority first."""
    with _lock:
        found = [b for b in _registry.values() if b.device == device]
    return sorted(found, key=lambda b: -b.priority)


def backend_named(name: str):
    """The backend registered as ``"device/algorithm"``; ValueError naming the known ones."""
    backend = _registry.get(name)
    if backend is None:
        raise ValueError(f"algorithm must be one of {sorted(_registry)}, got {name!r}")
    return backend


def choose(spec: PlanSpec, primitive: str, forced: Optional[str] = None):
    """``(backend, None)`` of the backend that builds ``primitive`` for ``spec``, or
    ``(None, reason)`` when none serves it.

    A forced algorithm is used for every primitive it implements (a ValueError naming why
    when it does not serve the configuration); other primitives are chosen automatically.
    """
    if forced is not None:
        backend = backend_named(forced)
        if backend.device != spec.device:
            raise ValueError(f"algorithm {forced!r} runs on {backend.device} arrays, got arrays on {spec.device}")
        if primitive in getattr(backend, "primitives", PRIMITIVES):
            reason = backend.serves(spec, primitive)
            if reason is not None:
                raise ValueError(f"algorithm {forced!r} does not serve this {primitive}: {reason}")
            return backend, None
    reasons = []
    for backend in candidates(spec.device):
        if primitive not in getattr(backend, "primitives", PRIMITIVES):
            continue
        reason = backend.serves(spec, primitive)
        if reason is None:
            # What a backend can compute but is not the best choice for (measured slower) it
            # says through ``recommends``; it stays available to a forced choice.
            recommends = getattr(backend, "recommends", None)
            reason = recommends(spec, primitive) if recommends is not None else None
        if reason is None:
            return backend, None
        reasons.append(f"{backend.device}/{backend.algorithm}: {reason}")
    return None, f"no algorithm serves {primitive} on {spec.device} (" + "; ".join(reasons or ["none registered"]) + ")"


_forced = threading.local()


@contextlib.contextmanager
def use_algorithm(name: Optional[str]):
    """Force ``name`` (e.g. ``"cuda/im2col"``) for the functional API's plans built in this
    thread (it is part of their cache key; :func:`dcn_cupy.plan` takes ``algorithm=`` instead).
    ``None`` restores the automatic choice."""
    if name is not None:
        backend_named(name)
    previous = getattr(_forced, "name", None)
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = previous


def forced_algorithm() -> Optional[str]:
    """The algorithm forced by :func:`use_algorithm` in this thread, or None."""
    return getattr(_forced, "name", None)


_cuda_settings = None


def cuda_settings() -> tuple:
    """The CUDA backends' module settings (workspace limits, tile sizes, cuda/direct's size
    limits), read when their executables are built or chosen: part of the functional API's
    plan key, so that a changed setting builds new plans."""
    global _cuda_settings
    if _cuda_settings is None:
        _cuda_settings = tuple(importlib.import_module(f"dcn_cupy._backends.{name}").settings
                               for name in ("cuda", "cuda_direct", "cuda_fused"))
    return tuple(settings() for settings in _cuda_settings)


def get_backend(device: str):
    """The backend module of ``device`` (``cpu`` / ``cuda``): its ``xp`` and ``device_context``."""
    return importlib.import_module(f"dcn_cupy._backends.{device}")


# ---------------------------------------------------------------------------------------------
# the built-in backends


class _NumbaBackend:
    """``cpu/numba``: the Numba loops (along positions) and BLAS GEMMs of ``cpu.py``."""

    device = "cpu"
    algorithm = "numba"
    priority = 0
    primitives = PRIMITIVES
    module = "cpu"
    summary = "sampling plan + BLAS, loops along positions, chunked over the batch"

    def serves(self, spec, primitive):
        return None

    def build(self, spec, primitive):
        return _NumbaExecutable(self, spec, primitive)


class _ChannelsLastBackend(_NumbaBackend):
    """``cpu/channels-last``: ``cpu_channels_last.py``'s loops along channels, chosen where every
    run of channels of one offset, mask and conv group is long enough to fill them."""

    algorithm = "channels-last"
    priority = 10
    module = "cpu_channels_last"
    summary = "sampling plan + BLAS, loops along channels of a channels-last copy, chunked over the batch"

    def recommends(self, spec, primitive):
        from . import cpu_channels_last as cl
        run = cl.channel_run(spec.geom)
        if run < cl.MIN_CHANNELS:
            return (f"runs of {run} channels share an offset, mask and conv group, under the "
                    f"{cl.MIN_CHANNELS} its loops along channels need (cpu/numba loops along positions)")
        return None


class _NumbaExecutable:
    workspace_bytes = 0

    def __init__(self, backend, spec, primitive):
        self._cpu = importlib.import_module(f"dcn_cupy._backends.{backend.module}")  # entry points looked up per call
        self.geom = spec.geom
        self.primitive = primitive
        self.description = f"cpu/{backend.algorithm}: {backend.summary}" + (
            "; deterministic (no atomics: bitwise repeatable at any thread count)" if spec.deterministic else "")

    def run(self, args, out, workspace):
        cpu, geom = self._cpu, self.geom
        if self.primitive == "conv_forward":
            y = cpu.conv_forward(args["input"], args["weight"], args["offset"], args["mask"], args["bias"], geom,
                                 out=out)
            if y is not out:
                out[...] = y
            return
        grads = cpu.conv_backward(args["grad_output"], args["input"], args["weight"], args["offset"],
                                  args["mask"], geom, args["wanted"], bias=args.get("bias"))
        for name, value in zip(("input", "weight", "offset", "mask"), grads):
            target = out.get(name)
            if target is not None and value is not None:
                target[...] = value


register(_NumbaBackend())
register(_ChannelsLastBackend())
register_lazy("cuda", "im2col", 0, "dcn_cupy._backends.cuda:BACKEND")
register_lazy("cuda", "im2col-deterministic", -1, "dcn_cupy._backends.cuda_deterministic:BACKEND")
register_lazy("cuda", "fused", 20, "dcn_cupy._backends.cuda_fused:BACKEND")
register_lazy("cuda", "fused-backward", 20, "dcn_cupy._backends.cuda_fused_backward:BACKEND")
register_lazy("cuda", "direct", 30, "dcn_cupy._backends.cuda_direct:BACKEND")


def cuda_source_dir():
    """The folder of the CUDA sources (``.cu``/``.cuh``).

    Installed: ``dcn_cupy/cuda`` (pyproject maps the repository's ``cuda/`` there); from a
    checkout: ``<repo>/cuda``. The environment variable ``DCN_CUPY_CUDA_SOURCES`` overrides both.
    """
    import os
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent
    override = os.environ.get("DCN_CUPY_CUDA_SOURCES")
    candidates_ = ([Path(override)] if override else []) + [package / "cuda", package.parent / "cuda"]
    for folder in candidates_:
        if folder.is_dir() and any(folder.glob("*.cu")):
            return folder
    raise FileNotFoundError(
        f"dcn_cupy's CUDA sources (*.cu) were not found in any of {[str(c) for c in candidates_]}; "
        f"set DCN_CUPY_CUDA_SOURCES to their folder"
    )
