"""Depthwise-convolution backends: the one place where a depthwise layer picks its implementation.

model.py builds every depthwise layer as a `DepthwiseConv2d(backend=...)`; the backend is looked up here by
the name the user typed (`backend=torch|cudnn|custom`). A backend that cannot serve a configuration raises
`BackendUnavailable` and the run stops: nothing falls back to another implementation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.conv_arith import resolve_padding, to_pair
from kernels.depthwise_args import out_shape
from .registry import Registry

Pair = tuple[int, int]


class BackendUnavailable(RuntimeError):
    """The requested depthwise backend cannot run here (no CUDA, no kernels, unsupported case)."""


@dataclass(frozen=True)
class DepthwiseBackend:
    name: str
    description: str
    # Raises BackendUnavailable when this backend cannot run on `device`.
    check: Callable[[torch.device], None]
    # conv2d(x, weight, bias, stride, padding, dilation) with weight of shape (C, 1, kh, kw).
    conv2d: Callable[[Tensor, Tensor, Tensor | None, Pair, Pair, Pair], Tensor]


_REGISTRY: Registry[DepthwiseBackend] = Registry("depthwise backend")


def register_backend(backend: DepthwiseBackend) -> DepthwiseBackend:
    return _REGISTRY.register(backend.name, backend)


def available_backends() -> list[str]:
    return _REGISTRY.names()


def get_backend(name: str) -> DepthwiseBackend:
    return _REGISTRY.get(name)


def _require_cuda(name: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise BackendUnavailable(
            f"backend={name} needs a CUDA GPU, but this run's device is {device.type!r}"
            + ("" if torch.cuda.is_available() else " (torch.cuda.is_available() is False)")
            + ". Use backend=torch on a CPU."
        )


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


# --- backend=torch: F.conv2d, PyTorch's own dispatch (cuDNN or its native depthwise kernel) -------------------


def _torch_conv2d(x, weight, bias, stride, padding, dilation):
    return F.conv2d(x, weight, bias, stride, padding, dilation, groups=x.shape[1])


register_backend(
    DepthwiseBackend(
        name="torch",
        description="F.conv2d(groups=C): PyTorch picks cuDNN or its native depthwise kernel by its heuristic",
        check=lambda device: None,
        conv2d=_torch_conv2d,
    )
)


# --- backend=cudnn: cuDNN forced for forward, input gradient and weight gradient --------------------------------
#
# F.conv2d sends fp32/bf16 NCHW depthwise to PyTorch's native kernel, and convolution_backward re-runs that
# heuristic, so neither is a way to force cuDNN. The three cuDNN calls used instead:
#   forward      torch.cudnn_convolution                    (cudnnConvolutionForward)
#   input grad   torch.cudnn_convolution_transpose(grad)    (cudnnConvolutionBackwardData)
#   weight grad  convolution_backward of a *transposed* conv with the roles of x and grad swapped: PyTorch only
#                applies its depthwise heuristic to non-transposed convs, so this reaches
#                cudnnConvolutionBackwardFilter(x, grad) directly. We assert that dispatch once per case.
# Wrapped as custom ops so torch.compile keeps them as calls instead of re-lowering them.
# Where PyTorch's own dispatch already picks cuDNN (channels_last, and some NCHW cases), F.conv2d makes the same
# three cuDNN calls with a fraction of the custom ops' host overhead, which would otherwise make this backend
# host-bound, slower and less steady from run to run than F.conv2d. That choice is checked per
# case with the selector that convolution_backward uses too, so both gradients stay on cuDNN as well.


def _memory_format(x: Tensor) -> torch.memory_format:
    return torch.channels_last if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() else torch.contiguous_format


def _cudnn_flags() -> tuple[bool, bool, bool]:
    b = torch.backends.cudnn
    return b.benchmark, b.deterministic, b.allow_tf32


@torch.library.custom_op("mobilenet::cudnn_depthwise_fwd", mutates_args=())
def _cudnn_fwd(x: Tensor, weight: Tensor, stride: list[int], padding: list[int], dilation: list[int]) -> Tensor:
    return torch.cudnn_convolution(x, weight, padding, stride, dilation, x.shape[1], *_cudnn_flags())


@_cudnn_fwd.register_fake
def _(x, weight, stride, padding, dilation):
    return x.new_empty(out_shape(x.shape, weight.shape, stride, padding, dilation)).contiguous(
        memory_format=_memory_format(x))


_checked_wgrad_dispatch: set[tuple] = set()


@torch.library.custom_op("mobilenet::cudnn_depthwise_bwd", mutates_args=())
def _cudnn_bwd(
    grad: Tensor, x: Tensor, weight: Tensor, stride: list[int], padding: list[int], dilation: list[int],
    needs_input_grad: bool, needs_weight_grad: bool,
) -> tuple[Tensor, Tensor]:
    fmt = _memory_format(x)
    grad = grad.contiguous(memory_format=fmt)
    groups = x.shape[1]
    kh, kw = weight.shape[-2:]
    # The transposed conv of `grad` must come out at exactly x's size.
    output_padding = [
        x.shape[2] - ((grad.shape[2] - 1) * stride[0] - 2 * padding[0] + dilation[0] * (kh - 1) + 1),
        x.shape[3] - ((grad.shape[3] - 1) * stride[1] - 2 * padding[1] + dilation[1] * (kw - 1) + 1),
    ]
    grad_input = grad_weight = None
    if needs_input_grad:
        grad_input = torch.cudnn_convolution_transpose(
            grad, weight, padding, output_padding, stride, dilation, groups, *_cudnn_flags()
        )
    if needs_weight_grad:
        key = (x.dtype, fmt, tuple(x.shape), tuple(weight.shape), tuple(stride), tuple(padding), tuple(dilation))
        if key not in _checked_wgrad_dispatch:
            chosen = torch._C._select_conv_backend(grad, weight, None, stride, padding, dilation, True, output_padding, groups)
            if chosen != torch._C._ConvBackend.CudnnTranspose:
                raise BackendUnavailable(
                    f"backend=cudnn: PyTorch would compute this depthwise weight gradient with {chosen}, not cuDNN "
                    f"(dtype {x.dtype}, shape {tuple(x.shape)}); is torch.backends.cudnn.enabled False?"
                )
            _checked_wgrad_dispatch.add(key)
        grad_weight = torch.ops.aten.convolution_backward(
            x, grad, weight, None, stride, padding, dilation, True, output_padding, groups, [False, True, False]
        )[1]
    # custom ops cannot return None: empty tensors stand for "not requested".
    return (
        grad_input if grad_input is not None else x.new_empty(0),
        grad_weight if grad_weight is not None else weight.new_empty(0),
    )


@_cudnn_bwd.register_fake
def _(grad, x, weight, stride, padding, dilation, needs_input_grad, needs_weight_grad):
    gi = torch.empty_like(x, memory_format=_memory_format(x)) if needs_input_grad else x.new_empty(0)
    gw = torch.empty_like(weight) if needs_weight_grad else weight.new_empty(0)
    return gi, gw


def _cudnn_setup_context(ctx, inputs, output):
    x, weight, stride, padding, dilation = inputs
    ctx.save_for_backward(x, weight)
    ctx.conv_args = (stride, padding, dilation)


def _cudnn_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    gi, gw = _cudnn_bwd(grad, x, weight, *ctx.conv_args, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
    return (gi if ctx.needs_input_grad[0] else None, gw if ctx.needs_input_grad[1] else None, None, None, None)


_cudnn_fwd.register_autograd(_cudnn_backward, setup_context=_cudnn_setup_context)


_native_is_cudnn: dict[tuple, bool] = {}


def _dispatch_is_cudnn(x: Tensor, weight: Tensor, bias, stride, padding, dilation) -> bool:
    key = (x.dtype, x.device, tuple(x.shape), x.stride(), tuple(weight.shape), bias is None, tuple(stride),
           tuple(padding), tuple(dilation))
    hit = _native_is_cudnn.get(key)
    if hit is None:
        chosen = torch._C._select_conv_backend(x, weight, bias, list(stride), list(padding), list(dilation), False,
                                               [0, 0], x.shape[1])
        hit = _native_is_cudnn[key] = chosen == torch._C._ConvBackend.Cudnn
    return hit


def _cudnn_conv2d(x, weight, bias, stride, padding, dilation):
    if isinstance(padding, str):  # 'valid', or 'same' where it pads both sides alike
        before, padding = resolve_padding(padding, weight.shape[-2:], to_pair(stride, "stride"),
                                          to_pair(dilation, "dilation"), "backend=cudnn")
        if before != padding:
            raise ValueError("backend=cudnn: padding='same' with an even (dilated) kernel pads asymmetrically, "
                             "which torch.cudnn_convolution cannot; use backend=torch or backend=custom")
    if not torch.backends.cudnn.enabled:
        raise BackendUnavailable("backend=cudnn, but torch.backends.cudnn.enabled is False")
    # Autocast does not reach custom ops: cast as F.conv2d's autocast rule would (to the autocast dtype).
    dtype = _autocast_dtype(x.device.type)
    if dtype is not None:
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    # cuDNN picks its layout from both operands; pin the weight to x's so the output keeps x's layout.
    fmt = _memory_format(x)
    x = x.contiguous(memory_format=fmt)
    weight = weight.contiguous(memory_format=fmt)
    if not torch.compiler.is_compiling() and _dispatch_is_cudnn(x, weight, bias, stride, padding, dilation):
        return F.conv2d(x, weight, bias, stride, padding, dilation, x.shape[1])
    out = _cudnn_fwd(x, weight, list(stride), list(padding), list(dilation))
    return out if bias is None else out + bias.view(1, -1, 1, 1)


def _cudnn_check(device: torch.device) -> None:
    _require_cuda("cudnn", device)
    if not torch.backends.cudnn.is_available():
        raise BackendUnavailable("backend=cudnn: this PyTorch build has no cuDNN (torch.backends.cudnn.is_available() is False)")


register_backend(
    DepthwiseBackend(
        name="cudnn",
        description="cuDNN forced for forward, input gradient and weight gradient, in every dtype and layout",
        check=_cudnn_check,
        conv2d=_cudnn_conv2d,
    )
)


# --- backend=custom: the CUDA kernels in kernels/ ---------------------------------------------------------------


def _custom_check(device: torch.device) -> None:
    _require_cuda("custom", device)
    try:
        import kernels

        kernels.load()
    except ImportError as e:  # the kernels package itself is missing from this install
        raise BackendUnavailable(f"backend=custom: the custom CUDA kernels cannot be imported ({e})") from e
    except RuntimeError as e:  # kernels.KernelUnavailable: no nvcc, build failure, ...
        raise BackendUnavailable(f"backend=custom: {e}") from e


def _custom_conv2d(x, weight, bias, stride, padding, dilation):
    from kernels.ops import depthwise_conv2d

    return depthwise_conv2d(x, weight, bias, stride, padding, dilation)


register_backend(
    DepthwiseBackend(
        name="custom",
        description="this project's CUDA kernels (kernels/): forward, input gradient and weight gradient",
        check=_custom_check,
        conv2d=_custom_conv2d,
    )
)


# --- the layer --------------------------------------------------------------------------------------------------


class DepthwiseConv2d(nn.Module):
    """A depthwise convolution (groups = channels; `multiplier` filters per channel, weight
    (channels * multiplier, 1, kh, kw)) computed by the named backend. padding: an int, a pair, 'valid' or 'same'
    as in F.conv2d; None keeps the spatial size at stride 1 for odd kernels."""

    def __init__(self, channels: int, kernel_size: int | Pair = 3, stride: int | Pair = 1,
                 padding: int | Pair | str | None = None, dilation: int | Pair = 1, bias: bool = False,
                 backend: str = "torch", multiplier: int = 1):
        super().__init__()
        self.backend = get_backend(backend)
        self.kernel_size = to_pair(kernel_size, "DepthwiseConv2d: kernel_size")
        self.stride = to_pair(stride, "DepthwiseConv2d: stride")
        self.dilation = to_pair(dilation, "DepthwiseConv2d: dilation")
        # Default padding keeps the spatial size at stride 1 ("same" for odd kernels).
        if padding is None:
            self.padding = tuple(d * (k - 1) // 2 for k, d in zip(self.kernel_size, self.dilation))
        elif isinstance(padding, str):
            resolve_padding(padding, self.kernel_size, self.stride, self.dilation, "DepthwiseConv2d")  # validates
            self.padding = padding
        else:
            self.padding = to_pair(padding, "DepthwiseConv2d: padding")
        if multiplier < 1:
            raise ValueError(f"DepthwiseConv2d: multiplier must be >= 1, got {multiplier}")
        self.weight = nn.Parameter(torch.empty(channels * multiplier, 1, *self.kernel_size))
        self.bias = nn.Parameter(torch.empty(channels * multiplier)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The same initialisation as nn.Conv2d(groups=C), so backends are interchangeable.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.kernel_size[0] * self.kernel_size[1]
            nn.init.uniform_(self.bias, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def forward(self, x: Tensor) -> Tensor:
        return self.backend.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]}, kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, bias={self.bias is not None}, backend={self.backend.name}")
