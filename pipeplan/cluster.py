"""Cluster: the devices a plan runs on, with a two-level topology (inside a node / across nodes)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.errors import ConfigError

MAX_DEVICES = 16_384  # a plan holds one op list per rank: planning 16k devices takes seconds, 100k minutes


@dataclass(frozen=True, kw_only=True)
class Cluster:
    num_devices: int
    devices_per_node: int
    memory_per_device: int  # bytes
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
            raise ConfigError(f"--devices-per-node must be >= 1, got {self.devices_per_node}")
        if self.num_devices > self.devices_per_node and self.num_devices % self.devices_per_node:
            raise ConfigError(
                f"--devices ({self.num_devices}) must be a multiple of --devices-per-node ({self.devices_per_node})"
            )
        if self.memory_per_device <= 0:
            raise ConfigError(f"--memory-per-device must be positive, got {self.memory_per_device}")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        for name in ("intra_node_latency_s", "inter_node_latency_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_devices // self.devices_per_node)

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def transfer_s(self, num_bytes: float, *, same_node: bool) -> float:
        """Seconds to move `num_bytes` point-to-point: latency + bytes / bandwidth."""
        if num_bytes <= 0:
            return 0.0
        if same_node:
            return self.intra_node_latency_s + num_bytes / self.intra_node_bandwidth
        return self.inter_node_latency_s + num_bytes / self.inter_node_bandwidth

    def allreduce_s(self, num_bytes: float, group_size: int, *, same_node: bool) -> float:
        """Ring all-reduce time of `num_bytes` over `group_size` devices: 2 (n-1)/n × bytes / bandwidth."""
        if group_size <= 1 or num_bytes <= 0:
            return 0.0
        bandwidth = self.intra_node_bandwidth if same_node else self.inter_node_bandwidth
        latency = self.intra_node_latency_s if same_node else self.inter_node_latency_s
        steps = 2 * (group_size - 1)
        return steps * latency + 2 * (group_size - 1) / group_size * num_bytes / bandwidth
