"""The convolution arithmetic that the depthwise backends and the custom op share."""

import pytest
import torch
import torch.nn.functional as F

from kernels.conv_arith import conv_out_size, to_pair


@pytest.mark.parametrize("value, pair", [(3, (3, 3)), ((2,), (2, 2)), ([1, 2], (1, 2)), (torch.Size([5, 7]), (5, 7))])
def test_to_pair_accepts_what_conv2d_accepts(value, pair):
    assert to_pair(value, "stride") == pair


def test_to_pair_names_the_argument_it_refuses():
    with pytest.raises(ValueError, match=r"depthwise_conv2d: padding must be an int or a pair, got \(1, 2, 3\)"):
        to_pair((1, 2, 3), "depthwise_conv2d: padding")


@pytest.mark.parametrize("size, k, s, p, d", [(7, 3, 1, 1, 1), (8, 3, 2, 1, 1), (9, 5, 2, 0, 2), (4, 7, 1, 3, 1)])
def test_conv_out_size_matches_conv2d(size, k, s, p, d):
    out = F.conv2d(torch.zeros(1, 1, size, size), torch.zeros(1, 1, k, k), stride=s, padding=p, dilation=d)
    assert conv_out_size(size, k, s, p, d) == out.shape[-1]
