"""Command line: ``python -m dcn_cupy {info,check,demo,bench}`` (also installed as ``dcn-cupy``).

``info``
    Versions of dcn_cupy and its dependencies, the optional frameworks that import, and the
    backends available on this machine (with each CUDA device's name and compute capability).
``check [--device cpu|cuda|all] [--seed S] [-k TEXT]``
    Runs every public operation and gradient on every available backend against
    :mod:`dcn_cupy.reference` (forwards in every dtype, gradients against float64 finite
    differences of the reference) and prints a table; exits with 1 on any mismatch.
``demo [ARGS...]``
    Trains a small network with a deformable convolution on scikit-learn's digits using only
    the explicit forward/backward functions, and compares it with a plain convolution.
``bench [ARGS...]``
    ``benchmarks/gpu.py`` on a CUDA machine, else ``benchmarks/cpu.py``, found next to the
    package in a source checkout; ARGS are handed to the benchmark's ``main``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from dcn_cupy._geometry import conv_output_size

__all__ = ["main"]


# ---------------------------------------------------------------------------------------------
# environment probing


def _version_of(module) -> str:
    return str(getattr(module, "__version__", "unknown version"))


def _try_import(name: str):
    """``(module, None)`` or ``(None, reason)``; never raises."""
    try:
        return importlib.import_module(name), None
    except Exception as error:  # ImportError, or a broken installation (e.g. a CUDA library)
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        return None, reason[:120]


def cuda_devices() -> list:
    """``[(index, name, "major.minor")]`` of the visible CUDA devices; [] when none or no CuPy."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        devices = []
        for index in range(count):
            props = cupy.cuda.runtime.getDeviceProperties(index)
            name = props["name"]
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            devices.append((index, name, f"{props['major']}.{props['minor']}"))
        return devices
    except Exception:
        return []


def available_backends() -> list:
    """``["cpu"]``, plus ``"cuda"`` when CuPy imports and sees at least one device."""
    return ["cpu"] + (["cuda"] if cuda_devices() else [])


def _info(args) -> int:
    import dcn_cupy
    from dcn_cupy._backends import cpu

    rows = [
        ("dcn_cupy", f"{dcn_cupy.__version__} ({Path(dcn_cupy.__file__).parent})"),
        ("Python", f"{platform.python_version()} ({sys.executable})"),
        ("Platform", platform.platform()),
        ("NumPy", np.__version__),
        ("Numba", cpu.threading_layer()),
    ]
    ml_dtypes, reason = _try_import("ml_dtypes")
    rows.append(("ml_dtypes", _version_of(ml_dtypes) if ml_dtypes else f"not importable ({reason})"))
    for label, name in (("CuPy", "cupy"), ("PyTorch", "torch"), ("torchvision", "torchvision"), ("JAX", "jax")):
        module, reason = _try_import(name)
        if module is None:
            text = "not installed" if reason and "No module named" in reason else f"not importable ({reason})"
        else:
            text = _version_of(module)
            if name == "cupy":
                text += _cuda_versions(module)
        rows.append((label, text))
    width = max(len(label) for label, _ in rows)
    for label, text in rows:
        print(f"{label:<{width}}  {text}")

    print()
    print("Backends:")
    print("  cpu   Numba + NumPy (always available)")
    devices = cuda_devices()
    if devices:
        print("  cuda  CuPy")
        for index, name, capability in devices:
            print(f"        device {index}: {name}, compute capability {capability}")
        try:
            from dcn_cupy._backends import cuda_source_dir
            print(f"        CUDA sources: {cuda_source_dir()}")
        except Exception as error:
            print(f"        CUDA sources: not found ({error})")
    else:
        print("  cuda  none (no CuPy or no visible CUDA device)")
    return 0


def _cuda_versions(cupy) -> str:
    try:
        runtime = cupy.cuda.runtime.runtimeGetVersion()
        driver = cupy.cuda.runtime.driverGetVersion()

        def fmt(v):
            return f"{v // 1000}.{(v % 1000) // 10}"

        return f" (CUDA runtime {fmt(runtime)}, " + (f"driver {fmt(driver)})" if driver else "no CUDA driver)")
    except Exception:
        return " (no CUDA driver)"


# ---------------------------------------------------------------------------------------------
# check: every operation and gradient against the reference

_FORWARD_TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "float16": 5e-3, "bfloat16": 4e-2}
# Low-precision gradients are compared with the same backend's float64 gradients.
_BACKWARD_TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}
_GRADIENT_TOLERANCE = 1e-6  # float64 gradient vs central finite difference of the reference
_STEP = 1e-6
_ARGUMENTS = ("input", "weight", "offset", "mask", "bias")


@dataclass
class _Config:
    """One deformable convolution (or transposed one): float64 arrays and hyper-parameters."""

    ndim: int
    transposed: bool
    arrays: dict
    params: dict

    @property
    def name(self) -> str:
        return f"deform_conv_transpose{self.ndim}d" if self.transposed else f"deform_conv{self.ndim}d"

    def reference(self, arrays=None):
        from dcn_cupy import reference

        arrays = self.arrays if arrays is None else arrays
        fn = reference.deform_conv_transpose if self.transposed else reference.deform_conv
        return fn(**arrays, **self.params)


def _fractional_offsets(rng, shape):
    """Offsets whose fractional part lies in [0.2, 0.8]: sample positions stay off the kinks."""
    return rng.integers(-2, 3, size=shape) + rng.uniform(0.2, 0.8, size=shape)


# (C_in, C_out, groups, offset_groups, mask_groups, S, k, stride, padding, dilation[, output_padding])
_CONV_SPECS = {
    1: (4, 6, 2, 4, 2, (9,), (3,), (2,), (1,), (2,)),
    2: (4, 6, 2, 2, 1, (7, 6), (3, 2), (2, 1), (1, 0), (1, 2)),
    3: (4, 4, 2, 1, 2, (4, 5, 4), (2, 3, 2), (1, 2, 1), (0, 1, 1), (2, 1, 1)),
}
_TRANSPOSE_SPECS = {
    1: (4, 6, 2, 3, 2, (5,), (3,), (2,), (1,), (1,), (1,)),
    2: (4, 4, 2, 2, 4, (4, 3), (2, 3), (2, 1), (0, 1), (1, 2), (1, 0)),
    3: (2, 4, 2, 1, 2, (3, 3, 2), (2, 2, 3), (1, 2, 1), (0, 0, 1), (1, 1, 1), (0, 1, 0)),
}


def _make_config(rng, ndim: int, transposed: bool, batch: int = 2) -> _Config:
    if transposed:
        c_in, c_out, groups, g_o, g_m, size, kernel, stride, padding, dilation, out_pad = _TRANSPOSE_SPECS[ndim]
        grid = size  # offsets and masks live on the input grid
        weight_shape = (c_in, c_out // groups) + kernel
    else:
        c_in, c_out, groups, g_o, g_m, size, kernel, stride, padding, dilation = _CONV_SPECS[ndim]
        grid = tuple(conv_output_size(size[a], kernel[a], stride[a], padding[a], dilation[a]) for a in range(ndim))
        weight_shape = (c_out, c_in // groups) + kernel
    volume = int(np.prod(kernel))
    arrays = {
        "input": rng.standard_normal((batch, c_in) + size),
        "weight": rng.standard_normal(weight_shape),
        "offset": _fractional_offsets(rng, (batch, g_o * volume * ndim) + grid),
        "mask": rng.uniform(-1.0, 2.0, (batch, g_m * volume) + grid),
        "bias": rng.standard_normal(c_out),
    }
    params = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    if transposed:
        params["output_padding"] = out_pad
    return _Config(ndim, transposed, arrays, params)


@dataclass
class _Case:
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
        self.cupy = importlib.import_module("cupy") if backend == "cuda" else None

    def put(self, array, dtype: str):
        if array is None:
            return None
        host = np.asarray(array).astype(_np_dtype(dtype))
        if self.cupy is None:
            return host
        if dtype == "bfloat16":
            bits = self.cupy.asarray(host.view(np.uint16))
            return bits.view(host.dtype)
        return self.cupy.asarray(host)

    def get(self, array):
        if array is None:
            return None
        if self.cupy is not None and isinstance(array, self.cupy.ndarray):
            if np.dtype(array.dtype) == _np_dtype("bfloat16"):
                array = array.view(self.cupy.uint16).get().view(_np_dtype("bfloat16"))
            else:
                array = array.get()
        return np.asarray(array).astype(np.float64)


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _rounded(arrays: dict, dtype: str) -> dict:
    """The float64 values the arrays take after a round trip through ``dtype``."""
    return {k: None if a is None else a.astype(_np_dtype(dtype)).astype(np.float64) for k, a in arrays.items()}


def _relative(got, expected) -> float:
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    if got.shape != expected.shape:
        raise AssertionError(f"shape {got.shape}, expected {expected.shape}")
    if expected.size == 0:
        return 0.0
    diff = np.abs(got - expected)
    if not np.all(np.isfinite(got)):
        return math.inf
    scale = max(float(np.max(np.abs(expected))), 1e-300)
    return float(np.max(diff)) / scale


def _directional_error(analytic, fd, grad, direction) -> float:
    """|<grad, v> - FD| relative to |FD|, floored at a typical size of <grad, v>."""
    typical = float(np.linalg.norm(grad) * np.linalg.norm(direction)) / math.sqrt(max(direction.size, 1))
    scale = max(abs(fd), 0.01 * typical, 1e-300)
    if not math.isfinite(analytic):
        return math.inf
    return abs(analytic - fd) / scale


def _conv_cases(backend: str, dev: _Device, rng, dtypes: list) -> list:
    import dcn_cupy

    cases = []
    for transposed in (False, True):
        for ndim in (1, 2, 3):
            config = _make_config(rng, ndim, transposed)
            generic = "deform_conv_transpose" if transposed else "deform_conv"
            forward_nd = getattr(dcn_cupy, config.name)
            forward_generic = getattr(dcn_cupy, generic)
            backward_nd = getattr(dcn_cupy, config.name + "_backward")
            backward_generic = getattr(dcn_cupy, generic + "_backward")

            for dtype in dtypes:
                def run_forward(config=config, dtype=dtype, forward_nd=forward_nd, forward_generic=forward_generic):
                    arrays = {k: dev.put(a, dtype) for k, a in config.arrays.items()}
                    expected = config.reference(_rounded(config.arrays, dtype))
                    err = _relative(dev.get(forward_nd(**arrays, **config.params)), expected)
                    err_generic = _relative(dev.get(forward_generic(**arrays, **config.params)), expected)
                    return max(err, err_generic)

                cases.append(_Case(f"{config.name} forward", backend, dtype, _FORWARD_TOLERANCE[dtype], run_forward))

            # float64 gradients against finite differences of the reference forward.
            grad_output = rng.standard_normal(config.reference().shape)
            directions = {name: rng.standard_normal(a.shape) for name, a in config.arrays.items()}
            cache = {}

            def gradients(config=config, grad_output=grad_output, backward_nd=backward_nd, cache=cache):
                if "grads" not in cache:
                    arrays = {k: dev.put(a, "float64") for k, a in config.arrays.items()}
                    grads = backward_nd(dev.put(grad_output, "float64"), **arrays, **config.params)
                    cache["grads"] = {name: dev.get(getattr(grads, name)) for name in _ARGUMENTS}
                return cache["grads"]

            for name in _ARGUMENTS:
                def run_gradient(config=config, name=name, grad_output=grad_output, gradients=gradients,
                                 direction=directions[name]):
                    grad = gradients()[name]
                    if grad is None:
                        raise AssertionError(f"the {name} gradient is None")
                    if grad.shape != direction.shape:
                        raise AssertionError(f"{name} gradient shape {grad.shape}, expected {direction.shape}")

                    def objective(step):
                        arrays = dict(config.arrays)
                        arrays[name] = arrays[name] + step * direction
                        return float(np.sum(config.reference(arrays) * grad_output))

                    fd = (objective(_STEP) - objective(-_STEP)) / (2 * _STEP)
                    return _directional_error(float(np.sum(grad * direction)), fd, grad, direction)

                cases.append(_Case(f"{config.name} grad {name}", backend, "float64", _GRADIENT_TOLERANCE,
                                   run_gradient))

            # Low-precision gradients (generic entry point) against this backend's float64 ones.
            for dtype in dtypes:
                if dtype == "float64":
                    continue

                def run_low(config=config, dtype=dtype, grad_output=grad_output, backward_generic=backward_generic,
                            backward_nd=backward_nd):
                    rounded = _rounded(config.arrays, dtype)
                    gy = grad_output.astype(_np_dtype(dtype)).astype(np.float64)
                    low = backward_generic(dev.put(gy, dtype), **{k: dev.put(a, dtype) for k, a in rounded.items()},
                                           **config.params)
                    high = backward_nd(dev.put(gy, "float64"),
                                       **{k: dev.put(a, "float64") for k, a in rounded.items()}, **config.params)
                    errors = []
                    for name in _ARGUMENTS:
                        got, want = getattr(low, name), getattr(high, name)
                        if got is None or want is None:
                            raise AssertionError(f"the {name} gradient is None")
                        if np.dtype(got.dtype) != _np_dtype(dtype):
                            raise AssertionError(f"the {name} gradient has dtype {got.dtype}, expected {dtype}")
                        errors.append(_relative(dev.get(got), dev.get(want)))
                    return max(errors)

                cases.append(_Case(f"{config.name} backward (all 5 grads)", backend, dtype,
                                   _BACKWARD_TOLERANCE[dtype], run_low))
    return cases


def _mask_cases(backend: str, dev: _Device, rng, dtypes: list) -> list:
    import dcn_cupy
    from dcn_cupy import reference

    cases = []
    kernels = {1: (3,), 2: (3, 2), 3: (2, 2, 2)}
    grids = {1: (5,), 2: (4, 3), 3: (2, 3, 2)}
    for ndim in (1, 2, 3):
        kernel = kernels[ndim]
        volume = int(np.prod(kernel))
        logits = rng.standard_normal((2, 2 * volume) + grids[ndim]) * 2
        forward_nd = getattr(dcn_cupy, f"mask_softmax{ndim}d")
        for dtype in dtypes:
            def run_softmax(logits=logits, kernel=kernel, dtype=dtype, forward_nd=forward_nd):
                m = dev.put(logits, dtype)
                expected = reference.mask_softmax(_rounded({"m": logits}, dtype)["m"], kernel)
                err = _relative(dev.get(forward_nd(m, kernel)), expected)
                return max(err, _relative(dev.get(dcn_cupy.mask_softmax(m, kernel)), expected))

            cases.append(_Case(f"mask_softmax{ndim}d forward", backend, dtype, _FORWARD_TOLERANCE[dtype],
                               run_softmax))

        grad_output = rng.standard_normal(logits.shape)
        direction = rng.standard_normal(logits.shape)

        def run_softmax_grad(logits=logits, kernel=kernel, grad_output=grad_output, direction=direction,
                             forward_nd=forward_nd):
            y = forward_nd(dev.put(logits, "float64"), kernel)
            grad = dev.get(dcn_cupy.mask_softmax_backward(dev.put(grad_output, "float64"), y, kernel))

            def objective(step):
                return float(np.sum(reference.mask_softmax(logits + step * direction, kernel) * grad_output))

            fd = (objective(_STEP) - objective(-_STEP)) / (2 * _STEP)
            return _directional_error(float(np.sum(grad * direction)), fd, grad, direction)

        cases.append(_Case(f"mask_softmax{ndim}d grad", backend, "float64", _GRADIENT_TOLERANCE, run_softmax_grad))

    logits = rng.standard_normal((2, 9, 4, 5)) * 3
    scale = 2.0
    for dtype in dtypes:
        def run_sigmoid(dtype=dtype):
            expected = reference.mask_sigmoid(_rounded({"m": logits}, dtype)["m"], scale)
            return _relative(dev.get(dcn_cupy.mask_sigmoid(dev.put(logits, dtype), scale)), expected)

        cases.append(_Case("mask_sigmoid forward", backend, dtype, _FORWARD_TOLERANCE[dtype], run_sigmoid))

    grad_output = rng.standard_normal(logits.shape)
    direction = rng.standard_normal(logits.shape)

    def run_sigmoid_grad():
        y = dcn_cupy.mask_sigmoid(dev.put(logits, "float64"), scale)
        grad = dev.get(dcn_cupy.mask_sigmoid_backward(dev.put(grad_output, "float64"), y, scale))

        def objective(step):
            return float(np.sum(reference.mask_sigmoid(logits + step * direction, scale) * grad_output))

        fd = (objective(_STEP) - objective(-_STEP)) / (2 * _STEP)
        return _directional_error(float(np.sum(grad * direction)), fd, grad, direction)

    cases.append(_Case("mask_sigmoid grad", backend, "float64", _GRADIENT_TOLERANCE, run_sigmoid_grad))
    return cases


def build_cases(backends: list, seed: int) -> list:
    """Every check case for the given backends (a fresh seeded generator per backend)."""
    cases = []
    for backend in backends:
        dtypes = ["float64", "float32", "float16", "bfloat16"]
        rng = np.random.default_rng(seed)
        dev = _Device(backend)
        cases += _conv_cases(backend, dev, rng, dtypes)
        cases += _mask_cases(backend, dev, rng, dtypes)
    return cases


def _format_error(error: Optional[float]) -> str:
    if error is None:
        return "-"
    return f"{error:.2e}" if math.isfinite(error) else str(error)


def _check(args) -> int:
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
    width = len(str(len(cases)))
    start = time.perf_counter()
    for number, case in enumerate(cases, 1):
        prefix = f"[{number:>{width}}/{len(cases)}] {case.backend} {case.label} {case.dtype} ..."
        print(prefix, end=" ", flush=True)
        tic = time.perf_counter()
        try:
            case.error = case.run()
            ok = case.error is not None and math.isfinite(case.error) and case.error <= case.tolerance
            case.status = "ok" if ok else "MISMATCH"
        except Exception as error:  # report and go on: one broken case must not hide the others
            case.status = "ERROR"
            case.detail = f"{type(error).__name__}: {error}"
            if args.verbose:
                traceback.print_exc()
        note = f" ({case.detail})" if case.detail else ""
        print(f"{case.status} [err {_format_error(case.error)}, {time.perf_counter() - tic:.2f} s]{note}", flush=True)

    headers = ("case", "backend", "dtype", "max rel. error", "tolerance", "status")
    rows = [(c.label, c.backend, c.dtype, _format_error(c.error), f"{c.tolerance:.0e}", c.status) for c in cases]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    failed = [c for c in cases if c.status != "ok"]
    elapsed = time.perf_counter() - start
    print()
    if failed:
        print(f"FAILED: {len(failed)} of {len(cases)} cases mismatched or raised ({elapsed:.1f} s):")
        for c in failed:
            print(f"  {c.backend} {c.label} {c.dtype}: {c.status} "
                  f"(error {_format_error(c.error)}, tolerance {c.tolerance:.0e}){' ' + c.detail if c.detail else ''}")
        return 1
    print(f"all {len(cases)} cases passed ({elapsed:.1f} s)")
    return 0


# ---------------------------------------------------------------------------------------------
# bench


def benchmarks_dir() -> Path:
    """``benchmarks/`` of the source checkout this package was imported from (may not exist)."""
    import dcn_cupy

    return Path(dcn_cupy.__file__).resolve().parent.parent / "benchmarks"


def _load_script(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _bench(argv: list) -> int:
    folder = benchmarks_dir()
    if not folder.is_dir():
        print(f"The benchmarks are not installed with the package: {folder} does not exist. "
              f"Run `python -m dcn_cupy bench` from a source checkout of dcn_cupy "
              f"(the benchmarks/ folder next to the dcn_cupy/ package).", file=sys.stderr)
        return 2
    script = None
    if cuda_devices():
        gpu = folder / "gpu.py"
        if not gpu.is_file():
            print(f"A CUDA device is visible but {gpu} is missing: falling back to the CPU benchmark.", flush=True)
        elif importlib.util.find_spec("torch") is None:
            # gpu.py measures torchvision and cuDNN side by side and builds its inputs with torch.
            print("A CUDA device is visible but PyTorch is not installed, which the GPU benchmark needs: "
                  "falling back to the CPU benchmark.", flush=True)
        else:
            script = ("GPU", gpu)
    else:
        print("No CUDA device visible (or CuPy missing): running the CPU benchmark.", flush=True)
    if script is None:
        script = ("CPU", folder / "cpu.py")
    kind, path = script
    if not path.is_file():
        print(f"The {kind} benchmark {path} is missing.", file=sys.stderr)
        return 2
    module = _load_script(path, f"_dcn_cupy_benchmark_{kind.lower()}")
    result = module.main(list(argv))
    return int(result) if isinstance(result, (int, np.integer)) else 0


# ---------------------------------------------------------------------------------------------
# entry point


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dcn_cupy",
        description="dcn_cupy: framework-neutral deformable convolutions.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{info,check,bench,demo}")
    sub.required = True
    sub.add_parser("info", help="versions, optional frameworks and available backends")
    check = sub.add_parser("check", help="check every operation and gradient against the reference")
    check.add_argument("--device", choices=("cpu", "cuda", "all"), default="all",
                       help="backend(s) to check (default: every available one)")
    check.add_argument("--seed", type=int, default=0, help="seed of the random test data (default 0)")
    check.add_argument("-k", "--select", action="append", default=[], metavar="TEXT",
                       help="only cases whose 'backend label dtype' contains TEXT (repeatable)")
    check.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing cases")
    sub.add_parser("bench", help="benchmarks/gpu.py on a CUDA machine, else benchmarks/cpu.py "
                                 "(further arguments go to the benchmark; try `bench --help`)",
                   add_help=False)
    sub.add_parser("demo", help="train a small deformable CNN on scikit-learn's digits with the explicit "
                                "forward/backward functions (try `demo --help`)", add_help=False)
    return parser


def main(argv=None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # everything after `bench` belongs to the benchmark
        return _bench(argv[1:])
    if argv and argv[0] == "demo":  # everything after `demo` belongs to the demo
        from . import _demo
        return _demo.main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "info":
        return _info(args)
    if args.command == "check":
        return _check(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
