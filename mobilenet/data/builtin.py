"""Datasets that ship with a dependency, written once as a JPEG ImageFolder so the real decode path runs."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DIGITS_SIZE = 32
DIGITS_VERSION = 1


def cache_dir() -> Path:
    root = os.environ.get("MOBILENET_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "mobilenet-fast")
    return Path(root).expanduser()


def write_digits(root: Path, size: int = DIGITS_SIZE, val_fraction: float = 0.2) -> None:
    """scikit-learn's 1,797 8x8 digits, upscaled to size x size RGB JPEGs, split train/val per class."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    index = np.arange(len(images))
    train_idx, val_idx = train_test_split(index, test_size=val_fraction, stratify=digits.target, random_state=0)
    for split, idx in (("train", train_idx), ("val", val_idx)):
        for i in idx:
            label = int(digits.target[i])
            out = root / split / str(label)
            out.mkdir(parents=True, exist_ok=True)
            img = Image.fromarray(images[i], mode="L").resize((size, size), Image.BICUBIC).convert("RGB")
            img.save(out / f"{i:04d}.jpg", quality=95)


def ensure_builtin(name: str) -> Path:
    """Path of the built-in dataset's ImageFolder, writing it on first use (atomically: concurrent runs agree)."""
    if name != "digits":
        raise ValueError(f"unknown built-in dataset {name!r}; choose one of: digits")
    final = cache_dir() / f"digits-jpeg{DIGITS_SIZE}-v{DIGITS_VERSION}"
    if (final / "val").is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".digits-", dir=final.parent))
    try:
        write_digits(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "val").is_dir():  # lost a race to another process: theirs is complete
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
