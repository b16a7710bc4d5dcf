"""`Level`: one level of the partitioner's search (devices or nodes, their links, the memory limit), what the
one-level DP (`partition.single`) and the straight-pipeline stage times (`partition.straight`) both read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.cluster import Link
from pipeplan.costs import LayerArrays, StageCostModel
from pipeplan.partition.config import PartitionConfig


@dataclass(frozen=True, kw_only=True)
class Level:
    """One DP level: `units` devices (or nodes), the link between consecutive stages, the node size for
    straight pipelines that cross node boundaries (device d starts a node when d % devices_per_node == 0)."""

    arrays: LayerArrays
    config: PartitionConfig
    units: int
    intra: Link
    inter: Link
    devices_per_node: int
    memory_limit: float

    @property
    def model(self) -> StageCostModel:
        return StageCostModel(
            arrays=self.arrays,
            config=self.config,
            link=self.replica_link,
            num_microbatches=self.config.num_microbatches,
        )

    @property
    def replica_link(self) -> Link:
        return self.intra if self.units <= self.devices_per_node else self.inter

    def crosses_node(self, device):
        """(input cut crosses a node, output cut does) for the stage on `device` of a straight pipeline: the device
        starts a node (and is not the first) / ends one. Elementwise."""
        d, g = np.asarray(device), self.devices_per_node
        return (d % g == 0) & (d > 0), (d + 1) % g == 0

    @property
    def exact_units(self) -> bool:
        return self.config.cost_model == "pipedream"
