"""The tensor-core walk (FWD_MMA_WALK, kernels/csrc/depthwise_mma_walk.cu): 16-bit NHWC 3x3/5x5/7x7 forward at
strides 1 and 2, and the stride-1 input gradient, by mma.sync products of 16 pixels x 8 channels. GPU tests: against
float64 F.conv2d on fresh random inputs with outputs poisoned, over both product shapes (16 columns of a row, 8
columns of two rows), both channel widths (8 and 16 channels per warp), row segments, padding 0 to past K - 1 per
dimension, odd row counts, several images per warp (N not a multiple of them), bias and activations; bitwise
repeatability; the profiler showing which kernel ran."""

from __future__ import annotations

import random

import pytest
import torch

from test_depthwise_mma import _check, _kernels_named, _leaves_to_other_kernels
from test_kernels import _make_input, cuda

KERNEL = "fwd_nhwc_mma_walk_kernel"


@pytest.fixture
def walk(set_knobs):
    """set_knobs(...) for the walk, then the depthwise op."""
    from kernels.ops import depthwise_conv2d

    def with_knobs(**knobs):
        set_knobs(**knobs)
        return depthwise_conv2d

    return with_knobs


def _walk_kernels(fn) -> list[str]:
    return _kernels_named(fn, KERNEL)


# (n, c, h, w): 8-channel groups only (24, 40), 16-channel groups (48, 144, 32); rows of 3 to 8 columns (two rows
# per product) and of 14, 28, 57 (one row of 16 columns, a last segment the row does not fill); odd row counts; a
# batch of 1 with few channels, which the planner cuts into row segments; tall rows of 8 columns, cut into row
# segments with several images per warp (the copies running on from one image into the next).
SIZES = [(3, 24, 7, 7), (5, 48, 14, 14), (2, 32, 28, 28), (1, 144, 15, 57), (3, 40, 3, 5), (1, 16, 40, 33),
         (2, 48, 9, 8), (3, 16, 40, 8)]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("knobs", [{}, {"MMA_WALK_ROWS": 1, "MMA_WALK_CH": 1}, {"MMA_WALK_ROWS": 2, "MMA_WALK_IMAGES": 3}],
                         ids=["by_shape", "rows1_ch8", "rows2_images3"])
def test_mma_walk_against_float64(walk, dtype, knobs):
    dw = walk(FWD_MMA_WALK=2, **knobs)
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    i = 0
    for k in (3, 5, 7):
        for stride in (1, 2):
            for n, c, h, w in SIZES:
                padding = [(k // 2, k // 2), (0, 0), (k - 1, k - 1), (k // 2, 0), (1, k - 1)][i % 5]
                if h + 2 * padding[0] < k or w + 2 * padding[1] < k:
                    padding = (k // 2, k // 2)
                _check(dw, dtype, n, c, h, w, k, padding, i % 2 == 0, None, gen, stride=stride)
                i += 1
    for k, stride, activation in ((3, 1, "relu"), (5, 2, "relu6"), (7, 1, "relu"), (5, 1, "relu6")):
        _check(dw, dtype, 2, 32, 19, 23, k, k // 2, True, activation, gen, stride=stride)


@pytest.mark.gpu
@cuda
def test_mma_walk_runs_forward_and_input_gradient(walk):
    dw = walk(FWD_MMA_WALK=2)
    x = torch.randn(2, 32, 20, 20, device="cuda", dtype=torch.float16).contiguous(
        memory_format=torch.channels_last).requires_grad_()
    for k in (5, 7):  # (3x3 padding 1's backward is the input-row walk's, both gradients in one kernel)
        w = torch.randn(32, 1, k, k, device="cuda", dtype=torch.float16, requires_grad=True)

        def step():
            y = dw(x, w, None, 1, k // 2, 1)
            torch.autograd.grad(y, (x, w), torch.ones_like(y))

        names = _walk_kernels(step)
        # the FLIP argument (the last but one), demangled or not
        rotated = [n for n in names if ", true, false>(" in n or "Lb1ELb0EEEv" in n]
        assert len(names) == 2 and len(rotated) == 1, (k, names)


@pytest.mark.gpu
@cuda
def test_mma_walk_default_takes_5x5_and_7x7_forwards(walk):
    dw = walk()  # the defaults
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    for k, stride, expect in ((5, 1, True), (7, 2, True), (3, 1, False)):
        x = _make_input(2, 64, 14, 14, torch.float16, "nhwc", gen)
        w = torch.randn(64, 1, k, k, device="cuda", dtype=torch.float16, generator=gen)
        assert bool(_walk_kernels(lambda: dw(x, w, None, stride, k // 2, 1))) == expect, (k, stride)


@pytest.mark.gpu
@cuda
def test_mma_walk_leaves_what_it_cannot_take(walk):
    # fp32, channels not a multiple of 8, NCHW, dilation 2: the other kernels, the same results
    _leaves_to_other_kernels(walk(FWD_MMA_WALK=2), _walk_kernels,
                             [(torch.float32, 16, 1, 1, "nhwc"), (torch.float16, 12, 1, 1, "nhwc"),
                              (torch.float16, 16, 1, 1, "nchw"), (torch.float16, 16, 1, 2, "nhwc")])
