"""Child processes of the measuring scripts: each in its own session with its output in a log file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_logged(cmd: list[str], log_path: Path, timeout: float, env: dict[str, str] | None = None) -> int | None:
    """Run cmd in the repository root with stdout and stderr in log_path; its exit status, or None on a timeout.

    The child gets its own session, so that a timeout, Ctrl-C or SIGTERM here also ends what it started (torchrun's
    workers, torch.compile's compile workers): the whole process group is killed, then the exception goes on (a
    timeout is returned as None instead)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except BaseException as e:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            return None


def exit_on_sigterm() -> None:
    """A SIGTERM (e.g. a job's time limit) unwinds like Ctrl-C, so that run_logged ends the running child too."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
