"""analyse_trace: the stages over one exported trace, in order, gathered in a Report with its findings."""

from __future__ import annotations

from pathlib import Path

from . import stages
from .findings import add_findings
from .report import Report
from .trace import GPU_CATS, HOST_CATS, env_from_trace, link_parents, load_trace, parse_meta, trace_events
from .window import build_window, link_gpu_rows, select_steps


def analyse_trace(trace: dict | str | Path, baseline_step_ms: float | None = None, meta: dict | None = None,
                  top_k: int = 15, trace_path: str | None = None, skip_steps: int = 0) -> Report:
    """Diagnose the ProfilerStep ranges of an exported torch.profiler Chrome trace.

    skip_steps leaves out the first recorded steps (first-call effects caught in the window); the GPU work they
    launched is then not counted, though it still occupies the GPU inside the window."""
    if not isinstance(trace, dict):
        trace_path = trace_path or str(trace)
        trace = load_trace(trace)
    meta = {**parse_meta(trace), **(meta or {})}
    if baseline_step_ms is None and meta.get("baseline_step_ms") is not None:
        baseline_step_ms = float(meta["baseline_step_ms"])
    events = trace_events(trace)
    host = [e for e in events if e.cat in HOST_CATS]
    link_parents(host)
    notes: list[str] = []
    window = build_window(host, select_steps(host, skip_steps, notes))
    gpu = link_gpu_rows(host, [e for e in events if e.cat in GPU_CATS], window, notes)
    report = Report(env=env_from_trace(trace, meta), gpu=bool(gpu.rows), steps=window.n_steps,
                    timing=stages.step_timing(window, gpu, baseline_step_ms), notes=notes, trace_path=trace_path)
    if gpu.rows:
        threads = stages.step_threads(host, window)
        calls = stages.blocking_calls(host, window, gpu, threads)
        report.gpu_time = stages.gpu_time(gpu, window, top_k, threads)
        report.launches = stages.launches(gpu, window.n_steps, threads)
        report.host_syncs = stages.host_syncs(calls, gpu, window, meta, threads)
        report.utilisation = stages.utilisation(window, gpu, calls)
    else:
        report.top_ops = stages.cpu_top_ops(host, window, top_k)
    add_findings(report)
    return report
