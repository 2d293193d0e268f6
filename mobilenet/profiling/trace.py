"""Reading an exported Chrome trace: its rows as Events nested by time, the run's facts stored with it, and the
slimmed copies that serve as test fixtures."""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

# Top-level key of the trace JSON that carries the run's facts (environment, config) for offline analysis.
META_KEY = "mobilenet_meta"

# How the run launches its kernels when it is not profiled (profile=true and infer.py --profile trace eager steps, so
# that every kernel is attributed to its op): the env key the engine and infer.py set, and its values. The launch
# findings' hints depend on it: a launch-bound trace of a run that is captured without the profiler is no finding
# about that run.
UNPROFILED = "launches without the profiler"
UNPROFILED_GRAPH = "one CUDA graph replayed per step"
UNPROFILED_COMPILED = "compiled kernels, launched one by one"
UNPROFILED_EAGER = "eager, launched one by one"


def unprofiled_launches(captured: bool, compiled: bool) -> str:
    return UNPROFILED_GRAPH if captured else UNPROFILED_COMPILED if compiled else UNPROFILED_EAGER


def load_trace(path: str | Path) -> dict:
    """A Chrome trace exported by torch.profiler (.json or .json.gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def save_trace(trace: dict, path: str | Path) -> None:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        json.dump(trace, f, separators=(",", ":"))


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
HOST_CATS = ("cpu_op", "user_annotation", "runtime")
STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
# Containment tolerance: trace timestamps are microseconds with nanosecond rounding.
EPS = 0.002

# Arguments the analysis reads; slim_trace drops the rest.
_KEPT_ARGS = ("correlation", "External id", "Input Dims", "Input type", "Input Strides", "Concrete Inputs", "bytes",
              "stream", "device", "grid", "block")


def slim_trace(trace: dict) -> dict:
    """A smaller trace that analyses the same: host ops, ranges, runtime calls and GPU rows with the arguments
    the analysis reads (no flow arrows, Python frames or per-kernel occupancy figures): the rows of every category
    trace_events recognises (_CATEGORY_ALIASES). For test fixtures."""
    events = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M":
            events.append(e)
        elif e.get("ph") == "X" and str(e.get("cat", "")).lower() in _CATEGORY_ALIASES:
            e = dict(e)
            e["args"] = {k: v for k, v in (e.get("args") or {}).items() if k in _KEPT_ARGS}
            events.append(e)
    return {**{k: v for k, v in trace.items() if k != "traceEvents"}, "traceEvents": events}


def trace_events(trace: dict) -> list[Event]:
    """The trace's complete ("X") rows, with normalised categories."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = _CATEGORY_ALIASES.get(str(e.get("cat", "")).lower(), "other")
        out.append(Event(e.get("name", ""), cat, float(e["ts"]), float(e["dur"]), e.get("tid"), e.get("pid"), e.get("args") or {}))
    return out


def link_parents(events: Iterable[Event]) -> None:
    """Nest host events (ops, ranges, runtime calls) per thread by time containment."""
    by_thread: dict[Any, list[Event]] = defaultdict(list)
    for e in events:
        by_thread[(e.pid, e.tid)].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.ts, -e.dur))
        stack: list[Event] = []
        for e in evs:
            while stack and not (e.ts >= stack[-1].ts - EPS and e.end <= stack[-1].end + EPS):
                stack.pop()
            e.parent = stack[-1] if stack else None
            stack.append(e)


def _ancestors(e: Event | None) -> Iterable[Event]:
    while e is not None:
        yield e
        e = e.parent


def cpu_ops(e: Event | None) -> list[Event]:
    """The CPU ops enclosing a host event, innermost first (pass a launch's parent: its op stack)."""
    return [a for a in _ancestors(e) if a.cat == "cpu_op"]


def parse_meta(trace: dict) -> dict:
    """The run's facts StepProfiler stored in the trace (a JSON string, as Kineto keeps metadata)."""
    meta = trace.get(META_KEY) or {}
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError:
            meta = {}
    return dict(meta)


def env_from_trace(trace: dict, meta: dict) -> dict:
    """The run's facts, completed with the GPU and CUDA versions the trace itself records."""
    env = dict(meta)
    props = trace.get("deviceProperties") or []
    if props and "gpu" not in env:
        env["gpu"] = props[0].get("name", "unknown")
    for key, trace_key in (("cuda_runtime", "cuda_runtime_version"), ("cuda_driver", "cuda_driver_version")):
        if trace_key in trace and key not in env:
            env[key] = trace[trace_key]
    return env
