"""Python side of the stem convolution's weight gradient (mobilenet_stem::conv3x3_weight_grad, csrc/stem_ops.cpp):
its fake kernel, and `stem_conv2d`, a convolution whose forward is cuDNN's and whose weight gradient is this
project's kernel (cuDNN runs the 3-channel weight gradient at several times its memory floor: docs/kernels.md).
Importing this module builds/loads the CUDA extension (kernels.load()), so it raises kernels.KernelUnavailable where
the kernels cannot run. What the kernel takes is checked by kernels.stem_args, which imports no extension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import load
from .stem_args import stem_unsupported

load()

__all__ = ["stem_conv2d"]

_weight_grad = torch.ops.mobilenet_stem.conv3x3_weight_grad.default


@torch.library.register_fake("mobilenet_stem::conv3x3_weight_grad")
def _weight_grad_fake(grad_out, x, stride, padding):
    return grad_out.new_empty((grad_out.shape[1], x.shape[1], 3, 3), dtype=torch.float32)


class _StemConv2d(torch.autograd.Function):
    """y = conv2d(x, weight) in `dtype`, the run's compute dtype (autocast's where it is on); backward: the weight
    gradient from this project's kernel, in fp32 and then the weight's dtype; the input gradient (rarely needed:
    images need none) from aten's convolution_backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, stride: tuple[int, int], padding: tuple[int, int],
                dtype: torch.dtype) -> Tensor:
        with torch.autocast("cuda", enabled=False):
            xc, wc = x.to(dtype), weight.to(dtype)
            y = F.conv2d(xc, wc, None, stride, padding)
        ctx.save_for_backward(xc, wc)
        ctx.conv = (list(stride), list(padding))
        ctx.dtypes = (x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        xc, wc = ctx.saved_tensors
        stride, padding = ctx.conv
        x_dtype, w_dtype = ctx.dtypes
        grad_out = grad_out.to(xc.dtype).contiguous(memory_format=torch.channels_last)
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(grad_out, xc, stride, padding).to(w_dtype)
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.convolution_backward(grad_out, xc, wc, None, stride, padding, [1, 1], False,
                                                         [0, 0], 1, [True, False, False])[0].to(x_dtype)
        return grad_x, grad_w, None, None, None


def stem_conv2d(x: Tensor, weight: Tensor, stride: tuple[int, int], padding: tuple[int, int]) -> Tensor:
    """conv2d(x, weight, stride=stride, padding=padding) without bias, its weight gradient from this project's
    kernel. Raises ValueError naming what the kernel does not take (kernels.stem_args.stem_unsupported)."""
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    why = stem_unsupported(x, weight, dtype, stride, padding)
    if why:
        raise ValueError(f"the custom stem weight gradient cannot run here: {why}")
    return _StemConv2d.apply(x, weight, tuple(stride), tuple(padding), dtype)
