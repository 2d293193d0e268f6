"""norm.apply_in_pointwise: a BatchNorm + ReLU (training, batch statistics) whose normalize is done by the 1x1
convolution after it, through cuDNN's fused convolutions (the graph API, driven by cudnn-frontend's Python
bindings: nvidia-cudnn-frontend, a dependency). relu(batch_norm(y)) is never written or read back: the BatchNorm computes
only its statistics, and cuDNN's forward and weight-gradient kernels apply relu(y * scale + shift) to y as they load
it (scale = weight * invstd, shift = bias - mean * scale per channel, rounded to fp16: cuDNN 9.19 runs no fp32
operands here on Hopper), the way NVIDIA's MLPerf ResNet-50 fuses its NHWC BatchNorms into the next convolution.
fp16 only: bf16 operands are too coarse.

  mobilenet_bn::bn_scale_shift(mean, invstd, weight, bias, dtype) -> scale_shift
      [2, C] in y's dtype: scale = weight * invstd, shift = bias - mean * scale against the rounded scale.
  mobilenet_cudnn::sbr_conv1x1(y, scale_shift, w) -> (out, sums)
      conv1x1(relu(y * scale + shift), w): y channels_last fp16, w (K, C, 1, 1) in y's dtype, out like y; and
      sums [2, K] fp32, the sum and sum of squares of out per channel (cuDNN's genstats epilogue), from which the
      next BatchNorm takes its statistics instead of a pass over out (mobilenet_bn::bn_stats_from_sums). genstats
      adds its blocks' sums with atomics: they vary in their last bits between calls (so steps are not bitwise
      repeatable, and norm.apply_in_pointwise is off by default); out is repeatable.
  mobilenet_cudnn::sbr_conv1x1_wgrad(grad_out, y, scale_shift, w) -> grad_w
      its weight gradient, relu(y * scale + shift) recomputed from y; grad_w like w.

The backward of the pair: the convolution's input gradient (cuDNN's plain dgrad, which does not read the input),
the weight gradient above, then mobilenet_bn::bn_relu_bwd, which takes y and recomputes the ReLU's mask from it, as
norm.apply_in_depthwise does. Each cuDNN graph is built once per shape and autotuned over the heuristics' first
buildable plans on its first call (cudnn.benchmark's rule), which must not be inside a CUDA-graph capture: train.py's
captured step runs its warm-up steps eagerly first.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from . import in_weight_strides
from .cudnn_frontend import cudnn_frontend_missing
from .depthwise_args import out_shape
from .norm_depthwise import (_bn_bwd_consts, _bn_bwd_from_sums, _bwd_normed, _check_pair, _fwd_normed, _input_stats,
                             next_norm_unsupported)
from .norm_ops import _check_running_update, _check_supported, _check_unbiased_count, _f32

__all__ = ["pointwise_unsupported", "batch_norm_relu_conv1x1", "stats_from_sums", "sbr_conv1x1", "sbr_conv1x1_wgrad",
           "batch_norm_relu_depthwise_conv2d_batch_norm_relu_conv1x1"]

_CANDIDATES = 4  # execution plans timed per graph


def pointwise_unsupported(y: Tensor, weight: Tensor) -> str | None:
    """Why the fused graphs cannot take this 1x1 convolution of y, or None when they can. Reads metadata only."""
    if y.dtype != torch.float16:
        # cuDNN takes the scale and shift operands in the input's dtype: bf16's 8 significant bits failed the
        # float64 checks that fp16 passes (docs/results/pointwise_norm_fusion_h200.md).
        return (f"cuDNN's fused convolutions are used with fp16 inputs only, got {y.dtype} (run with amp=true "
                "amp_dtype=fp16)")
    if y.dim() != 4 or not y.is_contiguous(memory_format=torch.channels_last) or y.is_contiguous():
        return "the input must be channels_last (NHWC)"
    if weight.dim() != 4 or tuple(weight.shape[1:]) != (y.shape[1], 1, 1):
        return f"the convolution must be 1x1 over all {y.shape[1]} channels, got weight {tuple(weight.shape)}"
    if y.shape[1] % 8 or weight.shape[0] % 8:
        return (f"cuDNN's fused kernels need channel counts that are multiples of 8, got {y.shape[1]} -> "
                f"{weight.shape[0]}")
    return None


# --- the cuDNN graphs ---------------------------------------------------------------------------------------------

_lock = threading.Lock()
_handles: dict[int, object] = {}
_plans: dict[tuple, "_Plan"] = {}


def _cudnn():
    import cudnn

    return cudnn


def _handle(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _handles:
            with torch.cuda.device(index):
                _handles[index] = _cudnn().create_handle()
        return _handles[index]


def _nhwc_strides(shape) -> list[int]:
    n, c, h, w = shape
    return [h * w * c, 1, w * c, c]


class _Plan:
    """One cuDNN graph for one shape, with the execution plan that ran fastest on its first inputs."""

    def __init__(self, kind: str, y: Tensor, w: Tensor, feeds: dict[str, Tensor]):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"norm.apply_in_pointwise: cuDNN's {kind} graph for input {tuple(y.shape)} would be "
                               "built and autotuned inside a CUDA-graph capture; run one step eagerly first")
        cudnn = _cudnn()
        self.handle = _handle(y.device)
        io = cudnn.data_type.HALF  # fp16 only (pointwise_unsupported)
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        c = y.shape[1]
        t = {"y": g.tensor(name="y", dim=list(y.shape), stride=_nhwc_strides(y.shape), data_type=io),
             # in y's dtype: cuDNN 9.19 on Hopper has no engine for fp32 scale and shift operands here
             "scale": g.tensor(name="scale", dim=[1, c, 1, 1], stride=[c, 1, c, c], data_type=io),
             "shift": g.tensor(name="shift", dim=[1, c, 1, 1], stride=[c, 1, c, c], data_type=io)}
        normed = g.relu(name="relu", input=g.bias(name="shift", input=g.scale(name="scale", input=t["y"],
                                                                                scale=t["scale"]), bias=t["shift"]))
        conv = dict(padding=[0, 0], stride=[1, 1], dilation=[1, 1])
        if kind == "fprop":
            t["w"] = g.tensor(name="w", dim=list(w.shape), stride=_nhwc_strides(w.shape), data_type=io)
            t["out"] = g.conv_fprop(image=normed, weight=t["w"], **conv)
            t["out"].set_output(True).set_data_type(io)
            # The only form of this graph cuDNN 9 runs on Hopper has the statistics epilogue (without it: "no
            # valid engine configs", docs/results/pointwise_norm_fusion_h200.md).
            t["sum"], t["sumsq"] = g.genstats(name="genstats", input=t["out"])
            t["sum"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
            t["sumsq"].set_output(True).set_data_type(cudnn.data_type.FLOAT)
        else:
            grad_shape = feeds["grad_out"].shape
            t["grad_out"] = g.tensor(name="grad_out", dim=list(grad_shape), stride=_nhwc_strides(grad_shape),
                                     data_type=io)
            t["grad_w"] = g.conv_wgrad(image=normed, loss=t["grad_out"], **conv)
            t["grad_w"].set_output(True).set_dim(list(w.shape)).set_stride(_nhwc_strides(w.shape)).set_data_type(io)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        # No engine that cuDNN notes as nondeterministic (genstats' atomic sums carry no such note).
        g.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])
        g.check_support()
        self.graph, self.tensors = g, t
        # The heuristics' first buildable candidates only: a runtime-fused plan is compiled when it is built, and the
        # heuristics rank the good ones first.
        self.built = []
        for i in range(g.get_execution_plan_count()):
            if len(self.built) == _CANDIDATES:
                break
            try:
                g.build_plan_at_index(i)
            except Exception:  # noqa: BLE001 - a deselected or unbuildable candidate is no candidate
                continue
            self.built.append(i)
        if not self.built:
            raise RuntimeError(f"cuDNN could not build any plan for the fused {kind} graph of input {tuple(y.shape)}")
        self.workspace = {i: g.get_workspace_size_plan_at_index(i) for i in self.built}
        self.index = self._fastest(feeds)

    def _fastest(self, feeds: dict[str, Tensor]) -> int:
        """The plan that runs these inputs fastest: each candidate's best of 3 timings of 3 calls (CUDA events)."""
        best, best_ms = None, float("inf")
        for i in self.built:
            try:
                self.run(feeds, i)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                times = []
                for _ in range(3):
                    start.record()
                    for _ in range(3):
                        self.run(feeds, i)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
            except Exception:  # noqa: BLE001 - a plan that cannot run these inputs is no candidate
                continue
            if min(times) < best_ms:
                best, best_ms = i, min(times)
        if best is None:
            raise RuntimeError(f"none of the {len(self.built)} plans cuDNN built for this graph ran")
        return best

    def run(self, feeds: dict[str, Tensor], index: int | None = None) -> None:
        index = self.index if index is None else index
        cudnn = _cudnn()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        workspace = torch.empty(max(self.workspace[index], 1), dtype=torch.uint8, device=feeds["y"].device)
        self.graph.execute_plan_at_index({self.tensors[k]: v for k, v in feeds.items()}, workspace, index,
                                         handle=self.handle)


def _plan(kind: str, y: Tensor, w: Tensor, feeds: dict[str, Tensor]) -> _Plan:
    """The plan for this shape, built and autotuned on `feeds` (which that overwrites) on its first use."""
    key = (kind, tuple(y.shape), tuple(w.shape), y.dtype, y.device)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _Plan(kind, y, w, feeds)
    return plan


def _fprop_outputs(y: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    n, _, h, wd = y.shape
    out = torch.empty((n, w.shape[0], h, wd), dtype=y.dtype, device=y.device, memory_format=torch.channels_last)
    return out, torch.empty((2, w.shape[0]), dtype=torch.float32, device=y.device)


@torch.library.custom_op("mobilenet_cudnn::sbr_conv1x1", mutates_args=())
def sbr_conv1x1(y: Tensor, scale_shift: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """(conv1x1(relu(y * scale + shift), w), [2, K] fp32 sums and sums of squares of that output per channel);
    scale_shift [2, C] in y's dtype (mobilenet_bn::bn_scale_shift)."""
    out, sums = _fprop_outputs(y, w)
    feeds = {"y": y, "scale": scale_shift[0], "shift": scale_shift[1], "w": w, "out": out, "sum": sums[0],
             "sumsq": sums[1]}
    plan = _plan("fprop", y, w, feeds)
    sums.zero_()  # cuDNN does not document that genstats overwrites its outputs; the autotuning has run it
    plan.run(feeds)
    return out, sums


@sbr_conv1x1.register_fake
def _(y, scale_shift, w):
    return _fprop_outputs(y, w)


@torch.library.custom_op("mobilenet_cudnn::sbr_conv1x1_wgrad", mutates_args=())
def sbr_conv1x1_wgrad(grad_out: Tensor, y: Tensor, scale_shift: Tensor, w: Tensor) -> Tensor:
    """The weight gradient of sbr_conv1x1's output, relu(y * scale + shift) recomputed from y."""
    grad_w = torch.empty(w.shape, dtype=y.dtype, device=y.device, memory_format=torch.channels_last)
    feeds = {"y": y, "scale": scale_shift[0], "shift": scale_shift[1], "grad_out": grad_out, "grad_w": grad_w}
    _plan("wgrad", y, w, feeds).run(feeds)
    return grad_w


@sbr_conv1x1_wgrad.register_fake
def _(grad_out, y, scale_shift, w):
    return torch.empty(w.shape, dtype=y.dtype, device=y.device, memory_format=torch.channels_last)


@torch.library.register_fake("mobilenet_bn::bn_scale_shift")
def _(mean, invstd, weight, bias, dtype):
    return mean.new_empty((2, mean.shape[0]), dtype=dtype)


@torch.library.register_fake("mobilenet_bn::bn_stats_from_sums")
def _(sums, count, running_mean, running_var, num_batches_tracked, eps, momentum):
    return tuple(sums.new_empty(sums.shape[1]) for _ in range(3))


# --- the pair ------------------------------------------------------------------------------------------------------


def _normed_conv1x1(y, norm_weight, norm_bias, conv_weight, running_mean, running_var, num_batches_tracked, eps,
                    momentum):
    """The forward of the pair: (out, sums, mean, invstd, scale_shift), the BatchNorm's statistics from a pass over y
    (updating its running statistics where given), then sbr_conv1x1 applying it."""
    bn = torch.ops.mobilenet_bn
    if running_mean is not None:
        mean, invstd, _var = bn.bn_stats_update(y, norm_weight, norm_bias, running_mean, running_var,
                                                num_batches_tracked, eps, momentum)
    else:
        mean, invstd, _var = bn.bn_stats(y, norm_weight, norm_bias, eps)
    scale_shift = bn.bn_scale_shift(mean, invstd, norm_weight, norm_bias, y.dtype)
    out, sums = sbr_conv1x1(y, scale_shift, conv_weight)
    return out, sums, mean, invstd, scale_shift


def _conv1x1_input_grad(grad_out: Tensor, y: Tensor, conv_weight: Tensor) -> Tensor:
    """The gradient of the 1x1 convolution's input, relu(batch_norm(y)): cuDNN's plain dgrad (y stands in for that
    input: a dgrad reads only its shape)."""
    return torch.ops.aten.convolution_backward(grad_out, y, conv_weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                               [True, False, False])[0]


def _pointwise_weight(op: str, arg: str, y: Tensor, weight) -> Tensor:
    """The 1x1 conv weight `arg` of `op` in y's dtype, channels_last, once the fused graphs can take it with an input
    like y and cudnn-frontend is installed; ValueError naming what is wrong otherwise."""
    if not isinstance(weight, Tensor):
        raise ValueError(f"{op}: {arg} must be a tensor (K, C, 1, 1)")
    why = pointwise_unsupported(y, weight)
    if why is not None:
        raise ValueError(f"{op}: {why}")
    missing = cudnn_frontend_missing()
    if missing is not None:
        raise ValueError(f"{op} needs {missing}")
    return weight.to(y.dtype).contiguous(memory_format=torch.channels_last)


class _BatchNormReluConv1x1(torch.autograd.Function):
    """conv1x1(relu(batch_norm(y))) from y: bn_stats(_update), bn_scale_shift, then sbr_conv1x1, which also returns
    its output's sums (no gradient); backward as the module docstring."""

    @staticmethod
    def forward(ctx, y, norm_weight, norm_bias, conv_weight, running_mean, running_var, num_batches_tracked, eps,
                momentum):
        out, sums, mean, invstd, scale_shift = _normed_conv1x1(y, norm_weight, norm_bias, conv_weight, running_mean,
                                                               running_var, num_batches_tracked, eps, momentum)
        ctx.save_for_backward(y, norm_weight, norm_bias, conv_weight, mean, invstd, scale_shift)
        ctx.mark_non_differentiable(sums)
        return out, sums

    @staticmethod
    def backward(ctx, grad_out, _grad_sums):
        y, norm_weight, norm_bias, conv_weight, mean, invstd, scale_shift = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_out = grad_out.to(y.dtype).contiguous(memory_format=torch.channels_last)
        grad_conv_weight = None
        if needs[3]:
            grad_conv_weight = sbr_conv1x1_wgrad(grad_out, y, scale_shift, conv_weight)
        grad_y = grad_norm_weight = grad_norm_bias = None
        if any(needs[:3]):
            grad_x = _conv1x1_input_grad(grad_out, y, conv_weight)  # then the BatchNorm + ReLU backward from y
            grad_y, grad_norm_weight, grad_norm_bias = torch.ops.mobilenet_bn.bn_relu_bwd(
                grad_x, y, norm_weight, norm_bias, mean, invstd)
        return (grad_y if needs[0] else None, grad_norm_weight if needs[1] else None,
                grad_norm_bias if needs[2] else None, grad_conv_weight, None, None, None, None, None)


def batch_norm_relu_conv1x1(y: Tensor, norm_weight: Tensor, norm_bias: Tensor, conv_weight: Tensor,
                            eps: float = 1e-5, running_mean: Tensor | None = None, running_var: Tensor | None = None,
                            num_batches_tracked: Tensor | None = None,
                            momentum: float | None = None) -> tuple[Tensor, Tensor]:
    """(out, sums): out = F.conv2d(relu(batch_norm(y, training=True)), conv_weight) for a 1x1 conv_weight (K, C, 1, 1)
    on channels_last fp16/bf16 y, without relu(batch_norm(y)) being stored, and sums [2, K] fp32, the sum and sum of
    squares of out per channel (the next BatchNorm's statistics: stats_from_sums). The normalize is
    relu(y * scale + shift) with scale and shift rounded to y's dtype, cuDNN's operands. With running_mean,
    running_var and num_batches_tracked (and momentum in [0, 1]) the running statistics are updated as nn.BatchNorm2d
    updates them, in the statistics kernel. Differentiable in y, norm_weight, norm_bias and conv_weight; conv_weight
    is used in y's dtype (autocast's rule for a convolution), the BatchNorm's parameters in fp32. Cases the graphs do
    not take raise ValueError."""
    _check_supported(y, norm_weight, norm_bias)
    conv_weight = _pointwise_weight("batch_norm_relu_conv1x1", "conv_weight", y, conv_weight)
    update = _check_running_update("batch_norm_relu_conv1x1", y, momentum, running_mean, running_var)
    return _BatchNormReluConv1x1.apply(y, _f32(norm_weight), _f32(norm_bias), conv_weight, running_mean, running_var,
                                       num_batches_tracked, float(eps), float(momentum) if update else 0.0)


def stats_from_sums(sums: Tensor, count: int, eps: float, running_mean: Tensor | None = None,
                    running_var: Tensor | None = None, num_batches_tracked: Tensor | None = None,
                    momentum: float | None = None) -> tuple[Tensor, Tensor]:
    """(mean, invstd) fp32 of a BatchNorm whose input's sums [2, C] (sum and sum of squares of `count` values per
    channel) batch_norm_relu_conv1x1 returned, with the running statistics updated as nn.BatchNorm2d updates them
    where given (momentum in [0, 1]). The variance is E[x^2] - E[x]^2 in fp64 from fp32 sums."""
    update = running_mean is not None
    if update and (momentum is None or not 0.0 <= momentum <= 1.0):
        raise ValueError(f"stats_from_sums: momentum must be in [0, 1] to update the running statistics, got "
                         f"{momentum}")
    mean, invstd, _var = torch.ops.mobilenet_bn.bn_stats_from_sums(sums, count, running_mean, running_var,
                                                                   num_batches_tracked, eps,
                                                                   float(momentum) if update else 0.0)
    return mean, invstd


# --- the depthwise pair, the BatchNorm after it and the pointwise conv as one function ------------------------------


class _BatchNormReluDepthwiseBatchNormReluConv1x1(torch.autograd.Function):
    """conv1x1(relu(batch_norm(z))) with z = depthwise(relu(batch_norm(y))), from y: norm_depthwise's pair (the
    BatchNorm before applied by the depthwise kernels as they load y), the BatchNorm after it computing only its
    statistics, and sbr_conv1x1 applying that one as it loads z. The backward splits the middle BatchNorm as
    MBN_DEPTHWISE_BACKWARD=next_norm does: the pointwise conv's weight gradient (sbr_conv1x1_wgrad) and input gradient
    (cuDNN's dgrad), bn_relu_bwd_consts for the middle BatchNorm (its reduce pass and the gradients of its weight and
    bias), depthwise_bwd_normed applying its input gradient as the walk or the rings load the gradient, then
    bn_relu_bwd_from_sums for the BatchNorm before. The same kernels' arithmetic as _BatchNormReluConv1x1 after
    norm_depthwise's pair, so the same bits, without the middle BatchNorm's input-gradient pass. Returns (out, sums) as
    _BatchNormReluConv1x1 does."""

    @staticmethod
    def forward(ctx, y, norm_weight, norm_bias, dw_weight, running_mean, running_var, num_batches_tracked, eps,
                momentum, stride, padding, sums, mid_weight, mid_bias, mid_running_mean, mid_running_var,
                mid_num_batches_tracked, mid_eps, mid_momentum, pw_weight):
        mean, invstd = _input_stats(y, norm_weight, norm_bias, running_mean, running_var, num_batches_tracked, eps,
                                    momentum, sums)
        z = _fwd_normed(y, dw_weight, mean, invstd, norm_weight, norm_bias, stride, padding)
        out, out_sums, mid_mean, mid_invstd, scale_shift = _normed_conv1x1(
            z, mid_weight, mid_bias, pw_weight, mid_running_mean, mid_running_var, mid_num_batches_tracked, mid_eps,
            mid_momentum)
        ctx.save_for_backward(y, norm_weight, norm_bias, dw_weight, mean, invstd, z, mid_weight, mid_bias, mid_mean,
                              mid_invstd, scale_shift, pw_weight)
        ctx.conv_args = (stride, padding)
        ctx.mark_non_differentiable(out_sums)
        return out, out_sums

    @staticmethod
    def backward(ctx, grad_out, _grad_sums):
        (y, norm_weight, norm_bias, dw_weight, mean, invstd, z, mid_weight, mid_bias, mid_mean, mid_invstd,
         scale_shift, pw_weight) = ctx.saved_tensors
        stride, padding = ctx.conv_args
        needs = ctx.needs_input_grad
        grad_out = grad_out.to(z.dtype).contiguous(memory_format=torch.channels_last)
        grad_pw_weight = sbr_conv1x1_wgrad(grad_out, z, scale_shift, pw_weight) if needs[19] else None
        grad_normed = _conv1x1_input_grad(grad_out, z, pw_weight)
        consts, grad_mid_weight, grad_mid_bias = _bn_bwd_consts(grad_normed, z, mid_weight, mid_bias, mid_mean,
                                                                mid_invstd)
        grad_x, grad_dw_weight, bn_sums = _bwd_normed(grad_normed, y, dw_weight, mean, invstd, norm_weight, norm_bias,
                                                      stride, padding, True, z, consts)
        grad_y, grad_norm_weight, grad_norm_bias = _bn_bwd_from_sums(grad_x, y, norm_weight, norm_bias, mean, invstd,
                                                                     bn_sums)
        return (grad_y if needs[0] else None, grad_norm_weight if needs[1] else None,
                grad_norm_bias if needs[2] else None,
                in_weight_strides(grad_dw_weight, dw_weight) if needs[3] else None,
                None, None, None, None, None, None, None, None,
                grad_mid_weight if needs[12] else None, grad_mid_bias if needs[13] else None,
                None, None, None, None, None, grad_pw_weight)


def batch_norm_relu_depthwise_conv2d_batch_norm_relu_conv1x1(
        y: Tensor, norm_weight: Tensor, norm_bias: Tensor, dw_weight: Tensor, mid_weight: Tensor, mid_bias: Tensor,
        pw_weight: Tensor, stride=(1, 1), padding=(1, 1), eps: float = 1e-5, running_mean: Tensor | None = None,
        running_var: Tensor | None = None, num_batches_tracked: Tensor | None = None, momentum: float | None = None,
        mid_eps: float = 1e-5, mid_running_mean: Tensor | None = None, mid_running_var: Tensor | None = None,
        mid_num_batches_tracked: Tensor | None = None, mid_momentum: float | None = None,
        sums: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out, sums): out = batch_norm_relu_conv1x1(z, mid_weight, mid_bias, pw_weight, ...)[0] for
    z = kernels.norm_depthwise.batch_norm_relu_depthwise_conv2d(y, norm_weight, norm_bias, dw_weight, ...), with the
    middle BatchNorm's input gradient applied by the depthwise backward kernel as it loads the gradient instead of a
    pass of its own (kernels.norm_depthwise.batch_norm_relu_depthwise_conv2d_batch_norm_relu's split); sums as
    batch_norm_relu_conv1x1 returns them. The running statistics of each BatchNorm are updated where its own are
    given (momentum in [0, 1]). The cases of both functions at stride 1 or 2 with padding 1, on fp16 channels_last y
    with the cudnn-frontend package installed; others raise ValueError."""
    name = "batch_norm_relu_depthwise_conv2d_batch_norm_relu_conv1x1"
    dw_weight, stride, padding, update = _check_pair(name, y, norm_weight, norm_bias, dw_weight, stride, padding,
                                                     running_mean, running_var, momentum, sums,
                                                     unsupported=next_norm_unsupported)
    _check_supported(y, mid_weight, mid_bias)
    # The pointwise conv's input is z: y's dtype, layout and channels, which is what the fused graphs look at.
    pw_weight = _pointwise_weight(name, "pw_weight", y, pw_weight)
    mid_update = _check_running_update(name, y, mid_momentum, mid_running_mean, mid_running_var)
    if mid_update:
        n, _, oh, ow = out_shape(y.shape, dw_weight.shape, stride, padding, (1, 1))
        _check_unbiased_count(name, n * oh * ow)
    return _BatchNormReluDepthwiseBatchNormReluConv1x1.apply(
        y, _f32(norm_weight), _f32(norm_bias), dw_weight, running_mean, running_var, num_batches_tracked, float(eps),
        float(momentum) if update else 0.0, stride, padding, sums, _f32(mid_weight), _f32(mid_bias), mid_running_mean,
        mid_running_var, mid_num_batches_tracked, float(mid_eps), float(mid_momentum) if mid_update else 0.0,
        pw_weight)
