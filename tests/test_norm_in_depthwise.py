"""Tests of norm.apply_in_depthwise: the BatchNorm + ReLU before a depthwise conv computing only its statistics
(mobilenet_bn::bn_stats, bn_stats_update), and the depthwise forward and weight gradient that normalize their input
as they load it (mobilenet_dw::depthwise_fwd_normed, depthwise_wgrad_normed), run as one pair by
kernels/norm_depthwise.py and, across MobileNetV1's blocks, by the model.

CPU (CI): the config composes (auto by default), validate() refuses true without what it needs, auto is
off there and says why, the model builder follows the resolved switch, the model refuses other norms or
backends and the two fusions together, the state_dict is the same with the switch on, a CPU training forward stops
naming CUDA, and the summary names the switch. GPU (`pytest -m gpu`): the pair against float64 (forward and all four
gradients, poisoned outputs, odd shapes, a large mean), bitwise the two separate ops where both run the column walks
the running statistics bitwise those of the separate ops, opcheck, clear errors for cases the walk does not take, and
a whole MobileNetV1 step with the switch on equal to the step with it off (bitwise but the depthwise weights'
gradients with MBN_DEPTHWISE_BACKWARD=walk|separate, to the BatchNorm sums' order with the default, sums), and the
captured step bitwise the eager one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mobilenet.config import compose
from mobilenet.model import MobileNetV1
from mobilenet.norm import NormUnavailable
from test_kernels import _profiled

# ---------------------------------------------------------------------------------------------- CPU tests


def test_config_default_is_auto_and_composes_each_choice():
    from mobilenet.model import apply_in_depthwise_state

    assert compose([]).norm.apply_in_depthwise == "auto"
    pair = ["backend=custom", "norm=custom", "channels_last=true", "data=synthetic"]
    assert apply_in_depthwise_state(compose(pair)) == (True, "norm.apply_in_depthwise=auto")
    assert apply_in_depthwise_state(compose([*pair, "norm.apply_in_depthwise=true"])) == (
        True, "norm.apply_in_depthwise=true")
    assert apply_in_depthwise_state(compose([*pair, "norm.apply_in_depthwise=false"])) == (
        False, "norm.apply_in_depthwise=false")


def test_an_unknown_value_is_refused_naming_the_choices():
    from mobilenet.errors import ConfigError
    from mobilenet.model import apply_in_depthwise_state

    with pytest.raises(ConfigError, match="norm.apply_in_depthwise='sometimes' is not a choice; choose one of: "
                                          "auto, true, false"):
        apply_in_depthwise_state(compose(["norm.apply_in_depthwise=sometimes"]))


_BLOCKED = [
    (["backend=cudnn", "norm=custom", "channels_last=true"], "backend=custom"),
    (["backend=custom", "norm=apex", "channels_last=true"], "norm=custom"),
    (["backend=custom", "norm=custom", "channels_last=false"], "channels_last=true"),
    (["backend=custom", "norm=custom", "channels_last=true", "sync_bn=true"], "sync_bn=false"),
    (["backend=custom", "norm=custom", "channels_last=true", "compile=true"], "compile=false"),
    (["backend=custom", "norm=custom", "channels_last=true", "norm.stats_from_depthwise=true"],
     "norm.stats_from_depthwise=false"),
]


@pytest.mark.parametrize("overrides, missing", _BLOCKED)
def test_validate_refuses_true_where_it_cannot_run(overrides, missing):
    from mobilenet.engine import _check_apply_in_depthwise
    from mobilenet.errors import ConfigError

    with pytest.raises(ConfigError, match=f"norm.apply_in_depthwise=true needs .*{missing}"):
        _check_apply_in_depthwise(compose([*overrides, "norm.apply_in_depthwise=true"]))
    _check_apply_in_depthwise(compose([*overrides, "norm.apply_in_depthwise=false"]))  # off: nothing to refuse


@pytest.mark.parametrize("overrides, missing", _BLOCKED)
def test_auto_is_off_where_it_cannot_run_and_says_why(overrides, missing):
    from mobilenet.engine import _check_apply_in_depthwise
    from mobilenet.model import apply_in_depthwise_state

    cfg = compose(overrides)
    _check_apply_in_depthwise(cfg)  # auto refuses nothing
    applied, why = apply_in_depthwise_state(cfg)
    assert not applied
    assert why.startswith("norm.apply_in_depthwise=auto: off, it needs ") and missing in why


def test_odd_channel_counts_under_amp_keep_auto_off_and_refuse_true():
    from mobilenet.errors import ConfigError
    from mobilenet.model import apply_in_depthwise_state, depthwise_inputs

    assert depthwise_inputs(1.0, 224) == [(32, 112), (64, 112), (128, 56), (128, 56), (256, 28), (256, 28), (512, 14),
                                          (512, 14), (512, 14), (512, 14), (512, 14), (512, 14), (1024, 7)]
    assert depthwise_inputs(0.3, 224)[0] == (9, 112)  # int(32 * 0.3): an odd stem
    odd = ["backend=custom", "norm=custom", "channels_last=true", "data=synthetic", "model.width_mult=0.3"]
    applied, why = apply_in_depthwise_state(compose([*odd, "amp=true"]))
    assert not applied and "an even number of channels into every depthwise conv under amp" in why
    assert "model.width_mult=0.3 gives 9, 19, 153, 307)" in why  # 307: int(1024 * 0.3), the last input
    with pytest.raises(ConfigError, match="norm.apply_in_depthwise=true needs an even number of channels"):
        apply_in_depthwise_state(compose([*odd, "amp=true", "norm.apply_in_depthwise=true"]))
    assert apply_in_depthwise_state(compose(odd))[0]  # fp32: one channel per 32-bit word, any count


def test_a_one_by_one_depthwise_input_keeps_auto_off():
    """At 32 px (data=digits) the last depthwise input is 1x1, contiguous in both layouts, so it reads as NCHW."""
    from mobilenet.model import apply_in_depthwise_state, depthwise_inputs

    assert depthwise_inputs(1.0, 32)[-1] == (1024, 1) and depthwise_inputs(1.0, 64)[-1] == (1024, 2)
    digits = ["backend=custom", "norm=custom", "channels_last=true"]
    applied, why = apply_in_depthwise_state(compose(digits))
    assert not applied and "every depthwise conv's input at least 2x2 with 2 channels" in why and "1024x1x1" in why
    assert apply_in_depthwise_state(compose([*digits, "data.resolution=64"]))[0]


def test_a_batch_past_32_bit_indexing_keeps_auto_off():
    from mobilenet.model import apply_in_depthwise_state

    pair = ["backend=custom", "norm=custom", "channels_last=true", "data=synthetic"]
    assert apply_in_depthwise_state(compose([*pair, "data.batch_size=2048"]))[0]  # 64 x 112 x 112 x 2048 < 2^31
    applied, why = apply_in_depthwise_state(compose([*pair, "data.batch_size=3000"]))
    assert not applied and "fewer than 2^31 elements in every depthwise conv's input" in why and "2,408,448,000" in why


def test_build_for_run_follows_the_resolved_switch():
    from mobilenet.engine import build_for_run

    pair = ["backend=custom", "norm=custom", "channels_last=true", "data=synthetic"]
    cpu = torch.device("cpu")
    assert build_for_run(compose(pair), cpu, 10).apply_norm_in_depthwise is True
    assert build_for_run(compose([*pair, "norm.apply_in_depthwise=false"]), cpu, 10).apply_norm_in_depthwise is False
    assert build_for_run(compose([*pair[:2], "channels_last=false"]), cpu, 10).apply_norm_in_depthwise is False


@pytest.mark.parametrize("backend, norm", [("torch", "custom"), ("custom", "torch"), ("cudnn", "apex")])
def test_model_refuses_other_pairs_at_construction(backend, norm):
    with pytest.raises(NormUnavailable, match="apply_in_depthwise=true needs backend=custom and norm=custom without "
                                              "sync_bn"):
        MobileNetV1(num_classes=10, width_mult=0.25, depthwise=backend, norm=norm, apply_norm_in_depthwise=True)


def test_model_refuses_both_fusions():
    with pytest.raises(ValueError, match="cannot both be on"):
        MobileNetV1(num_classes=10, width_mult=0.25, depthwise="custom", norm="custom", stats_from_depthwise=True,
                    apply_norm_in_depthwise=True)


def test_state_dict_is_the_same_with_the_switch_on():
    off = MobileNetV1(num_classes=10, width_mult=0.25, depthwise="custom", norm="custom")
    on = MobileNetV1(num_classes=10, width_mult=0.25, depthwise="custom", norm="custom", apply_norm_in_depthwise=True)
    assert list(off.state_dict()) == list(on.state_dict())
    on.load_state_dict(off.state_dict())
    MobileNetV1(num_classes=10, width_mult=0.25).load_state_dict(on.state_dict())


def test_training_forward_on_cpu_stops_naming_cuda():
    model = MobileNetV1(num_classes=10, width_mult=0.25, depthwise="custom", norm="custom",
                        apply_norm_in_depthwise=True).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    with pytest.raises(NormUnavailable, match="apply_in_depthwise is on: the depthwise kernels need a CUDA tensor"):
        model.train()(x)


def test_summary_names_the_switch():
    from mobilenet.run_record import norm_label

    pair = ["backend=custom", "norm=custom", "channels_last=true", "data=synthetic"]
    # the rest of the row is norm.apply_in_pointwise's (tests/test_norm_in_pointwise.py)
    assert norm_label(compose(pair)).startswith("custom (applied by the depthwise kernel after it, in training; "
                                                "norm.apply_in_depthwise=auto) (backward: the BatchNorm+ReLU after "
                                                "it has its input gradient applied by the depthwise backward kernel "
                                                "where that kernel runs from the rings of rows (MDW_BWD_RING_NORM: "
                                                "16-bit by default)) "
                                                "(norm.apply_in_pointwise=")
    assert norm_label(compose([*pair, "norm.apply_in_depthwise=false"])).startswith(
        "custom (norm.apply_in_depthwise=false) (norm.apply_in_pointwise=")
    assert norm_label(compose(["norm=custom"])).startswith("custom (norm.apply_in_depthwise=auto: off, it needs "
                                                           "backend=custom (got torch), channels_last=true")
    assert norm_label(compose([])) == "torch"
    assert norm_label(compose(pair), training=False) == "custom"  # inference runs the modules as they are


def test_a_training_profile_names_the_switch_and_an_inference_one_the_norm():
    from mobilenet.run_record import run_meta

    cfg = compose(["backend=custom", "norm=custom", "channels_last=true", "data=synthetic"])
    assert run_meta(cfg, {}, "train")["norm"].startswith("custom (applied by the depthwise kernel after it, in "
                                                         "training; norm.apply_in_depthwise=auto) (")
    assert run_meta(cfg, {}, "infer")["norm"] == "custom"


# ---------------------------------------------------------------------------------------------- GPU tests

gpu = pytest.mark.gpu

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CASES = [  # (N, C, H, W, stride): MobileNet's shapes at small N, odd sizes, C not a multiple of 8, one band and many
    (4, 32, 112, 112, 1), (3, 64, 56, 56, 2), (5, 128, 28, 28, 1), (2, 256, 28, 28, 2), (16, 512, 14, 14, 1),
    (8, 1024, 7, 7, 1), (7, 6, 9, 11, 1), (3, 10, 13, 7, 2), (1, 2, 3, 3, 1), (33, 66, 5, 5, 2),
]
_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
# fp32 sums of the same products in two groupings, rounded to the weight's dtype: about one rounding of it apart.
_WGRAD_ORDER_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# A model's gradients with the BatchNorm backward's sums in another order (MBN_DEPTHWISE_BACKWARD=sums): a few
# roundings of each layer's input gradient, through every layer before it. fp32: the stem's weight gradient, the
# farthest upstream, moved by 6.2e-4 on an H200 (cf7ee82), where each layer's BatchNorm backward agrees to 1e-5
# (tests/test_depthwise_backward_walk.py).
_SUMS_ORDER_TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _ids(case):
    return "x".join(map(str, case[:4])) + f"s{case[4]}"


def _column_everywhere(c, dtype):
    """Whether the separate depthwise op runs the column walks too (else its tiled or generic kernels, which round
    differently): whole 16-byte vectors of channels."""
    return c % (4 if dtype == torch.float32 else 8) == 0


def _inputs(case, dtype, mean=0.0, seed=0):
    """y (channels_last, in dtype), the BatchNorm's fp32 weight and bias, the depthwise weight in dtype, the stride."""
    n, c, h, w, stride = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    y = ((torch.randn(n, c, h, w, device="cuda", generator=g) * 2 + mean).to(dtype)
         .contiguous(memory_format=torch.channels_last))
    bn_w = torch.rand(c, device="cuda", generator=g) + 0.5
    bn_b = torch.randn(c, device="cuda", generator=g) * 0.5
    conv_w = (torch.randn(c, 1, 3, 3, device="cuda", generator=g) / 3).to(dtype)
    return y, bn_w, bn_b, conv_w, (stride, stride)


def _poison():
    from test_kernels import _poison_allocator

    _poison_allocator(64 << 20)


def _fused(y, bn_w, bn_b, conv_w, stride, grad):
    """The pair's output and the gradients of y, BatchNorm weight and bias, and conv weight for grad."""
    from kernels.norm_depthwise import batch_norm_relu_depthwise_conv2d

    leaves = [t.detach().clone().requires_grad_() for t in (y, bn_w, bn_b, conv_w)]
    _poison()
    out = batch_norm_relu_depthwise_conv2d(*leaves, stride, (1, 1))
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def _separate(y, bn_w, bn_b, conv_w, stride, grad):
    """The same through the two separate custom ops."""
    from kernels.norm_ops import batch_norm_relu_train
    from kernels.ops import depthwise_conv2d

    leaves = [t.detach().clone().requires_grad_() for t in (y, bn_w, bn_b, conv_w)]
    x = batch_norm_relu_train(leaves[0], leaves[1], leaves[2])[0]
    out = depthwise_conv2d(x, leaves[3], None, stride, 1)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def _reference(y, bn_w, bn_b, conv_w, stride, grad):
    """float64 output and gradients, with the two roundings the kernels make taken from them (straight through):
    relu(batch_norm(y)) as stored in y's dtype (its ReLU mask too, so an element within rounding of zero does not
    move a gradient by a whole value), and the convolution's inputs in their dtype."""
    from kernels.norm_ops import batch_norm_relu_train

    y64, bw, bb, cw = (t.detach().double().requires_grad_() for t in (y, bn_w, bn_b, conv_w))
    stored = batch_norm_relu_train(y, bn_w, bn_b)[0].double()
    pre = F.batch_norm(y64, None, None, bw, bb, training=True, eps=1e-5)
    x64 = pre * (stored > 0)
    x64 = x64 + (stored - x64).detach()
    out = F.conv2d(x64, cw, None, stride, 1, groups=y.shape[1])
    out.backward(grad.double())
    return [out.detach(), y64.grad, bw.grad, bb.grad, cw.grad]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@gpu
@pytest.mark.parametrize("large_mean", [False, True], ids=["mean0", "mean300"])
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", _CASES, ids=_ids)
def test_pair_against_float64_and_the_separate_ops(case, dtype, large_mean):
    import kernels.norm_depthwise  # noqa: F401  (registers the ops' Python side)

    y, bn_w, bn_b, conv_w, stride = _inputs(case, dtype, mean=300.0 if large_mean else 0.0, seed=1)
    n, c, h, w = y.shape
    g = torch.Generator(device="cuda").manual_seed(2)
    grad = torch.randn(n, c, (h - 1) // stride[0] + 1, (w - 1) // stride[1] + 1, device="cuda", generator=g)
    grad = grad.to(dtype).contiguous(memory_format=torch.channels_last)
    got = _fused(y, bn_w, bn_b, conv_w, stride, grad)
    for t in got:
        assert torch.isfinite(t).all(), "an output element was not written"
    sep = _separate(y, bn_w, bn_b, conv_w, stride, grad)
    if _column_everywhere(c, dtype):
        # The conv weight's gradient (last) sums the same products, grouped by its own grid (fewer blocks on large
        # layers), so it is bitwise equal only where both grids have one block per band of rows.
        for i, (a, b) in enumerate(zip(got[:-1], sep[:-1])):
            assert torch.equal(a, b), f"output {i} must be bitwise the separate ops'"
        assert _rel(got[-1], sep[-1]) < _WGRAD_ORDER_TOL[dtype]
    ref = _reference(y, bn_w, bn_b, conv_w, stride, grad)
    # fp32 y at a mean of 300 holds each value to ~3e-5 of a std of 2, which the weight and bias gradients (sums of
    # g * (y - mean)) carry: 1.1e-5 was measured on an H200, so fp32 gets ten times its bound there.
    tol = _TOL[dtype] * (10 if large_mean and dtype == torch.float32 else 1)
    # With a mean of 300 the BatchNorm's input gradient subtracts nearly equal terms of y's rounding; the separate
    # ops then agree with this pair, checked above, and the other outputs with float64 as everywhere.
    for i, (a, want) in enumerate(zip(got, ref)):
        if not (large_mean and i == 1 and dtype != torch.float32):
            assert _rel(a, want) < tol, i


@gpu
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_running_statistics_are_the_separate_ops_bits_and_nn_batchnorms(dtype):
    from kernels.norm_depthwise import batch_norm_relu_depthwise_conv2d
    from kernels.norm_ops import batch_norm_relu_train_update

    y, bn_w, bn_b, conv_w, stride = _inputs((8, 64, 20, 20, 1), dtype, mean=3.0, seed=4)
    states = [[torch.rand(64, device="cuda"), torch.rand(64, device="cuda") + 0.5,
               torch.tensor(3, device="cuda")] for _ in range(3)]
    for s in states[1:]:
        for a, b in zip(s, states[0]):
            a.copy_(b)
    batch_norm_relu_depthwise_conv2d(y, bn_w, bn_b, conv_w, stride, (1, 1), 1e-5, *states[0], momentum=0.1)
    batch_norm_relu_train_update(y, bn_w, bn_b, *states[1], 1e-5, 0.1)
    for a, b in zip(states[0], states[1]):
        assert torch.equal(a, b)
    bn = torch.nn.BatchNorm2d(64, momentum=0.1).cuda()
    bn.running_mean.copy_(states[2][0]), bn.running_var.copy_(states[2][1]), bn.num_batches_tracked.fill_(3)
    bn(y.float())
    assert torch.allclose(states[0][0], bn.running_mean, rtol=1e-5, atol=1e-5)
    assert torch.allclose(states[0][1], bn.running_var, rtol=1e-4, atol=1e-5)
    assert int(states[0][2]) == 4 == int(bn.num_batches_tracked)


def _opcheck_inputs():
    """A small fp16 stride-2 pair's (y, bn_w, bn_b, conv_w, stride, grad_out, (mean, invstd, bn_w, bn_b))."""
    y, bn_w, bn_b, conv_w, stride = _inputs((4, 16, 9, 9, 2), torch.float16, seed=6)
    mean, invstd, _ = torch.ops.mobilenet_bn.bn_stats.default(y, bn_w, bn_b, 1e-5)
    grad = torch.randn(4, 16, 5, 5, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    return y, bn_w, bn_b, conv_w, stride, grad, (mean, invstd, bn_w, bn_b)


@gpu
def test_ops_opcheck_and_clear_errors():
    from kernels.norm_depthwise import batch_norm_relu_depthwise_conv2d

    y, bn_w, bn_b, conv_w, stride, grad, norm = _opcheck_inputs()
    torch.library.opcheck(torch.ops.mobilenet_dw.depthwise_fwd_normed.default, (y, conv_w, *norm, [2, 2], [1, 1]))
    torch.library.opcheck(torch.ops.mobilenet_dw.depthwise_wgrad_normed.default,
                          (grad, y, conv_w, *norm, [2, 2], [1, 1]))
    torch.library.opcheck(torch.ops.mobilenet_bn.bn_stats.default, (y, bn_w, bn_b, 1e-5))
    running = [torch.zeros(16, device="cuda"), torch.ones(16, device="cuda"), torch.tensor(0, device="cuda")]
    torch.library.opcheck(torch.ops.mobilenet_bn.bn_stats_update.default, (y, bn_w, bn_b, *running, 1e-5, 0.1))
    with pytest.raises(ValueError, match="not channels_last"):
        batch_norm_relu_depthwise_conv2d(y.contiguous(), bn_w, bn_b, conv_w, stride)
    odd = y[:, :15].contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="whole 32-bit words"):
        batch_norm_relu_depthwise_conv2d(odd, bn_w[:15], bn_b[:15], conv_w[:15], stride)
    with pytest.raises(ValueError, match="momentum must be in"):
        batch_norm_relu_depthwise_conv2d(y, bn_w, bn_b, conv_w, stride, (1, 1), 1e-5, *running, momentum=None)


def _model_pair(switches_of_both: dict, switch_on: dict):
    """MobileNetV1 (width 0.25: 8 to 256 channels, backend=custom norm=custom) without and with `switch_on`, one
    state (the BatchNorms' weights and biases drawn away from 1 and 0), on the GPU, channels_last."""
    torch.manual_seed(0)
    kw = dict(num_classes=10, width_mult=0.25, depthwise="custom", norm="custom", **switches_of_both)
    off = MobileNetV1(**kw).cuda().to(memory_format=torch.channels_last)
    on = MobileNetV1(**kw, **switch_on).cuda().to(memory_format=torch.channels_last)
    with torch.no_grad():
        for m in off.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5), m.bias.normal_(0, 0.3)
    on.load_state_dict(off.state_dict())
    return off, on


def _models(dtype):
    """The model with norm.apply_in_depthwise off and on."""
    return _model_pair({}, {"apply_norm_in_depthwise": True})


def _step(model, x, target, dtype):
    """One training step's loss, every gradient and every buffer, in module order."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        loss = F.cross_entropy(model(x), target)
    loss.backward()
    return ([loss.detach()] + [p.grad.detach().clone() for p in model.parameters()]
            + [b.detach().clone() for b in model.buffers()])


def _is_depthwise_weight_grad(model) -> list[bool]:
    """Which entries of _step's list are the gradients of a depthwise conv's weight."""
    from mobilenet.depthwise import DepthwiseConv2d

    ids = {id(m.weight) for m in model.modules() if isinstance(m, DepthwiseConv2d)}
    return [False] + [id(p) in ids for p in model.parameters()] + [False for _ in model.buffers()]


def _batch():
    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(16, 3, 64, 64, device="cuda", generator=g).contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 10, (16,), device="cuda", generator=g)


@gpu
@pytest.mark.parametrize("backward", ["walk", "sums", "next_norm", "separate"])  # MBN_DEPTHWISE_BACKWARD
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_model_step_is_bitwise_the_same_with_the_switch_on(dtype, backward, monkeypatch, deterministic_cudnn):
    from mobilenet.norm import depthwise_backward_mode

    monkeypatch.setenv("MBN_DEPTHWISE_BACKWARD", backward)
    depthwise_backward_mode.cache_clear()  # read once per process; cleared again after the test
    try:
        off, on = _models(dtype)
        x, target = _batch()
        depthwise_grad = _is_depthwise_weight_grad(on)
        grads = range(1, 1 + len(list(on.parameters())))
        for _ in range(2):  # the second step starts from the running statistics the first updated
            a, b = _step(off.train(), x, target, dtype), _step(on.train(), x, target, dtype)
            for i, (u, v) in enumerate(zip(a, b)):
                if backward in ("sums", "next_norm") and i in grads:
                    # The BatchNorm backward's sums summed by the walk's grid: every gradient upstream, the
                    # depthwise weights' too, moves by about a rounding of its dtype, amplified where a
                    # BatchNorm's backward cancels (2x2 maps of 16 images at this model's end).
                    assert _rel(v, u) < _SUMS_ORDER_TOL[dtype], i
                elif depthwise_grad[i]:  # the same products, grouped by the normalizing walk's own grid
                    assert _rel(v, u) < _WGRAD_ORDER_TOL[dtype], i
                else:
                    assert torch.equal(u, v), i
        with torch.no_grad():
            assert torch.equal(off.eval()(x), on.eval()(x))
    finally:
        depthwise_backward_mode.cache_clear()


def _assert_captured_step_equals_eager(model) -> None:
    """One fp16 training step of model eager, then the same step captured in a CUDA graph and replayed from the same
    state: the same loss, gradients and updated parameters, bit for bit."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x, target = _batch()
    eager = _step(model.train(), x, target, torch.float16)
    model.load_state_dict(state)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _step(model, x, target, torch.float16)  # warm-up, then reset what it updated
    torch.cuda.current_stream().wait_stream(side)
    model.load_state_dict(state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        captured = _step(model, x, target, torch.float16)
    model.load_state_dict(state)
    graph.replay()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(eager, captured)):
        assert torch.equal(a, b), i


@gpu
def test_captured_model_step_equals_eager(deterministic_cudnn):
    _assert_captured_step_equals_eager(_models(torch.float16)[1])


@gpu
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_pair_forward_from_the_ring_is_the_walks_bits(dtype, set_knobs):
    # FWD_RING_NORM=1: the pair's forward from the ring of input rows, normalized in shared memory as they land, where
    # the plain forward takes the ring (stride 1 here): the normalizing column walk's bits (FWD_RING_NORM=0), on
    # MobileNet's stride-1 shapes and odd ones (whole 16-byte channel units, one row, several blocks per image).
    from kernels.norm_depthwise import batch_norm_relu_depthwise_conv2d

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the ring's bulk copies need compute capability 9.0")
    per_word = 1 if dtype == torch.float32 else 2
    cases = [(4, 32, 112, 112, 1), (5, 128, 28, 28, 1), (16, 256 * per_word, 14, 14, 1), (3, 8 * per_word, 13, 7, 1),
             (2, 16 * per_word, 1, 33, 1)]
    inputs = [_inputs(case, dtype, mean=3.0, seed=i) for i, case in enumerate(cases)]

    def forwards(knob):
        set_knobs(FWD_RING_NORM=knob)

        def run():
            out = []
            for y, bn_w, bn_b, conv_w, stride in inputs:
                _poison()
                out.append(batch_norm_relu_depthwise_conv2d(y, bn_w, bn_b, conv_w, stride, (1, 1)).detach())
            return out

        return _profiled(run)

    ring, ring_names = forwards(1)
    walk, walk_names = forwards(0)
    assert sum("fwd_nhwc_ring_kernel" in n for n in ring_names) == len(cases), ring_names
    assert not [n for n in walk_names if "fwd_nhwc_ring_kernel" in n], walk_names
    for case, a, b in zip(cases, ring, walk):
        assert torch.isfinite(a).all(), case
        assert torch.equal(a, b), case
