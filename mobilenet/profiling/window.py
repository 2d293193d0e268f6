"""The analysed window of an exported trace: its steps and ranges, and every GPU row linked to the launch call,
op stack and step that issued it. Each GPU row is linked through its `correlation` id to the runtime call that
launched it, and from there to the enclosing CPU ops and record_function range."""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

from .trace import EPS, STEP_RE, Event, cpu_ops


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


@dataclass
class Window:
    """The ProfilerStep ranges analysed and the record_function ranges directly inside them (data, forward,
    backward, optimizer), with lookups by host time."""

    steps: list[Event]
    phases: list[Event]
    _step_starts: list[float] = field(init=False, repr=False)
    _phase_starts: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._step_starts = [s.ts for s in self.steps]
        self._phase_starts = [p.ts for p in self.phases]

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def lo(self) -> float:
        return self.steps[0].ts

    @property
    def hi(self) -> float:
        return self.steps[-1].end

    def step_index(self, t: float) -> int | None:
        i = bisect.bisect_right(self._step_starts, t) - 1
        return i if 0 <= i < self.n_steps and t <= self.steps[i].end + EPS else None

    def phase_at(self, t: float) -> str:
        i = bisect.bisect_right(self._phase_starts, t) - 1
        return self.phases[i].name if i >= 0 and t <= self.phases[i].end + EPS else "(outside ranges)"


def select_steps(host: list[Event], skip_steps: int, notes: list[str]) -> list[Event]:
    """The ProfilerStep ranges to analyse, in time order; the whole trace as one step when it has none."""
    steps = sorted((e for e in host if e.cat in ("user_annotation", "cpu_op") and STEP_RE.match(e.name)), key=lambda e: e.ts)
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
    return steps


def build_window(host: list[Event], steps: list[Event]) -> Window:
    step_ids = {id(s) for s in steps}
    phases = sorted((e for e in host if e.cat == "user_annotation" and e.parent is not None and id(e.parent) in step_ids),
                    key=lambda e: e.ts)
    return Window(steps, phases)


class Launched(NamedTuple):
    """A GPU row with the runtime call that launched it (None: unlinked), that call's op stack and its step."""

    row: Event
    launch: Event | None
    ops: list[Event]
    step: int | None


@dataclass
class GpuRows:
    rows: list[Event]  # every GPU row of the trace
    counted: list[Launched]  # those issued inside a step of the window
    runtime_by_corr: dict
    first_last: dict[int, list[float]]  # step -> [first start, last end] of the GPU rows it launched
    earlier_end: float | None = None  # end of the last row launched before the trace's host record (None: none)


def link_gpu_rows(host: list[Event], rows: list[Event], window: Window, notes: list[str]) -> GpuRows:
    runtime_by_corr = {e.args["correlation"]: e for e in host if e.cat == "runtime" and "correlation" in e.args}
    # Correlation ids grow with every launch call. A GPU row whose id is below the first call the trace kept was
    # launched before the trace's host record begins (in the profiler's warm-up, whose host rows are dropped) and
    # ran late into the window: the GPU of a GPU-bound loop lags its host. Placed by its own start time it would
    # count as work of the first step, so it is left out of every per-step figure; its busy time still counts.
    first_corr = min((c for c in runtime_by_corr if isinstance(c, int)), default=None)
    linked, earlier = [], []
    for g in rows:
        corr = g.args.get("correlation")
        launch = runtime_by_corr.get(corr)
        if launch is None and first_corr is not None and isinstance(corr, int) and corr < first_corr:
            earlier.append(g)
            continue
        t_issue = launch.ts if launch is not None else g.ts
        linked.append(Launched(g, launch, cpu_ops(launch.parent if launch else None), window.step_index(t_issue)))
    if earlier:
        notes.append(f"{len(earlier)} GPU rows ({sum(g.dur for g in earlier) / 1000:.3f} ms) were launched before the "
                     "trace's first recorded launch call (in the profiler's warm-up) and ran inside the window: they "
                     "are left out of the per-step figures, and count only as GPU busy time")
    unlinked = sum(1 for r in linked if r.launch is None)
    if unlinked:
        notes.append(f"{unlinked} of {len(linked)} GPU rows are unlinked (no launch call with their correlation id): "
                     "they are placed by their own start time and their idle time before them counts as gaps")
    counted = [r for r in linked if r.step is not None]
    first_last: dict[int, list[float]] = {}
    for r in counted:
        fl = first_last.setdefault(r.step, [r.row.ts, r.row.end])
        fl[0], fl[1] = min(fl[0], r.row.ts), max(fl[1], r.row.end)
    return GpuRows(rows, counted, runtime_by_corr, first_last, max((g.end for g in earlier), default=None))
