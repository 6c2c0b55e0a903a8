"""dcn_cupy.keras under every Keras backend that is installed here (TensorFlow, JAX, PyTorch).

Keras picks its backend once per process (``KERAS_BACKEND``), so each backend runs this file as a
script in its own subprocess; the checks: every layer against the float64 reference in both data
formats, gradients reaching every weight (the zero-initialised offset/mask predictors included)
and a few training steps lowering the loss, get_config/from_config, model.save/load_model.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
_FRAMEWORK = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}


@pytest.mark.parametrize("backend", sorted(_FRAMEWORK))
def test_layers_under_keras_backend(backend, tmp_path):
    if importlib.util.find_spec("keras") is None:
        pytest.skip("Keras is not installed")
    if importlib.util.find_spec(_FRAMEWORK[backend]) is None:
        pytest.skip(f"{_FRAMEWORK[backend]} (the {backend} Keras backend) is not installed")
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    result = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert f"backend {backend}: all checks passed" in result.stdout, result.stdout


# ---------------------------------------------------------------------------------------------
# the checks, run in a subprocess with KERAS_BACKEND set


def _to_first(a, ndim):
    return np.moveaxis(a, -1, 1)


def _to_last(a, ndim):
    return np.moveaxis(a, 1, -1)


def _dcn_kernel(kernel, ndim):
    return np.transpose(kernel, (ndim + 1, ndim) + tuple(range(ndim)))


def _check_layers(keras, tmp):
    from dcn_cupy import reference
    from dcn_cupy import keras as dck
    from dcn_cupy.testing import fractional_offsets, relative_error

    rng = np.random.default_rng(0)
    sizes = {1: (9,), 2: (7, 6), 3: (5, 4, 5)}
    for ndim in (1, 2, 3):
        K = 2 ** ndim  # kernel size 2 on every axis
        for data_format in ("channels_last", "channels_first") if ndim == 2 else ("channels_last",):
            x_first = rng.standard_normal((2, 4) + sizes[ndim]).astype(np.float32)
            x = x_first if data_format == "channels_first" else _to_last(x_first, ndim)

            def to_layer(a):
                return a if data_format == "channels_first" else _to_last(a, ndim)

            # offsets and masks as inputs
            conv = getattr(dck, f"DeformConv{ndim}D")(6, 2, strides=2, padding=1, groups=2, offset_groups=2,
                                                      bias_initializer="random_normal", data_format=data_format)
            q = tuple((s + 2 - 2) // 2 + 1 for s in sizes[ndim])
            offset = fractional_offsets(rng, (2, 2 * K * ndim) + q).astype(np.float32)
            mask = rng.uniform(0.2, 1.2, (2, K) + q).astype(np.float32)
            y = np.asarray(keras.ops.convert_to_numpy(conv([x, to_layer(offset), to_layer(mask)])))
            w = _dcn_kernel(keras.ops.convert_to_numpy(conv.kernel), ndim).astype(np.float64)
            b = keras.ops.convert_to_numpy(conv.bias).astype(np.float64)
            expected = reference.deform_conv(x_first.astype(np.float64), w, offset.astype(np.float64),
                                             mask.astype(np.float64), b, stride=2, padding=1, groups=2)
            assert relative_error(y, to_layer(expected)) < 1e-5, ("DeformConv", ndim, data_format)
            assert tuple(conv.compute_output_shape(x.shape)) == y.shape

            tconv = getattr(dck, f"DeformConvTranspose{ndim}D")(4, 2, strides=2, padding=1, output_padding=1,
                                                                data_format=data_format)
            toff = fractional_offsets(rng, (2, K * ndim) + sizes[ndim]).astype(np.float32)
            y = np.asarray(keras.ops.convert_to_numpy(tconv([x, to_layer(toff)])))
            w = _dcn_kernel(keras.ops.convert_to_numpy(tconv.kernel), ndim).astype(np.float64)
            expected = reference.deform_conv_transpose(x_first.astype(np.float64), w, toff.astype(np.float64),
                                                       stride=2, padding=1, output_padding=1)
            assert relative_error(y, to_layer(expected)) < 1e-5, ("DeformConvTranspose", ndim, data_format)
            assert tuple(tconv.compute_output_shape(x.shape)) == y.shape

            # packed: zero-initialised predictors, so zero offsets and a mask of activation(0)
            for cls, activation, mask_value, transposed in (
                    (f"PackedDeformConv{ndim}D", "softmax", 1.0 / K, False),
                    (f"PackedDeformConv{ndim}D", "sigmoid", 0.5, False),
                    (f"PackedDeformConvTranspose{ndim}D", "sigmoid", 0.5, True)):
                layer = getattr(dck, cls)(4, 2, padding=1, strides=2 if transposed else 1, mask_activation=activation,
                                          offset_groups=2, mask_groups=2, data_format=data_format)
                y = np.asarray(keras.ops.convert_to_numpy(layer(x)))
                w = _dcn_kernel(keras.ops.convert_to_numpy(layer.kernel), ndim).astype(np.float64)
                b = keras.ops.convert_to_numpy(layer.bias).astype(np.float64)
                fn = reference.deform_conv_transpose if transposed else reference.deform_conv
                expected = fn(x_first.astype(np.float64), w, None, None, b, stride=2 if transposed else 1,
                              padding=1) * mask_value
                assert relative_error(y, to_layer(expected)) < 1e-5, (cls, activation, data_format)
                assert tuple(layer.compute_output_shape(x.shape)) == y.shape
    print("layers match the reference")


def _check_training_and_saving(keras, tmp):
    from dcn_cupy import keras as dck

    rng = np.random.default_rng(1)
    keras.utils.set_random_seed(1)
    inputs = keras.Input((10, 10, 2))
    h = dck.PackedDeformConv2D(6, 3, padding=1, mask_activation="sigmoid", name="deform")(inputs)
    h = keras.layers.Activation("relu")(h)
    h = dck.PackedDeformConvTranspose2D(3, 2, strides=2, name="up")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(1)(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    x = rng.standard_normal((32, 10, 10, 2)).astype(np.float32)
    target = (x[:, 3:6, 4:7, 0].mean(axis=(1, 2)) - x[:, :, :, 1].mean(axis=(1, 2)))[:, None]
    before = float(model.evaluate(x, target, verbose=0))
    model.fit(x, target, epochs=12, batch_size=8, verbose=0)
    after = float(model.evaluate(x, target, verbose=0))
    assert np.isfinite(after) and after < 0.7 * before, (before, after)
    for layer in ("deform", "up"):  # the predictors started at zero and received gradients
        assert np.abs(keras.ops.convert_to_numpy(model.get_layer(layer).offset_kernel)).max() > 0, layer
        assert np.abs(keras.ops.convert_to_numpy(model.get_layer(layer).mask_kernel)).max() > 0, layer
    print(f"training: loss {before:.4f} -> {after:.4f}")

    config = model.get_layer("deform").get_config()
    assert config["mask_activation"] == "sigmoid" and config["padding"] == (1, 1)
    clone = dck.PackedDeformConv2D.from_config(config)
    assert clone.get_config() == config
    path = os.path.join(tmp, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.get_layer("deform")).__name__ == "PackedDeformConv2D"
    np.testing.assert_allclose(np.asarray(loaded.predict(x, verbose=0)), np.asarray(model.predict(x, verbose=0)),
                               rtol=1e-5, atol=1e-6)
    print("save/load round trip")


def _check_errors(keras):
    from dcn_cupy import keras as dck

    for kwargs, message in (({"padding": "same"}, "padding must be an int or a tuple of 2 ints"),
                            ({"data_format": "NHWC"}, "data_format must be None"),
                            ({"groups": 4}, "filters must be divisible by groups"),
                            ({"mask_activation": "relu"}, "mask_activation must be None")):
        try:
            dck.PackedDeformConv2D(6, 3, **kwargs)
        except ValueError as error:
            assert message in str(error), (kwargs, error)
        else:
            raise AssertionError(f"no error for {kwargs}")
    layer = dck.DeformConv2D(4, 3, offset_groups=2, data_format="channels_first")
    try:
        layer([np.zeros((1, 2, 6, 6), "float32"), np.zeros((1, 18, 4, 4), "float32")])
    except ValueError as error:
        assert "offset must have 36 channels (offset_groups=2" in str(error), error
    else:
        raise AssertionError("no error for offsets of the wrong offset_groups")
    print("argument errors")


def _main(tmp) -> int:
    import keras

    backend = keras.config.backend()
    if backend == "jax":
        import jax
        jax.config.update("jax_enable_x64", True)
    _check_errors(keras)
    _check_layers(keras, tmp)
    _check_training_and_saving(keras, tmp)
    print(f"backend {backend}: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
