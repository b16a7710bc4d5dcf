"""What the cost formulas need to know of a search's or partitioner's options, stated as a protocol so that the
formulas stand below the partitioner (`partition.config.PartitionConfig` provides it)."""

from __future__ import annotations

from typing import Protocol


class CostOptions(Protocol):
    """The options a stage's time and memory screen depend on."""

    @property
    def cost_model(self) -> str:  # `pipeplan` or `pipedream`
        ...

    @property
    def data_parallel(self) -> int:  # data-parallel pipelines (ZeRO-1 shards over replicas x these)
        ...

    @property
    def splits_backward(self) -> bool:  # the schedule runs I and W as separate ops
        ...

    @property
    def recompute_modes(self) -> tuple[str, ...]:  # the recomputation modes a stage may take, cheapest first
        ...

    @property
    def layer_recompute(self) -> bool:  # full recomputation layer by layer (the engines), not whole stages
        ...

    @property
    def expert_parallel(self) -> int:  # ranks the routed experts are split over (ZeRO-1: their state over group / ep)
        ...

    def static_bytes_per_param(self, group_size):  # weights + gradients + optimizer state per parameter
        ...
