"""The inference fast path: BatchNorm folding, fused epilogues, the replayed forward, latency, ONNX export.

CPU (CI): folding is exact in float64, fold_bn=false is the training graph, switches that cannot run here are
refused or say why, infer.py's modes run, the ONNX file matches PyTorch in onnxruntime. GPU (`pytest -m gpu`): the
fused-epilogue depthwise op against a float64 reference with poisoned outputs, opcheck, replay bit-equal to eager,
fp16 folding keeping the predictions.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mobilenet.config import compose
from mobilenet.inference import build_path
from mobilenet.inference_model import build_inference_model, fold_batchnorm
from mobilenet.model import MobileNetV1

ROOT = Path(__file__).resolve().parent.parent
CPU_SMALL = ["device=cpu", "data=synthetic", "data.resolution=32", "data.batch_size=4", "model.width_mult=0.25"]


def _calibrated(model: MobileNetV1, resolution: int = 32, batches: int = 3, dtype=torch.float32) -> MobileNetV1:
    """BatchNorm statistics and affine parameters far from their initial 0/1, so that folding has work to do."""
    gen = torch.Generator().manual_seed(1)
    device = next(model.parameters()).device
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None  # cumulative average over the calibration batches
            with torch.no_grad():
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.2)
    model.train()
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randn(8, 3, resolution, resolution, generator=gen).to(device, dtype))
    return model.eval()


def test_folding_matches_the_unfolded_model_to_1e9_in_float64():
    torch.manual_seed(0)
    model = _calibrated(MobileNetV1(num_classes=10, width_mult=0.5).double(), dtype=torch.float64)
    folded = build_inference_model(model, torch.float64, channels_last=False, fused=False)
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        ref, out = model(x), folded(x)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 1e-9, rel
    assert len(folded.features) == 27  # the stem and 13 x (depthwise, pointwise)


def test_fold_batchnorm_is_the_eval_mode_batchnorm_of_the_convolution():
    bn = torch.nn.BatchNorm2d(3).double().eval()
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([1.0, -2.0, 0.5]))
        bn.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
        bn.weight.copy_(torch.tensor([2.0, 1.0, -1.0]))
        bn.bias.copy_(torch.tensor([0.0, 1.0, 3.0]))
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64)
    b = torch.randn(3, dtype=torch.float64)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    fw, fb = fold_batchnorm(w, b, bn)
    torch.testing.assert_close(F.conv2d(x, fw, fb), bn(F.conv2d(x, w, b)), rtol=1e-12, atol=1e-12)


def test_folded_weights_are_stored_in_the_run_dtype_and_run_without_autocast():
    cfg = compose([*CPU_SMALL, "amp=true", "amp_dtype=bf16", "channels_last=true"])
    model = _calibrated(MobileNetV1(num_classes=10, width_mult=0.25))
    path = build_path(model, cfg, torch.device("cpu"))
    assert path.amp_dtype is None
    buffers = list(path.model.buffers()) + list(path.model.parameters())
    assert buffers and all(t.dtype == torch.bfloat16 for t in buffers)
    assert path.rows["inference path"].startswith("BatchNorm folded, weights in bfloat16")
    x = torch.randn(2, 3, 32, 32).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        assert path.forward(x).dtype == torch.bfloat16


def test_fold_bn_false_runs_the_training_graph_under_autocast():
    cfg = compose([*CPU_SMALL, "fold_bn=false", "amp=true", "amp_dtype=bf16"])
    model = _calibrated(MobileNetV1(num_classes=10, width_mult=0.25))
    path = build_path(model, cfg, torch.device("cpu"))
    assert path.model is model and path.forward is model
    assert path.amp_dtype == torch.bfloat16
    assert path.rows["inference path"] == "training graph in eval mode (fold_bn=false), autocast bfloat16"
    assert "fused epilogue" not in path.rows


def test_on_a_cpu_the_epilogue_and_replay_are_off_and_say_why():
    cfg = compose(CPU_SMALL)
    path = build_path(_calibrated(MobileNetV1(num_classes=10, width_mult=0.25)), cfg, torch.device("cpu"))
    assert path.rows["fused epilogue"].startswith("off (fused_epilogue=auto: the run's device is cpu")
    assert path.rows["CUDA graph"].startswith("off (cuda_graph=auto: the run's device is cpu")
    assert {path.rows[k] for k in ("stem kernel", "depthwise kernel", "pointwise kernel")} == {"conv + separate ReLU"}


@pytest.mark.parametrize("override, message", [
    ("fused_epilogue=true", "fused_epilogue=true needs a CUDA GPU"),
    ("cuda_graph=true", "cuda_graph=true, but this inference run cannot be replayed"),
    ("fused_epilogue=maybe", "fused_epilogue='maybe' is not a choice; choose one of: auto, true, false"),
])
def test_switches_that_cannot_run_on_a_cpu_are_refused(override, message):
    cfg = compose([*CPU_SMALL, override])
    with pytest.raises(ValueError, match=message):
        build_path(MobileNetV1(num_classes=10, width_mult=0.25), cfg, torch.device("cpu"))


def test_a_model_that_is_not_mobilenet_is_not_folded():
    cfg = compose(CPU_SMALL)
    with pytest.raises(ValueError, match="is not this project's MobileNetV1; use fold_bn=false"):
        build_path(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), cfg, torch.device("cpu"))


def _infer(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "infer.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_infer_user_errors_are_one_line_naming_the_flag_without_a_traceback():
    proc = _infer("--checkpoint", "/missing.pt")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --checkpoint '/missing.pt': no such checkpoint file or run directory"
    proc = _infer("fused_epilogue=true", "--steps", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error: fused_epilogue=true needs a CUDA GPU")
    debug = _infer("--debug", "--checkpoint", "/missing.pt")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_profile_traces_as_many_steps_as_steps_asks(tmp_path):
    proc = _infer("--profile", "--steps", "3", "--warmup", "1", "data.resolution=32", "model.width_mult=0.25",
                  "data.batch_size=2", f"log_root={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert "| profiled steps | 3 |" in proc.stdout
    assert "overhead" in proc.stdout
    assert "| launches without the profiler | eager, launched one by one |" in proc.stdout  # a CPU run: no replay


def test_latency_sweep_prints_one_row_per_batch_size():
    from mobilenet import inference

    cfg = compose(CPU_SMALL)
    rows = inference.latency_sweep(cfg, [1, 3], warmup=1, steps=3)
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["img/s"] > 0 and 0 < r["p50 ms"] <= r["p99 ms"] and r["calls"] == 3 for r in rows)


def test_infer_on_a_cpu_announces_cpu_sized_defaults():
    proc = _infer("data.resolution=32", "model.width_mult=0.25", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "inference on cpu: batch 16, 32px, 2 warm-up + 2 timed passes" in proc.stdout


def test_onnx_export_runs_in_onnxruntime_and_matches_pytorch(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from mobilenet import inference

    out = tmp_path / "model.onnx"
    cfg = compose([*CPU_SMALL, "backend=torch"])
    inference.export_onnx(cfg, None, str(out))
    torch.manual_seed(cfg.seed)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (inp,) = session.get_inputs()
    assert inp.name == "images" and inp.type == "tensor(float)"
    assert str(inp.shape[0]) not in ("2",)  # the batch axis is dynamic
    # The same model as the export, rebuilt from the same seed, against the file on a batch size it was not traced at.
    setup = inference._setup(cfg, None)
    x = torch.randn(5, 3, 32, 32)
    with torch.inference_mode():
        ref = setup.path.forward(x).numpy()
    got = session.run(None, {"images": x.numpy()})[0]
    assert got.shape == (5, 1000)
    assert abs(got - ref).max() <= 1e-4 * max(1.0, abs(ref).max())


def test_export_that_cannot_be_done_names_what_is_unsupported(tmp_path):
    from mobilenet import inference

    with pytest.raises(ValueError, match="fold_bn=false .* is not exported"):
        inference.export_onnx(compose([*CPU_SMALL, "fold_bn=false"]), None, str(tmp_path / "m.onnx"))
    with pytest.raises(ValueError, match="must end in .onnx"):
        inference.export_onnx(compose(CPU_SMALL), None, str(tmp_path / "m.pt"))


def test_export_without_the_onnx_packages_says_which_extra_to_install(tmp_path, monkeypatch):
    from mobilenet import inference
    from mobilenet.errors import MissingDependency

    monkeypatch.setitem(sys.modules, "onnxscript", None)  # how Python marks a package as absent
    with pytest.raises(MissingDependency, match=r"--export needs onnxscript .*pip install -e '\.\[export\]'"):
        inference.export_onnx(compose(CPU_SMALL), None, str(tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()


def test_checkpoint_top1_is_the_same_folded_and_unfolded_on_digits(tmp_path):
    from mobilenet import inference
    from mobilenet.engine import Trainer

    train = ["model.width_mult=0.25", "device=cpu", "progress=false", "perf.warmup_steps=1", "epochs=2",
             "data.steps_per_epoch=4", f"log_root={tmp_path}"]
    trainer = Trainer(compose(train), tmp_path / "run")
    trainer.fit()
    ckpt = str(trainer.checkpoint_path)
    evaluated = {fold: inference.evaluate_checkpoint(compose(["device=cpu", f"fold_bn={fold}"]), ckpt)
                 for fold in ("true", "false")}
    assert evaluated["true"] == evaluated["false"]


def test_a_checkpoint_keeps_its_architecture_and_images_are_checked_before_the_model(tmp_path, digits_root):
    from mobilenet import inference
    from mobilenet.engine import Trainer
    from mobilenet.errors import ConfigError, DataError

    train = ["model.width_mult=0.25", "device=cpu", "progress=false", "perf.warmup_steps=1", "epochs=1",
             "data.steps_per_epoch=2", "evaluate=false", f"log_root={tmp_path}"]
    trainer = Trainer(compose(train), tmp_path / "run")
    trainer.fit()
    ckpt = str(trainer.checkpoint_path)
    image = next((digits_root / "val").glob("*/*.jpg"))
    # A width the command line sets is refused where it is not the checkpoint's, not replaced by it.
    with pytest.raises(ConfigError, match=r"was trained with model\.width_mult=0\.25, and model\.width_mult=0\.5 asks "
                                          r"for another model: leave model\.width_mult out"):
        inference.classify_images(compose(["device=cpu", "model.width_mult=0.5"]), ckpt, [str(image)],
                                  ["device", "model.width_mult"])
    inference.classify_images(compose(["device=cpu", "model.width_mult=0.25"]), ckpt, [str(image)],
                              ["device", "model.width_mult"])
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    inference.check_given_architecture(compose([]), state, ckpt, [])  # not set: the checkpoint's width, as documented
    (tmp_path / "notes.jpg").write_text("not an image")
    with pytest.raises(DataError, match=r"--images: cannot decode '.*notes\.jpg' as an image"):
        inference.classify_images(compose(["device=cpu"]), ckpt, [str(image), str(tmp_path / "notes.jpg")])
    (ranked,) = inference.classify_images(compose(["device=cpu"]), ckpt, [str(image)])
    assert len(ranked) == 5 and all(0.0 <= p <= 1.0 for _, p in ranked)


# ---------------------------------------------------------------------------------------------- GPU tests

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def _activation_ref(y: torch.Tensor, activation: str) -> torch.Tensor:
    return y.clamp(min=0) if activation == "relu" else y.clamp(0, 6)


@pytest.mark.gpu
@cuda
def test_fused_epilogue_op_against_float64_with_poisoned_outputs():
    from kernels.ops import depthwise_conv2d

    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, (1,))))
    cases = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for layout in ("nchw", "nhwc", "noncontig"):
            for k, stride, (n, c, h, w) in [(3, 1, (3, 32, 14, 14)), (3, 2, (2, 64, 15, 16)), (5, 1, (2, 24, 9, 11)),
                                            (7, 2, (2, 16, 20, 20)), (3, 1, (2, 6, 7, 7))]:
                for activation in ("relu", "relu6"):
                    x = torch.randn(n, c, h, w if layout != "noncontig" else 2 * w, device="cuda", dtype=dtype,
                                    generator=gen) * 3
                    x = x[..., ::2] if layout == "noncontig" else x
                    if layout == "nhwc":
                        x = x.contiguous(memory_format=torch.channels_last)
                    wt = torch.randn(c, 1, k, k, device="cuda", dtype=dtype, generator=gen) / k
                    b = torch.randn(c, device="cuda", dtype=dtype, generator=gen)
                    ref = _activation_ref(F.conv2d(x.double(), wt.double(), b.double(), stride, k // 2, 1, c), activation)
                    torch.empty(4 * x.numel() * x.element_size(), dtype=torch.uint8, device="cuda").fill_(0xFF)
                    y = depthwise_conv2d(x, wt, b, stride, k // 2, activation=activation)
                    what = f"{dtype} {layout} k={k} s={stride} {activation} {tuple(x.shape)}"
                    assert torch.isfinite(y).all(), f"unwritten (NaN) output: {what}"
                    err = ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                    assert err <= TOL[dtype], f"rel. error {err:.2e}: {what}"
                    assert (y >= 0).all() and (activation == "relu" or (y <= 6).all()), what
                    cases += 1
    assert cases == 4 * 3 * 5 * 2


@pytest.mark.gpu
@cuda
def test_fused_epilogue_gradient_masks_like_relu():
    from kernels.ops import depthwise_conv2d

    x = torch.randn(2, 16, 9, 9, device="cuda", dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, 1, 3, 3, device="cuda", dtype=torch.float64, requires_grad=True)
    b = torch.randn(16, device="cuda", dtype=torch.float64, requires_grad=True)
    for activation in ("relu", "relu6"):
        assert torch.autograd.gradcheck(lambda x, w, b: depthwise_conv2d(x, w, b, 1, 1, activation=activation) * 3,
                                        (x, w, b))


@pytest.mark.gpu
@cuda
def test_opcheck_with_activation():
    from kernels.ops import depthwise_conv2d  # noqa: F401  (loads the op)

    op = torch.ops.mobilenet_dw.depthwise_fwd.default
    for dtype, fmt in [(torch.float32, torch.contiguous_format), (torch.float16, torch.channels_last)]:
        x = torch.randn(2, 8, 9, 9, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
        w = torch.randn(8, 1, 3, 3, device="cuda", dtype=dtype)
        b = torch.randn(8, device="cuda", dtype=dtype)
        for activation in (1, 2):
            torch.library.opcheck(op, (x, w, b, [1, 1], [1, 1], [1, 1], activation))
            torch.library.opcheck(op, (x.clone().requires_grad_(), w.clone().requires_grad_(), b, [2, 2], [1, 1],
                                       [1, 1], activation))


def _gpu_path(backend: str, dtype: str, cuda_graph: str, resolution: int = 64):
    overrides = ["data=synthetic", f"data.resolution={resolution}", f"backend={backend}", "channels_last=true",
                 f"cuda_graph={cuda_graph}"]
    if dtype != "fp32":
        overrides += ["amp=true", f"amp_dtype={dtype}"]
    cfg = compose(overrides)
    torch.manual_seed(0)
    model = _calibrated(MobileNetV1(num_classes=100).cuda(), resolution=resolution)
    model = model.to(memory_format=torch.channels_last)
    return cfg, model, build_path(model, cfg, torch.device("cuda"))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", ["custom", "cudnn", "torch"])
def test_replayed_forward_is_bit_equal_to_eager(backend):
    cfg, _, eager = _gpu_path(backend, "fp16", "false")
    _, _, replayed = _gpu_path(backend, "fp16", "true")
    assert replayed.rows["CUDA graph"].startswith("on (cuda_graph=true")
    for seed in (1, 2):
        x = torch.randn(16, 3, 64, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        x = x.half().contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            want = eager.forward(x).clone()
            got = replayed.forward(x).clone()
            got_partial = replayed.forward(x[:5]).clone()  # another shape: another graph
        assert torch.equal(got, want)
        assert torch.equal(got_partial, eager.forward(x[:5]))
    assert replayed.forward.graphs == 2


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", ["custom", "cudnn"])
def test_fp16_folding_keeps_the_predictions_of_10000_inputs(backend, tmp_path):
    # A trained model: an untrained one's logits are near-ties that any fp16 rounding reorders.
    from mobilenet.engine import Trainer

    train = [f"backend={backend}", "amp=true", "channels_last=true", "epochs=6", "progress=false", "evaluate=false",
             "save_checkpoints=false", f"log_root={tmp_path}"]
    trainer = Trainer(compose(train), tmp_path / "run")
    trainer.fit()
    model = trainer.model.eval()
    fast = build_path(model, compose([*train, "cuda_graph=true"]), torch.device("cuda"))
    assert fast.rows["fused epilogue"].startswith("on") and fast.rows["CUDA graph"].startswith("on")
    agree = total = 0
    worst = 0.0
    with torch.inference_mode():
        while total < 10_000:  # augmented training images: 10,000 distinct inputs from 1,437 digits
            for images, _ in trainer.train_loader:
                ref = model(images.float())  # fp32, unfolded
                out = fast.forward(images).float()
                agree += (out.argmax(1) == ref.argmax(1)).sum().item()
                total += images.shape[0]
                worst = max(worst, ((out - ref).abs().max() / ref.abs().max()).item())
    assert agree / total >= 0.999, f"top-1 agrees on {agree} of {total}"
    assert worst <= 1e-2, f"largest logit difference {worst:.2e} of the largest logit"
