"""data=synthetic: ImageNet-shaped random tensors made once on the device, for pure compute throughput."""

from __future__ import annotations

import torch

from . import LoaderSpec, register_loader


class SyntheticLoader:
    def __init__(self, batch_size: int, resolution: int, num_classes: int, steps: int, spec: LoaderSpec, seed: int):
        if steps is None or steps < 1:
            raise ValueError(f"data=synthetic needs data.steps_per_epoch >= 1 (and data.val_steps for validation), got {steps}")
        self.batch_size = batch_size
        self.num_classes = num_classes
        self.steps = steps
        self.num_samples = steps * batch_size
        # Per-rank generator: each rank of a DDP run has its own data, as a sharded real loader would.
        g = torch.Generator(device="cpu").manual_seed(seed * 1000 + spec.rank)
        images = torch.randn(batch_size, 3, resolution, resolution, generator=g)
        self.images = images.to(spec.device, spec.dtype).contiguous(memory_format=spec.memory_format)
        self.labels = torch.randint(0, num_classes, (batch_size,), generator=g).to(spec.device)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.images, self.labels

    def set_epoch(self, epoch: int) -> None:
        pass


@register_loader("synthetic")
def build(cfg, spec: LoaderSpec):
    train = SyntheticLoader(cfg.batch_size, cfg.resolution, cfg.num_classes, cfg.steps_per_epoch, spec, spec.seed)
    val = SyntheticLoader(cfg.batch_size, cfg.resolution, cfg.num_classes, cfg.val_steps or 1, spec, spec.seed + 1)
    return train, val
