"""Checkpoints of a training run: atomic writes, clear errors for files that do not fit, and an exact resume (the
model, optimizer, schedule, loss scale, position and RNG states all come back)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from . import cuda_graph
from .errors import UserError
from .optim import scheduled_lrs

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1
# Where a train.py run directory keeps the checkpoint of its last complete epoch.
CHECKPOINT_IN_RUN_DIR = Path("checkpoints") / "last.pt"
# Config keys that decide the shapes of the model's weights: a checkpoint resumes only into the same values.
WEIGHT_SHAPING_KEYS = ("model.name", "model.width_mult")


class CheckpointError(UserError, RuntimeError):
    """resume= names no checkpoint of this project, or one that does not fit the run's model."""


def save_checkpoint(path: Path, state: dict) -> None:
    """Write to a temporary file in the same directory, then rename: a crash or Ctrl-C mid-write leaves the previous
    checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C included: drop the partial file, keep the previous checkpoint
        tmp.unlink(missing_ok=True)
        raise


def checkpoint_file(path: str, option: str = "resume=") -> Path:
    """The checkpoint that resume=PATH means: the file itself, or a run directory's checkpoints/last.pt. `option`
    names the setting the path came from in messages (infer.py passes "--checkpoint ")."""
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / CHECKPOINT_IN_RUN_DIR).is_file():
            return p / CHECKPOINT_IN_RUN_DIR
        raise CheckpointError(f"{option}{path!r} is a directory without {CHECKPOINT_IN_RUN_DIR} (not a train.py run "
                              "directory, or its run ended before the first epoch's checkpoint)")
    if not p.is_file():
        raise CheckpointError(f"{option}{path!r}: no such checkpoint file or run directory")
    return p


def load_checkpoint(path: str, option: str = "resume=") -> dict:
    p = checkpoint_file(path, option)
    try:
        state = torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"{option}{path!r} is not a readable checkpoint (corrupt or truncated?): {type(e).__name__}: {e}") from e
    missing = {"version", "model", "optimizer", "scheduler", "epoch", "step"} - set(state if isinstance(state, dict) else {})
    if missing:
        raise CheckpointError(f"{option}{path!r} is not a checkpoint of this project: missing {sorted(missing)}")
    return state


def _config_dict(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if OmegaConf.is_config(cfg) else dict(cfg)


def _lookup(tree: dict, dotted: str):
    """tree's value at a dotted key ("model.width_mult"), None where it has none."""
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def architecture_mismatch(saved: dict | None, cfg, keys=WEIGHT_SHAPING_KEYS) -> tuple[str, object, object] | None:
    """(key, the checkpoint's value, the run's) for the first of `keys` whose values differ where both are set, or
    None."""
    run = _config_dict(cfg)
    for key in keys:
        theirs, ours = _lookup(saved or {}, key), _lookup(run, key)
        if theirs is not None and ours is not None and theirs != ours:
            return key, theirs, ours
    return None


def config_mismatch(saved: dict | None, cfg, num_classes: int, saved_num_classes: int | None) -> str | None:
    """Why a checkpoint's weights cannot fit this run's model (the first differing key, both values), or None."""
    differing = architecture_mismatch(saved, cfg)
    if differing is not None:
        key, theirs, ours = differing
        return f"the checkpoint was trained with {key}={theirs}, this run has {key}={ours}; set {key}={theirs}"
    if saved_num_classes is not None and saved_num_classes != num_classes:
        return (f"the checkpoint has {saved_num_classes} classes, this run's data has {num_classes} "
                f"(resume with the data it was trained on)")
    return None


def restore_rng_states(saved: dict) -> None:
    """Put back the RNG states a checkpoint saved, so that dropout draws the masks the uninterrupted run would.
    The CUDA states go back only onto as many GPUs as saved them; otherwise the run goes on, with a warning, from
    this process's CUDA seeds."""
    torch.set_rng_state(saved["torch"])
    if not torch.cuda.is_available():
        return  # a CPU run draws from the CPU generator alone
    cuda_states = saved.get("cuda")
    if cuda_states is not None and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
        return
    saved_on = "a machine without CUDA" if cuda_states is None else f"{len(cuda_states)} GPU(s)"
    log.warning("the checkpoint's CUDA RNG states were saved on %s and this machine has %d GPU(s): they are not "
                "restored, so GPU random draws (dropout) differ from an uninterrupted run",
                saved_on, torch.cuda.device_count())


def training_state(cfg, model: nn.Module, optimizer, scheduler, scaler, epoch: int, step: int, train_loader) -> dict:
    """Everything a resume needs to take the steps the uninterrupted run would, and what infer.py reads back (the
    config and the classes)."""
    return {
        "version": CHECKPOINT_VERSION,
        "model": model.state_dict(),
        "optimizer": cuda_graph.host_lrs(optimizer.state_dict()),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "step": step,
        "config": _config_dict(cfg),
        "num_classes": train_loader.num_classes,
        "classes": getattr(train_loader, "classes", None),
        "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
    }


def _load_model_weights(model: nn.Module, weights: dict, resume: str) -> None:
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:  # a checkpoint without a config, or a model changed in code: the first mismatch
        first = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), str(e))
        raise CheckpointError(f"resume={resume!r} does not fit this model: {first}") from e


def restore_training_state(state: dict, cfg, model: nn.Module, optimizer, scheduler, scaler, num_classes: int) -> tuple[int, int]:
    """Load a training_state() into the run's objects, after checking it fits; returns (epoch, step) to go on from."""
    why = config_mismatch(state.get("config"), cfg, num_classes, state.get("num_classes"))
    if why:
        raise CheckpointError(f"resume={cfg.resume!r} does not fit this run's model: {why}")
    _load_model_weights(model, state["model"], cfg.resume)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    # The optimizer restored the LR of the saved schedule; continue on this run's (epochs may have grown).
    for group, lr in zip(optimizer.param_groups, scheduled_lrs(scheduler)):
        group["lr"] = lr
    if state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    epoch, step = int(state["epoch"]), int(state["step"])
    restore_rng_states(state["rng"])
    log.info("resumed from %s at epoch %d, step %d", cfg.resume, epoch, step)
    return epoch, step
