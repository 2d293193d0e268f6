"""Python side of the fused BatchNorm + ReLU ops (torch.ops.mobilenet_bn): fake kernels, autograd, autocast, and the
public `batch_norm_relu_train`. Importing this module builds/loads the CUDA extension (kernels.load()), so it raises
kernels.KernelUnavailable where the kernels cannot run.

  bn_relu_fwd(x, weight, bias, eps) -> (y, mean, invstd, var)
      y = relu((x - mean) * invstd * weight + bias) in x's dtype and layout; batch statistics per channel in fp32
      (var biased, invstd = 1 / sqrt(var + eps)). x fp32/fp16/bf16; weight and bias fp32.
  bn_relu_bwd(grad_y, x, weight, bias, mean, invstd) -> (grad_x, grad_weight, grad_bias)
      the ReLU's backward folded in (grad_y where y > 0, the mask recomputed from x); grad_x in x's dtype and layout,
      the others fp32.
  bn_relu_fwd_update(x, weight, bias, running_mean!, running_var!, num_batches_tracked!, eps, momentum)
      -> (y, mean, invstd, var)
      bn_relu_fwd that also applies bn_update_running_stats' update (momentum in [0, 1]) in its finalize kernel, with
      the same results bit for bit and one kernel less. An op that mutates its inputs cannot take
      torch.library.register_autograd, so its autograd is a torch.autograd.Function; public as
      `batch_norm_relu_train_update`.
  bn_relu_fwd_from_partials(x, partials, weight, bias, eps) -> (y, mean, invstd, var)
      bn_relu_fwd with x's statistics given as per-block partials [bands, 3, C] fp64 (count, mean, M2), as
      mobilenet_dw::depthwise_fwd_stats returns them with x (kernels.ops.depthwise_conv2d_stats): no statistics pass
      over x; the backward is bn_relu_bwd's. Public as `batch_norm_relu_from_partials`.
  bn_update_running_stats(running_mean!, running_var!, num_batches_tracked!, mean, var, momentum, count)
      nn.BatchNorm2d's running-statistics update in one kernel (momentum < 0: the cumulative average); public as
      `update_running_stats`.

The same passes split where sync_bn combines the ranks' statistics and gradient sums (mobilenet/norm.py,
SyncCustomBatchNormReLU); each public under the name in brackets, checked in Python first:
  bn_local_stats(x) -> (mean, var)                                           [local_batch_stats]
      this batch's mean and biased variance per channel, fp64 (the forward's reduce).
  bn_relu_normalize(x, weight, bias, mean, invstd) -> y                      [batch_norm_relu_normalize]
      y = relu((x - mean) * weight * invstd + bias) for given fp32 statistics: the forward's apply, bit for bit.
  bn_relu_grad_sums(grad_y, x, weight, bias, mean, invstd) -> sums           [batch_norm_relu_grad_sums]
      [2, C] fp64: sum(g) and sum(g * (x - mean)), g = grad_y masked by the ReLU recomputed from x.
  bn_relu_input_grad(grad_y, x, weight, bias, mean, invstd, grad_means) -> grad_x   [batch_norm_relu_input_grad]
      grad_x from grad_means [2, C] fp32 = those sums divided by the count, over every rank's batch.
  bn_update_running_stats_unbiased(running_mean!, running_var!, num_batches_tracked!, mean, unbiased_var, momentum)
      the running-statistics update for a variance already unbiased (the global count is on the device)
                                                                             [update_running_stats_unbiased]
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import kernel_layout, load

load()

__all__ = ["batch_norm_relu_train", "batch_norm_relu_train_update", "batch_norm_relu_from_partials",
           "update_running_stats", "local_batch_stats", "batch_norm_relu_normalize", "batch_norm_relu_grad_sums",
           "batch_norm_relu_input_grad", "update_running_stats_unbiased"]

_fwd = torch.ops.mobilenet_bn.bn_relu_fwd.default
_bwd = torch.ops.mobilenet_bn.bn_relu_bwd.default
_fwd_update = torch.ops.mobilenet_bn.bn_relu_fwd_update.default
_fwd_partials = torch.ops.mobilenet_bn.bn_relu_fwd_from_partials.default
_update = torch.ops.mobilenet_bn.bn_update_running_stats.default
_local_stats = torch.ops.mobilenet_bn.bn_local_stats.default
_normalize = torch.ops.mobilenet_bn.bn_relu_normalize.default
_grad_sums = torch.ops.mobilenet_bn.bn_relu_grad_sums.default
_input_grad = torch.ops.mobilenet_bn.bn_relu_input_grad.default
_update_unbiased = torch.ops.mobilenet_bn.bn_update_running_stats_unbiased.default

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


_layout = kernel_layout


@torch.library.register_fake("mobilenet_bn::bn_relu_fwd")
def _fwd_fake(x, weight, bias, eps):
    c = x.shape[1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=_layout(x))
    stats = [x.new_empty(c, dtype=torch.float32) for _ in range(3)]
    return (y, *stats)


@torch.library.register_fake("mobilenet_bn::bn_relu_fwd_update")
def _fwd_update_fake(x, weight, bias, running_mean, running_var, num_batches_tracked, eps, momentum):
    return _fwd_fake(x, weight, bias, eps)


@torch.library.register_fake("mobilenet_bn::bn_relu_fwd_from_partials")
def _fwd_partials_fake(x, partials, weight, bias, eps):
    return _fwd_fake(x, weight, bias, eps)


@torch.library.register_fake("mobilenet_bn::bn_relu_bwd")
def _bwd_fake(grad_y, x, weight, bias, mean, invstd):
    c = x.shape[1]
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=_layout(x))
    return grad_x, x.new_empty(c, dtype=torch.float32), x.new_empty(c, dtype=torch.float32)


@torch.library.register_fake("mobilenet_bn::bn_update_running_stats")
def _update_fake(running_mean, running_var, num_batches_tracked, mean, var, momentum, count):
    return None


def _like_x(x: Tensor) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=_layout(x))


@torch.library.register_fake("mobilenet_bn::bn_local_stats")
def _local_stats_fake(x):
    return x.new_empty(x.shape[1], dtype=torch.float64), x.new_empty(x.shape[1], dtype=torch.float64)


@torch.library.register_fake("mobilenet_bn::bn_relu_normalize")
def _normalize_fake(x, weight, bias, mean, invstd):
    return _like_x(x)


@torch.library.register_fake("mobilenet_bn::bn_relu_grad_sums")
def _grad_sums_fake(grad_y, x, weight, bias, mean, invstd):
    return x.new_empty((2, x.shape[1]), dtype=torch.float64)


@torch.library.register_fake("mobilenet_bn::bn_relu_input_grad")
def _input_grad_fake(grad_y, x, weight, bias, mean, invstd, grad_means):
    return _like_x(x)


@torch.library.register_fake("mobilenet_bn::bn_update_running_stats_unbiased")
def _update_unbiased_fake(running_mean, running_var, num_batches_tracked, mean, unbiased_var, momentum):
    return None


def _setup_context(ctx, inputs, output):
    x, weight, bias, _eps = inputs
    _y, mean, invstd, var = output
    # Not y: the backward recomputes the ReLU mask from x (one tensor less to read, and to keep alive).
    ctx.save_for_backward(x, weight, bias, mean, invstd)
    ctx.mark_non_differentiable(mean, invstd, var)


def _grads(ctx, grad_y, needs) -> tuple:
    """(grad_x, grad_weight, grad_bias) of the forward _setup_context saved, each None where `needs` (the three
    inputs' needs_input_grad) says so: one bn_relu_bwd for all of the forward ops."""
    x, weight, bias, mean, invstd = ctx.saved_tensors
    if grad_y is None or not any(needs):
        return None, None, None
    grads = _bwd(grad_y.to(x.dtype), x, weight, bias, mean, invstd)
    return tuple(g if need else None for g, need in zip(grads, needs))


def _backward(ctx, grad_y, _grad_mean, _grad_invstd, _grad_var):
    return (*_grads(ctx, grad_y, ctx.needs_input_grad[:3]), None)


torch.library.register_autograd("mobilenet_bn::bn_relu_fwd", _backward, setup_context=_setup_context)


def _partials_setup_context(ctx, inputs, output):
    x, _partials, weight, bias, eps = inputs
    _setup_context(ctx, (x, weight, bias, eps), output)


def _partials_backward(ctx, grad_y, _grad_mean, _grad_invstd, _grad_var):
    # bn_relu_fwd's backward: grad_x is the full BatchNorm gradient (through the batch statistics), so the partials,
    # which are these statistics computed elsewhere, take none. Inputs: x, partials, weight, bias, eps.
    need = ctx.needs_input_grad
    grad_x, grad_weight, grad_bias = _grads(ctx, grad_y, (need[0], need[2], need[3]))
    return grad_x, None, grad_weight, grad_bias, None


torch.library.register_autograd("mobilenet_bn::bn_relu_fwd_from_partials", _partials_backward,
                                setup_context=_partials_setup_context)


def _register_autocast(name: str, cast) -> None:
    """Autocast: BatchNorm is on none of autocast's cast lists, so cuDNN's takes x as it comes (fp16/bf16 from the
    convolution before it) with fp32 weight, bias and statistics. These ops do the same, stated explicitly: x (and the
    tensors of x's dtype) keep their dtype, the per-channel tensors are fp32; then the op runs with autocast off."""
    op = getattr(torch.ops.mobilenet_bn, name).default
    key = torch._C.DispatchKey.AutocastCUDA

    def autocast_impl(*args):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*cast(*args))

    if op.has_kernel_for_dispatch_key(key):
        op.py_kernels.pop(key, None)
    op.py_impl(key)(autocast_impl)
    _lib.impl(name, lambda _keyset, *args: autocast_impl(*args), "AutocastCUDA", with_keyset=True)


def _f32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _fwd_autocast_args(x, weight, bias, eps):
    return x, _f32(weight), _f32(bias), eps


def _fwd_update_autocast_args(x, weight, bias, running_mean, running_var, num_batches_tracked, eps, momentum):
    return x, _f32(weight), _f32(bias), running_mean, running_var, num_batches_tracked, eps, momentum


def _fwd_partials_autocast_args(x, partials, weight, bias, eps):
    return x, partials, _f32(weight), _f32(bias), eps  # partials stay fp64


def _bwd_autocast_args(grad_y, x, weight, bias, mean, invstd):
    return grad_y.to(x.dtype), x, _f32(weight), _f32(bias), _f32(mean), _f32(invstd)


_lib = torch.library.Library("mobilenet_bn", "FRAGMENT")
_register_autocast("bn_relu_fwd", _fwd_autocast_args)
_register_autocast("bn_relu_bwd", _bwd_autocast_args)
_register_autocast("bn_relu_fwd_from_partials", _fwd_partials_autocast_args)
_register_autocast("bn_relu_fwd_update", _fwd_update_autocast_args)


class _TrainWithUpdate(torch.autograd.Function):
    """bn_relu_fwd_update with bn_relu_fwd's backward (_setup_context and _grads above)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, eps, momentum):
        out = _fwd_update(x, weight, bias, running_mean, running_var, num_batches_tracked, eps, momentum)
        _setup_context(ctx, (x, weight, bias, eps), out)
        return out

    @staticmethod
    def backward(ctx, grad_y, _grad_mean, _grad_invstd, _grad_var):
        return (*_grads(ctx, grad_y, ctx.needs_input_grad[:3]), None, None, None, None, None)


def _check_supported(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> None:
    """The op checks all of this again in C++; checking here first gives a Python ValueError before any C++ exception
    (a TORCH_CHECK thrown inside a custom op crashed the process on the H200 image, see docs/kernel_notes.md)."""
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"batch_norm_relu: input must be a 4-D tensor (N, C, H, W), got {getattr(x, 'shape', x)}")
    if not x.is_cuda:
        raise ValueError(f"batch_norm_relu: the custom kernels need CUDA tensors, got input on {x.device}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"batch_norm_relu: dtype {x.dtype} is not supported (float32, float16, bfloat16)")
    c = x.shape[1]
    if c < 1 or x.numel() == 0:
        raise ValueError(f"batch_norm_relu: input {tuple(x.shape)} has no values per channel")
    if x.numel() >= 2**31:
        raise ValueError("batch_norm_relu: tensors of 2^31 or more elements are not supported")
    if weight is not None:
        _check_channel_vectors(x, weight=weight, bias=bias)


def _check_channel_vectors(x: Tensor, **vectors: Tensor) -> None:
    c = x.shape[1]
    for name, t in vectors.items():
        if not isinstance(t, Tensor) or tuple(t.shape) != (c,) or t.device != x.device:
            raise ValueError(f"batch_norm_relu: {name} must be a ({c},) tensor on {x.device}, got "
                             f"{tuple(getattr(t, 'shape', ()))} on {getattr(t, 'device', None)}")


def batch_norm_relu_train(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5):
    """relu(batch_norm(x, training=True)) with batch statistics, fused. Returns (y, mean, invstd, var): y in x's dtype
    and memory format; mean, invstd = 1 / sqrt(var + eps) and the biased variance var per channel, in fp32.
    Differentiable in x, weight and bias (weight and bias are used in fp32, cast if they are not)."""
    _check_supported(x, weight, bias)
    return _fwd(x, _f32(weight), _f32(bias), float(eps))


def batch_norm_relu_train_update(x: Tensor, weight: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor,
                                 num_batches_tracked: Tensor, eps: float, momentum: float):
    """batch_norm_relu_train, and in the same op (its finalize kernel) the running-statistics update of
    update_running_stats with this momentum in [0, 1]: the same (y, mean, invstd, var) and running statistics bit for
    bit, one kernel less. momentum=None (the cumulative average) is update_running_stats' alone."""
    _check_supported(x, weight, bias)
    if momentum is None or not 0.0 <= momentum <= 1.0:
        raise ValueError(f"batch_norm_relu_train_update: momentum must be in [0, 1], got {momentum} (for "
                         "momentum=None use batch_norm_relu_train and update_running_stats)")
    _check_channel_vectors(x, running_mean=running_mean, running_var=running_var)
    _check_unbiased_count("batch_norm_relu_train_update", x.numel() // x.shape[1])
    return _TrainWithUpdate.apply(x, _f32(weight), _f32(bias), running_mean, running_var, num_batches_tracked,
                                  float(eps), float(momentum))


def batch_norm_relu_from_partials(x: Tensor, partials: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5):
    """batch_norm_relu_train with x's batch statistics given as partials [bands, 3, C] float64 (count, mean, M2 per
    band and channel), the second output of kernels.ops.depthwise_conv2d_stats for the convolution that produced x:
    the same (y, mean, invstd, var) without the pass over x that computes them. The partials must be that
    convolution's for this very x (they are not checked against it). Differentiable in x, weight and bias as
    batch_norm_relu_train."""
    _check_supported(x, weight, bias)
    c = x.shape[1]
    if (not isinstance(partials, Tensor) or partials.dim() != 3 or not 1 <= partials.shape[0] < 2**30
            or tuple(partials.shape[1:]) != (3, c) or partials.dtype != torch.float64 or partials.device != x.device):
        raise ValueError(f"batch_norm_relu: partials must be a float64 (bands, 3, {c}) tensor on {x.device}, got "
                         f"{getattr(partials, 'dtype', None)} {tuple(getattr(partials, 'shape', ()))}")
    return _fwd_partials(x, partials, _f32(weight), _f32(bias), float(eps))


def update_running_stats(running_mean: Tensor, running_var: Tensor, num_batches_tracked: Tensor, mean: Tensor,
                         var: Tensor, momentum: float | None, count: int) -> None:
    """nn.BatchNorm2d's running-statistics update, in place and in one kernel: num_batches_tracked += 1, then
    running = (1 - f) * running + f * batch with the unbiased variance var * count / (count - 1), where f = momentum,
    or 1 / num_batches_tracked for momentum=None. mean and var: this batch's mean and biased variance (fp32, as
    batch_norm_relu_train returns them) over `count` values per channel."""
    _check_unbiased_count("update_running_stats", count)
    _update(running_mean, running_var, num_batches_tracked, mean, var, _momentum_arg(momentum), int(count))


def _check_running_update(op: str, x: Tensor, momentum: float | None, running_mean: Tensor | None,
                          running_var: Tensor | None) -> bool:
    """Whether a pair's statistics kernel updates running statistics (running_mean given), checking what that needs:
    a momentum in [0, 1], (C,) vectors, more than one value per channel."""
    if running_mean is None:
        return False
    if momentum is None or not 0.0 <= momentum <= 1.0:
        raise ValueError(f"{op}: momentum must be in [0, 1] to update the running statistics, got {momentum}")
    _check_channel_vectors(x, running_mean=running_mean, running_var=running_var)
    _check_unbiased_count(op, x.numel() // x.shape[1])
    return True


def _check_unbiased_count(op: str, count: int) -> None:
    if count < 2:
        raise ValueError(f"{op}: the unbiased variance needs more than 1 value per channel, got {count}")


def _momentum_arg(momentum: float | None) -> float:
    """The ops' momentum: nn.BatchNorm2d's, or -1 for its momentum=None (the cumulative average)."""
    return -1.0 if momentum is None else float(momentum)


# --- sync_bn's building blocks: the fused passes split at the statistics and at the gradient sums -----------------


def _check_split_inputs(x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, invstd: Tensor,
                        grad_y: Tensor | None = None) -> None:
    """What every pass after the statistics takes: x, its four per-channel vectors and, backward, grad_y like x."""
    _check_supported(x, weight, bias)
    _check_channel_vectors(x, mean=mean, invstd=invstd)
    if grad_y is not None:
        _check_grad_y(grad_y, x)


def _check_grad_y(grad_y: Tensor, x: Tensor) -> None:
    if not isinstance(grad_y, Tensor) or grad_y.shape != x.shape or grad_y.device != x.device:
        raise ValueError(f"batch_norm_relu backward: grad_y must have the input's shape {tuple(x.shape)} and device "
                         f"{x.device}, got {tuple(getattr(grad_y, 'shape', ()))} on {getattr(grad_y, 'device', None)}")


def local_batch_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    """(mean, biased variance) of x per channel over this batch, fp64 [C] each: what a rank contributes to sync_bn's
    combine (fp64, so that the combine adds no rounding of its own)."""
    _check_supported(x, None, None)
    return _local_stats(x)


def batch_norm_relu_normalize(x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, invstd: Tensor) -> Tensor:
    """y = relu((x - mean) * weight * invstd + bias) in x's dtype and memory format, for given statistics (cast to
    fp32): the fused forward's arithmetic, bit for bit. Not differentiable by itself (see batch_norm_relu_input_grad)."""
    _check_split_inputs(x, weight, bias, mean, invstd)
    return _normalize(x, _f32(weight), _f32(bias), _f32(mean), _f32(invstd))


def batch_norm_relu_grad_sums(grad_y: Tensor, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor,
                              invstd: Tensor) -> Tensor:
    """[2, C] fp64: sum(g) and sum(g * (x - mean)) per channel over this batch, where g is grad_y where
    y = relu(...) > 0 (the mask recomputed from x, as the fused backward does). grad_weight = sums[1] * invstd and
    grad_bias = sums[0]."""
    _check_split_inputs(x, weight, bias, mean, invstd, grad_y)
    return _grad_sums(grad_y.to(x.dtype), x, _f32(weight), _f32(bias), _f32(mean), _f32(invstd))


def batch_norm_relu_input_grad(grad_y: Tensor, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, invstd: Tensor,
                               grad_means: Tensor) -> Tensor:
    """The input gradient of y = relu(batch_norm(x)) when the statistics are those of a larger batch (every rank's):
    grad_means [2, C] holds mean(g) and mean(g * (x - mean)) over that batch (the summed grad sums over its count).
    In x's dtype and memory format."""
    _check_split_inputs(x, weight, bias, mean, invstd, grad_y)
    if not isinstance(grad_means, Tensor) or tuple(grad_means.shape) != (2, x.shape[1]) or grad_means.device != x.device:
        raise ValueError(f"batch_norm_relu backward: grad_means must be a (2, {x.shape[1]}) tensor on {x.device}, got "
                         f"{tuple(getattr(grad_means, 'shape', ()))}")
    return _input_grad(grad_y.to(x.dtype), x, _f32(weight), _f32(bias), _f32(mean), _f32(invstd), _f32(grad_means))


def update_running_stats_unbiased(running_mean: Tensor, running_var: Tensor, num_batches_tracked: Tensor,
                                  mean: Tensor, unbiased_var: Tensor, momentum: float | None) -> None:
    """update_running_stats for a variance that is already unbiased (sync_bn: the global count is a device tensor,
    and reading it back would stall every layer). mean and unbiased_var are cast to fp32."""
    _update_unbiased(running_mean, running_var, num_batches_tracked, _f32(mean).contiguous(),
                     _f32(unbiased_var).contiguous(), _momentum_arg(momentum))
