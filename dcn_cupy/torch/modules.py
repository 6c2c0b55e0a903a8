"""The ``nn.Module``\\ s: mask activations, deformable convolutions, their transposes and the
packed forms that predict offset and mask with inner convolutions (tvdcn's constructors).

``DeformConv2d(in, out, kernel_size, ...)`` takes ``forward(input, offset=None, mask=None)``;
``PackedDeformConv2d`` predicts offset (and, when ``modulated``, mask) with inner
zero-initialised convolutions: ``forward(input)``.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _api, _geometry
from .functional import _deform_conv, _deform_conv_transpose, _mask_softmax, mask_sigmoid

__all__ = [
    "DeformConv1d", "DeformConv2d", "DeformConv3d",
    "DeformConvTranspose1d", "DeformConvTranspose2d", "DeformConvTranspose3d",
    "PackedDeformConv1d", "PackedDeformConv2d", "PackedDeformConv3d",
    "PackedDeformConvTranspose1d", "PackedDeformConvTranspose2d", "PackedDeformConvTranspose3d",
    "MaskSoftmax1d", "MaskSoftmax2d", "MaskSoftmax3d", "MaskSigmoid",
]


# ---------------------------------------------------------------------------------------------
# activation modules


class _MaskSoftmaxNd(nn.Module):
    _ndim = 0

    def __init__(self, kernel_size) -> None:
        super().__init__()
        self.kernel_size = _geometry.normalise_kernel_size(kernel_size, self._ndim)

    def forward(self, mask: Tensor) -> Tensor:
        return _mask_softmax(self._ndim, mask, self.kernel_size)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}"


class MaskSoftmax1d(_MaskSoftmaxNd):
    """Module form of :func:`mask_softmax1d`."""
    _ndim = 1


class MaskSoftmax2d(_MaskSoftmaxNd):
    """Module form of :func:`mask_softmax2d`."""
    _ndim = 2


class MaskSoftmax3d(_MaskSoftmaxNd):
    """Module form of :func:`mask_softmax3d`."""
    _ndim = 3


class MaskSigmoid(nn.Module):
    """Module form of :func:`mask_sigmoid`: ``scale * sigmoid(mask)``.

    ``scale=1`` is the plain sigmoid of DCNv2 (0.5 at zero); ``scale=2`` gives 1 at zero, so a
    zero-initialised mask predictor starts as an unmodulated convolution.
    """

    def __init__(self, scale: float = 2.0) -> None:
        super().__init__()
        self.scale = _api._check_scale(scale)

    def forward(self, mask: Tensor) -> Tensor:
        return mask_sigmoid(mask, self.scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


# ---------------------------------------------------------------------------------------------
# convolution modules


_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _tuple(value, ndim: int, name: str, minimum: int) -> Tuple[int, ...]:
    return _geometry.fix_sequence_arg(value, ndim, name, minimum)


class _DeformConvNd(nn.Module):
    """Parameters, initialisation and repr shared by every convolution module."""

    _ndim = 0
    _transposed = False

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride, padding, dilation,
                 output_padding, groups: int, bias: bool, padding_mode: str, device=None, dtype=None) -> None:
        super().__init__()
        n = self._ndim
        groups = _geometry.check_groups(groups)
        if in_channels < 1 or out_channels < 1:
            raise ValueError(f"in_channels and out_channels must be positive, got {in_channels} and {out_channels}")
        if in_channels % groups:
            raise ValueError(f"in_channels must be divisible by groups, got {in_channels} and groups={groups}")
        if out_channels % groups:
            raise ValueError(f"out_channels must be divisible by groups, got {out_channels} and groups={groups}")
        if isinstance(padding, str):
            raise ValueError(f"padding must be an int or a tuple of {n} ints, got the string {padding!r}")
        if padding_mode not in _PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {_PADDING_MODES}, got {padding_mode!r}")
        if self._transposed and padding_mode != "zeros":
            raise ValueError(f"only 'zeros' padding_mode is supported for {type(self).__name__}, got {padding_mode!r}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = _tuple(kernel_size, n, "kernel_size", 1)
        self.stride = _tuple(stride, n, "stride", 1)
        self.padding = _tuple(padding, n, "padding", 0)
        self.dilation = _tuple(dilation, n, "dilation", 1)
        self.output_padding = _tuple(output_padding, n, "output_padding", 0)
        for a in range(n):
            if self.output_padding[a] >= max(self.stride[a], self.dilation[a]):
                raise ValueError(
                    f"output_padding must be smaller than max(stride, dilation) along every axis, got "
                    f"output_padding={self.output_padding}, stride={self.stride}, dilation={self.dilation}")
        self.groups = groups
        self.padding_mode = padding_mode
        self._reversed_padding_repeated_twice = tuple(p for p in reversed(self.padding) for _ in range(2))
        factory = {"device": device, "dtype": dtype}
        if self._transposed:
            shape = (in_channels, out_channels // groups) + self.kernel_size
        else:
            shape = (out_channels, in_channels // groups) + self.kernel_size
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        self.bias = nn.Parameter(torch.empty(out_channels, **factory)) if bias else None
        self._reset_own_parameters()

    def _reset_own_parameters(self) -> None:
        # As torch.nn.ConvNd / ConvTransposeNd.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.weight)
            if fan_in != 0:
                bound = 1 / math.sqrt(fan_in)
                nn.init.uniform_(self.bias, -bound, bound)

    def reset_parameters(self) -> None:
        self._reset_own_parameters()

    def extra_repr(self) -> str:
        n = self._ndim
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0,) * n:
            s += f", padding={self.padding}"
        if self.dilation != (1,) * n:
            s += f", dilation={self.dilation}"
        if self.output_padding != (0,) * n:
            s += f", output_padding={self.output_padding}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if getattr(self, "offset_groups", 1) != 1:
            s += f", offset_groups={self.offset_groups}"
        if getattr(self, "mask_groups", 1) != 1:
            s += f", mask_groups={self.mask_groups}"
        if self.bias is None:
            s += ", bias=False"
        if not getattr(self, "deformable", True):
            s += ", deformable=False"
        if getattr(self, "modulated", False):
            s += ", modulated=True"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode!r}"
        return s


class _DeformConvBase(_DeformConvNd):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", device=None, dtype=None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, 0, groups, bias,
                         padding_mode, device, dtype)

    def _conv_forward(self, input: Tensor, offset: Optional[Tensor], mask: Optional[Tensor]) -> Tensor:
        padding = self.padding
        if self.padding_mode != "zeros":
            input = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0
        return _deform_conv(self._ndim, input, self.weight, offset, mask, self.bias, self.stride, padding,
                            self.dilation, self.groups)

    def forward(self, input: Tensor, offset: Optional[Tensor] = None, mask: Optional[Tensor] = None) -> Tensor:
        """``input`` ``(B, C_in, *S)``; ``offset`` ``(B, G_o*K*N, *Q)``; ``mask`` ``(B, G_m*K, *Q)``."""
        return self._conv_forward(input, offset, mask)


class _DeformConvTransposeBase(_DeformConvNd):
    _transposed = True

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 output_padding=0, groups=1, bias=True, padding_mode="zeros", device=None, dtype=None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, output_padding,
                         groups, bias, padding_mode, device, dtype)

    def _output_padding(self, input: Tensor, output_size) -> Tuple[int, ...]:
        if output_size is None:
            return self.output_padding
        n = self._ndim
        output_size = tuple(int(s) for s in output_size)
        if len(output_size) == input.dim():  # includes batch/channel dims
            output_size = output_size[-n:]
        if len(output_size) != n:
            raise ValueError(f"output_size must have {n} or {input.dim()} elements, got {len(output_size)}")
        result = []
        for a in range(n):
            smallest = _geometry.conv_transpose_output_size(
                input.shape[input.dim() - n + a], self.kernel_size[a], self.stride[a], self.padding[a],
                self.dilation[a], 0)
            largest = smallest + max(self.stride[a], self.dilation[a]) - 1
            if not smallest <= output_size[a] <= largest:
                raise ValueError(f"requested an output size of {output_size}, but valid sizes along axis {a} "
                                 f"range from {smallest} to {largest} (for an input of {tuple(input.shape)})")
            result.append(output_size[a] - smallest)
        return tuple(result)

    def _conv_forward(self, input: Tensor, offset: Optional[Tensor], mask: Optional[Tensor],
                      output_size=None) -> Tensor:
        return _deform_conv_transpose(self._ndim, input, self.weight, offset, mask, self.bias, self.stride,
                                      self.padding, self._output_padding(input, output_size), self.dilation,
                                      self.groups)

    def forward(self, input: Tensor, offset: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                output_size: Optional[Sequence[int]] = None) -> Tensor:
        """``input`` ``(B, C_in, *S)``; ``offset`` ``(B, G_o*K*N, *S)``; ``mask`` ``(B, G_m*K, *S)``
        (both on the input grid); ``output_size`` picks ``output_padding`` as in torch."""
        return self._conv_forward(input, offset, mask, output_size)


class DeformConv1d(_DeformConvBase):
    """1D deformable convolution layer: ``forward(input, offset=None, mask=None)``.

    Arguments as :class:`torch.nn.Conv1d` (``in_channels, out_channels, kernel_size, stride=1,
    padding=0, dilation=1, groups=1, bias=True, padding_mode='zeros', device=None, dtype=None``).
    """
    _ndim = 1


class DeformConv2d(_DeformConvBase):
    """2D deformable convolution layer: ``forward(input, offset=None, mask=None)``.

    Arguments as :class:`torch.nn.Conv2d`; offset ``(B, 2*G_o*K, H_out, W_out)`` in ``(dy, dx)``
    pairs and mask ``(B, G_m*K, H_out, W_out)``, as torchvision's.
    """
    _ndim = 2


class DeformConv3d(_DeformConvBase):
    """3D deformable convolution layer: ``forward(input, offset=None, mask=None)``."""
    _ndim = 3


class DeformConvTranspose1d(_DeformConvTransposeBase):
    """1D transposed deformable convolution layer (the adjoint of :class:`DeformConv1d`).

    Arguments in tvdcn's order: ``in_channels, out_channels, kernel_size, stride=1, padding=0,
    dilation=1, output_padding=0, groups=1, bias=True, padding_mode='zeros', device, dtype``;
    ``forward(input, offset=None, mask=None, output_size=None)``.
    """
    _ndim = 1


class DeformConvTranspose2d(_DeformConvTransposeBase):
    """2D transposed deformable convolution layer; see :class:`DeformConvTranspose1d`."""
    _ndim = 2


class DeformConvTranspose3d(_DeformConvTransposeBase):
    """3D transposed deformable convolution layer; see :class:`DeformConvTranspose1d`."""
    _ndim = 3


# ---------------------------------------------------------------------------------------------
# packed modules: offset and mask predicted from the input by inner convolutions


_CONV_CLASSES = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_SOFTMAX_CLASSES = {1: MaskSoftmax1d, 2: MaskSoftmax2d, 3: MaskSoftmax3d}


def _mask_activation_module(activation, ndim: int, kernel_size) -> Optional[Callable]:
    if activation is None or (isinstance(activation, str) and activation.lower() == "none"):
        return None
    if isinstance(activation, str):
        name = activation.lower()
        if name == "sigmoid":
            return MaskSigmoid(scale=1.0)  # tvdcn: torch.sigmoid, 0.5 at zero
        if name == "softmax":
            return _SOFTMAX_CLASSES[ndim](kernel_size)
        raise ValueError(
            f"mask_activation must be None, 'none', 'sigmoid', 'softmax' or a callable, got {activation!r}")
    if not callable(activation):
        raise TypeError(f"mask_activation must be None, a string or a callable, got {type(activation).__name__}")
    return activation


def _offset_activation(activation) -> Optional[Callable]:
    if activation is None or (isinstance(activation, str) and activation.lower() == "none"):
        return None
    if isinstance(activation, str):
        raise ValueError(f"offset_activation must be None, 'none' or a callable, got {activation!r}")
    if not callable(activation):
        raise TypeError(f"offset_activation must be None or a callable, got {type(activation).__name__}")
    return activation


class _PackedMixin:
    """Builds ``conv_offset`` / ``conv_mask`` and zero-initialises them."""

    def _build_predictors(self, offset_groups, mask_groups, deformable, modulated, offset_activation,
                          mask_activation, conv_kwargs, device, dtype) -> None:
        n, K = self._ndim, math.prod(self.kernel_size)
        split = self.out_channels if self._transposed else self.in_channels
        split_name = "out_channels" if self._transposed else "in_channels"
        offset_groups = _geometry._as_int(offset_groups, "offset_groups")
        mask_groups = _geometry._as_int(mask_groups, "mask_groups")
        for name, value in (("offset_groups", offset_groups), ("mask_groups", mask_groups)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
            if split % value:
                raise ValueError(f"{split_name} must be divisible by {name}, got {split} and {name}={value}")
        self.offset_groups = offset_groups
        self.mask_groups = mask_groups
        self.deformable = bool(deformable)
        self.modulated = bool(modulated)
        conv = _CONV_CLASSES[n]
        factory = {"device": device, "dtype": dtype}
        if self.deformable:
            self.conv_offset = conv(self.in_channels, n * K * offset_groups, bias=True, **conv_kwargs, **factory)
        else:
            self.register_module("conv_offset", None)
        if self.modulated:
            self.conv_mask = conv(self.in_channels, K * mask_groups, bias=True, **conv_kwargs, **factory)
        else:
            self.register_module("conv_mask", None)
        self.offset_activation = _offset_activation(offset_activation)
        self.mask_activation = _mask_activation_module(mask_activation, n, self.kernel_size)
        self._reset_predictors()

    def _reset_predictors(self) -> None:
        for layer in (self.conv_offset, self.conv_mask):
            if layer is not None:
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)

    def reset_parameters(self) -> None:
        self._reset_own_parameters()
        if hasattr(self, "conv_offset"):
            self._reset_predictors()

    def _predict(self, input: Tensor):
        offset = mask = None
        if self.conv_offset is not None:
            offset = self.conv_offset(input)
            if self.offset_activation is not None:
                offset = self.offset_activation(offset)
        if self.conv_mask is not None:
            mask = self.conv_mask(input)
            if self.mask_activation is not None:
                mask = self.mask_activation(mask)
        return offset, mask


class _PackedDeformConvBase(_PackedMixin, _DeformConvBase):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 offset_groups=1, mask_groups=1, bias=True, deformable=True, modulated=False,
                 offset_activation=None, mask_activation="softmax", padding_mode="zeros", device=None,
                 dtype=None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, device, dtype)
        # The predictors see the same windows as the deformable convolution: their output is on Q.
        conv_kwargs = dict(kernel_size=self.kernel_size, stride=self.stride, padding=self.padding,
                           dilation=self.dilation, padding_mode=padding_mode)
        self._build_predictors(offset_groups, mask_groups, deformable, modulated, offset_activation,
                               mask_activation, conv_kwargs, device, dtype)

    def forward(self, input: Tensor) -> Tensor:
        offset, mask = self._predict(input)
        return self._conv_forward(input, offset, mask)


class _PackedDeformConvTransposeBase(_PackedMixin, _DeformConvTransposeBase):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 output_padding=0, groups=1, offset_groups=1, mask_groups=1, bias=True, deformable=True,
                 modulated=False, offset_activation=None, mask_activation="sigmoid", padding_mode="zeros",
                 device=None, dtype=None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, output_padding,
                         groups, bias, padding_mode, device, dtype)
        # Offsets and masks of a transposed convolution live on the input grid: 1x1 predictors.
        self._build_predictors(offset_groups, mask_groups, deformable, modulated, offset_activation,
                               mask_activation, dict(kernel_size=1), device, dtype)

    def forward(self, input: Tensor, output_size: Optional[Sequence[int]] = None) -> Tensor:
        offset, mask = self._predict(input)
        return self._conv_forward(input, offset, mask, output_size)


_PACKED_DOC = """Packed {n}D deformable convolution: offsets (and, when ``modulated``, masks) are
predicted from the input by inner ``nn.Conv{n}d`` layers ``conv_offset`` / ``conv_mask`` with the
layer's kernel size, stride, padding and dilation, zero-initialised (at initialisation offsets are
0 and the mask is the activation of 0: 1/K for ``'softmax'``, 0.5 for ``'sigmoid'``).

Arguments (tvdcn's): ``in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
groups=1, offset_groups=1, mask_groups=1, bias=True, deformable=True, modulated=False,
offset_activation=None, mask_activation='softmax', padding_mode='zeros', device=None,
dtype=None``. ``mask_activation`` is None/'none', 'sigmoid' (``torch.sigmoid``), 'softmax'
(over the K taps of each mask group) or any callable, e.g. ``MaskSigmoid(scale=2.0)``.
``forward(input)``.
"""

_PACKED_TRANSPOSE_DOC = """Packed {n}D transposed deformable convolution: offsets (and, when
``modulated``, masks) on the input grid are predicted by inner 1x1 ``nn.Conv{n}d`` layers
``conv_offset`` / ``conv_mask``, zero-initialised.

Arguments (tvdcn's order): ``in_channels, out_channels, kernel_size, stride=1, padding=0,
dilation=1, output_padding=0, groups=1, offset_groups=1, mask_groups=1, bias=True,
deformable=True, modulated=False, offset_activation=None, mask_activation='sigmoid',
padding_mode='zeros', device=None, dtype=None``. Offset and mask groups partition the output
channels. ``forward(input, output_size=None)``.
"""


class PackedDeformConv1d(_PackedDeformConvBase, DeformConv1d):
    __doc__ = _PACKED_DOC.format(n=1)
    _ndim = 1


class PackedDeformConv2d(_PackedDeformConvBase, DeformConv2d):
    __doc__ = _PACKED_DOC.format(n=2)
    _ndim = 2


class PackedDeformConv3d(_PackedDeformConvBase, DeformConv3d):
    __doc__ = _PACKED_DOC.format(n=3)
    _ndim = 3


class PackedDeformConvTranspose1d(_PackedDeformConvTransposeBase, DeformConvTranspose1d):
    __doc__ = _PACKED_TRANSPOSE_DOC.format(n=1)
    _ndim = 1


class PackedDeformConvTranspose2d(_PackedDeformConvTransposeBase, DeformConvTranspose2d):
    __doc__ = _PACKED_TRANSPOSE_DOC.format(n=2)
    _ndim = 2


class PackedDeformConvTranspose3d(_PackedDeformConvTransposeBase, DeformConvTranspose3d):
    __doc__ = _PACKED_TRANSPOSE_DOC.format(n=3)
    _ndim = 3
