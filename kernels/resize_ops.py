"""Python side of the training loader's fused resize + mirror + normalise (mobilenet_data::resize_normalize,
csrc/resize_normalize_ops.cpp): the fake kernel, and two ways to call it.

- `resize_normalize(crops, mirror, ...)` takes the crops as tensors and checks them, naming the crop that is off.
- `resize_normalize_table(table, device, ...)` takes a crop table (address, height, width, mirror per crop) that
  the caller built from memory it keeps alive until the kernel has run: data.dali.resize=kernel hands DALI's decoded
  crops over this way, one table per batch instead of one DLPack tensor per image (mobilenet/data/dali.py).

The op reads the table on the device; both functions copy it there from pinned memory, without a synchronisation.
Importing this module builds/loads the CUDA extension (kernels.load()), so it raises kernels.KernelUnavailable where
the kernels cannot run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import load

load()

__all__ = ["resize_normalize", "resize_normalize_table", "TABLE_COLUMNS"]

_op = torch.ops.mobilenet_data.resize_normalize.default
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TABLE_COLUMNS = 4  # address, height, width, mirror (csrc/resize_normalize.h: kDescWords)


@torch.library.register_fake("mobilenet_data::resize_normalize")
def _resize_normalize_fake(table, size, mean, std, dtype, channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty((table.shape[0], 3, *size), dtype=dtype, device=table.device, memory_format=fmt)


def _check_settings(size, mean, std, dtype) -> None:
    if dtype not in _DTYPES:
        raise ValueError(f"resize_normalize: the output dtype must be float32, float16 or bfloat16, not {dtype}")
    if len(size) != 2 or min(size) < 1:
        raise ValueError(f"resize_normalize: size must be (height, width), two positive numbers, not {tuple(size)}")
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise ValueError(f"resize_normalize: mean and std take 3 values each (R, G, B), std positive; got mean "
                         f"{list(mean)}, std {list(std)}")


def resize_normalize_table(table: Tensor, device: torch.device, size: Sequence[int], mean: Sequence[float],
                           std: Sequence[float], dtype: torch.dtype, channels_last: bool) -> Tensor:
    """The batch (N, 3, size[0], size[1]) in `dtype` on `device` from the N crops listed in `table`, a CPU int64
    tensor (N, 4) of address, height, width and mirror flag (nonzero: mirror left-right): contiguous uint8 HWC RGB
    images on `device`, which the caller keeps alive until the kernel has run (record an event after this call).
    Each crop is resized with PyTorch's antialiased bilinear filter (F.interpolate(mode="bilinear", antialias=True)),
    mirrored where flagged, normalised as (v / 255 - mean) / std; channels_last memory if asked, else contiguous."""
    _check_settings(size, mean, std, dtype)
    if table.device.type != "cpu" or table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != TABLE_COLUMNS:
        raise ValueError(f"resize_normalize: the crop table must be a CPU int64 tensor (N, {TABLE_COLUMNS}), not "
                         f"{table.dtype} {tuple(table.shape)} on {table.device}")
    if table.shape[0] == 0:
        raise ValueError("resize_normalize: no crops")
    if bool((table[:, 1:3] < 1).any()):
        raise ValueError(f"resize_normalize: crop {int((table[:, 1:3] < 1).any(dim=1).nonzero()[0])} is empty; "
                         "every crop needs a height and width of at least 1")
    on_device = table.pin_memory().to(device, non_blocking=True)
    return _op(on_device, list(size), [float(m) for m in mean], [float(s) for s in std], dtype, channels_last)


def resize_normalize(crops: Sequence[Tensor], mirror: Tensor | None, size: Sequence[int], mean: Sequence[float],
                     std: Sequence[float], dtype: torch.dtype, channels_last: bool) -> Tensor:
    """resize_normalize_table for crops given as tensors: N contiguous uint8 (H, W, 3) RGB images of any sizes on one
    CUDA device; `mirror`, N values on the CPU (nonzero: mirror) or None. The crops stay alive while the kernel runs,
    as the caching allocator orders their reuse after the current stream's work."""
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
    flags = [0] * len(crops) if mirror is None else [int(bool(m)) for m in mirror.reshape(-1).tolist()]
    table = torch.tensor([[c.data_ptr(), c.shape[0], c.shape[1], f] for c, f in zip(crops, flags)], dtype=torch.int64)
    return resize_normalize_table(table, device, size, mean, std, dtype, channels_last)
