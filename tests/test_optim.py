"""The optimizer factory (mobilenet/optim.py) as a Trainer uses it: PyTorch's foreach and fused implementations, and
apex's optimizers refused by name where apex is not installed."""

import pytest

from mobilenet.config import compose
from mobilenet.engine import Trainer

COMMON = ["device=cpu", "model.width_mult=0.5", "progress=false", "data.workers=0", "perf.warmup_steps=2"]


def test_optimizer_implementations(run_dir):
    for impl in ("foreach", "fused"):
        t = Trainer(compose([*COMMON, f"optim.impl={impl}", "epochs=1", "data.steps_per_epoch=2",
                             "perf.warmup_steps=1", "evaluate=false"]), run_dir)
        assert t.optimizer.defaults[impl] is True
    with pytest.raises(ImportError, match="optim.impl=apex: NVIDIA apex is not installed"):
        Trainer(compose([*COMMON, "optim.impl=apex"]), run_dir)
    with pytest.raises(ValueError, match="optim.name=lamb is apex's FusedLAMB"):
        Trainer(compose([*COMMON, "optim.name=lamb"]), run_dir)
