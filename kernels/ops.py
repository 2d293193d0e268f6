"""Python side of the custom depthwise op: fake (meta) kernels, depthwise_fwd_stats' autograd, and the public
`depthwise_conv2d`; depthwise_fwd's autograd and the ops' autocast kernels are C++ (csrc/depthwise_autograd.cpp).
Importing this module builds/loads the CUDA extension (kernels.load()), so it raises kernels.KernelUnavailable where
the kernels cannot run.
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


# depthwise_fwd's autograd and the three ops' autocast kernels are C++ (csrc/depthwise_autograd.cpp): an eager
# training step calls them for every layer and direction, and as Python kernels they made that step host-bound.

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
    key = plan = None
    if not torch.compiler.is_compiling():  # traced once there; the cache would only add guards
        try:
            key = (x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device,
                   None if bias is None else (bias.shape, bias.dtype, bias.device), stride, padding, dilation,
                   activation, torch.is_autocast_enabled("cuda"))
            plan = _PLANS.get(key)
        except (AttributeError, TypeError):  # not tensors, or list arguments: checked below, not remembered
            key = None
    if plan is None:
        plan = _plan(x, weight, bias, stride, padding, dilation, activation)
        if key is not None:
            if len(_PLANS) >= 4096:
                _PLANS.clear()
            _PLANS[key] = plan
    stride, after, dilation, crop, code = plan
    y = _fwd(x, weight, bias, stride, after, dilation, code)
    if crop is not None:  # 'same' with an even kernel: drop the extra first row/column (see above)
        y = y[:, :, crop[0]:, crop[1]:].contiguous(memory_format=_layout(x))
    return y


# depthwise_conv2d's checked arguments by everything its checks read: an eager training step calls it for every layer
# with the same few keys, and the checks would cost the host tens of microseconds a call.
_PLANS: dict[tuple, tuple] = {}


def _plan(x, weight, bias, stride, padding, dilation, activation) -> tuple:
    """(stride, padding, dilation as the op takes them, the (rows, columns) to crop or None, activation code); raises
    ValueError for what F.conv2d refuses."""
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
    crop = None if before == after else (after[0] - before[0], after[1] - before[1])
    return list(stride), list(after), list(dilation), crop, ACTIVATIONS[activation]


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
