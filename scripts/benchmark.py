"""The throughput matrix: training and inference img/s of every backend x amp x layout x compile x data combination
(and, on request, with the training step captured as a CUDA graph, and with the fused BatchNorm+ReLU norms).

    python scripts/benchmark.py [--backends torch,cudnn,custom] [--amp off,fp16,bf16] [--channels-last false,true]
                                [--compile false,true] [--data synthetic,dali] [--cuda-graph false]
                                [--norms torch] (of torch,custom,apex) [--env 'NAME=VALUE ...']
                                [--batch-size 256] [--resolution 224]
                                [--warmup 20] [--steps 100] [--repeats 1] [--out runs/matrix-<time>]
                                [-- HYDRA OVERRIDES ...]
    python scripts/compare.py runs/matrix-<time>

Every combination runs in its own subprocess with its own run directory under --out: torch.compile's in-process
state and cuDNN's autotuning stay isolated (Inductor's on-disk cache, shared by default, only shortens compiling a
graph seen before, which happens in the untimed warm-up), and a crash is recorded as a failed row (with its last
error line) instead of ending the matrix. All combinations use the same batch size, resolution, warm-up and timed
steps and run back to back, so their ratios are fair. Each run measures, in this order,
  - inference: --infer-warmup + --infer-steps forward passes of the run's model on a device-resident batch of the
    same size under torch.inference_mode (perf/infer_img_s);
  - training: the project's Trainer (mobilenet/engine.py), one epoch of --warmup + --steps steps; its StepMeter
    times the last --steps (perf/train_img_s, perf/compute_img_s, ...). No validation pass (evaluate=false): it
    would only add another torch.compile graph.
Both are logged to TensorBoard in the run's directory, with hparams (hparam/infer_img_s added to the metrics), so
TensorBoard's HParams tab over --out shows the whole grid.

The peer row (backend "timm"): timm's mobilenetv1_100 measured by the same StepMeter loops under the same settings
on synthetic data, logged under the same tags. timm is optional (pip install timm, or the `bench` extra).

Combinations that cannot run here are skipped up front with the reason (no CUDA for backend=cudnn/custom or
amp=fp16, DALI not installed, no --data-root for data=dali, timm not installed); each gets a run directory holding
only its benchmark.json, so compare.py lists it with that reason; so does a combination that --time-budget left
unstarted. A run directory whose benchmark.json says "ok"
is not measured again when the same --out is used again: an interrupted matrix continues where it stopped.

--env 'NAME=VALUE ...' adds an environment variant: every combination (the peer's aside) also runs with those
variables set in its process, next to the run in the invocation's own environment; repeat --env for more variants.
It compares what only an environment variable switches, such as the custom kernels' launch knobs (MDW_*, docs/
kernels.md) or MBN_DEPTHWISE_BACKWARD, end to end and in alternating processes with --repeats:
    python scripts/benchmark.py --peer no --repeats 2 --env MDW_BWD_RING=0 backend=custom norm=custom amp=fp16 \
        channels_last=true compile=false data=synthetic cuda_graph=true
compare.py shows a variant's rows with the backend as `custom [MDW_BWD_RING=0]`.

Within a round, the backends, norms and environment variants of one precision and layout run back to back, so the
runs a comparison reads are close in time, and a matrix cut short by --time-budget still holds whole comparisons.

--repeats N measures every combination N times, each time in a process of its own, in rounds: every combination once,
then every combination again, so that the runs of a pair (custom and cudnn of one setting) alternate. Round k > 1
writes to `<combination>,repeat=k`. compare.py turns the runs of one combination into their median and shows their
spread: some rows (compiled training above all) differ by several percent from one process to the next, more than
the differences a matrix is read for.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python scripts/benchmark.py`

from mobilenet.errors import run_main  # noqa: E402
from mobilenet.bench.matrix import parse_args, run_matrix  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return run_matrix(parse_args(sys.argv[1:] if argv is None else argv, description=__doc__))


if __name__ == "__main__":
    run_main(main)
