#!/usr/bin/env python
"""Input-pipeline throughput: images/s of data=dali (decode=mixed, decode=cpu) and data=folder, loader alone.

Each loader's training iterator runs one untimed warm-up epoch (worker start, nvJPEG allocation, page cache),
then --epochs timed epochs: throughput = images delivered / wall time, with the device synchronised at both ends.
No model runs, so this is the most each loader can feed. Writes a markdown table (machine, versions, command),
with what the machine did over the timed epochs (mobilenet/machine_load.py: host CPUs, threads, SMs, JPEG engines).

    python scripts/bench_loader.py --root /data/fake-imagenet --threads 16 --out docs/results/loader_h200.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from mobilenet.errors import run_main  # noqa: E402
from mobilenet.bench.dtypes import DTYPES  # noqa: E402
from mobilenet.config import compose  # noqa: E402
from mobilenet.data import LoaderSpec, build_loaders  # noqa: E402
from mobilenet.machine_load import LoadSampler  # noqa: E402
from mobilenet.reporting import environment, gpu_slug  # noqa: E402

LOADERS = {
    "dali-mixed": ["data=dali", "data.dali.decode=mixed"],
    "dali-cpu": ["data=dali", "data.dali.decode=cpu"],
    "folder": ["data=folder"],
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, args, device: torch.device) -> dict:
    overrides = [*LOADERS[name], f"data.root={args.root}", f"data.batch_size={args.batch_size}",
                 f"data.resolution={args.resolution}", f"data.num_classes={args.classes}",
                 f"data.workers={args.threads}", f"data.dali.threads={args.threads}", *args.override]
    cfg = compose(overrides)
    spec = LoaderSpec(device, DTYPES[args.dtype], args.channels_last)
    start = time.perf_counter()
    train, _ = build_loaders(cfg.data, spec)
    build_s = time.perf_counter() - start
    for _ in range(args.warmup_epochs):
        for images, labels in train:
            pass
    sync(device)
    images_seen = 0
    sampler = LoadSampler(device).start()
    start = time.perf_counter()
    for _ in range(args.epochs):
        for images, labels in train:
            images_seen += labels.shape[0]
    sync(device)
    elapsed = time.perf_counter() - start
    load = sampler.stop()
    result = dict(loader=name, images=images_seen, seconds=elapsed, rate=images_seen / elapsed, build_s=build_s,
                  shape=tuple(images.shape), dtype=str(images.dtype).replace("torch.", ""), device=str(images.device),
                  channels_last=images.is_contiguous(memory_format=torch.channels_last), load=load.line())
    print(f"{name}: {result['rate']:.0f} img/s ({images_seen} images in {elapsed:.2f} s, build {build_s:.1f} s)\n"
          f"  machine load: {result['load']}", flush=True)
    del train
    return result


def versions(env: dict) -> str:
    return (f"Python {env['python']}, torch {env['torch']}, DALI {env['dali']}, torchvision {env['torchvision']}, "
            f"CUDA {env['cuda']}")


def machine(env: dict) -> str:
    gpu = f"{env['gpu']} (driver {env['driver']})" if env["gpu"] != "none" else "no GPU"
    return f"{gpu}; {env['cpu_cores']} CPU cores; {env['platform']}"


def dataset_summary(root: Path) -> str:
    files = [p for p in (root / "train").rglob("*") if p.is_file()]
    classes = sum(1 for p in (root / "train").iterdir() if p.is_dir())
    mean_kb = sum(p.stat().st_size for p in files) / max(1, len(files)) / 1000
    return f"{len(files)} train images in {classes} classes, mean {mean_kb:.0f} KB"


def write_markdown(path: Path, args, device: torch.device, results: list[dict]) -> None:
    rows = "\n".join(
        f"| {r['loader']} | {r['rate']:,.0f} | {r['images']} | {r['seconds']:.2f} | {r['build_s']:.1f} | "
        f"{r['dtype']} {'NHWC/channels_last' if r['channels_last'] else 'NCHW'} on {r['device']} | {r['load']} |"
        for r in results
    )
    env = environment(device)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO), *sys.argv[1:]])
    text = f"""# Input pipeline throughput ({datetime.date.today().isoformat()})

Loader alone (no model): training iterator, {args.warmup_epochs} untimed warm-up epoch(s), then {args.epochs} timed
epoch(s); images/s = images delivered / wall time, device synchronised at both ends. Batch {args.batch_size},
{args.resolution}px, {args.dtype}, {"channels_last" if args.channels_last else "NCHW"}, {args.threads} DALI threads /
DataLoader workers.

- Machine: {machine(env)}
- Software: {versions(env)}
- Data: {dataset_summary(Path(args.root))} (`scripts/make_fake_imagenet.py`)
- Command: `{command}`

| loader | img/s | images | seconds | build s | output | machine load (timed epochs) |
| --- | ---: | ---: | ---: | ---: | --- | --- |
{rows}
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="ImageFolder root (train/ and val/)")
    p.add_argument("--loaders", default="dali-mixed,dali-cpu,folder", help=f"comma-separated: {', '.join(LOADERS)}")
    p.add_argument("--threads", type=int, default=8, help="DALI threads and DataLoader workers")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per loader")
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None, help="markdown file (default docs/results/loader_<gpu or cpu>.md)")
    p.add_argument("override", nargs="*", help="extra Hydra overrides, e.g. data.dali.prefetch=3")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    names = [n.strip() for n in args.loaders.split(",") if n.strip()]
    unknown = [n for n in names if n not in LOADERS]
    if unknown:
        p.error(f"unknown loader(s) {unknown}; choose from {', '.join(LOADERS)}")
    if device.type == "cpu" and "dali-mixed" in names:
        print("no GPU: dali-mixed would decode on the CPU like dali-cpu; skipping it")
        names.remove("dali-mixed")
    results = [measure(name, args, device) for name in names]
    out = args.out
    if out is None:
        tag = gpu_slug(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu"
        out = REPO / "docs" / "results" / f"loader_{tag}.md"
    write_markdown(out, args, device, results)
    return 0


if __name__ == "__main__":
    run_main(main)
