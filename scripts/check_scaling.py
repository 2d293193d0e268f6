"""Does data-parallel training scale? The same train.py run on 1 GPU and under torchrun on N GPUs, back to back.

    python scripts/check_scaling.py [--gpus N] [--steps 400] [--warmup 50] [--rounds 1] [--target 0.90]
                                    [--out docs/results/ddp_scaling_2xh200.md] [--device cuda|cpu] [HYDRA OVERRIDES ...]

Each round runs `python train.py OVERRIDES` (one process, one GPU), then
`python -m torch.distributed.run --standalone --nproc_per_node=N train.py OVERRIDES` (torchrun, DDP over N GPUs of
this host), each into its own log_root under --work-dir; rounds alternate the two so that clock and thermal drift
hit both alike. This is weak scaling: the per-GPU batch (data.batch_size) is the same in both runs, so the N-GPU run
trains a global batch N times larger. Throughput is read from each run's TensorBoard event file (perf/train_img_s:
images of all ranks over the slowest rank's timed window, warm-up excluded), not from its console output:

    scaling efficiency = global img/s of the N-process run / (N x img/s of the 1-process run)

With --rounds > 1 the verdict compares medians. The N-process run also gets perf.single_gpu_img_s=<the single run of
its round>, so it logs perf/scaling_efficiency itself. Both runs get NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (NVLink multicast off; needed on the lent H200 hosts)
and one OMP_NUM_THREADS (cores / N), unless they are already set. The default overrides are the acceptance
configuration, data=synthetic backend=torch amp=true amp_dtype=fp16 channels_last=true; overrides given here are
added after them (same key: yours wins). --device cpu runs the same pipeline with gloo on CPU processes, small
images and fp32 (for tests; its efficiency says nothing about GPUs).

Exit status: 0 efficiency >= --target, 1 below it, 2 a run failed or the setup is wrong (the message says which).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mobilenet.errors import run_main  # noqa: E402
from mobilenet.bench.train_runs import FIXED, TrainRunError, merge_overrides, num as _num, run_train  # noqa: E402
from mobilenet.reporting import environment, gpu_slug, machine_line, publish  # noqa: E402
from mobilenet.subprocesses import exit_on_sigterm  # noqa: E402

GPU_DEFAULT = ["data=synthetic", "backend=torch", "amp=true", "amp_dtype=fp16", "channels_last=true"]
CPU_DEFAULT = ["data=synthetic", "backend=torch", "amp=false", "channels_last=true", "data.resolution=64",
               "data.batch_size=16", "model.width_mult=0.25"]
# NVLink multicast (NVLS) off: mandatory on the target machines; set in the children unless the caller set them.
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class Measurement:
    processes: int
    img_s: float  # global: all ranks' images over the slowest rank's time
    per_gpu_img_s: float
    step_ms: float
    logged_efficiency: float | None  # the run's own perf/scaling_efficiency (N-process runs only)
    command: str
    run_dir: Path
    seconds: float


def measure(processes: int, overrides: list[str], log_root: Path, env: dict[str, str], timeout: float,
            single_img_s: float | None = None) -> Measurement:
    extra = [f"perf.single_gpu_img_s={single_img_s:.2f}"] if processes > 1 and single_img_s is not None else []
    run = run_train(overrides, log_root, env, timeout, processes, extra)
    s = run.scalars
    return Measurement(processes, run.img_s, s.get("perf/train_img_s_per_gpu", run.img_s / processes),
                       s.get("perf/step_ms", float("nan")), s.get("perf/scaling_efficiency"), run.command, run.run_dir,
                       run.seconds)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (NCCL, one GPU per process; default) or cpu (gloo, for testing the pipeline)")
    p.add_argument("--gpus", type=int, help="processes of the multi-GPU run (default: all visible GPUs; 2 on cpu)")
    p.add_argument("--steps", type=int, default=400, help="timed training steps per run (default 400)")
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps before them, not timed (default 50)")
    p.add_argument("--rounds", type=int, default=1, help="alternate 1-GPU and N-GPU runs this many times; medians")
    p.add_argument("--target", type=float, default=0.90, help="the efficiency to pass (default 0.90)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take (default 1800)")
    p.add_argument("--out", type=Path, help="markdown result (default docs/results/ddp_scaling_<N>x<gpu>.md)")
    p.add_argument("--work-dir", type=Path, help="where the runs' log_roots go (default runs/ddp_scaling/<time>)")
    p.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides for both runs (after `--` or inline)")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    exit_on_sigterm()
    import torch

    if args.device == "cuda":
        visible = torch.cuda.device_count()  # no CUDA context in this process: the runs get the GPUs to themselves
        if visible == 0:
            print("error: no CUDA GPU visible; --device cpu runs the same pipeline on CPU processes (gloo)", file=sys.stderr)
            return 2
        n = args.gpus or visible
        if n > visible:
            print(f"error: --gpus {n}, but {visible} GPU(s) are visible", file=sys.stderr)
            return 2
    else:
        n = args.gpus or 2
    if n < 2:
        print(f"error: scaling needs at least 2 processes (--gpus {n}" + (f"; {visible} GPU visible)" if args.device == "cuda"
              else ")"), file=sys.stderr)
        return 2
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        print("error: --steps and --rounds must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    defaults = GPU_DEFAULT if args.device == "cuda" else CPU_DEFAULT
    overrides = merge_overrides([*defaults, f"device={args.device}", f"data.steps_per_epoch={args.steps + args.warmup}",
                                 f"perf.warmup_steps={args.warmup}", "epochs=1", *FIXED], args.overrides)
    try:  # a misspelled key or a bad value fails here, in a second, instead of in the first run
        from mobilenet.config import compose

        cfg = compose(overrides)
    except Exception as e:
        print(f"error: the overrides do not compose: {type(e).__name__}: {e}\n  {' '.join(overrides)}", file=sys.stderr)
        return 2

    env = dict(os.environ)
    for name, value in {**CHILD_ENV, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}.items():
        env.setdefault(name, value)
    env_line = " ".join(f"{k}={env[k]}" for k in [*CHILD_ENV, "OMP_NUM_THREADS"])
    work = (args.work_dir or ROOT / "runs" / "ddp_scaling" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    roots = [(work / f"round{r + 1}-1proc", work / f"round{r + 1}-{n}proc") for r in range(args.rounds)]
    taken = [p for pair in roots for p in pair if p.exists()]
    if taken:
        print(f"error: {taken[0]} already exists; pick another --work-dir", file=sys.stderr)
        return 2

    unit = "GPU" if args.device == "cuda" else "process"
    print(f"weak scaling, {cfg.data.batch_size} images per {unit} per step; {args.rounds} round(s) of 1 vs {n} "
          f"processes, {args.steps} timed steps after {args.warmup} warm-up; runs under {work}", flush=True)
    singles: list[Measurement] = []
    multis: list[Measurement] = []
    try:
        for r, (root1, root_n) in enumerate(roots, 1):
            one = measure(1, overrides, root1, env, args.timeout)
            singles.append(one)
            print(f"round {r}/{args.rounds}: 1 process   {_num(one.img_s):>10} img/s ({one.seconds:.0f} s)", flush=True)
            many = measure(n, overrides, root_n, env, args.timeout, single_img_s=one.img_s)
            multis.append(many)
            print(f"round {r}/{args.rounds}: {n} processes {_num(many.img_s):>10} img/s, {_num(many.per_gpu_img_s)} per {unit}, "
                  f"efficiency {many.img_s / (n * one.img_s):.3f} ({many.seconds:.0f} s)", flush=True)
    except TrainRunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    single = statistics.median(m.img_s for m in singles)
    multi = statistics.median(m.img_s for m in multis)
    efficiency = multi / (n * single)
    ok = efficiency >= args.target
    if args.device == "cuda":
        device = torch.device("cuda", 0)
        env_facts = environment(device)
        names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        hardware = f"{n} x {' / '.join(names)} in one host ({torch.cuda.device_count()} visible), NCCL {nccl}; " \
                   "the 1-GPU run uses cuda:0"
        slug = f"{n}x{gpu_slug(names[0])}"  # '2xh200'
        title = f"{n} x {names[0]}"
    else:
        env_facts = environment(torch.device("cpu"))
        hardware = f"{n} CPU processes (gloo) on {env_facts['cpu_cores']} cores; OMP_NUM_THREADS={env['OMP_NUM_THREADS']} each"
        slug = f"{n}xcpu"
        title = f"{n} CPU processes"
    out = args.out or ROOT / "docs" / "results" / f"ddp_scaling_{slug}.md"
    label = {1: f"1 {unit}", n: f"{n} {unit}{'es' if unit == 'process' else 's'} (DDP)"}

    def row(name: str, m_img_s: float, processes: int, per_gpu: float, step_ms: float, eff: str) -> str:
        return f"| {name} | {processes} | {_num(m_img_s)} | {_num(per_gpu)} | {step_ms:.1f} | {eff} |"

    table = ["| run | processes | global img/s | per-GPU img/s | step ms | efficiency |", "|---|--:|--:|--:|--:|--:|"]
    for r, (one, many) in enumerate(zip(singles, multis), 1):
        table.append(row(f"round {r}: {label[1]}", one.img_s, 1, one.img_s, one.step_ms, "1.000 (reference)"))
        table.append(row(f"round {r}: {label[n]}", many.img_s, n, many.per_gpu_img_s, many.step_ms,
                         f"{many.img_s / (n * one.img_s):.3f}"))
    if args.rounds > 1:
        table.append(row(f"median: {label[1]}", single, 1, single, statistics.median(m.step_ms for m in singles), "1.000 (reference)"))
        table.append(row(f"median: {label[n]}", multi, n, multi / n, statistics.median(m.step_ms for m in multis),
                         f"{efficiency:.3f}"))
    logged = [f"{m.logged_efficiency:.3f}" for m in multis if m.logged_efficiency is not None]
    lines = [
        f"# DDP scaling: 1 vs {title}, same train.py configuration, back to back",
        "",
        f"Command: `python scripts/check_scaling.py {shlex.join(argv)}`",
        f"Overrides: `{' '.join(overrides)}`",
        f"Weak scaling: {cfg.data.batch_size} images per {unit} per step in both runs (the {n}-process run's global batch "
        f"is {n * cfg.data.batch_size}), {cfg.data.resolution}px, {args.steps} timed steps after {args.warmup} warm-up; "
        f"{args.rounds} round(s), each 1 process then {n}.",
        f"Child environment: `{env_line}`",
        machine_line(env_facts),
        f"Hardware: {hardware}",
        "",
        "Commands (round 1; later rounds differ only in log_root and perf.single_gpu_img_s):",
        "",
        "```bash",
        singles[0].command,
        multis[0].command,
        "```",
        "",
        *table,
        "",
        f"img/s are perf/train_img_s from each run's TensorBoard events (images of all ranks over the slowest rank's "
        f"timed window); per-GPU = global / processes. The {n}-process runs' own perf/scaling_efficiency: "
        f"{', '.join(logged) or 'not logged'}.",
        "",
        f"Scaling efficiency {efficiency:.3f} = {_num(multi)} / ({n} x {_num(single)}); target >= {args.target:.2f}: "
        f"{'PASS' if ok else 'FAIL'}",
    ]
    publish("\n".join(lines), out)
    print(f"wrote {out}; runs in {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
