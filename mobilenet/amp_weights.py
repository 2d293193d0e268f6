"""perf.amp_weight_cast: the autocast casts of every convolution and linear weight done as one kernel each way.

Under autocast each convolution and linear layer casts its fp32 weight to fp16/bf16 in the forward (one small
kernel per weight) and casts the weight's gradient back to fp32 in the backward (another): 62 kernels per
MobileNetV1 step, about 1% of its GPU time on an H200 (docs/results/profile_h200_train_custom_norm_custom_fbb093a.md).
Here those weights share one flat fp32 buffer (each parameter's data is a view of it, in the parameter's own memory
format), the forward casts the buffer once and runs the model on views of the cast copy
(torch.func.functional_call), and the backward gathers the low-precision gradients into one buffer and casts it
once. The parameters stay the same nn.Parameter objects (same names, state_dict and optimizer), their values and
gradients are the same numbers as autocast's casts give.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["cast_parameters", "flatten_parameters", "plan", "WeightCastForward"]

MODES = ("auto", "true", "false")
_AUTOCAST = "autocast's, one kernel per weight each way"

# The layers whose parameters autocast casts to the low dtype (BatchNorm's stay fp32).
_CAST_LAYERS = (nn.Conv2d, nn.Linear)


def cast_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter autocast casts in `model`'s forward, in module order."""
    from .depthwise import DepthwiseConv2d

    out = []
    for module_name, module in model.named_modules():
        if isinstance(module, _CAST_LAYERS + (DepthwiseConv2d,)):
            for name, p in module.named_parameters(recurse=False):
                out.append((f"{module_name}.{name}" if module_name else name, p))
    return out


def plan(cfg, distributed: bool, model: nn.Module) -> tuple[bool, str]:
    """(cast the weights as one buffer or not, the summary's words) for `perf.amp_weight_cast`. auto: wherever it
    can run, as measured faster (docs/results/train_norm_h200.md); true where it cannot is an error."""
    mode = str(cfg.perf.amp_weight_cast).lower()  # Hydra hands `=true` over as a bool
    if mode not in MODES:
        raise ValueError(f"perf.amp_weight_cast={cfg.perf.amp_weight_cast!r} is not a choice; choose one of: "
                         f"{', '.join(MODES)}")
    if mode == "false":
        return False, f"{_AUTOCAST} (perf.amp_weight_cast=false)"
    params = cast_parameters(model)
    blockers = [what for blocked, what in (
        (not cfg.amp, "amp=false"),
        (bool(cfg.compile), "compile=true, whose compiler fuses the casts itself"),
        (distributed, "several processes (DDP with it is untested)"),
        (not params, "the model has no convolution or linear weights"),
        (bool(params) and _unflattenable([p for _, p in params]) is not None,
         "a weight that is not a dense fp32 tensor on the first one's device"),
    ) if blocked]
    if blockers and mode == "true":
        raise ValueError(f"perf.amp_weight_cast=true cannot run here: {'; '.join(blockers)}. Use "
                         "perf.amp_weight_cast=auto (on where it can run, and the summary says which) or false")
    if blockers:
        return False, f"{_AUTOCAST} (perf.amp_weight_cast=auto: {'; '.join(blockers)})"
    return True, (f"one kernel each way for the {len(params)} convolution and linear parameters "
                  f"(perf.amp_weight_cast={mode})")


def _dense_in_memory(t: Tensor) -> bool:
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _unflattenable(params: list[nn.Parameter]) -> nn.Parameter | None:
    """The first parameter flatten_parameters cannot take (not a dense float32 tensor on params[0]'s device)."""
    device = params[0].device
    return next((p for p in params if p.device != device or p.dtype != torch.float32 or not _dense_in_memory(p)),
                None)


# Every view starts on a multiple of this many elements (128 bytes in fp16): the kernels that read a weight pick
# vectorised or tensor-core paths by its address, as they would for a weight of its own.
ALIGN = 64


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def flatten_parameters(params: list[nn.Parameter]) -> tuple[Tensor, list[tuple[torch.Size, tuple, int]]]:
    """Moves the parameters' data into one flat buffer, each a view in its own memory format; returns the buffer and
    each view's (shape, strides, offset). Call it after every .to() of the model: .to() would give the parameters new
    storage again."""
    if not params:
        raise ValueError("perf.amp_weight_cast: the model has no convolution or linear weights to cast")
    bad = _unflattenable(params)
    if bad is not None:
        raise ValueError(f"perf.amp_weight_cast: every cast weight must be a dense float32 tensor on one device, "
                         f"got {bad.dtype} {tuple(bad.shape)} strides {bad.stride()} on {bad.device}")
    device, dtype = params[0].device, params[0].dtype
    offsets, end = [], 0
    for p in params:
        offsets.append(_aligned(end))
        end = offsets[-1] + p.numel()
    flat = torch.zeros(_aligned(end), device=device, dtype=dtype)
    layouts = []
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            view = flat.as_strided(p.shape, p.stride(), offset)
            view.copy_(p)
            p.data = view
            layouts.append((p.shape, p.stride(), offset))
    return flat, layouts


def _gather(grads, layouts, total: int, pad: Tensor) -> Tensor:
    """The gradients laid out as the parameters are in the flat buffer (`total` elements, the gaps from `pad`'s
    zeros), as one flat tensor: one cat kernel."""
    parts, end = [], 0
    for g, (shape, stride, offset) in zip(grads, layouts):
        if offset > end:
            parts.append(pad[:offset - end])
        if g is None:
            g = torch.zeros(shape, dtype=pad.dtype, device=pad.device)
        if g.stride() != stride and not _same_order(g, stride):
            g = torch.empty_strided(shape, stride, dtype=g.dtype, device=g.device).copy_(g)
        parts.append(g.as_strided((g.numel(),), (1,)))
        end = offset + g.numel()
    if total > end:
        parts.append(pad[:total - end])
    return torch.cat(parts)


def _same_order(t: Tensor, stride: tuple) -> bool:
    """t's elements lie in memory as `stride` (a dense layout) places them; dimensions of size 1 may have any stride
    (cuDNN returns such weight gradients)."""
    return all(a == b for a, b, n in zip(t.stride(), stride, t.shape) if n != 1)


class _CastFlat(torch.autograd.Function):
    """forward: the flat fp32 buffer cast once, returned as views in each parameter's layout. backward: the views'
    gradients gathered and cast to fp32 once, returned as each parameter's gradient (views of one buffer)."""

    @staticmethod
    def forward(ctx, flat, pad, layouts, *params):
        low = flat.to(pad.dtype)
        ctx.layouts, ctx.total = layouts, flat.numel()
        ctx.save_for_backward(pad)
        return tuple(low.as_strided(shape, stride, offset) for shape, stride, offset in layouts)

    @staticmethod
    def backward(ctx, *grads):
        (pad,) = ctx.saved_tensors
        flat = _gather(grads, ctx.layouts, ctx.total, pad).float()
        out = tuple(flat.as_strided(shape, stride, offset) for shape, stride, offset in ctx.layouts)
        return (None, None, None, *out)


class WeightCastForward(nn.Module):
    """`model`'s forward with its convolution and linear weights cast by one kernel (see the module docstring),
    under autocast to `dtype`. Outside autocast (or in eval mode) it runs the model as it is."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model = model
        named = cast_parameters(model)
        self.names = [n for n, _ in named]
        self.flat, self.layouts = flatten_parameters([p for _, p in named])
        self._params = [p for _, p in named]
        # the zeros the backward fills the gaps between the gradients with, made once
        self._pad = torch.zeros(ALIGN, dtype=dtype, device=self.flat.device)

    def forward(self, x: Tensor) -> Tensor:
        if not (self.model.training and torch.is_autocast_enabled(x.device.type)):
            return self.model(x)
        low = _CastFlat.apply(self.flat, self._pad, self.layouts, *self._params)
        return functional_call(self.model, dict(zip(self.names, low)), (x,))
