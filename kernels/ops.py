"""Python side of the custom depthwise op: fake (meta) kernels, autograd, autocast, and the public
`depthwise_conv2d`. Importing this module builds/loads the CUDA extension (kernels.load()), so it raises
kernels.KernelUnavailable where the kernels cannot run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import kernel_layout, load
from .conv_arith import IntOrPair, conv_out_size, to_pair

load()

__all__ = ["depthwise_conv2d"]

_fwd = torch.ops.mobilenet_dw.depthwise_fwd.default
_bwd = torch.ops.mobilenet_dw.depthwise_bwd.default

_layout = kernel_layout


# The forward epilogue's activations, by the name users pass, as the op's `activation` argument.
ACTIVATIONS = {None: 0, "relu": 1, "relu6": 2}


@torch.library.register_fake("mobilenet_dw::depthwise_fwd")
def _fwd_fake(x, w, bias, stride, padding, dilation, activation=0):
    n, c, h, wd = x.shape
    kh, kw = w.shape[-2:]
    oh = conv_out_size(h, kh, stride[0], padding[0], dilation[0])
    ow = conv_out_size(wd, kw, stride[1], padding[1], dilation[1])
    return torch.empty((n, c, oh, ow), dtype=x.dtype, device=x.device, memory_format=_layout(x))


@torch.library.register_fake("mobilenet_dw::depthwise_bwd")
def _bwd_fake(grad_out, x, w, stride, padding, dilation, output_mask):
    gx = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=_layout(x)) if output_mask[0] else x.new_empty(0)
    gw = w.new_empty(w.shape) if output_mask[1] else w.new_empty(0)
    gb = w.new_empty(w.shape[0]) if output_mask[2] else w.new_empty(0)
    return gx, gw, gb


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
    return (gx if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None, None, None, None, None)


torch.library.register_autograd("mobilenet_dw::depthwise_fwd", _backward, setup_context=_setup_context)


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


def depthwise_conv2d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: IntOrPair = (1, 1),
    padding: IntOrPair | str = (0, 0),
    dilation: IntOrPair = (1, 1),
    activation: str | None = None,
) -> Tensor:
    """Depthwise conv2d (groups = C, weight (C, 1, kh, kw)) with the custom CUDA kernels; same arguments and
    result as F.conv2d(x, weight, bias, stride, padding, dilation, groups=C), then `activation` ("relu",
    "relu6" or None) applied in the same kernel. Output in x's memory format."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"depthwise_conv2d: activation {activation!r} is not supported "
                         f"(choose one of: None, 'relu', 'relu6')")
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"depthwise_conv2d: input must be a 4-D tensor (N, C, H, W), got {getattr(x, 'shape', x)}")
    if weight.dim() != 4:
        raise ValueError(f"depthwise_conv2d: weight must have shape (C, 1, kh, kw), got {tuple(weight.shape)}")
    if not x.is_cuda:
        raise ValueError(f"depthwise_conv2d: the custom kernels need CUDA tensors, got input on {x.device}")
    stride = to_pair(stride, "depthwise_conv2d: stride")
    dilation = to_pair(dilation, "depthwise_conv2d: dilation")
    kh, kw = weight.shape[-2:]
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0, 0)
        elif padding == "same":
            if stride != (1, 1):
                raise ValueError("depthwise_conv2d: padding='same' is not supported for strided convolutions")
            for k in (kh, kw):
                if k % 2 == 0:
                    raise ValueError(f"depthwise_conv2d: kernel size {k} is not supported (odd sizes 1-7)")
            padding = (dilation[0] * (kh - 1) // 2, dilation[1] * (kw - 1) // 2)
        else:
            raise ValueError(f"depthwise_conv2d: invalid padding string {padding!r}, should be 'same' or 'valid'")
    else:
        padding = to_pair(padding, "depthwise_conv2d: padding")
    _check_supported(x, weight, bias, stride, padding, dilation)
    return _fwd(x, weight, bias, list(stride), list(padding), list(dilation), ACTIVATIONS[activation])


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_supported(x, weight, bias, stride, padding, dilation) -> None:
    """The op checks all of this again in C++; checking here first gives a Python ValueError before any
    C++ exception (a TORCH_CHECK thrown inside the op crashed the process on the H200 image, see
    docs/kernel_notes.md)."""
    c = x.shape[1]
    if x.dtype not in _DTYPES:
        raise ValueError(f"depthwise_conv2d: dtype {x.dtype} is not supported (float32, float16, bfloat16, float64)")
    if weight.shape[1] != 1 or (weight.shape[0] != c and not (c and weight.shape[0] % c == 0)):
        raise ValueError(f"depthwise_conv2d: weight must have shape (C, 1, kh, kw) with C={c}, got {tuple(weight.shape)}")
    if weight.shape[0] != c:
        raise ValueError(f"depthwise_conv2d: depth multiplier {weight.shape[0] // c} is not supported "
                         f"(weight must have as many filters as input channels, {c})")
    for k in weight.shape[-2:]:
        if not (1 <= k <= 7 and k % 2 == 1):
            raise ValueError(f"depthwise_conv2d: kernel size {k} is not supported (odd sizes 1-7)")
    for v in stride:
        if v not in (1, 2):
            raise ValueError(f"depthwise_conv2d: stride {v} is not supported (1 or 2)")
    for v in dilation:
        if v not in (1, 2):
            raise ValueError(f"depthwise_conv2d: dilation {v} is not supported (1 or 2)")
    for v in padding:
        if v < 0:
            raise ValueError(f"depthwise_conv2d: padding {v} is not supported (must be >= 0)")
    # under autocast the op's autocast kernel casts x, weight and bias to one dtype
    same_dtype = torch.is_autocast_enabled("cuda") or weight.dtype == x.dtype
    if weight.device != x.device or not same_dtype:
        raise ValueError(f"depthwise_conv2d: weight ({weight.dtype}, {weight.device}) must match the input "
                         f"({x.dtype}, {x.device})")
    if bias is not None and (tuple(bias.shape) != (c,) or bias.device != x.device
                             or not (torch.is_autocast_enabled("cuda") or bias.dtype == x.dtype)):
        raise ValueError(f"depthwise_conv2d: bias must have shape ({c},) and the input's dtype and device, got "
                         f"{tuple(bias.shape)} {bias.dtype} {bias.device}")
    if c > 65535:
        raise ValueError(f"depthwise_conv2d: {c} channels is not supported (at most 65535)")
    for size, k, st, p, d in zip(x.shape[2:], weight.shape[-2:], stride, padding, dilation):
        if conv_out_size(size, k, st, p, d) < 1:
            raise ValueError(f"depthwise_conv2d: input {tuple(x.shape[2:])} is smaller than the dilated kernel "
                             f"{tuple(weight.shape[-2:])} after padding {tuple(padding)}")
    if x.numel() >= 2**31:
        raise ValueError("depthwise_conv2d: tensors of 2^31 or more elements are not supported")
