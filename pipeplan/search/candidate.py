"""One search candidate: a layout (microbatch size, data-parallel pipelines, devices per pipeline, microbatches,
schedule, replication mode) evaluated into a predicted step — or a rejection saying why it cannot run.

Evaluation: partition the (batch-scaled) profile onto one pipeline's devices (pipeplan.partition, which screens
memory with a per-stage bound), generate the schedule with the partition's per-stage costs (zb-auto under the
activation bytes left after static memory), simulate one step of the op lists `run` executes — replicated stages
as their expanded per-replica lists (pipeplan.schedules.replicate), every op at its full single-device time — and
add the gradient all-reduce that follows the pipeline flush: every stage's replicas across all pipelines reduce
that stage's gradients (ring all-reduce, `partition.costs.allreduce_ms`); a device reduces its stages (chunks) in
turn and the devices reduce in parallel, so the step pays the busiest device.

Memory: the simulator's per-device peak in bytes (`Timeline.peak_memory_bytes`: static bytes of the stages the
device holds — weights, gradients, optimizer state, `partition.costs.static_bytes`, the state split over a stage's
replicas in every pipeline under ZeRO-1 — plus the most live activation bytes, F adding what a stage keeps, I
freeing what the profile says it frees, W the rest, B all, recomputation re-creating its bytes while I or B runs)
is the one figure checked against the device memory (less the search's reserve) and reported.

Options per candidate (`zero`, `recompute`; search/variants.py tries them): ZeRO-1 shards the optimizer state and
replaces each stage's gradient all-reduce by a reduce-scatter + all-gather (`costs.comm.gradient_sync_ms`);
`recompute="auto"` lets the partitioner give each stage its cheapest fitting recomputation mode, which
`planner.recompute_choice` then settles on the simulator's exact peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeplan.cluster import Cluster
from pipeplan.costs import (
    LayerArrays,
    compute_ms,
    device_static_bytes,
    transfer_ms,
)
from pipeplan.costs.overlap import Overlap
from pipeplan.errors import InfeasibleError, ScheduleError
from pipeplan.partition.config import PartitionConfig
from pipeplan.partition.partitioner import min_memory_per_device, partition
from pipeplan.partition.result import Partition
from pipeplan.plan.asynchronous import with_weight_versions
from pipeplan.plan.layout import PipelineLayout, pipeline_layout, simulate_layout, transfer_costs
from pipeplan.precision import get_precision
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.registry import async_stream_steps, default_chunks, generate, schedule_info
from pipeplan.schedules.simulate import MemoryCosts, StageCosts, Timeline
from pipeplan.search.gradient_sync import allreduce_step_ms, post_validation_allowed
from pipeplan.search.period_end import period_end
from pipeplan.search.recompute_choice import settle_recompute
from pipeplan.search.stage_memory import activation_budget, memory_costs, stage_bytes_per_param
from pipeplan.units import format_bytes

STRAIGHT = "straight"
NO_OVERLAP = Overlap()
REPLICATED = "replicated"


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What the search enumerates; `label` is how summaries name it."""

    schedule: str
    microbatch_size: int
    data_parallel: int
    pipeline_devices: int
    num_microbatches: int
    mode: str = STRAIGHT
    tensor_parallel: int = 1  # devices per tensor-parallel group
    context_parallel: int = 1  # tensor-parallel groups per context-parallel group; a search device is t x cp
    expert_parallel: int = 1  # ranks of pipelines x cp the routed experts are split over
    chunks: int | None = None  # stages per device of a looped schedule (interleaved's v); None: the schedule's

    @property
    def holders(self) -> int:
        """Ranks of a stage replica that hold the same parameters: one per pipeline and per context-parallel rank
        (ZeRO-1 shards the optimizer state over them; the gradient exchange runs over them)."""
        return self.data_parallel * self.context_parallel

    @property
    def num_chunks(self) -> int:
        """Stages (chunks) per pipeline device: one when replicated, else `chunks` or the schedule's default."""
        if self.mode == REPLICATED:
            return 1
        return self.chunks or default_chunks(self.schedule)

    @property
    def label(self) -> str:
        """e.g. `1f1b 4x2 m=8 b=1`: P devices per pipeline x D pipelines, m microbatches of b samples; with tensor
        and context parallelism ` t=8 cp=2` (each of the P x D pipeline devices a group of 16 devices)."""
        suffix = " replicated" if self.mode == REPLICATED else ""
        tensor = f" t={self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        tensor += f" cp={self.context_parallel}" if self.context_parallel > 1 else ""
        tensor += f" ep={self.expert_parallel}" if self.expert_parallel > 1 else ""
        tensor += f" v={self.chunks}" if self.chunks and self.chunks != default_chunks(self.schedule) else ""
        return (
            f"{self.schedule} {self.pipeline_devices}x{self.data_parallel} m={self.num_microbatches} "
            f"b={self.microbatch_size}{tensor}{suffix}"
        )


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """A candidate that fits: its partition, schedule, per-pipeline-device layout and predicted step."""

    layout: Layout
    partition: Partition
    schedule: Schedule
    pipeline: PipelineLayout
    costs: StageCosts  # per stage: one op's time on one device; comm_ms per boundary (before `transfer_costs`)
    memory: MemoryCosts  # per stage activation bytes, per pipeline device static bytes, as simulated
    timeline: Timeline
    stage_allreduce_ms: tuple[float, ...]  # per stage, after the pipeline flush (ZeRO-1: its exchange)
    stage_optimizer_ms: tuple[float, ...]  # per stage, its optimizer update on one of its devices
    step_ms: float
    samples_per_s: float
    device_memory_bytes: tuple[int, ...]  # the simulator's peak per pipeline device (static + activations)
    zero: int = 0  # ZeRO stage the memory and gradient exchange were counted with
    overlap: Overlap = NO_OVERLAP  # communication overlap the step was timed with
    post_validate: bool = False  # step_ms is the period of post-validated steps (`run --post-validate`)

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.device_memory_bytes)

    @property
    def allreduce_ms(self) -> float:
        return allreduce_step_ms(self.partition, self.stage_allreduce_ms)

    def resimulate(self, costs: StageCosts) -> Timeline:
        """This candidate's op lists simulated again under other `costs` (e.g. free transfers), transfers blocking
        or not as its overlap says."""
        timed = transfer_costs(costs, self.pipeline, self.overlap)
        num_stages, m = self.partition.num_stages, self.layout.num_microbatches
        return simulate_layout(self.pipeline, self.schedule.name, num_stages, m, timed, self.memory)

    @property
    def label_with_replicas(self) -> str:
        """The layout's label, with the stages' replica counts when any stage is replicated, and ZeRO-1 /
        recomputation when used."""
        replicas = self.partition.replicas
        label = self.layout.label + (" zero1" if self.zero else "")
        recomputing = self.recomputing
        if recomputing:
            label += f" recompute {recompute_label(self.partition)}"
        if max(replicas) == 1:
            return label
        return f"{label} (replicas {','.join(map(str, replicas))})"

    @property
    def recomputing(self) -> int:
        """How many stages recompute activations."""
        return sum(s.recompute != "none" for s in self.partition.stages)


@dataclass(frozen=True, kw_only=True)
class Rejection:
    """Why a candidate lost. kind: memory | schedule | topology | duplicate | estimate | bound."""

    layout: Layout
    kind: str
    reason: str
    needed_memory_bytes: int | None = None  # a lower bound on the memory per device this candidate needs
    retry_budget_bytes: int | None = None  # simulated peak over memory: a tighter partitioner budget to try


def pipeline_cluster(cluster: Cluster, pipeline_devices: int) -> Cluster:
    """The cluster one pipeline sees: its own devices, same memory and links."""
    return replace(
        cluster, num_devices=pipeline_devices, devices_per_node=min(cluster.devices_per_node, pipeline_devices)
    )


def recompute_label(part: Partition) -> str:
    """The stages' recomputation modes, e.g. `full,full,none,none`."""
    return ",".join(s.recompute for s in part.stages)


def engine_recompute(layout: Layout, precision: str) -> bool:
    """Whether full recomputation runs layer by layer (`costs.recompute`): in the engines that run what pipeplan's
    runtime cannot (tensor or context parallel layouts, Megatron's mixed precision and FP8)."""
    analytic = bool(precision) and not get_precision(precision).runnable
    return analytic or layout.tensor_parallel * layout.context_parallel > 1


def partition_config(
    layout: Layout, optimizer: str | float, precision: str, *, zero: int = 0, recompute: str = "none"
) -> PartitionConfig:
    """Straight layouts use every pipeline device (P x chunks stages); replicated ones let the DP choose."""
    return PartitionConfig(
        layer_recompute=engine_recompute(layout, precision),
        num_microbatches=layout.num_microbatches,
        schedule=layout.schedule,
        mode=layout.mode,
        chunks=layout.num_chunks,
        num_stages=None if layout.mode == REPLICATED else layout.pipeline_devices * layout.num_chunks,
        optimizer=optimizer,
        precision=precision,
        zero=zero,
        data_parallel=layout.holders,
        expert_parallel=layout.expert_parallel,
        recompute=recompute,
    )


def min_memory_bytes(
    layout: Layout, profile: Profile, cluster: Cluster, *, optimizer: str | float, **options
) -> int | None:
    """Smallest memory per device for which the partitioner finds a partition of `layout` (None: none at all);
    `options`: precision, zero, recompute as `partition_config` takes them."""
    arrays = LayerArrays.from_profile(profile)
    return min_memory_per_device(
        arrays, pipeline_cluster(cluster, layout.pipeline_devices), partition_config(layout, optimizer, **options)
    )


def partition_layout(
    layout: Layout, profile: Profile, cluster: Cluster, *, optimizer: str | float, explain: bool = True, **options
) -> Partition | Rejection:
    """Stage cuts and replicas for `layout` from the partitioner (memory screened against
    `cluster.memory_per_device`), or why there are none (with the memory that would fit when `explain`);
    `options` as `partition_config` takes them."""
    try:
        config = partition_config(layout, optimizer, **options)
        part = partition(profile, pipeline_cluster(cluster, layout.pipeline_devices), config, explain=explain)
    except InfeasibleError as exc:
        return Rejection(layout=layout, kind="memory", reason=str(exc))
    except ScheduleError as exc:
        return Rejection(layout=layout, kind="schedule", reason=str(exc))
    if layout.mode == REPLICATED and part.num_stages == layout.pipeline_devices and max(part.replicas) == 1:
        return Rejection(layout=layout, kind="duplicate", reason="the same stages as without replication")
    return part


def stage_work_ms(part: Partition) -> tuple[float, ...]:
    """Per stage, one microbatch's compute as simulated: F + I + W split, F + B fused; / replicas."""
    split = schedule_info(part.schedule).split_backward
    return tuple(
        compute_ms(s.forward_ms, s.input_grad_ms, s.weight_grad_ms, s.backward_ms, split_backward=split) / s.replicas
        for s in part.stages
    )


def evaluate(
    layout: Layout, profile: Profile, cluster: Cluster, *, optimizer: str | float, global_batch_size: int, **options
) -> Evaluation | Rejection:
    """Partition, schedule and simulate `layout`; `profile` is already scaled to its microbatch size; `options`:
    precision, zero, recompute (`partition_config`)."""
    post_validate = options.pop("post_validate", "off")  # the period's, not the partitioner's
    part = partition_layout(layout, profile, cluster, optimizer=optimizer, **options)
    if isinstance(part, Rejection):
        return part
    batch = global_batch_size
    return evaluate_partition(
        layout,
        part,
        profile,
        cluster,
        optimizer=optimizer,
        global_batch_size=batch,
        post_validate=post_validate,
        **options,
    )


def evaluate_partition(
    layout: Layout,
    part: Partition,
    profile: Profile,
    cluster: Cluster,
    *,
    optimizer: str | float,
    global_batch_size: int,
    precision: str,
    zero: int = 0,
    recompute: str = "none",
    overlap: Overlap = NO_OVERLAP,
    post_validate: str = "off",
) -> Evaluation | Rejection:
    """Generate `part`'s schedule, settle its recompute modes (auto), simulate its op lists (transfers blocking unless
    `overlap.p2p`), check the peaks against the memory and predict its period (`search.period_end`)."""
    per_param = stage_bytes_per_param(
        part, layout.holders, optimizer, precision, zero, profile=profile, ep=layout.expert_parallel
    )
    eager = post_validate == "on" or (post_validate == "auto" and post_validation_allowed(layout.schedule, zero))
    made = _schedule_layout(layout, part, profile, cluster, per_param, precision, eager)
    if isinstance(made, Rejection):
        return made
    schedule, pipe = made
    static = device_static_bytes([s.param_count for s in part.stages], pipe.device_stages, per_param)
    if recompute != "none":
        config = partition_config(layout, optimizer, precision, zero=zero, recompute=recompute)
        part = settle_recompute(part, profile, pipe, static, cluster.memory_per_device, config)
    costs = _stage_costs(part, profile, cluster, pipe=pipe)
    per_layer = engine_recompute(layout, precision)
    memory = replace(memory_costs(part, profile, per_layer=per_layer), static_bytes=static)
    counts = [s.param_count for s in part.stages]  # asynchronous: stashed weight copies
    memory = with_weight_versions(memory, layout.schedule, counts, precision)
    timed = transfer_costs(costs, pipe, overlap)
    timeline = simulate_layout(pipe, schedule.name, part.num_stages, layout.num_microbatches, timed, memory)
    device_bytes = tuple(int(round(b)) for b in timeline.peak_memory_bytes)
    options = dict(optimizer=optimizer, precision=precision, zero=zero, overlap=overlap, post_validate=post_validate)
    reject = lambda b: _memory_rejection(layout, part, pipe, b, cluster.memory_per_device)  # noqa: E731
    ended = period_end(layout, part, pipe, timeline, profile, cluster, (timed, counts, device_bytes), options, reject)
    if isinstance(ended, Rejection):
        return ended
    device_bytes, (allreduce_ms, optimizer_ms, step_ms, bubble, post_validated) = ended
    timeline = replace(timeline, bubble_rate=bubble)  # the period's (asynchronous: the steady state's)
    return Evaluation(
        layout=layout,
        partition=part,
        schedule=schedule,
        pipeline=pipe,
        costs=costs,
        memory=memory,
        timeline=timeline,
        stage_allreduce_ms=allreduce_ms,
        stage_optimizer_ms=optimizer_ms,
        step_ms=step_ms,
        post_validate=post_validated,
        samples_per_s=global_batch_size / step_ms * 1000.0,
        device_memory_bytes=device_bytes,
        zero=zero,
        overlap=overlap,
    )


def _schedule_layout(
    layout: Layout, part: Partition, profile: Profile, cluster: Cluster, per_param, precision: str, eager: bool
) -> tuple[Schedule, PipelineLayout] | Rejection:
    """The schedule for `part` (zb-auto generated under the activation bytes left after static memory) and the
    op lists of one pipeline, or why there are none."""
    auto = schedule_info(layout.schedule).within_memory_limit  # zb-auto: generated under the byte budget
    devices = part.num_stages // part.chunks
    try:
        schedule = generate(
            layout.schedule,
            num_devices=devices,
            num_microbatches=layout.num_microbatches,
            chunks=part.chunks,
            costs=_stage_costs(part, profile, cluster, pipe=None),
            memory=memory_costs(part, profile, per_layer=engine_recompute(layout, precision)) if auto else None,
            memory_limit=activation_budget(part, cluster, per_param) if auto else None,
            steps=async_stream_steps(layout.schedule, devices, layout.num_microbatches),
            post_validate=eager,  # zb-auto, zbv: ranked by the period the run may have
        )
        pipe = pipeline_layout(schedule, part.replicas, tuple(s.devices for s in part.stages))
    except ScheduleError as exc:
        return Rejection(layout=layout, kind="schedule", reason=str(exc))
    assert all(pipe.stage_devices(s.index) == s.devices for s in part.stages), "partition and schedule placement differ"
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
