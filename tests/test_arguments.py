"""Every argument rule of the design gives a ValueError/TypeError naming what was expected and got."""

import re

import numpy as np
import pytest

import dcn_cupy

F = np.float64


def arr(*shape, dtype=F):
    return np.zeros(shape, dtype=dtype)


X = arr(2, 4, 8, 8)
W = arr(6, 2, 3, 3)          # groups=2
OFF = arr(2, 2 * 9 * 2, 6, 6)  # offset groups 2
MASK = arr(2, 4 * 9, 6, 6)     # mask groups 4
BIAS = arr(6)


def conv(**kw):
    args = dict(input=X, weight=W, offset=OFF, mask=MASK, bias=BIAS, groups=2)
    args.update(kw)
    return dcn_cupy.deform_conv2d(**args)


def test_valid_call_works():
    assert conv().shape == (2, 6, 6, 6)


@pytest.mark.parametrize("kw, error, message", [
    # hyper-parameters
    (dict(groups=0), ValueError, "groups must be >= 1, got 0"),
    (dict(groups=2.0), TypeError, "groups must be an int, got float 2.0"),
    (dict(stride=0), ValueError, "stride must be >= 1, got 0"),
    (dict(stride=(1, 0)), ValueError, r"stride must be >= 1, got \(1, 0\)"),
    (dict(stride=(1, 1, 1)), ValueError, r"stride must be an int or a sequence of 2 ints, got 3 values"),
    (dict(stride=True), TypeError, "stride must be an int, got bool"),
    (dict(padding=-1), ValueError, "padding must be >= 0, got -1"),
    (dict(dilation=0), ValueError, "dilation must be >= 1, got 0"),
    (dict(dilation="2"), TypeError, "dilation must be an int, got str"),
    # beyond the kernels' 32-bit coordinates: a ValueError, never an OverflowError
    (dict(stride=2**63), ValueError, r"stride must be <= 2\*\*30 = 1073741824 .* got 9223372036854775808"),
    (dict(stride=(1, 2**31)), ValueError, r"stride must be <= 2\*\*30 .* got \(1, 2147483648\)"),
    (dict(padding=2**63), ValueError, r"padding must be <= 2\*\*30 .* got 9223372036854775808"),
    (dict(dilation=2**64), ValueError, r"dilation must be <= 2\*\*30 .* got 18446744073709551616"),
    (dict(padding=2**29, offset=None, mask=None), ValueError,
     r"input size \+ 2\*padding along spatial axis 0 must be <= 2\*\*30 = 1073741824 .* got 8 \+ 2\*536870912"),
    (dict(groups=2**63), ValueError, r"weight.shape\[0\] \(C_out\) must be divisible by groups=9223372036854775808"),
    # shapes
    (dict(input=arr(4, 8)), ValueError, r"input must be 4-D \(B, C, \*S\) or 3-D \(C, \*S\) for a 2D convolution, got shape \(4, 8\)"),
    (dict(weight=arr(6, 2, 3)), ValueError, r"weight must be 4-D .* for a 2D convolution, got shape \(6, 2, 3\)"),
    (dict(weight=arr(5, 2, 3, 3), bias=None), ValueError, r"weight.shape\[0\] \(C_out\) must be divisible by groups=2, got 5"),
    (dict(weight=arr(6, 3, 3, 3)), ValueError, r"input.shape\[1\] \(C_in\) must equal weight.shape\[1\] \* groups = 6, got 4"),
    (dict(weight=arr(6, 2, 0, 3)), ValueError, r"kernel_size\) must be >= 1, got \(0, 3\)"),
    # empty axes: only the batch may be empty (an empty spatial axis with padding would
    # otherwise produce outputs that read memory the input does not have)
    (dict(input=arr(2, 4, 0, 8), padding=2, offset=None, mask=None), ValueError,
     r"input.shape\[2\] \(spatial axis 0\) must be >= 1, got 0 \(shape \(2, 4, 0, 8\)\); only the batch may be empty"),
    (dict(input=arr(2, 4, 8, 0), padding=2, offset=None, mask=None), ValueError,
     r"input.shape\[3\] \(spatial axis 1\) must be >= 1, got 0"),
    (dict(input=arr(4, 8, 0), padding=2, offset=None, mask=None), ValueError,
     r"input.shape\[2\] \(spatial axis 1\) must be >= 1, got 0 \(shape \(4, 8, 0\)\)"),
    (dict(input=arr(2, 0, 8, 8), weight=arr(6, 0, 3, 3)), ValueError, r"input.shape\[1\] \(C_in\) must be >= 1, got 0"),
    (dict(weight=arr(0, 2, 3, 3), bias=None), ValueError, r"weight.shape\[0\] \(C_out\) must be >= 1, got 0"),
    (dict(weight=arr(6, 0, 3, 3)), ValueError, r"weight.shape\[1\] \(C_in/groups\) must be >= 1, got 0"),
    (dict(offset=arr(2, 36, 0, 6)), ValueError, r"offset spatial shape must be Q=\(6, 6\), got \(0, 6\)"),
    (dict(mask=arr(2, 0, 6, 6)), ValueError, r"mask.shape\[1\] must be a positive multiple of K=9, got 0"),
    (dict(bias=arr(0)), ValueError, r"bias must have shape \(6,\), got \(0,\)"),
    (dict(weight=arr(6, 2, 3, 3), input=arr(2, 4, 2, 8), offset=None, mask=None), ValueError,
     "output size along spatial axis 0 must be >= 1, got 0"),
    # offset
    (dict(offset=arr(2, 20, 6, 6)), ValueError, r"offset.shape\[1\] must be a positive multiple of 2\*K=18, got 20"),
    (dict(offset=arr(2, 0, 6, 6)), ValueError, r"offset.shape\[1\] must be a positive multiple of 2\*K=18, got 0"),
    (dict(offset=arr(2, 3 * 18, 6, 6)), ValueError, "C_in=4 must be divisible by offset groups .* = 3"),
    (dict(offset=arr(3, 18, 6, 6)), ValueError, r"offset.shape\[0\] must equal the batch size 2, got 3"),
    (dict(offset=arr(2, 18, 5, 6)), ValueError, r"offset spatial shape must be Q=\(6, 6\), got \(5, 6\)"),
    (dict(offset=arr(18, 6, 6)), ValueError, r"offset must be 4-D \(B, G_o\*K\*N, \*Q\), got shape \(18, 6, 6\)"),
    # mask
    (dict(mask=arr(2, 10, 6, 6)), ValueError, r"mask.shape\[1\] must be a positive multiple of K=9, got 10"),
    (dict(mask=arr(2, 27, 6, 6)), ValueError, "C_in=4 must be divisible by mask groups .* = 3"),
    (dict(mask=arr(2, 9, 6, 7)), ValueError, r"mask spatial shape must be Q=\(6, 6\), got \(6, 7\)"),
    (dict(mask=arr(1, 9, 6, 6)), ValueError, r"mask.shape\[0\] must equal the batch size 2, got 1"),
    # bias
    (dict(bias=arr(5)), ValueError, r"bias must have shape \(6,\), got \(5,\)"),
    # libraries, dtypes
    (dict(input=X.astype(np.int32)), TypeError, "input must have dtype float16, bfloat16, float32 or float64, got int32"),
    (dict(weight=W.astype(np.float32)), TypeError, r"weight must have the same dtype as input \(float64\), got float32"),
    (dict(mask=MASK.tolist()), TypeError, "mask must be an array that supports DLPack"),
])
def test_conv_argument_errors(kw, error, message):
    with pytest.raises(error, match=message):
        conv(**kw)


def test_generic_form_infers_ndim_and_rejects_other_ranks():
    assert dcn_cupy.deform_conv(X, W, groups=2).shape == (2, 6, 6, 6)
    with pytest.raises(ValueError, match=r"weight must be 3-D, 4-D or 5-D .* got shape \(6, 2\)"):
        dcn_cupy.deform_conv(X, arr(6, 2))
    with pytest.raises(ValueError, match=r"weight must be 3-D, 4-D or 5-D .* got shape \(1, 1, 1, 1, 1, 1\)"):
        dcn_cupy.deform_conv_transpose(X, arr(1, 1, 1, 1, 1, 1))


def test_unbatched_input_needs_unbatched_offset_and_mask():
    assert dcn_cupy.deform_conv2d(X[0], W, OFF[0], MASK[0], groups=2).shape == (6, 6, 6)
    with pytest.raises(ValueError, match=r"offset must be 3-D \(G_o\*K\*N, \*Q\), got shape \(2, 36, 6, 6\)"):
        dcn_cupy.deform_conv2d(X[0], W, OFF, groups=2)


def tconv(**kw):
    # transposed: input (2, 4, 5, 5), weight (C_in=4, C_out/G=3, 3, 3), G=2 -> C_out=6, out 11x11 (stride 2)
    args = dict(input=arr(2, 4, 5, 5), weight=arr(4, 3, 3, 3), offset=arr(2, 2 * 9 * 2, 5, 5),
                mask=arr(2, 3 * 9, 5, 5), bias=arr(6), groups=2, stride=2)
    args.update(kw)
    return dcn_cupy.deform_conv_transpose2d(**args)


def test_transposed_valid_call_works():
    assert tconv().shape == (2, 6, 11, 11)
    assert tconv(output_padding=1).shape == (2, 6, 12, 12)
    assert tconv(stride=1, dilation=3, output_padding=2, offset=None, mask=None).shape == (2, 6, 13, 13)


@pytest.mark.parametrize("kw, error, message", [
    (dict(output_padding=2), ValueError,
     r"output_padding must be smaller than max\(stride, dilation\) = 2 along spatial axis 0, got 2"),
    (dict(output_padding=-1), ValueError, "output_padding must be >= 0, got -1"),
    (dict(weight=arr(3, 3, 3, 3)), ValueError, r"weight.shape\[0\] must equal input.shape\[1\] \(C_in\) = 4, got 3"),
    (dict(groups=3, weight=arr(4, 2, 3, 3)), ValueError, r"input.shape\[1\] \(C_in\) must be divisible by groups=3, got 4"),
    (dict(offset=arr(2, 4 * 18, 5, 5)), ValueError, "C_out=6 must be divisible by offset groups .* = 4"),
    (dict(mask=arr(2, 4 * 9, 5, 5)), ValueError, "C_out=6 must be divisible by mask groups .* = 4"),
    (dict(offset=arr(2, 18, 11, 11)), ValueError, r"offset spatial shape must be S=\(5, 5\), got \(11, 11\)"),
    (dict(bias=arr(4)), ValueError, r"bias must have shape \(6,\), got \(4,\)"),
    (dict(padding=9), ValueError, "output size along spatial axis 0 must be >= 1"),
    (dict(input=arr(2, 4, 5, 0), offset=None, mask=None), ValueError,
     r"input.shape\[3\] \(spatial axis 1\) must be >= 1, got 0 .* only the batch may be empty"),
    (dict(input=arr(2, 0, 5, 5), weight=arr(0, 3, 3, 3), offset=None, mask=None), ValueError,
     r"input.shape\[1\] \(C_in\) must be >= 1, got 0"),
    (dict(weight=arr(4, 0, 3, 3), bias=None, offset=None, mask=None), ValueError,
     r"weight.shape\[1\] \(C_out/groups\) must be >= 1, got 0"),
    (dict(stride=2**63), ValueError, r"stride must be <= 2\*\*30 .* got 9223372036854775808"),
    (dict(output_padding=2**63), ValueError, r"output_padding must be <= 2\*\*30 .* got 9223372036854775808"),
    (dict(stride=2**28, offset=None, mask=None), ValueError,
     r"output size \+ 2\*padding along spatial axis 0 must be <= 2\*\*30 .* got 1073741827 \+ 2\*0"),
])
def test_transposed_argument_errors(kw, error, message):
    with pytest.raises(error, match=message):
        tconv(**kw)


def test_backward_checks_grad_output_and_wrt():
    y = conv()
    with pytest.raises(ValueError, match=r"grad_output must have the output's shape \(2, 6, 6, 6\), got \(2, 6, 6, 5\)"):
        dcn_cupy.deform_conv2d_backward(arr(2, 6, 6, 5), X, W, OFF, MASK, BIAS, groups=2)
    with pytest.raises(ValueError, match=r"wrt must be a subset of .* got unknown names \['inputs'\]"):
        dcn_cupy.deform_conv2d_backward(y, X, W, OFF, MASK, BIAS, groups=2, wrt={"inputs"})
    with pytest.raises(TypeError, match="wrt must be None or a collection of names, got int"):
        dcn_cupy.deform_conv2d_backward(y, X, W, OFF, MASK, BIAS, groups=2, wrt=3)
    with pytest.raises(TypeError, match=r"grad_output must have the same dtype as input \(float64\), got float32"):
        dcn_cupy.deform_conv2d_backward(y.astype(np.float32), X, W, OFF, MASK, BIAS, groups=2)
    g = dcn_cupy.deform_conv2d_backward(y, X, W, groups=2, wrt="weight")
    assert g.weight is not None and g.input is None and g.offset is None
    t = tconv()
    with pytest.raises(ValueError, match=r"grad_output must have the output's shape \(2, 6, 11, 11\)"):
        dcn_cupy.deform_conv_transpose2d_backward(t[:, :, :-1], arr(2, 4, 5, 5), arr(4, 3, 3, 3), groups=2, stride=2)


def test_mask_activation_errors():
    with pytest.raises(ValueError, match=r"mask.shape\[1\] must be a positive multiple of K=9, got 10"):
        dcn_cupy.mask_softmax2d(arr(2, 10, 4, 4), 3)
    with pytest.raises(ValueError, match=r"mask must be 4-D \(B, G_m\*K, \*Q\) or 3-D \(G_m\*K, \*Q\), got shape \(9,\)"):
        dcn_cupy.mask_softmax2d(arr(9), 3)
    with pytest.raises(ValueError, match=r"mask must be 3-D, 4-D or 5-D \(B, G_m\*K, \*Q\) with an int kernel_size "
                                         r".* got shape \(9, 4\)"):
        dcn_cupy.mask_softmax(arr(9, 4), 3)
    with pytest.raises(ValueError, match=r"output must be 3-D, 4-D or 5-D .* got shape \(9, 4\)"):
        dcn_cupy.mask_softmax_backward(arr(9, 4), arr(9, 4), 3)
    with pytest.raises(ValueError, match="kernel_size must be >= 1, got 0"):
        dcn_cupy.mask_softmax2d(arr(2, 9, 4, 4), 0)
    with pytest.raises(ValueError, match=r"grad_output must have the output's shape \(2, 9, 4, 4\), got \(2, 9, 4\)"):
        dcn_cupy.mask_softmax_backward(arr(2, 9, 4), arr(2, 9, 4, 4), 3)
    with pytest.raises(TypeError, match="scale must be a real number, got str"):
        dcn_cupy.mask_sigmoid(arr(3), scale="2")
    with pytest.raises(ValueError, match="scale must be finite, got inf"):
        dcn_cupy.mask_sigmoid(arr(3), scale=float("inf"))
    with pytest.raises(TypeError, match=r"grad_output must have the same dtype as output \(float64\), got float32"):
        dcn_cupy.mask_sigmoid_backward(arr(3, dtype=np.float32), arr(3))


def test_mixed_libraries_and_grad_tensors_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"weight must come from the same library as input \(numpy\), got torch"):
        conv(weight=torch.zeros(6, 2, 3, 3, dtype=torch.float64))
    w = torch.zeros(6, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError, match=re.escape("weight is a torch.Tensor that requires grad") + ".*dcn_cupy.torch.*detach"):
        dcn_cupy.deform_conv2d(torch.zeros(2, 4, 8, 8, dtype=torch.float64), w, groups=2)


def test_empty_batch_is_the_only_empty_axis_accepted():
    y = conv(input=arr(0, 4, 8, 8), offset=arr(0, 36, 6, 6), mask=arr(0, 36, 6, 6))
    assert y.shape == (0, 6, 6, 6)
    g = dcn_cupy.deform_conv2d_backward(arr(0, 6, 6, 6), arr(0, 4, 8, 8), W, arr(0, 36, 6, 6), arr(0, 36, 6, 6),
                                        BIAS, groups=2)
    assert g.input.shape == (0, 4, 8, 8) and not g.weight.any() and not g.bias.any()


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_empty_axes_are_refused_before_any_kernel_runs(transposed, monkeypatch):
    from dcn_cupy._backends import cpu

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(cpu, "conv_forward", refuse)
    monkeypatch.setattr(cpu, "conv_backward", refuse)
    for a in range(2):
        shape = [2, 4, 5, 5]
        shape[2 + a] = 0
        with pytest.raises(ValueError, match=rf"input.shape\[{2 + a}\] \(spatial axis {a}\) must be >= 1, got 0"):
            if transposed:
                dcn_cupy.deform_conv_transpose2d(arr(*shape), arr(4, 3, 3, 3), padding=1)
            else:
                dcn_cupy.deform_conv2d(arr(*shape), arr(6, 4, 3, 3), padding=3)
        with pytest.raises(ValueError, match=rf"input.shape\[{2 + a}\] \(spatial axis {a}\) must be >= 1, got 0"):
            if transposed:
                dcn_cupy.deform_conv_transpose2d_backward(arr(2, 3, 7, 7), arr(*shape), arr(4, 3, 3, 3), padding=1)
            else:
                dcn_cupy.deform_conv2d_backward(arr(2, 6, 5, 5), arr(*shape), arr(6, 4, 3, 3), padding=3)
