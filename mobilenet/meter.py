"""Throughput that is honest about asynchronous GPUs.

- Warm-up steps (module load, cuDNN autotune, allocator growth, compilation) are excluded.
- Wall time is read only after synchronising the device, so queued work is never missed.
- Throughput is total images over total time, never a mean of per-step rates.
- Compute time is measured with CUDA events around forward+backward+optimizer (host clock on CPU); data wait
  is the host time spent blocked on the loader. Both are reported, with total img/s beside compute img/s.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .machine_load import LoadSampler, MachineLoad


@dataclass
class Throughput:
    images: int
    steps: int
    seconds: float  # wall time of the timed steps, device synchronised at both ends
    compute_seconds: float  # sum over timed steps of forward+backward+optimizer time
    data_wait_seconds: float  # sum over timed steps of host time blocked on the loader
    step_ms_median: float  # median wall time between consecutive step ends (host clock)
    machine_load: MachineLoad | None = None  # this process's readings over the timed steps (perf.sample_load)

    @property
    def img_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else float("nan")

    @property
    def compute_img_s(self) -> float:
        return self.images / self.compute_seconds if self.compute_seconds > 0 else float("nan")

    @property
    def step_ms(self) -> float:
        return 1000 * self.seconds / self.steps if self.steps else float("nan")

    @property
    def data_wait_ms(self) -> float:
        return 1000 * self.data_wait_seconds / self.steps if self.steps else float("nan")


class StepMeter:
    """Call `data_start()` before fetching a batch, `compute_start()` once it arrived, `step_end(n)` after the
    optimizer step. `result()` synchronises and returns the figures of the steps after warm-up."""

    def __init__(self, device: torch.device, warmup_steps: int, load_sampler: LoadSampler | None = None):
        """`load_sampler` samples the machine over the timed window (opened after the warm-up, closed by result(),
        whose Throughput carries its readings)."""
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.device = device
        self.load_sampler = load_sampler
        self.warmup_steps = warmup_steps
        self.cuda = device.type == "cuda"
        self.steps_seen = 0
        self.images = 0
        self.steps = 0
        self.data_wait = 0.0
        self.compute = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._t_data = self._t_compute = 0.0
        self._start_event: torch.cuda.Event | None = None
        self._t_start: float | None = None
        self._step_ends: list[float] = []
        self._ev_compute: torch.cuda.Event | None = None

    @property
    def timing(self) -> bool:
        return self.steps_seen >= self.warmup_steps

    def data_start(self) -> None:
        if self.timing and self._t_start is None:
            # The timed window opens here: drain the warm-up's queued work first.
            if self.cuda:
                torch.cuda.synchronize(self.device)
            if self.load_sampler is not None:
                self.load_sampler.start()
            self._t_start = time.perf_counter()
        self._t_data = time.perf_counter()

    def compute_start(self) -> None:
        now = time.perf_counter()
        if self.timing:
            self.data_wait += now - self._t_data
        self._t_compute = now
        if self.timing and self.cuda:
            self._ev_compute = torch.cuda.Event(enable_timing=True)
            self._ev_compute.record()

    def step_end(self, batch_images: int) -> None:
        if self.timing:
            self.images += batch_images
            self.steps += 1
            if self.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((self._ev_compute, end))
                self._resolve(keep=64)
            else:
                self.compute += time.perf_counter() - self._t_compute
            self._step_ends.append(time.perf_counter())
        self.steps_seen += 1

    def _resolve(self, keep: int) -> None:
        # Read back finished event pairs now and then, so the list stays short without forcing a sync.
        while len(self._events) > keep and self._events[0][1].query():
            start, end = self._events.pop(0)
            self.compute += start.elapsed_time(end) / 1000

    def result(self) -> Throughput:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        load = self.load_sampler.stop() if self.load_sampler is not None and self.load_sampler.started else None
        for start, stop in self._events:
            self.compute += start.elapsed_time(stop) / 1000
        self._events.clear()
        seconds = end - self._t_start if self._t_start is not None and self.steps else 0.0
        gaps = [b - a for a, b in zip(self._step_ends, self._step_ends[1:])]
        return Throughput(
            images=self.images,
            steps=self.steps,
            seconds=seconds,
            compute_seconds=self.compute,
            data_wait_seconds=self.data_wait,
            step_ms_median=1000 * statistics.median(gaps) if gaps else float("nan"),
            machine_load=load,
        )

    def live_img_s(self, window: int = 20) -> float | None:
        """A rough live rate for the progress bar (host clock; the host runs ahead of the GPU by a bounded queue)."""
        if len(self._step_ends) < 2:
            return None
        ends = self._step_ends[-window:]
        if len(ends) < 2 or ends[-1] == ends[0]:
            return None
        return self.images / self.steps * (len(ends) - 1) / (ends[-1] - ends[0])
