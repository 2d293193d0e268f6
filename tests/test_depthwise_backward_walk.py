"""Tests of norm.apply_in_depthwise's backward walks: mobilenet_dw::depthwise_bwd_normed, both gradients of the
normalizing depthwise conv in one walk at stride 1, with grad_sums also the BatchNorm backward's gradient sums, which
mobilenet_bn::bn_relu_bwd_from_sums takes instead of its reduce pass, and at stride 2 with grad_sums the stride-2 walk
that gives all three (MBN_DEPTHWISE_BACKWARD=sums, the default; =next_norm adds the BatchNorm after the conv,
tests/test_next_norm_walk.py; =walk without the sums and =separate with the two kernels the walk replaces, for A/B
runs).

CPU (CI): a bad MBN_DEPTHWISE_BACKWARD stops the run naming the choices, and the summary names a mode that is not the
default. GPU (`pytest -m gpu`): both gradients against float64 with outputs poisoned, the input gradient bitwise the
separate kernel's where that runs the column walk, the sums against float64 and the BatchNorm backward from them
against its own, and opcheck; tests/test_norm_in_depthwise.py runs a MobileNetV1 step in each mode against the model
with norm.apply_in_depthwise off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mobilenet.config import compose
from mobilenet.errors import ConfigError
from mobilenet.norm import depthwise_backward_mode
from test_norm_in_depthwise import _DTYPES, _TOL, _WGRAD_ORDER_TOL, _column_everywhere, _ids, _inputs, _poison, _rel

gpu = pytest.mark.gpu


@pytest.fixture
def backward_mode(monkeypatch):
    """Sets MBN_DEPTHWISE_BACKWARD for one test (the mode is read once per process and cached)."""

    def set_mode(mode: str | None):
        if mode is None:
            monkeypatch.delenv("MBN_DEPTHWISE_BACKWARD", raising=False)
        else:
            monkeypatch.setenv("MBN_DEPTHWISE_BACKWARD", mode)
        depthwise_backward_mode.cache_clear()

    yield set_mode
    monkeypatch.delenv("MBN_DEPTHWISE_BACKWARD", raising=False)
    depthwise_backward_mode.cache_clear()


# ---------------------------------------------------------------------------------------------- CPU tests


def test_an_unknown_mode_stops_naming_the_choices(backward_mode):
    backward_mode("both")
    with pytest.raises(ConfigError, match="MBN_DEPTHWISE_BACKWARD must be one of sums, next_norm, next_norm_ring, walk, "
                                          "separate, got 'both'; unset it for the default \\(next_norm_ring\\)"):
        depthwise_backward_mode()
    backward_mode(None)
    assert depthwise_backward_mode() == "next_norm_ring"


def test_validate_refuses_an_unknown_mode_before_any_work(backward_mode):
    from mobilenet.engine import validate

    backward_mode("fused")
    with pytest.raises(ConfigError, match="MBN_DEPTHWISE_BACKWARD must be one of sums, next_norm, next_norm_ring, walk, "
                                          "separate, got 'fused'"):
        validate(compose(["backend=custom", "norm=custom", "channels_last=true"]), torch.device("cpu"))
    validate(compose([]), torch.device("cpu"))  # norm=torch reads no such variable


def test_the_summary_names_a_mode_other_than_the_default(backward_mode):
    from mobilenet.run_record import norm_label

    cfg = compose(["backend=custom", "norm=custom", "channels_last=true", "data=synthetic"])
    backward_mode(None)
    assert "MBN_DEPTHWISE_BACKWARD" not in norm_label(cfg)
    backward_mode("separate")
    assert "(backward: MBN_DEPTHWISE_BACKWARD=separate)" in norm_label(cfg)
    off = compose(["backend=custom", "norm=custom", "channels_last=true", "data=synthetic",
                   "norm.apply_in_depthwise=false"])
    assert "MBN_DEPTHWISE_BACKWARD" not in norm_label(off)  # nothing of the pair runs


# ---------------------------------------------------------------------------------------------- GPU tests

_STRIDE1 = [  # (N, C, H, W, 1): MobileNet's stride-1 shapes at small N, odd sizes, one row and one pixel
    (4, 32, 112, 112, 1), (5, 128, 28, 28, 1), (16, 512, 14, 14, 1), (8, 1024, 7, 7, 1), (7, 6, 9, 11, 1),
    (3, 10, 1, 13, 1), (2, 4, 2, 3, 1), (33, 66, 5, 5, 1),
]
_STRIDE2 = [  # MobileNet's stride-2 shapes at small N; odd and even sizes, one row, one column, one pixel
    (2, 64, 112, 112, 2), (3, 64, 56, 56, 2), (4, 256, 28, 28, 2), (16, 512, 14, 14, 2), (3, 10, 13, 7, 2),
    (5, 6, 2, 9, 2), (2, 4, 1, 3, 2), (3, 8, 7, 1, 2), (33, 66, 5, 5, 2),
]


def _stats(y, bn_w, bn_b):
    mean, invstd, _ = torch.ops.mobilenet_bn.bn_stats.default(y, bn_w, bn_b, 1e-5)
    return mean, invstd


def _grad(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=g).to(dtype).contiguous(memory_format=torch.channels_last)


def _conv_reference(y, bn_w, bn_b, conv_w, stride, grad):
    """float64 gradients of conv(x) for x = relu(batch_norm(y)) as stored in y's dtype: (grad_x, grad_w)."""
    from kernels.norm_ops import batch_norm_relu_train

    x = batch_norm_relu_train(y, bn_w, bn_b)[0].double().requires_grad_()
    w = conv_w.double().requires_grad_()
    out = F.conv2d(x, w, None, stride, 1, groups=y.shape[1])
    out.backward(grad.double())
    return x.grad, w.grad


@gpu
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", _STRIDE1 + _STRIDE2, ids=_ids)
def test_both_gradients_against_float64_and_the_separate_kernels(case, dtype):
    import kernels.norm_depthwise  # noqa: F401  (registers the ops' Python side)

    y, bn_w, bn_b, conv_w, stride = _inputs(case, dtype, seed=11)
    n, c, h, w = y.shape
    grad = _grad((n, c, (h - 1) // stride[0] + 1, (w - 1) // stride[1] + 1), dtype, 12)
    mean, invstd = _stats(y, bn_w, bn_b)
    _poison()
    grad_x, grad_w, _ = torch.ops.mobilenet_dw.depthwise_bwd_normed.default(grad, y, conv_w, mean, invstd, bn_w, bn_b,
                                                                          list(stride), [1, 1])
    assert torch.isfinite(grad_x).all() and torch.isfinite(grad_w).all(), "an output element was not written"
    assert grad_x.is_contiguous(memory_format=torch.channels_last)
    sep_x = torch.ops.mobilenet_dw.depthwise_bwd.default(grad, y, conv_w, list(stride), [1, 1], [1, 1],
                                                         [True, False, False])[0]
    sep_w = torch.ops.mobilenet_dw.depthwise_wgrad_normed.default(grad, y, conv_w, mean, invstd, bn_w, bn_b,
                                                                  list(stride), [1, 1])
    if _column_everywhere(c, dtype):
        assert torch.equal(grad_x, sep_x), "the input gradient must be the rotated-kernel column walk's, bit for bit"
    assert _rel(grad_w, sep_w) < _WGRAD_ORDER_TOL[dtype]
    ref_x, ref_w = _conv_reference(y, bn_w, bn_b, conv_w, stride, grad)
    assert _rel(grad_x, ref_x) < _TOL[dtype]
    assert _rel(grad_w, ref_w) < _TOL[dtype]


@gpu
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", _STRIDE1 + _STRIDE2, ids=_ids)
def test_walk_sums_against_float64_and_the_reduce_pass(case, dtype):
    """grad_sums: the BatchNorm backward's sums of the grad_x the walk wrote against float64, and
    bn_relu_bwd_from_sums with them against bn_relu_bwd (which sums in another order). The conv's gradients: at
    stride 1 those of the walk without the sums, bit for bit (where the sums bring the rings of rows, the weight
    gradient to its summation order and against float64); at stride 2 (the stride-2 walk, in its own summation
    order) those of the two kernels it replaces to a rounding, and both gradients against float64."""
    import kernels.norm_depthwise  # noqa: F401
    from kernels.norm_ops import batch_norm_relu_train

    y, bn_w, bn_b, conv_w, stride = _inputs(case, dtype, seed=31)
    n, c, h, w = y.shape
    s = stride[0]
    grad = _grad((n, c, (h - 1) // s + 1, (w - 1) // s + 1), dtype, 32)
    mean, invstd = _stats(y, bn_w, bn_b)
    walk = torch.ops.mobilenet_dw.depthwise_bwd_normed.default
    _poison()
    grad_x, grad_w, sums = walk(grad, y, conv_w, mean, invstd, bn_w, bn_b, list(stride), [1, 1], True)
    assert sums.shape == (torch.ops.mobilenet_dw.bwd_normed_sums_rows(n, c, h, w, s, dtype), 2, c)
    assert sums.shape[0] > 0
    assert torch.isfinite(sums).all(), "a partial sum was not written"
    assert torch.isfinite(grad_x).all() and torch.isfinite(grad_w).all(), "an output element was not written"
    assert grad_x.is_contiguous(memory_format=torch.channels_last)
    plain_x, plain_w, none = walk(grad, y, conv_w, mean, invstd, bn_w, bn_b, list(stride), [1, 1])
    assert none.numel() == 0
    if s == 1 and not torch.ops.mobilenet_dw.bwd_normed_ring_runs(n, c, h, w, dtype):
        assert torch.equal(grad_x, plain_x) and torch.equal(grad_w, plain_w)
    elif s == 1:  # with the sums the rings of rows run (MDW_BWD_RING_NORM): grad_x's bits, grad_w summed otherwise
        assert torch.equal(grad_x, plain_x)
        assert _rel(grad_w, plain_w) < _WGRAD_ORDER_TOL[dtype]
        assert _rel(grad_w, _conv_reference(y, bn_w, bn_b, conv_w, stride, grad)[1]) < _TOL[dtype]
    else:
        assert _rel(grad_x, plain_x) < _WGRAD_ORDER_TOL[dtype]
        assert _rel(grad_w, plain_w) < _WGRAD_ORDER_TOL[dtype]
        ref_x, ref_w = _conv_reference(y, bn_w, bn_b, conv_w, stride, grad)
        assert _rel(grad_x, ref_x) < _TOL[dtype]
        assert _rel(grad_w, ref_w) < _TOL[dtype]
        again = walk(grad, y, conv_w, mean, invstd, bn_w, bn_b, list(stride), [1, 1], True)
        for a, b in zip((grad_x, grad_w, sums), again):
            assert torch.equal(a, b), "the stride-2 walk must be bitwise repeatable"
    g = grad_x.double() * (batch_norm_relu_train(y, bn_w, bn_b)[0] > 0)
    want = torch.stack([g.sum((0, 2, 3)), (g * (y.double() - mean.double()[None, :, None, None])).sum((0, 2, 3))])
    got = sums.double().sum(0)
    scale = (g.abs().sum((0, 2, 3)) * (1 + (y.double() - mean.double()[None, :, None, None]).abs().amax((0, 2, 3))))
    assert ((got - want).abs() <= 1e-5 * scale.clamp_min(1e-30)).all()  # fp32 sums of at most this magnitude
    _poison()
    got_bn = torch.ops.mobilenet_bn.bn_relu_bwd_from_sums.default(grad_x, y, bn_w, bn_b, mean, invstd, sums)
    for t in got_bn:
        assert torch.isfinite(t).all(), "an output element was not written"
    want_bn = torch.ops.mobilenet_bn.bn_relu_bwd.default(grad_x, y, bn_w, bn_b, mean, invstd)
    for i, (a, b) in enumerate(zip(got_bn, want_bn)):
        assert _rel(a, b) < _WGRAD_ORDER_TOL[dtype], i


@gpu
def test_op_opcheck():
    import kernels.norm_depthwise  # noqa: F401

    walk = torch.ops.mobilenet_dw.depthwise_bwd_normed.default
    for stride, out in ((1, 9), (2, 5)):
        y, bn_w, bn_b, conv_w, _ = _inputs((4, 16, 9, 9, stride), torch.float16, seed=21)
        grad = _grad((4, 16, out, out), torch.float16, 22)
        for grad_sums in (False, True):  # with the sums, stride 2 runs its own walk
            torch.library.opcheck(walk, (grad, y, conv_w, *_stats(y, bn_w, bn_b), bn_w, bn_b, [stride] * 2, [1, 1],
                                         grad_sums))
    mean, invstd = _stats(y, bn_w, bn_b)
    grad_x = _grad(y.shape, torch.float16, 23)
    sums = torch.randn(3, 2, 16, device="cuda")
    torch.library.opcheck(torch.ops.mobilenet_bn.bn_relu_bwd_from_sums.default,
                          (grad_x, y, bn_w, bn_b, mean, invstd, sums))


@gpu
@pytest.mark.parametrize("pairs", ["2", "4"])
def test_stride2_walk_keeps_results_at_each_pairs_setting(pairs):
    """MDW_S2_WALK_PAIRS (read once per process): the stride-2 cases of the sums test in a process of their own with
    2 and with 4 column pairs' loads in flight, so that both are checked in every dtype whatever the defaults."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MDW_S2_WALK_PAIRS": pairs}
    test = f"{__file__}::test_walk_sums_against_float64_and_the_reduce_pass"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-k", "s2",
                           test], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"MDW_S2_WALK_PAIRS={pairs}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    assert f"{3 * len(_STRIDE2)} passed" in proc.stdout, proc.stdout[-1000:]
