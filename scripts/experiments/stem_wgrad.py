#!/usr/bin/env python
"""The stem convolution (3 -> 32 channels, 3x3, stride 2) forward + weight gradient, as training runs it, in a few
input layouts. The input needs no gradient, so the backward is the weight gradient alone, which cuDNN runs slowly
for 3 NHWC channels. Variants:

    nhwc3       the input as the loaders deliver it: 3 channels, channels_last
    nchw3       the input NCHW; the output converted to channels_last for the next layer (and its gradient back)
    nhwc4       the input delivered with a 4th, zero channel; the weight zero-padded to 4 input channels per step
    nhwc8       the same with 8 channels
    nhwc3_pad4  3 channels delivered, padded to 4 inside the step (what a loader that cannot pad would cost)
    gemm        nhwc3's forward; the weight gradient as one matrix product of the output gradient with the input's
                patches (zero-padded, unfolded and copied: 27 values per output pixel) instead of cuDNN's kernel
    custom      nhwc3's forward; the weight gradient from this project's kernel (model.stem_weight_grad=custom,
                kernels/stem_ops.py)

    python scripts/experiments/stem_wgrad.py [--batch 256] [--dtype fp16] [--rounds 7] [--iters 20]
                                             [--variants nhwc3,custom]

CUDA events around --iters steps of each variant, the variants alternating for --rounds rounds after a warm-up;
cudnn.benchmark on, as in train.py. Prints the median time per step of each variant.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as `python scripts/experiments/...`

from mobilenet.bench.dtypes import DTYPES  # noqa: E402

CL = torch.channels_last


def patch_gemm_weight_grad(x: torch.Tensor, dy: torch.Tensor, kernel: int = 3, stride: int = 2,
                           padding: int = 1) -> torch.Tensor:
    """The weight gradient of a convolution of channels_last x as dy^T @ patches(x): (K, C, kernel, kernel)."""
    n, c = x.shape[:2]
    k, ho, wo = dy.shape[1:]
    xp = F.pad(x.permute(0, 2, 3, 1), (0, 0, padding, padding, padding, padding))  # NHWC, padded
    cols = xp.unfold(1, kernel, stride).unfold(2, kernel, stride)[:, :ho, :wo]  # (N, Ho, Wo, C, kh, kw), a view
    cols = cols.reshape(n * ho * wo, c * kernel * kernel)  # (c, r, s) order, as the weight's
    return (dy.permute(0, 2, 3, 1).reshape(n * ho * wo, k).t() @ cols).view(k, c, kernel, kernel)


class _GemmWeightGradConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x)
        return F.conv2d(x, weight, stride=2, padding=1)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return None, patch_gemm_weight_grad(x, dy.contiguous(memory_format=CL))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--dtype", choices=DTYPES, default="fp16")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--variants", default="nhwc3,nchw3,nhwc4,nhwc8,nhwc3_pad4,gemm,custom",
                   help="comma-separated variants to time (default: all)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("stem_wgrad.py times CUDA kernels and needs a CUDA device")
    torch.backends.cudnn.benchmark = True
    dt, n, s = DTYPES[args.dtype], args.batch, args.size
    dev = torch.device("cuda")
    x3 = torch.randn(n, 3, s, s, device=dev, dtype=dt)
    inputs = {
        "nhwc3": x3.contiguous(memory_format=CL),
        "nchw3": x3.contiguous(),
        "nhwc4": F.pad(x3, (0, 0, 0, 0, 0, 1)).contiguous(memory_format=CL),
        "nhwc8": F.pad(x3, (0, 0, 0, 0, 0, 5)).contiguous(memory_format=CL),
        "nhwc3_pad4": x3.contiguous(memory_format=CL),
        "gemm": x3.contiguous(memory_format=CL),
        "custom": x3.contiguous(memory_format=CL),
    }
    wanted = args.variants.split(",")
    unknown = sorted(set(wanted) - set(inputs))
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(inputs)}")
    inputs = {name: inputs[name] for name in wanted}
    if "custom" in inputs:
        from kernels.stem_ops import stem_conv2d
    w = torch.randn(32, 3, 3, 3, device=dev, dtype=dt).contiguous(memory_format=CL).requires_grad_()
    dy = torch.randn(n, 32, s // 2, s // 2, device=dev, dtype=dt).contiguous(memory_format=CL)

    def step(name: str) -> None:
        x = inputs[name]
        if name == "nhwc3_pad4":
            x = F.pad(x, (0, 0, 0, 0, 0, 1)).contiguous(memory_format=CL)
        weight = w if x.shape[1] == 3 else F.pad(w, (0, 0, 0, 0, 0, x.shape[1] - 3))
        if name == "gemm":
            y = _GemmWeightGradConv.apply(x, weight)
        elif name == "custom":
            y = stem_conv2d(x, weight, (2, 2), (1, 1))
        else:
            y = F.conv2d(x, weight, stride=2, padding=1)
        if name == "nchw3":
            y = y.contiguous(memory_format=CL)
        y.backward(dy)

    # float64 reference of the weight gradient, from a slice of the batch (the same slice of every variant's sum
    # is not separable, so the check runs each variant on that slice too)
    xs, dys = x3[:8].double(), dy[:8].double()
    wd = w.detach().double().requires_grad_()
    F.conv2d(xs, wd, stride=2, padding=1).backward(dys)
    for name in inputs:  # warm-up (cuDNN's autotuning), and each variant's gradient against the reference
        for _ in range(3):
            w.grad = None
            step(name)
        saved = inputs[name]
        inputs[name] = saved[:8]
        dy_full, dy = dy, dy[:8].contiguous(memory_format=CL)
        w.grad = None
        step(name)
        inputs[name], dy = saved, dy_full
        err = ((w.grad.double() - wd.grad).abs().max() / wd.grad.abs().max()).item()
        print(f"{name}: weight gradient of 8 images, max |diff| / max |ref| against float64 = {err:.2e}")
    times: dict[str, list[float]] = {name: [] for name in inputs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args.rounds):
        for name in inputs:
            torch.cuda.synchronize()
            start.record()
            for _ in range(args.iters):
                w.grad = None
                step(name)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / args.iters)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"batch {n}, {s}px, {args.dtype}; median of {args.rounds} rounds of {args.iters} steps")
    for name, t in times.items():
        print(f"{name:11s} {statistics.median(t) * 1000:8.1f} us/step  (min {min(t) * 1000:.1f}, max {max(t) * 1000:.1f})")


if __name__ == "__main__":
    main()
