"""Tests of norm.apply_in_pointwise: the BatchNorm + ReLU before each pointwise conv computing only its statistics,
and cuDNN's fused convolutions (kernels/norm_pointwise.py, through cudnn-frontend) applying it as they load their
input, run as one pair and, across MobileNetV1's blocks, by the model.

CPU (CI): the config composes (off by default), auto is off where it cannot run and says why (cudnn-frontend
missing included, with how to install it), true is refused there, norm.stats_from_pointwise is refused without the
switch, the model refuses other norms, the state_dict is the same with the switch on, a CPU training forward stops
naming CUDA, and the summary names the switch and where the next BatchNorm's statistics come from. GPU (`pytest -m
gpu`, with nvidia-cudnn-frontend installed): the pair against float64 (forward and all four gradients, poisoned
outputs), the normalize within its operands' rounding, the next BatchNorm's statistics from the pair's output sums,
what is repeatable, the running statistics bitwise those of the separate ops, opcheck, clear errors, and a whole
MobileNetV1 step with the switch on against off within the noise floor (the statistics from the BatchNorm's own pass
and from cuDNN's sums), bitwise repeatable with its own pass, and captured in a CUDA graph against eager; the depthwise
pair, the BatchNorm after it and the pointwise conv as one function (the middle BatchNorm's input gradient applied by
the depthwise backward) bit for bit the two pairs in turn, alone and in the model's ring layers.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from mobilenet.config import compose
from mobilenet.model import MobileNetV1
from mobilenet.norm import NormUnavailable
from test_depthwise_backward_walk import backward_mode  # noqa: F401 (a fixture)
from test_norm_in_depthwise import _batch, _model_pair, _poison
from test_norm_in_depthwise import _step as _depthwise_step

HAS_FRONTEND = importlib.util.find_spec("cudnn") is not None
PAIR = ["backend=custom", "norm=custom", "channels_last=true", "amp=true", "data=synthetic"]

# ---------------------------------------------------------------------------------------------- CPU tests


def test_config_default_is_auto_and_each_choice_resolves():
    from mobilenet.model import apply_in_pointwise_state

    assert compose([]).norm.apply_in_pointwise == "auto"
    assert compose([]).norm.stats_from_pointwise is False
    assert apply_in_pointwise_state(compose([*PAIR, "norm.apply_in_pointwise=false"])) == (
        False, "norm.apply_in_pointwise=false")
    if HAS_FRONTEND:
        assert apply_in_pointwise_state(compose(PAIR)) == (True, "norm.apply_in_pointwise=auto")
        assert apply_in_pointwise_state(compose([*PAIR, "norm.apply_in_pointwise=true"])) == (
            True, "norm.apply_in_pointwise=true")


def test_without_cudnn_frontend_auto_is_off_and_true_says_how_to_install_it(monkeypatch):
    from mobilenet.errors import ConfigError
    from mobilenet.model import apply_in_pointwise_state

    # A dependency, so normally installed: a None entry in sys.modules makes the package unimportable here, as in an
    # environment that lacks it (monkeypatch restores the entry).
    monkeypatch.setitem(sys.modules, "cudnn", None)

    applied, why = apply_in_pointwise_state(compose([*PAIR, "norm.apply_in_pointwise=auto"]))
    assert not applied and "nvidia-cudnn-frontend, which is not installed: pip install" in why
    with pytest.raises(ConfigError, match=r"norm.apply_in_pointwise=true needs nvidia-cudnn-frontend, which is not "
                                          r"installed: pip install 'nvidia-cudnn-frontend>=1.16,<1.17'"):
        apply_in_pointwise_state(compose([*PAIR, "norm.apply_in_pointwise=true"]))


_BLOCKED = [
    (["norm=torch", "channels_last=true", "amp=true"], "norm=custom"),
    (["norm=custom", "channels_last=false", "amp=true"], "channels_last=true"),
    (["norm=custom", "channels_last=true", "amp=false"], "amp=true amp_dtype=fp16"),
    (["norm=custom", "channels_last=true", "amp=true", "amp_dtype=bf16"], "amp=true amp_dtype=fp16"),
    (["norm=custom", "channels_last=true", "amp=true", "sync_bn=true"], "sync_bn=false"),
    (["norm=custom", "channels_last=true", "amp=true", "compile=true"], "compile=false"),
    (["norm=custom", "channels_last=true", "amp=true", "backend=custom", "norm.stats_from_depthwise=true"],
     "norm.stats_from_depthwise=false"),
    (["norm=custom", "channels_last=true", "amp=true", "model.width_mult=0.3"], "multiples of 8"),
]


@pytest.mark.parametrize("overrides, missing", _BLOCKED)
def test_auto_is_off_and_true_refused_where_it_cannot_run(overrides, missing):
    from mobilenet.engine import _check_apply_in_depthwise
    from mobilenet.errors import ConfigError
    from mobilenet.model import apply_in_pointwise_state

    cfg = compose([*overrides, "norm.apply_in_pointwise=auto"])
    _check_apply_in_depthwise(cfg)  # auto refuses nothing
    applied, why = apply_in_pointwise_state(cfg)
    assert not applied and why.startswith("norm.apply_in_pointwise=auto: off, it needs ") and missing in why
    with pytest.raises(ConfigError, match=f"norm.apply_in_pointwise=true needs .*{missing}"):
        _check_apply_in_depthwise(compose([*overrides, "norm.apply_in_pointwise=true"]))


def test_width_point_three_names_the_channel_counts():
    from mobilenet.model import apply_in_pointwise_state, pointwise_channels

    assert pointwise_channels(1.0)[:2] == [(32, 64), (64, 128)] and pointwise_channels(1.0)[-1] == (1024, 1024)
    why = apply_in_pointwise_state(compose([*PAIR, "model.width_mult=0.3", "norm.apply_in_pointwise=auto"]))[1]
    assert ("model.width_mult=0.3 gives 9->19, 19->38, 38->38, 38->76, 76->76, 76->153, 153->153, 153->307, "
            "307->307)") in why


def test_build_for_run_follows_the_resolved_switch():
    from mobilenet.engine import build_for_run

    model = build_for_run(compose([*PAIR, "norm.apply_in_pointwise=false", "model.width_mult=0.25"]),
                          torch.device("cpu"), 10)
    assert not model.apply_norm_in_pointwise
    if HAS_FRONTEND:
        model = build_for_run(compose([*PAIR, "model.width_mult=0.25", "norm.apply_in_pointwise=true"]),
                              torch.device("cpu"), 10)
        assert model.apply_norm_in_pointwise and not model.stats_from_pointwise
        model = build_for_run(compose([*PAIR, "model.width_mult=0.25", "norm.apply_in_pointwise=true",
                                       "norm.stats_from_pointwise=true"]), torch.device("cpu"), 10)
        assert model.apply_norm_in_pointwise and model.stats_from_pointwise


def test_stats_from_pointwise_is_refused_without_the_fused_pointwise_convs():
    from mobilenet.config import ConfigError
    from mobilenet.engine import _check_stats_from_pointwise

    cfg = compose([*PAIR, "norm.apply_in_pointwise=false", "norm.stats_from_pointwise=true"])
    with pytest.raises(ConfigError, match=r"norm.stats_from_pointwise=true needs norm.apply_in_pointwise on, whose "
                                          r"fused convolutions compute the sums \(this run: "
                                          r"norm.apply_in_pointwise=false\); or set norm.stats_from_pointwise=false"):
        _check_stats_from_pointwise(cfg)
    cfg = compose([*PAIR, "channels_last=false", "norm.apply_in_pointwise=auto", "norm.stats_from_pointwise=true"])
    with pytest.raises(ConfigError, match=r"\(this run: norm.apply_in_pointwise=auto: off, it needs "
                                          r"channels_last=true"):
        _check_stats_from_pointwise(cfg)
    _check_stats_from_pointwise(compose(PAIR))  # off: nothing to refuse
    if HAS_FRONTEND:
        _check_stats_from_pointwise(compose([*PAIR, "norm.apply_in_pointwise=true", "norm.stats_from_pointwise=true"]))
    with pytest.raises(ValueError, match="stats_from_pointwise takes the sums of the fused pointwise convs: it needs "
                                         "apply_norm_in_pointwise"):
        MobileNetV1(num_classes=10, width_mult=0.25, norm="custom", stats_from_pointwise=True)


def test_model_refuses_other_norms_at_construction():
    with pytest.raises(NormUnavailable, match="norm.apply_in_pointwise needs norm=custom without sync_bn"):
        MobileNetV1(num_classes=10, width_mult=0.25, norm="torch", apply_norm_in_pointwise=True)
    with pytest.raises(ValueError, match="stats_from_depthwise and apply_norm_in_pointwise cannot both be on"):
        MobileNetV1(num_classes=10, width_mult=0.25, depthwise="custom", norm="custom", stats_from_depthwise=True,
                    apply_norm_in_pointwise=True)


def test_state_dict_is_the_same_with_the_switch_on():
    off = MobileNetV1(num_classes=10, width_mult=0.25, norm="custom")
    on = MobileNetV1(num_classes=10, width_mult=0.25, norm="custom", apply_norm_in_pointwise=True)
    assert list(off.state_dict()) == list(on.state_dict())
    on.load_state_dict(off.state_dict())
    MobileNetV1(num_classes=10, width_mult=0.25).load_state_dict(on.state_dict())


def test_training_forward_on_cpu_stops_naming_cuda():
    model = MobileNetV1(num_classes=10, width_mult=0.25, norm="custom", apply_norm_in_pointwise=True)
    model.features[0][1] = torch.nn.Identity()  # let the stem's output through to the first pointwise pair
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    with pytest.raises(NormUnavailable, match="apply_in_pointwise is on: cuDNN's fused convolutions need a CUDA"):
        model.train()(x)


def test_summary_names_the_switch():
    from mobilenet.run_record import norm_label

    assert norm_label(compose([*PAIR, "norm.apply_in_pointwise=false"])).endswith(" (norm.apply_in_pointwise=false)")
    label = norm_label(compose([*PAIR, "norm.apply_in_depthwise=false", "channels_last=false"]))
    assert "(norm.apply_in_pointwise=auto: off, it needs channels_last=true" in label
    if HAS_FRONTEND:
        assert norm_label(compose(PAIR)).endswith(
            " (applied by cuDNN's fused pointwise conv after it, in training; norm.apply_in_pointwise=auto)")
        assert norm_label(compose([*PAIR, "norm.apply_in_pointwise=true", "norm.stats_from_pointwise=true"])).endswith(
            " (applied by cuDNN's fused pointwise conv after it, in training; norm.apply_in_pointwise=true; the "
            "BatchNorm after that conv takes its statistics from cuDNN's sums, norm.stats_from_pointwise=true: not "
            "bitwise repeatable)")
    assert norm_label(compose(PAIR), training=False) == "custom"


# ---------------------------------------------------------------------------------------------- GPU tests

gpu = pytest.mark.gpu
needs_frontend = pytest.mark.skipif(not HAS_FRONTEND, reason="needs nvidia-cudnn-frontend")

_CASES = [(4, 32, 64, 28, 28), (3, 64, 128, 14, 14), (2, 512, 512, 7, 7), (5, 8, 16, 9, 11), (1, 256, 8, 3, 3)]
_TOL = 1e-2  # fp16: max |difference| / max |float64|, as for the other fused ops


def _ids(case):
    return "x".join(map(str, case))


def _inputs(case, dtype, mean=0.0, seed=0):
    """y (channels_last, in dtype), the BatchNorm's fp32 weight and bias, the 1x1 conv weight in dtype, and a
    gradient of the conv's output."""
    n, c, k, h, w = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    y = ((torch.randn(n, c, h, w, device="cuda", generator=g) * 2 + mean).to(dtype)
         .contiguous(memory_format=torch.channels_last))
    bn_w = torch.rand(c, device="cuda", generator=g) + 0.5
    bn_b = torch.randn(c, device="cuda", generator=g) * 0.5
    conv_w = (torch.randn(k, c, 1, 1, device="cuda", generator=g) / c ** 0.5).to(dtype)
    grad = torch.randn(n, k, h, w, device="cuda", generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
    return y, bn_w, bn_b, conv_w, grad


def _fused(y, bn_w, bn_b, conv_w, grad):
    from kernels.norm_pointwise import batch_norm_relu_conv1x1
    from test_kernels import _poison_allocator

    leaves = [t.detach().clone().requires_grad_() for t in (y, bn_w, bn_b, conv_w)]
    _poison_allocator(64 << 20)
    out, sums = batch_norm_relu_conv1x1(*leaves)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves] + [sums]


def _reference(y, bn_w, bn_b, conv_w, grad):
    """float64 output and gradients. The convolution's input is what the fused graphs compute, relu(y * scale +
    shift) with cuDNN's fp16 operands (mobilenet_bn::bn_scale_shift), taken straight through to the BatchNorm's
    float64 gradients, whose ReLU mask is the one the custom BatchNorm stores (so an element within rounding of zero
    does not move a gradient by a whole value)."""
    from kernels.norm_ops import batch_norm_relu_train

    y64, bw, bb, cw = (t.detach().double().requires_grad_() for t in (y, bn_w, bn_b, conv_w))
    stored, mean, invstd, _ = batch_norm_relu_train(y, bn_w, bn_b)
    scale, shift = torch.ops.mobilenet_bn.bn_scale_shift(mean, invstd, bn_w, bn_b, y.dtype).double()
    loaded = (y.double() * scale[:, None, None] + shift[:, None, None]).relu()
    pre = F.batch_norm(y64, None, None, bw, bb, training=True, eps=1e-5)
    x64 = pre * (stored > 0)
    x64 = x64 + (loaded - x64).detach()
    out = F.conv2d(x64, cw)
    out.backward(grad.double())
    return [out.detach(), y64.grad, bw.grad, bb.grad, cw.grad]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@gpu
@needs_frontend
@pytest.mark.parametrize("mean", [0.0, 3.0, 300.0], ids=["mean0", "mean3", "mean300"])
@pytest.mark.parametrize("case", _CASES, ids=_ids)
def test_pair_against_float64(case, mean):
    y, bn_w, bn_b, conv_w, grad = _inputs(case, torch.float16, mean=mean, seed=1)
    got = _fused(y, bn_w, bn_b, conv_w, grad)
    for t in got:
        assert torch.isfinite(t).all(), "an output element was not written"
    ref = _reference(y, bn_w, bn_b, conv_w, grad)
    for i, (a, want) in enumerate(zip(got[:-1], ref)):
        # With a mean of 300 the BatchNorm's input gradient subtracts nearly equal terms of y's rounding (as for
        # norm.apply_in_depthwise and the separate ops); the other outputs are held to float64 as everywhere.
        if not (mean == 300.0 and i == 1):
            assert _rel(a, want) < _TOL, i
    out = got[0].double()
    sums = torch.stack([out.sum((0, 2, 3)), out.square().sum((0, 2, 3))])
    # genstats sums the convolution's fp32 results before they are rounded to fp16 and stored: 1.4e-4 was measured
    # on an H200 for the smallest case (9 values per channel)
    assert _rel(got[-1], sums) < 1e-3


@gpu
@needs_frontend
@pytest.mark.parametrize("mean", [0.0, 3.0, 30.0], ids=["mean0", "mean3", "mean30"])
def test_the_normalize_is_the_batchnorms_within_the_shift_operands_rounding(mean):
    """What the fused graphs normalize with, relu(y * scale + shift) in fp16 operands, against relu(batch_norm(y)) in
    float64: off by at most the shift's rounding, |shift| * 2^-11, plus the scale's, |(y - mean) * scale| * 2^-11 (the
    shift is taken against the rounded scale), so a mean of many deviations costs accuracy: mean 30 / std 2 puts
    about 7e-3 of a unit into every value."""
    y, bn_w, bn_b, _, _ = _inputs((8, 64, 128, 14, 14), torch.float16, mean=mean, seed=5)
    from kernels.norm_ops import batch_norm_relu_train

    _, m, invstd, _ = batch_norm_relu_train(y, bn_w, bn_b)
    scale, shift = torch.ops.mobilenet_bn.bn_scale_shift(m, invstd, bn_w, bn_b, torch.float16).double()
    y64 = y.double()
    loaded = (y64 * scale[:, None, None] + shift[:, None, None]).relu()
    exact = F.batch_norm(y64, None, None, bn_w.double(), bn_b.double(), training=True, eps=1e-5).relu()
    centred = (y64 - m.double()[:, None, None]) * scale[:, None, None]
    bound = (shift.abs()[:, None, None] + centred.abs()) * 2.0**-11
    assert ((loaded - exact).abs() <= bound + 1e-5).all()  # 1e-5: the fp32 statistics against float64's


@gpu
@needs_frontend
def test_only_the_sums_vary_between_calls():
    """cuDNN's genstats adds its blocks' sums with atomics, in no fixed order: the sums (so the next BatchNorm's
    statistics) vary in their last bits between calls, which is why norm.apply_in_pointwise is off by default. The
    output and every gradient are bitwise repeatable."""
    y, bn_w, bn_b, conv_w, grad = _inputs((16, 128, 256, 14, 14), torch.float16, mean=1.0, seed=7)
    first, second = _fused(y, bn_w, bn_b, conv_w, grad), _fused(y, bn_w, bn_b, conv_w, grad)
    for i, (a, b) in enumerate(zip(first[:-1], second[:-1])):
        assert torch.equal(a, b), i
    assert _rel(first[-1], second[-1]) < 1e-5


@gpu
@needs_frontend
def test_statistics_from_the_sums_against_float64():
    """The next BatchNorm's statistics from the pair's sums (stats_from_sums), and its running statistics, against
    float64 ones of the stored output."""
    from kernels.norm_pointwise import batch_norm_relu_conv1x1, stats_from_sums

    y, bn_w, bn_b, conv_w, _ = _inputs((8, 64, 128, 14, 14), torch.float16, mean=1.0, seed=3)
    out, sums = batch_norm_relu_conv1x1(y, bn_w, bn_b, conv_w)
    running = [torch.rand(128, device="cuda"), torch.rand(128, device="cuda") + 0.5, torch.tensor(5, device="cuda")]
    before = [t.clone() for t in running]
    count = out.numel() // out.shape[1]
    mean, invstd = stats_from_sums(sums, count, 1e-5, *running, momentum=0.1)
    o = out.double()
    ref_mean, ref_var = o.mean((0, 2, 3)), o.var((0, 2, 3), unbiased=False)
    assert _rel(mean, ref_mean) < 1e-4
    assert _rel(invstd, (ref_var + 1e-5).rsqrt()) < 1e-4
    assert _rel(running[0], 0.9 * before[0] + 0.1 * ref_mean) < 1e-5
    assert _rel(running[1], 0.9 * before[1] + 0.1 * ref_var * count / (count - 1)) < 1e-4
    assert int(running[2]) == 6


@gpu
@needs_frontend
def test_running_statistics_are_the_separate_ops_bits():
    from kernels.norm_ops import batch_norm_relu_train_update
    from kernels.norm_pointwise import batch_norm_relu_conv1x1

    y, bn_w, bn_b, conv_w, _ = _inputs((8, 64, 32, 20, 20), torch.float16, mean=3.0, seed=4)
    states = [[torch.rand(64, device="cuda"), torch.rand(64, device="cuda") + 0.5, torch.tensor(3, device="cuda")]
              for _ in range(2)]
    for a, b in zip(states[1], states[0]):
        a.copy_(b)
    batch_norm_relu_conv1x1(y, bn_w, bn_b, conv_w, 1e-5, *states[0], momentum=0.1)  # the statistics pass's update
    batch_norm_relu_train_update(y, bn_w, bn_b, *states[1], 1e-5, 0.1)
    for a, b in zip(states[0], states[1]):
        assert torch.equal(a, b)
    assert int(states[0][2]) == 4


@gpu
@needs_frontend
def test_ops_opcheck_and_clear_errors():
    from kernels.norm_pointwise import batch_norm_relu_conv1x1

    y, bn_w, bn_b, conv_w, grad = _inputs((4, 16, 24, 9, 9), torch.float16, seed=6)
    mean, invstd, _ = torch.ops.mobilenet_bn.bn_stats.default(y, bn_w, bn_b, 1e-5)
    scale_shift = torch.ops.mobilenet_bn.bn_scale_shift.default(mean, invstd, bn_w, bn_b, torch.float16)
    assert scale_shift.dtype == torch.float16 and scale_shift.shape == (2, 16)
    torch.library.opcheck(torch.ops.mobilenet_bn.bn_scale_shift.default, (mean, invstd, bn_w, bn_b, torch.float16))
    torch.library.opcheck(torch.ops.mobilenet_cudnn.sbr_conv1x1.default, (y, scale_shift, conv_w))
    torch.library.opcheck(torch.ops.mobilenet_cudnn.sbr_conv1x1_wgrad.default, (grad, y, scale_shift, conv_w))
    sums = torch.rand(2, 16, device="cuda") + torch.tensor([[0.0], [1.0]], device="cuda")
    running = [torch.zeros(16, device="cuda"), torch.ones(16, device="cuda"), torch.tensor(0, device="cuda")]
    torch.library.opcheck(torch.ops.mobilenet_bn.bn_stats_from_sums.default, (sums, 100, *running, 1e-5, 0.1))
    torch.library.opcheck(torch.ops.mobilenet_bn.bn_stats_from_sums.default, (sums, 100, None, None, None, 1e-5, 0.0))
    with pytest.raises(ValueError, match="must be channels_last"):
        batch_norm_relu_conv1x1(y.contiguous(), bn_w, bn_b, conv_w)
    with pytest.raises(ValueError, match="with fp16 inputs only, got torch.bfloat16"):
        batch_norm_relu_conv1x1(y.bfloat16(), bn_w, bn_b, conv_w)
    with pytest.raises(ValueError, match="multiples of 8, got 12 -> 24"):
        batch_norm_relu_conv1x1(y[:, :12].contiguous(memory_format=torch.channels_last), bn_w[:12], bn_b[:12],
                                conv_w[:, :12])
    with pytest.raises(ValueError, match="must be 1x1 over all 16 channels"):
        batch_norm_relu_conv1x1(y, bn_w, bn_b, conv_w.expand(24, 16, 3, 3))


def _models(stats_from_pointwise: bool = False):
    """The model with norm.apply_in_depthwise on, and norm.apply_in_pointwise off and on."""
    return _model_pair({"apply_norm_in_depthwise": True},
                       {"apply_norm_in_pointwise": True, "stats_from_pointwise": stats_from_pointwise})


def _step(model, x, target):
    return _depthwise_step(model, x, target, torch.float16)


def _perturbed(model):
    """A copy of `model` whose weights are each nudged by a random relative 2^-11 (half an fp16 ulp), as
    scripts/compare_loss_curves.py measures its noise floor."""
    import copy

    twin = copy.deepcopy(model)
    gen = torch.Generator(device="cuda").manual_seed(12345)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1 + 2.0**-11 * (torch.randint(0, 2, p.shape, device="cuda", generator=gen) * 2 - 1))
    return twin


def _within_noise(ref, cand, floor):
    """Every tensor of `cand` is as close to `ref` as rounding alone moves it (`floor`: the same step from weights
    perturbed by half an fp16 ulp), with a factor of 3 as compare_loss_curves.py allows."""
    for i, (r, c, f) in enumerate(zip(ref, cand, floor)):
        if not r.is_floating_point():
            assert torch.equal(r, c), i
        else:
            allowed = 3 * (f.double() - r.double()).abs().max() + 1e-6 * r.double().abs().max()
            assert (c.double() - r.double()).abs().max() <= allowed, i


@gpu
@needs_frontend
@pytest.mark.parametrize("stats_from_pointwise", [False, True], ids=["own_stats", "cudnn_sums"])
def test_model_step_with_the_switch_on_trains_like_off(stats_from_pointwise):
    """cuDNN's fused convolutions normalize with fp16 scale and shift operands instead of the BatchNorm's centred
    form, and the next BatchNorm's statistics come from their fp32 sums: the same steps to rounding. At this size a
    step's loss moved by 5e-4 and 7e-4 (H200); its gradients, sums with much cancellation at initialisation, move by
    far more than a weight perturbation of half an fp16 ulp moves them, so they are compared over 300 training steps
    against that noise floor by scripts/compare_loss_curves.py (docs/results/pointwise_norm_fusion_h200.md)."""
    off, on = _models(stats_from_pointwise)
    x, target = _batch()
    for _ in range(2):  # the second step starts from the running statistics the first updated
        ref, cand = _step(off.train(), x, target), _step(on.train(), x, target)
        assert abs(cand[0].item() - ref[0].item()) < 5e-3
        assert all(torch.isfinite(t).all() for t in cand if t.is_floating_point())
        counts = [(a, b) for a, b in zip(ref, cand) if not a.is_floating_point()]  # num_batches_tracked
        assert counts and all(torch.equal(a, b) for a, b in counts)


@gpu
@needs_frontend
def test_model_step_with_its_own_statistics_is_bitwise_repeatable(deterministic_cudnn):
    """Without norm.stats_from_pointwise nothing of the step adds in a varying order: two steps from one state are
    bit for bit the same (cuDNN's sums are computed, and not used)."""
    _, on = _models()
    state = {k: v.clone() for k, v in on.state_dict().items()}
    x, target = _batch()
    first = _step(on.train(), x, target)
    on.load_state_dict(state)
    second = _step(on, x, target)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@gpu
@needs_frontend
@pytest.mark.parametrize("stats_from_pointwise", [False, True], ids=["own_stats", "cudnn_sums"])
def test_captured_model_step_matches_eager(stats_from_pointwise, deterministic_cudnn):
    _, on = _models(stats_from_pointwise)
    state = {k: v.clone() for k, v in on.state_dict().items()}
    x, target = _batch()
    eager = _step(on.train(), x, target)
    on.load_state_dict(state)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _step(on, x, target)  # warm-up, then reset what it updated
    torch.cuda.current_stream().wait_stream(side)
    on.load_state_dict(state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        captured = _step(on, x, target)
    on.load_state_dict(state)
    graph.replay()
    torch.cuda.synchronize()
    if not stats_from_pointwise:
        assert all(torch.equal(a, b) for a, b in zip(eager, captured))
        return
    # Not bitwise: the sums vary between calls (test_only_the_sums_vary_between_calls).
    on.load_state_dict(state)
    _within_noise(eager, captured, _step(_perturbed(on).train(), x, target))


# --- the depthwise pair, the BatchNorm after it and the pointwise conv as one function (next_norm's split) ---------

_TRIPLE_CASES = [(4, 64, 28, 28, 1), (3, 128, 14, 14, 1), (2, 64, 28, 28, 2), (5, 32, 9, 11, 1)]  # (N, C, H, W, stride)


def _triple_inputs(case, seed):
    """y fp16 channels_last, the BatchNorm before (fp32 weight, bias), the depthwise weight, the middle BatchNorm, the
    pointwise weight (2C outputs), the stride, and running statistics for both BatchNorms."""
    from test_norm_in_depthwise import _inputs

    y, bn_w, bn_b, dw_w, stride = _inputs(case, torch.float16, seed=seed)
    c = y.shape[1]
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    mid_w = torch.rand(c, device="cuda", generator=g) + 0.5
    mid_b = torch.randn(c, device="cuda", generator=g) * 0.5
    pw_w = (torch.randn(2 * c, c, 1, 1, device="cuda", generator=g) / c**0.5).half().contiguous(
        memory_format=torch.channels_last)
    running = [(torch.zeros(c, device="cuda"), torch.ones(c, device="cuda"), torch.zeros((), dtype=torch.long,
                                                                                        device="cuda"))
               for _ in range(2)]
    return y, bn_w, bn_b, dw_w, mid_w, mid_b, pw_w, stride, running


def _triple_run(fused: bool, y, bn_w, bn_b, dw_w, mid_w, mid_b, pw_w, stride, running, seed):
    """out, sums, the gradients of y and of the five weights for a random output gradient, and both BatchNorms'
    running statistics: as one function, or as the depthwise pair then the pointwise pair."""
    from kernels.norm_depthwise import batch_norm_relu_depthwise_conv2d
    from kernels.norm_pointwise import batch_norm_relu_conv1x1, batch_norm_relu_depthwise_conv2d_batch_norm_relu_conv1x1
    from test_depthwise_backward_walk import _grad

    leaves = [t.detach().clone().requires_grad_() for t in (y, bn_w, bn_b, dw_w, mid_w, mid_b, pw_w)]
    running = [tuple(t.clone() for t in r) for r in running]
    _poison()
    if fused:
        out, sums = batch_norm_relu_depthwise_conv2d_batch_norm_relu_conv1x1(
            *leaves, stride=stride, padding=(1, 1), running_mean=running[0][0], running_var=running[0][1],
            num_batches_tracked=running[0][2], momentum=0.1, mid_running_mean=running[1][0],
            mid_running_var=running[1][1], mid_num_batches_tracked=running[1][2], mid_momentum=0.1)
    else:
        z = batch_norm_relu_depthwise_conv2d(leaves[0], leaves[1], leaves[2], leaves[3], stride, (1, 1),
                                             running_mean=running[0][0], running_var=running[0][1],
                                             num_batches_tracked=running[0][2], momentum=0.1, walk_sums=True)
        out, sums = batch_norm_relu_conv1x1(z, leaves[4], leaves[5], leaves[6], running_mean=running[1][0],
                                            running_var=running[1][1], num_batches_tracked=running[1][2], momentum=0.1)
    _poison()
    out.backward(_grad(out.shape, out.dtype, seed + 2))
    return [out.detach(), sums] + [t.grad for t in leaves] + [t for r in running for t in r]


@gpu
@needs_frontend
@pytest.mark.parametrize("case", _TRIPLE_CASES, ids=_ids)
def test_pair_and_pointwise_pair_as_one_function_are_the_two_in_turn(case, deterministic_cudnn):
    """The one function gives the output, every gradient and both running statistics of the depthwise pair followed
    by the fused pointwise pair bit for bit (these are checked against float64 by their own tests), with outputs and
    gradients finite where the allocator was poisoned; the sums (cuDNN's atomics) to fp32 rounding."""
    inputs = _triple_inputs(case, seed=sum(case))
    fused = _triple_run(True, *inputs, seed=sum(case))
    separate = _triple_run(False, *inputs, seed=sum(case))
    for i, (a, b) in enumerate(zip(fused, separate)):
        assert torch.isfinite(a.float()).all(), i
        if i == 1:
            assert _rel(a, b) < 1e-5
        else:
            assert torch.equal(a, b), i


@gpu
@needs_frontend
def test_one_function_refuses_what_it_cannot_take():
    from kernels.norm_pointwise import batch_norm_relu_depthwise_conv2d_batch_norm_relu_conv1x1 as triple

    y, bn_w, bn_b, dw_w, mid_w, mid_b, pw_w, _, _ = _triple_inputs((2, 16, 8, 8, 1), seed=0)
    with pytest.raises(ValueError, match=r"batch_norm_relu_depthwise_conv2d_batch_norm_relu_conv1x1: .*padding"):
        triple(y, bn_w, bn_b, dw_w, mid_w, mid_b, pw_w, stride=(1, 1), padding=(0, 0))
    with pytest.raises(ValueError, match="fp16 inputs only"):
        triple(y.bfloat16(), bn_w, bn_b, dw_w.bfloat16(), mid_w, mid_b, pw_w)
    with pytest.raises(ValueError, match="must be 1x1 over all 16 channels"):
        triple(y, bn_w, bn_b, dw_w, mid_w, mid_b, pw_w[:, :8].contiguous(memory_format=torch.channels_last))


@gpu
@needs_frontend
def test_model_step_applies_the_middle_norm_in_the_rings_bit_for_bit(set_knobs, backward_mode, deterministic_cudnn):
    """With the pointwise fusion, MBN_DEPTHWISE_BACKWARD=next_norm_ring (the default) runs the ring layers' depthwise
    pair, BatchNorm and pointwise conv as one function: two steps bit for bit those of the sums mode, the rings
    applying the BatchNorm (their GNORM instantiation), which the sums mode's kernels do not."""
    from test_bwd_ring_norm import _RING
    from test_kernels import _profiled

    sums_model, ring_model = _model_pair({"apply_norm_in_depthwise": True, "apply_norm_in_pointwise": True}, {})
    x, target = _batch()
    set_knobs(BWD_RING=1, BWD_RING_NORM=1)
    for _ in range(2):
        backward_mode("sums")
        a, sums_names = _profiled(lambda: _step(sums_model.train(), x, target))
        backward_mode("next_norm_ring")
        b, names = _profiled(lambda: _step(ring_model.train(), x, target))
        for i, (u, v) in enumerate(zip(a, b)):
            assert torch.equal(u, v), i
        assert any(_RING in n and "true, true>" in n for n in names), "the rings applied no BatchNorm"
        assert not any(_RING in n and "true, true>" in n for n in sums_names)
