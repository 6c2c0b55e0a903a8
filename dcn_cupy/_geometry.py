"""ConvGeometry: the normalised hyper-parameters and shapes of one deformable convolution.

Every rule of the design (section 1) is checked here, once, with a message that states what
was expected and what was got. Backends receive a ``ConvGeometry`` and never re-validate.

A transposed convolution is described by the geometry of the convolution it is the adjoint
of: input channels are the transposed output channels, the input grid is the transposed
output grid and the output grid is the transposed input grid.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

__all__ = [
    "ConvGeometry",
    "conv_output_size",
    "conv_transpose_output_size",
    "spatial_ndim",
    "check_groups",
    "conv_geometry",
    "conv_transpose_geometry",
    "fix_sequence_arg",
    "normalise_kernel_size",
    "GRADIENT_NAMES",
    "normalise_wrt",
]

GRADIENT_NAMES = ("input", "weight", "offset", "mask", "bias")

#: Bound of every per-axis quantity: stride, padding, dilation, output_padding, kernel_size and
#: the padded input extent S + 2p. The CUDA kernels compute grid coordinates in 32-bit ints
#: (and the tiled scatter adds a small halo), so this keeps every coordinate far from overflow.
MAX_EXTENT = 2**30


@dataclass(frozen=True)
class ConvGeometry:
    """Shapes and hyper-parameters of a (batched) deformable convolution.

    ``input_shape`` is the spatial shape ``S`` of the convolution's input and
    ``output_shape`` the spatial shape ``Q`` of its output; offset and mask live on ``Q``.
    ``offset_groups`` / ``mask_groups`` are 0 when there is no offset / mask.
    """

    ndim: int
    batch: int
    in_channels: int
    out_channels: int
    groups: int
    offset_groups: int
    mask_groups: int
    kernel_size: Tuple[int, ...]
    stride: Tuple[int, ...]
    padding: Tuple[int, ...]
    dilation: Tuple[int, ...]
    input_shape: Tuple[int, ...]
    output_shape: Tuple[int, ...]

    @property
    def kernel_volume(self) -> int:
        return math.prod(self.kernel_size)

    @property
    def in_channels_per_group(self) -> int:
        return self.in_channels // self.groups

    @property
    def out_channels_per_group(self) -> int:
        return self.out_channels // self.groups

    @property
    def input_size(self) -> int:
        return math.prod(self.input_shape)

    @property
    def output_size(self) -> int:
        return math.prod(self.output_shape)

    @property
    def has_offset(self) -> bool:
        return self.offset_groups > 0

    @property
    def has_mask(self) -> bool:
        return self.mask_groups > 0

    def with_batch(self, batch: int) -> "ConvGeometry":
        """The same geometry for a chunk of ``batch`` samples."""
        return ConvGeometry(
            self.ndim, batch, self.in_channels, self.out_channels, self.groups,
            self.offset_groups, self.mask_groups, self.kernel_size, self.stride, self.padding,
            self.dilation, self.input_shape, self.output_shape,
        )

    # Full array shapes, batch included.
    @property
    def x_shape(self) -> Tuple[int, ...]:
        return (self.batch, self.in_channels) + self.input_shape

    @property
    def y_shape(self) -> Tuple[int, ...]:
        return (self.batch, self.out_channels) + self.output_shape

    @property
    def weight_shape(self) -> Tuple[int, ...]:
        return (self.out_channels, self.in_channels_per_group) + self.kernel_size

    @property
    def offset_shape(self) -> Tuple[int, ...]:
        return (self.batch, self.offset_groups * self.kernel_volume * self.ndim) + self.output_shape

    @property
    def mask_shape(self) -> Tuple[int, ...]:
        return (self.batch, self.mask_groups * self.kernel_volume) + self.output_shape


def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def fix_sequence_arg(arg, ndim: int, name: str, minimum: int) -> Tuple[int, ...]:
    """An int or a sequence of ``ndim`` ints, each in [``minimum``, MAX_EXTENT], as an ``ndim``-tuple."""
    if isinstance(arg, (list, tuple)):
        if len(arg) != ndim:
            raise ValueError(
                f"{name} must be an int or a sequence of {ndim} ints, got {len(arg)} values {tuple(arg)!r}"
            )
        values = tuple(_as_int(v, name) for v in arg)
    else:
        values = (_as_int(arg, name),) * ndim
    got = values if isinstance(arg, (list, tuple)) else values[0]
    if min(values) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {got}")
    if max(values) > MAX_EXTENT:
        raise ValueError(f"{name} must be <= 2**30 = {MAX_EXTENT} (32-bit kernel coordinates), got {got}")
    return values


def normalise_kernel_size(kernel_size, ndim: int) -> Tuple[int, ...]:
    return fix_sequence_arg(kernel_size, ndim, "kernel_size", 1)


def normalise_wrt(wrt, given: dict) -> frozenset:
    """The set of gradients to compute: ``wrt`` (or every given argument) minus missing ones."""
    if wrt is None:
        return frozenset(name for name in GRADIENT_NAMES if given[name])
    if isinstance(wrt, str):
        wrt = (wrt,)
    try:
        names = frozenset(wrt)
    except TypeError:
        raise TypeError(f"wrt must be None or a collection of names, got {type(wrt).__name__}") from None
    unknown = sorted(str(n) for n in names - set(GRADIENT_NAMES))
    if unknown:
        raise ValueError(f"wrt must be a subset of {set(GRADIENT_NAMES)}, got unknown names {unknown}")
    return frozenset(name for name in names if given[name])


def conv_output_size(size, kernel, stride, padding, dilation):
    """``Q = (S + 2p - d(k - 1) - 1) // s + 1`` along one axis (plain ints or symbolic sizes)."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def conv_transpose_output_size(size, kernel, stride, padding, dilation, output_padding):
    """``out = (S - 1)s - 2p + d(k - 1) + 1 + op`` along one axis (plain ints or symbolic sizes)."""
    return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + 1 + output_padding


def _check_ndim(shape, expected: int, name: str, layout: str) -> None:
    if len(shape) != expected:
        raise ValueError(f"{name} must be {expected}-D {layout}, got shape {tuple(shape)}")


def _groups_from_channels(channels: int, per_group: int, name: str, per_group_text: str) -> int:
    if channels == 0 or channels % per_group:
        raise ValueError(
            f"{name}.shape[1] must be a positive multiple of {per_group_text}={per_group}, got {channels}"
        )
    return channels // per_group


def _check_divides(total: int, total_name: str, groups: int, groups_name: str) -> None:
    if total % groups:
        raise ValueError(f"{total_name}={total} must be divisible by {groups_name} = {groups}")


def _check_batched_arg(shape, name: str, batched: bool, batch: int, channels_text: str,
                       grid: Tuple[int, ...], grid_name: str, ndim: int) -> Tuple[int, ...]:
    """Check an offset/mask shape against the batch and grid; return it batched."""
    expected_ndim = ndim + 2 if batched else ndim + 1
    layout = f"(B, {channels_text}, *{grid_name})" if batched else f"({channels_text}, *{grid_name})"
    _check_ndim(shape, expected_ndim, name, layout)
    shape = tuple(shape) if batched else (batch,) + tuple(shape)
    if shape[0] != batch:
        raise ValueError(f"{name}.shape[0] must equal the batch size {batch}, got {shape[0]}")
    if shape[2:] != grid:
        raise ValueError(f"{name} spatial shape must be {grid_name}={grid}, got {shape[2:]}")
    return shape


def _hyper_parameters(ndim, stride, padding, dilation):
    return (
        fix_sequence_arg(stride, ndim, "stride", 1),
        fix_sequence_arg(padding, ndim, "padding", 0),
        fix_sequence_arg(dilation, ndim, "dilation", 1),
    )


def spatial_ndim(weight_shape, ndim: Optional[int],
                 layout: str = "(C_out, C_in/groups, *kernel_size)", operation: str = "convolution") -> int:
    """N read off the weight (1, 2 or 3), or checked against the ``ndim`` of an Nd function."""
    n = len(weight_shape) - 2
    if ndim is None:
        if n not in (1, 2, 3):
            raise ValueError(f"weight must be 3-D, 4-D or 5-D {layout}, got shape {tuple(weight_shape)}")
        return n
    if n != ndim:
        raise ValueError(
            f"weight must be {ndim + 2}-D {layout} for a {ndim}D {operation}, got shape {tuple(weight_shape)}"
        )
    return ndim


def check_groups(groups) -> int:
    groups = _as_int(groups, "groups")
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    return groups


def _split_batch(input_shape, ndim: int, name: str = "input"):
    """(batched, batch, (C, *S)) of an input shape; every axis but the batch must be non-empty."""
    shape = tuple(int(v) for v in input_shape)
    if len(shape) == ndim + 2:
        batched, batch, rest = True, shape[0], shape[1:]
    elif len(shape) == ndim + 1:
        batched, batch, rest = False, 1, shape
    else:
        raise ValueError(
            f"{name} must be {ndim + 2}-D (B, C, *S) or {ndim + 1}-D (C, *S) for a {ndim}D convolution, "
            f"got shape {shape}"
        )
    first = 1 if batched else 0
    if rest[0] < 1:
        raise ValueError(f"{name}.shape[{first}] (C_in) must be >= 1, got {rest[0]} (shape {shape})")
    for a, size in enumerate(rest[1:]):
        if size < 1:
            raise ValueError(
                f"{name}.shape[{first + 1 + a}] (spatial axis {a}) must be >= 1, got {size} (shape {shape}); "
                f"only the batch may be empty"
            )
    return batched, batch, rest


def _check_padded_extent(spatial, padding, what: str) -> None:
    for a, (size, pad) in enumerate(zip(spatial, padding)):
        if size + 2 * pad > MAX_EXTENT:
            raise ValueError(
                f"{what} + 2*padding along spatial axis {a} must be <= 2**30 = {MAX_EXTENT} "
                f"(32-bit kernel coordinates), got {size} + 2*{pad}"
            )


def _common_groups_and_extras(offset_shape, mask_shape, bias_shape, batched, batch,
                              grid, grid_name, grouped_channels, grouped_name, bias_channels, ndim,
                              kernel_volume):
    offset_groups = mask_groups = 0
    if offset_shape is not None:
        shape = _check_batched_arg(offset_shape, "offset", batched, batch, "G_o*K*N", grid, grid_name, ndim)
        offset_groups = _groups_from_channels(shape[1], kernel_volume * ndim, "offset", f"{ndim}*K")
        _check_divides(grouped_channels, grouped_name, offset_groups, "offset groups (offset.shape[1] // (N*K))")
    if mask_shape is not None:
        shape = _check_batched_arg(mask_shape, "mask", batched, batch, "G_m*K", grid, grid_name, ndim)
        mask_groups = _groups_from_channels(shape[1], kernel_volume, "mask", "K")
        _check_divides(grouped_channels, grouped_name, mask_groups, "mask groups (mask.shape[1] // K)")
    if bias_shape is not None and tuple(bias_shape) != (bias_channels,):
        raise ValueError(f"bias must have shape ({bias_channels},), got {tuple(bias_shape)}")
    return offset_groups, mask_groups


def conv_geometry(input_shape: Sequence[int], weight_shape: Sequence[int], offset_shape=None,
                  mask_shape=None, bias_shape=None, stride=1, padding=0, dilation=1, groups=1,
                  ndim: Optional[int] = None) -> Tuple[ConvGeometry, bool]:
    """Validate a deform_convNd call; return its geometry and whether the input was batched."""
    ndim = spatial_ndim(weight_shape, ndim)
    groups = check_groups(groups)
    stride, padding, dilation = _hyper_parameters(ndim, stride, padding, dilation)
    batched, batch, (in_channels, *spatial) = _split_batch(input_shape, ndim)
    spatial = tuple(spatial)
    out_channels, in_per_group, *kernel = (int(v) for v in weight_shape)
    kernel = tuple(kernel)
    if min(kernel) < 1:
        raise ValueError(f"weight spatial dimensions (kernel_size) must be >= 1, got {kernel}")
    if out_channels < 1:
        raise ValueError(f"weight.shape[0] (C_out) must be >= 1, got {out_channels}")
    if in_per_group < 1:
        raise ValueError(f"weight.shape[1] (C_in/groups) must be >= 1, got {in_per_group}")
    if out_channels % groups:
        raise ValueError(f"weight.shape[0] (C_out) must be divisible by groups={groups}, got {out_channels}")
    if in_per_group * groups != in_channels:
        raise ValueError(
            f"input.shape[1] (C_in) must equal weight.shape[1] * groups = {in_per_group * groups}, got {in_channels}"
        )
    _check_padded_extent(spatial, padding, "input size")
    out_shape = []
    for a in range(ndim):
        q = conv_output_size(spatial[a], kernel[a], stride[a], padding[a], dilation[a])
        if q < 1:
            span = dilation[a] * (kernel[a] - 1) + 1
            raise ValueError(
                f"output size along spatial axis {a} must be >= 1, got {q} "
                f"(input size {spatial[a]} + 2*padding {padding[a]} < dilated kernel size {span})"
            )
        out_shape.append(q)
    out_shape = tuple(out_shape)
    kernel_volume = math.prod(kernel)
    offset_groups, mask_groups = _common_groups_and_extras(
        offset_shape, mask_shape, bias_shape, batched, batch, out_shape, "Q", in_channels,
        "C_in", out_channels, ndim, kernel_volume,
    )
    geom = ConvGeometry(ndim, batch, in_channels, out_channels, groups, offset_groups, mask_groups,
                        kernel, stride, padding, dilation, spatial, out_shape)
    return geom, batched


def conv_transpose_geometry(input_shape, weight_shape, offset_shape=None, mask_shape=None,
                            bias_shape=None, stride=1, padding=0, output_padding=0, dilation=1,
                            groups=1, ndim: Optional[int] = None) -> Tuple[ConvGeometry, bool]:
    """Validate a deform_conv_transposeNd call.

    Returns the geometry of the convolution whose adjoint the call computes (its input is the
    transposed output, its output grid the transposed input grid) and whether the input was
    batched.
    """
    ndim = spatial_ndim(weight_shape, ndim, "(C_in, C_out/groups, *kernel_size)", "transposed convolution")
    groups = check_groups(groups)
    stride, padding, dilation = _hyper_parameters(ndim, stride, padding, dilation)
    output_padding = fix_sequence_arg(output_padding, ndim, "output_padding", 0)
    for a in range(ndim):
        limit = max(stride[a], dilation[a])
        if output_padding[a] >= limit:
            raise ValueError(
                f"output_padding must be smaller than max(stride, dilation) = {limit} along spatial axis {a}, "
                f"got {output_padding[a]}"
            )
    batched, batch, (in_channels, *spatial) = _split_batch(input_shape, ndim)
    spatial = tuple(spatial)
    w_in, out_per_group, *kernel = (int(v) for v in weight_shape)
    kernel = tuple(kernel)
    if min(kernel) < 1:
        raise ValueError(f"weight spatial dimensions (kernel_size) must be >= 1, got {kernel}")
    if out_per_group < 1:
        raise ValueError(f"weight.shape[1] (C_out/groups) must be >= 1, got {out_per_group}")
    if w_in != in_channels:
        raise ValueError(f"weight.shape[0] must equal input.shape[1] (C_in) = {in_channels}, got {w_in}")
    if in_channels % groups:
        raise ValueError(f"input.shape[1] (C_in) must be divisible by groups={groups}, got {in_channels}")
    out_channels = out_per_group * groups
    out_shape = []
    for a in range(ndim):
        size = conv_transpose_output_size(spatial[a], kernel[a], stride[a], padding[a], dilation[a],
                                          output_padding[a])
        if size < 1:
            raise ValueError(f"output size along spatial axis {a} must be >= 1, got {size}")
        out_shape.append(size)
    out_shape = tuple(out_shape)
    _check_padded_extent(out_shape, padding, "output size")
    kernel_volume = math.prod(kernel)
    offset_groups, mask_groups = _common_groups_and_extras(
        offset_shape, mask_shape, bias_shape, batched, batch, spatial, "S", out_channels,
        "C_out", out_channels, ndim, kernel_volume,
    )
    geom = ConvGeometry(ndim, batch, out_channels, in_channels, groups, offset_groups, mask_groups,
                        kernel, stride, padding, dilation, out_shape, spatial)
    return geom, batched
