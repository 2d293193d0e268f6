"""The tensor-core tile (FWD_MMA, kernels/csrc/depthwise_mma.cu): 16-bit NHWC stride-1 3x3/5x5/7x7 forward and input
gradient by mma.sync. GPU tests: against float64 F.conv2d on fresh random inputs with outputs poisoned, over the
ways the planner cuts a tile (channel counts that allow groups of 8, 16 and 32, several whole images per block, rows in tiles, rows
wider than one tile, a last tile the image does not fill, padding 0 to past K - 1, per dimension), bias and
activations, bitwise repeatability, and the profiler showing the tile ran (forward and rotated input gradient)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from test_kernels import _make_input, _poison_allocator, _profiled, _rel, cuda

TOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.fixture
def mma(set_knobs):
    """The depthwise op with FWD_MMA = 2 (forward and stride-1 input gradient on the tensor-core tile; the tensor-core
    walk, which the dispatch tries first, off); the knobs are read again after the test."""
    from kernels.ops import depthwise_conv2d

    set_knobs(FWD_MMA=2, FWD_MMA_WALK=0)
    return depthwise_conv2d


def _kernels_named(fn, name: str) -> list[str]:
    """The CUDA kernels whose name contains `name` that fn() launches, as the profiler reports them."""
    return [n for n in _profiled(fn)[1] if name in n]


def _mma_kernels(fn) -> list[str]:
    return _kernels_named(fn, "fwd_nhwc_mma_kernel")


def _check(dw, dtype, n, c, h, w, k, padding, bias, activation, gen, stride=1):
    """One NHWC 16-bit case against float64 F.conv2d, outputs poisoned: the forward, and at stride 1 without an
    activation the input gradient; both bitwise repeatable."""
    x = _make_input(n, c, h, w, dtype, "nhwc", gen).requires_grad_()
    wt = (torch.randn(c, 1, k, k, device="cuda", dtype=dtype, generator=gen) / k).requires_grad_()
    b = torch.randn(c, device="cuda", dtype=dtype, generator=gen) if bias else None
    ref = F.conv2d(x.double(), wt.double(), None if b is None else b.double(), stride, padding, 1, c)
    if activation == "relu":
        ref = ref.clamp_min(0)
    elif activation == "relu6":
        ref = ref.clamp(0, 6)
    what = f"{dtype} n={n} c={c} {h}x{w} k={k} s={stride} p={padding} bias={bias} act={activation}"
    _poison_allocator(4 * x.numel() * x.element_size())
    kwargs = {"activation": activation} if activation else {}
    if activation is None and stride == 1:
        go = torch.randn(ref.shape, device="cuda", dtype=dtype, generator=gen).contiguous(
            memory_format=torch.channels_last)
        (ref_gx,) = torch.autograd.grad(ref, [x], go.double())
        y = dw(x, wt, b, stride, padding, 1)
        (gx,) = torch.autograd.grad(y, [x], go)
        assert torch.isfinite(gx).all(), f"grad_input has unwritten (NaN) elements: {what}"
        assert _rel(gx, ref_gx) <= TOL[dtype], (_rel(gx, ref_gx), what)
        (gx2,) = torch.autograd.grad(dw(x, wt, b, stride, padding, 1), [x], go)
        assert torch.equal(gx, gx2), f"input gradient differs between runs: {what}"
    else:
        with torch.no_grad():
            y = dw(x, wt, b, stride, padding, 1, **kwargs)
    assert y.shape == ref.shape and y.is_contiguous(memory_format=torch.channels_last), what
    assert torch.isfinite(y).all(), f"forward has unwritten (NaN) elements: {what}"
    assert _rel(y, ref) <= TOL[dtype], (_rel(y, ref), what)
    with torch.no_grad():
        y2 = dw(x.detach(), wt.detach(), b, stride, padding, 1, **kwargs)
    assert torch.equal(y.detach(), y2), f"forward differs between runs: {what}"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_tile_against_float64(mma, dtype):
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    # (n, c, h, w): C allowing channel groups of 8 only (24, 40), up to 16 (48, 144) and up to 32 (64; the planner
    # picks among them); images of 3 to 7 rows stacked
    # several per block, 14 and 28 rows (whole images or tiles), 57 columns (rows wider than a tile, a last
    # 8-column block the image does not fill), odd image counts (a last block of images the batch does not fill)
    sizes = [(3, 24, 7, 7), (5, 48, 14, 14), (2, 64, 28, 28), (1, 144, 15, 57), (3, 40, 3, 5), (2, 16, 40, 33)]
    for i, (k, (n, c, h, w)) in enumerate(itertools.product((3, 5, 7), sizes)):
        padding = [(k // 2, k // 2), (0, 0), (k - 1, k - 1), (k // 2, 0), (1, k - 1)][i % 5]
        if h + 2 * padding[0] < k or w + 2 * padding[1] < k:
            padding = (k // 2, k // 2)
        _check(mma, dtype, n, c, h, w, k, padding, i % 2 == 0, None, gen)
    for k, activation in ((3, "relu"), (5, "relu6"), (7, "relu")):
        _check(mma, dtype, 2, 32, 19, 23, k, k // 2, True, activation, gen)


@pytest.mark.gpu
@cuda
def test_mma_tile_runs_forward_and_input_gradient(mma, set_knobs):
    set_knobs(BWD_WALK=0)  # 3x3 padding 1: the input gradient's kernel, not the one-walk backward of both gradients
    x = torch.randn(2, 32, 20, 20, device="cuda", dtype=torch.float16).contiguous(
        memory_format=torch.channels_last).requires_grad_()
    for k in (3, 5, 7):
        w = torch.randn(32, 1, k, k, device="cuda", dtype=torch.float16, requires_grad=True)

        def step():
            y = mma(x, w, None, 1, k // 2, 1)
            torch.autograd.grad(y, (x, w), torch.ones_like(y))

        names = _mma_kernels(step)
        rotated = [n for n in names if ", true>(" in n or "Lb1EEEv" in n]  # the FLIP argument, demangled or not
        assert len(names) == 2 and len(rotated) == 1, (k, names)


def _leaves_to_other_kernels(dw, kernels_of, cases):
    """Each (dtype, channels, stride, dilation, layout) case, a 2 x C x 14 x 14 input and a 5x5 weight with padding
    2 x dilation: kernels_of(fn) finds none of the kernel's launches in dw's call, whose result is F.conv2d's (the
    other kernels ran)."""
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    for dtype, c, stride, dilation, layout in cases:
        x = _make_input(2, c, 14, 14, dtype, layout, gen)
        w = torch.randn(c, 1, 5, 5, device="cuda", dtype=dtype, generator=gen)
        conv = (stride, 2 * dilation, dilation)
        assert not kernels_of(lambda: dw(x, w, None, *conv)), (dtype, c, stride, dilation, layout)
        ref = F.conv2d(x.double(), w.double(), None, *conv, c)
        assert _rel(dw(x, w, None, *conv), ref) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@cuda
def test_mma_tile_leaves_what_it_cannot_take(mma):
    # fp32, stride 2, channels not a multiple of 8, NCHW: the other kernels, the same results
    _leaves_to_other_kernels(mma, _mma_kernels, [(torch.float32, 16, 1, 1, "nhwc"), (torch.float16, 16, 2, 1, "nhwc"),
                                                 (torch.float16, 12, 1, 1, "nhwc"), (torch.float16, 16, 1, 1, "nchw")])
