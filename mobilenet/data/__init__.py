"""One interface, several loaders.

Every loader yields `(images, labels)` already on the run's device, images in the run's dtype and memory
format and normalised, labels int64. The training loop never converts a batch itself, so what the profiler
shows for the model is the model's cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch

from ..errors import ConfigError


class Loader(Protocol):
    batch_size: int  # per rank
    num_classes: int
    num_samples: int  # images one epoch yields on this rank (val: exact, each image once over all ranks)

    def __len__(self) -> int: ...  # batches per epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def set_epoch(self, epoch: int) -> None: ...


@dataclass(frozen=True)
class LoaderSpec:
    """How the run wants its batches delivered."""

    device: torch.device
    dtype: torch.dtype
    channels_last: bool
    rank: int = 0
    world_size: int = 1
    seed: int = 0

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format


# Loaders over an ImageFolder: they take data.num_classes from the class directories when it is unset.
COUNTS_CLASSES = frozenset({"folder", "dali"})

Builder = Callable[..., tuple[Loader, Loader]]
_LOADERS: dict[str, Builder] = {}


def register_loader(name: str):
    def wrap(fn: Builder) -> Builder:
        _LOADERS[name] = fn
        return fn

    return wrap


def available_loaders() -> list[str]:
    _import_all()
    return sorted(_LOADERS)


def _import_all() -> None:
    from . import dali, folder, synthetic  # noqa: F401  (each registers itself)


def data_label(cfg) -> str:
    """The loader as a run's summary names it: its name, and for data=dali how it decodes."""
    label = cfg.name + (f" ({cfg.builtin})" if cfg.builtin else "")
    if cfg.name == "dali":
        from .dali import decoder_label

        label += f" ({decoder_label(cfg.dali)})"
    return label


def resolve_root(cfg) -> Path:
    """The ImageFolder root: data.root, or the cached JPEG copy of a built-in dataset."""
    if cfg.builtin is not None:
        if cfg.root is not None:
            raise ConfigError(f"set either data.root or data.builtin, not both (root={cfg.root!r}, builtin={cfg.builtin!r})")
        from .builtin import ensure_builtin

        return ensure_builtin(cfg.builtin)
    if cfg.root is None:
        raise ConfigError(f"data={cfg.name} needs data.root=DIR, an ImageFolder with DIR/train/<class>/*.jpg and DIR/val/<class>/*.jpg")
    return Path(cfg.root).expanduser()


def build_loaders(cfg, spec: LoaderSpec) -> tuple[Loader, Loader]:
    """(train, val) loaders for the data config `cfg` (the `data` node)."""
    _import_all()
    if cfg.name not in _LOADERS:
        raise ConfigError(f"unknown data loader {cfg.name!r}; choose one of: {', '.join(sorted(_LOADERS))}")
    if cfg.batch_size < 1:
        raise ConfigError(f"data.batch_size must be >= 1, got {cfg.batch_size}")
    if cfg.num_classes is None and cfg.name not in COUNTS_CLASSES:
        raise ConfigError(f"data={cfg.name} needs data.num_classes=N (only {', '.join(sorted(COUNTS_CLASSES))} "
                          "count the class directories)")
    if cfg.num_classes is not None and cfg.num_classes < 1:
        raise ConfigError(f"data.num_classes must be >= 1, got {cfg.num_classes}")
    return _LOADERS[cfg.name](cfg, spec)
