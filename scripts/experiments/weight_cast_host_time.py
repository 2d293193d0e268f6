#!/usr/bin/env python
"""What does perf.amp_weight_cast's one-buffer weight cast cost the host in an eager training step, against
autocast's own cast of each weight? The two in one process, in alternating rounds, each round the median step
time of --steps eager forward+backward steps of the project's model under autocast (loss.backward(), gradients
cleared as the optimizer's zero_grad(set_to_none=True) does; no optimizer step).

    python scripts/experiments/weight_cast_host_time.py                       # CPU, bf16 autocast, a tiny model
    python scripts/experiments/weight_cast_host_time.py --device cuda --dtype fp16 --backend custom --batch 8

The captured step (cuda_graph) replays its kernels without the host, so there the one-buffer cast only saves
kernels; an eager step pays its Python (torch.func.functional_call swaps every cast parameter, the gradients are
gathered by one cat). Small batches and models keep the device's work short, so that the step time is the host's.
On a GPU, synchronised at the end of each timed run of steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as `python scripts/experiments/...`

from mobilenet.amp_weights import WeightCastForward  # noqa: E402
from mobilenet.model import MobileNetV1  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
VARIANTS = ("autocast's per-weight casts", "one-buffer cast (perf.amp_weight_cast)")


def _step(forward, params, x, device_type: str, dtype: torch.dtype) -> None:
    with torch.autocast(device_type, dtype=dtype):
        loss = forward(x).float().sum()
    loss.backward()
    for p in params:
        p.grad = None


def _run(forward, params, x, device_type, dtype, steps: int) -> float:
    """ms per step over `steps` steps, the device drained before and after."""
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        _step(forward, params, x, device_type, dtype)
    sync()
    return (time.perf_counter() - t) / steps * 1e3


def measure(device: str = "cpu", dtype: str = "bf16", backend: str = "torch", width_mult: float = 0.25,
            batch: int = 2, resolution: int = 32, steps: int = 100, rounds: int = 5, warmup: int = 20,
            threads: int = 1) -> dict[str, list[float]]:
    """{variant: ms per step of each round}; the variants alternate within every round."""
    if device == "cpu":
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    models = [MobileNetV1(num_classes=10, width_mult=width_mult, depthwise=backend).to(device).train()
              for _ in VARIANTS]
    if device == "cuda":
        models = [m.to(memory_format=torch.channels_last) for m in models]
    forwards = [models[0], WeightCastForward(models[1], DTYPES[dtype])]
    params = [list(m.parameters()) for m in models]
    x = torch.randn(batch, 3, resolution, resolution, device=device)
    if device == "cuda":
        x = x.contiguous(memory_format=torch.channels_last)
    device_type = torch.device(device).type
    for f, p in zip(forwards, params):
        _run(f, p, x, device_type, DTYPES[dtype], warmup)
    out: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v, f, p in zip(VARIANTS, forwards, params):
            out[v].append(_run(f, p, x, device_type, DTYPES[dtype], steps))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="autocast dtype (CPU autocast: bf16)")
    p.add_argument("--backend", choices=("torch", "cudnn", "custom"), default="torch", help="depthwise backend")
    p.add_argument("--width-mult", type=float, default=0.25)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--steps", type=int, default=100, help="timed steps per round and variant")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (device=cpu)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (torch.cuda.is_available() is False)")
    if args.device == "cpu" and args.dtype != "bf16":
        p.error("--device cpu: CPU autocast runs bf16 here; use --dtype bf16")
    if args.device == "cpu" and args.backend != "torch":
        p.error(f"--device cpu: backend={args.backend} needs a CUDA GPU; use --backend torch")
    if args.batch < 2:
        p.error("--batch must be >= 2 (BatchNorm in training needs more than one value per channel)")
    times = measure(args.device, args.dtype, args.backend, args.width_mult, args.batch, args.resolution, args.steps,
                    args.rounds, threads=args.threads)
    print(f"eager training step, {args.device}, autocast {args.dtype}, backend={args.backend}, width_mult "
          f"{args.width_mult}, batch {args.batch}, {args.resolution} px; {args.rounds} alternating rounds of "
          f"{args.steps} steps\n")
    print("| weight casts | ms per step, each round | median |")
    print("|---|---|--:|")
    for v, ts in times.items():
        print(f"| {v} | {', '.join(f'{t:.3f}' for t in ts)} | {statistics.median(ts):.3f} |")
    a, b = (statistics.median(times[v]) for v in VARIANTS)
    print(f"\none-buffer cast minus per-weight casts: {b - a:+.3f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
