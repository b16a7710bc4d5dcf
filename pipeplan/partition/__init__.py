"""The dynamic programs: stage cuts, replication, chunk placement, the memory screen (formulas from pipeplan.costs).

Public API: `partition(profile, cluster, config) -> Partition`, `PartitionConfig`,
`bytes_per_param` (costs.optimizer), `uniform_partition`, `parameter_balanced_partition`.
PipeDream's graph.txt reader lives in pipeplan.profiling.pipedream.
"""

from pipeplan.cluster import Cluster
from pipeplan.costs import bytes_per_param
from pipeplan.partition.baselines import parameter_balanced_partition, uniform_partition
from pipeplan.partition.config import PartitionConfig
from pipeplan.partition.partitioner import partition
from pipeplan.partition.result import Partition, StageAssignment

__all__ = [
    "Cluster",
    "Partition",
    "PartitionConfig",
    "StageAssignment",
    "bytes_per_param",
    "parameter_balanced_partition",
    "partition",
    "uniform_partition",
]
