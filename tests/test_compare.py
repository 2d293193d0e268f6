"""scripts/compare.py on the CPU: the event files of a tiny matrix (tests/conftest.py's `matrix`) and hand-written
ones become a table, a CSV and a PNG whose numbers are the logged scalars, and bad input is named."""

from __future__ import annotations

import csv
import shutil

import pytest
from matrix_runs import COMPARE, MEASURED, combo_dir, fake_run, read_scalars, run_tool

from mobilenet.bench.matrix import TIMM_MISSING


@pytest.fixture(scope="module")
def compared(matrix, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    proc = run_tool(COMPARE, str(matrix), "--out", str(out), "--name", "matrix_cpu", check=True)
    return out, proc


def test_compare_table_csv_and_png_carry_the_logged_scalars(matrix, compared):
    out, proc = compared
    table = (out / "matrix_cpu.md").read_text()
    assert table.strip() in proc.stdout  # printed as well
    rows = {r["run"]: r for r in csv.DictReader(open(out / "matrix_cpu.csv"))}
    baseline = read_scalars(combo_dir(matrix, "torch", "off", False))
    for amp, cl in MEASURED:
        run_dir = combo_dir(matrix, "torch", amp, cl)
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
                    if line.startswith(f"| torch | torch | {row['precision']} | {row['layout']} | False | off | synthetic |"))
        assert f"| {scalars['perf/train_img_s']:,.0f} | {speedup:.2f}x | {scalars['perf/infer_img_s']:,.0f} |" in line
    # Sorted by training img/s, fastest first.
    measured = [float(r["train_img_s"]) for r in rows.values() if r["status"] == "ok" and r["backend"] == "torch"]
    order = [float(line.split("|")[8].replace(",", "")) for line in table.splitlines() if line.startswith("| torch |")]
    assert order == sorted(order, reverse=True) and len(order) == len(measured) == 4
    # The skip reasons are in the table and the CSV.
    assert "needs a CUDA GPU" in table and "## Not measured" in table
    cudnn_rows = [r for r in rows.values() if r["backend"] == "cudnn"]
    assert len(cudnn_rows) == 4 and all(r["status"] == "skipped" and "CUDA" in r["reason"] for r in cudnn_rows)
    if any(r["backend"] == "timm" and r["status"] == "skipped" for r in rows.values()):
        assert TIMM_MISSING in table
    import matplotlib.image

    image = matplotlib.image.imread(out / "matrix_cpu.png")
    assert image.shape[0] > 200 and image.shape[1] > 400


def test_mixed_batch_sizes_are_flagged(matrix, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(matrix, runs)
    fake_run(runs / "other-batch", 16, {"perf/train_img_s": 100.0, "perf/infer_img_s": 300.0})
    proc = run_tool(COMPARE, str(runs))
    assert proc.returncode == 1
    assert "WARNING: mixed batch_size in one comparison (16, 8)" in proc.stdout
    assert "--allow-mixed" in proc.stderr
    assert run_tool(COMPARE, str(runs), "--allow-mixed").returncode == 0


def test_missing_scalars_and_hparams_are_named(tmp_path):
    fake_run(tmp_path / "runs" / "no-train", 8, {"perf/infer_img_s": 100.0})
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(tmp_path / "runs" / "no-hparams")) as w:
        w.add_scalar("perf/train_img_s", 1.0, 1)
    proc = run_tool(COMPARE, str(tmp_path / "runs"))
    assert proc.returncode == 2
    assert "run 'no-train': missing scalar 'perf/train_img_s'" in proc.stderr
    assert "run 'no-hparams': no hparams" in proc.stderr


def test_a_run_without_inference_img_s_has_blank_inference_columns_and_a_note(tmp_path):
    fake_run(tmp_path / "runs" / "no-infer", 8, {"perf/train_img_s": 100.0})
    proc = run_tool(COMPARE, str(tmp_path / "runs"), check=True)
    assert "1 run(s) have no perf/infer_img_s (no-infer): train.py runs measure" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| torch |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[7] == "100" and cells[9] == "" and cells[10] == ""  # train img/s; infer img/s and speed-up blank


@pytest.mark.parametrize("content", ["empty", "foreign", "absent"])
def test_an_empty_or_foreign_directory_says_so(tmp_path, content):
    runs = tmp_path / "runs"
    if content != "absent":
        runs.mkdir()
    if content == "foreign":
        (runs / "notes.txt").write_text("not a run")
        (runs / "sub").mkdir()
    proc = run_tool(COMPARE, str(runs))
    assert proc.returncode == 2
    expected = "no such directory" if content == "absent" else "no TensorBoard event files"
    assert expected in proc.stderr and str(runs) in proc.stderr


def test_custom_vs_cudnn_says_how_many_pairs_custom_wins_and_names_those_it_trails(tmp_path):
    # Hand-written event files with real TensorBoard records: one pair (fp32 NCHW, compile) in which custom trains
    # faster by 0.5% and infers slower by 1%.
    runs = tmp_path / "runs"
    fake_run(runs / "cudnn", 8, {"perf/train_img_s": 1000.0, "perf/infer_img_s": 3000.0}, backend="cudnn")
    fake_run(runs / "custom", 8, {"perf/train_img_s": 1005.0, "perf/infer_img_s": 2970.0}, backend="custom")
    proc = run_tool(COMPARE, str(runs), check=True)
    assert ("custom >= cudnn: training in 1 of 1 pairs; inference in 0 of 1 pairs. Custom behind: inference fp32 "
            "NCHW, compile=True, CUDA graph unknown, data=synthetic (0.990x).") in proc.stdout


def _table_rows(stdout: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in stdout.split("## custom vs cudnn")[0].splitlines()
            if line.startswith("| cudnn |") or line.startswith("| custom |")]


def test_runs_that_differ_beyond_the_columns_stay_apart_and_seeds_are_repeats(tmp_path):
    # Hydra's overrides say what else differs: optim is a setting (its own rows), seed and the run directory are not
    # (those runs are repeats of one combination, combined into their median).
    runs = tmp_path / "runs"
    scalars = {"perf/train_img_s": 1000.0, "perf/infer_img_s": 3000.0}
    for i, (optim, seed, img_s) in enumerate([("sgd", 1, 1000.0), ("sgd", 2, 1100.0), ("rmsprop", 1, 900.0)]):
        fake_run(runs / f"custom{i}", 8, {**scalars, "perf/train_img_s": img_s}, backend="custom",
                 overrides=[f"optim={optim}", f"seed={seed}", f"hydra.run.dir=/tmp/r{i}", "backend=custom", "epochs=2"])
    for optim in ("sgd", "rmsprop"):
        fake_run(runs / f"cudnn-{optim}", 8, scalars, backend="cudnn", overrides=[f"optim={optim}", "backend=cudnn",
                                                                                   "epochs=2"])
    proc = run_tool(COMPARE, str(runs), check=True)
    rows = {(r[0], r[7]): r for r in _table_rows(proc.stdout)}
    assert sorted(rows) == [("cudnn", "optim=rmsprop"), ("cudnn", "optim=sgd"), ("custom", "optim=rmsprop"),
                            ("custom", "optim=sgd")], proc.stdout
    assert rows[("custom", "optim=sgd")][8] == "1,050" and rows[("custom", "optim=sgd")][15:17] == ["2", "1,000-1,100"]
    assert rows[("custom", "optim=rmsprop")][8] == "900"
    assert "1 combination(s) measured more than once (2 runs)" in proc.stdout
    pairs = [line for line in proc.stdout.split("## custom vs cudnn")[1].splitlines() if line.startswith("| torch |")]
    assert [p.split("|")[7].strip() for p in pairs] == ["optim=rmsprop", "optim=sgd"]  # each optim its own pair
    assert "custom >= cudnn: training in 1 of 2 pairs" in proc.stdout and "optim=rmsprop (0.900x)" in proc.stdout


def test_norm_comes_from_the_hparams_else_the_overrides_and_each_norm_is_its_own_row(tmp_path):
    runs = tmp_path / "runs"
    fake_run(runs / "logged-custom", 8, {"perf/train_img_s": 2000.0}, backend="custom", norm="custom")
    fake_run(runs / "logged-torch", 8, {"perf/train_img_s": 1500.0}, backend="custom", norm="torch")
    fake_run(runs / "older", 8, {"perf/train_img_s": 1000.0}, backend="cudnn", overrides=["norm=custom", "backend=cudnn"])
    proc = run_tool(COMPARE, str(runs), check=True)
    assert [(r[0], r[1], r[7]) for r in _table_rows(proc.stdout)] == [
        ("custom", "custom", "2,000"), ("custom", "torch", "1,500"), ("cudnn", "custom", "1,000")], proc.stdout
    assert "measured more than once" not in proc.stdout and "| settings |" not in proc.stdout
    pairs = [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.split("## custom vs cudnn")[1].splitlines()
             if line.startswith("| custom |")]
    assert [p[:1] + p[6:9] for p in pairs] == [["custom", "1,000", "2,000", "2.00x"]]  # norm=custom's pair alone


def test_an_unreadable_overrides_file_is_named(tmp_path):
    fake_run(tmp_path / "runs" / "bad", 8, {"perf/train_img_s": 100.0}, overrides=[])
    (tmp_path / "runs" / "bad" / ".hydra" / "overrides.yaml").write_text("{not: [a list")
    proc = run_tool(COMPARE, str(tmp_path / "runs"))
    assert proc.returncode == 2 and "overrides.yaml: cannot be read as Hydra's list of overrides" in proc.stderr


def test_a_run_without_overrides_is_known_apart_from_one_without_recorded_overrides(tmp_path):
    # `python train.py` (Hydra keeps an empty list) against `python train.py optim=rmsprop`: two combinations. A run
    # whose overrides were not kept at all (copied without .hydra/) adds no settings to the others.
    runs = tmp_path / "runs"
    fake_run(runs / "plain", 8, {"perf/train_img_s": 100.0}, overrides=[])
    fake_run(runs / "rmsprop", 8, {"perf/train_img_s": 90.0}, overrides=["optim=rmsprop"])
    fake_run(runs / "copied", 8, {"perf/train_img_s": 60.0})
    proc = run_tool(COMPARE, str(runs), check=True)
    rows = sorted((c[7], c[8]) for c in (
        [c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines() if line.startswith("| torch |")))
    assert rows == [("", "80"), ("optim=rmsprop", "90")], proc.stdout  # plain and copied: one combination, median 80
