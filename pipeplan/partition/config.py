"""PartitionConfig: what the partitioner optimizes for (microbatches, schedule, replication, optimizer, cost model).

Optimizer memory is counted per parameter (weights + gradients + optimizer state, activations excluded) by
`pipeplan.partition.costs.optimizer.bytes_per_param(optimizer, precision)`, where the byte table is. `precision`
None: the optimizer alias's, else bf16-mixed.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.errors import ConfigError
from pipeplan.partition.costs.optimizer import bytes_per_param
from pipeplan.schedules.registry import schedule_info

MODES = ("replicated", "straight")
COST_MODELS = ("pipeplan", "pipedream")


@dataclass(frozen=True, kw_only=True)
class PartitionConfig:
    """Options of `partition()`.

    mode: `replicated` lets the DP replicate a stage over several devices (PipeDream's non-uniform replication);
    `straight` puts one device per stage. None (default) means `replicated` for one-chunk schedules and `straight`
    for chunked ones (interleaved, zbv, dualpipev), which cannot replicate stages.
    num_stages: fix the number of pipeline stages (counting chunks); None lets the DP choose.
    cost_model: `pipeplan` (latency + bandwidth transfers, ring all-reduce once per step) or `pipedream` (the
    objective of PipeDream's optimizer_graph_hierarchical.py with activation_compression_ratio=1).
    memory_limit_microbatches: passed to the schedule's memory model (caps in-flight microbatches for zb-auto).
    max_layer_groups: with several nodes the DP runs on at most this many groups of consecutive layers.
    """

    num_microbatches: int
    schedule: str = "1f1b"
    chunks: int | None = None
    mode: str | None = None
    num_stages: int | None = None
    optimizer: str | float = "adamw"
    precision: str | None = None  # pipeplan.precision mode the optimizer bytes are counted in
    cost_model: str = "pipeplan"
    memory_limit_microbatches: int | None = None
    max_layer_groups: int = 128

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ConfigError(f"--microbatches must be >= 1, got {self.num_microbatches}")
        info = schedule_info(self.schedule)
        if self.chunks is not None and self.chunks < 1:
            raise ConfigError(f"--chunks must be >= 1, got {self.chunks}")
        if self.chunks is None:
            object.__setattr__(self, "chunks", info.default_chunks)
        if self.mode is None:
            object.__setattr__(self, "mode", "straight" if self.chunks > 1 else "replicated")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "replicated" and self.chunks > 1:
            raise ConfigError(f"schedule {self.schedule} places {self.chunks} chunks per device; use mode='straight'")
        if self.cost_model not in COST_MODELS:
            raise ConfigError(f"cost_model must be one of {', '.join(COST_MODELS)}, got {self.cost_model!r}")
        if self.cost_model == "pipedream" and self.chunks > 1:
            raise ConfigError("cost_model='pipedream' knows one stage per device; use cost_model='pipeplan'")
        if self.num_stages is not None and self.num_stages < 1:
            raise ConfigError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.num_stages is not None and self.num_stages % self.chunks:
            raise ConfigError(f"num_stages ({self.num_stages}) must be a multiple of --chunks ({self.chunks})")
        if self.memory_limit_microbatches is not None and self.memory_limit_microbatches < 1:
            raise ConfigError(f"--memory-limit must be >= 1, got {self.memory_limit_microbatches}")
        if self.max_layer_groups < 2:
            raise ConfigError(f"max_layer_groups must be >= 2, got {self.max_layer_groups}")
        bytes_per_param = self.optimizer_bytes_per_param  # validates
        assert bytes_per_param >= 0

    @property
    def optimizer_bytes_per_param(self) -> float:
        return bytes_per_param(self.optimizer, self.precision)

    @property
    def splits_backward(self) -> bool:
        """True when the schedule runs I and W separately (compute = F + I + W, else F + B)."""
        return schedule_info(self.schedule).split_backward
