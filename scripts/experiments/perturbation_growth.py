"""How far apart do two identical training runs end when one starts from weights nudged by a tiny relative amount?

    python scripts/experiments/perturbation_growth.py [--nudge 1e-6] [--layers 4] [HYDRA OVERRIDES ...]

Both runs are `Trainer(cfg).fit()` with the same config, seed and data; before training, every parameter of the
second is multiplied by (1 + nudge * N(0, 1)). The script prints both loss curves and, for the first --layers
parameter tensors, how far the two runs ended apart next to how far training moved them. When the gap is of the size
of the movement, the training is chaotic at these settings. Two whole runs then cannot be compared to check that a
change (a CUDA graph, another kernel) computes the same steps; compare single steps from a shared state instead
(tests/test_cuda_graph.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as `python scripts/experiments/perturbation_growth.py`

from mobilenet.config import compose  # noqa: E402
from mobilenet.engine import Trainer  # noqa: E402

# The GPU test's run, on whatever device is there (device=auto) with the backend every device has.
DEFAULT = ["data=synthetic", "data.steps_per_epoch=12", "data.num_classes=100", "data.batch_size=32",
           "data.resolution=64", "evaluate=false", "save_checkpoints=false", "epochs=1", "perf.warmup_steps=2",
           "perf.log_every=1", "optim.warmup_epochs=0.5", "backend=torch", "channels_last=true", "progress=false"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nudge", type=float, default=1e-6, help="relative size of the nudge (default 1e-6)")
    p.add_argument("--layers", type=int, default=4, help="parameter tensors to report (default 4)")
    args, overrides = p.parse_known_args(argv)
    cfg = compose([*DEFAULT, *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        base, nudged = Trainer(cfg, Path(tmp) / "base"), Trainer(cfg, Path(tmp) / "nudged")
        start = [q.detach().clone() for q in base.model.parameters()]
        with torch.no_grad():
            for q in nudged.model.parameters():
                q.mul_(1 + args.nudge * torch.randn_like(q))
        r_base, r_nudged = base.fit(), nudged.fit()
    print("loss, base:  ", " ".join(f"{v:.4f}" for _, v in r_base.losses))
    print("loss, nudged:", " ".join(f"{v:.4f}" for _, v in r_nudged.losses))
    print("| parameter | shape | max abs gap between the runs | max abs move by training | max abs at start |")
    print("|---|---|--:|--:|--:|")
    params = zip(base.model.named_parameters(), nudged.model.parameters(), start)
    for (name, a), b, a0 in list(params)[: args.layers]:
        print(f"| {name} | {tuple(a.shape)} | {(a - b).abs().max().item():.3e} | {(a - a0).abs().max().item():.3e} "
              f"| {a0.abs().max().item():.3e} |")


if __name__ == "__main__":
    main()
