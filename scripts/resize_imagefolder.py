#!/usr/bin/env python
"""Copy an ImageFolder (train/ and val/) with every image's shorter side at most --short-side pixels.

Why: a JPEG decoder's work grows with the pixels it decodes, and on an H200 DALI's hardware decoder, not the
training step, is what limits DALI-fed training with ImageNet's full-size JPEGs (docs/dali.md). Training at 224 px
reads a random crop that is then resized to 224, so most of a 500x375 photo's pixels are decoded only to be thrown
away; many fast ImageNet recipes store the set at a shorter side of 256-320 px for that reason.

What it writes: the same class directories and file names under --dst. An image whose shorter side is already at most
--short-side is copied byte for byte; a larger one is resized (aspect ratio kept, Lanczos, from a DCT-domain
downscale where libjpeg can do part of it exactly) and saved in its own format, JPEGs at --quality with their EXIF and
ICC profile kept. Each file is written under --dst/.partial/ and then renamed into place, so an interrupted run can
be started again: files already in --dst are left alone. A file that cannot be decoded stops the run with its name,
or with --skip-corrupt is left out, counted and listed.

    python scripts/resize_imagefolder.py --src /data/imagenet --dst /data/imagenet-320 --short-side 320
    python train.py data=dali data.root=/data/imagenet-320 ...
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from multiprocessing import Pool
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mobilenet.data.folder import scan_split  # noqa: E402
from mobilenet.errors import DataError, report_user_errors  # noqa: E402

SPLITS = ("train", "val")
# Files being written live here (under --dst, beside train/ and val/, where the loaders do not look) until renamed.
PARTIAL = ".partial"


def resize_one(job: tuple[str, str, int, int]) -> tuple[str, str, int, int]:
    """(src, what happened: copied | resized | corrupt: <why>, bytes read, bytes written) for one image."""
    from PIL import Image

    src, dst, short_side, quality = job
    size_in = os.path.getsize(src)
    try:
        with Image.open(src) as img:
            width, height = img.size
            if min(width, height) <= short_side:
                img.load()  # copied as it is, but decoded once: a truncated file must be found now, not in training
                action = "copied"
            else:
                scale = short_side / min(width, height)
                target = (max(1, round(width * scale)), max(1, round(height * scale)))
                # MPO (a camera's JPEG with extra frames): the first frame, saved as the JPEG it starts with
                fmt, info = ("JPEG" if img.format == "MPO" else img.format), dict(img.info)
                img.draft(img.mode, target)  # JPEG: libjpeg decodes at 1/2, 1/4 or 1/8 scale where that covers target
                out = img.resize(target, Image.Resampling.LANCZOS)
                action = "resized"
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        return src, f"corrupt: {e}", size_in, 0
    root = Path(dst).parents[2]  # dst is root/split/class/name
    tmp = str(root / PARTIAL / f"{os.getpid()}-{Path(dst).name}")
    if action == "copied":
        shutil.copyfile(src, tmp)
    else:
        extra = {k: info[k] for k in ("exif", "icc_profile") if info.get(k)}
        if fmt == "JPEG":
            extra.update(quality=quality, optimize=True)
        out.save(tmp, format=fmt, **extra)
    os.replace(tmp, dst)
    return src, action, size_in, os.path.getsize(dst)


def plan(src: Path, dst: Path, short_side: int, quality: int) -> list[tuple[str, str, int, int]]:
    """One job per image of src's splits whose copy under dst does not exist yet; dst's class directories made."""
    jobs = []
    for split in SPLITS:
        if not (src / split).is_dir():
            continue
        samples, classes = scan_split(src, split)  # the loaders' own checks: class directories, image extensions
        for name in classes:
            (dst / split / name).mkdir(parents=True, exist_ok=True)
        for path, _ in samples:
            out = dst / Path(path).relative_to(src)
            if not out.exists():
                jobs.append((path, str(out), short_side, quality))
    return jobs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", required=True, type=Path, help="ImageFolder root holding train/ (and val/)")
    p.add_argument("--dst", required=True, type=Path, help="where the copy goes (created; a partial copy is resumed)")
    p.add_argument("--short-side", required=True, type=int, help="largest shorter side in pixels, e.g. 320")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of resized images (1-95)")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--skip-corrupt", action="store_true", help="leave out files that cannot be decoded (listed)")
    args = p.parse_args(argv)
    src, dst = args.src.expanduser().resolve(), args.dst.expanduser().resolve()
    if not (src / "train").is_dir():
        p.error(f"--src {str(args.src)!r} has no train/ directory: it must be an ImageFolder root (train/<class>/*.jpg)")
    if dst == src or src in dst.parents or dst in src.parents:
        p.error(f"--dst {str(args.dst)!r} must lie outside --src {str(args.src)!r} and not contain it")
    if args.short_side < 1:
        p.error(f"--short-side must be a positive number of pixels, got {args.short_side}")
    if not 1 <= args.quality <= 95:
        p.error(f"--quality must be from 1 to 95 (Pillow's JPEG scale; above 95 only grows the files), got {args.quality}")
    with report_user_errors():
        return resize_folder(args, src, dst)


def resize_folder(args, src: Path, dst: Path) -> int:
    jobs = plan(src, dst, args.short_side, args.quality)
    shutil.rmtree(dst / PARTIAL, ignore_errors=True)  # what an interrupted run was writing
    (dst / PARTIAL).mkdir()
    start = time.perf_counter()
    counts = {"resized": 0, "copied": 0}
    corrupt: list[tuple[str, str]] = []
    bytes_in = bytes_out = 0
    with Pool(max(1, args.workers)) as pool:
        for path, action, size_in, size_out in pool.imap_unordered(resize_one, jobs, chunksize=32):
            if action.startswith("corrupt"):
                corrupt.append((path, action.removeprefix("corrupt: ")))
                if not args.skip_corrupt:
                    pool.terminate()
                    break
                continue
            counts[action] += 1
            bytes_in, bytes_out = bytes_in + size_in, bytes_out + size_out
    shutil.rmtree(dst / PARTIAL, ignore_errors=True)
    if corrupt and not args.skip_corrupt:
        path, why = corrupt[0]
        raise DataError(f"cannot decode {path!r} ({why}); fix or remove it, or pass --skip-corrupt to leave such "
                        f"files out of {str(args.dst)!r}")
    elapsed = time.perf_counter() - start
    ratio = f", {bytes_out / bytes_in:.2f}x the bytes" if bytes_in else ""
    print(f"{dst}: {counts['resized']} resized to a shorter side of {args.short_side} px, {counts['copied']} copied "
          f"as they were (already that small){ratio}, in {elapsed:.1f} s with {args.workers} processes"
          + ("" if jobs else " (already complete)"))
    if corrupt:
        print(f"left out {len(corrupt)} file(s) that cannot be decoded (--skip-corrupt):")
        for path, why in corrupt:
            print(f"  {path}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
