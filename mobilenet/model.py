"""MobileNetV1 (Howard et al. 2017, Table 1), with every depthwise layer built through the backend registry and every
BatchNorm + ReLU pair through the norm registry (one `norm_relu` module in place of [BatchNorm2d, ReLU]: the ReLU had
no state, so state_dict keys are those of the older [conv, bn, relu] layout)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.cudnn_frontend import cudnn_frontend_missing
from kernels.depthwise_args import column_walk_offsets_fit
from kernels.stem_args import channels_per_vector

from .config import enum_value
from .depthwise import DepthwiseConv2d
from .errors import ConfigError
from .norm import (NEXT_NORM_MODES, check_apply_in_depthwise, check_apply_in_pointwise, check_stats_from_depthwise,
                   custom_pair_needs, depthwise_backward_mode, depthwise_norm_relu, get_norm, next_norm_in,
                   norm_relu_depthwise, norm_relu_depthwise_norm_relu, norm_relu_depthwise_norm_relu_pointwise,
                   norm_relu_pointwise)

# (output channels, stride) of the 13 depthwise-separable blocks at width multiplier 1.0 (Table 1).
BLOCKS: tuple[tuple[int, int], ...] = (
    (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
    (512, 1), (512, 1), (512, 1), (512, 1), (512, 1),
    (1024, 2), (1024, 1),
)
STEM_CHANNELS = 32


def _scaled(channels: int, width_mult: float) -> int:
    return max(1, int(channels * width_mult))


def depthwise_inputs(width_mult: float, resolution: int) -> list[tuple[int, int]]:
    """(channels, height = width) of the 13 depthwise convs' inputs for a square input of `resolution`: the stem's
    output, then every block's pointwise output but the last's."""
    size = (resolution - 1) // 2 + 1  # the stem: 3x3, stride 2, padding 1
    channels = _scaled(STEM_CHANNELS, width_mult)
    inputs = []
    for block_out, stride in BLOCKS:
        inputs.append((channels, size))
        size = (size - 1) // stride + 1
        channels = _scaled(block_out, width_mult)
    return inputs


# --- norm.apply_in_depthwise: which runs apply each BatchNorm + ReLU before a depthwise conv in that conv's kernels --

def _depthwise_shape_needs(cfg) -> list[tuple[bool, str]]:
    """The shapes the normalizing walks refuse (kernels/depthwise_args.py stats_unsupported), for this config's
    MobileNetV1: each becomes a need, so that auto is off and true refused before the first step instead of a
    NormUnavailable at it."""
    inputs = depthwise_inputs(cfg.model.width_mult, cfg.data.resolution)
    needs = []
    # An (N, C, 1, 1) or (N, 1, H, W) tensor is contiguous in both layouts and reads as NCHW, which the walks refuse.
    small = sorted({f"{c}x{h}x{h}" for c, h in inputs if h < 2 or c < 2})
    if small:
        needs.append((False, f"every depthwise conv's input at least 2x2 with 2 channels (data.resolution="
                             f"{cfg.data.resolution} and model.width_mult={cfg.model.width_mult} give "
                             f"{', '.join(small)}; a 1x1 or one-channel tensor reads as NCHW)"))
    odd = sorted({c for c, _ in inputs if c % 2})
    if cfg.amp and odd:  # 16-bit channels come in pairs, one 32-bit word per lane
        needs.append((False, f"an even number of channels into every depthwise conv under amp (the kernels walk "
                             f"32-bit words of 16-bit pairs; model.width_mult={cfg.model.width_mult} gives "
                             f"{', '.join(map(str, odd))})"))
    largest = max(cfg.data.batch_size * c * h * h for c, h in inputs)
    if largest >= 2**31:  # the walks index with 32 bits
        needs.append((False, f"fewer than 2^31 elements in every depthwise conv's input (data.batch_size="
                             f"{cfg.data.batch_size} at data.resolution={cfg.data.resolution} gives {largest:,})"))
    elem = 2 if cfg.amp else 4
    for (c, h), (_, stride) in zip(inputs, BLOCKS):
        if not column_walk_offsets_fit(h, h, (h - 1) // stride + 1, 1, c, elem):
            needs.append((False, f"an image of each depthwise input within 2^31 words (data.resolution="
                                 f"{cfg.data.resolution} gives {c}x{h}x{h})"))
            break
    return needs

APPLY_IN_DEPTHWISE_MODES = ("auto", "true", "false")


def apply_in_depthwise_state(cfg) -> tuple[bool, str]:
    """(apply each BatchNorm + ReLU before a depthwise conv in that conv's kernels, the summary's words) for
    norm.apply_in_depthwise. auto: on wherever it can run; true with a blocker is a ConfigError: nothing is silently
    left off."""
    mode = _switch_mode(cfg, "apply_in_depthwise")
    if mode == "false":
        return False, "norm.apply_in_depthwise=false"
    needs = [*custom_pair_needs(cfg),
             (bool(cfg.channels_last), "channels_last=true (the depthwise kernels that apply it are NHWC)"),
             (not cfg.sync_bn, "sync_bn=false (the statistics would be this rank's only)"),
             (not cfg.compile, "compile=false (it runs eagerly or captured in a CUDA graph)"),
             (not cfg.norm.stats_from_depthwise,
              "norm.stats_from_depthwise=false (that walk reads the normalized input this one never writes)")]
    needs += _depthwise_shape_needs(cfg)
    return _switch_state("norm.apply_in_depthwise", mode, needs)


def _switch_state(switch: str, mode: str, needs: list[tuple[bool, str]]) -> tuple[bool, str]:
    """(on, the summary's words) for an auto|true|false fusion switch whose `needs` are (holds, what it needs):
    auto is on where every need holds; true with a need that does not is a ConfigError."""
    missing = [what for ok, what in needs if not ok]
    if missing and mode == "true":
        raise ConfigError(f"{switch}=true needs {', '.join(missing)}; or set {switch}=auto (on where it can run, and "
                          "the summary says which) or false")
    if missing:
        return False, f"{switch}=auto: off, it needs {', '.join(missing)}"
    return True, f"{switch}={mode}"


def _switch_mode(cfg, key: str) -> str:
    value = getattr(cfg.norm, key)
    mode = str(value).lower()  # Hydra hands `=true` over as a bool
    if mode not in APPLY_IN_DEPTHWISE_MODES:
        raise ConfigError(f"norm.{key}={value!r} is not a choice; choose one of: {', '.join(APPLY_IN_DEPTHWISE_MODES)}")
    return mode


# --- norm.apply_in_pointwise: which runs apply each BatchNorm + ReLU before a pointwise conv in cuDNN's fused ones --

def pointwise_channels(width_mult: float) -> list[tuple[int, int]]:
    """(input, output channels) of the 13 pointwise convs."""
    channels, out = _scaled(STEM_CHANNELS, width_mult), []
    for block_out, _ in BLOCKS:
        out.append((channels, _scaled(block_out, width_mult)))
        channels = _scaled(block_out, width_mult)
    return out


def apply_in_pointwise_state(cfg) -> tuple[bool, str]:
    """(apply each BatchNorm + ReLU before a pointwise conv in cuDNN's fused convolutions, the summary's words) for
    norm.apply_in_pointwise, as apply_in_depthwise_state does for the depthwise convs."""
    mode = _switch_mode(cfg, "apply_in_pointwise")
    if mode == "false":
        return False, "norm.apply_in_pointwise=false"
    odd = list(dict.fromkeys(f"{a}->{b}" for a, b in pointwise_channels(cfg.model.width_mult) if a % 8 or b % 8))
    missing_frontend = cudnn_frontend_missing()
    needs = [(cfg.norm.name == "custom", f"norm=custom (got {cfg.norm.name})"),
             (bool(cfg.channels_last), "channels_last=true (cuDNN's fused convolutions are NHWC)"),
             (bool(cfg.amp) and enum_value(cfg.amp_dtype) == "fp16",
              "amp=true amp_dtype=fp16 (the fused convolutions' scale and shift operands are in the input's dtype, "
              "too coarse in bf16)"),
             (not cfg.sync_bn, "sync_bn=false (the statistics would be this rank's only)"),
             (not cfg.compile, "compile=false (it runs eagerly or captured in a CUDA graph)"),
             (not cfg.norm.stats_from_depthwise,
              "norm.stats_from_depthwise=false (that pair writes the normalized output this one never reads)"),
             (not odd, f"pointwise channel counts that are multiples of 8 (model.width_mult={cfg.model.width_mult} "
                       f"gives {', '.join(odd)})"),
             (missing_frontend is None, missing_frontend or "")]
    return _switch_state("norm.apply_in_pointwise", mode, needs)


STEM_WEIGHT_GRADS = ("cudnn", "custom")


def stem_weight_grad_needs(cfg, device: torch.device, dtype: torch.dtype) -> list[tuple[bool, str]]:
    """(holds, what it needs) of model.stem_weight_grad=custom for this run, whose convolutions compute in `dtype`:
    the kernel's conditions (kernels/stem_args.py) as the config decides them, checked before any work."""
    channels = _scaled(STEM_CHANNELS, cfg.model.width_mult)
    per_vector = channels_per_vector(dtype)
    return [(device.type == "cuda", f"a CUDA GPU (this run's device is {device.type})"),
            (bool(cfg.channels_last), "channels_last=true (the kernel reads the images NHWC)"),
            (channels % per_vector == 0,
             f"stem output channels in whole 16-byte vectors, a multiple of {per_vector} "
             f"{'under amp' if cfg.amp else 'in fp32'} (model.width_mult={cfg.model.width_mult} gives {channels})")]


class StemConv2d(nn.Conv2d):
    """The stem's convolution (bias-free) with this project's weight-gradient kernel in training
    (kernels/stem_ops.py; the forward is cuDNN's either way), for model.stem_weight_grad=custom; the default, cudnn,
    keeps a plain nn.Conv2d. The same parameters, so the same state_dict. Eval, and a weight without gradient, run
    nn.Conv2d's forward."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int):
        super().__init__(in_ch, out_ch, kernel_size, stride, padding=kernel_size // 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.weight.requires_grad and torch.is_grad_enabled():
            from kernels.stem_ops import stem_conv2d  # builds/loads the extension: only where it is asked for

            return stem_conv2d(x, self.weight, self.stride, self.padding)
        return super().forward(x)


class ConvBNReLU(nn.Sequential):
    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int, norm: str = "torch",
                 custom_weight_grad: bool = False):
        conv = (StemConv2d(in_ch, out_ch, kernel_size, stride) if custom_weight_grad else
                nn.Conv2d(in_ch, out_ch, kernel_size, stride, padding=kernel_size // 2, bias=False))
        super().__init__(conv, get_norm(norm).norm_relu(out_ch))


class DepthwiseSeparable(nn.Sequential):
    """3x3 depthwise conv + BN + ReLU, then 1x1 pointwise conv + BN + ReLU.

    stats_from_depthwise: the depthwise conv and its BatchNorm run as one pair whose batch statistics come from the
    depthwise kernel (mobilenet/norm.py depthwise_norm_relu); the same modules, so the same state_dict."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, backend: str, norm: str = "torch",
                 stats_from_depthwise: bool = False):
        super().__init__(
            DepthwiseConv2d(in_ch, 3, stride, padding=1, backend=backend),
            get_norm(norm).norm_relu(in_ch),
            # The slot the separate ReLU had: keeps the pointwise block at index 3, so state_dict keys (and checkpoints)
            # are those of the [dw, bn, relu, pointwise] layout.
            nn.Identity(),
            ConvBNReLU(in_ch, out_ch, 1, 1, norm),
        )
        if stats_from_depthwise:
            check_stats_from_depthwise(self[0], self[1])
        self.stats_from_depthwise = stats_from_depthwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.stats_from_depthwise:
            return super().forward(x)
        depthwise, norm_relu, relu_slot, pointwise = self
        return pointwise(relu_slot(depthwise_norm_relu(depthwise, norm_relu, x)))


class _SpatialMean(torch.autograd.Function):
    """x.mean((2, 3)) whose gradient comes back in x's memory format. Autograd's own backward (an expand divided by
    H*W) is NCHW-contiguous even for a channels_last x, so the last BatchNorm's backward had to transpose it: one
    strided copy per step, 61 us on an H200 at batch 256. Same values, bitwise: the same mean, the same division."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        ctx.memory_format = (torch.channels_last if x.dim() == 4 and not x.is_contiguous()
                             and x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format)
        return x.mean((2, 3))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        n, c, h, w = ctx.shape
        out = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device, memory_format=ctx.memory_format)
        return out.copy_((grad / (h * w))[:, :, None, None].expand(n, c, h, w))


class GlobalAvgPool(nn.Module):
    """Global average pooling and flatten: (N, C, H, W) -> (N, C), the gradient in the input's memory format."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad:
            return x.mean((2, 3))
        return _SpatialMean.apply(x)


class MobileNetV1(nn.Module):
    """apply_norm_in_depthwise: in training, each BatchNorm + ReLU that feeds a depthwise conv (the stem's and the
    first 12 pointwise blocks') is applied by that conv's kernels as they load their input (mobilenet/norm.py
    norm_relu_depthwise). apply_norm_in_pointwise: likewise each BatchNorm + ReLU that feeds a pointwise conv (the 13
    after the depthwise convs), applied by cuDNN's fused convolutions (norm_relu_pointwise). stats_from_pointwise:
    with it, the BatchNorm after each of those convs takes its statistics from the sums cuDNN computed from the conv's
    output (not bitwise repeatable: cuDNN adds them with atomics) instead of its own pass. The same modules either
    way, so the same state_dict. Eval runs the layers one by one."""

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, depthwise: str = "torch", dropout: float = 0.0,
                 norm: str = "torch", stats_from_depthwise: bool = False, apply_norm_in_depthwise: bool = False,
                 apply_norm_in_pointwise: bool = False, stem_weight_grad: str = "cudnn",
                 stats_from_pointwise: bool = False):
        super().__init__()
        if stats_from_pointwise and not apply_norm_in_pointwise:
            raise ValueError("stats_from_pointwise takes the sums of the fused pointwise convs: it needs "
                             "apply_norm_in_pointwise")
        for name, on in (("apply_norm_in_depthwise", apply_norm_in_depthwise),
                         ("apply_norm_in_pointwise", apply_norm_in_pointwise)):
            if stats_from_depthwise and on:
                raise ValueError(f"stats_from_depthwise and {name} cannot both be on: the depthwise conv and its "
                                 "BatchNorm then run as one pair that writes the normalized output")
        if not 0 < width_mult <= 4:
            raise ValueError(f"model.width_mult must be in (0, 4] (the paper uses 0.25, 0.5, 0.75, 1.0), got {width_mult}")
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.depthwise_backend = depthwise
        self.norm = get_norm(norm).name
        if stem_weight_grad not in STEM_WEIGHT_GRADS:
            raise ValueError(f"unknown model.stem_weight_grad {stem_weight_grad!r}; choose one of: "
                             f"{', '.join(STEM_WEIGHT_GRADS)}")
        # cudnn: a plain nn.Conv2d, so the default model holds no module of this project in its stem.
        stem = ConvBNReLU(3, _scaled(STEM_CHANNELS, width_mult), 3, 2, norm,
                          custom_weight_grad=stem_weight_grad == "custom")
        layers: list[nn.Module] = [stem]
        in_ch = _scaled(STEM_CHANNELS, width_mult)
        for out, stride in BLOCKS:
            out_ch = _scaled(out, width_mult)
            layers.append(DepthwiseSeparable(in_ch, out_ch, stride, depthwise, norm, stats_from_depthwise))
            in_ch = out_ch
        self.features = nn.Sequential(*layers)
        self.apply_norm_in_depthwise = apply_norm_in_depthwise
        if apply_norm_in_depthwise:
            for producer, block in zip(self.features[:-1], self.features[1:]):
                check_apply_in_depthwise(self._last_norm(producer), block[0])
        self.apply_norm_in_pointwise = apply_norm_in_pointwise
        self.stats_from_pointwise = stats_from_pointwise
        if apply_norm_in_pointwise:
            for block in self.features[1:]:
                check_apply_in_pointwise(block[1], block[3][0])
        self.pool = GlobalAvgPool()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.classifier = nn.Linear(in_ch, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, DepthwiseConv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    @staticmethod
    def _last_norm(layer: nn.Module) -> nn.Module:
        """The BatchNorm + ReLU that ends the stem or a depthwise-separable block."""
        return layer[1] if isinstance(layer, ConvBNReLU) else layer[3][1]

    def _features_norm_in_next_conv(self, x: torch.Tensor) -> torch.Tensor:
        """self.features(x) with each BatchNorm + ReLU applied by the conv after it where its switch is on: y is the
        pre-normalization output of the conv before, `pending` the BatchNorm + ReLU still to apply to it."""
        stem_conv, pending = self.features[0]
        y, sums = stem_conv(x), None  # sums: y's per-channel sums where the conv that wrote it returned them
        # MBN_DEPTHWISE_BACKWARD=next_norm (every layer) or next_norm_ring (the default: the layers whose backward runs
        # from the rings of rows): the BatchNorm after the depthwise conv joins the pair, whose backward kernel then
        # applies that BatchNorm's input gradient; with the pointwise fusion, the pointwise conv that applies that
        # BatchNorm in the forward joins them too.
        next_norm = self.apply_norm_in_depthwise and depthwise_backward_mode() in NEXT_NORM_MODES
        for block in self.features[1:]:
            depthwise, norm_relu, relu_slot, (pointwise_conv, next_pending) = block
            if next_norm and next_norm_in(depthwise, y):
                if self.apply_norm_in_pointwise:
                    y, sums = norm_relu_depthwise_norm_relu_pointwise(pending, depthwise, norm_relu, pointwise_conv, y,
                                                                      sums)
                    if not self.stats_from_pointwise:
                        sums = None  # as below
                else:
                    y = pointwise_conv(relu_slot(norm_relu_depthwise_norm_relu(pending, depthwise, norm_relu, y, sums)))
                pending = next_pending
                continue
            if self.apply_norm_in_depthwise:
                y = norm_relu_depthwise(pending, depthwise, y, sums)
            else:
                y = depthwise(pending(y))
            if self.apply_norm_in_pointwise:
                y, sums = norm_relu_pointwise(norm_relu, pointwise_conv, y)
                if not self.stats_from_pointwise:
                    sums = None  # the next BatchNorm's own statistics pass: fixed-order sums, bitwise repeatable
            else:
                y = pointwise_conv(relu_slot(norm_relu(y)))
            pending = next_pending
        return pending(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.apply_norm_in_depthwise or self.apply_norm_in_pointwise) and self.training:
            x = self._features_norm_in_next_conv(x)
        else:
            x = self.features(x)
        x = self.pool(x)
        return self.classifier(self.dropout(x))


def build_model(name: str, num_classes: int, width_mult: float, depthwise: str, dropout: float = 0.0,
                norm: str = "torch", stats_from_depthwise: bool = False,
                apply_norm_in_depthwise: bool = False, apply_norm_in_pointwise: bool = False,
                stem_weight_grad: str = "cudnn", stats_from_pointwise: bool = False) -> nn.Module:
    if name != "mobilenet_v1":
        raise ValueError(f"unknown model {name!r}; choose one of: mobilenet_v1")
    return MobileNetV1(num_classes=num_classes, width_mult=width_mult, depthwise=depthwise, dropout=dropout, norm=norm,
                       stats_from_depthwise=stats_from_depthwise, apply_norm_in_depthwise=apply_norm_in_depthwise,
                       apply_norm_in_pointwise=apply_norm_in_pointwise, stem_weight_grad=stem_weight_grad,
                       stats_from_pointwise=stats_from_pointwise)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module, resolution: int) -> int:
    """Multiply-adds of one image's forward pass, from PyTorch's own FLOP counter (FLOPs = 2 x MACs)."""
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.eval()
    param = next(model.parameters())
    x = torch.zeros(1, 3, resolution, resolution, device=param.device, dtype=param.dtype)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    model.train(was_training)
    return counter.get_total_flops() // 2
