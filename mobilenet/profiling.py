"""Profiling that tells the truth: capture a few steady-state steps, then diagnose them from the exported trace.

Capture (the training loop or infer.py)::

    prof = StepProfiler(run_dir, device, meta={"mode": "train", "backend": "torch", "precision": "amp fp16",
                                               "memory_format": "NCHW", "batch_size": 256}, cfg=cfg.profiler)
    with prof:
        for images, labels in loader:
            with prof.range("data"): ...
            with prof.range("forward"): ...
            with prof.range("backward"): ...
            with prof.range("optimizer"): ...
            prof.step()
            if prof.finished:
                break
    report = prof.finish(baseline_step_ms)   # exports, analyses, prints, writes profile_report.md

The schedule skips `skip_first` steps (lazy module loading, cuDNN autotune, allocator growth), traces `warmup`
steps and throws them away, then records `active` steps. `finish()` writes `<run_dir>/trace.json.gz`: open it
in https://ui.perfetto.dev (drag the file in) or chrome://tracing. TensorBoard's profiler plugin is not used.

Diagnosis (`analyse_trace`, also `python scripts/diagnose.py TRACE` offline) reads only the exported Chrome
trace JSON, so a trace from any machine can be analysed anywhere. It counts device-side rows (kernels,
memcpys, memsets) and never the CPU ops' "CUDA time" columns, which attribute asynchronous work to whichever op
was running when it finished. Each GPU row is linked through its `correlation` id to the runtime call that
launched it, and from there to the enclosing CPU ops and record_function range.

Step time: the report's step time is the unprofiled median given as `baseline_step_ms` (the engine and infer.py
time steps just before the window with the same meter as an ordinary run), because recording every op slows a
host-bound loop; the profiled steps' own time is shown beside it, and the difference is the profiler's overhead.
"""

from __future__ import annotations

import bisect
import gzip
import json
import math
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from .reporting import environment
from .streams import CUDA_DEFAULT_CONNECTIONS  # the hardware work queues when nothing sets CUDA_DEVICE_MAX_CONNECTIONS

TRACE_FILE = "trace.json.gz"
REPORT_FILE = "profile_report.md"
# Top-level key of the trace JSON that carries the run's facts (environment, config) for offline analysis.
META_KEY = "mobilenet_meta"

# Defaults when no ProfilerConfig is given (same values as mobilenet.config.ProfilerConfig, which imports Hydra).
_DEFAULT_SCHEDULE = {"skip_first": 10, "warmup": 3, "active": 10, "top_k": 15}


# =============================================================================================================
# Capture
# =============================================================================================================


class StepProfiler:
    """torch.profiler over a window of steps, with record_function ranges and a diagnosis at the end.

    Args:
        run_dir: where `trace.json.gz` and `profile_report.md` go.
        device: the run's device; on CPU only CPU ops are traced and the report says there was no GPU.
        meta: facts about the run shown in the report and stored in the trace (key `mobilenet_meta`) so offline
            analysis has them. Recognised keys: mode (train|infer), backend, precision, memory_format,
            batch_size, resolution, compile; any other key is listed as is. Versions and the GPU name
            (mobilenet.reporting.environment) are filled in when meta does not already carry them.
        cfg: any object with skip_first, warmup, active, top_k (mobilenet.config.ProfilerConfig).
        baseline_step_ms: the unprofiled median step time, when already known (it is then stored in the trace
            too); `finish(baseline_step_ms)` may give it instead.
    """

    def __init__(self, run_dir: str | Path, device: torch.device | str, meta: dict[str, Any] | None = None,
                 cfg: Any = None, *, baseline_step_ms: float | None = None, print_report: bool = True):
        from torch.profiler import ProfilerActivity, profile, schedule

        self.run_dir = Path(run_dir)
        self.device = torch.device(device)
        sched = {k: getattr(cfg, k, v) if cfg is not None else v for k, v in _DEFAULT_SCHEDULE.items()}
        if sched["active"] < 1 or sched["warmup"] < 0 or sched["skip_first"] < 0:
            raise ValueError(f"profiler schedule needs active >= 1, warmup >= 0, skip_first >= 0; got {sched}")
        self.skip_first, self.warmup, self.active, self.top_k = (int(sched[k]) for k in ("skip_first", "warmup", "active", "top_k"))
        meta = meta or {}
        # The engine and infer.py pass the whole environment in meta already (run_meta); gather it only when missing.
        env = meta if "torch" in meta else environment(self.device)
        self.meta = {**env, "device": self.device.type, **meta}
        self.meta["profiler_schedule"] = {"skip_first": self.skip_first, "warmup": self.warmup, "active": self.active}
        if baseline_step_ms is not None:
            self.meta["baseline_step_ms"] = float(baseline_step_ms)  # finish() reads it back through analyse_trace
        self._meta_json = json.dumps(self.meta, default=str)  # meta is fixed from here on
        self.print_report = print_report
        self.finished = False
        self.recorded_steps = 0
        self.trace_path = self.run_dir / TRACE_FILE
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            schedule=schedule(skip_first=self.skip_first, wait=0, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=self._on_trace_ready,
            record_shapes=True,
        )
        self._running = False

    @property
    def total_steps(self) -> int:
        """How many step() calls the window needs."""
        return self.skip_first + self.warmup + self.active

    def __enter__(self) -> "StepProfiler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def start(self) -> None:
        self._prof.start()
        self._running = True
        self._tag_trace()

    def range(self, name: str):
        """A named range (record_function) in the trace: data, forward, backward, optimizer, ..."""
        return torch.profiler.record_function(name)

    def step(self) -> None:
        """Call once at the end of every step, inside the `with`."""
        if not self._running:
            return
        from torch.profiler import ProfilerAction

        if self._prof.current_action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            self.recorded_steps += 1
        self._prof.step()
        self._tag_trace()

    def _tag_trace(self) -> None:
        from torch.profiler import ProfilerAction

        # Kineto drops metadata added while it is not tracing, so tag every traced step (the last write wins).
        if self._prof.current_action != ProfilerAction.NONE:
            self._prof.add_metadata_json(META_KEY, self._meta_json)

    def _on_trace_ready(self, prof) -> None:
        # Exported in finish(): writing a large trace here would stall the step that closes the window.
        self.finished = True

    def _stop(self) -> None:
        if self._running:
            self._running = False
            self._prof.stop()

    def finish(self, baseline_step_ms: float | None = None) -> "Report":
        """Stop, export the trace, analyse it, print and save the report; returns it (`.markdown()` for text).
        Without baseline_step_ms, the one given to __init__ (stored in meta) is used."""
        self._stop()
        if not self.finished or self.recorded_steps == 0:
            raise RuntimeError(
                f"the profiler recorded no step: call step() at least skip_first + warmup + 1 = "
                f"{self.skip_first + self.warmup + 1} times (recorded {self.recorded_steps} of {self.active} active steps)"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.trace_path))
        trace = load_trace(self.trace_path)
        report = analyse_trace(trace, baseline_step_ms=baseline_step_ms, meta=self.meta, top_k=self.top_k,
                               trace_path=str(self.trace_path))
        if self.recorded_steps < self.active:
            report.notes.append(f"only {self.recorded_steps} of the {self.active} active steps ran before finish()")
        md = report.markdown()
        (self.run_dir / REPORT_FILE).write_text(md)
        if self.print_report:
            print(md)
        return report


# =============================================================================================================
# Trace loading
# =============================================================================================================


def load_trace(path: str | Path) -> dict:
    """A Chrome trace exported by torch.profiler (.json or .json.gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


@dataclass(eq=False)
class Event:
    name: str
    cat: str  # normalised: cpu_op, user_annotation, runtime, kernel, memcpy, memset, other
    ts: float  # microseconds
    dur: float
    tid: Any
    pid: Any
    args: dict
    parent: "Event | None" = None

    @property
    def end(self) -> float:
        return self.ts + self.dur


_CATEGORY_ALIASES = {
    "cpu_op": "cpu_op", "operator": "cpu_op",
    "user_annotation": "user_annotation",
    "cuda_runtime": "runtime", "runtime": "runtime", "cuda_driver": "runtime", "driver": "runtime",
    "kernel": "kernel",
    "gpu_memcpy": "memcpy", "memcpy": "memcpy",
    "gpu_memset": "memset", "memset": "memset",
}
GPU_CATS = ("kernel", "memcpy", "memset")
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
# Containment tolerance: trace timestamps are microseconds with nanosecond rounding.
_EPS = 0.002


# Arguments the analysis reads; slim_trace drops the rest.
_KEPT_ARGS = ("correlation", "External id", "Input Dims", "Input type", "Input Strides", "Concrete Inputs", "bytes",
              "stream", "device", "grid", "block")


def slim_trace(trace: dict) -> dict:
    """A smaller trace that analyses the same: host ops, ranges, runtime calls and GPU rows with the arguments
    the analysis reads (no flow arrows, Python frames or per-kernel occupancy figures): the rows of every category
    _events recognises (_CATEGORY_ALIASES). For test fixtures."""
    events = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M":
            events.append(e)
        elif e.get("ph") == "X" and str(e.get("cat", "")).lower() in _CATEGORY_ALIASES:
            e = dict(e)
            e["args"] = {k: v for k, v in (e.get("args") or {}).items() if k in _KEPT_ARGS}
            events.append(e)
    return {**{k: v for k, v in trace.items() if k != "traceEvents"}, "traceEvents": events}


def save_trace(trace: dict, path: str | Path) -> None:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        json.dump(trace, f, separators=(",", ":"))


def _events(trace: dict) -> list[Event]:
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = _CATEGORY_ALIASES.get(str(e.get("cat", "")).lower(), "other")
        out.append(Event(e.get("name", ""), cat, float(e["ts"]), float(e["dur"]), e.get("tid"), e.get("pid"), e.get("args") or {}))
    return out


def _link_parents(events: Iterable[Event]) -> None:
    """Nest host events (ops, ranges, runtime calls) per thread by time containment."""
    by_thread: dict[Any, list[Event]] = defaultdict(list)
    for e in events:
        by_thread[(e.pid, e.tid)].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.ts, -e.dur))
        stack: list[Event] = []
        for e in evs:
            while stack and not (e.ts >= stack[-1].ts - _EPS and e.end <= stack[-1].end + _EPS):
                stack.pop()
            e.parent = stack[-1] if stack else None
            stack.append(e)


def _ancestors(e: Event | None) -> Iterable[Event]:
    while e is not None:
        yield e
        e = e.parent


def _cpu_ops(e: Event | None) -> list[Event]:
    """The CPU ops enclosing a host event, innermost first (pass a launch's parent: its op stack)."""
    return [a for a in _ancestors(e) if a.cat == "cpu_op"]


# =============================================================================================================
# Classification tables. Order matters: the first matching row wins. Verified against H200 traces
# (torch 2.11 + cuDNN 9.19); extend the tables when a new kernel family shows up under "unidentified".
# =============================================================================================================

# Kernel-name patterns that identify which implementation computed a depthwise convolution. cuDNN 9.19 on an
# H200 runs depthwise convs as sm90_xmma_depthwise_convolution_{fprop,dgrad,wgrad}_tiling_*, cudnn::cnn::
# {conv2d,dgrad2d}_grouped_direct_kernel, {conv2d,dgrad2d}_c1_k1_{nchw,nhwc}_* and wgrad2d_shmem_tiling; PyTorch's
# own kernels are at::native::conv_depthwise2d_{forward,backward,grad_weight}_kernel.
DEPTHWISE_IMPLEMENTATIONS: tuple[tuple[str, re.Pattern], ...] = (
    ("custom (kernels/)", re.compile(r"mobilenet_dw", re.I)),
    ("PyTorch native", re.compile(r"conv_depthwise[23]d|DepthwiseConv|at::native::.*depthwise", re.I)),
    ("cuDNN", re.compile(r"cudnn|xmma|cutlass|nvjet|sm\d{2,3}_|implicit|dgrad|wgrad|fprop|grouped_direct|conv2d_|_c1_k1_|"
                         r"shmem_tiling|convolve|winograd|gemm|splitK|nchw|nhwc|fft|flip_filter|region_transform", re.I)),
    ("custom (kernels/)", re.compile(r"depthwise", re.I)),
    ("elementwise inside depthwise ops", re.compile(r"elementwise|FillFunctor|reduce_kernel", re.I)),
)
# Kernel names that are depthwise on their own, whatever op launched them (native and custom kernels).
DEPTHWISE_KERNEL_NAMES = re.compile(r"conv_depthwise[23]d|DepthwiseConv|mobilenet_dw|depthwise", re.I)
# Ops whose name says depthwise: the cudnn backend's custom ops, the custom kernels' `mobilenet_dw::` ops.
DEPTHWISE_OP_NAMES = re.compile(r"depthwise|mobilenet_dw", re.I)
# Convolution ops and the argument positions of (input, weight), to recognise depthwise from the shapes.
CONV_OP_ARGS: dict[str, tuple[int, int]] = {
    "aten::conv2d": (0, 1), "aten::convolution": (0, 1), "aten::_convolution": (0, 1),
    "aten::cudnn_convolution": (0, 1), "aten::cudnn_convolution_transpose": (0, 1),
    "aten::convolution_backward": (1, 2), "aten::convolution_overrideable": (0, 1),
}
# Layout transposes: cuDNN's own NCHW<->NHWC kernels and generic transpose kernels.
TRANSPOSE_KERNELS = re.compile(r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw|transpose", re.I)
# Elementwise copy kernels: a dtype cast or a layout copy, told apart by the launching copy op's arguments.
COPY_KERNELS = re.compile(r"copy_kernel|direct_copy|CopyKernel", re.I)
CAST_OPS = ("aten::_to_copy", "aten::to", "aten::copy_", "aten::type_as")
LAYOUT_OPS = ("aten::contiguous", "aten::clone", "aten::copy_")
# Host calls that block until the GPU (or a copy) has finished.
_AUTOGRAD_PREFIX = "autograd::engine::evaluate_function: "  # autograd's backward ops, on its own thread
SYNC_CALLS = re.compile(r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy|cudaMemcpy2D|"
                        r"cuStreamSynchronize|cuCtxSynchronize|cuEventSynchronize|cuMemcpyDtoH|cuMemcpyHtoD)$")
DEVICE_SYNC_CALLS = frozenset({"cudaDeviceSynchronize", "cuCtxSynchronize"})
SLOW_LAUNCH_US = 1000.0

CATEGORIES = ("depthwise", "transpose", "cast", "memcpy", "other")
CATEGORY_TITLES = {
    "depthwise": "depthwise convolution", "transpose": "layout transposes", "cast": "dtype casts",
    "memcpy": "host<->device / device copies", "other": "everything else",
}


def short_kernel_name(name: str, width: int = 110) -> str:
    s = re.sub(r"^void ", "", name)
    s = s.replace("(anonymous namespace)::", "").replace("at::native::", "")
    return s if len(s) <= width else s[: width - 3] + "..."


def op_label(ops: list[Event]) -> str:
    """'outermost op > nearest op' of a launch's op stack (innermost first): says both what the model did
    (aten::conv2d, ConvolutionBackward0, aten::linear) and which op launched the kernel."""
    if not ops:
        return "(no op)"
    outer = ops[-1].name.removeprefix(_AUTOGRAD_PREFIX)
    return outer if len(ops) == 1 or outer == ops[0].name else f"{outer} > {ops[0].name}"


def _dims(op: Event, i: int) -> list | None:
    dims = op.args.get("Input Dims")
    if isinstance(dims, list) and i < len(dims) and isinstance(dims[i], list):
        return dims[i]
    return None


def _is_depthwise_conv(op: Event) -> bool:
    if DEPTHWISE_OP_NAMES.search(op.name):
        return True
    idx = CONV_OP_ARGS.get(op.name)
    if idx is None:
        return False
    x, w = _dims(op, idx[0]), _dims(op, idx[1])
    # Weight (C, 1, kh, kw) applied to a C-channel input: one filter per channel.
    return bool(x and w and len(x) == 4 and len(w) == 4 and w[1] == 1 and x[1] == w[0] > 1)


def _copy_kind(ops: list[Event]) -> str | None:
    """'cast' or 'transpose' for an elementwise copy, from the nearest copy op's argument types and strides."""
    for op in ops:
        if op.name not in CAST_OPS and op.name not in LAYOUT_OPS:
            continue
        types = op.args.get("Input type") or []
        if op.name == "aten::copy_" and len(types) >= 2 and types[0] and types[1]:
            if types[0] != types[1]:
                return "cast"
            strides = op.args.get("Input Strides") or []
            if len(strides) >= 2 and strides[0] != strides[1]:
                return "transpose"
            return None
        if op.name in ("aten::_to_copy", "aten::to", "aten::type_as"):
            return "cast"
    return None


CUSTOM_OP_NAMESPACE = "mobilenet_dw::"


def implementation_of(kernel_name: str, ops: Iterable[Event] = ()) -> str:
    """Which implementation ran a depthwise kernel: an op of the custom kernels' namespace decides, else the name."""
    if any(op.name.startswith(CUSTOM_OP_NAMESPACE) for op in ops):
        return "custom (kernels/)"
    for impl, pattern in DEPTHWISE_IMPLEMENTATIONS:
        if pattern.search(kernel_name):
            return impl
    return "unidentified"


# =============================================================================================================
# Report
# =============================================================================================================


@dataclass
class Finding:
    title: str
    detail: str
    hint: str = ""
    severity: str = "info"  # info | warn


@dataclass
class CategoryShare:
    ms_per_step: float
    pct: float  # of GPU activity time (sum of kernel, memcpy and memset rows)
    count_per_step: float


@dataclass
class Report:
    env: dict[str, Any]
    gpu: bool
    steps: int
    # Step time = from one step's completion to the next; a step completes when its host range and the last GPU
    # row it launched have both ended (see _completion_periods). host_step_ms: the ProfilerStep ranges alone.
    step_ms: list[float]
    step_ms_median: float
    step_ms_min: float
    step_ms_max: float
    host_step_ms_median: float = 0.0
    baseline_step_ms: float | None = None
    profiler_overhead_pct: float | None = None
    first_step_ratio: float | None = None
    # First-call effects inside the window: extra kernels in the first step (cuDNN autotune tries candidates)
    # and launch calls slower than SLOW_LAUNCH_US (lazy module loading happens inside the first launch).
    first_step_extra_kernels: float = 0.0
    slow_launches: list[dict] = field(default_factory=list)
    gpu_span_ms_per_step: float | None = None  # from the first to the last GPU row launched by a step (median)
    gpu_ms_per_step: float = 0.0  # summed GPU activity time per step (the categories' total)
    window_ms: float = 0.0
    busy_pct: float = 0.0
    idle_pct: float = 0.0
    idle_host_pct: float = 0.0  # nothing queued: the GPU waited for the host to launch
    idle_host_sync_pct: float = 0.0  # ... while the host sat in a blocking call (sync, pageable copy)
    idle_host_data_pct: float = 0.0  # ... while the host was in the "data" range
    idle_gap_pct: float = 0.0  # work was already queued: launch latency and gaps between kernels
    kernels_per_step: float = 0.0
    short_kernels_per_step: float = 0.0
    short_kernel_pct: float = 0.0
    median_kernel_us: float = 0.0
    median_launch_us: float = 0.0
    launch_bound: bool = False
    categories: dict[str, CategoryShare] = field(default_factory=dict)
    depthwise_impls: dict[str, float] = field(default_factory=dict)  # implementation -> % of depthwise time
    depthwise_implementation: str | None = None
    transposes: list[dict] = field(default_factory=list)  # by launching op
    casts: list[dict] = field(default_factory=list)
    casts_per_step: float = 0.0
    memcpys: list[dict] = field(default_factory=list)  # by kind (HtoD pageable, ...)
    pageable_copies_per_step: float = 0.0
    syncs: list[dict] = field(default_factory=list)  # by call and op, on the threads that run the step
    syncs_per_step: float = 0.0
    # CUDA API calls of other threads in the process (a data loader's workers, e.g. DALI's): they block only
    # their own thread, but they share the CUDA context (and its locks) with the step's launches.
    other_thread_syncs_per_step: float = 0.0
    other_thread_cuda_calls_per_step: float = 0.0
    # Device-wide syncs among them: each waits for everything queued on the GPU, the step's work included.
    other_thread_device_syncs_per_step: float = 0.0
    other_thread_device_sync_ms_median: float = 0.0
    # CUDA streams whose work ran in the window, and the hardware work queues the process had (meta
    # "cuda_work_queues"; None: the trace does not say, so CUDA's default 8 applies unless the environment changed it).
    streams_with_work: int = 0
    work_queues: int | None = None
    top_kernels: list[dict] = field(default_factory=list)
    top_ops: list[dict] = field(default_factory=list)  # CPU runs: self CPU time by op
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    trace_path: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def step_time_ms(self) -> float:
        """The run's step time: the unprofiled median when it was measured (the profiler's own host overhead
        inflates the profiled steps of a host-bound loop), else the profiled steps' median."""
        return self.baseline_step_ms if self.baseline_step_ms is not None else self.step_ms_median

    def markdown(self) -> str:
        return _render_markdown(self)


# =============================================================================================================
# Analysis
# =============================================================================================================


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _parse_meta(trace: dict) -> dict:
    meta = trace.get(META_KEY) or {}
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError:
            meta = {}
    return dict(meta)


def _env_from_trace(trace: dict, meta: dict) -> dict:
    env = dict(meta)
    props = trace.get("deviceProperties") or []
    if props and "gpu" not in env:
        env["gpu"] = props[0].get("name", "unknown")
    for key, trace_key in (("cuda_runtime", "cuda_runtime_version"), ("cuda_driver", "cuda_driver_version")):
        if trace_key in trace and key not in env:
            env[key] = trace[trace_key]
    return env


def _interval_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _overlap(a: float, b: float, intervals: list[tuple[float, float]], starts: list[float]) -> float:
    """Total overlap of [a, b] with sorted disjoint intervals."""
    total = 0.0
    i = max(0, bisect.bisect_right(starts, a) - 1)
    while i < len(intervals) and intervals[i][0] < b:
        lo, hi = max(a, intervals[i][0]), min(b, intervals[i][1])
        if hi > lo:
            total += hi - lo
        i += 1
    return total


def _completion_periods(steps: list, per_step_first_last: dict[int, list[float]]) -> list[float]:
    """Step times (ms) from one step's completion to the next. A step completes when its host range and the last
    GPU row it launched (per_step_first_last: step index -> [first GPU start, last GPU end]) have both ended: host
    ranges alone understate a GPU-bound step (the host runs ahead, queueing work), GPU spans alone miss a host-bound
    one. The first step counts from its host start."""
    done = [max(st.end, per_step_first_last[i][1]) if i in per_step_first_last else st.end for i, st in enumerate(steps)]
    return [(done[0] - steps[0].ts) / 1000] + [(b - a) / 1000 for a, b in zip(done, done[1:])]


def _site_rows(agg: dict[tuple, list], keys: tuple[str, ...], n_steps: int) -> list[dict]:
    """Rows of an aggregate {key tuple: [us, count]}, heaviest first: the key's fields, then ms and count per step."""
    return [{**dict(zip(keys, key)), "ms_per_step": us / 1000 / n_steps, "count_per_step": n / n_steps}
            for key, (us, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])]


def analyse_trace(trace: dict | str | Path, baseline_step_ms: float | None = None, meta: dict | None = None,
                  top_k: int = 15, trace_path: str | None = None, skip_steps: int = 0) -> Report:
    """Diagnose the ProfilerStep ranges of an exported torch.profiler Chrome trace.

    skip_steps leaves out the first recorded steps (first-call effects caught in the window); the GPU work they
    launched is then not counted, though it still occupies the GPU inside the window."""
    if not isinstance(trace, dict):
        trace_path = trace_path or str(trace)
        trace = load_trace(trace)
    meta = {**_parse_meta(trace), **(meta or {})}
    if baseline_step_ms is None and meta.get("baseline_step_ms") is not None:
        baseline_step_ms = float(meta["baseline_step_ms"])
    env = _env_from_trace(trace, meta)
    events = _events(trace)
    host = [e for e in events if e.cat in ("cpu_op", "user_annotation", "runtime")]
    gpu_rows = [e for e in events if e.cat in GPU_CATS]
    _link_parents(host)

    notes: list[str] = []
    steps = sorted((e for e in host if e.cat in ("user_annotation", "cpu_op") and _STEP_RE.match(e.name)), key=lambda e: e.ts)
    if not steps:
        notes.append("the trace has no ProfilerStep ranges (no schedule / step()): the whole trace is one step")
        lo = min((e.ts for e in host), default=0.0)
        hi = max((e.end for e in host), default=0.0)
        steps = [Event("ProfilerStep#0", "user_annotation", lo, hi - lo, None, None, {})]
    if skip_steps:
        if skip_steps >= len(steps):
            raise ValueError(f"skip_steps={skip_steps} leaves none of the trace's {len(steps)} steps")
        notes.append(f"the first {skip_steps} recorded step(s) are left out of this analysis")
        steps = steps[skip_steps:]
    step_starts = [s.ts for s in steps]
    win_lo, win_hi = steps[0].ts, steps[-1].end
    n_steps = len(steps)
    step_ms = [s.dur / 1000 for s in steps]

    def step_index(t: float) -> int | None:
        i = bisect.bisect_right(step_starts, t) - 1
        return i if 0 <= i < n_steps and t <= steps[i].end + _EPS else None

    # Phases: the record_function ranges directly inside a ProfilerStep (data, forward, backward, optimizer).
    step_ids = {id(s) for s in steps}
    phases = sorted((e for e in host if e.cat == "user_annotation" and e.parent is not None and id(e.parent) in step_ids),
                    key=lambda e: e.ts)
    phase_starts = [p.ts for p in phases]

    def phase_at(t: float) -> str:
        i = bisect.bisect_right(phase_starts, t) - 1
        return phases[i].name if i >= 0 and t <= phases[i].end + _EPS else "(outside ranges)"

    runtime_by_corr = {e.args["correlation"]: e for e in host if e.cat == "runtime" and "correlation" in e.args}

    # ---- link each GPU row to its launch, ops and step ---------------------------------------------------------
    rows = []
    for g in gpu_rows:
        launch = runtime_by_corr.get(g.args.get("correlation"))
        t_issue = launch.ts if launch is not None else g.ts
        rows.append((g, launch, _cpu_ops(launch.parent if launch else None), step_index(t_issue)))
    counted = [r for r in rows if r[3] is not None]
    unlinked = sum(1 for r in rows if r[1] is None)
    if unlinked:
        notes.append(f"{unlinked} of {len(rows)} GPU rows are unlinked (no launch call with their correlation id): "
                     "they are placed by their own start time and their idle time before them counts as gaps")
    per_step_first_last: dict[int, list[float]] = {}  # step -> [first start, last end] of the GPU rows it launched
    for g, _, _, s in counted:
        fl = per_step_first_last.setdefault(s, [g.ts, g.end])
        fl[0], fl[1] = min(fl[0], g.ts), max(fl[1], g.end)

    times = _completion_periods(steps, per_step_first_last) if gpu_rows else step_ms
    median = _median(times)
    report = Report(env=env, gpu=bool(gpu_rows), steps=n_steps, step_ms=times, step_ms_median=median,
                    step_ms_min=min(times), step_ms_max=max(times), host_step_ms_median=_median(step_ms),
                    baseline_step_ms=baseline_step_ms,
                    profiler_overhead_pct=100 * (median / baseline_step_ms - 1) if baseline_step_ms else None,
                    # first-call effects (lazy loading, autotuning) are host-side: compare host ranges
                    first_step_ratio=step_ms[0] / _median(step_ms[1:]) if n_steps >= 3 else None,
                    notes=notes, trace_path=trace_path)
    if not gpu_rows:
        _analyse_cpu(report, host, win_lo, win_hi, top_k)
        _findings(report)
        return report

    # ---- partition of GPU time -----------------------------------------------------------------------------
    cat_ms: dict[str, float] = {c: 0.0 for c in CATEGORIES}
    cat_n: Counter = Counter()
    impl_us: Counter = Counter()
    # Transposes and casts by launching op and range: category -> {(op, phase): [us, count]}.
    copy_sites: dict[str, dict[tuple, list]] = {c: defaultdict(lambda: [0.0, 0]) for c in ("transpose", "cast")}
    memcpys: dict[str, list] = defaultdict(lambda: [0.0, 0, 0.0, Counter()])
    kernels: dict[str, dict] = {}
    for g, launch, ops, _ in counted:
        op_name = op_label(ops)
        phase = phase_at(launch.ts) if launch is not None else "(unlinked)"
        category = "other"
        if g.cat == "memcpy":
            category = "memcpy"
            m = memcpys[g.name]
            m[0] += g.dur
            m[1] += 1
            m[2] += float(g.args.get("bytes", 0) or 0)
            m[3][op_name] += 1
        elif g.cat == "kernel":
            if TRANSPOSE_KERNELS.search(g.name):
                category = "transpose"
            elif COPY_KERNELS.search(g.name):
                category = _copy_kind(ops) or "other"
            if category == "other":
                if DEPTHWISE_KERNEL_NAMES.search(g.name) or any(_is_depthwise_conv(op) for op in ops):
                    category = "depthwise"
                    impl_us[implementation_of(g.name, ops)] += g.dur
            if category in copy_sites:
                site = copy_sites[category][(op_name, phase)]
                site[0] += g.dur
                site[1] += 1
        cat_ms[category] += g.dur
        cat_n[category] += 1
        # One kernel can serve several categories (cuDNN's implicit GEMM runs depthwise and pointwise convs).
        k = kernels.setdefault((g.name, category), {"us": 0.0, "n": 0, "by_site": Counter()})
        k["us"] += g.dur
        k["n"] += 1
        shaped = next((op for op in ops if op.args.get("Input Dims")), None)
        shapes = json.dumps([d for d in shaped.args["Input Dims"] if d]) if shaped else "[]"
        k["by_site"][(op_name, shapes)] += g.dur
    total_us = sum(cat_ms.values())
    report.gpu_ms_per_step = total_us / 1000 / n_steps
    for c in CATEGORIES:
        report.categories[c] = CategoryShare(ms_per_step=cat_ms[c] / 1000 / n_steps,
                                             pct=100 * cat_ms[c] / total_us if total_us else 0.0,
                                             count_per_step=cat_n[c] / n_steps)
    dw_total = sum(impl_us.values())
    report.depthwise_impls = {impl: 100 * us / dw_total for impl, us in impl_us.most_common()} if dw_total else {}
    report.depthwise_implementation = impl_us.most_common(1)[0][0] if impl_us else None
    report.transposes = _site_rows(copy_sites["transpose"], ("op", "phase"), n_steps)
    report.casts = _site_rows(copy_sites["cast"], ("op", "phase"), n_steps)
    report.casts_per_step = cat_n["cast"] / n_steps
    for name, (us, n, nbytes, ops_c) in sorted(memcpys.items(), key=lambda kv: -kv[1][0]):
        report.memcpys.append({"kind": name, "ms_per_step": us / 1000 / n_steps, "count_per_step": n / n_steps,
                               "MB_per_step": nbytes / 1e6 / n_steps, "pageable": "Pageable" in name,
                               "ops": ", ".join(op for op, _ in ops_c.most_common(3))})
    report.pageable_copies_per_step = sum(m["count_per_step"] for m in report.memcpys if m["pageable"])
    spans = [b - a for a, b in per_step_first_last.values()]
    report.gpu_span_ms_per_step = _median(spans) / 1000 if spans else None

    report.top_kernels = []
    for (name, category), k in sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:top_k]:
        (top_op, shapes), _ = k["by_site"].most_common(1)[0]
        report.top_kernels.append({
            "kernel": name, "category": category, "ms_per_step": k["us"] / 1000 / n_steps,
            "pct": 100 * k["us"] / total_us if total_us else 0.0, "calls_per_step": k["n"] / n_steps,
            "avg_us": k["us"] / k["n"], "op": top_op, "shapes": json.loads(shapes),
            "other_sites": len(k["by_site"]) - 1,  # further (op, shapes) pairs that ran this kernel
        })

    # ---- launch-bound ---------------------------------------------------------------------------------------
    # A CUDA graph launches many kernels with one call: comparing each kernel with that call says nothing.
    launched = [(g, launch) for g, launch, _, _ in counted
                if g.cat == "kernel" and launch is not None and "GraphLaunch" not in launch.name]
    report.kernels_per_step = sum(1 for r in counted if r[0].cat == "kernel") / n_steps
    short = sum(1 for g, launch in launched if g.dur < launch.dur)
    report.short_kernels_per_step = short / n_steps
    report.short_kernel_pct = 100 * short / len(launched) if launched else 0.0
    report.median_kernel_us = _median([g.dur for g, _ in launched]) if launched else 0.0
    report.median_launch_us = _median([launch.dur for _, launch in launched]) if launched else 0.0
    report.launch_bound = report.short_kernel_pct >= 50
    per_step = Counter(st for g, _, _, st in counted if g.cat == "kernel")
    if n_steps >= 3:
        report.first_step_extra_kernels = per_step[0] - _median([per_step[i] for i in range(1, n_steps)])
    # Only a kernel's first launch can load its module; a later slow launch is a full launch queue (GPU-bound).
    first_launch: dict[str, tuple] = {}  # kernel name -> (launch, ops, step) of its first launch
    for g, launch, ops, s in sorted((r for r in counted if r[0].cat == "kernel" and r[1] is not None), key=lambda r: r[1].ts):
        first_launch.setdefault(g.name, (launch, ops, s))
    slow = {id(launch): (launch, ops, s) for launch, ops, s in first_launch.values() if launch.dur > SLOW_LAUNCH_US}
    by_slow: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    for launch, ops, s in slow.values():
        key = (launch.name, op_label(ops), s)
        by_slow[key][0] = max(by_slow[key][0], launch.dur)
        by_slow[key][1] += 1
    report.slow_launches = [{"call": c, "op": op, "step": st, "max_ms": us / 1000, "count": n}
                            for (c, op, st), (us, n) in sorted(by_slow.items(), key=lambda kv: -kv[1][0])]

    # ---- syncs ------------------------------------------------------------------------------------------------
    # A copy from or to pageable memory blocks the host as well: the driver stages it through a pinned buffer.
    pageable_calls = {id(launch) for g, launch, _, _ in counted if launch is not None and g.cat == "memcpy" and "Pageable" in g.name}
    # The step runs on the thread of the ProfilerStep ranges and on autograd's backward thread(s); a sync on any
    # other thread (a loader's worker) does not stall the step.
    step_threads = {(steps[0].pid, steps[0].tid)} | {(e.pid, e.tid) for e in host if e.cat == "cpu_op"
                                                      and (e.name.startswith(_AUTOGRAD_PREFIX) or "backward" in e.name.lower())}
    on_step_thread = (lambda e: True) if steps[0].tid is None else (lambda e: (e.pid, e.tid) in step_threads)
    in_window = [e for e in host if e.cat == "runtime" and step_index(e.ts) is not None]
    blocking_calls = [e for e in in_window if SYNC_CALLS.match(e.name) or id(e) in pageable_calls]
    syncs = [e for e in blocking_calls if on_step_thread(e)]
    report.other_thread_syncs_per_step = (len(blocking_calls) - len(syncs)) / n_steps
    other_thread_calls = [e for e in in_window if not on_step_thread(e)]
    report.other_thread_cuda_calls_per_step = len(other_thread_calls) / n_steps
    device_syncs = [e.dur for e in other_thread_calls if e.name in DEVICE_SYNC_CALLS]
    report.other_thread_device_syncs_per_step = len(device_syncs) / n_steps
    report.other_thread_device_sync_ms_median = statistics.median(device_syncs) / 1000 if device_syncs else 0.0
    report.streams_with_work = len({(g.args.get("device"), g.args["stream"]) for g, _, _, _ in counted if "stream" in g.args})
    if meta.get("cuda_work_queues") is not None:
        report.work_queues = int(meta["cuda_work_queues"])
    by_sync: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    for e in syncs:
        call = f"{e.name} (pageable)" if id(e) in pageable_calls and not SYNC_CALLS.match(e.name) else e.name
        key = (call, op_label(_cpu_ops(e.parent)), phase_at(e.ts))
        by_sync[key][0] += e.dur
        by_sync[key][1] += 1
    report.syncs = _site_rows(by_sync, ("call", "op", "phase"), n_steps)
    report.syncs_per_step = len(syncs) / n_steps

    # ---- busy / idle over the window: first step start to the end of the last GPU row it launched ------------
    span_hi = max([win_hi] + [hi for _, hi in per_step_first_last.values()])
    report.window_ms = (span_hi - win_lo) / 1000
    clipped = [(max(g.ts, win_lo), min(g.end, span_hi)) for g in gpu_rows if g.end > win_lo and g.ts < span_hi]
    busy = _interval_union([iv for iv in clipped if iv[1] > iv[0]])
    busy_us = sum(b - a for a, b in busy)
    # Blocking host calls: syncs and copies from pageable memory (the host stages the data itself).
    blocking = _interval_union([(e.ts, e.end) for e in syncs])
    blocking_starts = [a for a, _ in blocking]
    data_ranges = _interval_union([(p.ts, p.end) for p in phases if p.name == "data"])
    data_starts = [a for a, _ in data_ranges]
    starts_sorted = sorted(gpu_rows, key=lambda g: g.ts)
    start_ts = [g.ts for g in starts_sorted]
    host_wait = host_sync = host_data = gap = 0.0
    edges = [win_lo] + [x for iv in busy for x in iv] + [span_hi]
    for a, b in zip(edges[0::2], edges[1::2]):
        if b <= a:
            continue
        # The GPU row that ends this idle stretch, and when the host issued it.
        i = bisect.bisect_left(start_ts, b - _EPS)
        nxt = starts_sorted[i] if i < len(starts_sorted) and b < span_hi else None
        launch = runtime_by_corr.get(nxt.args.get("correlation")) if nxt is not None else None
        if nxt is not None and launch is None:
            gap += b - a
            continue
        issued = min(b, max(a, launch.ts)) if launch is not None else b
        wait = issued - a
        host_wait += wait
        host_sync += _overlap(a, issued, blocking, blocking_starts)
        host_data += _overlap(a, issued, data_ranges, data_starts)
        gap += b - issued
    window_us = span_hi - win_lo
    if window_us > 0:
        report.busy_pct = 100 * busy_us / window_us
        report.idle_pct = 100 - report.busy_pct
        report.idle_host_pct = 100 * host_wait / window_us
        report.idle_host_sync_pct = 100 * host_sync / window_us
        report.idle_host_data_pct = 100 * host_data / window_us
        report.idle_gap_pct = 100 * gap / window_us
    _findings(report)
    return report


def _analyse_cpu(report: Report, host: list[Event], win_lo: float, win_hi: float, top_k: int) -> None:
    """Self CPU time per op over the steps (a CPU run has no device rows)."""
    self_us: dict[int, float] = {}
    ops = [e for e in host if e.cat == "cpu_op" and win_lo - _EPS <= e.ts <= win_hi + _EPS]
    for e in ops:
        self_us[id(e)] = self_us.get(id(e), 0.0) + e.dur
        if e.parent is not None and e.parent.cat == "cpu_op":
            self_us[id(e.parent)] = self_us.get(id(e.parent), 0.0) - e.dur
    agg: dict[str, list] = {}
    for e in ops:
        a = agg.setdefault(e.name, [0.0, 0, None])
        a[0] += self_us[id(e)]
        a[1] += 1
        if a[2] is None and e.args.get("Input Dims"):
            a[2] = [d for d in e.args["Input Dims"] if d]
    total = sum(max(0.0, a[0]) for a in agg.values())
    for name, (us, n, shapes) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:top_k]:
        report.top_ops.append({"op": name, "self_ms_per_step": us / 1000 / report.steps,
                               "pct": 100 * us / total if total else 0.0, "calls_per_step": n / report.steps,
                               "shapes": shapes or []})


# =============================================================================================================
# Findings: each states a measured fact and, where one applies, what to change.
# =============================================================================================================


def _meta_flag(env: dict, *keys: str) -> Any:
    for k in keys:
        if k in env:
            return env[k]
    return None


def _channels_last(env: dict) -> bool | None:
    fmt = _meta_flag(env, "memory_format", "memory format")
    if fmt is not None:
        return "last" in str(fmt).lower() or "nhwc" in str(fmt).lower()
    cl = env.get("channels_last")
    return None if cl is None else bool(cl) and str(cl).lower() not in ("false", "0")


def _findings(r: Report) -> None:
    F = r.findings
    slow_first = r.first_step_ratio is not None and r.first_step_ratio > 1.5
    if slow_first or r.first_step_extra_kernels > 0 or r.slow_launches:
        parts = []
        if r.first_step_ratio is not None:
            parts.append(f"the first profiled step took {r.step_ms[0]:.2f} ms, {r.first_step_ratio:.1f}x the later steps' median "
                         f"({_median(r.step_ms[1:]):.2f} ms)")
        if r.first_step_extra_kernels > 0:
            parts.append(f"it ran {r.first_step_extra_kernels:.0f} more kernels than a later step (cuDNN autotune tries candidates)")
        if r.slow_launches:
            n = sum(x["count"] for x in r.slow_launches)
            top = r.slow_launches[0]
            parts.append(f"{n} launch calls took over {SLOW_LAUNCH_US / 1000:.0f} ms (longest {top['max_ms']:.1f} ms, {top['call']} "
                         f"from {top['op']}: lazy module loading happens inside the first launch of a kernel)")
        F.append(Finding("first-call effects in the window", "; ".join(parts),
                         "the figures below are not steady state: raise profiler.skip_first / profiler.warmup, or analyse "
                         "without the first step (scripts/diagnose.py TRACE --skip-steps 1); per-op 'CUDA time' of such "
                         "steps (and of any asynchronous run) is no measure of a kernel", "warn"))
    if r.profiler_overhead_pct is not None:
        detail = (f"profiled steps: median {r.step_ms_median:.2f} ms vs {r.baseline_step_ms:.2f} ms without the profiler "
                  f"({r.profiler_overhead_pct:+.1f}%)")
        hint = ("the profiler inflates host-side times: the step time reported is the unprofiled one; in the profiled "
                "steps trust the GPU rows and the ratios more than the absolute times and the GPU-idle share"
                if r.profiler_overhead_pct > 10 else "")
        F.append(Finding("profiler overhead", detail, hint, "warn" if r.profiler_overhead_pct > 10 else "info"))
    if not r.gpu:
        if str(r.env.get("device", "")).startswith("cuda"):
            F.append(Finding("no GPU rows", "the run was on CUDA but the trace has no kernel rows: CUPTI was unavailable or "
                             "CUDA activity was not traced, so only CPU ops were profiled", "check that CUPTI loads", "warn"))
        else:
            F.append(Finding("no GPU", "this trace has no GPU activity (a CPU run): only CPU ops were profiled"))
        return
    cats = r.categories
    if r.launch_bound:
        F.append(Finding("launch-bound",
                         f"{r.short_kernels_per_step:.0f} of {r.kernels_per_step:.0f} kernels per step ({r.short_kernel_pct:.0f}%) are "
                         f"shorter than their launch (median kernel {r.median_kernel_us:.1f} us, median launch {r.median_launch_us:.1f} us)",
                         "launch-bound: try torch.compile / CUDA graphs / a larger batch", "warn"))
    if r.idle_host_pct >= 20:
        parts = []
        if r.idle_host_sync_pct >= 1:
            parts.append(f"{r.idle_host_sync_pct:.0f}% while the host sat in blocking calls")
        if r.idle_host_data_pct >= 1:
            parts.append(f"{r.idle_host_data_pct:.0f}% while the host was loading data")
        F.append(Finding("GPU waits for the host",
                         f"the GPU is idle {r.idle_host_pct:.0f}% of the window with nothing queued"
                         + (f" ({'; '.join(parts)})" if parts else ""),
                         "the host is the bottleneck: remove syncs, feed data faster, or cut launches (torch.compile / CUDA graphs)"
                         + (f"; part of this is the profiler's own host overhead ({r.profiler_overhead_pct:+.0f}% step time)"
                            if r.profiler_overhead_pct is not None and r.profiler_overhead_pct > 10 else ""),
                         "warn"))
    dw = cats["depthwise"]
    if r.depthwise_implementation:
        mix = ", ".join(f"{impl} {pct:.0f}%" for impl, pct in r.depthwise_impls.items())
        backend = r.env.get("backend")
        detail = f"depthwise kernels are {dw.pct:.1f}% of GPU time ({dw.ms_per_step:.3f} ms/step), run by: {mix}"
        hint, sev = "", "info"
        expected = {"cudnn": "cuDNN", "custom": "custom (kernels/)"}.get(str(backend))
        if expected and r.depthwise_implementation != expected:
            hint, sev = f"backend={backend} was requested but {r.depthwise_implementation} kernels did most of the depthwise work", "warn"
        F.append(Finding("depthwise implementation", detail, hint, sev))
    tr = cats["transpose"]
    if tr.count_per_step > 0:
        where = ", ".join(f"{t['op']} in {t['phase']}" for t in r.transposes[:3])
        cl = _channels_last(r.env)
        if cl:
            hint = f"the model is channels_last, yet these ops transpose: check the layout of what reaches them ({where})"
        else:
            hint = f"channels_last=true would remove the {tr.ms_per_step:.3f} ms of transposes per step"
        F.append(Finding("layout transposes",
                         f"{tr.count_per_step:.0f} transpose kernels per step, {tr.ms_per_step:.3f} ms ({tr.pct:.1f}% of GPU time), "
                         f"launched by {where}", hint, "warn" if tr.pct >= 2 else "info"))
    ca = cats["cast"]
    if ca.count_per_step > 0:
        where = ", ".join(f"{c['op']} in {c['phase']}" for c in r.casts[:3])
        F.append(Finding("dtype casts",
                         f"{ca.count_per_step:.0f} cast kernels per step, {ca.ms_per_step:.3f} ms ({ca.pct:.1f}% of GPU time), launched by {where}",
                         "autocast re-casts weights every step: torch.compile fuses the casts into neighbouring kernels; "
                         "cast the input batch once in the loader", "warn" if ca.pct >= 5 else "info"))
    mc = cats["memcpy"]
    pageable = [m for m in r.memcpys if m["pageable"]]
    if pageable:
        desc = "; ".join(f"{m['kind']}: {m['count_per_step']:.0f}/step, {m['MB_per_step']:.1f} MB, {m['ms_per_step']:.3f} ms (from {m['ops']})"
                         for m in pageable)
        F.append(Finding("pageable host copies", desc,
                         "this copy is pageable: pin it (pin_memory=True in the DataLoader) and copy with non_blocking=True", "warn"))
    if mc.pct >= 10:
        F.append(Finding("copies dominate",
                         f"copies are {mc.pct:.0f}% of GPU time ({mc.ms_per_step:.3f} ms/step) against {100 - mc.pct:.0f}% compute",
                         "keep the data on the GPU between steps, or overlap the copy with compute (pinned memory, a side stream)",
                         "warn"))
    if r.syncs_per_step > 0:
        where = ", ".join(f"{s['call']} from {s['op']} in {s['phase']}" for s in r.syncs[:3])
        hints = []
        for s in r.syncs[:3]:
            if "_local_scalar_dense" in s["op"] and s["phase"] == "optimizer":
                hints.append("GradScaler.step() reads found_inf back every step (fp16 loss scaling; bf16 needs no scaler)")
            elif "copy_" in s["op"] or "pageable" in s["call"]:
                hints.append(f"the copy in {s['phase']} touches pageable memory: pin it and pass non_blocking=True")
        hints.append("each sync stalls the host until the GPU drains: read values back less often (e.g. the loss every N steps)")
        F.append(Finding("blocking synchronisations",
                         f"{r.syncs_per_step:.0f} per step ({sum(s['ms_per_step'] for s in r.syncs):.3f} ms of host time): {where}",
                         "; ".join(dict.fromkeys(hints)), "warn" if r.syncs_per_step >= 1 else "info"))
    if r.other_thread_cuda_calls_per_step >= 50:
        F.append(Finding("CUDA calls from other threads",
                         f"other threads of the process (a data loader's workers, e.g. DALI's decoders) made "
                         f"{r.other_thread_cuda_calls_per_step:.0f} CUDA API calls per step, "
                         f"{r.other_thread_syncs_per_step:.0f} of them blocking; those syncs stall only their own thread, "
                         f"but every call shares the CUDA context with the step's launches (median launch "
                         f"{r.median_launch_us:.1f} us here)",
                         "if the step is host-bound, compare the launch times with a run on synthetic data: contention "
                         "for the context slows the step's own launches; fewer loader threads or batched loader work help"))
    queues = r.work_queues if r.work_queues is not None else CUDA_DEFAULT_CONNECTIONS
    if r.streams_with_work > queues:
        known = "" if r.work_queues is not None else " (CUDA's default; the trace does not record the setting)"
        F.append(Finding("streams share hardware work queues",
                         f"{r.streams_with_work} CUDA streams ran work in these steps, but the process had {queues} "
                         f"hardware work queues{known}: streams beyond that share queues, and the work in one queue "
                         "runs in order, so independent streams wait behind each other (a loader's copies and kernels "
                         "behind the training kernels queued before them)",
                         "give the process 32 queues: perf.max_connections=32 (auto does it for data=dali), or "
                         "CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment before the process starts",
                         "warn"))
    if r.other_thread_device_syncs_per_step >= 0.5:
        F.append(Finding("device-wide syncs from other threads",
                         f"{r.other_thread_device_syncs_per_step:.1f} per step on threads other than the step's (median "
                         f"{r.other_thread_device_sync_ms_median:.2f} ms each): each waits for all work queued on the GPU, "
                         "the step's included, so whatever that thread does next waits for the training to drain",
                         "DALI takes each batch's buffer back only after such a sync (its DLTensorGraveyard); it stalls "
                         "DALI's buffer recycling, not the step, as long as the step does not wait for data (see the "
                         "data wait)",
                         "warn"))
    if r.gpu_span_ms_per_step and r.gpu_span_ms_per_step > 1.2 * r.host_step_ms_median:
        F.append(Finding("host runs ahead",
                         f"the GPU work a step launches spans {r.gpu_span_ms_per_step:.2f} ms, the host step "
                         f"{r.host_step_ms_median:.2f} ms: GPU-bound; host-side step times (and per-op CPU times) understate "
                         f"the true step time, {r.step_ms_median:.2f} ms from one step's completion to the next"))


# =============================================================================================================
# Markdown
# =============================================================================================================


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v).replace("|", "\\|")


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] * len(headers)) + "|"]
    out += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


_ENV_ORDER = ("gpu", "torch", "cuda", "cudnn", "mode", "backend", "precision", "memory_format", "batch_size",
              "resolution", "compile", "device")
_ENV_SKIP = ("profiler_schedule", "baseline_step_ms")


def _render_markdown(r: Report) -> str:
    out = ["# Profile report", ""]
    if r.trace_path:
        out += [f"Trace: `{r.trace_path}` (open in https://ui.perfetto.dev or chrome://tracing).", ""]
    if r.baseline_step_ms is not None:
        out += [f"Step time: **{r.baseline_step_ms:.2f} ms** without the profiler (median, this run); the {r.steps} profiled "
                f"steps took {r.step_ms_median:.2f} ms ({r.profiler_overhead_pct:+.1f}% profiler overhead).", ""]
    else:
        out += [f"Step time: **{r.step_ms_median:.2f} ms** (median of the {r.steps} profiled steps; not measured without "
                "the profiler, so the profiler's overhead is unknown).", ""]
    env_rows = [[k, r.env[k]] for k in _ENV_ORDER if k in r.env]
    env_rows += [[k, v] for k, v in r.env.items() if k not in _ENV_ORDER and k not in _ENV_SKIP]
    if "profiler_schedule" in r.env:
        env_rows.append(["profiler schedule", json.dumps(r.env["profiler_schedule"])])
    out += ["## Environment", "", _table(["", "value"], env_rows), ""]

    out += ["## Findings", ""]
    for f in r.findings:
        line = f"- **{f.title}**{' (warning)' if f.severity == 'warn' else ''}: {f.detail}."
        if f.hint:
            line += f" Hint: {f.hint}."
        out.append(line)
    out += [f"- note: {n}" for n in r.notes]
    out.append("")

    out += ["## Steps", ""]
    if r.baseline_step_ms is not None:
        rows = [["step time, ms (median, without the profiler)", r.baseline_step_ms]]
    else:
        rows = [["step time, ms (median of the profiled steps; no unprofiled measurement given)", r.step_ms_median]]
    rows += [["profiled steps", r.steps], ["profiled step ms, median", r.step_ms_median],
             ["profiled step ms, min / max", f"{r.step_ms_min:.3f} / {r.step_ms_max:.3f}"],
             ["spread (max-min)/median", f"{100 * (r.step_ms_max - r.step_ms_min) / r.step_ms_median:.1f}%" if r.step_ms_median else "-"]]
    if r.first_step_ratio is not None:
        rows.append(["first step / steady median", f"{r.first_step_ratio:.2f}x"])
    if r.profiler_overhead_pct is not None:
        rows.append(["profiler overhead (profiled vs unprofiled step)", f"{r.profiler_overhead_pct:+.1f}%"])
    rows.append(["host-side ProfilerStep range, median ms", r.host_step_ms_median])
    if r.gpu_span_ms_per_step is not None:
        rows.append(["GPU span of a step's work, median ms", r.gpu_span_ms_per_step])
    out += [_table(["", "value"], rows), "",
            "Step time without the profiler: the run's own meter (median time between step ends) over the steps just "
            "before the profiled window, in the same process; the profiler's host-side cost per op slows a host-bound "
            "loop, so the profiled steps serve the breakdowns below, not the step time. Profiled step time: from one "
            "step's completion to the next, where a step completes when its host range and the last GPU row it "
            "launched have both ended.", ""]

    if not r.gpu:
        out += ["## No GPU", "", "This trace has no GPU activity: only CPU ops were profiled, listed by self CPU time.", ""]
        out += [_table(["op", "self ms/step", "% of op time", "calls/step", "input shapes"],
                       [[o["op"], o["self_ms_per_step"], f"{o['pct']:.1f}", o["calls_per_step"], o["shapes"]] for o in r.top_ops]), ""]
    else:
        out += ["## GPU time by category", "",
                f"A partition of the {r.gpu_ms_per_step:.3f} ms of GPU rows (kernels, copies, memsets) per step; the shares add up to 100%.", ""]
        out += [_table(["category", "ms/step", "% of GPU time", "rows/step"],
                       [[CATEGORY_TITLES[c], s.ms_per_step, f"{s.pct:.1f}", s.count_per_step] for c, s in r.categories.items()]), ""]
        out += ["## GPU utilisation", "", f"Window: the profiled steps plus the GPU work they launched, {r.window_ms:.2f} ms.", ""]
        out += [_table(["", "% of window"], [
            ["GPU busy", f"{r.busy_pct:.1f}"],
            ["GPU idle", f"{r.idle_pct:.1f}"],
            ["  waiting for the host (nothing queued)", f"{r.idle_host_pct:.1f}"],
            ["    of which host in blocking calls (sync, pageable copy)", f"{r.idle_host_sync_pct:.1f}"],
            ["    of which host in the data range", f"{r.idle_host_data_pct:.1f}"],
            ["  gaps between queued kernels (launch latency)", f"{r.idle_gap_pct:.1f}"],
        ]), ""]
        out += [_table(["launches", "value"], [
            ["kernels per step", f"{r.kernels_per_step:.0f}"],
            ["kernels shorter than their launch, per step", f"{r.short_kernels_per_step:.0f} ({r.short_kernel_pct:.0f}%)"],
            ["median kernel / launch us", f"{r.median_kernel_us:.1f} / {r.median_launch_us:.1f}"],
            ["launch-bound", "yes" if r.launch_bound else "no"],
        ]), ""]
    if r.gpu:
        if r.depthwise_impls:
            out += ["## Depthwise implementation", "", _table(["implementation", "% of depthwise time"],
                                                               [[k, f"{v:.1f}"] for k, v in r.depthwise_impls.items()]), ""]
        if r.transposes:
            out += ["## Layout transposes by launching op", "", _table(["op", "range", "ms/step", "kernels/step"],
                    [[t["op"], t["phase"], t["ms_per_step"], t["count_per_step"]] for t in r.transposes]), ""]
        if r.casts:
            out += ["## Casts by launching op", "", _table(["op", "range", "ms/step", "kernels/step"],
                    [[c["op"], c["phase"], c["ms_per_step"], c["count_per_step"]] for c in r.casts]), ""]
        if r.memcpys or r.syncs:
            out += ["## Copies and synchronisations", ""]
            if r.memcpys:
                out += [_table(["copy", "ms/step", "count/step", "MB/step", "launched by"],
                               [[m["kind"], m["ms_per_step"], m["count_per_step"], m["MB_per_step"], m["ops"]] for m in r.memcpys]), ""]
            if r.syncs:
                out += [_table(["blocking call", "op", "range", "host ms/step", "count/step"],
                               [[s["call"], s["op"], s["phase"], s["ms_per_step"], s["count_per_step"]] for s in r.syncs]), ""]
        out += [f"## Top {len(r.top_kernels)} kernels by self GPU time", "",
                "Launching op and input shapes: the heaviest of the (op, shapes) pairs that ran the kernel; "
                "+N counts the others.", "",
                _table(["kernel", "category", "ms/step", "% GPU", "calls/step", "avg us", "launching op", "input shapes"],
                       [[short_kernel_name(k["kernel"]), k["category"], k["ms_per_step"], f"{k['pct']:.1f}", k["calls_per_step"],
                         k["avg_us"], k["op"], f"{k['shapes']}" + (f" +{k['other_sites']}" if k["other_sites"] else "")]
                        for k in r.top_kernels]), ""]
    return "\n".join(out)
