"""Bad input, memory layouts, non-finite inputs and torchvision's kinks, in every array library.

One suite, parametrised over NumPy (with the automatic choice of CPU algorithm, and with
``cpu/channels-last`` forced), torch CPU tensors, CuPy arrays and torch CUDA tensors (the last
two carry ``@pytest.mark.gpu``; each skips where its library or device is absent), so the CPU
(Numba) and CUDA backends answer the same questions:

* bad input (empty axes, hyper-parameters beyond the kernels' 32-bit coordinates, shapes) is
  refused with a ValueError/TypeError naming the argument, before any kernel runs;
* Fortran-order, negative-stride, read-only and zero-stride (broadcast) arrays give the
  reference's results and are never written;
* a non-finite input element makes non-finite exactly what the float64 reference makes
  non-finite, forward and all five gradients (with zero offsets: what the dense conv does);
* the offset gradient at integer positions, -1 included, is torchvision's.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import dcn_cupy
from dcn_cupy import reference
from dcn_cupy._backends import use_algorithm

from cases import ARGUMENTS, random_case, relative_error


class Library:
    """Turns float64 NumPy arrays into one library's arrays (and back) and makes layouts."""

    def __init__(self, name: str):
        self.name = name
        if name in ("torch", "torch-cuda"):
            self.torch = pytest.importorskip("torch")
            if name == "torch-cuda" and not self.torch.cuda.is_available():
                pytest.skip("torch has no CUDA")
        if name in ("cupy", "torch-cuda"):
            self.cupy = pytest.importorskip("cupy")

    def asarray(self, a):
        if a is None:
            return None
        a = np.ascontiguousarray(a)
        if self.name == "numpy":
            return a.copy()
        if self.name == "cupy":
            return self.cupy.asarray(a)
        t = self.torch.from_numpy(a.copy())
        return t.cuda() if self.name == "torch-cuda" else t

    def host(self, a):
        if a is None:
            return None
        if self.name == "cupy":
            return self.cupy.asnumpy(a)
        if self.name.startswith("torch"):
            assert isinstance(a, self.torch.Tensor)
            return a.detach().cpu().numpy()
        assert isinstance(a, np.ndarray)
        return a

    def layout(self, a, kind: str):
        """The values of ``a`` (this library's array) in the memory layout ``kind``."""
        if kind == "fortran":
            if self.name.startswith("torch"):
                dims = tuple(reversed(range(a.ndim)))
                return a.permute(dims).contiguous().permute(dims)
            xp = np if self.name == "numpy" else self.cupy
            return xp.asfortranarray(a)
        if kind == "negative_strides":
            if self.name.startswith("torch"):
                pytest.skip("torch tensors have no negative strides")
            xp = np if self.name == "numpy" else self.cupy
            return xp.flip(xp.flip(a).copy())
        if kind == "read_only":
            if self.name != "numpy":
                pytest.skip(f"{self.name} arrays have no read-only flag")
            a = a.copy()
            a.setflags(write=False)
            return a
        raise ValueError(kind)

    def broadcast_batch(self, a):
        """``a[:1]`` repeated along the batch axis with stride 0."""
        if self.name.startswith("torch"):
            return a[:1].expand(a.shape)
        xp = np if self.name == "numpy" else self.cupy
        return xp.broadcast_to(a[:1], a.shape)


LIBRARIES = [
    pytest.param("numpy", id="numpy"),
    pytest.param("numpy-channels-last", id="numpy-channels-last"),  # cpu/channels-last forced
    pytest.param("torch", id="torch-cpu"),
    pytest.param("cupy", id="cupy", marks=pytest.mark.gpu),
    pytest.param("torch-cuda", id="torch-cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=LIBRARIES)
def lib(request):
    if request.param == "numpy-channels-last":
        with use_algorithm("cpu/channels-last"):
            yield Library("numpy")
        return
    yield Library(request.param)


def _same_pattern(actual, expected, what):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, what
    mismatch = np.argwhere(np.isfinite(actual) != np.isfinite(expected))
    assert mismatch.size == 0, f"{what}: non-finite pattern differs at {mismatch[:5].tolist()}"


def _close_where_finite(actual, expected, what, tol=1e-10):
    _same_pattern(actual, expected, what)
    finite = np.isfinite(expected)
    assert relative_error(np.asarray(actual)[finite], expected[finite]) < tol, what


def _reference_grads(case, arrays, grad_output):
    backward = reference.deform_conv_transpose_backward if case.transposed else reference.deform_conv_backward
    with np.errstate(invalid="ignore", over="ignore"):
        return dict(zip(ARGUMENTS, backward(grad_output, **arrays, **case.params)))


# ---------------------------------------------------------------------------------------------
# bad input

def _z(*shape):
    return np.zeros(shape)


BAD_CALLS = [
    # (function name, arrays, keyword arguments, error, message)
    ("deform_conv2d", dict(input=_z(2, 3, 0, 5), weight=_z(4, 3, 3, 3)), dict(padding=2), ValueError,
     r"input.shape\[2\] \(spatial axis 0\) must be >= 1, got 0"),
    ("deform_conv2d", dict(input=_z(3, 5, 0), weight=_z(4, 3, 3, 3)), dict(padding=2), ValueError,
     r"input.shape\[2\] \(spatial axis 1\) must be >= 1, got 0"),
    ("deform_conv1d", dict(input=_z(2, 0, 5), weight=_z(4, 0, 3)), {}, ValueError,
     r"input.shape\[1\] \(C_in\) must be >= 1, got 0"),
    ("deform_conv3d", dict(input=_z(1, 2, 4, 0, 4), weight=_z(2, 2, 1, 1, 1)), dict(padding=1), ValueError,
     r"input.shape\[3\] \(spatial axis 1\) must be >= 1, got 0"),
    ("deform_conv2d", dict(input=_z(2, 3, 5, 5), weight=_z(0, 3, 3, 3)), {}, ValueError,
     r"weight.shape\[0\] \(C_out\) must be >= 1, got 0"),
    ("deform_conv2d", dict(input=_z(2, 3, 5, 5), weight=_z(4, 3, 3, 3), offset=_z(2, 0, 3, 3)), {}, ValueError,
     r"offset.shape\[1\] must be a positive multiple of 2\*K=18, got 0"),
    ("deform_conv2d", dict(input=_z(2, 3, 5, 5), weight=_z(4, 3, 3, 3), mask=_z(2, 9, 3, 0)), {}, ValueError,
     r"mask spatial shape must be Q=\(3, 3\), got \(3, 0\)"),
    ("deform_conv_transpose2d", dict(input=_z(2, 3, 0, 4), weight=_z(3, 2, 3, 3)), dict(stride=2), ValueError,
     r"input.shape\[2\] \(spatial axis 0\) must be >= 1, got 0"),
    ("deform_conv_transpose1d", dict(input=_z(2, 3, 4), weight=_z(3, 0, 3)), {}, ValueError,
     r"weight.shape\[1\] \(C_out/groups\) must be >= 1, got 0"),
    ("deform_conv2d", dict(input=_z(1, 3, 5, 5), weight=_z(4, 3, 3, 3)), dict(stride=2**63), ValueError,
     r"stride must be <= 2\*\*30 = 1073741824 \(32-bit kernel coordinates\), got 9223372036854775808"),
    ("deform_conv2d", dict(input=_z(1, 3, 5, 5), weight=_z(4, 3, 3, 3)), dict(padding=(0, 2**40)), ValueError,
     r"padding must be <= 2\*\*30 .* got \(0, 1099511627776\)"),
    ("deform_conv2d", dict(input=_z(1, 3, 5, 5), weight=_z(4, 3, 3, 3)), dict(dilation=2**31), ValueError,
     r"dilation must be <= 2\*\*30 .* got 2147483648"),
    ("deform_conv1d", dict(input=_z(1, 3, 5), weight=_z(4, 3, 3)), dict(padding=2**30), ValueError,
     r"input size \+ 2\*padding along spatial axis 0 must be <= 2\*\*30"),
    ("deform_conv_transpose1d", dict(input=_z(1, 3, 5), weight=_z(3, 2, 3)), dict(stride=2**29), ValueError,
     r"output size \+ 2\*padding along spatial axis 0 must be <= 2\*\*30"),
    ("deform_conv_transpose2d", dict(input=_z(1, 3, 5, 5), weight=_z(3, 2, 3, 3)), dict(output_padding=2**63),
     ValueError, r"output_padding must be <= 2\*\*30 .* got 9223372036854775808"),
    ("deform_conv2d", dict(input=_z(1, 3, 5, 5), weight=_z(4, 3, 3, 3)), dict(groups=2**63), ValueError,
     r"must be divisible by groups=9223372036854775808"),
    ("deform_conv2d", dict(input=_z(1, 3, 5, 5), weight=_z(4, 3, 3, 3)), dict(stride=2.0), TypeError,
     "stride must be an int, got float 2.0"),
    ("deform_conv2d", dict(input=_z(1, 3, 5, 5), weight=_z(4, 3, 3, 3), offset=_z(1, 18, 3, 4)), {}, ValueError,
     r"offset spatial shape must be Q=\(3, 3\), got \(3, 4\)"),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("call", BAD_CALLS, ids=lambda c: c[-1][:40])
def test_bad_input_is_refused(lib, call, backward):
    name, arrays, kwargs, error, message = call
    args = {k: lib.asarray(v) for k, v in arrays.items()}
    with pytest.raises(error, match=message):
        if backward:
            # grad_output's shape cannot be right for a refused call: any array will do.
            getattr(dcn_cupy, name + "_backward")(lib.asarray(np.zeros((1, 1, 1))), **args, **kwargs)
        else:
            getattr(dcn_cupy, name)(**args, **kwargs)


def test_empty_batch_is_accepted(lib):
    x, w = lib.asarray(np.zeros((0, 3, 5, 5))), lib.asarray(np.ones((4, 3, 3, 3)))
    y = dcn_cupy.deform_conv2d(x, w, padding=1)
    assert tuple(y.shape) == (0, 4, 5, 5)
    g = dcn_cupy.deform_conv2d_backward(lib.asarray(np.zeros((0, 4, 5, 5))), x, w, padding=1)
    assert tuple(g.input.shape) == (0, 3, 5, 5) and not lib.host(g.weight).any()


# ---------------------------------------------------------------------------------------------
# layouts

@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("kind", ["fortran", "negative_strides", "read_only", "broadcast_batch"])
def test_layouts_give_the_reference_results(lib, kind, transposed):
    rng = np.random.default_rng(60 + transposed)
    case = random_case(rng, 2, transposed, batch=3)
    arrays = dict(case.arrays_)
    broadcast = ("input", "offset", "mask") if kind == "broadcast_batch" else ()
    for name in broadcast:  # the values a zero-stride batch holds: sample 0, repeated
        arrays[name] = np.repeat(arrays[name][:1], 3, axis=0)
    y_ref = case.reference(arrays)
    grad_output = rng.standard_normal(y_ref.shape)
    if broadcast:
        grad_output = np.repeat(grad_output[:1], 3, axis=0)
    expected = _reference_grads(case, arrays, grad_output)

    given = {k: lib.asarray(v) for k, v in arrays.items()}
    gy = lib.asarray(grad_output)
    if broadcast:
        given = {k: lib.broadcast_batch(v) if k in broadcast else v for k, v in given.items()}
        gy = lib.broadcast_batch(gy)
    else:
        given = {k: v if v.ndim < 2 else lib.layout(v, kind) for k, v in given.items()}
        gy = lib.layout(gy, kind)
    before = {k: lib.host(v).copy() for k, v in given.items()}

    y = case.forward(**given, **case.params)
    assert relative_error(lib.host(y), y_ref) < 1e-10, case.label
    grads = case.backward(gy, **given, **case.params)
    for name in ARGUMENTS:
        assert relative_error(lib.host(getattr(grads, name)), expected[name]) < 1e-10, name
    for name, value in given.items():
        np.testing.assert_array_equal(lib.host(value), before[name], err_msg=f"{name} was written")


# ---------------------------------------------------------------------------------------------
# non-finite inputs

def _poison(rng, a, count):
    a = a.copy()
    picks = rng.choice(a.size, size=count, replace=False)
    a.reshape(-1)[picks] = np.resize([np.inf, np.nan, -np.inf], count)
    return a


def test_one_inf_with_1x1_kernel_and_padding(lib):
    # Issue 11: 28 non-finite outputs on the CPU backend, 21 in the reference, 1 in torch.
    x = np.ones((1, 1, 5, 6))
    x[0, 0, 2, 3] = np.inf
    w = np.ones((1, 1, 1, 1))
    y = lib.host(dcn_cupy.deform_conv2d(lib.asarray(x), lib.asarray(w), padding=1))
    assert np.argwhere(~np.isfinite(y)).tolist() == [[0, 0, 3, 4]]
    g = dcn_cupy.deform_conv2d_backward(lib.asarray(np.ones(y.shape)), lib.asarray(x), lib.asarray(w), padding=1)
    assert not np.isfinite(lib.host(g.weight)).all() and np.isfinite(lib.host(g.input)).all()


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_non_finite_input_zero_offsets_matches_dense_conv(lib, ndim, transposed):
    """With zero offsets the non-finite pattern of the output is the dense convolution's."""
    rng = np.random.default_rng(70 + ndim + 10 * transposed)
    case = random_case(rng, ndim, transposed, batch=2)
    arrays = dict(case.arrays_)
    arrays["offset"] = np.zeros_like(arrays["offset"])
    arrays["mask"] = np.ones_like(arrays["mask"])
    arrays["input"] = _poison(rng, arrays["input"], 3)
    with np.errstate(invalid="ignore"):
        y_ref = case.reference(arrays)
        plain = case.reference({**arrays, "offset": None, "mask": None})
    _same_pattern(y_ref, plain, "reference with zero offsets vs without")
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        name = f"conv_transpose{ndim}d" if transposed else f"conv{ndim}d"
        params = dict(case.params)
        dense = getattr(torch.nn.functional, name)(
            torch.from_numpy(arrays["input"]), torch.from_numpy(arrays["weight"]),
            torch.from_numpy(arrays["bias"]), **params).numpy()
        _same_pattern(y_ref, dense, "reference vs torch's dense conv")
    y = case.forward(**{k: lib.asarray(v) for k, v in arrays.items()}, **case.params)
    _close_where_finite(lib.host(y), y_ref, "forward")


@pytest.mark.parametrize("offsets", ["fractional", "integer", "zero"])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_non_finite_patterns_of_forward_and_gradients(lib, ndim, transposed, offsets):
    """A non-finite input or grad_output element reaches exactly what it reaches in the reference."""
    rng = np.random.default_rng(80 + ndim + 10 * transposed + 100 * len(offsets))
    case = random_case(rng, ndim, transposed, batch=2)
    arrays = dict(case.arrays_)
    if offsets == "integer":  # integer positions: corners of weight 0 next to the poison
        arrays["offset"] = np.round(arrays["offset"])
    elif offsets == "zero":
        arrays["offset"] = np.zeros_like(arrays["offset"])
    arrays["input"] = _poison(rng, arrays["input"], 2)
    with np.errstate(invalid="ignore"):
        y_ref = case.reference(arrays)
    grad_output = _poison(rng, rng.standard_normal(y_ref.shape), 1)
    expected = _reference_grads(case, arrays, grad_output)

    given = {k: lib.asarray(v) for k, v in arrays.items()}
    y = case.forward(**given, **case.params)
    _close_where_finite(lib.host(y), y_ref, "forward")
    grads = case.backward(lib.asarray(grad_output), **given, **case.params)
    for name in ARGUMENTS:
        _close_where_finite(lib.host(getattr(grads, name)), expected[name], name, tol=1e-9)


def test_non_finite_offsets_give_zero_contributions_and_gradients(lib):
    rng = np.random.default_rng(90)
    case = random_case(rng, 2, False, batch=2)
    arrays = dict(case.arrays_)
    arrays["offset"] = _poison(rng, arrays["offset"], 6)
    y_ref = case.reference(arrays)
    assert np.isfinite(y_ref).all()
    grad_output = rng.standard_normal(y_ref.shape)
    expected = _reference_grads(case, arrays, grad_output)
    given = {k: lib.asarray(v) for k, v in arrays.items()}
    assert relative_error(lib.host(case.forward(**given, **case.params)), y_ref) < 1e-10
    grads = case.backward(lib.asarray(grad_output), **given, **case.params)
    for name in ARGUMENTS:
        got = lib.host(getattr(grads, name))
        assert np.isfinite(got).all() and relative_error(got, expected[name]) < 1e-10, name
    bad = ~np.isfinite(arrays["offset"])
    assert (lib.host(grads.offset)[bad] == 0).all()


# ---------------------------------------------------------------------------------------------
# torchvision's offset gradient at integer positions, -1 included

def _zero_offset_case(rng, batch=2, c_in=4, c_out=3, size=(6, 5), kernel=(3, 3), groups=1, offset_groups=2):
    K = math.prod(kernel)
    return dict(
        input=rng.standard_normal((batch, c_in) + size),
        weight=rng.standard_normal((c_out, c_in // groups) + kernel),
        offset=np.zeros((batch, 2 * offset_groups * K) + size),
        mask=rng.uniform(0.2, 1.2, (batch, offset_groups * K) + size),
        bias=rng.standard_normal(c_out),
    )


@pytest.mark.parametrize("shift", [0.0, 1.0, -2.0], ids=["zero", "plus1", "minus2"])
def test_offset_gradient_at_integer_positions_matches_reference(lib, shift):
    # Zero offsets and padding 1: every border tap sits at exactly -1 (or at S), where the
    # offset gradient is torchvision's one-sided derivative, not 0.
    rng = np.random.default_rng(100)
    arrays = _zero_offset_case(rng)
    arrays["offset"] = arrays["offset"] + shift
    y_ref = reference.deform_conv(**arrays, padding=1)
    grad_output = rng.standard_normal(y_ref.shape)
    expected = reference.deform_conv_backward(grad_output, **arrays, padding=1)
    given = {k: lib.asarray(v) for k, v in arrays.items()}
    grads = dcn_cupy.deform_conv2d_backward(lib.asarray(grad_output), **given, padding=1)
    for name, want in zip(ARGUMENTS, expected):
        assert relative_error(lib.host(getattr(grads, name)), want) < 1e-10, name
    if shift == 0.0:
        # Output row 0, centre tap (channel 2 of each offset group's block): row -1, inside columns.
        assert np.abs(lib.host(grads.offset)[:, 2, 0, :]).min() > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("offsets", ["zero", "integer"])
def test_all_gradients_match_torchvision_at_integer_positions(device, offsets):
    """All five gradients against torchvision.ops.deform_conv2d, float64, zero offsets and
    padding 1 (border taps at exactly -1) or integer offsets (taps at -1, S-1 and S)."""
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("torchvision.ops")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    rng = np.random.default_rng(110)
    arrays = _zero_offset_case(rng, batch=3, c_in=4, c_out=6, size=(7, 6), offset_groups=2)
    if offsets == "integer":
        arrays["offset"] = rng.integers(-2, 3, arrays["offset"].shape).astype(np.float64)
    tensors = {k: torch.from_numpy(v).to(device) for k, v in arrays.items()}
    leaves = {k: t.clone().requires_grad_(True) for k, t in tensors.items()}
    y_tv = ops.deform_conv2d(leaves["input"], leaves["offset"], leaves["weight"], leaves["bias"], padding=1,
                             mask=leaves["mask"])
    gy = torch.from_numpy(rng.standard_normal(tuple(y_tv.shape))).to(device)
    y_tv.backward(gy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = dcn_cupy.deform_conv2d(**tensors, padding=1)
        grads = dcn_cupy.deform_conv2d_backward(gy, **tensors, padding=1)
    assert relative_error(y.cpu().numpy(), y_tv.detach().cpu().numpy()) < 1e-10
    for name in ARGUMENTS:
        got = getattr(grads, name)
        assert got.device == y_tv.device
        err = relative_error(got.cpu().numpy(), leaves[name].grad.cpu().numpy())
        assert err < 1e-10, f"{name}: {err}"
    assert leaves["offset"].grad.abs().sum() > 0
