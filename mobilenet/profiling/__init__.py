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

The package, in the order a trace flows through it: capture (StepProfiler), trace (reading and slimming traces),
window (steps, ranges, GPU rows linked to their launches), classify (kernel and op tables), intervals, stages (one
Report dataclass each), analysis (analyse_trace), findings (one function a finding), report and markdown.
"""

from .capture import REPORT_FILE, TRACE_FILE, StepProfiler
from .analysis import analyse_trace
from .classify import (CAST_OPS, CATEGORIES, CATEGORY_TITLES, CONV_OP_ARGS, COPY_KERNELS, CUSTOM_OP_NAMESPACE,
                       DEPTHWISE_IMPLEMENTATIONS, DEPTHWISE_KERNEL_NAMES, DEPTHWISE_OP_NAMES, DEVICE_SYNC_CALLS,
                       LAYOUT_OPS, SLOW_LAUNCH_US, SYNC_CALLS, TRANSPOSE_KERNELS, category_of, implementation_of,
                       op_label, short_kernel_name)
from .findings import FINDINGS, finding
from .report import CategoryShare, Finding, GpuTime, HostSyncs, Launches, Report, StepTiming, Utilisation
from .trace import GPU_CATS, META_KEY, Event, load_trace, save_trace, slim_trace

__all__ = [
    "StepProfiler", "TRACE_FILE", "REPORT_FILE", "META_KEY", "analyse_trace", "load_trace", "save_trace", "slim_trace",
    "Event", "GPU_CATS", "Report", "Finding", "CategoryShare", "StepTiming", "GpuTime", "Launches", "HostSyncs",
    "Utilisation", "FINDINGS", "finding", "CATEGORIES", "CATEGORY_TITLES", "implementation_of", "category_of",
    "op_label", "short_kernel_name", "DEPTHWISE_IMPLEMENTATIONS", "DEPTHWISE_KERNEL_NAMES", "DEPTHWISE_OP_NAMES",
    "CONV_OP_ARGS", "TRANSPOSE_KERNELS", "COPY_KERNELS", "CAST_OPS", "LAYOUT_OPS", "SYNC_CALLS", "DEVICE_SYNC_CALLS",
    "SLOW_LAUNCH_US", "CUSTOM_OP_NAMESPACE",
]
