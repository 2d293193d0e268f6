"""Time arithmetic over trace rows: unions and overlaps of intervals, step completion times, per-site rows."""

from __future__ import annotations

import bisect

from .trace import Event


def interval_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def overlap(a: float, b: float, intervals: list[tuple[float, float]], starts: list[float]) -> float:
    """Total overlap of [a, b] with sorted disjoint intervals."""
    total = 0.0
    i = max(0, bisect.bisect_right(starts, a) - 1)
    while i < len(intervals) and intervals[i][0] < b:
        lo, hi = max(a, intervals[i][0]), min(b, intervals[i][1])
        if hi > lo:
            total += hi - lo
        i += 1
    return total


def completion_periods(steps: list[Event], per_step_first_last: dict[int, list[float]],
                       gpu_free_from: float | None = None) -> list[float]:
    """Step times (ms) from one step's completion to the next. A step completes when its host range and the last
    GPU row it launched (per_step_first_last: step index -> [first GPU start, last GPU end]) have both ended: host
    ranges alone understate a GPU-bound step (the host runs ahead, queueing work), GPU spans alone miss a host-bound
    one. The first step counts from its host start, or from gpu_free_from when the GPU was still running earlier
    work then (launched before the window)."""
    done = [max(st.end, per_step_first_last[i][1]) if i in per_step_first_last else st.end for i, st in enumerate(steps)]
    start = max(steps[0].ts, gpu_free_from) if gpu_free_from is not None else steps[0].ts
    return [(done[0] - start) / 1000] + [(b - a) / 1000 for a, b in zip(done, done[1:])]


def site_rows(agg: dict[tuple, list], keys: tuple[str, ...], n_steps: int) -> list[dict]:
    """Rows of an aggregate {key tuple: [us, count]}, heaviest first: the key's fields, then ms and count per step."""
    return [{**dict(zip(keys, key)), "ms_per_step": us / 1000 / n_steps, "count_per_step": n / n_steps}
            for key, (us, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])]
