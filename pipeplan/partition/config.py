"""PartitionConfig: what the partitioner optimizes for (microbatches, schedule, replication, optimizer, cost model).

Optimizer memory is counted per parameter (weights + gradients + optimizer state, activations excluded) by
`pipeplan.costs.optimizer.bytes_per_param(numerics)`, where the byte table is; `numerics` (precision and optimizer)
is the caller's (the command decides it; there is no default here).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.costs.optimizer import Numerics, bytes_per_param, check_zero_stage
from pipeplan.costs.recompute import RECOMPUTE_CHOICES, modes_for
from pipeplan.errors import ConfigError
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
    recompute: `none`, or `auto`: each stage takes the recomputation mode (`costs.recompute`) that passes the
    memory screen with the least added time (none first on ties), so cuts and modes are chosen together.
    zero / data_parallel: ZeRO stage and the number of data-parallel pipelines; with zero 1 a stage's optimizer
    state is split over its replicas in every pipeline (replicas x data_parallel devices) in the memory screen.
    memory_limit_bytes: what the memory screen lets a device hold (the search's usable memory, or a tighter retry
    budget); None: the cluster's memory per device.
    """

    num_microbatches: int
    numerics: Numerics  # the precision and optimizer the static bytes are counted for
    schedule: str = "1f1b"
    chunks: int | None = None
    mode: str | None = None
    num_stages: int | None = None
    cost_model: str = "pipeplan"
    memory_limit_microbatches: int | None = None
    max_layer_groups: int = 128
    recompute: str = "none"
    zero: int = 0
    data_parallel: int = 1
    expert_parallel: int = 1  # routed experts split over ep of the data_parallel holders (costs.memory)
    layer_recompute: bool = False  # full recomputation layer by layer, as the engines run analytic plans
    memory_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ConfigError(f"--microbatches must be >= 1, got {self.num_microbatches}")
        info = schedule_info(self.schedule)
        if self.chunks is not None and self.chunks < 1:
            raise ConfigError(f"--chunks must be >= 1, got {self.chunks}")
        chunks = info.default_chunks if self.chunks is None else self.chunks
        object.__setattr__(self, "chunks", chunks)
        if self.mode is None:
            object.__setattr__(self, "mode", "straight" if chunks > 1 else "replicated")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "replicated" and chunks > 1:
            raise ConfigError(f"schedule {self.schedule} places {chunks} chunks per device; use mode='straight'")
        if self.cost_model not in COST_MODELS:
            raise ConfigError(f"cost_model must be one of {', '.join(COST_MODELS)}, got {self.cost_model!r}")
        if self.cost_model == "pipedream" and chunks > 1:
            raise ConfigError("cost_model='pipedream' knows one stage per device; use cost_model='pipeplan'")
        if self.num_stages is not None and self.num_stages < 1:
            raise ConfigError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.num_stages is not None and self.num_stages % chunks:
            raise ConfigError(f"num_stages ({self.num_stages}) must be a multiple of --chunks ({chunks})")
        if self.memory_limit_microbatches is not None and self.memory_limit_microbatches < 1:
            raise ConfigError(f"--memory-limit must be >= 1, got {self.memory_limit_microbatches}")
        if self.max_layer_groups < 2:
            raise ConfigError(f"max_layer_groups must be >= 2, got {self.max_layer_groups}")
        bytes_per_param = self.optimizer_bytes_per_param  # validates
        assert bytes_per_param >= 0
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE_CHOICES)}, got {self.recompute!r}")
        if self.recompute != "none" and self.cost_model == "pipedream":
            raise ConfigError("cost_model='pipedream' models no recomputation; use recompute='none'")
        if self.data_parallel < 1:
            raise ConfigError(f"data_parallel must be >= 1, got {self.data_parallel}")
        check_zero_stage(self.zero)
        self.static_bytes_per_param(1)  # validates the optimizer for ZeRO
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ConfigError(f"memory_limit_bytes must be positive, got {self.memory_limit_bytes}")

    @property
    def optimizer_bytes_per_param(self) -> float:
        return bytes_per_param(self.numerics)

    def static_bytes_per_param(self, group_size):
        """Weights + gradients + optimizer state per parameter on one device of a group of `group_size` devices
        holding the same parameters (`costs.optimizer.bytes_per_param`; the group matters only with zero 1)."""
        if not self.zero:
            return self.optimizer_bytes_per_param
        return bytes_per_param(self.numerics, zero=self.zero, group_size=group_size)

    def memory_limit(self, cluster) -> float:
        """The memory screen's limit per device on `cluster` (`memory_limit_bytes`, else its memory)."""
        return float(cluster.memory_per_device if self.memory_limit_bytes is None else self.memory_limit_bytes)

    @property
    def recompute_modes(self) -> tuple[str, ...]:
        """The modes each stage may take, cheapest first."""
        return modes_for(self.recompute)

    @property
    def splits_backward(self) -> bool:
        """True when the schedule runs I and W separately (compute = F + I + W, else F + B)."""
        return schedule_info(self.schedule).split_backward

    @property
    def num_chunks(self) -> int:
        """`chunks` as resolved by __post_init__ (None given: the schedule's default)."""
        assert self.chunks is not None, "PartitionConfig.__post_init__ resolves chunks"
        return self.chunks

    @property
    def stage_mode(self) -> str:
        """`mode` as resolved by __post_init__ (None given: straight for chunked schedules, else replicated)."""
        assert self.mode is not None, "PartitionConfig.__post_init__ resolves mode"
        return self.mode
