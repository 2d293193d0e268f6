"""norm.apply_in_depthwise: a BatchNorm + ReLU (training, batch statistics) whose normalize is done by the depthwise
convolution after it, as that kernel loads its input. relu(batch_norm(y)) is never written or read back: the
BatchNorm computes only its statistics (one pass over y instead of three), and the depthwise forward and weight
gradient apply it to every word of y they load. Importing this module builds/loads the CUDA extension.

  mobilenet_bn::bn_stats(x, weight, bias, eps) -> (mean, invstd, var)
  mobilenet_bn::bn_stats_update(x, weight, bias, running_mean!, running_var!, num_batches_tracked!, eps, momentum)
      -> (mean, invstd, var)
      bn_relu_fwd / bn_relu_fwd_update without y: the same statistics and running-statistics update, bit for bit.
  mobilenet_dw::depthwise_fwd_normed(y, w, mean, invstd, norm_weight, norm_bias, stride, padding) -> out
      conv(relu(batch_norm(y)), w), with relu(batch_norm(y)) rounded to y's dtype as the BatchNorm's own apply pass
      stores it: the same bits as bn_relu_normalize followed by depthwise_fwd's column walk.
  mobilenet_dw::depthwise_wgrad_normed(grad_out, y, w, mean, invstd, norm_weight, norm_bias, stride, padding)
      -> grad_w
      its weight gradient, likewise from y (at stride 1 a walk with a lane per input row, which normalizes each word
      of y once; at stride 2 the column walk).

  mobilenet_dw::depthwise_bwd_normed(grad_out, y, w, mean, invstd, norm_weight, norm_bias, stride, padding,
                                     grad_sums=False) -> (grad_x, grad_w, sums)
      both gradients of the convolution (grad_x that of relu(batch_norm(y))): at stride 1 and padding 1 one walk
      (a lane per input row) reads grad_out once for both and writes grad_x in the rotated-kernel column walk's order,
      so grad_x has depthwise_bwd's bits; elsewhere depthwise_bwd's input gradient, then the weight gradient above.
      With grad_sums the walk also sums, as it writes grad_x beside the word of y it holds, the BatchNorm backward's
      sum(g) and sum(g * (y - mean)) (g = grad_x where the ReLU passed): sums [chunks, 2, C] fp32 partials
      (bwd_normed_sums_rows(n, c, h, w, stride, dtype) of them). At stride 2 and padding 1 grad_sums runs a walk
      with a lane per input row that gives grad_x, grad_w and the sums from one read of grad_out and of y (grad_x
      to depthwise_bwd's within a rounding: its own summation order). Elsewhere sums is empty.
      With out_x and out_consts (and grad_sums, where a walk gives the sums), grad_out is instead the gradient of the
      BatchNorm + ReLU after the convolution (out_x its input, the convolution's output; out_consts [6, C] from
      bn_relu_bwd_consts): the walk computes each grad_out word from the two as it loads them, the bits
      bn_relu_bwd's input gradient would have stored, and that input gradient is never written.
  mobilenet_dw::depthwise_bwd_normed_sums(grad_out, y, w, mean, invstd, norm_weight, norm_bias, stride, padding)
      -> (grad_w, sums)
      depthwise_bwd_normed with grad_sums (stride 1 or 2, padding 1) without its input gradient: the walks compute
      it for the sums and store nothing else (at stride 1 the input-row walk, also where the rings would run).
  mobilenet_dw::depthwise_dgrad_normed(grad_out, w, y, consts, stride, padding) -> grad_y
      the gradient of y itself in one pass from grad_out: the convolution's input gradient (the tiled kernel's,
      rounded to y's dtype as depthwise_bwd stores it) with the BatchNorm + ReLU's input-gradient arithmetic applied
      to each value (consts from bn_relu_bwd_consts_from_sums). Whole vectors of channels (8 16-bit or 4 fp32).
  mobilenet_bn::bn_relu_bwd_from_sums(grad_y, x, weight, bias, mean, invstd, sums) -> (grad_x, grad_weight, grad_bias)
      bn_relu_bwd with those sums instead of its reduce pass over grad_y and x.
  mobilenet_bn::bn_relu_bwd_consts(grad_y, x, weight, bias, mean, invstd) -> (consts, grad_weight, grad_bias)
      bn_relu_bwd without its input-gradient pass: that pass's per-channel constants [6, C] fp32 instead.
  mobilenet_bn::bn_relu_bwd_consts_from_sums(x, weight, bias, mean, invstd, sums) -> (consts, grad_weight, grad_bias)
      the same from the sums: the finalize alone.

The backward of the pair: depthwise_bwd_normed (or, for A/B runs, depthwise_bwd's input gradient, which does not read
the input, and depthwise_wgrad_normed), then bn_relu_bwd, which takes y and recomputes the ReLU's mask from it, or
bn_relu_bwd_from_sums where the walk gave the sums. With grad_in_dgrad (MBN_NORM_INPUT_GRAD=dgrad) the walk gives
only the sums and the weight gradient, and depthwise_dgrad_normed computes the BatchNorm's input gradient from
grad_out: the convolution's input gradient is never written or read back, for one more read of grad_out. Only these
NHWC 3x3 walks apply a BatchNorm to their input: other cases are refused (normed_unsupported and
dgrad_normed_unsupported say why), never run another way.

batch_norm_relu_depthwise_conv2d_batch_norm_relu adds the BatchNorm + ReLU after the convolution to the pair, so that
its backward runs bn_relu_bwd_consts (the reduce pass) and the walk applies its input gradient: one pass over three
tensors of the convolution's output size less per layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import in_weight_strides, kernel_layout, load
from .depthwise_args import out_shape, stats_unsupported
from .norm_ops import _check_running_update, _check_supported, _check_unbiased_count, _f32

load()

__all__ = ["normed_unsupported", "next_norm_unsupported", "dgrad_normed_unsupported",
           "batch_norm_relu_depthwise_conv2d", "batch_norm_relu_depthwise_conv2d_batch_norm_relu"]

_stats = torch.ops.mobilenet_bn.bn_stats.default
_stats_update = torch.ops.mobilenet_bn.bn_stats_update.default
_bn_bwd = torch.ops.mobilenet_bn.bn_relu_bwd.default
_fwd_normed = torch.ops.mobilenet_dw.depthwise_fwd_normed.default
_wgrad_normed = torch.ops.mobilenet_dw.depthwise_wgrad_normed.default
_dw_bwd = torch.ops.mobilenet_dw.depthwise_bwd.default
_bwd_normed = torch.ops.mobilenet_dw.depthwise_bwd_normed.default
_bn_bwd_from_sums = torch.ops.mobilenet_bn.bn_relu_bwd_from_sums.default
_bn_bwd_consts = torch.ops.mobilenet_bn.bn_relu_bwd_consts.default
_bwd_normed_sums = torch.ops.mobilenet_dw.depthwise_bwd_normed_sums.default
_dgrad_normed = torch.ops.mobilenet_dw.depthwise_dgrad_normed.default
_bn_bwd_consts_from_sums = torch.ops.mobilenet_bn.bn_relu_bwd_consts_from_sums.default
_bn_fwd = torch.ops.mobilenet_bn.bn_relu_fwd.default
_bn_fwd_update = torch.ops.mobilenet_bn.bn_relu_fwd_update.default


def _stats_outputs(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(x.new_empty(x.shape[1], dtype=torch.float32) for _ in range(3))


@torch.library.register_fake("mobilenet_bn::bn_stats")
def _stats_fake(x, weight, bias, eps):
    return _stats_outputs(x)


@torch.library.register_fake("mobilenet_bn::bn_stats_update")
def _stats_update_fake(x, weight, bias, running_mean, running_var, num_batches_tracked, eps, momentum):
    return _stats_outputs(x)


@torch.library.register_fake("mobilenet_dw::depthwise_fwd_normed")
def _fwd_normed_fake(y, w, mean, invstd, norm_weight, norm_bias, stride, padding):
    return torch.empty(out_shape(y.shape, w.shape, stride, padding, (1, 1)), dtype=y.dtype, device=y.device,
                       memory_format=kernel_layout(y))


@torch.library.register_fake("mobilenet_dw::depthwise_wgrad_normed")
def _wgrad_normed_fake(grad_out, y, w, mean, invstd, norm_weight, norm_bias, stride, padding):
    return w.new_empty(w.shape)


@torch.library.register_fake("mobilenet_dw::depthwise_bwd_normed")
def _bwd_normed_fake(grad_out, y, w, mean, invstd, norm_weight, norm_bias, stride, padding, grad_sums=False,
                     out_x=None, out_consts=None):
    n, c, h, width = y.shape
    rows = 0
    if grad_sums and tuple(stride) in ((1, 1), (2, 2)) and tuple(padding) == (1, 1):
        rows = torch.ops.mobilenet_dw.bwd_normed_sums_rows(n, c, h, width, stride[0], y.dtype)
    sums = y.new_empty((rows, 2, c) if rows else (0, 0, 0), dtype=torch.float32)
    return (torch.empty(y.shape, dtype=y.dtype, device=y.device, memory_format=kernel_layout(y)),
            w.new_empty(w.shape), sums)


@torch.library.register_fake("mobilenet_dw::depthwise_bwd_normed_sums")
def _bwd_normed_sums_fake(grad_out, y, w, mean, invstd, norm_weight, norm_bias, stride, padding):
    n, c, h, width = y.shape
    rows = torch.ops.mobilenet_dw.bwd_normed_sums_rows(n, c, h, width, stride[0], y.dtype)
    return w.new_empty(w.shape), y.new_empty((rows, 2, c), dtype=torch.float32)


@torch.library.register_fake("mobilenet_dw::depthwise_dgrad_normed")
def _dgrad_normed_fake(grad_out, w, y, consts, stride, padding):
    return torch.empty(y.shape, dtype=y.dtype, device=y.device, memory_format=kernel_layout(y))


@torch.library.register_fake("mobilenet_bn::bn_relu_bwd_consts_from_sums")
def _bn_bwd_consts_from_sums_fake(x, weight, bias, mean, invstd, sums):
    c = x.shape[1]
    return (x.new_empty((6, c), dtype=torch.float32), x.new_empty(c, dtype=torch.float32),
            x.new_empty(c, dtype=torch.float32))


@torch.library.register_fake("mobilenet_bn::bn_relu_bwd_from_sums")
def _bn_bwd_from_sums_fake(grad_y, x, weight, bias, mean, invstd, sums):
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=kernel_layout(x)),
            x.new_empty(x.shape[1], dtype=torch.float32), x.new_empty(x.shape[1], dtype=torch.float32))


@torch.library.register_fake("mobilenet_bn::bn_relu_bwd_consts")
def _bn_bwd_consts_fake(grad_y, x, weight, bias, mean, invstd):
    c = x.shape[1]
    return (x.new_empty((6, c), dtype=torch.float32), x.new_empty(c, dtype=torch.float32),
            x.new_empty(c, dtype=torch.float32))


def normed_unsupported(y: Tensor, weight: Tensor, bias: Tensor | None, stride, padding) -> str | None:
    """Why the column walk cannot apply a BatchNorm to this convolution's input, or None when it can: the cases of
    the statistics walk (channels_last, 3x3, one filter per channel, no bias, stride 1 or 2, whole 32-bit words of
    channels). Reads metadata only."""
    padding = padding if isinstance(padding, str) else tuple(padding)
    return stats_unsupported(y, weight, bias, tuple(stride), padding, (1, 1))


def dgrad_normed_unsupported(y: Tensor, weight: Tensor, stride, padding) -> str | None:
    """Why depthwise_dgrad_normed cannot compute the BatchNorm's input gradient for this pair, or None when it can:
    the walks that give the sums (stride 1 or 2, padding 1) and whole vectors of channels for the tiled kernel.
    Reads metadata only."""
    why = normed_unsupported(y, weight, None, stride, padding)
    if why is not None:
        return why
    if tuple(padding) != (1, 1):
        return f"the BatchNorm's input gradient in the input-gradient kernel needs padding 1, got {tuple(padding)}"
    vec = 4 if y.dtype == torch.float32 else 8
    if y.shape[1] % vec:
        return (f"the BatchNorm's input gradient in the input-gradient kernel needs a multiple of {vec} "
                f"{str(y.dtype).removeprefix('torch.')} channels, got {y.shape[1]}")
    return None


def _input_stats(y, norm_weight, norm_bias, running_mean, running_var, num_batches_tracked, eps, momentum, sums):
    """(mean, invstd) of the BatchNorm the pair applies to y, updating its running statistics where given; from
    `sums` (y's per-channel sums as the convolution that wrote y returned them) instead of a pass over y."""
    if sums is not None:
        mean, invstd, _var = torch.ops.mobilenet_bn.bn_stats_from_sums(
            sums, y.numel() // y.shape[1], running_mean, running_var, num_batches_tracked, eps, momentum)
    elif running_mean is not None:
        mean, invstd, _var = _stats_update(y, norm_weight, norm_bias, running_mean, running_var,
                                           num_batches_tracked, eps, momentum)
    else:
        mean, invstd, _var = _stats(y, norm_weight, norm_bias, eps)
    return mean, invstd


class _BatchNormReluDepthwise(torch.autograd.Function):
    """conv(relu(batch_norm(y))) from y: bn_stats(_update), depthwise_fwd_normed; backward as the module docstring."""

    @staticmethod
    def forward(ctx, y, norm_weight, norm_bias, conv_weight, running_mean, running_var, num_batches_tracked, eps,
                momentum, stride, padding, sums, one_walk, walk_sums, grad_in_dgrad):
        mean, invstd = _input_stats(y, norm_weight, norm_bias, running_mean, running_var, num_batches_tracked, eps,
                                    momentum, sums)
        out = _fwd_normed(y, conv_weight, mean, invstd, norm_weight, norm_bias, stride, padding)
        ctx.save_for_backward(y, norm_weight, norm_bias, conv_weight, mean, invstd)
        ctx.conv_args = (stride, padding, one_walk, walk_sums, grad_in_dgrad)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        y, norm_weight, norm_bias, conv_weight, mean, invstd = ctx.saved_tensors
        stride, padding, one_walk, walk_sums, grad_in_dgrad = ctx.conv_args
        needs = ctx.needs_input_grad
        grad_out = grad_out.to(y.dtype)
        if grad_in_dgrad and any(needs[:3]):
            # The walk's sums and weight gradient; then y's gradient in one pass from grad_out.
            grad_conv_weight, bn_sums = _bwd_normed_sums(grad_out, y, conv_weight, mean, invstd, norm_weight,
                                                         norm_bias, stride, padding)
            consts, grad_norm_weight, grad_norm_bias = _bn_bwd_consts_from_sums(y, norm_weight, norm_bias, mean,
                                                                                invstd, bn_sums)
            grad_y = _dgrad_normed(grad_out, conv_weight, y, consts, stride, padding) if needs[0] else None
            return (grad_y, grad_norm_weight if needs[1] else None, grad_norm_bias if needs[2] else None,
                    in_weight_strides(grad_conv_weight, conv_weight) if needs[3] else None,
                    None, None, None, None, None, None, None, None, None, None, None)
        grad_conv_weight = grad_x = None
        bn_sums = None  # the BatchNorm backward's gradient sums, where the walk gave them
        if any(needs[:3]) and one_walk:
            grad_x, grad_conv_weight, bn_sums = _bwd_normed(grad_out, y, conv_weight, mean, invstd, norm_weight,
                                                            norm_bias, stride, padding, walk_sums)
        elif any(needs[:3]):
            # The convolution's input gradient (y stands in for its input: the kernels read only its shape).
            grad_x = _dw_bwd(grad_out, y, conv_weight, stride, padding, [1, 1], [True, False, False])[0]
        if needs[3] and grad_conv_weight is None:
            grad_conv_weight = _wgrad_normed(grad_out, y, conv_weight, mean, invstd, norm_weight, norm_bias, stride,
                                             padding)
        grad_y = grad_norm_weight = grad_norm_bias = None
        if grad_x is not None and bn_sums is not None and bn_sums.numel():  # the BatchNorm + ReLU backward from y
            grad_y, grad_norm_weight, grad_norm_bias = _bn_bwd_from_sums(grad_x, y, norm_weight, norm_bias, mean,
                                                                         invstd, bn_sums)
        elif grad_x is not None:
            grad_y, grad_norm_weight, grad_norm_bias = _bn_bwd(grad_x, y, norm_weight, norm_bias, mean, invstd)
        return (grad_y if needs[0] else None, grad_norm_weight if needs[1] else None,
                grad_norm_bias if needs[2] else None, in_weight_strides(grad_conv_weight, conv_weight) if needs[3] else None,
                None, None, None, None, None, None, None, None, None, None, None)


def next_norm_unsupported(y: Tensor, weight: Tensor, bias: Tensor | None, stride, padding) -> str | None:
    """Why the backward walks cannot also apply the BatchNorm after this convolution, or None when they can: the
    cases of normed_unsupported at stride 1 or 2 with padding 1 (the walks that give the BatchNorm sums)."""
    why = normed_unsupported(y, weight, bias, stride, padding)
    if why is None and (tuple(stride) not in ((1, 1), (2, 2)) or tuple(padding) != (1, 1)):
        why = (f"the BatchNorm after the convolution is applied by the stride-1 and stride-2 walks with padding 1, got "
               f"stride {tuple(stride)} and padding {tuple(padding)}")
    return why


def _check_pair(name, y, norm_weight, norm_bias, conv_weight, stride, padding, running_mean, running_var, momentum,
                sums, unsupported=normed_unsupported):
    """The arguments of a BatchNorm + ReLU + depthwise conv pair checked (ValueError naming what is wrong; the cases
    `unsupported` refuses): returns (conv_weight in y's dtype, stride, padding as int lists, whether the running
    statistics are updated)."""
    _check_supported(y, norm_weight, norm_bias)
    if not isinstance(conv_weight, Tensor) or conv_weight.dim() != 4:
        raise ValueError(f"{name}: conv_weight must have shape (C, 1, 3, 3), got "
                         f"{tuple(getattr(conv_weight, 'shape', ()))}")
    conv_weight = conv_weight.to(y.dtype)
    stride, padding = [int(v) for v in stride], [int(v) for v in padding]
    why = unsupported(y, conv_weight, None, stride, padding)
    if why is not None:
        raise ValueError(f"{name}: {why}")
    update = _check_running_update(name, y, momentum, running_mean, running_var)
    if sums is not None and (sums.dtype != torch.float32 or tuple(sums.shape) != (2, y.shape[1])):
        raise ValueError(f"{name}: sums must be a float32 (2, {y.shape[1]}) tensor, got {sums.dtype} "
                         f"{tuple(sums.shape)}")
    return conv_weight, stride, padding, update


def batch_norm_relu_depthwise_conv2d(y: Tensor, norm_weight: Tensor, norm_bias: Tensor, conv_weight: Tensor,
                                     stride=(1, 1), padding=(1, 1), eps: float = 1e-5,
                                     running_mean: Tensor | None = None, running_var: Tensor | None = None,
                                     num_batches_tracked: Tensor | None = None,
                                     momentum: float | None = None, sums: Tensor | None = None,
                                     one_walk: bool = True, walk_sums: bool = False,
                                     grad_in_dgrad: bool = False) -> Tensor:
    """F.conv2d(relu(batch_norm(y, training=True)), conv_weight, None, stride, padding, groups=C) for a 3x3 depthwise
    conv_weight (C, 1, 3, 3) on channels_last y, without relu(batch_norm(y)) being stored. With running_mean,
    running_var and num_batches_tracked (and momentum in [0, 1]) the running statistics are updated as
    nn.BatchNorm2d updates them, in the statistics kernel. Differentiable in y, norm_weight, norm_bias and
    conv_weight. conv_weight is used in y's dtype (autocast's rule for a convolution), the BatchNorm's parameters in
    fp32. Cases the walk does not take raise ValueError (normed_unsupported says why). `sums` [2, C] fp32, the sum
    and sum of squares of y per channel as the convolution that wrote y returned them (kernels/norm_pointwise.py),
    replace the BatchNorm's statistics pass over y. one_walk=False runs the backward's input and weight gradients as
    two kernels (the same input gradient, bit for bit), for A/B runs; walk_sums (with one_walk) has the walk sum the
    BatchNorm backward's gradient sums too (the same gradients to those sums' summation order at stride 1; at stride
    2 the stride-2 walk, whose input gradient also sums in its own order). grad_in_dgrad (with walk_sums) has the
    walk give only the sums and the weight gradient, and the gradient of y computed from grad_out in one pass
    (depthwise_dgrad_normed); cases it does not take raise ValueError (dgrad_normed_unsupported says why)."""
    name = "batch_norm_relu_depthwise_conv2d"
    conv_weight, stride, padding, update = _check_pair(name, y, norm_weight, norm_bias, conv_weight, stride, padding,
                                                       running_mean, running_var, momentum, sums)
    if grad_in_dgrad:
        if not (one_walk and walk_sums):
            raise ValueError(f"{name}: grad_in_dgrad needs the walk's sums (one_walk=True, walk_sums=True)")
        why = dgrad_normed_unsupported(y, conv_weight, stride, padding)
        if why is not None:
            raise ValueError(f"{name}: {why}")
    return _BatchNormReluDepthwise.apply(y, _f32(norm_weight), _f32(norm_bias), conv_weight, running_mean,
                                         running_var, num_batches_tracked, float(eps),
                                         float(momentum) if update else 0.0, stride, padding, sums, bool(one_walk),
                                         bool(one_walk and walk_sums), bool(grad_in_dgrad))


class _BatchNormReluDepthwiseBatchNormRelu(torch.autograd.Function):
    """relu(batch_norm(conv(relu(batch_norm(y))))) from y: the pair above, then the BatchNorm + ReLU after the
    convolution (bn_relu_fwd(_update) on its output z). Backward: bn_relu_bwd_consts(grad, z) (the reduce pass and the
    gradients of that BatchNorm's weight and bias), depthwise_bwd_normed with out_x=z (the walk applies that
    BatchNorm's input gradient as it loads grad), then bn_relu_bwd_from_sums for the BatchNorm before. Returns (out,
    mean, var) of the BatchNorm after (mean and var: its batch statistics, not differentiable)."""

    @staticmethod
    def forward(ctx, y, norm_weight, norm_bias, conv_weight, running_mean, running_var, num_batches_tracked, eps,
                momentum, stride, padding, sums, out_weight, out_bias, out_running_mean, out_running_var,
                out_num_batches_tracked, out_eps, out_momentum):
        mean, invstd = _input_stats(y, norm_weight, norm_bias, running_mean, running_var, num_batches_tracked, eps,
                                    momentum, sums)
        z = _fwd_normed(y, conv_weight, mean, invstd, norm_weight, norm_bias, stride, padding)
        if out_running_mean is not None:
            out, out_mean, out_invstd, out_var = _bn_fwd_update(z, out_weight, out_bias, out_running_mean,
                                                                out_running_var, out_num_batches_tracked, out_eps,
                                                                out_momentum)
        else:
            out, out_mean, out_invstd, out_var = _bn_fwd(z, out_weight, out_bias, out_eps)
        ctx.save_for_backward(y, norm_weight, norm_bias, conv_weight, mean, invstd, z, out_weight, out_bias, out_mean,
                              out_invstd)
        ctx.conv_args = (stride, padding)
        ctx.mark_non_differentiable(out_mean, out_var)
        return out, out_mean, out_var

    @staticmethod
    def backward(ctx, grad_out, _grad_mean, _grad_var):
        (y, norm_weight, norm_bias, conv_weight, mean, invstd, z, out_weight, out_bias, out_mean,
         out_invstd) = ctx.saved_tensors
        stride, padding = ctx.conv_args
        needs = ctx.needs_input_grad
        grad_out = grad_out.to(z.dtype)
        consts, grad_out_weight, grad_out_bias = _bn_bwd_consts(grad_out, z, out_weight, out_bias, out_mean,
                                                                out_invstd)
        grad_x, grad_conv_weight, bn_sums = _bwd_normed(grad_out, y, conv_weight, mean, invstd, norm_weight,
                                                        norm_bias, stride, padding, True, z, consts)
        grad_y, grad_norm_weight, grad_norm_bias = _bn_bwd_from_sums(grad_x, y, norm_weight, norm_bias, mean, invstd,
                                                                     bn_sums)
        return (grad_y if needs[0] else None, grad_norm_weight if needs[1] else None,
                grad_norm_bias if needs[2] else None, in_weight_strides(grad_conv_weight, conv_weight) if needs[3] else None,
                None, None, None, None, None, None, None, None, grad_out_weight if needs[12] else None,
                grad_out_bias if needs[13] else None, None, None, None, None, None)


def batch_norm_relu_depthwise_conv2d_batch_norm_relu(
        y: Tensor, norm_weight: Tensor, norm_bias: Tensor, conv_weight: Tensor, out_weight: Tensor, out_bias: Tensor,
        stride=(1, 1), padding=(1, 1), eps: float = 1e-5, running_mean: Tensor | None = None,
        running_var: Tensor | None = None, num_batches_tracked: Tensor | None = None, momentum: float | None = None,
        out_eps: float = 1e-5, out_running_mean: Tensor | None = None, out_running_var: Tensor | None = None,
        out_num_batches_tracked: Tensor | None = None, out_momentum: float | None = None,
        sums: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """relu(batch_norm(batch_norm_relu_depthwise_conv2d(y, ...), out_weight, out_bias)): the pair of
    batch_norm_relu_depthwise_conv2d (its arguments and cases), then a BatchNorm + ReLU (training, batch statistics,
    out_weight and out_bias fp32) on the convolution's output, whose running statistics are updated where
    out_running_mean, out_running_var, out_num_batches_tracked and out_momentum are given. The backward's walk applies
    that BatchNorm's input gradient as it loads the gradient (the same bits as bn_relu_bwd's, never stored), at
    stride 1 or 2 with padding 1 (the walks that give the BatchNorm sums); other cases raise ValueError. Returns
    (out, mean, var): out in y's dtype and layout, and the batch mean and biased variance of the BatchNorm after, fp32
    (for a caller that updates its running statistics itself)."""
    name = "batch_norm_relu_depthwise_conv2d_batch_norm_relu"
    conv_weight, stride, padding, update = _check_pair(name, y, norm_weight, norm_bias, conv_weight, stride, padding,
                                                       running_mean, running_var, momentum, sums,
                                                       unsupported=next_norm_unsupported)
    _check_supported(y, out_weight, out_bias)
    # The BatchNorm after runs on the convolution's output: y's channels, the output's values per channel.
    out_update = _check_running_update(name, y, out_momentum, out_running_mean, out_running_var)
    n, c, oh, ow = out_shape(y.shape, conv_weight.shape, stride, padding, (1, 1))
    if out_update:
        _check_unbiased_count(name, n * oh * ow)
    return _BatchNormReluDepthwiseBatchNormRelu.apply(
        y, _f32(norm_weight), _f32(norm_bias), conv_weight, running_mean, running_var, num_batches_tracked,
        float(eps), float(momentum) if update else 0.0, stride, padding, sums, _f32(out_weight), _f32(out_bias),
        out_running_mean, out_running_var, out_num_batches_tracked, float(out_eps),
        float(out_momentum) if out_update else 0.0)
