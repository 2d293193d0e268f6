"""A captured DDP training step (torchrun with cuda_graph on): two ranks on two GPUs over NCCL, each rank's replayed
steps against an eager DDP twin started from the same state, for both norms, with and without sync_bn.

What could go wrong, and what catches it: a replay that skips the gradient all-reduce leaves the two ranks' weights
apart (each rank trains on its own batches), so every rank's replayed weights must equal rank 0's bit for bit; a
replay that all-reduces stale buckets, or sync_bn statistics captured from the wrong tensors, makes the replayed
step differ from the eager one. Skipped with fewer than two GPUs; CPU runs (gloo) are never captured.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from test_sync_norm import _free_port

gpu = pytest.mark.gpu
CASES = [("custom", "custom", False), ("custom", "custom", True), ("cudnn", "torch", False), ("cudnn", "torch", True)]
RUN = ["device=cuda", "progress=false", "data=synthetic", "data.steps_per_epoch=20", "data.num_classes=100",
       "data.batch_size=32", "data.resolution=64", "evaluate=false", "save_checkpoints=false", "epochs=1",
       "perf.warmup_steps=2", "optim.warmup_epochs=0.5", "amp=true", "channels_last=true"]
_COMPARED_STEPS = 2


def _case_id(case) -> str:
    backend, norm, sync = case
    return f"{backend}-{norm}-sync_bn={str(sync).lower()}"


def _twin_steps(case, out: Path, rank: int) -> dict:
    """The graphed trainer's eager warm-up, capture and a replay; then _COMPARED_STEPS steps of it and of an eager
    twin loaded with its state, on this rank's batch."""
    from mobilenet import cuda_graph
    from mobilenet.config import compose
    from mobilenet.engine import Trainer

    backend, norm, sync = case
    common = [*RUN, f"backend={backend}", f"norm={norm}", f"sync_bn={str(sync).lower()}"]
    graphed = Trainer(compose([*common, "cuda_graph=true"]), out / f"{_case_id(case)}-graph-{rank}")
    eager = Trainer(compose([*common, "cuda_graph=false"]), out / f"{_case_id(case)}-eager-{rank}")
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    images, labels = next(iter(graphed.train_loader))
    graphed.model.train(), eager.model.train()
    for _ in range(cuda_graph.DDP_WARMUP_STEPS + 2):  # the eager steps, the capture, one replay
        graphed.train_step(images, labels)
    assert graphed.graphed.graph is not None and graphed.graphed.eager_steps == cuda_graph.DDP_WARMUP_STEPS
    eager.model.load_state_dict(graphed.model.state_dict())
    eager.optimizer.load_state_dict(copy.deepcopy(cuda_graph.host_lrs(graphed.optimizer.state_dict())))
    eager.scheduler.load_state_dict(copy.deepcopy(graphed.scheduler.state_dict()))
    eager.scaler.load_state_dict(graphed.scaler.state_dict())
    losses = [(graphed.train_step(images, labels).item(), eager.train_step(images, labels).item())
              for _ in range(_COMPARED_STEPS)]
    state = lambda t: {k: v.detach().cpu().clone() for k, v in t.model.state_dict().items()}  # noqa: E731
    return dict(losses=losses, graphed=state(graphed), eager=state(eager), summary=graphed.cuda_graph_state,
                sync_bn=graphed.sync_bn_state)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    from mobilenet import distributed

    out = Path(out_dir)
    try:
        results = {_case_id(case): _twin_steps(case, out, rank) for case in CASES}
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        distributed.shutdown()


@pytest.fixture(scope="module")
def two_gpu_results(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
    import kernels

    kernels.load()  # built once here, not by each rank at the same time
    out = tmp_path_factory.mktemp("ddp_capture")
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_replayed_ddp_step_does_what_an_eager_ddp_step_does_and_keeps_the_ranks_equal(two_gpu_results, case):
    ranks = [r[_case_id(case)] for r in two_gpu_results]
    for r in ranks:
        assert r["summary"] == "on (cuda_graph=true; DDP's gradient all-reduce captured with the step)"
        assert ("statistics over 2 ranks" in r["sync_bn"]) == case[2], r["sync_bn"]
        for loss_g, loss_e in r["losses"]:
            assert loss_g == pytest.approx(loss_e, rel=1e-4, abs=1e-5)
        for name, g in r["graphed"].items():
            if g.is_floating_point():
                torch.testing.assert_close(g, r["eager"][name], atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")
            else:
                assert torch.equal(g, r["eager"][name]), name
    # The ranks trained on different batches, and the replayed all-reduce kept their weights the same.
    assert ranks[0]["losses"][0][0] != ranks[1]["losses"][0][0]
    for name, g in ranks[0]["graphed"].items():
        if "running_" not in name or case[2]:  # without sync_bn each rank keeps its own BatchNorm statistics
            assert torch.equal(g, ranks[1]["graphed"][name]), name


@gpu
def test_a_captured_torchrun_run_evaluates_and_checkpoints_between_replays(tmp_path):
    """Validation (DDP's uncaptured buffer broadcast and the metric all-reduces) and checkpoints (a barrier) between
    replayed steps that hold captured NCCL collectives on the same communicator, over two epochs; then a clean exit."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "train.py",
           *[o for o in RUN if not o.startswith(("evaluate=", "save_checkpoints=", "epochs="))],
           "backend=custom", "norm=custom", "epochs=2", "evaluate=true", "save_checkpoints=true", "data.val_steps=2",
           f"log_root={tmp_path}"]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0", "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "DDP's gradient all-reduce captured with the step" in out.stdout, out.stdout[-3000:]
    assert "val top-1 %" in out.stdout, out.stdout[-3000:]
