"""What the matrix tests of scripts/benchmark.py and scripts/compare.py share: the tiny CPU settings, running either
script as a user would, and reading event files independently of compare.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mobilenet.bench.matrix import Combo

ROOT = Path(__file__).resolve().parent.parent
BENCHMARK = ROOT / "scripts" / "benchmark.py"
COMPARE = ROOT / "scripts" / "compare.py"

TINY = ["--batch-size", "8", "--resolution", "32", "--width-mult", "0.25", "--warmup", "2", "--steps", "3",
        "--infer-warmup", "2", "--infer-steps", "3", "--compile", "false", "--data", "synthetic"]
MEASURED = [(amp, cl) for amp in ("off", "bf16") for cl in (False, True)]


def run_tool(script: Path, *args: str, check: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script.name} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def combo_dir(root: Path, backend: str, amp: str, channels_last: bool) -> Path:
    return root / Combo(backend, amp, channels_last, False, "synthetic").name


def read_scalars(run_dir: Path) -> dict[str, float]:
    """The last value of every scalar in a run's event files, read record by record (independent of compare.py)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    last: dict[str, tuple[int, float]] = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        for record in RawEventFileLoader(str(path)).Load():
            event = Event.FromString(record)
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value" and event.step >= last.get(value.tag, (-1, 0))[0]:
                    last[value.tag] = (event.step, value.simple_value)
    return {tag: v for tag, (_, v) in last.items()}


def fake_run(run_dir: Path, batch_size: int, scalars: dict[str, float], backend: str = "torch",
             norm: str | None = None, overrides: list[str] | None = None) -> None:
    """A run's event files as train.py writes them (hparams without norm, as runs before it was logged), and its
    .hydra/overrides.yaml where overrides are given."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(run_dir))
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, 5)
    writer.add_hparams({"backend": backend, "amp": False, "amp_dtype": "fp16", "channels_last": False, "compile": True,
                        "data": "synthetic", "batch_size": batch_size, "resolution": 32, "gpu": "none",
                        **({"norm": norm} if norm else {})},
                       {"hparam/train_img_s": scalars.get("perf/train_img_s", 0.0)}, run_name=".")
    writer.close()
    if overrides is not None:
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
