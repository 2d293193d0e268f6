"""The custom depthwise op over everything F.conv2d(groups=C) accepts for a 4-D depthwise convolution (issue #22):
any kernel size (even, kh != kw), stride, padding (per axis, 'same' with even kernels), dilation, depth multiplier
m >= 1 (weight (C * m, 1, kh, kw)), tensors of 2^31 elements or more.

CPU (CI): the argument checks (kernels/depthwise_args.py) refuse with ValueError what F.conv2d refuses and pass
what it runs; the output shape the fake kernel gives; 'same' padding as F.conv2d reads it.
GPU: a randomized sweep of the whole domain (>= 500 cases, a fresh seed each run, printed; MDW_SWEEP_SEED=<seed>
reruns one) against float64 F.conv2d with poisoned outputs; one forward and backward of >= 2^31 elements checked
at the far end of the index range; opcheck on new cases.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from kernels.conv_arith import resolve_padding
from kernels.depthwise_args import check_supported, out_shape

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------------------------------------- CPU tests


def _args(c=4, m=1, k=(3, 3), h=12, w=12, dtype=torch.float32, bias=False):
    x = torch.empty(1, c, h, w, dtype=dtype)
    wt = torch.empty(c * m, 1, *k, dtype=dtype)
    b = torch.empty(c * m, dtype=dtype) if bias else None
    return x, wt, b


@pytest.mark.parametrize("k, stride, padding, dilation, m", [
    ((9, 9), (1, 1), (4, 4), (1, 1), 1),   # kernel size 9
    ((4, 4), (1, 1), (1, 1), (1, 1), 1),   # even
    ((2, 5), (1, 1), (0, 2), (1, 1), 1),   # kh != kw
    ((3, 3), (3, 4), (1, 1), (1, 1), 1),   # stride 3, 4
    ((3, 3), (1, 1), (3, 3), (3, 3), 1),   # dilation 3
    ((3, 3), (1, 1), (1, 1), (1, 1), 2),   # depth multiplier 2
    ((1, 8), (2, 3), (0, 5), (2, 1), 3),   # all of it at once
])
def test_checks_pass_what_f_conv2d_runs(k, stride, padding, dilation, m):
    x, wt, b = _args(m=m, k=k, bias=True)
    check_supported(x, wt, b, stride, padding, dilation)
    F.conv2d(x.normal_(), wt.normal_(), b.normal_(), stride, padding, dilation, groups=x.shape[1])  # it runs


def test_checks_pass_many_channels_and_large_tensors():
    # > 65535 channels and >= 2^31 elements: meta tensors, nothing is allocated
    x = torch.empty(1, 70000, 4, 4, device="meta")
    check_supported(x, torch.empty(70000, 1, 3, 3, device="meta"), None, (1, 1), (1, 1), (1, 1))
    x = torch.empty(1, 2, 32769, 32769, device="meta", dtype=torch.float16)
    check_supported(x, torch.empty(2, 1, 3, 3, device="meta", dtype=torch.float16), None, (1, 1), (1, 1), (1, 1))


@pytest.mark.parametrize("change, match", [
    (dict(wshape=(6, 1, 3, 3)), r"weight has 6 filters, which is not a multiple m >= 1 of the input's 4 channels"),
    (dict(wshape=(2, 1, 3, 3)), r"weight has 2 filters"),
    (dict(wshape=(4, 2, 3, 3)), r"weight must have shape \(C \* m, 1, kh, kw\)"),
    (dict(wshape=(4, 1, 0, 3)), r"kernel size 0 is not supported \(must be >= 1\)"),
    (dict(stride=(0, 1)), r"stride 0 is not supported \(must be >= 1\)"),
    (dict(dilation=(1, 0)), r"dilation 0 is not supported \(must be >= 1\)"),
    (dict(padding=(-1, 0)), r"padding -1 is not supported \(must be >= 0\)"),
    (dict(wshape=(4, 1, 15, 3)), r"smaller than the dilated kernel"),
    (dict(dtype=torch.int32), r"dtype torch.int32 is not supported"),
    (dict(bshape=(5,)), r"bias must have shape \(4,\)"),
])
def test_checks_refuse_what_f_conv2d_refuses_with_value_error(change, match):
    x = torch.empty(1, 4, 12, 12, dtype=change.get("dtype", torch.float32))
    wt = torch.empty(*change.get("wshape", (4, 1, 3, 3)), dtype=x.dtype)
    b = torch.empty(*change["bshape"], dtype=x.dtype) if "bshape" in change else None
    with pytest.raises(ValueError, match=match):
        check_supported(x, wt, b, change.get("stride", (1, 1)), change.get("padding", (1, 1)),
                        change.get("dilation", (1, 1)))
    if "dtype" not in change:  # F.conv2d refuses it too
        with pytest.raises(RuntimeError):
            F.conv2d(x.normal_(), wt.normal_(), None if b is None else b.normal_(), change.get("stride", (1, 1)),
                     change.get("padding", (1, 1)), change.get("dilation", (1, 1)), groups=4)


def test_check_refuses_a_weight_of_another_dtype():
    x, wt, _ = _args()
    with pytest.raises(ValueError, match="must match the input"):
        check_supported(x, wt.double(), None, (1, 1), (1, 1), (1, 1))


# The references are F.conv2d's own 'same', which warns that it copies the input for even kernels: expected here.
SAME_PADDING_COPY = "ignore:Using padding='same' with even kernel lengths:UserWarning"


@pytest.mark.filterwarnings(SAME_PADDING_COPY)
@pytest.mark.parametrize("k, d", [((3, 3), (1, 1)), ((4, 4), (1, 1)), ((2, 5), (1, 1)), ((4, 3), (2, 1)),
                                  ((8, 9), (3, 2)), ((1, 1), (1, 1))])
def test_same_padding_is_f_conv2d_s(k, d):
    before, after = resolve_padding("same", k, (1, 1), d, "t")
    x = torch.randn(1, 2, 13, 11, dtype=torch.float64)
    wt = torch.randn(2, 1, *k, dtype=torch.float64)
    # F.conv2d's 'same' equals explicit padding (left, right, top, bottom) = (before[1], after[1], before[0], after[0])
    ref = F.conv2d(x, wt, None, 1, "same", d, groups=2)
    ours = F.conv2d(F.pad(x, (before[1], after[1], before[0], after[0])), wt, None, 1, 0, d, groups=2)
    assert torch.equal(ours, ref)
    assert all(a - b in (0, 1) for a, b in zip(after, before))
    # the op's way: symmetric padding `after`, then drop the first (after - before) rows and columns
    sym = F.conv2d(x, wt, None, 1, after, d, groups=2)
    assert torch.equal(sym[:, :, after[0] - before[0]:, after[1] - before[1]:], ref)


def test_padding_strings_refused_like_f_conv2d():
    with pytest.raises(ValueError, match="padding='same' is not supported for strided convolutions"):
        resolve_padding("same", (3, 3), (2, 1), (1, 1), "depthwise_conv2d")
    with pytest.raises(ValueError, match="invalid padding string 'full'"):
        resolve_padding("full", (3, 3), (1, 1), (1, 1), "depthwise_conv2d")
    assert resolve_padding("valid", (4, 4), (3, 3), (1, 1), "t") == ((0, 0), (0, 0))


@pytest.mark.parametrize("xs, ws, stride, padding, dilation", [
    ((2, 3, 17, 12), (6, 1, 4, 2), (3, 1), (1, 0), (1, 2)),
    ((1, 4, 9, 9), (12, 1, 9, 9), (4, 4), (4, 4), (1, 1)),
    ((3, 2, 20, 7), (2, 1, 2, 7), (2, 3), (0, 3), (3, 1)),
])
def test_fake_kernel_output_shape_matches_f_conv2d(xs, ws, stride, padding, dilation):
    x, wt = torch.randn(*xs), torch.randn(*ws)
    ref = F.conv2d(x, wt, None, stride, padding, dilation, groups=xs[1])
    assert out_shape(x.shape, wt.shape, stride, padding, dilation) == tuple(ref.shape)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # the meta path on fake tensors, as the fake kernel runs it
        fx, fw = torch.empty(*xs), torch.empty(*ws)
        assert out_shape(fx.shape, fw.shape, stride, padding, dilation) == tuple(ref.shape)


def test_depthwise_layer_takes_multiplier_and_padding_strings():
    from mobilenet.depthwise import DepthwiseConv2d

    layer = DepthwiseConv2d(3, (4, 2), 1, "same", 1, bias=True, backend="torch", multiplier=2).double()
    assert tuple(layer.weight.shape) == (6, 1, 4, 2) and tuple(layer.bias.shape) == (6,)
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.conv2d(x, layer.weight, layer.bias, 1, "same", 1, groups=3))
    with pytest.raises(ValueError, match="padding='same' is not supported for strided"):
        DepthwiseConv2d(3, 3, 2, "same")
    with pytest.raises(ValueError, match="multiplier must be >= 1"):
        DepthwiseConv2d(3, 3, 1, 1, multiplier=0)


# ---------------------------------------------------------------------------------------------- GPU tests

SWEEP_CASES = 520
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DTYPES = list(TOL)
LAYOUTS = ["nchw", "nhwc", "slice", "permute"]


@pytest.fixture(scope="module")
def dw():
    from kernels.ops import depthwise_conv2d

    return depthwise_conv2d


def _layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "nhwc":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "slice":  # neither layout: every other column of a wider tensor
        wide = torch.empty(*x.shape[:3], 2 * x.shape[3], dtype=x.dtype, device=x.device)
        wide[..., ::2] = x
        return wide[..., ::2]
    if layout == "permute":  # neither layout: (N, H, C, W) storage
        return x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    return x


def _expected_format(x: torch.Tensor) -> torch.memory_format:
    """The op's layout contract: a standard layout is kept (a tensor with a size-1 dimension can be both, and counts
    as contiguous first), any other strides give the suggested layout."""
    if x.is_contiguous():
        return torch.contiguous_format
    if x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    from torch._prims_common import suggest_memory_format

    return suggest_memory_format(x)


def _random_case(rng: random.Random) -> dict:
    kh = rng.randint(1, 9)
    kw = kh if rng.random() < 0.5 else rng.randint(1, 9)
    stride = (rng.randint(1, 4), rng.randint(1, 4)) if rng.random() < 0.7 else (1, 1)
    dilation = (rng.randint(1, 3), rng.randint(1, 3)) if rng.random() < 0.5 else (1, 1)
    if stride == (1, 1) and rng.random() < 0.3:
        padding = "same"
    elif rng.random() < 0.1:
        padding = "valid"
    else:
        padding = (rng.randint(0, 4), rng.randint(0, 4))
    pads = resolve_padding(padding, (kh, kw), stride, dilation, "sweep")[1]
    # input at least the dilated kernel after padding, plus a few outputs' worth
    h = max(1, dilation[0] * (kh - 1) + 1 - 2 * pads[0]) + rng.randint(0, 12)
    w = max(1, dilation[1] * (kw - 1) + 1 - 2 * pads[1]) + rng.randint(0, 12)
    c = rng.choice([1, 2, 3, 5, 8, 16])
    return dict(dtype=rng.choice(DTYPES), layout=rng.choice(LAYOUTS), n=rng.randint(1, 3), c=c, h=h, w=w,
                m=rng.choice([1, 1, 2, 3]), k=(kh, kw), stride=stride, padding=padding, dilation=dilation,
                bias=rng.random() < 0.5)


def _run_case(dw, case: dict, gen: torch.Generator) -> None:
    from test_kernels import _poison_allocator, _rel

    dtype, c, m = case["dtype"], case["c"], case["m"]
    dev = "cuda"
    x64 = torch.randn(case["n"], c, case["h"], case["w"], device=dev, dtype=torch.float64, generator=gen)
    w64 = torch.randn(c * m, 1, *case["k"], device=dev, dtype=torch.float64, generator=gen) / (case["k"][0] * case["k"][1]) ** 0.5
    b64 = torch.randn(c * m, device=dev, dtype=torch.float64, generator=gen) if case["bias"] else None
    # the reference runs on the op's inputs rounded to its dtype, so only the op's arithmetic differs
    x = _layout(x64.to(dtype), case["layout"]).requires_grad_()
    wt = w64.to(dtype).requires_grad_()
    b = b64.to(dtype).requires_grad_() if b64 is not None else None
    leaves = [x, wt] + ([b] if b is not None else [])
    refs = [t.detach().double().requires_grad_() for t in leaves]
    ref = F.conv2d(refs[0], refs[1], refs[2] if b is not None else None, case["stride"], case["padding"],
                   case["dilation"], groups=c)
    go = torch.randn(ref.shape, device=dev, dtype=torch.float64, generator=gen).to(dtype)
    ref_grads = torch.autograd.grad(ref, refs, go.double())

    _poison_allocator(4 * x.numel() * x.element_size())
    y = dw(x, wt, b, case["stride"], case["padding"], case["dilation"])
    grads = torch.autograd.grad(y, leaves, go)
    what = f"{case}"
    assert y.dtype == dtype and y.shape == ref.shape, what
    assert y.is_contiguous(memory_format=_expected_format(x)), what
    tol = TOL[dtype]
    for name, out, r in [("forward", y, ref)] + list(zip(["grad_input", "grad_weight", "grad_bias"], grads, ref_grads)):
        assert out.shape == r.shape, f"{name} shape {tuple(out.shape)} != {tuple(r.shape)}: {what}"
        assert torch.isfinite(out).all(), f"{name} has unwritten (NaN) elements: {what}"
        err = _rel(out, r)
        assert err <= tol, f"{name} rel. error {err:.2e} > {tol}: {what}"


@pytest.mark.gpu
@cuda
@pytest.mark.filterwarnings(SAME_PADDING_COPY)
def test_random_sweep_of_the_whole_domain_against_float64(dw):
    seed = int(os.environ.get("MDW_SWEEP_SEED", random.randrange(1 << 30)))
    print(f"depthwise domain sweep: MDW_SWEEP_SEED={seed}")
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cases = [_random_case(rng) for _ in range(SWEEP_CASES)]
    # the corners the random draw may miss: even 'same', kh != kw, stride 4, dilation 3, m = 3, each layout
    cases += [dict(dtype=dt, layout=lay, n=2, c=3, h=11, w=10, m=3, k=(4, 2), stride=(1, 1), padding="same",
                   dilation=(3, 1), bias=True) for dt in DTYPES for lay in LAYOUTS]
    cases += [dict(dtype=dt, layout=lay, n=1, c=8, h=19, w=17, m=2, k=(9, 8), stride=(4, 3), padding=(4, 1),
                   dilation=(1, 2), bias=False) for dt in DTYPES for lay in LAYOUTS]
    for i, case in enumerate(cases):
        try:
            _run_case(dw, case, gen)
        except AssertionError as e:
            raise AssertionError(f"case {i} of MDW_SWEEP_SEED={seed}: {e}") from None


@pytest.mark.gpu
@cuda
def test_many_channels_generic(dw):
    # more than 65535 channels (the old grid-y limit), NCHW and NHWC, with a multiplier
    from test_kernels import _rel

    for fmt in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(1, 70000, 5, 4, device="cuda").contiguous(memory_format=fmt).requires_grad_()
        wt = torch.randn(140000, 1, 3, 2, device="cuda", requires_grad=True)
        y = dw(x, wt, None, 1, 1, 1)
        ref = F.conv2d(x.double(), wt.double(), None, 1, 1, 1, groups=70000)
        assert _rel(y, ref) <= 1e-5
        go = torch.randn_like(y)
        gx, gw = torch.autograd.grad(y, (x, wt), go)
        rx, rw = torch.autograd.grad(ref, (x, wt), go.double())
        assert _rel(gx, rx) <= 1e-5 and _rel(gw, rw) <= 1e-5


@pytest.mark.gpu
@cuda
def test_2_pow_31_elements_forward_and_backward_at_the_far_end(dw):
    """x of 2 * 32769^2 > 2^31 fp16 elements (4.3 GB, four such tensors): the 64-bit generic kernels, checked
    against float64 F.conv2d on the last rows (the far end of the index range) and the weight and bias gradients
    over the whole tensor, summed slab by slab."""
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs >= 40 GB of GPU memory")
    n, c, h, w, R = 1, 2, 32769, 32769, 8
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    x = torch.randn(n, c, h, w, device="cuda", dtype=torch.float16, generator=gen)
    assert x.numel() >= 2**31
    wt = torch.randn(c, 1, 3, 3, device="cuda", dtype=torch.float16, generator=gen)
    b = torch.randn(c, device="cuda", dtype=torch.float16, generator=gen)
    x.requires_grad_(), wt.requires_grad_(), b.requires_grad_()
    y = dw(x, wt, b, 1, 1, 1)
    # scaled so that the weight and bias gradients, sums of 2^31 products, stay well inside fp16's range
    go = torch.randn(y.shape, device="cuda", dtype=torch.float16, generator=gen).mul_(1 / 64)
    gx, gw, gb = torch.autograd.grad(y, (x, wt, b), go)

    def slab_ref(r0, r1):
        """float64 F.conv2d for output rows r0..r1-1: input rows r0-1..r1 (zero rows past either edge)."""
        xs = x.detach()[:, :, max(r0 - 1, 0):min(r1 + 1, h)].double()
        xs = F.pad(xs, (0, 0, 1 if r0 == 0 else 0, 1 if r1 == h else 0)).requires_grad_()
        wd = wt.detach().double().requires_grad_()
        ys = F.conv2d(xs, wd, b.detach().double(), 1, (0, 1), 1, groups=c)
        return xs, wd, ys

    # forward and input gradient on the last R rows
    xs, wd, ys = slab_ref(h - R, h)
    y_last = y.detach()[:, :, h - R:]
    assert torch.isfinite(y_last).all()
    torch.testing.assert_close(y_last.double(), ys, rtol=1e-2, atol=1e-2)
    assert (y_last[..., -1, -1].double() - ys[..., -1, -1]).abs().max() <= 1e-2 * ys[..., -1, -1].abs().max() + 1e-2
    (gxs,) = torch.autograd.grad(ys, xs, go[:, :, h - R:].double())
    # rows h-R+1 .. h-1 of the input get every output that touches them; xs holds rows h-R-1 .. h-1 then a pad row
    torch.testing.assert_close(gx[:, :, h - R + 1:].double(), gxs[:, :, 2:-1], rtol=1e-2, atol=1e-3)
    # weight and bias gradients over everything, in slabs of output rows
    rw = torch.zeros_like(wd)
    step = 4096
    for r0 in range(0, h, step):
        r1 = min(r0 + step, h)
        xs, wd, ys = slab_ref(r0, r1)
        rw += torch.autograd.grad(ys, wd, go[:, :, r0:r1].double())[0]
        del xs, ys
    rb = go.sum(dim=(0, 2, 3), dtype=torch.float64)
    assert ((gw.double() - rw).norm() / rw.norm()).item() <= 1e-2
    assert ((gb.double() - rb).norm() / rb.norm()).item() <= 1e-2


@pytest.mark.gpu
@cuda
def test_opcheck_new_cases():
    import kernels.ops  # noqa: F401  (registers the fake kernels)

    ops = torch.ops.mobilenet_dw
    for dtype, fmt, m, k, stride, padding, dilation in [
        (torch.float32, torch.contiguous_format, 2, (4, 2), [3, 1], [1, 0], [1, 2]),
        (torch.float16, torch.channels_last, 3, (9, 9), [4, 4], [4, 3], [1, 1]),
        (torch.float64, torch.channels_last, 1, (2, 6), [1, 2], [2, 2], [3, 1]),
    ]:
        x = torch.randn(2, 4, 13, 12, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
        w = torch.randn(4 * m, 1, *k, device="cuda", dtype=dtype)
        b = torch.randn(4 * m, device="cuda", dtype=dtype)
        torch.library.opcheck(ops.depthwise_fwd.default, (x, w, b, stride, padding, dilation))
        torch.library.opcheck(ops.depthwise_fwd.default,
                              (x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_(),
                               stride, padding, dilation))
        y = ops.depthwise_fwd.default(x, w, b, stride, padding, dilation)
        go = torch.randn_like(y)
        for mask in ([True, True, True], [True, False, False], [False, True, True]):
            torch.library.opcheck(ops.depthwise_bwd.default, (go, x, w, stride, padding, dilation, mask))
