"""Data-parallel runs under torchrun: one process per GPU (NCCL) or per CPU worker (gloo).

`torchrun --nproc_per_node=N train.py ...` sets RANK, WORLD_SIZE and LOCAL_RANK; a plain `python train.py` has
none of them and runs as a world of one, with no process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .cuda_graph import release_captured_steps
from .meter import Throughput


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device: torch.device, timeout_s: int) -> tuple[DistInfo, torch.device]:
    """Join the process group torchrun describes (once per process); returns this rank's info and device."""
    if not launched_by_torchrun():
        return DistInfo(), device
    info = DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        if info.local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={info.local_rank} but this host has {torch.cuda.device_count()} GPU(s): "
                               f"use --nproc_per_node <= {torch.cuda.device_count()}")
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # A rank that crashes makes the others fail at their next collective after timeout_s, not hang forever.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return info, device


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def sum_over_ranks(values: list[float], device: torch.device, info: DistInfo) -> list[float]:
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def max_over_ranks(value: float, device: torch.device, info: DistInfo) -> float:
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def shutdown() -> None:
    if dist.is_initialized():
        release_captured_steps()  # graphs that captured NCCL collectives would block the destroy forever
        dist.destroy_process_group()


def throughput_over_ranks(tp: Throughput, device: torch.device, info: DistInfo) -> Throughput:
    """Images summed over ranks over the slowest rank's time: the run's img/s, not one GPU's."""
    if not info.enabled:
        return tp
    images, = sum_over_ranks([tp.images], device, info)

    def slowest(value: float) -> float:
        return max_over_ranks(value, device, info)

    return Throughput(images=int(images), steps=tp.steps, seconds=slowest(tp.seconds),
                      compute_seconds=slowest(tp.compute_seconds), data_wait_seconds=slowest(tp.data_wait_seconds),
                      step_ms_median=slowest(tp.step_ms_median), machine_load=tp.machine_load)
