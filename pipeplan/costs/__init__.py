"""The cost model: every formula that turns a profile and a cluster into milliseconds or bytes, in one place each.
Partition, planner, capacity and the plans `show` and `run` re-simulate all call these.

    link: latency + bytes / bandwidth; ring collectives   pipeplan.cluster.Link (Cluster picks intra/inter node)
    per-boundary transfer, all-reduce, reduce-scatter,    costs.comm: transfer_ms, allreduce_ms, reduce_scatter_ms,
    all-gather, ZeRO-1's exchange, all-to-all, in ms      all_gather_ms, zero1_exchange_ms; gradient_sync_ms
                                                          (all-reduce, or ZeRO-1's exchange); all_to_all_ms
    PipeDream's transfer and 4 (r-1) replication terms    costs.comm: pipedream_transfer_ms, pipedream_sync_ms
    compute per microbatch (F + I + W or F + B)           costs.stage: compute_ms (span_compute_ms over layers)
    an I or B op with recomputation                       costs.stage: backward_op_ms
    a stage's I and W op times (the model's first stage:  costs.stage: stage_grad_ms
    I only recomputes, W runs the whole backward)
    a stage's F, I, W, B and recomputation op times       costs.stage: stage_op_ms
    recomputation per stage: kept / re-created bytes,     costs.recompute: stage_kept_bytes,
    added time, which modes a stage may take              stage_recompute_bytes, stage_recompute_ms, mode_offered
    stage time (pipeplan / PipeDream)                     costs.stage: stage_ms, exposed_transfer_ms,
                                                          pipedream_stage_ms; StageCostModel for DP columns
    a device's stages one after another, the busiest      costs.stage: device_totals, busiest_device_ms
    bytes per parameter: weights + gradients +            costs.optimizer: sharded_bytes_per_param; the parts by
    optimizer state / shards (one formula)                mode (static_split, OPTIMIZER_STATES); bytes_per_param,
                                                          zero_bytes_per_param;
                                                          expert_bytes_per_param (expert data-parallel group)
    static memory (weights, gradients, optimizer state)   costs.memory: static_bytes (optimizer_state_bytes,
                                                          spread_static_bytes, device_static_bytes)
    in-flight microbatches per replica                    costs.memory: replica_share
    the partitioner's per-stage memory screen             costs.memory: stage_memory_bytes (per recompute
                                                          mode, ZeRO group); screened_recompute picks the mode
"""

from pipeplan.costs.arrays import LayerArrays, balanced_bounds
from pipeplan.costs.comm import (
    all_gather_ms,
    all_to_all_ms,
    allreduce_ms,
    gradient_sync_ms,
    pipedream_sync_ms,
    pipedream_transfer_ms,
    reduce_scatter_ms,
    transfer_ms,
    zero1_exchange_ms,
)
from pipeplan.costs.memory import (
    device_static_bytes,
    least_stage_memory_bytes,
    optimizer_state_bytes,
    replica_share,
    screened_recompute,
    spread_static_bytes,
    stage_memory_bytes,
    stage_optimizer_state_bytes,
    stage_static_per_param,
    static_bytes,
)
from pipeplan.costs.optimizer import (
    OPTIMIZER_NAMES,
    ZERO_STAGES,
    Numerics,
    bytes_per_param,
    check_zero_stage,
    expert_bytes_per_param,
    expert_holders,
    numerics,
    sharded_bytes_per_param,
    static_split,
    zero_bytes_per_param,
)
from pipeplan.costs.recompute import (
    RECOMPUTE_CHOICES,
    mode_offered,
    stage_freed_bytes,
    stage_kept_bytes,
    stage_recompute_bytes,
    stage_recompute_ms,
)
from pipeplan.costs.stage import (
    StageCostModel,
    StageOpMs,
    backward_op_ms,
    busiest_device_ms,
    compute_ms,
    device_totals,
    exposed_transfer_ms,
    pipedream_stage_ms,
    span_compute_ms,
    stage_grad_ms,
    stage_ms,
    stage_op_ms,
    stages_per_device,
)

__all__ = [
    "OPTIMIZER_NAMES",
    "RECOMPUTE_CHOICES",
    "ZERO_STAGES",
    "LayerArrays",
    "Numerics",
    "StageCostModel",
    "all_gather_ms",
    "all_to_all_ms",
    "expert_bytes_per_param",
    "expert_holders",
    "stage_optimizer_state_bytes",
    "stage_static_per_param",
    "backward_op_ms",
    "stage_grad_ms",
    "StageOpMs",
    "stage_op_ms",
    "allreduce_ms",
    "balanced_bounds",
    "busiest_device_ms",
    "bytes_per_param",
    "check_zero_stage",
    "compute_ms",
    "device_static_bytes",
    "device_totals",
    "exposed_transfer_ms",
    "gradient_sync_ms",
    "least_stage_memory_bytes",
    "mode_offered",
    "optimizer_state_bytes",
    "pipedream_stage_ms",
    "pipedream_sync_ms",
    "pipedream_transfer_ms",
    "reduce_scatter_ms",
    "replica_share",
    "numerics",
    "screened_recompute",
    "sharded_bytes_per_param",
    "span_compute_ms",
    "spread_static_bytes",
    "stage_freed_bytes",
    "stage_kept_bytes",
    "stage_memory_bytes",
    "stage_ms",
    "stage_recompute_bytes",
    "stage_recompute_ms",
    "stages_per_device",
    "static_bytes",
    "static_split",
    "transfer_ms",
    "zero1_exchange_ms",
    "zero_bytes_per_param",
]
