"""Diagnose a torch.profiler Chrome trace offline (a trace.json.gz written by StepProfiler, or any exported trace).

    python scripts/diagnose.py runs/.../trace.json.gz [--md report.md] [--baseline-ms 12.3] [--top-k 15]
                               [--skip-steps N] [--json]

Prints the report (GPU time by category, idle split, launch-boundness, depthwise implementation, transposes,
casts, copies, syncs, top kernels); the run's facts come from the trace's `mobilenet_meta` metadata when present.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mobilenet.errors import run_main  # noqa: E402
from mobilenet.profiling import analyse_trace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="Chrome trace (.json or .json.gz)")
    p.add_argument("--md", type=Path, help="also write the report as markdown to this file")
    p.add_argument("--baseline-ms", type=float, help="unprofiled median step time, to state the profiler's overhead")
    p.add_argument("--top-k", type=int, default=15)
    p.add_argument("--skip-steps", type=int, default=0, help="leave out the first N recorded steps (first-call effects)")
    p.add_argument("--json", action="store_true", help="print the report's figures as JSON instead of markdown")
    args = p.parse_args(argv)
    if not args.trace.exists():
        p.error(f"no such trace: {args.trace}")
    report = analyse_trace(args.trace, baseline_step_ms=args.baseline_ms, top_k=args.top_k, skip_steps=args.skip_steps)
    md = report.markdown()
    print(json.dumps(report.to_dict(), indent=1, default=str) if args.json else md)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(md)
    return 0


if __name__ == "__main__":
    run_main(main)
