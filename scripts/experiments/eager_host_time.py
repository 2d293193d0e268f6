#!/usr/bin/env python
"""Where does an eager (or, with --compile, a compiled) training step's host time go, per depthwise backend? The
backends' models in one process, in alternating rounds, each round the mean step time of --steps training steps
(forward under autocast, backward through GradScaler under fp16, fused SGD step) at a batch small enough that the
device's work is short and the step time is the host's. Then, with --cprofile, a cProfile of --steps steps of each
backend: the Python functions that take the most host time, so a gap between backends points at code.

    python scripts/experiments/eager_host_time.py --backends cudnn,custom --cprofile

At the training batch (--batch 256 --resolution 224) the same rounds compare whole steps with the backends
alternating in one process, which keeps them apart from the process-to-process swings of host-bound (compiled)
steps:

    python scripts/experiments/eager_host_time.py --backends cudnn,custom --weight-cast off --compile
        --batch 256 --resolution 224 --steps 20 --rounds 7 --dtype fp16 --channels-last true   (one command)

Needs a CUDA GPU for backend=cudnn|custom. Synchronised before and after each timed run of steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as `python scripts/experiments/...`

from mobilenet.amp_weights import WeightCastForward  # noqa: E402
from mobilenet.depthwise import available_backends  # noqa: E402
from mobilenet.model import MobileNetV1  # noqa: E402
from mobilenet.reporting import environment  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # fp32: autocast off


def _variant(backend: str, norm: str, weight_cast: bool, dtype: torch.dtype | None, device: str,
             apply_in_depthwise: bool = False, compile: bool = False, channels_last: bool = True):
    torch.manual_seed(0)
    model = MobileNetV1(num_classes=1000, depthwise=backend, norm=norm,
                        apply_norm_in_depthwise=apply_in_depthwise).to(device).train()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    forward = WeightCastForward(model, dtype) if weight_cast else model
    if compile:  # as train.py compiles it: the forward (and through AOTAutograd its backward), not the optimizer
        forward = torch.compile(forward)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)  # as train.py's step under fp16
    return forward, scaler, opt


def _steps(variant, x, y, dtype, steps: int) -> float:
    """ms per step over `steps` steps, the device drained before and after."""
    forward, scaler, opt = variant
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(forward(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="cudnn,custom")
    p.add_argument("--norm", default="torch", help="torch, custom or apex")
    p.add_argument("--apply-in-depthwise", action="store_true",
                   help="norm.apply_in_depthwise: each BatchNorm + ReLU before a depthwise conv applied by its kernels "
                        "(needs --norm custom and a custom backend; train.py turns it on there by default)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp16", help="autocast's dtype; fp32: autocast off")
    p.add_argument("--channels-last", choices=("true", "false"), default="true", help="the model's and input's layout")
    p.add_argument("--weight-cast", choices=("on", "off", "both"), default="both",
                   help="perf.amp_weight_cast's one-buffer cast (on), autocast's per-weight casts (off), or both")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--resolution", type=int, default=128)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each variant's forward, as train.py's compile=true does (no CUDA graphs)")
    p.add_argument("--cprofile", action="store_true", help="also profile each variant's host code (top 25)")
    args = p.parse_args(argv)
    unknown = [b for b in args.backends.split(",") if b not in available_backends()]
    if unknown:
        p.error(f"--backends: {', '.join(unknown)} is not a backend (choose from {', '.join(available_backends())})")
    if args.apply_in_depthwise and (args.norm != "custom" or args.backends != "custom"):
        p.error("--apply-in-depthwise needs --norm custom --backends custom (the depthwise kernels apply the norm)")
    if args.dtype == "fp32" and args.weight_cast != "off":
        p.error("--weight-cast on|both casts the weights to autocast's dtype; with --dtype fp32 use --weight-cast off")
    if args.compile and args.weight_cast != "off":
        p.error("--compile needs --weight-cast off (train.py turns the one-buffer cast off under compile=true)")
    if args.batch < 2:
        p.error("--batch must be >= 2 (BatchNorm in training needs more than one value per channel)")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (torch.cuda.is_available() is False)")
    dtype = DTYPES[args.dtype]
    casts = {"on": [True], "off": [False], "both": [False, True]}[args.weight_cast]
    names, variants = [], []
    for b in args.backends.split(","):
        for wc in casts:
            names.append(f"backend={b} norm={args.norm}{' apply_in_depthwise' if args.apply_in_depthwise else ''} "
                         f"amp_weight_cast={'on' if wc else 'off'}")
            variants.append(_variant(b, args.norm, wc, dtype, "cuda", args.apply_in_depthwise, args.compile,
                                     args.channels_last == "true"))
    layout = torch.channels_last if args.channels_last == "true" else torch.contiguous_format
    x = torch.randn(args.batch, 3, args.resolution, args.resolution, device="cuda").contiguous(memory_format=layout)
    y = torch.randint(0, 1000, (args.batch,), device="cuda")
    for v in variants:
        _steps(v, x, y, dtype, 15)
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for n, v in zip(names, variants):
            times[n].append(_steps(v, x, y, dtype, args.steps))
    print(f"{'compiled' if args.compile else 'eager'} training step ({args.dtype}, "
          f"{'channels_last' if args.channels_last == 'true' else 'NCHW'}, fused SGD), batch {args.batch}, "
          f"{args.resolution} px, {torch.cuda.get_device_name()}; {args.rounds} alternating rounds of {args.steps} steps")
    env = environment(torch.device("cuda"))
    print(f"tree {env['tree']}, torch {env['torch']}, cuDNN {env['cudnn']}, driver {env['driver']}, "
          f"{env['cpu_cores']} CPU cores\n")
    print("| variant | ms per step, each round | median | img/s at the median |")
    print("|---|---|--:|--:|")
    for n, ts in times.items():
        med = statistics.median(ts)
        print(f"| {n} | {', '.join(f'{t:.3f}' for t in ts)} | {med:.3f} | {args.batch / med * 1e3:,.0f} |")
    if args.cprofile:
        for n, v in zip(names, variants):
            prof = cProfile.Profile()
            prof.enable()
            _steps(v, x, y, dtype, args.steps)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            print(f"\n### cProfile, {n}, {args.steps} steps (sorted by own time)\n\n```\n{s.getvalue().strip()}\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
