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
    """The same gradients fed to optim.impl=apex (FusedSGD) and optim.impl=foreach (torch SGD) for a few steps, with
    the project's momentum, Nesterov, weight decay and param groups: the parameters agree to rounding."""
    import torch

    from mobilenet.model import MobileNetV1
    from mobilenet.optim import build_optimizer

    torch.manual_seed(0)
    state = MobileNetV1(num_classes=10, width_mult=0.25).state_dict()
    gen = torch.Generator(device="cuda").manual_seed(1)
    grads = [[torch.randn(p.shape, device="cuda", generator=gen) for p in MobileNetV1(num_classes=10, width_mult=0.25)
              .parameters()] for _ in range(3)]
    params = {}
    for impl in ("foreach", "apex"):
        model = MobileNetV1(num_classes=10, width_mult=0.25).cuda()
        model.load_state_dict(state)
        opt = build_optimizer(compose([f"optim.impl={impl}"]), model, global_batch=256)
        for step in grads:
            opt.zero_grad()
            for p, g in zip(model.parameters(), step):
                p.grad = g.clone()
            opt.step()
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters()), f"{impl}: zero_grad() left gradients"
        params[impl] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert not torch.equal(params["foreach"], torch.cat([v.cuda().flatten() for k, v in state.items()
                                                         if k in dict(model.named_parameters())]))
    torch.testing.assert_close(params["apex"], params["foreach"], rtol=1e-5, atol=1e-6)
