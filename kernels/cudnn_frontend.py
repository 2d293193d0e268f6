"""Whether cuDNN's graph API can be driven from Python here: cudnn-frontend's bindings (the `cudnn` module of the
nvidia-cudnn-frontend package), which kernels/norm_pointwise.py builds its fused convolutions with. Asking imports
nothing, so a config can be checked on any machine."""

from __future__ import annotations

import importlib.util

__all__ = ["INSTALL", "cudnn_frontend_missing"]

# 1.16 needs nothing beyond cuDNN itself; later releases pull in the CUTLASS DSL (several hundred MB).
INSTALL = "pip install 'nvidia-cudnn-frontend>=1.16,<1.17' (a dependency of this project: pip install -e .)"


def cudnn_frontend_missing() -> str | None:
    """Why cudnn-frontend's Python bindings are not there (with how to install them), or None when they are."""
    if importlib.util.find_spec("cudnn") is None:
        return f"nvidia-cudnn-frontend, which is not installed: {INSTALL}"
    return None
