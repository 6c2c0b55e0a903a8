"""The Keras layers: parameters, data format, serialisation; the computation is the adapters'."""

from __future__ import annotations

import math

import keras
from keras import ops

from . import _ops

__all__ = [
    "DeformConv1D", "DeformConv2D", "DeformConv3D",
    "DeformConvTranspose1D", "DeformConvTranspose2D", "DeformConvTranspose3D",
    "PackedDeformConv1D", "PackedDeformConv2D", "PackedDeformConv3D",
    "PackedDeformConvTranspose1D", "PackedDeformConvTranspose2D", "PackedDeformConvTranspose3D",
]

_PACKAGE = "dcn_cupy"


def _tuple(value, ndim: int, name: str, minimum: int) -> tuple:
    if isinstance(value, str):
        raise ValueError(f"{name} must be an int or a tuple of {ndim} ints, got the string {value!r}")
    if isinstance(value, (list, tuple)):
        if len(value) != ndim:
            raise ValueError(f"{name} must be an int or a tuple of {ndim} ints, got {tuple(value)}")
        result = tuple(int(v) for v in value)
    else:
        result = (int(value),) * ndim
    if any(v < minimum for v in result):
        raise ValueError(f"{name} must be >= {minimum} along every axis, got {result}")
    return result


def _data_format(value) -> str:
    value = keras.config.image_data_format() if value is None else str(value).lower()
    if value not in ("channels_last", "channels_first"):
        raise ValueError(f"data_format must be None, 'channels_last' or 'channels_first', got {value!r}")
    return value


class _DeformConvBase(keras.layers.Layer):
    """Parameters, data format and configuration shared by every layer here."""

    _ndim = 0
    _transposed = False
    _packed = False

    def __init__(self, filters, kernel_size, strides=1, padding=0, dilation_rate=1, groups=1, offset_groups=1,
                 mask_groups=1, use_bias=True, data_format=None, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None, bias_regularizer=None, kernel_constraint=None,
                 bias_constraint=None, **kwargs):
        super().__init__(**kwargs)
        n = self._ndim
        if int(filters) < 1:
            raise ValueError(f"filters must be a positive int, got {filters}")
        self.filters = int(filters)
        self.kernel_size = _tuple(kernel_size, n, "kernel_size", 1)
        self.strides = _tuple(strides, n, "strides", 1)
        self.padding = _tuple(padding, n, "padding", 0)
        self.dilation_rate = _tuple(dilation_rate, n, "dilation_rate", 1)
        for name, value in (("groups", groups), ("offset_groups", offset_groups), ("mask_groups", mask_groups)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.groups, self.offset_groups, self.mask_groups = int(groups), int(offset_groups), int(mask_groups)
        if self.filters % self.groups:
            raise ValueError(f"filters must be divisible by groups, got {self.filters} and groups={self.groups}")
        self.use_bias = bool(use_bias)
        self.data_format = _data_format(data_format)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)

    # -- shapes and layout ------------------------------------------------------------------

    @property
    def _taps(self) -> int:
        return math.prod(self.kernel_size)

    def _channels(self, shape) -> int:
        channels = shape[-1] if self.data_format == "channels_last" else shape[1]
        if channels is None:
            raise ValueError(f"{type(self).__name__} needs a known number of input channels, got shape {shape}")
        return int(channels)

    def _spatial(self, shape) -> list:
        return list(shape[1:-1]) if self.data_format == "channels_last" else list(shape[2:])

    def _output_spatial(self, spatial) -> list:
        out = []
        for a, s in enumerate(spatial):
            k, st, p, d = self.kernel_size[a], self.strides[a], self.padding[a], self.dilation_rate[a]
            if s is None:
                out.append(None)
            elif self._transposed:
                out.append((s - 1) * st - 2 * p + d * (k - 1) + 1 + self.output_padding[a])
            else:
                out.append((s + 2 * p - d * (k - 1) - 1) // st + 1)
        return out

    def _with_channels(self, batch, channels, spatial) -> tuple:
        if self.data_format == "channels_last":
            return (batch, *spatial, channels)
        return (batch, channels, *spatial)

    def _first(self, x):
        """channels_last -> channels_first (dcn_cupy's layout)."""
        if self.data_format == "channels_first":
            return x
        n = self._ndim
        return ops.transpose(x, (0, n + 1) + tuple(range(1, n + 1)))

    def _last(self, y):
        if self.data_format == "channels_first":
            return y
        n = self._ndim
        return ops.transpose(y, (0,) + tuple(range(2, n + 2)) + (1,))

    @staticmethod
    def _dcn_kernel(kernel, ndim: int):
        """Keras layout ``(*k, a, b)`` -> dcn_cupy's ``(b, a, *k)``."""
        return ops.transpose(kernel, (ndim + 1, ndim) + tuple(range(ndim)))

    # -- parameters -------------------------------------------------------------------------

    def _build_kernel(self, in_channels: int) -> None:
        if in_channels % self.groups:
            raise ValueError(f"the input's channels must be divisible by groups, got {in_channels} "
                             f"and groups={self.groups}")
        if self._transposed:  # Keras Conv{N}DTranspose's layout (*k, filters/groups, C_in)
            shape = self.kernel_size + (self.filters // self.groups, in_channels)
        else:                 # Keras Conv{N}D's layout (*k, C_in/groups, filters)
            shape = self.kernel_size + (in_channels // self.groups, self.filters)
        self.kernel = self.add_weight(name="kernel", shape=shape, initializer=self.kernel_initializer,
                                      regularizer=self.kernel_regularizer, constraint=self.kernel_constraint)
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(name="bias", shape=(self.filters,), initializer=self.bias_initializer,
                                        regularizer=self.bias_regularizer, constraint=self.bias_constraint)

    def _convolve(self, x, offset, mask):
        """x, offset, mask in channels_first; the deformable convolution with this layer's weights."""
        params = dict(stride=self.strides, padding=self.padding, dilation=self.dilation_rate, groups=self.groups)
        if self._transposed:
            params["output_padding"] = self.output_padding
        bias = None if self.bias is None else ops.convert_to_tensor(self.bias, dtype=x.dtype)
        weight = ops.cast(self._dcn_kernel(self.kernel, self._ndim), x.dtype)
        return _ops.deform_conv(self._ndim, self._transposed, x, weight, offset, mask, bias, **params)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            filters=self.filters, kernel_size=self.kernel_size, strides=self.strides, padding=self.padding,
            dilation_rate=self.dilation_rate, groups=self.groups, offset_groups=self.offset_groups,
            mask_groups=self.mask_groups, use_bias=self.use_bias, data_format=self.data_format,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
            kernel_regularizer=keras.regularizers.serialize(self.kernel_regularizer),
            bias_regularizer=keras.regularizers.serialize(self.bias_regularizer),
            kernel_constraint=keras.constraints.serialize(self.kernel_constraint),
            bias_constraint=keras.constraints.serialize(self.bias_constraint),
        )
        if self._transposed:
            config["output_padding"] = self.output_padding
        return config


class _TransposeMixin:
    """``output_padding``, checked as torch's ConvTranspose does."""

    _transposed = True

    def _set_output_padding(self, output_padding) -> None:
        self.output_padding = _tuple(output_padding, self._ndim, "output_padding", 0)
        for a in range(self._ndim):
            if self.output_padding[a] >= max(self.strides[a], self.dilation_rate[a]):
                raise ValueError(
                    f"output_padding must be smaller than max(strides, dilation_rate) along every axis, got "
                    f"output_padding={self.output_padding}, strides={self.strides}, "
                    f"dilation_rate={self.dilation_rate}")


# ---------------------------------------------------------------------------------------------
# offsets and masks given as inputs


class _DeformConv(_DeformConvBase):
    """``layer(x)``, ``layer([x, offset])`` or ``layer([x, offset, mask])``; offset and mask in
    the layer's data format: ``(B, *grid, G_o*K*N)`` / ``(B, *grid, G_m*K)`` channels_last,
    where the grid is the output grid (the input grid for a transposed layer)."""

    @staticmethod
    def _split(inputs):
        if isinstance(inputs, (list, tuple)):
            if not 1 <= len(inputs) <= 3:
                raise ValueError(f"inputs must be x, [x], [x, offset] or [x, offset, mask], got {len(inputs)} "
                                 f"tensors")
            parts = list(inputs) + [None] * (3 - len(inputs))
            return parts[0], parts[1], parts[2]
        return inputs, None, None

    def build(self, input_shape):
        nested = isinstance(input_shape, (list, tuple)) and isinstance(input_shape[0], (list, tuple))
        shapes = list(input_shape) if nested else [input_shape]
        self._build_kernel(self._channels(shapes[0]))
        # offsets and masks given as inputs must have the channels offset_groups/mask_groups say
        n, K = self._ndim, self._taps
        for name, shape, expected in (("offset", shapes[1] if len(shapes) > 1 else None, n * K * self.offset_groups),
                                      ("mask", shapes[2] if len(shapes) > 2 else None, K * self.mask_groups)):
            if shape is not None and self._channels(shape) != expected:
                groups = "offset_groups" if name == "offset" else "mask_groups"
                raise ValueError(f"{name} must have {expected} channels ({groups}={getattr(self, groups)}, "
                                 f"kernel_size={self.kernel_size}), got {self._channels(shape)}")

    def compute_output_shape(self, input_shape):
        x_shape = input_shape[0] if isinstance(input_shape, (list, tuple)) and isinstance(
            input_shape[0], (list, tuple)) else input_shape
        return self._with_channels(x_shape[0], self.filters, self._output_spatial(self._spatial(x_shape)))

    def call(self, inputs):
        x, offset, mask = self._split(inputs)
        offset = None if offset is None else self._first(offset)
        mask = None if mask is None else self._first(mask)
        return self._last(self._convolve(self._first(x), offset, mask))


class _DeformConvTranspose(_TransposeMixin, _DeformConv):
    def __init__(self, filters, kernel_size, strides=1, padding=0, dilation_rate=1, groups=1, offset_groups=1,
                 mask_groups=1, use_bias=True, data_format=None, output_padding=0, **kwargs):
        super().__init__(filters, kernel_size, strides, padding, dilation_rate, groups, offset_groups, mask_groups,
                         use_bias, data_format, **kwargs)
        self._set_output_padding(output_padding)


# ---------------------------------------------------------------------------------------------
# packed: offsets and masks predicted from the input


_MASK_ACTIVATIONS = (None, "sigmoid", "softmax")


class _PackedMixin:
    """Inner zero-initialised convolutions predict offsets (and, when ``modulated``, masks)."""

    _packed = True

    def _set_packing(self, modulated, mask_activation) -> None:
        if isinstance(mask_activation, str) and mask_activation.lower() == "none":
            mask_activation = None
        if isinstance(mask_activation, str):
            mask_activation = mask_activation.lower()
        if mask_activation not in _MASK_ACTIVATIONS:
            raise ValueError(f"mask_activation must be None, 'sigmoid' or 'softmax', got {mask_activation!r}")
        self.modulated = bool(modulated)
        self.mask_activation = mask_activation

    def _predictor_params(self) -> dict:
        if self._transposed:  # offsets and masks live on the input grid: 1x1 predictors
            return dict(kernel=(1,) * self._ndim, stride=1, padding=0, dilation=1)
        # the same windows as the deformable convolution: the predictions are on its output grid
        return dict(kernel=self.kernel_size, stride=self.strides, padding=self.padding, dilation=self.dilation_rate)

    def build(self, input_shape):
        in_channels = self._channels(input_shape)
        self._build_kernel(in_channels)
        split = self.filters if self._transposed else in_channels
        for name in ("offset_groups", "mask_groups"):
            if split % getattr(self, name):
                raise ValueError(f"{'filters' if self._transposed else 'the input channels'} must be divisible "
                                 f"by {name}, got {split} and {name}={getattr(self, name)}")
        kernel = self._predictor_params()["kernel"]
        n, K = self._ndim, self._taps
        self.offset_kernel = self.add_weight(name="offset_kernel", shape=kernel + (in_channels, n * K * self.offset_groups),
                                             initializer="zeros")
        self.offset_bias = self.add_weight(name="offset_bias", shape=(n * K * self.offset_groups,), initializer="zeros")
        self.mask_kernel = self.mask_bias = None
        if self.modulated:
            self.mask_kernel = self.add_weight(name="mask_kernel", shape=kernel + (in_channels, K * self.mask_groups),
                                               initializer="zeros")
            self.mask_bias = self.add_weight(name="mask_bias", shape=(K * self.mask_groups,), initializer="zeros")

    def compute_output_shape(self, input_shape):
        return self._with_channels(input_shape[0], self.filters, self._output_spatial(self._spatial(input_shape)))

    def _predict(self, x, kernel, bias):
        p = self._predictor_params()
        weight = ops.cast(self._dcn_kernel(kernel, self._ndim), x.dtype)
        return _ops.deform_conv(self._ndim, False, x, weight, None, None, ops.cast(bias, x.dtype),
                                stride=p["stride"], padding=p["padding"], dilation=p["dilation"], groups=1)

    def call(self, inputs):
        x = self._first(inputs)
        offset = self._predict(x, self.offset_kernel, self.offset_bias)
        mask = None
        if self.modulated:
            mask = self._predict(x, self.mask_kernel, self.mask_bias)
            if self.mask_activation is not None:
                mask = _ops.mask_activation(self.mask_activation, self._ndim, mask, self.kernel_size)
        return self._last(self._convolve(x, offset, mask))

    def _packing_config(self) -> dict:
        return dict(modulated=self.modulated, mask_activation=self.mask_activation)


class _PackedDeformConv(_PackedMixin, _DeformConvBase):
    def __init__(self, filters, kernel_size, strides=1, padding=0, dilation_rate=1, groups=1, offset_groups=1,
                 mask_groups=1, use_bias=True, data_format=None, modulated=True, mask_activation="softmax",
                 **kwargs):
        super().__init__(filters, kernel_size, strides, padding, dilation_rate, groups, offset_groups, mask_groups,
                         use_bias, data_format, **kwargs)
        self._set_packing(modulated, mask_activation)

    def get_config(self) -> dict:
        return {**super().get_config(), **self._packing_config()}


class _PackedDeformConvTranspose(_PackedMixin, _TransposeMixin, _DeformConvBase):
    def __init__(self, filters, kernel_size, strides=1, padding=0, dilation_rate=1, groups=1, offset_groups=1,
                 mask_groups=1, use_bias=True, data_format=None, output_padding=0, modulated=True,
                 mask_activation="sigmoid", **kwargs):
        super().__init__(filters, kernel_size, strides, padding, dilation_rate, groups, offset_groups, mask_groups,
                         use_bias, data_format, **kwargs)
        self._set_output_padding(output_padding)
        self._set_packing(modulated, mask_activation)

    def get_config(self) -> dict:
        return {**super().get_config(), **self._packing_config()}


# ---------------------------------------------------------------------------------------------
# the public classes


_DOCS = {
    _DeformConv: """{n}D deformable convolution layer: ``layer(x)``, ``layer([x, offset])`` or
``layer([x, offset, mask])``.

Arguments: ``filters, kernel_size, strides=1, padding=0, dilation_rate=1, groups=1,
offset_groups=1, mask_groups=1, use_bias=True, data_format=None`` and Keras's
``kernel_initializer``, ``bias_initializer``, ``*_regularizer``, ``*_constraint``. ``padding`` is
an int or a tuple of {n} ints (zeros on both sides). Offsets ``(B, *Q, G_o*K*{n})`` and masks
``(B, *Q, G_m*K)`` in channels_last (channels first in channels_first), ``K = prod(kernel_size)``;
offset channel ``(g*K + t)*{n} + a`` shifts tap ``t`` of group ``g`` along spatial axis ``a``.
The kernel has Keras's layout ``(*kernel_size, C_in/groups, filters)``.""",
    _DeformConvTranspose: """{n}D transposed deformable convolution layer (the adjoint of
``DeformConv{n}D``): ``layer(x)``, ``layer([x, offset])`` or ``layer([x, offset, mask])``, with
offsets and masks on the input grid.

Arguments as ``DeformConv{n}D`` plus ``output_padding=0``; the kernel has Keras's transposed
layout ``(*kernel_size, filters/groups, C_in)``.""",
    _PackedDeformConv: """Packed {n}D deformable convolution: offsets (and, when ``modulated``, masks)
are predicted from the input by inner convolutions with the layer's kernel size, strides, padding
and dilation, zero-initialised (so the layer starts as a plain convolution, with the mask at the
activation of 0). ``layer(x)``.

Arguments as ``DeformConv{n}D`` plus ``modulated=True, mask_activation="softmax"`` (None,
``"sigmoid"`` or ``"softmax"`` over each mask group's K taps).""",
    _PackedDeformConvTranspose: """Packed {n}D transposed deformable convolution: offsets (and, when
``modulated``, masks) on the input grid are predicted by inner 1x1 convolutions, zero-initialised.
``layer(x)``.

Arguments as ``DeformConvTranspose{n}D`` plus ``modulated=True, mask_activation="sigmoid"``.""",
}


def _public(base, prefix: str, ndim: int):
    name = f"{prefix}{ndim}D"
    cls = type(name, (base,), {"_ndim": ndim, "__doc__": _DOCS[base].format(n=ndim), "__module__": "dcn_cupy.keras"})
    return keras.saving.register_keras_serializable(package=_PACKAGE, name=name)(cls)


DeformConv1D, DeformConv2D, DeformConv3D = (_public(_DeformConv, "DeformConv", n) for n in (1, 2, 3))
DeformConvTranspose1D, DeformConvTranspose2D, DeformConvTranspose3D = (
    _public(_DeformConvTranspose, "DeformConvTranspose", n) for n in (1, 2, 3))
PackedDeformConv1D, PackedDeformConv2D, PackedDeformConv3D = (
    _public(_PackedDeformConv, "PackedDeformConv", n) for n in (1, 2, 3))
PackedDeformConvTranspose1D, PackedDeformConvTranspose2D, PackedDeformConvTranspose3D = (
    _public(_PackedDeformConvTranspose, "PackedDeformConvTranspose", n) for n in (1, 2, 3))
