"""Python side of the training loader's fused resize + mirror + normalise (mobilenet_data::resize_normalize,
csrc/resize_normalize_ops.cpp): the fake kernel, and `resize_normalize`, which checks its arguments with messages
that name the offending crop. data=dali with data.dali.resize=kernel hands DALI's decoded random crops to it.
Importing this module builds/loads the CUDA extension (kernels.load()), so it raises kernels.KernelUnavailable where
the kernels cannot run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import load

load()

__all__ = ["resize_normalize"]

_op = torch.ops.mobilenet_data.resize_normalize.default
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@torch.library.register_fake("mobilenet_data::resize_normalize")
def _resize_normalize_fake(crops, mirror, size, mean, std, dtype, channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty((len(crops), 3, *size), dtype=dtype, device=crops[0].device, memory_format=fmt)


def resize_normalize(crops: Sequence[Tensor], mirror: Tensor | None, size: tuple[int, int], mean: Sequence[float],
                     std: Sequence[float], dtype: torch.dtype, channels_last: bool) -> Tensor:
    """The batch (N, 3, size[0], size[1]) in `dtype` from N uint8 RGB crops (H, W, 3) of any sizes on one CUDA device:
    each resized with PyTorch's antialiased bilinear filter, mirrored left-right where `mirror` (N values on the CPU)
    is nonzero, and normalised as (v / 255 - mean) / std; channels_last memory if asked, else contiguous."""
    if not crops:
        raise ValueError("resize_normalize: no crops")
    device = crops[0].device
    for i, c in enumerate(crops):
        if c.device != device or c.device.type != "cuda":
            raise ValueError(f"resize_normalize: crop {i} is on {c.device}; every crop must be on one CUDA device "
                             f"(crop 0: {device})")
        if c.dtype != torch.uint8 or c.dim() != 3 or c.shape[2] != 3 or not c.is_contiguous() or c.numel() == 0:
            raise ValueError(f"resize_normalize: crop {i} is a {c.dtype} tensor of shape {tuple(c.shape)}"
                             f"{'' if c.is_contiguous() else ', not contiguous'}; each crop must be a contiguous, "
                             "non-empty uint8 (H, W, 3) RGB image")
    if mirror is not None and (mirror.device.type != "cpu" or mirror.numel() != len(crops)):
        raise ValueError(f"resize_normalize: mirror must hold one value per crop ({len(crops)}) on the CPU, not "
                         f"{mirror.numel()} on {mirror.device}")
    if dtype not in _DTYPES:
        raise ValueError(f"resize_normalize: the output dtype must be float32, float16 or bfloat16, not {dtype}")
    if len(size) != 2 or min(size) < 1:
        raise ValueError(f"resize_normalize: size must be (height, width), two positive numbers, not {tuple(size)}")
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise ValueError(f"resize_normalize: mean and std take 3 values each (R, G, B), std positive; got mean "
                         f"{list(mean)}, std {list(std)}")
    return _op(list(crops), mirror, list(size), [float(m) for m in mean], [float(s) for s in std], dtype,
               channels_last)
