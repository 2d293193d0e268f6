"""`perf.stream=auto|default|dedicated`: the CUDA stream a run issues its work on.

PyTorch issues work on the device's default stream, which is CUDA's *legacy* default stream: every operation on
it waits for all earlier work on the process's blocking streams, and work on those streams waits for it. A library
that copies or launches on blocking streams (or on the legacy stream itself) then serialises with training
instead of overlapping it. DALI's GPU decoding is such a case: on the H200, DALI-fed training (fp16, channels_last,
batch 256) ran at 12.7k img/s on a dedicated stream against 10.2k on the default stream, one A/B pair back to back
(docs/results/loader_h200.md). With synthetic data the two were within 2% (14.7k vs 15.0k, one run each), so
`auto` uses a dedicated stream for data=dali only.

`perf.stream_priority=auto|normal|high` sets that stream's scheduling priority. With high, the GPU starts the run's
kernels ahead of work waiting on normal-priority streams, such as DALI's decoding, which then fills the gaps. DALI-fed
training measured 12.4k (twice) against 12.0k and 12.2k img/s at normal priority, two A/B pairs, and synthetic data
15.0k either way, so `auto` gives data=dali runs the high priority.

A dedicated stream is created with `torch.cuda.Stream()`, which PyTorch makes non-blocking. The run's model, optimizer
state and batches are created on it (so autograd's gradient accumulation runs on the stream that produces the
gradients), and the stream is ordered after the work queued before it and before the work queued after it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .config import enum_value


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
