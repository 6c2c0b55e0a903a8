"""PyTorch adapter: autograd, ``torch.compile`` and CUDA-graph support, functional forms and ``nn.Module``\\ s.

Every operation and its backward are registered as ``torch.library.custom_op``\\ s in the
``dcn_cupy`` namespace (``torch.ops.dcn_cupy.*``), with fake (meta) kernels, so that
``torch.compile`` traces forward and backward graphs through them; eager calls run the same
implementation as a ``torch.autograd.Function``, without the custom-op dispatcher's host time.
Each configuration has a plan (:func:`dcn_cupy.plan`), run on views of the tensors (no DLPack):

* outputs, gradients and workspaces are allocated by torch's caching allocator on the tensor's
  device, so ``torch.cuda.memory_allocated`` counts them and CUDA graphs keep them in their pool;
* CUDA kernels run on torch's current stream of the tensor's device and never synchronise
  with the host: the ops can be captured by ``torch.cuda.graph`` and
  ``torch.compile(mode="reduce-overhead")`` (kernels are compiled when a configuration is first
  met, i.e. in the warm-up before a capture);
* float32 GEMMs use TF32 exactly when ``torch.backends.cuda.matmul.allow_tf32`` is set, and
  ``torch.use_deterministic_algorithms(True)`` asks the plans for deterministic algorithms.

Functional forms keep the core's argument order::

    y = dcn_cupy.torch.deform_conv2d(x, weight, offset, mask, bias, stride=1, padding=1)

Modules follow tvdcn's constructors: ``DeformConv2d(in, out, kernel_size, ...)`` takes
``forward(input, offset=None, mask=None)``; ``PackedDeformConv2d`` predicts offset (and,
when ``modulated``, mask) with inner zero-initialised convolutions: ``forward(input)``.

Under ``torch.autocast`` the floating-point float32 arguments are cast to the autocast dtype,
as autocast does for ``torch.nn.functional.conv2d``. Double backward is not supported.

Layout: :mod:`._ops` (custom ops, fake kernels, autograd), :mod:`._plans` (a plan per
configuration), :mod:`._runtime` (zero-copy views, stream, allocator, TF32), :mod:`.functional`
and :mod:`.modules`. This package is imported explicitly (``import dcn_cupy.torch``);
``import dcn_cupy`` never imports PyTorch.
"""

from .functional import (
    deform_conv,
    deform_conv1d,
    deform_conv2d,
    deform_conv3d,
    deform_conv_transpose,
    deform_conv_transpose1d,
    deform_conv_transpose2d,
    deform_conv_transpose3d,
    mask_sigmoid,
    mask_softmax,
    mask_softmax1d,
    mask_softmax2d,
    mask_softmax3d,
)
from .modules import (
    DeformConv1d,
    DeformConv2d,
    DeformConv3d,
    DeformConvTranspose1d,
    DeformConvTranspose2d,
    DeformConvTranspose3d,
    MaskSigmoid,
    MaskSoftmax1d,
    MaskSoftmax2d,
    MaskSoftmax3d,
    PackedDeformConv1d,
    PackedDeformConv2d,
    PackedDeformConv3d,
    PackedDeformConvTranspose1d,
    PackedDeformConvTranspose2d,
    PackedDeformConvTranspose3d,
)

__all__ = [
    "deform_conv", "deform_conv1d", "deform_conv2d", "deform_conv3d",
    "deform_conv_transpose", "deform_conv_transpose1d", "deform_conv_transpose2d", "deform_conv_transpose3d",
    "mask_softmax", "mask_softmax1d", "mask_softmax2d", "mask_softmax3d", "mask_sigmoid",
    "DeformConv1d", "DeformConv2d", "DeformConv3d",
    "DeformConvTranspose1d", "DeformConvTranspose2d", "DeformConvTranspose3d",
    "PackedDeformConv1d", "PackedDeformConv2d", "PackedDeformConv3d",
    "PackedDeformConvTranspose1d", "PackedDeformConvTranspose2d", "PackedDeformConvTranspose3d",
    "MaskSoftmax1d", "MaskSoftmax2d", "MaskSoftmax3d", "MaskSigmoid",
]
