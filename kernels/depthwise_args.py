"""The argument checks and output shape of the custom depthwise op, importable without CUDA (kernels/ops.py
loads the extension on import): what F.conv2d(groups=C) refuses raises ValueError, everything it runs passes."""

from __future__ import annotations

from typing import Sequence

import torch

from .conv_arith import conv_out_size

__all__ = ["check_supported", "out_shape"]


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
