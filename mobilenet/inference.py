"""What infer.py does: benchmark, latency sweep, evaluate a checkpoint, classify images, export, profile.

Every mode runs the same inference path (`build_path`): with `fold_bn=true` (the default) the folded model of
mobilenet/inference_model.py, weights in the run's dtype and no autocast; with `fold_bn=false` the training graph
in eval mode under autocast. `cuda_graph` replays the whole forward; `compile` compiles it first. The summary names
the path, the kernel behind each kind of layer, and whether the forward was replayed.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from tqdm import tqdm

from . import cuda_graph, streams
from .data import LoaderSpec, build_loaders
from .data.folder import image_transforms
from .engine import (CheckpointError, autocast_dtype, build_for_run, config_rows, evaluate, load_checkpoint, resolve_device,
                     run_dtype, validate)
from .errors import ConfigError, DataError, DataNotFound, MissingDependency
from .inference_model import build_inference_model, onnx_export_form, resolve_epilogue
from .meter import StepMeter, Throughput
from .reporting import environment, print_summary

_UNSET = object()


class InferencePath(NamedTuple):
    forward: nn.Module  # what a batch goes through: the model, compiled and/or replayed
    model: nn.Module  # the model before compile and replay (folded where fold_bn=true)
    amp_dtype: torch.dtype | None  # autocast around forward: None for the folded path, whose weights are in the run's dtype
    rows: dict  # what the summary says about the path


def build_path(model: nn.Module, cfg, device: torch.device, profiling: bool = False) -> InferencePath:
    """The inference path `cfg` asks for, from a model in eval mode on `device`. Nothing is substituted: a step that
    cannot run as asked is an error (`true`) or is off and says why (`auto`)."""
    model.eval()
    rows: dict = {}
    if cfg.fold_bn:
        fused, rows["fused epilogue"] = resolve_epilogue(cfg.fused_epilogue, device)
        dtype = run_dtype(cfg)
        model = build_inference_model(model, dtype, cfg.channels_last, fused)
        amp_dtype = None
        rows["inference path"] = f"BatchNorm folded, weights in {str(dtype).removeprefix('torch.')} (fold_bn=true)"
        for kind, label in model.epilogues().items():
            rows[f"{kind} kernel"] = label
    else:
        amp_dtype = autocast_dtype(cfg)
        rows["inference path"] = "training graph in eval mode (fold_bn=false)" + (
            f", autocast {str(amp_dtype).removeprefix('torch.')}" if amp_dtype else "")
    forward: nn.Module = torch.compile(model) if cfg.compile else model
    replay, rows["CUDA graph"] = cuda_graph.resolve_inference(cfg, device, profiling)
    if replay:
        forward = cuda_graph.ReplayedForward(forward, device)
    return InferencePath(forward, model, amp_dtype, rows)


class _Setup(NamedTuple):
    device: torch.device
    path: InferencePath
    state: dict | None  # the checkpoint, when one was loaded
    queues: str  # the summary's "CUDA work queues": the count in force and why


def check_given_architecture(cfg, state: dict, checkpoint: str, given_keys) -> None:
    """With --checkpoint the architecture (model.name, model.width_mult) is the checkpoint's (`state`, read from
    `checkpoint`); a different value the command line sets for it (`given_keys`: the keys it set) is refused rather
    than replaced."""
    from .checkpoint import WEIGHT_SHAPING_KEYS, architecture_mismatch

    keys = [k for k in WEIGHT_SHAPING_KEYS if k in set(given_keys)]
    differing = architecture_mismatch(state.get("config"), cfg, keys)
    if differing is not None:
        key, theirs, ours = differing
        raise ConfigError(f"--checkpoint {checkpoint!r} was trained with {key}={theirs}, and {key}={ours} asks for "
                          f"another model: leave {key} out (the checkpoint decides the architecture)")


def _setup(cfg, checkpoint: str | None, num_classes: int | None = None, profiling: bool = False,
           given_keys=()) -> _Setup:
    """The device, the model on its inference path and the checkpoint's contents where one is given; `given_keys`: the
    keys the command line set, whose architecture settings must then be the checkpoint's (check_given_architecture)."""
    queues = streams.apply_max_connections(cfg)  # before anything creates the CUDA context
    device = resolve_device(cfg.device)
    if device.type != "cuda":
        queues = f"none ({device.type})"
    validate(cfg, device, job="infer")
    torch.backends.cudnn.benchmark = True
    state = load_checkpoint(checkpoint, option="--checkpoint ") if checkpoint else None
    if state is not None:
        check_given_architecture(cfg, state, checkpoint, given_keys)
        # The architecture comes from the checkpoint; the run settings (backend, amp, layout) from the command line.
        saved = state["config"]["model"]
        cfg.model.width_mult = saved["width_mult"]
        cfg.model.name = saved["name"]
        num_classes = state["num_classes"]
    num_classes = num_classes or cfg.data.num_classes
    if num_classes is None:
        raise ConfigError("data.num_classes is not set: without --checkpoint, infer.py builds an untrained model and "
                          "needs it (data=synthetic sets 1000)")
    model = build_for_run(cfg, device, num_classes)
    if state is not None:
        model.load_state_dict(state["model"])
    return _Setup(device, build_path(model, cfg, device, profiling), state, queues)


def _input_batch(cfg, device, batch_size: int | None = None) -> torch.Tensor:
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    gen = torch.Generator().manual_seed(cfg.seed)
    n = batch_size or cfg.data.batch_size
    x = torch.randn(n, 3, cfg.data.resolution, cfg.data.resolution, generator=gen).to(device)
    return x.to(run_dtype(cfg)).contiguous(memory_format=fmt)


def measure(forward, model: torch.nn.Module, cfg, device: torch.device, warmup: int, steps: int,
            amp_dtype=_UNSET, batch_size: int | None = None) -> Throughput:
    """Inference throughput of any model (this project's or a peer) on one device-resident batch. `amp_dtype`
    defaults to the config's autocast dtype (the folded path passes None: its weights are already in that dtype)."""
    amp_dtype = autocast_dtype(cfg) if amp_dtype is _UNSET else amp_dtype
    x = _input_batch(cfg, device, batch_size)
    was_training = model.training
    model.eval()
    meter = StepMeter(device, warmup)
    # On a CPU a pass at ImageNet size takes seconds: show progress there (GPU passes take milliseconds).
    passes = tqdm(range(warmup + steps), desc="inference passes", unit="pass", disable=device.type == "cuda",
                  leave=False)
    with torch.inference_mode():
        for _ in passes:
            meter.data_start()
            meter.compute_start()
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                forward(x)
            meter.step_end(x.shape[0])
        tp = meter.result()
    model.train(was_training)
    return tp


def _path_rows(cfg, device, setup: _Setup) -> dict:
    rows = config_rows(cfg, device, environment(device), training=False)
    rows.update(setup.path.rows)
    return rows


def benchmark(cfg, warmup: int, steps: int) -> float:
    """Inference img/s of the configured combination on a device-resident batch (no input pipeline)."""
    setup = _setup(cfg, None)
    path = setup.path
    _announce(cfg, setup.device, warmup, steps)
    tp = measure(path.forward, path.model, cfg, setup.device, warmup, steps, amp_dtype=path.amp_dtype)
    rows = _path_rows(cfg, setup.device, setup)
    rows.update({"infer img/s": tp.img_s, "ms / batch": tp.step_ms, "timed steps": tp.steps, "warm-up steps": warmup})
    print_summary("inference benchmark", rows)
    return tp.img_s


def _announce(cfg, device: torch.device, warmup: int, steps: int, batch_sizes: list[int] | None = None) -> None:
    """Say what is about to run: on a CPU a benchmark at ImageNet size takes minutes, and nothing else would show."""
    sizes = ",".join(map(str, batch_sizes)) if batch_sizes else str(cfg.data.batch_size)
    print(f"inference on {device.type}: batch {sizes}, {cfg.data.resolution}px, {warmup} warm-up + {steps} timed "
          f"passes", flush=True)


def latency_sweep(cfg, batch_sizes: list[int], warmup: int, steps: int) -> list[dict]:
    """Per batch size: throughput (passes issued back to back, total images over total time) and the p50 / p99
    latency of one call (each call timed alone, host clock from the call to the device's completion)."""
    setup = _setup(cfg, None)
    path, device = setup.path, setup.device
    _announce(cfg, device, warmup, steps, batch_sizes)
    results = []
    for n in batch_sizes:
        tp = measure(path.forward, path.model, cfg, device, warmup, steps, amp_dtype=path.amp_dtype, batch_size=n)
        lat = _latencies_ms(path, cfg, device, n, steps)
        results.append({"batch": n, "img/s": tp.img_s, "p50 ms": statistics.median(lat),
                        "p99 ms": _percentile(lat, 99), "calls": len(lat)})
    rows = _path_rows(cfg, device, setup)
    rows.pop("batch size", None)
    print_summary("inference latency", rows)
    print(f"{'batch':>6} {'img/s':>10} {'p50 ms':>9} {'p99 ms':>9}")
    for r in results:
        print(f"{r['batch']:>6} {r['img/s']:>10,.0f} {r['p50 ms']:>9.3f} {r['p99 ms']:>9.3f}")
    return results


def _latencies_ms(path: InferencePath, cfg, device: torch.device, batch_size: int, calls: int) -> list[float]:
    x = _input_batch(cfg, device, batch_size)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    with torch.inference_mode(), torch.autocast(device.type, dtype=path.amp_dtype, enabled=path.amp_dtype is not None):
        path.forward(x)  # a new batch size may capture a new graph or autotune: not a latency
        sync()
        for _ in range(calls):
            t0 = time.perf_counter()
            path.forward(x)
            sync()
            out.append(1e3 * (time.perf_counter() - t0))
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def evaluate_checkpoint(cfg, checkpoint: str, given_keys=()) -> tuple[float, float]:
    setup = _setup(cfg, checkpoint, given_keys=given_keys)
    device, path, state = setup.device, setup.path, setup.state
    stream, stream_state = streams.resolve(cfg, device)  # as in training: a dedicated stream for data=dali
    spec = LoaderSpec(device, run_dtype(cfg), cfg.channels_last, seed=cfg.seed)
    _, val = build_loaders(cfg.data, spec)
    if val.num_classes != state["num_classes"]:
        raise CheckpointError(f"the data has {val.num_classes} classes but the checkpoint {checkpoint} was trained for "
                              f"{state['num_classes']}")
    with torch.inference_mode(), streams.issued_on(stream):
        top1, top5, n, tp = evaluate(path.forward, val, device, path.amp_dtype)
    rows = _path_rows(cfg, device, setup)
    rows["CUDA stream"] = stream_state
    rows["CUDA work queues"] = setup.queues
    rows.update({"checkpoint": checkpoint, "val top-1 %": top1, "val top-5 %": top5, "val images": n, "img/s": tp.img_s})
    print_summary("evaluation", rows)
    return top1, top5


@torch.inference_mode()
def classify_images(cfg, checkpoint: str | None, files: list[str], given_keys=()) -> list[list[tuple[str, float]]]:
    from PIL import Image
    from torchvision import transforms as T

    if checkpoint is None:
        raise ConfigError("--images needs --checkpoint PATH (an untrained model's classes mean nothing)")
    for f in files:
        if not Path(f).is_file():
            raise DataNotFound(f"--images: no such file {f!r}")
    rgb = []  # every image decoded before the model is built: a file that is not one stops the run, not its output
    for f in files:
        try:
            with Image.open(f) as img:
                rgb.append(img.convert("RGB"))
        except OSError as e:  # PIL's UnidentifiedImageError (not an image) and truncated data alike
            raise DataError(f"--images: cannot decode {f!r} as an image ({e})") from e
    setup = _setup(cfg, checkpoint, given_keys=given_keys)
    device, path, state = setup.device, setup.path, setup.state
    classes = state.get("classes") or [str(i) for i in range(state["num_classes"])]
    d = cfg.data
    prep = T.Compose([*image_transforms(d, train=False).transforms, T.ToTensor(), T.Normalize(d.mean, d.std)])
    results = []
    for f, img in zip(files, rgb):
        x = prep(img).unsqueeze(0).to(device, run_dtype(cfg))
        if cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=path.amp_dtype, enabled=path.amp_dtype is not None):
            probs = path.forward(x).float().softmax(1)[0]
        top = probs.topk(min(5, probs.numel()))
        ranked = [(classes[i], float(p)) for p, i in zip(top.values.tolist(), top.indices.tolist())]
        print(f"{f}: " + ", ".join(f"{name} {p:.1%}" for name, p in ranked))
        results.append(ranked)
    return results


ONNX_OPSET = 18


def export_onnx(cfg, checkpoint: str | None, out: str, given_keys=()) -> Path:
    """Write the folded model as standard ONNX operators (Conv, Relu, ReduceMean, Gemm): every depthwise backend
    becomes a grouped Conv, so the file runs anywhere. The batch axis is dynamic; dtype and layout follow the run
    (fp32 unless amp=true). Returns the path written."""
    if not cfg.fold_bn:
        raise ConfigError("--export writes the folded inference model; fold_bn=false (the training graph with "
                         "BatchNorm) is not exported. Drop fold_bn=false")
    if cfg.compile:
        raise ConfigError("--export traces the model itself; compile=true does not apply to an export, drop it")
    dest = Path(out)
    if dest.suffix != ".onnx":
        raise ConfigError(f"--export {out}: the file name must end in .onnx")
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:  # torch.onnx's exporter imports them only once the export is under way: say so before any work
        raise MissingDependency(f"--export needs {' and '.join(missing)} (torch's ONNX exporter), not installed in this "
                                "Python environment: pip install -e '.[export]'")
    setup = _setup(cfg, checkpoint, given_keys=given_keys)
    model = onnx_export_form(setup.path.model)
    x = _input_batch(cfg, setup.device, batch_size=2)
    batch = torch.export.Dim("batch", min=1, max=65536)
    dest.parent.mkdir(parents=True, exist_ok=True)
    program = torch.onnx.export(model, (x,), input_names=["images"], output_names=["logits"], opset_version=ONNX_OPSET,
                                dynamic_shapes=({0: batch},), dynamo=True, verbose=False)
    program.save(str(dest))
    dtype = str(x.dtype).removeprefix("torch.")
    print(f"wrote {dest}: ONNX opset {ONNX_OPSET}, input 'images' ({dtype}, [batch, 3, {cfg.data.resolution}, "
          f"{cfg.data.resolution}], batch dynamic), output 'logits' ({dtype}, [batch, {model.classifier.out_features}]); "
          "BatchNorm folded, depthwise as grouped Conv")
    return dest


def profile(cfg, run_dir: Path, warmup: int, steps: int) -> None:
    """Time inference steps without the profiler, then trace a window of steps and print the diagnosis."""
    from .engine import run_meta
    from .profiling import StepProfiler
    from .profiling.trace import unprofiled_launches

    setup = _setup(cfg, None, profiling=True)
    path, device = setup.path, setup.device
    # The profiler's overhead is stated against this baseline: too few steps would make it noise (even negative).
    baseline_steps = max(steps, cfg.profiler.baseline_steps)
    baseline = measure(path.forward, path.model, cfg, device, warmup, baseline_steps, amp_dtype=path.amp_dtype)
    x = _input_batch(cfg, device)
    unprofiled = unprofiled_launches(cuda_graph.resolve_inference(cfg, device, profiling=False)[0], cfg.compile)
    prof = StepProfiler(run_dir, device, run_meta(cfg, environment(device), "infer", unprofiled), cfg.profiler,
                        baseline_step_ms=baseline.step_ms_median)
    with torch.inference_mode(), prof:
        for _ in range(prof.total_steps):
            with prof.range("forward"), torch.autocast(device.type, dtype=path.amp_dtype,
                                                       enabled=path.amp_dtype is not None):
                path.forward(x)
            prof.step()
    prof.finish()
    print(f"trace: {prof.trace_path} (open it in https://ui.perfetto.dev)")
