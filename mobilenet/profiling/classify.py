"""Which kind of GPU work a kernel is, and which op and implementation launched it. Order matters in the tables:
the first matching row wins. Verified against H200 traces (torch 2.11 + cuDNN 9.19); extend the tables when a new
kernel family shows up under "unidentified"."""

from __future__ import annotations

import re
from typing import Iterable

from .trace import Event

# Kernel-name patterns that identify which implementation computed a depthwise convolution. cuDNN 9.19 on an
# H200 runs depthwise convs as sm90_xmma_depthwise_convolution_{fprop,dgrad,wgrad}_tiling_*, cudnn::cnn::
# {conv2d,dgrad2d}_grouped_direct_kernel, {conv2d,dgrad2d}_c1_k1_{nchw,nhwc}_* and wgrad2d_shmem_tiling; PyTorch's
# own kernels are at::native::conv_depthwise2d_{forward,backward,grad_weight}_kernel.
DEPTHWISE_IMPLEMENTATIONS: tuple[tuple[str, re.Pattern], ...] = (
    ("custom (kernels/)", re.compile(r"mobilenet_dw", re.I)),
    ("PyTorch native", re.compile(r"conv_depthwise[23]d|DepthwiseConv|at::native::.*depthwise", re.I)),
    ("cuDNN", re.compile(r"cudnn|xmma|cutlass|nvjet|sm\d{2,3}_|implicit|dgrad|wgrad|fprop|grouped_direct|conv2d_|_c1_k1_|"
                         r"shmem_tiling|convolve|winograd|gemm|splitK|nchw|nhwc|fft|flip_filter|region_transform", re.I)),
    ("custom (kernels/)", re.compile(r"depthwise", re.I)),
    ("elementwise inside depthwise ops", re.compile(r"elementwise|FillFunctor|reduce_kernel", re.I)),
)
# Kernel names that are depthwise on their own, whatever op launched them (native and custom kernels).
DEPTHWISE_KERNEL_NAMES = re.compile(r"conv_depthwise[23]d|DepthwiseConv|mobilenet_dw|depthwise", re.I)
# Ops whose name says depthwise: the cudnn backend's custom ops, the custom kernels' `mobilenet_dw::` ops.
DEPTHWISE_OP_NAMES = re.compile(r"depthwise|mobilenet_dw", re.I)
# Convolution ops and the argument positions of (input, weight), to recognise depthwise from the shapes.
CONV_OP_ARGS: dict[str, tuple[int, int]] = {
    "aten::conv2d": (0, 1), "aten::convolution": (0, 1), "aten::_convolution": (0, 1),
    "aten::cudnn_convolution": (0, 1), "aten::cudnn_convolution_transpose": (0, 1),
    "aten::convolution_backward": (1, 2), "aten::convolution_overrideable": (0, 1),
}
# Layout transposes: cuDNN's own NCHW<->NHWC kernels and generic transpose kernels.
TRANSPOSE_KERNELS = re.compile(r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw|transpose", re.I)
# Elementwise copy kernels: a dtype cast or a layout copy, told apart by the launching copy op's arguments.
COPY_KERNELS = re.compile(r"copy_kernel|direct_copy|CopyKernel", re.I)
CAST_OPS = ("aten::_to_copy", "aten::to", "aten::copy_", "aten::type_as")
LAYOUT_OPS = ("aten::contiguous", "aten::clone", "aten::copy_")
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function: "  # autograd's backward ops, on its own thread
# Host calls that block until the GPU (or a copy) has finished.
SYNC_CALLS = re.compile(r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy|cudaMemcpy2D|"
                        r"cuStreamSynchronize|cuCtxSynchronize|cuEventSynchronize|cuMemcpyDtoH|cuMemcpyHtoD)$")
DEVICE_SYNC_CALLS = frozenset({"cudaDeviceSynchronize", "cuCtxSynchronize"})
SLOW_LAUNCH_US = 1000.0

# "loader": GPU work launched by threads that do not run the step (a data loader's, e.g. DALI's decode, resize and
# normalisation): it shares the GPU with the step, but none of the step's ops asked for it, so it is kept out of the
# step's categories (a loader's pageable copy is not the step's to pin).
CATEGORIES = ("depthwise", "norm", "transpose", "cast", "memcpy", "loader", "other")
CATEGORY_TITLES = {
    "depthwise": "depthwise convolution", "norm": "BatchNorm + ReLU", "transpose": "layout transposes",
    "cast": "dtype casts", "memcpy": "host<->device / device copies",
    "loader": "data loader's GPU work (other threads)", "other": "everything else",
}
# BatchNorm and ReLU, forward and backward, whichever implementation (norm=torch|custom|apex) ran them: the share the
# fused norm exists to shrink. Kernels are recognised by the op that launched them (cuDNN's, PyTorch's, this
# project's mobilenet_bn:: ops, apex's bnp), which kernel names alone do not say reliably.
NORM_OPS = re.compile(r"batch_norm|BatchNorm|NativeBatchNorm|mobilenet_bn::|bn_relu|aten::relu|ReluBackward|"
                      r"threshold_backward|ThresholdBackward|bnp\.|groupbn", re.I)
NORM_KERNELS = re.compile(r"^(void )?mbn::|batch_?norm|bn_fw|bn_bw|nhwc_batch_norm", re.I)
# Convolution ops (not depthwise ones, which are decided before): under norm.apply_in_pointwise the op that launches
# a pointwise convolution is the BatchNorm + ReLU pair's (_BatchNormReluConv1x1), whose name says BatchNorm; the
# convolution's own op (cuDNN's fused graph, or aten's dgrad) says what the kernel is.
CONV_OPS = re.compile(r"mobilenet_cudnn::|^aten::(conv2d|convolution|_convolution|cudnn_convolution|"
                      r"convolution_backward)$")


def short_kernel_name(name: str, width: int = 110) -> str:
    s = re.sub(r"^void ", "", name)
    s = s.replace("(anonymous namespace)::", "").replace("at::native::", "")
    return s if len(s) <= width else s[: width - 3] + "..."


def op_label(ops: list[Event]) -> str:
    """'outermost op > nearest op' of a launch's op stack (innermost first): says both what the model did
    (aten::conv2d, ConvolutionBackward0, aten::linear) and which op launched the kernel."""
    if not ops:
        return "(no op)"
    outer = ops[-1].name.removeprefix(AUTOGRAD_PREFIX)
    return outer if len(ops) == 1 or outer == ops[0].name else f"{outer} > {ops[0].name}"


def _dims(op: Event, i: int) -> list | None:
    dims = op.args.get("Input Dims")
    if isinstance(dims, list) and i < len(dims) and isinstance(dims[i], list):
        return dims[i]
    return None


def _is_depthwise_conv(op: Event) -> bool:
    if DEPTHWISE_OP_NAMES.search(op.name):
        return True
    idx = CONV_OP_ARGS.get(op.name)
    if idx is None:
        return False
    x, w = _dims(op, idx[0]), _dims(op, idx[1])
    # Weight (C, 1, kh, kw) applied to a C-channel input: one filter per channel.
    return bool(x and w and len(x) == 4 and len(w) == 4 and w[1] == 1 and x[1] == w[0] > 1)


def _copy_kind(ops: list[Event]) -> str | None:
    """'cast' or 'transpose' for an elementwise copy, from the nearest copy op's argument types and strides."""
    for op in ops:
        if op.name not in CAST_OPS and op.name not in LAYOUT_OPS:
            continue
        types = op.args.get("Input type") or []
        if op.name == "aten::copy_" and len(types) >= 2 and types[0] and types[1]:
            if types[0] != types[1]:
                return "cast"
            strides = op.args.get("Input Strides") or []
            # A source with a zero stride is a broadcast being written out (a pooling's gradient), not a transpose.
            if len(strides) >= 2 and strides[0] != strides[1] and 0 not in (strides[1] or ()):
                return "transpose"
            return None
        if op.name in ("aten::_to_copy", "aten::to", "aten::type_as"):
            return "cast"
    return None


CUSTOM_OP_NAMESPACE = "mobilenet_dw::"


def implementation_of(kernel_name: str, ops: Iterable[Event] = ()) -> str:
    """Which implementation ran a depthwise kernel: an op of the custom kernels' namespace decides, else the name."""
    if any(op.name.startswith(CUSTOM_OP_NAMESPACE) for op in ops):
        return "custom (kernels/)"
    for impl, pattern in DEPTHWISE_IMPLEMENTATIONS:
        if pattern.search(kernel_name):
            return impl
    return "unidentified"


def category_of(row: Event, ops: list[Event]) -> str:
    """The CATEGORIES entry of a GPU row, from its name and the op stack that launched it."""
    if row.cat == "memcpy":
        return "memcpy"
    if row.cat != "kernel":
        return "other"
    category = "other"
    if TRANSPOSE_KERNELS.search(row.name):
        category = "transpose"
    elif COPY_KERNELS.search(row.name):
        category = _copy_kind(ops) or "other"
    # A kernel's own name decides before the ops that launched it: under norm.apply_in_depthwise one op
    # (_BatchNormReluDepthwise) launches both the BatchNorm's kernels and the depthwise ones.
    if category == "other" and DEPTHWISE_KERNEL_NAMES.search(row.name):
        category = "depthwise"
    if category == "other" and NORM_KERNELS.search(row.name):
        category = "norm"
    if category == "other":
        # The convolution op nearest the kernel says which conv it computes: under norm.apply_in_pointwise one op
        # (_BatchNormReluDepthwiseBatchNormReluConv1x1) launches a depthwise conv's kernels and a pointwise one's.
        conv = next((op for op in ops if _is_depthwise_conv(op) or CONV_OPS.search(op.name)), None)
        if conv is not None:
            return "depthwise" if _is_depthwise_conv(conv) else category
    if category == "other" and any(NORM_OPS.search(op.name) for op in ops):
        category = "norm"
    return category
