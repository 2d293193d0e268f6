"""perf.amp_weight_cast: the weights' autocast casts as one kernel each way give autocast's own numbers (CPU bf16
autocast here; the GPU test runs fp16 and a captured step)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from mobilenet.amp_weights import ALIGN, WeightCastForward, cast_parameters
from mobilenet.config import compose
from mobilenet.engine import Trainer
from mobilenet.errors import ConfigError
from mobilenet.model import MobileNetV1

CPU_FAST = ["model.width_mult=0.25", "device=cpu", "progress=false", "perf.warmup_steps=1", "data=synthetic",
            "data.steps_per_epoch=3", "data.batch_size=4", "data.resolution=32", "data.num_classes=5", "evaluate=false"]


def _model(channels_last: bool, device="cpu"):
    torch.manual_seed(0)
    model = MobileNetV1(num_classes=7, width_mult=0.25).to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def _steps(forward, model, x, labels, dtype, steps=2):
    """`steps` SGD steps under autocast; the losses, then the parameters' gradients and values after the last."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast(x.device.type, dtype=dtype):
            loss = F.cross_entropy(forward(x), labels)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}, {
        n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_one_cast_each_way_gives_autocasts_losses_gradients_and_steps_bitwise(channels_last):
    plain, fused = _model(channels_last), _model(channels_last)
    wrapper = WeightCastForward(fused, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 32, 32, generator=g)
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    labels = torch.randint(0, 7, (4,), generator=g)
    want = _steps(plain, plain, x, labels, torch.bfloat16)
    got = _steps(wrapper, fused, x, labels, torch.bfloat16)
    for a, b in zip(want[0], got[0]):
        assert torch.equal(a, b)
    for name in want[1]:
        assert torch.equal(want[1][name], got[1][name]), name
        assert torch.equal(want[2][name], got[2][name]), name


def _inside(event, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def _casts(forward, x, dtype=torch.bfloat16):
    """The dtype conversions (aten::_to_copy) in one forward and backward under bf16 autocast, without those the CPU
    convolution backward makes inside itself (a GPU's cuDNN makes none)."""
    from torch.profiler import profile

    with profile() as prof:
        with torch.autocast(x.device.type, dtype=dtype):
            out = forward(x)
        out.float().sum().backward()
    return sum(1 for e in prof.events()
               if e.name == "aten::_to_copy" and not _inside(e, "aten::convolution_backward"))


def test_the_weights_are_cast_by_one_conversion_each_way_instead_of_one_per_weight():
    plain, fused = _model(True), _model(True)
    wrapper = WeightCastForward(fused, torch.bfloat16)
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    n = len(cast_parameters(plain))
    # autocast: each weight down and its gradient up; besides them the input, the pooling's and the loss's casts
    # (the same few in both)
    others = _casts(wrapper, x) - 2
    assert _casts(plain, x) == 2 * n + others
    assert others <= 8


def test_the_parameters_keep_their_names_memory_format_and_live_in_one_buffer():
    model = _model(channels_last=True)
    before = {n: (p, p.detach().clone(), p.stride()) for n, p in model.named_parameters()}
    wrapper = WeightCastForward(model, torch.bfloat16)
    named = cast_parameters(model)
    assert len(named) == 2 + 13 * 2 + 1  # the stem conv, 13 depthwise + 13 pointwise, the classifier's weight + bias
    start, end = wrapper.flat.data_ptr(), wrapper.flat.data_ptr() + wrapper.flat.numel() * 4
    for name, p in model.named_parameters():
        obj, value, stride = before[name]
        assert p is obj and torch.equal(p, value) and p.stride() == stride, name
        assert (start <= p.data_ptr() < end) == (name in dict(named)), name
        if name in dict(named):  # each view starts on its own 64-element boundary
            assert (p.data_ptr() - start) % (ALIGN * 4) == 0, name
    state = copy.deepcopy(model.state_dict())
    fresh = _model(channels_last=False)
    fresh.load_state_dict(state)  # a checkpoint of the flattened model loads into a plain one
    for name, p in fresh.named_parameters():
        assert torch.equal(p, before[name][1])


def test_gradients_in_another_layout_land_where_their_parameter_lies_in_the_buffer():
    # cuDNN hands back weight gradients whose size-1 dimensions have other strides, and may return another layout.
    from mobilenet.amp_weights import _gather
    depthwise = torch.randn(8, 1, 3, 3)  # strides (9, 9, 3, 1)
    pointwise = torch.randn(8, 4, 2, 2).contiguous(memory_format=torch.channels_last)  # 128 values
    layouts = [(depthwise.shape, depthwise.stride(), 0), (pointwise.shape, pointwise.stride(), 2 * ALIGN)]
    odd_strides = torch.as_strided(depthwise, depthwise.shape, (9, 1, 3, 1))  # the same memory order
    pad = torch.zeros(ALIGN)
    flat = _gather([odd_strides, pointwise.contiguous()], layouts, 4 * ALIGN, pad)
    assert flat.shape == (4 * ALIGN,)
    assert torch.equal(flat.as_strided(depthwise.shape, depthwise.stride(), 0), depthwise)
    assert torch.equal(flat.as_strided(pointwise.shape, pointwise.stride(), 2 * ALIGN), pointwise)
    assert not flat[depthwise.numel():2 * ALIGN].any()


def test_eval_mode_and_autocast_off_run_the_model_as_it_is():
    model = _model(channels_last=False)
    wrapper = WeightCastForward(model, torch.bfloat16)
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(wrapper(x), model(x))
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(wrapper(x), model(x))


def test_true_is_refused_where_it_cannot_run_and_auto_says_why_it_stayed_off(run_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"perf.amp_weight_cast=true cannot run here: amp=false\. Use"):
        Trainer(compose([*CPU_FAST, "perf.amp_weight_cast=true"]), run_dir)
    with pytest.raises(ConfigError, match="cannot run here: compile=true, whose compiler fuses the casts itself"):
        Trainer(compose([*CPU_FAST, "perf.amp_weight_cast=true", "amp=true", "amp_dtype=bf16", "compile=true"]), run_dir)
    with pytest.raises(ConfigError, match="perf.amp_weight_cast='sometimes' is not a choice; choose one of: auto, true"):
        Trainer(compose([*CPU_FAST, "perf.amp_weight_cast=sometimes", "amp=true", "amp_dtype=bf16"]), run_dir)
    trainer = Trainer(compose([*CPU_FAST, "amp=true", "amp_dtype=bf16", "compile=true"]), tmp_path / "auto")
    assert not isinstance(trainer.forward, WeightCastForward)
    assert trainer.weight_cast_state == ("autocast's, one kernel per weight each way (perf.amp_weight_cast=auto: "
                                         "compile=true, whose compiler fuses the casts itself)")


def test_auto_stays_off_for_a_weight_it_cannot_flatten_and_true_refuses_it():
    from mobilenet.amp_weights import plan
    model = _model(channels_last=False)
    conv = model.features[0][0]
    conv.weight.data = torch.randn(2 * conv.weight.shape[0], *conv.weight.shape[1:])[::2]  # every other filter
    cfg = compose([*CPU_FAST, "amp=true", "amp_dtype=bf16"])
    assert plan(cfg, False, model) == (False, "autocast's, one kernel per weight each way (perf.amp_weight_cast=auto: "
                                              "a weight that is not a dense fp32 tensor on the first one's device)")
    with pytest.raises(ValueError, match="cannot run here: a weight that is not a dense fp32 tensor"):
        plan(compose([*CPU_FAST, "amp=true", "amp_dtype=bf16", "perf.amp_weight_cast=true"]), False, model)
    with pytest.raises(ValueError, match=r"every cast weight must be a dense float32 tensor on one device, got "
                                         r"torch.float32 \(8, 3, 3, 3\)"):
        WeightCastForward(model, torch.bfloat16)


def test_a_cpu_bf16_training_run_with_it_trains_like_one_without(run_dir, tmp_path):
    results = []
    for flag in ("false", "auto"):  # auto: on, as nothing here blocks it
        trainer = Trainer(compose([*CPU_FAST, "amp=true", "amp_dtype=bf16", f"perf.amp_weight_cast={flag}",
                                   "save_checkpoints=false", "epochs=1"]), tmp_path / flag)
        assert isinstance(trainer.forward, WeightCastForward) == (flag == "auto")
        result = trainer.fit()
        assert trainer.summary_rows(result)["weight casts"] == (
            "one kernel each way for the 29 convolution and linear parameters (perf.amp_weight_cast=auto)" if flag == "auto"
            else "autocast's, one kernel per weight each way (perf.amp_weight_cast=false)")
        results.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


gpu = pytest.mark.gpu


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_steps_equal_autocasts_bitwise(dtype, deterministic_cudnn):
    plain, fused = _model(True, "cuda"), _model(True, "cuda")
    wrapper = WeightCastForward(fused, dtype)
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(8, 3, 64, 64, device="cuda", generator=g).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 7, (8,), device="cuda", generator=g)
    want = _steps(plain, plain, x, labels, dtype)
    got = _steps(wrapper, fused, x, labels, dtype)
    for name in want[1]:
        assert torch.equal(want[1][name], got[1][name]), name
        assert torch.equal(want[2][name], got[2][name]), name
    others = _casts(wrapper, x, dtype) - 2
    assert _casts(plain, x, dtype) == 2 * len(cast_parameters(plain)) + others


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_fp16_run_with_it_trains(tmp_path):
    overrides = ["model.width_mult=0.25", "progress=false", "perf.warmup_steps=2", "data=synthetic",
                 "data.steps_per_epoch=12", "data.batch_size=16", "data.resolution=64", "data.num_classes=5",
                 "evaluate=false", "save_checkpoints=false", "epochs=1", "amp=true", "channels_last=true",
                 "backend=custom", "norm=custom", "cuda_graph=true", "perf.amp_weight_cast=true"]
    trainer = Trainer(compose(overrides), tmp_path / "run")
    assert isinstance(trainer.forward, WeightCastForward)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    assert trainer.graphed is not None and trainer.graphed.graph is not None
    for name, p in trainer.model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p, before[name]), name
