#!/usr/bin/env python
"""Benchmark MobileNetV1's 27 BatchNorm+ReLU layers in training: norm=torch against norm=custom (and norm=apex where
apex is installed), forward and forward+backward, per layer and summed over the network.

Each layer is timed as the model runs it: the module of `norm=<name>` (mobilenet/norm.py) in training mode, so the
running-statistics update is part of the forward and the ReLU's backward part of the backward. Timing: CUDA events
around CUDA-graph replays (launch overhead out of the numbers), warm-up, the median of repeats, the implementations
alternating case by case, and a rotation over input sets totalling well above the 60 MB L2 so no pass reads its input
from L2. The HBM floor is the fewest bytes any implementation must move (forward: read x, write y; backward: read
grad_y and x, write grad_x) over the device-to-device copy bandwidth measured in the same run.
Writes docs/results/norm_<gpu>.md and .csv.

  python scripts/bench_norm.py                                  # fp16 channels_last, batch 256 (a minute on an H200)
  python scripts/bench_norm.py --dtypes fp32,fp16,bf16 --layouts nhwc,nchw --norms torch,custom
"""

from __future__ import annotations

import argparse
import csv
import math
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mobilenet.errors import run_main  # noqa: E402
from mobilenet.bench.dtypes import DTYPES  # noqa: E402
from mobilenet.bench.timing import device_copy_bandwidth, time_case  # noqa: E402
from mobilenet.model import MobileNetV1  # noqa: E402
from mobilenet.norm import NormUnavailable, available_norms, get_norm  # noqa: E402
from mobilenet.reporting import environment, gpu_slug, machine_line  # noqa: E402

LAYOUTS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}
ROTATION_BYTES = 512 << 20  # input sets per case total at least this: > 8x the H200's 60 MB L2
MODES = ("fwd", "fwdbwd")


def norm_layer_shapes(resolution: int) -> list[tuple[int, int, int]]:
    """(channels, height, width) of every BatchNorm input of the project's MobileNetV1, in order, read from the model
    itself with forward hooks on a CPU."""
    model = MobileNetV1(num_classes=10)
    shapes: list[tuple[int, int, int]] = []
    hooks = [m.register_forward_hook(lambda _m, inp, _out: shapes.append(tuple(inp[0].shape[1:])))
             for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    with torch.no_grad():
        model.eval()(torch.zeros(1, 3, resolution, resolution))
    for h in hooks:
        h.remove()
    return shapes


def unique_layers(shapes):
    """[(shape, how many layers have it)] in first-seen order: equal layers are timed once and counted n times."""
    counts: dict[tuple[int, int, int], int] = {}
    for s in shapes:
        counts[s] = counts.get(s, 0) + 1
    return list(counts.items())


def floor_bytes(n: int, shape, elem: int, mode: str) -> int:
    tensor = n * math.prod(shape) * elem
    return 2 * tensor if mode == "fwd" else 5 * tensor


def bench_shape(modules: dict, dtype, fmt, n: int, shape, repeats: int) -> dict:
    """{(norm, mode): ms} for one layer shape; the norms alternate mode by mode, in one process."""
    c, h, w = shape
    elem = torch.finfo(dtype).bits // 8
    n_sets = max(2, min(16, math.ceil(ROTATION_BYTES / (2 * n * c * h * w * elem))))
    gen = torch.Generator(device="cuda").manual_seed(7 + c + h)
    xs = [(torch.randn(n, c, h, w, device="cuda", dtype=dtype, generator=gen) * 2 + 0.5).contiguous(memory_format=fmt)
          .requires_grad_() for _ in range(n_sets)]
    gys = [torch.randn(n, c, h, w, device="cuda", dtype=dtype, generator=gen).contiguous(memory_format=fmt)
           for _ in range(n_sets)]
    out = {}
    for mode in MODES:
        for name, make in modules.items():
            m = make(c).cuda().train()
            if mode == "fwd":
                def step(i, m=m):
                    m(xs[i])
            else:
                def step(i, m=m):
                    torch.autograd.grad(m(xs[i]), (xs[i], m.weight, m.bias), gys[i])
            try:
                out[(name, mode)] = time_case(step, n_sets, repeats)[0]
            except (RuntimeError, NormUnavailable) as e:  # a norm that cannot run a case is reported, not fatal
                print(f"    {name} {mode} {shape}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                out[(name, mode)] = float("nan")
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="fp16", help=f"comma-separated, of {','.join(DTYPES)}")
    ap.add_argument("--layouts", default="nhwc", help=f"comma-separated, of {','.join(LAYOUTS)}")
    ap.add_argument("--norms", default="torch,custom", help=f"comma-separated, of {','.join(available_norms())}")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--resolution", type=int, default=224)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results",
                    help="folder for norm_<gpu>.md and .csv; '' prints only")
    args = ap.parse_args(argv)
    for flag, value, allowed in (("--dtypes", args.dtypes, DTYPES), ("--layouts", args.layouts, LAYOUTS),
                                 ("--norms", args.norms, available_norms())):
        bad = [v for v in value.split(",") if v not in allowed]
        if bad:
            ap.error(f"{flag}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    if args.batch < 1 or args.resolution < 32 or args.repeats < 1:
        ap.error("--batch and --repeats must be >= 1 and --resolution >= 32")
    return args


def fmt_ms(v: float) -> str:
    return "n/a" if v != v else f"{v:.3f}"


def run(args) -> tuple[list[dict], str]:
    norms = args.norms.split(",")
    modules = {}
    for name in norms:
        impl = get_norm(name)
        impl.check(torch.device("cuda"))  # NormUnavailable (with how to fix it) before any timing
        modules[name] = impl.norm_relu
    torch.backends.cudnn.benchmark = True
    bw = device_copy_bandwidth()
    layers = unique_layers(norm_layer_shapes(args.resolution))
    rows, lines = [], []
    for dname in args.dtypes.split(","):
        for lname in args.layouts.split(","):
            dtype, fmt = DTYPES[dname], LAYOUTS[lname]
            elem = torch.finfo(dtype).bits // 8
            totals = {(nm, md): 0.0 for nm in norms for md in MODES}
            floors = dict.fromkeys(MODES, 0.0)
            lines += [f"\n## {dname} {lname}, batch {args.batch}\n",
                      "| C x H x W | layers | mode | " + " | ".join(f"{nm} ms" for nm in norms)
                      + " | floor ms | " + " | ".join(f"{nm} / floor" for nm in norms) + " |",
                      "|---|--:|---|" + "--:|" * (2 * len(norms) + 1)]
            for shape, count in layers:
                res = bench_shape(modules, dtype, fmt, args.batch, shape, args.repeats)
                for mode in MODES:
                    floor = floor_bytes(args.batch, shape, elem, mode) / bw * 1e3
                    ms = [res[(nm, mode)] for nm in norms]
                    lines.append(f"| {'x'.join(map(str, shape))} | {count} | {mode} | "
                                 + " | ".join(fmt_ms(v) for v in ms) + f" | {floor:.3f} | "
                                 + " | ".join(f"{v / floor:.2f}" for v in ms) + " |")
                    for nm, v in zip(norms, ms):
                        totals[(nm, mode)] += count * v
                        rows.append({"dtype": dname, "layout": lname, "batch": args.batch, "shape": "x".join(
                            map(str, shape)), "layers": count, "mode": mode, "norm": nm, "ms": f"{v:.4f}",
                            "floor_ms": f"{floor:.4f}"})
                    floors[mode] += count * floor
            for mode, floor in floors.items():
                ms = [totals[(nm, mode)] for nm in norms]
                lines.append(f"| **all layers** | {sum(c for _, c in layers)} | {mode} | " + " | ".join(f"**{fmt_ms(v)}**" for v in ms)
                             + f" | {floor:.3f} | " + " | ".join(f"{v / floor:.2f}" for v in ms) + " |")
            print("\n".join(lines[-4:]), flush=True)
    return rows, "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_norm: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    try:
        rows, table = run(args)
    except NormUnavailable as e:
        print(f"bench_norm: {e}", file=sys.stderr)
        return 2
    env = environment(torch.device("cuda"))
    head = (f"# BatchNorm+ReLU layers of MobileNetV1 in training: {', '.join(args.norms.split(','))}\n\n"
            f"{machine_line(env)}\n\n{time.strftime('%Y-%m-%d', time.gmtime())}. Command: `{' '.join(shlex.quote(a) for a in ['python', 'scripts/bench_norm.py', *argv])}`"
            "\n\nms per layer (median of graph replays; the norms alternate case by case). fwd: the module's forward in "
            "training (statistics, normalize + ReLU, running-statistics update); fwdbwd: forward and backward. floor: "
            "forward reads x and writes y, backward reads grad_y and x and writes grad_x, at the copy bandwidth "
            "measured in the run.\n")
    text = head + table + "\n"
    print(text)
    if str(args.out):
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"norm_{gpu_slug(env.get('gpu', 'gpu'))}"
        stem.with_suffix(".md").write_text(text)
        with open(stem.with_suffix(".csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {stem}.md and .csv")
    return 0


if __name__ == "__main__":
    run_main(main)
