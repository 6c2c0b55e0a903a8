"""GPU benchmark: dcn_cupy against torchvision.ops.deform_conv2d and dense cuDNN conv2d.

All in one process, on one GPU, same shapes, each timed with CUDA events (warm-up first,
median of several repeats of a loop of launches):

* 2D, DCNv2 (offset + mask), 3x3, padding 1: B=8 C 256->256 56x56, and B=32 C 64->64 56x56;
  dcn_cupy, torchvision's deform_conv2d and torch's dense conv2d;
* 3D, B=2 C 32->32 32^3, 3x3x3, padding 1, offset + mask: dcn_cupy only (forward,
  forward+backward and the transposed forward);
* transposed, stride 2 (S -> 2S), forward and forward+backward, dcn_cupy only (tvdcn's numbers
  are in DESIGN section 5): 2D B=8 C128 28x28 and 3D B=2 C32 16^3 (``--only 2d`` / ``3d`` take
  them too).

dcn_cupy runs through plans (``dcn_cupy.plan``, validated once; each call allocates its
output, gradients and workspace from CuPy's pool, as the functional API does). Rows:
``dcn_cupy`` is the automatic choice (cuda/fused forward for fp16/bf16, cuda/im2col
otherwise; ``plan.algorithm`` is in the JSON); ``dcn_cupy cuda/im2col`` and ``dcn_cupy
cuda/fused`` force that algorithm where the automatic choice took the other one (forced
cuda/fused computes float32 in TF32 or 3xTF32); ``dcn_cupy deterministic`` is
``deterministic=True`` (the backward on cuda/im2col-deterministic).

Precisions: fp32 (strict: TF32 off everywhere), tf32 (float32 data, TF32 GEMMs / cuDNN; the
plans get ``allow_tf32=``), fp16, bf16. "fwd+bwd" is the forward plus every gradient (input,
weight, offset, mask, bias; input, weight, bias for the dense conv). "peak" is the peak memory
allocated during the call beyond what was allocated before it (inputs excluded, outputs and
workspace included), read off CuPy's pool (dcn_cupy, through a memory hook) or torch's
allocator statistics.

Usage: ``python benchmarks/gpu.py [--quick] [--json PATH] [--only 2d|3d] [--shapes 0,3,5]
[--budget SECONDS]``; ``--budget`` starts no further (shape, precision) once that many seconds
have passed, so that a run under a time limit still prints its table. ``main(argv)`` is
what ``python -m dcn_cupy bench`` calls. Prints a table; writes JSON only where asked. Without a
CUDA device (or CuPy) it says so and returns 0.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


# ---------------------------------------------------------------------------------------------
# timing and memory


def no_gpu_reason():
    """None when CuPy sees a CUDA device; else why not (the GPU scripts then exit cleanly)."""
    try:
        import cupy
    except Exception as error:  # not installed, or a broken install
        return f"CuPy is not importable ({type(error).__name__}: {error})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver, no device
        return f"no CUDA device visible to CuPy ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    return None if count > 0 else "no CUDA device visible to CuPy"


# GPU time per call: CUDA events around ``inner`` calls, the median over ``repeats`` windows. One
# untimed call is enqueued before each window's start event, so that the window opens with the
# GPU busy: otherwise it also holds the host's latency to the first launch (GPU idle), which
# with --quick's 2-4 calls a window was 4% of a 0.28 ms forward+backward (H200, session 30). Host
# time per call is benchmarks/overhead.py's measure. Every implementation is timed alike.
def _time_cupy(fn, warmup: int, repeats: int, inner: int) -> float:
    import cupy
    for _ in range(warmup):
        fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        fn()   # untimed: the window opens with the GPU busy
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / inner)
    return statistics.median(times)


def _time_torch(fn, warmup: int, repeats: int, inner: int) -> float:
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()   # untimed: the window opens with the GPU busy
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / inner)
    return statistics.median(times)


def _peak_cupy(fn) -> float:
    """Peak bytes held in CuPy's pool by ``fn`` beyond what was held before, in MiB."""
    import cupy
    from cupy.cuda import memory_hook

    class Peak(memory_hook.MemoryHook):
        name = "DcnPeakHook"

        def __init__(self):
            self.current = self.peak = 0

        def malloc_postprocess(self, **kw):
            self.current += kw["mem_size"]
            self.peak = max(self.peak, self.current)

        def free_postprocess(self, **kw):
            self.current -= kw["mem_size"]

    cupy.cuda.Device().synchronize()
    hook = Peak()
    with hook:
        result = fn()
        cupy.cuda.Device().synchronize()
    del result
    return hook.peak / 2**20


def _peak_torch(fn, leaves=()) -> float:
    """Peak bytes allocated by torch during ``fn`` beyond what was allocated before, in MiB.

    The ``.grad`` of ``leaves`` (left by a timing loop) are dropped first: the baseline then
    excludes them and the gradients the call allocates count in its peak.
    """
    import torch
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak / 2**20


# ---------------------------------------------------------------------------------------------
# precision switches


def _set_precision(precision: str):
    """Data dtype for the precision, with TF32 switched on only for 'tf32' (torch's switches;
    dcn_cupy's plans get ``allow_tf32=_allow_tf32(precision)``)."""
    import torch
    tf32 = _allow_tf32(precision)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    return {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]


def _allow_tf32(precision: str) -> bool:
    return precision == "tf32"


# ---------------------------------------------------------------------------------------------
# cases


def _make_inputs(shape, dtype, seed=0):
    """torch CUDA tensors x, w, b, offset, mask, grad_output for a 'same' 3^N convolution."""
    import torch
    B, C_in, C_out, spatial = shape["B"], shape["C_in"], shape["C_out"], shape["S"]
    n = len(spatial)
    k = (3,) * n
    K = 3 ** n
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"

    def randn(*s, scale=1.0):
        return (torch.randn(*s, generator=g, device=dev, dtype=torch.float32) * scale).to(dtype)

    x = randn(B, C_in, *spatial)
    w = randn(C_out, C_in, *k, scale=1.0 / math.sqrt(C_in * K))
    b = randn(C_out)
    off = randn(B, n * K, *spatial, scale=1.0)
    msk = torch.rand(B, K, *spatial, generator=g, device=dev, dtype=torch.float32).to(dtype)
    gy = randn(B, C_out, *spatial)
    return x, w, b, off, msk, gy


def _as_cupy(*tensors):
    from dcn_cupy._interop import to_native
    return tuple(to_native(t, f"benchmark tensor {i}")[0] for i, t in enumerate(tensors))


#: The dcn_cupy rows: label, plan options. Forced rows are kept only where their algorithm
#: string differs from the automatic row's.
DCN_ROWS = (
    ("dcn_cupy", {}),
    ("dcn_cupy cuda/im2col", {"algorithm": "cuda/im2col"}),
    ("dcn_cupy cuda/fused", {"algorithm": "cuda/fused"}),
    ("dcn_cupy deterministic", {"deterministic": True}),
)


def _plan_row(label, p, forward, forward_backward, args) -> dict:
    """One plan's row: its times (forward, forward+backward) and peak memory."""
    return {"impl": label, "algorithm": p.algorithm, "workspace_mib": p.workspace_bytes / 2**20,
            "fwd_ms": _time_cupy(forward, args.warmup, args.repeats, args.inner),
            "fwdbwd_ms": _time_cupy(forward_backward, args.warmup, args.repeats, max(1, args.inner // 2)),
            "fwd_peak_mib": _peak_cupy(forward), "fwdbwd_peak_mib": _peak_cupy(forward_backward)}


def bench_dcn(shape, precision, args, transposed_too=False, fused=True):
    """Rows of dcn_cupy plans: the automatic choice, the forced algorithms that differ from it
    (``fused``: cuda/fused included), ``deterministic=True``; the transposed forward too."""
    import cupy
    import dcn_cupy
    dtype = _set_precision(precision)
    tf32 = _allow_tf32(precision)
    x, w, b, off, msk, gy = _as_cupy(*_make_inputs(shape, dtype))
    rows, seen = [], set()
    for label, options in DCN_ROWS:
        if label == "dcn_cupy cuda/fused" and not fused:
            continue
        try:
            p = dcn_cupy.plan(x, w, off, msk, b, padding=1, allow_tf32=tf32, **options)
        except ValueError as error:   # the forced algorithm does not serve this configuration
            rows.append({"impl": label, "error": f"ValueError: {str(error).splitlines()[0][:100]}"})
            continue
        if p.algorithm in seen:
            continue
        seen.add(p.algorithm)

        def forward(p=p):
            return p.forward(x, w, off, msk, b)

        def forward_backward(p=p):
            y = p.forward(x, w, off, msk, b)
            return y, p.backward(gy, x, w, off, msk, b)

        rows.append(_plan_row(label, p, forward, forward_backward, args))
    if transposed_too:
        # w (C_out, C_in, *k) -> (C_in, C_out, *k): the transposed layout (C_in, C_out/groups, *k),
        # groups = 1, taking x's C_in channels to C_out (b's length)
        wt = cupy.ascontiguousarray(w.swapaxes(0, 1))
        p = dcn_cupy.plan(x, wt, off, msk, b, padding=1, transposed=True, allow_tf32=tf32)

        def transposed():
            return p.forward(x, wt, off, msk, b)

        rows.append({"impl": "dcn_cupy transposed", "algorithm": p.algorithm,
                     "fwd_ms": _time_cupy(transposed, args.warmup, args.repeats, args.inner),
                     "fwd_peak_mib": _peak_cupy(transposed)})
    return rows


def transposed_case(shape, precision):
    """``((x, w, offset, mask, bias), grad_output, plan keywords)`` of a transposed convolution
    of ``shape`` (stride 2, padding 1, output_padding 1: S -> 2S; offsets and mask on its input
    grid), CuPy arrays of the precision's dtype."""
    import cupy
    dtype = _set_precision(precision)
    B, C_in, C_out, S = shape["B"], shape["C_in"], shape["C_out"], shape["S"]
    n, K = len(S), 3 ** len(S)
    x, w, b, off, msk, _ = _as_cupy(*_make_inputs(dict(shape, C_out=C_in), dtype))
    rng = cupy.random.default_rng(1)
    wt = (rng.standard_normal((C_in, C_out) + (3,) * n, dtype=cupy.float32) / math.sqrt(C_in * K)).astype(x.dtype)
    bt = rng.standard_normal((C_out,), dtype=cupy.float32).astype(x.dtype)
    gy = rng.standard_normal((B, C_out) + tuple(2 * v for v in S), dtype=cupy.float32).astype(x.dtype)
    return ((x, wt, off, msk, bt), gy,
            dict(stride=2, padding=1, output_padding=1, transposed=True, allow_tf32=_allow_tf32(precision)))


def bench_transposed(shape, precision, args):
    """Rows of a transposed convolution (``transposed_case``): the automatic choice and forced
    cuda/im2col where it differs, forward and forward+backward (every gradient)."""
    import dcn_cupy
    (x, wt, off, msk, bt), gy, hyper = transposed_case(shape, precision)
    rows, seen = [], set()
    for label, options in (("dcn_cupy", {}), ("dcn_cupy cuda/im2col", {"algorithm": "cuda/im2col"})):
        p = dcn_cupy.plan(x, wt, off, msk, bt, **hyper, **options)
        if p.algorithm in seen:
            continue
        seen.add(p.algorithm)

        def forward(p=p):
            return p.forward(x, wt, off, msk, bt)

        def forward_backward(p=p):
            y = p.forward(x, wt, off, msk, bt)
            return y, p.backward(gy, x, wt, off, msk, bt)

        rows.append(_plan_row(label, p, forward, forward_backward, args))
    return rows


def accuracy(shape, args):
    """fp16/bf16 forward error against the float64 reference (dcn_cupy's float64 im2col on the
    same rounded inputs): fused, im2col and torchvision's fp16, relative errors in the norm."""
    import torch
    shape = dict(shape, B=min(shape["B"], 2))
    out = {}
    for precision, tdtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        try:
            out.update(_accuracy_one(shape, precision, tdtype))
        except Exception:
            traceback.print_exc(file=sys.stderr)
    return out


def _accuracy_one(shape, precision, tdtype) -> dict:
    import cupy
    import torch
    import dcn_cupy
    n = len(shape["S"])
    t16 = _make_inputs(shape, tdtype, seed=3)
    x, w, b, off, msk = _as_cupy(*t16[:5])
    wide = tuple(a.astype(cupy.float64) for a in (x, w, off, msk, b))
    ref = dcn_cupy.plan(*wide, padding=1).forward(*wide)
    scale = float(cupy.linalg.norm(ref))
    error = lambda y: float(cupy.linalg.norm(y.astype(cupy.float64) - ref)) / scale  # noqa: E731
    out = {}
    for name in ("fused", "im2col"):
        p = dcn_cupy.plan(x, w, off, msk, b, padding=1, algorithm=f"cuda/{name}")
        out[f"{name} {precision}"] = error(p.forward(x, w, off, msk, b))
    if n == 2 and precision == "fp16":
        try:
            from torchvision.ops import deform_conv2d
        except ImportError:
            return out
        xt, wt, bt, offt, mskt = t16[:5]
        with torch.no_grad():
            yt = deform_conv2d(xt, offt, wt, bt, padding=1, mask=mskt)
        out["torchvision fp16"] = error(_as_cupy(yt.double())[0])
    return out


def bench_torchvision(shape, precision, args):
    import torch
    from torchvision.ops import deform_conv2d
    dtype = _set_precision(precision)
    x, w, b, off, msk, gy = _make_inputs(shape, dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b, off, msk)]

    def forward():
        with torch.no_grad():
            return deform_conv2d(x, off, w, b, padding=1, mask=msk)

    def forward_backward():
        for t in leaves:
            t.grad = None
        y = deform_conv2d(leaves[0], leaves[3], leaves[1], leaves[2], padding=1, mask=leaves[4])
        y.backward(gy)
        return y

    row = {"impl": "torchvision"}
    row["fwd_ms"] = _time_torch(forward, args.warmup, args.repeats, args.inner)
    row["fwdbwd_ms"] = _time_torch(forward_backward, args.warmup, args.repeats, max(1, args.inner // 2))
    row["fwd_peak_mib"] = _peak_torch(forward, leaves)
    row["fwdbwd_peak_mib"] = _peak_torch(forward_backward, leaves)
    return [row]


def bench_dense(shape, precision, args):
    import torch
    import torch.nn.functional as F
    dtype = _set_precision(precision)
    torch.backends.cudnn.benchmark = True
    x, w, b, off, msk, gy = _make_inputs(shape, dtype)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(shape["S"])]
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]

    def forward():
        with torch.no_grad():
            return conv(x, w, b, padding=1)

    def forward_backward():
        for t in leaves:
            t.grad = None
        y = conv(leaves[0], leaves[1], leaves[2], padding=1)
        y.backward(gy)
        return y

    row = {"impl": "dense conv (cuDNN)"}
    row["fwd_ms"] = _time_torch(forward, args.warmup, args.repeats, args.inner)
    row["fwdbwd_ms"] = _time_torch(forward_backward, args.warmup, args.repeats, max(1, args.inner // 2))
    row["fwd_peak_mib"] = _peak_torch(forward, leaves)
    row["fwdbwd_peak_mib"] = _peak_torch(forward_backward, leaves)
    return [row]


SHAPES = [
    {"name": "2D B=8 C256->256 56x56 3x3", "B": 8, "C_in": 256, "C_out": 256, "S": (56, 56)},
    {"name": "2D B=32 C64->64 56x56 3x3", "B": 32, "C_in": 64, "C_out": 64, "S": (56, 56)},
    {"name": "2D B=16 C512->512 14x14 3x3", "B": 16, "C_in": 512, "C_out": 512, "S": (14, 14)},
    {"name": "1D B=16 C256->256 L4096 k3", "B": 16, "C_in": 256, "C_out": 256, "S": (4096,)},
    {"name": "3D B=2 C32->32 32^3 3x3x3", "B": 2, "C_in": 32, "C_out": 32, "S": (32, 32, 32)},
]
#: Transposed convolutions at DESIGN section 5's tvdcn shapes (3^N kernel, stride 2, padding 1,
#: output_padding 1: S -> 2S), forward and forward+backward (``bench_transposed``).
TRANSPOSED_SHAPES = [
    {"name": "2D transposed B=8 C128 28x28 s2", "B": 8, "C_in": 128, "C_out": 128, "S": (28, 28), "transposed": True},
    {"name": "3D transposed B=2 C32 16^3 s2", "B": 2, "C_in": 32, "C_out": 32, "S": (16, 16, 16), "transposed": True},
]


def parse_shape(text: str, name: str = "custom") -> dict:
    """``"B,C_in,C_out,S"`` (S like 56x56) -> a shape dict of a 'same' 3^N convolution, named
    ``name`` then its sizes; ValueError where it does not parse."""
    B, C_in, C_out, spatial = text.split(",")
    S = tuple(int(v) for v in spatial.split("x"))
    return {"name": f"{name} B={int(B)} C{int(C_in)}->{int(C_out)} {'x'.join(map(str, S))}", "B": int(B),
            "C_in": int(C_in), "C_out": int(C_out), "S": S}


def _gflop(shape) -> float:
    """GEMM work of the forward: 2 * C_out * C_in * K * B * Q (3^N kernel, 'same' padding)."""
    return 2.0 * shape["C_out"] * shape["C_in"] * 3 ** len(shape["S"]) * shape["B"] * math.prod(shape["S"]) / 1e9


def _device_name() -> str:
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _fmt(value, spec="{:8.3f}"):
    return spec.format(value) if isinstance(value, (int, float)) else f"{str(value):>8}"


def add_ratios(results: list) -> None:
    """Adds to each dcn_cupy row its speed-ups and peak-memory ratios against torchvision ("tv")
    and dense cuDNN ("dense") of the same shape and precision. bf16 goes against torchvision's
    fp16 (issue 8's target), since torchvision's bf16 row is an error (it has no bf16 kernel)."""
    by_key = {(r["shape"], r["precision"], r["impl"]): r for r in results}
    for r in results:
        if not r["impl"].startswith("dcn_cupy") or "transposed" in r["impl"] or "fwd_ms" not in r:
            continue
        for other, tag in (("torchvision", "tv"), ("dense conv (cuDNN)", "dense")):
            o = by_key.get((r["shape"], r["precision"], other))
            if (o is None or "fwd_ms" not in o) and tag == "tv" and r["precision"] == "bf16":
                o = by_key.get((r["shape"], "fp16", other))
            if o and "fwd_ms" in o:
                r[f"fwd_speedup_vs_{tag}"] = o["fwd_ms"] / r["fwd_ms"]
                r[f"fwd_peak_ratio_vs_{tag}"] = r["fwd_peak_mib"] / max(o["fwd_peak_mib"], 1e-9)
                if "fwdbwd_ms" in r:
                    r[f"fwdbwd_speedup_vs_{tag}"] = o["fwdbwd_ms"] / r["fwdbwd_ms"]
                    r[f"fwdbwd_peak_ratio_vs_{tag}"] = r["fwdbwd_peak_mib"] / max(o["fwdbwd_peak_mib"], 1e-9)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu.py", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--json", default=None, help="write the results as JSON to this path (default: nowhere)")
    parser.add_argument("--only", choices=("1d", "2d", "3d"), default=None)
    parser.add_argument("--shapes", default=None,
                        help="comma-separated indices into SHAPES, then TRANSPOSED_SHAPES (5 and 6)")
    parser.add_argument("--shape", default=None,
                        help="one custom shape instead of SHAPES: B,C_in,C_out,S (S like 56x56; 3^N kernel)")
    parser.add_argument("--no-fused", action="store_true",
                        help="skip the forced cuda/fused rows and the fp16/bf16 accuracy line")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds after which no further (shape, precision) starts; the table still prints")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.repeats, args.inner = 2, 3, 4
    custom = None
    if args.shape:
        try:
            custom = parse_shape(args.shape)
        except ValueError:
            parser.error(f"--shape must look like B,C_in,C_out,S (e.g. 2,16,16,8x8), got {args.shape!r}")
    reason = no_gpu_reason()
    if reason is not None:
        print(f"benchmarks/gpu.py: {reason}: nothing to measure.")
        return 0
    import cupy
    import torch
    import dcn_cupy
    try:
        import torchvision
        tv_version = torchvision.__version__
    except Exception:
        tv_version = None
    precisions = [p for p in args.precisions.split(",") if p]
    shapes = [s for s in SHAPES + TRANSPOSED_SHAPES if args.only is None or s["name"].lower().startswith(args.only)]
    if args.shapes:
        shapes = [(SHAPES + TRANSPOSED_SHAPES)[int(i)] for i in args.shapes.split(",")]
    if custom is not None:
        shapes = [custom]
    meta = {
        "device": _device_name(), "dcn_cupy": dcn_cupy.__version__, "cupy": cupy.__version__,
        "torch": torch.__version__, "torchvision": tv_version, "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "warmup": args.warmup, "repeats": args.repeats,
        "inner": args.inner,
    }
    results = []
    started, skipped = time.monotonic(), []
    for shape in shapes:
        is2d = len(shape["S"]) == 2
        for precision in precisions:
            if args.budget is not None and time.monotonic() - started > args.budget:
                skipped.append((shape, precision))
                continue
            benches = [("dcn_cupy", lambda s=shape, p=precision, t=not is2d: bench_dcn(
                s, p, args, transposed_too=t, fused=not args.no_fused))]
            if shape.get("transposed"):
                benches = [("dcn_cupy", lambda s=shape, p=precision: bench_transposed(s, p, args))]
            elif is2d:
                if tv_version is not None:
                    benches.append(("torchvision", lambda s=shape, p=precision: bench_torchvision(s, p, args)))
                benches.append(("dense", lambda s=shape, p=precision: bench_dense(s, p, args)))
            for label, bench in benches:
                try:
                    rows = bench()
                except Exception as error:
                    rows = [{"impl": label, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"}]
                    traceback.print_exc(file=sys.stderr)
                for row in rows:
                    row.update(shape=shape["name"], precision=precision)
                    if "fwd_ms" in row and "transposed" not in row["impl"] and not shape.get("transposed"):
                        row["fwd_tflops"] = _gflop(shape) / row["fwd_ms"]
                    results.append(row)
                    print(f"  {shape['name']:<28} {precision:<5} {row['impl']:<22} "
                          f"fwd {_fmt(row.get('fwd_ms', '-'))} ms {_fmt(row.get('fwd_tflops', '-'), '{:6.1f}')} TFLOP/s  fwd+bwd {_fmt(row.get('fwdbwd_ms', '-'))} ms"
                          + (f"  peak MiB {_fmt(row.get('fwd_peak_mib', '-'), '{:.0f}')} / "
                             f"{_fmt(row.get('fwdbwd_peak_mib', '-'), '{:.0f}')}" if "fwd_peak_mib" in row else "")
                          + (f"  {row['error']}" if "error" in row else "")
                          + (f"  [{row['algorithm']}]" if "algorithm" in row else ""), flush=True)
                import gc
                gc.collect()
                cupy.get_default_memory_pool().free_all_blocks()
                torch.cuda.empty_cache()
    _set_precision("fp32")
    if skipped:
        print(f"--budget {args.budget:g} s reached after {time.monotonic() - started:.0f} s; not run: "
              + ", ".join(f"{shape['name']} {precision}" for shape, precision in skipped))

    add_ratios(results)
    print()
    print(f"device: {meta['device']}; cupy {meta['cupy']}, torch {meta['torch']}, torchvision {tv_version}; "
          f"median of {args.repeats} x {args.inner} launches (CUDA events)")
    header = (f"| {'shape':<27} | {'prec':<4} | {'impl':<22} | {'fwd ms':>8} | {'TFLOP/s':>7} | {'fwd+bwd ms':>10} | "
              f"{'fwd peak MiB':>12} | {'f+b peak MiB':>12} | {'vs tv fwd':>9} | {'vs tv f+b':>9} | "
              f"{'vs dense fwd':>12} | {'vs dense f+b':>12} |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in results:
        def f(key, width, spec="{:.3f}"):
            v = r.get(key)
            return (spec.format(v) if isinstance(v, (int, float)) else "-").rjust(width)
        if "error" in r:
            print(f"| {r['shape']:<27} | {r['precision']:<4} | {r['impl']:<22} | error: {r['error']}")
            continue
        print(f"| {r['shape']:<27} | {r['precision']:<4} | {r['impl']:<22} | {f('fwd_ms', 8)} | "
              f"{f('fwd_tflops', 7, '{:.1f}')} | {f('fwdbwd_ms', 10)} | "
              f"{f('fwd_peak_mib', 12, '{:.0f}')} | {f('fwdbwd_peak_mib', 12, '{:.0f}')} | "
              f"{f('fwd_speedup_vs_tv', 9, '{:.2f}x')} | {f('fwdbwd_speedup_vs_tv', 9, '{:.2f}x')} | "
              f"{f('fwd_speedup_vs_dense', 12, '{:.2f}x')} | {f('fwdbwd_speedup_vs_dense', 12, '{:.2f}x')} |")
    print("(vs X = X's time / dcn_cupy's time: above 1 means dcn_cupy is faster; bf16 vs tv: "
          "against torchvision's fp16)")
    algorithms = sorted({(r["impl"], r["precision"], r["algorithm"]) for r in results if "algorithm" in r})
    for impl, precision, algorithm in algorithms:
        print(f"  {impl} {precision}: {algorithm}")
    if not args.no_fused and any(len(s["S"]) == 2 for s in shapes):
        try:
            errors = accuracy(next(s for s in shapes if len(s["S"]) == 2), args)
            meta["accuracy"] = errors
            print("forward error vs float64 (relative, norm; B=2 of the first 2D shape): "
                  + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        except Exception:
            traceback.print_exc(file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
