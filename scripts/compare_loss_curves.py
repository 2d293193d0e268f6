"""Do two depthwise backends, or two norms, train the same? Loss curves of the same seed, step by step, against the
noise floor.

    python scripts/compare_loss_curves.py [--backends custom,cudnn] [--steps 100] [--out FILE] [HYDRA OVERRIDES ...]
    python scripts/compare_loss_curves.py --norms custom,torch --steps 300 backend=custom amp=true channels_last=true
    python scripts/compare_loss_curves.py --setting norm.apply_in_pointwise=true,false --steps 300 backend=custom \
        norm=custom amp=true channels_last=true data=synthetic

Each candidate trains `--steps` steps from the same seed (same initial weights, same batches) in one process.
`--backends` varies `backend` (the overrides fix the norm), `--norms` varies `norm` (the overrides fix the backend),
`--setting NAME=A,B` any other setting.
The reference runs twice, the second time with every initial weight perturbed by a random relative 2^-11 (half
an fp16 ulp): how far that moves the loss curve is the noise floor, what rounding alone does to this training. The
candidate matches when its gap to the reference stays within `--tolerance` times that floor (plus a small
absolute slack for the first steps, where both gaps are ~0).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mobilenet.errors import run_main  # noqa: E402
from mobilenet.config import compose  # noqa: E402
from mobilenet.engine import Trainer, resolve_device  # noqa: E402
from mobilenet.reporting import environment, machine_line, publish  # noqa: E402

DEFAULT = ["data=synthetic", "amp=true", "channels_last=true"]


def losses(overrides: list[str], choice: str, steps: int, log_root: Path, perturb: float = 0.0) -> list[float]:
    """`choice` is one override, e.g. backend=custom or norm=torch."""
    cfg = compose([*overrides, choice, f"data.steps_per_epoch={steps}", "epochs=1", "evaluate=false",
                   "save_checkpoints=false", "progress=false", "perf.log_every=1", "perf.warmup_steps=0"])
    trainer = Trainer(cfg, log_root / f"{choice.replace('=', '-')}-{time.strftime('%H%M%S')}")
    if perturb:
        gen = torch.Generator().manual_seed(12345)
        with torch.no_grad():
            for p in trainer.model.parameters():
                sign = torch.randint(0, 2, p.shape, generator=gen).to(p.device, p.dtype) * 2 - 1
                p.mul_(1 + perturb * sign)
    result = trainer.fit()
    return [v for _, v in sorted(result.losses)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--backends", help="CANDIDATE,REFERENCE depthwise backends (the default: custom,cudnn)")
    which.add_argument("--norms", help="CANDIDATE,REFERENCE norms, e.g. custom,torch")
    which.add_argument("--setting", help="NAME=CANDIDATE,REFERENCE: any other setting, e.g. "
                                         "norm.apply_in_pointwise=true,false")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--tolerance", type=float, default=3.0, help="allowed multiple of the reference's own run-to-run gap")
    p.add_argument("--slack", type=float, default=1e-3, help="absolute loss slack added to the allowed gap")
    p.add_argument("--out", type=Path)
    args, overrides = p.parse_known_args()
    if args.steps < 1 or args.tolerance <= 0 or args.slack < 0:
        p.error(f"--steps must be >= 1, --tolerance > 0 and --slack >= 0, got {args.steps}, {args.tolerance:g} and "
                f"{args.slack:g}")
    if args.setting:
        if "=" not in args.setting:
            p.error(f"--setting takes NAME=CANDIDATE,REFERENCE, got {args.setting!r}")
        (axis, values), option = args.setting.split("=", 1), "--setting"
    else:
        axis, values = ("norm", args.norms) if args.norms else ("backend", args.backends or "custom,cudnn")
        option = f"--{axis}s"
    pair = values.split(",")
    if len(pair) != 2 or not all(pair):
        p.error(f"{option} takes CANDIDATE,REFERENCE (two values and a comma), got {values!r}")
    if any(o.split("=", 1)[0] == axis for o in overrides):
        p.error(f"{axis} is what {option} varies: leave it out of the overrides")
    candidate, reference = (f"{axis}={v}" for v in pair)
    overrides = overrides or DEFAULT
    log_root = Path("runs") / "loss_curves"
    ref1 = losses(overrides, reference, args.steps, log_root)
    ref2 = losses(overrides, reference, args.steps, log_root, perturb=2.0**-11)
    cand = losses(overrides, candidate, args.steps, log_root)
    noise = max(abs(a - b) for a, b in zip(ref1, ref2))
    gap = max(abs(a - b) for a, b in zip(cand, ref1))
    allowed = args.tolerance * noise + args.slack
    ok = gap <= allowed and len(cand) == len(ref1) == args.steps
    env = environment(resolve_device("auto"))
    lines = [
        f"# Loss curves: {candidate} vs {reference}, same seed, {args.steps} steps",
        "",
        f"Command: `python scripts/compare_loss_curves.py {' '.join(sys.argv[1:])}`",
        f"Overrides: `{' '.join(overrides)}`",
        machine_line(env),
        "",
        f"- noise floor (max |loss| gap between {reference} and {reference} from weights perturbed by 2^-11): {noise:.5f}",
        f"- max |loss| gap {candidate} vs {reference}: {gap:.5f} (allowed {allowed:.5f} = {args.tolerance} x floor + {args.slack})",
        f"- loss at step 1 / {args.steps}: {reference} {ref1[0]:.4f} / {ref1[-1]:.4f}, {candidate} {cand[0]:.4f} / {cand[-1]:.4f}",
        "",
        "| step | " + f"{reference} | {reference} (perturbed) | {candidate} |",
        "|---|---|---|---|",
        *[f"| {i + 1} | {a:.4f} | {b:.4f} | {c:.4f} |" for i, (a, b, c) in enumerate(zip(ref1, ref2, cand))
          if i < 5 or (i + 1) % 10 == 0],
        "",
        f"Match within noise: {'yes' if ok else 'NO'}",
    ]
    publish("\n".join(lines), args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
