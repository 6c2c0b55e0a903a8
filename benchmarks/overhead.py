"""Host time per call on a tiny problem: what a call costs the CPU, not the GPU.

B=1, C 16->16, 8x8, 3x3, DCNv2 (offset + mask), padding 1, float32. On a GPU the device is kept
busy by a long kernel queued first, so that a call's time is its host time (validation,
interop, launches); on the CPU the rows are the whole call (the problem is tiny). Each row
times forward alone and forward+backward (every gradient; on the torch rows the leaves' ``.grad``
set to None first, inside the timed call, as a training step's ``optimizer.zero_grad()`` does,
unless ``--accumulate``): per round, the median over repeats
of the mean over a batch of calls; every path is timed once per round, in turn, and the table
gives the median over the rounds, so that a slow spell of the host weighs on every path alike.

    python benchmarks/overhead.py                 # every path this machine can run
    python benchmarks/overhead.py --device cpu    # CPU rows only

Paths whose library is missing (or has no GPU) are printed as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dcn_cupy  # noqa: E402

B, C, H, K = 1, 16, 8, 3


def _arrays(rng, dtype=np.float32):
    return dict(
        input=rng.standard_normal((B, C, H, H)).astype(dtype),
        weight=(rng.standard_normal((C, C, K, K)) / (C * K * K) ** 0.5).astype(dtype),
        offset=rng.standard_normal((B, 2 * K * K, H, H)).astype(dtype),
        mask=rng.random((B, K * K, H, H)).astype(dtype),
        bias=rng.standard_normal(C).astype(dtype),
    )


class _Busy:
    """Keeps the GPU busy (a spinning kernel) while host time is measured."""

    def __init__(self, kind):
        self.kind = kind
        if kind == "cupy":
            import cupy
            self.kernel = cupy.RawKernel(r'''
            extern "C" __global__ void spin(long long cycles) {
                long long start = clock64();
                while (clock64() - start < cycles) { }
            }''', "spin")

    def __call__(self, seconds):
        if self.kind == "cupy":
            import cupy
            rate = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["clockRate"] * 1e3
            self.kernel((1,), (1,), (np.int64(seconds * rate),))
        elif self.kind == "torch":
            import torch
            torch.cuda._sleep(int(seconds * 2e9))

    def sync(self):
        if self.kind == "cupy":
            import cupy
            cupy.cuda.get_current_stream().synchronize()
        elif self.kind == "torch":
            import torch
            torch.cuda.synchronize()


def _time(call, busy=None, calls=50, repeats=7, finish=None) -> float:
    """Median over repeats of the mean host µs of ``calls`` calls."""
    call()
    call()
    if busy is not None:
        busy.sync()
    results = []
    for _ in range(repeats):
        if busy is not None:
            busy(0.05)  # far longer than the calls take to enqueue
        start = time.perf_counter()
        for _ in range(calls):
            call()
        elapsed = time.perf_counter() - start
        if finish is not None:
            finish()
        if busy is not None:
            busy.sync()
        results.append(elapsed / calls * 1e6)
    return statistics.median(results)


# ---------------------------------------------------------------------------------------------
# the paths: each returns (forward, forward+backward, busy) or raises _Skip


class _Skip(Exception):
    pass


def _need(module):
    try:
        return __import__(module, fromlist=["_"])
    except Exception as error:
        raise _Skip(f"{module} is not importable ({type(error).__name__})") from None


def _cupy():
    cupy = _need("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise _Skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        raise _Skip("no CUDA device") from None
    return cupy


def _torch_cuda():
    torch = _need("torch")
    if not torch.cuda.is_available():
        raise _Skip("torch has no CUDA")
    return torch


def _device_arrays(device, rng):
    """The tiny problem's arrays on ``device`` (CuPy on "cuda", with the GPU kept busy)."""
    a = _arrays(rng)
    if device != "cuda":
        return a, None
    cupy = _cupy()
    return {k: cupy.asarray(v) for k, v in a.items()}, _Busy("cupy")


def path_plan(device, rng):
    a, busy = _device_arrays(device, rng)
    p = dcn_cupy.plan(**a, padding=1)
    y = p.forward(**a)
    gy = y.copy()
    xp = np if device == "cpu" else __import__("cupy")
    out = xp.empty_like(y)
    ws = xp.empty(max(p.workspace_bytes, 1), np.uint8)
    grads = {k: xp.empty_like(v) for k, v in a.items()}

    def fwd():
        p.forward(**a, out=out, workspace=ws)

    def both():
        p.forward(**a, out=out, workspace=ws)
        p.backward(gy, **a, out=grads, workspace=ws)

    return fwd, both, busy


def path_functional(device, rng):
    a, busy = _device_arrays(device, rng)
    gy = dcn_cupy.deform_conv2d(**a, padding=1)

    def fwd():
        dcn_cupy.deform_conv2d(**a, padding=1)

    def both():
        dcn_cupy.deform_conv2d(**a, padding=1)
        dcn_cupy.deform_conv2d_backward(gy, **a, padding=1)

    return fwd, both, busy


#: Whether the torch rows' forward+backward adds into the leaves' existing ``.grad`` (one
#: accumulation kernel per leaf) instead of starting from ``.grad = None`` (``--accumulate``).
ACCUMULATE = False


def _torch_tensors(device, rng, grad):
    torch = _torch_cuda() if device == "cuda" else _need("torch")
    t = {k: torch.from_numpy(v).to(device) for k, v in _arrays(rng).items()}
    if grad:
        for k in ("input", "weight", "offset", "mask", "bias"):
            t[k].requires_grad_(True)
    return torch, t


def _zero_grad(t):
    """What ``optimizer.zero_grad()`` does before a training step's backward (its default,
    ``set_to_none=True``): the backward then hands its gradients to the leaves, with no
    accumulation kernel. Nothing with ``--accumulate``."""
    if not ACCUMULATE:
        for v in t.values():
            v.grad = None


def path_dcn_torch(device, rng):
    _need("torch")
    dt = _need("dcn_cupy.torch")
    torch, t = _torch_tensors(device, rng, True)
    busy = _Busy("torch") if device == "cuda" else None
    gy = torch.ones(B, C, H, H, device=device)

    def fwd():
        with torch.no_grad():
            dt.deform_conv2d(t["input"], t["weight"], t["offset"], t["mask"], t["bias"], padding=1)

    def both():
        _zero_grad(t)
        y = dt.deform_conv2d(t["input"], t["weight"], t["offset"], t["mask"], t["bias"], padding=1)
        y.backward(gy)

    return fwd, both, busy


def path_dcn_torch_graph(device, rng):
    if device != "cuda":
        raise _Skip("CUDA graphs need a GPU")
    torch = _torch_cuda()
    dt = _need("dcn_cupy.torch")
    _, t = _torch_tensors(device, rng, True)
    gy = torch.ones(B, C, H, H, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            y = dt.deform_conv2d(t["input"], t["weight"], t["offset"], t["mask"], t["bias"], padding=1)
            y.backward(gy)
    torch.cuda.current_stream().wait_stream(side)
    try:
        g_fwd, g_both = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g_fwd):
            dt.deform_conv2d(t["input"], t["weight"], t["offset"], t["mask"], t["bias"], padding=1)
        with torch.cuda.graph(g_both):
            y = dt.deform_conv2d(t["input"], t["weight"], t["offset"], t["mask"], t["bias"], padding=1)
            y.backward(gy)
    except Exception as error:
        raise _Skip(f"capture failed: {type(error).__name__}: {str(error)[:120]}") from None
    return g_fwd.replay, g_both.replay, _Busy("torch")


def path_jax_jit(device, rng, raw_addresses=True):
    jax = _need("jax")
    jnp = _need("jax.numpy")
    dj = _need("dcn_cupy.jax")
    from dcn_cupy.jax import _callbacks
    try:
        target = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    except Exception:
        raise _Skip(f"jax has no {device} device") from None
    a = {k: jax.device_put(jnp.asarray(v), target) for k, v in _arrays(rng).items()}
    names = ("input", "weight", "offset", "mask", "bias")

    f = jax.jit(lambda *args: dj.deform_conv2d(*args, padding=1))
    g = jax.jit(jax.grad(lambda *args: dj.deform_conv2d(*args, padding=1).sum(), argnums=(0, 1, 2, 3, 4)))
    args = tuple(a[n] for n in names)

    def fwd():
        _callbacks.RAW_ADDRESSES = raw_addresses   # read at every execution of the callbacks
        try:
            f(*args).block_until_ready()
        finally:
            _callbacks.RAW_ADDRESSES = True

    def both():
        _callbacks.RAW_ADDRESSES = raw_addresses
        try:
            jax.block_until_ready(g(*args))
        finally:
            _callbacks.RAW_ADDRESSES = True

    return fwd, both, None


def path_jax_jit_arrays(device, rng):
    """The same with the raw-address path off: CuPy arrays over XLA's buffers, checked by the plan."""
    if device != "cuda":
        raise _Skip("the raw-address path is CUDA only")
    return path_jax_jit(device, rng, raw_addresses=False)


def path_torchvision(device, rng):
    torch = _torch_cuda() if device == "cuda" else _need("torch")
    ops = _need("torchvision.ops")
    _, t = _torch_tensors(device, rng, True)
    busy = _Busy("torch") if device == "cuda" else None
    gy = torch.ones(B, C, H, H, device=device)

    def fwd():
        with torch.no_grad():
            ops.deform_conv2d(t["input"], t["offset"], t["weight"], t["bias"], padding=1, mask=t["mask"])

    def both():
        _zero_grad(t)
        ops.deform_conv2d(t["input"], t["offset"], t["weight"], t["bias"], padding=1, mask=t["mask"]).backward(gy)

    return fwd, both, busy


def path_torch_floor(device, rng):
    """What torch's autograd costs any Python-level op of this signature: a
    ``torch.autograd.Function`` of the five tensors whose forward allocates the output and whose
    backward allocates the five gradients, no kernel (the engine, the node, the five leaves'
    ``.grad``)."""
    _need("torch")
    torch, t = _torch_tensors(device, rng, True)
    busy = _Busy("torch") if device == "cuda" else None
    gy = torch.ones(B, C, H, H, device=device)
    tensors = [t[k] for k in ("input", "weight", "offset", "mask", "bias")]

    class Allocating(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            ctx.save_for_backward(*args)
            return args[0].new_empty((B, C, H, H))

        @staticmethod
        def backward(ctx, grad_output):
            return tuple(torch.empty_like(a) for a in ctx.saved_tensors)

    def fwd():
        with torch.no_grad():
            Allocating.apply(*tensors)

    def both():
        _zero_grad(t)
        Allocating.apply(*tensors).backward(gy)

    return fwd, both, busy


def path_dense(device, rng):
    torch = _torch_cuda() if device == "cuda" else _need("torch")
    _, t = _torch_tensors(device, rng, True)
    busy = _Busy("torch") if device == "cuda" else None
    gy = torch.ones(B, C, H, H, device=device)
    conv = torch.nn.functional.conv2d

    def fwd():
        with torch.no_grad():
            conv(t["input"], t["weight"], t["bias"], padding=1)

    def both():
        _zero_grad(t)
        conv(t["input"], t["weight"], t["bias"], padding=1).backward(gy)

    return fwd, both, busy


class _NoopBackend:
    """``cpu/noop``: serves everything and computes nothing: the rows using it time the
    library's own host layer (interop, checks, plan cache, dispatch) without any kernel."""

    device, algorithm, priority = "cpu", "noop", -100

    def serves(self, spec, primitive):
        return None

    def build(self, spec, primitive):
        class Executable:
            workspace_bytes = 0
            description = "cpu/noop: nothing"

            def run(self, args, out, workspace):
                pass

        return Executable()


def _noop():
    from dcn_cupy import _backends
    _backends.register(_NoopBackend())
    return _backends


def path_plan_layer(device, rng):
    _noop()
    a = _arrays(rng)
    p = dcn_cupy.plan(**a, padding=1, algorithm="cpu/noop")
    gy = np.zeros(p.output_shape, np.float32)
    out = np.empty(p.output_shape, np.float32)
    grads = {k: np.empty_like(v) for k, v in a.items()}

    def fwd():
        p.forward(**a, out=out)

    def both():
        p.forward(**a, out=out)
        p.backward(gy, **a, out=grads)

    return fwd, both, None


def path_functional_layer(device, rng):
    backends = _noop()
    a = _arrays(rng)
    gy = np.zeros((B, C, H, H), np.float32)
    forced = backends._forced

    # use_algorithm("cpu/noop") for the row's calls only (a thread-local name, set and reset)
    def fwd():
        forced.name = "cpu/noop"
        try:
            dcn_cupy.deform_conv2d(**a, padding=1)
        finally:
            forced.name = None

    def both():
        forced.name = "cpu/noop"
        try:
            dcn_cupy.deform_conv2d(**a, padding=1)
            dcn_cupy.deform_conv2d_backward(gy, **a, padding=1)
        finally:
            forced.name = None

    return fwd, both, None


PATHS = [
    ("plan, host layer only (no-op backend)", path_plan_layer, ("cpu",)),
    ("functional API, host layer only (no-op backend)", path_functional_layer, ("cpu",)),
    ("plan (out=, workspace=)", path_plan, ("cuda", "cpu")),
    ("functional API", path_functional, ("cuda", "cpu")),
    ("dcn_cupy.torch eager", path_dcn_torch, ("cuda", "cpu")),
    ("dcn_cupy.torch, torch.cuda.graph replay", path_dcn_torch_graph, ("cuda",)),
    ("dcn_cupy.jax, jax.jit", path_jax_jit, ("cuda", "cpu")),
    ("dcn_cupy.jax, jax.jit, raw-address path off", path_jax_jit_arrays, ("cuda",)),
    ("torchvision.ops.deform_conv2d", path_torchvision, ("cuda", "cpu")),
    ("dense torch conv2d", path_dense, ("cuda", "cpu")),
    ("torch autograd floor: a Python Function allocating, no kernel", path_torch_floor, ("cuda", "cpu")),
]

_NATIVE = {"cuda": "CuPy", "cpu": "NumPy"}
_ARRAYS = {name: _NATIVE for name, *_ in PATHS[:4]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("all", "cpu", "cuda"), default="all")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--accumulate", action="store_true",
                        help="torch rows: add into the leaves' existing .grad (earlier tables' method)")
    args = parser.parse_args(argv)
    global ACCUMULATE
    ACCUMULATE = args.accumulate
    devices = ("cuda", "cpu") if args.device == "all" else (args.device,)
    where = {"cpu": "CPU"}
    try:
        import cupy
        if "cuda" in devices and cupy.cuda.runtime.getDeviceCount():
            where["cuda"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:
        pass
    rows = []    # [name, label, device, (fwd, both, busy) or None, message or None, times per round]
    for device in devices:
        for name, make, serves in PATHS:
            if device not in serves:
                continue
            label = _ARRAYS.get(name, {}).get(device, "torch" if "torch" in name or "conv2d" in name else "JAX")
            row = [name, label, device, None, None, ([], [])]
            try:
                row[3] = make(device, np.random.default_rng(0))
            except _Skip as reason:
                row[4] = "skipped: " + " ".join(str(reason).split())
            except Exception as error:  # a path that fails is reported, not fatal
                row[4] = f"error: {type(error).__name__}: {' '.join(str(error).split())[:100]}"
            rows.append(row)
    for _ in range(args.rounds):
        for row in rows:
            if row[3] is None:
                continue
            fwd, both, busy = row[3]
            try:
                for times, call in zip(row[5], (fwd, both)):
                    times.append(_time(call, busy, args.calls, args.repeats))
            except Exception as error:
                row[3], row[4] = None, f"error: {type(error).__name__}: {' '.join(str(error).split())[:100]}"
    print(f"# host µs per call, B={B} C{C}->{C} {H}x{H} {K}x{K} DCNv2 float32 (GPU: {where.get('cuda', 'none')}); "
          f"median of {args.rounds} rounds; torch rows' forward+backward "
          f"{'adding into existing .grad' if ACCUMULATE else 'from .grad = None (zero_grad)'}")
    print("| path | arrays | device | forward µs | forward+backward µs |")
    print("| --- | --- | --- | ---: | ---: |")
    for name, label, device, made, message, (fwd_times, both_times) in rows:
        if message is not None:
            print(f"| {name} | {label} | {device} | {message} | |")
            continue
        fwd_us, both_us = statistics.median(fwd_times), statistics.median(both_times)
        print(f"| {name} | {label} | {where.get(device, device)} | {fwd_us:.1f} | {both_us:.1f} |", flush=True)
    _print_targets(rows)


def _print_targets(rows) -> None:
    """Issue 7's host-time targets, checked against this run's medians (GPU rows)."""
    timed = {(name, device): times for name, _, device, made, message, times in rows
             if message is None and all(times)}   # (forward, forward+backward) per round
    found = {key: (statistics.median(f), statistics.median(b)) for key, (f, b) in timed.items()}
    plan, functional = found.get(("plan (out=, workspace=)", "cuda")), found.get(("functional API", "cuda"))
    torch_eager = found.get(("dcn_cupy.torch eager", "cuda"))
    peer = found.get(("torchvision.ops.deform_conv2d", "cuda"))
    checks = []
    if plan:
        checks += [("plan forward <= 25 µs", plan[0], 25.0), ("plan forward+backward <= 62.5 µs", plan[1], 62.5)]
    if functional:
        checks += [("functional forward <= 50 µs", functional[0], 50.0),
                   ("functional forward+backward <= 125 µs", functional[1], 125.0)]
    if torch_eager and peer:
        checks += [(f"dcn_cupy.torch forward < torchvision's ({peer[0]:.1f} µs)", torch_eager[0], peer[0]),
                   (f"dcn_cupy.torch forward+backward <= 2.5x torchvision's forward ({2.5 * peer[0]:.1f} µs): "
                    f"{torch_eager[1] / peer[0]:.2f}x", torch_eager[1], 2.5 * peer[0])]
    for text, value, limit in checks:
        print(f"target {text}: {value:.1f} -> {'met' if value <= limit else 'NOT met'}")
    ours, peer = timed.get(("dcn_cupy.torch eager", "cuda")), timed.get(("torchvision.ops.deform_conv2d", "cuda"))
    if ours and peer:
        print("dcn_cupy.torch forward+backward / torchvision's forward, round by round: "
              + ", ".join(f"{b / f:.2f}x" for b, f in zip(ours[1], peer[0])))


if __name__ == "__main__":
    main()
