#!/usr/bin/env python
"""The stem convolution (3 -> 32 channels, 3x3, stride 2) forward + weight gradient, as training runs it, in a few
input layouts. The input needs no gradient, so the backward is the weight gradient alone, which cuDNN runs slowly
for 3 NHWC channels. Variants:

    nhwc3       the input as the loaders deliver it: 3 channels, channels_last
    nchw3       the input NCHW; the output converted to channels_last for the next layer (and its gradient back)
    nhwc4       the input delivered with a 4th, zero channel; the weight zero-padded to 4 input channels per step
    nhwc8       the same with 8 channels
    nhwc3_pad4  3 channels delivered, padded to 4 inside the step (what a loader that cannot pad would cost)

    python scripts/experiments/stem_wgrad.py [--batch 256] [--dtype fp16] [--rounds 7] [--iters 20]

CUDA events around --iters steps of each variant, the variants alternating for --rounds rounds after a warm-up;
cudnn.benchmark on, as in train.py. Prints the median time per step of each variant.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CL = torch.channels_last


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--dtype", choices=DTYPES, default="fp16")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
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
    }
    w = torch.randn(32, 3, 3, 3, device=dev, dtype=dt).contiguous(memory_format=CL).requires_grad_()
    dy = torch.randn(n, 32, s // 2, s // 2, device=dev, dtype=dt).contiguous(memory_format=CL)

    def step(name: str) -> None:
        x = inputs[name]
        if name == "nhwc3_pad4":
            x = F.pad(x, (0, 0, 0, 0, 0, 1)).contiguous(memory_format=CL)
        weight = w if x.shape[1] == 3 else F.pad(w, (0, 0, 0, 0, 0, x.shape[1] - 3))
        y = F.conv2d(x, weight, stride=2, padding=1)
        if name == "nchw3":
            y = y.contiguous(memory_format=CL)
        y.backward(dy)

    reference = None
    for name in inputs:  # warm-up: cuDNN's autotuning, and the gradients agree
        for _ in range(3):
            w.grad = None
            step(name)
        g = w.grad.float()
        reference = g if reference is None else reference
        err = ((g - reference).abs().max() / reference.abs().max()).item()
        print(f"{name}: weight gradient max |diff| / max |ref| vs nhwc3 = {err:.2e}")
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
