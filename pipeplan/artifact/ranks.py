"""A plan's rank map: one pipeline's devices (`predict.layout.PipelineLayout`) tiled `data_parallel` times over the
global ranks. Rank `r` belongs to pipeline `r // P` at pipeline device `r % P` (P devices per pipeline), so a
pipeline's devices are consecutive and stay inside a node whenever P divides the devices per node. With tensor or
context parallelism a rank stands for a group of t x cp consecutive devices (`cluster.DeviceGroups`): rank r holds
devices r·t·cp .. r·t·cp + t·cp - 1, and its node is that of its first device."""

from __future__ import annotations

from pipeplan.artifact.plan import RankInfo
from pipeplan.cluster import Cluster, DeviceGroups
from pipeplan.predict.layout import PipelineLayout


def rank_infos(
    layout: PipelineLayout, data_parallel: int, cluster: Cluster, groups: DeviceGroups = DeviceGroups()
) -> tuple[RankInfo, ...]:
    """Every rank of `data_parallel` pipelines laid out as `layout` on `cluster`'s devices, a rank standing for one of
    `groups` (t x cp consecutive devices); its node is its first device's."""
    per_pipeline = layout.num_devices
    return tuple(
        RankInfo(
            rank=rank,
            node=cluster.node_of(rank * groups.size),
            pipeline=rank // per_pipeline,
            stages=layout.device_stages[rank % per_pipeline],
            stage_replica=layout.device_replica[rank % per_pipeline],
        )
        for rank in range(per_pipeline * data_parallel)
    )
