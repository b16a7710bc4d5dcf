"""Baseline splits to compare the DP against, scored with the same cost model (straight pipelines, no replicas).

- `uniform_partition`: the same number of layers per stage (the first `L mod P` stages get one more), what
  GPipe-style `balance=[L/P]*P` and torch.distributed.pipelining's even split do.
- `parameter_balanced_partition`: DeepSpeed's default `partition_method="parameters"`: contiguous stages whose
  largest parameter count is as small as possible (the min-max split of the parameter counts, solved exactly by the
  same DP on parameter counts instead of times).
- `even_blocks_partition`: Megatron-LM's split of a transformer stack: the blocks in equal runs (the first
  `blocks mod S` stages one more), the embedding with the first stage and the LM head with the last (what
  `--pipeline-model-parallel-size` with `--num-layers-per-virtual-pipeline-stage` does).

Both use P = config.num_stages, or min(layers, devices x chunks), and ignore memory limits (their memory is
reported in the Partition, not enforced).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pipeplan.cluster import Cluster
from pipeplan.costs import LayerArrays
from pipeplan.partition import dp, single
from pipeplan.partition.chunks import chunk_level
from pipeplan.partition.config import PartitionConfig
from pipeplan.partition.partitioner import build_partition, one_level
from pipeplan.partition.result import Partition
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.registry import stage_device


def _num_stages(arrays: LayerArrays, cluster: Cluster, config: PartitionConfig) -> int:
    if config.num_stages is not None:
        return min(config.num_stages, arrays.num_items)
    p = min(cluster.num_devices, arrays.num_items // config.num_chunks)
    return max(p, 1) * config.num_chunks if config.num_chunks > 1 else min(cluster.num_devices, arrays.num_items)


def _score(arrays: LayerArrays, cluster: Cluster, config: PartitionConfig, stages: single.Stages) -> Partition:
    straight = dataclasses.replace(config, mode="straight")
    if config.num_chunks > 1:
        p = len(stages) // config.num_chunks
        level = chunk_level(arrays, cluster, straight, float("inf"), spans_nodes=p > cluster.devices_per_node)
        raw = single.describe(level, stages)
        placement = stage_device(config.schedule, p, config.num_chunks)
        raw = [dataclasses.replace(st, devices=(placement[s],)) for s, st in enumerate(raw)]
    else:
        raw = single.describe(one_level(arrays, cluster, straight, float("inf")), stages)
    objective = max(st.time_ms for st in raw)
    return build_partition(arrays, cluster, straight, raw, objective=objective, layer_groups=arrays.num_items)


def uniform_partition(profile: Profile, cluster: Cluster, config: PartitionConfig) -> Partition:
    """Equal layer counts per stage, one device per stage."""
    arrays = LayerArrays.from_profile(profile)
    p = _num_stages(arrays, cluster, config)
    sizes = [arrays.num_items // p + (1 if s < arrays.num_items % p else 0) for s in range(p)]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    stages = [(int(starts[s]), int(starts[s + 1]) - 1, 1) for s in range(p)]
    return _score(arrays, cluster, config, stages)


def cut_partition(profile: Profile, cluster: Cluster, config: PartitionConfig, lasts: list[int]) -> Partition:
    """The straight partition whose stage s ends at layer `lasts[s]` (its last layer, inclusive), scored."""
    arrays = LayerArrays.from_profile(profile)
    firsts = [0, *[last + 1 for last in lasts[:-1]]]
    return _score(arrays, cluster, config, [(a, b, 1) for a, b in zip(firsts, lasts, strict=True)])


def even_blocks_partition(
    profile: Profile,
    cluster: Cluster,
    config: PartitionConfig,
    num_stages: int,
    blocks_per_stage: tuple[int, ...] | None = None,
) -> Partition:
    """Megatron's split of an embedding, blocks and a head into `num_stages` stages (module docstring), or the
    given blocks per stage (Megatron's `--pipeline-model-parallel-layout`): 0 blocks in the first stage leaves it
    the embedding alone, 0 in the last the head alone (the callers check the counts)."""
    blocks = profile.num_layers - 2
    sizes = blocks_per_stage or [
        blocks // num_stages + (1 if s < blocks % num_stages else 0) for s in range(num_stages)
    ]
    assert len(sizes) == num_stages and sum(sizes) == blocks, (sizes, blocks)
    lasts = [int(v) for v in np.cumsum(sizes)]  # block s ends at layer lasts[s] (layer 0 is the embedding)
    lasts[-1] = profile.num_layers - 1  # the head joins the last stage
    return cut_partition(profile, cluster, config, lasts)


def parameter_balanced_partition(profile: Profile, cluster: Cluster, config: PartitionConfig) -> Partition:
    """Contiguous stages minimizing the largest parameter count (DeepSpeed partition_method='parameters')."""
    arrays = LayerArrays.from_profile(profile)
    p = _num_stages(arrays, cluster, config)

    def times(last: int) -> np.ndarray:
        counts = arrays.span("param_count", np.arange(last + 1), last)
        return np.broadcast_to(counts[:, None], (last + 1, p))

    table = dp.straight_dp(arrays.num_items, p, times)
    return _score(arrays, cluster, config, dp.backtrack(table, arrays.num_items, p))
