"""DistributedDataParallel check: dcn_cupy.torch modules train correctly on several processes.

One training step of a small model holding a modulated ``PackedDeformConv2d`` runs under
``torch.nn.parallel.DistributedDataParallel``, each rank on its own slice of one fixed, seeded
batch. Rank 0 then recomputes the step without DDP, in one process, on the whole batch; the
parameter gradients (and the parameters after one SGD step) must agree.

    torchrun --nproc_per_node=2 benchmarks/ddp_check.py                       # NCCL, one GPU per rank
    torchrun --nproc_per_node=2 benchmarks/ddp_check.py --backend gloo --device cpu

Prints the largest absolute and relative differences and ``DDP OK`` or ``DDP MISMATCH``;
every rank exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

# NVLink SHARP (multicast) stays off on the machines this runs on; a value set by the caller wins.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import dcn_cupy.torch as dct  # noqa: E402


def build_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(1234)
    deform = dct.PackedDeformConv2d(8, 8, 3, padding=1, offset_groups=2, mask_groups=1, modulated=True,
                                    mask_activation="sigmoid", dtype=dtype)
    # The predictors start at zero; give them small weights so that offsets are fractional and
    # the mask varies, and every gradient path is exercised.
    with torch.no_grad():
        deform.conv_offset.weight.normal_(0.0, 0.05)
        deform.conv_mask.weight.normal_(0.0, 0.05)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, dtype=dtype), nn.ReLU(),
        deform, nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5, dtype=dtype),
    )


def make_batch(batch: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(4321)
    x = torch.randn(batch, 3, 12, 12, generator=generator, dtype=dtype)
    y = torch.randint(0, 5, (batch,), generator=generator)
    return x, y


def step(model: nn.Module, x, y, lr: float):
    """Forward, backward and one SGD step; returns the gradients (taken before the step)."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return loss.detach(), grads


def compare(named_a, named_b):
    """Largest absolute difference, and largest difference relative to each tensor's scale."""
    worst_abs, worst_rel, worst_name = 0.0, 0.0, ""
    for (name, a), b in zip(named_a, named_b):
        diff = (a.double() - b.double()).abs().max().item()
        scale = b.double().abs().max().item()
        rel = diff / scale if scale > 0 else diff
        worst_abs = max(worst_abs, diff)
        if rel >= worst_rel:
            worst_rel, worst_name = rel, name
    return worst_abs, worst_rel, worst_name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="nccl", help="torch.distributed backend (nccl, gloo)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--batch", type=int, default=8, help="global batch, split evenly over the ranks")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--rtol", type=float, default=None,
                        help="largest accepted relative difference (default 1e-4 float32, 1e-9 float64)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rtol = args.rtol if args.rtol is not None else (1e-4 if dtype == torch.float32 else 1e-9)

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the world size {world}")
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if torch.cuda.device_count() <= local_rank:
            raise SystemExit(f"rank {rank} needs cuda:{local_rank}, but {torch.cuda.device_count()} GPU(s) are visible")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    model = build_model(dtype)
    reference_model = copy.deepcopy(model)  # the same initial parameters, no DDP
    x, y = make_batch(args.batch, dtype)
    share = args.batch // world
    x_local, y_local = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]

    ddp = nn.parallel.DistributedDataParallel(
        model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    loss, grads = step(ddp, x_local.to(device), y_local.to(device), args.lr)
    names = [name for name, _ in model.named_parameters()]

    # Every rank must hold the same gradients after the all-reduce.
    spread = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        g0 = g.clone()
        dist.broadcast(g0, src=0)
        scale = g0.double().abs().max().clamp_min(torch.finfo(torch.float64).tiny)
        spread = torch.maximum(spread, (g.double() - g0.double()).abs().max() / scale)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)

    ok = torch.ones((), dtype=torch.int32, device=device)
    if rank == 0:
        ref_device = torch.device("cuda", 0) if args.device == "cuda" else device
        reference_model.to(ref_device)
        ref_loss, ref_grads = step(reference_model, x.to(ref_device), y.to(ref_device), args.lr)
        grad_abs, grad_rel, grad_name = compare(zip(names, (g.to(ref_device) for g in grads)), ref_grads)
        params = [p.detach().to(ref_device) for p in model.parameters()]
        param_abs, param_rel, param_name = compare(zip(names, params),
                                                   [p.detach() for p in reference_model.parameters()])
        print(f"world size {world}, backend {args.backend}, device {args.device}, dtype {args.dtype}, "
              f"batch {args.batch} ({share} per rank)")
        print(f"gradients:  max abs diff {grad_abs:.3e}, max rel diff {grad_rel:.3e} ({grad_name})")
        print(f"parameters after one SGD step: max abs diff {param_abs:.3e}, max rel diff {param_rel:.3e} "
              f"({param_name})")
        print(f"gradient spread across ranks (relative): {spread.item():.3e}")
        good = grad_rel <= rtol and param_rel <= rtol and spread.item() <= rtol
        print("DDP OK" if good else f"DDP MISMATCH (tolerance {rtol:g})", flush=True)
        ok.fill_(int(good))
        del loss, ref_loss
    dist.broadcast(ok, src=0)
    verdict = bool(ok.item())
    dist.destroy_process_group()
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
