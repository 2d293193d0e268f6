"""What the stem weight-gradient kernel (csrc/stem_weight_grad.cu) takes, checked in Python before the op runs, so
that users read which argument is off and what is allowed. Imports no extension: CPU tests and config validation
use it too."""

from __future__ import annotations

import torch

__all__ = ["stem_unsupported", "channels_per_vector", "STEM_DTYPES"]

STEM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def channels_per_vector(dtype: torch.dtype) -> int:
    """Output channels in the 16 bytes the kernel reads of the output gradient at a time: the stem's channel count
    must be a multiple of it."""
    return 16 // dtype.itemsize


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def stem_unsupported(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, stride, padding) -> str | None:
    """None where the kernel can compute the weight gradient of conv2d(x, weight) (no bias, dilation 1, groups 1)
    in `dtype`, else why not, with what is allowed."""
    if x.dim() != 4 or x.shape[1] != 3:
        return f"it needs a 4-D input of 3 channels (N, 3, H, W), got shape {tuple(x.shape)}"
    if weight.dim() != 4 or tuple(weight.shape[1:]) != (3, 3, 3):
        return f"it needs a 3x3 kernel over 3 input channels (K, 3, 3, 3), got weight shape {tuple(weight.shape)}"
    if dtype not in STEM_DTYPES:
        return f"it computes in float32, float16 or bfloat16, got {dtype}"
    if not x.is_contiguous(memory_format=torch.channels_last):
        return "it needs the input in channels_last (channels_last=true); converting it would be a copy per step"
    s, p = _pair(stride), _pair(padding)
    if s[0] != s[1] or s[0] not in (1, 2):
        return f"it takes stride 1 or 2, the same along both axes, got {s}"
    if p[0] != p[1] or p[0] not in (0, 1, 2):
        return f"it takes padding 0, 1 or 2, the same along both axes, got {p}"
    h, w = x.shape[2] + 2 * p[0], x.shape[3] + 2 * p[1]
    if h < 3 or w < 3:
        return f"the padded input {h}x{w} is smaller than the 3x3 kernel"
    k = weight.shape[0]
    per_vector = channels_per_vector(dtype)
    if k % per_vector:
        return (f"it reads the output gradient in 16-byte vectors, so the output channels must be a multiple of "
                f"{per_vector} in {dtype}, got {k} (model.width_mult 0.25, 0.5, 0.75 and 1.0 give 8, 16, 24, 32)")
    ho, wo = (h - 3) // s[0] + 1, (w - 3) // s[1] + 1
    if x.numel() >= 2**31 or x.shape[0] * k * ho * wo >= 2**31:
        return f"it indexes with 32 bits: input {tuple(x.shape)} and its output need fewer than 2^31 elements each"
    if x.device.type != "cuda":
        return f"it needs a CUDA tensor, got one on {x.device}"
    return None
