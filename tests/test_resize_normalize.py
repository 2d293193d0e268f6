"""Tests of the DALI loader's fused resize + mirror + normalise (mobilenet_data::resize_normalize,
kernels/resize_ops.py), which data.dali.resize=kernel runs on the decoded random crops.

GPU (`pytest -m gpu`): the op against a float64 reference (PyTorch's antialiased bilinear interpolation, then the
flip and the normalisation) over crops that shrink, grow, are 1 px or far larger than the output, in every output
dtype and both layouts, with the output poisoned first; bitwise repeatable; opcheck; the argument checks name the
crop that is off. The loader's use of it is tested in tests/test_dali.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

gpu = pytest.mark.gpu

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]
TOL = {torch.float32: 5e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # absolute, outputs within about +-2.7

CROP_SHAPES = [  # (H, W) of the crops of one batch
    [(375, 500), (224, 224), (100, 180), (57, 301)],  # shrink, same size, grow in one axis
    [(1, 1), (2, 3), (13, 7)],                        # tiny: every output pixel from one or a few inputs
    [(1900, 2400), (224, 3000)],                      # far larger: windows of ~20 inputs per axis
]


def _reference(crops, mirror, size):
    """float64: each crop resized by F.interpolate(bilinear, antialias), flipped where mirror, normalised."""
    out = []
    for c, m in zip(crops, mirror.tolist()):
        x = c.permute(2, 0, 1)[None].double().cpu()
        y = F.interpolate(x, size, mode="bilinear", antialias=True, align_corners=False)[0]
        if m:
            y = y.flip(-1)
        out.append((y / 255 - torch.tensor(MEAN, dtype=torch.float64)[:, None, None])
                   / torch.tensor(STD, dtype=torch.float64)[:, None, None])
    return torch.stack(out)


def _crops(shapes, gen):
    return [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, device="cuda", generator=gen) for h, w in shapes]


def _poisoned_call(crops, mirror, size, dtype, channels_last):
    """The op after NaN blocks of its output's size went back to the caching allocator."""
    n = len(crops) * 3 * size[0] * size[1]
    for numel in (n, 1 << 20):
        torch.full((numel,), float("nan"), device="cuda")
    from kernels.resize_ops import resize_normalize

    return resize_normalize(crops, mirror, size, MEAN, STD, dtype, channels_last)


@gpu
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shapes", CROP_SHAPES, ids=["mixed", "tiny", "large"])
@pytest.mark.parametrize("size", [(224, 224), (21, 33)])
def test_against_float64(shapes, size, dtype, channels_last):
    gen = torch.Generator(device="cuda")
    gen.seed()  # fresh inputs every run; a failure prints the shapes and the error
    crops = _crops(shapes, gen)
    mirror = torch.randint(0, 2, (len(crops),), dtype=torch.int32)
    got = _poisoned_call(crops, mirror, size, dtype, channels_last)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert got.shape == (len(crops), 3, *size) and got.dtype == dtype and got.is_contiguous(memory_format=fmt)
    assert torch.isfinite(got).all()
    ref = _reference(crops, mirror, size)
    err = (got.double().cpu() - ref).abs()
    assert err.max() <= TOL[dtype], f"{shapes} -> {size}, mirror {mirror.tolist()}: max error {err.max():.3g}"
    again = _poisoned_call(crops, mirror, size, dtype, channels_last)
    assert torch.equal(got, again)  # bitwise repeatable


@gpu
def test_without_mirror_nothing_is_flipped_and_mirror_flips_exactly():
    gen = torch.Generator(device="cuda").manual_seed(3)
    crops = _crops([(90, 130), (40, 41)], gen)
    plain = _poisoned_call(crops, None, (32, 48), torch.float32, True)
    assert torch.allclose(plain.double().cpu(), _reference(crops, torch.zeros(2), (32, 48)), atol=TOL[torch.float32])
    flipped = _poisoned_call(crops, torch.tensor([1, 0]), (32, 48), torch.float32, True)
    assert torch.equal(flipped[0], plain[0].flip(-1)) and torch.equal(flipped[1], plain[1])


def _table(crops, mirror):
    return torch.tensor([[c.data_ptr(), c.shape[0], c.shape[1], int(m)] for c, m in zip(crops, mirror)])


@gpu
def test_opcheck():
    import kernels.resize_ops  # noqa: F401  (registers the op and its fake kernel)

    gen = torch.Generator(device="cuda").manual_seed(0)
    crops = _crops([(30, 40), (12, 9)], gen)
    table = _table(crops, [0, 1]).cuda()
    for channels_last in (True, False):
        torch.library.opcheck(torch.ops.mobilenet_data.resize_normalize.default,
                              (table, [16, 16], MEAN, STD, torch.float16, channels_last))


@gpu
def test_the_table_call_equals_the_tensor_call():
    from kernels.resize_ops import resize_normalize, resize_normalize_table

    gen = torch.Generator(device="cuda").manual_seed(2)
    crops = _crops([(64, 80), (300, 20)], gen)
    by_table = resize_normalize_table(_table(crops, [1, 0]), torch.device("cuda"), (24, 24), MEAN, STD,
                                      torch.bfloat16, False)
    assert torch.equal(by_table, resize_normalize(crops, torch.tensor([1, 0]), (24, 24), MEAN, STD, torch.bfloat16,
                                                  False))


@gpu
@pytest.mark.parametrize("table, words", [
    (torch.zeros(2, 4, dtype=torch.int32), r"CPU int64 tensor \(N, 4\), not torch.int32 \(2, 4\) on cpu"),
    (torch.zeros(2, 3, dtype=torch.int64), r"CPU int64 tensor \(N, 4\), not torch.int64 \(2, 3\)"),
    (torch.zeros(0, 4, dtype=torch.int64), r"no crops"),
    (torch.tensor([[1, 5, 5, 0], [1, 5, 0, 0]]), r"crop 1 is empty; every crop needs a height and width of at least 1"),
])
def test_a_bad_table_is_refused(table, words):
    from kernels.resize_ops import resize_normalize_table

    with pytest.raises(ValueError, match=words):
        resize_normalize_table(table, torch.device("cuda"), (16, 16), MEAN, STD, torch.float16, True)


@gpu
@pytest.mark.parametrize("change, words", [
    (lambda c, m: ([c[0], c[1].float()], m), r"crop 1 is a torch.float32 tensor of shape \(12, 9, 3\)"),
    (lambda c, m: ([c[0], c[1][:, :, :2].contiguous()], m), r"crop 1 .* shape \(12, 9, 2\).*uint8 \(H, W, 3\)"),
    (lambda c, m: ([c[0].permute(1, 0, 2), c[1]], m), r"crop 0 .* not contiguous"),
    (lambda c, m: ([c[0], c[1].cpu()], m), r"crop 1 is on cpu; every crop must be on one CUDA device"),
    (lambda c, m: (c, m.cuda()), r"mirror must hold one value per crop \(2\) on the CPU, not 2 on cuda"),
    (lambda c, m: (c, m[:1]), r"mirror must hold one value per crop \(2\) on the CPU, not 1 on cpu"),
    (lambda c, m: ([], m), r"no crops"),
])
def test_bad_arguments_are_refused_naming_the_crop(change, words):
    from kernels.resize_ops import resize_normalize

    gen = torch.Generator(device="cuda").manual_seed(1)
    crops, mirror = change(_crops([(30, 40), (12, 9)], gen), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=words):
        resize_normalize(crops, mirror, (16, 16), MEAN, STD, torch.float16, True)
