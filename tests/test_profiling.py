"""StepProfiler on CPU with the real model, and the trace analysis on real GPU traces (tests/fixtures/traces: H200
runs, and one DALI-fed run on an H100)."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mobilenet.model import MobileNetV1
from mobilenet.profiling.trace import UNPROFILED, UNPROFILED_COMPILED, UNPROFILED_EAGER, UNPROFILED_GRAPH
from mobilenet.profiling import (
    CATEGORIES,
    REPORT_FILE,
    TRACE_FILE,
    StepProfiler,
    analyse_trace,
    implementation_of,
    load_trace,
    save_trace,
    slim_trace,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "traces"
sys.path.insert(0, str(ROOT / "scripts"))


def _cfg(**kw):
    return SimpleNamespace(**{"skip_first": 1, "warmup": 1, "active": 2, "top_k": 10, **kw})


def _assert_partition(report):
    gpu_time, util = report.gpu_time, report.utilisation
    total = sum(gpu_time.categories[c].pct for c in CATEGORIES)
    assert math.isclose(total, 100.0, abs_tol=1e-6), total
    assert math.isclose(sum(gpu_time.categories[c].ms_per_step for c in CATEGORIES), gpu_time.gpu_ms_per_step, rel_tol=1e-9)
    assert math.isclose(util.busy_pct + util.idle_host_pct + util.idle_gap_pct, 100.0, abs_tol=1e-6)
    assert util.idle_host_sync_pct <= util.idle_host_pct + 1e-9
    assert util.idle_host_data_pct <= util.idle_host_pct + 1e-9


# --- capture on CPU, real model -----------------------------------------------------------------------------


def _run(tmp_path, mode: str):
    torch.manual_seed(0)
    model = MobileNetV1(num_classes=10, width_mult=0.25)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    meta = {"mode": mode, "backend": "torch", "precision": "fp32", "memory_format": "NCHW", "batch_size": 2}
    prof = StepProfiler(tmp_path, "cpu", meta, _cfg(), print_report=False)
    model.train(mode == "train")
    with prof:
        while not prof.finished:
            with prof.range("data"):
                images, labels = x.clone(), y.clone()
            if mode == "train":
                with prof.range("forward"):
                    loss = torch.nn.functional.cross_entropy(model(images), labels)
                with prof.range("backward"):
                    opt.zero_grad()
                    loss.backward()
                with prof.range("optimizer"):
                    opt.step()
            else:
                with torch.inference_mode(), prof.range("forward"):
                    model(images)
            prof.step()
    return prof, prof.finish(baseline_step_ms=1.0)


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_cpu_capture_writes_trace_and_report(tmp_path, mode):
    prof, report = _run(tmp_path, mode)
    assert prof.finished and prof.recorded_steps == 2
    assert (tmp_path / TRACE_FILE).exists() and (tmp_path / REPORT_FILE).exists()
    assert not report.gpu and report.steps == 2
    assert report.timing.profiler_overhead_pct is not None
    md = (tmp_path / REPORT_FILE).read_text()
    assert "No GPU" in md and "only CPU ops" in md
    assert any("conv" in o["op"] for o in report.top_ops)
    # The run's facts travel inside the trace, for offline analysis.
    trace = load_trace(tmp_path / TRACE_FILE)
    assert trace["mobilenet_meta"]["mode"] == mode
    offline = analyse_trace(tmp_path / TRACE_FILE)
    assert offline.env["batch_size"] == 2 and offline.steps == 2
    names = {e["name"] for e in trace["traceEvents"]}
    wanted = {"data", "forward"} | ({"backward", "optimizer"} if mode == "train" else set())
    assert wanted <= names


@pytest.mark.gpu
def test_a_gpu_bound_loop_counts_the_same_kernels_in_every_profiled_step(tmp_path):
    """The host queues 4 matmuls a step (~2 ms of GPU work each) in microseconds, so the profiler's window opens while
    the GPU still runs the warm-up's kernels: those must not count as work of the first profiled step."""
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    prof = StepProfiler(tmp_path, "cuda", {"mode": "infer"}, _cfg(skip_first=2, warmup=2, active=4), print_report=False)
    with prof:
        while not prof.finished:
            with prof.range("forward"):
                b = a
                for _ in range(4):
                    b = b @ a
            prof.step()
    report = prof.finish()
    assert report.gpu and report.steps == 4
    assert report.launches.first_step_extra_kernels == 0
    assert report.launches.kernels_per_step == round(report.launches.kernels_per_step) >= 4
    assert not any("unlinked" in n for n in report.notes), report.notes
    # The step time is the GPU's: four 4096^3 matmuls, never the host's microseconds.
    assert report.timing.step_ms_median > 20 * report.timing.host_step_ms_median


def test_finish_without_active_step_raises(tmp_path):
    prof = StepProfiler(tmp_path, "cpu", {}, _cfg(skip_first=5), print_report=False)
    with prof:
        prof.step()
    with pytest.raises(RuntimeError, match="recorded no step"):
        prof.finish()


def test_bad_schedule_rejected(tmp_path):
    with pytest.raises(ValueError):
        StepProfiler(tmp_path, "cpu", {}, _cfg(active=0))


# --- classification table ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name,impl", [
    ("void at::native::(anonymous namespace)::conv_depthwise2d_forward_kernel<3, float, int>(...)", "PyTorch native"),
    ("void at::native::(anonymous namespace)::conv_depthwise2d_grad_weight_kernel<float, int>(...)", "PyTorch native"),
    ("void mobilenet_dw::depthwise3x3_fwd_nhwc<__half>(...)", "custom (kernels/)"),
    ("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize64x64x64", "cuDNN"),
    ("void cudnn::cnn::conv2d_grouped_direct_kernel<false, true, ...>", "cuDNN"),
    ("some_unknown_kernel", "unidentified"),
])
def test_implementation_table(name, impl):
    assert implementation_of(name) == impl


# --- analysis on a hand-made GPU trace: every code path, exact numbers ------------------------------------


class _TraceBuilder:
    """Rows of a hand-made Chrome trace: x() adds a complete event, launch() a launch call on a host thread and the
    GPU row it launched (stream 7 of pid 0), linked by a fresh correlation id (1, 2, ...)."""

    def __init__(self):
        self.events: list[dict] = []
        self._corr = itertools.count(1)

    def x(self, name, cat, ts, dur, tid=1, pid=1, **args):
        self.events.append({"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args})

    def launch(self, t0, kname, kts, kdur, tid=1, call="cudaLaunchKernel", cat="kernel", launch_dur=5, **kargs):
        c = next(self._corr)
        self.x(call, "cuda_runtime", t0, launch_dur, tid=tid, correlation=c)
        self.x(kname, cat, kts, kdur, tid=7, pid=0, correlation=c, **kargs)


def _synthetic_gpu_trace() -> dict:
    b = _TraceBuilder()
    x, launch = b.x, b.launch
    for s, base in enumerate((0.0, 1000.0)):
        x(f"ProfilerStep#{s + 5}", "user_annotation", base, 1000)
        x("data", "user_annotation", base, 100)
        x("aten::to", "cpu_op", base + 10, 80)
        x("aten::copy_", "cpu_op", base + 15, 72, **{"Input type": ["float", "float", "Scalar"]})
        launch(base + 20, "Memcpy HtoD (Pageable -> Device)", base + 30, 25, call="cudaMemcpyAsync", cat="gpu_memcpy", bytes=4_000_000)
        x("cudaStreamSynchronize", "cuda_runtime", base + 60, 25)
        x("forward", "user_annotation", base + 100, 400)
        x("aten::conv2d", "cpu_op", base + 110, 95, **{"Input Dims": [[32, 64, 56, 56], [64, 1, 3, 3], []]})
        x("aten::cudnn_convolution", "cpu_op", base + 115, 80, **{"Input Dims": [[32, 64, 56, 56], [64, 1, 3, 3]]})
        launch(base + 120, "void cudnn::ops::nchwToNhwcKernel<__half, __half, float, false, true>", base + 130, 10)
        launch(base + 126, "sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc", base + 140, 60)
        x("aten::_to_copy", "cpu_op", base + 206, 12)
        x("aten::copy_", "cpu_op", base + 208, 9, **{"Input type": ["c10::Half", "float", "Scalar"]})
        launch(base + 210, "void at::native::vectorized_elementwise_kernel<4, direct_copy_kernel_cuda>", base + 216, 2)
        x("aten::conv2d", "cpu_op", base + 220, 20, **{"Input Dims": [[32, 64, 56, 56], [128, 64, 1, 1], []]})
        launch(base + 222, "sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc", base + 230, 70)
        x("mobilenet_dw::depthwise_fwd", "cpu_op", base + 300, 20)
        launch(base + 305, "void mobilenet_dw::depthwise3x3_fwd<float>", base + 310, 40)
        x("backward", "user_annotation", base + 500, 400)
        # The autograd engine runs backward ops on its own thread.
        x("aten::convolution_backward", "cpu_op", base + 590, 30, tid=2,
          **{"Input Dims": [[32, 64, 56, 56], [32, 64, 56, 56], [64, 1, 3, 3]]})
        launch(base + 600, "void at::native::conv_depthwise2d_grad_weight_kernel<float>", base + 610, 90, tid=2)
        # A loader's worker thread (DALI's decoders) waits on its own event: that does not stall the step.
        x("cudaEventSynchronize", "cuda_runtime", base + 650, 40, tid=7)
        x("optimizer", "user_annotation", base + 900, 100)
        x("aten::_foreach_add_", "cpu_op", base + 910, 20)
        launch(base + 915, "void at::native::multi_tensor_apply_kernel<...>", base + 920, 30)
    return {"traceEvents": b.events, "deviceProperties": [{"name": "Synthetic GPU"}],
            "mobilenet_meta": {"backend": "torch", "memory_format": "NCHW", "precision": "amp fp16"}}


def _gpu_bound_trace() -> dict:
    """Three 200 us host steps, each launching one 1000 us kernel: the GPU runs 1 ms behind per step."""
    b = _TraceBuilder()
    for s in range(3):
        t = 200.0 * s
        b.x(f"ProfilerStep#{s}", "user_annotation", t, 200)
        b.launch(t + 10, "sm90_xmma_fprop_implicit_gemm", 20 + 1000.0 * s, 1000)
    return {"traceEvents": b.events, "deviceProperties": [{"name": "Synthetic GPU"}]}


def test_step_time_counts_gpu_completion_when_the_host_runs_ahead():
    r = analyse_trace(_gpu_bound_trace(), baseline_step_ms=1.0)
    assert math.isclose(r.timing.host_step_ms_median, 0.2)
    # completions at 1020, 2020, 3020 us; the first step counts from its host start (0)
    assert [round(t, 6) for t in r.timing.step_ms] == [1.02, 1.0, 1.0]
    assert math.isclose(r.timing.step_ms_median, 1.0) and math.isclose(r.timing.profiler_overhead_pct, 0.0, abs_tol=1e-9)
    assert any(f.title == "host runs ahead" for f in r.findings)


def test_synthetic_gpu_trace_exact_figures():
    r = analyse_trace(_synthetic_gpu_trace(), baseline_step_ms=0.8)
    _assert_partition(r)
    assert r.gpu and r.steps == 2 and r.env["gpu"] == "Synthetic GPU"
    cat = r.gpu_time.categories
    # Per step: memcpy 25, transpose 10, cast 2, depthwise 60 + 40 + 90, other 70 + 30 (microseconds).
    assert math.isclose(r.gpu_time.gpu_ms_per_step, 0.327)
    assert math.isclose(cat["memcpy"].ms_per_step, 0.025)
    assert math.isclose(cat["transpose"].ms_per_step, 0.010) and cat["transpose"].count_per_step == 1
    assert math.isclose(cat["cast"].ms_per_step, 0.002) and r.gpu_time.casts_per_step == 1
    assert math.isclose(cat["depthwise"].ms_per_step, 0.190)
    assert math.isclose(cat["other"].ms_per_step, 0.100)
    assert (r.gpu_time.transposes[0]["op"], r.gpu_time.transposes[0]["phase"]) == ("aten::conv2d > aten::cudnn_convolution",
                                                                                 "forward")
    assert r.gpu_time.casts[0]["op"] == "aten::_to_copy > aten::copy_"
    assert set(r.gpu_time.depthwise_impls) == {"cuDNN", "custom (kernels/)", "PyTorch native"}
    assert r.gpu_time.depthwise_implementation == "PyTorch native"  # 90 of 190 us
    # The stream sync and the pageable copy itself, which blocks the host too.
    assert r.gpu_time.pageable_copies_per_step == 1 and r.host_syncs.syncs_per_step == 2
    assert {s["call"] for s in r.host_syncs.syncs} == {"cudaStreamSynchronize", "cudaMemcpyAsync (pageable)"}
    assert {s["phase"] for s in r.host_syncs.syncs} == {"data"}
    assert r.host_syncs.other_thread_syncs_per_step == 1 and r.host_syncs.other_thread_cuda_calls_per_step == 1
    # Idle split, per step: the GPU idles 0-30 (host issues the copy at 20), 55-130 (next launch issued at 120), ...
    assert r.utilisation.idle_host_data_pct > 0 and r.utilisation.idle_host_sync_pct > 0
    assert r.launches.kernels_per_step == 7 and r.launches.short_kernels_per_step == 1  # the 2 us cast under a 5 us launch
    assert math.isclose(r.timing.profiler_overhead_pct, 25.0)
    # The step time reported is the unprofiled one; the profiled steps' time is shown with the overhead.
    assert r.step_time_ms == 0.8 and math.isclose(r.timing.step_ms_median, 1.0)
    md = r.markdown()
    assert "Step time: **0.80 ms** without the profiler" in md and "(+25.0% profiler overhead)" in md
    titles = {f.title for f in r.findings}
    assert {"layout transposes", "pageable host copies", "blocking synchronisations", "dtype casts"} <= titles
    assert any("channels_last=true would remove" in f.hint for f in r.findings)
    md = r.markdown()
    assert "nchwToNhwcKernel" in md and "Pageable" in md


def test_device_wide_syncs_of_another_thread_are_named_with_their_cost():
    """A loader thread (DALI's buffer graveyard) calls cudaDeviceSynchronize once per step, waiting 800 us."""
    b = _TraceBuilder()
    for s in range(4):
        t = 1000.0 * s
        b.x(f"ProfilerStep#{s}", "user_annotation", t, 1000)
        b.launch(t + 10, "sm90_xmma_fprop_implicit_gemm", t + 20, 900)
        b.x("cudaDeviceSynchronize", "cuda_runtime", t + 100, 800 + s, tid=9)
        b.x("cudaEventSynchronize", "cuda_runtime", t + 950, 10, tid=9)  # blocking, but not device-wide
    r = analyse_trace({"traceEvents": b.events, "deviceProperties": [{"name": "Synthetic GPU"}]})
    assert r.host_syncs.other_thread_device_syncs_per_step == 1 and r.host_syncs.other_thread_syncs_per_step == 2
    assert math.isclose(r.host_syncs.other_thread_device_sync_ms_median, 0.8015)
    (f,) = [f for f in r.findings if f.title == "device-wide syncs from other threads"]
    assert "1.0 per step" in f.detail and "0.80 ms each" in f.detail and "DLTensorGraveyard" in f.hint
    assert r.host_syncs.syncs_per_step == 0  # the step's own threads never blocked
    # The step-thread trace above has no such call, and no such finding.
    assert not any(f.title == "device-wide syncs from other threads" for f in analyse_trace(_synthetic_gpu_trace()).findings)


def _many_streams_trace(loader_streams: int = 12) -> dict:
    """Three steps: the training kernel on stream 7, and a loader thread's kernels on streams of its own."""
    b = _TraceBuilder()
    for s in range(3):
        t = 1000.0 * s
        b.x(f"ProfilerStep#{s}", "user_annotation", t, 1000)
        b.launch(t + 10, "sm90_xmma_fprop_implicit_gemm", t + 20, 900, stream=7, device=0)
        for i in range(loader_streams):
            b.launch(t + 30 + i, "nvjpeg::rgba2rgb", t + 40 + i, 4, tid=9, stream=100 + i, device=0)
    return {"traceEvents": b.events, "deviceProperties": [{"name": "Synthetic GPU"}]}


def test_more_streams_than_hardware_work_queues_is_a_finding_with_the_setting_that_fixes_it():
    r = analyse_trace(_many_streams_trace(), meta={"cuda_work_queues": 8})
    assert (r.host_syncs.streams_with_work, r.host_syncs.work_queues) == (13, 8)
    (f,) = [f for f in r.findings if f.title == "streams share hardware work queues"]
    assert f.detail.startswith("13 CUDA streams ran work in these steps (1 of the step's threads, 12 of other threads), "
                               "but the process had 8 hardware work queues:")
    assert "perf.max_connections=32" in f.hint and f.severity == "warn"
    # With 32 queues there is room for every stream; a trace that does not record the setting is read with CUDA's 8.
    assert not any(f.title == "streams share hardware work queues"
                   for f in analyse_trace(_many_streams_trace(), meta={"cuda_work_queues": 32}).findings)
    (f,) = [f for f in analyse_trace(_many_streams_trace()).findings if f.title == "streams share hardware work queues"]
    assert "8 hardware work queues (CUDA's default; the trace does not record the setting)" in f.detail


def test_more_streams_than_cudas_most_work_queues_says_no_setting_adds_queues():
    """A DALI-fed step on an H100 ran 33 streams with 32 queues (the step's 1, two pipelines' 16 each): advising
    perf.max_connections=32, already in effect, would send the reader in a circle."""
    r = analyse_trace(_many_streams_trace(loader_streams=32), meta={"cuda_work_queues": 32})
    assert (r.host_syncs.streams_with_work, r.host_syncs.step_streams_with_work) == (33, 1)
    (f,) = [f for f in r.findings if f.title == "streams share hardware work queues"]
    assert "(1 of the step's threads, 32 of other threads), but the process had 32 hardware work queues" in f.detail
    assert "perf.max_connections" not in f.hint and "no setting adds queues" in f.hint and f.severity == "info"


def test_gpu_work_launched_by_a_loader_thread_is_the_loaders_not_the_steps():
    """A loader thread (tid 9, DALI's) launches a kernel named like a transpose, a pageable copy and a resize
    kernel each step: they are the loader's GPU work, not a layout transpose, a copy the step should pin, or
    everything else."""
    b = _TraceBuilder()
    for s in range(3):
        t = 1000.0 * s
        b.x(f"ProfilerStep#{s}", "user_annotation", t, 1000)
        b.launch(t + 10, "sm90_xmma_fprop_implicit_gemm", t + 20, 800)
        b.launch(t + 30, "void dali::kernels::TransposeKernel<unsigned char>", t + 830, 20, tid=9)
        b.launch(t + 40, "Memcpy HtoD (Pageable -> Device)", t + 850, 30, tid=9, call="cudaMemcpyAsync",
                 cat="gpu_memcpy", bytes=1_000_000)
        b.launch(t + 50, "void dali::kernels::resampling::BatchedSeparableResizeKernel", t + 880, 50, tid=9)
    r = analyse_trace({"traceEvents": b.events, "deviceProperties": [{"name": "Synthetic GPU"}]})
    _assert_partition(r)
    cat = r.gpu_time.categories
    assert math.isclose(cat["loader"].ms_per_step, 0.100) and cat["loader"].count_per_step == 3
    assert math.isclose(cat["other"].ms_per_step, 0.800)
    assert cat["transpose"].count_per_step == 0 and cat["memcpy"].count_per_step == 0
    assert r.gpu_time.pageable_copies_per_step == 0 and r.gpu_time.memcpys == []
    titles = {f.title for f in r.findings}
    assert not {"pageable host copies", "layout transposes"} & titles
    (f,) = [f for f in r.findings if f.title == "the data loader's GPU work"]
    assert "launched 11.1% of GPU time (0.100 ms/step, 3 kernels and copies per step)" in f.detail
    assert "data loader's GPU work (other threads)" in r.markdown()
    # A captured step launches its kernels with one graph launch: the loader's many short launches are not the
    # step's, so the step is neither launch-bound nor running the loader's kernels.
    graph = _TraceBuilder()
    for s in range(3):
        t = 1000.0 * s
        graph.x(f"ProfilerStep#{s}", "user_annotation", t, 1000)
        graph.launch(t + 10, "sm90_xmma_fprop_implicit_gemm", t + 20, 800, call="cudaGraphLaunch", launch_dur=20)
        for i in range(5):
            graph.launch(t + 100 + 30 * i, "void dali::kernels::SliceFlipNormalizePermutePadKernel", t + 830 + 10 * i,
                         2, tid=9)
    captured = analyse_trace({"traceEvents": graph.events, "deviceProperties": [{"name": "Synthetic GPU"}]})
    assert captured.launches.kernels_per_step == 1 and not captured.launches.launch_bound
    assert captured.gpu_time.categories["loader"].count_per_step == 5
    assert "launch-bound" not in {f.title for f in captured.findings}
    # The same rows launched by the step's thread are the step's: a transpose and a pageable copy to pin.
    for e in b.events:
        if e["tid"] == 9:
            e["tid"] = 1
    r = analyse_trace({"traceEvents": b.events, "deviceProperties": [{"name": "Synthetic GPU"}]})
    assert r.gpu_time.categories["loader"].count_per_step == 0
    assert {"pageable host copies", "layout transposes"} <= {f.title for f in r.findings}


def _launch_bound_trace() -> dict:
    """Three host-bound steps of ten 2 us kernels, each launched by a 10 us call, the GPU idle in between."""
    b = _TraceBuilder()
    for s in range(3):
        t = 1000.0 * s
        b.x(f"ProfilerStep#{s}", "user_annotation", t, 1000)
        for k in range(10):
            b.launch(t + 20 + 90 * k, f"elementwise_{k}", t + 35 + 90 * k, 2, launch_dur=10)
    return {"traceEvents": b.events, "deviceProperties": [{"name": "Synthetic GPU"}]}


@pytest.mark.parametrize("meta, words", [
    ({"mode": "train", UNPROFILED: UNPROFILED_GRAPH}, "nothing to change for the run itself"),
    ({"mode": "infer", UNPROFILED: UNPROFILED_GRAPH}, "nothing to change for the run itself"),
    ({"mode": "train", UNPROFILED: UNPROFILED_COMPILED}, "the step is compiled already; capture it instead"),
    ({"mode": "train", UNPROFILED: UNPROFILED_EAGER}, "capture the step (cuda_graph=true"),
    ({"mode": "infer", UNPROFILED: UNPROFILED_COMPILED}, "replay the forward as a CUDA graph"),
    ({"mode": "infer", UNPROFILED: UNPROFILED_EAGER}, "replay the forward as a CUDA graph"),
    ({}, "torch.compile, CUDA graphs or a larger batch"),
])
def test_launch_findings_say_what_removes_launches_from_the_run_as_it_runs_unprofiled(meta, words):
    r = analyse_trace(_launch_bound_trace(), meta=meta, baseline_step_ms=0.9)
    hints = {f.title: f.hint for f in r.findings}
    assert words in hints["launch-bound"] and words in hints["GPU waits for the host"]
    # Only a run captured without the profiler has eager figures that its own summary does not share.
    assert ("Both are eager steps" in r.markdown()) == (meta.get(UNPROFILED) == UNPROFILED_GRAPH)


def _cold_trace() -> dict:
    """Three steps; the first launches 50 autotune kernels and loads a module inside its first launch."""
    b = _TraceBuilder()
    b.x("ProfilerStep#0", "user_annotation", 0, 20_000)
    b.launch(10, "gemm_a", 3000, 100, launch_dur=2900)  # lazy module load inside the first launch
    for i in range(50):
        b.launch(3100 + 100 * i, f"autotune_candidate_{i}", 3200 + 100 * i, 50)
    for s, base in ((1, 20_000), (2, 21_000)):
        b.x(f"ProfilerStep#{s}", "user_annotation", base, 1000)
        b.launch(base + 10, "gemm_a", base + 20, 100)
    return {"traceEvents": b.events}


def test_first_call_effects_are_flagged():
    r = analyse_trace(_cold_trace())
    _assert_partition(r)
    assert r.timing.first_step_ratio == pytest.approx(20.0)
    assert r.launches.first_step_extra_kernels == 50
    assert len(r.launches.slow_launches) == 1 and r.launches.slow_launches[0]["max_ms"] == pytest.approx(2.9)
    finding = next(f for f in r.findings if f.title == "first-call effects in the window")
    assert "skip_first" in finding.hint and "--skip-steps 1" in finding.hint
    steady = analyse_trace(_cold_trace(), skip_steps=1)
    assert steady.steps == 2 and steady.launches.kernels_per_step == 1
    assert "first-call effects in the window" not in {f.title for f in steady.findings}
    with pytest.raises(ValueError):
        analyse_trace(_cold_trace(), skip_steps=3)


def _warmup_tail_trace() -> dict:
    """Three 1 ms steps of a GPU-bound loop whose profiler window opened while the GPU still ran 4 kernels (800 us)
    launched in the profiler's warm-up: their launch calls were dropped with the warm-up's host rows, their GPU rows
    kept (correlation ids 1-4, below every launch call the trace kept)."""
    b = _TraceBuilder()
    b._corr = itertools.count(100)
    for i in range(4):
        b.x(f"warmup_kernel_{i}", "kernel", 200 * i, 200, tid=7, pid=0, correlation=1 + i)
    for s in range(3):
        t = 1000.0 * s
        b.x(f"ProfilerStep#{s + 5}", "user_annotation", t, 1000)
        b.launch(t + 10, "gemm_a", 800 + t + 10, 600)
        b.launch(t + 20, "bn_relu", 800 + t + 610, 300)
    return {"traceEvents": b.events}


def test_gpu_rows_launched_before_the_window_are_not_work_of_its_first_step():
    r = analyse_trace(_warmup_tail_trace())
    _assert_partition(r)
    assert r.launches.kernels_per_step == 2 and r.launches.first_step_extra_kernels == 0
    assert math.isclose(r.gpu_time.gpu_ms_per_step, 0.9)
    assert r.gpu_time.top_kernels[0]["calls_per_step"] == 1
    assert "first-call effects in the window" not in {f.title for f in r.findings}
    assert any("4 GPU rows (0.800 ms) were launched before" in n for n in r.notes)
    assert not any("unlinked" in n for n in r.notes)
    # The first step counts from when the GPU was free of the earlier rows (800 us), not from its host start (0).
    assert [round(t, 6) for t in r.timing.step_ms] == [0.91, 1.0, 1.0]
    # The GPU was busy with them all the same: over the window (0 to 3710 us) it idles only 10 + 100 + 100 us.
    assert r.utilisation.busy_pct == pytest.approx(100 * 3500 / 3710)


def test_first_call_finding_quotes_the_host_ranges_it_compares():
    r = analyse_trace(_cold_trace())
    finding = next(f for f in r.findings if f.title == "first-call effects in the window")
    assert "host range took 20.00 ms, 20.0x the later steps' median (1.00 ms)" in finding.detail


def test_slim_trace_analyses_the_same():
    trace = _synthetic_gpu_trace()
    trace["traceEvents"].append({"ph": "s", "cat": "ac2g", "name": "flow", "id": 1, "ts": 0, "pid": 1, "tid": 1})
    a, b = analyse_trace(trace), analyse_trace(slim_trace(trace))
    assert a.to_dict() == b.to_dict()


# --- analysis on real H200 traces ---------------------------------------------------------------------------


def _fixture(name: str):
    path = FIXTURES / f"{name}.json.gz"
    if not path.exists():
        pytest.skip(f"fixture {path.name} not recorded (tests/fixtures/record_trace_fixtures.py on a GPU)")
    return analyse_trace(path)


def test_fixtures_are_small():
    files = list(FIXTURES.glob("*.json.gz"))
    assert sum(f.stat().st_size for f in files) < 5e6


FIXTURE_NAMES = ["amp_fp16_nchw_torch", "amp_fp16_cl", "fp32_pageable_infer", "amp_fp16_nchw_cudnn_infer"]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_partition_and_environment(name):
    r = _fixture(name)
    assert r.gpu and "H200" in r.env["gpu"] and r.steps == 3
    assert r.env["cudnn"] == "91900" and r.env["torch"].startswith("2.11")
    assert r.env["batch_size"] == 32 and r.timing.baseline_step_ms > 0 and r.timing.profiler_overhead_pct is not None
    _assert_partition(r)
    # Every GPU row was linked to the call that launched it, so each one has an op.
    assert not any("unlinked" in n for n in r.notes)
    assert r.launches.kernels_per_step > 0 and r.gpu_time.top_kernels and r.gpu_time.top_kernels[0]["op"] != "(no op)"
    assert "unidentified" not in r.gpu_time.depthwise_impls


def test_fixture_amp_nchw_has_cudnn_transposes():
    """User report 3: AMP fp16 NCHW training, cuDNN transposes inside the conv backward, thousands of casts."""
    r = _fixture("amp_fp16_nchw_torch")
    assert r.env["precision"] == "amp fp16" and r.env["memory_format"] == "NCHW"
    tr = r.gpu_time.categories["transpose"]
    assert tr.count_per_step >= 10 and tr.pct > 1
    by_phase = {t["phase"]: t for t in r.gpu_time.transposes}
    assert "aten::convolution_backward" in by_phase["backward"]["op"]
    assert "aten::cudnn_convolution" in by_phase["forward"]["op"]
    assert any("nchwToNhwc" in k["kernel"] and k["category"] == "transpose" for k in r.gpu_time.top_kernels)
    assert any("channels_last=true would remove" in f.hint for f in r.findings)
    assert r.gpu_time.casts_per_step > 20 and {c["phase"] for c in r.gpu_time.casts} >= {"forward", "backward"}
    assert any(f.title == "dtype casts" and "perf.amp_weight_cast=auto" in f.hint for f in r.findings)
    # PyTorch's heuristic splits fp16 NCHW depthwise layers between its own kernel and cuDNN.
    assert set(r.gpu_time.depthwise_impls) == {"PyTorch native", "cuDNN"}
    # GradScaler reads found_inf back every step.
    assert any("_local_scalar_dense" in s["op"] and s["phase"] == "optimizer" for s in r.host_syncs.syncs)


def test_fixture_channels_last_has_no_transposes():
    r = _fixture("amp_fp16_cl")
    assert r.env["memory_format"] == "channels_last"
    assert r.gpu_time.categories["transpose"].count_per_step == 0 and r.gpu_time.transposes == []
    assert "layout transposes" not in {f.title for f in r.findings}
    assert r.gpu_time.depthwise_impls == {"cuDNN": 100.0}
    assert any("depthwise_convolution" in k["kernel"] and k["category"] == "depthwise" for k in r.gpu_time.top_kernels) or \
        r.gpu_time.categories["depthwise"].pct > 10


def test_fixture_dali_fed_step_keeps_the_loaders_gpu_work_apart():
    """A real DALI-fed training trace: `python train.py data=dali data.root=DIR backend=custom norm=custom amp=true
    channels_last=true profile=true epochs=1 evaluate=false` on one H100 (2026-12-06, tree 0a988a1), full-size
    fake ImageNet JPEGs, two pipelines; slimmed with slim_trace. DALI's threads launch the JPEG bitstream copies,
    the hardware decoder's colour conversion, the resize and the normalisation: they are the loader's, and none of
    them is a layout transpose, a copy the step should pin or one of the step's launches."""
    r = _fixture("dali_fed_h100")
    assert "H100" in r.env["gpu"] and r.env["data"] == "dali" and r.env["batch_size"] == 256 and r.steps == 10
    _assert_partition(r)
    loader = r.gpu_time.categories["loader"]
    assert 15 < loader.pct < 35 and loader.count_per_step > 500
    by_kernel = {k["kernel"]: k["category"] for k in r.gpu_time.top_kernels}
    assert by_kernel["Memcpy HtoD (Pinned -> Device)"] == "loader"
    assert any(k.startswith("void nvjpeg::rgba2rgb") and c == "loader" for k, c in by_kernel.items())
    assert r.gpu_time.categories["transpose"].count_per_step == 0
    assert r.gpu_time.categories["memcpy"].ms_per_step < 0.01  # the step's own copies: the labels' few bytes
    assert r.gpu_time.depthwise_impls["custom (kernels/)"] > 99
    # The step's launches alone: about 300 kernels, not the loader's 548 rows on top, and not launch-bound.
    assert 200 < r.launches.kernels_per_step < 400 and not r.launches.launch_bound
    assert (r.host_syncs.streams_with_work, r.host_syncs.step_streams_with_work, r.host_syncs.work_queues) == (33, 1, 32)
    findings = {f.title: f for f in r.findings}
    assert "24.4% of GPU time" in findings["the data loader's GPU work"].detail
    assert findings["streams share hardware work queues"].severity == "info"
    assert "layout transposes" not in findings


def _copy_op(src_strides):
    from mobilenet.profiling.trace import Event
    return Event("aten::copy_", "cpu_op", 0.0, 1.0, 1, 1, {
        "Input type": ["c10::Half", "c10::Half"], "Input Dims": [[256, 1024, 7, 7], [256, 1024, 7, 7]],
        "Input Strides": [[50176, 1, 7168, 1024], src_strides]})


def test_a_copy_between_layouts_is_a_transpose_and_a_broadcast_written_out_is_not():
    from mobilenet.profiling.classify import category_of
    from mobilenet.profiling.trace import Event
    kernel = Event("void at::native::elementwise_kernel<128, 4, at::native::copy_kernel_cuda>", "kernel",
                   0.0, 1.0, 7, 0, {})
    assert category_of(kernel, [_copy_op([50176, 49, 7, 1])]) == "transpose"  # NCHW into channels_last
    assert category_of(kernel, [_copy_op([1024, 1, 0, 0])]) == "other"  # a pooling's gradient, expanded
    assert category_of(kernel, [_copy_op([50176, 1, 7168, 1024])]) == "other"


def test_a_kernel_name_decides_before_the_op_that_launched_it():
    """norm.apply_in_depthwise: one op launches the BatchNorm's kernels and the depthwise kernels that normalize."""
    from mobilenet.profiling.classify import category_of
    from mobilenet.profiling.trace import Event
    pair = [Event("_BatchNormReluDepthwiseBackward", "cpu_op", 0.0, 1.0, 1, 1, {}),
            Event("mobilenet_bn::bn_relu_bwd", "cpu_op", 0.0, 1.0, 1, 1, {})]
    bn_kernel = Event("void mbn::apply_nhwc<8, mbn::InputGradOp<mdw::F16T> >(mbn::InputGradOp<mdw::F16T>, int, int, "
                      "int)", "kernel", 0.0, 1.0, 7, 0, {})
    assert category_of(bn_kernel, pair) == "norm"
    walk = [Event("_BatchNormReluDepthwiseBackward", "cpu_op", 0.0, 1.0, 1, 1, {}),
            Event("mobilenet_dw::depthwise_wgrad_normed", "cpu_op", 0.0, 1.0, 1, 1, {})]
    dw_kernel = Event("void mdw::wgrad_nhwc_column_kernel<mdw::F16T, 1, 4, 2, true, 3>(unsigned int const*)", "kernel",
                      0.0, 1.0, 7, 0, {})
    assert category_of(dw_kernel, walk) == "depthwise"


def test_a_convolution_launched_by_a_batchnorm_pair_is_a_convolution():
    """norm.apply_in_pointwise: the pair's op launches the BatchNorm's statistics kernel and cuDNN's convolutions."""
    from mobilenet.profiling.classify import category_of
    from mobilenet.profiling.trace import Event
    fused = Event("xmma__5x_cudnn::gemm::warp_specialized_kernel_gmma_utmaldg<xmma__5x_cudnn::implicit_gemm::fprop>",
                  "kernel", 0.0, 1.0, 7, 0, {})
    stats = Event("void mbn::reduce_nhwc<8, mbn::StatsOp<mdw::F16T> >(mbn::StatsOp<mdw::F16T>, int, int, int, float*)",
                  "kernel", 0.0, 1.0, 7, 0, {})
    forward = [Event("mobilenet_cudnn::sbr_conv1x1", "cpu_op", 0.0, 1.0, 1, 1, {}),
               Event("_BatchNormReluConv1x1", "cpu_op", 0.0, 1.0, 1, 1, {})]
    assert category_of(fused, forward) == "other"
    assert category_of(stats, [Event("mobilenet_bn::bn_stats_update", "cpu_op", 0.0, 1.0, 1, 1, {}),
                               Event("_BatchNormReluConv1x1", "cpu_op", 0.0, 1.0, 1, 1, {})]) == "norm"
    dgrad = [Event("aten::convolution_backward", "cpu_op", 0.0, 1.0, 1, 1, {}),
             Event("_BatchNormReluConv1x1Backward", "cpu_op", 0.0, 1.0, 1, 1, {})]
    assert category_of(fused, dgrad) == "other"
    assert category_of(fused, [Event("_BatchNormReluConv1x1Backward", "cpu_op", 0.0, 1.0, 1, 1, {})]) == "norm"


def test_the_pointwise_conv_of_the_depthwise_pointwise_function_is_not_depthwise():
    """One op launches the depthwise conv, the BatchNorm and the pointwise conv of a ring layer
    (norm_relu_depthwise_norm_relu_pointwise): the conv op nearest each kernel says which conv it computes."""
    from mobilenet.profiling.classify import category_of
    from mobilenet.profiling.trace import Event

    def ops(*names):
        return [Event(name, "cpu_op", 0.0, 1.0, 1, 1, {}) for name in names]

    gemm = Event("xmma__5x_cudnn::gemm::warp_specialized_kernel_gmma_utmaldg<xmma__5x_cudnn::implicit_gemm::fprop>",
                 "kernel", 0.0, 1.0, 7, 0, {})
    ring = Event("void mdw::bwd_nhwc_ring_kernel<mdw::F16T, true, true>(unsigned int const*)", "kernel", 0.0, 1.0, 7, 0,
                 {})
    fused = "_BatchNormReluDepthwiseBatchNormReluConv1x1"
    assert category_of(gemm, ops("mobilenet_cudnn::sbr_conv1x1", fused)) == "other"
    assert category_of(gemm, ops("mobilenet_cudnn::sbr_conv1x1_wgrad", fused + "Backward")) == "other"
    dgrad = [Event("aten::convolution_backward", "cpu_op", 0.0, 1.0, 1, 1,
                   {"Input Dims": [[256, 512, 14, 14], [256, 512, 14, 14], [512, 512, 1, 1]]}),
             *ops(fused + "Backward")]
    assert category_of(gemm, dgrad) == "other"
    assert category_of(ring, ops("mobilenet_dw::depthwise_bwd_normed", fused + "Backward")) == "depthwise"
    # a depthwise conv by its shapes inside a pair's op stays depthwise
    dw_grad = [Event("aten::convolution_backward", "cpu_op", 0.0, 1.0, 1, 1,
                     {"Input Dims": [[256, 512, 14, 14], [256, 512, 14, 14], [512, 1, 3, 3]]}), *ops(fused + "Backward")]
    assert category_of(gemm, dw_grad) == "depthwise"


def test_fixture_pageable_copies():
    """User report 1: host-to-device copies of pageable memory dominate the GPU time."""
    r = _fixture("fp32_pageable_infer")
    assert r.env["mode"] == "infer"
    assert r.gpu_time.pageable_copies_per_step >= 1
    htod = [m for m in r.gpu_time.memcpys if "HtoD" in m["kind"] and m["pageable"]]
    assert htod and htod[0]["MB_per_step"] == pytest.approx(32 * 3 * 224 * 224 * 4 / 1e6, rel=0.01)
    assert r.gpu_time.categories["memcpy"].pct > 30
    assert r.host_syncs.syncs_per_step >= 1 and any(s["phase"] == "data" for s in r.host_syncs.syncs)
    titles = {f.title for f in r.findings}
    assert {"pageable host copies", "copies dominate"} <= titles
    assert any("pin_memory=True" in f.hint for f in r.findings)
    assert r.gpu_time.depthwise_impls == {"PyTorch native": 100.0}  # fp32 NCHW depthwise: PyTorch's own kernel
    assert r.gpu_time.casts_per_step == 0


def test_fixture_cudnn_backend_is_identified():
    """backend=cudnn runs every depthwise conv through its own custom op, on cuDNN's kernels."""
    r = _fixture("amp_fp16_nchw_cudnn_infer")
    assert r.env["backend"] == "cudnn" and r.env["mode"] == "infer"
    assert r.gpu_time.depthwise_impls == {"cuDNN": 100.0}
    dw = [k for k in r.gpu_time.top_kernels if k["category"] == "depthwise"]
    assert dw and all(k["op"].startswith("mobilenet::cudnn_depthwise_fwd") for k in dw)
    assert not any(f.severity == "warn" and f.title == "depthwise implementation" for f in r.findings)


def test_diagnose_cli(tmp_path, capsys):
    import diagnose

    trace = tmp_path / "t.json.gz"
    save_trace(_synthetic_gpu_trace(), trace)
    assert diagnose.main([str(trace), "--md", str(tmp_path / "r.md"), "--baseline-ms", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "GPU time by category" in out and "profiler overhead" in out
    assert (tmp_path / "r.md").read_text() in out


def test_a_registered_finding_function_reaches_the_report_and_its_markdown(monkeypatch):
    from mobilenet import profiling
    from mobilenet.profiling import findings

    monkeypatch.setattr(findings, "FINDINGS", list(findings.FINDINGS))
    findings.finding()(lambda r: profiling.Finding("every step launches", f"{r.launches.kernels_per_step:.0f} kernels per step"))
    r = analyse_trace(_synthetic_gpu_trace())
    assert r.findings[-1].title == "every step launches"
    assert "- **every step launches**: 7 kernels per step." in r.markdown()


def test_batchnorm_and_relu_kernels_are_a_category_with_a_finding():
    from mobilenet.profiling import analyse_trace, load_trace

    report = analyse_trace(load_trace(FIXTURES / "amp_fp16_cl.json.gz"))
    norm = report.gpu_time.categories["norm"]
    assert norm.count_per_step > 0 and 20 < norm.pct < 80  # cuDNN's BatchNorm and PyTorch's ReLU, both directions
    assert abs(sum(c.pct for c in report.gpu_time.categories.values()) - 100) < 0.1  # still a partition
    found = [f for f in report.findings if f.title == "BatchNorm + ReLU"]
    assert found and f"{norm.pct:.1f}% of GPU time" in found[0].detail

