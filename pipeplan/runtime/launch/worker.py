"""One rank of `pipeplan run`: what the planner's launch.sh runs under torchrun on every node.

    torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m pipeplan.runtime.launch.worker DIR/plan.json [OPTIONS]

OPTIONS are `pipeplan run`'s (pipeplan.runtime.launch.run_options.RunOptions): --steps, --trace, --trace-steps,
--checkpoint-dir, --checkpoint-every, --resume, --init-from, --optimizer, --lr, --lr-schedule, --warmup-steps,
--decay-steps, --weight-decay, --momentum, --seed, --log, --tensorboard, --heartbeat-timeout, --device,
--precision, --threads, --check-every, --quiet, --clip-grad-norm, --post-validate, --overlap-pairs.

Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the environment (torchrun sets them); runs on
the plan's device unless --device says otherwise: gloo on CPU, nccl on CUDA with one device per rank
(cuda:LOCAL_RANK). A user error prints one line naming the rank (and its traceback under PIPEPLAN_DEBUG=1) and
exits 1; under `pipeplan run` the launcher prints one line for the whole run instead.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import traceback
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeplan.artifact.plan import Plan
from pipeplan.cluster import cpu_core_blocks, cpu_threads_per_rank, pin_process
from pipeplan.errors import PipeplanError, RunError
from pipeplan.options import parse_options
from pipeplan.runtime.launch.run_options import RunOptions
from pipeplan.runtime.launch.watchdog import Watchdog, record_error
from pipeplan.runtime.step.stages import check_plan_runs
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.train.loop import train
from pipeplan.runtime.train.trainer import RunResult


def _device(name: str) -> tuple[str, torch.device]:
    """Backend and device for run device `name`: gloo on the CPU, or nccl on cuda:LOCAL_RANK."""
    if name == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise RunError(
                f"local rank {local_rank} has no GPU (this node has {torch.cuda.device_count()}); start at most one "
                "rank per GPU, or run with --device cpu"
            )
        torch.cuda.set_device(local_rank)
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def default_cpu_threads() -> int:
    """Threads per CPU rank when --threads is not given: this machine's usable cores shared by the ranks the
    launcher started on it (LOCAL_WORLD_SIZE), so that the ranks do not oversubscribe the cores."""
    return cpu_threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _pin_local_rank(threads: int) -> None:
    """This CPU rank pinned to its block of this machine's cores (cluster.cpu_core_blocks: LOCAL_RANK's of
    LOCAL_WORLD_SIZE), where the ranks' threads fit in blocks of their own."""
    blocks = cpu_core_blocks(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), threads)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if blocks is not None and local_rank < len(blocks):
        pin_process(blocks[local_rank])


def run_worker(plan_path: str, config: RunConfig, capture_grads: bool = False, threads: int | None = None) -> RunResult:
    """Join the process group described by the environment, train, and leave. The elastic_launch entrypoint."""
    return run_plans([(plan_path, config)], capture_grads=capture_grads, threads=threads)[0]


def run_plans(
    runs: list[tuple[str, RunConfig]], *, capture_grads: bool = False, threads: int | None = None
) -> list[RunResult]:
    """Run several plans of the same world size one after another in one process group (tests and benchmarks
    amortize start-up this way); the heartbeat and timeouts of the first config apply to all. `threads`: torch's
    CPU threads (default on CPU: default_cpu_threads())."""
    try:
        return _run_plans(runs, capture_grads=capture_grads, threads=threads)
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal's group: leave without a traceback,
        # also when it arrives while a failure is reported (a rank blocked in C++ sees it late, after its peer left)
        os._exit(INTERRUPTED_EXIT)


def _run_plans(runs: list[tuple[str, RunConfig]], *, capture_grads: bool, threads: int | None) -> list[RunResult]:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    watchdog = None
    _quiet_termination()
    try:
        plans = [Plan.load(path) for path, _ in runs]
        runs = [(path, config.for_plan(plan.training.post_validate)) for (path, config), plan in zip(runs, plans)]
        for plan in plans:
            check_plan_runs(plan, trace=False)
            if world_size != plan.world_size:
                raise RunError(
                    f"the plan needs {plan.world_size} ranks but {world_size} were started; start {plan.world_size}"
                )
        devices = {config.run_device(plan.training.device) for plan, (_, config) in zip(plans, runs, strict=True)}
        if len(devices) > 1:
            raise RunError("plans run together in one launch must all run on the same device")
        backend, device = _device(devices.pop())
        if threads or device.type == "cpu":
            threads = threads or default_cpu_threads()
            if device.type == "cpu":
                _pin_local_rank(threads)
            torch.set_num_threads(threads)
        first = runs[0][1]
        timeout = timedelta(seconds=first.pg_timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        watchdog = Watchdog(rank=rank, world_size=world_size, timeout_s=first.heartbeat_s).start()
        results = [
            train(plan, config, rank=rank, device=device, capture_grads=capture_grads, watchdog=watchdog, plan_path=p)
            for plan, (p, config) in zip(plans, runs, strict=True)
        ]
        dist.barrier()  # still under the heartbeat: a rank stopped before it is noticed by its peers
        watchdog.stop(done=True)
        dist.destroy_process_group()
        cores = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else None
        return [replace(result, cores=cores) for result in results]
    except PipeplanError as exc:
        _fail(rank, str(exc), watchdog, traceback.format_exc())
    except Exception as exc:  # a peer vanished mid-transfer, a CUDA error, a bug: still one line per rank
        _fail(rank, f"{type(exc).__name__}: {_short(str(exc))}", watchdog, traceback.format_exc())
    raise AssertionError("unreachable")


INTERRUPTED_EXIT = 130


def _quiet_termination() -> None:
    """SIGTERM (the launcher stopping the run, or a scheduler) ends the rank at once, without a traceback."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(128 + signum))


def _short(text: str) -> str:
    """First sentence of an exception message, without gloo's `[file.cc:line]` prefix."""
    line = text.splitlines()[0] if text else ""
    line = re.sub(r"^\[[^\]]*\]\s*", "", line).lstrip(" .:")
    sentence = line.split(". ")[0]
    return sentence[:200] or "(no message)"


def _fail(rank: int, message: str, watchdog: Watchdog | None, trace: str) -> None:
    record_error(rank, message, trace)
    if watchdog is not None:
        watchdog.report_failure(f"rank {rank} failed: {message}")
        watchdog.stop(done=False)
    sys.stdout.flush()
    os._exit(1)  # skip interpreter teardown: a process group with a dead peer can block in its destructor


def parse_args(argv: list[str] | None = None) -> tuple[str, RunConfig, int | None]:
    """The plan path, run config and threads from `pipeplan run`'s options (declared once: RunConfig's fields)."""
    options = parse_options(
        RunOptions, argv, prog="python -m pipeplan.runtime.launch.worker", help=__doc__.splitlines()[0]
    )
    return str(options.plan), options, options.threads  # RunOptions is the RunConfig the ranks run with


def main(argv: list[str] | None = None) -> None:
    try:
        plan_path, config, threads = parse_args(argv)
    except PipeplanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    run_worker(plan_path, config, threads=threads)


if __name__ == "__main__":
    main()
