"""What infer.py does: benchmark, evaluate a checkpoint, classify images, profile."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

import torch

from . import streams
from .data import LoaderSpec, build_loaders
from .data.folder import image_transforms
from .engine import autocast_dtype, build_for_run, config_rows, evaluate, load_checkpoint, resolve_device, run_dtype, validate
from .meter import StepMeter, Throughput
from .reporting import environment, print_summary


class _Setup(NamedTuple):
    device: torch.device
    model: torch.nn.Module
    forward: Callable  # the model, or its torch.compile wrapper
    amp_dtype: torch.dtype | None
    state: dict | None  # the checkpoint, when one was loaded
    queues: str  # the summary's "CUDA work queues": the count in force and why


def _setup(cfg, checkpoint: str | None, num_classes: int | None = None) -> _Setup:
    queues = streams.apply_max_connections(cfg)  # before anything creates the CUDA context
    device = resolve_device(cfg.device)
    if device.type != "cuda":
        queues = f"none ({device.type})"
    validate(cfg, device)
    torch.backends.cudnn.benchmark = True
    state = load_checkpoint(checkpoint) if checkpoint else None
    if state is not None:
        # The architecture comes from the checkpoint; the run settings (backend, amp, layout) from the command line.
        saved = state["config"]["model"]
        cfg.model.width_mult = saved["width_mult"]
        cfg.model.name = saved["name"]
        num_classes = state["num_classes"]
    model = build_for_run(cfg, device, num_classes or cfg.data.num_classes)
    if state is not None:
        model.load_state_dict(state["model"])
    model.eval()
    forward = torch.compile(model) if cfg.compile else model
    amp_dtype = autocast_dtype(cfg)
    return _Setup(device, model, forward, amp_dtype, state, queues)


def _synthetic_batch(cfg, device):
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.data.batch_size, 3, cfg.data.resolution, cfg.data.resolution, generator=gen).to(device)
    return x.to(run_dtype(cfg)).contiguous(memory_format=fmt)


def measure(forward, model: torch.nn.Module, cfg, device: torch.device, warmup: int, steps: int) -> Throughput:
    """Inference throughput of any model (this project's or a peer) on one device-resident batch."""
    amp_dtype = autocast_dtype(cfg)
    x = _synthetic_batch(cfg, device)
    was_training = model.training
    model.eval()
    meter = StepMeter(device, warmup)
    with torch.inference_mode():
        for _ in range(warmup + steps):
            meter.data_start()
            meter.compute_start()
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                forward(x)
            meter.step_end(x.shape[0])
        tp = meter.result()
    model.train(was_training)
    return tp


def benchmark(cfg, warmup: int, steps: int) -> float:
    """Inference img/s of the configured combination on a device-resident batch (no input pipeline)."""
    device, model, forward, *_ = _setup(cfg, None)
    tp = measure(forward, model, cfg, device, warmup, steps)
    rows = config_rows(cfg, device, environment(device))
    rows.update({"infer img/s": tp.img_s, "ms / batch": tp.step_ms, "timed steps": tp.steps, "warm-up steps": warmup})
    print_summary("inference benchmark", rows)
    return tp.img_s


def evaluate_checkpoint(cfg, checkpoint: str) -> tuple[float, float]:
    device, _, forward, amp_dtype, state, queues = _setup(cfg, checkpoint)
    stream, stream_state = streams.resolve(cfg, device)  # as in training: a dedicated stream for data=dali
    spec = LoaderSpec(device, run_dtype(cfg), cfg.channels_last, seed=cfg.seed)
    _, val = build_loaders(cfg.data, spec)
    if val.num_classes != state["num_classes"]:
        raise ValueError(f"the data has {val.num_classes} classes but the checkpoint was trained for {state['num_classes']}")
    with streams.issued_on(stream):
        top1, top5, n, tp = evaluate(forward, val, device, amp_dtype)
    rows = config_rows(cfg, device, environment(device))
    rows["CUDA stream"] = stream_state
    rows["CUDA work queues"] = queues
    rows.update({"checkpoint": checkpoint, "val top-1 %": top1, "val top-5 %": top5, "val images": n, "img/s": tp.img_s})
    print_summary("evaluation", rows)
    return top1, top5


@torch.inference_mode()
def classify_images(cfg, checkpoint: str | None, files: list[str]) -> list[list[tuple[str, float]]]:
    from PIL import Image
    from torchvision import transforms as T

    if checkpoint is None:
        raise ValueError("--images needs --checkpoint PATH (an untrained model's classes mean nothing)")
    device, _, forward, amp_dtype, state, _ = _setup(cfg, checkpoint)
    classes = state.get("classes") or [str(i) for i in range(state["num_classes"])]
    d = cfg.data
    prep = T.Compose([*image_transforms(d, train=False).transforms, T.ToTensor(), T.Normalize(d.mean, d.std)])
    results = []
    for f in files:
        if not Path(f).is_file():
            raise FileNotFoundError(f"--images: no such file {f!r}")
        with Image.open(f) as img:
            x = prep(img.convert("RGB")).unsqueeze(0).to(device, run_dtype(cfg))
        if cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            probs = forward(x).float().softmax(1)[0]
        top = probs.topk(min(5, probs.numel()))
        ranked = [(classes[i], float(p)) for p, i in zip(top.values.tolist(), top.indices.tolist())]
        print(f"{f}: " + ", ".join(f"{name} {p:.1%}" for name, p in ranked))
        results.append(ranked)
    return results


def profile(cfg, run_dir: Path, warmup: int, steps: int) -> None:
    """Time inference steps without the profiler, then trace a window of steps and print the diagnosis."""
    from .engine import run_meta
    from .profiling import StepProfiler

    device, model, forward, amp_dtype, *_ = _setup(cfg, None)
    baseline = measure(forward, model, cfg, device, warmup, steps)
    x = _synthetic_batch(cfg, device)
    prof = StepProfiler(run_dir, device, run_meta(cfg, environment(device), "infer"), cfg.profiler,
                        baseline_step_ms=baseline.step_ms_median)
    with torch.inference_mode(), prof:
        for _ in range(prof.total_steps):
            with prof.range("forward"), torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                forward(x)
            prof.step()
    prof.finish()
    print(f"trace: {prof.trace_path} (open it in https://ui.perfetto.dev)")
