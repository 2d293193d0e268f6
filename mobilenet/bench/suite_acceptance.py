"""Issue 22's acceptance table from scripts/bench_depthwise.py's CSV files: for each suite and each dtype x layout,
custom against the best of the other backends (torch, cudnn), the count-weighted sums over the suite's layers, for
the forward and the forward+backward; and custom over the HBM floor. One table over several suites, so that runs of
one commit read as one result (scripts/depthwise_acceptance.py prints it).
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SuiteSums", "read_sums", "markdown"]

# Backends that are variants of custom (bench_depthwise.py --ab), never its competitors.
_NOT_COMPETITORS = {"custom", "custom_ab"}
_DTYPES = ("fp32", "fp16", "bf16")
_LAYOUTS = ("nchw", "nhwc")
_MODES = ("fwd", "fwdbwd")


@dataclass(frozen=True)
class SuiteSums:
    """A suite's count-weighted sums (ms) for one dtype, layout and pass: per backend, and the HBM floor."""

    suite: str
    dtype: str
    layout: str
    mode: str
    backends: dict[str, float]
    floor: float
    source: str = ""  # the file the sums came from

    def speed_up(self, custom: str = "custom") -> tuple[float, str]:
        """(best other backend's sum / custom's, that backend); nan where custom or every other backend is missing."""
        others = {b: t for b, t in self.backends.items() if b not in _NOT_COMPETITORS and not math.isnan(t)}
        mine = self.backends.get(custom, math.nan)
        if not others or math.isnan(mine):
            return math.nan, ""
        best = min(others, key=others.get)
        return others[best] / mine, best

    def over_floor(self, custom: str = "custom") -> float:
        return self.backends.get(custom, math.nan) / self.floor if self.floor > 0 else math.nan

    def against(self, backend: str, custom: str = "custom") -> float:
        """backend's sum / custom's (nan where either is missing): custom against one competitor alone."""
        mine = self.backends.get(custom, math.nan)
        return self.backends.get(backend, math.nan) / mine if mine > 0 else math.nan


def _ms(text: str) -> float:
    try:
        return float(text)
    except ValueError:  # an empty cell: that backend did not run the case
        return math.nan


def read_sums(paths: list[Path]) -> list[SuiteSums]:
    """The sums of every (suite, dtype, layout, pass) in the CSV files; a file that lacks bench_depthwise.py's
    columns raises ValueError naming it and what is missing. Where two files hold the same (suite, dtype, layout,
    pass), the later file's sums replace the earlier ones (a re-run of some layouts at a later commit, named last);
    adding the two runs' layers together would judge neither."""
    out: dict[tuple[str, str, str, str], SuiteSums] = {}
    for path in paths:
        acc: dict[tuple[str, str, str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            fields = reader.fieldnames or []
            need = {"suite", "dtype", "layout", "mode", "count", "floor_ms"}
            missing = sorted(need - set(fields))
            backends = [c[: -len("_ms")] for c in fields if c.endswith("_ms") and c != "floor_ms"]
            if missing or "custom" not in backends:
                raise ValueError(f"{path}: not a bench_depthwise.py CSV (missing columns: "
                                 f"{', '.join(missing + ([] if 'custom' in backends else ['custom_ms']))})")
            for row in reader:
                key = (row["suite"], row["dtype"], row["layout"], row["mode"])
                count = int(row["count"])
                sums = acc[key]
                sums["floor"] += count * float(row["floor_ms"])
                for b in backends:
                    sums[b] += count * _ms(row[b + "_ms"])  # nan stays nan: a missing layer spoils the sum
        for key, sums in acc.items():
            floor = sums.pop("floor")
            out[key] = SuiteSums(*key, dict(sums), floor, Path(path).name)
    return list(out.values())


def _cell(sums: dict[tuple[str, str, str, str], SuiteSums], suite: str, dtype: str, layout: str, custom: str) -> str:
    parts = []
    for mode in _MODES:
        s = sums.get((suite, dtype, layout, mode))
        sp = s.speed_up(custom)[0] if s else math.nan
        parts.append("-" if math.isnan(sp) else (f"**{sp:.2f}**" if sp < 1.0 else f"{sp:.2f}"))
    return " / ".join(parts)


def _figures(what: str, all_sums: list[SuiteSums], keep, value, label=lambda s: s.suite) -> list[str]:
    """One line, `what: <label> <value>x, ...`, over the sums `keep` selects whose value is known; none without one."""
    cells = [f"{label(s)} {v:.2f}x" for s in all_sums if keep(s) and not math.isnan(v := value(s))]
    return [f"{what}: " + ", ".join(cells) + "."] if cells else []


def markdown(all_sums: list[SuiteSums], custom: str = "custom") -> str:
    """The table: a row per suite, a column per dtype x layout, each cell forward / forward+backward speed-up
    (bold below 1.00), then how many sums are at least 1.00, the channels_last forward+backward and the fp32 NCHW
    forward over their floors, and the fp16 channels_last forward against cudnn alone."""
    sums = {(s.suite, s.dtype, s.layout, s.mode): s for s in all_sums}
    suites = list(dict.fromkeys(s.suite for s in all_sums))
    cols = [(d, lay) for d in _DTYPES for lay in _LAYOUTS]
    lines = [f"{custom} against the best of the other backends, suite sums, forward / forward+backward "
             "(>= 1.00: at least as fast)", "",
             "| suite | " + " | ".join(f"{d} {lay.upper()}" for d, lay in cols) + " |",
             "|---|" + "--:|" * len(cols)]
    for suite in suites:
        lines.append(f"| {suite} | " + " | ".join(_cell(sums, suite, d, lay, custom) for d, lay in cols) + " |")
    ratios = [s.speed_up(custom)[0] for s in all_sums if s.mode in _MODES]
    ratios = [r for r in ratios if not math.isnan(r)]
    lines += ["", f"{sum(r >= 1.0 for r in ratios)} of {len(ratios)} sums at least 1.00."]
    lines += _figures(f"channels_last forward+backward, {custom} over the HBM floor", all_sums,
                      lambda s: s.layout == "nhwc" and s.mode == "fwdbwd", lambda s: s.over_floor(custom),
                      lambda s: f"{s.suite} {s.dtype}")
    # The issue's other two quantities, for every suite that has them (its bounds are on large_k7's).
    lines += _figures(f"fp32 NCHW forward, {custom} over the HBM floor", all_sums,
                      lambda s: (s.dtype, s.layout, s.mode) == ("fp32", "nchw", "fwd"), lambda s: s.over_floor(custom))
    lines += _figures(f"fp16 channels_last forward, {custom} against cudnn alone", all_sums,
                      lambda s: (s.dtype, s.layout, s.mode) == ("fp16", "nhwc", "fwd"),
                      lambda s: s.against("cudnn", custom))
    sources: dict[str, dict[str, None]] = defaultdict(dict)
    for s in all_sums:
        sources[s.source][f"{s.suite} {s.layout.upper()}"] = None
    if len(sources) > 1:  # a table merged from runs of different files (commits) says which cell is whose
        lines += ["", "Sums by file:"] + [f"- {src}: {', '.join(cells)}" for src, cells in sources.items()]
    return "\n".join(lines) + "\n"
