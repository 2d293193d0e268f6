"""Tests of model.stem_weight_grad=custom: the stem convolution's weight gradient from this project's kernel
(mobilenet_stem::conv3x3_weight_grad, kernels/stem_ops.py).

CPU (CI): the config composes (cudnn by default) and refuses other values, validate() refuses custom without a GPU,
without channels_last and with a width whose stem channels do not fill 16-byte vectors, naming each; the kernel's
argument checks name what is off; the default model keeps a plain nn.Conv2d stem; the custom model has the same
state_dict and the same eval output; the summary names who computed the gradient. GPU (`pytest -m gpu`): the op
against float64 over a grid of shapes and every dtype with its output poisoned, bitwise repeatable, opcheck, the
autocast path's output and gradient against cuDNN's, the whole model's step against the cudnn stem's, and a captured
step bitwise the eager one.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.stem_args import stem_unsupported
from mobilenet.config import compose
from mobilenet.model import MobileNetV1, StemConv2d

gpu = pytest.mark.gpu
CL = torch.channels_last

# ---------------------------------------------------------------------------------------------- CPU tests


def test_config_default_is_cudnn_and_custom_composes():
    from mobilenet.config import enum_value

    assert enum_value(compose([]).model.stem_weight_grad) == "cudnn"
    assert enum_value(compose(["model.stem_weight_grad=custom"]).model.stem_weight_grad) == "custom"


def test_an_unknown_value_is_refused_naming_the_choices():
    from mobilenet.config import check_overrides
    from mobilenet.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.stem_weight_grad=winograd: .*'winograd'.*\[cudnn, custom\]"):
        check_overrides(["model.stem_weight_grad=winograd"])


@pytest.mark.parametrize("overrides, device, missing", [
    ([], "cpu", "a CUDA GPU"),
    (["channels_last=false"], "cuda", "channels_last=true"),
    (["amp=true", "model.width_mult=0.3"], "cuda", "a multiple of 8 under amp .*gives 9"),
    (["model.width_mult=0.3"], "cuda", "a multiple of 4 in fp32 .*gives 9"),
])
def test_validate_refuses_custom_where_it_cannot_run(overrides, device, missing):
    from mobilenet.engine import _check_stem_weight_grad
    from mobilenet.errors import ConfigError

    cfg = compose(["channels_last=true", *overrides, "model.stem_weight_grad=custom"])
    with pytest.raises(ConfigError, match=f"model.stem_weight_grad=custom needs .*{missing}.*"
                                          "or set model.stem_weight_grad=cudnn"):
        _check_stem_weight_grad(cfg, torch.device(device))
    _check_stem_weight_grad(compose([*overrides]), torch.device(device))  # cudnn: nothing to refuse


def test_validate_accepts_custom_where_it_can_run():
    from mobilenet.engine import _check_stem_weight_grad

    for amp in ("true", "false"):
        _check_stem_weight_grad(compose([f"amp={amp}", "channels_last=true", "model.stem_weight_grad=custom"]),
                                torch.device("cuda"))


def _x(shape=(2, 3, 16, 16), fmt=CL, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype).to(memory_format=fmt)


@pytest.mark.parametrize("x, w, dtype, stride, padding, words", [
    (_x((2, 4, 16, 16)), torch.zeros(32, 4, 3, 3), torch.float32, 2, 1, "3 channels .* got shape \\(2, 4, 16, 16\\)"),
    (_x(), torch.zeros(32, 3, 5, 5), torch.float32, 2, 1, "3x3 kernel .* got weight shape \\(32, 3, 5, 5\\)"),
    (_x(), torch.zeros(32, 3, 3, 3), torch.float64, 2, 1, "float32, float16 or bfloat16, got torch.float64"),
    (_x(fmt=torch.contiguous_format), torch.zeros(32, 3, 3, 3), torch.float32, 2, 1, "channels_last"),
    (_x(), torch.zeros(32, 3, 3, 3), torch.float32, 3, 1, "stride 1 or 2.* got \\(3, 3\\)"),
    (_x(), torch.zeros(32, 3, 3, 3), torch.float32, (2, 1), 1, "stride 1 or 2.* got \\(2, 1\\)"),
    (_x(), torch.zeros(32, 3, 3, 3), torch.float32, 2, 3, "padding 0, 1 or 2.* got \\(3, 3\\)"),
    (_x((2, 3, 1, 1)), torch.zeros(32, 3, 3, 3), torch.float32, 2, 0, "padded input 1x1 is smaller"),
    (_x(), torch.zeros(12, 3, 3, 3), torch.float16, 2, 1, "a multiple of 8 in torch.float16, got 12"),
    (_x(), torch.zeros(10, 3, 3, 3), torch.float32, 2, 1, "a multiple of 4 in torch.float32, got 10"),
    (_x(), torch.zeros(32, 3, 3, 3), torch.float32, 2, 1, "a CUDA tensor, got one on cpu"),
])
def test_the_kernels_argument_checks_name_what_is_off(x, w, dtype, stride, padding, words):
    why = stem_unsupported(x, w, dtype, stride, padding)
    assert why is not None and re.search(words, why), why


def test_the_kernels_argument_checks_accept_the_stem():
    assert stem_unsupported(_x((2, 3, 224, 224)), torch.zeros(32, 3, 3, 3), torch.float16, 2, 1) == \
        "it needs a CUDA tensor, got one on cpu"  # every other condition holds: the device is checked last


def test_the_default_model_keeps_a_plain_conv_and_custom_has_the_same_state_dict():
    torch.manual_seed(0)
    plain = MobileNetV1(num_classes=10, width_mult=0.25)
    assert type(plain.features[0][0]) is nn.Conv2d
    custom = MobileNetV1(num_classes=10, width_mult=0.25, stem_weight_grad="custom")
    assert type(custom.features[0][0]) is StemConv2d
    a, b = plain.state_dict(), custom.state_dict()
    assert list(a) == list(b) and all(a[k].shape == b[k].shape for k in a)
    custom.load_state_dict(a)
    plain.eval(), custom.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(plain(x), custom(x))  # eval runs nn.Conv2d's forward


def test_an_unknown_stem_weight_grad_is_refused():
    with pytest.raises(ValueError, match="unknown model.stem_weight_grad 'winograd'; choose one of: cudnn, custom"):
        MobileNetV1(num_classes=10, stem_weight_grad="winograd")


def test_the_training_summary_names_who_computed_the_stem_weight_gradient():
    from mobilenet.reporting import environment
    from mobilenet.run_record import config_rows

    cpu, env = torch.device("cpu"), environment()
    assert config_rows(compose(["data=synthetic"]), cpu, env)["stem weight gradient"] == "cudnn"
    custom = compose(["data=synthetic", "model.stem_weight_grad=custom"])
    assert config_rows(custom, cpu, env)["stem weight gradient"] == "custom (kernels/csrc/stem_weight_grad.cu)"
    assert "stem weight gradient" not in config_rows(custom, cpu, env, training=False)  # inference computes none


# ---------------------------------------------------------------------------------------------- GPU tests


def _weight_grad_reference(x: torch.Tensor, gy: torch.Tensor, stride: int, padding: int):
    """float64 weight gradient and the same sum over |terms| (the scale of its rounding error)."""
    x64, gy64 = x.double().cpu(), gy.double().cpu()
    shape = (gy.shape[1], x.shape[1], 3, 3)
    ref = torch.nn.grad.conv2d_weight(x64, shape, gy64, stride=stride, padding=padding)
    scale = torch.nn.grad.conv2d_weight(x64.abs(), shape, gy64.abs(), stride=stride, padding=padding)
    return ref, scale


def _poisoned_call(gy, x, stride, padding):
    """The op after NaN blocks of its output's and workspace's sizes went back to the caching allocator."""
    k = gy.shape[1]
    for n in (k * 27, 1 << 20):
        torch.full((n,), float("nan"), device=gy.device)
    return torch.ops.mobilenet_stem.conv3x3_weight_grad(gy, x, [stride, stride], [padding, padding])


SHAPES = [  # N, H, W, K, stride, padding
    (2, 224, 224, 32, 2, 1),  # the stem at 224 px
    (3, 37, 29, 32, 2, 1),    # odd sizes: partial tiles
    (2, 32, 32, 8, 2, 1),     # width 0.25
    (2, 31, 17, 24, 2, 1),    # width 0.75
    (1, 64, 48, 64, 2, 1),    # two slices of 32 output channels
    (2, 23, 19, 40, 1, 1),    # stride 1, a partial slice
    (2, 20, 20, 16, 1, 0),
    (2, 15, 15, 16, 2, 2),
    (1, 9, 700, 16, 2, 1),    # a wide row: the tile's loads exceed the register slots
]


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, h, w, k, stride, padding", SHAPES)
def test_weight_grad_against_float64(n, h, w, k, stride, padding, dtype):
    import kernels.stem_ops  # noqa: F401  (registers the op)

    if k * torch.empty(0, dtype=dtype).element_size() % 16:
        pytest.skip("channels that do not fill 16-byte vectors in this dtype")
    torch.manual_seed(n * h + w + k)
    x = torch.randn(n, 3, h, w, device="cuda").to(dtype).to(memory_format=CL)
    ho, wo = (h + 2 * padding - 3) // stride + 1, (w + 2 * padding - 3) // stride + 1
    gy = torch.randn(n, k, ho, wo, device="cuda").to(dtype).to(memory_format=CL)
    got = _poisoned_call(gy, x, stride, padding)
    assert got.dtype == torch.float32 and got.shape == (k, 3, 3, 3) and got.is_contiguous()
    ref, scale = _weight_grad_reference(x, gy, stride, padding)
    err = (got.double().cpu() - ref).abs()
    assert torch.isfinite(got).all()
    assert (err <= 1e-5 * scale + 1e-6).all(), f"max error / scale {(err / scale).max().item():.3g}"
    again = torch.ops.mobilenet_stem.conv3x3_weight_grad(gy, x, [stride, stride], [padding, padding])
    assert torch.equal(got, again)  # bitwise repeatable


@gpu
def test_opcheck():
    import kernels.stem_ops  # noqa: F401

    x = torch.randn(2, 3, 20, 18, device="cuda", dtype=torch.float16).to(memory_format=CL)
    gy = torch.randn(2, 16, 10, 9, device="cuda", dtype=torch.float16).to(memory_format=CL)
    torch.library.opcheck(torch.ops.mobilenet_stem.conv3x3_weight_grad.default, (gy, x, [2, 2], [1, 1]))


@gpu
@pytest.mark.parametrize("amp_dtype", [None, torch.float16, torch.bfloat16])
def test_stem_conv2d_matches_cudnn_forward_and_gradient(amp_dtype):
    from kernels.stem_ops import stem_conv2d

    torch.manual_seed(1)
    x = torch.randn(4, 3, 64, 64, device="cuda").to(amp_dtype or torch.float32).to(memory_format=CL)
    w = torch.randn(32, 3, 3, 3, device="cuda").to(memory_format=CL).requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=amp_dtype or torch.float16, enabled=amp_dtype is not None):
        y = stem_conv2d(x, w, (2, 2), (1, 1))
        y_ref = F.conv2d(x, w_ref, None, 2, 1)
    assert y.dtype == y_ref.dtype and y.is_contiguous(memory_format=CL)
    assert torch.equal(y, y_ref)  # the forward is cuDNN's in both
    gy = torch.randn_like(y)
    y.backward(gy)
    y_ref.backward(gy)
    assert w.grad.dtype == torch.float32 and w.grad.shape == w.shape
    ref, scale = _weight_grad_reference(x.to(y.dtype), gy, 2, 1)
    assert ((w.grad.double().cpu() - ref).abs() <= 1e-5 * scale + 1e-6).all()
    # cuDNN's rounds its gradient to the compute dtype under autocast: within that rounding
    assert torch.allclose(w.grad, w_ref.grad, rtol=1e-2 if amp_dtype else 1e-4, atol=1e-3 * scale.max().item())


@gpu
def test_an_input_that_needs_a_gradient_gets_cudnns():
    from kernels.stem_ops import stem_conv2d

    x = torch.randn(2, 3, 16, 16, device="cuda").to(memory_format=CL).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    w = torch.randn(8, 3, 3, 3, device="cuda")
    stem_conv2d(x, w, (2, 2), (1, 1)).sum().backward()
    F.conv2d(x_ref, w, None, 2, 1).sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)


@gpu
def test_unsupported_input_is_refused_before_the_op():
    from kernels.stem_ops import stem_conv2d

    with pytest.raises(ValueError, match="custom stem weight gradient cannot run here: it needs the input in "
                                         "channels_last"):
        stem_conv2d(torch.randn(2, 3, 16, 16, device="cuda"), torch.randn(8, 3, 3, 3, device="cuda"), 2, 1)


def _model_step(stem_weight_grad: str, x, target, amp: bool):
    torch.manual_seed(0)
    model = MobileNetV1(num_classes=10, width_mult=0.25, stem_weight_grad=stem_weight_grad).cuda().to(
        memory_format=CL)
    with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
        loss = F.cross_entropy(model(x), target)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@gpu
@pytest.mark.parametrize("amp", [False, True])
def test_model_step_matches_the_cudnn_stem(amp, deterministic_cudnn):
    # cuDNN computes fp32 convolutions in TF32 by default (10-bit mantissa): the reference stem's weight gradient then
    # differed from the kernel's fp32 one by 4e-4 of its values (H100, 2026-12-05). The kernel matches float64 to fp32
    # rounding (test_weight_grad_against_float64), so the reference is computed in fp32 here too.
    torch.backends.cudnn.allow_tf32 = False  # restored by the autouse _cudnn_flags_restored
    torch.manual_seed(2)
    x = torch.randn(8, 3, 64, 64, device="cuda").to(memory_format=CL)
    x = x.half() if amp else x
    target = torch.randint(0, 10, (8,), device="cuda")
    loss, grads = _model_step("custom", x, target, amp)
    loss_ref, grads_ref = _model_step("cudnn", x, target, amp)
    assert torch.equal(loss, loss_ref)  # the same forward
    for name, g in grads.items():
        if name == "features.0.0.weight":
            assert torch.allclose(g, grads_ref[name], rtol=2e-2 if amp else 1e-4, atol=1e-2 if amp else 1e-5)
        else:
            assert torch.equal(g, grads_ref[name]), name  # the stem's weight gradient feeds nothing upstream


@gpu
def test_captured_step_equals_eager():
    from kernels.stem_ops import stem_conv2d

    x = torch.randn(4, 3, 64, 64, device="cuda", dtype=torch.float16).to(memory_format=CL)
    w = torch.randn(32, 3, 3, 3, device="cuda").requires_grad_()
    gy = torch.randn(4, 32, 32, 32, device="cuda", dtype=torch.float16).to(memory_format=CL)

    def step():
        w.grad = None
        with torch.autocast("cuda", dtype=torch.float16):
            y = stem_conv2d(x, w, (2, 2), (1, 1))
        y.backward(gy)
        return w.grad

    eager = step().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@gpu
def test_compiled_step_matches_eager():
    """compile=true: the op's fake kernel lets Dynamo trace the Function without a graph break."""
    from kernels.stem_ops import stem_conv2d

    x = torch.randn(4, 3, 32, 32, device="cuda", dtype=torch.float16).to(memory_format=CL)
    w = torch.randn(16, 3, 3, 3, device="cuda").requires_grad_()

    def loss_of(x, w):
        with torch.autocast("cuda", dtype=torch.float16):
            return stem_conv2d(x, w, (2, 2), (1, 1)).float().square().mean()

    loss_of(x, w).backward()
    eager = w.grad.clone()
    w.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(loss_of, fullgraph=True)
    compiled(x, w).backward()
    assert torch.allclose(w.grad, eager, rtol=1e-3, atol=1e-5)


@gpu
def test_a_captured_fit_with_the_custom_stem_learns_and_says_so(tmp_path):
    """The whole training path: perf.amp_weight_cast (the weight reaches the stem as its fp16 copy), the captured
    step, and the summary row."""
    from mobilenet.engine import Trainer

    run = ["device=cuda", "progress=false", "data=synthetic", "data.steps_per_epoch=12", "data.num_classes=100",
           "data.batch_size=32", "data.resolution=64", "evaluate=false", "save_checkpoints=false", "epochs=1",
           "perf.warmup_steps=2", "perf.log_every=1", "optim.warmup_epochs=0.5", "backend=custom", "norm=custom",
           "amp=true", "channels_last=true", "cuda_graph=true", "model.stem_weight_grad=custom"]
    t = Trainer(compose(run), tmp_path)
    assert isinstance(t.model.features[0][0], StemConv2d)
    result = t.fit()
    losses = [v for _, v in result.losses]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert t.summary_rows(result)["stem weight gradient"] == "custom (kernels/csrc/stem_weight_grad.cu)"
