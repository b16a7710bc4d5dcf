"""Cost model and dynamic program: stage cuts, replication, chunk placement, memory check.

Public API: `partition(profile, cluster, config) -> Partition`, `PartitionConfig`, `OPTIMIZER_BYTES_PER_PARAM`,
`uniform_partition`, `parameter_balanced_partition`, `read_pipedream_graph`.
"""

from pipeplan.partition.api import partition
from pipeplan.partition.baselines import parameter_balanced_partition, uniform_partition
from pipeplan.partition.cluster import Cluster
from pipeplan.partition.config import OPTIMIZER_BYTES_PER_PARAM, PartitionConfig
from pipeplan.partition.pipedream import read_pipedream_graph
from pipeplan.partition.result import Partition, StageAssignment

__all__ = [
    "OPTIMIZER_BYTES_PER_PARAM",
    "Cluster",
    "Partition",
    "PartitionConfig",
    "StageAssignment",
    "parameter_balanced_partition",
    "partition",
    "read_pipedream_graph",
    "uniform_partition",
]
