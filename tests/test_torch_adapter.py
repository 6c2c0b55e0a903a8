"""dcn_cupy.torch: custom ops, autograd, functional forms, modules, torch.compile, CUDA streams.

CPU tests run everywhere torch is installed; tests marked ``gpu`` need a CUDA device (conftest.py
skips them where none is visible) and a CUDA build of torch.

Gradients are checked with ``torch.autograd.gradcheck`` in float64 on tiny shapes, with offsets
whose fractional part lies in [0.2, 0.8]: sample positions stay away from the integer
positions where bilinear interpolation has kinks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import dcn_cupy  # noqa: E402
from dcn_cupy import reference  # noqa: E402
import dcn_cupy.torch as dct  # noqa: E402

F64 = torch.float64
NAMES = ("input", "weight", "offset", "mask", "bias")

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA device")


def fractional_offsets(generator, shape, spread=2):
    whole = torch.randint(-spread, spread + 1, shape, generator=generator).to(F64)
    return whole + 0.2 + 0.6 * torch.rand(shape, generator=generator, dtype=F64)


def _k(kernel, n):
    return tuple(kernel) if isinstance(kernel, tuple) else (kernel,) * n


def conv_case(n, *, batch=2, c_in=4, c_out=4, spatial=None, kernel=2, stride=1, padding=0, dilation=1,
              groups=1, offset_groups=1, mask_groups=1, offset=True, mask=True, bias=True, seed=0):
    """Float64 arguments of a deform_convNd call (a dict) and its hyper-parameters."""
    g = torch.Generator().manual_seed(seed)
    spatial = spatial or (5,) * n
    k = _k(kernel, n)
    s, p, d = (_k(v, n) for v in (stride, padding, dilation))
    q = tuple((spatial[a] + 2 * p[a] - d[a] * (k[a] - 1) - 1) // s[a] + 1 for a in range(n))
    K = math.prod(k)
    lead = (batch,) if batch is not None else ()
    args = {
        "input": torch.randn(lead + (c_in,) + tuple(spatial), generator=g, dtype=F64),
        "weight": torch.randn((c_out, c_in // groups) + k, generator=g, dtype=F64),
        "offset": fractional_offsets(g, lead + (offset_groups * K * n,) + q) if offset else None,
        "mask": torch.rand(lead + (mask_groups * K,) + q, generator=g, dtype=F64) + 0.5 if mask else None,
        "bias": torch.randn((c_out,), generator=g, dtype=F64) if bias else None,
    }
    params = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    return args, params


def transpose_case(n, *, batch=2, c_in=4, c_out=4, spatial=None, kernel=2, stride=1, padding=0,
                   output_padding=0, dilation=1, groups=1, offset_groups=1, mask_groups=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    spatial = spatial or (3,) * n
    k = _k(kernel, n)
    K = math.prod(k)
    args = {
        "input": torch.randn((batch, c_in) + tuple(spatial), generator=g, dtype=F64),
        "weight": torch.randn((c_in, c_out // groups) + k, generator=g, dtype=F64),
        "offset": fractional_offsets(g, (batch, offset_groups * K * n) + tuple(spatial)),
        "mask": torch.rand((batch, mask_groups * K) + tuple(spatial), generator=g, dtype=F64) + 0.5,
        "bias": torch.randn((c_out,), generator=g, dtype=F64),
    }
    params = dict(stride=stride, padding=padding, output_padding=output_padding, dilation=dilation,
                  groups=groups)
    return args, params


def to(args, device):
    return {k: None if v is None else v.to(device) for k, v in args.items()}


def _gradcheck(fn, args, params, device="cpu"):
    names = [k for k, v in args.items() if v is not None]
    leaves = [args[k].detach().to(device).requires_grad_() for k in names]

    def f(*tensors):
        return fn(**dict(args, **dict(zip(names, tensors))), **params)

    # CUDA backward kernels accumulate with atomics: two runs may differ in the last bits.
    nondet_tol = 1e-10 if torch.device(device).type == "cuda" else 0.0
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5, nondet_tol=nondet_tol)


CONV_CASES = {
    # 1D: groups 2, offset groups 2 != mask groups 1, stride/padding.
    "1d": (1, dict(c_in=4, c_out=2, spatial=(7,), kernel=3, stride=2, padding=1, groups=2,
                   offset_groups=2, mask_groups=1)),
    # 2D: non-square kernel, per-axis stride/padding/dilation, G_o=2, G_m=4, groups 2.
    "2d": (2, dict(c_in=4, c_out=2, spatial=(5, 6), kernel=(2, 3), stride=(1, 2), padding=(1, 0),
                   dilation=(2, 1), groups=2, offset_groups=2, mask_groups=4)),
    # 3D: G_o=1, G_m=2.
    "3d": (3, dict(batch=1, c_in=2, c_out=2, spatial=(4, 3, 4), kernel=2, padding=(1, 0, 1),
                   dilation=(1, 1, 2), offset_groups=1, mask_groups=2)),
}

TRANSPOSE_CASES = {
    "1d": (1, dict(c_in=4, c_out=2, spatial=(4,), kernel=3, stride=2, padding=1, output_padding=1,
                   groups=2, offset_groups=2, mask_groups=1)),
    "2d": (2, dict(c_in=2, c_out=4, spatial=(3, 2), kernel=(2, 3), stride=(2, 1), padding=(0, 1),
                   output_padding=(1, 0), dilation=(1, 2), offset_groups=2, mask_groups=4)),
    "3d": (3, dict(batch=1, c_in=2, c_out=2, spatial=(2, 3, 2), kernel=2, stride=(2, 1, 1), padding=0,
                   output_padding=(1, 0, 0), mask_groups=2)),
}


# ---------------------------------------------------------------------------------------------
# gradients


@pytest.mark.parametrize("label", sorted(CONV_CASES))
def test_deform_conv_gradcheck(label):
    n, kwargs = CONV_CASES[label]
    args, params = conv_case(n, **kwargs)
    _gradcheck(getattr(dct, f"deform_conv{n}d"), args, params)


@pytest.mark.parametrize("label", sorted(TRANSPOSE_CASES))
def test_deform_conv_transpose_gradcheck(label):
    n, kwargs = TRANSPOSE_CASES[label]
    args, params = transpose_case(n, **kwargs)
    _gradcheck(getattr(dct, f"deform_conv_transpose{n}d"), args, params)


def test_gradcheck_unbatched_and_without_mask_or_bias():
    args, params = conv_case(2, batch=None, c_in=2, c_out=2, spatial=(4, 4), padding=1, mask=False, bias=False)
    _gradcheck(dct.deform_conv2d, args, params)
    args, params = conv_case(1, c_in=2, c_out=2, spatial=(6,), kernel=3, offset=False)
    _gradcheck(dct.deform_conv, args, params)  # generic form, N from weight.dim()


@pytest.mark.parametrize("n, kernel", [(1, 3), (2, (2, 3)), (3, 2)])
def test_mask_softmax_gradcheck(n, kernel):
    K = math.prod(_k(kernel, n))
    g = torch.Generator().manual_seed(n)
    mask = 2 * torch.randn((2, 2 * K) + (3,) * n, generator=g, dtype=F64)
    fn = getattr(dct, f"mask_softmax{n}d")
    assert torch.autograd.gradcheck(lambda m: fn(m, kernel), (mask.requires_grad_(),))
    y = fn(mask.detach(), kernel)
    torch.testing.assert_close(y.view(2, 2, K, *y.shape[2:]).sum(2), torch.ones((2, 2) + (3,) * n, dtype=F64))


def test_mask_sigmoid_gradcheck():
    mask = torch.randn(2, 9, 3, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda m: dct.mask_sigmoid(m, 1.5), (mask,))
    torch.testing.assert_close(dct.mask_sigmoid(mask), 2 * torch.sigmoid(mask))


def test_only_requested_gradients_are_computed(monkeypatch):
    args, params = conv_case(2, c_in=2, c_out=2, spatial=(4, 4))
    full = dcn_cupy.deform_conv2d_backward(torch.ones(2, 2, 3, 3, dtype=F64), **args, **params)
    calls = []
    original = dcn_cupy._plan.Plan._backward  # every backward of a plan runs through it

    def spy(self, natives, wanted, *a, **k):
        calls.append(set(wanted))
        return original(self, natives, wanted, *a, **k)

    monkeypatch.setattr(dcn_cupy._plan.Plan, "_backward", spy)
    leaves = {k: v.clone().requires_grad_(k in ("offset", "mask")) for k, v in args.items()}
    dct.deform_conv2d(**leaves, **params).sum().backward()
    assert calls == [{"offset", "mask"}]
    for name in NAMES:
        if name in ("offset", "mask"):
            torch.testing.assert_close(leaves[name].grad, getattr(full, name))
        else:
            assert leaves[name].grad is None


def test_forward_matches_core_and_reference():
    n, kwargs = CONV_CASES["2d"]
    args, params = conv_case(n, **kwargs)
    y = dct.deform_conv2d(**args, **params)
    np.testing.assert_allclose(y.numpy(), dcn_cupy.deform_conv2d(**args, **params).numpy(), rtol=0, atol=0)
    ref = reference.deform_conv(**{k: None if v is None else v.numpy() for k, v in args.items()},
                                         **params)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-12, atol=1e-12)


def test_non_contiguous_arguments():
    args, params = conv_case(2, c_in=4, c_out=4, spatial=(5, 5), padding=1)
    one_mask = args["mask"][:1]
    args["mask"] = one_mask.expand_as(args["mask"]).contiguous()
    expected = dct.deform_conv2d(**args, **params)
    strided = dict(args)
    strided["input"] = args["input"].contiguous(memory_format=torch.channels_last)
    strided["weight"] = args["weight"].transpose(2, 3).contiguous().transpose(2, 3)
    strided["offset"] = torch.stack([args["offset"], torch.zeros_like(args["offset"])], -1)[..., 0]
    strided["mask"] = one_mask.expand_as(args["mask"])  # stride 0 along the batch
    assert not any(strided[k].is_contiguous() for k in ("input", "weight", "offset", "mask"))
    leaves = {k: v.detach().requires_grad_() for k, v in strided.items()}
    y = dct.deform_conv2d(**leaves, **params)
    torch.testing.assert_close(y, expected)
    # grad_output of .expand()/.sum() is stride-0: the backward must not read it as dense memory.
    y.sum().backward()
    ref = dcn_cupy.deform_conv2d_backward(torch.ones_like(expected), **args, **params)
    for name in NAMES:
        torch.testing.assert_close(leaves[name].grad, getattr(ref, name))


@pytest.mark.skipif(not hasattr(torch, "_neg_view"), reason="torch._neg_view not available")
def test_lazily_negated_tensor_is_resolved():
    # DLPack export ignores torch's negative bit; the adapter resolves it before the core sees it.
    args, params = conv_case(1, c_in=2, c_out=2, spatial=(6,), kernel=3)
    negated = dict(args, input=torch._neg_view(-args["input"]))
    assert negated["input"].is_neg()
    torch.testing.assert_close(dct.deform_conv1d(**negated, **params), dct.deform_conv1d(**args, **params))


def test_double_backward_is_refused_and_create_graph_gradients_are_right():
    # The eager backward is differentiable once (torch's once_differentiable, applied when
    # autograd records the backward): a second differentiation raises, as for torchvision's op.
    args, params = conv_case(2, c_in=2, c_out=2, spatial=(4, 4))
    leaves = {k: v.clone().requires_grad_() for k, v in args.items()}
    y = dct.deform_conv2d(**leaves, **params)
    gy = torch.ones_like(y, requires_grad=True)   # a grad_output that autograd differentiates
    grads = torch.autograd.grad(y, list(leaves.values()), gy, create_graph=True)
    ref = dcn_cupy.deform_conv2d_backward(torch.ones_like(y), **args, **params)
    for name, g in zip(leaves, grads):
        torch.testing.assert_close(g.detach(), getattr(ref, name))
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grads[0].sum().backward()
    # without create_graph the gradients are plain tensors
    grads = torch.autograd.grad(dct.deform_conv2d(**leaves, **params).sum(), list(leaves.values()))
    assert all(g.grad_fn is None and not g.requires_grad for g in grads)


def test_hyper_parameters_checked_at_every_call():
    # the checked hyper-parameters are memoised: a bad value still raises every time
    args, params = conv_case(2, c_in=2, c_out=2, spatial=(4, 4))
    good = dct.deform_conv2d(**args, **params)
    for _ in range(2):
        torch.testing.assert_close(dct.deform_conv2d(**args, **params), good, rtol=0, atol=0)
        with pytest.raises(TypeError, match="stride must be an int, got bool True"):
            dct.deform_conv2d(**args, **dict(params, stride=True))
        with pytest.raises(ValueError, match=r"padding must be >= 0, got \(-1, 1\)"):
            dct.deform_conv2d(**args, **dict(params, padding=(-1, 1)))
        with pytest.raises(ValueError, match="stride must be an int or a sequence of 2 ints"):
            dct.deform_conv2d(**args, **dict(params, stride=(1, 1, 1)))


# ---------------------------------------------------------------------------------------------
# custom ops


def _opcheck(op, args):
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_eager_path_equals_the_registered_op(transposed):
    # Eager calls run an autograd.Function that skips the dispatcher; traced calls the op.
    if transposed:
        a, p = transpose_case(2, **TRANSPOSE_CASES["2d"][1])
        op, hyper = torch.ops.dcn_cupy.deform_conv_transpose, ([2, 1], [0, 1], [1, 0], [1, 2], 1)
        fn = dct.deform_conv_transpose2d
    else:
        a, p = conv_case(2, **CONV_CASES["2d"][1])
        op, hyper = torch.ops.dcn_cupy.deform_conv, ([1, 2], [1, 0], [2, 1], 2)
        fn = dct.deform_conv2d
    results = []
    for path in ("eager", "op"):
        leaves = {k: v.clone().requires_grad_() for k, v in a.items()}
        y = fn(**leaves, **p) if path == "eager" else op(*leaves.values(), *hyper)
        assert (type(y.grad_fn).__name__ == "EagerConvBackward") == (path == "eager")
        y.backward(torch.ones_like(y))
        results.append([y.detach()] + [leaves[k].grad for k in NAMES])
    for eager, op_result in zip(*results):
        torch.testing.assert_close(eager, op_result, rtol=0, atol=0)


def test_opcheck_deform_conv_ops():
    ops = torch.ops.dcn_cupy
    n, kwargs = CONV_CASES["2d"]
    a, p = conv_case(n, **kwargs)
    hyper = ([1, 2], [1, 0], [2, 1], 2)
    leaves = [None if v is None else v.clone().requires_grad_() for v in a.values()]
    _opcheck(ops.deform_conv.default, (*leaves, *hyper))
    y = ops.deform_conv.default(*a.values(), *hyper)
    _opcheck(ops.deform_conv_backward.default,
             (torch.randn_like(y), *a.values(), *hyper, [True, False, True, True, False]))
    # missing offset / mask / bias, unbatched input
    a, _ = conv_case(1, batch=None, c_in=2, c_out=2, spatial=(6,), kernel=3, offset=False, mask=False, bias=False)
    _opcheck(ops.deform_conv.default, (a["input"].requires_grad_(), a["weight"].requires_grad_(), None, None, None,
                                       [1], [1], [1], 1))


def test_opcheck_deform_conv_transpose_ops():
    ops = torch.ops.dcn_cupy
    n, kwargs = TRANSPOSE_CASES["2d"]
    a, _ = transpose_case(n, **kwargs)
    hyper = ([2, 1], [0, 1], [1, 0], [1, 2], 1)
    leaves = [v.clone().requires_grad_() for v in a.values()]
    _opcheck(ops.deform_conv_transpose.default, (*leaves, *hyper))
    y = ops.deform_conv_transpose.default(*a.values(), *hyper)
    _opcheck(ops.deform_conv_transpose_backward.default,
             (torch.randn_like(y), *a.values(), *hyper, [True, True, True, True, True]))


def test_opcheck_mask_ops():
    ops = torch.ops.dcn_cupy
    mask = torch.randn(2, 18, 3, 4, dtype=F64, requires_grad=True)
    _opcheck(ops.mask_softmax.default, (mask, [3, 3]))
    _opcheck(ops.mask_sigmoid.default, (mask, 1.5))
    y = ops.mask_softmax.default(mask.detach(), [3, 3])
    _opcheck(ops.mask_softmax_backward.default, (torch.randn_like(y), y, [3, 3]))
    y = ops.mask_sigmoid.default(mask.detach(), 1.5)
    _opcheck(ops.mask_sigmoid_backward.default, (torch.randn_like(y), y, 1.5))


def test_fake_kernels_validate_and_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 4, 9, 8)
        w = torch.empty(6, 2, 3, 3)
        y = dct.deform_conv2d(x, w, torch.empty(2, 18, 4, 6), None, None, stride=(2, 1), padding=(0, 0),
                              dilation=(1, 1), groups=2)
        assert tuple(y.shape) == (2, 6, 4, 6)
        z = dct.deform_conv_transpose3d(torch.empty(1, 4, 2, 3, 2), torch.empty(4, 3, 2, 2, 2), stride=2,
                                        output_padding=1, groups=2)
        assert tuple(z.shape) == (1, 6, 5, 7, 5)
        with pytest.raises(ValueError, match="offset.shape\\[1\\] must be a positive multiple"):
            dct.deform_conv2d(x, w, torch.empty(2, 17, 7, 6), groups=2)


# ---------------------------------------------------------------------------------------------
# functional errors and the core's refusal of tensors that require grad


def test_core_refuses_tensor_that_requires_grad():
    args, params = conv_case(2, c_in=2, c_out=2, spatial=(4, 4))
    x = args["input"].requires_grad_()
    with pytest.raises(TypeError, match="dcn_cupy.torch"):
        dcn_cupy.deform_conv2d(x, args["weight"], args["offset"])


def test_functional_errors():
    x = torch.randn(1, 2, 5, 5)
    with pytest.raises(ValueError, match="weight must be 4-D"):
        dct.deform_conv2d(x, torch.randn(2, 2, 3))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        dct.deform_conv2d(x.numpy(), torch.randn(2, 2, 3, 3))
    with pytest.raises(ValueError, match="stride must be an int or a sequence of 2 ints"):
        dct.deform_conv2d(x, torch.randn(2, 2, 3, 3), stride=(1, 1, 1))
    with pytest.raises(ValueError, match="offset.shape\\[1\\] must be a positive multiple of 2\\*K=18"):
        dct.deform_conv2d(x, torch.randn(2, 2, 3, 3), torch.zeros(1, 20, 3, 3))


def test_autocast_cpu_bfloat16():
    conv = dct.DeformConv2d(4, 4, 3, padding=1)
    x = torch.randn(2, 4, 5, 5)
    offset = torch.zeros(2, 18, 5, 5, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = conv(x, offset)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert conv.weight.grad.dtype == torch.float32 and offset.grad.dtype == torch.float32
    torch.testing.assert_close(y.float(), F.conv2d(x, conv.weight, conv.bias, padding=1), atol=0.1, rtol=0.05)


# ---------------------------------------------------------------------------------------------
# modules


PLAIN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
PLAIN_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@pytest.mark.parametrize("n", [1, 2, 3])
def test_deform_conv_module(n):
    conv = getattr(dct, f"DeformConv{n}d")(4, 6, 3, stride=2, padding=1, groups=2, dtype=F64)
    assert [name for name, _ in conv.named_parameters()] == ["weight", "bias"]
    assert conv.weight.shape == (6, 2) + (3,) * n
    x = torch.randn((2, 4) + (5,) * n, dtype=F64)
    # no offset, no mask: the plain convolution
    torch.testing.assert_close(conv(x), PLAIN[n](x, conv.weight, conv.bias, stride=2, padding=1, groups=2))
    offset = torch.randn((2, n * 3 ** n * 2) + (3,) * n, dtype=F64)
    mask = torch.rand((2, 3 ** n) + (3,) * n, dtype=F64)
    y = conv(x, offset, mask)
    assert y.shape == (2, 6) + (3,) * n
    y.sum().backward()
    assert conv.weight.grad is not None and conv.bias.grad is not None
    assert "groups=2" in repr(conv) and "padding=" in repr(conv)
    bound = 1 / math.sqrt(2 * 3 ** n)  # kaiming_uniform(a=sqrt(5)) bound = 1/sqrt(fan_in)
    assert conv.weight.abs().max() <= bound and conv.bias.abs().max() <= bound


@pytest.mark.parametrize("n", [1, 2, 3])
def test_deform_conv_transpose_module(n):
    conv = getattr(dct, f"DeformConvTranspose{n}d")(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2,
                                                    dtype=F64)
    assert conv.weight.shape == (4, 3) + (3,) * n
    x = torch.randn((2, 4) + (3,) * n, dtype=F64)
    expected = PLAIN_T[n](x, conv.weight, conv.bias, stride=2, padding=1, output_padding=1, groups=2)
    torch.testing.assert_close(conv(x), expected)
    assert expected.shape == (2, 6) + (6,) * n
    offset = torch.randn((2, n * 3 ** n) + (3,) * n, dtype=F64)
    y = conv(x, offset, torch.rand((2, 3 ** n) + (3,) * n, dtype=F64))
    assert y.shape == expected.shape
    y.sum().backward()
    assert conv.weight.grad is not None and conv.bias.grad is not None
    # output_size picks output_padding, as torch.nn.ConvTransposeNd does
    assert conv(x, output_size=(5,) * n).shape == (2, 6) + (5,) * n
    with pytest.raises(ValueError, match="output size"):
        conv(x, output_size=(8,) * n)
    assert "output_padding=" in repr(conv)


def test_padding_mode():
    conv = dct.DeformConv2d(2, 3, 3, padding=(1, 2), padding_mode="reflect", dtype=F64)
    x = torch.randn(1, 2, 5, 6, dtype=F64)
    nn_conv = torch.nn.Conv2d(2, 3, 3, padding=(1, 2), padding_mode="reflect", dtype=F64)
    with torch.no_grad():
        nn_conv.weight.copy_(conv.weight)
        nn_conv.bias.copy_(conv.bias)
    torch.testing.assert_close(conv(x), nn_conv(x))
    with pytest.raises(ValueError, match="padding_mode"):
        dct.DeformConvTranspose2d(2, 3, 3, padding_mode="reflect")


PACKED_CASES = [
    # (n, transposed, mask_activation, the mask at initialisation: the activation of 0)
    (1, False, "softmax", 1 / 3), (2, False, "sigmoid", 0.5), (3, False, None, 0.0), (2, False, "none", 0.0),
    (1, True, "sigmoid", 0.5), (2, True, "softmax", 1 / 9), (3, True, None, 0.0),
]


@pytest.mark.parametrize("n, transposed, activation, value", PACKED_CASES)
def test_packed_module_at_init_is_a_plain_convolution(n, transposed, activation, value):
    name = f"PackedDeformConvTranspose{n}d" if transposed else f"PackedDeformConv{n}d"
    kwargs = dict(output_padding=1) if transposed else {}
    module = getattr(dct, name)(4, 6, 3, stride=2, padding=1, groups=2, offset_groups=2, mask_groups=2,
                                modulated=True, mask_activation=activation, dtype=F64, **kwargs)
    names = {name for name, _ in module.named_parameters()}
    assert names == {"weight", "bias", "conv_offset.weight", "conv_offset.bias", "conv_mask.weight",
                     "conv_mask.bias"}
    K = 3 ** n
    assert module.conv_offset.out_channels == 2 * n * K and module.conv_mask.out_channels == 2 * K
    assert not module.conv_offset.weight.any() and not module.conv_mask.weight.any()
    x = torch.randn((2, 4) + (4,) * n, dtype=F64)
    y = module(x)
    if transposed:
        plain = PLAIN_T[n](x, module.weight, None, stride=2, padding=1, output_padding=1, groups=2)
    else:
        plain = PLAIN[n](x, module.weight, None, stride=2, padding=1, groups=2)
    expected = value * plain + module.bias.view(-1, *(1,) * n)
    torch.testing.assert_close(y, expected)
    (y * torch.randn_like(y)).sum().backward()
    for pname, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    # Offsets learn from the first step, unless the mask is 0 (no activation on a zero predictor).
    assert (module.conv_offset.weight.grad.abs().sum() > 0) == (value != 0)
    assert module.conv_mask.weight.grad.abs().sum() > 0
    assert "modulated=True" in repr(module) and "offset_groups=2" in repr(module)


def test_packed_module_options():
    m = dct.PackedDeformConv2d(4, 4, 3, deformable=False, modulated=False)
    assert m.conv_offset is None and m.conv_mask is None
    x = torch.randn(1, 4, 5, 5)
    torch.testing.assert_close(m(x), F.conv2d(x, m.weight, m.bias))
    m = dct.PackedDeformConv2d(4, 4, 3, modulated=True, mask_activation=dct.MaskSigmoid(2.0), bias=False)
    torch.testing.assert_close(m(x), F.conv2d(x, m.weight))  # 2*sigmoid(0) = 1
    with pytest.raises(ValueError, match="mask_activation"):
        dct.PackedDeformConv2d(4, 4, 3, modulated=True, mask_activation="relu")
    with pytest.raises(ValueError, match="in_channels must be divisible by offset_groups"):
        dct.PackedDeformConv2d(4, 4, 3, offset_groups=3)
    with pytest.raises(ValueError, match="out_channels must be divisible by mask_groups"):
        dct.PackedDeformConvTranspose2d(4, 6, 3, mask_groups=4, modulated=True)
    m.reset_parameters()
    assert not m.conv_mask.weight.any()


def test_torch_compile_packed_module_cpu():
    # The default backend (inductor, C++ through gcc) compiles this graph in well under a minute.
    torch._dynamo.reset()
    module = dct.PackedDeformConv2d(4, 6, 3, padding=1, offset_groups=2, modulated=True)
    with torch.no_grad():
        module.conv_offset.weight.normal_(0, 0.1)
        module.conv_mask.weight.normal_(0, 0.1)
    x = torch.randn(2, 4, 7, 7, requires_grad=True)
    compiled = torch.compile(module, fullgraph=True)
    y = compiled(x)
    y.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    gx = x.grad.clone()
    module.zero_grad()
    x.grad = None
    y_eager = module(x)
    y_eager.square().sum().backward()
    torch.testing.assert_close(y, y_eager)
    torch.testing.assert_close(gx, x.grad)
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_dcn_cupy_does_not_import_torch_adapter():
    import subprocess
    import sys

    code = "import sys, dcn_cupy; assert 'dcn_cupy.torch' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# GPU


def _labelled_case(kind, label):
    """(args, params, the dct function) of CONV_CASES / TRANSPOSE_CASES[label]."""
    if kind == "conv":
        n, kwargs = CONV_CASES[label]
        args, params = conv_case(n, **kwargs)
        return args, params, getattr(dct, f"deform_conv{n}d")
    n, kwargs = TRANSPOSE_CASES[label]
    args, params = transpose_case(n, **kwargs)
    return args, params, getattr(dct, f"deform_conv_transpose{n}d")


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("kind, label", [("conv", "2d"), ("conv", "3d"), ("transpose", "2d")])
def test_gradcheck_cuda_float64(kind, label):
    args, params, fn = _labelled_case(kind, label)
    _gradcheck(fn, args, params, device="cuda")
    # and the same numbers as the CPU backend
    cpu = fn(**args, **params)
    torch.testing.assert_close(fn(**to(args, "cuda"), **params).cpu(), cpu, rtol=1e-10, atol=1e-10)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("kind, label", [("conv", "2d"), ("conv", "1d"), ("transpose", "2d"), ("transpose", "3d")])
@pytest.mark.parametrize("wrt", ["all", "input", "bias", "weight+mask"])
def test_raw_address_path_equals_array_path(kind, label, wrt, monkeypatch):
    """Contiguous CUDA tensors reach the plan as raw addresses (Plan.launch_forward/backward);
    the results equal the array path's (views, checks, CuPy scopes) for every gradient subset."""
    from dcn_cupy import _plan
    from dcn_cupy.torch import _runtime

    args, params, fn = _labelled_case(kind, label)
    names = {"all": NAMES, "input": ("input",), "bias": ("bias",), "weight+mask": ("weight", "mask")}[wrt]
    calls = []
    for method in ("launch_forward", "launch_backward"):
        original = getattr(_plan.Plan, method)

        def spy(self, *a, _original=original, _method=method, **k):
            done = _original(self, *a, **k)
            calls.append((_method, done))
            return done

        monkeypatch.setattr(_plan.Plan, method, spy)

    def run():
        leaves = {k: v.cuda().requires_grad_(k in names) for k, v in args.items() if v is not None}
        y = fn(**leaves, **params)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=F64, device="cuda").reshape(y.shape))
        return y.detach(), {k: v.grad for k, v in leaves.items() if k in names}

    y_fast, g_fast = run()
    assert ("launch_forward", True) in calls and ("launch_backward", True) in calls, calls
    calls.clear()
    monkeypatch.setattr(_runtime, "launch_addresses", lambda tensors: None)
    y_slow, g_slow = run()
    assert not calls
    torch.testing.assert_close(y_fast, y_slow, rtol=1e-12, atol=1e-12)
    assert set(g_fast) == set(names)
    for k in names:
        torch.testing.assert_close(g_fast[k], g_slow[k], rtol=1e-10, atol=1e-10, msg=k)


@pytest.mark.gpu
@cuda_only
def test_raw_address_path_is_skipped_for_non_contiguous_tensors():
    from dcn_cupy.torch import _runtime

    n, kwargs = CONV_CASES["2d"]
    args, params = conv_case(n, **kwargs)
    cuda = {k: v.cuda() for k, v in args.items()}
    assert _runtime.launch_addresses(tuple(cuda[k] for k in NAMES)) is not None
    strided = dict(cuda, input=cuda["input"].transpose(2, 3).contiguous().transpose(2, 3))
    assert _runtime.launch_addresses(tuple(strided[k] for k in NAMES)) is None
    assert _runtime.launch_addresses(tuple(dict(cuda, weight=cuda["weight"].float())[k] for k in NAMES)) is None
    torch.testing.assert_close(dct.deform_conv2d(**strided, **params), dct.deform_conv2d(**cuda, **params),
                               rtol=1e-12, atol=1e-12)


def _stream_case():
    n, kwargs = CONV_CASES["2d"]
    return conv_case(n, **dict(kwargs, batch=4, c_in=8, c_out=8, spatial=(33, 31)))


@pytest.mark.gpu
@cuda_only
def test_runs_on_torch_current_stream():
    args, params = _stream_case()
    names = [k for k, v in args.items() if v is not None]
    # Reference on the default stream (also compiles every kernel the stream run needs).
    ref_leaves = {k: args[k].cuda().float().requires_grad_() for k in names}
    ref = dct.deform_conv2d(**ref_leaves, **params)
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).cuda()
    ref.backward(grad_out)
    torch.cuda.synchronize()

    host = {k: args[k].float().pin_memory() for k in names}

    def side_stream_leaves():
        leaves = {}
        for k in names:
            t = torch.empty(host[k].shape, device="cuda").fill_(float("nan"))
            t.copy_(host[k], non_blocking=True)
            leaves[k] = t.requires_grad_()
        return leaves

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        # torch's first making of these inputs in a process (empty, fill_, copy_) waited for the
        # device (on an H100: 2 s behind a 2 s sleep when this test ran first), so make them once
        # before the sleep: the test is about the op, not torch's set-up.
        side_stream_leaves()
        s.synchronize()
        # Keep the side stream busy, then produce the inputs on it: a kernel launched on any
        # other stream (without waiting for s) would read them before they are written.
        torch.cuda._sleep(500_000_000)
        leaves = side_stream_leaves()
        assert not s.query(), "making the inputs synchronised with the side stream"
        y = dct.deform_conv2d(**leaves, **params)
        assert not s.query(), "the op synchronised with the side stream"
        g = torch.empty_like(y).copy_(grad_out)
        y.backward(g)
    s.synchronize()
    torch.testing.assert_close(y, ref.detach(), rtol=1e-5, atol=1e-5)
    for k in names:
        torch.testing.assert_close(leaves[k].grad, ref_leaves[k].grad, rtol=1e-4, atol=1e-4, msg=k)


@pytest.mark.gpu
@cuda_only
def test_torch_compile_cuda():
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = dct.PackedDeformConv2d(8, 8, 3, padding=1, offset_groups=2, modulated=True,
                                    mask_activation="sigmoid").cuda()
    with torch.no_grad():
        module.conv_offset.weight.normal_(0, 0.05)
        module.conv_mask.weight.normal_(0, 0.05)
    x = torch.randn(2, 8, 16, 16, device="cuda", requires_grad=True)
    compiled = torch.compile(module, fullgraph=True)
    y = compiled(x)
    y.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad()
    y_eager = module(x)
    y_eager.square().sum().backward()
    torch.testing.assert_close(y, y_eager, rtol=1e-4, atol=1e-4)
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-3, atol=1e-3, msg=name)


@pytest.mark.gpu
@cuda_only
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_model_on_second_device():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        dct.PackedDeformConv2d(4, 8, 3, padding=1, modulated=True, mask_activation="sigmoid"),
        torch.nn.ReLU(),
        dct.DeformConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1),
    ).double()
    with torch.no_grad():
        model[0].conv_offset.weight.normal_(0, 0.05)
    x = torch.randn(2, 4, 9, 9, dtype=F64)
    y_cpu = model(x)
    y_cpu.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.to("cuda:1")
    assert torch.cuda.current_device() == 0
    y = model(x.to("cuda:1"))
    assert y.device == torch.device("cuda", 1)
    y.square().sum().backward()
    torch.cuda.synchronize(1)
    torch.testing.assert_close(y.cpu(), y_cpu, rtol=1e-10, atol=1e-10)
    for name, p in model.named_parameters():
        assert p.grad.device == torch.device("cuda", 1)
        torch.testing.assert_close(p.grad.cpu(), grads[name], rtol=1e-9, atol=1e-9, msg=name)


def _deterministic_run(device):
    args, params = _stream_case()
    leaves = {k: v.to(device).float().requires_grad_() for k, v in args.items() if v is not None}
    y = dct.deform_conv2d(**leaves, **params)
    y.backward(torch.ones_like(y))
    return y.detach(), {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda_only])])
def test_deterministic_algorithms(device):
    # torch.use_deterministic_algorithms(True) asks the plans for deterministic algorithms; where
    # none serves the backward, torch's convention: a RuntimeError that says so.
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        try:
            first = _deterministic_run(device)
        except RuntimeError as error:
            assert device == "cuda" and "does not have a deterministic implementation" in str(error)
            return
        second = _deterministic_run(device)
    finally:
        torch.use_deterministic_algorithms(old)
    assert torch.equal(first[0], second[0])
    for name in first[1]:
        assert torch.equal(first[1][name], second[1][name]), name
