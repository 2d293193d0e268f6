"""sync_bn with norm=custom (SyncCustomBatchNormReLU, mobilenet/norm.py): the fused BatchNorm+ReLU with the batch
statistics and gradient sums of every rank.

CPU (CI): combine_rank_statistics against float64 statistics of the concatenated batch, for uneven rank batches,
directly and through a real two-process gloo all-reduce. GPU (`pytest -m gpu tests/test_sync_norm.py`): the split ops
against float64 with poisoned outputs; a world of one against CustomBatchNormReLU; two processes on one GPU (gloo)
and on two GPUs (NCCL, skipped with fewer) against a float64 BatchNorm of the whole batch; the engine's refusal of a
single-process sync_bn run; a torchrun training run on two GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor

from mobilenet.norm import CustomBatchNormReLU, SyncCustomBatchNormReLU, _all_reduce_slots, combine_rank_statistics

ROOT = Path(__file__).resolve().parent.parent
gpu = pytest.mark.gpu
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
_EPS = 1e-5


def _rel_err(out: Tensor, ref: Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _slots(parts: list[Tensor]) -> Tensor:
    """[world, 3, C] (count, mean, biased variance) of each part (N_r, C) in float64, as the ranks fill them."""
    rows = [torch.stack([torch.full((p.shape[1],), float(p.shape[0]), dtype=torch.float64), p.mean(0),
                         p.var(0, unbiased=False)]) for p in parts]
    return torch.stack(rows)


def _uneven_parts(sizes, channels=7, mean=0.0, seed=0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Ranks whose data differ in mean and spread: the between-rank term of the combine matters.
    return [torch.randn(n, channels, dtype=torch.float64, generator=g) * (r + 1) + mean + 3 * r
            for r, n in enumerate(sizes)]


# ---------------------------------------------------------------------------------------------- CPU tests


@pytest.mark.parametrize("sizes", [(5,), (1, 1), (3, 10, 1, 50), (1000, 2), (7, 7, 7, 7, 7, 7, 7, 7)])
@pytest.mark.parametrize("mean", [0.0, 1e4], ids=["centred", "large_mean"])
def test_combine_equals_the_statistics_of_the_concatenated_batch(sizes, mean):
    parts = _uneven_parts(sizes, mean=mean)
    count, combined_mean, combined_var = combine_rank_statistics(_slots(parts))
    whole = torch.cat(parts)
    assert combined_mean.dtype == combined_var.dtype == torch.float64
    assert torch.equal(count, torch.full((7,), float(whole.shape[0]), dtype=torch.float64))
    torch.testing.assert_close(combined_mean, whole.mean(0), rtol=1e-14, atol=1e-12)
    torch.testing.assert_close(combined_var, whole.var(0, unbiased=False), rtol=1e-12, atol=1e-12)


def test_combine_of_float32_slots_is_computed_in_float64():
    parts = _uneven_parts((4, 9))
    count, mean, var = combine_rank_statistics(_slots(parts).float())
    assert mean.dtype == var.dtype == count.dtype == torch.float64
    torch.testing.assert_close(var, torch.cat(parts).var(0, unbiased=False), rtol=1e-6, atol=1e-6)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, backend: str, init: str) -> None:
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)


def _combine_worker(rank: int, world: int, init: str, sizes, out_dir: str) -> None:
    _init(rank, world, "gloo", init)
    try:
        part = _uneven_parts(sizes)[rank]
        local = _slots([part])[0]  # this rank's (count, mean, variance)
        slots = _all_reduce_slots(local, None)
        torch.save(dict(slots=slots, stats=combine_rank_statistics(slots)), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_combine_their_slots_into_the_whole_batch_statistics(tmp_path):
    sizes = (3, 11)
    mp.spawn(_combine_worker, args=(2, f"tcp://127.0.0.1:{_free_port()}", sizes, str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    parts = _uneven_parts(sizes)
    assert torch.equal(results[0]["slots"], _slots(parts))  # each rank's row, exactly, in rank order
    for a, b in zip(*(r["stats"] for r in results)):
        assert torch.equal(a, b)  # every rank derives the same bits
    count, mean, var = results[0]["stats"]
    whole = torch.cat(parts)
    assert count[0] == 14
    torch.testing.assert_close(mean, whole.mean(0), rtol=1e-14, atol=1e-12)
    torch.testing.assert_close(var, whole.var(0, unbiased=False), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------- GPU: the ops


@pytest.fixture(scope="module")
def ops():
    import kernels.norm_ops as norm_ops

    return norm_ops


_SHAPES = [(1, 13, 7, 7), (64, 27, 7, 7), (2, 256, 14, 14), (8, 32, 112, 112), (5, 64, 28, 28), (3, 40, 9, 11)]


def _case(shape, dtype, channels_last, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = (torch.randn(shape, generator=g) * 2 + 0.3).to(dtype)
    grad = torch.randn(shape, generator=g).to(dtype)
    weight, bias = torch.rand(shape[1], generator=g) + 0.5, torch.randn(shape[1], generator=g) * 0.5
    on = [t.to(device) for t in (x, grad, weight, bias)]
    return on[0].contiguous(memory_format=fmt), on[1].contiguous(memory_format=fmt), on[2], on[3]


def _reference(x, grad, weight, bias, y, running=None, factor=0.1):
    """float64 BatchNorm + ReLU of the whole batch; the ReLU's mask from `y` (the op's output), as in test_norm.py.
    `running`: float64 running statistics, updated in place with the averaging factor `factor`."""
    x64 = x.double().requires_grad_()
    w64, b64 = weight.double().requires_grad_(), bias.double().requires_grad_()
    rm, rv = running if running is not None else (None, None)
    normalized = F.batch_norm(x64, rm, rv, w64, b64, training=True, momentum=factor, eps=_EPS)
    normalized.backward(grad.double() * (y > 0).to(x64.device))
    return F.relu(normalized).detach(), x64.grad, w64.grad, b64.grad


def _split_ops_poisoned(ops, x, grad, weight, bias):
    """The four split ops as one rank of a world of one runs them, after the same ops ran on NaN data: the
    caching allocator hands the NaN-filled blocks back, so an element the kernels do not write stays NaN."""
    def run(x, grad):
        mean64, var64 = ops.local_batch_stats(x)
        mean, invstd = mean64.float(), (var64 + _EPS).rsqrt().float()
        y = ops.batch_norm_relu_normalize(x, weight, bias, mean, invstd)
        sums = ops.batch_norm_relu_grad_sums(grad, x, weight, bias, mean, invstd)
        count = x.numel() // x.shape[1]
        gx = ops.batch_norm_relu_input_grad(grad, x, weight, bias, mean, invstd, (sums / count).float())
        return mean64, var64, y, sums, gx

    run(torch.full_like(x, float("nan")), torch.full_like(grad, float("nan")))
    return run(x, grad)


@gpu
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_split_ops_against_float64(ops, shape, dtype, channels_last):
    x, grad, weight, bias = _case(shape, dtype, channels_last)
    mean64, var64, y, sums, gx = _split_ops_poisoned(ops, x, grad, weight, bias)
    for name, t in dict(mean=mean64, var=var64, y=y, sums=sums, gx=gx).items():
        assert torch.isfinite(t).all(), f"{name} has NaN/inf: an element was not written"
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert y.dtype == gx.dtype == dtype and y.is_contiguous(memory_format=fmt) and gx.is_contiguous(memory_format=fmt)
    assert mean64.dtype == var64.dtype == sums.dtype == torch.float64 and sums.shape == (2, shape[1])
    x64 = x.double()
    assert _rel_err(mean64, x64.mean((0, 2, 3))) < 1e-5  # fp32 partial sums, as the fused forward's
    assert _rel_err(var64, x64.var((0, 2, 3), unbiased=False)) < 1e-5
    ry, rgx, rgw, rgb = _reference(x, grad, weight, bias, y)
    assert _rel_err(y, ry) < _TOL[dtype] and _rel_err(gx, rgx) < _TOL[dtype]
    invstd = (var64 + _EPS).rsqrt().float().double()
    assert _rel_err(sums[1] * invstd, rgw) < 1e-5 and _rel_err(sums[0], rgb) < 1e-5


@gpu
@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_split_ops_given_the_fused_statistics_reproduce_the_fused_ops(ops, dtype, channels_last):
    """normalize is the fused forward's apply pass, and the gradient sums its backward's reduce: given the fused
    forward's statistics they give its y bit for bit, and its weight and bias gradients (the same chunked sums)."""
    x, grad, weight, bias = _case((16, 96, 14, 14), dtype, channels_last)
    y, mean, invstd, _var = torch.ops.mobilenet_bn.bn_relu_fwd.default(x, weight, bias, _EPS)
    _gx, gw, gb = torch.ops.mobilenet_bn.bn_relu_bwd.default(grad, x, weight, bias, mean, invstd)
    assert torch.equal(ops.batch_norm_relu_normalize(x, weight, bias, mean, invstd), y)
    sums = ops.batch_norm_relu_grad_sums(grad, x, weight, bias, mean, invstd)
    assert torch.equal((sums[1] * invstd.double()).float(), gw) and torch.equal(sums[0].float(), gb)


@gpu
def test_split_ops_refuse_bad_input_with_value_errors(ops):
    x, grad, weight, bias = _case((2, 8, 4, 4), torch.float32, True)
    with pytest.raises(ValueError, match="mean must be a \\(8,\\) tensor"):
        ops.batch_norm_relu_normalize(x, weight, bias, weight[:4], weight)
    with pytest.raises(ValueError, match="grad_y must have the input's shape"):
        ops.batch_norm_relu_grad_sums(grad[:1], x, weight, bias, weight, weight)
    with pytest.raises(ValueError, match="grad_means must be a \\(2, 8\\) tensor"):
        ops.batch_norm_relu_input_grad(grad, x, weight, bias, weight, weight, weight)
    with pytest.raises(ValueError, match="4-D"):
        ops.local_batch_stats(x[0])


@gpu
def test_split_ops_opcheck(ops):
    x, grad, weight, bias = _case((4, 12, 6, 6), torch.float16, True)
    mean, invstd = torch.randn(12, device="cuda"), torch.rand(12, device="cuda") + 0.5
    means = torch.randn(2, 12, device="cuda")
    bn = torch.ops.mobilenet_bn
    torch.library.opcheck(bn.bn_local_stats.default, (x,))
    torch.library.opcheck(bn.bn_relu_normalize.default, (x, weight, bias, mean, invstd))
    torch.library.opcheck(bn.bn_relu_grad_sums.default, (grad, x, weight, bias, mean, invstd))
    torch.library.opcheck(bn.bn_relu_input_grad.default, (grad, x, weight, bias, mean, invstd, means))
    stats = [torch.zeros(12, device="cuda"), torch.ones(12, device="cuda"), torch.zeros((), device="cuda",
                                                                                         dtype=torch.long)]
    torch.library.opcheck(bn.bn_update_running_stats_unbiased.default, (*stats, mean, invstd, 0.1))


# ---------------------------------------------------------------------------------------------- GPU: the module


@dataclass(frozen=True)
class Case:
    shape: tuple  # the whole batch (N, C, H, W), split over the ranks by batch size
    sizes: tuple  # images per rank
    dtype: torch.dtype
    channels_last: bool
    momentum: float | None = 0.1

    @property
    def id(self) -> str:
        return (f"{'x'.join(map(str, self.shape))}-{'+'.join(map(str, self.sizes))}-{str(self.dtype).split('.')[-1]}-"
                f"{'nhwc' if self.channels_last else 'nchw'}-m{self.momentum}")


_STEPS = 2  # the second step sees running statistics the first updated


def _cases(world: int) -> list[Case]:
    splits = {1: [((6, 20, 9, 9), (6,))], 2: [((8, 20, 9, 9), (4, 4)), ((6, 64, 14, 14), (1, 5))]}[world]
    return [Case(shape, sizes, dtype, cl, momentum) for shape, sizes in splits for dtype in _DTYPES
            for cl in (True, False) for momentum in ((0.1, None) if world == 1 else (0.1,))]


def _batch(case: Case, step: int, rank: int | None, device) -> tuple:
    """Step `step`'s whole batch (rank None) or rank `rank`'s share of it, made the same way in every process."""
    x, grad, weight, bias = _case(case.shape, case.dtype, case.channels_last, seed=step, device="cpu")
    weight, bias = _case(case.shape, torch.float32, False, seed=99, device="cpu")[2:]  # one module: fixed params
    if rank is not None:
        lo = sum(case.sizes[:rank])
        x, grad = x[lo:lo + case.sizes[rank]], grad[lo:lo + case.sizes[rank]]
    fmt = torch.channels_last if case.channels_last else torch.contiguous_format
    return (x.to(device).contiguous(memory_format=fmt), grad.to(device).contiguous(memory_format=fmt),
            weight.to(device), bias.to(device))


def _train_steps(module, case: Case, rank: int | None, device) -> dict:
    """_STEPS forward/backward steps of `module` on its share of each batch: outputs, gradients, statistics."""
    steps = []
    for step in range(_STEPS):
        x, grad, weight, bias = _batch(case, step, rank, device)
        with torch.no_grad():
            module.weight.copy_(weight), module.bias.copy_(bias)
        module.weight.grad = module.bias.grad = None
        x.requires_grad_()
        y = module(x)
        y.backward(grad)
        fmt = torch.channels_last if case.channels_last else torch.contiguous_format
        assert y.is_contiguous(memory_format=fmt) and y.dtype == case.dtype
        steps.append({k: t.detach().cpu() for k, t in
                      dict(y=y, gx=x.grad, gw=module.weight.grad, gb=module.bias.grad).items()})
    return dict(steps=steps, running_mean=module.running_mean.cpu(), running_var=module.running_var.cpu(),
                batches=module.num_batches_tracked.cpu())


def _rank_worker(rank: int, world: int, backend: str, init: str, out_dir: str) -> None:
    device = torch.device("cuda", rank if backend == "nccl" else 0)
    torch.cuda.set_device(device)
    _init(rank, world, backend, init)
    try:
        results = {}
        for case in _cases(world):
            module = SyncCustomBatchNormReLU(case.shape[1], momentum=case.momentum).to(device)
            results[case.id] = _train_steps(module, case, rank, device)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run_ranks(tmp_path: Path, world: int, backend: str) -> list[dict]:
    import kernels

    kernels.load()  # built once here, not by each rank at the same time
    mp.spawn(_rank_worker, args=(world, backend, f"tcp://127.0.0.1:{_free_port()}", str(tmp_path)), nprocs=world)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _check_against_the_whole_batch(case: Case, ranks: list[dict]) -> None:
    """Each rank's share of y and grad_x equals a float64 BatchNorm+ReLU of the whole batch; the ranks' weight and
    bias gradients sum to its (each rank's are its own share, which DDP averages); every rank's running statistics
    equal its."""
    tol = _TOL[case.dtype]
    c = case.shape[1]
    running = (torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64))
    for step in range(_STEPS):
        x, grad, weight, bias = _batch(case, step, None, "cpu")
        got = {k: [r["steps"][step][k] for r in ranks] for k in ("y", "gx", "gw", "gb")}
        y = torch.cat(got["y"])
        factor = 1 / (step + 1) if case.momentum is None else case.momentum  # momentum=None: the cumulative average
        ry, rgx, rgw, rgb = _reference(x, grad, weight, bias, y, running, factor)
        assert _rel_err(y, ry) < tol, step
        assert _rel_err(torch.cat(got["gx"]), rgx) < tol, step
        assert _rel_err(sum(g.double() for g in got["gw"]), rgw) < 1e-5, step
        assert _rel_err(sum(g.double() for g in got["gb"]), rgb) < 1e-5, step
    for r in ranks:
        torch.testing.assert_close(r["running_mean"].double(), running[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["running_var"].double(), running[1], rtol=1e-5, atol=1e-6)
        assert int(r["batches"]) == _STEPS
    for r in ranks[1:]:  # the same bits on every rank: the combine is deterministic
        assert torch.equal(r["running_mean"], ranks[0]["running_mean"])
        assert torch.equal(r["running_var"], ranks[0]["running_var"])


@pytest.fixture(scope="module")
def two_ranks_one_gpu(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _run_ranks(tmp_path_factory.mktemp("gloo2"), 2, "gloo")


@pytest.fixture(scope="module")
def two_ranks_two_gpus(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
    return _run_ranks(tmp_path_factory.mktemp("nccl2"), 2, "nccl")


@gpu
@pytest.mark.parametrize("case", _cases(2), ids=lambda c: c.id)
def test_two_gloo_ranks_on_one_gpu_equal_the_whole_batch_in_float64(two_ranks_one_gpu, case):
    _check_against_the_whole_batch(case, [r[case.id] for r in two_ranks_one_gpu])


@gpu
@pytest.mark.parametrize("case", _cases(2), ids=lambda c: c.id)
def test_two_nccl_ranks_on_two_gpus_equal_the_whole_batch_in_float64(two_ranks_two_gpus, case):
    _check_against_the_whole_batch(case, [r[case.id] for r in two_ranks_two_gpus])


@pytest.fixture
def world_of_one(tmp_path):
    """A process group of this process alone (gloo, CUDA tensors), torn down afterwards."""
    _init(0, 1, "gloo", f"file://{tmp_path / 'store'}")
    try:
        yield
    finally:
        dist.destroy_process_group()


@gpu
@pytest.mark.parametrize("case", _cases(1), ids=lambda c: c.id)
def test_a_world_of_one_computes_what_the_unsynchronised_module_does(ops, world_of_one, case):
    device = torch.device("cuda")
    sync = _train_steps(SyncCustomBatchNormReLU(case.shape[1], momentum=case.momentum).to(device), case, 0, device)
    plain = _train_steps(CustomBatchNormReLU(case.shape[1], momentum=case.momentum).to(device), case, 0, device)
    tol = _TOL[case.dtype]
    for step in range(_STEPS):
        for k in ("y", "gx"):
            assert _rel_err(sync["steps"][step][k], plain["steps"][step][k]) < tol, (step, k)
        for k in ("gw", "gb"):
            assert _rel_err(sync["steps"][step][k], plain["steps"][step][k]) < 1e-5, (step, k)
    for k in ("running_mean", "running_var"):
        torch.testing.assert_close(sync[k], plain[k], rtol=1e-6, atol=1e-7)
    assert torch.equal(sync["batches"], plain["batches"])
    _check_against_the_whole_batch(case, [sync])


@gpu
def test_a_single_process_sync_bn_run_with_norm_custom_is_refused(run_dir):
    from mobilenet.config import compose
    from mobilenet.engine import Trainer

    with pytest.raises(ValueError, match="sync_bn=true needs a process group.*torchrun"):
        Trainer(compose(["device=cuda", "norm=custom", "sync_bn=true", "data=synthetic", "progress=false"]), run_dir)


@gpu
def test_torchrun_on_two_gpus_trains_with_the_synchronised_fused_norm(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "train.py",
           "device=cuda", "norm=custom", "backend=custom", "sync_bn=true", "amp=true", "channels_last=true",
           "data=synthetic", "data.steps_per_epoch=16", "data.batch_size=32", "data.resolution=64",
           "data.num_classes=100", "epochs=1", "evaluate=false", "save_checkpoints=false", "progress=false",
           "perf.warmup_steps=2", f"log_root={tmp_path}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0", "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    # COLUMNS: the summary table's rows on one line each, as the assertions read them.
    assert "on (SyncCustomBatchNormReLU; statistics over 2 ranks)" in out.stdout, out.stdout[-3000:]
    assert "DDP's gradient all-reduce captured with the step" in out.stdout, out.stdout[-3000:]
