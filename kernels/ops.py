"""Python side of the custom depthwise op: fake (meta) kernels, autograd, autocast, and the public
`depthwise_conv2d`. Importing this module builds/loads the CUDA extension (kernels.load()), so it raises
kernels.KernelUnavailable where the kernels cannot run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import in_weight_strides, kernel_layout, load
from .conv_arith import IntOrPair, resolve_padding, to_pair
from .depthwise_args import check_supported as _check_supported
from .depthwise_args import out_shape, stats_bands, stats_unsupported

load()

__all__ = ["depthwise_conv2d", "depthwise_conv2d_stats"]

_fwd = torch.ops.mobilenet_dw.depthwise_fwd.default
_bwd = torch.ops.mobilenet_dw.depthwise_bwd.default
_fwd_stats = torch.ops.mobilenet_dw.depthwise_fwd_stats.default

_layout = kernel_layout


# The forward epilogue's activations, by the name users pass, as the op's `activation` argument.
ACTIVATIONS = {None: 0, "relu": 1, "relu6": 2}


@torch.library.register_fake("mobilenet_dw::depthwise_fwd")
def _fwd_fake(x, w, bias, stride, padding, dilation, activation=0):
    return torch.empty(out_shape(x.shape, w.shape, stride, padding, dilation), dtype=x.dtype, device=x.device,
                       memory_format=_layout(x))


@torch.library.register_fake("mobilenet_dw::depthwise_bwd")
def _bwd_fake(grad_out, x, w, stride, padding, dilation, output_mask):
    gx = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=_layout(x)) if output_mask[0] else x.new_empty(0)
    gw = w.new_empty(w.shape) if output_mask[1] else w.new_empty(0)
    gb = w.new_empty(w.shape[0]) if output_mask[2] else w.new_empty(0)
    return gx, gw, gb


@torch.library.register_fake("mobilenet_dw::depthwise_fwd_stats")
def _fwd_stats_fake(x, w, stride, padding):
    shape = out_shape(x.shape, w.shape, stride, padding, (1, 1))
    y = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=_layout(x))
    bands = stats_bands(*shape, stride[0], x.dtype)
    return y, x.new_empty((bands, 3, shape[1]), dtype=torch.float64)


def _setup_context(ctx, inputs, output):
    x, w, bias, stride, padding, dilation, *rest = inputs
    ctx.activation = rest[0] if rest else 0
    # With an activation the output is needed for its gradient mask (y > 0, and y < 6 for ReLU6).
    ctx.save_for_backward(x, w, output if ctx.activation else None)
    ctx.conv_args = (stride, padding, dilation)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, w, y = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
    if not any(mask):
        return None, None, None, None, None, None, None
    if ctx.activation:
        passes = y > 0 if ctx.activation == ACTIVATIONS["relu"] else (y > 0) & (y < 6)
        grad = grad * passes
    # One op for all three gradients: grad_out is consumed by dgrad and wgrad in the same call.
    gx, gw, gb = _bwd(grad.to(x.dtype), x, w, *ctx.conv_args, mask)
    return (gx if mask[0] else None, in_weight_strides(gw, w) if mask[1] else None, gb if mask[2] else None,
            None, None, None, None)


torch.library.register_autograd("mobilenet_dw::depthwise_fwd", _backward, setup_context=_setup_context)


def _stats_setup_context(ctx, inputs, output):
    x, w, stride, padding = inputs
    ctx.save_for_backward(x, w)
    ctx.conv_args = (stride, padding, [1, 1])
    ctx.mark_non_differentiable(output[1])


def _stats_backward(ctx, grad, _grad_partials):
    # depthwise_fwd's backward without bias or activation: the statistics are outputs only (the BatchNorm's own
    # backward accounts for how its statistics depend on y).
    x, w = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], False]
    if grad is None or not any(mask):
        return None, None, None, None
    gx, gw, _ = _bwd(grad.to(x.dtype), x, w, *ctx.conv_args, mask)
    return gx if mask[0] else None, in_weight_strides(gw, w) if mask[1] else None, None, None


torch.library.register_autograd("mobilenet_dw::depthwise_fwd_stats", _stats_backward,
                                setup_context=_stats_setup_context)


def _register_autocast(qualname: str) -> None:
    """Autocast: cast floating inputs to the active autocast dtype (fp16 or bf16), then run with autocast
    off. torch.library.register_autocast fixes one target dtype; this follows torch.autocast(dtype=...)."""
    op = getattr(torch.ops.mobilenet_dw, qualname.split("::")[1]).default
    key = torch._C.DispatchKey.AutocastCUDA

    def cast(v, dtype):
        if isinstance(v, Tensor) and v.is_floating_point() and v.dtype != torch.float64 and v.is_cuda:
            return v.to(dtype)
        return v

    def autocast_impl(*args):
        dtype = torch.get_autocast_dtype("cuda")
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*[cast(a, dtype) for a in args])

    if op.has_kernel_for_dispatch_key(key):
        op.py_kernels.pop(key, None)
    op.py_impl(key)(autocast_impl)
    _lib.impl(qualname.split("::")[1], lambda _keyset, *args: autocast_impl(*args), "AutocastCUDA", with_keyset=True)


_lib = torch.library.Library("mobilenet_dw", "FRAGMENT")
_register_autocast("mobilenet_dw::depthwise_fwd")
_register_autocast("mobilenet_dw::depthwise_bwd")
_register_autocast("mobilenet_dw::depthwise_fwd_stats")


def depthwise_conv2d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: IntOrPair = (1, 1),
    padding: IntOrPair | str = (0, 0),
    dilation: IntOrPair = (1, 1),
    activation: str | None = None,
) -> Tensor:
    """Depthwise conv2d (groups = C, weight (C * m, 1, kh, kw) for a depth multiplier m >= 1) with the custom CUDA
    kernels; same arguments and result as F.conv2d(x, weight, bias, stride, padding, dilation, groups=C), for
    every case F.conv2d runs, then `activation` ("relu", "relu6" or None) applied in the same kernel. Output in
    x's memory format.

    padding='same' with an even kernel pads one more at the bottom/right than at the top/left, as F.conv2d does;
    the op takes one padding per axis, so that case runs with the larger (bottom/right) padding on both sides,
    which computes one extra first output row/column, and drops it: exactly F.conv2d's taps, in the same order."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"depthwise_conv2d: activation {activation!r} is not supported "
                         f"(choose one of: None, 'relu', 'relu6')")
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"depthwise_conv2d: input must be a 4-D tensor (N, C, H, W), got {getattr(x, 'shape', x)}")
    if not isinstance(weight, Tensor) or weight.dim() != 4:
        raise ValueError(f"depthwise_conv2d: weight must have shape (C * m, 1, kh, kw), got "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    if not x.is_cuda:
        raise ValueError(f"depthwise_conv2d: the custom kernels need CUDA tensors, got input on {x.device}")
    stride = to_pair(stride, "depthwise_conv2d: stride")
    dilation = to_pair(dilation, "depthwise_conv2d: dilation")
    before, after = resolve_padding(padding, weight.shape[-2:], stride, dilation, "depthwise_conv2d")
    _check_supported(x, weight, bias, stride, after, dilation)
    y = _fwd(x, weight, bias, list(stride), list(after), list(dilation), ACTIVATIONS[activation])
    if before != after:  # 'same' with an even kernel: drop the extra first row/column (see above)
        y = y[:, :, after[0] - before[0]:, after[1] - before[1]:].contiguous(memory_format=_layout(x))
    return y


def depthwise_conv2d_stats(x: Tensor, weight: Tensor, stride: IntOrPair = (1, 1),
                           padding: IntOrPair = (1, 1)) -> tuple[Tensor, Tensor]:
    """(y, partials): y = F.conv2d(x, weight, None, stride, padding, groups=C) for a 3x3 depthwise weight (C, 1, 3, 3)
    on channels_last x, and the statistics of y as stored, per band of output rows: partials [bands, 3, C] float64 =
    (count, mean, M2 = sum of squared deviations) per band and channel, for kernels.norm_ops.batch_norm_relu_from_partials.
    y is bitwise depthwise_conv2d's where that runs the column walk too (the default knobs, C a multiple of 8 16-bit
    or 4 fp32 channels), else equal to rounding. Differentiable in x and weight (not through partials).
    Cases the statistics walk does not take raise ValueError (kernels.depthwise_args.stats_unsupported says why)."""
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"depthwise_conv2d_stats: input must be a 4-D tensor (N, C, H, W), got {getattr(x, 'shape', x)}")
    if not isinstance(weight, Tensor) or weight.dim() != 4:
        raise ValueError(f"depthwise_conv2d_stats: weight must have shape (C, 1, 3, 3), got "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    stride = to_pair(stride, "depthwise_conv2d_stats: stride")
    padding = to_pair(padding, "depthwise_conv2d_stats: padding")
    _check_supported(x, weight, None, stride, padding, (1, 1))
    why = stats_unsupported(x, weight, None, stride, padding, (1, 1))
    if why is not None:
        raise ValueError(f"depthwise_conv2d_stats: {why}")
    return _fwd_stats(x, weight, list(stride), list(padding))
