"""dcn_cupy.tensorflow: tf.custom_gradient functions against the reference and finite differences,
eagerly and inside tf.function, with tf.Variables; the TensorFlow array library of the interop
registry; a small Keras model trained for a few steps. Skips where TensorFlow is not installed."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import dcn_cupy  # noqa: E402
import dcn_cupy.tensorflow as dctf  # noqa: E402
from dcn_cupy import reference  # noqa: E402
from dcn_cupy.tensorflow._library import LIBRARY  # noqa: E402
from dcn_cupy.testing import ARGUMENTS, directional_derivative, random_case, relative_error  # noqa: E402


def _tf(case):
    return {k: None if a is None else tf.constant(a) for k, a in case.arrays_.items()}


def _function(case):
    return getattr(dctf, case.name)


def _gradients(case, grad_output, compiled: bool):
    arrays = _tf(case)
    names = [k for k in ARGUMENTS if arrays[k] is not None]
    fn = _function(case)

    def compute(*tensors):
        given = dict(zip(names, tensors))
        with tf.GradientTape() as tape:
            for t in tensors:
                tape.watch(t)
            y = fn(**given, **case.params)
            loss = tf.reduce_sum(y * tf.constant(grad_output))
        return y, tape.gradient(loss, list(tensors))

    if compiled:
        compute = tf.function(compute)
    y, grads = compute(*[arrays[k] for k in names])
    return y, dict(zip(names, grads))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_gradients_match_finite_differences(ndim, transposed, compiled):
    rng = np.random.default_rng(100 * ndim + 10 * transposed + compiled)
    case = random_case(rng, ndim, transposed)
    grad_output = rng.standard_normal(case.reference().shape)
    y, grads = _gradients(case, grad_output, compiled)
    assert isinstance(y, tf.Tensor) and y.dtype == tf.float64
    assert relative_error(y.numpy(), case.reference()) < 1e-12
    for name in ARGUMENTS:
        direction = rng.standard_normal(case.arrays_[name].shape)
        fd = directional_derivative(case, name, grad_output, direction)
        analytic = float(np.vdot(grads[name].numpy(), direction))
        assert abs(analytic - fd) <= 1e-6 * max(1.0, abs(fd)), (name, analytic, fd)


def test_variables_missing_arguments_and_unbatched_inputs():
    rng = np.random.default_rng(1)
    case = random_case(rng, 2, False, mask=False, bias=False, batch=1)
    x = tf.Variable(case.arrays_["input"][0])           # unbatched (C, H, W)
    w = tf.Variable(case.arrays_["weight"])
    offset = tf.Variable(case.arrays_["offset"][0])
    with tf.GradientTape() as tape:
        y = dctf.deform_conv2d(x, w, offset, **case.params)
        loss = tf.reduce_sum(y ** 2)
    gx, gw, go = tape.gradient(loss, [x, w, offset])
    expected = case.reference()[0]
    assert y.shape == expected.shape and relative_error(y.numpy(), expected) < 1e-12
    core = dcn_cupy.deform_conv2d_backward(2 * expected, case.arrays_["input"][0], case.arrays_["weight"],
                                           case.arrays_["offset"][0], **case.params)
    for got, want in ((gx, core.input), (gw, core.weight), (go, core.offset)):
        assert relative_error(got.numpy(), want) < 1e-12


def test_numpy_weight_is_converted_to_the_input_dtype():
    rng = np.random.default_rng(2)
    x = tf.constant(rng.standard_normal((1, 2, 5, 5)), tf.float32)
    w = rng.standard_normal((3, 2, 3, 3))                 # float64 NumPy
    y = dctf.deform_conv2d(x, w, padding=1)
    assert isinstance(y, tf.Tensor) and y.dtype == tf.float32
    expected = reference.deform_conv(x.numpy().astype(np.float64), w.astype(np.float32).astype(np.float64),
                                     padding=1)
    assert relative_error(y.numpy(), expected) < 1e-5


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32])
def test_low_precision_forward_and_gradient_dtypes(dtype):
    rng = np.random.default_rng(3)
    case = random_case(rng, 2, False)
    arrays = {k: tf.cast(tf.constant(a), dtype) for k, a in case.arrays_.items()}
    with tf.GradientTape() as tape:
        tape.watch(list(arrays.values()))
        y = dctf.deform_conv2d(**arrays, **case.params)
        loss = tf.reduce_sum(tf.cast(y, tf.float32))
    grads = tape.gradient(loss, list(arrays.values()))
    assert y.dtype == dtype and all(g.dtype == dtype for g in grads)
    tolerance = {tf.float16: 5e-3, tf.bfloat16: 4e-2, tf.float32: 1e-5}[dtype]
    rounded = {k: tf.cast(a, tf.float64).numpy() for k, a in arrays.items()}
    expected = reference.deform_conv(**rounded, **case.params)
    assert relative_error(tf.cast(y, tf.float64).numpy(), expected) < tolerance


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
def test_mask_activations_and_their_gradients(compiled):
    rng = np.random.default_rng(4)
    kernel = (3, 2)
    logits = tf.constant(rng.standard_normal((2, 12, 4, 5)))
    grad_output = rng.standard_normal((2, 12, 4, 5))
    direction = rng.standard_normal((2, 12, 4, 5))

    def compute(m):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(m)
            soft = dctf.mask_softmax2d(m, kernel)
            sig = dctf.mask_sigmoid(m, 1.5)
            a = tf.reduce_sum(soft * grad_output)
            b = tf.reduce_sum(sig * grad_output)
        return soft, sig, tape.gradient(a, m), tape.gradient(b, m)

    soft, sig, g_soft, g_sig = (tf.function(compute) if compiled else compute)(logits)
    x = logits.numpy()
    assert relative_error(soft.numpy(), reference.mask_softmax(x, kernel)) < 1e-12
    assert relative_error(sig.numpy(), reference.mask_sigmoid(x, 1.5)) < 1e-12
    h = 1e-6
    for grad, ref in ((g_soft, lambda v: reference.mask_softmax(v, kernel)),
                      (g_sig, lambda v: reference.mask_sigmoid(v, 1.5))):
        fd = (np.vdot(ref(x + h * direction), grad_output) - np.vdot(ref(x - h * direction), grad_output)) / (2 * h)
        assert abs(np.vdot(grad.numpy(), direction) - fd) < 1e-6 * max(1.0, abs(fd))


def test_graph_mode_keeps_static_shapes():
    seen = {}

    @tf.function(input_signature=[tf.TensorSpec((None, 4, 9, 9), tf.float32)])
    def f(x):
        w = tf.ones((6, 2, 3, 3))
        y = dctf.deform_conv2d(x, w, padding=1, stride=2, groups=2)
        seen["conv"] = y.shape
        yt = dctf.deform_conv_transpose2d(x, tf.ones((4, 3, 3, 3)), stride=2, padding=1, output_padding=1)
        seen["transposed"] = yt.shape
        return y, yt

    y, yt = f(tf.ones((2, 4, 9, 9)))
    assert seen["conv"].as_list() == [None, 6, 5, 5] and y.shape == (2, 6, 5, 5)
    assert seen["transposed"].as_list() == [None, 3, 18, 18] and yt.shape == (2, 3, 18, 18)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="offset"):
        dctf.deform_conv2d(tf.ones((1, 2, 5, 5)), tf.ones((3, 2, 3, 3)), tf.ones((1, 17, 3, 3)))
    with pytest.raises(TypeError, match="weight"):
        dctf.deform_conv2d(tf.ones((1, 2, 5, 5)), object())


def test_tensorflow_array_library():
    """The ArrayLibrary the interop registry takes: zero-copy views in, tf.Tensors out."""
    rng = np.random.default_rng(5)
    t = tf.constant(rng.standard_normal((2, 3)), tf.float32)
    v = tf.Variable(t)
    assert LIBRARY.name == "tensorflow" and LIBRARY.owns(t) and LIBRARY.owns(v)
    assert not LIBRARY.owns(np.zeros(2))
    for value in (t, v):
        native, device, index = LIBRARY.to_native(value, "input")
        assert isinstance(native, np.ndarray) and (device, index) == ("cpu", 0)
        np.testing.assert_array_equal(native, t.numpy())
    back = LIBRARY.from_native(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert isinstance(back, tf.Tensor) and back.shape == (2, 3)
    bf = tf.cast(t, tf.bfloat16)
    native, _, _ = LIBRARY.to_native(bf, "input")
    assert native.dtype.name == "bfloat16"
    assert LIBRARY.from_native(native).dtype == tf.bfloat16


def test_core_api_returns_tensorflow_tensors():
    """With the interop registry (DESIGN §3), the core functions take and return tf.Tensors."""
    rng = np.random.default_rng(6)
    x = tf.constant(rng.standard_normal((1, 2, 5, 5)), tf.float32)
    w = tf.constant(rng.standard_normal((3, 2, 3, 3)), tf.float32)
    y = dcn_cupy.deform_conv2d(x, w, padding=1)
    assert isinstance(y, tf.Tensor)
    y_var = dcn_cupy.deform_conv2d(x, tf.Variable(w), padding=1)
    assert isinstance(y_var, tf.Tensor)
    np.testing.assert_allclose(y.numpy(), y_var.numpy())
    capsule = tf.experimental.dlpack.to_dlpack(x)
    y_capsule = dcn_cupy.deform_conv2d(capsule, w.numpy(), padding=1)
    np.testing.assert_allclose(np.asarray(y_capsule), y.numpy(), rtol=1e-6)
    # arguments share one library (DESIGN §2); the message names TensorFlow, not "dlpack"
    with pytest.raises(TypeError, match=r"weight must come from the same library as input \(tensorflow\), got numpy"):
        dcn_cupy.deform_conv2d(x, w.numpy(), padding=1)


def test_a_small_keras_model_trains():
    keras = pytest.importorskip("keras")
    if keras.config.backend() != "tensorflow":
        pytest.skip(f"Keras runs on the {keras.config.backend()} backend in this process")
    rng = np.random.default_rng(7)

    class Deformable(keras.layers.Layer):
        """Offsets from a plain conv, then a deformable conv, all through dcn_cupy.tensorflow."""

        def build(self, shape):
            self.w_off = self.add_weight(shape=(18, shape[1], 3, 3), initializer="zeros")
            self.w = self.add_weight(shape=(4, shape[1], 3, 3), initializer="glorot_uniform")

        def call(self, x):
            offset = dctf.deform_conv2d(x, self.w_off, padding=1)
            return dctf.deform_conv2d(x, self.w, offset, padding=1)

    model = keras.Sequential([keras.Input((2, 8, 8)), Deformable(), keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x = rng.standard_normal((32, 2, 8, 8)).astype(np.float32)
    target = x[:, :1, 2:5, 3:6].sum(axis=(1, 2, 3))[:, None]
    before = model.evaluate(x, target, verbose=0)
    history = model.fit(x, target, epochs=8, batch_size=8, verbose=0)
    after = model.evaluate(x, target, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert after < 0.7 * before, (before, after)
    # the offset predictor received gradients (it started at zero)
    assert float(np.abs(model.layers[0].w_off.numpy()).max()) > 0
