#!/usr/bin/env python
"""How precise is each backend's 16-bit depthwise forward? For every layer of a suite (mobilenet/bench/
depthwise_suites.py), in one dtype and layout: ||y - ref|| / ||ref|| of cudnn's and custom's output against F.conv2d
in float64 on the same inputs, next to the same error of the float64 result rounded to the dtype (the least any
kernel can have). A backend whose error is several times that rounding error accumulates in fewer bits than fp32;
one at about 1x rounds the fp32 sum once, as custom's kernels do.

    python scripts/experiments/depthwise_precision.py --suite efficientnet_b0 --dtype fp16 --layout nhwc

Inputs: ReLU'd N(0, 1) activations (what the layer sees after BatchNorm + ReLU), weights N(0, 1 / k^2), fresh from
a seeded generator; batch 32. cuDNN autotuned as in train.py and infer.py (three untimed calls first).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as `python scripts/experiments/...`

from mobilenet.bench.depthwise_suites import SUITES  # noqa: E402
from mobilenet.bench.dtypes import DTYPES  # noqa: E402
from mobilenet.depthwise import get_backend  # noqa: E402



def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=tuple(SUITES), default="mobilenet_v1")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp16")
    p.add_argument("--layout", choices=("nchw", "nhwc"), default="nhwc")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.backends.cudnn.benchmark = True
    dtype = DTYPES[args.dtype]
    fmt = torch.channels_last if args.layout == "nhwc" else torch.contiguous_format
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    backends = ("cudnn", "custom")
    print(f"# {args.suite}, {args.dtype} {args.layout}, batch {args.batch}, seed {args.seed}: relative error "
          "against float64")
    print("| C x H x W | k | stride | rounded float64 | " + " | ".join(backends)
          + " | " + " | ".join(f"{b} / rounded" for b in backends) + " |")
    print("|---|--:|--:|--:|" + "--:|" * (2 * len(backends)))
    for layer in SUITES[args.suite].layers:
        c, k, s, pad = layer.C, layer.k, layer.stride, layer.padding
        x = torch.randn(args.batch, c, layer.H, layer.W, device="cuda", generator=gen).relu_()
        w = torch.randn(c, 1, k, k, device="cuda", generator=gen) / k
        x, w = x.to(dtype).contiguous(memory_format=fmt), w.to(dtype).contiguous(memory_format=fmt)
        ref = F.conv2d(x.double(), w.double(), None, s, pad, 1, c)
        errors = {}
        for name in backends:
            conv = get_backend(name).conv2d
            for _ in range(3):
                y = conv(x, w, None, (s, s), (pad, pad), (1, 1))
            errors[name] = relative_error(y, ref)
        rounded = relative_error(ref.to(dtype), ref)
        print(f"| {layer.shape()} | {k} | {s} | {rounded:.2e} | "
              + " | ".join(f"{errors[b]:.2e}" for b in backends) + " | "
              + " | ".join(f"{errors[b] / rounded:.2f}" for b in backends) + " |")


if __name__ == "__main__":
    main()
