"""What a run was and what it measured, described once: the summary table, the TensorBoard hparams and scalars,
and the metadata that profiles and reports carry all read from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import kernels

from . import streams
from .config import enum_value
from .data import data_label
from .distributed import DistInfo
from .machine_load import sampling_wanted
from .meter import Throughput
from .model import apply_in_depthwise_state, apply_in_pointwise_state
from .norm import (DEFAULT_DEPTHWISE_BACKWARD, NEXT_NORM_MODES, depthwise_backward_mode, norm_input_grad_mode,
                   running_update_label)
from .profiling.trace import UNPROFILED


def precision_label(cfg) -> str:
    return f"amp {enum_value(cfg.amp_dtype)}" if cfg.amp else "fp32"


def norm_label(cfg, training: bool = True) -> str:
    """The summary's norm row. The fusions with the depthwise conv are training's (eval mode runs the modules as they
    are), so an inference summary names the implementation alone."""
    label = cfg.norm.name
    if not training:
        return label
    if getattr(cfg.norm, "stats_from_depthwise", False):
        label += " (statistics from the depthwise kernel)"
    if cfg.norm.name == "custom":
        applied, why = apply_in_depthwise_state(cfg)
        label += f" (applied by the depthwise kernel after it, in training; {why})" if applied else f" ({why})"
        mode = depthwise_backward_mode()
        pointwise, pointwise_why = apply_in_pointwise_state(cfg)
        if applied:
            named = mode != DEFAULT_DEPTHWISE_BACKWARD
            detail = ""
            if mode in NEXT_NORM_MODES:
                detail = "the BatchNorm+ReLU after it has its input gradient applied by the depthwise backward kernel"
                if mode == "next_norm_ring":
                    detail += " where that kernel runs from the rings of rows (MDW_BWD_RING_NORM: 16-bit by default)"
            if named:
                label += f" (backward: MBN_DEPTHWISE_BACKWARD={mode}" + (f": {detail}" if detail else "") + ")"
            elif detail:
                label += f" (backward: {detail})"
            if norm_input_grad_mode() == "dgrad":
                label += (" (MBN_NORM_INPUT_GRAD=dgrad: where the depthwise backward does not apply the next "
                          "BatchNorm, this BatchNorm's input gradient is computed by the input-gradient kernel)")
        applied, why = pointwise, pointwise_why
        if applied and cfg.norm.stats_from_pointwise:
            why += ("; the BatchNorm after that conv takes its statistics from cuDNN's sums, "
                    "norm.stats_from_pointwise=true: not bitwise repeatable")
        label += (f" (applied by cuDNN's fused pointwise conv after it, in training; {why})" if applied
                  else f" ({why})")
    return label


def stem_weight_grad_label(cfg) -> str:
    """The summary's "stem weight gradient" row: who computed it in training."""
    name = enum_value(getattr(cfg.model, "stem_weight_grad", "cudnn"))
    return "custom (kernels/csrc/stem_weight_grad.cu)" if name == "custom" else name


def layout_label(cfg) -> str:
    return "channels_last" if cfg.channels_last else "NCHW"


def config_rows(cfg, device: torch.device, env: dict, backend: str | None = None,
                training: bool = True) -> dict[str, Any]:
    """What a summary table says about the combination that ran (training and inference alike)."""
    return {
        "backend": backend or cfg.backend.name,
        "norm": norm_label(cfg, training),
        "precision": precision_label(cfg),
        "memory format": layout_label(cfg),
        "compile": cfg.compile,
        "data": data_label(cfg.data),
        "batch size": cfg.data.batch_size,
        "resolution": cfg.data.resolution,
        "device": env.get("gpu") if device.type == "cuda" else "cpu",
        "torch / CUDA / cuDNN": f"{env['torch']} / {env['cuda']} / {env['cudnn']}",
        "source tree": env.get("tree", "unknown"),
        # training only: inference computes no weight gradient
        **({"stem weight gradient": stem_weight_grad_label(cfg)} if training else {}),
        # a prebuilt library (MOBILENET_KERNELS_PREBUILT) is named, so a run never hides which binary it ran
        **({"custom kernels": origin} if (origin := kernels.loaded_from()) else {}),
    }


def run_meta(cfg, env: dict, mode: str, unprofiled: str | None = None) -> dict[str, Any]:
    """The facts of a run that reports and traces carry; `unprofiled`, for a profile, how the run launches its
    kernels when it is not profiled (one of profiling.trace's UNPROFILED_* values)."""
    return {
        # norm as the summary names it: a training profile says whether the depthwise kernels applied the BatchNorm
        **env, "mode": mode, "backend": cfg.backend.name, "norm": norm_label(cfg, training=mode == "train"),
        "fold_bn": cfg.fold_bn,
        "precision": precision_label(cfg),
        "memory_format": layout_label(cfg),
        "batch_size": cfg.data.batch_size, "resolution": cfg.data.resolution, "compile": cfg.compile,
        "data": cfg.data.name,
        # the profiler's "streams share hardware work queues" finding compares it with the streams in the trace
        **({"cuda_work_queues": streams.connections_in_force()} if env.get("gpu", "none") != "none" else {}),
        **({UNPROFILED: unprofiled} if unprofiled is not None else {}),
    }


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


@dataclass(frozen=True)
class TrainingRun:
    """The settings a training run ran with, as it resolved them."""
    cfg: Any
    device: torch.device
    env: dict
    dist: DistInfo
    backend_label: str
    cuda_graph_state: str
    stream_state: str
    queues_state: str
    captured: bool  # whether the training step runs as a CUDA graph
    stream: torch.cuda.Stream | None
    sync_bn_state: str = "off"  # "on (the converted BatchNorm classes; ...)" under sync_bn=true
    weight_cast_state: str = ""  # how amp=true cast the weights (mobilenet/amp_weights.py plan)

    def scaling(self, tp: Throughput) -> tuple[float | None, float | None]:
        """(img/s per rank when data-parallel, efficiency against perf.single_gpu_img_s when given), else None."""
        per_rank = tp.img_s / self.dist.world_size if self.dist.enabled else None
        single = self.cfg.perf.single_gpu_img_s
        efficiency = tp.img_s / (self.dist.world_size * single) if single else None
        return per_rank, efficiency

    def epoch_scalars(self, tp: Throughput) -> dict[str, float]:
        """The TensorBoard scalars logged after each epoch."""
        scalars = {
            "perf/train_img_s": tp.img_s,
            "perf/compute_img_s": tp.compute_img_s,
            "perf/step_ms": tp.step_ms,
            "perf/data_wait_ms": tp.data_wait_ms,
        }
        per_rank, efficiency = self.scaling(tp)
        if per_rank is not None:
            scalars["perf/train_img_s_per_gpu"] = per_rank
        if efficiency is not None:
            scalars["perf/scaling_efficiency"] = efficiency
        if tp.machine_load is not None:
            scalars.update(tp.machine_load.scalars())
        if self.device.type == "cuda":
            scalars["sys/max_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return scalars

    def summary_rows(self, result: RunResult) -> dict[str, Any]:
        """The run's summary table: the combination, how it ran, and what it measured."""
        rows = config_rows(self.cfg, self.device, self.env, self.backend_label)
        rows["CUDA graph"] = self.cuda_graph_state
        rows["CUDA stream"] = self.stream_state
        rows["CUDA work queues"] = self.queues_state
        update = running_update_label(self.cfg, self.dist.enabled)
        if update is not None:
            rows["running statistics update"] = update
        if self.cfg.amp:
            rows["weight casts"] = self.weight_cast_state
        if self.dist.enabled:
            rows["ranks"] = self.dist.world_size
            rows["sync_bn"] = self.sync_bn_state
        if result.train is not None:
            rows.update(self._throughput_rows(result.train))
        rows["machine load"] = sampling_wanted(self.cfg)[1]
        if result.train is not None and result.train.machine_load is not None:
            rows.update(result.train.machine_load.rows())
        if self.cfg.evaluate:
            rows.update({"val top-1 %": result.val_top1, "val top-5 %": result.val_top5, "val images": result.val_images,
                         "val img/s": result.val_img_s})
        return rows

    def _throughput_rows(self, tp: Throughput) -> dict[str, Any]:
        rows: dict[str, Any] = {}
        per_rank, efficiency = self.scaling(tp)
        if per_rank is not None:
            rows["train img/s per rank (GPU)"] = per_rank
        if efficiency is not None:
            rows["scaling efficiency"] = efficiency
        rows.update({
            "train img/s (total)": tp.img_s,
            "train img/s (compute)": tp.compute_img_s,
            "step ms": tp.step_ms,
            "data wait ms/step": tp.data_wait_ms,
            "timed steps": tp.steps,
        })
        return rows

    def hparams(self) -> dict[str, Any]:
        """The TensorBoard hparams: what scripts/compare.py groups and labels runs by."""
        cfg = self.cfg
        return {
            "backend": self.backend_label, "norm": cfg.norm.name, "amp": cfg.amp, "amp_dtype": enum_value(cfg.amp_dtype), "channels_last": cfg.channels_last,
            "data": cfg.data.name, "batch_size": cfg.data.batch_size, "resolution": cfg.data.resolution, "compile": cfg.compile,
            "cuda_graph": self.captured, **streams.hparams(self.stream, self.device),
            "max_connections": streams.connections_in_force() if self.device.type == "cuda" else 0,
            "gpu": self.env.get("gpu", "none"), "torch": self.env["torch"],
            "cudnn": self.env["cudnn"], "world_size": self.dist.world_size,
        }
