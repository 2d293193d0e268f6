#!/usr/bin/env python
"""The depthwise suites' acceptance table (issue 22) from scripts/bench_depthwise.py's CSV files: a row per suite, a
column per dtype x layout, each cell custom's speed-up over the best of the other backends for the forward and the
forward+backward (count-weighted sums over the suite's layers; bold below 1.00), then how many sums are at least 1.00,
the channels_last forward+backward and the fp32 NCHW forward over their HBM floors, and the fp16 channels_last
forward against cudnn alone.

    python scripts/depthwise_acceptance.py docs/results/depthwise_*_h200_c6d3f32.csv [--custom custom_ab] [--out F.md]

A later file's sums replace an earlier one's for the same suite, dtype, layout and pass (a re-run of some layouts).

Exit status 0; 2 when a file cannot be read as such a CSV (the message names it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python scripts/depthwise_acceptance.py`

from mobilenet.errors import run_main  # noqa: E402
from mobilenet.bench.suite_acceptance import markdown, read_sums  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csvs", nargs="+", type=Path, metavar="CSV", help="bench_depthwise.py result files (later ones replace what they measure again)")
    p.add_argument("--custom", default="custom",
                   help="the backend column to judge (custom_ab: the --ab setting of a bench_depthwise.py run)")
    p.add_argument("--out", type=Path, help="also write the table to this file")
    args = p.parse_args(argv)
    try:
        table = markdown(read_sums(args.csvs), custom=args.custom)
    except (OSError, ValueError) as e:
        print(f"depthwise_acceptance: {e}", file=sys.stderr)
        return 2
    print(table, end="")
    if args.out:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    run_main(main)
