"""Backends: one module per kind of device, all with the same small interface.

A backend module provides, for native arrays (NumPy for ``cpu``, CuPy for ``cuda``) that are
C-contiguous, batched (``B >= 1``), of one dtype, with ``geom`` a ``ConvGeometry``:

``conv_forward(x, weight, offset, mask, bias, geom) -> y``
    ``y = deform_conv(x)``, shape ``geom.y_shape``; bias added when not None.
``conv_backward(grad_output, x, weight, offset, mask, geom, need_input, need_weight, need_offset, need_mask, bias=None)``
    ``(grad_x, grad_weight, grad_offset, grad_mask)`` in one pass over the batch, each None
    unless asked for (offset/mask gradients also when that argument is None); ``x`` may be None
    when only ``grad_x`` is wanted. ``grad_x`` is the adjoint of ``conv_forward`` in ``x``
    (shape ``geom.x_shape``), plus ``bias`` per channel when given: with ``need_input`` alone
    this is the transposed convolution's forward.
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
    """The folder of the CUDA sources (``.cu``/``.cuh``).

    Installed: ``dcn_cupy/cuda`` (pyproject maps the repository's ``cuda/`` there); from a
    checkout: ``<repo>/cuda``. The environment variable ``DCN_CUPY_CUDA_SOURCES`` overrides both.
    """
    import os
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent
    override = os.environ.get("DCN_CUPY_CUDA_SOURCES")
    candidates = ([Path(override)] if override else []) + [package / "cuda", package.parent / "cuda"]
    for folder in candidates:
        if folder.is_dir() and any(folder.glob("*.cu")):
            return folder
    raise FileNotFoundError(
        f"dcn_cupy's CUDA sources (*.cu) were not found in any of {[str(c) for c in candidates]}; "
        f"set DCN_CUPY_CUDA_SOURCES to their folder"
    )
