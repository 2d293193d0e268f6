"""The argument checks and output shape of the custom depthwise op, importable without CUDA (kernels/ops.py
loads the extension on import): what F.conv2d(groups=C) refuses raises ValueError, everything it runs passes."""

from __future__ import annotations

from typing import Sequence

import torch

from .conv_arith import conv_out_size

__all__ = ["check_supported", "out_shape", "stats_unsupported", "stats_bands", "column_walk_offsets_fit"]


def out_shape(x_shape: Sequence[int], w_shape: Sequence[int], stride: Sequence[int], padding: Sequence[int],
              dilation: Sequence[int]) -> tuple[int, int, int, int]:
    """(N, C * m, OH, OW) of the op on input (N, C, H, W) and weight (C * m, 1, kh, kw), symmetric padding per
    axis: one output channel per filter."""
    n, _, h, w = x_shape
    kh, kw = w_shape[-2:]
    return (n, w_shape[0], conv_out_size(h, kh, stride[0], padding[0], dilation[0]),
            conv_out_size(w, kw, stride[1], padding[1], dilation[1]))


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_supported(x, weight, bias, stride, padding, dilation) -> None:
    """What F.conv2d(groups=C) refuses, as a ValueError; everything it runs passes. The op checks the same again
    in C++ (check_and_shape in csrc/depthwise_ops.cpp); checking here first gives a Python ValueError before any
    C++ exception (a TORCH_CHECK thrown inside the op crashed the process on the H200 image, see
    docs/kernel_notes.md)."""
    c = x.shape[1]
    if x.dtype not in _DTYPES:
        raise ValueError(f"depthwise_conv2d: dtype {x.dtype} is not supported (float32, float16, bfloat16, float64)")
    if weight.dim() != 4 or weight.shape[1] != 1:
        raise ValueError(f"depthwise_conv2d: weight must have shape (C * m, 1, kh, kw) with C={c}, got "
                         f"{tuple(weight.shape)}")
    filters = weight.shape[0]
    if (filters < c or filters % c != 0) if c > 0 else filters != 0:
        raise ValueError(f"depthwise_conv2d: weight has {filters} filters, which is not a multiple m >= 1 of the "
                         f"input's {c} channels (weight must have shape (C * m, 1, kh, kw))")
    for k in weight.shape[-2:]:
        if k < 1:
            raise ValueError(f"depthwise_conv2d: kernel size {k} is not supported (must be >= 1)")
    for what, values, least in (("stride", stride, 1), ("dilation", dilation, 1), ("padding", padding, 0)):
        if len(values) != 2:
            raise ValueError(f"depthwise_conv2d: {what} must have two values, got {tuple(values)}")
        for v in values:
            if v < least:
                raise ValueError(f"depthwise_conv2d: {what} {v} is not supported (must be >= {least})")
    # under autocast the op's autocast kernel casts x, weight and bias to one dtype
    same_dtype = torch.is_autocast_enabled("cuda") or weight.dtype == x.dtype
    if weight.device != x.device or not same_dtype:
        raise ValueError(f"depthwise_conv2d: weight ({weight.dtype}, {weight.device}) must match the input "
                         f"({x.dtype}, {x.device})")
    if bias is not None and (tuple(bias.shape) != (filters,) or bias.device != x.device
                             or not (torch.is_autocast_enabled("cuda") or bias.dtype == x.dtype)):
        raise ValueError(f"depthwise_conv2d: bias must have shape ({filters},) and the input's dtype and device, "
                         f"got {tuple(bias.shape)} {bias.dtype} {bias.device}")
    for size, k, st, p, d in zip(x.shape[2:], weight.shape[-2:], stride, padding, dilation):
        if conv_out_size(size, k, st, p, d) < 1:
            raise ValueError(f"depthwise_conv2d: input {tuple(x.shape[2:])} is smaller than the dilated kernel "
                             f"{tuple(weight.shape[-2:])} after padding {tuple(padding)}")


_STATS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_MAX = 2**31 - 1


def column_walk_offsets_fit(h: int, w: int, ow: int, pad_h: int, c: int, elem: int) -> bool:
    """Whether the word offsets a 3x3 column walk forms within one image of an (h, w) input, output width ow, top
    padding pad_h and c channels of elem bytes fit an int (column_fits in csrc/depthwise_dispatch.cpp)."""
    return (h + pad_h + 2) * (w + 2 * ow + 12) * (c * elem // 4) <= _INT_MAX


def _compute_dtype(x) -> torch.dtype:
    """The dtype the op computes in: under CUDA autocast, the autocast dtype (its autocast kernel casts x)."""
    if torch.is_autocast_enabled("cuda") and x.dtype in _STATS_DTYPES:
        return torch.get_autocast_dtype("cuda")
    return x.dtype


def stats_unsupported(x, weight, bias, stride, padding, dilation) -> str | None:
    """Why depthwise_fwd_stats (the forward that also returns the statistics of its output) cannot take this
    case, or None when it can: the NHWC 3x3 column walk only (forward_stats_fits in csrc/depthwise_dispatch.cpp,
    with narrow_shape's and column_fits' limits), no bias. The arguments are those of check_supported, which
    must pass first. Reads metadata only (no device work), so it traces under torch.compile."""
    from . import kernel_layout

    dtype = _compute_dtype(x)
    n, c, h, w = x.shape
    if not x.is_cuda:
        return f"the input is on {x.device}, not a CUDA device"
    if dtype not in _STATS_DTYPES:
        return f"dtype {dtype} (float32, float16, bfloat16)"
    if kernel_layout(x) != torch.channels_last:
        return "the input is not channels_last (NHWC)"
    if tuple(weight.shape) != (c, 1, 3, 3):
        return f"weight {tuple(weight.shape)} is not a 3x3 depthwise ({c}, 1, 3, 3)"
    if bias is not None:
        return "the convolution has a bias"
    if isinstance(padding, str) or tuple(stride) not in ((1, 1), (2, 2)) or tuple(dilation) != (1, 1):
        return (f"stride {tuple(stride)}, dilation {tuple(dilation)}, padding {padding!r}: the walk takes equal "
                "strides 1 or 2, dilation 1 and numeric padding")
    elem = dtype.itemsize
    # The offset is data, not metadata, to torch.compile (a graph break); traced, the op's own check
    # (forward_stats_fits) refuses a misaligned input instead.
    misaligned = (x.dtype == dtype and not torch.compiler.is_compiling() and (x.storage_offset() * elem) % 4)
    if (c * elem) % 4 or misaligned:
        return f"{c} channels of {dtype} are not whole 32-bit words (or the input is not 4-byte aligned)"
    _, _, oh, ow = out_shape(x.shape, weight.shape, stride, padding, dilation)
    if (c > 65535 or max(padding) > 2**20 or n * c * h * w >= 2**31 or n * c * oh * ow >= 2**31
            or not column_walk_offsets_fit(h, w, ow, padding[0], c, elem)):
        return f"input {tuple(x.shape)} is beyond the column walk's 32-bit index range"
    return None


# FWD_COLUMN_ROWS' defaults per dtype (csrc/launch_plan.cpp): 0 picks by shape (column_plain_rows).
_COLUMN_ROWS_DEFAULT = {torch.float32: 2, torch.float16: 0, torch.bfloat16: 0}
_KNOB_SUFFIX = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _env_knob(name: str, dtype: torch.dtype, default: int) -> int:
    """knob() of csrc/launch_plan.cpp: MDW_<NAME>, then MDW_<NAME>_<DTYPE>, each a leading integer as atoi reads it."""
    import os
    import re

    value = default
    for key in (f"MDW_{name}", f"MDW_{name}_{_KNOB_SUFFIX[dtype]}"):
        text = os.environ.get(key, "")
        if text:
            m = re.match(r"\s*[+-]?\d+", text)
            value = int(m.group()) if m else 0
    return value


def stats_bands(n: int, c: int, oh: int, ow: int, stride: int, dtype: torch.dtype) -> int:
    """The first dimension of depthwise_fwd_stats' partials for output (n, c, oh, ow): the blocks along the rows of
    the column walk (column_stats_tiling in csrc/stencil_3x3.cuh: rows per lane, then column_tiling's bands)."""
    rows_knob = _env_knob("FWD_COLUMN_ROWS", dtype, _COLUMN_ROWS_DEFAULT[dtype])
    two = rows_knob == 2 or (rows_knob == 0 and stride == 1 and ow <= 28)
    rows = n * ((oh + 1) // 2 if two else oh)
    words = c if dtype == torch.float32 else c // 2
    groups = -(-words // 32)
    lanes_c = -(-words // groups)
    per_band = min(256 // lanes_c, rows)
    return -(-rows // per_band)
