"""Start a plan's ranks on this machine through torch's elastic launcher (what torchrun runs; no restarts) and turn
a failed run into one RunError line naming the rank that failed first."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import re
import socket
import sys
import tempfile
import time
import uuid
from multiprocessing.reduction import DupFd
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from pipeplan.artifact.plan import Plan
from pipeplan.errors import DEBUG_ENV, RunError
from pipeplan.runtime.launch.prelaunch import check_before_launch
from pipeplan.runtime.launch.watchdog import ERROR_DIR_ENV, ExitWatch
from pipeplan.runtime.launch.worker import run_plans
from pipeplan.runtime.step.stages import check_plan_runs, load_spec
from pipeplan.runtime.train.asynchronous import check_async_run
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.train.optim import check_training
from pipeplan.runtime.train.post_validate import check_post_validate
from pipeplan.runtime.train.trainer import RunResult

# phrases of errors that only say a peer went away (the rank reporting them is not the cause)
_LOST_PEER = ("Connection reset", "Connection closed", "closed by peer", "Broken pipe", "timed out", "Timed out")
_STOPPED_PEER = re.compile(r"^rank \d+ stopped responding")
CPP_LOG = "TORCH_CPP_LOG_LEVEL"  # c10's log: ranks whose store or peer vanished log C++ stack traces at ERROR; the
# launcher's one line says it (FATAL keeps them quiet unless the user set a level or PIPEPLAN_DEBUG=1)
SHUTDOWN_TIMEOUT_S = 3  # after a failure, a rank that ignores SIGTERM (frozen, stopped) is killed this much later
# The ranks are forked from one server process that imported torch and the worker once (multiprocessing's
# forkserver, one per launching process), not spawned fresh: a spawned rank spends ~2 s importing them, again at
# every launch (the test suite launches ~100 times; an API user may launch repeatedly). The server's environment and
# output streams are those of its start, so each launch hands the ranks its own (`_adopt_launcher`), as spawned ranks
# would inherit them.
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"  # (Windows)
PRELOAD = ["torch", "pipeplan.runtime.launch.worker"]
_ELASTIC_ENV = re.compile(
    r"^(RANK|GROUP_RANK|ROLE_RANK|ROLE_NAME|LOCAL_RANK|LOCAL_WORLD_SIZE|WORLD_SIZE|"
    r"GROUP_WORLD_SIZE|ROLE_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|"
    r"TORCH_NCCL_ASYNC_ERROR_HANDLING|CUDA_VISIBLE_DEVICES)$"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local(plan_path: str | os.PathLike, config: RunConfig, *, threads: int | None = None) -> list[RunResult]:
    """Run every rank of the plan on this machine; returns the per-rank results in rank order."""
    return [per_rank[0] for per_rank in launch_many([(plan_path, config)], threads=threads)]


def launch_many(
    runs: list[tuple[str | os.PathLike, RunConfig]], *, capture_grads: bool = False, threads: int | None = None
) -> list[list[RunResult]]:
    """Run several plans of one world size in one launch; result[rank][i] is plan i's result on that rank."""
    plans = [Plan.load(path) for path, _ in runs]
    runs = [(path, config.for_plan(plan.training.post_validate)) for (path, config), plan in zip(runs, plans)]
    for plan in plans:
        check_plan_runs(plan)  # fail here, before starting any rank
    world_size = plans[0].world_size
    written: set[str] = set()  # checkpoint directories an earlier run of this launch writes (checked by the ranks)
    for plan, (_, config) in zip(plans, runs):
        config.run_precision(plan.training.precision, config.run_device(plan.training.device))
        check_post_validate(plan, config.post_validate)
        check_async_run(plan, config)
        check_training(plan, load_spec(plan), config)  # optimizer vs plan and factory, schedule options
        # --init-from keys, shapes, dtypes; the model buildable here; the --resume checkpoint whole
        check_before_launch(plan, config, check_resume=config.checkpoint_dir not in written)
        written.add(config.checkpoint_dir or "")
    on_cuda = any(config.run_device(plan.training.device) == "cuda" for plan, (_, config) in zip(plans, runs))
    gpus = torch.cuda.device_count() if on_cuda else 0
    if on_cuda and world_size > gpus:
        raise RunError(
            f"the plan needs {world_size} ranks but this machine has {gpus} GPU(s); run the plan's launch.sh on "
            f"{-(-world_size // gpus)} nodes instead, or run on this CPU with --device cpu"
        )
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"pipeplan-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.2,
        start_method=START_METHOD,
        **_shutdown_option(),
    )
    torch.multiprocessing.set_forkserver_preload(PRELOAD)  # (no effect once this process's server runs)
    with tempfile.TemporaryDirectory(prefix="pipeplan-errors-") as errors, _quiet_torch_logs():
        # handed to the ranks (and multiprocessing's resource tracker: a failed rank's os._exit leaves
        # semaphores it cleans up, and its warning about them would follow the error line)
        warnings = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), "ignore:resource_tracker:UserWarning"]))
        exits = ExitWatch(errors, max(run[1].heartbeat_s for run in runs))  # every rank's exit watched
        quiet_cpp = {} if os.environ.get(DEBUG_ENV) else {"TORCH_CPP_LOG_LEVEL": os.environ.get(CPP_LOG, "FATAL")}
        with _environment({ERROR_DIR_ENV: errors, "PYTHONWARNINGS": warnings, **quiet_cpp}), exits:
            try:
                jobs = [(str(path), config) for path, config in runs]
                environ, streams = dict(os.environ), _LauncherStreams()
                results = elastic_launch(launch, _entry)(jobs, capture_grads, threads, environ, streams)
            except ChildFailedError as exc:
                _print_rank_tracebacks(Path(errors))
                raise RunError(_failure_line(exc, Path(errors), world_size)) from None
            except SignalException:  # Ctrl-C or SIGTERM: the agent has stopped every rank
                raise KeyboardInterrupt from None
    return [results[rank] for rank in range(world_size)]


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _shutdown_option() -> dict[str, Any]:  # LaunchConfig keywords (which this torch has)
    """Wait only briefly for ranks to exit once the run has failed (torch's default is 30 s; older torch has no
    such option and keeps its default)."""
    fields = getattr(LaunchConfig, "__dataclass_fields__", {})
    return {"shutdown_timeout": SHUTDOWN_TIMEOUT_S} if "shutdown_timeout" in fields else {}


@contextlib.contextmanager
def _quiet_torch_logs():
    """The elastic agent logs every failure as a traceback; pipeplan reports one line per failed run instead."""
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _entry(
    jobs: list[tuple[str, RunConfig]], capture_grads: bool, threads: int | None, environ: dict[str, str], streams
) -> list[RunResult]:
    _adopt_launcher(environ, streams)
    return run_plans(jobs, capture_grads=capture_grads, threads=threads)


class _LauncherStreams:
    """This process's stdout and stderr as they are when a rank's process starts: pickled into each rank (under its
    forkserver Popen) as that rank's own duplicates of the two file descriptors (multiprocessing's `DupFd`)."""

    def __reduce__(self):
        return tuple, (tuple(DupFd(fd) if _is_open(fd) else None for fd in (1, 2)),)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # closed (a daemon's): the rank keeps the server's
        return False
    return True


def _adopt_launcher(environ: dict[str, str], streams) -> None:
    """The launching process's environment at launch, with what the elastic agent set for this rank on top, and its
    stdout and stderr (multiprocessing `DupFd`s) as this rank's."""
    own = {name: value for name, value in os.environ.items() if _ELASTIC_ENV.match(name)}
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(own)
    for target, stream in zip((1, 2), streams, strict=True):
        if stream is None:
            continue
        fd = stream.detach()
        os.dup2(fd, target)
        os.close(fd)


def _print_rank_tracebacks(errors: Path) -> None:
    """PIPEPLAN_DEBUG=1: each failed rank's traceback (the ranks left them beside their one-line messages)."""
    for path in sorted(errors.glob("rank_*.traceback")):
        print(f"{path.stem.replace('_', ' ')}: {path.read_text()}", file=sys.stderr, end="", flush=True)


def _failure_line(exc: ChildFailedError, errors: Path, world_size: int) -> str:
    """Name the rank that failed first. A rank with its own error (bad plan, watchdog timeout) wrote a message;
    a rank that died (killed, crashed, os._exit) wrote none while the others report losing their connection."""
    messages = sorted(errors.glob("rank_*.txt"), key=lambda p: p.stat().st_mtime)
    by_rank = {int(p.stem.removeprefix("rank_")): p.read_text().strip() for p in messages}
    own = [r for r in by_rank if not any(mark in by_rank[r] for mark in _LOST_PEER)]
    if own:  # a pipeplan-level error or a heartbeat timeout names the cause itself
        first = min(own, key=lambda r: [p.stem for p in messages].index(f"rank_{r}"))
        if _STOPPED_PEER.match(by_rank[first]):  # the reporter is healthy: blame the rank it names
            return f"{by_rank[first]}; noticed by rank {first}"
        return f"rank {first} failed: {by_rank[first]}"
    silent = [r for r in range(world_size) if r not in by_rank]
    if by_rank and silent:
        first = next(iter(by_rank))
        who = f"rank {silent[0]}" if len(silent) == 1 else f"one of ranks {silent}"
        return f"{who} died without an error message; rank {first} then reported: {by_rank[first]}"
    if by_rank:
        first = next(iter(by_rank))
        return f"rank {first} failed: {by_rank[first]}"
    rank, failure = min(exc.failures.items(), key=lambda item: item[1].timestamp or time.time())
    return f"rank {rank} died (exit code {failure.exitcode})"
