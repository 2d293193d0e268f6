"""Each depthwise backend against F.conv2d, where it can run; and clear errors where it cannot."""

import pytest
import torch
import torch.nn.functional as F

from mobilenet.depthwise import BackendUnavailable, DepthwiseConv2d, available_backends, get_backend
from test_kernels import _profiled


def test_registry_lists_the_three_backends():
    assert available_backends() == ["cudnn", "custom", "torch"]


@pytest.mark.parametrize("stride, padding, dilation, k", [(1, 1, 1, 3), (2, 1, 1, 3), (1, 2, 2, 3), (2, 2, 1, 5)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_torch_backend_matches_conv2d_in_float64(stride, padding, dilation, k, channels_last):
    torch.manual_seed(0)
    layer = DepthwiseConv2d(6, k, stride, padding, dilation, bias=True, backend="torch").double()
    x = torch.randn(3, 6, 11, 9, dtype=torch.float64, requires_grad=True)
    if channels_last:
        x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    out = layer(x)
    ref = F.conv2d(x, layer.weight, layer.bias, stride, padding, dilation, groups=6)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, layer.weight), g)
    rx, rw = torch.autograd.grad(ref, (x, layer.weight), g)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


@pytest.mark.parametrize("name", ["cudnn", "custom"])
def test_gpu_backends_refuse_a_cpu_device_with_a_clear_error(name):
    with pytest.raises(BackendUnavailable, match=rf"backend={name} needs a CUDA GPU.*Use backend=torch"):
        get_backend(name).check(torch.device("cpu"))


# --- GPU: cuDNN forced in every dtype and layout ----------------------------------------------------------------

CASES = [(dt, cl) for dt in (torch.float32, torch.float16, torch.bfloat16) for cl in (False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, channels_last", CASES)
@pytest.mark.parametrize("stride", [1, 2])
def test_cudnn_backend_matches_float64_reference(dtype, channels_last, stride):
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    x64 = torch.randn(4, 24, 15, 13, dtype=torch.float64)
    w64 = torch.randn(24, 1, 3, 3, dtype=torch.float64)
    g64 = torch.randn(4, 24, (15 + 2 - 3) // stride + 1, (13 + 2 - 3) // stride + 1, dtype=torch.float64)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = x64.to(dev, dtype).contiguous(memory_format=fmt).requires_grad_()
    w = w64.to(dev, dtype).requires_grad_()
    out = get_backend("cudnn").conv2d(x, w, None, (stride, stride), (1, 1), (1, 1))
    assert out.dtype == dtype
    assert out.is_contiguous(memory_format=fmt)
    gx, gw = torch.autograd.grad(out, (x, w), g64.to(dev, dtype).contiguous(memory_format=fmt))
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    ref = F.conv2d(xr, wr, None, stride, 1, 1, 24)
    rx, rw = torch.autograd.grad(ref, (xr, wr), g64)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in ((out, ref), (gx, rx), (gw, rw)):
        rel = (got.double().cpu() - want).norm() / want.norm()
        assert rel <= tol, rel


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, channels_last", CASES)
def test_cudnn_backend_runs_cudnn_kernels_not_the_native_ones(dtype, channels_last):
    dev = torch.device("cuda")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(8, 64, 28, 28, device=dev, dtype=dtype).contiguous(memory_format=fmt).requires_grad_()
    w = torch.randn(64, 1, 3, 3, device=dev, dtype=dtype, requires_grad=True)
    conv = get_backend("cudnn").conv2d
    conv(x, w, None, (1, 1), (1, 1), (1, 1)).sum().backward()  # warm-up outside the trace
    _, names = _profiled(lambda: conv(x, w, None, (1, 1), (1, 1), (1, 1)).sum().backward())
    assert not [n for n in names if "conv_depthwise2d" in n], names
    assert any(("cudnn" in n.lower() or "xmma" in n.lower() or "sm90" in n.lower() or "conv" in n.lower()) for n in names), names


@pytest.mark.gpu
@pytest.mark.parametrize("backend, norm", [("torch", "torch"), ("cudnn", "torch"), ("custom", "torch"),
                                           ("custom", "custom")])
@pytest.mark.parametrize("amp", [None, torch.float16])
def test_channels_last_weight_gradients_have_their_weights_strides(backend, norm, amp):
    """DDP's gradient buckets take each gradient in its parameter's strides, every stride compared (a [C, 1, 3, 3]
    depthwise weight's size-1 dimension too): any other strides cost a copy and a warning at every step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mobilenet.model import build_model

    # norm=custom: with the BatchNorm+ReLU applied by the next depthwise kernel (its own weight-gradient path).
    model = build_model("mobilenet_v1", 10, 0.25, backend, norm=norm, apply_norm_in_depthwise=norm == "custom")
    model = model.cuda().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64, device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
        loss = model(x).float().square().mean()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.stride() == p.stride(), (name, p.grad.stride(), p.stride())
