"""``python -m dcn_cupy check``: every public operation and gradient against the reference.

Forwards run in every dtype against :mod:`dcn_cupy.reference` (on inputs rounded to that
dtype); float64 gradients against central finite differences of the reference; low-precision
gradients against the same backend's float64 ones. One table is printed at the end.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from .testing import (ARGUMENTS, directional_error, fixed_case, max_relative_error, numpy_dtype,
                      rounded)

__all__ = ["Case", "build_cases", "run"]

FORWARD_TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "float16": 5e-3, "bfloat16": 4e-2}
# Low-precision gradients are compared with the same backend's float64 gradients.
BACKWARD_TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}
GRADIENT_TOLERANCE = 1e-6  # float64 gradient vs central finite difference of the reference
_STEP = 1e-6
DTYPES = ("float64", "float32", "float16", "bfloat16")


@dataclass
class Case:
    """One row of the table: a check to run and, once run, its outcome."""

    label: str            # e.g. "deform_conv2d forward"
    backend: str
    dtype: str
    tolerance: float
    run: Callable[[], float]   # returns the error
    error: Optional[float] = None
    status: str = "pending"
    detail: str = field(default="")


class _Device:
    """Moves float64 NumPy arrays to a backend in a dtype, and results back to float64 NumPy."""

    def __init__(self, backend: str):
        self.backend = backend
        if backend == "cuda":
            import cupy
            self.cupy = cupy
        else:
            self.cupy = None

    def put(self, array, dtype: str):
        if array is None:
            return None
        host = np.asarray(array).astype(numpy_dtype(dtype))
        if self.cupy is None:
            return host
        if dtype == "bfloat16":  # CuPy has no bfloat16 dtype: move the bits
            return self.cupy.asarray(host.view(np.uint16)).view(host.dtype)
        return self.cupy.asarray(host)

    def get(self, array):
        if array is None:
            return None
        if self.cupy is not None and isinstance(array, self.cupy.ndarray):
            if np.dtype(array.dtype) == numpy_dtype("bfloat16"):
                array = array.view(self.cupy.uint16).get().view(numpy_dtype("bfloat16"))
            else:
                array = array.get()
        return np.asarray(array).astype(np.float64)


def _central_difference(objective) -> float:
    return (objective(_STEP) - objective(-_STEP)) / (2 * _STEP)


def _conv_cases(backend: str, dev: _Device, rng) -> list:
    import dcn_cupy

    cases = []
    for transposed in (False, True):
        for ndim in (1, 2, 3):
            config = fixed_case(rng, ndim, transposed)
            generic = "deform_conv_transpose" if transposed else "deform_conv"
            forward_nd, forward_generic = config.forward, getattr(dcn_cupy, generic)
            backward_nd, backward_generic = config.backward, getattr(dcn_cupy, generic + "_backward")

            for dtype in DTYPES:
                def run_forward(config=config, dtype=dtype, forward_nd=forward_nd, forward_generic=forward_generic):
                    arrays = config.arrays(lambda a: dev.put(a, dtype))
                    expected = config.reference(rounded(config.arrays_, dtype))
                    err = max_relative_error(dev.get(forward_nd(**arrays, **config.params)), expected)
                    err_generic = max_relative_error(dev.get(forward_generic(**arrays, **config.params)), expected)
                    return max(err, err_generic)

                cases.append(Case(f"{config.name} forward", backend, dtype, FORWARD_TOLERANCE[dtype], run_forward))

            # float64 gradients against finite differences of the reference forward.
            grad_output = rng.standard_normal(config.reference().shape)
            directions = {name: rng.standard_normal(a.shape) for name, a in config.arrays_.items()}
            cache = {}

            def gradients(config=config, grad_output=grad_output, backward_nd=backward_nd, cache=cache):
                if "grads" not in cache:
                    grads = backward_nd(dev.put(grad_output, "float64"),
                                        **config.arrays(lambda a: dev.put(a, "float64")), **config.params)
                    cache["grads"] = {name: dev.get(getattr(grads, name)) for name in ARGUMENTS}
                return cache["grads"]

            for name in ARGUMENTS:
                def run_gradient(config=config, name=name, grad_output=grad_output, gradients=gradients,
                                 direction=directions[name]):
                    grad = gradients()[name]
                    if grad is None:
                        raise AssertionError(f"the {name} gradient is None")
                    if grad.shape != direction.shape:
                        raise AssertionError(f"{name} gradient shape {grad.shape}, expected {direction.shape}")

                    def objective(step):
                        arrays = dict(config.arrays_)
                        arrays[name] = arrays[name] + step * direction
                        return float(np.sum(config.reference(arrays) * grad_output))

                    fd = _central_difference(objective)
                    return directional_error(float(np.sum(grad * direction)), fd, grad, direction)

                cases.append(Case(f"{config.name} grad {name}", backend, "float64", GRADIENT_TOLERANCE, run_gradient))

            # Low-precision gradients (generic entry point) against this backend's float64 ones.
            for dtype in DTYPES[1:]:
                def run_low(config=config, dtype=dtype, grad_output=grad_output, backward_generic=backward_generic,
                            backward_nd=backward_nd):
                    low_inputs = rounded(config.arrays_, dtype)
                    gy = grad_output.astype(numpy_dtype(dtype)).astype(np.float64)
                    low = backward_generic(dev.put(gy, dtype), **{k: dev.put(a, dtype) for k, a in low_inputs.items()},
                                           **config.params)
                    high = backward_nd(dev.put(gy, "float64"),
                                       **{k: dev.put(a, "float64") for k, a in low_inputs.items()}, **config.params)
                    errors = []
                    for name in ARGUMENTS:
                        got, want = getattr(low, name), getattr(high, name)
                        if got is None or want is None:
                            raise AssertionError(f"the {name} gradient is None")
                        if np.dtype(got.dtype) != numpy_dtype(dtype):
                            raise AssertionError(f"the {name} gradient has dtype {got.dtype}, expected {dtype}")
                        errors.append(max_relative_error(dev.get(got), dev.get(want)))
                    return max(errors)

                cases.append(Case(f"{config.name} backward (all 5 grads)", backend, dtype,
                                  BACKWARD_TOLERANCE[dtype], run_low))
    return cases


def _mask_cases(backend: str, dev: _Device, rng) -> list:
    import dcn_cupy
    from dcn_cupy import reference

    cases = []
    kernels = {1: (3,), 2: (3, 2), 3: (2, 2, 2)}
    grids = {1: (5,), 2: (4, 3), 3: (2, 3, 2)}
    for ndim in (1, 2, 3):
        kernel = kernels[ndim]
        logits = rng.standard_normal((2, 2 * math.prod(kernel)) + grids[ndim]) * 2
        forward_nd = getattr(dcn_cupy, f"mask_softmax{ndim}d")
        for dtype in DTYPES:
            def run_softmax(logits=logits, kernel=kernel, dtype=dtype, forward_nd=forward_nd):
                m = dev.put(logits, dtype)
                expected = reference.mask_softmax(rounded({"m": logits}, dtype)["m"], kernel)
                err = max_relative_error(dev.get(forward_nd(m, kernel)), expected)
                return max(err, max_relative_error(dev.get(dcn_cupy.mask_softmax(m, kernel)), expected))

            cases.append(Case(f"mask_softmax{ndim}d forward", backend, dtype, FORWARD_TOLERANCE[dtype], run_softmax))

        grad_output = rng.standard_normal(logits.shape)
        direction = rng.standard_normal(logits.shape)

        def run_softmax_grad(logits=logits, kernel=kernel, grad_output=grad_output, direction=direction,
                             forward_nd=forward_nd):
            y = forward_nd(dev.put(logits, "float64"), kernel)
            grad = dev.get(dcn_cupy.mask_softmax_backward(dev.put(grad_output, "float64"), y, kernel))
            fd = _central_difference(lambda step: float(np.sum(
                reference.mask_softmax(logits + step * direction, kernel) * grad_output)))
            return directional_error(float(np.sum(grad * direction)), fd, grad, direction)

        cases.append(Case(f"mask_softmax{ndim}d grad", backend, "float64", GRADIENT_TOLERANCE, run_softmax_grad))

    logits = rng.standard_normal((2, 9, 4, 5)) * 3
    scale = 2.0
    for dtype in DTYPES:
        def run_sigmoid(dtype=dtype):
            expected = reference.mask_sigmoid(rounded({"m": logits}, dtype)["m"], scale)
            return max_relative_error(dev.get(dcn_cupy.mask_sigmoid(dev.put(logits, dtype), scale)), expected)

        cases.append(Case("mask_sigmoid forward", backend, dtype, FORWARD_TOLERANCE[dtype], run_sigmoid))

    grad_output = rng.standard_normal(logits.shape)
    direction = rng.standard_normal(logits.shape)

    def run_sigmoid_grad():
        y = dcn_cupy.mask_sigmoid(dev.put(logits, "float64"), scale)
        grad = dev.get(dcn_cupy.mask_sigmoid_backward(dev.put(grad_output, "float64"), y, scale))
        fd = _central_difference(lambda step: float(np.sum(
            reference.mask_sigmoid(logits + step * direction, scale) * grad_output)))
        return directional_error(float(np.sum(grad * direction)), fd, grad, direction)

    cases.append(Case("mask_sigmoid grad", backend, "float64", GRADIENT_TOLERANCE, run_sigmoid_grad))
    return cases


def build_cases(backends: list, seed: int) -> list:
    """Every check case for the given backends (a fresh seeded generator per backend)."""
    cases = []
    for backend in backends:
        rng = np.random.default_rng(seed)
        dev = _Device(backend)
        cases += _conv_cases(backend, dev, rng)
        cases += _mask_cases(backend, dev, rng)
    return cases


def _format_error(error: Optional[float]) -> str:
    if error is None:
        return "-"
    return f"{error:.2e}" if math.isfinite(error) else str(error)


class _Progress:
    """A one-line counter on a terminal (redrawn in place); a dot per case elsewhere."""

    def __init__(self, total: int, stream=None):
        self.total, self.stream = total, stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def step(self, done: int, case: Case) -> None:
        if self.tty:
            self.stream.write(f"\r[{done}/{self.total}] {case.backend} {case.label} {case.dtype}\033[K")
        else:
            self.stream.write("." if case.status == "ok" else case.status[0])
            if done % 60 == 0 or done == self.total:
                self.stream.write(f" {done}/{self.total}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def run_cases(cases: list, verbose: bool = False) -> float:
    """Run every case (one failure never hides the others); returns the elapsed seconds."""
    progress = _Progress(len(cases))
    start = time.perf_counter()
    for number, case in enumerate(cases, 1):
        try:
            case.error = case.run()
            ok = case.error is not None and math.isfinite(case.error) and case.error <= case.tolerance
            case.status = "ok" if ok else "MISMATCH"
        except Exception as error:
            case.status = "ERROR"
            case.detail = f"{type(error).__name__}: {error}"
            if verbose:
                progress.close()
                traceback.print_exc()
        progress.step(number, case)
    progress.close()
    return time.perf_counter() - start


def print_table(cases: list) -> None:
    headers = ("case", "backend", "dtype", "max rel. error", "tolerance", "status")
    rows = [(c.label, c.backend, c.dtype, _format_error(c.error), f"{c.tolerance:.0e}",
             c.status + (f" ({c.detail})" if c.detail else "")) for c in cases]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers[:-1])]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths + [0])).rstrip())
    print("  ".join("-" * w for w in widths + [len(headers[-1])]))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths + [0])).rstrip())


def run(args) -> int:
    from ._info import available_backends

    available = available_backends()
    if args.device == "all":
        backends = available
    elif args.device in available:
        backends = [args.device]
    else:
        print(f"error: backend {args.device!r} is not available here (available: {', '.join(available)}); "
              f"run `python -m dcn_cupy info` for details", file=sys.stderr)
        return 2

    cases = build_cases(backends, args.seed)
    if args.select:
        cases = [c for c in cases if any(s in f"{c.backend} {c.label} {c.dtype}" for s in args.select)]
        if not cases:
            print(f"error: no case matches {args.select}", file=sys.stderr)
            return 2

    print(f"dcn_cupy check: {len(cases)} cases on {', '.join(backends)} (seed {args.seed}); "
          f"the first run compiles the kernels", flush=True)
    elapsed = run_cases(cases, args.verbose)
    print()
    print_table(cases)
    failed = [c for c in cases if c.status != "ok"]
    print()
    if failed:
        print(f"FAILED: {len(failed)} of {len(cases)} cases mismatched or raised ({elapsed:.1f} s)")
        return 1
    print(f"all {len(cases)} cases passed ({elapsed:.1f} s)")
    return 0
