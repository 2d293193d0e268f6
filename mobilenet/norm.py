"""BatchNorm + ReLU implementations: the one place where a normalization layer picks its implementation.

model.py builds every BatchNorm-then-ReLU pair as one `norm_relu(channels)` module looked up here by the name the
user typed (`norm=torch|custom|apex`). A norm that cannot run here raises `NormUnavailable` and the run stops:
nothing falls back to another implementation.

Every module returned is an instance of an nn.BatchNorm2d subclass with nn.BatchNorm2d's parameters, buffers and
state_dict keys, plus the class attribute `fused_relu = True` ("this module applies the ReLU itself"). That keeps
checkpoints interchangeable across `norm` values and with the older [conv, BatchNorm2d, ReLU] layout (the ReLU had
no state), and lets BatchNorm folding, param groups and SyncBatchNorm conversion find the layers by type.

Under sync_bn=true, convert_sync_batchnorm turns norm=torch modules into SyncBatchNormReLU (nn.SyncBatchNorm) and
norm=custom modules into SyncCustomBatchNormReLU (the fused kernels with the statistics and gradient sums of every
rank); norm=apex is refused.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .depthwise import BackendUnavailable
from .errors import ConfigError
from .registry import Registry

__all__ = [
    "NormUnavailable", "NormImpl", "register_norm", "available_norms", "get_norm", "applies_relu",
    "TorchBatchNormReLU", "CustomBatchNormReLU", "ApexBatchNormReLU", "SyncBatchNormReLU", "SyncCustomBatchNormReLU",
    "combine_rank_statistics", "convert_sync_batchnorm", "sync_bn_state", "check_stats_from_depthwise",
    "running_update_label", "check_ab_environment",
    "depthwise_norm_relu", "check_apply_in_depthwise", "norm_relu_depthwise", "norm_relu_depthwise_norm_relu",
    "depthwise_backward_mode",
    "custom_pair_needs",
    "check_apply_in_pointwise", "norm_relu_pointwise", "norm_relu_depthwise_norm_relu_pointwise",
]

APEX_INSTALL = (
    "build NVIDIA apex from source with the groupbn extension, beside the project (never committed): "
    "git clone https://github.com/NVIDIA/apex && cd apex && "
    "pip install -v --no-build-isolation --no-cache-dir --config-settings '--build-option=--cpp_ext' "
    "--config-settings '--build-option=--cuda_ext' --config-settings '--build-option=--bnp' ./ "
    "(the flags are --cpp_ext --cuda_ext --bnp), or use norm=torch|custom"
)


class NormUnavailable(BackendUnavailable):
    """The requested norm cannot run here (no CUDA, no kernels, apex missing, unsupported input).

    A subclass of depthwise.BackendUnavailable, so callers that stop a run on an unavailable backend catch both."""


@dataclass(frozen=True)
class NormImpl:
    name: str
    description: str
    # Raises NormUnavailable when this norm cannot run on `device`.
    check: Callable[[torch.device], None]
    # norm_relu(channels) -> a module computing ReLU(BatchNorm2d(x)); constructing it needs no GPU.
    norm_relu: Callable[[int], nn.BatchNorm2d]


_REGISTRY: Registry[NormImpl] = Registry("norm")


def running_update_label(cfg, distributed: bool) -> str | None:
    """Where norm=custom updated the running statistics in this run (the summary's row), None for other norms."""
    if cfg.norm.name != "custom":
        return None
    if cfg.sync_bn and distributed:
        return "a kernel of its own (sync_bn: from every rank's statistics)"
    if cfg.compile:
        return "a kernel of its own (torch.compile runs the functional ops)"
    if _running_update_mode() == "separate":
        return "a kernel of its own (MBN_RUNNING_UPDATE=separate)"
    where = "in the forward op's finalize kernel"
    if cfg.norm.stats_from_depthwise:
        return where + " (a kernel of its own after each depthwise conv, whose statistics it takes)"
    return where


def custom_pair_needs(cfg) -> list[tuple[bool, str]]:
    """(holds, what it needs) for the switches that fuse a depthwise conv with a norm=custom BatchNorm."""
    return [(cfg.backend.name == "custom", f"backend=custom (got {cfg.backend.name})"),
            (cfg.norm.name == "custom", f"norm=custom (got {cfg.norm.name})")]


@functools.cache
def _running_update_mode() -> str:
    """norm=custom's running-statistics update: "fused" into the forward op, or "separate" (its own op after it),
    read once per process at the first training forward, for A/B runs of the two (docs/kernels.md)."""
    mode = os.environ.get("MBN_RUNNING_UPDATE", "fused")
    if mode not in ("fused", "separate"):
        raise ConfigError(f"MBN_RUNNING_UPDATE must be fused or separate, got {mode!r}; unset it for the default "
                          "(fused)")
    return mode


DEPTHWISE_BACKWARD_MODES = ("sums", "next_norm", "next_norm_ring", "walk", "separate")
NEXT_NORM_MODES = ("next_norm", "next_norm_ring")
SUMS_MODES = ("sums",) + NEXT_NORM_MODES  # the modes whose backward kernels give the BatchNorm's gradient sums
DEFAULT_DEPTHWISE_BACKWARD = "next_norm_ring"


@functools.cache
def depthwise_backward_mode() -> str:
    """The backward of norm.apply_in_depthwise's pairs, read once per process at the first training forward, for A/B
    runs (docs/kernels.md): "sums", one kernel gives both gradients of a depthwise conv (stride 1 or 2)
    and the gradient sums of the BatchNorm before it, whose backward then skips its reduce pass; "next_norm", "sums"
    and the BatchNorm + ReLU after the depthwise conv too, whose input gradient that kernel applies as it loads the
    gradient (with norm.apply_in_pointwise, the pointwise conv that applies that BatchNorm joins them:
    norm_relu_depthwise_norm_relu_pointwise; measured slower in every layer, so not the default); "next_norm_ring" (the default: measured fastest, docs/kernels.md), "next_norm" only in the layers whose
    stride-1 backward runs from the rings of rows (MDW_BWD_RING_NORM; 16-bit), which apply that input gradient once
    per word in shared memory, and "sums" elsewhere (every layer in fp32, where the rings are off by default);
    "walk", the stride-1 kernel without the sums (stride 2 as "separate"); "separate", the conv's input and weight
    gradients as two kernels, each reading the output gradient."""
    mode = os.environ.get("MBN_DEPTHWISE_BACKWARD", DEFAULT_DEPTHWISE_BACKWARD)
    if mode not in DEPTHWISE_BACKWARD_MODES:
        raise ConfigError(f"MBN_DEPTHWISE_BACKWARD must be one of {', '.join(DEPTHWISE_BACKWARD_MODES)}, got "
                          f"{mode!r}; unset it for the default ({DEFAULT_DEPTHWISE_BACKWARD})")
    return mode


NORM_INPUT_GRAD_MODES = ("pass", "dgrad")


@functools.cache
def norm_input_grad_mode() -> str:
    """Where the input gradient of the BatchNorm + ReLU before a depthwise conv is computed, in the layers whose
    backward kernel gives that BatchNorm's gradient sums and does not apply the next BatchNorm (MBN_DEPTHWISE_BACKWARD
    sums, or next_norm_ring outside the rings), read once per process, for A/B runs: "pass" (the default), the
    conv's input gradient written by that kernel, then the BatchNorm's own input-gradient pass over it and y;
    "dgrad", that kernel gives only the sums and the weight gradient, and the input-gradient kernel computes the
    BatchNorm's input gradient from the output gradient, so the conv's input gradient is never written or read
    back (kernels/norm_depthwise.py)."""
    mode = os.environ.get("MBN_NORM_INPUT_GRAD", "pass")
    if mode not in NORM_INPUT_GRAD_MODES:
        raise ConfigError(f"MBN_NORM_INPUT_GRAD must be one of {', '.join(NORM_INPUT_GRAD_MODES)}, got {mode!r}; "
                          "unset it for the default (pass)")
    if mode == "dgrad" and depthwise_backward_mode() not in SUMS_MODES:
        raise ConfigError(f"MBN_NORM_INPUT_GRAD=dgrad needs the gradient sums of the depthwise backward kernels "
                          f"(MBN_DEPTHWISE_BACKWARD=sums, next_norm or next_norm_ring), got "
                          f"MBN_DEPTHWISE_BACKWARD={depthwise_backward_mode()}")
    return mode


def check_ab_environment(cfg) -> None:
    """The A/B variables norm=custom reads (MBN_RUNNING_UPDATE, MBN_DEPTHWISE_BACKWARD, MBN_NORM_INPUT_GRAD): a
    ConfigError naming the choices for a value that is none of them, before any work, rather than at the first
    training step."""
    if cfg.norm.name == "custom":
        _running_update_mode()
        depthwise_backward_mode()
        norm_input_grad_mode()


def register_norm(impl: NormImpl) -> NormImpl:
    return _REGISTRY.register(impl.name, impl)


def available_norms() -> list[str]:
    return _REGISTRY.names()


def get_norm(name: str) -> NormImpl:
    return _REGISTRY.get(name)


def applies_relu(module: nn.Module) -> bool:
    """Whether `module` is a BatchNorm that applies the following ReLU itself (so no nn.ReLU follows it)."""
    return bool(getattr(module, "fused_relu", False))


def _require_cuda(name: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise NormUnavailable(
            f"norm={name} needs a CUDA GPU, but this run's device is {device.type!r}"
            + ("" if torch.cuda.is_available() else " (torch.cuda.is_available() is False)")
            + ". Use norm=torch on a CPU."
        )


def _check_batch_size(shape) -> None:
    """nn.BatchNorm2d's own refusal of a single value per channel in training (its unbiased variance divides by 0), for
    an input of this shape."""
    if len(shape) != 4:
        raise ValueError(f"expected a 4-D input (N, C, H, W), got {len(shape)}-D")
    if shape[0] * shape[2] * shape[3] == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(shape)}")


def _uses_batch_stats(bn: nn.BatchNorm2d) -> bool:
    return bn.training or bn.running_mean is None


# --- norm=torch: nn.BatchNorm2d then ReLU, PyTorch's own kernels (cuDNN on a GPU) -----------------------------


class TorchBatchNormReLU(nn.BatchNorm2d):
    """nn.BatchNorm2d followed by an in-place ReLU: the same kernels as [nn.BatchNorm2d, nn.ReLU(inplace=True)]."""

    fused_relu = True

    def forward(self, x: Tensor) -> Tensor:
        # In place is safe: batch_norm's backward needs its input, not its output.
        return F.relu(super().forward(x), inplace=True)


register_norm(
    NormImpl(
        name="torch",
        description="nn.BatchNorm2d + ReLU: PyTorch's kernels (cuDNN batch norm on a GPU)",
        check=lambda device: None,
        norm_relu=TorchBatchNormReLU,
    )
)


# --- norm=custom: the fused CUDA ops in kernels/ (kernels/norm_ops.py) ------------------------------------------


class CustomBatchNormReLU(nn.BatchNorm2d):
    """BatchNorm + ReLU with the project's fused CUDA ops in training; running-statistics scale-shift + ReLU in eval.

    Training: one op computes the batch statistics (fp32) and y = relu(bn(x)) in x's dtype, another op the three
    gradients with the ReLU's backward folded in. The running statistics are updated from the batch mean and biased
    variance with nn.BatchNorm2d's arithmetic (momentum, unbiased variance, num_batches_tracked), on the GPU and
    without reading anything back, so the step can be captured: by the forward op itself where _update_in_forward
    says so, else by an op of their own."""

    fused_relu = True

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None):
        if not affine:
            raise ValueError("norm=custom: the fused op needs affine=True (a weight and a bias)")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        if not _uses_batch_stats(self):
            # Eval: a per-channel scale-shift from the running statistics, as nn.BatchNorm2d computes it.
            return F.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                       self.eps), inplace=True)
        if not x.is_cuda:
            raise NormUnavailable(f"norm=custom: the fused BatchNorm+ReLU op needs a CUDA tensor, got one on {x.device}")
        return self._train_forward(x)

    def _train_forward(self, x: Tensor) -> Tensor:
        _check_batch_size(x.shape)
        from kernels.norm_ops import batch_norm_relu_train, batch_norm_relu_train_update

        if self._update_in_forward():
            return batch_norm_relu_train_update(x, self.weight, self.bias, self.running_mean, self.running_var,
                                                self.num_batches_tracked, self.eps, self.momentum)[0]
        y, mean, _invstd, var = batch_norm_relu_train(x, self.weight, self.bias, self.eps)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean, var, x.numel() // x.shape[1])
        return y

    def _update_in_forward(self) -> bool:
        """The forward op updates the running statistics itself (one kernel per layer less; the same bits): with a
        momentum, outside torch.compile (whose graphs take the functional ops: an op that mutates its inputs has its
        autograd in a torch.autograd.Function), unless MBN_RUNNING_UPDATE=separate asks for the two ops (an A/B)."""
        return (self.training and self.track_running_stats and self.momentum is not None
                and not torch.compiler.is_compiling() and _running_update_mode() == "fused")

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, var: Tensor, count: int) -> None:
        from kernels.norm_ops import update_running_stats

        update_running_stats(self.running_mean, self.running_var, self.num_batches_tracked, mean, var, self.momentum,
                             count)


# --- norm.stats_from_depthwise: the batch statistics from the depthwise kernel before the BatchNorm --------------


def _require_custom_pair(switch: str, conv: nn.Module, bn: nn.Module) -> None:
    """What both fusions of a depthwise conv with a BatchNorm run on: a backend=custom conv, a norm=custom (not sync)
    BatchNorm; `switch` names the setting in the error."""
    backend = getattr(getattr(conv, "backend", None), "name", None)
    if backend != "custom" or type(bn) is not CustomBatchNormReLU:
        raise NormUnavailable(f"{switch}=true needs backend=custom and norm=custom without sync_bn "
                              f"(got a {backend} depthwise conv and {type(bn).__name__}); set {switch}=false")


def check_stats_from_depthwise(conv: nn.Module, bn: nn.Module) -> None:
    """The pair depthwise_norm_relu runs: a backend=custom depthwise conv and a norm=custom (not sync) BatchNorm."""
    _require_custom_pair("norm.stats_from_depthwise", conv, bn)


def depthwise_norm_relu(conv: nn.Module, bn: "CustomBatchNormReLU", x: Tensor) -> Tensor:
    """bn(conv(x)) with the batch statistics computed by the depthwise kernel from its output as stored
    (kernels.ops.depthwise_conv2d_stats), so the BatchNorm reads conv(x) once (normalize) instead of twice. The same
    y, statistics and running-statistics update as bn(conv(x)) to rounding; eval mode runs bn(conv(x)). A training
    input the statistics walk does not take stops the run (NormUnavailable naming why): nothing falls back."""
    check_stats_from_depthwise(conv, bn)
    if not _uses_batch_stats(bn):
        return bn(conv(x))
    from kernels.depthwise_args import stats_unsupported

    why = stats_unsupported(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation)
    if why is not None:
        raise NormUnavailable(f"norm.stats_from_depthwise=true: this depthwise conv cannot compute the BatchNorm's "
                              f"statistics ({why}); set norm.stats_from_depthwise=false")
    from kernels.norm_ops import batch_norm_relu_from_partials
    from kernels.ops import depthwise_conv2d_stats

    y, partials = depthwise_conv2d_stats(x, conv.weight, conv.stride, conv.padding)
    _check_batch_size(y.shape)
    out, mean, _invstd, var = batch_norm_relu_from_partials(y, partials, bn.weight, bn.bias, bn.eps)
    if bn.training and bn.track_running_stats:
        bn._update_running_stats(mean, var, y.numel() // y.shape[1])
    return out


# --- norm.apply_in_depthwise: the BatchNorm + ReLU before a depthwise conv, applied by that conv's kernels ---------


def _running_update(switch: str, bn: nn.BatchNorm2d) -> tuple[tuple, float | None]:
    """((running_mean, running_var, num_batches_tracked), momentum) for a pair whose statistics kernel updates bn's
    running statistics, or ((None,) * 3, None) where bn updates none; a cumulative average (momentum=None), which
    those kernels do not compute, stops the run naming `switch`."""
    if not (bn.training and bn.track_running_stats):
        return (None, None, None), None
    if bn.momentum is None:
        raise NormUnavailable(f"{switch} (on) updates the running statistics with a momentum; this BatchNorm has "
                              f"momentum=None (a cumulative average); set {switch}=false")
    return (bn.running_mean, bn.running_var, bn.num_batches_tracked), bn.momentum


def check_apply_in_depthwise(bn: nn.Module, conv: nn.Module) -> None:
    """The pair norm_relu_depthwise runs: a norm=custom (not sync) BatchNorm, then a backend=custom depthwise conv."""
    _require_custom_pair("norm.apply_in_depthwise", conv, bn)


def _check_pair_input(y: Tensor) -> None:
    """What the depthwise kernels that apply a BatchNorm need of their training input (NormUnavailable otherwise)."""
    if not y.is_cuda:
        raise NormUnavailable(f"norm.apply_in_depthwise is on: the depthwise kernels need a CUDA tensor, got one on "
                              f"{y.device}")
    if torch.is_autocast_enabled("cuda") and y.dtype != torch.get_autocast_dtype("cuda"):
        raise NormUnavailable(f"norm.apply_in_depthwise is on: under autocast the input must already be in "
                              f"{torch.get_autocast_dtype('cuda')} (it is {y.dtype}), since the pair computes in its "
                              "input's dtype")
    _check_batch_size(y.shape)


def norm_relu_depthwise(bn: "CustomBatchNormReLU", conv: nn.Module, y: Tensor, sums: Tensor | None = None) -> Tensor:
    """conv(bn(y)) in training with bn's normalize and ReLU applied by the depthwise kernels as they load y
    (kernels.norm_depthwise): bn computes only its batch statistics (and updates its running statistics in that
    kernel), and bn(y) is never stored. The same output as conv(bn(y)) bit for bit where both run the column walks;
    eval mode runs conv(bn(y)). A training input the walk does not take stops the run (NormUnavailable naming why).
    `sums`: y's per-channel sum and sum of squares as norm_relu_pointwise returned them with y, which then replace
    bn's statistics pass."""
    check_apply_in_depthwise(bn, conv)
    if not _uses_batch_stats(bn):
        return conv(bn(y))
    _check_pair_input(y)
    from kernels.norm_depthwise import batch_norm_relu_depthwise_conv2d, normed_unsupported

    why = normed_unsupported(y, conv.weight, conv.bias, conv.stride, conv.padding)
    if why is not None:
        raise NormUnavailable(f"norm.apply_in_depthwise is on: this depthwise conv cannot apply the BatchNorm before "
                              f"it ({why}); set norm.apply_in_depthwise=false")
    grad_in_dgrad = norm_input_grad_mode() == "dgrad"
    if grad_in_dgrad:
        from kernels.norm_depthwise import dgrad_normed_unsupported

        why = dgrad_normed_unsupported(y, conv.weight, conv.stride, conv.padding)
        if why is not None:
            raise NormUnavailable(f"MBN_NORM_INPUT_GRAD=dgrad: this depthwise conv cannot take the BatchNorm's input "
                                  f"gradient ({why}); unset MBN_NORM_INPUT_GRAD")
    running, momentum = _running_update("norm.apply_in_depthwise", bn)
    return batch_norm_relu_depthwise_conv2d(y, bn.weight, bn.bias, conv.weight, conv.stride, conv.padding, bn.eps,
                                            *running, momentum=momentum, sums=sums,
                                            one_walk=depthwise_backward_mode() != "separate",
                                            walk_sums=depthwise_backward_mode() in SUMS_MODES,
                                            grad_in_dgrad=grad_in_dgrad)


def next_norm_in(conv: nn.Module, y: Tensor) -> bool:
    """Whether the BatchNorm + ReLU after this depthwise conv (of input y) joins its pair in the backward mode: every
    layer with "next_norm", with "next_norm_ring" those whose backward runs from the rings of rows (a 3x3 stride-1
    padding-1 conv whose shape and dtype the rings take on this device)."""
    mode = depthwise_backward_mode()
    if mode != "next_norm_ring":
        return mode == "next_norm"
    if not y.is_cuda:  # the pair's own check names what is wrong
        return True
    if tuple(conv.stride) != (1, 1) or tuple(conv.padding) != (1, 1) or tuple(conv.weight.shape[2:]) != (3, 3):
        return False
    import kernels.ops  # noqa: F401  (loads the kernels: torch.ops.mobilenet_dw)

    n, c, h, w = y.shape
    return torch.ops.mobilenet_dw.bwd_normed_ring_runs(n, c, h, w, y.dtype)


def _check_next_norm_takes(y: Tensor, conv: nn.Module) -> None:
    """NormUnavailable naming why, where the depthwise walks cannot apply both the BatchNorm before the conv and the
    input gradient of the one after it for this training input."""
    _check_pair_input(y)
    from kernels.depthwise_args import out_shape
    from kernels.norm_depthwise import next_norm_unsupported

    why = next_norm_unsupported(y, conv.weight, conv.bias, conv.stride, conv.padding)
    if why is not None:
        raise NormUnavailable(f"norm.apply_in_depthwise is on: this depthwise conv cannot apply the BatchNorms around "
                              f"it ({why}); set norm.apply_in_depthwise=false")
    _check_batch_size(out_shape(y.shape, conv.weight.shape, conv.stride, conv.padding, (1, 1)))


def norm_relu_depthwise_norm_relu(bn: "CustomBatchNormReLU", conv: nn.Module, out_bn: "CustomBatchNormReLU",
                                  y: Tensor, sums: Tensor | None = None) -> Tensor:
    """out_bn(norm_relu_depthwise(bn, conv, y, sums)) in training, with out_bn's backward split so that the depthwise
    conv's backward kernel applies out_bn's input gradient as it loads the gradient (MBN_DEPTHWISE_BACKWARD=next_norm,
    kernels.norm_depthwise.batch_norm_relu_depthwise_conv2d_batch_norm_relu): the same values as the two calls, bit
    for bit. Eval mode runs the modules one by one. A training input the walks do not take stops the run
    (NormUnavailable naming why)."""
    if type(out_bn) is not CustomBatchNormReLU:
        raise NormUnavailable(f"MBN_DEPTHWISE_BACKWARD={depthwise_backward_mode()} needs norm=custom without sync_bn "
                              f"after the depthwise conv (got {type(out_bn).__name__}); set MBN_DEPTHWISE_BACKWARD=sums")
    if not (_uses_batch_stats(bn) and _uses_batch_stats(out_bn)):
        return out_bn(norm_relu_depthwise(bn, conv, y, sums))
    check_apply_in_depthwise(bn, conv)
    _check_next_norm_takes(y, conv)
    from kernels.norm_depthwise import batch_norm_relu_depthwise_conv2d_batch_norm_relu

    running, momentum = _running_update("norm.apply_in_depthwise", bn)
    out_in_forward = out_bn._update_in_forward()
    out_running, out_momentum = _running_update("norm.apply_in_depthwise", out_bn) if out_in_forward else \
        ((None, None, None), None)
    out, mean, var = batch_norm_relu_depthwise_conv2d_batch_norm_relu(
        y, bn.weight, bn.bias, conv.weight, out_bn.weight, out_bn.bias, conv.stride, conv.padding, bn.eps, *running,
        momentum=momentum, out_eps=out_bn.eps, out_running_mean=out_running[0], out_running_var=out_running[1],
        out_num_batches_tracked=out_running[2], out_momentum=out_momentum, sums=sums)
    if not out_in_forward and out_bn.track_running_stats:
        out_bn._update_running_stats(mean, var, out.numel() // out.shape[1])
    return out


# --- norm.apply_in_pointwise: the BatchNorm + ReLU before a pointwise conv, applied by cuDNN's fused convolutions ---


def check_apply_in_pointwise(bn: nn.Module, conv: nn.Module) -> None:
    """The pair norm_relu_pointwise runs: a norm=custom (not sync) BatchNorm, then a bias-free 1x1 nn.Conv2d."""
    if type(bn) is not CustomBatchNormReLU:
        raise NormUnavailable(f"norm.apply_in_pointwise needs norm=custom without sync_bn (got {type(bn).__name__}); "
                              "set norm.apply_in_pointwise=false")
    if (not isinstance(conv, nn.Conv2d) or conv.kernel_size != (1, 1) or conv.stride != (1, 1) or conv.groups != 1
            or conv.bias is not None or conv.padding != (0, 0)):
        raise NormUnavailable(f"norm.apply_in_pointwise needs a bias-free 1x1 convolution of stride 1 after the "
                              f"BatchNorm, got {conv}; set norm.apply_in_pointwise=false")


def _check_pointwise_takes(y: Tensor, conv: nn.Conv2d) -> None:
    """NormUnavailable naming why, where cuDNN's fused graphs cannot apply the BatchNorm before this pointwise conv to
    y (a training input of that BatchNorm, or of the depthwise conv whose output has y's dtype and channels)."""
    from kernels.norm_pointwise import pointwise_unsupported

    why = pointwise_unsupported(y, conv.weight)
    if why is not None:
        raise NormUnavailable(f"norm.apply_in_pointwise is on: this pointwise conv cannot apply the BatchNorm before "
                              f"it ({why}); set norm.apply_in_pointwise=false")


def norm_relu_pointwise(bn: "CustomBatchNormReLU", conv: nn.Conv2d, y: Tensor) -> tuple[Tensor, Tensor | None]:
    """(conv(bn(y)), its per-channel sums or None) in training with bn's normalize and ReLU applied by cuDNN's fused
    convolutions as they load y (kernels.norm_pointwise): bn computes only its batch statistics (and updates its
    running statistics in that kernel), and bn(y) is never stored; the sums (sum and sum of squares of the output)
    can replace the next BatchNorm's statistics pass (norm_relu_depthwise). The same output as conv(bn(y)) to
    rounding; eval mode runs conv(bn(y)) and gives no sums. A training input the fused graphs do not take stops the
    run (NormUnavailable naming why): nothing falls back."""
    check_apply_in_pointwise(bn, conv)
    if not _uses_batch_stats(bn):
        return conv(bn(y)), None
    if not y.is_cuda:
        raise NormUnavailable(f"norm.apply_in_pointwise is on: cuDNN's fused convolutions need a CUDA tensor, got one "
                              f"on {y.device}")
    _check_batch_size(y.shape)
    _check_pointwise_takes(y, conv)
    from kernels.norm_pointwise import batch_norm_relu_conv1x1

    running, momentum = _running_update("norm.apply_in_pointwise", bn)
    return batch_norm_relu_conv1x1(y, bn.weight, bn.bias, conv.weight, bn.eps, *running, momentum=momentum)


def norm_relu_depthwise_norm_relu_pointwise(bn: "CustomBatchNormReLU", conv: nn.Module, mid_bn: "CustomBatchNormReLU",
                                            pointwise_conv: nn.Conv2d, y: Tensor,
                                            sums: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """norm_relu_pointwise(mid_bn, pointwise_conv, norm_relu_depthwise(bn, conv, y, sums)) in training as one function
    (kernels.norm_pointwise.batch_norm_relu_depthwise_conv2d_batch_norm_relu_conv1x1), whose depthwise backward kernel
    applies mid_bn's input gradient as it loads the gradient instead of mid_bn's own pass: the same values, bit for
    bit, for the layers where MBN_DEPTHWISE_BACKWARD's next_norm modes apply the next BatchNorm (next_norm_in). Eval
    mode runs the modules one by one. A training input the kernels or the fused graphs do not take stops the run
    (NormUnavailable naming why)."""
    check_apply_in_depthwise(bn, conv)
    check_apply_in_pointwise(mid_bn, pointwise_conv)
    if not (_uses_batch_stats(bn) and _uses_batch_stats(mid_bn)):
        return norm_relu_pointwise(mid_bn, pointwise_conv, norm_relu_depthwise(bn, conv, y, sums))
    _check_next_norm_takes(y, conv)
    _check_pointwise_takes(y, pointwise_conv)
    from kernels.norm_pointwise import batch_norm_relu_depthwise_conv2d_batch_norm_relu_conv1x1

    running, momentum = _running_update("norm.apply_in_depthwise", bn)
    mid_running, mid_momentum = _running_update("norm.apply_in_pointwise", mid_bn)
    return batch_norm_relu_depthwise_conv2d_batch_norm_relu_conv1x1(
        y, bn.weight, bn.bias, conv.weight, mid_bn.weight, mid_bn.bias, pointwise_conv.weight, conv.stride,
        conv.padding, bn.eps, *running, momentum=momentum, mid_eps=mid_bn.eps, mid_running_mean=mid_running[0],
        mid_running_var=mid_running[1], mid_num_batches_tracked=mid_running[2], mid_momentum=mid_momentum, sums=sums)


def _custom_check(device: torch.device) -> None:
    _require_cuda("custom", device)
    try:
        import kernels

        kernels.load()
        import kernels.norm_ops  # noqa: F401  (registers fake kernels, autograd and autocast)
    except ImportError as e:
        raise NormUnavailable(f"norm=custom: the custom CUDA kernels cannot be imported ({e})") from e
    except RuntimeError as e:  # kernels.KernelUnavailable: no nvcc, build failure, ...
        raise NormUnavailable(f"norm=custom: {e}") from e


register_norm(
    NormImpl(
        name="custom",
        description="this project's fused BatchNorm+ReLU CUDA ops (kernels/): forward and backward in training",
        check=_custom_check,
        norm_relu=CustomBatchNormReLU,
    )
)


# --- norm=apex: NVIDIA apex's NHWC BatchNorm with fused ReLU (apex.contrib.groupbn) -------------------------------


def _import_apex_nhwc():
    try:
        # apex/contrib/groupbn/__init__.py swallows its own ImportError (it prints a line) when apex was built
        # without --bnp, so the name is then missing rather than the module.
        from apex.contrib.groupbn import BatchNorm2d_NHWC
    except ImportError as e:
        raise NormUnavailable(f"norm=apex: apex.contrib.groupbn.BatchNorm2d_NHWC cannot be imported ({e}); "
                              + APEX_INSTALL) from e
    return BatchNorm2d_NHWC


class ApexBatchNormReLU(nn.BatchNorm2d):
    """apex.contrib.groupbn.BatchNorm2d_NHWC(fuse_relu=True) computing with this module's own parameters and buffers.

    apex's module allocates CUDA tensors in its constructor, so it is made on the first forward pass and kept
    outside the module tree (its parameters are this module's; its scratch tensors are no state of ours)."""

    fused_relu = True

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1):
        super().__init__(num_features, eps, momentum)
        self.__dict__["_apex"] = None  # not a submodule: state_dict stays nn.BatchNorm2d's

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        impl = self._apex_module(x.device)
        # Point apex's module at our current tensors: .to()/.cuda() and load_state_dict may have replaced buffers.
        impl._parameters["weight"] = self.weight
        impl._parameters["bias"] = self.bias
        impl._buffers["running_mean"] = self.running_mean
        impl._buffers["running_var"] = self.running_var
        impl.momentum, impl.eps, impl.training = self.momentum, self.eps, self.training
        if self.training:
            self.num_batches_tracked.add_(1)  # apex does not count batches
        # A channels_last (N, C, H, W) tensor viewed as (N, H, W, C) is contiguous: apex's layout, no copy.
        y = impl(x.permute(0, 2, 3, 1))
        return y.permute(0, 3, 1, 2)

    def _check_input(self, x: Tensor) -> None:
        if not x.is_cuda:
            raise NormUnavailable(f"norm=apex needs CUDA tensors, got one on {x.device}")
        if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last):
            raise NormUnavailable("norm=apex: apex's BatchNorm2d_NHWC is NHWC only; run with channels_last=true")
        if x.dtype != torch.float16:
            raise NormUnavailable(f"norm=apex: apex's BatchNorm2d_NHWC computes in fp16 only, got {x.dtype}; "
                                  "run with amp=true amp_dtype=fp16")
        if self.momentum is None:
            raise NormUnavailable("norm=apex: apex's BatchNorm2d_NHWC has no cumulative average (momentum=None)")

    def _apex_module(self, device: torch.device) -> nn.Module:
        impl = self.__dict__["_apex"]
        if impl is None:
            cls = _import_apex_nhwc()
            with torch.cuda.device(device):
                impl = cls(self.num_features, fuse_relu=True)
            self.__dict__["_apex"] = impl
        return impl


def _apex_check(device: torch.device) -> None:
    _import_apex_nhwc()  # first: without apex, how to install it is the message to give, on any machine
    _require_cuda("apex", device)


register_norm(
    NormImpl(
        name="apex",
        description="NVIDIA apex's NHWC fp16 BatchNorm with fused ReLU (apex.contrib.groupbn.BatchNorm2d_NHWC)",
        check=_apex_check,
        norm_relu=ApexBatchNormReLU,
    )
)


# --- sync_bn: statistics all-reduced across ranks ----------------------------------------------------------------


class SyncBatchNormReLU(nn.SyncBatchNorm):
    """nn.SyncBatchNorm followed by an in-place ReLU: what a norm=torch BatchNorm+ReLU becomes under sync_bn."""

    fused_relu = True

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(super().forward(x), inplace=True)


def combine_rank_statistics(slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The statistics of all ranks' batches together, from each rank's own: `slots` is [world, 3, C], row r holding
    rank r's (count, mean, biased variance) per channel. Returns (count, mean, biased variance), [C] each, float64.

    Chan et al.'s parallel combination (what torch.batch_norm_gather_stats_with_counts computes, here in fp64): the
    ranks' within sums of squares plus each rank's count times its mean's squared distance to the global mean. No
    difference of two large sums, so a large mean does not cancel the variance away; fixed-order sums, so every rank
    gets the same bits."""
    counts, means, variances = slots.double().unbind(1)
    count = counts.sum(0)
    mean = (counts * means).sum(0) / count
    m2 = (counts * variances).sum(0) + (counts * (means - mean).square()).sum(0)
    return count, mean, m2 / count


def _all_reduce_slots(local: Tensor, group) -> Tensor:
    """Every rank's `local` [k, C], stacked as [world, k, C] in rank order: each rank fills its own slot of zeros
    and the sum over ranks is exact (one non-zero term per element), so NCCL and gloo give the same, in any order."""
    slots = local.new_zeros((dist.get_world_size(group), *local.shape))
    slots[dist.get_rank(group)] = local
    dist.all_reduce(slots, group=group)
    return slots


def _float32_eps(eps: float) -> float:
    # The fused forward takes eps as a float32 (as cuDNN's BatchNorm does); the same value here, rounded on the host
    # without making a tensor in every layer's forward.
    return struct.unpack("f", struct.pack("f", eps))[0]


class _SyncBatchNormReLUFunction(torch.autograd.Function):
    """y = relu(batch_norm(x)) for statistics of every rank's batch; the backward all-reduces the gradient sums."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, count, group):
        from kernels.norm_ops import batch_norm_relu_normalize

        ctx.save_for_backward(x, weight, bias, mean, invstd, count)
        ctx.group = group
        return batch_norm_relu_normalize(x, weight, bias, mean, invstd)

    @staticmethod
    def backward(ctx, grad_y):
        from kernels.norm_ops import batch_norm_relu_grad_sums, batch_norm_relu_input_grad

        x, weight, bias, mean, invstd, count = ctx.saved_tensors
        sums = batch_norm_relu_grad_sums(grad_y, x, weight, bias, mean, invstd)  # this rank's, fp64
        grad_x = None
        if ctx.needs_input_grad[0]:  # the same on every rank (one model), so every rank joins the collective or none
            total = _all_reduce_slots(sums, ctx.group).sum(0)
            grad_x = batch_norm_relu_input_grad(grad_y, x, weight, bias, mean, invstd, (total / count).float())
        # weight and bias: this rank's own sums, as nn.SyncBatchNorm's; DDP then averages them over the ranks.
        grad_weight = (sums[1] * invstd.double()).float()
        grad_bias = sums[0].float()
        return grad_x, grad_weight, grad_bias, None, None, None, None


class SyncCustomBatchNormReLU(CustomBatchNormReLU):
    """What a norm=custom BatchNorm+ReLU becomes under sync_bn: the fused kernels with the batch statistics of every
    rank's batch (nn.SyncBatchNorm's semantics, the ReLU still fused).

    Forward: each rank's local mean and variance (one reduce pass), all-reduced and combined in fp64
    (combine_rank_statistics), then y from the global statistics (one apply pass, the fused forward's arithmetic).
    Backward: each rank's sums of g and g * (x - mean) (one reduce pass), all-reduced, then the input gradient from
    the global ones (one apply pass); the weight and bias gradients are the rank's own, which DDP averages. The
    running statistics take the global mean and unbiased variance; the global count stays on the device, so no layer
    waits for the GPU. Without an initialised process group the batch is all there is, and it computes as
    CustomBatchNormReLU (as it does in eval mode without running statistics, as nn.SyncBatchNorm)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def _train_forward(self, x: Tensor) -> Tensor:
        # As nn.SyncBatchNorm: only training synchronises (in eval, ranks may see different numbers of batches).
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super()._train_forward(x)
        if dist.get_world_size(self.process_group) == 1:
            _check_batch_size(x.shape)  # with more ranks, one value here is fine: nn.SyncBatchNorm's rule
        from kernels.norm_ops import local_batch_stats, update_running_stats_unbiased

        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            local_mean, local_var = local_batch_stats(x)
            local = torch.stack([torch.full_like(local_mean, x.numel() // x.shape[1]), local_mean, local_var])
            count, mean64, var64 = combine_rank_statistics(_all_reduce_slots(local, self.process_group))
            mean, invstd = mean64.float(), (var64 + _float32_eps(self.eps)).sqrt().reciprocal().float()
        y = _SyncBatchNormReLUFunction.apply(x, self.weight, self.bias, mean, invstd, count, self.process_group)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                update_running_stats_unbiased(self.running_mean, self.running_var, self.num_batches_tracked, mean,
                                              var64 * count / (count - 1), self.momentum)
        return y


def _moved_to(converted: nn.BatchNorm2d, module: nn.BatchNorm2d) -> nn.BatchNorm2d:
    """`converted` with `module`'s parameters, buffers and mode (torch's conversion keeps them too)."""
    with torch.no_grad():
        if module.affine:
            converted.weight = module.weight
            converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
    converted.train(module.training)
    return converted


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """nn.SyncBatchNorm.convert_sync_batchnorm that keeps each fused ReLU, and the fused kernels of norm=custom.

    torch's conversion turns every BatchNorm into a plain nn.SyncBatchNorm, which would silently drop the ReLU of a
    norm_relu module. norm=custom modules become SyncCustomBatchNormReLU, other norm_relu modules SyncBatchNormReLU;
    norm=apex is refused (apex's NHWC kernels do not all-reduce their statistics)."""
    if isinstance(module, ApexBatchNormReLU):
        raise NormUnavailable("sync_bn=true with norm=apex: apex's BatchNorm2d_NHWC does not all-reduce the batch "
                              "statistics across ranks; use norm=custom or norm=torch with sync_bn=true")
    if isinstance(module, SyncCustomBatchNormReLU):
        return module
    is_bn = isinstance(module, nn.modules.batchnorm._BatchNorm)
    if is_bn and not applies_relu(module):
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    converted = module
    if is_bn:
        cls = SyncCustomBatchNormReLU if isinstance(module, CustomBatchNormReLU) else SyncBatchNormReLU
        converted = _moved_to(cls(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group), module)
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group))
    return converted


def sync_bn_state(model: nn.Module, world_size: int) -> str:
    """What the summary says sync_bn ran: the BatchNorm classes in the converted model."""
    classes = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)})
    return f"on ({', '.join(classes) or 'no BatchNorm'}; statistics over {world_size} ranks)"
