"""What a diagnosis holds: one small dataclass per analysis stage, gathered in a Report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .markdown import render_markdown


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
class StepTiming:
    # Step time = from one step's completion to the next; a step completes when its host range and the last GPU
    # row it launched have both ended (see completion_periods). host_step_ms: the ProfilerStep ranges alone.
    step_ms: list[float] = field(default_factory=list)
    step_ms_median: float = float("nan")
    step_ms_min: float = float("nan")
    step_ms_max: float = float("nan")
    host_step_ms: list[float] = field(default_factory=list)
    host_step_ms_median: float = 0.0
    baseline_step_ms: float | None = None
    profiler_overhead_pct: float | None = None
    first_step_ratio: float | None = None
    gpu_span_ms_per_step: float | None = None  # from the first to the last GPU row launched by a step (median)


@dataclass
class GpuTime:
    """The partition of GPU activity time into CATEGORIES, and the heaviest kernels and copy sites."""

    gpu_ms_per_step: float = 0.0  # summed GPU activity time per step (the categories' total)
    categories: dict[str, CategoryShare] = field(default_factory=dict)
    depthwise_impls: dict[str, float] = field(default_factory=dict)  # implementation -> % of depthwise time
    depthwise_implementation: str | None = None
    transposes: list[dict] = field(default_factory=list)  # by launching op
    casts: list[dict] = field(default_factory=list)
    casts_per_step: float = 0.0
    memcpys: list[dict] = field(default_factory=list)  # by kind (HtoD pageable, ...)
    pageable_copies_per_step: float = 0.0
    top_kernels: list[dict] = field(default_factory=list)


@dataclass
class Launches:
    """The step's kernel launches (those of the threads that run it; a loader's are in GpuTime's "loader")."""
    kernels_per_step: float = 0.0
    short_kernels_per_step: float = 0.0
    short_kernel_pct: float = 0.0
    median_kernel_us: float = 0.0
    median_launch_us: float = 0.0
    launch_bound: bool = False
    # First-call effects inside the window: extra kernels in the first step (cuDNN autotune tries candidates)
    # and launch calls slower than SLOW_LAUNCH_US (lazy module loading happens inside the first launch).
    first_step_extra_kernels: float = 0.0
    slow_launches: list[dict] = field(default_factory=list)


@dataclass
class HostSyncs:
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
    step_streams_with_work: int = 0  # of them, streams whose work the step's own threads launched
    work_queues: int | None = None


@dataclass
class Utilisation:
    """Busy and idle shares of the window: the profiled steps plus the GPU work they launched."""

    window_ms: float = 0.0
    busy_pct: float = 0.0
    idle_pct: float = 0.0
    idle_host_pct: float = 0.0  # nothing queued: the GPU waited for the host to launch
    idle_host_sync_pct: float = 0.0  # ... while the host sat in a blocking call (sync, pageable copy)
    idle_host_data_pct: float = 0.0  # ... while the host was in the "data" range
    idle_gap_pct: float = 0.0  # work was already queued: launch latency and gaps between kernels


@dataclass
class Report:
    env: dict[str, Any]
    gpu: bool
    steps: int
    timing: StepTiming
    gpu_time: GpuTime = field(default_factory=GpuTime)
    launches: Launches = field(default_factory=Launches)
    host_syncs: HostSyncs = field(default_factory=HostSyncs)
    utilisation: Utilisation = field(default_factory=Utilisation)
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
        return self.timing.baseline_step_ms if self.timing.baseline_step_ms is not None else self.timing.step_ms_median

    def markdown(self) -> str:
        return render_markdown(self)
