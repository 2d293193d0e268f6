"""Optimizers and the learning-rate schedule of a training run: what the config's optim.* settings build."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import enum_value
from .errors import ConfigError, MissingDependency

# The batch the configured optim.lr is meant for; other global batches scale it linearly.
REFERENCE_BATCH = 256

APEX_HINT = ("NVIDIA apex is not installed: build it from source with its CUDA extensions (see the apex README, "
             "'--cpp_ext --cuda_ext'), or use optim.impl=fused|foreach")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on BatchNorm parameters and biases (1-d tensors)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _zero_momentum_buffers(opt: torch.optim.SGD) -> None:
    """Give every parameter without one a zero momentum buffer; run at build time and after load_state_dict
    (a checkpoint saved before any real step, or by foreach/apex, carries no buffers).

    GradScaler lets a fused optimizer skip an overflowing fp16 step inside its kernel (no host sync, which is why
    fused is the default). torch's fused SGD then still allocates the momentum buffers of a first step it skips and
    leaves them uninitialised (reproducible with torch 2.14 on the CPU), and the next step reads that garbage, which
    can turn the loss into NaN. With zero buffers the skipped step changes nothing and the first real step gives
    buffer = grad, as stock SGD does (tests/test_engine.py checks both against foreach)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if opt.state[p].get("momentum_buffer") is None:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p)


def _apex_optimizer(name: str, groups: list[dict], lr: float, momentum: float, nesterov: bool) -> torch.optim.Optimizer:
    try:
        from apex.optimizers import FusedLAMB, FusedSGD
    except ImportError as e:
        raise MissingDependency(f"optim.impl=apex: {APEX_HINT} ({e})") from e
    # set_grad_none: apex's zero_grad() takes no set_to_none argument; this makes it drop the gradients as torch's
    # optimizers do by default, so the captured backward allocates them from the graph's pool.
    if name == "sgd":
        return FusedSGD(groups, lr=lr, momentum=momentum, nesterov=nesterov, set_grad_none=True)
    if name == "lamb":
        return FusedLAMB(groups, lr=lr, set_grad_none=True)
    raise ConfigError(f"optim.impl=apex offers optim=sgd (FusedSGD) and optim.name=lamb (FusedLAMB), not {name!r}")


def build_optimizer(cfg, model: nn.Module, global_batch: int) -> torch.optim.Optimizer:
    o = cfg.optim
    lr = o.lr * global_batch / REFERENCE_BATCH
    groups = param_groups(model, o.weight_decay)
    name, impl = enum_value(o.name), enum_value(o.impl)
    nesterov = o.nesterov and o.momentum > 0
    if impl == "apex":
        return _apex_optimizer(name, groups, lr, o.momentum, nesterov)
    if impl not in ("foreach", "fused"):
        raise ConfigError(f"unknown optim.impl {impl!r}; choose one of: foreach, fused, apex")
    kind = {impl: True}  # foreach=True or fused=True: never PyTorch's silent per-tensor loop
    if name == "sgd":
        opt = torch.optim.SGD(groups, lr=lr, momentum=o.momentum, nesterov=nesterov, **kind)
        if impl == "fused" and o.momentum > 0:
            _zero_momentum_buffers(opt)
            opt.register_load_state_dict_post_hook(_zero_momentum_buffers)
        return opt
    if name == "rmsprop":
        if impl == "fused":
            raise ConfigError("torch has no fused RMSprop; use optim.impl=foreach with optim=rmsprop")
        return torch.optim.RMSprop(groups, lr=lr, alpha=o.alpha, eps=o.eps, momentum=o.momentum, **kind)
    if name == "lamb":
        raise ConfigError("optim.name=lamb is apex's FusedLAMB: set optim.impl=apex")
    raise ConfigError(f"unknown optimizer {name!r}; choose one of: sgd, rmsprop, lamb (apex)")


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float):
    """The LR factor of a step: a linear warm-up to 1, then a cosine decay to min_ratio at total_steps."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return factor


def build_scheduler(cfg, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up and cosine decay over the run's cfg.epochs, stepped once per training step."""
    total = cfg.epochs * steps_per_epoch
    warmup = int(round(cfg.optim.warmup_epochs * steps_per_epoch))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total, max(1, warmup), cfg.optim.min_lr_ratio))


def scheduled_lrs(scheduler: torch.optim.lr_scheduler.LambdaLR) -> list[float]:
    """Each param group's learning rate at the scheduler's current step, computed on the host (a device-held lr, as
    a captured CUDA graph step has, would cost a sync to read)."""
    return [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
