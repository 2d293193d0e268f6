"""Inference img/s of several depthwise backends measured side by side in one process, in alternating rounds.

    python scripts/inference_ab.py [--backends cudnn,custom] [--amp fp16] [--channels-last true] [--modes eager,compile]
                                   [--rounds 7] [--steps 60] [--batch-size 256] [--resolution 224]

One MobileNetV1 per backend (and a torch.compile'd twin per mode "compile"), all in this process. Each round times
every model once, in turn (the order reversed on every other round, so that no model always runs first): 5 untimed
forward passes, then --steps passes between two CUDA events. The script prints each model's median img/s over the
rounds and every round's figure. Differences of 1% between processes are common on one GPU, so a backend comparison
this close is made here, within one process. A custom-kernel knob is compared across processes: run this script
alternately with and without it (`MDW_<KNOB>=...`, see docs/kernel_notes.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python scripts/inference_ab.py`

from mobilenet.errors import run_main  # noqa: E402
from mobilenet.bench.timing import events_elapsed_s  # noqa: E402
from mobilenet.model import build_model  # noqa: E402

AMP = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _choices(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"{what}: {','.join(bad) or 'nothing'} is not one of {', '.join(allowed)}")
    return values


def _elapsed_s(run, device: torch.device) -> float:
    """Seconds `run()` takes on the device: CUDA events on a GPU, the host clock after a sync elsewhere."""
    if device.type == "cuda":
        return events_elapsed_s(run)
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[tuple[str, str], list[float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", type=lambda s: _choices(s, ("torch", "cudnn", "custom"), "--backends"),
                   default=["cudnn", "custom"])
    p.add_argument("--amp", choices=tuple(AMP), default="fp16", help="autocast dtype, or off for fp32 (default fp16)")
    p.add_argument("--channels-last", choices=("true", "false"), default="true")
    p.add_argument("--modes", type=lambda s: _choices(s, ("eager", "compile"), "--modes"), default=["eager", "compile"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=60, help="timed forward passes per model and round (default 60)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--width-mult", type=float, default=1.0)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error(f"--rounds and --steps must be >= 1, got {args.rounds} and {args.steps}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch.cuda.is_available() is False; use --device cpu (with --backends torch)")

    torch.backends.cudnn.benchmark = True
    fmt = torch.channels_last if args.channels_last == "true" else torch.contiguous_format
    dtype = AMP[args.amp]
    x = torch.randn(args.batch_size, 3, args.resolution, args.resolution, device=device)
    x = x.to(dtype or torch.float32).contiguous(memory_format=fmt)
    forwards = {}
    for backend in args.backends:
        torch.manual_seed(0)  # the same weights for every backend
        model = build_model("mobilenet_v1", 1000, args.width_mult, backend).to(device).to(memory_format=fmt).eval()
        for mode in args.modes:
            forwards[(backend, mode)] = torch.compile(model) if mode == "compile" else model

    def passes(forward, n: int) -> None:
        with torch.inference_mode(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            for _ in range(n):
                forward(x)

    for forward in forwards.values():  # compile, cuDNN autotune, module load
        passes(forward, 30)
    img_s: dict[tuple[str, str], list[float]] = {key: [] for key in forwards}
    for rnd in range(args.rounds):
        order = list(forwards.items())
        for key, forward in order if rnd % 2 == 0 else reversed(order):
            passes(forward, 5)
            img_s[key].append(args.steps * args.batch_size / _elapsed_s(lambda: passes(forward, args.steps), device))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"inference img/s, batch {args.batch_size}, {args.resolution}px, amp {args.amp}, channels_last "
          f"{args.channels_last}, {args.rounds} rounds of {args.steps} passes, {name}, torch {torch.__version__}")
    for (backend, mode), values in img_s.items():
        print(f"{backend:6s} {mode:8s} median {statistics.median(values):9,.0f} img/s  runs {[round(v) for v in values]}")
    return img_s


if __name__ == "__main__":
    run_main(main)
