"""Compare the runs of a throughput matrix: a sorted markdown table, a CSV and a bar chart, from TensorBoard files.

    python scripts/compare.py RUNS_DIR [RUNS_DIR ...] [--out DIR] [--name matrix] [--allow-mixed] [--allow-incomplete]

Every directory under RUNS_DIR holding TensorBoard event files is a run: scripts/benchmark.py writes one per
combination, and train.py one per run (a `train.py -m` grid is a runs directory too). From each run it reads the
hparams that the run logged (hparams plugin data: backend, norm, amp, amp_dtype, channels_last, compile, cuda_graph,
data, batch_size, resolution, gpu, torch, cudnn; runs without the cuda_graph hparam show it blank, runs without norm
take it from their overrides, else norm=torch) and the last value of
the scalar perf/train_img_s, plus perf/infer_img_s, perf/compute_img_s, perf/step_ms and sys/max_mem_gb where present.
train.py measures no inference throughput (scripts/benchmark.py does): its runs leave the inference columns blank,
and the report says so. Combinations that scripts/benchmark.py skipped or that failed (their
benchmark.json says so) are listed with their reason. Runs of one combination (scripts/benchmark.py --repeats N, or
the same combination measured again) become one row: the median of each scalar, with the number of runs and the
min-max of training and inference img/s; ratios and speed-ups are taken between those medians. Runs that differ in
a Hydra override the table has no column for (the run's .hydra/overrides.yaml or benchmark.json: `optim=sgd`
against `optim=rmsprop`, say) are different combinations, named in a settings column; runs that differ only in
seed or in where they were written are repeats.

Writes DIR/NAME.md (also printed), DIR/NAME.csv and DIR/NAME.png (DIR defaults to the first RUNS_DIR). Exit status:
0; 1 when batch size or resolution differ between runs (img/s would not be comparable) unless --allow-mixed;
2 when there is nothing to compare or a run lacks its hparams or a required scalar, unless --allow-incomplete.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python scripts/compare.py`

from mobilenet.errors import run_main  # noqa: E402
from mobilenet.bench.compare import compare_runs  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs_dirs", nargs="+", type=Path, metavar="RUNS_DIR", help="one or more runs directories (e.g. one per slice)")
    p.add_argument("--out", type=Path, help="where NAME.md/.csv/.png go (default: the first RUNS_DIR)")
    p.add_argument("--name", default="matrix", help="file name stem (default: matrix)")
    p.add_argument("--allow-mixed", action="store_true", help="compare runs of different batch sizes or resolutions anyway")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="list runs lacking hparams or required scalars as not measured instead of failing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return compare_runs(args.runs_dirs, args.out, args.name, args.allow_mixed, args.allow_incomplete)


if __name__ == "__main__":
    run_main(main)
