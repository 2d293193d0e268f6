#!/usr/bin/env python
"""What does data=dali's training pipeline cost the GPU per batch, kernel by kernel, in each of its settings?

DALI-fed training trails synthetic data where the loader's kernels share the SMs with the step
(docs/results/loader_h200.md). This runs the training pipeline of mobilenet/data/dali.py alone, once per setting
(`--variant`, data.dali overrides), alternating over `--rounds`: img/s over `--iters` batches, then `--profile-iters`
batches under torch.profiler, whose CUDA rows are summed by name per batch (kernels apart from copies). Needs NVIDIA
DALI and a CUDA GPU:

    python scripts/experiments/dali_gpu_work.py --root /tmp/fake --variant data.dali.hw_decoder_load=1.0 \\
        --variant data.dali.hw_decoder_load=0.85

Its recorded uses compared settings that were measured and removed again: the decoder asked for YCbCr and converted
after the resize (commit cdd5744, docs/results/loader_h100_cdd5744.md), and a version of this script (commits 9b993c8
to b2af7e4) that also ran data.dali.resize=kernel, the project's own resize kernel (docs/results/loader_h100_7fe2d77.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling experiment's loader timing

import torch  # noqa: E402
from dali_decode_ceiling import timed  # noqa: E402

from mobilenet.config import compose  # noqa: E402
from mobilenet.data.dali import import_dali, make_train_pipeline  # noqa: E402
from mobilenet.data.folder import scan_image_folder  # noqa: E402


def build(root: str, variant: str, files, labels, *, batch: int, threads: int, seed: int):
    _, types, _, _, _ = import_dali()
    cfg = compose(["data=dali", f"data.root={root}", *variant.split()]).data
    pipe = make_train_pipeline(cfg, files, labels, decode="mixed", on_gpu=True, out_type=types.FLOAT16,
                               channels_last=True, shard_id=0, num_shards=1, batch_size=batch, num_threads=threads,
                               device_id=torch.cuda.current_device(), prefetch_queue_depth=2, seed=seed)
    pipe.build()
    return pipe


def gpu_rows(pipe, iters: int) -> dict[str, tuple[float, float]]:
    """(device microseconds, rows) per batch by CUDA row name over `iters` batches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            pipe.run()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name][0] += event.device_time / iters
            per_name[event.name][1] += 1 / iters
    return {name: (us, n) for name, (us, n) in per_name.items()}


def total(rows: dict[str, tuple[float, float]], copies: bool, field: int = 0) -> float:
    return sum(v[field] for name, v in rows.items() if is_copy(name) == copies)


def is_copy(name: str) -> bool:
    return name.lower().startswith(("memcpy", "memset"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="ImageFolder root (train/ and val/)")
    p.add_argument("--variant", action="append", required=True, help="data.dali overrides, space-separated")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--profile-iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--top", type=int, default=8, help="kernels listed per setting")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the pipeline decodes on a CUDA GPU and this machine has none")
    cfg = compose(["data=dali", f"data.root={args.root}"]).data
    _, samples, _, _ = scan_image_folder(cfg)
    files, labels = [s for s, _ in samples], [lbl for _, lbl in samples]
    print(f"{torch.cuda.get_device_name()}: {len(files)} files, batch {args.batch_size}, {args.threads} threads",
          flush=True)
    rates: dict[str, list[float]] = {v: [] for v in args.variant}
    rows: dict[str, list[dict[str, tuple[float, float]]]] = {v: [] for v in args.variant}
    for r in range(args.rounds):
        for variant in (args.variant if r % 2 == 0 else args.variant[::-1]):
            pipe = build(args.root, variant, files, labels, batch=args.batch_size, threads=args.threads, seed=7 + r)
            rates[variant].append(timed(pipe, args.warmup, args.iters, args.batch_size))
            rows[variant].append(gpu_rows(pipe, args.profile_iters))
            print(f"round {r + 1} {variant}: {rates[variant][-1]:,.0f} img/s, kernels "
                  f"{total(rows[variant][-1], False) / 1000:.3f} ms/batch", flush=True)
            del pipe
    print("\n| setting | img/s per round | kernels, ms per batch | kernels per batch | copies, ms per batch |")
    print("|---|---|--:|--:|--:|")
    for variant in args.variant:
        med = [statistics.median(total(rr, copies, field) for rr in rows[variant])
               for copies, field in ((False, 0), (False, 1), (True, 0))]
        print(f"| `{variant}` | {' / '.join(f'{v:,.0f}' for v in rates[variant])} | {med[0] / 1000:.3f} | "
              f"{med[1]:.0f} | {med[2] / 1000:.3f} |")
    print("\n(medians over the rounds)")
    for variant in args.variant:
        print(f"\n`{variant}`, last round, by name (us and rows per batch):")
        for name, (us, n) in sorted(rows[variant][-1].items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"- {us:9.1f} us {n:6.1f}x  {name[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
