"""Record the GPU trace fixtures of tests/test_profiling.py, and example reports, with StepProfiler.

A standalone loop (no Hydra: the GPU machine has none) over MobileNetV1 and synthetic batches:

    python scripts/record_trace_fixtures.py --out OUT_DIR [--device cuda] [--cases a,b,...]

For each case it writes OUT_DIR/<case>.json.gz (the trace, slimmed to what the analysis reads) and appends its
report to OUT_DIR/reports.md (each report can be rebuilt offline: python scripts/diagnose.py OUT_DIR/<case>.json.gz).
Cases (the default records the four committed fixtures; cold_amp_fp16_cl needs a process of its own):
    amp_fp16_nchw_torch   training, backend=torch, AMP fp16, NCHW: cuDNN inserts nchwToNhwc/nhwcToNchw transposes
    amp_fp16_cl           training, backend=torch, AMP fp16, channels_last: no transposes expected
    fp32_pageable_infer   inference, backend=torch, fp32 NCHW, a pageable host batch copied in every step and the
                          predictions read back (a blocking sync)
    amp_fp16_nchw_cudnn_infer   inference, backend=cudnn, AMP fp16, NCHW
    amp_fp16_nchw_cudnn   training with backend=cudnn (failed on the H200 with torch 2.11: the cudnn backend's
                          weight gradient came back empty)
    cold_amp_fp16_cl      amp_fp16_cl profiled from its very first step: first-call effects (trace of ~6 MB)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mobilenet.model import MobileNetV1  # noqa: E402
from mobilenet.profiling import StepProfiler, analyse_trace, load_trace, save_trace, slim_trace  # noqa: E402


@dataclass(frozen=True)
class Case:
    mode: str  # train | infer
    backend: str
    amp_dtype: torch.dtype | None
    channels_last: bool
    pageable_input: bool  # copy a pageable host batch to the device every step (else it stays on the device)
    # Profile from the very first step (no skip, no warm-up, no baseline): shows first-call effects. Must be the
    # first case of the process, before anything has loaded CUDA modules or filled cuDNN's autotune cache.
    cold: bool = False


CASES = {
    "amp_fp16_nchw_torch": Case("train", "torch", torch.float16, False, False),
    "amp_fp16_nchw_cudnn": Case("train", "cudnn", torch.float16, False, False),
    "amp_fp16_cl": Case("train", "torch", torch.float16, True, False),
    "fp32_pageable_infer": Case("infer", "torch", None, False, True),
    "amp_fp16_nchw_cudnn_infer": Case("infer", "cudnn", torch.float16, False, False),
    "cold_amp_fp16_cl": Case("train", "torch", torch.float16, True, False, cold=True),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def record(name: str, case: Case, args, out_dir: Path) -> None:
    device = torch.device(args.device)
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    fmt = torch.channels_last if case.channels_last else torch.contiguous_format
    model = MobileNetV1(num_classes=args.num_classes, width_mult=args.width, depthwise=case.backend).to(device, memory_format=fmt)
    model.train(case.mode == "train")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, enabled=case.amp_dtype == torch.float16)
    criterion = nn.CrossEntropyLoss()
    host_images = torch.randn(args.batch, 3, args.resolution, args.resolution)  # pageable on purpose
    host_labels = torch.randint(0, args.num_classes, (args.batch,))
    dev_images = host_images.to(device).contiguous(memory_format=fmt)
    dev_labels = host_labels.to(device)
    prof_cfg = SimpleNamespace(skip_first=0 if case.cold else args.skip_first, warmup=0 if case.cold else args.warmup,
                               active=args.active, top_k=15)
    meta = {
        "mode": case.mode, "backend": case.backend,
        "precision": f"amp {str(case.amp_dtype).removeprefix('torch.').replace('float16', 'fp16')}" if case.amp_dtype else "fp32",
        "memory_format": "channels_last" if case.channels_last else "NCHW",
        "batch_size": args.batch, "resolution": args.resolution, "width_mult": args.width,
        "data": "pageable host batch copied every step" if case.pageable_input else "batch resident on the device",
        "recorded_by": "scripts/record_trace_fixtures.py",
    }

    def step(prof: StepProfiler | None) -> None:
        rng = prof.range if prof else (lambda _name: torch.profiler.record_function(_name))
        with rng("data"):
            if case.pageable_input:
                images = host_images.to(device).contiguous(memory_format=fmt)
                labels = host_labels.to(device)
            else:
                images, labels = dev_images, dev_labels
        if case.mode == "train":
            with rng("forward"), torch.autocast(device.type, dtype=case.amp_dtype or torch.float32, enabled=case.amp_dtype is not None):
                loss = criterion(model(images), labels)
            with rng("backward"):
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
            with rng("optimizer"):
                scaler.step(optimizer)
                scaler.update()
        else:
            with torch.inference_mode():
                with rng("forward"), torch.autocast(device.type, dtype=case.amp_dtype or torch.float32, enabled=case.amp_dtype is not None):
                    logits = model(images)
                with rng("readback"):
                    logits.argmax(1).cpu()  # what an inference loop does with its predictions: a blocking copy

    # Baseline without the profiler: median interval between step ends, device drained before the window.
    baseline_ms = None
    if not case.cold:
        for _ in range(args.skip_first):
            step(None)
        _sync(device)
        ends = [time.perf_counter()]
        for _ in range(args.baseline_steps):
            step(None)
            ends.append(time.perf_counter())
        _sync(device)
        baseline_ms = statistics.median(1000 * (b - a) for a, b in zip(ends, ends[1:]))

    run_dir = Path(tempfile.gettempdir()) / "record_trace_fixtures" / name  # only the slimmed copy goes to --out
    prof = StepProfiler(run_dir, device, meta, prof_cfg, baseline_step_ms=baseline_ms, print_report=False)
    with prof:
        for _ in range(prof.total_steps):
            step(prof)
            prof.step()
    trace_out = out_dir / f"{name}.json.gz"
    try:
        report = prof.finish(baseline_ms)
    finally:
        # Keep the trace even when the analysis fails: it is what the fix will be tested on.
        if prof.trace_path.exists():
            raw_mb = prof.trace_path.stat().st_size / 1e6
            save_trace(slim_trace(load_trace(prof.trace_path)), trace_out)
            if name in args.keep_raw.split(","):
                shutil.copy(prof.trace_path, out_dir / f"{name}.raw.json.gz")
    # The slimmed trace must analyse exactly like the raw one.
    again = analyse_trace(load_trace(trace_out))
    same = all(abs(again.categories[c].pct - report.categories[c].pct) < 1e-6 for c in report.categories) and again.busy_pct == report.busy_pct
    report.trace_path = f"{name}.json.gz"
    with open(out_dir / "reports.md", "a") as f:
        f.write(f"\n\n<!-- case {name} -->\n\n" + report.markdown())
    cats = ", ".join(f"{c} {s.pct:.1f}%" for c, s in report.categories.items())
    print(f"[{name}] baseline {baseline_ms or float('nan'):.2f} ms/step, profiled {report.step_ms_median:.2f} ms; trace {raw_mb:.1f} MB raw, "
          f"{trace_out.stat().st_size / 1e6:.2f} MB slim (same analysis: {same}); {cats}; depthwise by {report.depthwise_impls}; "
          f"transposes/step {report.categories['transpose'].count_per_step if report.gpu else 0:.0f}; "
          f"pageable copies/step {report.pageable_copies_per_step:.0f}", flush=True)
    for f in report.findings:
        print(f"    - {f.title}: {f.detail}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cases", default="amp_fp16_nchw_torch,amp_fp16_cl,fp32_pageable_infer,amp_fp16_nchw_cudnn_infer")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--width", type=float, default=1.0)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--skip-first", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--active", type=int, default=3)
    p.add_argument("--baseline-steps", type=int, default=20)
    p.add_argument("--keep-raw", default="", help="cases whose unslimmed trace is kept too (<case>.raw.json.gz)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.device.startswith("cuda"):
        print(f"{torch.cuda.get_device_name()} torch {torch.__version__} CUDA {torch.version.cuda} cuDNN {torch.backends.cudnn.version()}", flush=True)
    failed = []
    for name in args.cases.split(","):
        try:
            record(name, CASES[name], args, args.out)
        except Exception as e:  # one failing case must not lose the others' fixtures
            import traceback

            traceback.print_exc()
            failed.append(f"{name}: {e}")
    if failed:
        sys.exit("failed cases: " + "; ".join(failed))


if __name__ == "__main__":
    main()
