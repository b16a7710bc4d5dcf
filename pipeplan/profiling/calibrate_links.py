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
import time
from datetime import timedelta

import torch

from pipeplan.errors import RunError
from pipeplan.profiling.calibrate import LinkResult, Sizes

_TIMEOUT_S = 120
_MAX_GPUS = 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, sizes: Sizes) -> float:
    import torch.distributed as dist

    for _ in range(sizes.warmup):
        fn()
    samples = []
    for _ in range(sizes.repeats):
        _sync(device)
        dist.barrier()
        began = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - began)
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
        latency = _timed(_ping_pong(small, rank), device, sizes) / 2
        reduce = _timed(lambda: dist.all_reduce(big), device, sizes)
        if rank == 0:
            results.put(
                LinkResult(
                    backend=backend,
                    ranks=world,
                    message_bytes=big.numel() * 4,
                    latency_s=latency,
                    p2p_bytes_per_s=big.numel() * 4 / p2p,
                    allreduce_bus_bytes_per_s=2 * (world - 1) / world * big.numel() * 4 / reduce,
                )  # fmt: skip
            )
        dist.barrier()
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
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0))
    alive = [proc for proc in procs if proc.is_alive()]
    for proc in alive:
        proc.kill()
        proc.join()
    failed = [proc.exitcode for proc in procs if proc.exitcode != 0]
    if alive or failed or results.empty():
        why = "timed out" if alive else f"exit codes {failed}"
        raise RunError(f"calibrate: the {backend} link measurement between {world} processes failed ({why})")
    return results.get()


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
