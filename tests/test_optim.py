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


def _apex_importable() -> bool:
    try:
        import amp_C  # noqa: F401
        from apex.optimizers import FusedSGD  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not _apex_importable(), reason="needs NVIDIA apex with its amp_C extension")
def test_apex_fused_sgd_takes_the_steps_of_torch_sgd():
    import torch

    from mobilenet.model import MobileNetV1
    from mobilenet.optim import build_optimizer

    torch.manual_seed(0)
    reference = MobileNetV1(num_classes=10, width_mult=0.25).cuda()
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    x = torch.randn(8, 3, 64, 64, device="cuda")
    labels = torch.randint(0, 10, (8,), device="cuda")
    params = {}
    for impl in ("foreach", "apex"):
        model = MobileNetV1(num_classes=10, width_mult=0.25).cuda()
        model.load_state_dict(state)
        opt = build_optimizer(compose([f"optim.impl={impl}"]), model, global_batch=8)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), labels).backward()
            opt.step()
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters()), f"{impl}: zero_grad() left gradients"
        params[impl] = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(params["apex"], params["foreach"], rtol=1e-4, atol=1e-5)
