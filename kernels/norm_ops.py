"""Python side of the fused BatchNorm + ReLU ops (torch.ops.mobilenet_bn): fake kernels, autograd, autocast, and the
public `batch_norm_relu_train`. Importing this module builds/loads the CUDA extension (kernels.load()), so it raises
kernels.KernelUnavailable where the kernels cannot run.

  bn_relu_fwd(x, weight, bias, eps) -> (y, mean, invstd, var)
      y = relu((x - mean) * invstd * weight + bias) in x's dtype and layout; batch statistics per channel in fp32
      (var biased, invstd = 1 / sqrt(var + eps)). x fp32/fp16/bf16; weight and bias fp32.
  bn_relu_bwd(grad_y, x, weight, bias, mean, invstd) -> (grad_x, grad_weight, grad_bias)
      the ReLU's backward folded in (grad_y where y > 0, the mask recomputed from x); grad_x in x's dtype and layout,
      the others fp32.
  bn_update_running_stats(running_mean!, running_var!, num_batches_tracked!, mean, var, momentum, count)
      nn.BatchNorm2d's running-statistics update in one kernel (momentum < 0: the cumulative average); public as
      `update_running_stats`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import kernel_layout, load

load()

__all__ = ["batch_norm_relu_train", "update_running_stats"]

_fwd = torch.ops.mobilenet_bn.bn_relu_fwd.default
_bwd = torch.ops.mobilenet_bn.bn_relu_bwd.default
_update = torch.ops.mobilenet_bn.bn_update_running_stats.default

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


_layout = kernel_layout


@torch.library.register_fake("mobilenet_bn::bn_relu_fwd")
def _fwd_fake(x, weight, bias, eps):
    c = x.shape[1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=_layout(x))
    stats = [x.new_empty(c, dtype=torch.float32) for _ in range(3)]
    return (y, *stats)


@torch.library.register_fake("mobilenet_bn::bn_relu_bwd")
def _bwd_fake(grad_y, x, weight, bias, mean, invstd):
    c = x.shape[1]
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=_layout(x))
    return grad_x, x.new_empty(c, dtype=torch.float32), x.new_empty(c, dtype=torch.float32)


@torch.library.register_fake("mobilenet_bn::bn_update_running_stats")
def _update_fake(running_mean, running_var, num_batches_tracked, mean, var, momentum, count):
    return None


def _setup_context(ctx, inputs, output):
    x, weight, bias, _eps = inputs
    _y, mean, invstd, var = output
    # Not y: the backward recomputes the ReLU mask from x (one tensor less to read, and to keep alive).
    ctx.save_for_backward(x, weight, bias, mean, invstd)
    ctx.mark_non_differentiable(mean, invstd, var)


def _backward(ctx, grad_y, _grad_mean, _grad_invstd, _grad_var):
    x, weight, bias, mean, invstd = ctx.saved_tensors
    if grad_y is None or not any(ctx.needs_input_grad[:3]):
        return None, None, None, None
    grad_x, grad_weight, grad_bias = _bwd(grad_y.to(x.dtype), x, weight, bias, mean, invstd)
    return (grad_x if ctx.needs_input_grad[0] else None, grad_weight if ctx.needs_input_grad[1] else None,
            grad_bias if ctx.needs_input_grad[2] else None, None)


torch.library.register_autograd("mobilenet_bn::bn_relu_fwd", _backward, setup_context=_setup_context)


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


def _bwd_autocast_args(grad_y, x, weight, bias, mean, invstd):
    return grad_y.to(x.dtype), x, _f32(weight), _f32(bias), _f32(mean), _f32(invstd)


_lib = torch.library.Library("mobilenet_bn", "FRAGMENT")
_register_autocast("bn_relu_fwd", _fwd_autocast_args)
_register_autocast("bn_relu_bwd", _bwd_autocast_args)


def _check_supported(x: Tensor, weight: Tensor, bias: Tensor) -> None:
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
    for name, t in (("weight", weight), ("bias", bias)):
        if not isinstance(t, Tensor) or tuple(t.shape) != (c,) or t.device != x.device:
            raise ValueError(f"batch_norm_relu: {name} must be a ({c},) tensor on {x.device}, got "
                             f"{tuple(getattr(t, 'shape', ()))} on {getattr(t, 'device', None)}")


def batch_norm_relu_train(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5):
    """relu(batch_norm(x, training=True)) with batch statistics, fused. Returns (y, mean, invstd, var): y in x's dtype
    and memory format; mean, invstd = 1 / sqrt(var + eps) and the biased variance var per channel, in fp32.
    Differentiable in x, weight and bias (weight and bias are used in fp32, cast if they are not)."""
    _check_supported(x, weight, bias)
    return _fwd(x, _f32(weight), _f32(bias), float(eps))


def update_running_stats(running_mean: Tensor, running_var: Tensor, num_batches_tracked: Tensor, mean: Tensor,
                         var: Tensor, momentum: float | None, count: int) -> None:
    """nn.BatchNorm2d's running-statistics update, in place and in one kernel: num_batches_tracked += 1, then
    running = (1 - f) * running + f * batch with the unbiased variance var * count / (count - 1), where f = momentum,
    or 1 / num_batches_tracked for momentum=None. mean and var: this batch's mean and biased variance (fp32, as
    batch_norm_relu_train returns them) over `count` values per channel."""
    if count < 2:
        raise ValueError(f"update_running_stats: the unbiased variance needs more than 1 value per channel, got {count}")
    _update(running_mean, running_var, num_batches_tracked, mean, var, -1.0 if momentum is None else float(momentum),
            int(count))
