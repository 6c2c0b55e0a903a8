"""dcn_cupy.jax: custom_vjp functions against the float64 reference and finite differences.

Every operation (N = 1, 2, 3, transposed too, mask activations) is checked eagerly and under
``jax.jit``: forward against :mod:`dcn_cupy.reference`, and ``jax.grad`` of every
differentiable argument against float64 central differences of the reference (directional
derivatives, offsets with fractional parts in [0.2, 0.8]). GPU tests (marked ``gpu``) repeat the
2D convolution and transposed convolution on ``jax.devices("gpu")[0]``.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import dcn_cupy  # noqa: E402
import dcn_cupy.jax as dj  # noqa: E402
from dcn_cupy import reference  # noqa: E402
from dcn_cupy.jax import _callbacks  # noqa: E402
from dcn_cupy.testing import fractional_offsets  # noqa: E402

NAMES = ("input", "weight", "offset", "mask", "bias")
STEP = 1e-6
GRAD_TOL = 1e-6


@pytest.fixture(autouse=True)
def cpu_by_default():
    """Arrays not placed explicitly live on the CPU (the gpu tests place theirs on the GPU)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def x64():
    old = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


@pytest.fixture
def mechanism():
    """Set dcn_cupy.jax's callback mechanism for one test (restored afterwards)."""
    old = _callbacks._MECHANISM
    try:
        yield dj.set_callback_mechanism
    finally:
        dj.set_callback_mechanism(old)


# name: (N, transposed, input shape, weight shape, offset groups, mask groups, hyper-parameters)
CONFIGS = {
    "conv1d": (1, False, (2, 4, 7), (4, 2, 3), 2, 1, dict(stride=2, padding=1, dilation=1, groups=2)),
    "conv2d": (2, False, (2, 2, 5, 4), (3, 2, 2, 3), 1, 2, dict(stride=(1, 2), padding=(1, 0), dilation=(2, 1))),
    "conv3d": (3, False, (1, 2, 3, 4, 3), (2, 2, 2, 2, 2), 2, 1, dict(padding=(0, 1, 0))),
    "transpose1d": (1, True, (2, 4, 4), (4, 1, 3), 2, 1, dict(stride=2, padding=1, output_padding=1, groups=2)),
    "transpose2d": (2, True, (1, 2, 3, 3), (2, 3, 2, 2), 1, 3, dict(stride=2, dilation=(1, 2))),
    "transpose3d": (3, True, (1, 2, 2, 2, 2), (2, 2, 2, 1, 2), 2, 1, dict(stride=(2, 1, 1), padding=(0, 0, 1))),
}


def make_case(name, seed=0):
    """float64 NumPy arrays {input, weight, offset, mask, bias} and the hyper-parameters."""
    n, transposed, xshape, wshape, g_o, g_m, params = CONFIGS[name]
    rng = np.random.default_rng(seed)
    kernel = wshape[2:]
    volume = int(np.prod(kernel))
    if transposed:
        grid = xshape[2:]  # offsets and mask live on the input grid
        c_out = wshape[1] * params.get("groups", 1)
    else:
        geom, _ = dcn_cupy._geometry.conv_geometry(xshape, wshape, ndim=n, **params)
        grid = geom.output_shape
        c_out = wshape[0]
    arrays = {
        "input": rng.standard_normal(xshape),
        "weight": rng.standard_normal(wshape),
        "offset": fractional_offsets(rng, (xshape[0], g_o * volume * n) + tuple(grid)),
        "mask": rng.uniform(0.5, 1.5, (xshape[0], g_m * volume) + tuple(grid)),
        "bias": rng.standard_normal(c_out),
    }
    return n, transposed, arrays, params


def functions(n, transposed, generic=False):
    """(dcn_cupy.jax function, reference function) of an operation."""
    base = "deform_conv_transpose" if transposed else "deform_conv"
    fn = getattr(dj, base if generic else f"{base}{n}d")
    return fn, getattr(reference, base)


def jax_args(arrays, dtype=None, device=None):
    out = {}
    for k, a in arrays.items():
        if a is None:
            out[k] = None
            continue
        v = jnp.asarray(a, dtype=dtype) if dtype is not None else jnp.asarray(a)
        out[k] = jax.device_put(v, device) if device is not None else v
    return out


def check_gradients(fn, ref_fn, arrays, params, jit, device=None, seed=1):
    """jax.grad of <fn(args), G> for every given argument against central differences."""
    rng = np.random.default_rng(seed)
    names = [k for k in NAMES if arrays.get(k) is not None]
    expected = ref_fn(**arrays, **params)
    cotangent = rng.standard_normal(expected.shape)
    g = jnp.asarray(cotangent)
    if device is not None:
        g = jax.device_put(g, device)

    def loss(diff, fixed):
        return jnp.sum(fn(**diff, **fixed, **params) * g)

    grad_fn = jax.grad(loss)
    if jit:
        grad_fn = jax.jit(grad_fn)
    args = jax_args(arrays, device=device)
    diff = {k: args[k] for k in names}
    fixed = {k: None for k in NAMES if k not in names}
    grads = grad_fn(diff, fixed)
    assert set(grads) == set(names)
    for name in names:
        grad = grads[name]
        assert grad.shape == arrays[name].shape and grad.dtype == jnp.float64, name
        if device is not None:
            assert grad.devices() == {device}, name
        direction = rng.standard_normal(arrays[name].shape)

        def objective(step):
            moved = dict(arrays)
            moved[name] = arrays[name] + step * direction
            return float(np.sum(ref_fn(**moved, **params) * cotangent))

        fd = (objective(STEP) - objective(-STEP)) / (2 * STEP)
        analytic = float(np.sum(np.asarray(grad) * direction))
        assert abs(analytic - fd) <= GRAD_TOL * max(1.0, abs(fd)), (name, analytic, fd)
    return grads


def check_forward(fn, ref_fn, arrays, params, jit, device=None):
    f = jax.jit(lambda a: fn(**a, **params)) if jit else (lambda a: fn(**a, **params))
    y = f(jax_args(arrays, device=device))
    expected = ref_fn(**arrays, **params)
    assert isinstance(y, jax.Array) and y.dtype == jnp.float64 and y.shape == expected.shape
    if device is not None:
        assert y.devices() == {device}
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# every convolution, every argument


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_conv_forward_and_gradients(x64, name, jit):
    n, transposed, arrays, params = make_case(name)
    fn, ref_fn = functions(n, transposed)
    check_forward(fn, ref_fn, arrays, params, jit)
    check_gradients(fn, ref_fn, arrays, params, jit)


@pytest.mark.parametrize("name", ["conv1d", "conv3d", "transpose2d"])
def test_generic_entry_points(x64, name):
    n, transposed, arrays, params = make_case(name)
    fn, ref_fn = functions(n, transposed, generic=True)
    check_forward(fn, ref_fn, arrays, params, jit=True)
    check_gradients(fn, ref_fn, arrays, params, jit=False)


NONE_SETS = [("offset",), ("mask",), ("bias",), ("offset", "mask"), ("offset", "mask", "bias")]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("missing", NONE_SETS, ids=lambda m: "no_" + "_".join(m))
@pytest.mark.parametrize("name", ["conv2d", "transpose2d"])
def test_missing_arguments(x64, name, missing, jit):
    n, transposed, arrays, params = make_case(name)
    for k in missing:
        arrays[k] = None
    fn, ref_fn = functions(n, transposed)
    check_forward(fn, ref_fn, arrays, params, jit)
    check_gradients(fn, ref_fn, arrays, params, jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gradient_of_none_is_none(x64, jit):
    _, _, arrays, params = make_case("conv2d")
    args = jax_args(arrays)
    args["offset"] = None

    def loss(a):
        return jnp.sum(dj.deform_conv2d(**a, **params) ** 2)

    grad_fn = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
    grads = grad_fn(args)
    assert grads["offset"] is None
    assert all(grads[k].shape == arrays[k].shape for k in NAMES if k != "offset")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transpose"])
def test_only_requested_gradients_are_computed(x64, monkeypatch, transposed, jit):
    name = "transpose2d" if transposed else "conv2d"
    n, _, arrays, params = make_case(name)
    fn, _ = functions(n, transposed)
    original = dcn_cupy._plan.Plan._backward  # eager (functional API) and jit (the trace's plan) alike
    calls = []

    def spy(self, natives, wanted, *a, **k):
        calls.append(tuple(sorted(wanted)))
        return original(self, natives, wanted, *a, **k)

    monkeypatch.setattr(dcn_cupy._plan.Plan, "_backward", spy)
    args = jax_args(arrays)

    def loss(w, m):
        return jnp.sum(fn(args["input"], w, args["offset"], m, args["bias"], **params) ** 2)

    for argnums, expected in (((0,), ("weight",)), ((1,), ("mask",)), ((0, 1), ("mask", "weight"))):
        grad_fn = jax.grad(loss, argnums=argnums)
        grads = (jax.jit(grad_fn) if jit else grad_fn)(args["weight"], args["mask"])
        assert len(grads) == len(argnums)
        assert calls[-1] == expected
    assert len(calls) == 3


def test_unbatched(x64):
    _, _, arrays, params = make_case("conv2d")
    unbatched = {k: (v[0] if k in ("input", "offset", "mask") else v) for k, v in arrays.items()}
    for jit in (False, True):
        check_forward(dj.deform_conv2d, reference.deform_conv, unbatched, params, jit)
        check_gradients(dj.deform_conv2d, reference.deform_conv, unbatched, params, jit)
    _, _, arrays, params = make_case("transpose1d")
    unbatched = {k: (v[0] if k in ("input", "offset", "mask") else v) for k, v in arrays.items()}
    check_gradients(dj.deform_conv_transpose1d, reference.deform_conv_transpose, unbatched, params, jit=True)


def test_empty_batch(x64):
    _, _, arrays, params = make_case("conv2d")
    args = jax_args({k: (v[:0] if k in ("input", "offset", "mask") else v) for k, v in arrays.items()})
    for f in (lambda a: dj.deform_conv2d(**a, **params), jax.jit(lambda a: dj.deform_conv2d(**a, **params))):
        y = f(args)
        assert y.shape == (0, 3) + arrays["offset"].shape[2:]
    grads = jax.jit(jax.grad(lambda a: jnp.sum(dj.deform_conv2d(**a, **params))))(args)
    assert grads["input"].shape == (0, 2, 5, 4)
    np.testing.assert_array_equal(np.asarray(grads["weight"]), 0)


# ---------------------------------------------------------------------------------------------
# mask activations

MASK_CASES = {
    "softmax1d": (1, (3,), (2, 6, 5)),
    "softmax2d": (2, (3, 2), (2, 12, 3, 2)),
    "softmax3d": (3, (2, 1, 2), (1, 8, 2, 3, 2)),
}


def check_scalar_function(fn, ref_fn, logits, jit, device=None, seed=2):
    rng = np.random.default_rng(seed)
    f = jax.jit(fn) if jit else fn
    arg = jnp.asarray(logits)
    if device is not None:
        arg = jax.device_put(arg, device)
    np.testing.assert_allclose(np.asarray(f(arg)), ref_fn(logits), rtol=1e-12, atol=1e-12)
    cotangent = rng.standard_normal(logits.shape)
    grad_fn = jax.grad(lambda m: jnp.sum(fn(m) * cotangent))
    grad = (jax.jit(grad_fn) if jit else grad_fn)(arg)
    assert grad.dtype == jnp.float64 and grad.shape == logits.shape
    direction = rng.standard_normal(logits.shape)
    fd = (np.sum(ref_fn(logits + STEP * direction) * cotangent)
          - np.sum(ref_fn(logits - STEP * direction) * cotangent)) / (2 * STEP)
    analytic = float(np.sum(np.asarray(grad) * direction))
    assert abs(analytic - fd) <= GRAD_TOL * max(1.0, abs(fd)), (analytic, fd)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", list(MASK_CASES))
def test_mask_softmax(x64, case, jit):
    n, kernel, shape = MASK_CASES[case]
    logits = np.random.default_rng(n).standard_normal(shape) * 2
    nd = getattr(dj, f"mask_softmax{n}d")
    check_scalar_function(lambda m: nd(m, kernel), lambda m: reference.mask_softmax(m, kernel), logits, jit)
    check_scalar_function(lambda m: dj.mask_softmax(m, kernel), lambda m: reference.mask_softmax(m, kernel),
                          logits, jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_mask_softmax_unbatched_int_kernel(x64, jit):
    # An int kernel_size with an unbatched mask: N comes from the Nd function, not from ndim.
    logits = np.random.default_rng(5).standard_normal((9, 4, 6))
    check_scalar_function(lambda m: dj.mask_softmax2d(m, 3),
                          lambda m: reference.mask_softmax(m[None], 3)[0], logits, jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("scale", [2.0, 0.5])
def test_mask_sigmoid(x64, scale, jit):
    logits = np.random.default_rng(3).standard_normal((2, 9, 3, 4)) * 3
    check_scalar_function(lambda m: dj.mask_sigmoid(m, scale), lambda m: reference.mask_sigmoid(m, scale),
                          logits, jit)


def test_composition_with_mask_activations(x64):
    """A DCNv2 layer: softmax-normalised mask, everything differentiated under jit."""
    _, _, arrays, params = make_case("conv2d")
    kernel = arrays["weight"].shape[2:]
    args = jax_args(arrays)

    def layer(a):
        m = dj.mask_softmax2d(a["mask"], kernel)
        y = dj.deform_conv2d(a["input"], a["weight"], a["offset"], m, a["bias"], **params)
        return jnp.sum(jnp.tanh(y))

    def ref_layer(a):
        m = reference.mask_softmax(a["mask"], kernel)
        y = reference.deform_conv(a["input"], a["weight"], a["offset"], m, a["bias"], **params)
        return float(np.sum(np.tanh(y)))

    grads = jax.jit(jax.grad(layer))(args)
    rng = np.random.default_rng(4)
    for name in NAMES:
        direction = rng.standard_normal(arrays[name].shape)
        plus, minus = dict(arrays), dict(arrays)
        plus[name] = arrays[name] + STEP * direction
        minus[name] = arrays[name] - STEP * direction
        fd = (ref_layer(plus) - ref_layer(minus)) / (2 * STEP)
        analytic = float(np.sum(np.asarray(grads[name]) * direction))
        assert abs(analytic - fd) <= GRAD_TOL * max(1.0, abs(fd)), (name, analytic, fd)


# ---------------------------------------------------------------------------------------------
# low precision: dtypes are kept


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ["conv2d", "transpose2d"])
def test_low_precision_dtypes(name, dtype, jit):
    n, transposed, arrays, params = make_case(name)
    fn, ref_fn = functions(n, transposed)
    jdtype = getattr(jnp, dtype)
    args = jax_args(arrays, dtype=jdtype)
    rounded = {k: np.asarray(v.astype(jnp.float32), dtype=np.float64) for k, v in args.items()}
    forward = jax.jit(lambda a: fn(**a, **params)) if jit else (lambda a: fn(**a, **params))
    y = forward(args)
    assert y.dtype == jdtype
    expected = ref_fn(**rounded, **params)
    tol = 1e-5 if dtype == "float32" else 3e-2
    error = np.linalg.norm(np.asarray(y.astype(jnp.float32), np.float64) - expected) / np.linalg.norm(expected)
    assert error < tol

    cotangent = np.random.default_rng(7).standard_normal(expected.shape)
    g = jnp.asarray(cotangent, dtype=jdtype)
    grad_fn = jax.grad(lambda a: jnp.sum((fn(**a, **params) * g).astype(jnp.float32)))
    grads = (jax.jit(grad_fn) if jit else grad_fn)(args)
    exact = dcn_cupy.deform_conv_transpose_backward if transposed else dcn_cupy.deform_conv_backward
    want = exact(np.asarray(g.astype(jnp.float32), np.float64), **rounded, **params)
    for k in NAMES:
        assert grads[k].dtype == jdtype, k
        got = np.asarray(grads[k].astype(jnp.float32), np.float64)
        ref = getattr(want, k)
        assert np.linalg.norm(got - ref) <= tol * max(np.linalg.norm(ref), 1e-3), k


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_low_precision_mask_activations(jit):
    logits = np.random.default_rng(8).standard_normal((2, 8, 3, 3))
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        m = jnp.asarray(logits, dtype=dtype)
        for fn in (lambda a: dj.mask_softmax2d(a, 2), lambda a: dj.mask_sigmoid(a)):
            f = jax.jit(fn) if jit else fn
            assert f(m).dtype == dtype
            grad = jax.grad(lambda a: jnp.sum(fn(a).astype(jnp.float32) ** 2))(m)
            assert grad.dtype == dtype and bool(jnp.all(jnp.isfinite(grad.astype(jnp.float32))))


# ---------------------------------------------------------------------------------------------
# callbacks: both mechanisms, vmap, errors


def test_mechanism_is_reported(mechanism):
    assert dj.callback_mechanism() == ("pure_callback" if _callbacks._buffer_callback is None else "buffer_callback")
    mechanism("pure")
    assert dj.callback_mechanism() == "pure_callback"
    with pytest.raises(ValueError, match="mechanism"):
        mechanism("host")


@pytest.mark.parametrize("which", ["pure", "buffer"])
def test_both_callback_mechanisms(x64, mechanism, which):
    if which == "buffer" and _callbacks._buffer_callback is None:
        pytest.skip("jax.experimental.buffer_callback is not available")
    mechanism(which)
    assert dj.callback_mechanism() == which + "_callback"
    for name in ("conv2d", "transpose1d"):
        n, transposed, arrays, params = make_case(name)
        fn, ref_fn = functions(n, transposed)
        check_forward(fn, ref_fn, arrays, params, jit=True)
        check_gradients(fn, ref_fn, arrays, params, jit=True)
    check_scalar_function(lambda m: dj.mask_sigmoid(m), reference.mask_sigmoid,
                          np.linspace(-3, 3, 12).reshape(3, 4), jit=True)
    m = jnp.ones((1, 4, 2, 2), jnp.bfloat16)
    assert jax.jit(lambda a: dj.mask_softmax2d(a, 2))(m).dtype == jnp.bfloat16


@pytest.mark.parametrize("which", ["pure", "buffer"])
def test_vmap(x64, mechanism, which):
    if which == "buffer" and _callbacks._buffer_callback is None:
        pytest.skip("jax.experimental.buffer_callback is not available")
    mechanism(which)
    _, _, arrays, params = make_case("conv2d")
    a = jax_args(arrays)
    rng = np.random.default_rng(9)
    xs = jnp.asarray(rng.standard_normal((3,) + arrays["input"].shape))
    offs = jnp.asarray(fractional_offsets(rng, (3,) + arrays["offset"].shape))
    ws = jnp.asarray(rng.standard_normal((3,) + arrays["weight"].shape))

    def conv(x, w, off):
        return dj.deform_conv2d(x, w, off, a["mask"], a["bias"], **params)

    # per-sample operands vmapped (merged into the native batch axis)
    got = jax.jit(jax.vmap(conv, in_axes=(0, None, 0)))(xs, a["weight"], offs)
    want = np.stack([np.asarray(conv(xs[i], a["weight"], offs[i])) for i in range(3)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)
    # a vmapped weight (looped inside the callback)
    got = jax.vmap(conv, in_axes=(None, 0, 0))(a["input"], ws, offs)
    want = np.stack([np.asarray(conv(a["input"], ws[i], offs[i])) for i in range(3)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)
    # per-example gradients: vmap of grad (weight gradients stay per element)
    per_example = jax.jit(jax.vmap(jax.grad(lambda w, x: jnp.sum(conv(x, w, a["offset"]) ** 2)),
                                   in_axes=(None, 0)))(a["weight"], xs)
    for i in range(3):
        one = jax.grad(lambda w: jnp.sum(conv(xs[i], w, a["offset"]) ** 2))(a["weight"])
        np.testing.assert_allclose(np.asarray(per_example[i]), np.asarray(one), rtol=1e-10, atol=1e-10)
    # nested vmap and the mask activations
    logits = jnp.asarray(rng.standard_normal((2, 3, 1, 4, 2, 2)))
    got = jax.vmap(jax.vmap(lambda m: dj.mask_softmax2d(m, 2)))(logits)
    np.testing.assert_allclose(np.asarray(got), reference.mask_softmax(np.asarray(logits).reshape(6, 4, 2, 2), 2)
                               .reshape(logits.shape), rtol=1e-12)
    got = jax.vmap(lambda m: dj.mask_sigmoid(m, 2.0))(logits)
    np.testing.assert_allclose(np.asarray(got), reference.mask_sigmoid(np.asarray(logits)), rtol=1e-12)


def test_errors_are_raised_when_tracing():
    x = jnp.ones((1, 2, 5, 5), jnp.float32)
    w = jnp.ones((3, 2, 3, 3), jnp.float32)
    bad_offset = jnp.ones((1, 20, 3, 3), jnp.float32)
    with pytest.raises(ValueError, match="offset"):
        jax.jit(dj.deform_conv2d)(x, w, bad_offset)
    with pytest.raises(ValueError, match="offset"):
        dj.deform_conv2d(x, w, bad_offset)
    with pytest.raises(TypeError, match="weight"):
        jax.jit(dj.deform_conv2d)(x, w.astype(jnp.float16))
    with pytest.raises(ValueError, match="weight"):
        dj.deform_conv2d(x, w[0])
    with pytest.raises(ValueError):
        dj.mask_softmax2d(jnp.ones((1, 7, 2, 2)), 3)


# ---------------------------------------------------------------------------------------------
# GPU


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")


@pytest.mark.gpu
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", ["conv2d", "transpose2d"])
def test_gpu_forward_and_gradients(x64, name, jit):
    device = _gpu()
    if jit:
        assert dj.callback_mechanism() == "buffer_callback" or _callbacks._buffer_callback is None
    n, transposed, arrays, params = make_case(name)
    fn, ref_fn = functions(n, transposed)
    check_forward(fn, ref_fn, arrays, params, jit, device=device)
    check_gradients(fn, ref_fn, arrays, params, jit, device=device)
    arrays["offset"] = arrays["bias"] = None
    check_gradients(fn, ref_fn, arrays, params, jit, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ["conv2d", "transpose2d"])
def test_gpu_low_precision(name, dtype, jit):
    device = _gpu()
    n, transposed, arrays, params = make_case(name)
    fn, ref_fn = functions(n, transposed)
    jdtype = getattr(jnp, dtype)
    args = jax_args(arrays, dtype=jdtype, device=device)
    rounded = {k: np.asarray(v.astype(jnp.float32), dtype=np.float64) for k, v in args.items()}
    forward = jax.jit(lambda a: fn(**a, **params)) if jit else (lambda a: fn(**a, **params))
    y = forward(args)
    assert y.dtype == jdtype and y.devices() == {device}
    expected = ref_fn(**rounded, **params)
    tol = 1e-3 if dtype == "float32" else 3e-2  # float32 may use TF32 on the GPU
    error = np.linalg.norm(np.asarray(y.astype(jnp.float32), np.float64) - expected) / np.linalg.norm(expected)
    assert error < tol
    grad_fn = jax.grad(lambda a: jnp.sum(fn(**a, **params).astype(jnp.float32) ** 2))
    grads = (jax.jit(grad_fn) if jit else grad_fn)(args)
    for k in NAMES:
        assert grads[k].dtype == jdtype and grads[k].devices() == {device}, k
        assert bool(jnp.all(jnp.isfinite(grads[k].astype(jnp.float32)))), k


@pytest.mark.gpu
def test_gpu_vmap_and_mask_activations(x64):
    device = _gpu()
    _, _, arrays, params = make_case("conv2d")
    a = jax_args(arrays, device=device)
    xs = jax.device_put(jnp.asarray(np.random.default_rng(3).standard_normal((2,) + arrays["input"].shape)), device)

    def conv(x, w):
        return dj.deform_conv2d(x, w, a["offset"], dj.mask_sigmoid(a["mask"]), a["bias"], **params)

    got = jax.jit(jax.vmap(conv, in_axes=(0, None)))(xs, a["weight"])
    for i in range(2):
        want = reference.deform_conv(np.asarray(xs[i]), arrays["weight"], arrays["offset"],
                                     reference.mask_sigmoid(arrays["mask"]), arrays["bias"], **params)
        np.testing.assert_allclose(np.asarray(got[i]), want, rtol=1e-10, atol=1e-10)
    per_example = jax.jit(jax.vmap(jax.grad(lambda w, x: jnp.sum(conv(x, w) ** 2)), in_axes=(None, 0)))(
        a["weight"], xs)
    assert per_example.shape == (2,) + arrays["weight"].shape and per_example.devices() == {device}
    kernel = arrays["weight"].shape[2:]
    check_scalar_function(lambda m: dj.mask_softmax2d(m, kernel), lambda m: reference.mask_softmax(m, kernel),
                          arrays["mask"], jit=True, device=device)


# ---------------------------------------------------------------------------------------------
# the raw-address path (buffer_callback on CUDA, no vmapped axes)


def _spy_launches(monkeypatch, refuse=False):
    """Record (method, done, wanted) of every Plan.launch_forward/launch_backward; ``refuse``:
    answer False without running (the callbacks must then take the array path)."""
    from dcn_cupy import _plan

    calls = []
    for method in ("launch_forward", "launch_backward"):
        original = getattr(_plan.Plan, method)

        def spy(self, *a, _original=original, _method=method, **k):
            done = False if refuse else _original(self, *a, **k)
            calls.append((_method, done, tuple(sorted(a[2])) if _method == "launch_backward" else None))
            return done

        monkeypatch.setattr(_plan.Plan, method, spy)
    return calls


def test_cpu_buffers_take_the_array_path(x64, monkeypatch):
    calls = _spy_launches(monkeypatch)
    n, transposed, arrays, params = make_case("conv2d")
    fn, ref_fn = functions(n, transposed)
    check_forward(fn, ref_fn, arrays, params, jit=True)
    check_gradients(fn, ref_fn, arrays, params, jit=True)
    assert not calls


RAW_SUBSETS = {"all": NAMES, "weight+mask": ("weight", "mask"), "input": ("input",), "bias": ("bias",)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", ["conv2d", "transpose2d"])
def test_gpu_raw_address_path_equals_array_path(x64, monkeypatch, name, dtype):
    """jit forward and jit(grad) (every gradient, and subsets) on GPU buffers reach the trace's
    plan through Plan.launch_forward/launch_backward; the results equal the array path's."""
    device = _gpu()
    if _callbacks._buffer_callback is None:
        pytest.skip("jax.experimental.buffer_callback is not available")
    assert dj.callback_mechanism() == "buffer_callback"
    n, transposed, arrays, params = make_case(name)
    fn, _ = functions(n, transposed)
    jdtype = getattr(jnp, dtype)
    args = jax_args(arrays, dtype=jdtype, device=device)
    forward = jax.jit(lambda a: fn(**a, **params))
    shape = jax.eval_shape(forward, args).shape
    cotangent = jax.device_put(jnp.asarray(np.random.default_rng(5).standard_normal(shape), jdtype), device)
    grad = jax.jit(jax.grad(lambda diff, fixed: jnp.sum(fn(**diff, **fixed, **params) * cotangent)))

    def run():
        y = forward(args)
        grads = {key: grad({k: args[k] for k in names}, {k: args[k] for k in NAMES if k not in names})
                 for key, names in RAW_SUBSETS.items()}
        return jax.block_until_ready((y, grads))

    calls = _spy_launches(monkeypatch)
    y_fast, g_fast = run()
    assert calls and all(done for _, done, _ in calls), calls
    # jit(grad) of a loss linear in y: XLA drops the (side-effect free) forward callback
    assert sum(m == "launch_forward" for m, _, _ in calls) >= 1
    assert sorted(w for m, _, w in calls if m == "launch_backward") == sorted(
        tuple(sorted(names)) for names in RAW_SUBSETS.values())
    calls.clear()
    monkeypatch.setattr(_callbacks, "RAW_ADDRESSES", False)   # read at every execution
    y_slow, g_slow = run()
    assert not calls
    monkeypatch.setattr(_callbacks, "RAW_ADDRESSES", True)
    refused = _spy_launches(monkeypatch, refuse=True)          # a launch answering False: the array path
    y_back, g_back = run()
    assert sum(m == "launch_backward" for m, _, _ in refused) == len(RAW_SUBSETS) and refused[0][0] == "launch_forward"

    def same(got, want, what):
        assert got.dtype == jdtype and got.devices() == {device}, what
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if dtype == "float64":
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=what)
        else:  # float32 gradients accumulate with atomics: the order may differ
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()), err_msg=what)

    for y_other, g_other in ((y_slow, g_slow), (y_back, g_back)):
        same(y_fast, y_other, "forward")
        for key, names in RAW_SUBSETS.items():
            assert set(g_fast[key]) == set(names)
            for k in names:
                same(g_fast[key][k], g_other[key][k], f"{key}: {k}")


@pytest.mark.gpu
def test_gpu_vmap_takes_the_array_path(x64, monkeypatch):
    device = _gpu()
    _, _, arrays, params = make_case("conv2d")
    a = jax_args(arrays, device=device)
    xs = jax.device_put(jnp.asarray(np.random.default_rng(4).standard_normal((3,) + arrays["input"].shape)), device)

    def conv(x, w):
        return dj.deform_conv2d(x, w, a["offset"], a["mask"], a["bias"], **params)

    calls = _spy_launches(monkeypatch)
    got = jax.jit(jax.vmap(conv, in_axes=(0, None)))(xs, a["weight"])
    per_example = jax.jit(jax.vmap(jax.grad(lambda w, x: jnp.sum(conv(x, w) ** 2)), in_axes=(None, 0)))(
        a["weight"], xs)
    jax.block_until_ready((got, per_example))
    assert not calls
    one = jax.jit(conv)
    one_grad = jax.jit(jax.grad(lambda w, x: jnp.sum(conv(x, w) ** 2)))
    for i in range(3):
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(one(xs[i], a["weight"])), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(np.asarray(per_example[i]), np.asarray(one_grad(a["weight"], xs[i])),
                                   rtol=1e-10, atol=1e-10)
    assert calls and all(done for _, done, _ in calls)
