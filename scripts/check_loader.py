"""Does the loader keep up with training? The same train.py run fed by a real loader and by synthetic data, back to back.

    python scripts/check_loader.py [--rounds 2] [--epochs 2] [--warmup 50] [--target 0.90] [--out FILE.md]
                                   [--work-dir DIR] [--device cuda|cpu] [--variant "OVERRIDES" ...]
                                   data=dali data.root=DIR [HYDRA OVERRIDES ...]

Each round runs `python train.py OVERRIDES` (the loader under test: data=dali or data=folder, with data.root), then
the same command with data=synthetic in its place: the same model, precision, layout, batch, resolution, classes
(the folder's count) and steps per epoch (the loader's: its training images over the batch, or data.steps_per_epoch
if smaller), so that the two differ in where the batches come from and in nothing else. Synthetic batches are made
on the device once, so the synthetic run is the step's own speed; the loader's run is that speed as the loader lets
it go. Throughput is read from each run's TensorBoard event file (perf/train_img_s: images over the timed window,
the warm-up steps excluded):

    loader share = img/s fed by the loader / img/s on synthetic data

With --rounds > 1 the verdict compares medians, and the rounds alternate the two. --variant (given twice or more)
compares loader settings in the same rounds: each variant's overrides (loader keys only: data, data.root, data.dali.*,
data.workers, ...) are added to the loader run's, every round runs each variant and one synthetic run in an order that
rotates from round to round, and each variant gets its own share against the same synthetic runs:

    python scripts/check_loader.py --rounds 3 --variant data.dali.pipelines=1 --variant data.dali.pipelines=2 \
        data=dali data.root=DIR backend=custom norm=custom amp=true channels_last=true

The loader's runs sample the
machine's load over their timed steps (perf.sample_load): host CPU busy and steal, and with nvidia-ml-py the GPU's SM
and JPEG-engine busy shares, in the table where logged. --device cpu runs the same comparison on the CPU (small
images; for tests: its share says nothing about GPUs).

Exit status: 0 share >= --target (every variant's), 1 below it, 2 a run failed or the setup is wrong (the message
says which).
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

from mobilenet.errors import run_main  # noqa: E402
from mobilenet.bench.train_runs import FIXED, TrainRun, TrainRunError, merge_overrides, num, run_train  # noqa: E402
from mobilenet.config import override_key  # noqa: E402
from mobilenet.reporting import environment, machine_line, publish  # noqa: E402
from mobilenet.subprocesses import exit_on_sigterm  # noqa: E402

LOADERS = ("dali", "folder")
CPU_DEFAULT = ["amp=false", "data.resolution=64", "data.batch_size=16", "model.width_mult=0.25"]
# The loader run's machine-load scalars (perf.sample_load) shown beside its img/s, where logged. The busiest
# thread's share tells a loader bound by one host thread (the training loop's, or one of DALI's) from one bound by
# the decoder; its name is in the run's summary (output.log).
LOAD_COLUMNS = {"sys/cpu_busy_pct": "host CPU busy %", "sys/cpu_steal_pct": "steal %",
                "sys/busiest_thread_pct": "busiest thread % of a core", "sys/gpu_sm_pct": "SM busy %",
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


# The keys a --variant may set: those the synthetic run drops, so that every variant shares its reference.
LOADER_KEYS = ("data.root", "data.dali.", "data.workers", "data.num_classes", "data.skip_corrupt", "data.check_files")


@dataclass
class Plan:
    loaders: list[list[str]]  # the loader runs' overrides: one, or one per --variant
    names: list[str]  # each loader run's data=
    variants: list[str]  # the --variant strings, in that order ([] without --variant)
    synthetic: list[str]  # the synthetic run's
    cfg: object  # the (first) loader run's composed config
    steps: int  # steps per epoch of every run


def _is_loader_key(key: str) -> bool:
    return key == "data" or key.startswith(LOADER_KEYS)


def _loader_run(base: list[str], args: argparse.Namespace):
    """(composed config, steps per epoch, classes) of one loader run; SetupError where it is none."""
    from mobilenet.config import compose

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
    return cfg, steps, classes


def plan(args: argparse.Namespace) -> Plan:
    """The runs to compare; SetupError where the overrides do not describe loader runs that can be compared."""
    device = [f"device={args.device}"] + (CPU_DEFAULT if args.device == "cpu" else [])
    base = merge_overrides([*device, f"epochs={args.epochs}", f"perf.warmup_steps={args.warmup}", *FIXED],
                           args.overrides)
    variants = args.variant or []
    runs = []
    for variant in variants or [None]:
        extra = shlex.split(variant) if variant is not None else []
        others = [o for o in extra if not _is_loader_key(override_key(o))]
        if others or (variant is not None and not extra):
            keys = ", ".join(["data", *(k + "*" if k.endswith(".") else k for k in LOADER_KEYS)])
            raise SetupError(f"--variant {variant!r} sets {' '.join(others) or 'nothing'}: a variant sets loader keys "
                             f"only ({keys}), which the synthetic run they share leaves out")
        overrides = merge_overrides(base, extra)
        runs.append((overrides, *_loader_run(overrides, args)))
    _, cfg, steps, classes = runs[0]
    for variant, (overrides, _, s, c) in zip(variants, runs):
        if (s, c) != (steps, classes):
            raise SetupError(f"--variant {variant!r} gives {s} steps per epoch and {c} classes, the first "
                             f"{variants[0]!r} {steps} and {classes}: the variants must read the same training split")
    loaders = [[o for o in overrides if override_key(o) != "data.steps_per_epoch"] + [f"data.steps_per_epoch={steps}"]
               for overrides, *_ in runs]
    # data=synthetic in place of the loader, with the loader's classes and steps; the loader's own keys dropped.
    synthetic = [o for o in loaders[0] if not _is_loader_key(override_key(o))]
    synthetic = merge_overrides(["data=synthetic"], synthetic) + [f"data.num_classes={classes}"]
    return Plan(loaders, [c.data.name for _, c, _, _ in runs], list(variants), synthetic, cfg, steps)


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
    p.add_argument("--variant", action="append", metavar="OVERRIDES",
                   help="loader overrides of one setting to compare (give it twice or more), e.g. "
                        "--variant data.dali.pipelines=1 --variant data.dali.pipelines=2")
    p.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides of the loader run (after `--` or "
                                                                     "inline); data=dali or data=folder and data.root")
    args = p.parse_intermixed_args(argv)
    if args.epochs < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--epochs and --rounds must be >= 1 and --warmup >= 0")
    if args.variant is not None and len(args.variant) < 2:
        p.error("--variant compares settings: give it at least twice (or not at all)")
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
    name = "/".join(dict.fromkeys(runs.names))  # the loader(s) under test: a variant may set data= too
    variants = runs.variants
    against = f"{len(variants)} settings of data={name}" if variants else f"data={name}"
    print(f"{against} against data=synthetic: {args.rounds} round(s), {args.epochs} epoch(s) of {steps} steps "
          f"(batch {cfg.data.batch_size}, {cfg.data.resolution}px), {args.warmup} warm-up steps; runs under {work}",
          flush=True)
    # (kind, overrides): the loader run(s), then the synthetic one; "loader" alone, or "loader1", "loader2", ...
    kinds = [(f"loader{k}" if variants else "loader", o) for k, o in enumerate(runs.loaders, 1)]
    kinds.append(("synthetic", runs.synthetic))
    fed: dict[str, list[TrainRun]] = {kind: [] for kind, _ in kinds}
    env = dict(os.environ)
    try:
        for r in range(1, args.rounds + 1):
            # the order rotates from round to round (with one loader: alternates), so that drift over the rounds
            # falls on every run alike
            shift = (r - 1) % len(kinds)
            for kind, overrides in kinds[shift:] + kinds[:shift]:
                run = run_train(overrides, work / f"round{r}-{kind}", env, args.timeout)
                fed[kind].append(run)
                print(f"round {r}/{args.rounds}: {kind:9} {num(run.img_s):>10} img/s ({run.seconds:.0f} s)", flush=True)
    except TrainRunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    made = fed.pop("synthetic")
    synthetic_img_s = statistics.median(m.img_s for m in made)
    labels = {kind: f"data={runs.names[i]}" + (f" `{variants[i]}`" if variants else "") for i, kind in enumerate(fed)}
    shares = {kind: statistics.median(f.img_s for f in results) / synthetic_img_s for kind, results in fed.items()}
    ok = all(share >= args.target for share in shares.values())
    env_facts = environment(torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu"))
    head = "| round | data | img/s | step ms | data wait ms/step | " + " | ".join(LOAD_COLUMNS.values()) + " | share |"
    table = [head, "|---|---|--:|--:|--:|" + "--:|" * len(LOAD_COLUMNS) + "--:|"]
    for r, m in enumerate(made, 1):
        rows = [(results[r - 1], labels[kind]) for kind, results in fed.items()] + [(m, "data=synthetic")]
        for run, label in rows:
            s = run.scalars
            share_cell = f"{run.img_s / m.img_s:.3f}" if run is not m else "1.000 (reference)"
            table.append(f"| {r} | {label} | {num(run.img_s)} | {num(s.get('perf/step_ms', float('nan')))} | "
                         f"{num(s.get('perf/data_wait_ms', float('nan')))} | " + " | ".join(_load_cells(run))
                         + f" | {share_cell} |")
    medians = " (medians)" if args.rounds > 1 else ""
    verdicts = [(f"{labels[kind]}: l" if variants else "L")
                + f"oader share {share:.3f} = {num(statistics.median(f.img_s for f in fed[kind]))} / "
                  f"{num(synthetic_img_s)}{medians}; target >= {args.target:.2f}: "
                  f"{'PASS' if share >= args.target else 'FAIL'}" for kind, share in shares.items()]
    order = ("each running every setting and the synthetic run once, in an order that rotates from round to round"
             if variants else "of one run each, alternating which goes first")
    lines = [
        f"# Does data={name} keep up? The same train.py run fed by it and by synthetic data",
        "",
        f"Command: `python scripts/check_loader.py {shlex.join(argv)}`",
        f"Date: {time.strftime('%Y-%m-%d')}; tree: {env_facts.get('tree', 'unknown')}",
        machine_line(env_facts) + f"; {env_facts['cpu_cores']} CPU cores; DALI {env_facts['dali']}",
        f"{args.rounds} round(s) {order}; {args.epochs} epoch(s) of {steps} "
        f"steps of batch {cfg.data.batch_size} at {cfg.data.resolution}px, {args.warmup} warm-up steps not timed.",
        "",
        "Commands (round 1):",
        "",
        "```bash",
        *[results[0].command for results in fed.values()],
        made[0].command,
        "```",
        "",
        *table,
        "",
        "img/s are perf/train_img_s from each run's TensorBoard events (images over the timed window); the machine's "
        "load is sampled over the loader runs' timed steps (perf.sample_load; GPU figures need nvidia-ml-py).",
        "",
        *[line for v in verdicts for line in (v, "")][:-1],
    ]
    publish("\n".join(lines), args.out or work / "report.md")
    print(f"wrote {args.out or work / 'report.md'}; runs in {work}")
    return 0 if ok else 1

if __name__ == "__main__":
    run_main(main)
