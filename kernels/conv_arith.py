"""Convolution arithmetic shared by the depthwise backends (mobilenet/depthwise.py) and the custom op
(kernels/ops.py). It lives in kernels/ because mobilenet/ imports kernels/, never the other way round."""

from __future__ import annotations

from typing import Sequence, Union

IntOrPair = Union[int, Sequence[int]]

__all__ = ["IntOrPair", "to_pair", "conv_out_size", "resolve_padding"]


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


def resolve_padding(padding: IntOrPair | str, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
                    name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """((top, left), (bottom, right)) padding from an int, a pair, 'valid' or 'same', as F.conv2d reads them.

    'same' (stride 1 only, as in F.conv2d) pads d * (k - 1) in all along an axis, total // 2 before and the rest
    after: with an even kernel (or an odd d * (k - 1)) one more at the bottom/right, as torch/nn/modules/conv.py
    (_reversed_padding_repeated_twice) and ATen's _convolution_mode do."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0), (0, 0)
        if padding != "same":
            raise ValueError(f"{name}: invalid padding string {padding!r}, should be 'same' or 'valid'")
        if tuple(stride) != (1, 1):
            raise ValueError(f"{name}: padding='same' is not supported for strided convolutions")
        total = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return (total[0] // 2, total[1] // 2), (total[0] - total[0] // 2, total[1] - total[1] // 2)
    pair = to_pair(padding, f"{name}: padding")
    return pair, pair
