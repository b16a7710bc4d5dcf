"""Link measurements for `pipeplan calibrate`: point-to-point and all-reduce bandwidth and small-message latency
between local processes (torch.distributed in spawned processes: nccl, one per GPU, when 2+ GPUs are visible;
gloo between two CPU processes for `--device cpu`).

- p2p: rank 0 sends `link_bytes` to rank 1, which sends them back (ping-pong); one direction is half the round trip,
  so bandwidth = size / (round trip / 2) (the latency inside it is negligible at this size).
- latency: the same ping-pong with a 4-byte message, half the round trip.
- all-reduce: every rank reduces `link_bytes`; reported as bus bandwidth 2·(n-1)/n · size / time (nccl-tests).
Each is the median of `repeats` samples after `warmup`.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch

from pipeplan.calibrate.spec import LinkResult, Sizes
from pipeplan.cluster import ring_bytes_sent
from pipeplan.errors import RunError

_TIMEOUT_S = 120
_MAX_GPUS = 8
_LATENCY_ROUND_TRIPS = 20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    import torch.distributed as dist

    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])  # nccl: on this rank's GPU, not a guessed one
    else:
        dist.barrier()


def _timed(fn, device: torch.device, sizes: Sizes, inner: int = 1) -> float:
    """Median seconds of one `fn()`: samples of `inner` calls, the device synchronized around each sample."""
    for _ in range(sizes.warmup):
        fn()
    samples = []
    for _ in range(sizes.repeats):
        _sync(device)
        _barrier(device)
        began = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - began) / inner)
    return statistics.median(samples)


def _ping_pong(tensor: torch.Tensor, rank: int):
    import torch.distributed as dist

    def run() -> None:
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        elif rank == 1:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)

    return run


def _worker(rank: int, world: int, backend: str, port: int, sizes: Sizes, results) -> None:
    """One rank; rank 0 puts ("ok", LinkResult) on `results`, a failing rank ("error", one line) and exits 1."""
    try:
        _measure(rank, world, backend, port, sizes, results)
    except Exception as exc:  # reported by the parent as one line, not a traceback per process
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        results.put(("error", f"rank {rank}: {type(exc).__name__}: {first}"))
        sys.exit(1)


def _measure(rank: int, world: int, backend: str, port: int, sizes: Sizes, results) -> None:
    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=_TIMEOUT_S))
    try:
        big = torch.ones(sizes.link_bytes // 4, device=device)
        small = torch.ones(1, device=device)
        p2p = _timed(_ping_pong(big, rank), device, sizes) / 2
        latency = _timed(_ping_pong(small, rank), device, sizes, inner=_LATENCY_ROUND_TRIPS) / 2
        reduce = _timed(lambda: dist.all_reduce(big), device, sizes)
        if rank == 0:
            size = big.numel() * 4
            link = LinkResult(
                backend=backend,
                ranks=world,
                message_bytes=size,
                latency_s=latency,
                p2p_bytes_per_s=size / p2p,
                allreduce_bus_bytes_per_s=ring_bytes_sent(size, world, passes=2) / reduce,
            )
            results.put(("ok", link))
        _barrier(device)
    finally:
        dist.destroy_process_group()


def _run(world: int, backend: str, sizes: Sizes) -> LinkResult:
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = _free_port()
    procs = [context.Process(target=_worker, args=(r, world, backend, port, sizes, results)) for r in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + _TIMEOUT_S * 2
    while time.monotonic() < deadline and any(proc.is_alive() for proc in procs):
        if any(proc.exitcode not in (None, 0) for proc in procs):
            break  # one rank failed: the others would wait for it until the timeout
        time.sleep(0.05)
    alive = [proc for proc in procs if proc.is_alive()]
    failed = any(proc.exitcode not in (None, 0) for proc in procs)
    for proc in alive:
        proc.kill()
        proc.join()
    messages = []
    while not results.empty():
        messages.append(results.get())
    errors = [text for kind, text in messages if kind == "error"]
    found = [value for kind, value in messages if kind == "ok"]
    if failed or alive or errors or not found:
        why = errors[0] if errors else f"exit codes {[p.exitcode for p in procs]}"
        why = "timed out" if alive and not failed else why
        raise RunError(f"calibrate: the {backend} link measurement between {world} processes failed ({why})")
    return found[0]


def measure_links(kind: str, sizes: Sizes) -> tuple[LinkResult | None, str]:
    """(result, note): nccl over min(#GPUs, 8) GPUs, gloo over two CPU processes; None and why when not possible."""
    if kind == "cuda":
        count = torch.cuda.device_count()
        if count < 2:
            return None, f"links not measured: {count} GPU visible (point-to-point and all-reduce need 2+)"
        if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
            return None, "links not measured: this torch has no nccl backend"
        return _run(min(count, _MAX_GPUS), "nccl", sizes), ""
    if not torch.distributed.is_available():
        return None, "links not measured: this torch has no torch.distributed"
    return _run(2, "gloo", sizes), ""
