"""`cuda_graph=false|true|auto`: the whole training step (forward, loss, backward, GradScaler, optimizer) captured
once as a CUDA graph and replayed, one graph launch per step instead of ~330 kernel launches.

Why: at batch 256 on an H200, MobileNetV1's kernels take about as long as the host needs to launch them, so the
eager loop is close to host-bound, and on a slow host day every microsecond added per launch shows in img/s (the
fused norm's Python autograd functions; DALI's decoder threads sharing the CUDA context). Measured gain on a day
the host kept up: 1-2% (docs/results/cuda_graph_h200.md); DALI-fed, with 32 hardware work queues, about 5%
(docs/results/loader_h200.md), and a loss with CUDA's default 8. With today's kernels (norm=custom) the eager step
is host-bound outright: 10.4 ms a step captured against about 21 ms eager under DDP on two H200s, where capture took
the scaling efficiency from 0.476 to 0.948 (docs/results/ddp_capture_2xh200.md).

What a captured step needs, and how it is met here:
- fixed input buffers: each batch is copied into the captured step's own input tensors (one device copy);
- a learning rate the schedule can still change: the optimizer's `lr` becomes a device tensor, which the
  LR scheduler fills in place every step (torch's fused SGD reads it on the device, no host read);
- no host syncs or lazy set-up inside the capture: the first `warmup_steps` run eagerly on a side stream, as
  torch's whole-network capture recipe does (cuDNN autotuning, GradScaler and optimizer state happen there).
- under DDP (torchrun), the gradient all-reduce is captured with the rest (NCCL collectives can be): DDP is built
  on the capture's side stream, since the gradient accumulators it keeps remember the stream they were made on,
  and a backward captured on another stream would wait on that one; and at least DDP_WARMUP_STEPS steps run eager
  first, torch's recipe for DDP (DDP rebuilds its gradient buckets after its first iteration and samples its
  runtime statistics at its tenth). sync_bn's statistics all-reduces are captured too (both norms' are sync-free).
Every step, eager or replayed, is a real training step: nothing is run twice.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import Tensor

from . import streams
from .config import enum_value
from .errors import ConfigError

MODES = ("auto", "true", "false")
# torch's CUDA-graph notes: DDP needs this many eager iterations before its backward can be captured.
DDP_WARMUP_STEPS = 11
# Every CapturedStep alive, so that a process can release their graphs before it destroys its process group.
_LIVE: weakref.WeakSet = weakref.WeakSet()


def parse_mode(value) -> str:
    """The config value as one of MODES (Hydra hands `cuda_graph=true` over as a bool)."""
    mode = str(value).lower()
    if mode not in MODES:
        raise ConfigError(f"cuda_graph={value!r} is not a choice; choose one of: {', '.join(MODES)}")
    return mode


def blockers(cfg, device: torch.device, profiling: bool | None = None) -> list[str]:
    """Why this run's training step cannot be captured; empty when it can. `profiling` (default: cfg.profile) says
    whether the run traces its steps with the profiler."""
    out = []
    if device.type != "cuda":
        out.append(f"the run's device is {device.type} (CUDA graphs need a GPU)")
    if cfg.compile:
        out.append("compile=true: Inductor launches the compiled kernels (its mode='reduce-overhead' is where capture "
                   "belongs), and the two are not combined here")
    if cfg.profile if profiling is None else profiling:
        out.append("profile=true traces eager steps, so that every kernel is attributed to the op that launched it")
    name, impl = enum_value(cfg.optim.name), enum_value(cfg.optim.impl)
    if (name, impl) != ("sgd", "fused"):
        out.append(f"optim={name} with optim.impl={impl}: only torch's fused SGD reads a learning rate held on the device "
                   "(others read it on the host every step, which a captured step would freeze at its first value)")
    return out


def measured_slower(cfg) -> list[str]:
    """Runs that can be captured but were measured slower captured; `auto` leaves them eager, `true` captures them."""
    queues = streams.connections_in_force()
    if cfg.data.name == "dali" and queues < streams.MAX_CONNECTIONS:
        return [f"data=dali with {queues} CUDA hardware work queues: DALI's decoder streams share queues with the "
                "replayed step and wait behind whole replays (9.6k img/s captured against 12.4k eager on the H200); "
                f"with {streams.MAX_CONNECTIONS} queues (perf.max_connections=auto's choice for data=dali) captured was "
                "the fastest, 13.8-14.1k against 13.1-13.6k eager (docs/results/loader_h200.md)"]
    return []


def resolve(cfg, device: torch.device, distributed: bool, profiling: bool | None = None) -> tuple[bool, str]:
    """(capture or not, why) for `cfg.cuda_graph`. `true` with a blocker is an error: nothing is silently left eager.
    profiling=False answers for the run as it is without the profiler (profile=true traces eager steps), which is what
    a profile's launch findings are read against."""
    mode = parse_mode(cfg.cuda_graph)
    if mode == "false":
        return False, "off (cuda_graph=false)"
    reasons = blockers(cfg, device, profiling)
    if mode == "true" and reasons:
        raise ValueError("cuda_graph=true, but this run's training step cannot be captured: " + "; ".join(reasons)
                         + ". Use cuda_graph=auto (captures where it can, and says so) or cuda_graph=false")
    reasons = reasons if mode == "true" else reasons + measured_slower(cfg)
    if reasons:
        return False, "off (cuda_graph=auto: " + "; ".join(reasons) + ")"
    if distributed:
        return True, f"on (cuda_graph={mode}; DDP's gradient all-reduce captured with the step)"
    return True, f"on (cuda_graph={mode})"


def lr_to_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Hold each group's learning rate as a 0-d fp32 device tensor. LR schedulers then fill it in place
    (torch.optim.lr_scheduler._update_param_group_val), so a captured optimizer step sees the schedule."""
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)


def host_lrs(state_dict: dict) -> dict:
    """An optimizer state_dict with learning rates as Python floats (a checkpoint stays loadable by eager runs)."""
    for group in state_dict.get("param_groups", []):
        for key in ("lr", "initial_lr"):
            if isinstance(group.get(key), Tensor):
                group[key] = float(group[key])
    return state_dict


class CapturedStep:
    """Wraps `step(images, labels) -> loss`: `warmup_steps` eager calls on a side stream, then one capture, then a
    replay per call. The returned loss is the graph's own output tensor, overwritten by the next replay: read it
    (or copy it) on the current stream before that, as the training loop's loss read-back does."""

    def __init__(self, step: Callable[[Tensor, Tensor], Tensor], optimizer: torch.optim.Optimizer, device: torch.device,
                 warmup_steps: int = 3, stream: torch.cuda.Stream | None = None):
        """`stream`: the side stream to warm up and capture on (a new one when None); a DDP model must have been
        wrapped on it."""
        if warmup_steps < 1:
            raise ValueError(f"CapturedStep needs at least 1 eager warm-up step before capture, got {warmup_steps}")
        self.step = step
        self.optimizer = optimizer
        self.device = device
        self.warmup_steps = warmup_steps
        self.eager_steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_images: Tensor | None = None
        self.static_labels: Tensor | None = None
        self.static_loss: Tensor | None = None
        self._side = stream if stream is not None else torch.cuda.Stream(device)
        lr_to_device(optimizer, device)
        self._lrs = [group["lr"] for group in optimizer.param_groups]
        self.released = False
        _LIVE.add(self)

    def __call__(self, images: Tensor, labels: Tensor) -> Tensor:
        self._check_lrs()
        if self.released:
            raise RuntimeError("cuda_graph: this captured step was released (its process group is being destroyed); "
                               "build a new Trainer to train again")
        if self.graph is None:
            if self.eager_steps < self.warmup_steps:
                return self._eager(images, labels)
            self._capture(images, labels)
        else:
            self._load(images, labels)
        self.graph.replay()
        return self.static_loss

    def release(self) -> None:
        """Free the graph. A graph that captured NCCL collectives holds a reference on their communicator, and
        destroying the process group waits for it forever (NCCL's commDestroy waits until no graph holds one)."""
        if self.graph is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            torch.cuda.synchronize(self.device)
            self.graph.reset()
            self.graph = None
        self.released = True

    def _eager(self, images: Tensor, labels: Tensor) -> Tensor:
        with streams.issued_on(self._side):
            loss = self.step(images, labels)
        self.eager_steps += 1
        return loss

    def _capture(self, images: Tensor, labels: Tensor) -> None:
        # clone() keeps the memory format: a channels_last batch gets a channels_last input buffer.
        self.static_images, self.static_labels = images.clone(), labels.clone()
        # Gradients are allocated by the captured backward, from the graph's memory pool (torch's recipe).
        self.optimizer.zero_grad()  # set_to_none, torch's default; apex's optimizers are built to match
        graph = torch.cuda.CUDAGraph()
        # thread_local: DALI's worker threads keep making their own (synchronising) CUDA calls during the capture.
        with torch.cuda.graph(graph, stream=self._side, capture_error_mode="thread_local"):
            self.static_loss = self.step(self.static_images, self.static_labels)
        self.graph = graph

    def _load(self, images: Tensor, labels: Tensor) -> None:
        for name, new, static in (("images", images, self.static_images), ("labels", labels, self.static_labels)):
            same = (new.shape, new.dtype, new.stride(), new.device) == (static.shape, static.dtype, static.stride(), static.device)
            if not same:
                raise ValueError(
                    f"cuda_graph: the training step was captured for {name} of shape {tuple(static.shape)}, {static.dtype}, "
                    f"strides {static.stride()} on {static.device}, and got {tuple(new.shape)}, {new.dtype}, strides "
                    f"{new.stride()} on {new.device}. A captured step needs every batch alike (the loaders drop the "
                    "last partial training batch); run with cuda_graph=false for varying batches")
            if new.data_ptr() != static.data_ptr():
                static.copy_(new, non_blocking=True)

    def _check_lrs(self) -> None:
        # A scheduler or a load_state_dict that *replaces* the lr tensor would leave the graph reading a stale one.
        for group, lr in zip(self.optimizer.param_groups, self._lrs):
            if group["lr"] is not lr:
                raise RuntimeError("cuda_graph: an optimizer learning rate was replaced instead of filled in place; "
                                   "the captured step would keep using the old value")


def release_captured_steps() -> None:
    """Release every live captured step's graph (before a process group is destroyed: CapturedStep.release)."""
    for step in list(_LIVE):
        step.release()


def captured_step(step: Callable[[Tensor, Tensor], Tensor], optimizer: torch.optim.Optimizer,
                  stream: torch.cuda.Stream | None, distributed: bool) -> CapturedStep | None:
    """A training run's captured step on `stream` (the one its DDP model was wrapped on); None for an eager run."""
    if stream is None:
        return None
    return CapturedStep(step, optimizer, stream.device, warmup_steps=DDP_WARMUP_STEPS if distributed else 3,
                        stream=stream)


# --- inference: the whole forward replayed --------------------------------------------------------------------


def resolve_inference(cfg, device: torch.device, profiling: bool = False) -> tuple[bool, str]:
    """(replay the forward or not, why) for `cuda_graph` in infer.py; `true` with a blocker is an error."""
    mode = parse_mode(cfg.cuda_graph)
    if mode == "false":
        return False, "off (cuda_graph=false)"
    reasons = []
    if device.type != "cuda":
        reasons.append(f"the run's device is {device.type} (CUDA graphs need a GPU)")
    if profiling:
        reasons.append("--profile traces eager passes, so that every kernel is attributed to the op that launched it")
    if mode == "true" and reasons:
        raise ConfigError("cuda_graph=true, but this inference run cannot be replayed: " + "; ".join(reasons)
                         + ". Use cuda_graph=auto (replays where it can, and says so) or cuda_graph=false")
    if reasons:
        return False, "off (cuda_graph=auto: " + "; ".join(reasons) + ")"
    return True, f"on (cuda_graph={mode}: one graph per input shape, replayed)"


class ReplayedForward(torch.nn.Module):
    """`forward(x)` captured as one CUDA graph per input shape, dtype and strides, then replayed: one launch per
    batch instead of one per kernel, which at MobileNetV1's size is the difference between host-bound and not.

    Each call copies x into the graph's input buffer (a device copy, part of the measured time) and returns the
    graph's own output tensor, which the next call with the same shape overwrites: consume it (or clone it) first.
    All graphs share one memory pool, so a partial last batch costs a second graph but little memory."""

    def __init__(self, forward: torch.nn.Module, device: torch.device, warmup_calls: int = 2):
        super().__init__()
        self.inner = forward
        self.device = device
        self.warmup_calls = warmup_calls
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Tensor, Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def forward(self, x: Tensor) -> Tensor:
        key = (tuple(x.shape), x.dtype, x.stride(), x.device)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(x)
        graph, static_in, static_out = entry
        static_in.copy_(x)
        graph.replay()
        return static_out

    def _capture(self, x: Tensor) -> tuple[torch.cuda.CUDAGraph, Tensor, Tensor]:
        static_in = x.clone()  # keeps x's memory format
        # Warm-up on a side stream, as torch's capture recipe does: cuDNN autotuning, cuBLAS handles, lazy module
        # set-up and (compile=true) compilation all happen before the capture, never inside it.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_calls):
                self.inner(static_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_out = self.inner(static_in)
        return graph, static_in, static_out
