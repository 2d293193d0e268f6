"""What a newcomer meets on a CPU: user errors as one `error:` line (no traceback unless asked for), run directories
that say where they are, resume=RUN_DIR, up-front checks (+key, steps that could never be timed), CPU-sized
loaders, num_classes from the folder, and compare.py over a real train.py grid."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mobilenet.config import compose
from mobilenet.errors import EXIT_USER_ERROR, ConfigError, UserError, report_user_errors

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.width_mult=0.25", "device=cpu", "progress=false", "perf.warmup_steps=1", "data.steps_per_epoch=2",
        "data.val_steps=1", "epochs=1"]
TINY_SYNTHETIC = ["data=synthetic", "data.resolution=32", "data.batch_size=4", *TINY]


def train(*overrides: str, log_root: Path, debug: bool = False) -> subprocess.CompletedProcess:
    args = [sys.executable, "train.py", *(["--debug"] if debug else []), *overrides, f"log_root={log_root}"]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def run_dirs(log_root: Path) -> list[Path]:
    return sorted(p.parent for p in log_root.rglob(".hydra"))


@pytest.fixture
def corrupt_root(tmp_path, digits_root) -> Path:
    """Two images per class and split, one of them truncated."""
    root = tmp_path / "ds"
    for split in ("train", "val"):
        for cls in sorted((digits_root / split).iterdir()):
            (root / split / cls.name).mkdir(parents=True)
            for f in sorted(cls.iterdir())[:2]:
                shutil.copy(f, root / split / cls.name / f.name)
    victim = sorted((root / "train" / "4").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:40])
    return root


@pytest.mark.parametrize("overrides, message", [
    (["backend=cudnn"], "error: backend=cudnn needs a CUDA GPU"),
    (["data=folder", "data.root=/no/such/dir"], "error: data.root '/no/such/dir' does not exist"),
    (["resume=/no/such/run"], "error: resume='/no/such/run': no such checkpoint file or run directory"),
    (["+epoch=3"], "error: +epoch: the config has no key 'epoch', so nothing would read it; did you mean epochs=3?"),
    (["data.steps_per_epoch=2", "perf.warmup_steps=10"], "error: only 2 training step(s) would run, all of them warm-up "
                                                         "(perf.warmup_steps=10)"),
], ids=["backend", "data-root", "checkpoint", "plus-key", "no-timed-step"])
def test_a_user_error_is_one_line_and_leaves_no_run_directory(tmp_path, overrides, message):
    proc = train(*TINY_SYNTHETIC, *overrides, log_root=tmp_path)
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr
    assert proc.stderr.strip().startswith(message), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert run_dirs(tmp_path) == []


@pytest.mark.parametrize("override, message", [
    ("epoch=3", "error: the config has no key 'epoch'; did you mean epochs?"),
    ("data.batchsize=3", "error: the config has no key 'data.batchsize'; did you mean data.batch_size?"),
    ("amp=perhaps", "error: amp=perhaps: Value 'perhaps' is not a valid bool"),
    ("data=_schema_data", "error: no config 'data/_schema_data'; choose one of: dali, digits, folder, synthetic"),
    ("optim.lr=-1", "error: optim.lr=-1.0: must be a number >= 0"),  # was torch.optim's ValueError and a traceback
])
def test_a_bad_override_is_one_line_before_hydra_starts(tmp_path, override, message):
    proc = train(override, log_root=tmp_path)
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr
    assert proc.stderr.strip().startswith(message) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "+epoch" not in proc.stderr and not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize("script, message", [
    (["compare_loss_curves.py", "--norms", "custom,nonexistent", "--steps", "2"],
     "error: no config 'norm/nonexistent'; choose one of: apex, custom, torch"),
    (["compare_loss_curves.py", "--steps", "2", "optim.lr=-1"], "error: optim.lr=-1.0: must be a number >= 0"),
    (["bench_loader.py", "--root", "/no/such/dir", "--loaders", "folder"], "error: data.root '/no/such/dir' does not exist"),
    (["benchmark.py", "--data", "synthetic", "optim.lr=-1"], "benchmark.py: error: optim.lr=-1.0: must be a number >= 0"),
], ids=["loss-curves-choice", "loss-curves-value", "bench-loader-root", "benchmark-shared-override"])
def test_a_scripts_user_error_is_one_line(script, message):
    proc = subprocess.run([sys.executable, f"scripts/{script[0]}", *script[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr


def test_a_corrupt_image_is_named_up_front(tmp_path, corrupt_root):
    proc = train(*TINY, "data=folder", f"data.root={corrupt_root}", "data.batch_size=4", log_root=tmp_path / "runs")
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr
    assert proc.stderr.startswith("error: cannot decode image") and "train/4/" in proc.stderr
    assert "Traceback" not in proc.stderr and "data.skip_corrupt=true" in proc.stderr


def test_debug_shows_the_traceback(tmp_path):
    proc = train(*TINY_SYNTHETIC, "backend=cudnn", log_root=tmp_path, debug=True)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "BackendUnavailable: backend=cudnn needs a CUDA GPU" in proc.stderr


def test_programming_errors_keep_their_traceback_and_user_errors_exit_2(capsys):
    with pytest.raises(KeyError):
        with report_user_errors():
            raise KeyError("a bug")
    with pytest.raises(SystemExit) as stop:
        with report_user_errors():
            raise ConfigError("data.batch_size must be >= 1")
    assert stop.value.code == EXIT_USER_ERROR
    assert capsys.readouterr().err == "error: data.batch_size must be >= 1\n"


def test_a_schema_name_is_neither_offered_nor_accepted_as_a_choice():
    with pytest.raises(ConfigError) as err:
        compose(["data=_schema_data"])
    message, choices = str(err.value).split("; choose one of: ")
    assert message == "no config 'data/_schema_data'"
    assert choices.split(", ") == sorted(p.stem for p in (ROOT / "conf" / "data").glob("*.yaml"))
    with pytest.raises(ConfigError, match="no config 'backend/base_backend'"):
        compose(["backend=base_backend"])


def test_plus_key_for_a_nested_typo_suggests_the_key():
    with pytest.raises(ConfigError, match=r"did you mean data\.batch_size=8\?"):
        compose(["+data.batchsize=8"])


def test_the_run_directory_is_printed_has_no_quoting_and_resumes_by_name(tmp_path, digits_root):
    first = train(*TINY, "data.batch_size=16", log_root=tmp_path, )
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    assert first.stdout.count(f"run directory: {run_dir}") == 2
    assert not set("=,") & set(str(run_dir.relative_to(tmp_path)))
    resumed = train(*TINY, "data.batch_size=16", "epochs=2", f"resume={run_dir}", log_root=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run_dir} at epoch 1, step 2" in resumed.stdout + resumed.stderr


def test_resume_into_another_model_names_the_key(tmp_path):
    from mobilenet.engine import CheckpointError, Trainer

    common = [*TINY_SYNTHETIC, "data.num_classes=10"]
    Trainer(compose(common), tmp_path / "a").fit()
    with pytest.raises(CheckpointError, match=r"trained with model\.width_mult=0\.25, this run has model\.width_mult=0\.5"):
        Trainer(compose([*common, "model.width_mult=0.5", f"resume={tmp_path / 'a'}"]), tmp_path / "b")
    with pytest.raises(CheckpointError, match="the checkpoint has 10 classes, this run's data has 20"):
        Trainer(compose([*common, "data.num_classes=20", f"resume={tmp_path / 'a'}"]), tmp_path / "c")
    with pytest.raises(CheckpointError, match="is a directory without checkpoints/last.pt"):
        Trainer(compose([*common, f"resume={tmp_path}"]), tmp_path / "d")


def test_steps_that_could_never_be_timed_are_refused_up_front(tmp_path):
    from mobilenet.engine import Trainer

    with pytest.raises(ConfigError, match=r"perf\.warmup_steps=2\b.*throughput would be nan"):
        Trainer(compose([*TINY_SYNTHETIC, "perf.warmup_steps=2"]), tmp_path)
    # Two epochs: the second is timed in full, so the same steps per epoch are fine.
    result = Trainer(compose([*TINY_SYNTHETIC, "perf.warmup_steps=2", "epochs=2", "evaluate=false"]), tmp_path).fit()
    assert result.train.steps == 2 and result.train.img_s > 0


def test_folder_counts_its_classes_unless_told(digits_root):
    from mobilenet.data import LoaderSpec, build_loaders

    spec = LoaderSpec(torch.device("cpu"), torch.float32, False)
    cfg = compose(["data=folder", f"data.root={digits_root}", "data.resolution=32", "data.workers=0"])
    assert cfg.data.num_classes is None
    train_loader, _ = build_loaders(cfg.data, spec)
    assert train_loader.num_classes == 10
    with pytest.raises(UserError, match="has 10 classes but data.num_classes=7"):
        build_loaders(compose(["data=folder", f"data.root={digits_root}", "data.num_classes=7"]).data, spec)
    with pytest.raises(ConfigError, match="data=synthetic needs data.num_classes=N"):
        build_loaders(compose(["data=synthetic", "data.num_classes=null"]).data, spec)


def test_loader_workers_are_capped_at_the_cpus(digits_root):
    from mobilenet.data import LoaderSpec, build_loaders
    from mobilenet.data.folder import available_cpus

    cfg = compose(["data.workers=512", "data.batch_size=16"])
    train_loader, _ = build_loaders(cfg.data, LoaderSpec(torch.device("cpu"), torch.float32, False))
    assert train_loader.loader.num_workers == available_cpus() < 512


def test_bf16_on_a_cpu_warns_once(tmp_path, caplog):
    from mobilenet import engine

    engine._WARNED.discard("bf16_cpu")
    cfg = compose([*TINY_SYNTHETIC, "amp=true", "amp_dtype=bf16"])
    with caplog.at_level(logging.WARNING, logger="mobilenet.engine"):
        engine.validate(cfg, torch.device("cpu"))
        engine.validate(cfg, torch.device("cpu"))
    warnings = [r.message for r in caplog.records if "bf16 on a CPU" in r.message]
    assert len(warnings) == 1 and "slower than fp32" in warnings[0]


def test_amp_dtype_without_amp_warns_that_the_run_is_fp32(caplog):
    from mobilenet import engine

    engine._WARNED.discard("amp_dtype_without_amp")
    with caplog.at_level(logging.WARNING, logger="mobilenet.engine"):
        engine.validate(compose([*TINY_SYNTHETIC, "amp=false", "amp_dtype=fp16"]), torch.device("cpu"))
        assert not [r for r in caplog.records if "amp_dtype" in r.message]
        engine.validate(compose([*TINY_SYNTHETIC, "amp=false", "amp_dtype=bf16"]), torch.device("cpu"))
    (warning,) = [r.message for r in caplog.records if "amp_dtype" in r.message]
    assert warning.startswith("amp_dtype=bf16 takes effect with amp=true; this run has amp=false and computes in fp32")


def test_compare_reads_a_train_py_grid(tmp_path):
    # A grid over a table column (channels_last) and over a setting the table has no column for (optim): four rows,
    # none of them taken for a repeat of another.
    grid = subprocess.run([sys.executable, "train.py", "-m", *TINY_SYNTHETIC, "data.steps_per_epoch=3",
                           "channels_last=false,true", "optim=sgd,rmsprop", f"log_root={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert grid.returncode == 0, grid.stderr[-3000:]
    (sweep,) = tmp_path.glob("multirun-*")
    proc = subprocess.run([sys.executable, "scripts/compare.py", str(sweep)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "4 run(s) have no perf/infer_img_s" in proc.stdout and "train.py runs measure" in proc.stdout
    assert "measured more than once" not in proc.stdout
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines()
            if line.startswith("| torch | torch | fp32 |")]  # norm as the runs logged it
    assert sorted((r[3], r[7]) for r in rows) == [("NCHW", "optim=rmsprop"), ("NCHW", "optim=sgd"),
                                                  ("channels_last", "optim=rmsprop"), ("channels_last", "optim=sgd")]
    for cells in rows:
        assert float(cells[8].replace(",", "")) > 0 and cells[10] == "" and cells[11] == ""  # train img/s; infer blank
        if cells[3] == "NCHW":
            assert cells[9] == "1.00x"  # each optim's own fp32 NCHW baseline


def test_compare_loss_curves_varies_any_setting(tmp_path):
    """--setting NAME=A,B: the two runs differ in that setting alone (here one that leaves a CPU run's arithmetic as
    it is, so the curves match); the report names it, and a setting also given as an override is refused."""
    out = tmp_path / "curves.md"
    script = [sys.executable, "scripts/compare_loss_curves.py"]
    proc = subprocess.run([*script, "--setting", "cuda_graph=false,auto", "--steps", "3", "--out", str(out),
                           *TINY_SYNTHETIC], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = out.read_text()
    assert "# Loss curves: cuda_graph=false vs cuda_graph=auto, same seed, 3 steps" in report
    assert "Match within noise: yes" in report
    refused = subprocess.run([*script, "--setting", "cuda_graph=false,auto", "cuda_graph=true"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "cuda_graph is what --setting varies" in refused.stderr
    malformed = subprocess.run([*script, "--setting", "cuda_graph"], cwd=ROOT, capture_output=True, text=True,
                               timeout=120)
    assert malformed.returncode == 2 and "--setting takes NAME=CANDIDATE,REFERENCE" in malformed.stderr


def test_a_setting_the_run_does_not_read_is_named_in_a_warning(caplog, tmp_path):
    from mobilenet import engine
    from mobilenet.config import unused_settings

    given = ["optim.alpha=0.5", "data.dali.pipelines=2", "fold_bn=false"]
    assert unused_settings(compose([*TINY_SYNTHETIC, *given]), "train") == [
        "optim.alpha=0.5 has no effect: only optim=rmsprop reads it",
        "data.dali.pipelines=2 has no effect: only data=dali reads it",
        "fold_bn=false has no effect: only infer.py reads it"]
    # The same settings where they are read, and the defaults, are not named.
    assert unused_settings(compose([*TINY_SYNTHETIC, "optim=rmsprop", "optim.alpha=0.5", "fold_bn=false"]),
                           "infer") == []
    assert unused_settings(compose(TINY_SYNTHETIC), "train") == []
    assert unused_settings(compose([*TINY_SYNTHETIC, "optim=rmsprop", "optim.nesterov=false"]), "train") == [
        "optim.nesterov=false has no effect: only optim=sgd reads it"]
    # A training run logs them.
    with caplog.at_level(logging.WARNING, logger="mobilenet.engine"):
        engine.Trainer(compose([*TINY_SYNTHETIC, "optim.eps=0.01"]), tmp_path)
    assert "optim.eps=0.01 has no effect: only optim=rmsprop reads it" in [r.message for r in caplog.records]
