"""The training loop on real data: it learns, resumes exactly, checkpoints atomically, refuses bad input."""

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mobilenet.config import compose
from mobilenet.engine import CheckpointError, Trainer, load_checkpoint, param_groups

ROOT = Path(__file__).resolve().parent.parent
FAST = ["model.width_mult=0.25", "device=cpu", "progress=false", "perf.warmup_steps=2", "perf.log_every=5"]


def test_a_short_run_on_digits_learns(run_dir):
    cfg = compose([*FAST, "epochs=4", "model.width_mult=0.5"])
    result = Trainer(cfg, run_dir).fit()
    losses = [v for _, v in result.losses]
    assert losses[-1] < 0.7 * losses[0]
    assert result.val_top1 > 50  # chance is 10%
    assert result.val_images == 360
    assert result.train.img_s > 0 and result.train.steps == result.train.images // 64


def test_resume_continues_with_the_same_step_and_lr(tmp_path):
    common = [*FAST, "data.steps_per_epoch=5", "evaluate=false", "perf.log_every=1"]
    straight = Trainer(compose([*common, "epochs=3"]), tmp_path / "a").fit()
    first = Trainer(compose([*common, "epochs=2"]), tmp_path / "b")
    first.fit()
    resumed = Trainer(compose([*common, "epochs=3", f"resume={first.checkpoint_path}"]), tmp_path / "c")
    assert (resumed.epoch, resumed.global_step) == (2, 10)
    result = resumed.fit()
    assert resumed.global_step == straight.global_step == 15
    # Steps 11..15 of the resumed run see exactly the learning rates of the uninterrupted run.
    assert [s for s, _ in result.lrs] == [11, 12, 13, 14, 15]
    assert [lr for _, lr in result.lrs] == pytest.approx([lr for _, lr in straight.lrs[10:]])


def _stop_before_epoch(trainer: Trainer, epoch: int) -> None:
    """Make `trainer` stop as Ctrl-C would once `epoch` epochs are done: same schedule as the full run, checkpoint
    of the last complete epoch left behind."""
    run_epoch = trainer.train_epoch

    def train_epoch(result, max_steps=None):
        if trainer.epoch == epoch:
            raise KeyboardInterrupt
        return run_epoch(result, max_steps)

    trainer.train_epoch = train_epoch


def _resumed_and_straight_states(tmp_path, overrides: list[str]) -> tuple[dict, dict]:
    """(model state after 3 epochs straight, model state after 2 epochs, a stop and a resume for the third)."""
    common = [*overrides, "data.steps_per_epoch=5", "evaluate=false", "model.dropout=0.2", "epochs=3"]
    cfg = compose(common)
    straight = Trainer(cfg, tmp_path / "straight")
    straight.fit()
    interrupted = Trainer(cfg, tmp_path / "interrupted")
    _stop_before_epoch(interrupted, 2)
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit()
    resumed = Trainer(compose([*common, f"resume={interrupted.checkpoint_path}"]), tmp_path / "resumed")
    resumed.fit()
    assert resumed.global_step == straight.global_step == 15
    return straight.model.state_dict(), resumed.model.state_dict()


def _assert_bitwise_equal(expected: dict, actual: dict) -> None:
    differ = [name for name, value in expected.items() if not torch.equal(value, actual[name])]
    assert not differ, f"{len(differ)} tensors differ, first: {differ[:3]}"


# data.workers=0: the crops are drawn from the main process's RNG, which the checkpoint holds. Persistent loader
# workers keep RNG streams of their own that no checkpoint saves.
EXACT_RESUME = ["model.width_mult=0.25", "progress=false", "perf.warmup_steps=2", "perf.log_every=5", "data.workers=0"]


def test_a_resumed_run_takes_the_same_steps_as_the_uninterrupted_run_bitwise(tmp_path):
    _assert_bitwise_equal(*_resumed_and_straight_states(tmp_path, [*EXACT_RESUME, "device=cpu"]))


@pytest.mark.gpu
def test_a_resumed_gpu_run_with_deterministic_cudnn_takes_the_same_steps_bitwise(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    # Eager steps: a captured step would restart its warm-up and capture after the resume.
    _assert_bitwise_equal(*_resumed_and_straight_states(tmp_path, [*EXACT_RESUME, "device=cuda", "cuda_graph=false"]))


@pytest.mark.parametrize("saved_cuda, restored", [([torch.zeros(8)] * 2, True), ([torch.zeros(8)], False), (None, False)])
def test_cuda_rng_states_are_restored_only_onto_as_many_gpus_as_saved_them(monkeypatch, caplog, saved_cuda, restored):
    from mobilenet.engine import restore_rng_states

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", calls.append)
    restore_rng_states({"torch": torch.get_rng_state(), "cuda": saved_cuda})
    assert bool(calls) == restored
    assert ("not restored" in caplog.text) == (not restored)


def test_resume_missing_or_corrupt_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        load_checkpoint(str(tmp_path / "nope.pt"))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x80\x04 definitely not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(str(bad))
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": 1}, foreign)
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(str(foreign))
    with pytest.raises(CheckpointError):
        Trainer(compose([*FAST, f"resume={bad}"]), tmp_path / "run")


def test_fp16_amp_on_a_cpu_is_refused(run_dir):
    with pytest.raises(ValueError, match="amp_dtype=fp16 needs a CUDA GPU.*amp_dtype=bf16"):
        Trainer(compose([*FAST, "amp=true"]), run_dir)


@pytest.mark.parametrize("backend", ["cudnn", "custom"])
def test_gpu_backends_on_a_cpu_stop_before_any_work(run_dir, backend):
    from mobilenet.depthwise import BackendUnavailable

    with pytest.raises(BackendUnavailable, match=f"backend={backend} needs a CUDA GPU"):
        Trainer(compose([*FAST, f"backend={backend}"]), run_dir)


@pytest.mark.parametrize("override, message", [
    ("backend.name=cuda", "unknown depthwise backend 'cuda'; choose one of: cudnn, custom, torch"),
    ("data.name=webdataset", "unknown data loader 'webdataset'; choose one of: dali, folder, synthetic"),
    ("model.name=resnet50", "unknown model 'resnet50'; choose one of: mobilenet_v1"),
])
def test_unknown_names_list_the_choices(run_dir, override, message):
    with pytest.raises(ValueError, match=message):
        Trainer(compose([*FAST, override]), run_dir)


def test_bf16_channels_last_synthetic_run_reports_throughput(run_dir):
    cfg = compose([*FAST, "data=synthetic", "data.resolution=64", "data.batch_size=8", "data.steps_per_epoch=6",
                   "data.val_steps=2", "epochs=1", "amp=true", "amp_dtype=bf16", "channels_last=true"])
    result = Trainer(cfg, run_dir).fit()
    tp = result.train
    assert tp.steps == 4 and tp.images == 32  # 6 steps minus 2 warm-up
    assert tp.compute_img_s >= tp.img_s > 0
    assert (run_dir / "checkpoints" / "last.pt").is_file()


def test_tensorboard_gets_the_documented_scalars_and_hparams(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = compose([*FAST, "data=synthetic", "data.resolution=32", "data.batch_size=4", "data.steps_per_epoch=5",
                   "data.val_steps=1", "epochs=1", "save_checkpoints=false"])
    result = Trainer(cfg, run_dir).fit()
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"perf/train_img_s", "perf/compute_img_s", "perf/step_ms", "perf/data_wait_ms", "train/loss", "train/lr",
            "val/top1", "val/top5"} <= tags
    assert acc.Scalars("perf/train_img_s")[-1].value == pytest.approx(result.train.img_s, rel=1e-5)
    assert "_hparams_/session_start_info" in acc.summary_metadata or any(
        "hparams" in m.plugin_data.plugin_name for m in acc.summary_metadata.values())


def test_ctrl_c_leaves_the_last_complete_checkpoint_intact(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "train.py", "epochs=200", "model.width_mult=0.25", "device=cpu", "progress=false",
         f"log_root={tmp_path}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.time() + 240
    ckpts: list[Path] = []
    while time.time() < deadline and not ckpts:
        time.sleep(0.5)
        ckpts = list(tmp_path.rglob("last.pt"))
    assert ckpts, proc.communicate(timeout=30)[0] if proc.poll() is not None else "no checkpoint appeared"
    time.sleep(1.5)  # interrupt somewhere inside a later epoch, possibly mid-save
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    state = load_checkpoint(str(ckpts[0]))
    assert state["epoch"] >= 1
    assert not [p for p in ckpts[0].parent.iterdir() if p.name != "last.pt"]  # no half-written leftovers


def test_multirun_cli_runs_each_combination(tmp_path):
    out = subprocess.run(
        [sys.executable, "train.py", "-m", "backend=torch", "amp=false,true", "amp_dtype=bf16", "data=synthetic",
         "data.resolution=32", "data.batch_size=4", "data.steps_per_epoch=3", "data.val_steps=1", "epochs=1",
         "perf.warmup_steps=1", "model.width_mult=0.25", "device=cpu", "progress=false", f"log_root={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    runs = sorted(p.name for p in tmp_path.glob("multirun-*/*") if p.is_dir())
    assert len(runs) == 2 and all("amp-" in r and "backend-torch" in r for r in runs), runs


def test_the_documented_gpu_command_on_a_cpu_names_the_backend(run_dir):
    from mobilenet.depthwise import BackendUnavailable

    # `python train.py backend=custom amp=true` on a CPU: the backend is the reason, not the fp16 autocast.
    with pytest.raises(BackendUnavailable, match="backend=custom needs a CUDA GPU"):
        Trainer(compose([*FAST, "backend=custom", "amp=true"]), run_dir)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_an_overflowing_fp16_step_is_skipped_and_later_steps_match_stock_sgd(impl):
    """GradScaler skips a step whose gradients overflow. torch's fused SGD alone leaves garbage in the momentum
    buffers of a skipped first step, which can turn the loss into NaN; build_optimizer must make it match foreach."""
    from torch import nn

    from mobilenet.engine import build_optimizer

    cfg = compose([f"optim.impl={impl}"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    ref = copy.deepcopy(model)
    opt = build_optimizer(cfg, model, 256)
    ref_opt = torch.optim.SGD(param_groups(ref, cfg.optim.weight_decay), lr=cfg.optim.lr, momentum=cfg.optim.momentum,
                              nesterov=cfg.optim.nesterov, foreach=False)
    assert opt.defaults[impl] is True
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**16) for _ in range(2))
    x = torch.randn(8, 6)
    before = [p.detach().clone() for p in model.parameters()]
    for step, factor in enumerate([1e36, 1.0, 0.5]):  # the first step overflows (inf gradients)
        for m, o, s in ((model, opt, scaler), (ref, ref_opt, ref_scaler)):
            o.zero_grad(set_to_none=True)
            s.scale(m(x).sum() * factor).backward()
            s.step(o)
            s.update()
        if step == 0:
            assert scaler.get_scale() == 2.0**15
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "the skipped step moved weights"
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.isfinite(p).all()
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_a_non_finite_loss_at_the_last_step_of_a_short_epoch_stops_the_run(run_dir):
    # 3 steps < perf.log_every: the only loss read back is the last step's. On CUDA it is usually still in flight
    # when the loop ends and is read by the final drain, which goes through the same check as the loop's reads.
    cfg = compose([*FAST, "perf.log_every=50", "epochs=1", "data.steps_per_epoch=3", "optim.lr=1e30",
                   "evaluate=false", "save_checkpoints=false"])
    with pytest.raises(FloatingPointError, match="training loss is (nan|inf) at step 3"):
        Trainer(cfg, run_dir).fit()


def test_fused_sgd_resumed_from_a_state_without_momentum_gets_zero_buffers():
    """A checkpoint saved before any real step (or by foreach) has no momentum buffers; loading it must not bring
    back the uninitialised-buffer case that the overflow test above covers."""
    from torch import nn

    from mobilenet.engine import build_optimizer

    cfg = compose(["optim.impl=fused"])
    model = nn.Linear(3, 2)
    empty = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True).state_dict()
    opt = build_optimizer(cfg, model, 256)
    empty["param_groups"] = opt.state_dict()["param_groups"]
    opt.load_state_dict(empty)
    bufs = [opt.state[p].get("momentum_buffer") for p in model.parameters()]
    assert all(b is not None and torch.equal(b, torch.zeros_like(b)) for b in bufs)
