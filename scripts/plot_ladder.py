#!/usr/bin/env python
"""Draw the training ladder that `bash scripts/train_ladder.sh` printed as a waterfall PNG.

    bash scripts/train_ladder.sh 2 | tee ladder.md
    python scripts/plot_ladder.py ladder.md --out docs/results/train_ladder_h200.png --title "H200, 2026-12-01, commit ..."
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mobilenet.bench.ladder import parse_ladder, write_waterfall  # noqa: E402
from mobilenet.errors import MissingDependency, run_main  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", type=Path, help="the markdown table train_ladder.sh printed ('-': standard input)")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--title", default="MobileNetV1 training, one switch at a time (batch 256, synthetic data)")
    args = ap.parse_args(argv)
    try:
        text = sys.stdin.read() if str(args.table) == "-" else args.table.read_text()
        write_waterfall(parse_ladder(text), args.out, args.title)
    except (OSError, ValueError, MissingDependency) as e:  # an unreadable table, a missing step, no matplotlib
        print(f"plot_ladder: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    run_main(main)
