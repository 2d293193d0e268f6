"""Tests of MBN_NORM_INPUT_GRAD=dgrad: the input gradient of the BatchNorm + ReLU before a depthwise conv computed by
the tiled input-gradient kernel from grad_out (mobilenet_dw::depthwise_dgrad_normed, with the constants of
mobilenet_bn::bn_relu_bwd_consts_from_sums), after the backward walk gave only the BatchNorm's sums and the weight
gradient (mobilenet_dw::depthwise_bwd_normed_sums), so the conv's input gradient is never written or read back.

CPU (CI): the variable is validated with the others before any work, refused with a backward that gives no sums, and
named in the summary; the cases the kernel does not take are named. GPU (`pytest -m gpu`): the pair against float64
(poisoned outputs) and against the default path (the same sums, constants and weight gradient where both run the
walk; y's gradient within its dtype's rounding, since the tiled kernel sums the taps in its own order), opcheck of the
three ops, clear errors, and a MobileNetV1 step with it on against the default one, captured and eager bitwise.
"""

from __future__ import annotations

import pytest
import torch

from mobilenet.config import compose
from mobilenet.errors import ConfigError

# ---------------------------------------------------------------------------------------------- CPU tests


@pytest.fixture
def env(monkeypatch):
    """setenv for the norm's A/B variables, read once per process: their caches cleared before and after."""
    from mobilenet import norm

    def clear():
        norm.depthwise_backward_mode.cache_clear()
        norm.norm_input_grad_mode.cache_clear()

    clear()
    yield monkeypatch.setenv
    clear()


_PAIR = ["backend=custom", "norm=custom", "channels_last=true", "data=synthetic"]


def test_an_unknown_value_is_refused_naming_the_choices(env):
    from mobilenet.norm import check_ab_environment

    env("MBN_NORM_INPUT_GRAD", "kernel")
    with pytest.raises(ConfigError, match="MBN_NORM_INPUT_GRAD must be one of pass, dgrad, got 'kernel'"):
        check_ab_environment(compose(_PAIR))


@pytest.mark.parametrize("backward", ["walk", "separate"])
def test_dgrad_needs_a_backward_that_gives_the_sums(env, backward):
    from mobilenet.norm import check_ab_environment

    env("MBN_NORM_INPUT_GRAD", "dgrad")
    env("MBN_DEPTHWISE_BACKWARD", backward)
    with pytest.raises(ConfigError, match=f"needs the gradient sums .*got MBN_DEPTHWISE_BACKWARD={backward}"):
        check_ab_environment(compose(_PAIR))


@pytest.mark.parametrize("backward", ["sums", "next_norm", "next_norm_ring"])
def test_dgrad_composes_with_every_backward_that_gives_the_sums(env, backward):
    from mobilenet.norm import check_ab_environment, norm_input_grad_mode

    env("MBN_NORM_INPUT_GRAD", "dgrad")
    env("MBN_DEPTHWISE_BACKWARD", backward)
    check_ab_environment(compose(_PAIR))
    assert norm_input_grad_mode() == "dgrad"


def test_the_summary_names_it_only_when_set(env):
    from mobilenet.run_record import norm_label

    cfg = compose([*_PAIR, "norm.apply_in_depthwise=true"])
    assert "MBN_NORM_INPUT_GRAD" not in norm_label(cfg)
    env("MBN_NORM_INPUT_GRAD", "dgrad")
    from mobilenet import norm

    norm.norm_input_grad_mode.cache_clear()
    assert "MBN_NORM_INPUT_GRAD=dgrad" in norm_label(cfg)
    assert "MBN_NORM_INPUT_GRAD" not in norm_label(cfg, training=False)


# ---------------------------------------------------------------------------------------------- GPU tests

gpu = pytest.mark.gpu

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CASES = [  # (N, C, H, W, stride): MobileNetV1's stride-2 and non-ring shapes at small N, odd sizes, one image
    (4, 32, 112, 112, 1), (3, 64, 112, 112, 2), (5, 128, 56, 56, 2), (2, 256, 28, 28, 2), (16, 512, 14, 14, 2),
    (8, 1024, 7, 7, 1), (7, 8, 9, 11, 1), (3, 16, 13, 7, 2), (1, 8, 3, 3, 1), (33, 64, 5, 5, 2),
]


def _ids(case):
    return "x".join(map(str, case[:4])) + f"s{case[4]}"


def _pair(y, bn_w, bn_b, conv_w, stride, grad, grad_in_dgrad):
    """The pair's output and the gradients of y, BatchNorm weight and bias, and conv weight, outputs poisoned."""
    from kernels.norm_depthwise import batch_norm_relu_depthwise_conv2d
    from test_norm_in_depthwise import _poison

    leaves = [t.detach().clone().requires_grad_() for t in (y, bn_w, bn_b, conv_w)]
    _poison()
    out = batch_norm_relu_depthwise_conv2d(*leaves, stride, (1, 1), walk_sums=True, grad_in_dgrad=grad_in_dgrad)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


@gpu
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", _CASES, ids=_ids)
def test_pair_against_float64_and_the_default_path(case, dtype):
    from test_norm_in_depthwise import _TOL, _WGRAD_ORDER_TOL, _inputs, _reference, _rel

    y, bn_w, bn_b, conv_w, stride = _inputs(case, dtype, seed=11)
    n, c, h, w = y.shape
    g = torch.Generator(device="cuda").manual_seed(12)
    grad = torch.randn(n, c, (h - 1) // stride[0] + 1, (w - 1) // stride[1] + 1, device="cuda", generator=g)
    grad = grad.to(dtype).contiguous(memory_format=torch.channels_last)
    got = _pair(y, bn_w, bn_b, conv_w, stride, grad, True)
    for t in got:
        assert torch.isfinite(t).all(), "an output element was not written"
    ref = _reference(y, bn_w, bn_b, conv_w, stride, grad)
    for i, (a, want) in enumerate(zip(got, ref)):
        assert _rel(a, want) < _TOL[dtype], i
    default = _pair(y, bn_w, bn_b, conv_w, stride, grad, False)
    assert torch.equal(got[0], default[0])  # the forward is the same op
    ring = stride[0] == 1 and torch.ops.mobilenet_dw.bwd_normed_ring_runs(n, c, h, w, dtype)
    if not ring:  # the same walk gives the sums and the weight gradient in both
        for i in (2, 3, 4):
            assert torch.equal(got[i], default[i]), i
    else:  # the rings' sums and weight gradient against the walk's: another order
        for i in (2, 3, 4):
            assert _rel(got[i], default[i]) < _WGRAD_ORDER_TOL[dtype], i
    # y's gradient: the tiled kernel's taps in its own order, each value rounded as depthwise_bwd stores it.
    assert _rel(got[1], default[1]) < _TOL[dtype]


@gpu
def test_ops_opcheck_and_clear_errors():
    from kernels.norm_depthwise import batch_norm_relu_depthwise_conv2d
    from test_norm_in_depthwise import _opcheck_inputs

    y, bn_w, bn_b, conv_w, stride, grad, norm = _opcheck_inputs()
    mean, invstd = norm[:2]
    torch.library.opcheck(torch.ops.mobilenet_dw.depthwise_bwd_normed_sums.default,
                          (grad, y, conv_w, *norm, [2, 2], [1, 1]))
    _, sums = torch.ops.mobilenet_dw.depthwise_bwd_normed_sums.default(grad, y, conv_w, *norm, [2, 2], [1, 1])
    torch.library.opcheck(torch.ops.mobilenet_bn.bn_relu_bwd_consts_from_sums.default,
                          (y, bn_w, bn_b, mean, invstd, sums))
    consts = torch.ops.mobilenet_bn.bn_relu_bwd_consts_from_sums.default(y, bn_w, bn_b, mean, invstd, sums)[0]
    torch.library.opcheck(torch.ops.mobilenet_dw.depthwise_dgrad_normed.default,
                          (grad, conv_w, y, consts, [2, 2], [1, 1]))
    # The constants are bn_relu_bwd_consts' where the sums are those of the stored input gradient.
    gx, _, walk_sums = torch.ops.mobilenet_dw.depthwise_bwd_normed.default(grad, y, conv_w, *norm, [2, 2], [1, 1],
                                                                           True)
    assert torch.equal(walk_sums, sums)
    from_pass = torch.ops.mobilenet_bn.bn_relu_bwd_consts.default(gx, y, bn_w, bn_b, mean, invstd)[0]
    assert torch.allclose(consts, from_pass, rtol=1e-3, atol=1e-5)
    odd = y[:, :12].contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="multiple of 8 float16 channels, got 12"):
        batch_norm_relu_depthwise_conv2d(odd, bn_w[:12], bn_b[:12], conv_w[:12], stride, walk_sums=True,
                                         grad_in_dgrad=True)
    with pytest.raises(ValueError, match="grad_in_dgrad needs the walk's sums"):
        batch_norm_relu_depthwise_conv2d(y, bn_w, bn_b, conv_w, stride, grad_in_dgrad=True)
    with pytest.raises(RuntimeError, match="depthwise_dgrad_normed: consts must be a float32 \\(6, 16\\)"):
        torch.ops.mobilenet_dw.depthwise_dgrad_normed.default(grad, conv_w, y, consts[:5], [2, 2], [1, 1])


@gpu
@pytest.mark.parametrize("backward", ["sums", "next_norm_ring"])  # MBN_DEPTHWISE_BACKWARD
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_model_step_with_it_on_matches_the_default(env, dtype, backward, deterministic_cudnn):
    from test_norm_in_depthwise import _SUMS_ORDER_TOL, _WGRAD_ORDER_TOL, _batch, _models, _rel, _step

    env("MBN_DEPTHWISE_BACKWARD", backward)
    _, default = _models(dtype)
    x, target = _batch()
    a = _step(default.train(), x, target, dtype)
    from mobilenet import norm

    env("MBN_NORM_INPUT_GRAD", "dgrad")
    norm.norm_input_grad_mode.cache_clear()
    _, dgrad = _models(dtype)
    b = _step(dgrad.train(), x, target, dtype)
    assert torch.equal(a[0], b[0])  # the forward is the same
    n_params = len(list(dgrad.parameters()))
    for i, (u, v) in enumerate(zip(a, b)):
        if 1 <= i <= n_params:
            # y's gradient summed in the tiled kernel's order (and, at stride 1, the walk's sums and weight
            # gradient where the default runs the rings): every gradient upstream moves by a few roundings.
            assert _rel(v, u) < _SUMS_ORDER_TOL[dtype] + _WGRAD_ORDER_TOL[dtype], i
        else:
            assert torch.equal(u, v), i


@gpu
def test_captured_model_step_equals_eager(env, deterministic_cudnn):
    from test_norm_in_depthwise import _assert_captured_step_equals_eager, _models

    env("MBN_NORM_INPUT_GRAD", "dgrad")
    _assert_captured_step_equals_eager(_models(torch.float16)[1])
