"""The one-off investigations of scripts/experiments/ that run on the CPU, so that they still run and still show
what docs/ records of them."""

import pytest
import torch

from scripts_under_test import load_script


def test_perturbation_growth_reports_zero_gap_without_a_nudge_and_a_gap_with_one(capsys):
    """perturbation_growth.py, the evidence for comparing a captured run with an eager one step by step
    (tests/test_cuda_graph.py): on the CPU two identical runs end bit-identical, and a nudge shows."""
    script = load_script("experiments/perturbation_growth")
    small = ["device=cpu", "model.width_mult=0.25", "data.steps_per_epoch=3", "data.resolution=32", "data.batch_size=8"]
    gaps = {}
    for nudge in (0.0, 1e-3):
        script.main(["--nudge", str(nudge), "--layers", "2", *small])
        rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| features")]
        assert len(rows) == 2
        gaps[nudge] = [float(r[3]) for r in rows]
    assert gaps[0.0] == [0.0, 0.0] and all(g > 0 for g in gaps[1e-3])


def test_stem_wgrad_patch_product_is_the_convolutions_weight_gradient():
    """stem_wgrad.py's `gemm` variant, whose timing docs/results/train_norm_h200.md records, computes the stem's
    weight gradient: against autograd's in float64 on fresh inputs, channels_last as the model runs it."""
    import torch
    import torch.nn.functional as F

    script = load_script("experiments/stem_wgrad")
    x = torch.randn(2, 3, 30, 30, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 8, 15, 15, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    F.conv2d(x, w, stride=2, padding=1).backward(dy)
    mine = w.detach().clone().requires_grad_()
    script._GemmWeightGradConv.apply(x, mine).backward(dy)
    assert torch.allclose(mine.grad, w.grad, rtol=1e-10, atol=1e-10)
    assert torch.allclose(script.patch_gemm_weight_grad(x, dy), w.grad, rtol=1e-10, atol=1e-10)


def test_depthwise_precision_measures_the_rounding_floor():
    """depthwise_precision.py's yardstick, which docs/results/depthwise_precision_fp16_h200.md records: the float64
    result rounded to fp16 has a relative error of about 2^-12 (half an fp16 unit, averaged), and a sum accumulated
    in fp16 has several times that, which is what the script tells apart."""
    import torch

    script = load_script("experiments/depthwise_precision")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 25, dtype=torch.float64, generator=gen).relu_()
    w = torch.randn(25, dtype=torch.float64, generator=gen) / 5
    ref = x @ w
    rounded = script.relative_error(ref.half(), ref)
    assert 1e-4 < rounded < 3e-4
    acc16 = torch.zeros(4096, dtype=torch.float16)
    for k in range(25):  # a 5x5 stencil's 25 taps, each product and sum rounded to fp16
        acc16 = (acc16 + (x[:, k].half() * w[k].half())).half()
    assert script.relative_error(acc16, ref) > 2 * rounded


def test_weight_cast_host_time_times_both_casts_in_alternating_rounds(capsys):
    """weight_cast_host_time.py, whose CPU figures docs/kernel_notes.md records: both weight casts run the same
    eager steps (one round each per round), and the table reports every round of each."""
    script = load_script("experiments/weight_cast_host_time")
    times = script.measure(steps=2, rounds=3, warmup=1, width_mult=0.25, batch=2, resolution=32)
    assert list(times) == list(script.VARIANTS)
    assert all(len(ts) == 3 and all(t > 0 for t in ts) for ts in times.values())
    assert script.main(["--steps", "2", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "| autocast's per-weight casts |" in out and "one-buffer cast minus per-weight casts:" in out


def test_weight_cast_host_time_refuses_what_it_cannot_run(capsys):
    script = load_script("experiments/weight_cast_host_time")
    for argv, words in ((["--dtype", "fp16"], "CPU autocast runs bf16"), (["--backend", "custom"], "needs a CUDA GPU"),
                        (["--batch", "1"], "--batch must be >= 2")):
        with pytest.raises(SystemExit):
            script.main(argv)
        assert words in capsys.readouterr().err


def test_eager_host_time_refuses_what_it_cannot_run(capsys):
    script = load_script("experiments/eager_host_time")
    cases = [(["--backends", "cudnn,tensorrt"], "tensorrt is not a backend"), (["--batch", "1"], "--batch must be >= 2"),
             (["--apply-in-depthwise"], "--apply-in-depthwise needs --norm custom --backends custom"),
             (["--dtype", "fp32"], "with --dtype fp32 use --weight-cast off"),
             (["--compile", "--weight-cast", "both"], "--compile needs --weight-cast off")]
    if not torch.cuda.is_available():
        cases.append(([], "needs a CUDA GPU"))
    for argv, words in cases:
        with pytest.raises(SystemExit):
            script.main(argv)
        assert words in capsys.readouterr().err


def test_dali_decode_ceiling_times_the_host_cuts_alone_and_together(capsys, digits_root):
    """dali_decode_ceiling.py, whose H200 figures docs/results/loader_h200.md records: on the CPU its host cuts run
    (the reader alone, the host decode), each setting in each round, and two pipelines run at once."""
    pytest.importorskip("nvidia.dali", reason="needs nvidia-dali-cuda130 (or -cuda120)")
    script = load_script("experiments/dali_decode_ceiling")
    common = ["--root", str(digits_root), "--batch-size", "32", "--warmup", "1", "--iters", "3", "--rounds", "2"]
    assert script.main([*common, "--cuts", "read,cpu_decode", "--threads", "1,2"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| read") or
            line.startswith("| cpu_decode")]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [("read", "1"), ("read", "2"), ("cpu_decode", "1"),
                                                            ("cpu_decode", "2")]
    for r in rows:
        per_round = [float(v.replace(",", "")) for v in r[5].split("/")]
        assert len(per_round) == 2 and all(v > 0 for v in per_round)
    assert script.main([*common, "--together", "read+cpu_decode:1+1:4+2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "together" in line]
    assert len(lines) == 2 and all("read (1 threads)" in line and "cpu_decode (1 threads)" in line for line in lines)
    if not torch.cuda.is_available():  # a GPU cut says it needs a GPU instead of decoding somewhere else
        with pytest.raises(SystemExit):
            script.main([*common, "--cuts", "decode"])
        assert "['decode'] decode on a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_dali_gpu_work_refuses_to_run_without_a_gpu(capsys, digits_root):
    """dali_gpu_work.py measures the pipeline's GPU work: without a GPU it says so instead of decoding on the host."""
    script = load_script("experiments/dali_gpu_work")
    with pytest.raises(SystemExit):
        script.main(["--root", str(digits_root), "--variant", "data.dali.hw_decoder_load=1.0"])
    assert "decodes on a CUDA GPU and this machine has none" in capsys.readouterr().err
