"""One search candidate: a layout (microbatch size, data-parallel pipelines, devices per pipeline, microbatches,
schedule, replication mode, t x cp x ep), its partition (`partition_layout`: the partitioner, which screens memory
with a per-stage bound) and, once evaluated (`search.evaluate`), its prediction — or a rejection saying why it cannot
run."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeplan.cluster import Cluster
from pipeplan.costs import LayerArrays, compute_ms
from pipeplan.costs.overlap import Overlap
from pipeplan.errors import InfeasibleError, ScheduleError
from pipeplan.partition.config import PartitionConfig
from pipeplan.partition.partitioner import min_memory_per_device, partition
from pipeplan.partition.result import Partition
from pipeplan.predict.layout import PipelineLayout
from pipeplan.predict.predict import Prediction, StepInputs, simulate_step
from pipeplan.predict.step import per_device
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.ops import Schedule
from pipeplan.schedules.placement import stage_copies
from pipeplan.schedules.registry import default_chunks, schedule_info
from pipeplan.schedules.simulate import MemoryCosts, StageCosts, Timeline
from pipeplan.search.config import SearchConfig

STRAIGHT = "straight"
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
        """Ranks of a stage replica that hold the same parameters: one per pipeline and per context-parallel rank,
        twice for a mirrored schedule (dualpipe's copy per direction); ZeRO-1 shards the optimizer state over them,
        the gradient exchange runs over them."""
        copies = stage_copies(schedule_info(self.schedule).placement)
        return self.data_parallel * self.context_parallel * copies

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
    """A candidate that fits: its partition, schedule, what its step is predicted from (`inputs`: layout, costs,
    memory, exchanges) and the prediction (`predict.predict`)."""

    layout: Layout
    partition: Partition
    schedule: Schedule
    inputs: StepInputs
    prediction: Prediction
    samples_per_s: float
    zero: int = 0  # ZeRO stage the memory and gradient exchange were counted with

    @property
    def pipeline(self) -> PipelineLayout:
        return self.inputs.pipeline

    @property
    def costs(self) -> StageCosts:
        """Per stage: one op's time on one device; comm_ms per boundary (before `transfer_costs`)."""
        return self.inputs.costs

    @property
    def memory(self) -> MemoryCosts:
        """Per stage activation bytes, per pipeline device static bytes, as simulated."""
        return self.inputs.memory

    @property
    def timeline(self) -> Timeline:
        """The first step (an asynchronous schedule's stream), its bubble rate the period's."""
        return self.prediction.timeline

    @property
    def stage_allreduce_ms(self) -> tuple[float, ...]:
        """Per stage, after the pipeline flush (ZeRO-1: its exchange)."""
        return self.inputs.stage_sync_ms

    @property
    def stage_optimizer_ms(self) -> tuple[float, ...]:
        """Per stage, its optimizer update on one of its devices."""
        return self.inputs.stage_optimizer_ms

    @property
    def step_ms(self) -> float:
        return self.prediction.step_ms

    @property
    def device_memory_bytes(self) -> tuple[int, ...]:
        """The simulated peak per pipeline device (static + activations, + the undo copy when post-validated)."""
        return self.prediction.device_memory_bytes

    @property
    def overlap(self) -> Overlap:
        return self.inputs.overlap

    @property
    def post_validate(self) -> bool:
        """Whether step_ms is the period of post-validated steps (`run --post-validate`)."""
        return self.prediction.post_validate

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.device_memory_bytes)

    @property
    def allreduce_ms(self) -> float:
        return max(per_device(self.stage_allreduce_ms, self.pipeline.device_stages))  # dualpipe: both copies

    def resimulate(self, costs: StageCosts) -> Timeline:
        """This candidate's op lists simulated again under other `costs` (e.g. free transfers), transfers blocking
        or not as its overlap says."""
        return simulate_step(replace(self.inputs, costs=costs))

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


def engine_recompute(layout: Layout, config: SearchConfig) -> bool:
    """Whether full recomputation runs layer by layer (`costs.recompute`): in the engines that run what pipeplan's
    runtime cannot (tensor or context parallel layouts, Megatron's mixed precision and FP8)."""
    return not config.numerics.precision.runnable or layout.tensor_parallel * layout.context_parallel > 1


def partition_config(
    layout: Layout, config: SearchConfig, *, zero: int = 0, recompute: str = "none", memory_limit: int | None = None
) -> PartitionConfig:
    """Straight layouts use every pipeline device (P x chunks stages); replicated ones let the DP choose; the memory
    screen holds a device to `memory_limit` (None: the cluster's memory)."""
    return PartitionConfig(
        layer_recompute=engine_recompute(layout, config),
        num_microbatches=layout.num_microbatches,
        schedule=layout.schedule,
        mode=layout.mode,
        chunks=layout.num_chunks,
        num_stages=None if layout.mode == REPLICATED else layout.pipeline_devices * layout.num_chunks,
        numerics=config.numerics,
        zero=zero,
        data_parallel=layout.holders,
        expert_parallel=layout.expert_parallel,
        recompute=recompute,
        memory_limit_bytes=memory_limit,
    )


def min_memory_bytes(
    layout: Layout,
    profile: Profile,
    cluster: Cluster,
    config: SearchConfig,
    *,
    zero: int = 0,
    recompute: str = "none",
    limit: int | None = None,
) -> int | None:
    """Smallest memory per device for which the partitioner finds a partition of `layout` (None: none at all),
    searched up from `limit` when none fits within it (None: the cluster's memory)."""
    arrays = LayerArrays.from_profile(profile)
    pipe = pipeline_cluster(cluster, layout.pipeline_devices)
    part_config = partition_config(layout, config, zero=zero, recompute=recompute, memory_limit=limit)
    return min_memory_per_device(arrays, pipe, part_config)


def partition_layout(
    layout: Layout,
    profile: Profile,
    cluster: Cluster,
    config: SearchConfig,
    *,
    memory_limit: int,
    zero: int = 0,
    recompute: str = "none",
    explain: bool = True,
) -> Partition | Rejection:
    """Stage cuts and replicas for `layout` from the partitioner (memory screened against `memory_limit` per
    device), or why there are none (with the memory that would fit when `explain`)."""
    try:
        part_config = partition_config(layout, config, zero=zero, recompute=recompute, memory_limit=memory_limit)
        part = partition(profile, pipeline_cluster(cluster, layout.pipeline_devices), part_config, explain=explain)
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
