"""scripts/inference_ab.py, the side-by-side inference A/B of docs/kernel_notes.md (v8), on the CPU: its command line
and what it prints."""

import pytest
from scripts_under_test import load_script


def test_inference_ab_times_every_model_in_every_round_and_refuses_unknown_backends(capsys):
    script = load_script("inference_ab")
    small = ["--device", "cpu", "--amp", "off", "--width-mult", "0.25", "--batch-size", "2", "--resolution", "32",
             "--steps", "2"]
    img_s = script.main([*small, "--backends", "torch", "--modes", "eager", "--rounds", "3"])
    assert list(img_s) == [("torch", "eager")] and len(img_s[("torch", "eager")]) == 3
    assert all(v > 0 for v in img_s[("torch", "eager")])
    out = capsys.readouterr().out
    assert "torch  eager    median" in out and "3 rounds of 2 passes, cpu" in out
    with pytest.raises(SystemExit):
        script.main([*small, "--backends", "torch,tensorrt"])
    assert "--backends: tensorrt is not one of torch, cudnn, custom" in capsys.readouterr().err
