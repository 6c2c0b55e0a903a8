"""Adapter overhead: the same deformable convolution work through dcn_cupy.torch, JAX and a plan.

One process, one GPU, strict float32 (TF32 off everywhere), B=8, C 64->64, 32x32, 3x3,
padding 1, DCNv2 (offset + mask + bias). Each path runs a forward and every gradient:

* ``plan``: ``dcn_cupy.plan`` on CuPy arrays, ``forward`` then ``backward`` (the baseline);
* ``torch functional``: ``dcn_cupy.torch.deform_conv2d`` on leaves, ``y.backward(g)``;
* ``torch PackedDeformConv2d step``: a training step (forward, backward, SGD step) of the
  packed module (its two inner offset/mask convolutions are extra work the plan does not do);
* the same step captured once in a CUDA graph and replayed;
* ``jax jit(grad)``: ``jax.jit(jax.grad(...))`` of a DCNv2 layer, all five gradients (the
  callbacks launch the plan on XLA's buffer addresses), and the same with that raw-address path
  switched off (CuPy arrays over the buffers, the plan's checks, CuPy device/stream scopes).
  The loss is linear in the layer's output, so XLA drops the forward callback: only the
  backward runs. ``jax jit(vjp)`` returns the output and the five gradients: the plan's work.

Times are wall-clock milliseconds per iteration (host time included: that is the overhead
measured), median of several repeats of a loop, the device synchronised at the end of each.

Usage: ``python benchmarks/adapters.py [--repeats 5] [--inner 50]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave CuPy and torch room
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

SHAPE = dict(batch=8, channels=64, size=32, kernel=3)


def _time(fn, sync, repeats: int, inner: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3 / inner)
    return statistics.median(times)


def _arrays(seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    b, c, s, k = SHAPE["batch"], SHAPE["channels"], SHAPE["size"], SHAPE["kernel"]
    f32 = np.float32
    return {
        "input": rng.standard_normal((b, c, s, s)).astype(f32),
        "weight": (0.05 * rng.standard_normal((c, c, k, k))).astype(f32),
        "offset": rng.uniform(-2, 2, (b, 2 * k * k, s, s)).astype(f32),
        "mask": rng.uniform(0, 1, (b, k * k, s, s)).astype(f32),
        "bias": rng.standard_normal(c).astype(f32),
        "grad": rng.standard_normal((b, c, s, s)).astype(f32),
    }


def bench_plan(host, repeats, inner):
    import cupy

    import dcn_cupy

    a = {k: cupy.asarray(v) for k, v in host.items()}
    args = [a[k] for k in ("input", "weight", "offset", "mask", "bias")]
    plan = dcn_cupy.plan(*args, padding=1)

    def step():
        plan.forward(*args)
        plan.backward(a["grad"], *args)

    return _time(step, cupy.cuda.Device().synchronize, repeats, inner), plan


def bench_torch_functional(host, repeats, inner):
    import torch

    import dcn_cupy.torch as dct

    leaves = [torch.from_numpy(host[k]).cuda().requires_grad_() for k in ("input", "weight", "offset", "mask", "bias")]
    grad = torch.from_numpy(host["grad"]).cuda()

    def step():
        for t in leaves:
            t.grad = None
        dct.deform_conv2d(*leaves, padding=1).backward(grad)

    return _time(step, torch.cuda.synchronize, repeats, inner)


def _packed_extra_step():
    """The packed step's work other than the deformable convolution: the offset/mask predictor
    forward and backward and the SGD step over every parameter (the plan does none of it)."""
    import torch

    import dcn_cupy.torch as dct

    b, c, s = SHAPE["batch"], SHAPE["channels"], SHAPE["size"]
    torch.manual_seed(0)
    module = dct.PackedDeformConv2d(c, c, 3, padding=1, modulated=True, mask_activation="sigmoid").cuda()
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    x = torch.randn(b, c, s, s, device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        offset, mask = module._predict(x)
        torch.autograd.backward((offset, mask), (torch.ones_like(offset), torch.ones_like(mask)))
        for p in (module.weight, module.bias):
            p.grad = torch.zeros_like(p)
        optimizer.step()

    return step


def _packed_step():
    import torch

    import dcn_cupy.torch as dct

    b, c, s = SHAPE["batch"], SHAPE["channels"], SHAPE["size"]
    torch.manual_seed(0)
    module = dct.PackedDeformConv2d(c, c, 3, padding=1, modulated=True, mask_activation="sigmoid").cuda()
    with torch.no_grad():
        module.conv_offset.weight.normal_(0, 0.01)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    x = torch.randn(b, c, s, s, device="cuda")
    grad = torch.randn(b, c, s, s, device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        module(x).backward(grad)
        optimizer.step()

    return step


def bench_torch_packed(repeats, inner):
    import torch

    return _time(_packed_step(), torch.cuda.synchronize, repeats, inner)


def bench_torch_extra(repeats, inner):
    import torch

    return _time(_packed_extra_step(), torch.cuda.synchronize, repeats, inner)


def bench_torch_packed_graph(repeats, inner):
    import torch

    step = _packed_step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return _time(graph.replay, torch.cuda.synchronize, repeats, inner)


def bench_jax(host, repeats, inner, raw_addresses=True, with_output=False):
    import jax
    import jax.numpy as jnp

    import dcn_cupy.jax as dj
    from dcn_cupy.jax import _callbacks

    if jax.devices()[0].platform != "gpu":
        raise RuntimeError(f"JAX runs on {jax.devices()[0].platform}, not on the GPU")
    args = [jnp.asarray(host[k]) for k in ("input", "weight", "offset", "mask", "bias")]
    grad = jnp.asarray(host["grad"])

    def loss(x, w, off, m, b):
        return jnp.vdot(dj.deform_conv2d(x, w, off, m, b, padding=1), grad)

    def forward_and_gradients(*args):
        y, vjp = jax.vjp(lambda *a: dj.deform_conv2d(*a, padding=1), *args)
        return y, vjp(grad)

    step = jax.jit(forward_and_gradients if with_output else jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    out = []

    def run():
        out[:] = [step(*args)]

    old = _callbacks.RAW_ADDRESSES
    _callbacks.RAW_ADDRESSES = raw_addresses   # read at every execution of the callbacks
    try:
        return _time(run, lambda: jax.block_until_ready(out), repeats, inner)
    finally:
        _callbacks.RAW_ADDRESSES = old


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=int, default=50)
    parser.add_argument("--no-jax", action="store_true")
    opts = parser.parse_args(argv)
    import cupy
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    host = _arrays()
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {name}; torch {torch.__version__}, cupy {cupy.__version__}; "
          f"B={SHAPE['batch']} C{SHAPE['channels']}->{SHAPE['channels']} {SHAPE['size']}x{SHAPE['size']} "
          f"3x3 DCNv2, float32 strict; ms per iteration (wall clock)")
    base, plan = bench_plan(host, opts.repeats, opts.inner)
    print(f"plan: {plan.algorithm}, workspace {plan.workspace_bytes} bytes")
    paths = [
        ("dcn_cupy.torch deform_conv2d forward+backward", lambda: bench_torch_functional(host, opts.repeats, opts.inner)),
        ("dcn_cupy.torch PackedDeformConv2d training step", lambda: bench_torch_packed(opts.repeats, opts.inner)),
        ("  its extra work alone (predictor fwd+bwd, SGD)", lambda: bench_torch_extra(opts.repeats, opts.inner)),
        ("  the same step as a CUDA graph replay", lambda: bench_torch_packed_graph(opts.repeats, opts.inner)),
    ]
    if not opts.no_jax:
        paths.append(("dcn_cupy.jax jit(grad), all five gradients", lambda: bench_jax(host, opts.repeats, opts.inner)))
        paths.append(("  the same, raw-address path off (CuPy arrays)",
                      lambda: bench_jax(host, opts.repeats, opts.inner, raw_addresses=False)))
        paths.append(("dcn_cupy.jax jit(vjp): output and five gradients",
                      lambda: bench_jax(host, opts.repeats, opts.inner, with_output=True)))
        paths.append(("  the same, raw-address path off (CuPy arrays)",
                      lambda: bench_jax(host, opts.repeats, opts.inner, raw_addresses=False, with_output=True)))
    width = max(len(label) for label, _ in paths) + 2
    print(f"{'plan forward+backward (CuPy arrays)':<{width}}  {base:8.3f} ms  1.00x plan")
    results = {}
    for label, run in paths:  # one failing path (no JAX GPU, a capture error) does not hide the others
        try:
            ms = results[label] = run()
        except Exception as error:
            print(f"{label:<{width}}  failed: {type(error).__name__}: {error}")
            continue
        print(f"{label:<{width}}  {ms:8.3f} ms  {ms / base:5.2f}x plan", flush=True)
    step, extra = (results.get(label) for label, _ in paths[1:3])
    if step is not None and extra is not None:
        # The same work on the plan side, approximated as the sum of its parts (run one after the other)
        print(f"packed step / (plan + its extra work alone) = {step:.3f} / {base + extra:.3f} ms = "
              f"{step / (base + extra):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
