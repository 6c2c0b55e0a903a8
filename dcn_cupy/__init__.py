"""dcn_cupy: framework-neutral deformable convolutions for NumPy, CuPy, PyTorch and JAX arrays.

Every operation has an explicit forward and backward function; arrays from any library that
speaks DLPack go in and come back in their own library, on their own device. A ``plan``
validates one configuration once and runs it with microseconds of host time per call.
"""

from ._api import (  # noqa: F401  (generated in _api)
    Gradients,
    deform_conv,
    deform_conv1d,
    deform_conv1d_backward,
    deform_conv2d,
    deform_conv2d_backward,
    deform_conv3d,
    deform_conv3d_backward,
    deform_conv_backward,
    deform_conv_transpose,
    deform_conv_transpose1d,
    deform_conv_transpose1d_backward,
    deform_conv_transpose2d,
    deform_conv_transpose2d_backward,
    deform_conv_transpose3d,
    deform_conv_transpose3d_backward,
    deform_conv_transpose_backward,
    mask_sigmoid,
    mask_sigmoid_backward,
    mask_softmax,
    mask_softmax1d,
    mask_softmax2d,
    mask_softmax3d,
    mask_softmax_backward,
)
from ._plan import Plan, plan

__version__ = "0.1.0"

__all__ = [
    "Gradients", "Plan", "plan",
    "deform_conv", "deform_conv1d", "deform_conv2d", "deform_conv3d",
    "deform_conv_backward", "deform_conv1d_backward", "deform_conv2d_backward", "deform_conv3d_backward",
    "deform_conv_transpose", "deform_conv_transpose1d", "deform_conv_transpose2d", "deform_conv_transpose3d",
    "deform_conv_transpose_backward", "deform_conv_transpose1d_backward",
    "deform_conv_transpose2d_backward", "deform_conv_transpose3d_backward",
    "mask_softmax", "mask_softmax1d", "mask_softmax2d", "mask_softmax3d", "mask_softmax_backward",
    "mask_sigmoid", "mask_sigmoid_backward",
]
