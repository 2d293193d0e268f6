"""`perf.sample_load=auto|true|false`: what the machine did while a run trained.

A loader-fed run that waits for data can be short of host CPU (its own threads, or a virtual machine's CPUs taken by
its neighbours: steal time), of the GPU's JPEG engines, or of SMs shared with the step. The step's own figures cannot
tell these apart, and DALI-fed runs of one command have differed by up to a quarter from one process to the next
(docs/results/loader_h200.md). So over the timed steps of each epoch the sampler records:

- the host's CPU time from /proc/stat: busy, steal and iowait shares of all CPUs (exact over the window: the
  counters' difference from its start to its end);
- this process's threads from /proc/self/task at the window's two ends: CPU cores used per thread name (DALI names
  its threads) and, where a group may run on fewer CPUs than the process, on how many; and the busiest single
  thread, which shows a loader bound by one thread (a thread that ends inside the window is not counted);
- the GPU through NVML (nvidia-ml-py, when installed), read by a background thread every `INTERVAL_S`: SM and
  JPEG-engine busy shares, the SM clock and the reasons NVML gives for holding the clock down (power, thermal), as
  medians of the samples.

Worker *processes* (data=folder's DataLoader) are not this process's threads: they show in the host's busy share
only. `auto` samples the runs whose loader decodes images (data=dali, data=folder) and leaves the others' timing
untouched. A sample of NVML costs tens of microseconds; the host's counters are read twice per window.
"""

from __future__ import annotations

import functools
import os
import re
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import enum_value
from .errors import ConfigError

MODES = ("auto", "true", "false")
# Loaders whose images are decoded in this process or its workers: the runs `auto` samples.
DECODING_LOADERS = ("dali", "folder")
INTERVAL_S = 0.25
# Thresholds for the summary's notes: steal above this share of the CPUs is another machine's load on ours; a thread
# above this share of one core is near the most one thread can do.
STEAL_NOTE_PCT = 5.0
BUSY_THREAD_NOTE = 0.9
JPEG_NOTE_PCT = 90.0
# NVML's clock-event reasons worth naming (an idle GPU's reason is not one: the window is a training loop).
_CLOCK_REASONS = {
    "nvmlClocksEventReasonSwPowerCap": "power cap",
    "nvmlClocksEventReasonHwSlowdown": "hardware slowdown",
    "nvmlClocksEventReasonSwThermalSlowdown": "thermal (software)",
    "nvmlClocksEventReasonHwThermalSlowdown": "thermal (hardware)",
    "nvmlClocksEventReasonHwPowerBrakeSlowdown": "power brake",
}


def sampling_wanted(cfg) -> tuple[bool, str]:
    """(sample or not, the summary's words) for perf.sample_load; a clear error for a value that is not a choice."""
    mode = str(cfg.perf.sample_load).lower()  # Hydra hands `=true` over as a bool
    if mode not in MODES:
        raise ConfigError(f"perf.sample_load={cfg.perf.sample_load!r} is not a choice; choose one of: {', '.join(MODES)}")
    loader = enum_value(cfg.data.name)
    if mode == "auto":
        on = loader in DECODING_LOADERS
        why = f"data={loader} decodes images" if on else f"data={loader} decodes nothing"
        return on, f"{'sampled' if on else 'not sampled'} (perf.sample_load=auto: {why})"
    return mode == "true", f"{'sampled' if mode == 'true' else 'not sampled'} (perf.sample_load={mode})"


def sampler_for(cfg, device: torch.device) -> LoadSampler | None:
    """A sampler for one epoch's timed window where perf.sample_load asks for one."""
    return LoadSampler(device) if sampling_wanted(cfg)[0] else None


# --------------------------------------------------------------------------------------------------- host


@dataclass(frozen=True)
class CpuTimes:
    """The host's CPU time (clock ticks, all CPUs together) from the first line of /proc/stat."""
    busy: int
    steal: int
    iowait: int
    total: int


def parse_cpu_times(text: str) -> CpuTimes:
    """/proc/stat's aggregate `cpu` line: user nice system idle iowait irq softirq steal [guest guest_nice]."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            v = [int(x) for x in fields[1:9]] + [0] * max(0, 8 - len(fields[1:9]))
            user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
            # guest time is already counted in user (and guest_nice in nice), so it is not added again.
            busy = user + nice + system + irq + softirq
            return CpuTimes(busy=busy, steal=steal, iowait=iowait, total=busy + idle + iowait + steal)
    raise ValueError("no aggregate 'cpu' line in /proc/stat's text")


def parse_task_stat(text: str) -> tuple[str, int]:
    """(thread name, user + system clock ticks) from one /proc/<pid>/task/<tid>/stat line. The name sits between the
    first '(' and the *last* ')', since a thread may name itself with parentheses or spaces."""
    start, end = text.index("("), text.rindex(")")
    name = text[start + 1:end]
    rest = text[end + 2:].split()  # fields from the third (state) on
    utime, stime = int(rest[11]), int(rest[12])  # fields 14 and 15 of proc(5)
    return name, utime + stime


def read_cpu_times() -> CpuTimes | None:
    try:
        with open("/proc/stat") as f:
            return parse_cpu_times(f.read())
    except (OSError, ValueError):
        return None


def read_threads(pid: int | None = None) -> dict[int, tuple[str, int]]:
    """{thread id: (name, CPU ticks)} of a process's threads (this one's by default); {} where /proc is absent."""
    root = f"/proc/{pid or os.getpid()}/task"
    out: dict[int, tuple[str, int]] = {}
    try:
        tids = os.listdir(root)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{root}/{tid}/stat") as f:
                out[int(tid)] = parse_task_stat(f.read())
        except (OSError, ValueError, IndexError):  # the thread ended between the listing and the read
            continue
    return out


def thread_cpus(tid: int) -> set[int]:
    """The CPUs a thread may run on; empty where it ended or cannot be asked."""
    try:
        return set(os.sched_getaffinity(tid))
    except OSError:
        return set()


def thread_group(name: str) -> str:
    """Threads of one pool differ only in their numbers ('[DALI][TP0]', '[DALI][TP1]'): group them as '[DALI][TP#]'."""
    return re.sub(r"\d+", "#", name)


# ---------------------------------------------------------------------------------------------------- GPU


class GpuProbe:
    """One GPU's NVML readings; `unavailable` says why there are none (no nvidia-ml-py, no NVML, a CPU run)."""

    def __init__(self, device: torch.device):
        self.unavailable: str | None = None
        self._nvml = self._handle = None
        self._jpeg = True
        if device.type != "cuda":
            self.unavailable = "a CPU run"
            return
        try:
            import pynvml
        except ImportError:
            self.unavailable = "nvidia-ml-py is not installed (`pip install nvidia-ml-py`, or the monitor extra)"
            return
        try:
            pynvml.nvmlInit()
            # By UUID: CUDA's device numbering (CUDA_VISIBLE_DEVICES, ordering) need not be NVML's.
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception as e:  # NVML's errors are its own class hierarchy; any of them means no readings
            self.unavailable = f"NVML: {e}"
            return
        self._nvml = pynvml

    def sample(self) -> dict[str, Any]:
        """SM busy %, JPEG engines busy % (None where NVML has no such counter), SM clock MHz, clock-reason mask."""
        nv, h = self._nvml, self._handle
        out: dict[str, Any] = {"sm_pct": nv.nvmlDeviceGetUtilizationRates(h).gpu,
                               "sm_clock_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)}
        if self._jpeg:
            try:
                out["jpeg_pct"] = nv.nvmlDeviceGetJpgUtilization(h)[0]
            except Exception:  # a GPU without JPEG engines, or a driver without the counter: stop asking
                self._jpeg = False
        try:
            out["reasons"] = nv.nvmlDeviceGetCurrentClocksEventReasons(h)
        except Exception:
            pass
        return out

    def reason_names(self, mask: int) -> list[str]:
        return [words for name, words in _CLOCK_REASONS.items() if mask & getattr(self._nvml, name, 0)]


@functools.cache
def gpu_probe(device: torch.device) -> GpuProbe:
    """The process's probe of `device`: NVML is initialised and the device looked up once, not every epoch."""
    return GpuProbe(device)


# ------------------------------------------------------------------------------------------------ summary


@dataclass
class MachineLoad:
    """What the machine did over one sampled window."""
    seconds: float
    cpus: int
    cpu_busy_pct: float | None  # of all CPUs' time, this process and every other
    cpu_steal_pct: float | None
    cpu_iowait_pct: float | None
    process_cores: float | None  # this process's threads together, in cores
    process_cpus: int = 0  # the CPUs this process may run on (a container's or taskset's share of `cpus`)
    # (name, threads, cores, CPUs they may run on), busiest first; None where they may run on all of process_cpus
    thread_groups: list[tuple[str, int, float, int | None]] = field(default_factory=list)
    busiest_thread: tuple[str, float] | None = None  # (name, share of one core)
    gpu_samples: int = 0
    sm_pct: float | None = None  # medians of the samples
    jpeg_pct: float | None = None
    sm_clock_mhz: float | None = None
    clock_reasons: list[str] = field(default_factory=list)  # named in any sample
    gpu_unavailable: str | None = None
    host_computes: bool = False  # a CPU run: its threads do the model's arithmetic, so a busy one is no finding

    def notes(self) -> list[str]:
        """Readings that point at what a loader-bound step waited for."""
        notes = []
        if self.cpu_steal_pct is not None and self.cpu_steal_pct >= STEAL_NOTE_PCT:
            notes.append(f"{self.cpu_steal_pct:.0f}% of the host's CPU time was stolen by other virtual machines: "
                         "a host-bound loader's speed varies with it")
        if self.busiest_thread and self.busiest_thread[1] >= BUSY_THREAD_NOTE and not self.host_computes:
            name, share = self.busiest_thread
            notes.append(f"thread {name!r} ran {share:.0%} of a core: work bound by one thread goes no faster")
        if self.jpeg_pct is not None and self.jpeg_pct >= JPEG_NOTE_PCT:
            notes.append(f"the JPEG engines were {self.jpeg_pct:.0f}% busy: near what they can decode")
        if self.clock_reasons:
            notes.append(f"the SM clock was held down ({', '.join(self.clock_reasons)})")
        return notes

    def rows(self) -> dict[str, str]:
        """The run summary's rows."""
        rows: dict[str, str] = {}
        if self.cpu_busy_pct is not None:
            rows["host CPUs busy / steal / iowait"] = (f"{self.cpu_busy_pct:.0f}% / {self.cpu_steal_pct:.1f}% / "
                                                      f"{self.cpu_iowait_pct:.1f}% of {self.cpus} CPUs")
        if self.process_cores is not None:
            groups = ", ".join(f"{name}{f' x{n}' if n > 1 else ''} {cores:.2f}"
                               f"{f' on {cpus} of {self.process_cpus} CPUs' if cpus is not None else ''}"
                               for name, n, cores, cpus in self.thread_groups)
            rows["this process, cores"] = f"{self.process_cores:.2f} ({groups})" if groups else f"{self.process_cores:.2f}"
        if self.busiest_thread is not None:
            rows["busiest thread"] = f"{self.busiest_thread[0]} ({self.busiest_thread[1]:.0%} of a core)"
        if self.gpu_unavailable is not None:
            rows["GPU load"] = f"not sampled: {self.gpu_unavailable}"
        elif self.gpu_samples:
            jpeg = "no counter" if self.jpeg_pct is None else f"{self.jpeg_pct:.0f}%"
            rows["GPU SMs / JPEG engines busy"] = f"{self.sm_pct:.0f}% / {jpeg} (median of {self.gpu_samples} samples)"
            reasons = ", ".join(self.clock_reasons) or "none named"
            rows["SM clock"] = f"{self.sm_clock_mhz:.0f} MHz median (held down by: {reasons})"
        for i, note in enumerate(self.notes()):
            rows[f"load note {i + 1}"] = note
        return rows

    def line(self) -> str:
        """The readings on one line, for a benchmark's table."""
        parts = []
        if self.cpu_busy_pct is not None:
            parts.append(f"host {self.cpu_busy_pct:.0f}% busy, {self.cpu_steal_pct:.1f}% steal")
        if self.process_cores is not None:
            parts.append(f"process {self.process_cores:.1f} cores")
        if self.busiest_thread is not None:
            parts.append(f"busiest thread {self.busiest_thread[0]} {self.busiest_thread[1]:.0%}")
        if self.gpu_samples:
            jpeg = "-" if self.jpeg_pct is None else f"{self.jpeg_pct:.0f}%"
            parts.append(f"SMs {self.sm_pct:.0f}%, JPEG {jpeg}, {self.sm_clock_mhz:.0f} MHz")
        elif self.gpu_unavailable is not None:
            parts.append(f"GPU not sampled ({self.gpu_unavailable})")
        return "; ".join(parts)

    def scalars(self) -> dict[str, float]:
        """TensorBoard scalars (sys/...) of the readings there are."""
        busiest = None if self.busiest_thread is None else 100 * self.busiest_thread[1]
        named = {"sys/cpu_busy_pct": self.cpu_busy_pct, "sys/cpu_steal_pct": self.cpu_steal_pct,
                 "sys/process_cores": self.process_cores, "sys/busiest_thread_pct": busiest,
                 "sys/gpu_sm_pct": self.sm_pct, "sys/jpeg_pct": self.jpeg_pct, "sys/sm_clock_mhz": self.sm_clock_mhz}
        return {k: float(v) for k, v in named.items() if v is not None}


class LoadSampler:
    """Samples from `start()` to `stop()`; `stop()` returns the window's MachineLoad. Host readings come from the
    counters' differences over the whole window; the GPU's from NVML's own short-window utilisation, sampled."""

    def __init__(self, device: torch.device, interval_s: float = INTERVAL_S):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.device = device
        self.interval_s = interval_s
        self._gpu = gpu_probe(device)
        self._gpu_samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._cpu0: CpuTimes | None = None
        self._threads0: dict[int, tuple[str, int]] = {}

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> LoadSampler:
        if self._thread is not None:
            raise RuntimeError("LoadSampler.start() called twice")
        self._t0 = time.perf_counter()
        self._cpu0 = read_cpu_times()
        self._threads0 = read_threads()
        self._thread = threading.Thread(target=self._run, name="mobilenet-load", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        # Only NVML is read in the loop (tens of microseconds); the threads' counters (about a millisecond for 60
        # threads, with the GIL held) only at the window's two ends.
        while not self._stop.wait(self.interval_s):
            if self._gpu.unavailable is None:
                self._gpu_samples.append(self._gpu.sample())

    def stop(self) -> MachineLoad:
        if self._thread is None:
            raise RuntimeError("LoadSampler.stop() before start()")
        self._stop.set()
        self._thread.join()
        seconds = time.perf_counter() - self._t0
        cpu1 = read_cpu_times()
        threads1 = read_threads()
        load = MachineLoad(seconds=seconds, cpus=os.cpu_count() or 1, cpu_busy_pct=None, cpu_steal_pct=None,
                           cpu_iowait_pct=None, process_cores=None, gpu_unavailable=self._gpu.unavailable,
                           host_computes=self.device.type != "cuda")
        if self._cpu0 is not None and cpu1 is not None and cpu1.total > self._cpu0.total:
            total = cpu1.total - self._cpu0.total
            load.cpu_busy_pct = 100.0 * (cpu1.busy - self._cpu0.busy) / total
            load.cpu_steal_pct = 100.0 * (cpu1.steal - self._cpu0.steal) / total
            load.cpu_iowait_pct = 100.0 * (cpu1.iowait - self._cpu0.iowait) / total
        if threads1 and seconds > 0:
            self._thread_figures(load, threads1, seconds)
        self._gpu_figures(load)
        return load

    def _thread_figures(self, load: MachineLoad, threads1: dict[int, tuple[str, int]], seconds: float) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        per_thread: dict[int, tuple[str, float]] = {}
        for tid, (name, ticks) in threads1.items():
            before = self._threads0.get(tid, (name, 0))[1]  # a thread started in the window counts from zero
            # At most one core: the counters advance in whole clock ticks, which can overshoot a short window.
            per_thread[tid] = (name, min(1.0, max(0, ticks - before) / tick / seconds))
        load.process_cores = sum(c for _, c in per_thread.values())
        process_cpus = thread_cpus(os.getpid()) or set(range(load.cpus))
        load.process_cpus = len(process_cpus)
        groups: dict[str, list[float]] = {}
        allowed: dict[str, set[int]] = {}
        for tid, (name, cores) in per_thread.items():
            group = thread_group(name)
            groups.setdefault(group, []).append(cores)
            # Where a library pins its threads (DALI pins its pools to the CPUs NVML names near the GPU), a group
            # confined to a few CPUs can be short of them while the host has idle ones.
            allowed.setdefault(group, set()).update(thread_cpus(tid) or process_cpus)
        ranked = sorted(((g, len(c), sum(c), len(allowed[g]) if len(allowed[g]) < len(process_cpus) else None)
                         for g, c in groups.items()), key=lambda x: -x[2])
        load.thread_groups = [g for g in ranked if g[2] >= 0.01][:6]
        name, cores = max(per_thread.values(), key=lambda x: x[1])
        load.busiest_thread = (name, cores)

    def _gpu_figures(self, load: MachineLoad) -> None:
        samples = self._gpu_samples
        load.gpu_samples = len(samples)
        if not samples:
            return
        load.sm_pct = statistics.median(s["sm_pct"] for s in samples)
        load.sm_clock_mhz = statistics.median(s["sm_clock_mhz"] for s in samples)
        jpeg = [s["jpeg_pct"] for s in samples if "jpeg_pct" in s]
        load.jpeg_pct = statistics.median(jpeg) if jpeg else None
        mask = 0
        for s in samples:
            mask |= s.get("reasons", 0)
        load.clock_reasons = self._gpu.reason_names(mask)
