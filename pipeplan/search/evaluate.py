"""A search candidate evaluated into a predicted step — or a rejection saying why it cannot run.

Evaluation: partition the (batch-scaled) profile onto one pipeline's devices (pipeplan.partition, which screens
memory with a per-stage bound), generate the schedule with the partition's per-stage costs (zb-auto under the
activation bytes left after static memory), settle recomputation on the exact peaks, then build what the step is
predicted from (`predict.StepInputs`: the op lists `run` executes — replicated stages as their expanded per-replica
lists, every op at its full single-device time — per stage its gradient exchange over its holders and optimizer
update, per device its static bytes) and predict it (`predict.predict`, through the post-validation policy
`search.post_validation.settled_prediction`): the period of its steps, each device's peak bytes.

Memory: the simulator's per-device peak in bytes (static bytes of the stages the device holds — weights, gradients,
optimizer state, the state split over a stage's holders under ZeRO-1: `predict.memory.StaticRule` — plus the most
live activation bytes, F adding what a stage keeps, I freeing what the profile says it frees, W the rest, B all,
recomputation re-creating its bytes while I or B runs; the undo copy when post-validated) is the one figure checked
against the usable memory (the device's less the search's reserve) and reported.

Options per candidate (`zero`, `recompute`; search/variants.py tries them): ZeRO-1 shards the optimizer state and
replaces each stage's gradient all-reduce by a reduce-scatter + all-gather (`costs.comm.gradient_sync_ms`);
`recompute="auto"` lets the partitioner give each stage its cheapest fitting recomputation mode, which
`search.recompute_choice` then settles on the simulator's exact peaks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipeplan.cluster import Cluster
from pipeplan.costs import transfer_ms
from pipeplan.errors import ScheduleError
from pipeplan.partition.result import Partition
from pipeplan.predict.gradient_sync import SyncGroup, stage_allreduce_ms, stage_optimizer_ms, step_checks_ms
from pipeplan.predict.layout import PipelineLayout, pipeline_layout
from pipeplan.predict.memory import (
    StaticRule,
    activation_budget,
    memory_costs,
    stage_expert_counts,
    with_weight_versions,
)
from pipeplan.predict.predict import StepInputs, simulate_step
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.placement import stage_copies
from pipeplan.schedules.registry import async_stream_steps, generate, schedule_info
from pipeplan.schedules.simulate import StageCosts
from pipeplan.search.candidate import (
    Evaluation,
    Layout,
    Rejection,
    engine_recompute,
    partition_config,
    partition_layout,
)
from pipeplan.search.config import SearchConfig
from pipeplan.search.post_validation import may_post_validate, settled_prediction
from pipeplan.search.recompute_choice import settle_recompute
from pipeplan.units import format_bytes


def evaluate(
    layout: Layout,
    profile: Profile,
    cluster: Cluster,
    config: SearchConfig,
    *,
    memory_limit: int,
    zero: int = 0,
    recompute: str = "none",
) -> Evaluation | Rejection:
    """Partition, schedule and simulate `layout` (`profile` already scaled to its microbatch size) under `config`
    with the memory options `zero` and `recompute`; peaks are checked against `memory_limit` per device."""
    part = partition_layout(layout, profile, cluster, config, memory_limit=memory_limit, zero=zero, recompute=recompute)
    if isinstance(part, Rejection):
        return part
    return evaluate_partition(
        layout, part, profile, cluster, config, memory_limit=memory_limit, zero=zero, recompute=recompute
    )


def evaluate_partition(
    layout: Layout,
    part: Partition,
    profile: Profile,
    cluster: Cluster,
    config: SearchConfig,
    *,
    memory_limit: int,
    zero: int = 0,
    recompute: str = "none",
) -> Evaluation | Rejection:
    """Generate `part`'s schedule, settle its recompute modes (auto), simulate its op lists (transfers blocking unless
    `config.overlap.p2p`), check the peaks against `memory_limit` and predict its period
    (`search.post_validation.settled_prediction`)."""
    rule = StaticRule(numerics=config.numerics, zero=zero, holders=layout.holders, ep=layout.expert_parallel)
    experts = stage_expert_counts(part, profile)
    per_param = rule.per_param([s.param_count for s in part.stages], experts, part.replicas)
    eager = may_post_validate(config.post_validate, layout.schedule, zero)
    made = _schedule_layout(layout, part, profile, cluster, config, (per_param, memory_limit), eager)
    if isinstance(made, Rejection):
        return made
    schedule, pipe = made
    counts = [s.param_count for s in part.stages]
    static = rule.device_bytes(counts, experts, part.replicas, pipe.device_stages)
    if recompute != "none":
        settle_config = partition_config(layout, config, zero=zero, recompute=recompute)
        part = settle_recompute(part, profile, pipe, static, memory_limit, settle_config)
    memory = replace(memory_costs(part, profile, per_layer=engine_recompute(layout, config)), static_bytes=static)
    inputs = StepInputs(
        schedule=layout.schedule,
        pipeline=pipe,
        num_stages=part.num_stages,
        num_microbatches=layout.num_microbatches,
        costs=_stage_costs(part, profile, cluster, pipe=pipe),
        memory=with_weight_versions(memory, layout.schedule, counts, config.numerics),  # asynchronous: stashes
        param_counts=tuple(counts),
        **_step_end(layout, part, profile, cluster, config, zero),
        numerics=config.numerics,
        overlap=config.overlap,
    )
    timeline = simulate_step(inputs)
    reject = lambda b: _memory_rejection(layout, part, pipe, b, memory_limit)  # noqa: E731
    found = settled_prediction(inputs, timeline, mode=config.post_validate, zero=zero, reject=reject)
    if isinstance(found, Rejection):
        return found
    return Evaluation(
        layout=layout,
        partition=part,
        schedule=schedule,
        inputs=inputs,
        prediction=found,
        samples_per_s=config.global_batch_size / found.step_ms * 1000.0,
        zero=zero,
    )


def _step_end(
    layout: Layout, part: Partition, profile: Profile, cluster: Cluster, config: SearchConfig, zero: int
) -> dict[str, Any]:
    """Per stage, its gradient exchange over its holders and its optimizer update, and the global checks a
    synchronized step ends with (`predict.gradient_sync`)."""
    group = SyncGroup(
        data_parallel=layout.data_parallel,
        context_parallel=layout.context_parallel,
        expert_parallel=layout.expert_parallel,
        mirrored=stage_copies(schedule_info(layout.schedule).placement) > 1,  # dualpipe: each stage's two copies
    )
    numerics = config.numerics
    return dict(
        stage_sync_ms=stage_allreduce_ms(profile, cluster, part, group, numerics=numerics, zero=zero),
        stage_optimizer_ms=stage_optimizer_ms(part, profile, numerics=numerics, zero=zero, group=group),
        step_checks_ms=step_checks_ms(profile),
    )


def _schedule_layout(
    layout: Layout,
    part: Partition,
    profile: Profile,
    cluster: Cluster,
    config: SearchConfig,
    static: tuple[float | tuple[float, ...], int],
    eager: bool,
) -> tuple[Schedule, PipelineLayout] | Rejection:
    """The schedule for `part` (zb-auto generated under the activation bytes left after static memory: `static` is
    (static bytes per parameter, the memory limit)) and the op lists of one pipeline, or why there are none."""
    auto = schedule_info(layout.schedule).within_memory_limit  # zb-auto: generated under the byte budget
    devices = part.num_stages // part.chunks
    per_param, limit = static
    try:
        schedule = generate(
            layout.schedule,
            num_devices=devices,
            num_microbatches=layout.num_microbatches,
            chunks=part.chunks,
            costs=_stage_costs(part, profile, cluster, pipe=None),
            memory=memory_costs(part, profile, per_layer=engine_recompute(layout, config)) if auto else None,
            memory_limit=activation_budget(part, per_param, limit) if auto else None,
            steps=async_stream_steps(layout.schedule, devices, layout.num_microbatches),
            post_validate=eager,  # zb-auto, zbv: ranked by the period the run may have
        )
        pipe = pipeline_layout(schedule, part.replicas, tuple(s.devices for s in part.stages))
    except ScheduleError as exc:
        return Rejection(layout=layout, kind="schedule", reason=str(exc))
    assert all(pipe.placed_as_partitioned(s.index, s.devices) for s in part.stages), "partition and placement differ"
    if pipe.num_devices < layout.pipeline_devices and (layout.data_parallel > 1 or cluster.num_nodes > 1):
        # idle devices would break the rank layout of several pipelines / nodes; other layouts cover this case
        reason = f"the partition uses {pipe.num_devices} of {layout.pipeline_devices} devices per pipeline"
        return Rejection(layout=layout, kind="topology", reason=reason)
    return schedule, pipe


def _memory_rejection(
    layout: Layout, part: Partition, pipe: PipelineLayout, device_bytes: tuple[int, ...], limit: int
) -> Rejection | None:
    """None when every device's simulated peak fits; else the rejection, with a partitioner budget that screens
    out this partition (its worst device's screened bytes scaled by limit / simulated peak)."""
    worst = max(range(len(device_bytes)), key=lambda d: device_bytes[d])
    if device_bytes[worst] <= limit:
        return None
    stage = pipe.device_stages[worst][0]
    screened = sum(part.stages[s].memory_bytes for s in pipe.device_stages[worst])
    budget = min(limit, screened) * limit / device_bytes[worst]
    return Rejection(
        layout=layout,
        kind="memory",
        needed_memory_bytes=None,
        retry_budget_bytes=int(budget),
        reason=(
            f"out of memory on pipeline device {worst} (stage {stage}) by {format_bytes(device_bytes[worst] - limit)}"
            " (simulated peak: static + live activations)"
        ),
    )


def _stage_costs(part: Partition, profile: Profile, cluster: Cluster, pipe: PipelineLayout | None) -> StageCosts:
    """Per-stage op times on one device (a replica runs each of its ops in full) and the transfer across each
    boundary: the cut's bytes over the link between the two stages' devices (inter-node if any pair crosses a
    node; intra-node before the layout is known)."""
    comm = []
    for stage in part.stages[:-1]:
        link = cluster.intra_link
        if pipe is not None:
            link = cluster.link_between(pipe.stage_devices(stage.index) + pipe.stage_devices(stage.index + 1))
        comm.append(transfer_ms(profile.cut_bytes[stage.last_layer], link))
    return StageCosts(
        forward_ms=tuple(s.forward_ms for s in part.stages),
        input_grad_ms=tuple(s.input_grad_ms for s in part.stages),
        weight_grad_ms=tuple(s.weight_grad_ms for s in part.stages),
        backward_ms=tuple(s.backward_ms for s in part.stages),
        comm_ms=tuple(comm),
    )
