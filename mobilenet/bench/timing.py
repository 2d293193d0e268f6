"""GPU timing shared by the kernel benchmarks (scripts/bench_depthwise.py, scripts/bench_norm.py): the copy
bandwidth that defines their HBM floor, a step timed from CUDA-graph replays with CUDA events, and back-to-back calls
timed between two CUDA events (the A/B scripts)."""

from __future__ import annotations

import statistics

import torch

__all__ = ["device_copy_bandwidth", "time_case", "events_elapsed_s"]


def events_elapsed_s(run, calls: int = 1) -> float:
    """Seconds the GPU takes for `calls` back-to-back calls of run(), between CUDA events recorded before the first
    and after the last (the host then waits for the second)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def device_copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n / statistics.median(times)


def time_case(step, n_sets: int, repeats: int) -> tuple[float, str]:
    """Median ms of one step, from graph replays of n_sets steps (one per input set)."""
    # Warm-up (JIT, cuDNN plans and autotuning, allocator) on the stream that then captures: autograd's
    # AccumulateGrad nodes remember the stream they were made on, and a backward captured against nodes of the
    # default stream fails.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(max(3, n_sets)):
            step(i % n_sets)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(n_sets):
                step(i)
        run, how = graph.replay, "graph"
    except Exception as e:  # noqa: BLE001 - report and time eagerly instead
        print(f"    graph capture failed ({type(e).__name__}: {str(e)[:100]}); timing eagerly", flush=True)
        torch.cuda.synchronize()

        def run():
            for i in range(n_sets):
                step(i)

        how = "eager"
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n_sets)
    return statistics.median(times), how
