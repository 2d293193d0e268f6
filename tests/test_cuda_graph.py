"""cuda_graph=false|true|auto: which runs capture their training step, the learning rate a captured step sees, and
(on the GPU) that a captured run trains like an eager one."""

import copy

import pytest
import torch
from torch import nn

from mobilenet import cuda_graph, streams
from mobilenet.config import compose
from mobilenet.engine import Trainer, build_optimizer, warmup_cosine

CUDA = torch.device("cuda")  # a device name only: resolve() is a pure function of the config and the device kind
CPU_FAST = ["model.width_mult=0.25", "device=cpu", "progress=false", "perf.warmup_steps=1", "data=synthetic",
            "data.steps_per_epoch=3", "data.batch_size=4", "data.resolution=32", "data.num_classes=5", "evaluate=false"]


def test_hydra_spellings_of_the_mode_are_accepted_and_others_refused(run_dir):
    for spelling, mode in (("true", "true"), ("false", "false"), ("auto", "auto"), ("True", "true")):
        assert cuda_graph.parse_mode(compose([f"cuda_graph={spelling}"]).cuda_graph) == mode
    with pytest.raises(ValueError, match=r"cuda_graph='yes' is not a choice; choose one of: auto, true, false"):
        Trainer(compose([*CPU_FAST, "cuda_graph=yes"]), run_dir)


def test_a_capturable_gpu_run_is_captured_under_auto_the_default_and_true_and_not_under_false():
    for overrides, mode in (([], "auto"), (["cuda_graph=auto"], "auto"), (["cuda_graph=true"], "true")):
        on, why = cuda_graph.resolve(compose(overrides), CUDA, distributed=False)
        assert on and why == f"on (cuda_graph={mode})"
    assert cuda_graph.resolve(compose(["cuda_graph=false"]), CUDA, distributed=False) == (False, "off (cuda_graph=false)")


def test_auto_captures_dali_runs_only_with_32_work_queues_and_true_captures_them_anyway(monkeypatch):
    # The queue count this process would give its CUDA context (streams.apply_max_connections sets it in a real run).
    monkeypatch.setattr(streams, "_in_force", None)
    monkeypatch.delenv(streams.CONNECTIONS_ENV, raising=False)
    on, why = cuda_graph.resolve(compose(["data=dali", "cuda_graph=auto"]), CUDA, distributed=False)
    assert not on and "data=dali with 8 CUDA hardware work queues" in why and "9.6k img/s captured" in why
    assert cuda_graph.resolve(compose(["data=dali", "cuda_graph=true"]), CUDA, distributed=False) == (True, "on (cuda_graph=true)")
    monkeypatch.setenv(streams.CONNECTIONS_ENV, "32")
    assert cuda_graph.resolve(compose(["data=dali", "cuda_graph=auto"]), CUDA, distributed=False) == (True, "on (cuda_graph=auto)")


def test_a_distributed_run_is_captured_with_its_gradient_all_reduce():
    assert cuda_graph.resolve(compose(["cuda_graph=auto"]), CUDA, distributed=True) == (
        True, "on (cuda_graph=auto; DDP's gradient all-reduce captured with the step)")
    assert cuda_graph.resolve(compose(["cuda_graph=false"]), CUDA, distributed=True) == (False, "off (cuda_graph=false)")


@pytest.mark.parametrize("overrides, device, distributed, reason", [
    ([], torch.device("cpu"), False, "device is cpu"),
    (["compile=true"], CUDA, False, "compile=true"),
    (["profile=true"], CUDA, False, "profile=true"),
    (["optim.impl=foreach"], CUDA, False, "optim=sgd with optim.impl=foreach"),
    (["optim=rmsprop", "optim.impl=foreach"], CUDA, False, "optim=rmsprop"),
])
def test_what_cannot_be_captured_is_said_under_auto_and_refused_under_true(overrides, device, distributed, reason):
    on, why = cuda_graph.resolve(compose([*overrides, "cuda_graph=auto"]), device, distributed)
    assert not on and why.startswith("off (cuda_graph=auto: ") and reason in why
    with pytest.raises(ValueError, match="cuda_graph=true, but this run's training step cannot be captured: .*" + reason):
        cuda_graph.resolve(compose([*overrides, "cuda_graph=true"]), device, distributed)


def test_a_profiled_run_knows_whether_its_unprofiled_step_is_captured():
    """profile=true traces eager steps; what the run does without it decides the profile's launch findings."""
    assert not cuda_graph.resolve(compose(["profile=true"]), CUDA, distributed=False)[0]

    def unprofiled(overrides, device=CUDA):
        return cuda_graph.resolve(compose(["profile=true", *overrides]), device, distributed=False, profiling=False)[0]

    assert unprofiled([])
    assert unprofiled(["cuda_graph=true"])
    for overrides, device in ((["cuda_graph=false"], CUDA), (["compile=true"], CUDA), ([], torch.device("cpu")),
                              (["optim.impl=foreach"], CUDA)):
        assert not unprofiled(overrides, device), overrides


def test_a_training_profile_records_how_the_run_launches_without_the_profiler(run_dir):
    from mobilenet.engine import profile_training

    t = Trainer(compose([*CPU_FAST, "profile=true", "profiler.skip_first=0", "profiler.warmup=1", "profiler.active=2",
                         "profiler.baseline_steps=2"]), run_dir)
    profile_training(t)
    report = (run_dir / "profile_report.md").read_text()
    assert "| launches without the profiler | eager, launched one by one |" in report  # a CPU run is not captured


def test_cpu_run_states_its_graph_mode_in_the_summary_and_hparams(run_dir):
    t = Trainer(compose([*CPU_FAST, "epochs=1", "cuda_graph=auto"]), run_dir)
    result = t.fit()
    assert t.graphed is None
    assert t.summary_rows(result)["CUDA graph"] == "off (cuda_graph=auto: the run's device is cpu (CUDA graphs need a GPU))"
    with pytest.raises(ValueError, match="device is cpu"):
        Trainer(compose([*CPU_FAST, "cuda_graph=true"]), run_dir)


def _sgd_with_schedule(lr_on_device: bool):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    cfg = compose(["optim.impl=fused", "optim.lr=0.4"])
    opt = build_optimizer(cfg, model, 256)
    if lr_on_device:
        cuda_graph.lr_to_device(opt, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(10, 3, 0.0))
    return model, opt, sched


def test_a_device_held_lr_follows_the_schedule_in_place_and_trains_like_a_float_lr():
    """What the captured optimizer step relies on: the scheduler fills the same lr tensor every step."""
    (m_f, o_f, s_f), (m_t, o_t, s_t) = _sgd_with_schedule(False), _sgd_with_schedule(True)
    lr_tensors = [g["lr"] for g in o_t.param_groups]
    assert all(isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 for lr in lr_tensors)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    for _ in range(10):
        for m, o, s in ((m_f, o_f, s_f), (m_t, o_t, s_t)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            s.step()
        assert all(g["lr"] is lr for g, lr in zip(o_t.param_groups, lr_tensors))
        assert float(o_t.param_groups[0]["lr"]) == pytest.approx(o_f.param_groups[0]["lr"], rel=1e-6)
    assert o_f.param_groups[0]["lr"] == 0.0  # the cosine reached its end: the schedule really moved
    for a, b in zip(m_f.parameters(), m_t.parameters()):
        torch.testing.assert_close(a, b)


def test_checkpoints_hold_host_learning_rates(tmp_path):
    _, opt, _ = _sgd_with_schedule(True)
    state = cuda_graph.host_lrs(opt.state_dict())
    assert all(type(g["lr"]) is float and type(g["initial_lr"]) is float for g in state["param_groups"])
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # the live optimizer keeps its device tensor
    torch.save({"optimizer": state}, tmp_path / "o.pt")
    eager = _sgd_with_schedule(False)[1]
    eager.load_state_dict(torch.load(tmp_path / "o.pt")["optimizer"])
    assert type(eager.param_groups[0]["lr"]) is float


# --- on the GPU ------------------------------------------------------------------------------------------------

GPU_RUN = ["device=cuda", "progress=false", "data=synthetic", "data.steps_per_epoch=12", "data.num_classes=100",
           "data.batch_size=32", "data.resolution=64", "evaluate=false", "save_checkpoints=false", "epochs=1",
           "perf.warmup_steps=2", "perf.log_every=1", "optim.warmup_epochs=0.5"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend, amp, norm", [("cudnn", "amp=true", "torch"), ("custom", "amp=true", "torch"),
                                                ("custom", "amp=false", "torch"), ("cudnn", "amp=false", "torch"),
                                                ("custom", "amp=true", "custom"), ("custom", "amp=false", "custom")])
def test_a_replayed_step_does_what_an_eager_step_does_from_the_same_state(tmp_path, deterministic_cudnn, backend, amp,
                                                                         norm):
    """Step by step, not run against run: this training is chaotic (on the CPU a 1e-6 nudge of the initial weights
    grows to 0.3 in the stem's weights within 12 fp32 steps, docs/results/cuda_graph_h200.md), so two whole runs
    differ by far more than any one step does."""
    common = [*GPU_RUN, f"backend={backend}", f"norm={norm}", amp, "channels_last=true"]
    graphed = Trainer(compose([*common, "cuda_graph=true"]), tmp_path / "graph")
    eager = Trainer(compose([*common, "cuda_graph=false"]), tmp_path / "eager")
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True  # Trainer() turns benchmark on
    images, labels = next(iter(graphed.train_loader))
    graphed.model.train(), eager.model.train()
    for _ in range(5):  # 3 eager steps, the capture, 1 replay
        graphed.train_step(images, labels)
    assert graphed.graphed.graph is not None and graphed.graphed.eager_steps == 3
    # The eager twin starts from the captured run's state (copies: nothing is shared with the graph's tensors).
    eager.model.load_state_dict(graphed.model.state_dict())
    eager.optimizer.load_state_dict(copy.deepcopy(cuda_graph.host_lrs(graphed.optimizer.state_dict())))
    eager.scheduler.load_state_dict(copy.deepcopy(graphed.scheduler.state_dict()))
    eager.scaler.load_state_dict(graphed.scaler.state_dict())
    for _ in range(2):
        loss_g, loss_e = graphed.train_step(images, labels).item(), eager.train_step(images, labels).item()
        assert loss_g == pytest.approx(loss_e, rel=1e-4, abs=1e-5)
        assert graphed.current_lr() == pytest.approx(eager.current_lr())
        for (name, g), e in zip(graphed.model.named_parameters(), eager.model.parameters()):
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")
        for (name, g), e in zip(graphed.model.named_buffers(), eager.model.buffers()):  # BatchNorm statistics
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
def test_a_captured_fit_logs_every_step_and_learns(tmp_path):
    t = Trainer(compose([*GPU_RUN, "backend=custom", "amp=true", "channels_last=true", "cuda_graph=true"]), tmp_path)
    result = t.fit()
    losses = [v for _, v in result.losses]
    assert [s for s, _ in result.losses] == list(range(1, 13)) and losses[-1] < losses[0]
    assert result.train.steps == 12 - 4  # perf.warmup_steps=2, raised to the 3 eager steps and the capture
    assert t.summary_rows(result)["CUDA graph"] == "on (cuda_graph=true)"


@pytest.mark.gpu
def test_released_captured_steps_free_their_graphs_and_refuse_further_steps(tmp_path):
    t = Trainer(compose([*GPU_RUN, "backend=torch", "cuda_graph=true"]), tmp_path)
    images, labels = next(iter(t.train_loader))
    for _ in range(4):  # 3 eager steps, then the capture
        t.train_step(images, labels)
    assert t.graphed.graph is not None
    cuda_graph.release_captured_steps()  # what distributed.shutdown() does before destroying the process group
    assert t.graphed.graph is None and t.graphed.released
    with pytest.raises(RuntimeError, match="was released"):
        t.train_step(images, labels)


@pytest.mark.gpu
def test_the_captured_optimizer_step_uses_the_scheduled_lr_and_refuses_other_batch_shapes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4)).cuda()
    opt = build_optimizer(compose(["optim.impl=fused", "optim.lr=0.5"]), model, 256)
    factors = [1.0] * 5 + [0.0] * 5  # the lr drops to zero after five steps, i.e. two steps after the capture
    step = cuda_graph.CapturedStep(
        lambda x, y: _loss_step(model, opt, x, y), opt, torch.device("cuda"), warmup_steps=3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: factors[min(i, 9)])
    x, y = torch.randn(16, 3, 8, 8, device="cuda"), torch.randint(0, 4, (16,), device="cuda")
    snapshots = []
    for _ in range(8):
        step(x + torch.randn_like(x), y)
        sched.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    assert step.graph is not None
    assert not torch.equal(snapshots[3][0], snapshots[4][0])  # a replayed step with lr 0.5 moves the weights
    for later in snapshots[5:]:  # replays with lr 0 leave them alone
        for a, b in zip(snapshots[4], later):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"captured for images of shape \(16, 3, 8, 8\).*got \(8, 3, 8, 8\)"):
        step(x[:8], y[:8])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("stride", [1, 2])
def test_the_custom_op_replayed_from_a_graph_matches_eager_calls_bit_for_bit(dtype, channels_last, stride):
    """The custom kernels are capture-safe: forward, input and weight gradient captured once, replayed on fresh
    inputs (outputs poisoned before each replay), equal to eager calls on the same inputs."""
    from kernels import ops

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(32, 64, 28, 28, device="cuda", dtype=dtype).contiguous(memory_format=fmt).requires_grad_()
    w = torch.randn(64, 1, 3, 3, device="cuda", dtype=dtype, requires_grad=True)
    go = torch.randn(32, 64, 28 // stride, 28 // stride, device="cuda", dtype=dtype).contiguous(memory_format=fmt)

    def fwd_bwd():
        y = ops.depthwise_conv2d(x, w, None, stride, 1)
        return (y, *torch.autograd.grad(y, (x, w), grad_outputs=go))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fwd_bwd()  # lazy set-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fwd_bwd()
    for _ in range(3):
        with torch.no_grad():
            for t in (x, w, go):
                t.copy_(torch.randn_like(t))
            for t in captured:
                t.fill_(float("nan"))
        graph.replay()
        for name, got, want in zip(("output", "input gradient", "weight gradient"), captured, fwd_bwd()):
            assert torch.equal(got, want), name


def _loss_step(model, opt, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss
