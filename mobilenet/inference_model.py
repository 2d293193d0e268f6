"""A trained MobileNetV1 made lean for inference: every BatchNorm folded into the convolution before it, bias and
ReLU computed in the convolution's epilogue where a fused kernel exists, weights stored once in the run's dtype.

Why: in eval mode a BatchNorm is a per-channel scale and shift, so it costs a full read and write of every
activation for arithmetic the convolution could have done on its weights. Folding removes those passes, fused
epilogues remove the ReLU passes, and weights kept in the run's dtype remove autocast's per-call weight casts.

Which kernel runs each convolution (`Epilogue`), and why:
- depthwise, backend=custom: this project's kernel with bias and ReLU in its epilogue;
- depthwise, backend=cudnn: cuDNN's fused convolution-bias-activation (torch.cudnn_convolution_relu);
- depthwise, backend=torch: F.conv2d, then a separate ReLU (PyTorch has no fused depthwise conv + ReLU);
- stem and 1x1 convolutions (the same for every backend, so backend comparisons stay fair): cuDNN's fused
  convolution-bias-activation. A channels_last 1x1 convolution is also a matrix product over pixels, which cuBLASLt
  runs with its bias+ReLU epilogue (torch._addmm_activation, CUBLASLT_FUSED); cuDNN measured faster for the whole
  model, and a separate ReLU far slower. docs/inference.md has the measurements behind these choices.
With `fused_epilogue` off (or on a CPU, where none of these kernels exist), every convolution runs with its bias and
then a separate ReLU, so the fused epilogue's gain can be measured on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .depthwise import DepthwiseConv2d, get_backend
from .errors import ConfigError
from .norm import applies_relu

EPILOGUE_MODES = ("auto", "true", "false")


def fold_batchnorm(weight: Tensor, bias: Tensor | None, bn: _BatchNorm) -> tuple[Tensor, Tensor]:
    """(weight', bias') of conv followed by eval-mode `bn`, computed in float64: bn(conv(x, w) + b) = conv(x, w') + b'.
    The result is float64; the caller stores it in the run's dtype, rounding once."""
    w = weight.detach().double()
    mean = bn.running_mean.detach().double()
    var = bn.running_var.detach().double()
    gamma = bn.weight.detach().double() if bn.weight is not None else torch.ones_like(mean)
    beta = bn.bias.detach().double() if bn.bias is not None else torch.zeros_like(mean)
    scale = gamma / torch.sqrt(var + bn.eps)
    b = bias.detach().double() if bias is not None else torch.zeros_like(mean)
    return w * scale.view(-1, *([1] * (w.dim() - 1))), (b - mean) * scale + beta


# --- the kernels a folded convolution can run ------------------------------------------------------------------


def _conv(x: Tensor, w: Tensor, b: Tensor, stride, padding, groups: int) -> Tensor:
    return F.conv2d(x, w, b, stride, padding, 1, groups)


def _cudnn_depthwise(x: Tensor, w: Tensor, b: Tensor, stride, padding, groups: int) -> Tensor:
    # backend=cudnn's own call: cuDNN in every dtype and layout, where F.conv2d would pick PyTorch's native kernel
    # for some NCHW cases.
    return get_backend("cudnn").conv2d(x, w, b, stride, padding, (1, 1))


def _cudnn_conv_bias_relu(x: Tensor, w: Tensor, b: Tensor, stride, padding, groups: int) -> Tensor:
    return torch.cudnn_convolution_relu(x, w, b, stride, padding, (1, 1), groups)


def _custom_depthwise_bias_relu(x: Tensor, w: Tensor, b: Tensor, stride, padding, groups: int) -> Tensor:
    from kernels.ops import depthwise_conv2d

    return depthwise_conv2d(x, w, b, stride, padding, activation="relu")


def _custom_depthwise(x: Tensor, w: Tensor, b: Tensor, stride, padding, groups: int) -> Tensor:
    from kernels.ops import depthwise_conv2d

    return depthwise_conv2d(x, w, b, stride, padding)


# Taller products are split into row blocks: PyTorch hands cuBLASLt (whose epilogue adds the bias and applies the
# ReLU) only products below a size limit; with blocks of 2^20 rows the H200 profile shows cuBLASLt's bias-ReLU kernel
# for every 1x1 layer.
_LT_MAX_ROWS = 1 << 20


def _cublaslt_pointwise_bias_relu(x: Tensor, w: Tensor, b: Tensor, stride, padding, groups: int) -> Tensor:
    # A channels_last (N, C, H, W) tensor is an (N*H*W, C) row-major matrix: the 1x1 convolution is x @ w^T, and the
    # (N*H*W, K) result viewed back is channels_last again. No copy either way.
    n, c, h, wd = x.shape
    if not x.is_contiguous(memory_format=torch.channels_last):
        raise ValueError("the cuBLASLt 1x1 convolution needs a channels_last input (the model was built for "
                         "channels_last=true)")
    rows = x.permute(0, 2, 3, 1).reshape(n * h * wd, c)
    wt = w.view(w.shape[0], c).t()
    if rows.shape[0] <= _LT_MAX_ROWS:
        out = torch._addmm_activation(b, rows, wt)
    else:
        out = rows.new_empty(rows.shape[0], w.shape[0])
        for start in range(0, rows.shape[0], _LT_MAX_ROWS):
            block = slice(start, start + _LT_MAX_ROWS)
            torch._addmm_activation(b, rows[block], wt, out=out[block])
    return out.view(n, h, wd, -1).permute(0, 3, 1, 2)


@dataclass(frozen=True)
class Epilogue:
    """How one folded convolution runs: its kernel, and the words the summary uses for it."""

    label: str
    run: Callable[..., Tensor]
    # The kernel already applies the ReLU (otherwise FoldedConv runs a separate one after it).
    fused: bool


CONV_THEN_RELU = Epilogue("conv + separate ReLU", _conv, fused=False)
CUDNN_FUSED = Epilogue("cuDNN conv-bias-ReLU", _cudnn_conv_bias_relu, fused=True)
CUBLASLT_FUSED = Epilogue("cuBLASLt GEMM + bias-ReLU epilogue", _cublaslt_pointwise_bias_relu, fused=True)
CUSTOM_FUSED = Epilogue("custom kernel, bias-ReLU epilogue", _custom_depthwise_bias_relu, fused=True)
CUSTOM_THEN_RELU = Epilogue("custom kernel + separate ReLU", _custom_depthwise, fused=False)
CUDNN_THEN_RELU = Epilogue("cuDNN conv + separate ReLU", _cudnn_depthwise, fused=False)


def depthwise_epilogue(backend: str, fused: bool) -> Epilogue:
    if backend == "custom":
        return CUSTOM_FUSED if fused else CUSTOM_THEN_RELU
    if backend == "cudnn":
        # cuDNN's fused conv-bias-ReLU runs grouped convolutions on a slow engine, several times slower for the
        # whole model than cuDNN's depthwise convolution and a separate ReLU (docs/inference.md), so backend=cudnn
        # keeps the ReLU separate.
        return CUDNN_THEN_RELU
    return CONV_THEN_RELU  # backend=torch: F.conv2d, PyTorch's own choice of kernel, has no fused form


def dense_epilogue(fused: bool) -> Epilogue:
    # cuDNN's fused conv-bias-ReLU is the fastest form of the 1x1 layers and the stem, ahead of cuBLASLt's bias-ReLU
    # epilogue and well ahead of a separate ReLU (docs/inference.md, the kernel behind each layer kind).
    return CUDNN_FUSED if fused else CONV_THEN_RELU


class FoldedConv(nn.Module):
    """conv(x, w') + b' then ReLU, with BatchNorm folded into (w', b'); the weights are buffers in the run's dtype."""

    def __init__(self, weight: Tensor, bias: Tensor, stride, padding, groups: int, epilogue: Epilogue, relu: bool = True):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.stride = tuple(stride)
        self.padding = tuple(padding)
        self.groups = groups
        self.epilogue = epilogue
        self.relu = relu
        if relu is False and epilogue.fused:
            raise ValueError("a fused bias-ReLU epilogue was given for a convolution without ReLU")

    @property
    def depthwise(self) -> bool:
        return self.groups > 1

    def forward(self, x: Tensor) -> Tensor:
        y = self.epilogue.run(x, self.weight, self.bias, self.stride, self.padding, self.groups)
        return y if self.epilogue.fused or not self.relu else torch.relu_(y)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[1] * self.groups}->{self.weight.shape[0]}, kernel={tuple(self.weight.shape[2:])}, "
                f"stride={self.stride}, {self.epilogue.label}, {self.weight.dtype}")


class InferenceMobileNet(nn.Module):
    """The folded network: FoldedConv layers, global average pool, classifier, all in one dtype."""

    def __init__(self, convs: list[FoldedConv], classifier: nn.Linear, memory_format: torch.memory_format):
        super().__init__()
        self.features = nn.Sequential(*convs)
        self.classifier = classifier
        self.memory_format = memory_format

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        return self.classifier(x.mean((2, 3)))

    def epilogues(self) -> dict[str, str]:
        """What runs each kind of layer, for the summary: {"stem": ..., "depthwise": ..., "pointwise": ...}."""
        kinds: dict[str, set[str]] = {}
        for i, conv in enumerate(self.features):
            kind = "stem" if i == 0 else ("depthwise" if conv.depthwise else "pointwise")
            kinds.setdefault(kind, set()).add(conv.epilogue.label)
        return {k: ", ".join(sorted(v)) for k, v in kinds.items()}


def _conv_bn_relu_triples(model: nn.Module) -> list[tuple[nn.Module, _BatchNorm, bool]]:
    """(conv, batchnorm, relu follows) for each convolution of model.features, in order. A norm module with
    `fused_relu` applies the ReLU itself (mobilenet/norm.py)."""
    # Identity: a slot kept so that state_dict keys stay those of the [conv, bn, relu] layout (model.py).
    leaves = [m for m in model.features.modules() if not isinstance(m, (nn.Sequential, nn.Identity))]
    triples = []
    i = 0
    while i < len(leaves):
        conv = leaves[i]
        if not isinstance(conv, (nn.Conv2d, DepthwiseConv2d)):
            raise ConfigError(f"fold_bn: expected a convolution at position {i} of the model's features, found "
                             f"{type(conv).__name__}; only MobileNetV1's conv -> BatchNorm -> ReLU layers can be folded")
        bn = leaves[i + 1] if i + 1 < len(leaves) else None
        if not isinstance(bn, _BatchNorm):
            raise ConfigError(f"fold_bn: the convolution at position {i} is not followed by a BatchNorm")
        relu = applies_relu(bn)
        i += 2
        if not relu and i < len(leaves) and isinstance(leaves[i], nn.ReLU):
            relu = True
            i += 1
        if not relu:
            raise ConfigError(f"fold_bn: the BatchNorm at position {i - 1} is not followed by a ReLU")
        triples.append((conv, bn, relu))
    return triples


def _conv_geometry(conv: nn.Module) -> tuple[tuple, tuple, int, Tensor | None]:
    if isinstance(conv, DepthwiseConv2d):
        if conv.dilation != (1, 1):
            raise ConfigError(f"fold_bn: dilated depthwise convolutions are not supported ({conv.dilation})")
        return conv.stride, conv.padding, conv.weight.shape[0], conv.bias
    if conv.dilation != (1, 1) or not isinstance(conv.padding, tuple):
        raise ConfigError(f"fold_bn: only undilated convolutions with numeric padding are supported ({conv})")
    return conv.stride, conv.padding, conv.groups, conv.bias


def resolve_epilogue(mode, device: torch.device) -> tuple[bool, str]:
    """(fuse or not, why) for `fused_epilogue=auto|true|false`; `true` where no fused kernel exists is an error."""
    value = str(mode).lower()
    if value not in EPILOGUE_MODES:
        raise ConfigError(f"fused_epilogue={mode!r} is not a choice; choose one of: {', '.join(EPILOGUE_MODES)}")
    if value == "false":
        return False, "off (fused_epilogue=false)"
    if device.type != "cuda":
        if value == "true":
            raise ConfigError(f"fused_epilogue=true needs a CUDA GPU (the fused kernels are cuDNN's, cuBLASLt's and this "
                             f"project's), but the run's device is {device.type}; use fused_epilogue=auto or false")
        return False, f"off (fused_epilogue=auto: the run's device is {device.type}, which has no fused kernels here)"
    return True, f"on (fused_epilogue={value})"


@torch.no_grad()
def build_inference_model(model: nn.Module, dtype: torch.dtype, channels_last: bool, fused: bool,
                          kernels: dict[str, Epilogue] | None = None) -> InferenceMobileNet:
    """The folded, lean copy of a MobileNetV1 (the model itself is left as it is). Weights are folded in float64 and
    stored once in `dtype`; `fused` picks the fused-epilogue kernels (see the module docstring). `kernels` runs the
    "stem", "depthwise" or "pointwise" layers with another kernel, to measure the alternatives
    (scripts/bench_inference.py)."""
    kernels = kernels or {}
    if not hasattr(model, "features") or not hasattr(model, "classifier"):
        raise ConfigError(f"fold_bn: {type(model).__name__} is not this project's MobileNetV1; use fold_bn=false")
    device = model.classifier.weight.device
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    backend = getattr(model, "depthwise_backend", "torch")
    get_backend(backend)  # an unknown name is an error here too, not a silent torch path
    convs = []
    for i, (conv, bn, relu) in enumerate(_conv_bn_relu_triples(model)):
        stride, padding, groups, bias = _conv_geometry(conv)
        w, b = fold_batchnorm(conv.weight, bias, bn)
        kind = "stem" if i == 0 else ("depthwise" if groups > 1 else "pointwise")
        if kind in kernels:
            epilogue = kernels[kind]
        elif groups > 1:
            epilogue = depthwise_epilogue(backend, fused)
        else:
            epilogue = dense_epilogue(fused)
        weight = w.to(device, dtype).contiguous(memory_format=fmt)
        convs.append(FoldedConv(weight, b.to(device, dtype), stride, padding, groups, epilogue, relu))
    fc = model.classifier
    classifier = nn.Linear(fc.in_features, fc.out_features, device=device, dtype=dtype)
    classifier.weight.copy_(fc.weight)
    classifier.bias.copy_(fc.bias)
    folded = InferenceMobileNet(convs, classifier, fmt).eval()
    folded.requires_grad_(False)
    return folded


def onnx_export_form(model: InferenceMobileNet) -> InferenceMobileNet:
    """The same folded network with every convolution as a standard conv + ReLU (the custom depthwise kernel becomes
    a grouped Conv), so that an exporter sees only standard operators. Shares the weights."""
    convs = [FoldedConv(c.weight, c.bias, c.stride, c.padding, c.groups, CONV_THEN_RELU, c.relu) for c in model.features]
    return InferenceMobileNet(convs, model.classifier, model.memory_format).eval()
