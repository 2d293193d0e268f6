"""train.py runs started by the comparison scripts (check_scaling.py, check_loader.py): each run a process of its own
into a log_root of its own, its result read back from its TensorBoard events, a failure reported with its output."""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import override_key
from ..reporting import read_tensorboard
from ..subprocesses import run_logged

# What keeps a run short and its timing clean: nothing but training.
FIXED = ["evaluate=false", "save_checkpoints=false", "progress=false"]
TAIL_LINES = 60


class TrainRunError(RuntimeError):
    """A run failed or could not be read; the message says which and why."""


@dataclass
class TrainRun:
    img_s: float  # perf/train_img_s: images of all ranks over the slowest rank's timed window
    scalars: dict[str, float]  # every scalar's last value
    command: str  # as a user would type it
    run_dir: Path
    seconds: float


def merge_overrides(defaults: list[str], extra: list[str]) -> list[str]:
    """defaults then extra, where an extra override replaces a default of the same key (no duplicates in commands)."""
    keys = {override_key(o) for o in extra}
    return [o for o in defaults if override_key(o) not in keys] + list(extra)


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])


def run_child(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> None:
    """Run one train.py invocation with its output in log_path; raises TrainRunError (with the log's tail) on
    failure."""
    rc = run_logged(cmd, log_path, timeout, env)  # a timeout or Ctrl-C here also ends torchrun's worker processes
    if rc != 0:
        why = f"timed out after {timeout:.0f} s (--timeout)" if rc is None else f"exited with status {rc}"
        raise TrainRunError(f"this run {why}:\n  {shlex.join(cmd)}\nlast {TAIL_LINES} lines of its output "
                            f"({log_path}):\n{tail(log_path)}")


def read_run(log_root: Path, log_path: Path, processes: int = 1) -> tuple[Path, dict]:
    """The one run under log_root that wrote TensorBoard scalars: (its dir, {tag: last value})."""
    runs = {d: v for d, v in read_tensorboard(log_root).items() if v[1]}
    if len(runs) != 1:
        raise TrainRunError(f"{log_root}: expected the event file of one run, found {len(runs)} "
                            f"({', '.join(map(str, runs)) or 'none'}); its output ({log_path}) ends:\n{tail(log_path)}")
    (run_dir, (hparams, scalars)), = runs.items()
    if "perf/train_img_s" not in scalars or not scalars["perf/train_img_s"] > 0:
        raise TrainRunError(f"{run_dir}: perf/train_img_s is {scalars.get('perf/train_img_s', 'missing')} "
                            f"(no timed steps? --steps must leave steps after --warmup)")
    if hparams is not None and int(float(hparams.get("world_size", processes))) != processes:
        raise TrainRunError(f"{run_dir}: logged world_size {hparams.get('world_size')}, expected {processes}")
    return run_dir, scalars


def run_train(overrides: list[str], log_root: Path, env: dict[str, str], timeout: float, processes: int = 1,
              extra: list[str] = ()) -> TrainRun:
    """`python train.py OVERRIDES log_root=LOG_ROOT [EXTRA]`, under torchrun for several processes; its img/s and
    scalars from its event files. log_root must not exist yet: the run must be the only one read back from it."""
    args = ["train.py", *overrides, f"log_root={log_root}", *extra]
    launcher = [] if processes == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    cmd = [sys.executable, *launcher, *args]
    log_root.mkdir(parents=True)
    log_path = log_root / "output.log"
    started = time.perf_counter()
    run_child(cmd, env, log_path, timeout)
    seconds = time.perf_counter() - started
    run_dir, scalars = read_run(log_root, log_path, processes)
    shown = shlex.join(["python", *cmd[1:]])  # the interpreter by its usual name; everything else as it ran
    return TrainRun(scalars["perf/train_img_s"], scalars, shown, run_dir, seconds)


def num(v: float) -> str:
    """An img/s or ms figure as the reports print it."""
    return f"{v:,.1f}" if abs(v) < 100 else f"{v:,.0f}"
