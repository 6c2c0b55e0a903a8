"""The CPU (Numba) backend, both of its algorithms, against the float64 reference and float64
finite differences."""

import numba
import numpy as np
import pytest

import dcn_cupy
from dcn_cupy._interop import BFLOAT16

from dcn_cupy.testing import (ARGUMENTS, Case, directional_derivative, fractional_offsets, random_case,
                              relative_error)

SEEDS = range(6)


@pytest.fixture(autouse=True, params=["cpu/numba", "cpu/channels-last"])
def algorithm(request):
    """Every test once per CPU algorithm, forced (the automatic choice follows the channels)."""
    from dcn_cupy._backends import use_algorithm

    with use_algorithm(request.param):
        yield request.param


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("seed", SEEDS)
def test_forward_matches_reference_float64(ndim, transposed, seed):
    rng = np.random.default_rng(1000 * ndim + seed)
    case = random_case(rng, ndim, transposed, offset=seed % 3 != 1, mask=seed % 3 != 2, bias=seed % 2 == 0)
    out = case.forward(**case.arrays(), **case.params)
    assert out.dtype == np.float64
    assert relative_error(out, case.reference()) < 1e-10, case.label


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_forward_float32(ndim, transposed):
    rng = np.random.default_rng(7 + ndim)
    case = random_case(rng, ndim, transposed)
    out = case.forward(**case.arrays(lambda a: a.astype(np.float32)), **case.params)
    assert out.dtype == np.float32
    # The reference sees the same float32-rounded inputs.
    expected = case.reference({k: None if a is None else a.astype(np.float32).astype(np.float64)
                               for k, a in case.arrays_.items()})
    assert relative_error(out, expected) < 1e-4, case.label


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_forward_half_types_computed_in_float32(dtype, transposed):
    rng = np.random.default_rng(11)
    case = random_case(rng, 2, transposed)
    arrays = case.arrays(lambda a: a.astype(dtype))
    out = case.forward(**arrays, **case.params)
    assert out.dtype == np.dtype(dtype)
    expected = case.reference({k: None if a is None else a.astype(np.float64) for k, a in arrays.items()})
    # One rounding of the float32 result to the half type: 2^-11 (float16), 2^-8 (bfloat16) relative.
    tol = 2e-3 if dtype == np.float16 else 1e-2
    assert relative_error(out.astype(np.float64), expected) < tol
    grads = case.backward(rng.standard_normal(out.shape).astype(dtype), **arrays, **case.params)
    assert all(g.dtype == np.dtype(dtype) for g in grads if g is not None)


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_gradients_match_finite_differences(ndim, transposed, seed):
    rng = np.random.default_rng(5000 + 100 * ndim + seed)
    case = random_case(rng, ndim, transposed)
    out = case.reference()
    grad_output = rng.standard_normal(out.shape)
    grads = case.backward(grad_output, **case.arrays(), **case.params)
    for name in ARGUMENTS:
        value = case.arrays_[name]
        direction = rng.standard_normal(value.shape)
        expected = directional_derivative(case, name, grad_output, direction)
        actual = float(np.vdot(getattr(grads, name), direction))
        assert actual == pytest.approx(expected, rel=1e-6, abs=1e-8), f"{name}: {case.label}"


def _mixed_runs_case(rng, ndim, transposed):
    """24 sampled channels in 2 conv groups, 3 offset groups and 4 mask groups: runs of channels
    sharing all three of 6, 2, 4, 4, 2 and 6 (cpu/channels-last loops over each run)."""
    groups, offset_groups, mask_groups, channels, other = 2, 3, 4, 24, 4
    kernel, stride, padding, dilation = (2,) * ndim, (1,) * ndim, (1,) * ndim, (1,) * ndim
    spatial = (5,) * ndim
    # The transposed op's offsets and masks lie on its input grid; the convolution's on its output.
    grid = spatial if transposed else tuple(s + 2 * p - d * (k - 1) for s, k, p, d in zip(spatial, kernel, padding, dilation))
    x = rng.standard_normal((2, other if transposed else channels) + spatial)
    w = rng.standard_normal((other, channels // groups) + kernel)
    taps = 2 ** ndim
    arrays = {"input": x, "weight": w,
              "offset": fractional_offsets(rng, (2, offset_groups * taps * ndim) + grid),
              "mask": rng.uniform(0.1, 1.5, (2, mask_groups * taps) + grid), "bias": rng.standard_normal(
                  channels if transposed else other)}
    params = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    return Case(ndim, transposed, arrays, params, f"mixed runs {ndim}d{' transposed' if transposed else ''}")


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_runs_of_channels_of_several_groups_match_the_reference(ndim, transposed):
    """Channels of different conv, offset and mask groups interleaved in runs of 2 to 6 (each
    run one loop in cpu/channels-last), forward and every gradient, against the float64
    reference and finite differences."""
    rng = np.random.default_rng(6000 + ndim + 10 * transposed)
    case = _mixed_runs_case(rng, ndim, transposed)
    out = case.forward(**case.arrays(), **case.params)
    assert relative_error(out, case.reference()) < 1e-10, case.label
    grad_output = rng.standard_normal(out.shape)
    grads = case.backward(grad_output, **case.arrays(), **case.params)
    for name in ARGUMENTS:
        direction = rng.standard_normal(case.arrays_[name].shape)
        expected = directional_derivative(case, name, grad_output, direction)
        actual = float(np.vdot(getattr(grads, name), direction))
        assert actual == pytest.approx(expected, rel=1e-6, abs=1e-8), f"{name}: {case.label}"


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_int64_plan_indices_give_the_same_bits(ndim, transposed, monkeypatch):
    """Sampling plans index in uint32 up to ``cpu.INDEX32_LIMIT`` positions a channel, else in
    int64 (inputs of 2^32 positions and more): the int64 kernels, forced here on a small problem,
    give the same bits."""
    from dcn_cupy._backends import cpu

    rng = np.random.default_rng(6100 + ndim)
    case = random_case(rng, ndim, transposed, channels_scale=3)
    arrays = case.arrays(lambda a: a.astype(np.float32))
    grad_output = rng.standard_normal(case.reference().shape).astype(np.float32)
    results = []
    for limit in (cpu.INDEX32_LIMIT, 0):
        monkeypatch.setattr(cpu, "INDEX32_LIMIT", limit)
        results.append((case.forward(**arrays, **case.params), case.backward(grad_output, **arrays, **case.params)))
    np.testing.assert_array_equal(results[1][0], results[0][0])
    for name in ARGUMENTS:
        np.testing.assert_array_equal(getattr(results[1][1], name), getattr(results[0][1], name), err_msg=name)


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_gradients_float32_match_float64(transposed):
    rng = np.random.default_rng(3)
    case = random_case(rng, 2, transposed)
    grad_output = rng.standard_normal(case.reference().shape)
    g64 = case.backward(grad_output, **case.arrays(), **case.params)
    g32 = case.backward(grad_output.astype(np.float32), **case.arrays(lambda a: a.astype(np.float32)),
                        **case.params)
    for name in ARGUMENTS:
        assert getattr(g32, name).dtype == np.float32
        assert relative_error(getattr(g32, name), getattr(g64, name)) < 1e-4, name


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_wrt_computes_only_what_is_asked(transposed, monkeypatch):
    from dcn_cupy._backends import cpu

    rng = np.random.default_rng(4)
    case = random_case(rng, 2, transposed)
    grad_output = rng.standard_normal(case.reference().shape)
    full = case.backward(grad_output, **case.arrays(), **case.params)
    calls = []
    for fn in ("conv_forward", "conv_backward"):
        original = getattr(cpu, fn)
        monkeypatch.setattr(cpu, fn, lambda *a, _f=original, _n=fn, **k: calls.append(_n) or _f(*a, **k))
    only_bias = case.backward(grad_output, **case.arrays(), **case.params, wrt={"bias"})
    assert calls == [] and only_bias.input is None and only_bias.weight is None
    np.testing.assert_allclose(only_bias.bias, full.bias)
    for name in ARGUMENTS:
        part = case.backward(grad_output, **case.arrays(), **case.params, wrt=[name])
        np.testing.assert_allclose(getattr(part, name), getattr(full, name), rtol=1e-12, atol=1e-12)
        assert all(getattr(part, other) is None for other in ARGUMENTS if other != name)
    arrays = case.arrays()
    arrays["mask"] = None
    no_mask = case.backward(grad_output, **arrays, **case.params, wrt={"mask", "input"})
    assert no_mask.mask is None and no_mask.input is not None


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
@pytest.mark.parametrize("batch", [0, 1, 33])
def test_batch_sizes(batch, transposed):
    rng = np.random.default_rng(batch)
    case = random_case(rng, 2, transposed, batch=batch)
    out = case.forward(**case.arrays(), **case.params)
    expected = case.reference()
    assert out.shape == expected.shape
    if batch:
        assert relative_error(out, expected) < 1e-10
    grads = case.backward(np.ones(out.shape), **case.arrays(), **case.params)
    for name in ARGUMENTS:
        assert getattr(grads, name).shape == case.arrays_[name].shape
    if batch == 0:
        assert not grads.weight.any() and not grads.bias.any()


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_unbatched_matches_batch_of_one(transposed):
    rng = np.random.default_rng(21)
    case = random_case(rng, 2, transposed, batch=1)
    batched = case.arrays()
    unbatched = {k: (a[0] if k in ("input", "offset", "mask") and a is not None else a) for k, a in batched.items()}
    out = case.forward(**unbatched, **case.params)
    expected = case.forward(**batched, **case.params)
    assert out.shape == expected.shape[1:]
    np.testing.assert_allclose(out, expected[0], rtol=1e-12)
    grads = case.backward(np.ones(out.shape), **unbatched, **case.params)
    full = case.backward(np.ones(expected.shape), **batched, **case.params)
    for name in ("input", "offset", "mask"):
        np.testing.assert_allclose(getattr(grads, name), getattr(full, name)[0], rtol=1e-12)
    np.testing.assert_allclose(grads.weight, full.weight, rtol=1e-12)


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_non_contiguous_inputs_and_inputs_never_modified(transposed):
    rng = np.random.default_rng(8)
    case = random_case(rng, 2, transposed)
    # Non-contiguous views: every array is a strided slice of a larger one.
    views = {}
    for name, a in case.arrays().items():
        big = np.empty(a.shape[:-1] + (2 * a.shape[-1],))
        big[..., ::2] = a
        views[name] = big[..., ::2]
        assert not views[name].flags.c_contiguous or a.ndim == 1 and a.shape[0] == 1
    copies = {k: v.copy() for k, v in views.items()}
    out = case.forward(**views, **case.params)
    assert relative_error(out, case.reference()) < 1e-10
    grad_output = np.asfortranarray(rng.standard_normal(out.shape))
    grad_copy = grad_output.copy()
    grads = case.backward(grad_output, **views, **case.params)
    contiguous = case.backward(np.ascontiguousarray(grad_output), **case.arrays(), **case.params)
    for name in ARGUMENTS:
        np.testing.assert_allclose(getattr(grads, name), getattr(contiguous, name), rtol=1e-12)
        np.testing.assert_array_equal(views[name], copies[name])
    np.testing.assert_array_equal(grad_output, grad_copy)


def test_results_do_not_depend_on_thread_count():
    rng = np.random.default_rng(9)
    case = random_case(rng, 2, False, batch=3, channels_scale=2)
    grad_output = rng.standard_normal(case.reference().shape)
    results = []
    default = numba.get_num_threads()
    try:
        for threads in sorted({1, default}):
            numba.set_num_threads(threads)
            results.append((case.forward(**case.arrays(), **case.params),
                            case.backward(grad_output, **case.arrays(), **case.params)))
            tcase = random_case(np.random.default_rng(10), 3, True)
            results[-1] += (tcase.forward(**tcase.arrays(), **tcase.params),)
    finally:
        numba.set_num_threads(default)
    for other in results[1:]:
        np.testing.assert_array_equal(other[0], results[0][0])
        for name in ARGUMENTS:
            np.testing.assert_array_equal(getattr(other[1], name), getattr(results[0][1], name))
        np.testing.assert_array_equal(other[2], results[0][2])


def test_plain_convolution_without_offset_is_exact_conv():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 4, 9, 8))
    w = rng.standard_normal((6, 4, 3, 2))
    zero = np.zeros((2, 2 * 6, 7, 7))
    a = dcn_cupy.deform_conv2d(x, w)
    b = dcn_cupy.deform_conv2d(x, w, offset=zero, mask=np.ones((2, 6, 7, 7)))
    np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e30, -1e30])
def test_non_finite_and_huge_offsets_give_finite_zero_contributions(bad):
    rng = np.random.default_rng(13)
    case = random_case(rng, 2, False)
    offset = case.arrays_["offset"].copy()
    offset[0, 0] = bad
    arrays = case.arrays()
    arrays["offset"] = offset
    out = case.forward(**arrays, **case.params)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, case.reference(arrays), rtol=1e-10, atol=1e-12)
    grads = case.backward(np.ones(out.shape), **arrays, **case.params)
    for name in ARGUMENTS:
        assert np.isfinite(getattr(grads, name)).all(), name


def test_forward_into_out_even_where_it_is_an_input(algorithm, monkeypatch):
    """A plan's forward computes into a C-contiguous ``out`` directly, unless ``out`` overlaps an
    input: then into a new array first, so that ``out=input`` gives the same result, even where
    the work is cut into boxes of positions that read the input after earlier boxes' output."""
    from dcn_cupy._backends import cpu

    monkeypatch.setattr(cpu, "WORKSPACE_LIMIT_BYTES", 40_000)  # boxes of a few rows
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, 16, 9, 9)).astype(np.float32)
    w = (rng.standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32)
    off = rng.uniform(-2, 2, (2, 18, 9, 9)).astype(np.float32)
    m = rng.uniform(0, 1, (2, 9, 9, 9)).astype(np.float32)
    p = dcn_cupy.plan(x, w, off, m, padding=1, algorithm=algorithm)
    assert p.algorithm.startswith(f"forward: {algorithm}")
    expected = p.forward(x, w, off, m)
    fresh = np.full_like(expected, np.nan)
    assert p.forward(x, w, off, m, out=fresh) is fresh
    np.testing.assert_array_equal(fresh, expected)
    aliased = x.copy()
    assert p.forward(aliased, w, off, m, out=aliased) is aliased
    np.testing.assert_array_equal(aliased, expected)
