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


@pytest.fixture(scope="session")
def digits_root() -> Path:
    from mobilenet.data.builtin import ensure_builtin

    return ensure_builtin("digits")


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"


@pytest.fixture(autouse=True)
def _quiet_tqdm(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
