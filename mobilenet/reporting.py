"""What a run reports: environment facts, TensorBoard scalars and hparams (and reading them back), the console summary."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import torch


REPO_ROOT = Path(__file__).resolve().parent.parent
TREE_ENV = "MOBILENET_TREE"


def source_tree(root: Path = REPO_ROOT) -> str:
    """Which source tree ran, for result files: $MOBILENET_TREE when set (a copy that has no git metadata of its own,
    or whose metadata names another commit, says what it is), else the checkout's short commit, with "+changes" when
    tracked files differ from it, else "unknown (no git metadata)"."""
    given = os.environ.get(TREE_ENV, "").strip()
    if given:
        return given

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown (no git metadata)"
    changed = git("status", "--porcelain", "--untracked-files=no")
    return commit + ("+changes" if changed else "")


def environment(device: torch.device | None = None) -> dict[str, str]:
    """Versions and hardware, for summaries, hparams and result files."""
    env = {
        "tree": source_tree(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none",
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": str(os.cpu_count()),
        "platform": platform.platform(),
    }
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["gpu_memory_gb"] = f"{props.total_memory / 2**30:.0f}"
        env["driver"] = _driver_version()
    else:
        env["gpu"] = "none"
    try:
        from nvidia import dali

        env["dali"] = dali.__version__
    except ImportError:
        env["dali"] = "not installed"
    try:
        import torchvision

        env["torchvision"] = torchvision.__version__
    except ImportError:
        env["torchvision"] = "not installed"
    return env


def _driver_version() -> str:
    """The NVIDIA driver, from NVML when nvidia-ml-py is there, else from nvidia-smi."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # not installed, or NVML unusable: ask the command-line tool
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


class TensorBoardLog:
    """Scalars under the names users query (perf/*, train/*, val/*, sys/*), and hparams in the same run dir."""

    def __init__(self, run_dir: str, enabled: bool = True):
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=run_dir)

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def text(self, tag: str, markdown: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, markdown)

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
        if self.writer is not None:
            clean = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in hparams.items()}
            # run_name="." keeps the hparams in this run's own directory, next to its scalars.
            self.writer.add_hparams(clean, metrics, run_name=".")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_tensorboard(root: Path) -> dict[Path, tuple[dict | None, dict[str, float]]]:
    """{run dir: (hparams or None, {scalar tag: last value})} for every directory under root with event files."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import metadata

    mux = EventMultiplexer(size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    mux.AddRunsFromDirectory(str(root))
    mux.Reload()
    hparams_content = mux.PluginRunToTagToContent(metadata.PLUGIN_NAME)
    runs = {}
    for run, tags in mux.Runs().items():
        scalars = {tag: mux.Scalars(run, tag)[-1].value for tag in tags.get(ea.SCALARS, [])}
        content = hparams_content.get(run, {}).get(metadata.SESSION_START_INFO_TAG)
        runs[(root / run).resolve()] = (_hparams_of(content) if content is not None else None, scalars)
    return runs


def _hparams_of(content: bytes) -> dict:
    from tensorboard.plugins.hparams import metadata

    values = {}
    for name, value in metadata.parse_session_start_info_plugin_data(content).hparams.items():
        kind = value.WhichOneof("kind")
        values[name] = getattr(value, kind) if kind else None
    return values


def gpu_slug(name: str) -> str:
    """A GPU name as it appears in result file names: 'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' ->
    'h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-") or "gpu"


def machine_line(env: dict[str, str]) -> str:
    """One line naming the machine and versions a result came from."""
    return (f"Machine: {env.get('gpu')} (driver {env.get('driver', '?')}), torch {env['torch']}, CUDA {env['cuda']}, "
            f"cuDNN {env['cudnn']}")


def publish(text: str, out=None) -> None:
    """Print a markdown result and, when `out` is given, write it there too."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def print_summary(title: str, rows: dict[str, Any]) -> str:
    """A two-column table on the console; returns it as markdown for TensorBoard and result files."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=True)
    table.add_column("item")
    table.add_column("value", justify="right")
    for key, value in rows.items():
        table.add_row(key, _fmt(value))
    Console().print(table)
    return "\n".join([f"| {title} | |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in rows.items()])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)
