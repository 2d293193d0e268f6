#!/usr/bin/env python
"""One depthwise layer's forward as it runs inside the model, for Nsight Compute: a producer kernel (a ReLU from
another tensor, standing in for the model's BatchNorm + ReLU) writes the input just before the convolution, so the
part it wrote last is still in L2. Three untimed producer + convolution pairs (cuDNN autotuning, module loading),
then one pair between cudaProfilerStart and cudaProfilerStop, which `ncu --profile-from-start off` profiles.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section Occupancy --section LaunchStats --section WarpStateStats \\
        python scripts/experiments/ncu_depthwise_layer.py --backend custom --dtype fp16 --channels 512 --size 14 --stride 1

NHWC (channels_last), batch 256, a k x k kernel (--kernel, 3 by default), padding k // 2; cuDNN autotuned as in
train.py and infer.py. The custom kernels' launch knobs come from the environment (MDW_..., docs/kernel_notes.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as `python scripts/experiments/ncu_depthwise_layer.py`

from mobilenet.bench.dtypes import DTYPES  # noqa: E402
from mobilenet.depthwise import get_backend  # noqa: E402



def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("torch", "cudnn", "custom"), required=True)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp16")
    p.add_argument("--channels", type=int, required=True)
    p.add_argument("--size", type=int, required=True, help="input height = width")
    p.add_argument("--stride", type=int, choices=(1, 2), default=1)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--kernel", type=int, choices=(3, 5, 7), default=3, help="kernel height = width")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (torch.cuda.is_available() is False)")
    conv = get_backend(args.backend).conv2d
    torch.backends.cudnn.benchmark = True
    dtype = DTYPES[args.dtype]
    src = torch.randn(args.batch, args.channels, args.size, args.size, device="cuda", dtype=dtype)
    src = src.contiguous(memory_format=torch.channels_last)
    x = torch.empty_like(src)
    k = args.kernel
    w = torch.randn(args.channels, 1, k, k, device="cuda", dtype=dtype) / k
    stride = (args.stride, args.stride)

    def pair():
        torch.clamp(src, min=0, out=x)  # the producer: x's last-written part sits in L2
        conv(x, w, None, stride, (k // 2, k // 2), (1, 1))

    with torch.inference_mode():
        for _ in range(3):
            pair()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        pair()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
