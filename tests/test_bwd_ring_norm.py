"""Tests of MDW_BWD_RING_NORM: norm.apply_in_depthwise's stride-1 backward with the BatchNorm's gradient sums
(MBN_DEPTHWISE_BACKWARD=sums) from the backward's rings of grad_out and y rows (depthwise_ring.cu), and with
MBN_DEPTHWISE_BACKWARD=next_norm or next_norm_ring (the default) the BatchNorm after the convolution applied once to
each grad_out word in shared memory.

GPU (`pytest -m gpu`), each with MDW_BWD_RING=1 so that the rings run wherever they fit: the ring's input gradient bit
for bit the input-row walk's, its weight gradient and sums the walk's to a rounding and against float64, outputs
poisoned first, bitwise repeatable; which kernel ran (the profiler's names); the next BatchNorm applied in shared memory
bit for bit bn_relu_bwd followed by the ring; an input the bulk copies cannot take (4-byte aligned) runs the walk and
zeroes the sums' rows the ring would have written; MobileNetV1 steps with the ring against the walk, next_norm's bit
for bit the sums', and a captured step equal to an eager one.
"""

from __future__ import annotations

import pytest
import torch

from test_depthwise_backward_walk import _grad, _stats, backward_mode  # noqa: F401 (a fixture)
from test_kernels import _profiled
from test_norm_in_depthwise import (_DTYPES, _SUMS_ORDER_TOL, _TOL, _WGRAD_ORDER_TOL, _assert_captured_step_equals_eager,
                                    _batch, _ids, _inputs, _model_pair, _poison, _rel, _step)

gpu = pytest.mark.gpu

_CASES = [  # (N, C, H, W, 1): MobileNetV1's stride-1 shapes at small N, 72 channels (36 words: 7 lanes a word), one row
    (4, 64, 56, 56, 1), (5, 128, 28, 28, 1), (6, 256, 14, 14, 1), (16, 512, 14, 14, 1), (3, 72, 9, 13, 1),
    (2, 256, 1, 5, 1), (6, 128, 7, 7, 1),
]
_RING = "bwd_nhwc_ring_kernel"
_WALK = "wgrad_nhwc_input_row_kernel"


def _ring_takes(c, dtype):
    """Whether the rings hold the case: whole 16-byte units of channels, at most 256 32-bit words."""
    words = c if dtype == torch.float32 else c // 2
    return words % 4 == 0 and words <= 256


def _run(fn):
    """fn()'s outputs and which of the two kernels ran."""
    out, names = _profiled(fn)
    return out, any(_RING in n for n in names), any(_WALK in n for n in names)


def _sums_reference(grad_x, y, bn_w, bn_b, mean):
    """float64 sum(g) and sum(g * (y - mean)) of g = grad_x where the ReLU passed, and the scale of their terms."""
    from kernels.norm_ops import batch_norm_relu_train

    g = grad_x.double() * (batch_norm_relu_train(y, bn_w, bn_b)[0] > 0)
    centred = y.double() - mean.double()[None, :, None, None]
    want = torch.stack([g.sum((0, 2, 3)), (g * centred).sum((0, 2, 3))])
    return want, g.abs().sum((0, 2, 3)) * (1 + centred.abs().amax((0, 2, 3)))


@gpu
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", _CASES, ids=_ids)
def test_ring_against_the_walk_and_float64(case, dtype, set_knobs):
    import kernels.norm_depthwise  # noqa: F401  (registers the ops' Python side)

    y, bn_w, bn_b, conv_w, stride = _inputs(case, dtype, seed=71)
    n, c, h, w = y.shape
    grad = _grad(y.shape, dtype, 72)
    mean, invstd = _stats(y, bn_w, bn_b)
    op = torch.ops.mobilenet_dw.depthwise_bwd_normed.default
    args = (grad, y, conv_w, mean, invstd, bn_w, bn_b, [1, 1], [1, 1], True)
    set_knobs(BWD_RING=1, BWD_RING_NORM=0)
    _poison()
    (walk_x, walk_w, walk_sums), ring_ran, walk_ran = _run(lambda: op(*args))
    assert walk_ran and not ring_ran
    set_knobs(BWD_RING=1, BWD_RING_NORM=1)
    _poison()
    (grad_x, grad_w, sums), ring_ran, walk_ran = _run(lambda: op(*args))
    assert ring_ran == _ring_takes(c, dtype) and walk_ran != ring_ran
    assert sums.shape == (torch.ops.mobilenet_dw.bwd_normed_sums_rows(n, c, h, w, 1, dtype), 2, c)
    for name, t in (("grad_input", grad_x), ("grad_weight", grad_w), ("sums", sums)):
        assert torch.isfinite(t).all(), f"{name}: an element was not written"
    assert torch.equal(grad_x, walk_x), "the ring's input gradient must be the walk's, bit for bit"
    assert _rel(grad_w, walk_w) < _WGRAD_ORDER_TOL[dtype]
    want, scale = _sums_reference(grad_x, y, bn_w, bn_b, mean)
    for got in (sums.double().sum(0), walk_sums.double().sum(0)):
        assert ((got - want).abs() <= 1e-5 * scale.clamp_min(1e-30)).all()  # fp32 sums of at most this magnitude
    from test_depthwise_backward_walk import _conv_reference

    ref_x, ref_w = _conv_reference(y, bn_w, bn_b, conv_w, stride, grad)
    assert _rel(grad_x, ref_x) < _TOL[dtype] and _rel(grad_w, ref_w) < _TOL[dtype]
    got_bn = torch.ops.mobilenet_bn.bn_relu_bwd_from_sums.default(grad_x, y, bn_w, bn_b, mean, invstd, sums)
    want_bn = torch.ops.mobilenet_bn.bn_relu_bwd.default(grad_x, y, bn_w, bn_b, mean, invstd)
    for i, (a, b) in enumerate(zip(got_bn, want_bn)):
        assert _rel(a, b) < _WGRAD_ORDER_TOL[dtype], i
    again = op(*args)
    for a, b in zip((grad_x, grad_w, sums), again):
        assert torch.equal(a, b), "the ring must be bitwise repeatable"


@gpu
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", _CASES, ids=_ids)
def test_ring_applies_the_next_norm_bit_for_bit(case, dtype, set_knobs):
    """The ring given the next BatchNorm's output gradient, its input z and its constants: every output bit for bit
    that of bn_relu_bwd's input gradient followed by the ring."""
    import kernels.norm_depthwise  # noqa: F401

    from test_next_norm_walk import _out_norm

    set_knobs(BWD_RING=1, BWD_RING_NORM=1)
    y, bn_w, bn_b, conv_w, _ = _inputs(case, dtype, seed=81)
    mean, invstd = _stats(y, bn_w, bn_b)
    z = torch.ops.mobilenet_dw.depthwise_fwd_normed.default(y, conv_w, mean, invstd, bn_w, bn_b, [1, 1], [1, 1])
    out_w, out_b, out_mean, out_invstd, grad = _out_norm(z, seed=82)
    op = torch.ops.mobilenet_dw.depthwise_bwd_normed.default
    grad_z = torch.ops.mobilenet_bn.bn_relu_bwd.default(grad, z, out_w, out_b, out_mean, out_invstd)[0]
    want = op(grad_z, y, conv_w, mean, invstd, bn_w, bn_b, [1, 1], [1, 1], True)
    consts = torch.ops.mobilenet_bn.bn_relu_bwd_consts.default(grad, z, out_w, out_b, out_mean, out_invstd)[0]
    _poison()
    got, ring_ran, _ = _run(lambda: op(grad, y, conv_w, mean, invstd, bn_w, bn_b, [1, 1], [1, 1], True, z, consts))
    assert ring_ran == _ring_takes(y.shape[1], dtype)
    for name, a, b in zip(("grad_input", "grad_weight", "sums"), got, want):
        assert torch.isfinite(a).all(), f"{name}: an element was not written"
        assert torch.equal(a, b), name


@gpu
@pytest.mark.parametrize("next_norm", [False, True], ids=["sums", "next_norm"])
def test_an_input_the_copies_cannot_take_runs_the_walk(next_norm, set_knobs):
    """y and grad_out 4-byte aligned (a view 2 fp16 elements into its storage): the bulk copies need 16 bytes, so the
    walk runs, and the sums' rows past its chunks (the ring's blocks outnumber them here) are zeros: the results are
    those of the same tensors aligned."""
    import kernels.norm_depthwise  # noqa: F401

    from test_next_norm_walk import _out_norm

    set_knobs(BWD_RING=1, BWD_RING_NORM=1)
    case, dtype = (64, 512, 14, 14, 1), torch.float16
    y, bn_w, bn_b, conv_w, _ = _inputs(case, dtype, seed=91)
    mean, invstd = _stats(y, bn_w, bn_b)
    z = torch.ops.mobilenet_dw.depthwise_fwd_normed.default(y, conv_w, mean, invstd, bn_w, bn_b, [1, 1], [1, 1])
    out_w, out_b, out_mean, out_invstd, grad = _out_norm(z, seed=92)
    extra = ()
    if next_norm:
        extra = (z, torch.ops.mobilenet_bn.bn_relu_bwd_consts.default(grad, z, out_w, out_b, out_mean, out_invstd)[0])

    def shifted(t):
        storage = torch.empty(t.numel() + 2, dtype=t.dtype, device=t.device)
        view = storage[2:].as_strided(t.shape, t.stride())
        view.copy_(t)
        assert view.data_ptr() % 16 == 4 and view.is_contiguous(memory_format=torch.channels_last)
        return view

    op = torch.ops.mobilenet_dw.depthwise_bwd_normed.default
    aligned, ring_ran, _ = _run(lambda: op(grad, y, conv_w, mean, invstd, bn_w, bn_b, [1, 1], [1, 1], True, *extra))
    assert ring_ran
    _poison()
    got, ring_ran, walk_ran = _run(lambda: op(shifted(grad), shifted(y), conv_w, mean, invstd, bn_w, bn_b, [1, 1],
                                              [1, 1], True, *extra))
    assert walk_ran and not ring_ran
    set_knobs(BWD_RING_NORM=0)
    walk_rows = torch.ops.mobilenet_dw.bwd_normed_sums_rows(*case[:4], 1, dtype)
    assert got[2].shape == aligned[2].shape and got[2].shape[0] > walk_rows
    assert torch.count_nonzero(got[2][walk_rows:]) == 0, "the rows the walk does not write must be zeros"
    assert torch.isfinite(got[2]).all() and torch.count_nonzero(got[2][:walk_rows]) > 0
    assert torch.equal(got[0], aligned[0])
    assert _rel(got[1], aligned[1]) < _WGRAD_ORDER_TOL[dtype]
    assert _rel(got[2].double().sum(0), aligned[2].double().sum(0)) < 1e-5


@gpu
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_model_steps_with_the_ring(dtype, set_knobs, backward_mode, deterministic_cudnn):
    """Two MobileNetV1 training steps (width 0.25, norm.apply_in_depthwise on) with the rings and with the walks: the
    sums grouped otherwise, so the gradients agree to the sums' order, and the loss and buffers bit for bit; next_norm
    with the rings bit for bit the sums' with the rings."""
    walk_model, ring_model = _model_pair({"apply_norm_in_depthwise": True}, {})
    next_model = _model_pair({"apply_norm_in_depthwise": True}, {})[1]
    x, target = _batch()
    grads = range(1, 1 + len(list(ring_model.parameters())))
    for _ in range(2):
        backward_mode("sums")
        set_knobs(BWD_RING=1, BWD_RING_NORM=0)
        a = _step(walk_model.train(), x, target, dtype)
        set_knobs(BWD_RING=1, BWD_RING_NORM=1)
        b, names = _profiled(lambda: _step(ring_model.train(), x, target, dtype))
        assert any(_RING in n for n in names)
        backward_mode("next_norm")
        c = _step(next_model.train(), x, target, dtype)
        for i, (u, v, t) in enumerate(zip(a, b, c)):
            assert torch.equal(v, t), i
            if i in grads:
                assert _rel(v, u) < _SUMS_ORDER_TOL[dtype], i
            else:  # the loss and the running statistics come from the forwards, the same kernels
                assert torch.equal(u, v), i


@gpu
def test_next_norm_ring_applies_the_next_norm_only_in_the_ring_layers(set_knobs, backward_mode):
    """MBN_DEPTHWISE_BACKWARD=next_norm_ring with the rings where they fit (16-bit: MobileNetV1's layers of 16 or more
    channels at width 0.25): the step bit for bit the sums step; the ring applies the next BatchNorm, the walks do not;
    with MDW_BWD_RING_NORM=0 no layer runs the rings, so the mode is the sums mode, kernel for kernel."""
    sums_model, ring_model = _model_pair({"apply_norm_in_depthwise": True}, {})
    x, target = _batch()
    set_knobs(BWD_RING=1, BWD_RING_NORM=1)
    backward_mode("sums")
    a, sums_names = _profiled(lambda: _step(sums_model.train(), x, target, torch.float16))
    backward_mode("next_norm_ring")
    b, names = _profiled(lambda: _step(ring_model.train(), x, target, torch.float16))
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), i
    assert any(_RING in n and "true, true>" in n for n in names), "the ring applied no BatchNorm"
    assert not any(_RING in n and "true, true>" in n for n in sums_names)
    assert not any(_applies_next_norm_in_a_walk(n) for n in names), "a walk applied the BatchNorm"
    set_knobs(BWD_RING_NORM=0)
    _, off_names = _profiled(lambda: _step(ring_model.train(), x, target, torch.float16))
    assert not any(_RING in n for n in off_names) and not any(_applies_next_norm_in_a_walk(n) for n in off_names)


def _applies_next_norm_in_a_walk(name: str) -> bool:
    """Whether a kernel is a backward walk that applies the BatchNorm after the conv (GNORM: the stride-1 walk's sixth
    template argument, the stride-2 walk's fourth)."""
    return ((_WALK in name and "true, true, true, true>" in name)
            or ("bwd_nhwc_input_row_s2_kernel" in name and name.split(">")[0].endswith("true, true")))


@gpu
@pytest.mark.parametrize("backward", ["sums", "next_norm", "next_norm_ring"])
def test_captured_step_with_the_ring_equals_eager(backward, set_knobs, backward_mode, deterministic_cudnn):
    set_knobs(BWD_RING=1, BWD_RING_NORM=1)
    backward_mode(backward)
    _assert_captured_step_equals_eager(_model_pair({"apply_norm_in_depthwise": True}, {})[1])
