"""Inference: benchmark the configured combination, evaluate a checkpoint, classify images, or profile.

    python infer.py [--profile] [--checkpoint PATH] [--images FILE ...] [HYDRA OVERRIDES ...]

Flags come first; everything after them is a Hydra override, as for train.py
(`python infer.py --profile backend=custom amp=true`). Benchmark and profile runs use `data=synthetic`
(ImageNet-shaped: 224px, batch 256) unless a `data=` override says otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true", help="profile inference steps and print a diagnosis")
    parser.add_argument("--checkpoint", help="a checkpoint written by train.py; with no --images, evaluate it on data's val split")
    parser.add_argument("--images", nargs="+", metavar="FILE", help="print the top-5 classes of each image")
    parser.add_argument("--steps", type=int, default=100, help="timed benchmark steps (default 100)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed warm-up steps (default 20)")
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        parser.error(f"unknown flag(s) {unknown}; Hydra overrides look like key=value")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args, rest


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    from mobilenet.config import compose, override_key, unnamed_keys
    from mobilenet import inference

    if not (args.checkpoint or args.images) and not any(o.startswith("data=") for o in overrides):
        # Benchmarking and profiling measure the model on ImageNet-shaped device-resident batches unless told otherwise.
        overrides = ["data=synthetic", *overrides]
    cfg = compose(overrides)
    if args.images:
        inference.classify_images(cfg, args.checkpoint, args.images)
    elif args.checkpoint:
        inference.evaluate_checkpoint(cfg, args.checkpoint)
    elif args.profile:
        # The overrides in the order given; as in train.py's run names, paths and switches that do not change
        # what is measured stay out.
        unnamed = unnamed_keys()
        named = [o for o in overrides if override_key(o) not in unnamed]
        run_dir = Path(cfg.log_root) / "infer" / (",".join(named) or "default") / time.strftime("%Y%m%d-%H%M%S")
        inference.profile(cfg, run_dir, args.warmup, args.steps)
    else:
        inference.benchmark(cfg, args.warmup, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
