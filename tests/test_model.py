import pytest
import torch

from mobilenet.depthwise import DepthwiseConv2d
from mobilenet.model import MobileNetV1, count_macs, count_parameters


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
