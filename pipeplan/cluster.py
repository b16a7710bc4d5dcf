"""Cluster: the devices a plan runs on, with a two-level topology (inside a node / across nodes) and each device's
physical memory; `Link`: the one place that turns bytes into seconds on a link (point-to-point transfers and ring
collectives); `MemoryBudget`: a device's memory as plans fill it (physical, the reserve kept free, the usable rest);
`DeviceGroups`: devices grouped t x cp at a time, the devices the pipeline search places stages on.

Every formula here is vectorized over numpy arrays (bytes, group sizes) and returns a float for scalar inputs: the
partitioner calls it on whole DP columns, the planner on one boundary, with the same arithmetic."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

import numpy as np

from pipeplan.errors import ConfigError
from pipeplan.units import format_bytes

CPU_DEFAULT_DEVICES = 2  # a CPU plan's ranks when --devices is not given (a GPU machine: its GPUs)


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS says, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads_per_rank(ranks: int) -> int:
    """The CPU threads each of `ranks` processes on this machine runs with: the usable cores shared among them, at
    least one each. A CPU run's ranks run with it (the ranks the launcher started here), and a CPU profile measures
    with it (the ranks of the plan it is made for; `pipeplan profile` alone: CPU_DEFAULT_DEVICES), so that the
    profile's op costs are those of the run's ranks, not of a process that had every core to itself."""
    return max(1, usable_cores() // max(1, ranks))


def cpu_core_blocks(ranks: int, threads: int) -> list[frozenset[int]] | None:
    """The cores each of `ranks` processes on this machine is pinned to, running `threads` threads each: the
    usable cores in order, cut into `ranks` blocks of cpu_threads_per_rank(ranks); None (the OS places them) where
    the OS sets no affinity, there are fewer cores than ranks or `threads` outnumber a block. On a busy machine the
    scheduler otherwise moves a rank between cores as it likes, and one run of a plan differs from the next by where
    its ranks happened to land (a CPU profile's siblings are pinned the same way: profiling/siblings.py)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    size = len(cores) // max(1, ranks)
    if ranks < 1 or size < 1 or threads > size:
        return None
    return [frozenset(cores[rank * size : (rank + 1) * size]) for rank in range(ranks)]


def pin_process(cores: frozenset[int]) -> frozenset[int]:
    """Every thread of this process (torch's pool included) pinned to `cores`; returns the cores it could run on
    before, to pin it back."""
    before = frozenset(os.sched_getaffinity(0))
    try:
        threads = [int(task) for task in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread, which the threads it starts inherit
        threads = [0]
    for thread in threads:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(thread, cores)
    return before


MAX_DEVICES = 16_384  # a plan holds one op list per rank: planning 16k devices takes seconds, 100k minutes


def _out(values: np.ndarray):
    """A float for a scalar result, else the array."""
    return float(values) if values.ndim == 0 else values


def ring_bytes_sent(num_bytes, group_size, *, passes: int):
    """Bytes each device sends in a ring collective of `num_bytes` over `group_size` devices: passes (n-1)/n x bytes
    (also the nccl-tests "bus bandwidth" factor: bus bandwidth = this / time)."""
    return passes * (group_size - 1) / group_size * num_bytes


@dataclass(frozen=True, kw_only=True)
class Link:
    """One kind of link between two devices: bytes/s one way (full duplex) and the latency of one message."""

    bandwidth: float
    latency_s: float

    def transfer_s(self, num_bytes):
        """Seconds to move `num_bytes` point-to-point: latency + bytes / bandwidth; nothing to send costs 0."""
        b = np.asarray(num_bytes, dtype=np.float64)
        return _out(np.where(b > 0, self.latency_s + b / self.bandwidth, 0.0))

    def ring_s(self, num_bytes, group_size, *, passes: int):
        """A ring collective of `num_bytes` per device over `group_size` devices, in `passes` sweeps of n - 1 steps
        that each move bytes / n: passes (n-1) latency + passes (n-1)/n bytes / bandwidth; 0 for one device or no
        bytes. Reduce-scatter and all-gather are one pass, all-reduce two (Patarasuk & Yuan, JPDC 2009)."""
        b = np.asarray(num_bytes, dtype=np.float64)
        n = np.asarray(group_size, dtype=np.float64)
        t = passes * (n - 1) * self.latency_s + ring_bytes_sent(b, n, passes=passes) / self.bandwidth
        return _out(np.where((n > 1) & (b > 0), t, 0.0))

    def allreduce_s(self, num_bytes, group_size):
        """Ring all-reduce: a reduce-scatter then an all-gather, 2 (n-1)/n x bytes / bandwidth + 2 (n-1) latency."""
        return self.ring_s(num_bytes, group_size, passes=2)

    def reduce_scatter_s(self, num_bytes, group_size):
        """Ring reduce-scatter of `num_bytes` (each device keeps 1/n, reduced): (n-1)/n x bytes / bandwidth."""
        return self.ring_s(num_bytes, group_size, passes=1)

    def all_to_all_s(self, num_bytes, group_size):
        """All-to-all of `num_bytes` per device over `group_size` devices, each keeping 1/n and sending the rest in
        n - 1 pairwise exchanges of bytes / n (mixture-of-experts dispatch and combine): (n-1) latency + (n-1)/n x
        bytes / bandwidth; 0 for one device or no bytes."""
        return self.ring_s(num_bytes, group_size, passes=1)

    def all_gather_s(self, num_bytes, group_size):
        """Ring all-gather into `num_bytes` per device (each contributes 1/n): (n-1)/n x bytes / bandwidth."""
        return self.ring_s(num_bytes, group_size, passes=1)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    num_devices: int
    devices_per_node: int
    memory_per_device: int | None  # bytes; None: not known (a hand-made plan's devices: no limit)
    intra_node_bandwidth: float = 5e9  # bytes/s between devices of one node
    inter_node_bandwidth: float = 1.25e9  # bytes/s between nodes
    intra_node_latency_s: float = 20e-6
    inter_node_latency_s: float = 50e-6
    hardware: str = "cpu"

    def __post_init__(self) -> None:
        if not 1 <= self.num_devices <= MAX_DEVICES:
            raise ConfigError(
                f"--devices must be >= 1 and <= {MAX_DEVICES:,} (a plan lists every rank's op list), got "
                f"{self.num_devices:,}"
            )
        if self.devices_per_node < 1:
            raise ConfigError(f"devices per node must be >= 1, got {self.devices_per_node}")
        if self.num_devices > self.devices_per_node and self.num_devices % self.devices_per_node:
            raise ConfigError(
                f"--devices ({self.num_devices}) must be a multiple of the devices per node ({self.devices_per_node})"
            )
        if self.memory_per_device is not None and self.memory_per_device <= 0:
            raise ConfigError(f"--memory must be positive, got {self.memory_per_device}")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        for name in ("intra_node_latency_s", "inter_node_latency_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")

    @property
    def memory_bytes(self) -> int:
        """`memory_per_device` where a limit is needed (the search, capacity): a cluster without one is refused."""
        if self.memory_per_device is None:
            raise ConfigError("this cluster's memory per device is not known; give it with --memory")
        return self.memory_per_device

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_devices // self.devices_per_node)

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    @property
    def intra_link(self) -> Link:
        return Link(bandwidth=self.intra_node_bandwidth, latency_s=self.intra_node_latency_s)

    @property
    def inter_link(self) -> Link:
        return Link(bandwidth=self.inter_node_bandwidth, latency_s=self.inter_node_latency_s)

    def link(self, *, same_node: bool) -> Link:
        """The link inside a node, or the one across nodes."""
        return self.intra_link if same_node else self.inter_link

    def link_for_consecutive(self, num_devices: int) -> Link:
        """The link `num_devices` consecutive devices starting a node talk over: intra-node when they fit in one."""
        return self.link(same_node=num_devices <= self.devices_per_node)

    def link_between(self, devices) -> Link:
        """The link a group of devices talks over: intra-node when they all sit in one node, else inter-node (the
        slowest hop bounds a ring or a stage boundary)."""
        return self.link(same_node=len({self.node_of(d) for d in devices}) <= 1)

    def transfer_s(self, num_bytes, *, same_node: bool):
        """Seconds to move `num_bytes` point-to-point (`Link.transfer_s` of the chosen link)."""
        return self.link(same_node=same_node).transfer_s(num_bytes)

    def allreduce_s(self, num_bytes, group_size, *, same_node: bool):
        """Ring all-reduce time of `num_bytes` over `group_size` devices (`Link.allreduce_s` of the chosen link)."""
        return self.link(same_node=same_node).allreduce_s(num_bytes, group_size)


@dataclass(frozen=True, kw_only=True)
class MemoryBudget:
    """One device's memory as a plan fills it: `physical` bytes, less `reserve` kept free for what the model does not
    count (CUDA context, communication buffers, fragmentation), leaves `usable`: what every simulated peak is checked
    against."""

    physical: int
    reserve: int = 0

    def __post_init__(self) -> None:
        if self.reserve < 0:
            raise ConfigError(f"--memory reserve= must be >= 0, got {self.reserve}")
        if self.usable <= 0:
            raise ConfigError(
                f"--memory reserve={format_bytes(self.reserve)} leaves no memory of {format_bytes(self.physical)} "
                "per device; lower it"
            )

    @property
    def usable(self) -> int:
        return self.physical - self.reserve


@dataclass(frozen=True, kw_only=True)
class DeviceGroups:
    """Devices grouped `tensor_parallel` x `context_parallel` at a time: consecutive ranks, tensor parallelism
    innermost, then context parallelism (Megatron's order). The pipeline search places stages on groups; a plan's rank
    stands for one group."""

    tensor_parallel: int = 1
    context_parallel: int = 1

    def __post_init__(self) -> None:
        if min(self.tensor_parallel, self.context_parallel) < 1:
            raise ConfigError(f"group sizes must be >= 1, got t={self.tensor_parallel} cp={self.context_parallel}")

    @property
    def size(self) -> int:
        """Devices per group."""
        return self.tensor_parallel * self.context_parallel

    def of(self, cluster: Cluster) -> Cluster:
        """The groups of `cluster`'s devices as the pipeline search's devices: N / size groups, devices_per_node / size
        per node (1 when a group spans nodes: every link between groups is then inter-node), one device's memory and
        links."""
        if self.size == 1:
            return cluster
        assert cluster.num_devices % self.size == 0, "checked by search.stack.check_split"
        per_node = max(1, cluster.devices_per_node // self.size)
        return replace(cluster, num_devices=cluster.num_devices // self.size, devices_per_node=per_node)

    def phrase(self, num_groups: int) -> str:
        """How messages name `num_groups` groups: `64 device(s) with tensor parallelism t=8`."""
        t, cp = self.tensor_parallel, self.context_parallel
        split = f" with tensor parallelism t={t}" if t > 1 else ""
        split += f"{' and' if t > 1 else ' with'} context parallelism cp={cp}" if cp > 1 else ""
        return f"{num_groups * self.size} device(s){split}"
