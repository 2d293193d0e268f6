"""perf.sample_load: the host's CPU time, this process's threads and the GPU's load over a run's timed steps."""

import ctypes
import os
import threading
import time

import pytest
import torch

from mobilenet.config import compose
from mobilenet.engine import Trainer
from mobilenet.errors import ConfigError
from mobilenet.machine_load import (LoadSampler, MachineLoad, parse_cpu_times, parse_task_stat, read_cpu_times,
                                    read_threads, sampling_wanted, thread_group)

FAST = ["model.width_mult=0.25", "device=cpu", "progress=false", "perf.warmup_steps=2", "perf.log_every=5"]
PR_SET_NAME = 15  # prctl(2): names the calling thread as ps, top and /proc show it


def _burn_named(name: bytes, stop: threading.Event, cpus: set[int] | None = None) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name, 0, 0, 0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread
    x = 0
    while not stop.is_set():
        x += 1


def _load_while_burning(name: bytes, seconds: float, cpus: set[int] | None = None):
    """The sampler's readings over `seconds` while a thread called `name` spins (on `cpus` if given)."""
    stop = threading.Event()
    worker = threading.Thread(target=_burn_named, args=(name, stop, cpus))
    worker.start()
    try:
        sampler = LoadSampler(torch.device("cpu"), interval_s=0.05).start()
        time.sleep(seconds)
        return sampler.stop()
    finally:
        stop.set()
        worker.join()


def test_the_cpu_line_counts_guest_time_once_and_steal_apart():
    # user nice system idle iowait irq softirq steal guest guest_nice: guest is already inside user.
    times = parse_cpu_times("cpu  100 5 20 800 7 1 2 30 40 0\ncpu0 50 2 10 400 3 0 1 15 20 0\n")
    assert times.busy == 100 + 5 + 20 + 1 + 2
    assert (times.steal, times.iowait) == (30, 7)
    assert times.total == 128 + 800 + 7 + 30


def test_a_stat_without_the_aggregate_line_is_refused():
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        parse_cpu_times("cpu0 1 2 3 4 5 6 7 8\n")


def test_a_thread_name_with_spaces_and_parentheses_is_read_whole():
    fields = ["S"] + [str(i) for i in range(4, 14)] + ["70", "30"] + ["0"] * 30  # fields 3.. ; utime 70, stime 30
    name, ticks = parse_task_stat(f"4242 (a (b) c) {' '.join(fields)}\n")
    assert name == "a (b) c"
    assert ticks == 100


def test_thread_pools_group_by_name_without_their_numbers():
    assert thread_group("[DALI][TP12]") == thread_group("[DALI][TP3]") == "[DALI][TP#]"
    assert thread_group("python") == "python"


def test_this_machine_and_process_read_back_sane_counters():
    cpu = read_cpu_times()
    assert cpu is not None and 0 <= cpu.busy <= cpu.total and cpu.steal >= 0
    threads = read_threads()
    assert threading.get_native_id() in threads
    assert all(ticks >= 0 for _, ticks in threads.values())


def test_a_busy_named_thread_is_named_as_the_busiest_with_most_of_a_core():
    load = _load_while_burning(b"mbn-burner", 1.0)
    assert load.busiest_thread is not None and load.busiest_thread[0] == "mbn-burner"
    assert load.busiest_thread[1] > 0.4  # a core of this machine's two, shared with the test runner
    assert load.process_cores >= load.busiest_thread[1]
    assert any(name == "mbn-burner" and cpus is None for name, _, _, cpus in load.thread_groups)
    assert 0 < load.cpu_busy_pct <= 100
    rows = load.rows()
    assert "mbn-burner" in rows["busiest thread"]
    assert load.scalars()["sys/busiest_thread_pct"] == pytest.approx(100 * load.busiest_thread[1])
    assert rows["GPU load"] == "not sampled: a CPU run"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two or more CPUs allowed to this process")
def test_a_thread_group_pinned_to_one_cpu_says_on_how_many_it_may_run():
    load = _load_while_burning(b"mbn-pinned", 0.5, {min(os.sched_getaffinity(0))})
    pinned = [g for g in load.thread_groups if g[0] == "mbn-pinned"]
    assert pinned and pinned[0][3] == 1
    assert load.process_cpus == len(os.sched_getaffinity(0))
    assert f"mbn-pinned {pinned[0][2]:.2f} on 1 of {load.process_cpus} CPUs" in load.rows()["this process, cores"]


def test_the_sampler_refuses_to_run_twice_or_stop_unstarted():
    sampler = LoadSampler(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="before start"):
        sampler.stop()
    sampler.start()
    with pytest.raises(RuntimeError, match="twice"):
        sampler.start()
    sampler.stop()
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        LoadSampler(torch.device("cpu"), interval_s=0)


def test_notes_name_steal_a_saturated_thread_busy_jpeg_engines_and_a_held_clock():
    quiet = MachineLoad(seconds=1, cpus=16, cpu_busy_pct=30, cpu_steal_pct=1, cpu_iowait_pct=0, process_cores=2,
                        busiest_thread=("python", 0.5), jpeg_pct=60, clock_reasons=[])
    assert quiet.notes() == []
    loaded = MachineLoad(seconds=1, cpus=16, cpu_busy_pct=90, cpu_steal_pct=12, cpu_iowait_pct=0, process_cores=5,
                         busiest_thread=("[DALI][TP#]", 0.97), jpeg_pct=95, clock_reasons=["power cap"])
    notes = loaded.notes()
    assert len(notes) == 4
    assert "12% of the host's CPU time was stolen" in notes[0]
    assert "'[DALI][TP#]' ran 97% of a core" in notes[1]
    assert "JPEG engines were 95% busy" in notes[2]
    assert "power cap" in notes[3]
    assert loaded.rows()["load note 1"] == notes[0]


@pytest.mark.parametrize("overrides, on, words", [
    (["data=dali"], True, "perf.sample_load=auto: data=dali decodes images"),
    (["data=digits"], True, "perf.sample_load=auto: data=folder decodes images"),
    (["data=synthetic"], False, "perf.sample_load=auto: data=synthetic decodes nothing"),
    (["data=synthetic", "perf.sample_load=true"], True, "perf.sample_load=true"),
    (["data=dali", "perf.sample_load=false"], False, "perf.sample_load=false"),
])
def test_auto_samples_the_loaders_that_decode(overrides, on, words):
    wanted, label = sampling_wanted(compose(overrides))
    assert wanted is on
    assert words in label and label.startswith("sampled" if on else "not sampled")


def test_a_value_that_is_not_a_choice_is_a_clear_error(run_dir):
    with pytest.raises(ConfigError, match=r"perf.sample_load='sometimes' is not a choice; choose one of: auto, true, false"):
        Trainer(compose([*FAST, "epochs=1", "perf.sample_load=sometimes"]), run_dir)


def test_a_run_on_decoded_images_puts_the_machine_load_in_its_summary_and_tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = compose([*FAST, "epochs=1", "data.steps_per_epoch=8", "evaluate=false", "save_checkpoints=false"])
    trainer = Trainer(cfg, run_dir)
    result = trainer.fit()
    load = result.train.machine_load
    assert load is not None and load.seconds > 0
    assert 0 < load.cpu_busy_pct <= 100 and load.process_cores > 0
    rows = trainer.summary_rows(result)
    assert rows["machine load"].startswith("sampled (perf.sample_load=auto")
    assert rows["host CPUs busy / steal / iowait"].endswith(f"of {load.cpus} CPUs")
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    assert {"sys/cpu_busy_pct", "sys/cpu_steal_pct", "sys/process_cores"} <= set(acc.Tags()["scalars"])


def test_a_synthetic_run_is_not_sampled_by_default(run_dir):
    cfg = compose([*FAST, "data=synthetic", "data.resolution=32", "data.batch_size=4", "data.steps_per_epoch=4",
                   "epochs=1", "evaluate=false", "save_checkpoints=false"])
    trainer = Trainer(cfg, run_dir)
    result = trainer.fit()
    assert result.train.machine_load is None
    rows = trainer.summary_rows(result)
    assert rows["machine load"] == "not sampled (perf.sample_load=auto: data=synthetic decodes nothing)"
    assert "host CPUs busy / steal / iowait" not in rows


@pytest.mark.gpu
def test_nvml_sees_the_sms_busy_while_the_gpu_multiplies():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    sampler = LoadSampler(torch.device("cuda"), interval_s=0.1).start()
    end = time.perf_counter() + 2.0
    while time.perf_counter() < end:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    load = sampler.stop()
    assert load.gpu_unavailable is None
    assert load.gpu_samples >= 10
    assert load.sm_pct > 50
    assert load.sm_clock_mhz > 100
    assert load.jpeg_pct is not None and load.jpeg_pct < 5  # nothing decoded JPEGs


def test_the_loader_benchmark_records_the_machine_load_of_its_timed_epochs(digits_root, tmp_path, capsys):
    from scripts_under_test import load_script

    out = tmp_path / "loader.md"
    bench = load_script("bench_loader")
    assert bench.main(["--root", str(digits_root), "--loaders", "folder", "--threads", "1", "--batch-size", "64",
                       "--resolution", "32", "--classes", "10", "--epochs", "1", "--warmup-epochs", "0",
                       "--device", "cpu", "--out", str(out)]) == 0
    assert "machine load: host " in capsys.readouterr().out
    table_row = next(line for line in out.read_text().splitlines() if line.startswith("| folder |"))
    assert "host " in table_row and "% steal" in table_row and "GPU not sampled (a CPU run)" in table_row
