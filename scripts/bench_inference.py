"""Inference img/s of the inference ladder, the dtype pairs and the plain-PyTorch peer, side by side in one process.

    python scripts/bench_inference.py [--suites ladder,dtypes,kernels,peer] [--backends cudnn,custom]
                                      [--rounds 5] [--steps 50] [--batch-size 256] [--out docs/results --name NAME]

Suites (every variant is built through mobilenet.inference.build_path, the code infer.py runs):
- ladder (fp16, channels_last, per backend): eager training graph under autocast -> BatchNorm folded -> fused
  epilogues -> forward replayed from a CUDA graph -> compiled and replayed;
- dtypes: the fast path (folded, fused, replayed) in fp32, fp16 and bf16, channels_last, per backend;
- kernels: the fast path (fp16) with one kind of layer on another kernel than inference_model picks: the 1x1 layers
  on cuBLASLt's bias-ReLU epilogue or a convolution and a separate ReLU, the stem with a separate ReLU (custom), the
  depthwise layers on cuDNN's fused conv-bias-ReLU (cudnn); compare with the dtypes suite's fp16 rows;
- peer: what a plain-PyTorch user builds: timm's mobilenetv1_100, conv+BN fused by torch.fx, .half(),
  channels_last, torch.compile (needs timm).
All variants run in one process, each round timing every variant once, in turn, the order reversed every other
round; per variant: 5 untimed passes, then --steps passes between two CUDA events. The table gives the median
img/s over rounds, with min-max. Written: NAME.md (with the date, commit, command and machine), NAME.csv, and
NAME.png for the ladder.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as `python scripts/bench_inference.py`

from mobilenet.errors import run_main  # noqa: E402
from mobilenet.bench.dtypes import DTYPES  # noqa: E402
from mobilenet.bench.timing import events_elapsed_s  # noqa: E402
from mobilenet.config import compose  # noqa: E402
from mobilenet.engine import build_for_run  # noqa: E402
from mobilenet.inference import build_path  # noqa: E402
from mobilenet.reporting import environment  # noqa: E402

SUITES = ("ladder", "dtypes", "kernels", "peer")
LADDER = [  # (step, overrides)
    ("eager", ["fold_bn=false", "cuda_graph=false"]),
    ("folded", ["fused_epilogue=false", "cuda_graph=false"]),
    ("fused epilogues", ["cuda_graph=false"]),
    ("replayed", ["cuda_graph=true"]),
    ("compiled + replayed", ["cuda_graph=true", "compile=true"]),
]


@dataclass
class Variant:
    suite: str
    name: str
    backend: str
    dtype: str
    run: Callable[[], object]  # one forward pass on the variant's own input
    detail: str


def _overrides(backend: str, dtype: str, batch: int, resolution: int) -> list[str]:
    amp = [] if dtype == "fp32" else ["amp=true", f"amp_dtype={dtype}"]
    return ["data=synthetic", f"backend={backend}", "channels_last=true", f"data.batch_size={batch}",
            f"data.resolution={resolution}", *amp]


def _project_variant(suite: str, name: str, backend: str, dtype: str, extra: list[str], args, kernels=None) -> Variant:
    cfg = compose(_overrides(backend, dtype, args.batch_size, args.resolution) + extra)
    device = torch.device("cuda")
    torch.manual_seed(0)  # the same weights for every variant
    model = build_for_run(cfg, device, 1000).eval()
    path = build_path(model, cfg, device)
    if kernels:  # the same fast path with some layers on another kernel
        from mobilenet import cuda_graph, inference_model

        folded = inference_model.build_inference_model(model, DTYPES[dtype], True, True, kernels=kernels)
        path = path._replace(forward=cuda_graph.ReplayedForward(folded, device), model=folded,
                             rows={**path.rows, **{f"{k} kernel": v for k, v in folded.epilogues().items()}})
    x = torch.randn(args.batch_size, 3, args.resolution, args.resolution, device=device)
    x = x.to(DTYPES[dtype]).contiguous(memory_format=torch.channels_last)
    amp = path.amp_dtype

    def run():
        with torch.autocast("cuda", dtype=amp, enabled=amp is not None):
            return path.forward(x)

    detail = "; ".join(f"{k}: {v}" for k, v in path.rows.items())
    return Variant(suite, name, backend, dtype, run, detail)


def _peer_variant(args) -> Variant:
    import timm
    from torch.fx.experimental.optimization import fuse

    torch.manual_seed(0)
    model = timm.create_model("mobilenetv1_100", pretrained=False).cuda().eval()
    model = fuse(model).half().to(memory_format=torch.channels_last)
    forward = torch.compile(model)
    x = torch.randn(args.batch_size, 3, args.resolution, args.resolution, device="cuda").half()
    x = x.contiguous(memory_format=torch.channels_last)
    return Variant("peer", "timm mobilenetv1_100, fx conv+BN fuse, .half(), channels_last, torch.compile", "timm",
                   "fp16", lambda: forward(x), f"timm {timm.__version__}")


def build_variants(args) -> list[Variant]:
    from mobilenet import inference_model as im

    out: list[Variant] = []
    if "peer" in args.suites:
        out.append(_peer_variant(args))
    for backend in args.backends:
        if "ladder" in args.suites:
            out += [_project_variant("ladder", step, backend, "fp16", extra, args) for step, extra in LADDER]
        if "dtypes" in args.suites:
            out += [_project_variant("dtypes", "fast path", backend, d, ["cuda_graph=true"], args) for d in DTYPES]
    if "kernels" in args.suites:  # the alternatives behind inference_model's choice of kernel per layer kind
        replayed = ["cuda_graph=true"]
        for kind, backend, epilogue in [("pointwise", "custom", im.CUBLASLT_FUSED), ("pointwise", "custom", im.CONV_THEN_RELU),
                                        ("stem", "custom", im.CONV_THEN_RELU), ("depthwise", "cudnn", im.CUDNN_FUSED)]:
            out.append(_project_variant("kernels", f"{kind}: {epilogue.label}", backend, "fp16", replayed, args,
                                        kernels={kind: epilogue}))
    return out


def measure(variants: list[Variant], rounds: int, steps: int, batch: int) -> dict[int, list[float]]:
    img_s: dict[int, list[float]] = {i: [] for i in range(len(variants))}
    with torch.inference_mode():
        for v in variants:  # compile, autotune, capture
            for _ in range(20):
                v.run()
        torch.cuda.synchronize()
        order = list(range(len(variants)))
        for rnd in range(rounds):
            for i in order if rnd % 2 == 0 else reversed(order):
                for _ in range(5):
                    variants[i].run()
                img_s[i].append(steps * batch / events_elapsed_s(variants[i].run, steps))
    return img_s


def write_results(variants, img_s, args, out_dir: Path | None, name: str) -> str:
    env = environment(torch.device("cuda"))
    rows = []
    for i, v in enumerate(variants):
        values = img_s[i]
        rows.append({"suite": v.suite, "variant": v.name, "backend": v.backend, "dtype": v.dtype,
                     "median_img_s": round(statistics.median(values)), "min_img_s": round(min(values)),
                     "max_img_s": round(max(values)), "rounds": len(values), "detail": v.detail})
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    lines = [f"# Inference: {', '.join(args.suites)}", "",
             f"{datetime.date.today().isoformat()}, commit {args.commit or env['tree']}, `{command}`; {env['gpu']}, "
             f"driver {env.get('driver', '?')}, torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
             f"{env['cpu_cores']} CPU cores. Batch {args.batch_size}, {args.resolution}px, channels_last, synthetic "
             f"input on the GPU; median img/s over {args.rounds} alternating rounds of {args.steps} passes, one process.",
             "", "| suite | variant | backend | dtype | img/s | min-max |", "|---|---|---|---|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['suite']} | {r['variant']} | {r['backend']} | {r['dtype']} | {r['median_img_s']:,} | "
                     f"{r['min_img_s']:,}-{r['max_img_s']:,} |")
    peer = [r for r in rows if r["suite"] == "peer"]
    if peer:
        lines += ["", "Against the peer (median over median):"]
        for r in rows:
            if r["suite"] != "peer":
                lines.append(f"- {r['suite']} {r['variant']} {r['backend']} {r['dtype']}: "
                             f"{r['median_img_s'] / peer[0]['median_img_s']:.2f}x")
    lines += ["", "What ran (each variant's summary rows):", ""]
    lines += [f"- {r['suite']} / {r['variant']} / {r['backend']} / {r['dtype']}: {r['detail']}" for r in rows]
    text = "\n".join(lines) + "\n"
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{name}.md").write_text(text)
        with open(out_dir / f"{name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        _plot_ladder(rows, out_dir / f"{name}.png")
    return text


def _plot_ladder(rows: list[dict], path: Path) -> None:
    ladder = [r for r in rows if r["suite"] in ("ladder", "peer")]
    if not ladder:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['backend']}: {r['variant']}" if r["suite"] == "ladder" else "peer: timm, fused, compiled" for r in ladder]
    values = [r["median_img_s"] for r in ladder]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(ladder) + 1.2))
    bars = ax.barh(range(len(ladder)), values, color=["#888" if r["suite"] == "peer" else "#3a7" for r in ladder])
    ax.set_yticks(range(len(ladder)), labels)
    ax.invert_yaxis()
    ax.bar_label(bars, labels=[f"{v:,}" for v in values], padding=3)
    ax.set_xlabel("img/s (batch 256, fp16, channels_last)")
    ax.set_title("MobileNetV1 inference ladder")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _list(text: str, allowed, what: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"{what}: {','.join(bad) or 'nothing'} is not one of {', '.join(allowed)}")
    return values


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suites", type=lambda s: _list(s, SUITES, "--suites"), default=list(SUITES))
    p.add_argument("--backends", type=lambda s: _list(s, ("torch", "cudnn", "custom"), "--backends"),
                   default=["cudnn", "custom"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--out", type=Path, help="folder for NAME.md/.csv/.png (default: print only)")
    p.add_argument("--name", default="inference_h200")
    p.add_argument("--commit", help="the commit measured (default: mobilenet.reporting.source_tree(): $MOBILENET_TREE, "
                                    "else this checkout's commit)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    if not torch.cuda.is_available():
        p.error("this benchmark needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.backends.cudnn.benchmark = True
    variants = build_variants(args)
    img_s = measure(variants, args.rounds, args.steps, args.batch_size)
    text = write_results(variants, img_s, args, args.out, args.name)
    print(text)
    return text


if __name__ == "__main__":
    run_main(main)
