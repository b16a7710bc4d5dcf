"""The heartbeat covers shutdown (issue 38, Deliver 3): a rank stopped (SIGSTOP) after the run printed its summary
does not hang the launcher, synchronous or asynchronous; the launcher's ExitWatch kills a rank that finished (or
stopped beating) and is still there a heartbeat timeout later, and records why."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.runtime import TINY_GPT, make_plan

from pipeplan.errors import RunError
from pipeplan.runtime.launch.local import launch_local
from pipeplan.runtime.launch.watchdog import GRACE_S, ExitWatch
from pipeplan.runtime.train.config import RunConfig


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _age(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_exit_watch_kills_a_rank_stopped_after_it_finished_and_spares_a_live_one(tmp_path):
    stopped, beating = _sleeper(), _sleeper()
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        for rank, proc in enumerate((stopped, beating)):
            (tmp_path / f"rank_{rank}.pid").write_text(str(proc.pid))
        (tmp_path / "rank_0.done").touch()
        _age(tmp_path / "rank_0.pid", 60)
        _age(tmp_path / "rank_0.done", 1.5 + GRACE_S)
        with ExitWatch(tmp_path, timeout_s=1.0):
            deadline = time.monotonic() + 10
            while stopped.poll() is None and time.monotonic() < deadline:
                (tmp_path / "rank_1.beat").touch()  # rank 1 keeps beating
                time.sleep(0.2)
        assert stopped.poll() == -signal.SIGKILL
        assert beating.poll() is None
        assert "stopped or frozen after it finished" in (tmp_path / "rank_0.txt").read_text()
        assert not (tmp_path / "rank_1.txt").exists()
    finally:
        for proc in (stopped, beating):
            proc.kill()
            proc.wait()


def test_exit_watch_ignores_ranks_that_exited(tmp_path):
    gone = _sleeper()
    gone.kill()
    gone.wait()
    (tmp_path / "rank_0.pid").write_text(str(gone.pid))
    _age(tmp_path / "rank_0.pid", 60)
    with ExitWatch(tmp_path, timeout_s=0.5):
        time.sleep(1.5)
    assert not (tmp_path / "rank_0.txt").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["1f1b", "pipedream-2bw"])
def test_a_rank_stopped_after_the_summary_does_not_hang_the_launcher(tmp_path, monkeypatch, schedule):
    path, _ = make_plan(tmp_path, schedule, "gpt", TINY_GPT, schedule=schedule, pipeline_devices=2)
    monkeypatch.setenv("PIPEPLAN_FAULT", "rank=1,step=2,mode=stop")  # step = --steps: after the summary
    began = time.monotonic()
    with pytest.raises(RunError, match="rank 1 (stopped responding|failed: stopped or frozen)"):
        launch_local(path, RunConfig(steps=2, quiet=True, heartbeat_timeout_s=5.0), threads=1)
    assert time.monotonic() - began < 120


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ranks_of_a_killed_launcher_leave_quietly(tmp_path):
    """kill -9 of the launcher: its ranks notice the lost store and exit (their copies of its stdout and stderr
    close: the pipe ends), without C++ stack traces (c10's log is at FATAL in the ranks)."""
    import select

    path, _ = make_plan(tmp_path, "k9", "gpt", TINY_GPT, schedule="1f1b", pipeline_devices=2)
    args = [sys.executable, "-m", "pipeplan", "run", path, "--steps", "100000", "--heartbeat-timeout", "5"]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CPP_LOG_LEVEL", "PIPEPLAN_DEBUG")}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**env, "OMP_NUM_THREADS": "1"})
    output = b""
    while b"\nstep " not in b"\n" + output:  # steps are running
        assert select.select([proc.stdout], [], [], 120)[0], output[-2000:]
        chunk = os.read(proc.stdout.fileno(), 65536)
        assert chunk, output[-2000:]
        output += chunk
    proc.kill()
    proc.wait()
    ended = time.monotonic() + 60
    while time.monotonic() < ended:  # until every rank has closed the pipe
        if select.select([proc.stdout], [], [], 1)[0]:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            output += chunk
    else:
        pytest.fail("the ranks outlived their launcher by a minute")
    text = output.decode(errors="replace")
    assert "frame #" not in text and "Exception raised from" not in text, text[-3000:]
