"""`perf.stream=auto|default|dedicated`: the CUDA stream a run issues its work on.

PyTorch issues work on the device's default stream, which is CUDA's *legacy* default stream: every operation on
it waits for all earlier work on the process's blocking streams, and work on those streams waits for it. A library
that copies or launches on blocking streams (or on the legacy stream itself) then serialises with training
instead of overlapping it. DALI's GPU decoding is such a case: DALI-fed training runs clearly faster on a dedicated
stream, while with synthetic data the two streams are within the run-to-run spread (docs/results/loader_h200.md), so
`auto` uses a dedicated stream for data=dali only.

`perf.stream_priority=auto|normal|high` sets that stream's scheduling priority. With high, the GPU starts the run's
kernels ahead of work waiting on normal-priority streams, such as DALI's decoding, which then fills the gaps. It gains
a few percent DALI-fed and nothing with synthetic data (docs/results/loader_h200.md), so `auto` gives data=dali runs
the high priority.

`perf.max_connections=auto|1..32` sets CUDA_DEVICE_MAX_CONNECTIONS, the number of hardware work queues through which
the host feeds the GPU (CUDA's default: 8). Streams beyond that share queues, and work in one queue runs in order,
so a stream that shares a queue with the training stream waits behind the training kernels queued before its own
work, although the two are independent. DALI's decoder uses about 15 streams. 32 queues make DALI-fed training
faster, eager and more so captured (cuda_graph=true), and leave synthetic-data training unchanged
(docs/results/loader_h200.md). `auto` gives data=dali runs 32 and leaves other runs at CUDA's default, unless the
environment already sets the variable. It must be set before the process creates its CUDA context, so train.py and
infer.py apply it before they touch the GPU.

A dedicated stream is created with `torch.cuda.Stream()`, which PyTorch makes non-blocking. The run's model, optimizer
state and batches are created on it (so autograd's gradient accumulation runs on the stream that produces the
gradients), and the stream is ordered after the work queued before it and before the work queued after it.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import torch

from .config import enum_value

log = logging.getLogger(__name__)

CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
CUDA_DEFAULT_CONNECTIONS = 8  # what CUDA uses when the variable is not set
MAX_CONNECTIONS = 32  # CUDA's upper limit; also what auto gives data=dali runs
# The environment's own setting as last seen (None: unset), what apply_max_connections last left in the environment
# (so that a later run in the same process tells its own value from the user's), and the queue count it knows to be
# in force (None: not applied yet).
_user_value: str | None = None
_written: str | None = None
_in_force: int | None = None


def _queue_count(text: str) -> int | None:
    """`text` as a queue count CUDA takes (a whole number from 1 to MAX_CONNECTIONS), else None."""
    text = text.strip()
    n = int(text) if text.isdigit() else 0
    return n if 1 <= n <= MAX_CONNECTIONS else None


def parse_max_connections(value) -> int | None:
    """perf.max_connections as a queue count, or None for auto; a clear error for anything else."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    n = _queue_count(text)
    if n is None:
        raise ValueError(f"perf.max_connections={value!r} is not a choice: use auto or a whole number of hardware work "
                         f"queues from 1 to {MAX_CONNECTIONS} (CUDA_DEVICE_MAX_CONNECTIONS; CUDA's default is "
                         f"{CUDA_DEFAULT_CONNECTIONS})")
    return n


def _user_connections() -> int | None:
    """The queue count the user's environment sets: what the variable holds, unless this module put it there, in
    which case what it held before."""
    global _user_value
    raw = os.environ.get(CONNECTIONS_ENV)
    if raw != _written:  # set, changed or removed by someone else since this module last wrote it
        _user_value = raw
    if _user_value is None:
        return None
    n = _queue_count(_user_value)
    if n is None:
        raise ValueError(f"the environment sets {CONNECTIONS_ENV}={_user_value!r}; CUDA takes a whole number of queues "
                         f"from 1 to {MAX_CONNECTIONS}: fix or unset it")
    return n


def apply_max_connections(cfg) -> str:
    """Set CUDA_DEVICE_MAX_CONNECTIONS for perf.max_connections, before this process creates its CUDA context; return
    a description for the summary. An explicit value that can no longer take effect (CUDA already initialised with
    another count) is an error; auto says so in the summary and the log, and goes on."""
    global _written, _in_force
    asked = parse_max_connections(cfg.perf.max_connections)
    if enum_value(cfg.device) == "cpu":
        return "none (cpu)"
    env = _user_connections()
    if asked is not None:
        want, why = asked, f"perf.max_connections={asked}"
        if env is not None and env != asked:
            log.warning("perf.max_connections=%d replaces %s=%d from the environment", asked, CONNECTIONS_ENV, env)
    elif env is not None:
        want, why = env, f"{CONNECTIONS_ENV}={env} in the environment, perf.max_connections=auto"
    elif cfg.data.name == "dali":
        want, why = MAX_CONNECTIONS, "perf.max_connections=auto for data=dali"
    else:
        want, why = CUDA_DEFAULT_CONNECTIONS, "CUDA's default, perf.max_connections=auto"
    if torch.cuda.is_initialized():
        in_force = connections_in_force()
        if in_force != want:
            msg = (f"{want} hardware work queues ({why}) cannot take effect: this process initialised CUDA earlier with "
                   f"{in_force}. Set {CONNECTIONS_ENV}={want} in the environment before starting Python")
            if asked is not None:
                raise RuntimeError(msg)
            log.warning(msg)
            return f"{in_force} (CUDA was initialised before this run; auto wanted {want})"
        return f"{in_force} ({why})"
    if asked is None and env is None and want == CUDA_DEFAULT_CONNECTIONS:
        os.environ.pop(CONNECTIONS_ENV, None)  # nothing of the user's and CUDA's default: leave it unset
    else:
        os.environ[CONNECTIONS_ENV] = str(want)  # the user's own value again after an explicit one, or ours
    _written = os.environ.get(CONNECTIONS_ENV)
    _in_force = want
    return f"{want} ({why})"


def connections_in_force() -> int:
    """The hardware work queues of this process's CUDA context, as far as this process can know: what
    apply_max_connections set, else the environment's setting, else CUDA's default."""
    if _in_force is not None:
        return _in_force
    raw = os.environ.get(CONNECTIONS_ENV, "")
    return int(raw) if raw.strip().isdigit() else CUDA_DEFAULT_CONNECTIONS


def resolve(cfg, device: torch.device) -> tuple[torch.cuda.Stream | None, str]:
    """(the stream to issue the run's work on, or None for the default stream; a description for the summary).
    The schema (config.StreamMode, config.StreamPriority) has already refused any other value."""
    mode, priority = enum_value(cfg.perf.stream), enum_value(cfg.perf.stream_priority)
    if device.type != "cuda":
        if mode == "dedicated":
            raise ValueError(f"perf.stream=dedicated issues the run's work on a CUDA stream, but this run's device is "
                             f"{device.type}; use perf.stream=auto or perf.stream=default")
        if priority == "high":
            raise ValueError(f"perf.stream_priority=high sets a CUDA stream's priority, but this run's device is "
                             f"{device.type}; use perf.stream_priority=normal")
        return None, f"none ({device.type})"
    high = priority == "high" or (priority == "auto" and cfg.data.name == "dali")
    if mode == "default" or (mode == "auto" and cfg.data.name != "dali"):
        if priority == "high":
            raise ValueError(f"perf.stream_priority=high sets the priority of a dedicated stream, but this run uses "
                             f"the default stream (perf.stream={mode}, data={cfg.data.name}), whose priority is "
                             f"fixed; add perf.stream=dedicated")
        return None, f"default (perf.stream={mode})"
    why = " for data=dali" if mode == "auto" else ""
    if high:
        # PyTorch's stream pools: priority 0 (CUDA's default, the lowest) and negative values, higher the lower.
        return torch.cuda.Stream(device, priority=-1), f"dedicated, high priority (perf.stream={mode}{why})"
    return torch.cuda.Stream(device), f"dedicated (perf.stream={mode}{why})"


def hparams(stream: torch.cuda.Stream | None, device: torch.device) -> dict[str, str]:
    """What the HParams view records about the stream a run used (not the setting that chose it)."""
    if device.type != "cuda":
        return {"stream": "none", "stream_priority": "none"}
    if stream is None:
        return {"stream": "default", "stream_priority": "normal"}
    return {"stream": "dedicated", "stream_priority": "high" if stream.priority < 0 else "normal"}


@contextmanager
def issued_on(stream: torch.cuda.Stream | None):
    """Make `stream` the current stream for the block (nothing changes for None). It first waits for the work
    already queued on the stream it replaces, and that stream waits for the block's work afterwards, so work on
    either side sees the other's results. Memory is another matter: a tensor allocated on one stream and freed
    while the other still uses it needs `Tensor.record_stream`; the Trainer allocates the run's tensors inside
    the block and keeps them for the whole run."""
    if stream is None:
        yield
        return
    outer = torch.cuda.current_stream(stream.device)
    stream.wait_stream(outer)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        outer.wait_stream(stream)
