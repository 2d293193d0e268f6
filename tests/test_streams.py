"""perf.stream=auto|default|dedicated: which CUDA stream a run issues its work on, and (on the GPU) that a dedicated
stream is ordered against the default one and trains like it."""

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


# --- on the GPU ------------------------------------------------------------------------------------------------

CUDA = torch.device("cuda")
GPU_RUN = ["device=cuda", "progress=false", "data=synthetic", "data.steps_per_epoch=6", "data.num_classes=100",
           "data.batch_size=32", "data.resolution=64", "evaluate=false", "save_checkpoints=false", "epochs=1",
           "perf.warmup_steps=2", "perf.log_every=1", "backend=custom", "amp=true", "channels_last=true"]


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
