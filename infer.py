"""Inference: benchmark the configured combination, sweep batch sizes for latency, evaluate a checkpoint, classify
images, export to ONNX, or profile.

    python infer.py [--profile] [--batch-sizes 1,8,64,256] [--export model.onnx] [--checkpoint PATH]
                    [--images FILE ...] [HYDRA OVERRIDES ...]

Flags come first; everything after them is a Hydra override, as for train.py. A mistake in the command, config or
files prints one `error: ...` line; `--debug` (or HYDRA_FULL_ERROR=1) shows the traceback as well.
(`python infer.py backend=custom amp=true channels_last=true`). Benchmark, latency and profile runs use
`data=synthetic` (ImageNet-shaped: 224px, batch 256) unless a `data=` override says otherwise; on a machine without
a GPU they take CPU-sized defaults (batch 16, 10 timed passes) unless told otherwise. The model is the folded
inference model (fold_bn=true, the default) with fused epilogues and the forward replayed as a CUDA graph where the
GPU allows (fused_epilogue=auto, cuda_graph=auto); the summary names what ran.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true", help="profile inference steps and print a diagnosis")
    parser.add_argument("--checkpoint", help="a checkpoint written by train.py (its model.name and model.width_mult are "
                                             "used; a different one given here is refused); with no --images, "
                                             "evaluate it on data's val split")
    parser.add_argument("--images", nargs="+", metavar="FILE", help="print the top-5 classes of each image")
    parser.add_argument("--batch-sizes", metavar="N,N,...", help="img/s and p50/p99 latency per batch size, one table")
    parser.add_argument("--export", metavar="FILE.onnx", help="write the folded model as ONNX (standard operators)")
    parser.add_argument("--steps", type=int, help=f"timed benchmark steps (default {STEPS}; {CPU_STEPS} on a CPU)")
    parser.add_argument("--warmup", type=int, help=f"untimed warm-up steps (default {WARMUP}; {CPU_WARMUP} on a CPU)")
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        parser.error(f"unknown flag(s) {unknown}; Hydra overrides look like key=value")
    args.steps_given = args.steps is not None
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0):
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.batch_sizes is not None:
        args.batch_sizes = _batch_sizes(parser, args.batch_sizes)
    modes = [f for f in ("profile", "batch_sizes", "export", "images") if getattr(args, f)]
    if len(modes) > 1:
        parser.error("choose one of --profile, --batch-sizes, --export, --images")
    return args, rest


def _batch_sizes(parser: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 for n in sizes):
        parser.error(f"--batch-sizes {text!r}: give positive whole numbers separated by commas, e.g. 1,8,64,256")
    return sizes


STEPS, WARMUP = 100, 20
# ImageNet-sized inference takes about 19 s a batch of 256 on 2 CPU cores: the defaults there measure in seconds.
CPU_STEPS, CPU_WARMUP, CPU_BATCH = 10, 2, 16


def _cpu_defaults(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """On a machine without a GPU, CPU-sized steps and batch unless the user set them."""
    import torch

    on_cpu = not torch.cuda.is_available() or any(o in ("device=cpu",) for o in overrides)
    if args.steps is None:
        args.steps = CPU_STEPS if on_cpu else STEPS
    if args.warmup is None:
        args.warmup = CPU_WARMUP if on_cpu else WARMUP
    if on_cpu and not any(o.startswith("data.batch_size=") for o in overrides):
        overrides = [*overrides, f"data.batch_size={CPU_BATCH}"]
    return overrides


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:  # full tracebacks for user errors too, as HYDRA_FULL_ERROR=1 gives
        from mobilenet.errors import DEBUG_ENV

        os.environ[DEBUG_ENV] = "1"
        argv.remove("--debug")
    args, overrides = parse_args(argv)
    from mobilenet.errors import report_user_errors

    with report_user_errors():
        return _run(args, overrides)


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    from mobilenet.config import compose, override_key, unnamed_keys
    from mobilenet import inference

    measuring = not (args.checkpoint or args.images or args.export)
    if measuring and not any(o.startswith("data=") for o in overrides):
        # Benchmarking and profiling measure the model on ImageNet-shaped device-resident batches unless told otherwise.
        overrides = ["data=synthetic", *overrides]
    if measuring:
        overrides = _cpu_defaults(args, overrides)
    cfg = compose(overrides)  # a bad override or value is one line, not Hydra's report
    given = [override_key(o) for o in overrides]  # with --checkpoint, an architecture set here must be its own
    if args.export:
        inference.export_onnx(cfg, args.checkpoint, args.export, given)
    elif args.images:
        inference.classify_images(cfg, args.checkpoint, args.images, given)
    elif args.checkpoint:
        inference.evaluate_checkpoint(cfg, args.checkpoint, given)
    elif args.profile:
        # The overrides in the order given; as in train.py's run names, paths and switches that do not change
        # what is measured stay out.
        unnamed = unnamed_keys()
        named = [o for o in overrides if override_key(o) not in unnamed]
        # Named as train.py names its runs (conf/config.yaml's kv_sep and item_sep): no '=' or ',' to quote.
        name = "+".join(o.replace("=", "-", 1) for o in named)
        run_dir = Path(cfg.log_root) / "infer" / (name or "default") / time.strftime("%Y%m%d-%H%M%S")
        if args.steps_given:  # --steps sizes the traced window too
            cfg.profiler.active = args.steps
        inference.profile(cfg, run_dir, args.warmup, args.steps)
    elif args.batch_sizes:
        inference.latency_sweep(cfg, args.batch_sizes, args.warmup, args.steps)
    else:
        inference.benchmark(cfg, args.warmup, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
