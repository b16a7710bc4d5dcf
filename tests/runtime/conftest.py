"""Runtime tests import their helpers (`rt_helpers`) from this folder (pytest runs with --import-mode=importlib) and
compute their single-process references with one thread (the ranks also run one each; on a busy machine extra
OpenMP threads only spin)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
