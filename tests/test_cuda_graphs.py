"""dcn_cupy.torch under CUDA graphs, torch.compile(mode="reduce-overhead") and torch's allocator.

GPU only (marked ``gpu``; skipped where no CUDA device is visible). Every capture follows torch's
recipe: warm-up iterations on a side stream (they build the plans, i.e. compile the kernels),
then capture, then replay on fresh data and compare with the same computation run eagerly.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import dcn_cupy.torch as dct  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA device"),
]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    deform = dct.PackedDeformConv2d(8, 8, 3, padding=1, offset_groups=2, modulated=True, mask_activation="sigmoid")
    with torch.no_grad():  # fractional offsets and a varying mask: every gradient path runs
        deform.conv_offset.weight.normal_(0, 0.05)
        deform.conv_mask.weight.normal_(0, 0.05)
    return torch.nn.Sequential(deform, torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1)).cuda()


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 8, 12, 12, generator=g).cuda(), torch.randn(4, 4, 12, 12, generator=g).cuda()


def _warm_up(fn, iterations: int = 3):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iterations):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def test_graph_capture_of_forward():
    module = _model()[0]
    static_x = _data(0)[0]
    with torch.no_grad():
        _warm_up(lambda: module(static_x))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = module(static_x)
        for step in (1, 2):
            x = _data(step)[0]
            static_x.copy_(x)
            graph.replay()
            torch.testing.assert_close(static_y, module(x), rtol=0, atol=0)


def test_graph_capture_of_training_step():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    static_x, static_t = _data(0)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(static_x), static_t)
        loss.backward()
        optimizer.step()
        return loss

    _warm_up(step)
    eager = copy.deepcopy(model)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = step()
    for k in (1, 2, 3):
        x, t = _data(k)
        static_x.copy_(x)
        static_t.copy_(t)
        graph.replay()
        eager_optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(eager(x), t)
        loss.backward()
        eager_optimizer.step()
        # The backward scatters with atomics: equal up to float32 summation order.
        torch.testing.assert_close(static_loss, loss, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_torch_compile_reduce_overhead_training_step():
    counters = None
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover
        pass
    torch._dynamo.reset()
    if counters is not None:
        counters.clear()
    model = _model()
    eager = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    loss_of = torch.compile(lambda x, t: F.mse_loss(model(x), t), mode="reduce-overhead", fullgraph=True)
    for k in range(4):  # warm-up, recording, then replays
        x, t = _data(k)
        torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(x, t)
        loss.backward()
        optimizer.step()
        eager_optimizer.zero_grad(set_to_none=True)
        expected = F.mse_loss(eager(x), t)
        expected.backward()
        eager_optimizer.step()
        torch.testing.assert_close(loss.detach().clone(), expected.detach(), rtol=1e-4, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5, msg=name)
    if counters is not None:  # the graphs ran as CUDA graphs, not silently eagerly
        assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])


def test_torch_allocator_holds_every_buffer():
    import cupy

    from dcn_cupy.torch import _plans

    g = torch.Generator().manual_seed(0)
    shapes = dict(input=(8, 16, 20, 20), weight=(16, 16, 3, 3), offset=(8, 36, 20, 20), mask=(8, 18, 20, 20),
                  bias=(16,))
    args = {k: torch.randn(s, generator=g).cuda().requires_grad_() for k, s in shapes.items()}
    params = dict(padding=1)
    dct.deform_conv2d(**args, **params).sum().backward()  # builds the plan
    plan = _plans.plan_for(False, tuple(args.values()), ([1, 1], [1, 1], (), [1, 1], 1))
    torch.cuda.synchronize()
    pool = cupy.get_default_memory_pool()
    used, total = pool.used_bytes(), pool.total_bytes()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = dct.deform_conv2d(**args, **params)
    assert torch.cuda.memory_allocated() - before >= y.numel() * y.element_size()
    assert torch.cuda.max_memory_allocated() - before >= plan.forward_workspace_bytes
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y.sum().backward()
    assert torch.cuda.max_memory_allocated() - before >= plan.backward_workspace_bytes
    torch.cuda.synchronize()
    assert (pool.used_bytes(), pool.total_bytes()) == (used, total), "CuPy's memory pool was used"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_building_a_plan_leaves_cupys_pool_alone(dtype):
    """The first call of a configuration builds its plan, which times the fused kernels against
    cuda/im2col on random data (half types): those buffers come from a private pool, emptied."""
    import cupy

    g = torch.Generator().manual_seed(1)
    shapes = dict(input=(3, 40, 13, 11), weight=(48, 40, 3, 3), offset=(3, 18, 13, 11), mask=(3, 9, 13, 11))
    args = {k: torch.randn(s, generator=g).to("cuda", dtype).requires_grad_() for k, s in shapes.items()}
    torch.cuda.synchronize()
    pool = cupy.get_default_memory_pool()
    used, total = pool.used_bytes(), pool.total_bytes()
    dct.deform_conv2d(**args, padding=1).sum().backward()   # a configuration met here first
    torch.cuda.synchronize()
    assert (pool.used_bytes(), pool.total_bytes()) == (used, total), "CuPy's memory pool was used"


def test_no_deprecation_warning_from_dcn_cupy():
    module = _model()
    x = _data(0)[0].requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module(x).sum().backward()
        torch.cuda.synchronize()
    bad = [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))
           and ("dcn_cupy" in w.filename or "ExternalStream" in str(w.message))]
    assert not bad, [f"{w.filename}:{w.lineno}: {w.message}" for w in bad]


def test_tf32_follows_torch_flag():
    torch.manual_seed(0)
    x = torch.randn(2, 64, 16, 16, device="cuda")
    w = torch.randn(64, 64, 3, 3, device="cuda")
    offset = 0.5 * torch.randn(2, 18, 16, 16, device="cuda")
    exact = dct.deform_conv2d(x.double(), w.double(), offset.double(), padding=1)
    errors = {}
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for flag in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = flag
            y = dct.deform_conv2d(x, w, offset, padding=1)
            errors[flag] = (y.double() - exact).abs().max().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    # strict float32 ~1e-5 here; TF32 (10-bit mantissa) ~1e-2
    assert errors[False] < 1e-3 and errors[True] > 10 * errors[False], errors
