"""GPU memory benchmark: peak extra device memory of a call, per workspace limit.

The GPU side of ``benchmarks/memory.py`` (issue 11 item 6), at the same shapes: ``batch``
B=64 C64->64 64x64 k3 and ``wide`` B=1 C512->512 128x128 k7, float32 DCNv2 (offsets and
masks), padding k//2. For each ``DCN_CUPY_CUDA_WORKSPACE_BYTES`` limit it reports the peak of
CuPy's allocator during the forward and the forward+backward (all five gradients) beyond what
was allocated before the call (outputs, gradients and workspace included; inputs excluded), read
through a CuPy memory hook, with the time of one call; then the same through ``dcn_cupy.torch``
read off ``torch.cuda.max_memory_allocated`` (outputs, gradients and workspaces come from torch's
caching allocator there), and torchvision's ``deform_conv2d`` for comparison where installed.

    python benchmarks/memory_gpu.py                       # both shapes, limits 64M,256M
    python benchmarks/memory_gpu.py --limits 16M,64M,256M --shapes batch

Without CuPy or a CUDA device it says so and returns 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {
    "batch": dict(batch=64, channels=64, size=64, kernel=3),
    "wide": dict(batch=1, channels=512, size=128, kernel=7),
}
MIB = 2 ** 20


def _inputs(xp, shape, rng):
    b, c, s, k = shape["batch"], shape["channels"], shape["size"], shape["kernel"]
    kk = k * k
    return dict(
        input=xp.asarray(rng.standard_normal((b, c, s, s), dtype=np.float32)),
        weight=xp.asarray(rng.standard_normal((c, c, k, k), dtype=np.float32) / (c * kk) ** 0.5),
        offset=xp.asarray(rng.standard_normal((b, 2 * kk, s, s), dtype=np.float32)),
        mask=xp.asarray(rng.random((b, kk, s, s), dtype=np.float32)),
        bias=xp.asarray(rng.standard_normal(c, dtype=np.float32)),
    ), k // 2


def _cupy_peak(cupy, fn):
    """(peak extra bytes of CuPy's allocator during ``fn()``, seconds)."""
    from cupy.cuda import memory_hook

    class Peak(memory_hook.MemoryHook):
        name = "dcn_cupy_peak"

        def __init__(self):
            self.live, self.peak = 0, 0
            self.sizes = {}

        def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
            self.sizes[mem_ptr] = mem_size
            self.live += mem_size
            self.peak = max(self.peak, self.live)

        def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
            self.live -= self.sizes.pop(mem_ptr, mem_size)

    cupy.cuda.Device().synchronize()
    hook = Peak()
    tic = time.perf_counter()
    with hook:
        result = fn()
        cupy.cuda.Device().synchronize()
    seconds = time.perf_counter() - tic
    del result
    return hook.peak, seconds


def _torch_peak(torch, fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    tic = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - tic
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak, seconds


def _row(name, limit, fwd, fb):
    print(f"| {name} | {limit} | {fwd[0] / MIB:8.1f} | {fwd[1] * 1e3:8.2f} | {fb[0] / MIB:8.1f} | {fb[1] * 1e3:8.2f} |",
          flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/memory_gpu.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--limits", default="64M,256M")
    args = parser.parse_args(argv)
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as error:  # no CuPy, no driver or no device
        print(f"memory_gpu.py: nothing to measure ({type(error).__name__}: {error})")
        return 0
    import dcn_cupy
    from dcn_cupy import _limits
    from dcn_cupy._backends import cuda as dcn_cuda

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"# peak extra device memory (MiB) and time of one call (ms), float32 DCNv2, {name}")
    print("| path / shape | limit | forward MiB | forward ms | fwd+bwd MiB | fwd+bwd ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    rng = np.random.default_rng(0)
    for key in args.shapes.split(","):
        shape = SHAPES[key]
        arrays, padding = _inputs(cupy, shape, rng)
        label = f"dcn_cupy (CuPy) {key}"
        for limit in args.limits.split(","):
            dcn_cuda.WORKSPACE_LIMIT_BYTES = _limits.parse_size(limit, "--limits")
            dcn_cupy._plan.clear_plan_cache()

            def forward():
                return dcn_cupy.deform_conv2d(**arrays, padding=padding)

            def forward_backward():
                y = dcn_cupy.deform_conv2d(**arrays, padding=padding)
                return y, dcn_cupy.deform_conv2d_backward(cupy.ones_like(y), **arrays, padding=padding)

            forward_backward()  # compile and plan first
            _row(label, limit, _cupy_peak(cupy, forward), _cupy_peak(cupy, forward_backward))
        try:
            import torch
            import dcn_cupy.torch as dct
        except ImportError as error:
            print(f"| torch rows skipped: {error} | | | | | |")
            continue
        t = {k: torch.as_tensor(cupy.asnumpy(v), device="cuda") for k, v in arrays.items()}
        params = {k: t[k].clone().requires_grad_() for k in ("weight", "offset", "mask", "bias")}
        x = t["input"].clone().requires_grad_()

        def torch_step(fn):
            def run():
                y = fn(x, params["weight"], params["offset"], params["mask"], params["bias"])
                y.backward(torch.ones_like(y))
                return y
            return run

        ours = lambda a, w, o, m, b: dct.deform_conv2d(a, w, o, m, b, padding=padding)  # noqa: E731
        torch_step(ours)()
        with torch.no_grad():
            fwd = _torch_peak(torch, lambda: dct.deform_conv2d(x, params["weight"], params["offset"],
                                                                params["mask"], params["bias"], padding=padding))
        _row(f"dcn_cupy.torch {key}", "default", fwd, _torch_peak(torch, torch_step(ours)))
        try:
            import torchvision.ops as tvo
        except ImportError:
            continue
        theirs = lambda a, w, o, m, b: tvo.deform_conv2d(a, o, w, b, padding=padding, mask=m)  # noqa: E731
        torch_step(theirs)()
        with torch.no_grad():
            fwd = _torch_peak(torch, lambda: tvo.deform_conv2d(x, params["offset"], params["weight"], params["bias"],
                                                               padding=padding, mask=params["mask"]))
        _row(f"torchvision {key}", "-", fwd, _torch_peak(torch, torch_step(theirs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
