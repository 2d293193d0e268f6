"""The folder loader on real JPEGs: layout errors, corrupt files, memory format, dtype, exact validation."""

import shutil

import pytest
import torch

from mobilenet.config import compose
from mobilenet.data import LoaderSpec, build_loaders
from mobilenet.data.folder import CorruptImageError

CPU = torch.device("cpu")


def loaders(root, *extra, channels_last=False, dtype=torch.float32, world_size=1, rank=0):
    cfg = compose(["data=folder", f"data.root={root}", "data.num_classes=10", "data.resolution=32", "data.batch_size=32",
                   "data.workers=0", *extra])
    return build_loaders(cfg.data, LoaderSpec(CPU, dtype, channels_last, rank=rank, world_size=world_size))


@pytest.fixture
def small_copy(tmp_path, digits_root):
    """Three images per class and split: small enough to corrupt and count."""
    root = tmp_path / "ds"
    for split in ("train", "val"):
        for cls in sorted((digits_root / split).iterdir()):
            (root / split / cls.name).mkdir(parents=True)
            for f in sorted(cls.iterdir())[:3]:
                shutil.copy(f, root / split / cls.name / f.name)
    return root


@pytest.mark.parametrize("channels_last", [False, True])
def test_batches_arrive_normalised_in_the_requested_format_and_dtype(digits_root, channels_last):
    train, val = loaders(digits_root, channels_last=channels_last, dtype=torch.bfloat16)
    x, y = next(iter(train))
    assert x.shape == (32, 3, 32, 32) and x.dtype == torch.bfloat16 and y.dtype == torch.int64
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert x.is_contiguous(memory_format=fmt)
    assert -1.5 < x.float().mean() < 1.5 and x.float().std() > 0.1  # normalised, not raw 0..255


def test_validation_counts_every_image_once_over_ranks(digits_root):
    labels = []
    for rank in range(3):
        _, val = loaders(digits_root, world_size=3, rank=rank)
        got = torch.cat([y for _, y in val])
        assert len(got) == val.num_samples
        labels.append(got)
    assert sum(len(l) for l in labels) == 360


def test_val_steps_caps_validation_to_the_same_images_every_time(digits_root):
    _, val = loaders(digits_root, "data.val_steps=2")
    assert (len(val), val.num_samples) == (2, 64)
    first = torch.cat([y for _, y in val])
    assert len(first) == 64 and torch.equal(first, torch.cat([y for _, y in val]))


def test_missing_root_split_and_empty_class_are_named(tmp_path, small_copy):
    with pytest.raises(FileNotFoundError, match="does not exist.*ROOT/train/<class>"):
        loaders(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no train/ directory"):
        loaders(tmp_path / "empty")
    shutil.rmtree(small_copy / "val")
    with pytest.raises(FileNotFoundError, match="has no val/ directory"):
        loaders(small_copy)


def test_empty_class_directory_is_named(small_copy):
    for f in (small_copy / "train" / "4").iterdir():
        f.unlink()
    with pytest.raises(FileNotFoundError, match=r"train/4.*holds no images"):
        loaders(small_copy, "data.batch_size=4")


def test_non_image_files_are_named(small_copy):
    (small_copy / "train" / "2" / "notes.txt").write_text("not an image")
    with pytest.raises(ValueError, match=r"non-image file.*notes\.txt"):
        loaders(small_copy, "data.batch_size=4")


def test_root_must_be_given(tmp_path):
    cfg = compose(["data=folder"])
    with pytest.raises(ValueError, match="needs data.root=DIR"):
        build_loaders(cfg.data, LoaderSpec(CPU, torch.float32, False))


def test_batch_larger_than_the_dataset_is_rejected(small_copy):
    with pytest.raises(ValueError, match=r"data.batch_size=64 is larger than the 30 training images.*batch_size<=30"):
        loaders(small_copy, "data.batch_size=64")


def test_corrupt_jpeg_is_named_or_skipped_and_counted(small_copy):
    victim = sorted((small_copy / "val" / "7").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:40])  # truncated JPEG
    with pytest.raises(CorruptImageError, match=victim.name):  # found up front, before any batch
        loaders(small_copy, "data.batch_size=4")
    _, val = loaders(small_copy, "data.batch_size=4", "data.check_files=false")
    with pytest.raises(CorruptImageError, match=victim.name):  # unchecked: found when it is decoded
        list(val)
    fake = small_copy / "val" / "3" / "fake.jpg"
    fake.write_text("this is text, not a JPEG")
    with pytest.raises(CorruptImageError, match="fake.jpg.*1 more in val/"):
        loaders(small_copy, "data.batch_size=4")
    _, val = loaders(small_copy, "data.batch_size=4", "data.skip_corrupt=true")
    assert sum(len(y) for _, y in val) == 31 - 2  # left out up front
    _, val = loaders(small_copy, "data.batch_size=4", "data.skip_corrupt=true", "data.check_files=false")
    n = sum(len(y) for _, y in val)
    assert val.skipped == 2 and n == 31 - 2  # skipped while decoding
