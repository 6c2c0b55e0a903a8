"""Backends: one module per kind of device, all with the same small interface.

A backend module provides, for native arrays (NumPy for ``cpu``, CuPy for ``cuda``) that are
C-contiguous, batched (``B >= 1``), of one dtype, with ``geom`` a ``ConvGeometry``:

``conv_forward(x, weight, offset, mask, bias, geom) -> y``
    ``y = deform_conv(x)``, shape ``geom.y_shape``; bias added when not None.
``conv_backward_input(grad_output, weight, offset, mask, bias, geom) -> grad_x``
    The adjoint of ``conv_forward`` in ``x`` (shape ``geom.x_shape``), plus bias per channel
    when not None: this is also the transposed convolution's forward.
``conv_backward_params(grad_output, x, weight, offset, mask, geom, need_weight, need_offset, need_mask)``
    ``(grad_weight, grad_offset, grad_mask)``, each None unless asked for.
``device_context(device_id)``
    A context manager that makes the device current.
``xp``
    The array module of its native arrays (``numpy`` or ``cupy``), used by ``_api`` for the
    element-wise work (bias gradient, mask activations).

``offset`` and ``mask`` may be None (no offset: the integer grid; no mask: 1). Backends never
see foreign arrays and never re-validate; they never write into their arguments.
"""

from __future__ import annotations

import importlib

_BACKENDS = {"cpu": "dcn_cupy._backends.cpu", "cuda": "dcn_cupy._backends.cuda"}


def get_backend(device: str):
    """The backend module serving arrays on ``device`` ("cpu" or "cuda")."""
    return importlib.import_module(_BACKENDS[device])


def cuda_source_dir():
    """The folder of the CUDA sources: ``dcn_cupy/cuda`` when installed, ``cuda/`` in a checkout."""
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "cuda", package.parent / "cuda"):
        if candidate.is_dir() and any(candidate.glob("*.cu")):
            return candidate
    raise FileNotFoundError(f"CUDA sources not found in {package / 'cuda'} or {package.parent / 'cuda'}")
