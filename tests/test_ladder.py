"""scripts/plot_ladder.py: train_ladder.sh's table becomes the ladder's steps and a waterfall PNG; a table that lacks
a step, or holds a failed one, is a clear error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mobilenet.bench.ladder import LADDER_STEPS, OPTIONAL_STEPS, parse_ladder

ROOT = Path(__file__).resolve().parent.parent

# As train_ladder.sh prints it, with the rounds after the ladder (not steps of it).
TABLE = """| step | overrides | train img/s |
|---|---|--:|
| fp32 NCHW | `backend=torch amp=false channels_last=false cuda_graph=false` | 3,549 |
| AMP fp16 | `backend=torch amp=true channels_last=false cuda_graph=false` | 4,711 |
| channels_last | `backend=torch amp=true channels_last=true cuda_graph=false` | 15,055 |
| custom depthwise | `backend=custom amp=true channels_last=true cuda_graph=false` | 15,320 |
| custom BatchNorm+ReLU | `backend=custom norm=custom norm.apply_in_depthwise=false amp=true channels_last=true cuda_graph=false` | 13,986 |
| BatchNorm+ReLU in the depthwise kernels | `backend=custom norm=custom norm.apply_in_depthwise=true amp=true channels_last=true cuda_graph=false` | 14,120 |
| captured step | `backend=custom norm=custom norm.apply_in_depthwise=true amp=true channels_last=true cuda_graph=true` | 18,703 |
| round 1: custom + norm=custom | `backend=custom norm=custom amp=true channels_last=true` | 18,687 |
"""


def test_the_ladder_table_gives_its_seven_steps_in_order():
    steps = parse_ladder(TABLE)
    assert [s.label for s in steps] == list(LADDER_STEPS[:7])
    assert [s.img_s for s in steps] == [3549, 4711, 15055, 15320, 13986, 14120, 18703]
    assert steps[5].overrides == ("backend=custom norm=custom norm.apply_in_depthwise=true amp=true channels_last=true "
                                  "cuda_graph=false")


def test_a_table_from_before_the_norm_in_depthwise_step_still_parses():
    older = "\n".join(line for line in TABLE.splitlines() if "in the depthwise kernels" not in line)
    steps = parse_ladder(older)
    assert [s.label for s in steps] == [s for s in LADDER_STEPS if s not in OPTIONAL_STEPS]
    assert [s.img_s for s in steps] == [3549, 4711, 15055, 15320, 13986, 18703]


def test_the_opt_in_pointwise_step_is_the_last_where_it_ran():
    ran = TABLE.replace("| round 1:", "| BatchNorm+ReLU in cuDNN's pointwise convs | `norm.apply_in_pointwise=true` | "
                                      "19,500 |\n| round 1:")
    steps = parse_ladder(ran)
    assert [s.label for s in steps] == list(LADDER_STEPS) and steps[-1].img_s == 19500
    not_run = TABLE.replace("| round 1:", "| BatchNorm+ReLU in cuDNN's pointwise convs (not run) | "
                                          "`norm.apply_in_pointwise=true` | not run: nvidia-cudnn-frontend is not "
                                          "installed |\n| round 1:")
    assert [s.label for s in parse_ladder(not_run)] == list(LADDER_STEPS[:7])


def test_a_missing_or_failed_step_is_a_clear_error():
    with pytest.raises(ValueError, match="lacks the step\\(s\\) captured step"):
        parse_ladder("\n".join(line for line in TABLE.splitlines() if not line.startswith("| captured step")))
    with pytest.raises(ValueError, match="'AMP fp16': train img/s is 'failed', not a number"):
        parse_ladder(TABLE.replace("| 4,711 |", "| failed |"))


def test_plot_ladder_writes_a_png_and_refuses_a_bad_table(tmp_path):
    table = tmp_path / "ladder.md"
    table.write_text(TABLE)
    out = tmp_path / "ladder.png"
    proc = subprocess.run([sys.executable, "scripts/plot_ladder.py", str(table), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    table.write_text("| step | overrides | train img/s |\n")
    proc = subprocess.run([sys.executable, "scripts/plot_ladder.py", str(table), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "lacks the step(s) fp32 NCHW" in proc.stderr and "Traceback" not in proc.stderr


def test_without_matplotlib_plot_ladder_says_which_extra_to_install(tmp_path):
    # A Python whose matplotlib cannot be imported (an optional dependency, as on a `make train` install).
    table = tmp_path / "ladder.md"
    table.write_text(TABLE)
    code = ("import sys; sys.modules['matplotlib'] = None; sys.argv = ['plot_ladder.py', sys.argv[1], '--out', "
            "sys.argv[2]]; import runpy; runpy.run_path('scripts/plot_ladder.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, str(table), str(tmp_path / "x.png")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "needs matplotlib: pip install -e '.[bench]'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x.png").exists()
