"""`pipeplan run` end to end (log lines, summary, measured trace) and fault handling: a rank that dies or hangs
makes the whole run exit non-zero quickly with a message naming it, and the last complete checkpoint stays
loadable; diverged copies of a shared weight stop the run. Each test is one real launch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers.runtime import TINY_GPT, TINY_GPT_TIED, make_plan

from pipeplan.errors import RunError
from pipeplan.runtime.launch.local import launch_local
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.weights import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # multi-process runs


def _run(args: list[str], *, env_extra: dict[str, str] | None = None, timeout: float = 150):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    began = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    return proc, time.monotonic() - began


def test_cli_run_logs_steps_and_writes_an_overlayable_trace(tmp_path):
    path, plan = make_plan(tmp_path, "cli", "gpt", TINY_GPT_TIED, schedule="zb-h1", pipeline_devices=2)
    trace = tmp_path / "measured.json"
    proc, _ = _run(
        [sys.executable, "-m", "pipeplan", "run", path, "--steps", "3", "--trace", str(trace), "--threads", "1"]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("loss" in s and "samples/s" in s and "tokens/s" in s for s in steps)
    assert "summary: median step" in proc.stdout
    written = json.loads(trace.read_text())
    events = [e for e in written["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["pid"] for e in events}) == [0, 1]
    for step in range(3):  # every step's ops, on one clock
        ops = sorted(e["name"] for e in events if e["args"]["step"] == step)
        assert ops == sorted(op for ops in plan.rank_ops for op in ops)
    assert all(e["dur"] >= 0 for e in events) and min(e["ts"] for e in events) == 0
    for rank in written["pipeplan_measured"]["ranks"]:
        ends = [step["end_ms"] for step in rank["steps"]]
        starts = [min(op[1] for op in step["ops"]) for step in rank["steps"]]
        assert [s["step"] for s in rank["steps"]] == [0, 1, 2] and ends == sorted(ends)
        assert all(start < end for start, end in zip(starts, ends, strict=True))


def test_dead_rank_under_torchrun_stops_everyone_and_keeps_the_checkpoint(tmp_path):
    path, _ = make_plan(tmp_path, "dead", "gpt", TINY_GPT_TIED, schedule="1f1b", pipeline_devices=2)
    checkpoints = tmp_path / "ckpt"
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0"]
    args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
    args += ["-m", "pipeplan.runtime.launch.worker", path, "--steps", "5", "--checkpoint-dir", str(checkpoints)]
    args += ["--checkpoint-every", "1", "--heartbeat-timeout", "10", "--quiet"]
    proc, elapsed = _run(args, env_extra={"PIPEPLAN_FAULT": "rank=1,step=2,mode=exit"})
    assert proc.returncode != 0
    assert elapsed < 120
    assert "injected fault (exit) at step 2" in proc.stderr
    assert "rank    : 1" in proc.stderr or "rank: 1" in proc.stderr  # torchrun's failure summary names it
    assert checkpoint.latest_step(checkpoints) == 2
    state = torch.load(checkpoint.stage_file(checkpoints, 2, 1), weights_only=True)
    assert state["step"] == 2 and "head.norm.weight" in state["params"]


def test_hung_rank_is_detected_by_heartbeat(tmp_path):
    path, _ = make_plan(tmp_path, "hang", "gpt", TINY_GPT_TIED, schedule="1f1b", pipeline_devices=2)
    args = [sys.executable, "-m", "pipeplan", "run", path, "--steps", "4", "--heartbeat-timeout", "5", "--threads", "1"]
    proc, elapsed = _run(args, env_extra={"PIPEPLAN_FAULT": "rank=1,step=1,mode=hang"})
    assert proc.returncode == 1
    assert elapsed < 100
    last = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert last and "rank 1 stopped responding" in last[-1], proc.stderr[-2000:]
    # one line, once: the ranks leave their messages to the launcher, and no peer's lost connection follows
    from_ranks = [line for line in proc.stderr.splitlines() if "pipeplan rank" in line and "injected" not in line]
    assert len(last) == 1 and not from_ranks and "closed by peer" not in proc.stderr, proc.stderr[-2000:]
    assert "resource_tracker" not in proc.stderr, proc.stderr[-2000:]


def test_diverged_tied_copies_stop_the_run(tmp_path, monkeypatch):
    """Two ranks share the tied embedding; rank 1 nudges its copy before step 1, the per-step check must fail."""
    path, _ = make_plan(tmp_path, "d", "gpt", TINY_GPT_TIED, schedule="1f1b", pipeline_devices=2)
    monkeypatch.setenv("PIPEPLAN_FAULT", "rank=1,step=1,mode=diverge")
    config = RunConfig(steps=3, check_every=1, quiet=True, heartbeat_timeout_s=30.0)
    with pytest.raises(RunError, match=r"step 1: parameter 'embed.tok.weight' differs between ranks \[0, 1\]"):
        launch_local(path, config, threads=1)


def test_diverged_dualpipe_copies_stop_the_run(tmp_path, monkeypatch):
    """dualpipe holds every stage twice (rank d: stages d and p-1-d); a nudged copy fails the step's checksum."""
    path, _ = make_plan(tmp_path, "dp", "gpt", TINY_GPT, schedule="dualpipe", pipeline_devices=2)
    monkeypatch.setenv("PIPEPLAN_FAULT", "rank=1,step=1,mode=diverge")
    config = RunConfig(steps=2, check_every=1, quiet=True, heartbeat_timeout_s=30.0)
    with pytest.raises(RunError, match=r"step 1: parameter '.*' differs between ranks \[0, 1\]"):
        launch_local(path, config, threads=1)


def test_stopped_rank_is_blamed_and_everyone_is_gone_soon(tmp_path):
    """SIGSTOP freezes the whole process (its watchdog too); the peer notices within the heartbeat timeout, and the
    launcher kills the stopped rank instead of waiting for it: the run ends within timeout + 10 s of the stop."""
    path, _ = make_plan(tmp_path, "stop", "gpt", TINY_GPT_TIED, schedule="1f1b", pipeline_devices=2)
    args = [sys.executable, "-m", "pipeplan", "run", path, "--steps", "4", "--heartbeat-timeout", "5", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIPEPLAN_FAULT": "rank=1,step=1,mode=stop"}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:  # rank 1 stops at the start of step 2 (index 1), right after step 1 is logged
        if line.startswith("step "):
            break
    stopped_at = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    elapsed = time.monotonic() - stopped_at
    assert proc.returncode == 1
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors and errors[-1].startswith("error: rank 1 stopped responding"), stderr[-2000:]
    assert "rank 0 failed" not in errors[-1]
    assert elapsed < 5 + 10, f"the run took {elapsed:.1f} s to end after rank 1 stopped"


@pytest.mark.parametrize("how", ["sigint-group", "sigterm"])
def test_interrupt_is_one_line_exit_130_and_leaves_no_rank(tmp_path, how):
    """Ctrl-C (SIGINT to the terminal's whole process group) or SIGTERM to pipeplan: "interrupted", exit 130, no
    traceback, and no rank left behind."""
    path, _ = make_plan(tmp_path, "int", "gpt", TINY_GPT_TIED, schedule="1f1b", pipeline_devices=2)
    args = [sys.executable, "-m", "pipeplan", "run", path, "--steps", "100000", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    for line in proc.stdout:  # wait until the ranks train
        if line.startswith("step "):
            break
    if how == "sigint-group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr and "Traceback" not in stderr, stderr[-2000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # anyone left in the run's process group?
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail("a rank outlived the interrupted run")
