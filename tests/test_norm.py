"""Tests of the norm registry (mobilenet/norm.py) and the fused BatchNorm + ReLU ops (kernels/norm_ops.py).

CPU (CI): the config composes with every norm; norm=custom on a CPU and norm=apex without apex fail clearly; every
norm's modules keep nn.BatchNorm2d's state, so checkpoints load across norms and from the older [BatchNorm2d, ReLU]
layout; norm=torch computes exactly what BatchNorm2d + ReLU did; sync_bn conversion keeps each norm's fused ReLU and
state (norm=custom's kernels too; norm=apex refused). sync_bn's combine and kernels: tests/test_sync_norm.py. GPU (`pytest -m gpu`): the custom ops against a
float64 reference over a grid of shapes, layouts and dtypes with poisoned outputs, running statistics, bitwise
repeatability, opcheck, a captured step, torch.compile, and a tiny MobileNetV1 training against norm=torch.
"""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mobilenet.config import compose
from mobilenet.depthwise import BackendUnavailable, DepthwiseConv2d
from mobilenet.model import BLOCKS, STEM_CHANNELS, MobileNetV1, _scaled
from mobilenet.norm import (
    ApexBatchNormReLU, CustomBatchNormReLU, NormUnavailable, SyncBatchNormReLU, SyncCustomBatchNormReLU,
    TorchBatchNormReLU, applies_relu, available_norms, convert_sync_batchnorm, get_norm, sync_bn_state,
)
from test_kernels import _profiled

NORMS = ("torch", "custom", "apex")


# ---------------------------------------------------------------------------------------------- CPU tests


@pytest.mark.parametrize("name", NORMS)
def test_config_composes_with_each_norm(name):
    cfg = compose([f"norm={name}"])
    assert cfg.norm.name == name


def test_default_norm_is_torch():
    assert compose([]).norm.name == "torch"
    assert set(NORMS) <= set(available_norms())


def test_unknown_norm_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown norm 'fused'.*apex, custom, torch"):
        get_norm("fused")


def test_custom_on_cpu_fails_naming_cuda():
    with pytest.raises(NormUnavailable, match="norm=custom needs a CUDA GPU"):
        get_norm("custom").check(torch.device("cpu"))


def test_custom_module_runs_no_batch_statistics_on_cpu():
    m = CustomBatchNormReLU(4).train()
    with pytest.raises(NormUnavailable, match="CUDA"):
        m(torch.randn(2, 4, 3, 3))


def test_engine_validate_refuses_custom_on_cpu():
    from mobilenet.engine import validate

    with pytest.raises(BackendUnavailable, match="norm=custom.*CUDA"):
        validate(compose(["norm=custom", "device=cpu"]), torch.device("cpu"))


def _without_apex(monkeypatch):
    for name in [m for m in sys.modules if m == "apex" or m.startswith("apex.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "apex", None)  # `import apex` now raises ImportError


def test_apex_without_apex_says_how_to_install(monkeypatch):
    _without_apex(monkeypatch)
    for device in ("cpu", "cuda"):
        with pytest.raises(NormUnavailable, match=r"norm=apex.*--cpp_ext.*--cuda_ext.*--bnp"):
            get_norm("apex").check(torch.device(device))


def test_a_wrong_running_update_mode_is_refused_naming_the_choices(monkeypatch):
    from mobilenet import norm
    from mobilenet.errors import ConfigError

    monkeypatch.setenv("MBN_RUNNING_UPDATE", "both")
    norm._running_update_mode.cache_clear()
    try:
        with pytest.raises(ConfigError, match="must be fused or separate, got 'both'"):
            norm._running_update_mode()
        monkeypatch.setenv("MBN_RUNNING_UPDATE", "separate")
        norm._running_update_mode.cache_clear()
        assert norm._running_update_mode() == "separate"
    finally:
        norm._running_update_mode.cache_clear()


def test_the_summary_says_where_the_running_statistics_were_updated(monkeypatch):
    from mobilenet import norm

    norm._running_update_mode.cache_clear()
    monkeypatch.delenv("MBN_RUNNING_UPDATE", raising=False)
    try:
        label = norm.running_update_label
        assert label(compose(["norm=torch"]), False) is None
        assert label(compose(["norm=custom"]), False) == "in the forward op's finalize kernel"
        assert "after each depthwise conv" in label(compose(["norm=custom", "norm.stats_from_depthwise=true"]), False)
        assert "torch.compile" in label(compose(["norm=custom", "compile=true"]), False)
        assert "sync_bn" in label(compose(["norm=custom", "sync_bn=true"]), True)
        monkeypatch.setenv("MBN_RUNNING_UPDATE", "separate")
        norm._running_update_mode.cache_clear()
        assert "MBN_RUNNING_UPDATE=separate" in label(compose(["norm=custom"]), False)
    finally:
        norm._running_update_mode.cache_clear()


def test_norm_unavailable_is_a_backend_unavailable():
    assert issubclass(NormUnavailable, BackendUnavailable)


@pytest.mark.parametrize("name", NORMS)
def test_every_norm_module_is_a_batchnorm2d_that_applies_relu(name):
    m = get_norm(name).norm_relu(12)  # construction needs no GPU, whatever the norm
    assert isinstance(m, nn.BatchNorm2d) and applies_relu(m) and type(m).fused_relu is True
    reference = nn.BatchNorm2d(12)
    assert {k: v.shape for k, v in m.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}
    assert [n for n, _ in m.named_parameters()] == ["weight", "bias"]
    assert list(m.children()) == []


class _LegacyConvBNReLU(nn.Sequential):
    def __init__(self, in_ch, out_ch, kernel_size, stride):
        super().__init__(nn.Conv2d(in_ch, out_ch, kernel_size, stride, padding=kernel_size // 2, bias=False),
                         nn.BatchNorm2d(out_ch), nn.ReLU(inplace=True))


class _LegacyMobileNetV1(nn.Module):
    """The model as it was before the norm registry: [conv, BatchNorm2d, ReLU] everywhere."""

    def __init__(self, num_classes=10, width_mult=0.25):
        super().__init__()
        layers = [_LegacyConvBNReLU(3, _scaled(STEM_CHANNELS, width_mult), 3, 2)]
        in_ch = _scaled(STEM_CHANNELS, width_mult)
        for out, stride in BLOCKS:
            out_ch = _scaled(out, width_mult)
            layers.append(nn.Sequential(DepthwiseConv2d(in_ch, 3, stride, padding=1), nn.BatchNorm2d(in_ch),
                                        nn.ReLU(inplace=True), _LegacyConvBNReLU(in_ch, out_ch, 1, 1)))
            in_ch = out_ch
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Identity()
        self.classifier = nn.Linear(in_ch, num_classes)

    def forward(self, x):
        return self.classifier(self.dropout(self.pool(self.features(x)).flatten(1)))


def _shapes(model):
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_state_dicts_interchange_across_norms():
    models = {name: MobileNetV1(num_classes=10, width_mult=0.25, norm=name) for name in NORMS}
    reference = _shapes(models["torch"])
    for name, model in models.items():
        assert _shapes(model) == reference, name
    for src, dst in itertools.permutations(NORMS, 2):
        models[dst].load_state_dict(models[src].state_dict())  # strict: every key on both sides


@pytest.mark.parametrize("name", NORMS)
def test_old_checkpoint_loads_into_the_new_model(name):
    old = _LegacyMobileNetV1()
    for m in old.modules():  # non-default statistics, so that a silently skipped buffer would show
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.num_batches_tracked.fill_(7)
    new = MobileNetV1(num_classes=10, width_mult=0.25, norm=name)
    assert _shapes(new) == _shapes(old)
    new.load_state_dict(old.state_dict())
    for (k, a), (_, b) in zip(new.state_dict().items(), old.state_dict().items()):
        assert torch.equal(a, b), k


def _paired_models():
    torch.manual_seed(0)
    old = _LegacyMobileNetV1()
    new = MobileNetV1(num_classes=10, width_mult=0.25, norm="torch")
    new.load_state_dict(old.state_dict())
    return old, new


def test_torch_norm_equals_batchnorm_then_relu_exactly():
    old, new = _paired_models()
    x = torch.randn(4, 3, 32, 32)
    for step in range(2):  # training: outputs, every gradient and the running statistics, bit for bit
        outs = []
        for model in (old, new):
            model.zero_grad()
            out = model(x + step)
            out.square().sum().backward()
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        for (k, a), (_, b) in zip(old.named_parameters(), new.named_parameters()):
            assert torch.equal(a.grad, b.grad), k
    for (k, a), (_, b) in zip(old.state_dict().items(), new.state_dict().items()):
        assert torch.equal(a, b), k
    old.eval(), new.eval()
    with torch.no_grad():
        assert torch.equal(old(x), new(x))


def test_custom_norm_eval_mode_runs_on_cpu_like_torch():
    torch.manual_seed(0)
    ref, custom = TorchBatchNormReLU(6), CustomBatchNormReLU(6)
    ref.running_mean.uniform_(-1, 1), ref.running_var.uniform_(0.5, 2), ref.weight.data.uniform_(0.5, 1.5)
    custom.load_state_dict(ref.state_dict())
    x = torch.randn(3, 6, 5, 5)
    assert torch.equal(ref.eval()(x), custom.eval()(x))


def test_sync_batchnorm_conversion_keeps_the_relu():
    model = MobileNetV1(num_classes=10, width_mult=0.25, norm="torch")
    keys = _shapes(model)
    converted = convert_sync_batchnorm(model)
    norms = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms and all(isinstance(m, SyncBatchNormReLU) and applies_relu(m) for m in norms)
    assert _shapes(converted) == keys


def _with_statistics(model):
    """Non-default parameters and statistics, so that a conversion that dropped one would show."""
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5), m.bias.data.uniform_(-1, 1)
            m.running_mean.uniform_(-1, 1), m.running_var.uniform_(0.5, 2), m.num_batches_tracked.fill_(7)
    return model


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_sync_batchnorm_conversion_of_custom_keeps_the_fused_kernels_and_the_state(training):
    model = _with_statistics(MobileNetV1(num_classes=10, width_mult=0.25, norm="custom")).train(training)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    originals = [m for m in model.modules() if isinstance(m, CustomBatchNormReLU)]
    converted = convert_sync_batchnorm(model, process_group="group")
    norms = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == len(originals) == 27
    for new, old in zip(norms, originals):
        assert type(new) is SyncCustomBatchNormReLU and applies_relu(new) and new.process_group == "group"
        assert new.weight is old.weight and new.bias is old.bias and new.running_var is old.running_var
        assert (new.eps, new.momentum, new.training) == (old.eps, old.momentum, training)
    after = converted.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert convert_sync_batchnorm(converted) is converted  # converting twice changes nothing


def test_sync_custom_module_in_eval_runs_on_cpu_like_torch():
    ref = _with_statistics(TorchBatchNormReLU(6)).eval()
    sync = SyncCustomBatchNormReLU(6).eval()
    sync.load_state_dict(ref.state_dict())
    x = torch.randn(3, 6, 5, 5)
    assert torch.equal(ref(x), sync(x))


@pytest.mark.parametrize("name, cls", [("torch", "SyncBatchNormReLU"), ("custom", "SyncCustomBatchNormReLU")])
def test_the_summary_names_the_synchronised_modules(name, cls):
    converted = convert_sync_batchnorm(MobileNetV1(num_classes=10, width_mult=0.25, norm=name))
    assert sync_bn_state(converted, 4) == f"on ({cls}; statistics over 4 ranks)"


def test_sync_batchnorm_refuses_apex_naming_the_alternatives():
    with pytest.raises(NormUnavailable, match="sync_bn=true with norm=apex.*norm=custom or norm=torch"):
        convert_sync_batchnorm(MobileNetV1(num_classes=10, width_mult=0.25, norm="apex"))


@pytest.mark.parametrize("name", ["torch", "custom"])
def test_config_composes_with_sync_bn(name):
    cfg = compose([f"norm={name}", "sync_bn=true"])
    assert cfg.sync_bn is True and cfg.norm.name == name


@pytest.mark.parametrize("name", ["torch", "custom"])
def test_sync_bn_runs_are_captured_whatever_the_norm(name):
    # Both norms' statistics all-reduces are sync-free, so a torchrun step is captured with them (on two GPUs:
    # tests/test_ddp_capture.py); the summary says the all-reduce is in the graph.
    from mobilenet import cuda_graph

    for mode in ("auto", "true"):
        cfg = compose([f"norm={name}", "sync_bn=true", f"cuda_graph={mode}"])
        assert cuda_graph.resolve(cfg, torch.device("cuda"), distributed=True) == (
            True, f"on (cuda_graph={mode}; DDP's gradient all-reduce captured with the step)")


def test_apex_module_refuses_what_apex_cannot_compute():
    m = ApexBatchNormReLU(8)
    with pytest.raises(NormUnavailable, match="CUDA"):
        m(torch.randn(2, 8, 4, 4))


# ---------------------------------------------------------------------------------------------- GPU tests

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops():
    import kernels.norm_ops as norm_ops

    return norm_ops


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SHAPES = [  # C not a multiple of 8, 7x7 and 112x112 planes, N = 1 and 64
    (1, 13, 7, 7), (64, 27, 7, 7), (64, 1024, 7, 7), (2, 256, 14, 14), (8, 32, 112, 112), (1, 3, 112, 112),
    (64, 32, 112, 112), (5, 64, 28, 28), (3, 40, 9, 11),
]
_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _make_case(shape, dtype, channels_last, mean=0.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, c, h, w = shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = (torch.randn(shape, device="cuda", generator=g) * 2 + mean + 0.3).to(dtype).contiguous(memory_format=fmt)
    grad = torch.randn(shape, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    weight = torch.rand(c, device="cuda", generator=g) + 0.5
    bias = torch.randn(c, device="cuda", generator=g) * 0.5
    return x, grad, weight, bias


def _reference(x, grad, weight, bias, y=None, eps=1e-5):
    """float64 BatchNorm + ReLU. The ReLU's backward takes its mask from `y` (the op's output) where given: where the
    pre-activation is within rounding of 0 the two masks may differ, and one differing element moves a gradient by
    a whole grad_y value, which no tolerance on the BatchNorm arithmetic should have to absorb."""
    x64 = x.double().requires_grad_()
    w64, b64 = weight.double().requires_grad_(), bias.double().requires_grad_()
    normalized = F.batch_norm(x64, None, None, w64, b64, training=True, eps=eps)
    out = F.relu(normalized)
    mask = (y > 0) if y is not None else (out > 0)
    normalized.backward(grad.double() * mask)
    mean = x64.detach().mean((0, 2, 3))
    var = x64.detach().var((0, 2, 3), unbiased=False)
    return out.detach(), mean, var, x64.grad, w64.grad, b64.grad


def _run_poisoned(ops, x, grad, weight, bias):
    """Forward and backward, after the same op ran on NaN data: the caching allocator hands the NaN-filled blocks
    back for this call's outputs, so an element the kernels do not write stays NaN."""
    nan_x = torch.full_like(x, float("nan"))
    fwd = torch.ops.mobilenet_bn.bn_relu_fwd.default(nan_x, weight, bias, 1e-5)
    torch.ops.mobilenet_bn.bn_relu_bwd.default(torch.full_like(grad, float("nan")), nan_x, weight, bias, fwd[1], fwd[2])
    del fwd, nan_x
    y, mean, invstd, var = torch.ops.mobilenet_bn.bn_relu_fwd.default(x, weight, bias, 1e-5)
    gx, gw, gb = torch.ops.mobilenet_bn.bn_relu_bwd.default(grad, x, weight, bias, mean, invstd)
    return y, mean, invstd, var, gx, gw, gb


@gpu
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_custom_ops_against_float64(ops, shape, dtype, channels_last):
    x, grad, weight, bias = _make_case(shape, dtype, channels_last)
    y, mean, invstd, var, gx, gw, gb = _run_poisoned(ops, x, grad, weight, bias)
    ry, rmean, rvar, rgx, rgw, rgb = _reference(x, grad, weight, bias, y)
    for name, t in dict(y=y, mean=mean, invstd=invstd, var=var, gx=gx, gw=gw, gb=gb).items():
        assert torch.isfinite(t).all(), f"{name} has NaN/inf: an element was not written"
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert y.dtype == gx.dtype == dtype and y.is_contiguous(memory_format=fmt) and gx.is_contiguous(memory_format=fmt)
    assert mean.dtype == invstd.dtype == var.dtype == gw.dtype == gb.dtype == torch.float32
    tol = _TOL[dtype]
    assert _rel_err(y, ry) < tol
    assert _rel_err(gx, rgx) < tol
    assert _rel_err(mean, rmean) < 1e-5
    assert _rel_err(var, rvar) < 1e-5
    assert _rel_err(invstd, (rvar + 1e-5).rsqrt()) < 1e-5
    assert _rel_err(gw, rgw) < 1e-5  # sums of 16-bit values are exact in the fp64 reference, near exact in fp32
    assert _rel_err(gb, rgb) < 1e-5


@gpu
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_variance_is_accurate_for_a_large_mean(ops, channels_last):
    x, grad, weight, bias = _make_case((16, 24, 28, 28), torch.float32, channels_last, mean=100.0)
    x = ((x - x.mean()) / 2 + 100).contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    _, mean, _, var = ops.batch_norm_relu_train(x, weight, bias)
    _, rmean, rvar, *_ = _reference(x, grad, weight, bias)
    assert _rel_err(var, rvar) < 1e-5
    assert _rel_err(mean, rmean) < 1e-6


@gpu
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_running_statistics_equal_batchnorm2d(dtype, momentum):
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(24, momentum=momentum).cuda()
    custom = CustomBatchNormReLU(24, momentum=momentum).cuda()
    for step in range(3):
        x = (torch.randn(8, 24, 14, 14, device="cuda") * (step + 1) + step).to(dtype)
        x = x.contiguous(memory_format=torch.channels_last)
        ref(x), custom(x)
    torch.testing.assert_close(custom.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(custom.running_var, ref.running_var, rtol=1e-5, atol=1e-6)
    assert torch.equal(custom.num_batches_tracked, ref.num_batches_tracked)


def _running_stats_as_torch_ops(running_mean, running_var, num_batches_tracked, mean, var, momentum, count):
    """nn.BatchNorm2d's update written as torch ops: the reference the single-kernel update must equal bitwise."""
    num_batches_tracked.add_(1)
    factor = 1.0 / num_batches_tracked.to(torch.float32) if momentum is None else momentum
    running_mean.mul_(1 - factor).add_(mean * factor)
    running_var.mul_(1 - factor).add_(var * (count / (count - 1)) * factor)


@gpu
@pytest.mark.parametrize("momentum", [0.1, 0.3, None])
def test_running_statistics_update_equals_the_torch_formula_bitwise(ops, momentum):
    from kernels.norm_ops import update_running_stats

    c, count = 1000, 12544
    ref = [torch.rand(c, device="cuda") - 0.5, torch.rand(c, device="cuda") + 0.5,
           torch.tensor(7, device="cuda", dtype=torch.long)]
    mine = [t.clone() for t in ref]
    for _ in range(3):
        mean, var = torch.randn(c, device="cuda"), torch.rand(c, device="cuda") * 3
        _running_stats_as_torch_ops(*ref, mean, var, momentum, count)
        update_running_stats(*mine, mean, var, momentum, count)
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)


@gpu
def test_running_statistics_update_refuses_a_single_value_per_channel(ops):
    from kernels.norm_ops import update_running_stats

    stats = [torch.zeros(4, device="cuda"), torch.ones(4, device="cuda"), torch.zeros((), device="cuda",
                                                                                       dtype=torch.long)]
    with pytest.raises(ValueError, match="more than 1 value"):
        update_running_stats(*stats, torch.zeros(4, device="cuda"), torch.ones(4, device="cuda"), 0.1, 1)


@gpu
def test_running_statistics_update_opcheck(ops):
    stats = [torch.zeros(6, device="cuda"), torch.ones(6, device="cuda"), torch.zeros((), device="cuda",
                                                                                       dtype=torch.long)]
    args = (*stats, torch.randn(6, device="cuda"), torch.rand(6, device="cuda"), 0.1, 10)
    torch.library.opcheck(torch.ops.mobilenet_bn.bn_update_running_stats.default, args)


def _running_stats(c, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.rand(c, device="cuda", generator=g) - 0.5, torch.rand(c, device="cuda", generator=g) + 0.5,
            torch.tensor(7, device="cuda", dtype=torch.long)]


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@gpu
@pytest.mark.parametrize("momentum", [0.1, 0.0, 1.0])
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_forward_with_the_update_equals_forward_then_update_bitwise(ops, dtype, channels_last, momentum):
    for i, shape in enumerate([(8, 40, 14, 14), (2, 1024, 7, 7), (3, 13, 9, 11)]):
        x, grad, weight, bias = _make_case(shape, dtype, channels_last, mean=1.5, seed=20 + i)
        fused_stats, two_stats = _running_stats(shape[1], i), _running_stats(shape[1], i)
        fused_in, two_in = _leaves(x, weight, bias), _leaves(x, weight, bias)
        fused = ops.batch_norm_relu_train_update(*fused_in, *fused_stats, 1e-5, momentum)
        two = ops.batch_norm_relu_train(*two_in, 1e-5)
        ops.update_running_stats(*two_stats, two[1], two[3], momentum, x.numel() // shape[1])
        fused[0].backward(grad)
        two[0].backward(grad)
        for a, b in zip([*fused, *fused_stats, *(t.grad for t in fused_in)], [*two, *two_stats, *(t.grad for t in two_in)]):
            assert torch.equal(a, b), (shape, a.shape)
        assert fused_stats[2].item() == 8


@gpu
def test_forward_with_the_update_refuses_a_cumulative_momentum(ops):
    x, _, weight, bias = _make_case((2, 4, 3, 3), torch.float32, True)
    for momentum in (None, -0.5, 1.5):
        with pytest.raises(ValueError, match="momentum must be in"):
            ops.batch_norm_relu_train_update(x, weight, bias, *_running_stats(4, 0), 1e-5, momentum)


@gpu
def test_forward_with_the_update_opcheck(ops):
    x, _, weight, bias = _make_case((4, 12, 6, 6), torch.float16, True)
    torch.library.opcheck(torch.ops.mobilenet_bn.bn_relu_fwd_update.default,
                          (x, weight, bias, *_running_stats(12, 1), 1e-5, 0.1))


@gpu
@pytest.mark.parametrize("momentum", [0.1, None])
def test_the_module_updates_its_statistics_in_the_forward_op_when_it_has_a_momentum(momentum):
    bn = CustomBatchNormReLU(24, momentum=momentum).cuda()
    x = torch.randn(8, 24, 14, 14, device="cuda").contiguous(memory_format=torch.channels_last)
    _, kernels = _profiled(lambda: bn(x))
    assert any("finalize_stats" in k for k in kernels), kernels
    # momentum=None's cumulative average needs the batch count every channel reads: the update's own kernel
    assert any("update_running_stats" in k for k in kernels) == (momentum is None), kernels
    assert bn.num_batches_tracked.item() == 1 and not torch.equal(bn.running_var, torch.ones(24, device="cuda"))


@gpu
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_bitwise_repeatable(ops, dtype, channels_last):
    x, grad, weight, bias = _make_case((32, 96, 28, 28), dtype, channels_last)
    runs = []
    for _ in range(2):
        y, mean, invstd, var = torch.ops.mobilenet_bn.bn_relu_fwd.default(x, weight, bias, 1e-5)
        runs.append((y, mean, invstd, var, *torch.ops.mobilenet_bn.bn_relu_bwd.default(grad, x, weight, bias, mean, invstd)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_opcheck(ops, channels_last):
    x, grad, weight, bias = _make_case((4, 12, 6, 6), torch.float16, channels_last)
    x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()
    torch.library.opcheck(torch.ops.mobilenet_bn.bn_relu_fwd.default, (x, weight, bias, 1e-5))
    _, mean, invstd, _ = torch.ops.mobilenet_bn.bn_relu_fwd.default(x.detach(), weight.detach(), bias.detach(), 1e-5)
    torch.library.opcheck(torch.ops.mobilenet_bn.bn_relu_bwd.default,
                          (grad, x.detach(), weight.detach(), bias.detach(), mean, invstd))


@gpu
def test_autograd_through_the_public_function(ops):
    x, grad, weight, bias = _make_case((4, 16, 10, 10), torch.float32, True)
    x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()
    y, *_ = ops.batch_norm_relu_train(x, weight, bias)
    y.backward(grad)
    ry, _, _, rgx, rgw, rgb = _reference(x.detach(), grad, weight.detach(), bias.detach(), y.detach())
    assert _rel_err(x.grad, rgx) < 1e-5 and _rel_err(weight.grad, rgw) < 1e-5 and _rel_err(bias.grad, rgb) < 1e-5


@gpu
def test_autocast_keeps_x_dtype_and_fp32_statistics(ops):
    x, _, weight, bias = _make_case((4, 16, 10, 10), torch.float16, True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, mean, invstd, var = ops.batch_norm_relu_train(x, weight, bias)
    assert y.dtype == torch.float16 and mean.dtype == invstd.dtype == var.dtype == torch.float32


@gpu
def test_cuda_graph_step_equals_eager(ops):
    torch.manual_seed(0)
    m = CustomBatchNormReLU(32).cuda()
    x = torch.randn(16, 32, 14, 14, device="cuda").half().contiguous(memory_format=torch.channels_last)
    g = torch.randn_like(x)
    state = {k: v.clone() for k, v in m.state_dict().items()}

    def step():
        m.weight.grad = m.bias.grad = None
        xi = x.detach().requires_grad_()
        y = m(xi)
        y.backward(g)
        return y, xi.grad, m.weight.grad, m.bias.grad

    # Detached: a clone of y would keep the eager autograd graph, and with it AccumulateGrad nodes made on the default
    # stream, alive into the capture (which then fails).
    eager = [t.detach().clone() for t in step()]
    eager_stats = [m.running_mean.clone(), m.running_var.clone()]
    m.load_state_dict(state)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up (allocator, lazy init), then reset the statistics it updated
    torch.cuda.current_stream().wait_stream(side)
    m.load_state_dict(state)
    graph = torch.cuda.CUDAGraph()
    # As the training loop captures (mobilenet/cuda_graph.py): on the warm-up stream, errors checked per thread (in
    # global mode the autograd engine's device thread invalidated the capture).
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        captured = step()
    m.load_state_dict(state)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)
    assert torch.equal(eager_stats[0], m.running_mean) and torch.equal(eager_stats[1], m.running_var)


@gpu
def test_compile_fullgraph(ops):
    torch.manual_seed(0)
    m = CustomBatchNormReLU(16).cuda()
    x = torch.randn(4, 16, 8, 8).cuda().contiguous(memory_format=torch.channels_last)
    eager = m(x)
    m.running_mean.zero_(), m.running_var.fill_(1), m.num_batches_tracked.zero_()
    compiled = torch.compile(m, fullgraph=True)
    torch.testing.assert_close(compiled(x), eager)


def _model_gradient(norm: str, state: dict, dtype, amp: bool) -> Tensor:
    """The whole parameter gradient of one step of a small MobileNetV1 on a fixed batch, as one float64 vector."""
    model = MobileNetV1(num_classes=10, width_mult=0.25, norm=norm).cuda().to(memory_format=torch.channels_last)
    model.load_state_dict(state)
    model.to(dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(16, 3, 64, 64, device="cuda", generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 10, (16,), device="cuda", generator=gen)
    with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
        loss = F.cross_entropy(model(x), target)
    loss.backward()
    return torch.cat([p.grad.double().flatten() for p in model.parameters()])


@gpu
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp_fp16"])
def test_model_gradient_is_as_close_to_float64_as_torch_norms(amp):
    # Gradients of a whole network cannot be compared between two fp32 (or fp16) implementations directly: small
    # rounding differences grow through 27 normalizations. Both are compared with the float64 gradient instead, and
    # norm=custom must be about as close to it as cuDNN's BatchNorm is.
    b, cuda = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = b.benchmark, b.deterministic, b.allow_tf32, cuda.allow_tf32
    b.benchmark, b.deterministic, b.allow_tf32, cuda.allow_tf32 = False, True, False, False
    try:
        torch.manual_seed(0)
        state = MobileNetV1(num_classes=10, width_mult=0.25).state_dict()
        exact = _model_gradient("torch", state, torch.float64, False)
        errors = {norm: ((_model_gradient(norm, state, torch.float32, amp) - exact).norm() / exact.norm()).item()
                  for norm in ("torch", "custom")}
    finally:
        b.benchmark, b.deterministic, b.allow_tf32, cuda.allow_tf32 = saved
    print(f"relative gradient error against float64: {errors}")
    assert errors["custom"] <= 2 * errors["torch"] + 1e-6, errors
