"""scripts/bench_depthwise.py without a GPU: its options and the tables it writes from measured rows."""

from __future__ import annotations

import csv
import math

from scripts_under_test import load_script

bench = load_script("bench_depthwise")

INFO = {"gpu": "Test GPU", "driver": "1.0", "torch": "2.x", "cuda": "13.0", "cudnn": "91900", "python": "3.11",
        "command": "python scripts/bench_depthwise.py", "knobs": "none (defaults)"}


def _row(layer, mode, cudnn_ms, custom_ms, custom_timing="graph"):
    c, h, s = bench.LAYERS[layer]
    return {"dtype": "fp16", "layout": "nhwc", "mode": mode, "layer": layer, "C": c, "H": h, "stride": s,
            "floor_ms": 0.05, "cudnn_ms": cudnn_ms, "cudnn_timing": "graph", "custom_ms": custom_ms,
            "custom_timing": custom_timing}


def test_cudnn_autotunes_by_default_as_the_model_does():
    assert bench.parse_args([]).cudnn_benchmark is True
    assert bench.parse_args(["--no-cudnn-benchmark"]).cudnn_benchmark is False


def test_tables_mark_eager_timings_and_sum_the_layers(tmp_path):
    args = bench.parse_args(["--dtypes", "fp16", "--layouts", "nhwc", "--backends", "cudnn,custom", "--layers", "0,2",
                             "--out", str(tmp_path / "dw")])
    rows = [_row(0, "fwd", 0.135, 0.150), _row(2, "fwd", 0.110, 0.100),
            _row(0, "fwdbwd", 0.54, 0.50, custom_timing="eager"), _row(2, "fwdbwd", 0.40, 0.30)]
    bench.write_results(rows, {"cudnn": None, "custom": None}, ["fp16"], ["nhwc"], ["fwd", "fwdbwd"], [0, 2], INFO,
                        4.0e12, args)
    md = (tmp_path / "dw.md").read_text()
    assert "autotuned per shape" in md
    assert "| 0 | 32 | 112 | 1 | 0.540 | 0.500 (eager) |" in md
    assert "| 2 | 128 | 56 | 1 | 0.110 | 0.100 |" in md  # graph-timed cells carry no mark
    assert "a time marked (eager)" in md
    # the summary: sums over the measured layers, speed-up = cudnn / custom
    assert "| fp16 | NHWC | forward | 0.245 | 0.250 | 0.100 | 2.50 | 0.98 |" in md
    assert "| **sum (2 layers)** | | | | **0.940** | **0.800** |" in md
    with open(tmp_path / "dw.csv") as f:
        recs = list(csv.DictReader(f))
    assert [r["custom_timing"] for r in recs] == ["graph", "graph", "eager", "graph"]
    assert math.isclose(float(recs[1]["custom_ms"]), 0.100)


def test_tables_without_eager_timings_have_no_eager_note(tmp_path):
    args = bench.parse_args(["--out", str(tmp_path / "dw"), "--no-cudnn-benchmark"])
    bench.write_results([_row(0, "fwd", 0.17, 0.15)], {"cudnn": None, "custom": None}, ["fp16"], ["nhwc"], ["fwd"],
                        [0], INFO, 4.0e12, args)
    md = (tmp_path / "dw.md").read_text()
    assert "(eager)" not in md
    assert "heuristic choice" in md
