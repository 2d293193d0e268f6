import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cudnn_flags_restored():
    """Trainer() and infer.py's setup turn cudnn.benchmark on for the whole process, and some tests set cuDNN's flags
    themselves: restored after every test, so that no test leaves autotuned cuDNN algorithms, some of them not
    deterministic (fp32 weight gradients with atomics), or another TF32 setting to the tests after it."""
    flags = torch.backends.cudnn
    saved = flags.benchmark, flags.deterministic, flags.allow_tf32
    yield
    flags.benchmark, flags.deterministic, flags.allow_tf32 = saved


@pytest.fixture
def deterministic_cudnn():
    """Deterministic cuDNN algorithms and no autotuning for a test that compares steps with cuDNN's convolutions in
    them bit for bit (a Trainer built inside the test turns benchmark on again: set it back after). Restored by
    _cudnn_flags_restored, which as an autouse fixture is set up before and torn down after this one."""
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True


@pytest.fixture
def set_knobs(monkeypatch):
    """set_knobs(NAME=value, ...): the custom kernels' launch knob MDW_<NAME> for every dtype (per-dtype overrides
    dropped), read again by the kernels at once; after the test the environment and the kernels' knobs are as
    before."""
    import kernels.ops  # noqa: F401  (loads the kernels: torch.ops.mobilenet_dw)

    def set_(**knobs) -> None:
        for name, value in knobs.items():
            monkeypatch.setenv(f"MDW_{name}", str(value))
            for dt in ("F32", "F16", "BF16"):
                monkeypatch.delenv(f"MDW_{name}_{dt}", raising=False)
        torch.ops.mobilenet_dw.reload_knobs()

    yield set_
    monkeypatch.undo()
    torch.ops.mobilenet_dw.reload_knobs()


@pytest.fixture(scope="session")
def digits_root() -> Path:
    from mobilenet.data.builtin import ensure_builtin

    return ensure_builtin("digits")


@pytest.fixture(scope="session")
def matrix(tmp_path_factory) -> Path:
    """A tiny matrix really run by scripts/benchmark.py, for its tests and compare.py's: torch x {fp32, bf16} x
    {NCHW, channels_last} measured; cudnn (no CUDA) and the timm peer asked for as well."""
    from matrix_runs import BENCHMARK, TINY, run_tool

    out = tmp_path_factory.mktemp("matrix")
    run_tool(BENCHMARK, *TINY, "--backends", "torch,cudnn", "--amp", "off,bf16", "--channels-last", "false,true",
             "--out", str(out), check=True)
    return out


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"


@pytest.fixture(autouse=True)
def _quiet_tqdm(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
