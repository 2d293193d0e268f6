"""scripts/check_loader.py on the CPU: real train.py runs fed by data=folder (the bundled digits images) and by
synthetic data with the same classes and steps, their img/s read back from TensorBoard into a table whose share
agrees with the event files; setups that cannot be compared stop before any run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_loader.py"


def check_loader(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def tiny(digits_root: Path) -> list[str]:
    return ["--device", "cpu", "--epochs", "1", "--warmup", "2", "data=folder", f"data.root={digits_root}",
            "data.resolution=32", "data.batch_size=16", "data.steps_per_epoch=6"]


def scalars(log_root: Path) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, = {p.parent for p in log_root.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def compared(digits_root, tmp_path_factory):
    work = tmp_path_factory.mktemp("check_loader") / "work"
    # --target 0: on a 2-core CPU the share means nothing; the verdict line is checked, not its value.
    proc = check_loader(*tiny(digits_root), "--rounds", "2", "--target", "0", "--work-dir", str(work))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return work, proc


def test_the_rounds_alternate_and_the_synthetic_run_differs_only_in_its_data(compared):
    work, proc = compared
    order = re.findall(r"^round (\d)/2: (loader|synthetic)", proc.stdout, re.M)
    assert order == [("1", "loader"), ("1", "synthetic"), ("2", "synthetic"), ("2", "loader")]
    report = (work / "report.md").read_text()
    loader_cmd, synthetic_cmd = re.findall(r"^python train\.py .*$", report, re.M)

    def settings(cmd: str) -> set[str]:
        return {o for o in cmd.split()[2:] if not o.startswith("log_root=")}

    only_loader = settings(loader_cmd) - settings(synthetic_cmd)
    only_synthetic = settings(synthetic_cmd) - settings(loader_cmd)
    assert {o.split("=")[0] for o in only_loader} == {"data", "data.root"}, only_loader
    assert only_synthetic == {"data=synthetic", "data.num_classes=10"}  # the digits' ten class folders
    assert "data.steps_per_epoch=6" in settings(loader_cmd) & settings(synthetic_cmd)


def test_the_table_and_share_are_the_runs_tensorboard_scalars(compared):
    work, _ = compared
    report = (work / "report.md").read_text()
    rows = re.findall(r"^\| (\d) \| data=(folder|synthetic) \| ([\d,.]+) \|.*\| ([\d.]+)(?: \(reference\))? \|$",
                      report, re.M)
    assert len(rows) == 4, report
    for r, data, img_s, share in rows:
        logged = scalars(work / f"round{r}-{'loader' if data == 'folder' else 'synthetic'}")
        assert float(img_s.replace(",", "")) == pytest.approx(logged["perf/train_img_s"], rel=5e-3, abs=0.05)
        if data == "folder":
            made = scalars(work / f"round{r}-synthetic")["perf/train_img_s"]
            assert float(share) == pytest.approx(logged["perf/train_img_s"] / made, abs=1e-3)
    fed = sorted(scalars(work / f"round{r}-loader")["perf/train_img_s"] for r in (1, 2))
    made = sorted(scalars(work / f"round{r}-synthetic")["perf/train_img_s"] for r in (1, 2))
    verdict = re.search(r"Loader share ([\d.]+) = .* \(medians\); target >= 0\.00: PASS", report)
    assert verdict and float(verdict[1]) == pytest.approx((sum(fed) / 2) / (sum(made) / 2), abs=1e-3)
    # the loader runs sampled the machine's load (perf.sample_load=auto for a decoding loader); synthetic ones not
    assert "sys/cpu_busy_pct" in scalars(work / "round1-loader")
    assert "sys/cpu_busy_pct" not in scalars(work / "round1-synthetic")
    # the busiest thread's share of a core is a column of the loader's rows, empty in the synthetic ones
    head = next(line for line in report.splitlines() if line.startswith("| round |"))
    column = [c.strip() for c in head.split("|")].index("busiest thread % of a core")
    for r, data in ((1, "folder"), (1, "synthetic")):
        row = next(line for line in report.splitlines() if line.startswith(f"| {r} | data={data} |"))
        cell = [c.strip() for c in row.split("|")][column]
        if data == "folder":
            busiest = scalars(work / "round1-loader")["sys/busiest_thread_pct"]
            assert 0 < busiest <= 105 and float(cell.replace(",", "")) == pytest.approx(busiest, abs=0.51), row
        else:
            assert cell == "", row


def test_a_share_below_the_target_exits_1(digits_root, tmp_path):
    proc = check_loader(*tiny(digits_root), "--target", "1000", "--work-dir", str(tmp_path / "work"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert re.search(r"target >= 1000\.00: FAIL", (tmp_path / "work" / "report.md").read_text())


@pytest.mark.parametrize("overrides, message", [
    (["data=synthetic"], "data=synthetic is no loader to check; give data=dali or data=folder"),
    (["data=folder", "data.root=/nonexistent-images"], "data.root '/nonexistent-images' does not exist"),
    (["data=folder", "data.resolution=abc"], "data.resolution"),
])
def test_what_cannot_be_compared_stops_before_any_run(overrides, message, tmp_path):
    proc = check_loader("--device", "cpu", *overrides, "--work-dir", str(tmp_path / "work"))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "work").exists()


def test_too_few_steps_to_time_are_refused(digits_root, tmp_path):
    proc = check_loader(*tiny(digits_root), "--warmup", "6", "--work-dir", str(tmp_path / "work"))
    assert proc.returncode == 2 and "the loader's epoch has 6 steps, no more than --warmup 6" in proc.stderr


def test_variants_share_the_synthetic_runs_in_rotating_order(digits_root, tmp_path):
    """--variant twice: every round runs both loader settings and one synthetic run, the order rotating from round to
    round; each variant's share is its median over the synthetic runs' median, from the event files."""
    work = tmp_path / "work"
    proc = check_loader(*tiny(digits_root), "--rounds", "2", "--target", "0", "--work-dir", str(work),
                        "--variant", "data.workers=0", "--variant", "data.workers=1 data.check_files=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    order = re.findall(r"^round (\d)/2: (loader1|loader2|synthetic)", proc.stdout, re.M)
    assert order == [("1", "loader1"), ("1", "loader2"), ("1", "synthetic"),
                     ("2", "loader2"), ("2", "synthetic"), ("2", "loader1")]
    report = (work / "report.md").read_text()
    commands = re.findall(r"^python train\.py .*$", report, re.M)
    assert len(commands) == 3
    assert "data.workers=0" in commands[0] and "data.workers=1" in commands[1] and "data.check_files=false" in commands[1]
    assert "data=synthetic" in commands[2] and "data.workers" not in commands[2]
    made = sorted(scalars(work / f"round{r}-synthetic")["perf/train_img_s"] for r in (1, 2))
    for k, variant in ((1, "data.workers=0"), (2, "data.workers=1 data.check_files=false")):
        fed = sorted(scalars(work / f"round{r}-loader{k}")["perf/train_img_s"] for r in (1, 2))
        verdict = re.search(rf"^data=folder `{re.escape(variant)}`: loader share ([\d.]+) = .* \(medians\); "
                            r"target >= 0\.00: PASS$", report, re.M)
        assert verdict and float(verdict[1]) == pytest.approx(sum(fed) / sum(made), abs=1e-3), report
        assert len(re.findall(rf"^\| \d \| data=folder `{re.escape(variant)}` \|", report, re.M)) == 2


@pytest.mark.parametrize("variants, message", [
    (["data.workers=0", "backend=custom"], "--variant 'backend=custom' sets backend=custom: a variant sets loader "
                                           "keys only"),
    (["data.workers=0", "data.workers=1 amp=false"], "sets amp=false: a variant sets loader keys only"),
])
def test_a_variant_that_changes_more_than_the_loader_is_refused(variants, message, digits_root, tmp_path):
    flags = [a for v in variants for a in ("--variant", v)]
    proc = check_loader(*tiny(digits_root), *flags, "--work-dir", str(tmp_path / "work"))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "work").exists()


def test_a_single_variant_is_refused(digits_root, tmp_path):
    proc = check_loader(*tiny(digits_root), "--variant", "data.workers=0", "--work-dir", str(tmp_path / "work"))
    assert proc.returncode == 2 and "give it at least twice" in proc.stderr, proc.stderr


def test_each_variant_is_labelled_by_its_own_loader(digits_root):
    """A variant may change data= itself: each loader run keeps its own name, and the synthetic reference drops it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_loader as script
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    runs = script.plan(script.parse_args([*tiny(digits_root), "--variant", "data=folder",
                                          "--variant", "data=dali data.dali.decode=cpu"]))
    assert runs.names == ["folder", "dali"]
    assert "data=dali" in runs.loaders[1] and "data=folder" in runs.loaders[0]
    assert not any(o.startswith(("data=folder", "data=dali", "data.dali.")) for o in runs.synthetic)
