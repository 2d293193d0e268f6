"""The meter on a CPU, with steps of known duration: warm-up excluded, totals over totals, data wait apart."""

import time

import pytest
import torch

from mobilenet.meter import StepMeter


def run_steps(meter, durations, data_wait, batch):
    for d in durations:
        meter.data_start()
        time.sleep(data_wait)
        meter.compute_start()
        time.sleep(d)
        meter.step_end(batch)


def test_warmup_is_excluded_and_rates_are_totals_over_totals():
    meter = StepMeter(torch.device("cpu"), warmup_steps=3)
    # Slow warm-up steps (first-call effects) must not leak into the figures.
    run_steps(meter, [0.20, 0.20, 0.20], 0.0, batch=10)
    # Uneven timed steps: a mean of per-step rates would say (10/0.01 + 10/0.05)/2 = 600 img/s; the truth is lower.
    run_steps(meter, [0.01, 0.05] * 4, 0.02, batch=10)
    tp = meter.result()
    assert tp.steps == 8 and tp.images == 80
    total_time = 4 * (0.01 + 0.05) + 8 * 0.02
    assert tp.img_s == pytest.approx(80 / total_time, rel=0.25)
    assert tp.img_s < 80 / (4 * 0.06)  # data wait is part of total throughput
    assert tp.compute_img_s == pytest.approx(80 / (4 * 0.06), rel=0.25)
    assert tp.data_wait_ms == pytest.approx(20, rel=0.5)
    assert tp.seconds < 0.6  # the 0.6 s of warm-up is not in the window


def test_no_timed_steps_gives_nan_not_a_crash():
    meter = StepMeter(torch.device("cpu"), warmup_steps=5)
    run_steps(meter, [0.0] * 2, 0.0, batch=4)
    tp = meter.result()
    assert tp.steps == 0 and tp.img_s != tp.img_s  # NaN


@pytest.mark.gpu
def test_gpu_time_is_counted_even_though_launches_return_at_once():
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    meter = StepMeter(dev, warmup_steps=2)
    t0 = None
    for i in range(12):
        meter.data_start()
        meter.compute_start()
        for _ in range(10):
            a = a @ a
            a = a / a.norm()
        meter.step_end(1)
        if i == 1:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
    tp = meter.result()
    wall = time.perf_counter() - t0
    assert tp.seconds == pytest.approx(wall, rel=0.2)
    assert tp.compute_seconds == pytest.approx(tp.seconds, rel=0.2)
