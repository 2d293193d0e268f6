"""Data-parallel training with torchrun on the CPU (gloo): real processes, real digits data."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from mobilenet.config import compose
from mobilenet.data import LoaderSpec, build_loaders
from mobilenet.engine import Trainer, load_checkpoint

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["device=cpu", "model.width_mult=0.5", "progress=false", "data.workers=0", "perf.warmup_steps=2"]


def torchrun(log_root: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "train.py",
           *COMMON, f"log_root={log_root}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def last_scalar(run_dir: Path, tag: str) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return acc.Scalars(tag)[-1].value


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    log_root = tmp_path_factory.mktemp("ddp")
    out = torchrun(log_root, "epochs=6", "data.batch_size=32")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    ckpts = list(log_root.rglob("checkpoints/last.pt"))
    assert len(ckpts) == 1, ckpts  # only rank 0 writes checkpoints
    return ckpts[0].parent.parent, out


def test_two_process_run_trains_and_its_accuracy_equals_a_single_process_evaluation(two_process_run, capsys):
    from mobilenet.inference import evaluate_checkpoint

    run_dir, out = two_process_run
    assert "ranks" in out.stdout and "train img/s per rank" in out.stdout
    ddp_top1 = last_scalar(run_dir, "val/top1")
    assert ddp_top1 > 50  # chance is 10%
    top1, _ = evaluate_checkpoint(compose(COMMON), str(run_dir / "checkpoints" / "last.pt"))
    assert top1 == pytest.approx(ddp_top1, abs=1e-4)  # every one of the 360 images counted once, in both
    summary = capsys.readouterr().out
    assert "val top-1 %" in summary and re.search(r"CUDA work queues\W+none \(cpu\)", summary), summary


def test_only_rank_zero_writes_tensorboard(two_process_run):
    run_dir, _ = two_process_run
    event_dirs = {p.parent for p in run_dir.parent.parent.rglob("events.out.tfevents.*")}
    assert event_dirs == {run_dir}


def test_a_two_process_checkpoint_resumes_in_one_process(two_process_run, tmp_path):
    run_dir, _ = two_process_run
    ckpt = run_dir / "checkpoints" / "last.pt"
    state = load_checkpoint(str(ckpt))
    trainer = Trainer(compose([*COMMON, "epochs=7", f"resume='{ckpt}'", "data.steps_per_epoch=3"]), tmp_path / "single")
    assert (trainer.epoch, trainer.global_step) == (6, state["step"])
    result = trainer.fit()
    assert result.epochs_done == 7 and result.val_top1 > 50


def test_shards_are_disjoint_and_complete(digits_root):
    cfg = compose(["data=folder", f"data.root={digits_root}", "data.num_classes=10", "data.workers=0"])
    train_idx, val_idx = [], []
    for rank in range(2):
        train, val = build_loaders(cfg.data, LoaderSpec(torch.device("cpu"), torch.float32, False, rank, 2))
        train_idx.append(set(train.loader.sampler))
        val_idx.append(set(val.loader.dataset.indices))
    assert not train_idx[0] & train_idx[1] and not val_idx[0] & val_idx[1]
    assert len(train_idx[0] | train_idx[1]) == 1437 // 2 * 2  # drop_last drops one odd image per epoch
    assert val_idx[0] | val_idx[1] == set(range(360))


def test_sync_bn_on_cpu_ranks_is_refused_before_any_work(tmp_path):
    out = torchrun(tmp_path, "sync_bn=true", "epochs=1", timeout=300)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    # Each rank's one-line error (torchrun then reports the failed ranks with a traceback of its own).
    assert "error: sync_bn=true synchronises BatchNorm over CUDA tensors" in text, text[-3000:]
    assert "SyncBatchNorm expected input tensor" not in text


def test_sync_bn_without_a_process_group_is_refused(run_dir):
    with pytest.raises(ValueError, match="sync_bn=true needs a process group.*torchrun"):
        Trainer(compose([*COMMON, "sync_bn=true"]), run_dir)


def test_a_crashed_rank_does_not_leave_the_other_hanging(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "train.py",
           *COMMON, f"log_root={tmp_path}", "epochs=500", "dist.timeout_s=30"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not list(tmp_path.rglob("last.pt")):
            time.sleep(0.5)  # both ranks are past start-up once the first checkpoint exists
        workers = psutil.Process(proc.pid).children(recursive=True)
        ranks = [w for w in workers if "train.py" in " ".join(w.cmdline())]
        assert len(ranks) == 2, [w.cmdline() for w in workers]
        os.kill(ranks[1].pid, signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in ranks)
    finally:
        if proc.poll() is None:
            proc.kill()
