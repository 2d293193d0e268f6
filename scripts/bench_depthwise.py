#!/usr/bin/env python
"""Benchmark a network's depthwise layers: torch vs cudnn vs custom, forward and forward+backward.

--suite picks the layers (mobilenet/bench/depthwise_suites.py, each from its paper's table): mobilenet_v1 (the
default, MobileNetV1's 13), mobilenet_v3 (MobileNetV3-Large, 15), efficientnet_b0 (16), convnext_t (18 7x7),
large_k7 (four 7x7 layers at 224^2 and 112^2). Layers of identical shape are measured once and counted as often as
the network has them.

For every dtype x layout: per-layer rows and the suite's count-weighted sums, with the HBM floor (the fewest bytes
the pass must move over the device-to-device copy bandwidth measured in this run). Timing: CUDA events around
CUDA-graph replays (launch overhead out of the numbers; eager fallback if capture fails, marked in the table),
warm-up, median of repeats, and a rotation over several input sets totalling well above the 60 MB L2 so that no
pass reads its inputs from L2. cuDNN autotunes its algorithm per shape, as in train.py and infer.py
(--no-cudnn-benchmark: its heuristic choice, which is slower than the autotuned one on some layers; docs/kernel_notes.md,
"cuDNN autotuned in the benchmark").
Writes docs/results/depthwise_<gpu>.md and .csv for mobilenet_v1, docs/results/depthwise_<suite>_<gpu>.md and .csv
for the others; the markdown ends each dtype x layout with the suite's acceptance quantity, the best of the other
backends' sums over custom's, for each pass measured.

--modes picks the passes: fwd and fwdbwd (the default), and fwd_dgrad / fwd_wgrad, the forward with only the input
or only the weight gradient (the other operand detached), which split the backward: its input gradient takes
about fwd_dgrad - fwd, its weight gradient fwd_wgrad - fwd.

--l2 warm measures the layers as they run inside the model instead: before each pass a producer kernel (a ReLU
from another tensor, standing in for the model's BatchNorm + ReLU) writes the input, so its last-written part is
still in L2. The time reported is (producer + pass) - producer, each a median of graph replays.

  python scripts/bench_depthwise.py                      # everything (a few minutes on an H200)
  python scripts/bench_depthwise.py --suite convnext_t   # ConvNeXt-T's 7x7 layers -> depthwise_convnext_t_<gpu>
  python scripts/bench_depthwise.py --dtypes fp16 --layouts nhwc --backends cudnn,custom --batch 64
  python scripts/bench_depthwise.py --dtypes fp16 --layouts nhwc --backends cudnn,custom --modes fwd --l2 warm
  python scripts/bench_depthwise.py --suite efficientnet_b0 --layouts nhwc --modes fwd,fwd_dgrad,fwd_wgrad

--ab MDW_<KNOB>=<value>[,...] A/B-tests launch knobs: custom is also timed with those settings, as the backend
custom_ab, right after custom in every layer (the kernels re-read the knobs in between); both get the acceptance
lines.
  python scripts/bench_depthwise.py --suite large_k7 --backends cudnn,custom --ab MDW_FWD_COLUMN_K57=2
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mobilenet.errors import run_main  # noqa: E402
from mobilenet.bench.depthwise_suites import DEFAULT_SUITE, SUITES, Layer, floor_bytes, weighted_sum  # noqa: E402
from mobilenet.bench.dtypes import DTYPES  # noqa: E402
from mobilenet.bench.suite_acceptance import SuiteSums  # noqa: E402
from mobilenet.bench.timing import device_copy_bandwidth, time_case  # noqa: E402
from mobilenet.depthwise import get_backend  # noqa: E402
from mobilenet.reporting import environment, gpu_slug  # noqa: E402

LAYOUTS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}
# fwd_dgrad and fwd_wgrad run the forward and one gradient (the other operand does not require grad), so that the
# backward's time splits into its two passes: (fwd_dgrad - fwd) and (fwd_wgrad - fwd).
MODE_TITLE = {"fwd": "forward", "fwdbwd": "forward+backward", "fwd_dgrad": "forward+input gradient",
              "fwd_wgrad": "forward+weight gradient"}
ROTATION_BYTES = 512 << 20  # input sets per case total at least this: > 8x the H200's 60 MB L2
AB_BACKEND = "custom_ab"  # custom with --ab's knob settings


def conv_fn(backend: str):
    return get_backend(backend).conv2d


def reload_kernel_knobs() -> None:
    """The custom kernels read the MDW_* environment again at their next launch (knob() keeps what it read)."""
    import kernels

    kernels.load()  # the op is registered on load, and torch's or cuDNN's rows may run before any custom one
    torch.ops.mobilenet_dw.reload_knobs()


def knob_switch(ab: dict[str, str], reload=reload_kernel_knobs):
    """use(backend), before a backend runs: AB_BACKEND gets --ab's MDW_* settings, every other backend the process's
    own; then reload() makes the kernels read them."""
    base = {k: os.environ.get(k) for k in ab}

    def use(backend):
        for k, v in (ab if backend == AB_BACKEND else base).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reload()

    return use


def bench_layer(backends, dtype, fmt, n, layer: Layer, modes, repeats, check, warm=False, use_knobs=None):
    elem = torch.finfo(dtype).bits // 8
    c, (oh, ow) = layer.C, layer.out_hw
    set_bytes = n * (c * layer.H * layer.W + layer.out_channels * oh * ow) * elem
    n_sets = max(2, min(16, math.ceil(ROTATION_BYTES / set_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(1234 + c + layer.H)
    xs = [torch.randn(n, c, layer.H, layer.W, device="cuda", dtype=dtype, generator=gen).contiguous(
        memory_format=fmt) for _ in range(n_sets)]
    gos = [torch.randn(n, layer.out_channels, oh, ow, device="cuda", dtype=dtype, generator=gen).contiguous(
        memory_format=fmt) for _ in range(n_sets)]
    w = (torch.randn(layer.weight_shape, device="cuda", dtype=dtype, generator=gen) / layer.k).requires_grad_()
    stride, padding, dilation = layer.conv_args()  # the same arguments for every backend and the reference
    # From the seeded generator, not the default one: a failed capture can leave that one unusable.
    srcs = [torch.randn(x.shape, device="cuda", dtype=dtype, generator=gen).contiguous(memory_format=fmt) for x in xs
            ] if warm else []
    for x in xs:
        x.requires_grad_()

    def produce(i):  # --l2 warm: write the input just before the pass, as the model's BN + ReLU does
        with torch.no_grad():
            torch.clamp(srcs[i], min=0, out=xs[i])  # a ReLU into x (torch.relu has no out=)

    producer_ms = time_case(produce, n_sets, repeats)[0] if warm else 0.0
    out = {}
    ref = None
    for name, fn in backends.items():
        if use_knobs:
            use_knobs(name)
        if check:
            with torch.no_grad():
                y = fn(xs[0], w, None, stride, padding, dilation).double()
                if ref is None:  # under no_grad: a graph kept alive here holds the leaves' AccumulateGrad nodes
                    ref = F.conv2d(xs[0].double(), w.double(), None, stride, padding, dilation, c)
            err = ((y - ref).norm() / ref.norm()).item()
            if not err <= (1e-5 if dtype == torch.float32 else 1e-2):
                print(f"    WARNING {name}: forward rel. error {err:.2e} vs float64", flush=True)
        for mode in modes:
            if mode == "fwd":
                def step(i, fn=fn):
                    if warm:
                        produce(i)
                    with torch.no_grad():
                        fn(xs[i], w, None, stride, padding, dilation)
            elif mode == "fwdbwd":
                def step(i, fn=fn):
                    if warm:
                        produce(i)
                    y = fn(xs[i], w, None, stride, padding, dilation)
                    torch.autograd.grad(y, (xs[i], w), gos[i])
            else:  # one gradient: the other operand detached, so no backend computes its gradient
                def step(i, fn=fn, wants_input=mode == "fwd_dgrad"):
                    if warm:
                        produce(i)
                    x, wt = (xs[i], w.detach()) if wants_input else (xs[i].detach(), w)
                    y = fn(x, wt, None, stride, padding, dilation)
                    torch.autograd.grad(y, x if wants_input else wt, gos[i])
            try:
                ms, how = time_case(step, n_sets, repeats)
                out[(name, mode)] = (ms - producer_ms, how)
            except Exception as e:  # noqa: BLE001 - a backend that cannot run a case is reported, not fatal
                print(f"    {name} {mode} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                out[(name, mode)] = (float("nan"), "failed")
    del xs, gos, srcs
    return out


def env_info(argv) -> dict:
    return {
        **environment(torch.device("cuda")),
        "command": " ".join(shlex.quote(a) for a in ["python"] + argv),
        # launch-shape overrides of the custom kernels (kernels/csrc/launch_plan.cpp, knob())
        "knobs": " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MDW_")) or "none (defaults)",
    }


def fmt_ms(v):
    return "n/a" if v != v else f"{v:.3f}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="fp32,fp16,bf16")
    ap.add_argument("--layouts", default="nchw,nhwc")
    ap.add_argument("--backends", default="torch,cudnn,custom")
    ap.add_argument("--modes", default="fwd,fwdbwd",
                    help="comma-separated passes: fwd, fwdbwd, and fwd_dgrad / fwd_wgrad (the forward and only the "
                         "input or only the weight gradient)")
    ap.add_argument("--suite", choices=list(SUITES), default=DEFAULT_SUITE,
                    help="which network's depthwise layers (mobilenet/bench/depthwise_suites.py names the papers)")
    ap.add_argument("--batch", type=int, default=None,
                    help="default: the suite's (256; large_k7: 64)")
    ap.add_argument("--layers", default="",
                    help="comma-separated indices into the suite's distinct layers, as the tables number them "
                         "(default: all)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-check", action="store_true", help="skip the forward correctness check")
    ap.add_argument("--l2", choices=("cold", "warm"), default="cold",
                    help="cold: inputs rotated out of L2; warm: a producer writes each input just before the pass")
    ap.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                    help="let cuDNN autotune its algorithm per shape (torch.backends.cudnn.benchmark), as train.py and "
                         "infer.py do (default); --no-cudnn-benchmark: cuDNN's heuristic choice")
    ap.add_argument("--ab", default="", metavar="MDW_KNOB=VALUE[,...]",
                    help=f"also time custom with these launch-knob settings, as backend {AB_BACKEND}, after custom in "
                         "every layer")
    ap.add_argument("--out", default=None, help="output stem (default docs/results/depthwise_<gpu> for mobilenet_v1, "
                                                 "else docs/results/depthwise_<suite>_<gpu>)")
    args = ap.parse_args(argv)
    suite = SUITES[args.suite]
    if args.batch is None:
        args.batch = suite.default_batch
    try:
        args.layer_ids = [int(i) for i in args.layers.split(",")] if args.layers else list(range(len(suite.layers)))
    except ValueError:
        ap.error(f"--layers: comma-separated integers, got {args.layers!r}")
    if not all(0 <= i < len(suite.layers) for i in args.layer_ids):
        ap.error(f"--layers: suite {args.suite} has layers 0-{len(suite.layers) - 1}, got {args.layers}")
    args.mode_list = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.mode_list if m not in MODE_TITLE]
    if unknown or not args.mode_list:
        ap.error(f"--modes: comma-separated from {', '.join(MODE_TITLE)}; got {args.modes!r}")
    settings = [s for s in args.ab.split(",") if s]
    if not all(s.startswith("MDW_") and "=" in s for s in settings):
        ap.error(f"--ab: comma-separated MDW_<KNOB>=<value> settings, got {args.ab!r}")
    args.ab = dict(s.split("=", 1) for s in settings)
    if args.ab and "custom" not in args.backends.split(","):
        ap.error("--ab compares against custom: name it in --backends")
    return args


def main(argv=None):
    argv = sys.argv if argv is None else argv
    args = parse_args(argv[1:])
    if not torch.cuda.is_available():
        sys.exit("bench_depthwise: needs a CUDA GPU")
    torch.backends.cudnn.benchmark = args.cudnn_benchmark  # autotuning happens in each case's untimed warm-up

    dtypes = [d for d in args.dtypes.split(",") if d]
    layouts = [l for l in args.layouts.split(",") if l]
    modes = args.mode_list
    backends = {b: conv_fn(b) for b in args.backends.split(",") if b}
    if args.ab:
        backends[AB_BACKEND] = backends["custom"]
    layers = SUITES[args.suite].layers
    info = env_info(argv)  # before knob_switch changes the environment
    use_knobs = knob_switch(args.ab) if args.ab else None
    bw = device_copy_bandwidth()
    print(f"{info['gpu']}  torch {info['torch']}  CUDA {info['cuda']}  cuDNN {info['cudnn']}  "
          f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)

    rows = []
    t_start = time.time()
    for dname in dtypes:
        for lname in layouts:
            for li in args.layer_ids:
                layer = layers[li]
                res = bench_layer(backends, DTYPES[dname], LAYOUTS[lname], args.batch, layer, modes, args.repeats,
                                  not args.no_check, warm=args.l2 == "warm", use_knobs=use_knobs)
                for mode in modes:
                    elem = torch.finfo(DTYPES[dname]).bits // 8
                    floor = floor_bytes(layer, args.batch, elem, mode) / bw * 1e3
                    row = {"dtype": dname, "layout": lname, "mode": mode, "suite": args.suite, "layer": li,
                           **layer.fields(), "floor_ms": floor}
                    for b in backends:
                        row[f"{b}_ms"], row[f"{b}_timing"] = res[(b, mode)]
                    rows.append(row)
                    print("  " + " ".join(f"{k}={fmt_ms(v) if isinstance(v, float) else v}" for k, v in row.items()
                                          if not k.endswith("_timing")), flush=True)
    print(f"benchmark took {time.time() - t_start:.0f} s", flush=True)
    write_results(rows, backends, dtypes, layouts, modes, info, bw, args)


def write_results(rows, backends, dtypes, layouts, modes, info, bw, args):
    suite = SUITES[args.suite]
    name = "depthwise_" + ("" if args.suite == DEFAULT_SUITE else args.suite + "_") + gpu_slug(info["gpu"])
    stem = Path(args.out) if args.out else ROOT / "docs" / "results" / name
    stem.parent.mkdir(parents=True, exist_ok=True)
    names = list(backends)
    others = [b for b in names if b not in ("custom", AB_BACKEND)]

    def ratio_cols(times, floor):
        cust = times.get("custom", float("nan"))
        best_other = min((times[b] for b in others if times[b] == times[b]), default=float("nan"))
        return cust / floor if cust == cust else float("nan"), best_other / cust if cust == cust else float("nan")

    md = [f"# Depthwise convolution benchmark: {suite.title}, {info['gpu']}", "",
          f"- GPU: {info['gpu']}, driver {info['driver']}",
          f"- source tree: {info['tree']}; {time.strftime('%Y-%m-%d', time.gmtime())}",
          f"- torch {info['torch']}, CUDA {info['cuda']}, cuDNN {info['cudnn']}, Python {info['python']}",
          f"- command: `{info['command']}`",
          f"- custom-kernel launch knobs from the environment: {info['knobs']}",
          *([f"- `{AB_BACKEND}`: custom with " + " ".join(f"{k}={v}" for k, v in args.ab.items())
             + ", timed right after custom in every layer"] if getattr(args, "ab", None) else []),
          "- cuDNN algorithms: " + ("autotuned per shape (`--cudnn-benchmark`)" if args.cudnn_benchmark
                                    else "cuDNN's heuristic choice (`torch.backends.cudnn.benchmark` off)"),
          f"- batch {args.batch}; suite `{args.suite}`: {suite.title}'s {suite.n_layers} depthwise layers "
          f"({len(suite.layers)} distinct shapes) at 224x224 input, from {suite.source} "
          "(mobilenet/bench/depthwise_suites.py); a layer's times are for one layer, the sums weight them by `count`",
          f"- device-to-device copy bandwidth measured in this run: {bw / 1e12:.2f} TB/s (bytes read + written); "
          "HBM floor = (input + output + weight [+ grad_out + input + grad_input + weight grad]) bytes / that "
          "bandwidth",
          "- times: median over repeats of CUDA-graph replays, each replay running the pass once per input set of a "
          f"rotation totalling >= {ROTATION_BYTES >> 20} MB; ms per pass; "
          + ("inputs never sit in L2" if args.l2 == "cold" else
             "**L2 warm**: a producer (ReLU from another tensor) writes each input just before its pass, as in the "
             "model; reported = median(producer + pass) - median(producer)"),
          "- `speed-up` = best of the other backends / custom (>= 1.00 means custom is at least as fast)"]
    if any(r[f"{b}_timing"] == "eager" for r in rows for b in backends):
        md.append("- a time marked (eager) was measured from eager launches because capturing that case as a CUDA "
                  "graph failed (the run's log says why); launch gaps are in it")
    md.append("")
    intro_len = len(md)
    summary = []
    for dname in dtypes:
        for lname in layouts:
            for mode in modes:
                sel = [r for r in rows if r["dtype"] == dname and r["layout"] == lname and r["mode"] == mode]
                if not sel:
                    continue
                md += [f"## {dname} {lname.upper()} {MODE_TITLE[mode]}", "",
                       "| layer | C x H x W | k | stride | padding | count | " + " | ".join(f"{b} ms" for b in names)
                       + " | HBM floor ms | custom / floor | speed-up |",
                       "|" + "---|" * (6 + len(names) + 3)]
                for r in sel:
                    times = {b: r[f"{b}_ms"] for b in names}
                    cf, sp = ratio_cols(times, r["floor_ms"])  # NaN without a custom column
                    layer = Layer(**{f: r[f] for f in Layer.__dataclass_fields__})
                    md.append(f"| {r['layer']} | {layer.shape()} | {layer.k} | {layer.stride} | {layer.padding} | "
                              f"{layer.count} | "
                              + " | ".join(fmt_ms(times[b]) + (" (eager)" if r[f"{b}_timing"] == "eager" else "")
                                           for b in names)
                              + f" | {fmt_ms(r['floor_ms'])} | {cf:.2f} | {sp:.2f} |")
                sums = {b: weighted_sum(sel, f"{b}_ms") for b in names}
                floor_sum = weighted_sum(sel, "floor_ms")
                cf, sp = ratio_cols(sums, floor_sum)
                label = f"sum ({sum(r['count'] for r in sel)} layers)"
                md.append(f"| **{label}** | | | | | | " + " | ".join(f"**{fmt_ms(sums[b])}**" for b in names)
                          + f" | **{fmt_ms(floor_sum)}** | **{cf:.2f}** | **{sp:.2f}** |")
                md.append("")
                summary.append((dname, lname, mode, sums, floor_sum, cf, sp))
    head = ["## Summary: sums over the layers, weighted by count (ms)", "",
            "| dtype | layout | pass | " + " | ".join(names) + " | HBM floor | custom / floor | speed-up |",
            "|" + "---|" * (3 + len(names) + 3)]
    for dname, lname, mode, sums, floor_sum, cf, sp in summary:
        head.append(f"| {dname} | {lname.upper()} | {MODE_TITLE[mode]} | " + " | ".join(fmt_ms(sums[b]) for b in names)
                    + f" | {fmt_ms(floor_sum)} | {cf:.2f} | {sp:.2f} |")
    head += acceptance_lines(summary, others)
    if AB_BACKEND in names:
        head += acceptance_lines(summary, others, AB_BACKEND)
    md = md[:intro_len] + head + [""] + md[intro_len:]
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        fields = list(rows[0].keys()) if rows else []
        wr = csv.DictWriter(f, fieldnames=fields + ["gpu", "driver", "torch", "cuda", "cudnn", "copy_TBps"])
        wr.writeheader()
        for r in rows:
            wr.writerow({**r, "gpu": info["gpu"], "driver": info["driver"], "torch": info["torch"],
                         "cuda": info["cuda"], "cudnn": info["cudnn"], "copy_TBps": f"{bw / 1e12:.3f}"})
    print("\n".join(head))
    print(f"wrote {stem.with_suffix('.md')} and .csv")


def acceptance_lines(summary, others, custom="custom") -> list[str]:
    """Per dtype x layout: the best of the other backends' sums over custom's (or the A/B variant's), for each pass
    measured (the issue's acceptance, on forward and forward+backward: >= 1.00 in every line)."""
    if not summary or not others or custom not in summary[0][3]:
        return []
    out = ["", f"{custom} against the best of {', '.join(others)}, sums over the suite's layers: best / {custom} "
           f"(>= 1.00: {custom} at least as fast)", ""]
    by_case = {}
    for dname, lname, mode, sums, _, _, _ in summary:
        sp, best = SuiteSums("", dname, lname, mode, {b: sums[b] for b in (*others, custom)}, 0.0).speed_up(custom)
        by_case.setdefault((dname, lname), []).append(
            f"{MODE_TITLE[mode]} {sp:.2f}x ({best} {fmt_ms(sums[best])} ms / {custom} {fmt_ms(sums[custom])} ms)"
            if best else f"{MODE_TITLE[mode]} - (no sum to compare)")
    out += [f"- {dname} {lname.upper()}: " + "; ".join(parts) for (dname, lname), parts in by_case.items()]
    return out


if __name__ == "__main__":
    run_main(main)
