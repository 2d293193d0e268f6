"""The one training and evaluation loop, shared by every backend x precision x layout x loader combination."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import nn

from . import cuda_graph, distributed, streams
from .config import enum_value
from .data import LoaderSpec, build_loaders
from .depthwise import get_backend
from .errors import ConfigError, MissingDependency, UserError, checking_user_input
from .meter import StepMeter, Throughput
from .model import build_model
from .norm import convert_sync_batchnorm, get_norm
from .reporting import TensorBoardLog, environment, print_summary

log = logging.getLogger(__name__)

AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CHECKPOINT_VERSION = 1


class CheckpointError(UserError, RuntimeError):
    """resume= names no checkpoint of this project, or one that does not fit the run's model."""


# Config keys that decide the shapes of the model's weights: a checkpoint resumes only into the same values.
WEIGHT_SHAPING_KEYS = ("model.name", "model.width_mult")


def resolve_device(kind: Any) -> torch.device:
    kind = enum_value(kind)
    if kind == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda, but no CUDA GPU is available (torch.cuda.is_available() is False); use device=auto or device=cpu")
    if kind not in ("cuda", "cpu"):
        raise ConfigError(f"unknown device {kind!r}; choose one of: auto, cuda, cpu")
    return torch.device(kind)


def autocast_dtype(cfg) -> torch.dtype | None:
    """The autocast dtype under amp=true, else None (autocast off)."""
    return AMP_DTYPES[enum_value(cfg.amp_dtype)] if cfg.amp else None


def precision_label(cfg) -> str:
    return f"amp {enum_value(cfg.amp_dtype)}" if cfg.amp else "fp32"


def layout_label(cfg) -> str:
    return "channels_last" if cfg.channels_last else "NCHW"


def config_rows(cfg, device: torch.device, env: dict, backend: str | None = None) -> dict[str, Any]:
    """What a summary table says about the combination that ran (training and inference alike)."""
    return {
        "backend": backend or cfg.backend.name,
        "norm": cfg.norm.name,
        "precision": precision_label(cfg),
        "memory format": layout_label(cfg),
        "compile": cfg.compile,
        "data": cfg.data.name + (f" ({cfg.data.builtin})" if cfg.data.builtin else ""),
        "batch size": cfg.data.batch_size,
        "resolution": cfg.data.resolution,
        "device": env.get("gpu") if device.type == "cuda" else "cpu",
        "torch / CUDA / cuDNN": f"{env['torch']} / {env['cuda']} / {env['cudnn']}",
    }


def run_dtype(cfg) -> torch.dtype:
    """The dtype batches are delivered in: the autocast dtype under AMP, else fp32."""
    return autocast_dtype(cfg) or torch.float32


def validate(cfg, device: torch.device) -> None:
    """Reject combinations that cannot run as asked, before any work is done. Nothing is substituted."""
    with checking_user_input(ValueError):  # an unknown backend name
        backend = get_backend(cfg.backend.name)
    backend.check(device)  # first: a GPU-only backend on a CPU is the root cause to report
    get_norm(cfg.norm.name).check(device)
    if cfg.amp and enum_value(cfg.amp_dtype) == "fp16" and device.type != "cuda":
        raise ConfigError("amp=true with amp_dtype=fp16 needs a CUDA GPU (CPU autocast runs bf16 only); "
                          "use amp_dtype=bf16 on a CPU, or run on a GPU")
    if cfg.amp and enum_value(cfg.amp_dtype) == "bf16" and device.type == "cpu":
        warn_once("bf16_cpu", "amp=true amp_dtype=bf16 on a CPU: most CPUs have no fast bf16 arithmetic, and such a run "
                  "can be tens of times slower than fp32 (amp=false); use it to check the code path, not for speed")


_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Log a warning once per process: validate() runs for every Trainer a script builds."""
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_for_run(cfg, device: torch.device, num_classes: int, model: nn.Module | None = None) -> nn.Module:
    """The configured MobileNetV1 (or a given peer model) on the run's device, in the run's memory format."""
    if model is None:
        with checking_user_input(ValueError):  # an unknown model name or a width out of range
            model = build_model(cfg.model.name, num_classes, cfg.model.width_mult, cfg.backend.name, cfg.model.dropout, norm=cfg.norm.name)
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on BatchNorm parameters and biases (1-d tensors)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


APEX_HINT = ("NVIDIA apex is not installed: build it from source with its CUDA extensions (see the apex README, "
             "'--cpp_ext --cuda_ext'), or use optim.impl=fused|foreach")


def _zero_momentum_buffers(opt: torch.optim.SGD) -> None:
    """Give every parameter without one a zero momentum buffer; run at build time and after load_state_dict
    (a checkpoint saved before any real step, or by foreach/apex, carries no buffers).

    GradScaler lets a fused optimizer skip an overflowing fp16 step inside its kernel (no host sync, which is why
    fused is the default). torch's fused SGD then still allocates the momentum buffers of a first step it skips and
    leaves them uninitialised (reproduced with torch 2.14 on the CPU), and the next step reads that garbage; a
    fused-SGD run on the H200 (torch 2.11) stopped with a NaN loss at step 50, which this explains (that run was not
    repeated with the fix). With zero buffers the skipped step changes nothing and the first real step gives
    buffer = grad, as stock SGD does (tests/test_engine.py checks both against foreach)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if opt.state[p].get("momentum_buffer") is None:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p)


def build_optimizer(cfg, model: nn.Module, global_batch: int) -> torch.optim.Optimizer:
    o = cfg.optim
    lr = o.lr * global_batch / 256  # linear scaling from the reference batch of 256
    groups = param_groups(model, o.weight_decay)
    name, impl = enum_value(o.name), enum_value(o.impl)
    nesterov = o.nesterov and o.momentum > 0
    if impl == "apex":
        try:
            from apex.optimizers import FusedLAMB, FusedSGD
        except ImportError as e:
            raise MissingDependency(f"optim.impl=apex: {APEX_HINT} ({e})") from e
        if name == "sgd":
            return FusedSGD(groups, lr=lr, momentum=o.momentum, nesterov=nesterov)
        if name == "lamb":
            return FusedLAMB(groups, lr=lr)
        raise ConfigError(f"optim.impl=apex offers optim=sgd (FusedSGD) and optim.name=lamb (FusedLAMB), not {name!r}")
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
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return factor


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


CHECKPOINT_IN_RUN_DIR = Path("checkpoints") / "last.pt"


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


def _lookup(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def config_mismatch(saved: dict | None, cfg, num_classes: int, saved_num_classes: int | None) -> str | None:
    """Why a checkpoint's weights cannot fit this run's model (the first differing key, both values), or None."""
    run = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if OmegaConf.is_config(cfg) else dict(cfg)
    for key in WEIGHT_SHAPING_KEYS:
        theirs, ours = _lookup(saved or {}, key), _lookup(run, key)
        if theirs is not None and ours is not None and theirs != ours:
            return f"the checkpoint was trained with {key}={theirs}, this run has {key}={ours}; set {key}={theirs}"
    if saved_num_classes is not None and saved_num_classes != num_classes:
        return (f"the checkpoint has {saved_num_classes} classes, this run's data has {num_classes} "
                f"(resume with the data it was trained on)")
    return None


class _LossReadback:
    """Copies the loss to the host without stalling the GPU queue: read a step's value once its event completed."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[int, torch.Tensor, Any]] = []

    def push(self, step: int, loss: torch.Tensor) -> None:
        if not self.cuda:
            self.pending.append((step, loss.detach().float().cpu(), None))
            return
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(loss.detach().float(), non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.pending.append((step, host, ev))

    def ready(self, wait: bool = False) -> list[tuple[int, float]]:
        out = []
        while self.pending and (wait or self.pending[0][2] is None or self.pending[0][2].query()):
            step, host, ev = self.pending.pop(0)
            if ev is not None:
                ev.synchronize()
            out.append((step, float(host)))
        return out


@dataclass
class RunResult:
    train: Throughput | None = None
    val_top1: float = float("nan")
    val_top5: float = float("nan")
    val_img_s: float = float("nan")
    val_images: int = 0
    epochs_done: int = 0
    global_step: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)
    lrs: list[tuple[int, float]] = field(default_factory=list)
    run_dir: str = ""


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, amp_dtype: torch.dtype | None, warmup_steps: int = 0):
    """(top1 %, top5 %, images, throughput) over the whole loader; every image counted exactly once."""
    was_training = model.training
    model.eval()
    correct1 = torch.zeros((), dtype=torch.int64, device=device)
    correct5 = torch.zeros((), dtype=torch.int64, device=device)
    seen = 0
    meter = StepMeter(device, warmup_steps)
    it = iter(loader)
    while True:
        meter.data_start()
        try:
            images, labels = next(it)
        except StopIteration:
            break
        meter.compute_start()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images)
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hit = top.eq(labels.view(-1, 1))
        correct1 += hit[:, 0].sum()
        correct5 += hit.any(dim=1).sum()
        seen += labels.shape[0]
        meter.step_end(labels.shape[0])
    model.train(was_training)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        totals = torch.stack([correct1, correct5, torch.tensor(seen, device=device)])
        torch.distributed.all_reduce(totals)
        correct1, correct5, seen = totals[0], totals[1], int(totals[2])
    if seen == 0:
        raise RuntimeError("validation loader yielded no images")
    return 100.0 * int(correct1) / seen, 100.0 * int(correct5) / seen, seen, meter.result()


class Trainer:
    """Builds everything a run needs from the config, then `fit()` runs the epochs."""

    def __init__(self, cfg, run_dir: str | os.PathLike, overrides: str = "", model: nn.Module | None = None,
                 backend_label: str | None = None):
        """`model` replaces the project's MobileNetV1 (a peer model measured by this same loop); `backend_label`
        names it in summaries and hparams."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        with checking_user_input(ValueError):  # perf.max_connections out of range
            self.queues_state = streams.apply_max_connections(cfg)  # before anything creates the CUDA context
        self.dist, self.device = distributed.init(resolve_device(cfg.device), cfg.dist.timeout_s)
        if self.device.type != "cuda":
            self.queues_state = f"none ({self.device.type})"
        validate(cfg, self.device)
        self.overrides = overrides
        with checking_user_input(ValueError):  # a stream setting this device cannot take
            self.stream, self.stream_state = streams.resolve(cfg, self.device)
        with streams.issued_on(self.stream):  # the model, optimizer state and batches live on the run's stream
            self._build(cfg, model, backend_label)

    def _build(self, cfg, model: nn.Module | None, backend_label: str | None) -> None:
        with checking_user_input(ValueError):  # cuda_graph=true where a run cannot be captured
            use_graph, self.cuda_graph_state = cuda_graph.resolve(cfg, self.device, self.dist.enabled)
        if cfg.sync_bn and not self.dist.enabled:
            raise ConfigError("sync_bn=true needs a process group, and this run is a single process: "
                             "launch with `torchrun --nproc_per_node=N train.py ... sync_bn=true`")
        if cfg.profile and self.dist.enabled:
            raise ConfigError("profile=true traces one process: run it without torchrun")
        seed_everything(cfg.seed)
        torch.backends.cudnn.benchmark = True
        self.amp_dtype = autocast_dtype(cfg)
        spec = LoaderSpec(self.device, run_dtype(cfg), cfg.channels_last, self.dist.rank, self.dist.world_size, seed=cfg.seed)
        with checking_user_input(ValueError, FileNotFoundError, ImportError):  # the data config or the files
            self.train_loader, self.val_loader = build_loaders(cfg.data, spec)
        self.steps_per_epoch = len(self.train_loader)
        if cfg.data.steps_per_epoch is not None:  # the folder loader's cap (DALI and synthetic size themselves)
            self.steps_per_epoch = min(self.steps_per_epoch, cfg.data.steps_per_epoch)
        if self.steps_per_epoch < 1:
            raise ConfigError("the training loader yields no full batch; lower data.batch_size")
        self.model = build_for_run(cfg, self.device, self.train_loader.num_classes, model)
        if cfg.sync_bn:
            self.model = convert_sync_batchnorm(self.model)  # keeps each fused norm_relu's ReLU
        self.backend_label = backend_label or cfg.backend.name
        # Figures measured outside fit() (e.g. inference img/s) to log as perf/<name> and hparam/<name>.
        self.extra_metrics: dict[str, float] = {}
        wrapped = self.model
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(self.model, device_ids=[self.device] if self.device.type == "cuda" else None,
                                              gradient_as_bucket_view=True)
        self.forward = torch.compile(wrapped) if cfg.compile else wrapped
        self.optimizer = build_optimizer(cfg, self.model, cfg.data.batch_size * self.dist.world_size)
        total = cfg.epochs * self.steps_per_epoch
        warmup = int(round(cfg.optim.warmup_epochs * self.steps_per_epoch))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(total, max(1, warmup), cfg.optim.min_lr_ratio)
        )
        # fp16 needs loss scaling to keep small gradients representable; bf16 has fp32's exponent range.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)
        self.graphed = None
        self.epoch = 0
        self.global_step = 0
        if cfg.resume:
            self._restore(load_checkpoint(cfg.resume))
        self.start_step = self.global_step
        if use_graph:  # after a resume: the restored learning rates become the captured step's device tensors
            self.graphed = cuda_graph.CapturedStep(self._step_math, self.optimizer, self.device)
        if not cfg.profile:  # profile=true sizes its own windows
            self._check_steps_to_time()
        self.env = environment(self.device)
        # Only rank 0 writes: one TensorBoard run and one checkpoint per training run.
        self.tb = TensorBoardLog(str(self.run_dir), enabled=self.dist.is_main)
        self.profiler = None

    # --- checkpoints ---------------------------------------------------------------------------------------------

    def _state(self) -> dict:
        return {
            "version": CHECKPOINT_VERSION,
            "model": self.model.state_dict(),
            "optimizer": cuda_graph.host_lrs(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "step": self.global_step,
            "config": OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True) if OmegaConf.is_config(self.cfg) else dict(self.cfg),
            "num_classes": self.train_loader.num_classes,
            "classes": getattr(self.train_loader, "classes", None),
            "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }

    def _restore(self, state: dict) -> None:
        why = config_mismatch(state.get("config"), self.cfg, self.train_loader.num_classes, state.get("num_classes"))
        if why:
            raise CheckpointError(f"resume={self.cfg.resume!r} does not fit this run's model: {why}")
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as e:  # a checkpoint without a config, or a model changed in code: the first mismatch
            first = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), str(e))
            raise CheckpointError(f"resume={self.cfg.resume!r} does not fit this model: {first}") from e
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The optimizer restored the LR of the saved schedule; continue on this run's (epochs may have grown).
        sched = self.scheduler
        for group, base, fn in zip(self.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * fn(sched.last_epoch)
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.epoch = int(state["epoch"])
        self.global_step = int(state["step"])
        restore_rng_states(state["rng"])
        log.info("resumed from %s at epoch %d, step %d", self.cfg.resume, self.epoch, self.global_step)

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoints" / "last.pt"

    # --- the loop ------------------------------------------------------------------------------------------------

    def _range(self, name: str):
        """A named profiler range when profiling, else nothing."""
        return self.profiler.range(name) if self.profiler else contextlib.nullcontext()

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.graphed(images, labels) if self.graphed else self._step_math(images, labels)
        self.scheduler.step()  # outside the graph: it fills the captured step's learning-rate tensor in place
        return loss

    def _step_math(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward, loss, backward and optimizer step: what a CUDA graph captures."""
        with self._range("forward"):
            # Autocast's cast cache would hold tensors across a capture boundary; MobileNet uses each weight once.
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None,
                                cache_enabled=self.graphed is None):
                loss = self.criterion(self.forward(images), labels)
        with self._range("backward"):
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
        with self._range("optimizer"):
            self.scaler.step(self.optimizer)
            self.scaler.update()
        return loss

    def current_lr(self) -> float:
        """The learning rate of this step, computed on the host (a device-held lr would cost a sync to read)."""
        sched = self.scheduler
        return sched.base_lrs[0] * sched.lr_lambdas[0](sched.last_epoch)

    def _untimed_steps(self) -> int:
        """perf.warmup_steps, and with a captured step at least its eager steps and the capture: the capture
        synchronises and records ~330 launches once, which is set-up, not a step's speed."""
        if self.graphed is None:
            return self.cfg.perf.warmup_steps
        return max(self.cfg.perf.warmup_steps, self.graphed.warmup_steps + 1)

    def _check_steps_to_time(self) -> None:
        """Refuse a run whose reported throughput could only be nan: the summary reports the last epoch, and the
        first epoch of a run leaves its first _untimed_steps() steps untimed."""
        cfg, remaining = self.cfg, self.cfg.epochs - self.epoch
        if cfg.epochs < 1:
            raise ConfigError(f"epochs={cfg.epochs}: a run needs at least one epoch")
        if remaining < 1:
            raise ConfigError(f"resume={cfg.resume!r} has already run {self.epoch} epoch(s) and this run asks for "
                              f"epochs={cfg.epochs}: nothing left to train; raise epochs")
        untimed = self._untimed_steps()
        if remaining == 1 and self.steps_per_epoch <= untimed:
            graph = " (and the CUDA graph's eager steps and capture)" if self.graphed is not None else ""
            raise ConfigError(
                f"only {self.steps_per_epoch} training step(s) would run, all of them warm-up (perf.warmup_steps="
                f"{cfg.perf.warmup_steps}{graph}): no step would be timed and throughput would be nan; lower "
                f"perf.warmup_steps below {self.steps_per_epoch}, or run more steps (data.steps_per_epoch, epochs)")

    def train_epoch(self, result: RunResult, max_steps: int | None = None) -> Throughput:
        cfg = self.cfg
        self.model.train()
        self.train_loader.set_epoch(self.epoch)
        meter = StepMeter(self.device, self._untimed_steps() if self.epoch == self._first_epoch else 0)
        readback = _LossReadback(self.device)
        # A profiling window may be longer than a small data set's epoch: then the loader is read again.
        steps = self.steps_per_epoch if max_steps is None else max_steps
        bar = _progress(steps, f"epoch {self.epoch + 1}/{cfg.epochs}", cfg.progress)
        it = _cycle(self.train_loader)
        for i in range(steps):
            meter.data_start()
            with self._range("data"):
                images, labels = next(it)
            meter.compute_start()
            lr = self.current_lr()
            loss = self.train_step(images, labels)
            meter.step_end(labels.shape[0])
            if self.profiler:
                self.profiler.step()
            self.global_step += 1
            if self.global_step % cfg.perf.log_every == 0 or i == steps - 1:
                readback.push(self.global_step, loss)
                result.lrs.append((self.global_step, lr))
                self.tb.scalars({"train/lr": lr}, self.global_step)
            self._record_losses(readback.ready(), result, bar)
            if bar is not None:
                rate = meter.live_img_s()
                if rate is not None and i % 5 == 0:
                    bar.set_postfix(img_s=f"{rate:,.0f}", loss=f"{result.losses[-1][1]:.3f}" if result.losses else "-", refresh=False)
                bar.update(1)
        self._record_losses(readback.ready(wait=True), result, bar)
        if bar is not None:
            bar.close()
        return meter.result()

    def _record_losses(self, losses: list[tuple[int, float]], result: RunResult, bar) -> None:
        """Check, keep and log the losses read back so far; every one of them, the epoch's last included."""
        for step, value in losses:
            if not math.isfinite(value):
                raise FloatingPointError(f"training loss is {value} at step {step}; lower optim.lr or check the data")
            result.losses.append((step, value))
            self.tb.scalars({"train/loss": value}, step)
            if bar is not None:
                bar.set_postfix(loss=f"{value:.3f}", refresh=False)

    def profile(self) -> RunResult:
        """profile=true: time steps without the profiler, then trace a window of steps and diagnose it."""
        from .profiling import StepProfiler

        cfg, result = self.cfg, RunResult(run_dir=str(self.run_dir))
        self._first_epoch = self.epoch
        pc = cfg.profiler
        baseline = self.train_epoch(result, max_steps=cfg.perf.warmup_steps + pc.baseline_steps)
        result.train = baseline
        self.profiler = StepProfiler(self.run_dir, self.device, run_meta(cfg, self.env, "train"), pc,
                                     baseline_step_ms=baseline.step_ms_median)
        if self.device.type == "cpu":  # Kineto's own stderr line cannot be silenced from Python; say what it means
            log.info("a CPU-only trace: PyTorch's profiler (Kineto) may print 'ERROR: ... gpuGetDeviceCount failed' "
                     "as it finishes; that is its probe for a GPU finding none, and the trace is complete")
        try:
            with self.profiler:
                self.train_epoch(result, max_steps=self.profiler.total_steps)
            report = self.profiler.finish()
        finally:
            self.profiler = None
        self.tb.text("profile", report.markdown())
        self.tb.close()
        return result

    def global_throughput(self, tp: Throughput) -> Throughput:
        """Images summed over ranks over the slowest rank's time: the run's img/s, not one GPU's."""
        if not self.dist.enabled:
            return tp
        images, = distributed.sum_over_ranks([tp.images], self.device, self.dist)
        mx = lambda v: distributed.max_over_ranks(v, self.device, self.dist)  # noqa: E731
        return Throughput(images=int(images), steps=tp.steps, seconds=mx(tp.seconds), compute_seconds=mx(tp.compute_seconds),
                          data_wait_seconds=mx(tp.data_wait_seconds), step_ms_median=mx(tp.step_ms_median))

    def fit(self) -> RunResult:
        with streams.issued_on(self.stream):
            return self.profile() if self.cfg.profile else self._fit()

    def _fit(self) -> RunResult:
        cfg = self.cfg
        result = RunResult(run_dir=str(self.run_dir))
        self._first_epoch = self.epoch
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            while self.epoch < cfg.epochs:
                tp = self.global_throughput(self.train_epoch(result))
                result.train = tp
                self.epoch += 1
                scalars = {
                    "perf/train_img_s": tp.img_s,
                    "perf/compute_img_s": tp.compute_img_s,
                    "perf/step_ms": tp.step_ms,
                    "perf/data_wait_ms": tp.data_wait_ms,
                }
                if self.dist.enabled:
                    scalars["perf/train_img_s_per_gpu"] = tp.img_s / self.dist.world_size
                if cfg.perf.single_gpu_img_s:
                    scalars["perf/scaling_efficiency"] = tp.img_s / (self.dist.world_size * cfg.perf.single_gpu_img_s)
                if self.device.type == "cuda":
                    scalars["sys/max_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
                self.tb.scalars(scalars, self.global_step)
                if cfg.evaluate:
                    top1, top5, n, vtp = evaluate(self.forward, self.val_loader, self.device, self.amp_dtype,
                                                  warmup_steps=min(cfg.perf.warmup_steps, max(0, len(self.val_loader) - 1)))
                    result.val_top1, result.val_top5, result.val_images, result.val_img_s = top1, top5, n, vtp.img_s
                    self.tb.scalars({"val/top1": top1, "val/top5": top5, "perf/val_img_s": vtp.img_s}, self.global_step)
                    if self.dist.is_main:
                        log.info("epoch %d: val top1 %.2f%% top5 %.2f%% over %d images", self.epoch, top1, top5, n)
                if cfg.save_checkpoints:
                    if self.dist.is_main:
                        save_checkpoint(self.checkpoint_path, self._state())
                    distributed.barrier(self.dist)  # no rank runs ahead of a checkpoint it may be asked to resume
        except KeyboardInterrupt:
            log.warning("interrupted: the last complete checkpoint (%s) is intact", self.checkpoint_path)
            raise
        finally:
            self.tb.writer and self.tb.writer.flush()
        result.epochs_done = self.epoch
        result.global_step = self.global_step
        self._finish(result)
        return result

    def summary_rows(self, result: RunResult) -> dict[str, Any]:
        cfg, tp = self.cfg, result.train
        rows = config_rows(cfg, self.device, self.env, self.backend_label)
        rows["CUDA graph"] = self.cuda_graph_state
        rows["CUDA stream"] = self.stream_state
        rows["CUDA work queues"] = self.queues_state
        if self.dist.enabled:
            rows["ranks"] = self.dist.world_size
        if tp is not None:
            if self.dist.enabled:
                rows["train img/s per rank (GPU)"] = tp.img_s / self.dist.world_size
            if cfg.perf.single_gpu_img_s:
                rows["scaling efficiency"] = tp.img_s / (self.dist.world_size * cfg.perf.single_gpu_img_s)
            rows.update({
                "train img/s (total)": tp.img_s,
                "train img/s (compute)": tp.compute_img_s,
                "step ms": tp.step_ms,
                "data wait ms/step": tp.data_wait_ms,
                "timed steps": tp.steps,
            })
        if cfg.evaluate:
            rows.update({"val top-1 %": result.val_top1, "val top-5 %": result.val_top5, "val images": result.val_images,
                         "val img/s": result.val_img_s})
        return rows

    def _finish(self, result: RunResult) -> None:
        cfg = self.cfg
        if not self.dist.is_main:
            return
        md = print_summary(f"run {self.overrides or 'default'}", self.summary_rows(result))
        self.tb.text("summary", md)
        hparams = {
            "backend": self.backend_label, "amp": cfg.amp, "amp_dtype": enum_value(cfg.amp_dtype), "channels_last": cfg.channels_last,
            "data": cfg.data.name, "batch_size": cfg.data.batch_size, "resolution": cfg.data.resolution, "compile": cfg.compile,
            "cuda_graph": self.graphed is not None, **streams.hparams(self.stream, self.device),
            "max_connections": streams.connections_in_force() if self.device.type == "cuda" else 0,
            "gpu": self.env.get("gpu", "none"), "torch": self.env["torch"],
            "cudnn": self.env["cudnn"], "world_size": self.dist.world_size,
        }
        metrics = {"hparam/train_img_s": result.train.img_s if result.train else float("nan"),
                   "hparam/val_top1": result.val_top1}
        self.tb.scalars({f"perf/{k}": v for k, v in self.extra_metrics.items()}, self.global_step)
        metrics.update({f"hparam/{k}": v for k, v in self.extra_metrics.items()})
        self.tb.hparams(hparams, metrics)
        self.tb.close()


# What a run directory holds before its first step: Hydra's config copy and log, an empty TensorBoard file.
_SET_UP_ENTRIES = (".hydra", "*.log", "events.out.tfevents.*")


def discard_run_dir(run_dir: str | os.PathLike) -> bool:
    """Remove a run directory that holds only what set-up wrote (a run that died before its first step leaves no
    trace); a directory holding anything else is kept. Returns whether it was removed."""
    path = Path(run_dir)
    if not path.is_dir():
        return False
    entries = list(path.iterdir())
    if any(not any(e.match(pattern) for pattern in _SET_UP_ENTRIES) for e in entries):
        return False
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):  # the run name's directory, when this run was its only one
        path.parent.rmdir()
    return not path.exists()


def _cycle(loader):
    while True:
        yield from loader


def run_meta(cfg, env: dict, mode: str) -> dict[str, Any]:
    """The facts of a run that reports and traces carry."""
    return {
        **env, "mode": mode, "backend": cfg.backend.name, "norm": cfg.norm.name, "fold_bn": cfg.fold_bn,
        "precision": precision_label(cfg),
        "memory_format": layout_label(cfg),
        "batch_size": cfg.data.batch_size, "resolution": cfg.data.resolution, "compile": cfg.compile,
        "data": cfg.data.name,
        # the profiler's "streams share hardware work queues" finding compares it with the streams in the trace
        **({"cuda_work_queues": streams.connections_in_force()} if env.get("gpu", "none") != "none" else {}),
    }


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, mininterval=1.0, dynamic_ncols=True, leave=False)
