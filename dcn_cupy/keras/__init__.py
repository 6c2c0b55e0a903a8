"""Keras 3 layers of deformable convolutions, on the TensorFlow, JAX and PyTorch backends.

``DeformConv{1,2,3}D`` and ``DeformConvTranspose{1,2,3}D`` take the offsets (and masks) as
inputs; ``PackedDeformConv{1,2,3}D`` and ``PackedDeformConvTranspose{1,2,3}D`` predict them from
their input with inner zero-initialised convolutions, as tvdcn's packed modules do. They are
built like Keras convolutions::

    import keras
    from dcn_cupy.keras import PackedDeformConv2D

    model = keras.Sequential([keras.Input((28, 28, 1)),
                              PackedDeformConv2D(16, 3, padding=1, mask_activation="sigmoid"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])

``data_format=None`` follows ``keras.config.image_data_format()`` ("channels_last" by default).
The layers compute through :mod:`dcn_cupy.tensorflow`, :mod:`dcn_cupy.jax` or
:mod:`dcn_cupy.torch`, whichever matches ``keras.config.backend()``, and survive
``model.save`` / ``keras.models.load_model``.
"""

from ._layers import (
    DeformConv1D,
    DeformConv2D,
    DeformConv3D,
    DeformConvTranspose1D,
    DeformConvTranspose2D,
    DeformConvTranspose3D,
    PackedDeformConv1D,
    PackedDeformConv2D,
    PackedDeformConv3D,
    PackedDeformConvTranspose1D,
    PackedDeformConvTranspose2D,
    PackedDeformConvTranspose3D,
)

__all__ = [
    "DeformConv1D", "DeformConv2D", "DeformConv3D",
    "DeformConvTranspose1D", "DeformConvTranspose2D", "DeformConvTranspose3D",
    "PackedDeformConv1D", "PackedDeformConv2D", "PackedDeformConv3D",
    "PackedDeformConvTranspose1D", "PackedDeformConvTranspose2D", "PackedDeformConvTranspose3D",
]
