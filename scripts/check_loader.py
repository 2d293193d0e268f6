"""Does the loader keep up with training? The same train.py run fed by a real loader and by synthetic data, back to back.

    python scripts/check_loader.py [--rounds 2] [--epochs 2] [--warmup 50] [--target 0.90] [--out FILE.md]
                                   [--work-dir DIR] [--device cuda|cpu] data=dali data.root=DIR [HYDRA OVERRIDES ...]

Each round runs `python train.py OVERRIDES` (the loader under test: data=dali or data=folder, with data.root), then
the same command with data=synthetic in its place: the same model, precision, layout, batch, resolution, classes
(the folder's count) and steps per epoch (the loader's: its training images over the batch, or data.steps_per_epoch
if smaller), so that the two differ in where the batches come from and in nothing else. Synthetic batches are made
on the device once, so the synthetic run is the step's own speed; the loader's run is that speed as the loader lets
it go. Throughput is read from each run's TensorBoard event file (perf/train_img_s: images over the timed window,
the warm-up steps excluded):

    loader share = img/s fed by the loader / img/s on synthetic data

With --rounds > 1 the verdict compares medians, and the rounds alternate the two. The loader's runs sample the
machine's load over their timed steps (perf.sample_load): host CPU busy and steal, and with nvidia-ml-py the GPU's SM
and JPEG-engine busy shares, in the table where logged. --device cpu runs the same comparison on the CPU (small
images; for tests: its share says nothing about GPUs).

Exit status: 0 share >= --target, 1 below it, 2 a run failed or the setup is wrong (the message says which).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mobilenet.bench.train_runs import FIXED, TrainRun, TrainRunError, merge_overrides, num, run_train  # noqa: E402
from mobilenet.config import override_key  # noqa: E402
from mobilenet.reporting import environment, machine_line, publish  # noqa: E402
from mobilenet.subprocesses import exit_on_sigterm  # noqa: E402

LOADERS = ("dali", "folder")
CPU_DEFAULT = ["amp=false", "data.resolution=64", "data.batch_size=16", "model.width_mult=0.25"]
# The loader run's machine-load scalars (perf.sample_load) shown beside its img/s, where logged.
LOAD_COLUMNS = {"sys/cpu_busy_pct": "host CPU busy %", "sys/cpu_steal_pct": "steal %", "sys/gpu_sm_pct": "SM busy %",
                "sys/jpeg_pct": "JPEG engines %"}


def loader_split(cfg) -> tuple[int, int]:
    """(steps per epoch, classes) of the loader's training split for this config, one process: whole batches of the
    folder's training images, or data.steps_per_epoch where that is fewer, as the loaders count them."""
    from mobilenet.data.folder import scan_image_folder

    _, train_samples, _, classes = scan_image_folder(cfg.data)
    steps = len(train_samples) // cfg.data.batch_size
    if cfg.data.steps_per_epoch is not None:
        steps = min(steps, cfg.data.steps_per_epoch)
    return steps, len(classes)


class SetupError(ValueError):
    """The overrides describe no loader run that can be compared; the message says why."""


@dataclass
class Plan:
    loader: list[str]  # the loader run's overrides
    synthetic: list[str]  # the synthetic run's
    cfg: object  # the loader run's composed config
    steps: int  # steps per epoch of both


def plan(args: argparse.Namespace) -> Plan:
    """The two runs to compare; SetupError where the overrides do not describe a loader run that can be compared."""
    from mobilenet.config import compose

    device = [f"device={args.device}"] + (CPU_DEFAULT if args.device == "cpu" else [])
    base = merge_overrides([*device, f"epochs={args.epochs}", f"perf.warmup_steps={args.warmup}", *FIXED],
                           args.overrides)
    try:  # a misspelled key, a bad value or a missing data.root fails here, in a second, not in the first run
        cfg = compose(base)
        if cfg.data.name not in LOADERS:
            raise ValueError(f"data={cfg.data.name} is no loader to check; give data=dali or data=folder (with "
                             "data.root=DIR)")
        steps, classes = loader_split(cfg)
    except Exception as e:
        raise SetupError(f"the overrides do not describe a loader run: {type(e).__name__}: {e}\n  {' '.join(base)}") \
            from None
    if steps <= args.warmup and args.epochs == 1:
        raise SetupError(f"the loader's epoch has {steps} steps, no more than --warmup {args.warmup}: nothing would be "
                         "timed; lower --warmup or raise --epochs")
    loader = [o for o in base if override_key(o) != "data.steps_per_epoch"] + [f"data.steps_per_epoch={steps}"]
    # data=synthetic in place of the loader, with the loader's classes and steps; the loader's own keys dropped.
    synthetic = [o for o in loader if override_key(o) != "data" and not override_key(o).startswith(
        ("data.root", "data.dali.", "data.workers", "data.num_classes", "data.skip_corrupt", "data.check_files"))]
    synthetic = merge_overrides(["data=synthetic"], synthetic) + [f"data.num_classes={classes}"]
    return Plan(loader, synthetic, cfg, steps)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default) or cpu (for testing the pipeline)")
    p.add_argument("--epochs", type=int, default=2, help="epochs of each run (default 2: the loader's epoch boundary "
                                                          "is part of what it costs)")
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps, not timed (default 50)")
    p.add_argument("--rounds", type=int, default=1, help="loader and synthetic runs this many times, alternating")
    p.add_argument("--target", type=float, default=0.90, help="the loader share to pass (default 0.90)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take (default 1800)")
    p.add_argument("--out", type=Path, help="markdown result (default: report.md in the work directory)")
    p.add_argument("--work-dir", type=Path, help="where the runs' log_roots go (default runs/check_loader/<time>)")
    p.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides of the loader run (after `--` or "
                                                                     "inline); data=dali or data=folder and data.root")
    args = p.parse_intermixed_args(argv)
    if args.epochs < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--epochs and --rounds must be >= 1 and --warmup >= 0")
    return args


def _load_cells(run: TrainRun) -> list[str]:
    return [num(run.scalars[tag]) if tag in run.scalars else "" for tag in LOAD_COLUMNS]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    exit_on_sigterm()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU visible; --device cpu runs the same comparison on the CPU", file=sys.stderr)
        return 2
    try:
        runs = plan(args)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg, steps = runs.cfg, runs.steps
    work = (args.work_dir or ROOT / "runs" / "check_loader" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    if work.exists():
        print(f"error: {work} already exists; pick another --work-dir", file=sys.stderr)
        return 2
    name = cfg.data.name
    print(f"data={name} against data=synthetic: {args.rounds} round(s), {args.epochs} epoch(s) of {steps} steps "
          f"(batch {cfg.data.batch_size}, {cfg.data.resolution}px), {args.warmup} warm-up steps; runs under {work}",
          flush=True)
    fed: list[TrainRun] = []
    made: list[TrainRun] = []
    env = dict(os.environ)
    try:
        for r in range(1, args.rounds + 1):
            # alternate which goes first, so that drift over the rounds falls on both alike
            order = [("loader", runs.loader), ("synthetic", runs.synthetic)]
            for kind, overrides in (order if r % 2 else order[::-1]):
                run = run_train(overrides, work / f"round{r}-{kind}", env, args.timeout)
                (fed if kind == "loader" else made).append(run)
                print(f"round {r}/{args.rounds}: {kind:9} {num(run.img_s):>10} img/s ({run.seconds:.0f} s)", flush=True)
    except TrainRunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    loader_img_s = statistics.median(m.img_s for m in fed)
    synthetic_img_s = statistics.median(m.img_s for m in made)
    share = loader_img_s / synthetic_img_s
    ok = share >= args.target
    env_facts = environment(torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu"))
    head = "| round | data | img/s | step ms | data wait ms/step | " + " | ".join(LOAD_COLUMNS.values()) + " | share |"
    table = [head, "|---|---|--:|--:|--:|" + "--:|" * len(LOAD_COLUMNS) + "--:|"]
    for r, (f, m) in enumerate(zip(fed, made), 1):
        for run, label in ((f, f"data={name}"), (m, "data=synthetic")):
            s = run.scalars
            share_cell = f"{f.img_s / m.img_s:.3f}" if run is f else "1.000 (reference)"
            table.append(f"| {r} | {label} | {num(run.img_s)} | {num(s.get('perf/step_ms', float('nan')))} | "
                         f"{num(s.get('perf/data_wait_ms', float('nan')))} | " + " | ".join(_load_cells(run))
                         + f" | {share_cell} |")
    lines = [
        f"# Does data={name} keep up? The same train.py run fed by it and by synthetic data",
        "",
        f"Command: `python scripts/check_loader.py {shlex.join(argv)}`",
        f"Date: {time.strftime('%Y-%m-%d')}; tree: {env_facts.get('tree', 'unknown')}",
        machine_line(env_facts) + f"; {env_facts['cpu_cores']} CPU cores; DALI {env_facts['dali']}",
        f"{args.rounds} round(s) of one run each, alternating which goes first; {args.epochs} epoch(s) of {steps} "
        f"steps of batch {cfg.data.batch_size} at {cfg.data.resolution}px, {args.warmup} warm-up steps not timed.",
        "",
        "Commands (round 1):",
        "",
        "```bash",
        fed[0].command,
        made[0].command,
        "```",
        "",
        *table,
        "",
        "img/s are perf/train_img_s from each run's TensorBoard events (images over the timed window); the machine's "
        "load is sampled over the loader runs' timed steps (perf.sample_load; GPU figures need nvidia-ml-py).",
        "",
        f"Loader share {share:.3f} = {num(loader_img_s)} / {num(synthetic_img_s)}"
        + (" (medians)" if args.rounds > 1 else "") + f"; target >= {args.target:.2f}: {'PASS' if ok else 'FAIL'}",
    ]
    publish("\n".join(lines), args.out or work / "report.md")
    print(f"wrote {args.out or work / 'report.md'}; runs in {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
