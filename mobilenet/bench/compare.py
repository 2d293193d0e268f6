"""Compare the runs of a throughput matrix: rows from TensorBoard event files and scripts/benchmark.py's
benchmark.json records, repeated runs combined into their median, speed-ups over the fp32 NCHW torch baseline, and
the markdown table, CSV and bar chart that `python scripts/compare.py` writes (its docstring describes the inputs
and the exit status)."""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MissingDependency
from ..reporting import read_tensorboard
from .plotting import pyplot

REQUIRED_SCALARS = {"train_img_s": "perf/train_img_s"}
# Measured by scripts/benchmark.py only; a train.py run's inference columns stay blank.
INFER_SCALARS = {"infer_img_s": "perf/infer_img_s"}
OPTIONAL_SCALARS = {**INFER_SCALARS, "compute_img_s": "perf/compute_img_s", "step_ms": "perf/step_ms",
                    "max_mem_gb": "sys/max_mem_gb"}
SPREAD_METRICS = ("train_img_s", "infer_img_s")  # repeated runs show the min-max of these
BACKEND_ORDER = ("torch", "cudnn", "custom", "timm")
PRECISION_ORDER = ("fp32", "fp16", "bf16")
LAYOUT_ORDER = ("NCHW", "channels_last")
BASELINE = {"backend": "torch", "norm": "torch", "precision": "fp32", "layout": "NCHW", "compile": False, "env": ""}
STATUS_FILE = "benchmark.json"  # scripts/benchmark.py's record of a combination
HYDRA_OVERRIDES = Path(".hydra") / "overrides.yaml"  # a train.py run's command-line overrides
# Overrides the table has a column for; any other override that not every compared run shares makes a run another
# combination (its "settings"): a `train.py -m optim=sgd,rmsprop` grid is two rows, not one run measured twice.
AXIS_OVERRIDES = ("backend", "norm", "amp", "amp_dtype", "channels_last", "compile", "cuda_graph", "data")
# Overrides that say where a run was kept or which random draw it made, not what was measured: runs that differ only
# in these are repeats of one combination.
NOT_SETTINGS = ("hydra", "log_root", "resume", "progress", "save_checkpoints", "seed", "data.dali.seed")


def with_env(text: str, env: str) -> str:
    """text (a backend, a norm) with the environment variant a run had (scripts/benchmark.py --env), if any."""
    return text + (f" [{env}]" if env else "")


class CompareError(Exception):
    """Nothing comparable: the message says what is missing."""


@dataclass
class Row:
    run: str
    status: str = "ok"  # ok | skipped | failed | incomplete
    reason: str = ""
    backend: str = ""
    precision: str = ""  # fp32 | fp16 | bf16
    layout: str = ""  # NCHW | channels_last
    compile: bool | None = None
    cuda_graph: bool | None = None  # None: the run predates the option (it was eager)
    data: str = ""
    norm: str = ""  # "" until load_rows knows it (hparams, record or overrides)
    env: str = ""  # scripts/benchmark.py --env: the variables set in the run's process
    overrides: list[str] | None = None  # the run's Hydra overrides; None where neither Hydra nor benchmark.py kept them
    settings: str = ""  # the overrides that set this run apart from the others compared (see AXIS_OVERRIDES)
    batch_size: int | None = None
    resolution: int | None = None
    gpu: str = ""
    torch: str = ""
    cudnn: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    runs: int = 1  # how many runs of this combination the metrics are the median of
    spread: dict[str, tuple[float, float]] = field(default_factory=dict)  # (min, max) over those runs
    train_speedup: float = math.nan
    infer_speedup: float = math.nan

    @property
    def key(self) -> tuple:
        return (self.backend, *self.pair)

    @property
    def pair(self) -> tuple:
        """What a backend is compared under: everything but the backend."""
        return (self.norm, self.precision, self.layout, self.compile, self.cuda_graph, self.data, self.env, self.settings)

    @property
    def label(self) -> str:
        """The backend, with the environment variant it ran under."""
        return with_env(self.backend, self.env)

    @property
    def series(self) -> str:
        """The backend as a chart's bars name it: with its variant and its settings."""
        return self.label + (f" ({self.settings})" if self.settings else "")


# ----------------------------------------------------------------------------------------------- reading the runs


def _bool(value) -> bool:
    if isinstance(value, (bool, int, float)):  # add_hparams stores bools as numbers (1.0 / 0.0)
        return bool(value)
    return str(value).lower() in ("true", "1", "yes")


def _settings(hp: dict) -> dict:
    """Row fields from hparams, however they were spelled (TensorBoard values or benchmark.json)."""
    amp = hp.get("amp")
    if isinstance(amp, str) and amp in ("off", "fp16", "bf16"):  # benchmark.json's spelling
        precision = "fp32" if amp == "off" else amp
    else:
        precision = str(hp.get("amp_dtype", "fp16")) if _bool(amp) else "fp32"
    out = {
        "backend": str(hp.get("backend", "")),
        "precision": precision,
        "layout": "channels_last" if _bool(hp.get("channels_last", False)) else "NCHW",
        "compile": _bool(hp.get("compile", False)),
        "data": str(hp.get("data", "")),
        "norm": str(hp.get("norm") or ""),
        "env": str(hp.get("env") or ""),
    }
    if hp.get("cuda_graph") is not None:
        out["cuda_graph"] = _bool(hp["cuda_graph"])
    for name in ("batch_size", "resolution"):
        if hp.get(name) is not None:
            out[name] = int(hp[name])
    for name in ("gpu", "torch", "cudnn"):
        if hp.get(name) is not None:
            out[name] = str(hp[name])
    return out


def load_rows(roots: list[Path]) -> list[Row]:
    rows: list[Row] = []
    for root in roots:
        if not root.is_dir():
            raise CompareError(f"{root}: no such directory")
        runs = read_tensorboard(root)
        records = {p.parent.resolve(): json.loads(p.read_text()) for p in sorted(root.rglob(STATUS_FILE))}
        if not runs and not records:
            raise CompareError(f"{root}: no TensorBoard event files (events.out.tfevents.*) and no {STATUS_FILE} under "
                               "it; is it a runs directory written by scripts/benchmark.py or train.py?")
        for run_dir in sorted(set(runs) | set(records)):
            name = str(run_dir.relative_to(root.resolve())) if run_dir != root.resolve() else root.name
            record = records.get(run_dir)
            row = _row(name, runs.get(run_dir), record)
            row.overrides = _overrides(run_dir, record)
            if not row.norm:  # not in its hparams: its overrides say, else it predates the option (nn.BatchNorm2d)
                row.norm = _override_value(row.overrides, "norm") or "torch"
            rows.append(row)
    mark_settings(rows)
    return rows


def _overrides(run_dir: Path, record: dict | None) -> list[str] | None:
    """The run's Hydra overrides: scripts/benchmark.py's record of them, else the ones Hydra kept for a train.py run."""
    if record and record.get("overrides") is not None:
        return [str(o) for o in record["overrides"]]
    path = run_dir / HYDRA_OVERRIDES
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        return [str(o) for o in OmegaConf.to_container(OmegaConf.load(path))]
    except Exception as e:  # not YAML, or not a list: which runs are repeats would be a guess
        raise CompareError(f"{path}: cannot be read as Hydra's list of overrides ({e})") from e


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _override_value(overrides: list[str] | None, key: str) -> str | None:
    return next((o.split("=", 1)[1] for o in overrides or [] if "=" in o and _override_key(o) == key), None)


def _is_setting(override: str) -> bool:
    key = _override_key(override)
    return key not in AXIS_OVERRIDES and not any(key == k or key.startswith(k + ".") for k in NOT_SETTINGS)


def mark_settings(rows: list[Row]) -> None:
    """Each row's settings: its overrides that are not the table's columns, not a run's place or seed, and not shared
    by every run compared whose overrides are known (a run without them has none: it is compared as before)."""
    known = [set(r.overrides) for r in rows if r.overrides is not None]
    shared = set.intersection(*known) if known else set()
    for r in rows:
        r.settings = " ".join(sorted(o for o in r.overrides or [] if o not in shared and _is_setting(o)))


def _row(name: str, tensorboard: tuple | None, record: dict | None) -> Row:
    status = record.get("status", "ok") if record else "ok"
    if status != "ok":  # skipped up front, failed, or interrupted while running
        reason = record.get("reason") or ("interrupted: no result recorded" if status == "running" else "")
        return Row(name, status="failed" if status == "running" else status, reason=reason, **_settings(record))
    hparams, scalars = tensorboard or (None, {})
    if hparams is None:
        return Row(name, status="incomplete", reason=f"run {name!r}: no hparams in its event files (written by "
                   "train.py or scripts/benchmark.py, and finished?)", **(_settings(record) if record else {}))
    row = Row(name, **_settings(hparams))
    if record:  # what TensorBoard's hparams do not hold: the environment variant
        row.env = str(record.get("env") or "")
    missing = [tag for tag in REQUIRED_SCALARS.values() if tag not in scalars]
    invalid = [tag for tag in (*REQUIRED_SCALARS.values(), *INFER_SCALARS.values())
               if tag in scalars and not math.isfinite(scalars[tag])]
    if missing or invalid:
        row.status = "incomplete"
        row.reason = "; ".join(
            [f"run {name!r}: missing scalar {tag!r}" for tag in missing]
            + [f"run {name!r}: scalar {tag!r} is {scalars[tag]} (no timed steps? warm-up >= steps)" for tag in invalid])
        if missing:
            row.reason += f" (it has: {', '.join(sorted(scalars)) or 'no scalars'})"
    for key, tag in {**REQUIRED_SCALARS, **OPTIONAL_SCALARS}.items():
        if tag in scalars:
            row.metrics[key] = scalars[tag]
    return row


# ---------------------------------------------------------------------------------------------------- comparing


def _index(seq: tuple, value) -> int:
    """value's place in seq, for sorting; values not in seq after all of it."""
    return seq.index(value) if value in seq else len(seq)


def _order(row: Row) -> tuple:
    return (row.data, row.compile is True, row.cuda_graph is True, _index(PRECISION_ORDER, row.precision), _index(LAYOUT_ORDER, row.layout),
            row.settings, _index(BACKEND_ORDER, row.backend), row.backend, row.norm != "torch", row.norm, row.env)


def _facts(ok: list[Row]) -> dict[str, list[str]]:
    """Batch size, resolution, GPU, torch and cuDNN of the given runs: each one's distinct values, as sorted text."""
    return {name: sorted({str(getattr(r, name)) for r in ok}) for name in ("batch_size", "resolution", "gpu", "torch", "cudnn")}


def _ratio(a: Row, b: Row, metric: str) -> float:
    """a's metric over b's; nan where either run lacks it (a train.py run has no inference img/s)."""
    if metric not in a.metrics or metric not in b.metrics:
        return math.nan
    return a.metrics[metric] / b.metrics[metric]


def inference_note(rows: list[Row]) -> list[str]:
    """Why some rows have blank inference columns."""
    lacking = [r.run for r in rows if r.status == "ok" and "infer_img_s" not in r.metrics]
    if not lacking:
        return []
    shown = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
    return [f"{len(lacking)} run(s) have no perf/infer_img_s ({shown}): train.py runs measure training and "
            "validation, not inference throughput (scripts/benchmark.py does), so their inference columns are blank"]


def add_speedups(rows: list[Row]) -> list[str]:
    """Speed-up over the fp32 NCHW torch run (no compile) on the same data, with the same CUDA-graph setting and the
    same settings; notes for the groups that lack that baseline."""
    notes = []
    ok = [r for r in rows if r.status == "ok"]
    for group in sorted({(r.data, r.cuda_graph, r.settings) for r in ok}, key=str):
        data, graph, settings = group
        base = next((r for r in ok if (r.data, r.cuda_graph, r.settings) == group
                     and all(getattr(r, k) == v for k, v in BASELINE.items())), None)
        if base is None:
            notes.append(f"no baseline (backend torch, norm torch, fp32, NCHW, no compile, CUDA graph {_graph(graph) or 'unknown'}) "
                         f"for data={data}{f', settings {settings}' if settings else ''}: those speed-ups are left blank")
            continue
        for r in ok:
            if (r.data, r.cuda_graph, r.settings) == group:
                r.train_speedup = _ratio(r, base, "train_img_s")
                r.infer_speedup = _ratio(r, base, "infer_img_s")
    return notes


def combine_repeats(rows: list[Row]) -> tuple[list[Row], list[str]]:
    """One row per combination: the finished runs of one combination become their first row, holding the median of
    each scalar they all have, their count and the (min, max) of train and infer img/s. Rows that did not finish stay
    as they are. Returns the rows and a note when any were combined."""
    groups: dict[tuple, list[Row]] = {}
    out: list[Row] = []
    for r in rows:
        if r.status == "ok" and r.key in groups:
            groups[r.key].append(r)
            continue
        if r.status == "ok":
            groups[r.key] = [r]
        out.append(r)
    combined = [g for g in groups.values() if len(g) > 1]
    for group in combined:
        head = group[0]
        shared = set.intersection(*(set(g.metrics) for g in group))
        head.spread = {k: (min(g.metrics[k] for g in group), max(g.metrics[k] for g in group))
                       for k in SPREAD_METRICS if k in shared}
        head.metrics = {k: statistics.median(g.metrics[k] for g in group) for k in head.metrics if k in shared}
        head.runs = len(group)
    notes = []
    if combined:
        notes.append(f"{len(combined)} combination(s) measured more than once ({sum(len(g) for g in combined)} runs): "
                     "each such row shows the median of its runs; the runs column and the min-max columns give their "
                     "count and spread")
    return out, notes


def mixed_settings(rows: list[Row]) -> dict[str, str]:
    """{setting: warning} for settings that must be equal across compared runs (batch, resolution) or should be (gpu,
    torch) but are not."""
    facts = _facts([r for r in rows if r.status == "ok"])
    return {name: f"WARNING: mixed {name} in one comparison ({', '.join(facts[name])}): img/s are not directly comparable"
            for name in ("batch_size", "resolution", "gpu", "torch") if len(facts[name]) > 1}


def custom_vs_cudnn(rows: list[Row]) -> list[dict]:
    by_key = {r.key: r for r in rows if r.status == "ok"}
    pairs = []
    for r in sorted((r for r in rows if r.status == "ok" and r.backend == "cudnn"), key=_order):
        custom = by_key.get(("custom",) + r.pair)
        if custom is not None:
            pairs.append({"row": r, "custom": custom,
                          "train": _ratio(custom, r, "train_img_s"), "infer": _ratio(custom, r, "infer_img_s")})
    return pairs


def pairs_summary(pairs: list[dict]) -> str:
    """How many pairs custom wins or ties, in training and in inference, and which pairs it trails (ratios from the
    img/s themselves, not from their rounded display)."""
    parts = []
    behind = []
    for metric, label in (("train", "training"), ("infer", "inference")):
        measured = [p for p in pairs if not math.isnan(p[metric])]
        if not measured:
            continue
        ahead = sum(1 for p in measured if p[metric] >= 1.0)
        parts.append(f"{label} in {ahead} of {len(measured)} pairs")
        for p in pairs:
            if p[metric] < 1.0:
                r = p["row"]
                behind.append(f"{label} {r.precision} {r.layout}, compile={r.compile}, CUDA graph "
                              f"{_graph(r.cuda_graph) or 'unknown'}, data={r.data}" + (f", env {r.env}" if r.env else "")
                              + (f", {r.settings}" if r.settings else "") + f" ({p[metric]:.3f}x)")
    return "custom >= cudnn: " + "; ".join(parts) + ("." if not behind else ". Custom behind: " + "; ".join(behind) + ".")


# ------------------------------------------------------------------------------------------------------ writing


def _num(v: float | None, digits: int = 0) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.{digits}f}"


def _graph(v: bool | None) -> str:
    return "" if v is None else ("on" if v else "off")


def _speed(v: float) -> str:
    return "" if math.isnan(v) else f"{v:.2f}x"


def _span(r: Row, metric: str) -> str:
    low, high = r.spread.get(metric, (None, None))
    return "" if low is None else f"{_num(low)}-{_num(high)}"


def _combination(r: Row, settings: bool) -> str:
    """A row's leading cells: what was run."""
    cells = [r.label, r.norm, r.precision, r.layout, str(r.compile), _graph(r.cuda_graph), r.data]
    return "| " + " | ".join(cells + ([r.settings] if settings else [])) + " |"


def markdown(rows: list[Row], notes: list[str]) -> str:
    ok = sorted((r for r in rows if r.status == "ok"), key=lambda r: -r.metrics["train_img_s"])
    other = sorted((r for r in rows if r.status != "ok"), key=_order)
    settings = any(r.settings for r in rows)  # a column only where runs differ in more than the table's columns
    head = "| backend | norm | precision | layout | compile | CUDA graph | data |" + (" settings |" if settings else "")
    rule = "|---|---|---|---|---|---|---|" + ("---|" if settings else "")
    lines = ["# MobileNetV1 throughput matrix", ""]
    if ok:
        facts = _facts(ok)
        lines.append("batch " + "/".join(facts["batch_size"]) + ", resolution " + "/".join(facts["resolution"])
                     + ", GPU " + "/".join(facts["gpu"]) + ", torch " + "/".join(facts["torch"])
                     + ", cuDNN " + "/".join(facts["cudnn"]) + ". Sorted by training img/s; speed-ups are over "
                     "backend torch, norm torch, fp32, NCHW, no compile on the same data and CUDA-graph setting"
                     + (" and with the same settings (the overrides in which the compared runs differ beyond the "
                        "table's columns)" if settings else "") + ". CUDA graph: the "
                     "training step captured (cuda_graph). Inference: the project's model on infer.py's path for the row's "
                     "combination (BatchNorm folded, fused epilogues), the timm peer eager in eval mode.")
        lines.append("")
    lines += [n for n in notes]
    if notes:
        lines.append("")
    if ok:
        repeated = any(r.runs > 1 for r in ok)
        lines += [head + " train img/s | train speed-up | infer img/s | infer speed-up | compute img/s | step ms "
                  "| max mem GB |" + (" runs | train min-max | infer min-max |" if repeated else ""),
                  rule + "--:|--:|--:|--:|--:|--:|--:|" + ("--:|--:|--:|" if repeated else "")]
        for r in ok:
            m = r.metrics
            line = (f"{_combination(r, settings)} {_num(m['train_img_s'])} "
                    f"| {_speed(r.train_speedup)} | {_num(m.get('infer_img_s'))} | {_speed(r.infer_speedup)} "
                    f"| {_num(m.get('compute_img_s'))} | {_num(m.get('step_ms'), 1)} | {_num(m.get('max_mem_gb'), 2)} |")
            if repeated:
                line += f" {r.runs} | {_span(r, 'train_img_s')} | {_span(r, 'infer_img_s')} |"
            lines.append(line)
        lines.append("")
    pairs = custom_vs_cudnn(rows)
    if pairs:
        lines += ["## custom vs cudnn", "",
                  "| norm | precision | layout | compile | CUDA graph | data |" + (" settings |" if settings else "")
                  + " cudnn train img/s | custom train img/s | custom / cudnn | cudnn infer img/s | custom infer img/s "
                  "| custom / cudnn |",
                  "|---|---|---|---|---|---|" + ("---|" if settings else "") + "--:|--:|--:|--:|--:|--:|"]
        for p in pairs:
            r, c = p["row"], p["custom"]
            lines.append(f"| {with_env(r.norm, r.env)} | {r.precision} | {r.layout} | {r.compile} | {_graph(r.cuda_graph)} "
                         f"| {r.data} |" + (f" {r.settings} |" if settings else "")
                         + f" {_num(r.metrics['train_img_s'])} "
                         f"| {_num(c.metrics['train_img_s'])} | {_speed(p['train'])} | {_num(r.metrics.get('infer_img_s'))} "
                         f"| {_num(c.metrics.get('infer_img_s'))} | {_speed(p['infer'])} |")
        lines += ["", pairs_summary(pairs)]
        lines.append("")
    if other:
        lines += ["## Not measured", "", head + " status | reason |", rule + "---|---|"]
        for r in other:
            lines.append(f"{_combination(r, settings)} {r.status} | {r.reason.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


SPREAD_COLUMNS = [f"{m}_{end}" for m in SPREAD_METRICS for end in ("min", "max")]
CSV_COLUMNS = ["run", "status", "reason", "backend", "env", "norm", "precision", "layout", "compile", "cuda_graph", "data",
               "settings", "batch_size", "resolution",
               "gpu", "torch", "cudnn", *REQUIRED_SCALARS, *OPTIONAL_SCALARS, "train_speedup", "infer_speedup", "runs",
               *SPREAD_COLUMNS]


def write_csv(rows: list[Row], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in sorted(rows, key=lambda r: (r.status != "ok", -r.metrics.get("train_img_s", 0.0), _order(r))):
            values = {c: getattr(r, c) for c in CSV_COLUMNS if hasattr(r, c)}
            values.update(r.metrics)  # full precision: the CSV is for further analysis
            for c in ("train_speedup", "infer_speedup"):
                values[c] = "" if math.isnan(values[c]) else values[c]
            for metric, (low, high) in r.spread.items():
                values[f"{metric}_min"], values[f"{metric}_max"] = low, high
            writer.writerow({c: "" if values.get(c) is None else values[c] for c in CSV_COLUMNS})


def write_plot(rows: list[Row], path: Path) -> None:
    """One panel per (data, compile) and metric; groups are precision x layout, one bar per backend."""
    plt = pyplot()
    ok = [r for r in rows if r.status == "ok"]
    facets = sorted({(r.data, r.compile, r.cuda_graph) for r in ok}, key=str)
    backends = sorted({(r.backend, r.series) for r in ok}, key=lambda b: (_index(BACKEND_ORDER, b[0]), b[1]))
    metrics = [("train_img_s", "training img/s"), ("infer_img_s", "inference img/s")]
    fig, axes = plt.subplots(len(facets), len(metrics), figsize=(7 * len(metrics), 3.6 * len(facets)), squeeze=False)
    width = 0.8 / max(1, len(backends))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (data, compiled, graph), ax_row in zip(facets, axes):
        rows_here = [r for r in ok if (r.data, r.compile, r.cuda_graph) == (data, compiled, graph)]
        groups = sorted({(r.precision, r.layout) for r in rows_here},
                        key=lambda g: (_index(PRECISION_ORDER, g[0]), _index(LAYOUT_ORDER, g[1])))
        for ax, (metric, label) in zip(ax_row, metrics):
            for b, (_, backend) in enumerate(backends):
                xs, ys, err = [], [], [[], []]
                for g, group in enumerate(groups):
                    r = next((r for r in rows_here if r.series == backend and (r.precision, r.layout) == group), None)
                    if r is not None and metric in r.metrics:
                        xs.append(g + (b - (len(backends) - 1) / 2) * width)
                        ys.append(r.metrics[metric])
                        low, high = r.spread.get(metric, (ys[-1], ys[-1]))  # repeated runs: their min-max as a whisker
                        err[0].append(ys[-1] - low)
                        err[1].append(high - ys[-1])
                bars = ax.bar(xs, ys, width, label=backend, color=colors[b % len(colors)],
                              yerr=err if any(err[0] + err[1]) else None, capsize=2)
                ax.bar_label(bars, fmt="{:,.0f}", fontsize=6, rotation=90, padding=2)
            ax.set_xticks(range(len(groups)), [f"{p}\n{layout}" for p, layout in groups])
            ax.set_ylabel(label)
            graph_note = f", CUDA graph {_graph(graph)}" if graph is not None else ""
            ax.set_title(f"{label}, data={data}, compile={compiled}{graph_note}", fontsize=10)
            ax.margins(y=0.2)
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", title="backend")
    facts = _facts(ok)
    fig.suptitle(f"MobileNetV1 throughput: batch {'/'.join(facts['batch_size'])}, {'/'.join(facts['resolution'])} px, "
                 f"{'/'.join(facts['gpu'])}")
    fig.tight_layout(rect=(0, 0, 0.93, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare_runs(runs_dirs: list[Path], out: Path | None = None, name: str = "matrix", allow_mixed: bool = False,
                 allow_incomplete: bool = False) -> int:
    """Compare the runs under runs_dirs: write OUT/NAME.md (also printed), .csv and .png (OUT defaults to the first
    runs directory) and return the exit status: 0; 1 for mixed batch sizes or resolutions unless allow_mixed; 2 when
    nothing is comparable or a run is incomplete unless allow_incomplete."""
    try:
        rows = load_rows(runs_dirs)
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    incomplete = [r for r in rows if r.status == "incomplete"]
    for r in incomplete:
        print(f"error: {r.reason}", file=sys.stderr)
    if incomplete and not allow_incomplete:
        print(f"error: {len(incomplete)} run(s) lack hparams or required scalars ({', '.join(REQUIRED_SCALARS.values())}); "
              "fix or remove them, or pass --allow-incomplete", file=sys.stderr)
        return 2
    if not any(r.status == "ok" for r in rows):
        print("error: no run with results to compare (all skipped, failed or incomplete):\n  "
              + "\n  ".join(f"{r.run}: {r.status}: {r.reason}" for r in rows), file=sys.stderr)
        return 2
    warnings = mixed_settings(rows)
    mixed = [w for setting, w in warnings.items() if setting in ("batch_size", "resolution")]
    rows, repeat_notes = combine_repeats(rows)
    notes = list(warnings.values()) + repeat_notes + add_speedups(rows) + inference_note(rows)
    out = out or runs_dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, notes)
    (out / f"{name}.md").write_text(table + "\n")
    write_csv(rows, out / f"{name}.csv")
    try:
        write_plot(rows, out / f"{name}.png")
    except MissingDependency as e:  # the table and CSV are written; say why the chart is not
        print(table)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table)
    print(f"wrote {out / name}.md, .csv, .png")
    if mixed and not allow_mixed:
        print("error: " + "; ".join(w.removeprefix("WARNING: ") for w in mixed) + " (pass --allow-mixed to accept)", file=sys.stderr)
        return 1
    return 0

