"""scripts/check_scaling.py on the CPU: a real 1-process train.py run and a real 2-process torchrun (gloo) run,
their throughput read back from TensorBoard into a markdown table whose numbers agree with each other and with the
event files; a failing run stops the script with its output's tail."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_scaling.py"
TINY = ["--device", "cpu", "--gpus", "2", "--steps", "8", "--warmup", "3",
        "data.resolution=32", "data.batch_size=16", "model.width_mult=0.25"]


def check_scaling(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def last_scalar(log_root: Path, tag: str) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, = {p.parent for p in log_root.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return acc.Scalars(tag)[-1].value


def number(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.fixture(scope="module")
def scaling_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scaling")
    out, work = tmp / "ddp_scaling.md", tmp / "work"
    # --target 0: on a 2-core CPU the efficiency means nothing; the verdict line is checked, not its value.
    proc = check_scaling(*TINY, "--target", "0", "--out", str(out), "--work-dir", str(work))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, work, proc


def test_markdown_has_both_runs_and_a_consistent_efficiency(scaling_run):
    out, _, proc = scaling_run
    md = out.read_text()
    rows = {m[1]: m for m in re.finditer(r"^\| round 1: (1 process|2 processes \(DDP\)) \| (\d+) \| ([\d,.]+) \| ([\d,.]+) \| "
                                         r"([\d.]+) \| ([\d.]+)", md, re.M)}
    assert set(rows) == {"1 process", "2 processes (DDP)"}, md
    one, two = rows["1 process"], rows["2 processes (DDP)"]
    assert (one[2], two[2]) == ("1", "2")
    single, multi, per_gpu = number(one[3]), number(two[3]), number(two[4])
    assert single > 0 and multi > 0 and per_gpu > 0 and number(one[5]) > 0 and number(two[5]) > 0
    assert per_gpu == pytest.approx(multi / 2, rel=2e-3, abs=1)
    efficiency = float(two[6])
    assert efficiency == pytest.approx(multi / (2 * single), rel=2e-3, abs=2e-3)
    verdict = re.search(r"Scaling efficiency ([\d.]+) = ([\d,.]+) / \(2 x ([\d,.]+)\); target >= 0\.00: PASS", md)
    assert verdict, md
    assert (float(verdict[1]), number(verdict[2]), number(verdict[3])) == (efficiency, multi, single)
    assert "Weak scaling: 16 images per process per step" in md and "global batch is 32" in md
    assert "NCCL_NVLS_ENABLE=0" in md and "python train.py " in md
    assert "python -m torch.distributed.run --standalone --nproc_per_node=2 train.py " in md
    assert "| round 1: 2 processes (DDP) |" in proc.stdout and "Scaling efficiency" in proc.stdout  # printed too


def test_the_numbers_are_the_runs_tensorboard_scalars(scaling_run):
    out, work, _ = scaling_run
    md = out.read_text()
    single = last_scalar(work / "round1-1proc", "perf/train_img_s")
    multi = last_scalar(work / "round1-2proc", "perf/train_img_s")
    assert f"= {multi:,.0f} / (2 x {single:,.0f})" in md
    # The 2-process run was told the single run's img/s, and logged its own efficiency from it.
    logged = last_scalar(work / "round1-2proc", "perf/scaling_efficiency")
    assert logged == pytest.approx(multi / (2 * single), rel=1e-3)


def test_a_failing_run_stops_with_its_output(tmp_path):
    # The custom CUDA kernels cannot run on a CPU: the first (1-process) run fails in its first seconds.
    proc = check_scaling(*TINY, "backend=custom", "--out", str(tmp_path / "x.md"), "--work-dir", str(tmp_path / "work"))
    assert proc.returncode == 2
    assert "error: this run exited with status 2" in proc.stderr  # train.py's status for a user error
    assert "backend=custom" in proc.stderr and "last 60 lines of its output" in proc.stderr
    assert not (tmp_path / "x.md").exists()
