"""data=folder: torchvision ImageFolder, DataLoader workers, pinned memory, copies on a side CUDA stream.

Workers decode and crop to uint8 HWC; the batch is stacked as NHWC, which *is* a channels_last NCHW tensor,
so channels_last costs no copy. Conversion to the run's dtype and normalisation happen on the device.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from ..errors import DataError, DataNotFound, UserError
from . import LoaderSpec, register_loader, resolve_root

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
LAYOUT = "ROOT/train/<class>/<image>.jpg and ROOT/val/<class>/<image>.jpg"


class CorruptImageError(UserError, RuntimeError):
    """An image file that cannot be decoded; the message names it."""


def scan_split(root: Path, split: str) -> tuple[list[tuple[str, int]], list[str]]:
    """(samples, classes) of root/split with torchvision's class->index mapping, or a clear error.

    Shared by every loader over an ImageFolder so that they agree on labels and on what is an error.
    """
    from torchvision.datasets.folder import find_classes

    if not root.is_dir():
        raise DataNotFound(f"data.root {str(root)!r} does not exist or is not a directory; expected {LAYOUT}")
    split_dir = root / split
    if not split_dir.is_dir():
        raise DataNotFound(f"data.root {str(root)!r} has no {split}/ directory; expected {LAYOUT}")
    try:
        classes, class_to_idx = find_classes(str(split_dir))
    except FileNotFoundError:
        raise DataNotFound(f"{str(split_dir)!r} has no class directories; expected {LAYOUT}") from None
    samples: list[tuple[str, int]] = []
    not_images: list[str] = []
    for name in classes:
        files = sorted(p for p in (split_dir / name).rglob("*") if p.is_file())
        images = [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS]
        not_images += [str(p) for p in files if p.suffix.lower() not in IMAGE_EXTENSIONS]
        if not images:
            raise DataNotFound(f"class directory {str(split_dir / name)!r} holds no images ({', '.join(IMAGE_EXTENSIONS)}); remove it or add images")
        samples += [(str(p), class_to_idx[name]) for p in images]
    if not_images:
        shown = ", ".join(repr(p) for p in not_images[:3])
        raise DataError(f"{len(not_images)} non-image file(s) under {str(split_dir)!r}, e.g. {shown}; "
                         f"move them out (allowed extensions: {', '.join(IMAGE_EXTENSIONS)})")
    return samples, classes


class ImageFiles(Dataset):
    def __init__(self, samples: list[tuple[str, int]], transform, skip_corrupt: bool):
        self.samples = samples
        self.transform = transform
        self.skip_corrupt = skip_corrupt

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        path, label = self.samples[i]
        try:
            with Image.open(path) as img:
                img = img.convert("RGB")
        except Exception as e:  # PIL raises several types for truncated or foreign files
            if self.skip_corrupt:
                return None
            raise CorruptImageError(f"cannot decode image {path!r}: {e}. Fix or remove it, or set data.skip_corrupt=true") from e
        return np.asarray(self.transform(img), dtype=np.uint8), label


def collate_nhwc(items, channels_last: bool):
    """Stack HWC uint8 images as NCHW: a channels_last view (no copy), or a contiguous NCHW copy."""
    kept = [it for it in items if it is not None]
    skipped = len(items) - len(kept)
    if not kept:
        return None, None, skipped
    images = torch.from_numpy(np.stack([im for im, _ in kept])).permute(0, 3, 1, 2)
    if not channels_last:
        images = images.contiguous()
    return images, torch.tensor([lbl for _, lbl in kept], dtype=torch.int64), skipped


class _Collate:  # a class, not a lambda, so that worker processes can pickle it
    def __init__(self, channels_last: bool):
        self.channels_last = channels_last

    def __call__(self, items):
        return collate_nhwc(items, self.channels_last)


class DeviceLoader:
    """Wraps a DataLoader of uint8 batches; copies each to the device on a side stream while the previous step
    runs, then converts to the run's dtype and normalises there."""

    def __init__(self, loader: DataLoader, spec: LoaderSpec, mean, std, num_classes: int, num_samples: int, name: str):
        self.loader = loader
        self.spec = spec
        self.batch_size = loader.batch_size
        self.num_classes = num_classes
        self.num_samples = num_samples
        self.name = name
        self.classes: list[str] | None = None
        self.skipped = 0
        self.mean = torch.tensor(mean, device=spec.device).mul(255).view(1, 3, 1, 1).to(spec.dtype)
        self.inv_std = torch.tensor(std, device=spec.device).mul(255).reciprocal().view(1, 3, 1, 1).to(spec.dtype)
        self.stream = torch.cuda.Stream(spec.device) if spec.device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        if isinstance(self.loader.sampler, DistributedSampler):
            self.loader.sampler.set_epoch(epoch)
        elif self.loader.generator is not None:
            # Each epoch's shuffle depends on (seed, epoch) alone, as DistributedSampler's does: a run resumed at
            # epoch e reads the batches the uninterrupted run read.
            self.loader.generator.manual_seed(self.spec.seed + epoch)

    def _to_device(self, images, labels):
        images = images.to(self.spec.device, non_blocking=True)
        labels = labels.to(self.spec.device, non_blocking=True)
        return images.to(self.spec.dtype).sub_(self.mean).mul_(self.inv_std), labels

    def _prepare(self, batch):
        images, labels, skipped = batch
        if skipped:
            self.skipped += skipped
            log.warning("%s: skipped %d corrupt image(s) (data.skip_corrupt=true), %d so far", self.name, skipped, self.skipped)
        if images is None:
            return None
        if self.stream is None:
            return self._to_device(images, labels)
        with torch.cuda.stream(self.stream):
            return self._to_device(images, labels)

    def __iter__(self):
        pending = None
        for batch in self.loader:
            ready = pending
            pending = self._prepare(batch)
            if ready is not None:
                yield self._handover(ready)
        if pending is not None:
            yield self._handover(pending)

    def _handover(self, batch):
        if self.stream is not None:
            current = torch.cuda.current_stream(self.spec.device)
            current.wait_stream(self.stream)
            for t in batch:  # the caching allocator must not reuse these until the consumer's stream is done
                t.record_stream(current)
        return batch


def val_resize_size(cfg) -> int:
    """Validation: the shorter side is resized to this, then the centre resolution x resolution is cropped (every
    loader and infer.py --images use it)."""
    return int(round(cfg.resolution / cfg.val_resize_ratio))


def image_transforms(cfg, train: bool):
    """The folder loader's PIL transforms before tensor conversion: random-resized crop (+ flip), or the val crop."""
    from torchvision import transforms as T

    if train:
        steps = [T.RandomResizedCrop(cfg.resolution, scale=tuple(cfg.crop_scale), antialias=True)]
        if cfg.hflip:
            steps.append(T.RandomHorizontalFlip())
        return T.Compose(steps)
    return T.Compose([T.Resize(val_resize_size(cfg), antialias=True), T.CenterCrop(cfg.resolution)])


def check_batch_fits(num_train: int, cfg, world_size: int) -> None:
    per_rank = num_train // world_size
    if per_rank < cfg.batch_size:
        raise DataError(
            f"data.batch_size={cfg.batch_size} is larger than the {per_rank} training images per rank "
            f"({num_train} images over {world_size} rank(s)); training drops the last partial batch, so no step would run. "
            f"Use data.batch_size<={per_rank}."
        )


def scan_image_folder(cfg) -> tuple[Path, list[tuple[str, int]], list[tuple[str, int]], list[str]]:
    """(root, train samples, val samples, classes) of the data config's ImageFolder, checked for consistency."""
    root = resolve_root(cfg)
    train_samples, classes = scan_split(root, "train")
    val_samples, val_classes = scan_split(root, "val")
    if val_classes != classes:
        raise DataError(f"train/ and val/ under {str(root)!r} have different classes: "
                         f"{sorted(set(classes) ^ set(val_classes))[:5]} appear in only one")
    # data.num_classes unset: the class directories decide; set, it is a check that the folder is the one meant.
    if cfg.num_classes is not None and len(classes) != cfg.num_classes:
        raise DataError(f"{str(root)!r} has {len(classes)} classes but data.num_classes={cfg.num_classes}; "
                        f"set data.num_classes={len(classes)}, or leave it unset to take the folder's count")
    return root, train_samples, val_samples, classes


def available_cpus() -> int:
    """CPUs this process may run on (a container's or taskset's limit, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def worker_count(requested: int) -> int:
    """data.workers, capped at the CPUs there are: more decoding processes than CPUs only contend."""
    cpus = available_cpus()
    if requested > cpus:
        log.info("data.workers=%d capped at the %d CPU(s) available to this process", requested, cpus)
        return cpus
    return requested


def drop_undecodable(samples: list[tuple[str, int]], cfg, split: str) -> list[tuple[str, int]]:
    """Check every file's image signature and JPEG structure before training, as data=dali does, so that a corrupt
    file stops the run up front (naming it) instead of midway through an epoch; skipped with data.skip_corrupt."""
    from .dali import find_corrupt

    bad = find_corrupt([p for p, _ in samples], threads=min(32, available_cpus()))
    if not bad:
        return samples
    if not cfg.skip_corrupt:
        path, reason = bad[0]
        reason = reason.replace("image DALI can decode", "image this loader can decode")  # the check is DALI's
        more = f" ({len(bad) - 1} more in {split}/, e.g. {bad[1][0]!r})" if len(bad) > 1 else ""
        raise CorruptImageError(f"cannot decode image {path!r}: {reason}{more}. Fix or remove it, or set data.skip_corrupt=true")
    log.warning("data=folder %s: skipped %d corrupt image(s) (data.skip_corrupt=true), e.g. %s", split, len(bad), bad[0][0])
    bad_paths = {p for p, _ in bad}
    return [s for s in samples if s[0] not in bad_paths]


@register_loader("folder")
def build(cfg, spec: LoaderSpec):
    root, train_samples, val_samples, classes = scan_image_folder(cfg)
    if cfg.check_files:
        train_samples = drop_undecodable(train_samples, cfg, "train")
        val_samples = drop_undecodable(val_samples, cfg, "val")
    check_batch_fits(len(train_samples), cfg, spec.world_size)
    workers = worker_count(cfg.workers)

    train_ds = ImageFiles(train_samples, image_transforms(cfg, True), cfg.skip_corrupt)
    val_ds = ImageFiles(val_samples, image_transforms(cfg, False), cfg.skip_corrupt)
    # Validation shards are strided subsets without padding: every image is counted exactly once overall. A
    # val_steps cap shortens the shard itself, as in the DALI loader: every evaluation sees the same images.
    val_indices = range(spec.rank, len(val_ds), spec.world_size)
    if cfg.val_steps is not None:
        val_indices = val_indices[: cfg.val_steps * cfg.batch_size]
    val_ds_rank = Subset(val_ds, val_indices)
    g = torch.Generator().manual_seed(spec.seed)
    if spec.world_size > 1:
        train_sampler = DistributedSampler(train_ds, spec.world_size, spec.rank, shuffle=True, seed=spec.seed, drop_last=True)
        shuffle = None
    else:
        train_sampler, shuffle = None, True
    common = dict(
        num_workers=workers,
        pin_memory=spec.device.type == "cuda",
        persistent_workers=workers > 0,
        collate_fn=_Collate(spec.channels_last),
    )
    if workers > 0:
        common["prefetch_factor"] = 4
    train_dl = DataLoader(train_ds, cfg.batch_size, shuffle=shuffle, sampler=train_sampler, drop_last=True, generator=g, **common)
    val_dl = DataLoader(val_ds_rank, cfg.batch_size, shuffle=False, drop_last=False, **common)
    n_train = (len(train_ds) // spec.world_size // cfg.batch_size) * cfg.batch_size
    train = DeviceLoader(train_dl, spec, cfg.mean, cfg.std, len(classes), n_train, "train")
    val = DeviceLoader(val_dl, spec, cfg.mean, cfg.std, len(classes), len(val_ds_rank), "val")
    train.classes = val.classes = classes
    return train, val
