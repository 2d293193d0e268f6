"""The training ladder as a waterfall chart: the rows `bash scripts/train_ladder.sh` prints (a markdown table of
step, overrides, train img/s), each step's gain over the one before drawn as a floating bar."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .plotting import pyplot

__all__ = ["LadderStep", "LADDER_STEPS", "OPTIONAL_STEPS", "parse_ladder", "write_waterfall"]

# The ladder's steps in order, as train_ladder.sh labels them; the rows after them (the alternating rounds, bf16,
# fp32) are not steps of the ladder.
NORM_IN_DEPTHWISE_STEP = "BatchNorm+ReLU in the depthwise kernels"
NORM_IN_POINTWISE_STEP = "BatchNorm+ReLU in cuDNN's pointwise convs"
LADDER_STEPS = ("fp32 NCHW", "AMP fp16", "channels_last", "custom depthwise", "custom BatchNorm+ReLU",
                NORM_IN_DEPTHWISE_STEP, "captured step", NORM_IN_POINTWISE_STEP)
# Steps a table may lack: tables printed before train_ladder.sh measured norm.apply_in_depthwise as a step of its own,
# and norm.apply_in_pointwise, which runs only where nvidia-cudnn-frontend is installed (a dependency, so normally).
OPTIONAL_STEPS = frozenset({NORM_IN_DEPTHWISE_STEP, NORM_IN_POINTWISE_STEP})

_ROW = re.compile(r"^\|\s*(?P<label>[^|]+?)\s*\|\s*`?(?P<overrides>[^|]*?)`?\s*\|\s*(?P<value>[^|]+?)\s*\|\s*$")


@dataclass(frozen=True)
class LadderStep:
    label: str
    overrides: str
    img_s: float


def parse_ladder(text: str) -> list[LadderStep]:
    """The ladder's steps from train_ladder.sh's table, in LADDER_STEPS order. Raises ValueError naming what is
    missing or unreadable (a step that failed prints `failed` instead of a number)."""
    found: dict[str, LadderStep] = {}
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if not m or m["label"] not in LADDER_STEPS:
            continue
        value = m["value"].replace(",", "")
        try:
            img_s = float(value)
        except ValueError:
            raise ValueError(f"ladder step {m['label']!r}: train img/s is {m['value']!r}, not a number") from None
        found[m["label"]] = LadderStep(m["label"], m["overrides"], img_s)
    missing = [s for s in LADDER_STEPS if s not in found and s not in OPTIONAL_STEPS]
    if missing:
        raise ValueError(f"the ladder table lacks the step(s) {', '.join(missing)}; expected the rows "
                         f"{', '.join(LADDER_STEPS)} as bash scripts/train_ladder.sh prints them")
    return [found[s] for s in LADDER_STEPS if s in found]


def write_waterfall(steps: list[LadderStep], path: Path, title: str) -> None:
    """A waterfall PNG: the first step a full bar, each later step a bar from the previous value to its own (green
    up, red down), labelled with its img/s and its gain; the last a full bar again."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    previous = 0.0
    for i, step in enumerate(steps):
        bottom, height = (0.0, step.img_s) if i == 0 else (previous, step.img_s - previous)
        color = "#4c72b0" if i == 0 else ("#55a868" if height >= 0 else "#c44e52")
        ax.bar(i, height, bottom=bottom, color=color, width=0.6)
        gain = "" if i == 0 else f"\n{step.img_s / previous:.2f}x"
        ax.text(i, max(previous, step.img_s), f"{step.img_s:,.0f}{gain}", ha="center", va="bottom", fontsize=8)
        previous = step.img_s
    ax.bar(len(steps), steps[-1].img_s, color="#4c72b0", width=0.6)
    ax.text(len(steps), steps[-1].img_s, f"{steps[-1].img_s / steps[0].img_s:.1f}x overall", ha="center",
            va="bottom", fontsize=8)
    ax.set_xticks(range(len(steps) + 1), [s.label for s in steps] + ["result"], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("train img/s")
    ax.set_ylim(0, max(s.img_s for s in steps) * 1.2)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
