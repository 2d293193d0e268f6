"""The throughput matrix on the CPU: scripts/benchmark.py really runs a tiny matrix, scripts/compare.py turns its
event files into a table, a CSV and a PNG whose numbers are the logged scalars, and bad input is named."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from scripts_under_test import load_script

ROOT = Path(__file__).resolve().parent.parent
BENCHMARK = ROOT / "scripts" / "benchmark.py"
COMPARE = ROOT / "scripts" / "compare.py"


benchmark = load_script("benchmark")

TINY = ["--batch-size", "8", "--resolution", "32", "--width-mult", "0.25", "--warmup", "2", "--steps", "3",
        "--infer-warmup", "2", "--infer-steps", "3", "--compile", "false", "--data", "synthetic"]
MEASURED = [(amp, cl) for amp in ("off", "bf16") for cl in (False, True)]


def _run(script: Path, *args: str, check: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script.name} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _run_dir(root: Path, backend: str, amp: str, channels_last: bool) -> Path:
    return root / benchmark.Combo(backend, amp, channels_last, False, "synthetic").name


def read_scalars(run_dir: Path) -> dict[str, float]:
    """The last value of every scalar in a run's event files, read record by record (independent of compare.py)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    last: dict[str, tuple[int, float]] = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        for record in RawEventFileLoader(str(path)).Load():
            event = Event.FromString(record)
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value" and event.step >= last.get(value.tag, (-1, 0))[0]:
                    last[value.tag] = (event.step, value.simple_value)
    return {tag: v for tag, (_, v) in last.items()}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Path:
    """torch x {fp32, bf16} x {NCHW, channels_last} measured; cudnn (no CUDA) and the timm peer asked for as well."""
    out = tmp_path_factory.mktemp("matrix")
    _run(BENCHMARK, *TINY, "--backends", "torch,cudnn", "--amp", "off,bf16", "--channels-last", "false,true",
         "--out", str(out), check=True)
    return out


@pytest.fixture(scope="module")
def compared(matrix, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    proc = _run(COMPARE, str(matrix), "--out", str(out), "--name", "matrix_cpu", check=True)
    return out, proc


def test_matrix_runs_every_combination_in_its_own_run_dir(matrix):
    for amp, cl in MEASURED:
        run_dir = _run_dir(matrix, "torch", amp, cl)
        record = json.loads((run_dir / "benchmark.json").read_text())
        assert record["status"] == "ok", record
        scalars = read_scalars(run_dir)
        for tag in ("perf/train_img_s", "perf/compute_img_s", "perf/step_ms", "perf/infer_img_s", "hparam/infer_img_s"):
            assert scalars[tag] > 0, (run_dir.name, tag, scalars)
        assert scalars["perf/train_img_s"] == pytest.approx(record["train_img_s"], rel=1e-6)


def test_unavailable_combinations_are_skipped_with_their_reason(matrix):
    for amp, cl in MEASURED:
        cudnn = json.loads((_run_dir(matrix, "cudnn", amp, cl) / "benchmark.json").read_text())
        assert cudnn["status"] == "skipped" and "needs a CUDA GPU" in cudnn["reason"]
        assert not list(_run_dir(matrix, "cudnn", amp, cl).glob("events.out.tfevents.*"))
        peer = json.loads((_run_dir(matrix, "timm", amp, cl) / "benchmark.json").read_text())
        if peer["status"] != "ok":  # timm is an optional extra: without it the row says how to get it
            assert peer["status"] == "skipped" and peer["reason"] == benchmark.TIMM_MISSING


def test_compare_table_csv_and_png_carry_the_logged_scalars(matrix, compared):
    out, proc = compared
    table = (out / "matrix_cpu.md").read_text()
    assert table.strip() in proc.stdout  # printed as well
    rows = {r["run"]: r for r in csv.DictReader(open(out / "matrix_cpu.csv"))}
    baseline = read_scalars(_run_dir(matrix, "torch", "off", False))
    for amp, cl in MEASURED:
        run_dir = _run_dir(matrix, "torch", amp, cl)
        scalars = read_scalars(run_dir)
        row = rows[run_dir.name]
        assert row["status"] == "ok"
        assert (row["backend"], row["precision"], row["layout"]) == ("torch", {"off": "fp32"}.get(amp, amp),
                                                                     "channels_last" if cl else "NCHW")
        assert (row["batch_size"], row["resolution"], row["cuda_graph"]) == ("8", "32", "False")  # eager on a CPU
        for column, tag in (("train_img_s", "perf/train_img_s"), ("infer_img_s", "perf/infer_img_s"),
                            ("compute_img_s", "perf/compute_img_s"), ("step_ms", "perf/step_ms")):
            assert float(row[column]) == pytest.approx(scalars[tag], rel=1e-6), (run_dir.name, column)
        speedup = scalars["perf/train_img_s"] / baseline["perf/train_img_s"]
        assert float(row["train_speedup"]) == pytest.approx(speedup, rel=1e-6)
        line = next(line for line in table.splitlines()
                    if line.startswith(f"| torch | {row['precision']} | {row['layout']} | False | off | synthetic |"))
        assert f"| {scalars['perf/train_img_s']:,.0f} | {speedup:.2f}x | {scalars['perf/infer_img_s']:,.0f} |" in line
    # Sorted by training img/s, fastest first.
    measured = [float(r["train_img_s"]) for r in rows.values() if r["status"] == "ok" and r["backend"] == "torch"]
    order = [float(line.split("|")[7].replace(",", "")) for line in table.splitlines() if line.startswith("| torch |")]
    assert order == sorted(order, reverse=True) and len(order) == len(measured) == 4
    # The skip reasons are in the table and the CSV.
    assert "needs a CUDA GPU" in table and "## Not measured" in table
    cudnn_rows = [r for r in rows.values() if r["backend"] == "cudnn"]
    assert len(cudnn_rows) == 4 and all(r["status"] == "skipped" and "CUDA" in r["reason"] for r in cudnn_rows)
    if any(r["backend"] == "timm" and r["status"] == "skipped" for r in rows.values()):
        assert benchmark.TIMM_MISSING in table
    import matplotlib.image

    image = matplotlib.image.imread(out / "matrix_cpu.png")
    assert image.shape[0] > 200 and image.shape[1] > 400


def test_a_crashing_combination_is_a_failed_row_with_its_last_error_line(tmp_path):
    out = tmp_path / "m"
    args = [a if a != "0.25" else "5" for a in TINY]  # width_mult 5 passes the up-front checks, then the model refuses it
    proc = _run(BENCHMARK, *args, "--backends", "torch", "--amp", "off", "--channels-last", "false", "--peer", "no",
                "--out", str(out))
    assert proc.returncode == 1
    record = json.loads((_run_dir(out, "torch", "off", False) / "benchmark.json").read_text())
    assert record["status"] == "failed"
    assert record["reason"].startswith("exit 1: mobilenet.errors.ConfigError: model.width_mult must be in (0, 4]"), record["reason"]
    assert "failed" in proc.stdout
    # compare.py lists it with that reason; with nothing measured there is nothing to compare.
    report = _run(COMPARE, str(out))
    assert report.returncode == 2 and "model.width_mult must be in" in report.stderr


def test_finished_runs_are_kept_when_the_matrix_is_run_again(matrix, tmp_path):
    copy = tmp_path / "again"
    shutil.copytree(matrix, copy)
    before = {p: p.stat().st_mtime_ns for p in copy.rglob("events.out.tfevents.*")}
    proc = _run(BENCHMARK, *TINY, "--backends", "torch", "--amp", "off,bf16", "--channels-last", "false,true",
                "--peer", "no", "--out", str(copy), check=True)
    assert proc.stdout.count("(kept from an earlier invocation)") == 4
    assert {p: p.stat().st_mtime_ns for p in copy.rglob("events.out.tfevents.*")} == before


def _fake_run(run_dir: Path, batch_size: int, scalars: dict[str, float], backend: str = "torch") -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(run_dir))
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, 5)
    writer.add_hparams({"backend": backend, "amp": False, "amp_dtype": "fp16", "channels_last": False, "compile": True,
                        "data": "synthetic", "batch_size": batch_size, "resolution": 32, "gpu": "none"},
                       {"hparam/train_img_s": scalars.get("perf/train_img_s", 0.0)}, run_name=".")
    writer.close()


def test_mixed_batch_sizes_are_flagged(matrix, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(matrix, runs)
    _fake_run(runs / "other-batch", 16, {"perf/train_img_s": 100.0, "perf/infer_img_s": 300.0})
    proc = _run(COMPARE, str(runs))
    assert proc.returncode == 1
    assert "WARNING: mixed batch_size in one comparison (16, 8)" in proc.stdout
    assert "--allow-mixed" in proc.stderr
    assert _run(COMPARE, str(runs), "--allow-mixed").returncode == 0


def test_missing_scalars_and_hparams_are_named(tmp_path):
    _fake_run(tmp_path / "runs" / "no-train", 8, {"perf/infer_img_s": 100.0})
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(tmp_path / "runs" / "no-hparams")) as w:
        w.add_scalar("perf/train_img_s", 1.0, 1)
    proc = _run(COMPARE, str(tmp_path / "runs"))
    assert proc.returncode == 2
    assert "run 'no-train': missing scalar 'perf/train_img_s'" in proc.stderr
    assert "run 'no-hparams': no hparams" in proc.stderr


def test_a_run_without_inference_img_s_has_blank_inference_columns_and_a_note(tmp_path):
    _fake_run(tmp_path / "runs" / "no-infer", 8, {"perf/train_img_s": 100.0})
    proc = _run(COMPARE, str(tmp_path / "runs"), check=True)
    assert "1 run(s) have no perf/infer_img_s (no-infer): train.py runs measure" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| torch |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[6] == "100" and cells[8] == "" and cells[9] == ""  # train img/s; infer img/s and speed-up blank


@pytest.mark.parametrize("content", ["empty", "foreign", "absent"])
def test_an_empty_or_foreign_directory_says_so(tmp_path, content):
    runs = tmp_path / "runs"
    if content != "absent":
        runs.mkdir()
    if content == "foreign":
        (runs / "notes.txt").write_text("not a run")
        (runs / "sub").mkdir()
    proc = _run(COMPARE, str(runs))
    assert proc.returncode == 2
    expected = "no such directory" if content == "absent" else "no TensorBoard event files"
    assert expected in proc.stderr and str(runs) in proc.stderr


def test_axes_are_selected_with_overrides():
    full = benchmark.plan(benchmark.parse_args([]))
    assert len(full) == 3 * 3 * 2 * 2 * 2 + 3 * 2 * 2  # the grid plus the timm peer on synthetic data
    some = benchmark.plan(benchmark.parse_args(["--backends", "torch,cudnn", "--amp", "off,fp16", "--data", "synthetic",
                                                "--compile", "false", "--peer", "no"]))
    assert {(c.backend, c.amp) for c in some} == {("torch", "off"), ("torch", "fp16"), ("cudnn", "off"), ("cudnn", "fp16")}
    assert len(some) == 8 and not any(c.compile for c in some)
    peers = benchmark.plan(benchmark.parse_args(["--peer", "only", "--data", "synthetic,dali"]))
    assert {c.backend for c in peers} == {"timm"} and {c.data for c in peers} == {"synthetic"}
    hydra_style = benchmark.parse_args(["--", "backend=torch,cudnn", "amp=off,fp16", "data=synthetic", "compile=false",
                                        "data.num_classes=10"])
    assert benchmark.plan(hydra_style) == benchmark.plan(benchmark.parse_args(
        ["--backends", "torch,cudnn", "--amp", "off,fp16", "--data", "synthetic", "--compile", "false"]))
    assert hydra_style.overrides == ["data.num_classes=10"]  # the rest goes to every run
    assert not any(c.cuda_graph for c in full)  # the captured step is an opt-in axis
    graphs = benchmark.plan(benchmark.parse_args(["--backends", "custom", "--amp", "fp16", "--channels-last", "true",
                                                  "--data", "synthetic", "--peer", "no", "--", "cuda_graph=false,true"]))
    assert [(c.compile, c.cuda_graph) for c in graphs] == [(False, False), (False, True), (True, False), (True, True)]
    assert graphs[1].name.endswith(",cuda_graph=true") and "cuda_graph" not in graphs[0].name
    assert "cuda_graph=true" in benchmark.hydra_overrides(graphs[1], benchmark.parse_args([]))
    for bad in (["--amp", "fp8"], ["--", "amp=true"], ["--backends", "cudnn,tensorrt"], ["--cuda-graph", "auto"]):
        with pytest.raises(SystemExit):
            benchmark.parse_args(bad)


def test_captured_combinations_that_cannot_run_here_are_skipped_with_the_reason(tmp_path):
    proc = _run(BENCHMARK, *TINY, "--backends", "torch", "--amp", "off", "--channels-last", "false", "--peer", "no",
                "--compile", "false,true", "--cuda-graph", "true", "--out", str(tmp_path / "m"))
    assert proc.returncode == 0, proc.stderr
    for compiled in (False, True):
        name = f"backend=torch,amp=off,channels_last=false,compile={str(compiled).lower()},data=synthetic,cuda_graph=true"
        record = json.loads((tmp_path / "m" / name / "benchmark.json").read_text())
        assert record["status"] == "skipped" and record["cuda_graph"] is True
        assert "cannot be captured: the run's device is cpu" in record["reason"]
        assert ("compile=true" in record["reason"]) == compiled
    from mobilenet.bench import compare  # its table of what was not measured says these were the captured rows
    listing = compare.markdown(compare.load_rows([tmp_path / "m"]), [])
    for compiled in ("False", "True"):
        assert f"| torch | fp32 | NCHW | {compiled} | on | synthetic | skipped |" in listing, listing


def test_time_budget_leaves_combinations_for_the_next_invocation(tmp_path):
    proc = _run(BENCHMARK, *TINY, "--backends", "torch", "--amp", "off", "--channels-last", "false", "--peer", "no",
                "--out", str(tmp_path / "m"), "--time-budget", "5")
    assert proc.returncode == 1
    assert "not started: --time-budget spent" in proc.stdout and "run the same command again" in proc.stdout
    record = json.loads((_run_dir(tmp_path / "m", "torch", "off", False) / "benchmark.json").read_text())
    assert record["status"] == "not started" and "--time-budget" in record["reason"]
    # compare.py lists it as not measured, with the reason, instead of dropping it
    cmp = _run(COMPARE, str(tmp_path / "m"), "--out", str(tmp_path / "cmp"))
    table = (tmp_path / "cmp" / "matrix.md").read_text() if (tmp_path / "cmp" / "matrix.md").exists() else cmp.stdout + cmp.stderr
    assert "not started" in table and "--time-budget spent" in table, table


def test_last_error_line_of_a_traceback():
    log = "step 1\nTraceback (most recent call last):\n  File \"x.py\", line 1\n    boom()\nRuntimeError: CUDA out of memory\n"
    assert benchmark.last_error_line(log) == "RuntimeError: CUDA out of memory"
    assert benchmark.last_error_line("Killed\n") == "Killed"
    assert benchmark.last_error_line("") == "no output"


def test_repeats_run_in_rounds_and_compare_reports_their_median_and_spread(tmp_path):
    out = tmp_path / "repeats"
    proc = _run(BENCHMARK, *TINY, "--backends", "torch", "--amp", "off", "--channels-last", "false,true", "--peer", "no",
                "--repeats", "2", "--out", str(out), check=True)
    names = [_run_dir(out, "torch", "off", cl).name for cl in (False, True)]
    order = [line.split("] ")[1].split(":")[0] for line in proc.stdout.splitlines() if line.startswith("[")]
    assert order == names + [f"{n},repeat=2" for n in names]  # rounds: every combination once, then again
    report = tmp_path / "report"
    shown = _run(COMPARE, str(out), "--out", str(report), "--name", "m", check=True)
    assert "2 combination(s) measured more than once (4 runs)" in shown.stdout
    rows = {r["run"]: r for r in csv.DictReader(open(report / "m.csv"))}
    assert len(rows) == 2 and set(rows) == set(names)
    table = (report / "m.md").read_text()
    for name in names:
        runs = [read_scalars(out / name), read_scalars(out / f"{name},repeat=2")]
        row = rows[name]
        assert row["runs"] == "2"
        for column, tag in (("train_img_s", "perf/train_img_s"), ("infer_img_s", "perf/infer_img_s")):
            values = [r[tag] for r in runs]
            assert float(row[column]) == pytest.approx(sum(values) / 2, rel=1e-6)  # the median of two
            assert float(row[f"{column}_min"]) == pytest.approx(min(values), rel=1e-6)
            assert float(row[f"{column}_max"]) == pytest.approx(max(values), rel=1e-6)
        span = f"{min(r['perf/train_img_s'] for r in runs):,.0f}-{max(r['perf/train_img_s'] for r in runs):,.0f}"
        assert span in table
    bad = _run(BENCHMARK, *TINY, "--repeats", "0", "--out", str(tmp_path / "never"))
    assert bad.returncode == 2 and "--repeats must be >= 1, got 0" in bad.stderr


def test_custom_vs_cudnn_says_how_many_pairs_custom_wins_and_names_those_it_trails(tmp_path):
    # Hand-written event files with real TensorBoard records: one pair (fp32 NCHW, compile) in which custom trains
    # faster by 0.5% and infers slower by 1%.
    runs = tmp_path / "runs"
    _fake_run(runs / "cudnn", 8, {"perf/train_img_s": 1000.0, "perf/infer_img_s": 3000.0}, backend="cudnn")
    _fake_run(runs / "custom", 8, {"perf/train_img_s": 1005.0, "perf/infer_img_s": 2970.0}, backend="custom")
    proc = _run(COMPARE, str(runs), check=True)
    assert ("custom >= cudnn: training in 1 of 1 pairs; inference in 0 of 1 pairs. Custom behind: inference fp32 "
            "NCHW, compile=True, CUDA graph unknown, data=synthetic (0.990x).") in proc.stdout
