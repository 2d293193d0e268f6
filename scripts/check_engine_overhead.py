"""Is the training loop honest and lean? Its img/s against a bare loop, in one process, on the same model.

    python scripts/check_engine_overhead.py [HYDRA OVERRIDES ...] [--steps N] [--out docs/results/engine_overhead.md]

The bare loop is the least a training step can be: autocast forward, loss, scaled backward, the run's optimizer step,
a synchronised clock around the timed window. The engine run is `Trainer(cfg).fit()`, exactly what train.py does
with the same overrides. The two alternate for --rounds rounds so that clock and thermal drift hit both alike;
the verdict compares their medians. The bare loop is eager, so the default overrides run the engine eager too
(cuda_graph=false): the check is about the loop's own overhead, not about what a captured step buys.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mobilenet.errors import run_main  # noqa: E402
from mobilenet.config import compose  # noqa: E402
from mobilenet.engine import Trainer, autocast_dtype, build_for_run, build_optimizer, resolve_device  # noqa: E402
from mobilenet.reporting import environment, machine_line, publish  # noqa: E402

DEFAULT = ["data=synthetic", "backend=cudnn", "amp=true", "channels_last=true", "cuda_graph=false"]


def bare_loop(cfg, device, steps: int, warmup: int) -> float:
    torch.backends.cudnn.benchmark = True
    model = build_for_run(cfg, device, cfg.data.num_classes)
    # The run's own optimizer (kernels and GradScaler behaviour included): the comparison is about the loop around it.
    opt = build_optimizer(cfg, model, cfg.data.batch_size)
    amp_dtype = autocast_dtype(cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    b, r = cfg.data.batch_size, cfg.data.resolution
    x = torch.randn(b, 3, r, r, device=device).to(amp_dtype or torch.float32).contiguous(memory_format=fmt)
    y = torch.randint(0, cfg.data.num_classes, (b,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * b / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="write a markdown result here")
    args, overrides = p.parse_known_args()
    overrides = overrides or DEFAULT
    cfg = compose([*overrides, f"data.steps_per_epoch={args.steps + args.warmup}", f"perf.warmup_steps={args.warmup}",
                   "epochs=1", "evaluate=false", "save_checkpoints=false", "progress=false"])
    device = resolve_device(cfg.device)
    bare, engine = [], []
    for r in range(args.rounds):
        bare.append(bare_loop(cfg, device, args.steps, args.warmup))
        run_dir = Path(cfg.log_root) / "engine_overhead" / f"{time.strftime('%Y%m%d-%H%M%S')}-{r}"
        engine.append(Trainer(cfg, run_dir, overrides=",".join(overrides)).fit().train.img_s)
    ratio = statistics.median(engine) / statistics.median(bare)
    env = environment(device)
    lines = [
        "# Training loop overhead: train.py engine vs a bare loop, same process",
        "",
        f"Command: `python scripts/check_engine_overhead.py {' '.join(sys.argv[1:])}`",
        f"Overrides: `{' '.join(overrides)}`; {args.steps} timed steps after {args.warmup} warm-up, batch {cfg.data.batch_size}, "
        f"{cfg.data.resolution}px",
        machine_line(env),
        "",
        "| loop | img/s |",
        "|---|---|",
        *[f"| round {i + 1}: bare / engine | {b:,.0f} / {e:,.0f} |" for i, (b, e) in enumerate(zip(bare, engine))],
        f"| median bare | {statistics.median(bare):,.0f} |",
        f"| median engine (train.py) | {statistics.median(engine):,.0f} |",
        f"| engine / bare | {ratio:.3f} |",
        "",
        f"Within 8%: {'yes' if ratio >= 0.92 else 'NO'}",
    ]
    publish("\n".join(lines), args.out)
    return 0 if ratio >= 0.92 else 1


if __name__ == "__main__":
    run_main(main)
