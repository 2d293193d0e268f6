"""Tests of norm.stats_from_depthwise: the depthwise forward that also writes the statistics of its output
(mobilenet_dw::depthwise_fwd_stats), the BatchNorm+ReLU forward that takes them (mobilenet_bn::bn_relu_fwd_from_partials)
and the DepthwiseSeparable pair that runs the two (mobilenet/norm.py depthwise_norm_relu).

CPU (CI): the config composes, validate() refuses the switch without backend=custom norm=custom channels_last=true
sync_bn=false, the model refuses other norms or backends at construction and a CPU input at the first training
forward, the state_dict is the same with the switch on or off, the case check says which cases the walk takes, and
the fake kernel's band count follows the knob. GPU (`pytest -m gpu`): the partials against float64 statistics of
F.conv2d's output (poisoned outputs, odd shapes, large means), y bitwise the plain op's, the pair with the switch on
against off (forward, statistics, running statistics, gradients), bitwise repeatability, opcheck, a captured step and
torch.compile.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.depthwise_args import stats_bands, stats_unsupported
from mobilenet.config import compose
from mobilenet.model import DepthwiseSeparable, MobileNetV1
from mobilenet.norm import NormUnavailable

# ---------------------------------------------------------------------------------------------- CPU tests


def test_config_default_is_off_and_composes_on():
    assert compose([]).norm.stats_from_depthwise is False
    cfg = compose(["backend=custom", "norm=custom", "norm.stats_from_depthwise=true", "channels_last=true"])
    assert cfg.norm.stats_from_depthwise is True


@pytest.mark.parametrize("overrides, missing", [
    (["backend=torch", "norm=custom", "channels_last=true"], "backend=custom"),
    (["backend=custom", "norm=torch", "channels_last=true"], "norm=custom"),
    (["backend=custom", "norm=custom", "channels_last=false"], "channels_last=true"),
    (["backend=custom", "norm=custom", "channels_last=true", "sync_bn=true"], "sync_bn=false"),
])
def test_validate_refuses_the_switch_where_a_pair_cannot_take_it(overrides, missing):
    from mobilenet.engine import _check_stats_from_depthwise
    from mobilenet.errors import ConfigError

    with pytest.raises(ConfigError, match=f"norm.stats_from_depthwise=true needs .*{missing}"):
        _check_stats_from_depthwise(compose([*overrides, "norm.stats_from_depthwise=true"]))
    _check_stats_from_depthwise(compose(overrides))  # off: nothing to refuse


@pytest.mark.parametrize("backend, norm", [("torch", "custom"), ("custom", "torch")])
def test_model_refuses_other_pairs_at_construction(backend, norm):
    with pytest.raises(NormUnavailable, match="stats_from_depthwise=true needs backend=custom and norm=custom"):
        DepthwiseSeparable(8, 16, 1, backend, norm, stats_from_depthwise=True)


def test_state_dict_is_the_same_with_the_switch_on():
    off = MobileNetV1(num_classes=10, width_mult=0.25, depthwise="custom", norm="custom")
    on = MobileNetV1(num_classes=10, width_mult=0.25, depthwise="custom", norm="custom", stats_from_depthwise=True)
    assert list(off.state_dict()) == list(on.state_dict())
    on.load_state_dict(off.state_dict())
    torch_model = MobileNetV1(num_classes=10, width_mult=0.25)
    torch_model.load_state_dict(on.state_dict())


def test_training_forward_on_cpu_stops_naming_the_reason():
    block = DepthwiseSeparable(8, 16, 1, "custom", "custom", stats_from_depthwise=True).train()
    with pytest.raises(NormUnavailable, match=r"stats_from_depthwise=true.*cuda|CUDA"):
        block(torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last))


def _case(c=8, dtype=torch.float16, stride=(1, 1), padding=(1, 1), fmt=torch.channels_last, k=3, bias=False):
    x = torch.empty(2, c, 9, 9, dtype=dtype).contiguous(memory_format=fmt)
    w = torch.empty(c, 1, k, k, dtype=dtype)
    return x, w, (torch.empty(c, dtype=dtype) if bias else None), stride, padding, (1, 1)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(fmt=torch.contiguous_format), "not channels_last"),
    (dict(c=7), "whole 32-bit words"),
    (dict(k=5, padding=(2, 2)), "not a 3x3 depthwise"),
    (dict(bias=True), "has a bias"),
    (dict(stride=(1, 2)), "equal strides 1 or 2"),
    (dict(dtype=torch.float64), "dtype"),
])
def test_case_check_names_what_the_walk_does_not_take(kwargs, reason):
    x, w, b, stride, padding, dilation = _case(**kwargs)
    why = stats_unsupported(_Cuda(x), w, b, stride, padding, dilation)
    assert why is not None and reason in why


def test_case_check_takes_the_mobilenet_layers():
    for c, dtype, stride in [(32, torch.float16, 1), (64, torch.bfloat16, 2), (7, torch.float32, 2)]:
        x, w, b, s, p, d = _case(c=c, dtype=dtype, stride=(stride, stride))
        assert stats_unsupported(_Cuda(x), w, b, s, p, d) is None
    x, w, b, s, p, d = _case()
    assert "not a CUDA device" in stats_unsupported(x, w, b, s, p, d)


class _Cuda:
    """A CPU tensor that says it is on a CUDA device: the case check's other conditions, tested on a CPU."""

    def __init__(self, t):
        self._t = t
        self.is_cuda = True

    def __getattr__(self, name):
        return getattr(self._t, name)


def test_fake_band_count_follows_the_rows_knob(monkeypatch):
    # (256, 512, 14, 14) fp16: two rows per lane (OW <= 28), 256 words... 32 lanes x 8 rows of lanes per band.
    assert stats_bands(256, 512, 14, 14, 1, torch.float16) == 256 * 7 // 8
    monkeypatch.setenv("MDW_FWD_COLUMN_ROWS_F16", "1")
    assert stats_bands(256, 512, 14, 14, 1, torch.float16) == 256 * 14 // 8
    assert stats_bands(256, 512, 14, 14, 1, torch.float32) == 256 * 7 // 8  # fp32's default: 2 rows


# ---------------------------------------------------------------------------------------------- GPU tests

gpu = pytest.mark.gpu

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CASES = [  # (N, C, H, W, stride): MobileNet's shapes at small N, odd sizes, C not a multiple of 8, one band and many
    (4, 32, 112, 112, 1), (3, 64, 112, 112, 2), (5, 128, 28, 28, 1), (2, 256, 28, 28, 2), (16, 512, 14, 14, 1),
    (8, 1024, 7, 7, 1), (7, 6, 9, 11, 1), (3, 10, 13, 7, 2), (1, 2, 3, 3, 1), (33, 66, 5, 5, 2), (2, 1030, 4, 6, 1),
]
_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _ids(case):
    return "x".join(map(str, case[:4])) + f"s{case[4]}"


def _inputs(case, dtype, mean=0.0, seed=0):
    n, c, h, w, stride = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(n, c, h, w, device="cuda", generator=g) + mean).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(c, 1, 3, 3, device="cuda", generator=g) / 3 + (0.1 if mean else 0.0)).to(dtype)
    return x, weight, (stride, stride)


def _poisoned_stats(x, weight, stride):
    """depthwise_fwd_stats after the same call on NaN data (the allocator hands the NaN blocks back)."""
    op = torch.ops.mobilenet_dw.depthwise_fwd_stats.default
    dead = op(torch.full_like(x, float("nan")), weight, list(stride), [1, 1])
    del dead
    return op(x, weight, list(stride), [1, 1])


def _merged(partials):
    """The partials' per-channel count, mean and biased variance, combined in float64 (Chan's formula)."""
    n, mean, m2 = partials.double().unbind(1)
    count = n.sum(0)
    total_mean = (n * mean).sum(0) / count
    return count, total_mean, (m2.sum(0) + (n * (mean - total_mean).square()).sum(0)) / count


@gpu
@pytest.mark.parametrize("large_mean", [False, True], ids=["mean0", "mean300"])
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", _CASES, ids=_ids)
def test_partials_against_float64_statistics_of_the_output(case, dtype, large_mean):
    import kernels.ops  # noqa: F401  (registers the op's Python side)
    from kernels.depthwise_args import stats_bands as bands_of

    x, weight, stride = _inputs(case, dtype, mean=300.0 if large_mean else 0.0)
    y, partials = _poisoned_stats(x, weight, stride)
    plain = torch.ops.mobilenet_dw.depthwise_fwd.default(x, weight, None, list(stride), [1, 1], [1, 1], 0)
    if y.shape[1] % (4 if dtype == torch.float32 else 8) == 0:  # where the plain forward runs the column walk too
        assert torch.equal(y, plain), "y must be bitwise the plain forward's"
    ref = F.conv2d(x.double(), weight.double(), None, stride, 1, groups=x.shape[1])
    assert (y.double() - ref).abs().max() <= _TOL[dtype] * ref.abs().max()
    assert (plain.double() - ref).abs().max() <= _TOL[dtype] * ref.abs().max()
    assert partials.shape == (bands_of(*y.shape, stride[0], dtype), 3, y.shape[1]) and partials.dtype == torch.float64
    assert torch.isfinite(partials).all(), "a partial was not written"
    count, mean, var = _merged(partials)
    stored = y.double()  # the statistics are those of y as stored (rounded to its dtype)
    assert torch.all(count == y.numel() // y.shape[1])
    std = stored.std((0, 2, 3), unbiased=False)
    # fp32 sums of up to 2 * OW values per lane, the rest in fp64: far inside these, and an indexing error is O(1)
    assert ((mean - stored.mean((0, 2, 3))).abs() <= 1e-5 * std + 1e-12).all()
    ref_var = stored.var((0, 2, 3), unbiased=False)
    assert ((var - ref_var).abs() <= 1e-4 * ref_var + 1e-12).all()


def _grad_y(block, x):
    """A fixed grad_y for the pair's output (made outside any capture: a generator is not captured)."""
    n, c, h, w = x.shape
    s = block[0].stride[0]
    g = torch.Generator(device="cuda").manual_seed(7)
    return torch.randn(n, c, (h - 1) // s + 1, (w - 1) // s + 1, device="cuda", generator=g)


def _pair(block, x, dtype, grad=None):
    """One training step of the block's depthwise conv + BatchNorm+ReLU (fp32 parameters, autocast to `dtype`):
    the pair as the switch runs it, or as two modules; returns outputs, gradients and running statistics."""
    from mobilenet.norm import depthwise_norm_relu

    grad = _grad_y(block, x) if grad is None else grad

    block.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_()
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        if block.stats_from_depthwise:
            out = depthwise_norm_relu(block[0], block[1], xi)
        else:
            out = block[1](block[0](xi))
    out.backward(grad.to(out.dtype))
    bn = block[1]
    return [out.detach(), xi.grad, block[0].weight.grad, bn.weight.grad, bn.bias.grad, bn.running_mean.clone(),
            bn.running_var.clone(), bn.num_batches_tracked.clone()]


def _blocks(c, stride):
    """The same DepthwiseSeparable block with the switch off and on (one state), on the GPU, channels_last."""
    torch.manual_seed(0)
    off = DepthwiseSeparable(c, 8, stride, "custom", "custom").cuda().to(memory_format=torch.channels_last)
    on = DepthwiseSeparable(c, 8, stride, "custom", "custom", stats_from_depthwise=True).cuda()
    on = on.to(memory_format=torch.channels_last)
    with torch.no_grad():
        off[0].weight.normal_(0.1, 0.3)
        off[1].weight.uniform_(0.5, 1.5), off[1].bias.normal_(0, 0.5)
    on.load_state_dict(off.state_dict())
    return off, on


def _pair_reference(block, x, dtype, out):
    """float64 gradients of the pair (x, conv weight, BatchNorm weight and bias) for the step _pair ran: the conv on the
    inputs rounded to `dtype`, the BatchNorm on y as the kernels stored it (straight through to the conv's gradient)
    and the ReLU's mask from the op's output, as tests/test_norm.py's reference."""
    conv, bn = block[0], block[1]
    x64 = x.to(dtype).double().requires_grad_()
    w64 = conv.weight.detach().to(dtype).double().requires_grad_()
    bw, bb = bn.weight.detach().double().requires_grad_(), bn.bias.detach().double().requires_grad_()
    y64 = F.conv2d(x64, w64, None, conv.stride, conv.padding, groups=x.shape[1])
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        stored = conv(x).double()
    y_in = y64 + (stored - y64).detach()
    normalized = F.batch_norm(y_in, None, None, bw, bb, training=True, eps=bn.eps)
    normalized.backward(_grad_y(block, x).to(out.dtype).double() * (out > 0))
    return [F.relu(normalized).detach(), x64.grad, w64.grad, bw.grad, bb.grad]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@gpu
@pytest.mark.parametrize("large_mean", [False, True], ids=["mean0", "mean300"])
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", [(8, 32, 28, 28, 1), (4, 64, 15, 17, 2), (16, 512, 7, 7, 1), (3, 6, 5, 9, 2)],
                         ids=_ids)
def test_pair_with_the_switch_on_equals_off(case, dtype, large_mean):
    n, c, h, w, stride = case
    off, on = _blocks(c, stride)
    x, _, _ = _inputs(case, torch.float32, mean=300.0 if large_mean else 0.0, seed=3)
    # two steps each: the second starts from the running statistics the first updated
    runs = {name: [_pair(block, x, dtype), _pair(block, x, dtype)] for name, block in (("off", off), ("on", on))}
    a, b = runs["off"][1], runs["on"][1]
    # The running statistics agree to the statistics' rounding, and y to one rounding of its dtype. The plain path
    # accumulates in fp32, the partials in fp64: with bf16 at a mean of 300 (ulp 2, variance ~1000) they differ by
    # up to 6e-6 relative on an H200, so the bound is the partials test's 1e-4.
    assert torch.equal(a[7], b[7])
    for i in (5, 6):
        assert torch.allclose(a[i], b[i], rtol=1e-4, atol=1e-6)
    assert _rel(b[0], a[0]) < {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    # the gradients: each against float64 with its own ReLU mask (one element within rounding of 0 may pass the
    # gradient in one and not the other, which moves a gradient by a whole grad_y value)
    # With a mean of 300 the conv weight's gradient, sum(g * x), cancels 300 * sum(g) against a sum(g) that is zero
    # only up to the rounding of g: a property of such data under either setting, so that one is left out there.
    tol = _TOL[dtype]
    for name, block in (("off", off), ("on", on)):
        ref = _pair_reference(block, x, dtype, runs[name][1][0])
        for i, (got, want) in enumerate(zip(runs[name][1][:5], ref)):
            if not (large_mean and i == 2):
                assert _rel(got, want) < tol, (name, i)


@gpu
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_pair_is_bitwise_repeatable(dtype):
    _, on = _blocks(64, 2)
    state = {k: v.clone() for k, v in on.state_dict().items()}
    x, _, _ = _inputs((8, 64, 28, 28, 2), torch.float32, mean=2.0, seed=5)
    runs = []
    for _ in range(2):
        on.load_state_dict(state)
        runs.append(_pair(on, x, dtype))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@gpu
def test_from_partials_op_checks_and_opcheck():
    import kernels.norm_ops as norm_ops
    import kernels.ops as ops

    x, weight, stride = _inputs((4, 12, 6, 6, 1), torch.float16)
    y, partials = ops.depthwise_conv2d_stats(x, weight, stride, 1)
    bn_w, bn_b = torch.rand(12, device="cuda") + 0.5, torch.randn(12, device="cuda")
    with pytest.raises(ValueError, match="partials must be a float64"):
        norm_ops.batch_norm_relu_from_partials(y, partials.float(), bn_w, bn_b)
    with pytest.raises(ValueError, match="not channels_last"):
        ops.depthwise_conv2d_stats(x.contiguous(), weight, stride, 1)
    torch.library.opcheck(torch.ops.mobilenet_dw.depthwise_fwd_stats.default,
                          (x.requires_grad_(), weight.requires_grad_(), list(stride), [1, 1]))
    torch.library.opcheck(torch.ops.mobilenet_bn.bn_relu_fwd_from_partials.default,
                          (y.detach().requires_grad_(), partials, bn_w.requires_grad_(), bn_b.requires_grad_(), 1e-5))


@gpu
def test_cuda_graph_step_equals_eager():
    _, on = _blocks(32, 1)
    state = {k: v.clone() for k, v in on.state_dict().items()}
    x, _, _ = _inputs((8, 32, 14, 14, 1), torch.float32, seed=9)
    grad = _grad_y(on, x)
    eager = [t.detach().clone() for t in _pair(on, x, torch.float16, grad)]
    on.load_state_dict(state)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _pair(on, x, torch.float16, grad)  # warm-up, then reset what it updated
    torch.cuda.current_stream().wait_stream(side)
    on.load_state_dict(state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        captured = _pair(on, x, torch.float16, grad)
    on.load_state_dict(state)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)


@gpu
def test_compile_fullgraph():
    _, on = _blocks(32, 2)
    x, _, _ = _inputs((4, 32, 16, 16, 2), torch.float32, seed=11)
    state = {k: v.clone() for k, v in on.state_dict().items()}
    eager = on(x)
    on.load_state_dict(state)
    torch.testing.assert_close(torch.compile(on, fullgraph=True)(x), eager)
