"""Structured configs: the schema every Hydra config is checked against.

The dataclasses are registered in Hydra's ConfigStore as root nodes named `_schema_<group>` (not inside the
groups, so that they are neither offered nor accepted as a group's option); the YAML files under conf/<group>/ extend
them. A misspelled key or a value of the wrong type is rejected by OmegaConf with the key's full name, and a key
added with `+` that the schema lacks is refused by `check_schema_keys`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from .errors import ConfigError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class AmpDtype(str, Enum):
    fp16 = "fp16"
    bf16 = "bf16"


class DeviceKind(str, Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


class OptimName(str, Enum):
    sgd = "sgd"
    rmsprop = "rmsprop"
    lamb = "lamb"  # apex's FusedLAMB only (optim.impl=apex)


class OptimImpl(str, Enum):
    foreach = "foreach"  # torch's multi-tensor kernels
    fused = "fused"  # torch's single fused kernel per parameter group
    apex = "apex"  # NVIDIA apex's FusedSGD / FusedLAMB


class StreamMode(str, Enum):
    auto = "auto"
    default = "default"
    dedicated = "dedicated"


class StreamPriority(str, Enum):
    auto = "auto"
    normal = "normal"
    high = "high"


class StemWeightGrad(str, Enum):
    cudnn = "cudnn"
    custom = "custom"  # kernels/csrc/stem_weight_grad.cu


class DaliDecode(str, Enum):
    mixed = "mixed"
    cpu = "cpu"


@dataclass
class BackendConfig:
    name: str = "torch"


@dataclass
class NormConfig:
    # Which BatchNorm + ReLU implementation (mobilenet/norm.py): torch | custom | apex.
    name: str = "torch"
    # backend=custom norm=custom channels_last=true only: the 13 BatchNorms after a depthwise convolution take their
    # batch statistics from the depthwise kernel (computed from its output in its epilogue) instead of a pass of their
    # own over it (docs/kernels.md). Off until measured; a pair that cannot run so stops the run, nothing falls back.
    stats_from_depthwise: bool = False
    # Each BatchNorm + ReLU whose output feeds a depthwise conv (the stem's and the pointwise convs') computes only its
    # statistics in training, and the depthwise kernels (forward and weight gradient) normalize their input as they
    # load it, so relu(batch_norm(y)) is never written (docs/kernels.md). It needs backend=custom norm=custom
    # channels_last=true sync_bn=false compile=false norm.stats_from_depthwise=false, under amp an even number of
    # channels into each depthwise conv (every width_mult of the paper), and fewer than 2^31 elements in each depthwise
    # input (32-bit indexing), each at least 2x2 (so not at data=digits' 32 px). auto = on wherever it can run
    # (measured faster on an H200 in fp16, bf16 and fp32: docs/results/train_norm_h200.md); true = required (an error
    # where it cannot run); false = off. The summary's norm row says which ran (mobilenet/model.py
    # apply_in_depthwise_state).
    apply_in_depthwise: str = "auto"
    # Each BatchNorm + ReLU whose output feeds a pointwise (1x1) conv (the 13 after the depthwise convs) computes only
    # its statistics in training, and cuDNN's fused convolutions (forward and weight gradient, built through
    # cudnn-frontend's graph API) apply relu(batch_norm(.)) as they load their input (kernels/norm_pointwise.py). It
    # needs norm=custom channels_last=true amp=true amp_dtype=fp16 sync_bn=false compile=false
    # norm.stats_from_depthwise=false, channel counts that are multiples of 8 (every width_mult of the paper), and the
    # nvidia-cudnn-frontend package (a dependency). auto | true | false as apply_in_depthwise; auto by default
    # (fp16 channels_last, alternating: 2.0-2.2% faster on an H100, as fast on an H200, where BatchNorm + ReLU fall from
    # 36.5% to 32.4% of the GPU time: docs/results/train_h100_9cfeb02.md, train_h200_f79a96d.md). The
    # BatchNorm after each of those convs computes its statistics with its own pass, so steps stay bitwise repeatable.
    apply_in_pointwise: str = "auto"
    # With apply_in_pointwise on: the BatchNorm after each fused pointwise conv takes its statistics from the sums that
    # cuDNN's statistics epilogue computed from the conv's output, instead of a pass of its own over it. cuDNN adds
    # those sums with atomics, so steps are not bitwise repeatable: off by default (measured, with apply_in_pointwise,
    # +4.2-4.5% on an H200 and within the fp16 noise floor over 300 steps: docs/results/pointwise_norm_fusion_h200.md).
    stats_from_pointwise: bool = False


@dataclass
class ModelConfig:
    name: str = "mobilenet_v1"
    width_mult: float = 1.0
    dropout: float = 0.0
    # Who computes the stem convolution's weight gradient in training (3 -> 32 channels, 3x3, stride 2): cudnn, or
    # custom, this project's kernel (kernels/stem_ops.py), which needs a CUDA GPU, channels_last=true and output
    # channels in whole 16-byte vectors (every width_mult of the paper). The forward is cuDNN's either way. Measured
    # slower than cuDNN's (training 2% slower on an H100: docs/kernels.md), so not the default; the summary's "stem
    # weight gradient" row says which ran.
    stem_weight_grad: StemWeightGrad = StemWeightGrad.cudnn


@dataclass
class DaliConfig:
    decode: DaliDecode = DaliDecode.mixed
    threads: int = 4
    prefetch: int = 2
    seed: int = 42
    # Share of images nvJPEG sends to the hardware JPEG decoder where the GPU has one (0..1). All of them: on the
    # H200 that decodes faster than DALI's default of 0.65 and leaves the SMs to training (docs/results/loader_h200.md).
    hw_decoder_load: float = 1.0
    # Training pipelines decoding side by side, each with its own reader shard, decoder and `threads` threads; the
    # loader takes their batches in turn. One pipeline's decoder works through one batch at a time, and its JPEG
    # engines wait while it prepares the next (mobilenet/data/dali.py). None (the default): 2 with decode=mixed, 1
    # with decode=cpu, where no JPEG engine waits. Two fed training at 0.865 of synthetic data on an H100 against
    # 0.655 with one, alternating (docs/results/loader_h100_9cfeb02.md).
    pipelines: Optional[int] = None
    # Check every file's image signature / JPEG structure before DALI starts (DALI's decode errors do not name
    # the file, and DALI 2.4's CPU decoder can segfault instead of failing); needed for data.skip_corrupt. Costs
    # one small read at each end of every file.
    check_files: bool = True


@dataclass
class DataConfig:
    # Which loader: synthetic | folder | dali.
    name: str = "folder"
    # ImageFolder root holding train/ and val/ (folder and dali).
    root: Optional[str] = None
    # A dataset that ships with a dependency, written once as a JPEG ImageFolder into the cache: "digits".
    builtin: Optional[str] = None
    resolution: int = 224
    # None: the folder and DALI loaders count the class directories; data=synthetic needs a number.
    num_classes: Optional[int] = None
    batch_size: int = 256
    workers: int = 8
    # Batches per epoch: required for synthetic, an optional cap for the others.
    steps_per_epoch: Optional[int] = None
    val_steps: Optional[int] = None
    # Train augmentation: random-resized-crop area range and horizontal flip.
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    hflip: bool = True
    # Val: resize the shorter side to resolution / ratio, then centre-crop.
    val_resize_ratio: float = 0.875
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    # Skip (and count) corrupt images instead of stopping with an error that names the file.
    skip_corrupt: bool = False
    # data=folder: check every file's image signature (and JPEG structure) before the first step, so that a corrupt
    # file is named up front instead of stopping an epoch midway; the same check as data.dali.check_files.
    check_files: bool = True
    dali: DaliConfig = field(default_factory=DaliConfig)


@dataclass
class OptimConfig:
    name: OptimName = OptimName.sgd
    # fused: GradScaler skips an overflowing fp16 step inside the kernel instead of reading found_inf back every step
    # (a host sync), which makes training clearly faster than with foreach (docs/results/optimizer_impl_h200.md).
    impl: OptimImpl = OptimImpl.fused
    # Learning rate for a batch of 256; scaled linearly with the global batch size.
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 4e-5
    # RMSprop's smoothing constant and epsilon (the paper trains with RMSprop).
    alpha: float = 0.9
    eps: float = 1e-3
    warmup_epochs: float = 1.0
    min_lr_ratio: float = 0.0
    label_smoothing: float = 0.1


@dataclass
class PerfConfig:
    # Steps excluded from throughput (module load, cuDNN autotune, allocator growth, compile).
    warmup_steps: int = 10
    # How often the host reads the loss back (each read is a device sync).
    log_every: int = 50
    # img/s of the same config on one GPU: with it, a multi-GPU run reports its scaling efficiency.
    single_gpu_img_s: Optional[float] = None
    # The CUDA stream the run issues its work on (mobilenet/streams.py). default: PyTorch's default stream, which is
    # CUDA's legacy stream and so implicitly synchronises with every blocking stream in the process; dedicated: a
    # non-blocking stream of the run's own; auto: dedicated for data=dali (DALI's work then overlaps training instead
    # of serialising with it), the default stream otherwise (mobilenet/streams.py). train.py and infer.py's evaluation
    # follow it.
    stream: StreamMode = StreamMode.auto
    # The scheduling priority of a dedicated stream: high lets the GPU start the run's kernels ahead of work queued
    # on normal-priority streams (a loader's decoding), which then runs in the gaps. auto: high for data=dali (the
    # only loader measured to gain from it, mobilenet/streams.py), normal otherwise. The default
    # stream's priority cannot be changed, so high needs a dedicated stream.
    stream_priority: StreamPriority = StreamPriority.auto
    # CUDA_DEVICE_MAX_CONNECTIONS, the hardware work queues between host and GPU (CUDA's default 8), applied before
    # the run creates its CUDA context: auto or 1..32. With 8, DALI's ~15 decoder streams share queues with the
    # training stream and wait behind its kernels. auto: 32 for data=dali (faster DALI-fed training, eager and
    # captured), CUDA's default otherwise (mobilenet/streams.py).
    max_connections: str = "auto"
    # The fp32 -> fp16/bf16 casts of every convolution and linear weight as one kernel, and their gradients' casts
    # back as one, instead of two small kernels per weight (mobilenet/amp_weights.py): auto = wherever it can run
    # (amp=true, compile=false, one process), measured 0.8% faster on an H200 (docs/results/train_norm_h200.md);
    # true = required (an error where it cannot run); false = autocast's own casts. The summary says which ran.
    amp_weight_cast: str = "auto"
    # Sample the host's CPUs (busy, steal), this process's threads and the GPU's SMs and JPEG engines (NVML, with
    # nvidia-ml-py) over each epoch's timed steps, for the summary (mobilenet/machine_load.py): auto = for loaders that
    # decode images (data=dali, data=folder), true, false.
    sample_load: str = "auto"


@dataclass
class DistConfig:
    # A collective that waits longer than this fails with an error instead of hanging (a crashed rank).
    timeout_s: int = 600


@dataclass
class ProfilerConfig:
    # torch.profiler schedule: steps skipped entirely, warm-up steps traced but discarded, steps analysed.
    skip_first: int = 10
    warmup: int = 3
    active: int = 10
    top_k: int = 15
    # Steps timed without the profiler first, to state the profiler's own overhead.
    baseline_steps: int = 20


@dataclass
class Config:
    backend: BackendConfig = field(default_factory=BackendConfig)
    norm: NormConfig = field(default_factory=NormConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    amp: bool = False
    amp_dtype: AmpDtype = AmpDtype.fp16
    channels_last: bool = False
    compile: bool = False
    # Capture the training step as one CUDA graph (mobilenet/cuda_graph.py): true = required (an error where the run
    # cannot be captured); auto = where it can and was measured to help, and the summary says which; false = eager.
    # auto by default: capture is a little faster with synthetic data, and more so DALI-fed once DALI has 32 hardware
    # work queues (perf.max_connections); docs/results/cuda_graph_h200.md. Replayed steps match eager ones step by
    # step (tests/test_cuda_graph.py, a GPU test).
    cuda_graph: str = "auto"
    # Inference (infer.py) only. fold_bn: every BatchNorm folded into the convolution before it, weights stored once in
    # the run's dtype (mobilenet/inference_model.py); false runs the training graph in eval mode, so each step of the
    # inference ladder can be measured. fused_epilogue (with fold_bn): bias and ReLU computed inside each convolution
    # instead of as separate kernels: true = required (an error where no fused kernel exists, e.g. on a CPU); auto =
    # where the kernels exist, and the summary says which ran; false = every ReLU a kernel of its own.
    fold_bn: bool = True
    fused_epilogue: str = "auto"
    # BatchNorm statistics over all ranks (SyncBatchNorm); needs a process group (torchrun).
    sync_bn: bool = False
    dist: DistConfig = field(default_factory=DistConfig)
    device: DeviceKind = DeviceKind.auto
    epochs: int = 10
    seed: int = 0
    # Path of a checkpoint to continue from.
    resume: Optional[str] = None
    save_checkpoints: bool = True
    evaluate: bool = True
    profile: bool = False
    log_root: str = "runs"
    progress: bool = True


def enum_value(v: Any) -> Any:
    """A structured-config enum member as its plain value (`OptimImpl.fused` -> "fused"); other values as they are."""
    return v.value if isinstance(v, Enum) else v


def _run_name(override_dirname: str) -> str:
    return override_dirname or "default"


def override_key(override: str) -> str:
    """The config key a Hydra override sets: `+a.b=1` -> `a.b`."""
    return override.split("=", 1)[0].lstrip("+~")


def unnamed_keys() -> frozenset[str]:
    """Keys left out of run names (conf/config.yaml's hydra.job.config.override_dirname.exclude_keys): paths and
    switches that do not change what is measured."""
    cfg = OmegaConf.load(CONF_DIR / "config.yaml")
    return frozenset(cfg.hydra.job.config.override_dirname.exclude_keys)


def register_configs() -> None:
    """Register the schema nodes and resolvers; idempotent, called before Hydra composes."""
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver("run_name", _run_name)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in SCHEMA_GROUPS.items():
        cs.store(name=schema_node(group), node=node)


# The schema of each config group. A group's YAML files start with `defaults: [/_schema_<group>@_here_]`.
SCHEMA_GROUPS: dict[str, type] = {
    "backend": BackendConfig,
    "norm": NormConfig,
    "data": DataConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
}


def schema_node(group: str) -> str:
    """The ConfigStore name of a group's schema: at the root, so that `group=...` never lists or selects it."""
    return f"_schema_{group}"


def check_schema_keys(cfg) -> None:
    """Refuse keys the schema lacks (added with `+key=value`: nothing would read them), naming the closest key."""
    unknown = _unknown_keys(cfg, OmegaConf.structured(Config), "")
    if unknown:
        key, suggestion = unknown[0]
        hint = f"; did you mean {suggestion}={OmegaConf.select(cfg, key)}?" if suggestion else ""
        raise ConfigError(f"+{key}: the config has no key {key!r}, so nothing would read it{hint}")


def _within(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Callable[[Any], bool]:
    return lambda v: (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)


_INF = float("inf")
# The numeric settings' allowed values, checked when a config is composed (check_values): a value outside them would
# otherwise stop a run with a library's traceback, or train on quietly (a negative weight decay, a learning rate that
# grows after warm-up). (key, holds for the value, what is allowed); null passes for the Optional keys.
VALUE_RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("data.resolution", _within(1, _INF), "a whole number of pixels >= 1"),
    ("data.workers", _within(0, _INF), "a whole number >= 0 (0 loads in the training process)"),
    ("data.steps_per_epoch", _within(1, _INF), "a whole number >= 1, or null for the whole data set"),
    ("data.val_steps", _within(1, _INF), "a whole number >= 1, or null for the whole validation set"),
    ("data.crop_scale", lambda v: len(v) == 2 and 0 < v[0] <= v[1] <= 1,
     "[min, max] shares of the image's area with 0 < min <= max <= 1"),
    ("data.val_resize_ratio", _within(0, 1, lo_open=True), "a number in (0, 1] (the centre crop's share of the "
                                                           "shorter side)"),
    ("data.mean", lambda v: len(v) == 3, "three numbers, one per RGB channel"),
    ("data.std", lambda v: len(v) == 3 and all(x > 0 for x in v), "three numbers > 0, one per RGB channel"),
    ("data.dali.threads", _within(1, _INF), "a whole number >= 1"),
    ("data.dali.prefetch", _within(1, _INF), "a whole number >= 1 (batches DALI prepares ahead)"),
    ("model.dropout", _within(0, 1, hi_open=True), "a probability in [0, 1)"),
    ("optim.lr", _within(0, _INF), "a number >= 0 (for a batch of 256; scaled with the global batch)"),
    ("optim.momentum", _within(0, 1, hi_open=True), "a number in [0, 1)"),
    ("optim.weight_decay", _within(0, _INF), "a number >= 0"),
    ("optim.alpha", _within(0, 1), "a number in [0, 1] (RMSprop's smoothing constant)"),
    ("optim.eps", _within(0, _INF, lo_open=True), "a number > 0 (RMSprop's epsilon)"),
    ("optim.warmup_epochs", _within(0, _INF), "a number of epochs >= 0"),
    ("optim.min_lr_ratio", _within(0, 1), "a number in [0, 1] (the final learning rate's share of the peak)"),
    ("optim.label_smoothing", _within(0, 1, hi_open=True), "a number in [0, 1)"),
    ("perf.warmup_steps", _within(0, _INF), "a whole number of untimed steps >= 0"),
    ("perf.log_every", _within(1, _INF), "a whole number of steps >= 1"),
    ("perf.single_gpu_img_s", _within(0, _INF, lo_open=True), "a number > 0, or null"),
    ("profiler.skip_first", _within(0, _INF), "a whole number of steps >= 0"),
    ("profiler.warmup", _within(0, _INF), "a whole number of steps >= 0"),
    ("profiler.active", _within(1, _INF), "a whole number of steps >= 1"),
    ("profiler.top_k", _within(1, _INF), "a whole number >= 1"),
    ("profiler.baseline_steps", _within(1, _INF), "a whole number of steps >= 1"),
    ("dist.timeout_s", _within(1, _INF), "a whole number of seconds >= 1"),
]


def check_values(cfg) -> None:
    """ConfigError naming the first numeric setting outside its allowed values (VALUE_RULES) and what is allowed."""
    for key, holds, allowed in VALUE_RULES:
        value = OmegaConf.select(cfg, key, default=None)
        if value is None:
            continue
        if OmegaConf.is_config(value):
            value = OmegaConf.to_object(value)
        if not holds(value):
            raise ConfigError(f"{key}={value}: must be {allowed}")


def check_config(cfg) -> None:
    """The checks a composed config gets wherever it comes from (Hydra's main in train.py, compose() elsewhere): keys
    the schema lacks (check_schema_keys), then values outside their range (check_values)."""
    check_schema_keys(cfg)
    check_values(cfg)


# Settings that only one choice of another setting reads: (keys, reads them for this config and job, who reads them).
# A value given for one of them that the run does not read would otherwise pass without a word (unused_settings).
_READ_BY: list[tuple[tuple[str, ...], Callable[[Any, str], bool], str]] = [
    (("optim.alpha", "optim.eps"), lambda cfg, job: enum_value(cfg.optim.name) == "rmsprop", "optim=rmsprop"),
    (("optim.nesterov",), lambda cfg, job: enum_value(cfg.optim.name) == "sgd", "optim=sgd"),
    (("data.dali",), lambda cfg, job: cfg.data.name == "dali", "data=dali"),
    (("fold_bn", "fused_epilogue"), lambda cfg, job: job == "infer", "infer.py"),
]


def _leaves(node, prefix: str) -> list[tuple[str, Any]]:
    if not OmegaConf.is_dict(node):
        return [(prefix, node)]
    return [leaf for key in node for leaf in _leaves(node[key], f"{prefix}.{key}")]


def unused_settings(cfg, job: str) -> list[str]:
    """One line for each setting whose value is not the schema's default and that this run does not read (a
    RMSprop setting under optim=sgd, a DALI setting with another loader, an inference setting given to train.py).
    `job`: "train" or "infer"."""
    defaults = OmegaConf.structured(Config)
    lines = []
    for keys, reads, reader in _READ_BY:
        if reads(cfg, job):
            continue
        for key in keys:
            for leaf, value in _leaves(OmegaConf.select(cfg, key), key):
                if enum_value(value) != enum_value(OmegaConf.select(defaults, leaf)):
                    shown = str(value).lower() if isinstance(value, bool) else enum_value(value)
                    lines.append(f"{leaf}={shown} has no effect: only {reader} reads it")
    return lines


def _unknown_keys(node, schema, prefix: str) -> list[tuple[str, str | None]]:
    """[(dotted key, closest schema key or None)] for the keys of `node` that `schema` lacks."""
    import difflib

    from omegaconf import DictConfig

    found = []
    for key in node.keys():
        dotted = f"{prefix}{key}"
        if key not in schema:
            close = difflib.get_close_matches(str(key), [str(k) for k in schema.keys()], n=1, cutoff=0.6)
            found.append((dotted, f"{prefix}{close[0]}" if close else None))
            continue
        child, child_schema = node._get_node(key), schema._get_node(key)
        if isinstance(child, DictConfig) and isinstance(child_schema, DictConfig) and not child._is_none():
            found += _unknown_keys(child, child_schema, f"{dotted}.")
    return found


def check_overrides(overrides: list[str]) -> None:
    """Compose once, so that a bad override is a ConfigError of one line instead of Hydra's report, which for a
    misspelled key suggests `+key=value` (accepted, then read by nothing)."""
    compose(overrides)


def composition_message(e: Exception) -> str:
    """One line for Hydra's composition errors: what was wrong, and the closest key or the choices."""
    import difflib
    import re

    text = str(e) + (f"\n{e.__cause__}" if e.__cause__ is not None else "")
    unknown = re.search(r"Could not override '([^']+)'", text)
    if unknown:
        key = unknown.group(1)
        parent, _, leaf = key.rpartition(".")
        schema = OmegaConf.structured(Config)
        node = OmegaConf.select(schema, parent) if parent else schema
        known = [str(k) for k in node.keys()] if OmegaConf.is_dict(node) else []
        close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
        hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
        return f"the config has no key {key!r}{hint} (python train.py --cfg job lists them)"
    missing = re.search(r"Could not find '([^']+)'", text)
    if missing:
        options = re.findall(r"^\t(\S+)$", text.split("Config search path")[0], flags=re.M)
        return f"no config {missing.group(1)!r}" + (f"; choose one of: {', '.join(options)}" if options else "")
    lines = [line.strip() for line in text.splitlines() if line.strip()
             and not line.strip().startswith(("full_key:", "object_type=", "reference_type=", "Set the environment"))]
    if lines and lines[0].startswith("Error merging override "):  # then the reason, from OmegaConf
        lines[0] = lines[0].removeprefix("Error merging override ")
    return ": ".join(lines[:2]) or type(e).__name__


def compose(overrides: list[str] | None = None, config_name: str = "config") -> Any:
    """Compose the project's config outside @hydra.main (infer.py, scripts, tests), with the same checks; a bad override
    or value is a ConfigError of one line (composition_message, check_values)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides or []))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(composition_message(e)) from e  # the cause stays for --debug
    check_config(cfg)
    return cfg
