"""Shared test settings: the `helpers` package (tests/helpers/) importable by name, one intra-op thread per test,
`@pytest.mark.gpu` tests skipped without CUDA, hypothesis fast on 2 cores. `slow` marks multi-process and
long-running tests: `make test-fast` (pytest -m "not slow") leaves them out, `make test` runs everything."""

from __future__ import annotations

import multiprocessing.process
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# pytest runs with --import-mode=importlib, which puts no test folder on sys.path: this is the one place that does,
# so that every test imports its helpers as `from helpers.<module> import ...` (spawned ranks inherit sys.path)
sys.path.insert(0, str(Path(__file__).parent))

settings.register_profile(
    "pipeplan", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile("pipeplan")

torch.set_num_threads(1)  # module-scoped fixtures run before the per-test fixture below


@pytest.fixture(autouse=True)
def one_thread():
    """Every test runs with one intra-op thread and leaves one behind, whatever it (or a CLI call in it, e.g.
    `--threads 4`) set: no test depends on the order the others ran in, and on a shared 2-core machine extra OpenMP
    threads only spin (the ranks of a multi-process run use one each too)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


_RUNNING: dict[str, pytest.Item] = {}  # the test being run (its fixtures' set-up included)
_STARTED = pytest.StashKey[list]()


def pytest_configure(config):
    """A test not marked `slow` that starts a process through multiprocessing (torch's launchers: every in-process
    `launch_local`/`launch_many`/`pipeplan run`, calibrate's link ranks), in its body or in a fixture it sets up,
    fails: `make test-fast` stays free of multi-process runs. Runs started as a subprocess (`python -m pipeplan run`,
    launch.sh) are marked by hand."""
    start = multiprocessing.process.BaseProcess.start

    def guarded_start(process) -> None:
        item = _RUNNING.get("item")
        if item is not None and item.get_closest_marker("slow") is None:
            item.stash.setdefault(_STARTED, []).append(repr(process))
            raise RuntimeError(f"{item.nodeid} starts processes: mark it @pytest.mark.slow")
        start(process)

    multiprocessing.process.BaseProcess.start = guarded_start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _RUNNING["item"] = item
    yield
    _RUNNING.pop("item", None)


@pytest.fixture(autouse=True)
def _only_slow_tests_start_processes(request):
    """Fails the test (also where its code caught the refusal) if it tried to start a process unmarked."""
    yield
    started = request.node.stash.get(_STARTED, [])
    assert not started, f"{request.node.nodeid} starts processes ({started[0]}): mark it @pytest.mark.slow"


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
