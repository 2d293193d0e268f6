#!/usr/bin/env python
"""Write an ImageNet-like JPEG ImageFolder for loader benchmarks: DIR/train/<class>/*.JPEG and DIR/val/<class>/*.JPEG.

The images cost what ImageNet's cost to decode: about 500x375 (a quarter portrait), about 110 KB, and content that
compresses like a photo rather than like white noise: a 1/f ("pink") colour field, soft shapes with hard edges,
a light gradient, mild sensor noise. Labels carry no signal worth learning; this is for throughput only.

    python scripts/make_fake_imagenet.py --out /data/fake-imagenet --num 50000
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np

LANDSCAPE = (375, 500)  # (height, width)
PORTRAIT = (500, 375)
JPEG_QUALITY = 95
# Sensor-noise standard deviation range (0..255): most of what makes the files photo-sized rather than tiny.
NOISE = (2.0, 5.0)


def _pink_field(rng: np.random.Generator, shape: tuple[int, int], exponent: float) -> np.ndarray:
    """A random float32 field whose amplitude spectrum falls as 1/f**exponent (natural images: about 1), in 0..1."""
    h, w = shape
    fy = np.fft.fftfreq(h).astype(np.float32)[:, None]
    fx = np.fft.rfftfreq(w).astype(np.float32)[None, :]
    radius = np.sqrt(fx * fx + fy * fy)
    radius[0, 0] = 1.0
    noise = rng.standard_normal((2, h, w // 2 + 1), dtype=np.float32)
    spectrum = (noise[0] + 1j * noise[1]) / radius**exponent
    spectrum[0, 0] = 0.0
    field = np.fft.irfft2(spectrum, s=(h, w)).astype(np.float32)
    field -= field.min()
    return field / max(float(field.max()), 1e-9)


def render(seed: int) -> bytes:
    """One JPEG's bytes, fully determined by `seed`."""
    from PIL import Image, ImageChops, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    h, w = PORTRAIT if rng.random() < 0.25 else LANDSCAPE
    # Luminance plus two colour-difference fields: colour varies more smoothly than brightness, as in photos.
    luma = _pink_field(rng, (h, w), rng.uniform(0.8, 1.1)) - 0.5
    chroma = [_pink_field(rng, (h, w), rng.uniform(1.3, 1.8)) - 0.5 for _ in range(2)]
    base = rng.uniform(0.25, 0.75, size=3).astype(np.float32)
    tint = rng.uniform(-0.7, 0.7, size=(2, 3)).astype(np.float32)
    img = base + luma[..., None] * np.float32(rng.uniform(0.6, 1.0))
    img += chroma[0][..., None] * tint[0] + chroma[1][..., None] * tint[1]
    img += np.linspace(-0.15, 0.15, h, dtype=np.float32)[:, None, None] * np.float32(rng.uniform(-1, 1))  # lighting
    canvas = Image.fromarray((img.clip(0, 1) * 255).astype(np.uint8), "RGB")

    # Objects: shapes with hard edges (some softened, like depth of field), filled from a few textured layers
    # shifted per object; building the layers once per image keeps the cost down.
    layers = []
    for _ in range(3):
        texture = _pink_field(rng, (h, w), rng.uniform(0.7, 1.2))[..., None]
        colour, other = rng.uniform(0, 1, size=(2, 3)).astype(np.float32)
        layers.append(Image.fromarray(((colour + texture * (other - colour)) * 255).astype(np.uint8), "RGB"))
    for _ in range(int(rng.integers(3, 9))):
        mask = Image.new("L", (w, h), 0)
        draw = ImageDraw.Draw(mask)
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        rx, ry = rng.uniform(20, w / 3), rng.uniform(20, h / 3)
        kind = rng.integers(3)
        if kind == 0:
            draw.ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=255)
        elif kind == 1:
            draw.rectangle([cx - rx, cy - ry, cx + rx, cy + ry], fill=255)
        else:
            angles = np.sort(rng.uniform(0, 2 * np.pi, int(rng.integers(3, 8))))
            draw.polygon([(cx + rx * np.cos(a), cy + ry * np.sin(a)) for a in angles], fill=255)
        if rng.random() < 0.4:
            mask = mask.filter(ImageFilter.GaussianBlur(rng.uniform(1, 4)))
        fill = ImageChops.offset(layers[int(rng.integers(len(layers)))], int(rng.integers(w)), int(rng.integers(h)))
        canvas.paste(fill, (0, 0), mask)

    pixels = np.asarray(canvas, dtype=np.float32)
    pixels += rng.standard_normal(pixels.shape, dtype=np.float32) * np.float32(rng.uniform(NOISE[0], NOISE[1]))
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB").save(out, "JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def _write(job: tuple[str, int]) -> int:
    path, seed = job
    data = render(seed)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # an interrupted run leaves no half-written .JPEG
    return len(data)


def plan(out: Path, num: int, classes: int, val_fraction: float, seed: int) -> list[tuple[str, int]]:
    num_val = int(round(num * val_fraction))
    jobs = []
    for i in range(num):
        split = "val" if i < num_val else "train"
        label = i % classes
        jobs.append((str(out / split / f"n{label:08d}" / f"{split}_{i:08d}.JPEG"), seed * 100_000_003 + i))
    return jobs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="output ImageFolder root")
    p.add_argument("--num", required=True, type=int, help="images in all (train + val)")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--val-fraction", type=float, default=0.04, help="share of images in val/ (ImageNet: about 0.04)")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    num_val = int(round(args.num * args.val_fraction))
    if args.num - num_val < args.classes or (num_val and num_val < args.classes):
        p.error(f"--num {args.num} with --val-fraction {args.val_fraction} leaves a split with fewer images than "
                f"--classes {args.classes}: every class directory needs an image in train/ and val/")
    jobs = plan(args.out, args.num, args.classes, args.val_fraction, args.seed)
    for split in ("train", "val") if num_val else ("train",):
        for c in range(args.classes):
            (args.out / split / f"n{c:08d}").mkdir(parents=True, exist_ok=True)
    jobs = [j for j in jobs if not os.path.exists(j[0])]  # resumable
    start = time.perf_counter()
    sizes = []
    with Pool(args.workers) as pool:
        for size in pool.imap_unordered(_write, jobs, chunksize=64):
            sizes.append(size)
    elapsed = time.perf_counter() - start
    if sizes:
        s = np.array(sizes) / 1000
        print(f"wrote {len(sizes)} images to {args.out} in {elapsed:.1f} s with {args.workers} processes; "
              f"size KB mean {s.mean():.0f}, median {np.median(s):.0f}, 5-95% {np.percentile(s, 5):.0f}-{np.percentile(s, 95):.0f}")
    else:
        print(f"{args.out} already complete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
