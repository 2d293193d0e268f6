"""The floating-point dtypes the benchmark and experiment scripts take by name (--dtype fp16, --dtypes fp32,bf16)."""

from __future__ import annotations

import torch

__all__ = ["DTYPES"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
