"""perf.stream=auto|default|dedicated: which CUDA stream a run issues its work on, and (on the GPU) that a dedicated
stream is ordered against the default one and trains like it. perf.max_connections: the CUDA hardware work queues,
set in the environment before the CUDA context exists."""

import json
import os
import subprocess
import sys

import pytest
import torch

from mobilenet import streams
from mobilenet.config import compose
from mobilenet.engine import Trainer

CPU = torch.device("cpu")
CPU_FAST = ["model.width_mult=0.25", "device=cpu", "progress=false", "perf.warmup_steps=1", "data=synthetic",
            "data.steps_per_epoch=2", "data.batch_size=4", "data.resolution=32", "data.num_classes=5", "evaluate=false",
            "save_checkpoints=false", "epochs=1"]


def test_a_cpu_run_has_no_stream_and_refuses_a_dedicated_one(run_dir):
    for mode in ("auto", "default"):
        assert streams.resolve(compose([f"perf.stream={mode}", "data=dali"]), CPU) == (None, "none (cpu)")
    with pytest.raises(ValueError, match="perf.stream=dedicated issues the run's work on a CUDA stream, but this run's "
                                         "device is cpu; use perf.stream=auto or perf.stream=default"):
        Trainer(compose([*CPU_FAST, "perf.stream=dedicated"]), run_dir)
    t = Trainer(compose(CPU_FAST), run_dir)
    assert t.stream is None and t.summary_rows(t.fit())["CUDA stream"] == "none (cpu)"
    assert streams.hparams(t.stream, CPU) == {"stream": "none", "stream_priority": "none"}


def test_high_priority_is_refused_where_there_is_no_dedicated_stream_to_give_it():
    with pytest.raises(ValueError, match="perf.stream_priority=high sets a CUDA stream's priority, but this run's "
                                         "device is cpu; use perf.stream_priority=normal"):
        streams.resolve(compose(["perf.stream_priority=high", "data=dali"]), CPU)
    with pytest.raises(Exception) as err:
        compose(["perf.stream_priority=urgent"])
    assert "expected one of [auto, normal, high]" in str(err.value) + str(err.value.__cause__)


def test_an_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(Exception) as err:
        compose(["perf.stream=side"])
    text = str(err.value) + str(err.value.__cause__)  # Hydra names the override, OmegaConf the key and choices
    assert "perf.stream=side" in text and "expected one of [auto, default, dedicated]" in text


# A fresh interpreter: CUDA_DEVICE_MAX_CONNECTIONS only counts before the process creates its CUDA context, and each
# scenario below runs in the order a user's runs would, in one process.
MAX_CONNECTIONS_SCENARIOS = r"""
import json, os
from mobilenet import streams
from mobilenet.config import compose
out = []
for overrides in (["data=dali"], ["data=synthetic"], ["data=synthetic", "perf.max_connections=16"],
                  ["data=dali", "device=cpu"], ["data=synthetic"]):
    state = streams.apply_max_connections(compose(overrides))
    out.append([state, os.environ.get(streams.CONNECTIONS_ENV), streams.connections_in_force()])
print(json.dumps(out))
"""


def _max_connections_scenarios(env_value: str | None) -> list:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    if env_value is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = env_value
    done = subprocess.run([sys.executable, "-c", MAX_CONNECTIONS_SCENARIOS], env=env, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_max_connections_auto_gives_dali_32_queues_and_leaves_other_runs_at_cuda_default():
    assert _max_connections_scenarios(None) == [
        ["32 (perf.max_connections=auto for data=dali)", "32", 32],
        ["8 (CUDA's default, perf.max_connections=auto)", None, 8],  # the 32 written for DALI is taken back
        ["16 (perf.max_connections=16)", "16", 16],
        ["none (cpu)", "16", 16],  # a CPU run leaves the environment alone
        ["8 (CUDA's default, perf.max_connections=auto)", None, 8],  # auto again: the explicit 16 is taken back
    ]


def test_max_connections_auto_keeps_the_environments_setting_and_an_explicit_value_replaces_it():
    assert _max_connections_scenarios("4") == [
        ["4 (CUDA_DEVICE_MAX_CONNECTIONS=4 in the environment, perf.max_connections=auto)", "4", 4],
        ["4 (CUDA_DEVICE_MAX_CONNECTIONS=4 in the environment, perf.max_connections=auto)", "4", 4],
        ["16 (perf.max_connections=16)", "16", 16],
        ["none (cpu)", "16", 16],
        ["4 (CUDA_DEVICE_MAX_CONNECTIONS=4 in the environment, perf.max_connections=auto)", "4", 4],  # the user's again
    ]


def test_an_environment_value_cuda_cannot_take_is_refused():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    done = subprocess.run([sys.executable, "-c", "from mobilenet import streams; from mobilenet.config import compose; "
                           "streams.apply_max_connections(compose(['data=dali']))"],
                          env={**env, "CUDA_DEVICE_MAX_CONNECTIONS": "64"}, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode != 0
    assert ("the environment sets CUDA_DEVICE_MAX_CONNECTIONS='64'; CUDA takes a whole number of queues from 1 to 32"
            in done.stderr)


@pytest.mark.parametrize("value", ["0", "33", "many", "-1", "1.5"])
def test_a_bad_max_connections_is_refused_with_the_allowed_range(run_dir, value):
    with pytest.raises(ValueError, match=r"perf.max_connections='?" + value.replace(".", r"\.")
                       + r"'? is not a choice: use auto or a whole number of hardware work queues from 1 to 32"):
        Trainer(compose([*CPU_FAST, f"perf.max_connections={value}"]), run_dir)


def test_a_cpu_run_reports_no_work_queues(run_dir):
    t = Trainer(compose([*CPU_FAST, "data=synthetic"]), run_dir)
    assert t.summary_rows(t.fit())["CUDA work queues"] == "none (cpu)"


# --- on the GPU ------------------------------------------------------------------------------------------------

CUDA = torch.device("cuda")
GPU_RUN = ["device=cuda", "progress=false", "data=synthetic", "data.steps_per_epoch=6", "data.num_classes=100",
           "data.batch_size=32", "data.resolution=64", "evaluate=false", "save_checkpoints=false", "epochs=1",
           "perf.warmup_steps=2", "perf.log_every=1", "backend=custom", "amp=true", "channels_last=true",
           "cuda_graph=false"]  # eager steps: the forward hooks below see every step's stream


@pytest.mark.gpu
def test_auto_gives_dali_runs_a_dedicated_stream_and_others_the_default():
    stream, why = streams.resolve(compose(["data=dali"]), CUDA)
    assert isinstance(stream, torch.cuda.Stream) and why == "dedicated, high priority (perf.stream=auto for data=dali)"
    assert stream != torch.cuda.default_stream()
    assert streams.resolve(compose(["data=synthetic"]), CUDA) == (None, "default (perf.stream=auto)")
    assert streams.resolve(compose(["data=dali", "perf.stream=default"]), CUDA) == (None, "default (perf.stream=default)")
    stream, why = streams.resolve(compose(["data=synthetic", "perf.stream=dedicated"]), CUDA)
    assert stream is not None and why == "dedicated (perf.stream=dedicated)"


@pytest.mark.gpu
def test_high_priority_goes_to_the_dedicated_stream_only():
    normal, why = streams.resolve(compose(["data=dali", "perf.stream_priority=normal"]), CUDA)
    assert why == "dedicated (perf.stream=auto for data=dali)"
    high, why = streams.resolve(compose(["data=synthetic", "perf.stream=dedicated", "perf.stream_priority=high"]), CUDA)
    assert why == "dedicated, high priority (perf.stream=dedicated)"
    assert high.priority < normal.priority == 0  # CUDA: lower numbers run first; 0 is the default and the lowest
    # auto: high for data=dali only
    assert streams.resolve(compose(["data=dali"]), CUDA)[0].priority == high.priority
    assert streams.resolve(compose(["data=synthetic", "perf.stream=dedicated"]), CUDA)[0].priority == 0
    # HParams record the stream that was used
    assert streams.hparams(high, CUDA) == {"stream": "dedicated", "stream_priority": "high"}
    assert streams.hparams(normal, CUDA) == {"stream": "dedicated", "stream_priority": "normal"}
    assert streams.hparams(None, CUDA) == {"stream": "default", "stream_priority": "normal"}
    with pytest.raises(ValueError, match=r"but this run uses the default stream \(perf.stream=auto, data=synthetic\), "
                                         r"whose priority is fixed; add perf.stream=dedicated"):
        streams.resolve(compose(["data=synthetic", "perf.stream_priority=high"]), CUDA)


@pytest.mark.gpu
def test_work_crossing_into_and_out_of_a_dedicated_stream_is_ordered():
    default = torch.cuda.current_stream()
    x = torch.zeros(1 << 20, device=CUDA)
    torch.cuda._sleep(100_000_000)  # the fill below lands long after the other stream could have read x
    x.fill_(1.0)
    stream = torch.cuda.Stream()
    with streams.issued_on(stream):
        assert torch.cuda.current_stream() == stream
        y = x * 2  # must see the fill queued on the default stream
        torch.cuda._sleep(100_000_000)
        y.add_(1.0)
    assert torch.cuda.current_stream() == default
    z = y.clone()  # back on the default stream: must see the add
    assert torch.equal(z, torch.full_like(z, 3.0))


@pytest.mark.gpu
def test_a_dedicated_stream_run_issues_its_steps_there_and_trains_like_the_default_stream(tmp_path):
    runs = {}
    for mode in ("dedicated", "default"):
        t = Trainer(compose([*GPU_RUN, f"perf.stream={mode}"]), tmp_path / mode)
        seen = set()
        t.model.register_forward_hook(lambda *_, seen=seen: seen.add(torch.cuda.current_stream().cuda_stream))
        runs[mode] = t, seen, t.fit()
    t, seen, result = runs["dedicated"]
    assert seen == {t.stream.cuda_stream} != {torch.cuda.default_stream().cuda_stream}
    assert t.summary_rows(result)["CUDA stream"] == "dedicated (perf.stream=dedicated)"
    assert runs["default"][1] == {torch.cuda.default_stream().cuda_stream}
    # Same seed and data: the first steps agree (cuDNN autotuning may pick other algorithms, so not bit for bit).
    ded, dft = [v for _, v in result.losses], [v for _, v in runs["default"][2].losses]
    assert len(ded) == len(dft) == 6 and ded[0] == pytest.approx(dft[0], rel=1e-3)
    assert ded[1] == pytest.approx(dft[1], rel=1e-2)


@pytest.mark.gpu
def test_max_connections_that_can_no_longer_take_effect_is_an_error_when_asked_and_a_note_under_auto():
    torch.cuda.init()  # this process's CUDA context now exists with whatever count was in force
    in_force = streams.connections_in_force()
    other = 3 if in_force != 3 else 5
    with pytest.raises(RuntimeError, match=f"{other} hardware work queues \\(perf.max_connections={other}\\) cannot take "
                                           f"effect: this process initialised CUDA earlier with {in_force}"):
        streams.apply_max_connections(compose(["data=synthetic", f"perf.max_connections={other}"]))
    state = streams.apply_max_connections(compose(["data=dali"]))
    assert state.startswith(f"{in_force} (") and (in_force == 32 or "auto wanted 32" in state)
