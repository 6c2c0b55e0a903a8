"""A/B of a backend switch: its values take turns in one process, on one GPU.

    python benchmarks/ab.py cuda_fused_backward.EARLY_COPIES --cases 3dt-fp32,2dt-fp32 --rounds 5
    python benchmarks/ab.py cuda.GEMM_SPLITS --values 4,8,12 --cases 3dt-fp32

``SWITCH`` is ``MODULE.NAME``: a module-level setting of ``dcn_cupy._backends.MODULE`` (or of
``dcn_cupy._plan``), read when a plan is built or a launch list recorded; or ``plan.KEYWORD``, a
keyword of ``dcn_cupy.plan`` (``plan.deterministic``: the cost of deterministic mode, each shape
in one process). ``--deterministic`` builds every plan deterministic. ``--set MODULE.NAME=VALUE``
(repeatable) holds another setting at VALUE for the whole run: one switch's A/B with another one
on. ``--values`` are Python literals (default ``False,True``). A value may repeat: a second plan
with the same value shows how far two plans of one value differ, which is the noise floor.

A case is ``SHAPE-PRECISION``:
- SHAPE is one of c256, c64, 14, 1d, 3d (``gpu.py``'s SHAPES, in order), or 2dt, 3dt (its
  TRANSPOSED_SHAPES: stride 2, padding 1, output padding 1), or a KEY of ``--shape
  KEY=B,C_in,C_out,S`` (gpu.py's ``--shape`` format: a 'same' 3^N convolution, S like 56x56;
  ``--shape c128=8,128,128,56x56 --cases c128-fp32``);
- PRECISION is fp32 (strict), tf32, fp16 or bf16.

Each case builds one plan per value, with the switch set, on ``gpu.py``'s inputs (seed 0). Then
the values take turns, round after round. In each turn the switch is set again and the plan is
timed on forward+backward and on the backward alone (``gpu.py``'s CUDA-event timing). Last,
each value's forward+backward runs once more under ``gpu.py``'s memory hook: its peak extra MiB in
CuPy's pool (outputs, gradients and workspace). The table gives each value's best time over the
rounds, its ratio to the first value's, and that peak. The switch gets its old value back at the
end.

The A/Bs of sessions 29-49 (``scratch/ab*.py``, ``NOTES-gpu.md``) were done this way. Compare
figures only within one run. Needs CuPy, a CUDA device and PyTorch (for gpu.py's inputs).
Without them it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dcn_cupy import _bench  # noqa: E402

_gpu = _bench.load_script(Path(__file__).resolve().parent / "gpu.py", "_ab_gpu")

#: Case names of gpu.py's shapes.
SHAPE_KEYS = ("c256", "c64", "14", "1d", "3d", "2dt", "3dt")


def shapes() -> dict:
    """SHAPE_KEYS -> gpu.py's shape dicts (SHAPES, then TRANSPOSED_SHAPES)."""
    return dict(zip(SHAPE_KEYS, _gpu.SHAPES + _gpu.TRANSPOSED_SHAPES))


def parse_shape(text: str) -> tuple:
    """``"c128=8,128,128,56x56"`` -> ("c128", a gpu.py shape dict): a shape of one's own for
    ``--cases``, B,C_in,C_out,S after KEY= (a 'same' 3^N convolution)."""
    key, _, spec = text.partition("=")
    key = key.strip()
    try:
        if not key or "-" in key or "," in key or key in SHAPE_KEYS:
            raise ValueError
        shape = _gpu.parse_shape(spec, key)
    except ValueError:
        raise ValueError(f"--shape must be KEY=B,C_in,C_out,S with a KEY of its own (no '-' or ',', not one of "
                         f"{', '.join(SHAPE_KEYS)}) and S like 56x56, got {text!r}") from None
    return key, shape


def parse_cases(text: str, extra=None) -> list:
    """``"3dt-fp32,14-tf32"`` -> [(shape dict, precision, case name), ...]; ``extra``: the
    ``--shape`` keys' shapes."""
    found, known = [], {**shapes(), **(extra or {})}
    for case in (c.strip() for c in text.split(",")):
        key, _, precision = case.partition("-")
        if key not in known or precision not in _gpu.PRECISIONS:
            raise ValueError(f"a case must be SHAPE-PRECISION with SHAPE in {', '.join(known)} and "
                             f"PRECISION in {', '.join(_gpu.PRECISIONS)}, got {case!r}")
        found.append((known[key], precision, case))
    return found


def parse_values(text: str) -> list:
    """``"False,True,2"`` -> [False, True, 2]: Python literals, each at least once."""
    try:
        values = [ast.literal_eval(v.strip()) for v in text.split(",")]
    except (ValueError, SyntaxError):
        raise ValueError(f"--values must be comma-separated Python literals (e.g. False,True or 4,8), "
                         f"got {text!r}") from None
    if len(values) < 2:
        raise ValueError(f"--values needs at least two values to compare, got {text!r}")
    return values


def resolve_switch(name: str):
    """``"MODULE.NAME"`` -> (the module, NAME): a module of ``dcn_cupy._backends`` (or
    ``dcn_cupy._plan``) that has that module-level setting; ``"plan.KEYWORD"`` -> (None, KEYWORD)."""
    module_name, _, attribute = name.partition(".")
    if not module_name or not attribute or "." in attribute:
        raise ValueError(f"the switch must be MODULE.NAME (e.g. cuda_fused_backward.EARLY_COPIES) or "
                         f"plan.KEYWORD, got {name!r}")
    if module_name == "plan":
        import inspect

        import dcn_cupy
        if attribute not in inspect.signature(dcn_cupy.plan).parameters:
            raise ValueError(f"dcn_cupy.plan has no keyword {attribute!r}")
        return None, attribute
    path = "dcn_cupy._plan" if module_name == "_plan" else f"dcn_cupy._backends.{module_name}"
    try:
        module = importlib.import_module(path)
    except ImportError as error:
        raise ValueError(f"the switch's module {path} cannot be imported: {error}") from None
    if not hasattr(module, attribute):
        raise ValueError(f"{path} has no setting {attribute!r}")
    return module, attribute


def parse_setting(text: str) -> tuple:
    """``"cuda_fused_backward.WS_LOADS_AHEAD=False"`` -> ("dcn_cupy._backends.cuda_fused_backward",
    "WS_LOADS_AHEAD", False): a module-level setting that ``ab.py`` can switch (of a module of
    dcn_cupy._backends, or of dcn_cupy._plan), and a Python literal; ValueError naming what is
    wrong otherwise."""
    switch, equals, literal = text.partition("=")
    module, name = resolve_switch(switch.strip()) if equals else (None, None)
    if module is None:   # (no "=", or ab's plan.KEYWORD: not a module's setting)
        raise ValueError(f"expected MODULE.NAME=VALUE (e.g. cuda_fused_backward.WS_LOADS_AHEAD=False), got {text!r}")
    try:
        value = ast.literal_eval(literal.strip())
    except (ValueError, SyntaxError):
        raise ValueError(f"{text!r}: the value {literal.strip()!r} is not a Python literal") from None
    return module.__name__, name, value


def _case_arguments(shape: dict, precision: str):
    """(plan arguments, grad_output, plan keywords) on gpu.py's inputs: a 'same' 3^N convolution,
    or gpu.py's transposed case for the transposed shapes."""
    if shape.get("transposed"):
        return _gpu.transposed_case(shape, precision)
    x, w, b, off, msk, gy = _gpu._as_cupy(*_gpu._make_inputs(shape, _gpu._set_precision(precision)))
    return (x, w, off, msk, b), gy, dict(padding=1, allow_tf32=_gpu._allow_tf32(precision))


def _set(module, attribute: str, value) -> None:
    if module is not None:   # (a plan keyword is the plan's own)
        setattr(module, attribute, value)


def run_case(module, attribute: str, values: list, shape: dict, precision: str, rounds: int, timing: tuple,
             deterministic: bool = False) -> list:
    """[(value, best f+b ms, best backward ms, f+b peak MiB, plan description)] for one case
    (``module`` None: ``attribute`` is a plan keyword)."""
    import dcn_cupy

    args, gy, keywords = _case_arguments(shape, precision)
    keywords = dict(keywords, deterministic=True) if deterministic else keywords
    plans = []
    for value in values:
        _set(module, attribute, value)
        plans.append(dcn_cupy.plan(*args, **(keywords if module is not None else dict(keywords, **{attribute: value}))))
    both = [math.inf] * len(values)
    backward = [math.inf] * len(values)

    def step(p):   # (its outputs returned: held to the end of a peak's measurement)
        return p.forward(*args), p.backward(gy, *args)

    for _ in range(rounds):
        for i, (value, p) in enumerate(zip(values, plans)):
            _set(module, attribute, value)
            both[i] = min(both[i], _gpu._time_cupy(lambda p=p: step(p), *timing))
            backward[i] = min(backward[i], _gpu._time_cupy(lambda p=p: p.backward(gy, *args), *timing))
    peaks = []
    for value, p in zip(values, plans):
        _set(module, attribute, value)
        peaks.append(_gpu._peak_cupy(lambda p=p: step(p)))
    return [(value, f, b, peak, p.algorithm) for value, f, b, peak, p in zip(values, both, backward, peaks, plans)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/ab.py", description=__doc__.splitlines()[0])
    parser.add_argument("switch", help="MODULE.NAME, e.g. cuda_fused_backward.EARLY_COPIES")
    parser.add_argument("--values", default="False,True", help="comma-separated Python literals (default False,True)")
    parser.add_argument("--cases", default="3dt-fp32", help=f"SHAPE-PRECISION,... (SHAPE: {', '.join(SHAPE_KEYS)}, "
                        "or a --shape KEY)")
    parser.add_argument("--shape", action="append", default=[],
                        help="KEY=B,C_in,C_out,S: a shape of one's own for --cases (repeatable)")
    parser.add_argument("--rounds", type=int, default=3, help="turns of every value (default 3)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="another module-level setting held at VALUE for the whole run (repeatable), e.g. "
                             "to A/B one switch with another one on")
    parser.add_argument("--deterministic", action="store_true", help="every plan deterministic")
    parser.add_argument("--json", default=None, help="write the results as JSON to this path (default: nowhere)")
    args = parser.parse_args(argv)
    try:
        values = parse_values(args.values)
        cases = parse_cases(args.cases, dict(parse_shape(text) for text in args.shape))
    except ValueError as error:
        parser.error(str(error))
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    reason = _gpu.no_gpu_reason() or (None if _bench.torch_installed() else "PyTorch is not installed")
    if reason is not None:
        print(f"benchmarks/ab.py: {reason}: nothing to measure.")
        return 0
    try:
        module, attribute = resolve_switch(args.switch)
    except ValueError as error:
        parser.error(str(error))
    try:
        held_modules = [(importlib.import_module(path), name, value)
                        for path, name, value in (parse_setting(text) for text in args.set)]
    except ValueError as error:
        parser.error(f"--set: {error}")
    if any(m is module and name == attribute for m, name, _ in held_modules):
        parser.error(f"--set holds {args.switch}, the switch that the A/B turns")
    old = getattr(module, attribute) if module is not None else None
    held_old = [getattr(m, name) for m, name, _ in held_modules]
    results = []
    try:
        for m, name, value in held_modules:
            setattr(m, name, value)
        for shape, precision, name in cases:
            rows = run_case(module, attribute, values, shape, precision, args.rounds,
                            (args.warmup, args.repeats, args.inner), args.deterministic)
            for value, f, b, peak, algorithm in rows:
                results.append({"case": name, "shape": shape["name"], "precision": precision, "value": repr(value),
                                "fwdbwd_ms": f, "bwd_ms": b, "fwdbwd_peak_mib": peak, "algorithm": algorithm})
            print(f"{name}: {rows[0][4]}", flush=True)
    finally:
        _set(module, attribute, old)
        for (m, name, _), value in zip(held_modules, held_old):
            setattr(m, name, value)
    holding = "".join(f", {text.strip()}" for text in args.set)
    print(f"\n{args.switch} on {_gpu._device_name()}{holding}: the best of {args.rounds} rounds, ms "
          f"(ratio: over the first value's), and the f+b peak extra MiB")
    print("| case | value | f+b | backward | f+b ratio | backward ratio | f+b peak MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    first = {}
    for r in results:
        base = first.setdefault(r["case"], r)
        print(f"| {r['case']} | {r['value']} | {r['fwdbwd_ms']:.4f} | {r['bwd_ms']:.4f} | "
              f"{r['fwdbwd_ms'] / base['fwdbwd_ms']:.3f} | {r['bwd_ms'] / base['bwd_ms']:.3f} | "
              f"{r['fwdbwd_peak_mib']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"switch": args.switch, "rounds": args.rounds,
                                               "device": _gpu._device_name(), "results": results}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
