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
