"""scripts/bench_depthwise.py without a GPU: its options and the tables it writes from measured rows."""

from __future__ import annotations

import csv
import math

import pytest

from scripts_under_test import load_script

from mobilenet.bench.depthwise_suites import SUITES

bench = load_script("bench_depthwise")

INFO = {"gpu": "Test GPU", "driver": "1.0", "torch": "2.x", "cuda": "13.0", "cudnn": "91900", "python": "3.11",
        "command": "python scripts/bench_depthwise.py", "knobs": "none (defaults)", "tree": "abc1234+changes"}


def _row(layer, mode, cudnn_ms, custom_ms, custom_timing="graph"):
    return {"dtype": "fp16", "layout": "nhwc", "mode": mode, "suite": "mobilenet_v1", "layer": layer,
            **SUITES["mobilenet_v1"].layers[layer].fields(), "floor_ms": 0.05, "cudnn_ms": cudnn_ms,
            "cudnn_timing": "graph", "custom_ms": custom_ms, "custom_timing": custom_timing}


def test_cudnn_autotunes_by_default_as_the_model_does():
    assert bench.parse_args([]).cudnn_benchmark is True
    assert bench.parse_args(["--no-cudnn-benchmark"]).cudnn_benchmark is False


def test_tables_mark_eager_timings_and_sum_the_layers(tmp_path):
    args = bench.parse_args(["--dtypes", "fp16", "--layouts", "nhwc", "--backends", "cudnn,custom", "--layers", "0,2",
                             "--out", str(tmp_path / "dw")])
    rows = [_row(0, "fwd", 0.135, 0.150), _row(2, "fwd", 0.110, 0.100),
            _row(0, "fwdbwd", 0.54, 0.50, custom_timing="eager"), _row(2, "fwdbwd", 0.40, 0.30)]
    bench.write_results(rows, {"cudnn": None, "custom": None}, ["fp16"], ["nhwc"], ["fwd", "fwdbwd"], INFO, 4.0e12,
                        args)
    md = (tmp_path / "dw.md").read_text()
    assert "autotuned per shape" in md
    assert "- source tree: abc1234+changes; 20" in md  # and the UTC date of the run
    assert "| 0 | 32x112x112 | 3 | 1 | 1 | 1 | 0.540 | 0.500 (eager) |" in md
    assert "| 2 | 128x56x56 | 3 | 1 | 1 | 1 | 0.110 | 0.100 |" in md  # graph-timed cells carry no mark
    assert "a time marked (eager)" in md
    # the summary: sums over the measured layers, speed-up = cudnn / custom
    assert "| fp16 | NHWC | forward | 0.245 | 0.250 | 0.100 | 2.50 | 0.98 |" in md
    assert "| **sum (2 layers)** | | | | | | **0.940** | **0.800** |" in md
    # the acceptance quantity per dtype x layout: the best other backend's sum over custom's
    assert ("- fp16 NHWC: forward 0.98x (cudnn 0.245 ms / custom 0.250 ms); "
            "forward+backward 1.18x (cudnn 0.940 ms / custom 0.800 ms)") in md
    with open(tmp_path / "dw.csv") as f:
        recs = list(csv.DictReader(f))
    assert [r["custom_timing"] for r in recs] == ["graph", "graph", "eager", "graph"]
    assert math.isclose(float(recs[1]["custom_ms"]), 0.100)


def test_tables_without_eager_timings_have_no_eager_note(tmp_path):
    args = bench.parse_args(["--out", str(tmp_path / "dw"), "--no-cudnn-benchmark"])
    bench.write_results([_row(0, "fwd", 0.17, 0.15)], {"cudnn": None, "custom": None}, ["fp16"], ["nhwc"], ["fwd"],
                        INFO, 4.0e12, args)
    md = (tmp_path / "dw.md").read_text()
    assert "(eager)" not in md
    assert "heuristic choice" in md


def test_sums_weight_layers_by_their_count(tmp_path):
    # mobilenet_v1's layer 6 is the five 512 x 14 x 14 layers: measured once, counted five times
    args = bench.parse_args(["--dtypes", "fp16", "--layouts", "nhwc", "--backends", "cudnn,custom", "--layers", "0,6",
                             "--modes", "fwd", "--out", str(tmp_path / "dw")])
    rows = [_row(0, "fwd", 0.2, 0.1), _row(6, "fwd", 0.03, 0.02)]
    bench.write_results(rows, {"cudnn": None, "custom": None}, ["fp16"], ["nhwc"], ["fwd"], INFO, 4.0e12, args)
    md = (tmp_path / "dw.md").read_text()
    assert "| 6 | 512x14x14 | 3 | 1 | 1 | 5 | 0.030 | 0.020 |" in md
    assert "| **sum (6 layers)** | | | | | | **0.350** | **0.200** | **0.300** |" in md


def test_suite_picks_output_name_batch_and_layer_range(tmp_path, monkeypatch):
    assert bench.parse_args([]).suite == "mobilenet_v1"
    assert bench.parse_args([]).batch == 256
    assert bench.parse_args(["--suite", "large_k7"]).batch == SUITES["large_k7"].default_batch
    assert bench.parse_args(["--suite", "large_k7", "--batch", "8"]).batch == 8
    assert bench.parse_args(["--suite", "convnext_t"]).layer_ids == [0, 1, 2, 3]
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    for suite, name in (("mobilenet_v1", "depthwise_test-gpu"), ("convnext_t", "depthwise_convnext_t_test-gpu")):
        args = bench.parse_args(["--suite", suite, "--layers", "0", "--modes", "fwd"])
        row = {**_row(0, "fwd", 0.2, 0.1), "suite": suite, **SUITES[suite].layers[0].fields()}
        bench.write_results([row], {"cudnn": None, "custom": None}, ["fp16"], ["nhwc"], ["fwd"], INFO, 4.0e12, args)
        assert (tmp_path / "docs" / "results" / f"{name}.md").exists()
        assert (tmp_path / "docs" / "results" / f"{name}.csv").exists()


def test_suite_option_refuses_unknown_names_and_out_of_range_layers(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--suite", "resnet50"])
    err = capsys.readouterr().err
    assert "invalid choice: 'resnet50'" in err
    assert all(name in err for name in SUITES)
    with pytest.raises(SystemExit):
        bench.parse_args(["--suite", "convnext_t", "--layers", "4"])
    assert "convnext_t has layers 0-3" in capsys.readouterr().err


def test_ab_option_reads_knob_settings_and_refuses_other_text(capsys):
    assert bench.parse_args([]).ab == {}
    args = bench.parse_args(["--ab", "MDW_FWD_COLUMN_K57=2,MDW_COLUMN_REVERSE=0"])
    assert args.ab == {"MDW_FWD_COLUMN_K57": "2", "MDW_COLUMN_REVERSE": "0"}
    for bad in (["--ab", "FWD_COLUMN_K57=2"], ["--ab", "MDW_FWD_COLUMN_K57"], ["--ab", "MDW_X=1", "--backends", "cudnn"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    assert "--ab compares against custom" in capsys.readouterr().err


def test_knob_switch_gives_the_ab_backend_its_settings_and_the_others_the_process_environment(monkeypatch):
    reloads = []
    monkeypatch.setenv("MDW_COLUMN_REVERSE", "1")
    monkeypatch.delenv("MDW_FWD_COLUMN_K57", raising=False)
    use = bench.knob_switch({"MDW_FWD_COLUMN_K57": "2", "MDW_COLUMN_REVERSE": "0"}, reload=lambda: reloads.append(1))
    use(bench.AB_BACKEND)
    assert (bench.os.environ["MDW_FWD_COLUMN_K57"], bench.os.environ["MDW_COLUMN_REVERSE"]) == ("2", "0")
    use("custom")
    assert "MDW_FWD_COLUMN_K57" not in bench.os.environ and bench.os.environ["MDW_COLUMN_REVERSE"] == "1"
    assert len(reloads) == 2


def test_ab_backend_gets_its_own_acceptance_lines_and_is_not_an_other_backend(tmp_path):
    args = bench.parse_args(["--dtypes", "fp16", "--layouts", "nhwc", "--backends", "cudnn,custom", "--layers", "0",
                             "--modes", "fwd", "--ab", "MDW_FWD_COLUMN_K57=2", "--out", str(tmp_path / "dw")])
    row = {**_row(0, "fwd", 0.2, 0.25), "custom_ab_ms": 0.1, "custom_ab_timing": "graph"}
    bench.write_results([row], {"cudnn": None, "custom": None, "custom_ab": None}, ["fp16"], ["nhwc"], ["fwd"], INFO,
                        4.0e12, args)
    md = (tmp_path / "dw.md").read_text()
    assert "- `custom_ab`: custom with MDW_FWD_COLUMN_K57=2" in md
    assert "- fp16 NHWC: forward 0.80x (cudnn 0.200 ms / custom 0.250 ms)" in md  # cudnn, not custom_ab, is best
    assert "- fp16 NHWC: forward 2.00x (cudnn 0.200 ms / custom_ab 0.100 ms)" in md


def test_modes_option_takes_the_known_passes_and_names_them_when_refusing(capsys):
    assert bench.parse_args([]).mode_list == ["fwd", "fwdbwd"]
    assert bench.parse_args(["--modes", "fwd_dgrad,fwd_wgrad"]).mode_list == ["fwd_dgrad", "fwd_wgrad"]
    for bad in (["--modes", "bwd"], ["--modes", "fwd,wgrad"], ["--modes", ","]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        err = capsys.readouterr().err
        assert "--modes: comma-separated from fwd, fwdbwd, fwd_dgrad, fwd_wgrad" in err and repr(bad[1]) in err


def test_single_gradient_passes_get_tables_and_acceptance_lines_of_their_own(tmp_path):
    args = bench.parse_args(["--dtypes", "fp16", "--layouts", "nhwc", "--backends", "cudnn,custom", "--layers", "0",
                             "--modes", "fwd,fwd_wgrad", "--out", str(tmp_path / "dw")])
    rows = [_row(0, "fwd", 0.135, 0.150), _row(0, "fwd_wgrad", 0.40, 0.20)]
    bench.write_results(rows, {"cudnn": None, "custom": None}, ["fp16"], ["nhwc"], ["fwd", "fwd_wgrad"], INFO, 4.0e12,
                        args)
    md = (tmp_path / "dw.md").read_text()
    assert "## fp16 NHWC forward+weight gradient" in md
    assert "| fp16 | NHWC | forward+weight gradient | 0.400 | 0.200 |" in md
    assert ("- fp16 NHWC: forward 0.90x (cudnn 0.135 ms / custom 0.150 ms); "
            "forward+weight gradient 2.00x (cudnn 0.400 ms / custom 0.200 ms)") in md


def test_a_pass_custom_did_not_run_says_so_in_its_acceptance_line(tmp_path):
    # custom has no time for the forward (nan, as a case it could not run writes): the line says there is nothing
    # to compare rather than printing a nan speed-up against an arbitrary backend
    args = bench.parse_args(["--dtypes", "fp16", "--layouts", "nhwc", "--backends", "cudnn,custom", "--layers", "0",
                             "--modes", "fwd,fwd_wgrad", "--out", str(tmp_path / "dw")])
    rows = [_row(0, "fwd", 0.135, float("nan")), _row(0, "fwd_wgrad", 0.40, 0.20)]
    bench.write_results(rows, {"cudnn": None, "custom": None}, ["fp16"], ["nhwc"], ["fwd", "fwd_wgrad"], INFO, 4.0e12,
                        args)
    md = (tmp_path / "dw.md").read_text()
    assert ("- fp16 NHWC: forward - (no sum to compare); "
            "forward+weight gradient 2.00x (cudnn 0.400 ms / custom 0.200 ms)") in md
