"""The benchmark suites of scripts/bench_depthwise.py (mobilenet/bench/depthwise_suites.py): each layer a depthwise
case F.conv2d runs with the output size the suite states, the papers' layer counts, and the HBM floor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.depthwise_args import check_supported
from mobilenet.bench.depthwise_suites import SUITES, Layer, expand, floor_bytes, weighted_sum

# scripts/bench_depthwise.py's (C, H, stride) list before the suites: 3x3, padding 1, square inputs
OLD_LAYERS = [(32, 112, 1), (64, 112, 2), (128, 56, 1), (128, 56, 2), (256, 28, 1), (256, 28, 2)] + [
    (512, 14, 1)] * 5 + [(512, 14, 2), (1024, 7, 1)]

CASES = [(name, i, layer) for name, suite in SUITES.items() for i, layer in enumerate(suite.layers)]


@pytest.mark.parametrize("name,i,layer", CASES, ids=[f"{n}-{i}" for n, i, _ in CASES])
def test_every_layer_is_a_depthwise_case_with_the_stated_output_size(name, i, layer):
    # a small batch and few channels: the size arithmetic, at the layer's own spatial size
    c = min(layer.C, 4)
    small = Layer(**{**layer.fields(), "C": c})
    x = torch.randn(1, c, layer.H, layer.W)
    w = torch.randn(small.weight_shape)
    stride, padding, dilation = small.conv_args()
    check_supported(x, w, None, stride, padding, dilation)  # what the custom op takes
    y = F.conv2d(x, w, None, stride, padding, dilation, groups=c)
    assert tuple(y.shape) == (1, small.out_channels, *layer.out_hw)
    # and the same arithmetic at a small H (the output size follows the stride's usual formula)
    h = 9 + layer.k
    y = F.conv2d(torch.randn(1, c, h, h + 1), w, None, stride, padding, dilation, groups=c)
    assert tuple(y.shape[2:]) == Layer(**{**small.fields(), "H": h, "W": h + 1}).out_hw


@pytest.mark.parametrize("name", [n for n in SUITES if n != "large_k7"])
def test_network_suites_chain_their_sizes(name):
    # 224 input; a stride-2 layer halves the size, and padding k // 2 keeps a stride-1 layer's size (what 'same'
    # means for these odd kernels); the next depthwise layer runs at that size (ConvNeXt: or at half of it, after
    # the downsampling convolution between its stages)
    layers = expand(SUITES[name].layers)
    assert layers[0].H == (56 if name == "convnext_t" else 112)
    for layer, nxt in zip(layers, layers[1:] + [None]):
        assert layer.H == layer.W and layer.padding == layer.k // 2 and layer.k % 2 == 1
        assert layer.out_hw == (-(-layer.H // layer.stride),) * 2
        assert layer.dilation == 1 and layer.multiplier == 1
        if nxt is not None:
            assert nxt.H in ((layer.out_hw[0], layer.out_hw[0] // 2) if name == "convnext_t" else (layer.out_hw[0],))


def test_layer_counts_match_the_papers():
    counts = {name: suite.n_layers for name, suite in SUITES.items()}
    assert counts == {"mobilenet_v1": 13, "mobilenet_v3": 15, "efficientnet_b0": 16, "convnext_t": 18, "large_k7": 4}
    for suite in SUITES.values():  # identical layers are one entry with a count
        assert len(set(suite.layers)) == len(suite.layers)
        assert len({Layer(**{**l.fields(), "count": 1}) for l in suite.layers}) == len(suite.layers)


def test_mobilenet_v1_is_the_benchmarks_old_layer_list():
    layers = expand(SUITES["mobilenet_v1"].layers)
    assert [(l.C, l.H, l.stride) for l in layers] == OLD_LAYERS
    assert all((l.W, l.k, l.padding, l.dilation, l.multiplier) == (l.H, 3, 1, 1, 1) for l in layers)


def test_paper_shapes():
    # ConvNeXt-T: 7x7 depthwise at 96/192/384/768 channels, 56/28/14/7, depths 3/3/9/3
    assert [(l.C, l.H, l.k, l.stride, l.padding, l.count) for l in SUITES["convnext_t"].layers] == [
        (96, 56, 7, 1, 3, 3), (192, 28, 7, 1, 3, 3), (384, 14, 7, 1, 3, 9), (768, 7, 7, 1, 3, 3)]
    # large_k7: 7x7 stride 1 'same' at 224^2 and 112^2 with 32-64 channels
    assert {(l.C, l.H) for l in SUITES["large_k7"].layers} == {(32, 224), (64, 224), (32, 112), (64, 112)}
    assert all((l.k, l.stride, l.padding) == (7, 1, 3) for l in SUITES["large_k7"].layers)
    # EfficientNet-B0: kernels per MBConv block, stages 2-8 (1, 2, 2, 3, 3, 4, 1 blocks)
    assert [l.k for l in expand(SUITES["efficientnet_b0"].layers)] == [3] * 3 + [5] * 2 + [3] * 3 + [5] * 7 + [3]
    # MobileNetV3-Large: 5x5 in bneck rows 4-6 and 13-15 of Table 1
    assert [l.k for l in expand(SUITES["mobilenet_v3"].layers)] == [3] * 3 + [5] * 3 + [3] * 6 + [5] * 3


def test_floor_bytes():
    # MobileNetV1's first layer, batch 2, fp16: x 2*32*112*112, y the same (stride 1), weight 32*9
    layer = SUITES["mobilenet_v1"].layers[0]
    x = 2 * 32 * 112 * 112 * 2
    assert floor_bytes(layer, 2, 2, "fwd") == x + x + 32 * 9 * 2
    assert floor_bytes(layer, 2, 2, "fwdbwd") == 5 * x + 2 * 32 * 9 * 2
    # stride 2, 5x5, depth multiplier 2, fp32: y = 2*(8*2)*4*4, weight 16*25
    odd = Layer(8, 8, 8, 5, 2, 2, multiplier=2)
    assert odd.out_hw == (4, 4)
    x, y, w = 2 * 8 * 64 * 4, 2 * 16 * 16 * 4, 16 * 25 * 4
    assert floor_bytes(odd, 2, 4, "fwd") == x + y + w
    assert floor_bytes(odd, 2, 4, "fwdbwd") == 3 * x + 2 * y + 2 * w
    # one gradient each: the input gradient reads grad_out and the weight and writes grad_input; the weight
    # gradient reads grad_out and the input and writes the weight gradient: the same byte count
    assert floor_bytes(odd, 2, 4, "fwd_dgrad") == 2 * x + 2 * y + 2 * w
    assert floor_bytes(odd, 2, 4, "fwd_wgrad") == 2 * x + 2 * y + 2 * w
    with pytest.raises(KeyError):
        floor_bytes(odd, 2, 4, "bwd")


def test_weighted_sum_uses_counts():
    assert weighted_sum([{"t": 1.0, "count": 5}, {"t": 2.0}], "t") == 7.0
