"""The one training loop, shared by every backend x precision x layout x loader combination.

The collaborators it runs with come from small modules: optim (optimizer and schedule), checkpoint (save and exact
resume), evaluation (accuracy), run_record (what the run was and measured). Their public names are importable from
here as well, so that a caller needs one import for a run."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import amp_weights, cuda_graph, distributed, machine_load, streams
from .checkpoint import CHECKPOINT_IN_RUN_DIR, load_checkpoint, restore_training_state, save_checkpoint, training_state
from .config import enum_value, unused_settings
from .data import LoaderSpec, build_loaders
from .depthwise import get_backend
from .errors import ConfigError, checking_user_input
from .evaluation import evaluate
from .meter import StepMeter, Throughput
from .model import apply_in_depthwise_state, apply_in_pointwise_state, build_model, stem_weight_grad_needs
from .norm import check_ab_environment, convert_sync_batchnorm, custom_pair_needs, get_norm, sync_bn_state
from .optim import build_optimizer, build_scheduler, scheduled_lrs
from .reporting import TensorBoardLog, environment, print_summary
from .run_record import RunResult, TrainingRun, run_meta

# The collaborators' public names, for callers that import everything about a run from here.
from .checkpoint import (CHECKPOINT_VERSION, WEIGHT_SHAPING_KEYS, CheckpointError, checkpoint_file,  # noqa: F401, E402
                         config_mismatch, restore_rng_states)
from .optim import APEX_HINT, param_groups, warmup_cosine  # noqa: F401, E402
from .run_record import config_rows, layout_label, precision_label  # noqa: F401, E402

log = logging.getLogger(__name__)

AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


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


def run_dtype(cfg) -> torch.dtype:
    """The dtype batches are delivered in: the autocast dtype under AMP, else fp32."""
    return autocast_dtype(cfg) or torch.float32


def validate(cfg, device: torch.device, job: str = "train") -> None:
    """Reject combinations that cannot run as asked, before any work is done. Nothing is substituted. `job` ("train"
    or "infer") decides which settings the run reads (warn_unused_settings)."""
    check_ab_environment(cfg)
    with checking_user_input(ValueError):  # an unknown backend name
        backend = get_backend(cfg.backend.name)
    backend.check(device)  # first: a GPU-only backend on a CPU is the root cause to report
    get_norm(cfg.norm.name).check(device)
    machine_load.sampling_wanted(cfg)  # a perf.sample_load that is not a choice
    _check_stats_from_depthwise(cfg)
    _check_apply_in_depthwise(cfg)
    _check_stats_from_pointwise(cfg)
    _check_stem_weight_grad(cfg, device)
    if cfg.amp and enum_value(cfg.amp_dtype) == "fp16" and device.type != "cuda":
        raise ConfigError("amp=true with amp_dtype=fp16 needs a CUDA GPU (CPU autocast runs bf16 only); "
                          "use amp_dtype=bf16 on a CPU, or run on a GPU")
    if cfg.amp and enum_value(cfg.amp_dtype) == "bf16" and device.type == "cpu":
        warn_once("bf16_cpu", "amp=true amp_dtype=bf16 on a CPU: most CPUs have no fast bf16 arithmetic, and such a run "
                  "can be tens of times slower than fp32 (amp=false); use it to check the code path, not for speed")
    if not cfg.amp and enum_value(cfg.amp_dtype) == "bf16":  # fp16 is the default: only bf16 can have been asked for
        warn_once("amp_dtype_without_amp", "amp_dtype=bf16 takes effect with amp=true; this run has amp=false and "
                  "computes in fp32 (its summary says so): add amp=true for bf16 autocast")
    warn_unused_settings(cfg, job)


def warn_unused_settings(cfg, job: str) -> None:
    """Warn about each setting the run was given but does not read (config.unused_settings): it passes the schema,
    so without a word a user would believe it took effect."""
    for line in unused_settings(cfg, job):
        warn_once(f"unused:{line}", line)


def _check_stats_from_depthwise(cfg) -> None:
    """norm.stats_from_depthwise=true runs only where every depthwise + BatchNorm pair can take the fused path."""
    if not cfg.norm.stats_from_depthwise:
        return
    _refuse_unless("norm.stats_from_depthwise", [
        *custom_pair_needs(cfg), (bool(cfg.channels_last), "channels_last=true (the statistics walk is NHWC)"),
        (not cfg.sync_bn, "sync_bn=false (the depthwise kernel's statistics are this rank's only)")])


def _check_stats_from_pointwise(cfg) -> None:
    """norm.stats_from_pointwise=true takes its sums from the fused pointwise convs: only where those run."""
    if not cfg.norm.stats_from_pointwise:
        return
    on, why = apply_in_pointwise_state(cfg)
    _refuse_unless("norm.stats_from_pointwise", [(on, f"norm.apply_in_pointwise on, whose fused convolutions compute "
                                                      f"the sums (this run: {why})")])


def _check_stem_weight_grad(cfg, device: torch.device) -> None:
    """model.stem_weight_grad=custom runs only where its kernel takes the stem as this run feeds it."""
    if enum_value(cfg.model.stem_weight_grad) != "custom":
        return
    dtype = autocast_dtype(cfg) or torch.float32
    _refuse_unless("model.stem_weight_grad", stem_weight_grad_needs(cfg, device, dtype), on="custom", off="cudnn")


def _refuse_unless(switch: str, needs: list[tuple[bool, str]], on: str = "true", off: str = "false") -> None:
    """ConfigError naming every (condition, what it needs) of `needs` that does not hold for `switch`=`on`."""
    missing = [what for ok, what in needs if not ok]
    if missing:
        raise ConfigError(f"{switch}={on} needs {', '.join(missing)}; or set {switch}={off}")


def _check_apply_in_depthwise(cfg) -> None:
    """norm.apply_in_depthwise=true runs only where every BatchNorm before a depthwise conv can be applied by it, and
    norm.apply_in_pointwise=true only where every one before a pointwise conv can be applied by cuDNN."""
    apply_in_depthwise_state(cfg)  # raises ConfigError for true with a blocker, or a value that is not a choice
    apply_in_pointwise_state(cfg)


def _check_process_layout(cfg, dist: distributed.DistInfo, device: torch.device) -> None:
    """Settings that need, or cannot have, several processes."""
    if cfg.sync_bn and not dist.enabled:
        raise ConfigError("sync_bn=true needs a process group, and this run is a single process: "
                          "launch with `torchrun --nproc_per_node=N train.py ... sync_bn=true`")
    if cfg.sync_bn and device.type != "cuda":
        # nn.SyncBatchNorm refuses CPU tensors only at its first forward, with a traceback.
        raise ConfigError(f"sync_bn=true synchronises BatchNorm over CUDA tensors, and this run's device is "
                          f"{device.type!r}: run on GPUs, or leave sync_bn=false (each rank then normalises its own batch)")
    if cfg.profile and dist.enabled:
        raise ConfigError("profile=true traces one process: run it without torchrun")


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
            model = build_model(cfg.model.name, num_classes, cfg.model.width_mult, cfg.backend.name, cfg.model.dropout,
                                norm=cfg.norm.name, stats_from_depthwise=cfg.norm.stats_from_depthwise,
                                apply_norm_in_depthwise=apply_in_depthwise_state(cfg)[0],
                                apply_norm_in_pointwise=apply_in_pointwise_state(cfg)[0],
                                stats_from_pointwise=cfg.norm.stats_from_pointwise,
                                stem_weight_grad=enum_value(cfg.model.stem_weight_grad))
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def _forward_for_run(model: nn.Module, cfg, device: torch.device, dist: distributed.DistInfo,
                     capture_stream: torch.cuda.Stream | None) -> tuple[nn.Module, str]:
    """What a training step calls: the model, its weights cast as one buffer (perf.amp_weight_cast), wrapped for data
    parallelism (on `capture_stream` where the step is captured: cuda_graph.py says why) and compiled as
    configured; and how the weights are cast, for the summary."""
    with checking_user_input(ValueError):  # perf.amp_weight_cast=true where it cannot run
        cast_weights, cast_state = amp_weights.plan(cfg, dist.enabled, model)
    wrapped = model
    if cast_weights:
        wrapped = amp_weights.WeightCastForward(model, autocast_dtype(cfg))
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel

        with streams.issued_on(capture_stream):
            wrapped = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                              gradient_as_bucket_view=True)
    return (torch.compile(wrapped) if cfg.compile else wrapped), cast_state


def _steps_per_epoch(cfg, train_loader) -> int:
    steps = len(train_loader)
    if cfg.data.steps_per_epoch is not None:  # the folder loader's cap (DALI and synthetic size themselves)
        steps = min(steps, cfg.data.steps_per_epoch)
    if steps < 1:
        raise ConfigError("the training loader yields no full batch; lower data.batch_size")
    return steps


def untimed_steps(cfg, graphed: cuda_graph.CapturedStep | None) -> int:
    """perf.warmup_steps, and with a captured step at least its eager steps and the capture: the capture
    synchronises and records ~330 launches once, which is set-up, not a step's speed."""
    if graphed is None:
        return cfg.perf.warmup_steps
    return max(cfg.perf.warmup_steps, graphed.warmup_steps + 1)


def epoch_meter(cfg, device: torch.device, warmup_steps: int) -> StepMeter:
    """One epoch's meter; where perf.sample_load asks, it samples the machine over the epoch's timed steps."""
    return StepMeter(device, warmup_steps, machine_load.sampler_for(cfg, device))


def check_steps_to_time(cfg, epoch: int, steps_per_epoch: int, graphed: cuda_graph.CapturedStep | None) -> None:
    """Refuse a run whose reported throughput could only be nan: the summary reports the last epoch, and the
    first epoch of a run leaves its first untimed_steps() steps untimed."""
    remaining = cfg.epochs - epoch
    if cfg.epochs < 1:
        raise ConfigError(f"epochs={cfg.epochs}: a run needs at least one epoch")
    if remaining < 1:
        raise ConfigError(f"resume={cfg.resume!r} has already run {epoch} epoch(s) and this run asks for "
                          f"epochs={cfg.epochs}: nothing left to train; raise epochs")
    if remaining == 1 and steps_per_epoch <= untimed_steps(cfg, graphed):
        graph = " (and the CUDA graph's eager steps and capture)" if graphed is not None else ""
        raise ConfigError(
            f"only {steps_per_epoch} training step(s) would run, all of them warm-up (perf.warmup_steps="
            f"{cfg.perf.warmup_steps}{graph}): no step would be timed and throughput would be nan; lower "
            f"perf.warmup_steps below {steps_per_epoch}, or run more steps (data.steps_per_epoch, epochs)")


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


def _synchronise_batchnorm(model: nn.Module, cfg, world_size: int) -> tuple[nn.Module, str]:
    """sync_bn=true: every BatchNorm+ReLU in its synchronised form (each fused ReLU kept), and the summary's line."""
    if not cfg.sync_bn:
        return model, "off"
    model = convert_sync_batchnorm(model)
    return model, sync_bn_state(model, world_size)


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
        _check_process_layout(cfg, self.dist, self.device)
        seed_everything(cfg.seed)
        torch.backends.cudnn.benchmark = True
        self.amp_dtype = autocast_dtype(cfg)
        spec = LoaderSpec(self.device, run_dtype(cfg), cfg.channels_last, self.dist.rank, self.dist.world_size, seed=cfg.seed)
        with checking_user_input(ValueError, FileNotFoundError, ImportError):  # the data config or the files
            self.train_loader, self.val_loader = build_loaders(cfg.data, spec)
        self.steps_per_epoch = _steps_per_epoch(cfg, self.train_loader)
        self.model = build_for_run(cfg, self.device, self.train_loader.num_classes, model)
        self.model, self.sync_bn_state = _synchronise_batchnorm(self.model, cfg, self.dist.world_size)
        self.backend_label = backend_label or cfg.backend.name
        capture_stream = torch.cuda.Stream(self.device) if use_graph else None  # None: an eager run
        self.forward, self.weight_cast_state = _forward_for_run(self.model, cfg, self.device, self.dist, capture_stream)
        self._build_optimization(cfg, capture_stream)
        self.env = environment(self.device)
        # Only rank 0 writes: one TensorBoard run and one checkpoint per training run.
        self.tb = TensorBoardLog(str(self.run_dir), enabled=self.dist.is_main)
        self.profiler = None

    def _build_optimization(self, cfg, capture_stream: torch.cuda.Stream | None) -> None:
        """Optimizer, schedule, loss scaling and loss; then the resume, and the captured step over what it restored."""
        self.optimizer = build_optimizer(cfg, self.model, cfg.data.batch_size * self.dist.world_size)
        self.scheduler = build_scheduler(cfg, self.optimizer, self.steps_per_epoch)
        # fp16 needs loss scaling to keep small gradients representable; bf16 has fp32's exponent range.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)
        self.epoch, self.global_step = 0, 0
        if cfg.resume:
            self.epoch, self.global_step = restore_training_state(
                load_checkpoint(cfg.resume), cfg, self.model, self.optimizer, self.scheduler, self.scaler,
                self.train_loader.num_classes)
        self.start_step = self.global_step
        # After the resume: the restored learning rates become the captured step's device tensors.
        self.graphed = cuda_graph.captured_step(self._step_math, self.optimizer, capture_stream, self.dist.enabled)
        if not cfg.profile:  # profile=true sizes its own windows
            check_steps_to_time(cfg, self.epoch, self.steps_per_epoch, self.graphed)

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / CHECKPOINT_IN_RUN_DIR

    def _save_checkpoint(self) -> None:
        if self.dist.is_main:
            save_checkpoint(self.checkpoint_path, training_state(
                self.cfg, self.model, self.optimizer, self.scheduler, self.scaler, self.epoch, self.global_step,
                self.train_loader))
        distributed.barrier(self.dist)  # no rank runs ahead of a checkpoint it may be asked to resume

    def run_record(self) -> TrainingRun:
        """This run's settings as resolved, for its summary, hparams and scalars."""
        return TrainingRun(self.cfg, self.device, self.env, self.dist, self.backend_label, self.cuda_graph_state,
                           self.stream_state, self.queues_state, self.graphed is not None, self.stream,
                           self.sync_bn_state, self.weight_cast_state)

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
            self.optimizer.zero_grad()  # set_to_none, torch's default; apex's optimizers are built to match
            self.scaler.scale(loss).backward()
        with self._range("optimizer"):
            self.scaler.step(self.optimizer)
            self.scaler.update()
        return loss

    def current_lr(self) -> float:
        """The learning rate of this step, computed on the host (a device-held lr would cost a sync to read)."""
        return scheduled_lrs(self.scheduler)[0]

    def train_epoch(self, result: RunResult, max_steps: int | None = None) -> Throughput:
        cfg = self.cfg
        self.model.train()
        self.train_loader.set_epoch(self.epoch)
        meter = epoch_meter(cfg, self.device, untimed_steps(cfg, self.graphed) if self.epoch == self._first_epoch else 0)
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
            _show_progress(bar, i, meter, result)
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

    def fit(self, extra_metrics: dict[str, float] | None = None) -> RunResult:
        """Train. extra_metrics: figures of this run measured outside the loop (the throughput matrix's inference
        img/s), logged as perf/ scalars and with the run's hparams."""
        with streams.issued_on(self.stream):
            return profile_training(self) if self.cfg.profile else self._fit(extra_metrics or {})

    def _fit(self, extra_metrics: dict[str, float]) -> RunResult:
        result = RunResult(run_dir=str(self.run_dir))
        self._first_epoch = self.epoch
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            while self.epoch < self.cfg.epochs:
                result.train = distributed.throughput_over_ranks(self.train_epoch(result), self.device, self.dist)
                self.epoch += 1
                self.tb.scalars(self.run_record().epoch_scalars(result.train), self.global_step)
                if self.cfg.evaluate:
                    self._evaluate(result)
                if self.cfg.save_checkpoints:
                    self._save_checkpoint()
        except KeyboardInterrupt:
            log.warning("interrupted: the last complete checkpoint (%s) is intact", self.checkpoint_path)
            raise
        finally:
            self.tb.writer and self.tb.writer.flush()
        result.epochs_done = self.epoch
        result.global_step = self.global_step
        self._finish(result, extra_metrics)
        return result

    def _evaluate(self, result: RunResult) -> None:
        warmup = min(self.cfg.perf.warmup_steps, max(0, len(self.val_loader) - 1))
        top1, top5, n, vtp = evaluate(self.forward, self.val_loader, self.device, self.amp_dtype, warmup_steps=warmup)
        result.val_top1, result.val_top5, result.val_images, result.val_img_s = top1, top5, n, vtp.img_s
        self.tb.scalars({"val/top1": top1, "val/top5": top5, "perf/val_img_s": vtp.img_s}, self.global_step)
        if self.dist.is_main:
            log.info("epoch %d: val top1 %.2f%% top5 %.2f%% over %d images", self.epoch, top1, top5, n)

    def summary_rows(self, result: RunResult) -> dict[str, Any]:
        return self.run_record().summary_rows(result)

    def _finish(self, result: RunResult, extra_metrics: dict[str, float]) -> None:
        if not self.dist.is_main:
            return
        record = self.run_record()
        self.tb.text("summary", print_summary(f"run {self.overrides or 'default'}", record.summary_rows(result)))
        metrics = {"hparam/train_img_s": result.train.img_s if result.train else float("nan"),
                   "hparam/val_top1": result.val_top1}
        self.tb.scalars({f"perf/{k}": v for k, v in extra_metrics.items()}, self.global_step)
        metrics.update({f"hparam/{k}": v for k, v in extra_metrics.items()})
        self.tb.hparams(record.hparams(), metrics)
        self.tb.close()


def profile_training(trainer: Trainer) -> RunResult:
    """profile=true: time steps without the profiler, then trace a window of steps and diagnose it."""
    from .profiling import StepProfiler
    from .profiling.trace import unprofiled_launches

    cfg, result = trainer.cfg, RunResult(run_dir=str(trainer.run_dir))
    trainer._first_epoch = trainer.epoch
    baseline = trainer.train_epoch(result, max_steps=cfg.perf.warmup_steps + cfg.profiler.baseline_steps)
    result.train = baseline
    captured = cuda_graph.resolve(cfg, trainer.device, trainer.dist.enabled, profiling=False)[0]
    unprofiled = unprofiled_launches(captured, cfg.compile)
    trainer.profiler = StepProfiler(trainer.run_dir, trainer.device, run_meta(cfg, trainer.env, "train", unprofiled),
                                    cfg.profiler, baseline_step_ms=baseline.step_ms_median)
    if trainer.device.type == "cpu":  # Kineto's own stderr line cannot be silenced from Python; say what it means
        log.info("a CPU-only trace: PyTorch's profiler (Kineto) may print 'ERROR: ... gpuGetDeviceCount failed' "
                 "as it finishes; that is its probe for a GPU finding none, and the trace is complete")
    try:
        with trainer.profiler:
            trainer.train_epoch(result, max_steps=trainer.profiler.total_steps)
        report = trainer.profiler.finish()
    finally:
        trainer.profiler = None
    trainer.tb.text("profile", report.markdown())
    trainer.tb.close()
    return result


def _show_progress(bar, step_index: int, meter: StepMeter, result: RunResult) -> None:
    """Advance the progress bar; the live img/s and loss refresh every fifth step (a postfix costs host time)."""
    if bar is None:
        return
    rate = meter.live_img_s()
    if rate is not None and step_index % 5 == 0:
        bar.set_postfix(img_s=f"{rate:,.0f}", loss=f"{result.losses[-1][1]:.3f}" if result.losses else "-", refresh=False)
    bar.update(1)


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


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, mininterval=1.0, dynamic_ncols=True, leave=False)
