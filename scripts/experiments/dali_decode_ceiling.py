#!/usr/bin/env python
"""What caps data=dali's training pipeline: the JPEG decode, the host threads, or the GPU work after the decode?

The pipeline is cut after each stage and each cut is run alone, without a model, over the same files:

- `read`: the file reader only (host threads, page cache);
- `decode`: reader + the random-crop decode on the GPU (`decoders.image_random_crop`, device mixed);
- `decode_full`: reader + the whole-image decode on the GPU (`decoders.image`): what a region-of-interest decode saves;
- `cpu_decode`: reader + the random-crop decode on the host (libjpeg-turbo), nothing on the GPU: the host's capacity;
- `pipeline`: the training pipeline of mobilenet/data/dali.py (decode, resize, flip, normalise).

Each cut runs `--warmup` untimed iterations, then `--iters` timed ones; img/s = images / wall time, the device
synchronised at both ends. Cuts, thread counts and hardware-decoder shares alternate over `--rounds` rounds in one
process. Needs NVIDIA DALI, and a CUDA GPU for every cut but `read` and `cpu_decode`:

    python scripts/experiments/dali_decode_ceiling.py --root /tmp/fake --cuts decode,decode_full,pipeline --threads 4,8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from mobilenet.config import compose  # noqa: E402
from mobilenet.data.dali import decoder_args, import_dali, make_train_pipeline, random_crop_args  # noqa: E402
from mobilenet.data.folder import scan_image_folder  # noqa: E402

CUTS = ("read", "decode", "decode_full", "cpu_decode", "pipeline")


def build_cut(cut: str, cfg, files, labels, *, threads: int, hw: float, hint: str, prefetch: int, device_id: int,
              seed: int):
    fn, types, pipeline_def, _, _ = import_dali()
    common = dict(batch_size=cfg.batch_size, num_threads=threads, device_id=device_id,
                  prefetch_queue_depth=prefetch, seed=seed)
    data_cfg = compose(["data=dali", f"data.root={cfg.root}", f"data.dali.hw_decoder_load={hw}"]).data
    if cut == "pipeline":
        return make_train_pipeline(data_cfg, files, labels, decode="mixed", on_gpu=True, out_type=types.FLOAT16,
                                   channels_last=True, shard_id=0, num_shards=1, **common)
    gpu = decoder_args(data_cfg, "mixed")  # the training pipeline's own decoder settings
    if hint != "none":  # the hardware decoder's buffers sized up front for images up to W x H
        width, height = (int(v) for v in hint.split("x"))
        gpu.update(preallocate_width_hint=width, preallocate_height_hint=height)

    @pipeline_def(exec_dynamic=True)
    def cut_pipe():
        jpegs, _ = fn.readers.file(files=files, labels=labels, random_shuffle=True, initial_fill=4096, name="Reader")
        if cut == "read":
            return jpegs
        if cut == "decode_full":
            return fn.decoders.image(jpegs, device="mixed", output_type=types.RGB, **gpu)
        crop = random_crop_args(cfg)
        if cut == "cpu_decode":
            return fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB, **crop)
        return fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB, **crop, **gpu)

    return cut_pipe(**common)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(pipe, warmup: int, iters: int, batch: int) -> float:
    for _ in range(warmup):
        pipe.run()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        out = pipe.run()
    sync()
    del out
    return iters * batch / (time.perf_counter() - start)


def timed_together(pipes: list, warmup: int, iters: list[int], batch: int) -> tuple[list[float], float]:
    """Each pipeline in a thread of its own, started together: (img/s of each, img/s of all together)."""
    for pipe in pipes:
        for _ in range(warmup):
            pipe.run()
    sync()
    barrier = threading.Barrier(len(pipes) + 1)
    ends = [0.0] * len(pipes)

    def work(i, pipe, n):
        barrier.wait()
        for _ in range(n):
            pipe.run()
        ends[i] = time.perf_counter()

    threads = [threading.Thread(target=work, args=(i, p, n)) for i, (p, n) in enumerate(zip(pipes, iters))]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    sync()
    elapsed = time.perf_counter() - start
    # each pipeline's rate over its own time (the host does not sync per pipeline: GPU work may trail by a batch or
    # two), and all images over the wall time of all
    return [n * batch / (end - start) for n, end in zip(iters, ends)], sum(iters) * batch / elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="ImageFolder root (train/ and val/)")
    p.add_argument("--cuts", default="decode,decode_full,pipeline", help=f"comma-separated: {', '.join(CUTS)}")
    p.add_argument("--threads", default="4", help="comma-separated DALI thread counts")
    p.add_argument("--hw", default="1.0", help="comma-separated hw_decoder_load values")
    p.add_argument("--hints", default="none", help="comma-separated: none, or WxH for preallocate_width/height_hint "
                   "(decode and decode_full cuts only)")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=80)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--together", default=None, metavar="CUT+CUT[:THREADS+THREADS[:ITERS+ITERS]]",
                   help="instead of the sweep: two cuts as two pipelines running at once, e.g. "
                        "decode+cpu_decode:4+8:80+16 (the second pipeline's share of the images is its iterations')")
    args = p.parse_args(argv)
    together = args.together.split(":") if args.together else None
    cuts = together[0].split("+") if together else [c.strip() for c in args.cuts.split(",") if c.strip()]
    if together and len(cuts) != 2:
        p.error(f"--together takes two cuts joined by '+', got {together[0]!r}")
    if bad := [c for c in cuts if c not in CUTS]:
        p.error(f"unknown cut(s) {bad}; choose from {', '.join(CUTS)}")
    on_gpu = torch.cuda.is_available()
    if not on_gpu and (gpu_cuts := [c for c in cuts if c not in ("read", "cpu_decode")]):
        p.error(f"cut(s) {gpu_cuts} decode on a CUDA GPU and this machine has none; without one, use read,cpu_decode")
    cfg = compose(["data=dali", f"data.root={args.root}", f"data.batch_size={args.batch_size}"]).data
    _, samples, _, _ = scan_image_folder(cfg)
    files, labels = [s for s, _ in samples], [lbl for _, lbl in samples]
    print(f"{len(files)} files, batch {args.batch_size}, {args.iters} timed iterations after {args.warmup}", flush=True)
    hints = [h.strip() for h in args.hints.split(",")]
    if together:
        pair = cuts
        threads = [int(t) for t in together[1].split("+")] if len(together) > 1 else [int(args.threads)] * 2
        iters = [int(n) for n in together[2].split("+")] if len(together) > 2 else [args.iters] * 2
        for r in range(args.rounds):
            pipes = [build_cut(c, cfg, files, labels, threads=t, hw=float(args.hw), hint="none", prefetch=args.prefetch,
                               device_id=torch.cuda.current_device() if on_gpu else None, seed=99 + r + i)
                     for i, (c, t) in enumerate(zip(pair, threads))]
            for pipe in pipes:
                pipe.build()
            rates, total = timed_together(pipes, args.warmup, iters, args.batch_size)
            print(f"round {r + 1} together: " + ", ".join(f"{c} ({t} threads) {v:,.0f}" for c, t, v in
                                                           zip(pair, threads, rates)) + f"; all {total:,.0f} img/s",
                  flush=True)
            del pipes
        return 0
    settings = [(c, int(t), float(h), hint) for c in cuts for t in args.threads.split(",") for h in args.hw.split(",")
                for hint in (hints if c in ("decode", "decode_full") else ["none"])]
    rates: dict[tuple, list[float]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for cut, threads, hw, hint in settings:
            pipe = build_cut(cut, cfg, files, labels, threads=threads, hw=hw, hint=hint, prefetch=args.prefetch,
                             device_id=torch.cuda.current_device() if on_gpu else None, seed=1234 + r)
            pipe.build()
            rate = timed(pipe, args.warmup, args.iters, args.batch_size)
            rates[(cut, threads, hw, hint)].append(rate)
            print(f"round {r + 1} {time.strftime('%H:%M:%S')} {cut} threads={threads} hw={hw} hint={hint}: "
                  f"{rate:,.0f} img/s", flush=True)
            del pipe
    print("\n| cut | threads | hw_decoder_load | preallocate hint | img/s per round | median |")
    print("|---|--:|--:|---|---|--:|")
    for (cut, threads, hw, hint), values in rates.items():
        print(f"| {cut} | {threads} | {hw} | {hint} | {' / '.join(f'{v:,.0f}' for v in values)} | "
              f"{statistics.median(values):,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
