"""scripts/benchmark.py on the CPU: it really runs a tiny matrix, one process and run directory a combination,
skips what cannot run here with the reason, keeps finished runs, repeats in rounds and keeps to a time budget."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
from matrix_runs import BENCHMARK, COMPARE, MEASURED, TINY, combo_dir, read_scalars, run_tool

import mobilenet.bench.matrix as benchmark


def test_matrix_runs_every_combination_in_its_own_run_dir(matrix):
    for amp, cl in MEASURED:
        run_dir = combo_dir(matrix, "torch", amp, cl)
        record = json.loads((run_dir / "benchmark.json").read_text())
        assert record["status"] == "ok", record
        scalars = read_scalars(run_dir)
        for tag in ("perf/train_img_s", "perf/compute_img_s", "perf/step_ms", "perf/infer_img_s", "hparam/infer_img_s"):
            assert scalars[tag] > 0, (run_dir.name, tag, scalars)
        assert scalars["perf/train_img_s"] == pytest.approx(record["train_img_s"], rel=1e-6)


def test_unavailable_combinations_are_skipped_with_their_reason(matrix):
    for amp, cl in MEASURED:
        cudnn = json.loads((combo_dir(matrix, "cudnn", amp, cl) / "benchmark.json").read_text())
        assert cudnn["status"] == "skipped" and "needs a CUDA GPU" in cudnn["reason"]
        assert not list(combo_dir(matrix, "cudnn", amp, cl).glob("events.out.tfevents.*"))
        peer = json.loads((combo_dir(matrix, "timm", amp, cl) / "benchmark.json").read_text())
        if peer["status"] != "ok":  # timm is an optional extra: without it the row says how to get it
            assert peer["status"] == "skipped" and peer["reason"] == benchmark.TIMM_MISSING


def test_a_crashing_combination_is_a_failed_row_with_its_last_error_line(tmp_path):
    out = tmp_path / "m"
    args = [a if a != "0.25" else "5" for a in TINY]  # width_mult 5 passes the up-front checks, then the model refuses it
    proc = run_tool(BENCHMARK, *args, "--backends", "torch", "--amp", "off", "--channels-last", "false", "--peer", "no",
                "--out", str(out))
    assert proc.returncode == 1
    record = json.loads((combo_dir(out, "torch", "off", False) / "benchmark.json").read_text())
    assert record["status"] == "failed"
    assert record["reason"].startswith("exit 1: mobilenet.errors.ConfigError: model.width_mult must be in (0, 4]"), record["reason"]
    assert "failed" in proc.stdout
    # compare.py lists it with that reason; with nothing measured there is nothing to compare.
    report = run_tool(COMPARE, str(out))
    assert report.returncode == 2 and "model.width_mult must be in" in report.stderr


def test_finished_runs_are_kept_when_the_matrix_is_run_again(matrix, tmp_path):
    copy = tmp_path / "again"
    shutil.copytree(matrix, copy)
    before = {p: p.stat().st_mtime_ns for p in copy.rglob("events.out.tfevents.*")}
    proc = run_tool(BENCHMARK, *TINY, "--backends", "torch", "--amp", "off,bf16", "--channels-last", "false,true",
                "--peer", "no", "--out", str(copy), check=True)
    assert proc.stdout.count("(kept from an earlier invocation)") == 4
    assert {p: p.stat().st_mtime_ns for p in copy.rglob("events.out.tfevents.*")} == before


def test_the_backends_of_one_setting_run_back_to_back():
    combos = benchmark.plan(benchmark.parse_args(["--backends", "cudnn,custom", "--amp", "off,fp16", "--channels-last",
                                                  "false,true", "--data", "synthetic", "--compile", "false",
                                                  "--peer", "no"]))
    settings = [(c.amp, c.channels_last) for c in combos]
    assert [c.backend for c in combos] == ["cudnn", "custom"] * 4
    assert settings[0::2] == settings[1::2] and len(set(settings)) == 4  # each pair one setting, every setting once


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
    proc = run_tool(BENCHMARK, *TINY, "--backends", "torch", "--amp", "off", "--channels-last", "false", "--peer", "no",
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
        assert f"| torch | torch | fp32 | NCHW | {compiled} | on | synthetic | skipped |" in listing, listing


def _printed_table(stdout: str) -> list[list[str]]:
    """benchmark.py's closing table as printed (rich's box characters): the header, then one list of cells a row
    (a row's first line: the cells of a long reason wrap onto lines of their own)."""
    lines = [line for line in stdout.splitlines() if line.startswith(("┃", "│"))]
    cells = [[c.strip() for c in line.strip("┃│").split("┃" if line.startswith("┃") else "│")] for line in lines]
    return [cells[0]] + [row for row in cells[1:] if row[0]]


def test_norm_is_an_opt_in_axis_and_custom_norm_is_skipped_on_a_cpu_with_the_reason(tmp_path):
    assert {c.norm for c in benchmark.plan(benchmark.parse_args([]))} == {"torch"}
    norms = benchmark.plan(benchmark.parse_args(["--backends", "custom", "--amp", "fp16", "--channels-last", "true",
                                                 "--data", "synthetic", "--compile", "false", "--", "norm=torch,custom"]))
    assert [(c.backend, c.norm) for c in norms] == [("custom", "torch"), ("custom", "custom"), ("timm", "torch")]
    assert norms[1].name.endswith(",norm=custom") and "norm=" not in norms[0].name
    assert "norm=custom" in benchmark.hydra_overrides(norms[1], benchmark.parse_args([]))
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--norms", "groupnorm"])
    proc = run_tool(BENCHMARK, *TINY, "--backends", "torch", "--amp", "off", "--channels-last", "false", "--peer", "no",
                    "--compile", "false", "--norms", "custom", "--out", str(tmp_path / "m"))
    assert proc.returncode == 0, proc.stderr
    name = "backend=torch,amp=off,channels_last=false,compile=false,data=synthetic,norm=custom"
    record = json.loads((tmp_path / "m" / name / "benchmark.json").read_text())
    assert record["status"] == "skipped" and record["norm"] == "custom" and "CUDA" in record["reason"], record
    from mobilenet.bench import compare

    listing = compare.markdown(compare.load_rows([tmp_path / "m"]), [])
    assert "| torch | custom | fp32 | NCHW | False | off | synthetic | skipped |" in listing, listing
    header, *rows = _printed_table(proc.stdout)
    assert [dict(zip(header, r))["norm"] for r in rows] == ["custom"]  # benchmark.py's own table names the norm too


def test_time_budget_leaves_combinations_for_the_next_invocation(tmp_path):
    proc = run_tool(BENCHMARK, *TINY, "--backends", "torch", "--amp", "off", "--channels-last", "false", "--peer", "no",
                "--out", str(tmp_path / "m"), "--time-budget", "5")
    assert proc.returncode == 1
    assert "not started: --time-budget spent" in proc.stdout and "run the same command again" in proc.stdout
    record = json.loads((combo_dir(tmp_path / "m", "torch", "off", False) / "benchmark.json").read_text())
    assert record["status"] == "not started" and "--time-budget" in record["reason"]
    # compare.py lists it as not measured, with the reason, instead of dropping it
    cmp = run_tool(COMPARE, str(tmp_path / "m"), "--out", str(tmp_path / "cmp"))
    table = (tmp_path / "cmp" / "matrix.md").read_text() if (tmp_path / "cmp" / "matrix.md").exists() else cmp.stdout + cmp.stderr
    assert "not started" in table and "--time-budget spent" in table, table


def test_runs_of_one_comparison_are_counted_per_round_and_setting():
    args = benchmark.parse_args(["--backends", "cudnn,custom", "--amp", "fp16,bf16", "--channels-last", "true",
                                 "--peer", "no", "--compile", "false", "--data", "synthetic", "--repeats", "2"])
    rounds = [(k, combo) for k in (1, 2) for combo in benchmark.plan(args)]
    assert [c.backend for _, c in rounds] == ["cudnn", "custom"] * 4
    assert benchmark.runs_left_in_comparison(rounds) == [2, 1] * 4


def test_time_budget_starts_a_comparison_only_if_all_its_runs_fit(tmp_path):
    # Two environment variants of one setting: one comparison of two runs. With the longest run so far at 30 s and
    # 50 s left, one run would fit but not both, so neither starts (the second is not measured without the first).
    args = benchmark.parse_args(["--backends", "torch", "--amp", "off", "--channels-last", "false", "--peer", "no",
                                 "--compile", "false", "--data", "synthetic", "--env", "MBN_UNUSED=1", "--time-budget", "50",
                                 "--out", str(tmp_path)])
    rounds = [(1, combo) for combo in benchmark.plan(args)]
    assert benchmark.runs_left_in_comparison(rounds) == [2, 1]
    matrix = benchmark._Matrix(args)
    matrix.longest[False] = 30.0
    for (k, combo), left in zip(rounds, [2, 1]):
        record = matrix.record(combo, tmp_path / combo.name, first_round=True, round_=k, runs_left=left)
        assert record["status"] == "not started" and "--time-budget spent" in record["reason"], record
        assert json.loads((tmp_path / combo.name / "benchmark.json").read_text())["status"] == "not started"


def test_last_error_line_of_a_traceback():
    log = "step 1\nTraceback (most recent call last):\n  File \"x.py\", line 1\n    boom()\nRuntimeError: CUDA out of memory\n"
    assert benchmark.last_error_line(log) == "RuntimeError: CUDA out of memory"
    assert benchmark.last_error_line("Killed\n") == "Killed"
    assert benchmark.last_error_line("") == "no output"


def test_repeats_run_in_rounds_and_compare_reports_their_median_and_spread(tmp_path):
    out = tmp_path / "repeats"
    proc = run_tool(BENCHMARK, *TINY, "--backends", "torch", "--amp", "off", "--channels-last", "false,true", "--peer", "no",
                "--repeats", "2", "--out", str(out), check=True)
    names = [combo_dir(out, "torch", "off", cl).name for cl in (False, True)]
    order = [line.split("] ")[1].split(":")[0] for line in proc.stdout.splitlines() if line.startswith("[")]
    assert order == names + [f"{n},repeat=2" for n in names]  # rounds: every combination once, then again
    header, *printed = _printed_table(proc.stdout)
    assert [(r["channels_last"], r["round"]) for r in (dict(zip(header, row)) for row in printed)] == [
        ("False", "1"), ("True", "1"), ("False", "2"), ("True", "2")]
    report = tmp_path / "report"
    shown = run_tool(COMPARE, str(out), "--out", str(report), "--name", "m", check=True)
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
    bad = run_tool(BENCHMARK, *TINY, "--repeats", "0", "--out", str(tmp_path / "never"))
    assert bad.returncode == 2 and "--repeats must be >= 1, got 0" in bad.stderr


def test_environment_variants_run_in_processes_of_their_own_and_compare_keeps_them_apart(tmp_path):
    # --env: every combination also runs with the variables set in its own process (MOBILENET_TREE, which the run's
    # summary prints as the source tree), next to the invocation's own environment; compare.py keeps the two apart and
    # labels the variant's row.
    out = tmp_path / "env"
    proc = run_tool(BENCHMARK, *TINY, "--backends", "torch", "--amp", "off", "--channels-last", "false", "--peer", "no",
                    "--env", "MOBILENET_TREE=tree-of-the-variant", "--out", str(out), check=True)
    base = combo_dir(out, "torch", "off", False)
    variant = base.with_name(base.name + ",env=MOBILENET_TREE=tree-of-the-variant")
    for run_dir, env in ((base, ""), (variant, "MOBILENET_TREE=tree-of-the-variant")):
        record = json.loads((run_dir / "benchmark.json").read_text())
        assert record["status"] == "ok" and record["env"] == env, record
        assert ("tree-of-the-variant" in (run_dir / "benchmark.log").read_text()) == bool(env), run_dir.name
    assert f"{variant.name}: ok" in proc.stdout
    report = tmp_path / "report"
    shown = run_tool(COMPARE, str(out), "--out", str(report), "--name", "m", check=True)
    rows = {r["run"]: r for r in csv.DictReader(open(report / "m.csv"))}
    assert {name: r["env"] for name, r in rows.items()} == {base.name: "", variant.name: "MOBILENET_TREE=tree-of-the-variant"}
    assert "| torch [MOBILENET_TREE=tree-of-the-variant] |" in shown.stdout
    assert "measured more than once" not in shown.stdout  # two variants, not two runs of one combination
    bad = run_tool(BENCHMARK, *TINY, "--env", "MDW_BWD_RING", "--out", str(tmp_path / "never"))
    assert bad.returncode == 2 and "--env takes space-separated NAME=VALUE settings" in bad.stderr
