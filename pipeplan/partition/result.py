"""Partition: the partitioner's answer (stage layer ranges, replicas, devices, predicted costs) as plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

PARTITION_SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class StageAssignment:
    """One pipeline stage (a chunk, for chunked schedules). Times are per microbatch unless noted.

    forward_ms / input_grad_ms / weight_grad_ms / backward_ms: the stage's layers summed (one replica's work for one
    microbatch, not divided by replicas), I and B with the recomputation that runs before them (`recompute_ms`).
    comm_ms: transfer time of its input and output cuts per microbatch, divided by replicas. output_transfer_ms:
    latency + bytes / bandwidth of one microbatch's output cut (what a simulator charges between this stage and the
    next). allreduce_ms: the replicas' gradient all-reduce, once per step.
    time_ms: the stage's term in the objective (compute / replicas + all-reduce / microbatches, or communication,
    whichever is larger; the PipeDream formula under cost_model='pipedream'). memory_bytes: the partitioner's screen
    on one of its devices (static bytes + a bound on live activations, `costs.stage_memory_bytes`); the planner's
    figures are the simulator's exact peaks."""

    index: int
    first_layer: int
    last_layer: int  # inclusive
    replicas: int
    devices: tuple[int, ...]  # cluster device ids, one per replica
    forward_ms: float
    input_grad_ms: float
    weight_grad_ms: float
    backward_ms: float
    comm_ms: float
    allreduce_ms: float
    output_transfer_ms: float  # one microbatch's activations to the next stage, one way (0 for the last stage)
    time_ms: float
    inflight_microbatches: int  # per replica: most microbatches in flight (F run, W or B not), from the op order
    inflight_before_input_grad: int  # per replica: of those, most before their I (or B)
    param_count: int
    memory_bytes: int
    recompute: str = "none"  # activation recomputation mode (costs.recompute); none, selective or full
    recompute_ms: float = 0.0  # what it adds per microbatch, included in input_grad_ms and backward_ms

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1


@dataclass(frozen=True, kw_only=True)
class Partition:
    """objective_ms: the bottleneck, the largest stage `time_ms` (per microbatch; with chunks, the largest chunk).
    Under cost_model='pipedream' it is PipeDream's "time per stage" for one profiled minibatch (ms, not s).
    device_load_ms[d] / device_memory_bytes[d]: per cluster device id d (0..highest id used; a two-level plan may
    leave devices of a node idle, which show 0): the time_ms and memory of the stages (chunks) it runs, summed."""

    stages: tuple[StageAssignment, ...]
    num_layers: int
    num_devices: int  # distinct devices the pipeline uses (the cluster may have more)
    schedule: str
    chunks: int
    mode: str
    cost_model: str
    num_microbatches: int
    optimizer_bytes_per_param: float
    memory_limit_bytes: int  # the memory screen's limit per device it was planned for
    objective_ms: float
    device_load_ms: tuple[float, ...]
    device_memory_bytes: tuple[int, ...]
    layer_groups: int  # items the DP cut between (num_layers unless layers were grouped for a multi-node search)

    def __post_init__(self) -> None:
        assert self.stages and self.stages[0].first_layer == 0 and self.stages[-1].last_layer == self.num_layers - 1
        for prev, nxt in zip(self.stages, self.stages[1:]):
            assert nxt.first_layer == prev.last_layer + 1, "stages must cover the layers contiguously"

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(s.replicas for s in self.stages)

    @property
    def stage_ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple((s.first_layer, s.last_layer) for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {"schema_version": PARTITION_SCHEMA_VERSION, "num_stages": self.num_stages, **data}
