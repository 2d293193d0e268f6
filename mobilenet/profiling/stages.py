"""The analysis stages: each reads the window and its linked GPU rows and returns one dataclass of the Report.
Only device-side rows (kernels, memcpys, memsets) are counted, never the CPU ops' "CUDA time" columns, which
attribute asynchronous work to whichever op was running when it finished."""

from __future__ import annotations

import bisect
import json
from collections import Counter, defaultdict
from typing import NamedTuple

from .classify import (AUTOGRAD_PREFIX, CATEGORIES, DEVICE_SYNC_CALLS, SLOW_LAUNCH_US, SYNC_CALLS, category_of,
                       implementation_of, op_label)
from .intervals import completion_periods, interval_union, overlap, site_rows
from .report import CategoryShare, GpuTime, HostSyncs, Launches, StepTiming, Utilisation
from .trace import EPS, Event, cpu_ops
from .window import GpuRows, Window, median


def step_timing(window: Window, gpu: GpuRows, baseline_step_ms: float | None) -> StepTiming:
    host_ms = [s.dur / 1000 for s in window.steps]
    times = completion_periods(window.steps, gpu.first_last, gpu.earlier_end) if gpu.rows else host_ms
    step_median = median(times)
    spans = [b - a for a, b in gpu.first_last.values()]
    return StepTiming(
        step_ms=times, step_ms_median=step_median, step_ms_min=min(times), step_ms_max=max(times),
        host_step_ms=host_ms, host_step_ms_median=median(host_ms), baseline_step_ms=baseline_step_ms,
        profiler_overhead_pct=100 * (step_median / baseline_step_ms - 1) if baseline_step_ms else None,
        # first-call effects (lazy loading, autotuning) are host-side: compare host ranges
        first_step_ratio=host_ms[0] / median(host_ms[1:]) if window.n_steps >= 3 else None,
        gpu_span_ms_per_step=median(spans) / 1000 if spans else None)


class _Tally(NamedTuple):
    """GPU time summed per category, per depthwise implementation, per copy site, per memcpy kind, per kernel."""

    cat_us: dict[str, float]
    cat_n: Counter
    impl_us: Counter
    copy_sites: dict[str, dict[tuple, list]]  # transpose|cast -> {(op, phase): [us, count]}
    memcpys: dict[str, list]  # kind -> [us, count, bytes, Counter of ops]
    kernels: dict[tuple, dict]  # (name, category) -> {us, n, by_site: Counter of (op, shapes) -> us}


def _tally(gpu: GpuRows, window: Window, threads: set | None) -> _Tally:
    t = _Tally({c: 0.0 for c in CATEGORIES}, Counter(), Counter(),
               {c: defaultdict(lambda: [0.0, 0]) for c in ("transpose", "cast")},
               defaultdict(lambda: [0.0, 0, 0.0, Counter()]), {})
    for g, launch, ops, _ in gpu.counted:
        op_name = op_label(ops)
        category = category_of(g, ops) if on_step_thread(launch, threads) else "loader"
        if category == "memcpy":
            m = t.memcpys[g.name]
            m[0] += g.dur
            m[1] += 1
            m[2] += float(g.args.get("bytes", 0) or 0)
            m[3][op_name] += 1
        elif category == "depthwise":
            t.impl_us[implementation_of(g.name, ops)] += g.dur
        elif category in t.copy_sites:
            site = t.copy_sites[category][(op_name, window.phase_at(launch.ts) if launch is not None else "(unlinked)")]
            site[0] += g.dur
            site[1] += 1
        t.cat_us[category] += g.dur
        t.cat_n[category] += 1
        # One kernel can serve several categories (cuDNN's implicit GEMM runs depthwise and pointwise convs).
        k = t.kernels.setdefault((g.name, category), {"us": 0.0, "n": 0, "by_site": Counter()})
        k["us"] += g.dur
        k["n"] += 1
        shaped = next((op for op in ops if op.args.get("Input Dims")), None)
        shapes = json.dumps([d for d in shaped.args["Input Dims"] if d]) if shaped else "[]"
        k["by_site"][(op_name, shapes)] += g.dur
    return t


def _memcpy_rows(memcpys: dict[str, list], n_steps: int) -> list[dict]:
    return [{"kind": name, "ms_per_step": us / 1000 / n_steps, "count_per_step": n / n_steps,
             "MB_per_step": nbytes / 1e6 / n_steps, "pageable": "Pageable" in name,
             "ops": ", ".join(op for op, _ in ops_c.most_common(3))}
            for name, (us, n, nbytes, ops_c) in sorted(memcpys.items(), key=lambda kv: -kv[1][0])]


def _top_kernels(kernels: dict[tuple, dict], total_us: float, n_steps: int, top_k: int) -> list[dict]:
    out = []
    for (name, category), k in sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:top_k]:
        (top_op, shapes), _ = k["by_site"].most_common(1)[0]
        out.append({
            "kernel": name, "category": category, "ms_per_step": k["us"] / 1000 / n_steps,
            "pct": 100 * k["us"] / total_us if total_us else 0.0, "calls_per_step": k["n"] / n_steps,
            "avg_us": k["us"] / k["n"], "op": top_op, "shapes": json.loads(shapes),
            "other_sites": len(k["by_site"]) - 1,  # further (op, shapes) pairs that ran this kernel
        })
    return out


def gpu_time(gpu: GpuRows, window: Window, top_k: int, threads: set | None = None) -> GpuTime:
    """`threads`: the step's threads (step_threads); GPU work launched by others is the loader's."""
    n = window.n_steps
    t = _tally(gpu, window, threads)
    total_us = sum(t.cat_us.values())
    dw_total = sum(t.impl_us.values())
    memcpys = _memcpy_rows(t.memcpys, n)
    return GpuTime(
        gpu_ms_per_step=total_us / 1000 / n,
        categories={c: CategoryShare(ms_per_step=t.cat_us[c] / 1000 / n, pct=100 * t.cat_us[c] / total_us if total_us else 0.0,
                                     count_per_step=t.cat_n[c] / n) for c in CATEGORIES},
        depthwise_impls={impl: 100 * us / dw_total for impl, us in t.impl_us.most_common()} if dw_total else {},
        depthwise_implementation=t.impl_us.most_common(1)[0][0] if t.impl_us else None,
        transposes=site_rows(t.copy_sites["transpose"], ("op", "phase"), n),
        casts=site_rows(t.copy_sites["cast"], ("op", "phase"), n),
        casts_per_step=t.cat_n["cast"] / n,
        memcpys=memcpys,
        pageable_copies_per_step=sum(m["count_per_step"] for m in memcpys if m["pageable"]),
        top_kernels=_top_kernels(t.kernels, total_us, n, top_k))


def _slow_first_launches(counted: list) -> list[dict]:
    """Launch calls over SLOW_LAUNCH_US among each kernel's first launch: only that one can load its module; a
    later slow launch is a full launch queue (GPU-bound)."""
    first_launch: dict[str, tuple] = {}  # kernel name -> (launch, ops, step) of its first launch
    for g, launch, ops, s in sorted((r for r in counted if r.row.cat == "kernel" and r.launch is not None),
                                    key=lambda r: r.launch.ts):
        first_launch.setdefault(g.name, (launch, ops, s))
    slow = {id(launch): (launch, ops, s) for launch, ops, s in first_launch.values() if launch.dur > SLOW_LAUNCH_US}
    by_slow: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    for launch, ops, s in slow.values():
        key = (launch.name, op_label(ops), s)
        by_slow[key][0] = max(by_slow[key][0], launch.dur)
        by_slow[key][1] += 1
    return [{"call": c, "op": op, "step": st, "max_ms": us / 1000, "count": n}
            for (c, op, st), (us, n) in sorted(by_slow.items(), key=lambda kv: -kv[1][0])]


def launches(gpu: GpuRows, n_steps: int, threads: set | None = None) -> Launches:
    """The step's launches: those of `threads` (step_threads), not a loader's, whose own launches would otherwise
    stand for a captured step's (one graph launch each) and call it launch-bound."""
    counted = [r for r in gpu.counted if on_step_thread(r.launch, threads)]
    # A CUDA graph launches many kernels with one call: comparing each kernel with that call says nothing.
    launched = [(r.row, r.launch) for r in counted
                if r.row.cat == "kernel" and r.launch is not None and "GraphLaunch" not in r.launch.name]
    short = sum(1 for g, launch in launched if g.dur < launch.dur)
    short_pct = 100 * short / len(launched) if launched else 0.0
    per_step = Counter(r.step for r in counted if r.row.cat == "kernel")
    return Launches(
        kernels_per_step=sum(1 for r in counted if r.row.cat == "kernel") / n_steps,
        short_kernels_per_step=short / n_steps, short_kernel_pct=short_pct,
        median_kernel_us=median([g.dur for g, _ in launched]) if launched else 0.0,
        median_launch_us=median([launch.dur for _, launch in launched]) if launched else 0.0,
        launch_bound=short_pct >= 50,
        first_step_extra_kernels=per_step[0] - median([per_step[i] for i in range(1, n_steps)]) if n_steps >= 3 else 0.0,
        slow_launches=_slow_first_launches(counted))


class BlockingCalls(NamedTuple):
    """The window's CUDA runtime calls, sorted by whether they block and which thread made them."""

    on_step: list[Event]  # blocking calls on the threads that run the step
    other_blocking: int  # blocking calls on other threads
    other_thread_calls: list[Event]  # every call of other threads
    pageable_ids: set[int]  # launch calls of copies from or to pageable memory


def step_threads(host: list[Event], window: Window) -> set | None:
    """The (pid, tid) of the threads that run the step: the ProfilerStep ranges' and autograd's backward thread(s).
    None when the trace names no threads."""
    first = window.steps[0]
    if first.tid is None:
        return None
    return {(first.pid, first.tid)} | {(e.pid, e.tid) for e in host if e.cat == "cpu_op"
                                       and (e.name.startswith(AUTOGRAD_PREFIX) or "backward" in e.name.lower())}


def on_step_thread(call: Event | None, threads: set | None) -> bool:
    """Whether a host call (a GPU row's launch) ran on one of the step's `threads` (step_threads). An unlinked GPU
    row (no launch call) and a trace that names no threads count as the step's: nothing says otherwise."""
    return call is None or threads is None or (call.pid, call.tid) in threads


def blocking_calls(host: list[Event], window: Window, gpu: GpuRows, threads: set | None) -> BlockingCalls:
    """`threads`: step_threads(); a sync on any other thread (a loader's worker) does not stall the step."""
    # A copy from or to pageable memory blocks the host as well: the driver stages it through a pinned buffer.
    pageable = {id(r.launch) for r in gpu.counted if r.launch is not None and r.row.cat == "memcpy" and "Pageable" in r.row.name}
    in_window = [e for e in host if e.cat == "runtime" and window.step_index(e.ts) is not None]
    blocking = [e for e in in_window if SYNC_CALLS.match(e.name) or id(e) in pageable]
    on_step = [e for e in blocking if on_step_thread(e, threads)]
    return BlockingCalls(on_step, len(blocking) - len(on_step), [e for e in in_window if not on_step_thread(e, threads)], pageable)


def host_syncs(calls: BlockingCalls, gpu: GpuRows, window: Window, meta: dict, threads: set | None) -> HostSyncs:
    """`threads`: step_threads(), to tell the step's streams from those of other threads (a loader's)."""
    n = window.n_steps
    device_syncs = [e.dur for e in calls.other_thread_calls if e.name in DEVICE_SYNC_CALLS]
    by_sync: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    for e in calls.on_step:
        call = f"{e.name} (pageable)" if id(e) in calls.pageable_ids and not SYNC_CALLS.match(e.name) else e.name
        key = (call, op_label(cpu_ops(e.parent)), window.phase_at(e.ts))
        by_sync[key][0] += e.dur
        by_sync[key][1] += 1
    return HostSyncs(
        syncs=site_rows(by_sync, ("call", "op", "phase"), n), syncs_per_step=len(calls.on_step) / n,
        other_thread_syncs_per_step=calls.other_blocking / n,
        other_thread_cuda_calls_per_step=len(calls.other_thread_calls) / n,
        other_thread_device_syncs_per_step=len(device_syncs) / n,
        other_thread_device_sync_ms_median=median(device_syncs) / 1000 if device_syncs else 0.0,
        streams_with_work=len(_streams(gpu.counted)),
        step_streams_with_work=len(_streams([r for r in gpu.counted if on_step_thread(r.launch, threads)])),
        work_queues=int(meta["cuda_work_queues"]) if meta.get("cuda_work_queues") is not None else None)


def _streams(rows) -> set:
    return {(r.row.args.get("device"), r.row.args["stream"]) for r in rows if "stream" in r.row.args}


class _IdleSplit(NamedTuple):
    host_wait: float  # us idle with nothing queued yet
    host_sync: float  # ... of which the host sat in a blocking call
    host_data: float  # ... of which the host was in the data range
    gap: float  # us idle with the next row already queued


def _split_idle(idle: list[tuple[float, float]], gpu: GpuRows, span_hi: float, blocking: list, data: list) -> _IdleSplit:
    """Each idle stretch split at the moment the host issued the GPU row that ends it."""
    blocking_starts, data_starts = [a for a, _ in blocking], [a for a, _ in data]
    starts_sorted = sorted(gpu.rows, key=lambda g: g.ts)
    start_ts = [g.ts for g in starts_sorted]
    host_wait = host_sync = host_data = gap = 0.0
    for a, b in idle:
        if b <= a:
            continue
        i = bisect.bisect_left(start_ts, b - EPS)
        nxt = starts_sorted[i] if i < len(starts_sorted) and b < span_hi else None
        launch = gpu.runtime_by_corr.get(nxt.args.get("correlation")) if nxt is not None else None
        if nxt is not None and launch is None:
            gap += b - a
            continue
        issued = min(b, max(a, launch.ts)) if launch is not None else b
        host_wait += issued - a
        host_sync += overlap(a, issued, blocking, blocking_starts)
        host_data += overlap(a, issued, data, data_starts)
        gap += b - issued
    return _IdleSplit(host_wait, host_sync, host_data, gap)


def utilisation(window: Window, gpu: GpuRows, calls: BlockingCalls) -> Utilisation:
    """Busy and idle over the window: first step start to the end of the last GPU row it launched."""
    lo = window.lo
    span_hi = max([window.hi] + [hi for _, hi in gpu.first_last.values()])
    clipped = [(max(g.ts, lo), min(g.end, span_hi)) for g in gpu.rows if g.end > lo and g.ts < span_hi]
    busy = interval_union([iv for iv in clipped if iv[1] > iv[0]])
    edges = [lo] + [x for iv in busy for x in iv] + [span_hi]
    # Blocking host calls: syncs and copies from pageable memory (the host stages the data itself).
    split = _split_idle(list(zip(edges[0::2], edges[1::2])), gpu, span_hi,
                        interval_union([(e.ts, e.end) for e in calls.on_step]),
                        interval_union([(p.ts, p.end) for p in window.phases if p.name == "data"]))
    out = Utilisation(window_ms=(span_hi - lo) / 1000)
    window_us = span_hi - lo
    if window_us > 0:
        out.busy_pct = 100 * sum(b - a for a, b in busy) / window_us
        out.idle_pct = 100 - out.busy_pct
        out.idle_host_pct = 100 * split.host_wait / window_us
        out.idle_host_sync_pct = 100 * split.host_sync / window_us
        out.idle_host_data_pct = 100 * split.host_data / window_us
        out.idle_gap_pct = 100 * split.gap / window_us
    return out


def cpu_top_ops(host: list[Event], window: Window, top_k: int) -> list[dict]:
    """Self CPU time per op over the steps (a CPU run has no device rows)."""
    self_us: dict[int, float] = {}
    ops = [e for e in host if e.cat == "cpu_op" and window.lo - EPS <= e.ts <= window.hi + EPS]
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
    n = window.n_steps
    return [{"op": name, "self_ms_per_step": us / 1000 / n, "pct": 100 * us / total if total else 0.0,
             "calls_per_step": calls / n, "shapes": shapes or []}
            for name, (us, calls, shapes) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:top_k]]
