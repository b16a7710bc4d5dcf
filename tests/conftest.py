"""Shared test settings: `@pytest.mark.gpu` tests skip without CUDA; hypothesis stays fast on 2 cores."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "pipeplan", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile("pipeplan")


@pytest.fixture
def console_warnings(capsys, monkeypatch):
    """Read the `warning:` lines pipeplan.console.warn printed on stderr so far (its once-per-process registry is
    emptied for the test, so a warning another test already printed shows again)."""
    import pipeplan.console

    monkeypatch.setattr(pipeplan.console, "_warned", set())

    def read() -> list[str]:
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]

    return read


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
