"""Fuzz every command's options and corrupted plan files: no traceback, no hang, no success on nonsense, and each
failure one `error:` line (exit 1) or a usage error (exit 2). Cases run in a separate worker process with a memory
cap and a per-case alarm (fuzz_worker.py); the issue's reported cases are the seeds, hypothesis adds combinations."""

from __future__ import annotations

import json
import os
import select
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.fuzz_cases import Case, corrupted_plans, make_files, option_cases, tampered_checkpoints
from hypothesis import given, settings
from hypothesis import strategies as st

WORKER = Path(__file__).with_name("fuzz_worker.py")
CASE_TIMEOUT_S = 15
LOG_ENV = "PIPEPLAN_FUZZ_LOG"  # a file to append every case and result to (for triage)


class Worker:
    """The worker subprocess; restarted after a case that killed or hung it."""

    def __init__(self, cwd: Path) -> None:
        self.proc: subprocess.Popen | None = None
        self.cwd = cwd  # a scratch directory: a case that writes to "." must not touch the checkout

    def _start(self) -> subprocess.Popen:
        # CPU only (the cases are CPU cases; a CUDA context would also blow the memory cap on a GPU machine)
        env = {**os.environ, "PIPEPLAN_HEARTBEAT_TIMEOUT": "10", "COLUMNS": "120", "CUDA_VISIBLE_DEVICES": ""}
        return subprocess.Popen(
            [sys.executable, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=self.cwd,
        )

    def run(self, case: Case) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        self.proc.stdin.write(json.dumps({"argv": list(case.argv), "timeout": CASE_TIMEOUT_S}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + CASE_TIMEOUT_S + 60  # start-up and the worker's own alarm
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                break  # the worker died (memory cap, os._exit, ...)
            if line.startswith("@@fuzz@@"):
                return json.loads(line.removeprefix("@@fuzz@@"))
        died = self.proc.poll() is not None
        self.close()
        return {"exit": None, "traceback": False, "timed_out": not died, "died": died, "seconds": None, "output": ""}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def verdict(case: Case, result: dict) -> str | None:
    """Why the result is wrong for the case, or None."""
    if result.get("died"):
        return "worker died (memory cap or exit)"
    if result["timed_out"]:
        return f"no answer within {CASE_TIMEOUT_S} s"
    if result["traceback"]:
        return "traceback"
    code, output = result["exit"], result["output"]
    if "a pipeplan bug" in output:
        return "internal error (an unexpected exception)"
    if case.expect == "error" and code == 0:
        return "exit 0 on nonsense"
    if code not in (0, 1, 2):
        return f"exit code {code}"
    if code == 1 and sum(line.startswith("error:") for line in output.splitlines()) != 1:
        return "exit 1 without exactly one error: line"
    return None


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("fuzz-cwd"))
    yield w
    w.close()


def _check_all(worker: Worker, cases: list[Case]) -> dict[str, int]:
    counts = {"cases": 0, "clean": 0, "traceback": 0, "hang": 0, "wrong success": 0, "other": 0}
    failures = []
    for case in cases:
        result = worker.run(case)
        problem = verdict(case, result)
        counts["cases"] += 1
        key = {None: "clean", "traceback": "traceback", "exit 0 on nonsense": "wrong success"}.get(problem)
        if problem and problem.startswith("internal error"):
            key = "traceback"  # what the user would have seen without the CLI's last-resort handler
        if problem and problem.startswith("no answer"):
            key = "hang"
        counts[key or "other"] += 1
        if os.environ.get(LOG_ENV):
            with open(os.environ[LOG_ENV], "a") as log:
                log.write(json.dumps({"argv": case.argv, "expect": case.expect, "problem": problem, **result}) + "\n")
        if problem:
            failures.append(f"{case.label()} -> {problem}: {result['output'][-300:]}")
    print(json.dumps(counts))
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)
    return counts


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_option_seeds(files, worker):
    _check_all(worker, option_cases(files))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_corrupted_plans(files, worker):
    _check_all(worker, corrupted_plans(files))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_device_outputs_are_refused_and_left_alone(files, worker):
    """Every output option and export format given a FIFO or /dev/null: refused, and still a FIFO and a device."""
    cases = [c for c in option_cases(files) if any(device in c.argv for device in files.devices)]
    assert len(cases) > 10
    _check_all(worker, cases)
    assert stat.S_ISFIFO(os.stat(files.fifo).st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tampered_checkpoints(files, worker, tmp_path):
    """A real 2-step checkpoint, damaged one way per case: `run --resume` refuses each in one line."""
    from pipeplan.runtime.launch.local import launch_local
    from pipeplan.runtime.train.config import RunConfig

    written = tmp_path / "ckpt"
    config = RunConfig(steps=2, checkpoint_dir=str(written), checkpoint_every=1, quiet=True, heartbeat_timeout_s=30.0)
    launch_local(files.runnable, config, threads=1)
    _check_all(worker, tampered_checkpoints(files, written))


@pytest.mark.slow
@pytest.mark.timeout(1200)
@settings(max_examples=25)
@given(data=st.data())
def test_combined_bad_options(files, worker, data):
    """Two bad options of one command at once are still one clean error."""
    cases = [c for c in option_cases(files) if c.argv[0] in ("simulate", "plan", "run")]
    first = data.draw(st.sampled_from(cases))
    same = [c for c in cases if c.argv[0] == first.argv[0] and c.argv[-2] != first.argv[-2]]
    second = data.draw(st.sampled_from(same))
    combined = Case((*first.argv, *second.argv[-2:]))
    problem = verdict(combined, worker.run(combined))
    assert problem is None, f"{combined.label()}: {problem}"
