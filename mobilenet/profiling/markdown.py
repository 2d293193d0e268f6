"""The Report as markdown: one function a section, in the order the report shows them."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from .classify import CATEGORY_TITLES, short_kernel_name
from .trace import UNPROFILED, UNPROFILED_GRAPH

if TYPE_CHECKING:
    from .report import Report


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v).replace("|", "\\|")


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] * len(headers)) + "|"]
    out += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


_ENV_ORDER = ("tree", "gpu", "torch", "cuda", "cudnn", "mode", "backend", "precision", "memory_format", "batch_size",
              "resolution", "compile", "device")
_ENV_SKIP = ("profiler_schedule", "baseline_step_ms")


def _header(r: Report) -> list[str]:
    timing = r.timing
    out = ["# Profile report", ""]
    if r.trace_path:
        out += [f"Trace: `{r.trace_path}` (open in https://ui.perfetto.dev or chrome://tracing).", ""]
    if timing.baseline_step_ms is not None:
        eager_only = (" Both are eager steps: the profiler traces them so, while this run without it replays one CUDA "
                      "graph per step; that step's time is the summary's of the same command without the profiler."
                      if r.env.get(UNPROFILED) == UNPROFILED_GRAPH else "")
        out += [f"Step time: **{timing.baseline_step_ms:.2f} ms** without the profiler (median, this run); the {r.steps} profiled "
                f"steps took {timing.step_ms_median:.2f} ms ({timing.profiler_overhead_pct:+.1f}% profiler overhead)."
                + eager_only, ""]
    else:
        out += [f"Step time: **{timing.step_ms_median:.2f} ms** (median of the {r.steps} profiled steps; not measured without "
                "the profiler, so the profiler's overhead is unknown).", ""]
    return out


def _environment(r: Report) -> list[str]:
    env_rows = [[k, r.env[k]] for k in _ENV_ORDER if k in r.env]
    env_rows += [[k, v] for k, v in r.env.items() if k not in _ENV_ORDER and k not in _ENV_SKIP]
    if "profiler_schedule" in r.env:
        env_rows.append(["profiler schedule", json.dumps(r.env["profiler_schedule"])])
    return ["## Environment", "", _table(["", "value"], env_rows), ""]


def _findings(r: Report) -> list[str]:
    out = ["## Findings", ""]
    for f in r.findings:
        line = f"- **{f.title}**{' (warning)' if f.severity == 'warn' else ''}: {f.detail}."
        if f.hint:
            line += f" Hint: {f.hint}."
        out.append(line)
    out += [f"- note: {n}" for n in r.notes]
    out.append("")
    return out


def _steps(r: Report) -> list[str]:
    timing = r.timing
    if timing.baseline_step_ms is not None:
        rows = [["step time, ms (median, without the profiler)", timing.baseline_step_ms]]
    else:
        rows = [["step time, ms (median of the profiled steps; no unprofiled measurement given)", timing.step_ms_median]]
    rows += [["profiled steps", r.steps], ["profiled step ms, median", timing.step_ms_median],
             ["profiled step ms, min / max", f"{timing.step_ms_min:.3f} / {timing.step_ms_max:.3f}"],
             ["spread (max-min)/median", f"{100 * (timing.step_ms_max - timing.step_ms_min) / timing.step_ms_median:.1f}%" if timing.step_ms_median else "-"]]
    if timing.first_step_ratio is not None:
        rows.append(["first step's host range / later steps' median", f"{timing.first_step_ratio:.2f}x"])
    if timing.profiler_overhead_pct is not None:
        rows.append(["profiler overhead (profiled vs unprofiled step)", f"{timing.profiler_overhead_pct:+.1f}%"])
    rows.append(["host-side ProfilerStep range, median ms", timing.host_step_ms_median])
    if timing.gpu_span_ms_per_step is not None:
        rows.append(["GPU span of a step's work, median ms", timing.gpu_span_ms_per_step])
    return ["## Steps", "", _table(["", "value"], rows), "",
            "Step time without the profiler: the run's own meter (median time between step ends) over the steps just "
            "before the profiled window, in the same process; the profiler's host-side cost per op slows a host-bound "
            "loop, so the profiled steps serve the breakdowns below, not the step time. Profiled step time: from one "
            "step's completion to the next, where a step completes when its host range and the last GPU row it "
            "launched have both ended.", ""]


def _cpu_ops(r: Report) -> list[str]:
    return ["## No GPU", "", "This trace has no GPU activity: only CPU ops were profiled, listed by self CPU time.", "",
            _table(["op", "self ms/step", "% of op time", "calls/step", "input shapes"],
                   [[o["op"], o["self_ms_per_step"], f"{o['pct']:.1f}", o["calls_per_step"], o["shapes"]] for o in r.top_ops]), ""]


def _gpu_categories_and_utilisation(r: Report) -> list[str]:
    launches, gpu_time, util = r.launches, r.gpu_time, r.utilisation
    out = ["## GPU time by category", "",
           f"A partition of the {gpu_time.gpu_ms_per_step:.3f} ms of GPU rows (kernels, copies, memsets) per step; the shares add up to 100%.", ""]
    out += [_table(["category", "ms/step", "% of GPU time", "rows/step"],
                   [[CATEGORY_TITLES[c], s.ms_per_step, f"{s.pct:.1f}", s.count_per_step] for c, s in gpu_time.categories.items()]), ""]
    out += ["## GPU utilisation", "", f"Window: the profiled steps plus the GPU work they launched, {util.window_ms:.2f} ms.", ""]
    out += [_table(["", "% of window"], [
        ["GPU busy", f"{util.busy_pct:.1f}"],
        ["GPU idle", f"{util.idle_pct:.1f}"],
        ["  waiting for the host (nothing queued)", f"{util.idle_host_pct:.1f}"],
        ["    of which host in blocking calls (sync, pageable copy)", f"{util.idle_host_sync_pct:.1f}"],
        ["    of which host in the data range", f"{util.idle_host_data_pct:.1f}"],
        ["  gaps between queued kernels (launch latency)", f"{util.idle_gap_pct:.1f}"],
    ]), ""]
    out += [_table(["launches", "value"], [
        ["kernels per step", f"{launches.kernels_per_step:.0f}"],
        ["kernels shorter than their launch, per step", f"{launches.short_kernels_per_step:.0f} ({launches.short_kernel_pct:.0f}%)"],
        ["median kernel / launch us", f"{launches.median_kernel_us:.1f} / {launches.median_launch_us:.1f}"],
        ["launch-bound", "yes" if launches.launch_bound else "no"],
    ]), ""]
    return out


def _gpu_sites(r: Report) -> list[str]:
    gpu_time, host_syncs = r.gpu_time, r.host_syncs
    out = []
    if gpu_time.depthwise_impls:
        out += ["## Depthwise implementation", "", _table(["implementation", "% of depthwise time"],
                                                           [[k, f"{v:.1f}"] for k, v in gpu_time.depthwise_impls.items()]), ""]
    if gpu_time.transposes:
        out += ["## Layout transposes by launching op", "", _table(["op", "range", "ms/step", "kernels/step"],
                [[t["op"], t["phase"], t["ms_per_step"], t["count_per_step"]] for t in gpu_time.transposes]), ""]
    if gpu_time.casts:
        out += ["## Casts by launching op", "", _table(["op", "range", "ms/step", "kernels/step"],
                [[c["op"], c["phase"], c["ms_per_step"], c["count_per_step"]] for c in gpu_time.casts]), ""]
    if gpu_time.memcpys or host_syncs.syncs:
        out += ["## Copies and synchronisations", ""]
        if gpu_time.memcpys:
            out += [_table(["copy", "ms/step", "count/step", "MB/step", "launched by"],
                           [[m["kind"], m["ms_per_step"], m["count_per_step"], m["MB_per_step"], m["ops"]] for m in gpu_time.memcpys]), ""]
        if host_syncs.syncs:
            out += [_table(["blocking call", "op", "range", "host ms/step", "count/step"],
                           [[s["call"], s["op"], s["phase"], s["ms_per_step"], s["count_per_step"]] for s in host_syncs.syncs]), ""]
    return out


def _top_kernels(r: Report) -> list[str]:
    gpu_time = r.gpu_time
    return [f"## Top {len(gpu_time.top_kernels)} kernels by self GPU time", "",
            "Launching op and input shapes: the heaviest of the (op, shapes) pairs that ran the kernel; "
            "+N counts the others.", "",
            _table(["kernel", "category", "ms/step", "% GPU", "calls/step", "avg us", "launching op", "input shapes"],
                   [[short_kernel_name(k["kernel"]), k["category"], k["ms_per_step"], f"{k['pct']:.1f}", k["calls_per_step"],
                     k["avg_us"], k["op"], f"{k['shapes']}" + (f" +{k['other_sites']}" if k["other_sites"] else "")]
                    for k in gpu_time.top_kernels]), ""]


def render_markdown(r: Report) -> str:
    out = _header(r) + _environment(r) + _findings(r) + _steps(r)
    if not r.gpu:
        out += _cpu_ops(r)
    else:
        out += _gpu_categories_and_utilisation(r) + _gpu_sites(r) + _top_kernels(r)
    return "\n".join(out)
