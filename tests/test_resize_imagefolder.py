"""scripts/resize_imagefolder.py on a small real ImageFolder: what it resizes, what it copies, what the loaders then
read, how it resumes, and how it reports a file it cannot decode."""

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from mobilenet.config import compose
from mobilenet.data import LoaderSpec, build_loaders
from scripts_under_test import load_script

# (split, class, name, width, height, format)
IMAGES = [
    ("train", "cat", "wide.jpg", 96, 64, "JPEG"),
    ("train", "cat", "tall.JPEG", 50, 90, "JPEG"),
    ("train", "cat", "small.jpg", 40, 30, "JPEG"),
    ("train", "dog", "exact.jpg", 80, 32, "JPEG"),
    ("train", "dog", "drawing.png", 70, 48, "PNG"),
    ("val", "cat", "v1.jpg", 64, 64, "JPEG"),
    ("val", "dog", "v2.jpg", 30, 20, "JPEG"),
]


def write_folder(root: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    for split, cls, name, w, h, fmt in IMAGES:
        (root / split / cls).mkdir(parents=True, exist_ok=True)
        pixels = (torch.rand(h, w, 3, generator=gen) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels, "RGB").save(root / split / cls / name, format=fmt)


@pytest.fixture()
def folder(tmp_path) -> Path:
    write_folder(tmp_path / "src")
    return tmp_path / "src"


def run(capsys, *args) -> str:
    script = load_script("resize_imagefolder")
    assert script.main([*map(str, args), "--workers", "2"]) == 0
    return capsys.readouterr().out


def test_larger_images_are_resized_to_the_short_side_and_smaller_ones_copied_as_they_are(folder, tmp_path, capsys):
    dst = tmp_path / "dst"
    out = run(capsys, "--src", folder, "--dst", dst, "--short-side", 32)
    assert "4 resized to a shorter side of 32 px, 3 copied" in out
    for split, cls, name, w, h, fmt in IMAGES:
        src_file, dst_file = folder / split / cls / name, dst / split / cls / name
        with Image.open(dst_file) as img:
            assert img.format == fmt
            if min(w, h) <= 32:
                assert dst_file.read_bytes() == src_file.read_bytes()
                continue
            scale = 32 / min(w, h)
            assert min(img.size) == 32 and img.size == (round(w * scale), round(h * scale))
    assert not (dst / ".partial").exists()


def test_the_copy_is_a_dataset_the_loaders_read_with_the_same_classes_and_labels(folder, tmp_path, capsys):
    dst = tmp_path / "dst"
    run(capsys, "--src", folder, "--dst", dst, "--short-side", 40)
    spec = LoaderSpec(torch.device("cpu"), torch.float32, channels_last=False)
    loaders = {}
    for root in (folder, dst):
        cfg = compose(["data=folder", f"data.root={root}", "data.batch_size=2", "data.resolution=16", "data.workers=0",
                       "data.val_resize_ratio=0.8"])
        loaders[root] = build_loaders(cfg.data, spec)
    (src_train, src_val), (dst_train, dst_val) = loaders[folder], loaders[dst]
    assert src_train.classes == dst_train.classes == ["cat", "dog"]
    assert sorted(torch.cat([y for _, y in src_val]).tolist()) == sorted(torch.cat([y for _, y in dst_val]).tolist())
    assert len(dst_train) == len(src_train)


def test_a_second_run_writes_nothing_and_an_interrupted_one_is_completed(folder, tmp_path, capsys):
    dst = tmp_path / "dst"
    run(capsys, "--src", folder, "--dst", dst, "--short-side", 32)
    assert "(already complete)" in run(capsys, "--src", folder, "--dst", dst, "--short-side", 32)
    (dst / "train" / "cat" / "wide.jpg").unlink()  # as if the run had stopped before this file
    (dst / ".partial").mkdir()
    (dst / ".partial" / "123-wide.jpg").write_bytes(b"half a file")
    out = run(capsys, "--src", folder, "--dst", dst, "--short-side", 32)
    assert "1 resized" in out and "0 copied" in out
    assert not (dst / ".partial").exists()
    with Image.open(dst / "train" / "cat" / "wide.jpg") as img:
        assert img.size == (48, 32)


def test_exif_is_kept_on_a_resized_jpeg(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "train" / "a").mkdir(parents=True)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display
    Image.new("RGB", (120, 80), (200, 30, 30)).save(src / "train" / "a" / "x.jpg", exif=exif.tobytes())
    run(capsys, "--src", src, "--dst", tmp_path / "dst", "--short-side", 40)
    with Image.open(tmp_path / "dst" / "train" / "a" / "x.jpg") as img:
        assert img.size == (60, 40) and img.getexif().get(0x0112) == 6


@pytest.mark.parametrize("damage", ["truncated", "not_an_image"])
def test_a_file_that_cannot_be_decoded_is_named_or_with_skip_corrupt_left_out(folder, tmp_path, capsys, damage):
    bad = folder / "train" / "dog" / ("big.jpg" if damage == "truncated" else "small_bad.jpg")
    if damage == "truncated":
        buf = io.BytesIO()
        Image.new("RGB", (200, 150), (1, 2, 3)).save(buf, format="JPEG")
        bad.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    else:
        bad.write_bytes(b"this is text, not a JPEG")
    script = load_script("resize_imagefolder")
    with pytest.raises(SystemExit) as stop:
        script.main(["--src", str(folder), "--dst", str(tmp_path / "dst"), "--short-side", "32", "--workers", "1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"cannot decode {str(bad)!r}" in err and "--skip-corrupt" in err and "Traceback" not in err
    out = run(capsys, "--src", folder, "--dst", tmp_path / "dst2", "--short-side", 32, "--skip-corrupt")
    assert "left out 1 file(s)" in out and str(bad) in out
    assert not (tmp_path / "dst2" / "train" / "dog" / bad.name).exists()


@pytest.mark.parametrize("args,message", [
    (["--short-side", "0"], "--short-side must be a positive number of pixels"),
    (["--short-side", "32", "--quality", "100"], "--quality must be from 1 to 95"),
    (["--short-side", "32", "--dst-inside"], "must lie outside --src"),
])
def test_bad_arguments_are_refused_with_what_is_allowed(folder, tmp_path, capsys, args, message):
    script = load_script("resize_imagefolder")
    dst = folder / "copy" if "--dst-inside" in args else tmp_path / "dst"
    args = [a for a in args if a != "--dst-inside"]
    with pytest.raises(SystemExit):
        script.main(["--src", str(folder), "--dst", str(dst), *args])
    assert message in capsys.readouterr().err


def test_a_cameras_mpo_jpeg_is_resized_as_the_jpeg_of_its_first_frame(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "train" / "a").mkdir(parents=True)
    first, second = Image.new("RGB", (120, 80), (10, 200, 30)), Image.new("RGB", (120, 80), (200, 10, 30))
    first.save(src / "train" / "a" / "x.jpg", format="MPO", save_all=True, append_images=[second])
    run(capsys, "--src", src, "--dst", tmp_path / "dst", "--short-side", 40)
    with Image.open(tmp_path / "dst" / "train" / "a" / "x.jpg") as img:
        assert img.format == "JPEG" and img.size == (60, 40) and getattr(img, "n_frames", 1) == 1
        r, g, b = img.convert("RGB").getpixel((30, 20))
        assert g > 150 and r < 60  # the first frame's green, not the second's red
        reference = io.BytesIO()
        first.save(reference, format="JPEG", quality=90)
        assert img.quantization == Image.open(reference).quantization  # --quality's tables, as for any JPEG
