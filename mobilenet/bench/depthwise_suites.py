"""The depthwise layers that scripts/bench_depthwise.py measures, one suite per network, and the arithmetic of its
tables: the HBM floor of a layer and the count-weighted sums over a suite.

Every suite is at 224x224 network input. A layer is (C, H, W, kernel, stride, padding, dilation, multiplier, count):
the depthwise convolution's input channels and spatial size, its square kernel, stride, symmetric padding, dilation
and depth multiplier (weight (C * multiplier, 1, k, k)), and how many layers of the network have exactly that
shape. Identical layers are measured once and weighted by their count in every sum. Where a network pads 'same'
the suites use F.conv2d's symmetric k // 2 (every kernel here is odd; at stride 2 that is torchvision's padding,
TensorFlow's 'same' pads one less at the top and left there).

Sources (the depthwise layers of each network's table):

- mobilenet_v1: Howard et al. 2017, "MobileNets: Efficient Convolutional Neural Networks for Mobile Vision
  Applications", Table 1. 13 "Conv dw" rows, 3x3, padding 1. The table's last one ("Conv dw / s2" on 7x7x1024)
  runs at stride 1, as its output size (7x7) and every implementation have it.
- mobilenet_v3: Howard et al. 2019, "Searching for MobileNetV3", Table 1 (MobileNetV3-Large). One depthwise layer
  per bneck row (15): channels = the row's "exp size", kernel 3 or 5, the row's stride, at the row's input size.
- efficientnet_b0: Tan & Le 2019, "EfficientNet: Rethinking Model Scaling for Convolutional Neural Networks",
  Table 1. One depthwise layer per MBConv block (16 over stages 2-8): channels = the block's input channels x 6
  (stage 2's MBConv1: its 32 input channels), the stage's kernel (3 or 5); a stage's first block has stride
  (the stage's resolution / the next stage's), the others stride 1 at the reduced size.
- convnext_t: Liu et al. 2022, "A ConvNet for the 2020s", Section 2, as the authors' code builds ConvNeXt-T
  (facebookresearch/ConvNeXt, models/convnext.py `convnext_tiny`: depths [3, 3, 9, 3], dims [96, 192, 384, 768],
  every block's `nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)`, a 4x4 stride-4 stem and 2x2 stride-2
  downsampling): 7x7 depthwise, padding 3, stride 1, at 56 / 28 / 14 / 7 for a 224 px input: 18 layers.
- large_k7: not a network; large kernels at large sizes (issue #22): 7x7, stride 1, padding 3 ('same'), 32 and 64
  channels at 224x224 and 112x112.

Default batch: 256, as the rest of the benchmarks, except large_k7 at 64: its 64 x 224 x 224 layer holds 3.2 GB
per fp32 tensor at batch 256 (8x MobileNetV1's largest), which the rotation, gradients and cuDNN's autotuning
multiply; at 64 each tensor is 0.8 GB, still 13x the H200's L2.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kernels.conv_arith import conv_out_size

__all__ = ["Layer", "Suite", "SUITES", "DEFAULT_SUITE", "expand", "floor_bytes", "weighted_sum"]


@dataclass(frozen=True)
class Layer:
    C: int
    H: int
    W: int
    k: int
    stride: int
    padding: int
    dilation: int = 1
    multiplier: int = 1
    count: int = 1

    @property
    def out_channels(self) -> int:
        return self.C * self.multiplier

    @property
    def out_hw(self) -> tuple[int, int]:
        return tuple(conv_out_size(s, self.k, self.stride, self.padding, self.dilation) for s in (self.H, self.W))

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        return (self.out_channels, 1, self.k, self.k)

    def conv_args(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(stride, padding, dilation) as every backend's conv2d(x, w, bias, stride, padding, dilation) takes them."""
        return (self.stride,) * 2, (self.padding,) * 2, (self.dilation,) * 2

    def shape(self) -> str:
        """C x H x W, with the multiplier and dilation where they are not 1."""
        extra = (f" m{self.multiplier}" if self.multiplier != 1 else "") + (f" d{self.dilation}" if self.dilation != 1
                                                                            else "")
        return f"{self.C}x{self.H}x{self.W}{extra}"

    def fields(self) -> dict:
        return asdict(self)


def _square(c, h, k, stride, count=1, padding=None) -> Layer:
    return Layer(c, h, h, k, stride, k // 2 if padding is None else padding, count=count)


@dataclass(frozen=True)
class Suite:
    title: str
    source: str
    layers: tuple[Layer, ...]
    default_batch: int = 256

    @property
    def n_layers(self) -> int:
        return sum(layer.count for layer in self.layers)


SUITES = {
    "mobilenet_v1": Suite("MobileNetV1", "Howard et al. 2017, Table 1", (
        _square(32, 112, 3, 1), _square(64, 112, 3, 2), _square(128, 56, 3, 1), _square(128, 56, 3, 2),
        _square(256, 28, 3, 1), _square(256, 28, 3, 2), _square(512, 14, 3, 1, count=5), _square(512, 14, 3, 2),
        _square(1024, 7, 3, 1))),
    "mobilenet_v3": Suite("MobileNetV3-Large", "Howard et al. 2019, Table 1", (
        _square(16, 112, 3, 1), _square(64, 112, 3, 2), _square(72, 56, 3, 1), _square(72, 56, 5, 2),
        _square(120, 28, 5, 1, count=2), _square(240, 28, 3, 2), _square(200, 14, 3, 1),
        _square(184, 14, 3, 1, count=2), _square(480, 14, 3, 1), _square(672, 14, 3, 1), _square(672, 14, 5, 2),
        _square(960, 7, 5, 1, count=2))),
    "efficientnet_b0": Suite("EfficientNet-B0", "Tan & Le 2019, Table 1", (
        _square(32, 112, 3, 1),  # stage 2, MBConv1
        _square(96, 112, 3, 2), _square(144, 56, 3, 1),  # stage 3: 16 -> 24
        _square(144, 56, 5, 2), _square(240, 28, 5, 1),  # stage 4: 24 -> 40
        _square(240, 28, 3, 2), _square(480, 14, 3, 1, count=2),  # stage 5: 40 -> 80
        _square(480, 14, 5, 1), _square(672, 14, 5, 1, count=2),  # stage 6: 80 -> 112
        _square(672, 14, 5, 2), _square(1152, 7, 5, 1, count=3),  # stage 7: 112 -> 192
        _square(1152, 7, 3, 1))),  # stage 8: 192 -> 320
    "convnext_t": Suite("ConvNeXt-T", "Liu et al. 2022, Section 2; the authors' models/convnext.py convnext_tiny", (
        _square(96, 56, 7, 1, count=3), _square(192, 28, 7, 1, count=3), _square(384, 14, 7, 1, count=9),
        _square(768, 7, 7, 1, count=3))),
    "large_k7": Suite("large 7x7 kernels", "issue #22", (
        _square(32, 224, 7, 1), _square(64, 224, 7, 1), _square(32, 112, 7, 1), _square(64, 112, 7, 1)),
        default_batch=64),
}
DEFAULT_SUITE = "mobilenet_v1"


def expand(layers) -> list[Layer]:
    """Each layer repeated `count` times (count 1 each): the network's depthwise layers in order."""
    return [Layer(**{**layer.fields(), "count": 1}) for layer in layers for _ in range(layer.count)]


def floor_bytes(layer: Layer, n: int, elem: int, mode: str) -> int:
    """The fewest bytes one pass of one layer moves at batch n and `elem` bytes per element. fwd: read the input
    and the weight, write the output; fwdbwd adds the backward's read of grad_out and the input, its write of
    grad_input and the weight gradient; fwd_dgrad adds only the input gradient's (grad_out and the weight read,
    grad_input written), fwd_wgrad only the weight gradient's (grad_out and the input read, the weight gradient
    written)."""
    oh, ow = layer.out_hw
    x = n * layer.C * layer.H * layer.W * elem
    y = n * layer.out_channels * oh * ow * elem
    w = layer.out_channels * layer.k * layer.k * elem
    fwd = x + y + w
    extra = {"fwd": 0, "fwdbwd": y + x + x + w, "fwd_dgrad": y + w + x, "fwd_wgrad": y + x + w}
    return fwd + extra[mode]


def weighted_sum(rows, key: str) -> float:
    """Sum of row[key] over rows, each weighted by its layer's count (1 for rows without one)."""
    return sum(r[key] * r.get("count", 1) for r in rows)
