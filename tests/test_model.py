import pytest
import torch

from mobilenet.depthwise import DepthwiseConv2d
from mobilenet.model import GlobalAvgPool, MobileNetV1, count_macs, count_parameters


def test_parameter_and_mac_counts_match_the_paper():
    model = MobileNetV1(num_classes=1000, width_mult=1.0)
    assert count_parameters(model) == 4_231_976  # 4.23M with BatchNorm
    assert round(count_macs(model, 224) / 1e6) == 569  # ~569M multiply-adds (Table 1)


@pytest.mark.parametrize("alpha, params_m, macs_m", [(0.75, 2.59, 325), (0.5, 1.33, 149), (0.25, 0.47, 41)])
def test_width_multiplier_scales_like_table_6(alpha, params_m, macs_m):
    model = MobileNetV1(width_mult=alpha)
    assert round(count_parameters(model) / 1e6, 2) == params_m
    assert round(count_macs(model, 224) / 1e6) == macs_m


def test_every_depthwise_layer_goes_through_the_backend_registry():
    model = MobileNetV1(depthwise="torch")
    dw = [m for m in model.modules() if isinstance(m, DepthwiseConv2d)]
    assert len(dw) == 13
    assert {m.backend.name for m in dw} == {"torch"}
    assert [m.stride for m in dw].count((2, 2)) == 4


@pytest.mark.parametrize("resolution, classes", [(32, 10), (97, 3), (160, 1000)])
def test_any_resolution_and_class_count(resolution, classes):
    model = MobileNetV1(num_classes=classes, width_mult=0.25).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, resolution, resolution))
    assert out.shape == (2, classes)
    assert torch.isfinite(out).all()


def test_bad_model_arguments_are_rejected():
    with pytest.raises(ValueError, match="width_mult"):
        MobileNetV1(width_mult=0)
    with pytest.raises(ValueError, match="unknown depthwise backend 'cuda'; choose one of: cudnn, custom, torch"):
        MobileNetV1(depthwise="cuda")


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_global_pool_gives_autograds_values_with_the_gradient_in_the_inputs_layout(channels_last, dtype):
    # A channels_last gradient spares the last BatchNorm's backward a transpose; the values must stay autograd's.
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(3, 8, 7, 5, dtype=dtype).contiguous(memory_format=fmt)
    g = torch.randn(3, 8, dtype=dtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    grads = {}
    a.register_hook(lambda t: grads.__setitem__("ours", t))
    b.register_hook(lambda t: grads.__setitem__("autograd", t))
    ours, ref = GlobalAvgPool()(a), torch.nn.AdaptiveAvgPool2d(1)(b).flatten(1)
    assert torch.equal(ours, ref)
    ours.backward(g)
    ref.backward(g)
    assert torch.equal(grads["ours"], grads["autograd"])
    assert grads["ours"].is_contiguous(memory_format=fmt)
    assert torch.equal(a.grad, b.grad)


def test_global_pool_compiles_without_a_graph_break():
    x = torch.randn(2, 4, 3, 3).contiguous(memory_format=torch.channels_last).requires_grad_()
    out = torch.compile(GlobalAvgPool(), fullgraph=True, backend="aot_eager")(x)
    out.sum().backward()
    assert torch.equal(out, x.detach().mean((2, 3)))
    assert torch.allclose(x.grad, torch.full_like(x, 1 / 9))
