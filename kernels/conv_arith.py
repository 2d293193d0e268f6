"""Convolution arithmetic shared by the depthwise backends (mobilenet/depthwise.py) and the custom op
(kernels/ops.py). It lives in kernels/ because mobilenet/ imports kernels/, never the other way round."""

from __future__ import annotations

from typing import Sequence, Union

IntOrPair = Union[int, Sequence[int]]

__all__ = ["IntOrPair", "to_pair", "conv_out_size"]


def to_pair(value: IntOrPair, name: str) -> tuple[int, int]:
    """(h, w) from an int or a 1- or 2-element sequence, as F.conv2d accepts them; `name` starts the error message."""
    if isinstance(value, int):
        return (value, value)
    pair = tuple(int(i) for i in value)
    if len(pair) == 1:
        return (pair[0], pair[0])
    if len(pair) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {pair}")
    return pair


def conv_out_size(size: int, k: int, s: int, p: int, d: int) -> int:
    """Output length along one spatial axis of a convolution: input `size`, kernel `k`, stride `s`, padding `p`,
    dilation `d`. The C++ op's out_size() (kernels/csrc/depthwise_ops.cpp) is its twin."""
    return (size + 2 * p - d * (k - 1) - 1) // s + 1
