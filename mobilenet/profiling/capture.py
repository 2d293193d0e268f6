"""Capture: torch.profiler over a window of steps, the trace written with the run's facts, then diagnosed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..reporting import environment
from .analysis import analyse_trace
from .report import Report
from .trace import META_KEY, load_trace

TRACE_FILE = "trace.json.gz"
REPORT_FILE = "profile_report.md"

# Defaults when no ProfilerConfig is given (same values as mobilenet.config.ProfilerConfig, which imports Hydra).
_DEFAULT_SCHEDULE = {"skip_first": 10, "warmup": 3, "active": 10, "top_k": 15}


class StepProfiler:
    """torch.profiler over a window of steps, with record_function ranges and a diagnosis at the end.

    Args:
        run_dir: where `trace.json.gz` and `profile_report.md` go.
        device: the run's device; on CPU only CPU ops are traced and the report says there was no GPU.
        meta: facts about the run shown in the report and stored in the trace (key `mobilenet_meta`) so offline
            analysis has them. Recognised keys: mode (train|infer), backend, precision, memory_format,
            batch_size, resolution, compile; any other key is listed as is. Versions and the GPU name
            (mobilenet.reporting.environment) are filled in when meta does not already carry them.
        cfg: any object with skip_first, warmup, active, top_k (mobilenet.config.ProfilerConfig).
        baseline_step_ms: the unprofiled median step time, when already known (it is then stored in the trace
            too); `finish(baseline_step_ms)` may give it instead.
    """

    def __init__(self, run_dir: str | Path, device: torch.device | str, meta: dict[str, Any] | None = None,
                 cfg: Any = None, *, baseline_step_ms: float | None = None, print_report: bool = True):
        from torch.profiler import ProfilerActivity, profile, schedule

        self.run_dir = Path(run_dir)
        self.device = torch.device(device)
        sched = {k: getattr(cfg, k, v) if cfg is not None else v for k, v in _DEFAULT_SCHEDULE.items()}
        if sched["active"] < 1 or sched["warmup"] < 0 or sched["skip_first"] < 0:
            raise ValueError(f"profiler schedule needs active >= 1, warmup >= 0, skip_first >= 0; got {sched}")
        self.skip_first, self.warmup, self.active, self.top_k = (int(sched[k]) for k in ("skip_first", "warmup", "active", "top_k"))
        meta = meta or {}
        # The engine and infer.py pass the whole environment in meta already (run_meta); gather it only when missing.
        env = meta if "torch" in meta else environment(self.device)
        self.meta = {**env, "device": self.device.type, **meta}
        self.meta["profiler_schedule"] = {"skip_first": self.skip_first, "warmup": self.warmup, "active": self.active}
        if baseline_step_ms is not None:
            self.meta["baseline_step_ms"] = float(baseline_step_ms)  # finish() reads it back through analyse_trace
        self._meta_json = json.dumps(self.meta, default=str)  # meta is fixed from here on
        self.print_report = print_report
        self.finished = False
        self.recorded_steps = 0
        self.trace_path = self.run_dir / TRACE_FILE
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            schedule=schedule(skip_first=self.skip_first, wait=0, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=self._on_trace_ready,
            record_shapes=True,
        )
        self._running = False

    @property
    def total_steps(self) -> int:
        """How many step() calls the window needs."""
        return self.skip_first + self.warmup + self.active

    def __enter__(self) -> "StepProfiler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def start(self) -> None:
        self._prof.start()
        self._running = True
        self._tag_trace()

    def range(self, name: str):
        """A named range (record_function) in the trace: data, forward, backward, optimizer, ..."""
        return torch.profiler.record_function(name)

    def step(self) -> None:
        """Call once at the end of every step, inside the `with`."""
        if not self._running:
            return
        from torch.profiler import ProfilerAction

        if self._prof.current_action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            self.recorded_steps += 1
        self._prof.step()
        self._tag_trace()

    def _tag_trace(self) -> None:
        from torch.profiler import ProfilerAction

        # Kineto drops metadata added while it is not tracing, so tag every traced step (the last write wins).
        if self._prof.current_action != ProfilerAction.NONE:
            self._prof.add_metadata_json(META_KEY, self._meta_json)

    def _on_trace_ready(self, prof) -> None:
        # Exported in finish(): writing a large trace here would stall the step that closes the window.
        self.finished = True

    def _stop(self) -> None:
        if self._running:
            self._running = False
            self._prof.stop()

    def finish(self, baseline_step_ms: float | None = None) -> Report:
        """Stop, export the trace, analyse it, print and save the report; returns it (`.markdown()` for text).
        Without baseline_step_ms, the one given to __init__ (stored in meta) is used."""
        self._stop()
        if not self.finished or self.recorded_steps == 0:
            raise RuntimeError(
                f"the profiler recorded no step: call step() at least skip_first + warmup + 1 = "
                f"{self.skip_first + self.warmup + 1} times (recorded {self.recorded_steps} of {self.active} active steps)"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.trace_path))
        trace = load_trace(self.trace_path)
        report = analyse_trace(trace, baseline_step_ms=baseline_step_ms, meta=self.meta, top_k=self.top_k,
                               trace_path=str(self.trace_path))
        if self.recorded_steps < self.active:
            report.notes.append(f"only {self.recorded_steps} of the {self.active} active steps ran before finish()")
        md = report.markdown()
        (self.run_dir / REPORT_FILE).write_text(md)
        if self.print_report:
            print(md)
        return report
