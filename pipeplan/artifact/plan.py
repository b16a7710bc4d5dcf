"""Plan: everything `pipeplan run` needs to execute a chosen pipeline layout, as versioned JSON (plan.json).

Layout vocabulary:
- a *pipeline* is one copy of the model split into `stages`; `training.data_parallel` identical pipelines run side
  by side on disjoint ranks and all-reduce gradients stage by stage;
- a *stage* is a contiguous range of layers (and the FX nodes in them); a stage may be replicated inside a pipeline
  (PipeDream's non-uniform replication): its replicas split the microbatches between them;
- a *rank* is one process/device; it holds one or more stages (chunks: interleaved, zbv, dualpipev) of one pipeline.
`rank_ops[rank]` is the ordered op list that rank executes (`{stage}{kind}{microbatch}`, microbatches numbered per
pipeline); which rank handles (stage, microbatch) is read off these lists — they are the single source of truth.
For an asynchronous schedule (pipedream, pipedream-2bw) they are the stream the search simulated (several steps,
weight versions on the ops, `num_op_microbatches` in all); `run` regenerates its --steps' stream and checks them.
A plan made from a profile file alone names no FX nodes in its stages: `runnable` is False and executing it must
start with `require_runnable()`, which raises one clear RunError (`not_runnable_reason`). So does a plan with
context or expert parallelism (`training.expert_parallel`: a MoE model's routed experts over ep ranks), one
predicted with gradient or parameter collectives overlapped (`training.overlap`), and one with tensor parallelism
(`training.tensor_parallel` t > 1, planned analytically by `search.sharding`): there each rank of `ranks` stands for
a group of t x cp consecutive devices (`TrainingConfig.groups`: group r holds devices r·t·cp .. r·t·cp + t·cp - 1, on
node r·t·cp // devices_per_node), and the stages' costs, parameters and bytes are one device's of the group."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeplan.artifact.profile_ref import ProfileRef
from pipeplan.artifact.schedule_fields import check_schedule_fields
from pipeplan.cluster import Cluster, DeviceGroups
from pipeplan.costs import ZERO_STAGES, Numerics, bytes_per_param, numerics
from pipeplan.costs.overlap import Overlap
from pipeplan.errors import FormatError, PipeplanError, RunError, ScheduleError, UnknownScheduleError
from pipeplan.graph.recompute_modes import unknown_recompute
from pipeplan.jsonio import build_dataclass, fingerprint, read_json, write_json
from pipeplan.schedules.ops import Op
from pipeplan.schedules.placement import stage_copies
from pipeplan.schedules.registry import schedule_info
from pipeplan.schedules.validate import check_complete

PLAN_SCHEMA_VERSION = 1
RUN_DEVICES = ("cpu", "cuda")


def run_device_for(profile_device: str) -> str:
    """The device a plan runs on, from its profile's device: cpu stays cpu; cuda:NAME and meta (analytic, for a
    GPU hardware preset) mean cuda."""
    return "cpu" if profile_device == "cpu" else "cuda"


@dataclass(frozen=True, kw_only=True)
class ModelRef:
    ref: str  # built-in name, /abs/path/to/file.py:factory or package.module:factory
    options: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = ""  # of the traced LayerGraph; the runtime refuses a model that does not match
    granularity: int | None = None  # layer grouping used when tracing
    tokens_per_sample: int | None = None
    file_sha256: str = ""  # of the model file (file.py:factory refs, recorded with an absolute path); run checks it
    tracer: str = ""  # fx | export: how the graph was traced ("" in older plans: fx)


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    global_batch_size: int
    microbatch_size: int
    num_microbatches: int  # per pipeline per step
    data_parallel: int = 1  # identical pipelines
    optimizer: str = "adamw"
    optimizer_bytes_per_param: float = 16.0  # memory accounting (weights + grads + optimizer state)
    lr: float = 1e-3
    weight_decay: float = 0.01
    dtype: str = "float32"  # the precision's compute dtype
    precision: str = "fp32"  # pipeplan.precision mode the costs were profiled in and `run` trains in
    seed: int = 0
    device: str = "cpu"  # what the costs were measured or estimated for: cpu, or cuda (one GPU per rank)
    zero: int = 0  # ZeRO stage: 0, or 1 = optimizer state sharded over the ranks holding the same parameters
    tensor_parallel: int = 1  # devices per tensor-parallel group (analytic plans only; `run` needs 1)
    context_parallel: int = 1  # tensor-parallel groups per context-parallel group (analytic plans only)
    expert_parallel: int = 1  # ranks of pipelines x cp a MoE model's routed experts split over (analytic plans only)
    overlap: str = "none"  # communication overlap the step was predicted with (costs.overlap.Overlap.label)
    post_validate: bool = False  # the step is the period of post-validated steps: `run` post-validates (older: off)
    attention: str = ""  # analytic plans: what attention the costs assume (the profile's: flash, math, ...)
    step_checks_ms: float = 0.0  # a synchronized step's global checks (a profile refined from a run; predict.predict)

    def __post_init__(self) -> None:
        from pipeplan.precision import PRECISIONS

        if self.precision not in PRECISIONS:
            raise FormatError(f"training.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.device not in RUN_DEVICES:
            raise FormatError(f"training.device must be one of {', '.join(RUN_DEVICES)}, got {self.device!r}")
        if self.zero not in ZERO_STAGES:
            raise FormatError(
                f"training.zero must be 0 or 1 (ZeRO-1 shards optimizer state; stages 2 and 3 are not supported), "
                f"got {self.zero}"
            )
        try:
            Overlap.parse(self.overlap)
        except PipeplanError as exc:
            raise FormatError(f"training.overlap: {exc}") from None
        names = ("global_batch_size", "microbatch_size", "num_microbatches", "data_parallel", "tensor_parallel")
        for name in (*names, "context_parallel", "expert_parallel"):
            if getattr(self, name) < 1:
                raise FormatError(f"training.{name} must be >= 1")
        expected = self.microbatch_size * self.num_microbatches * self.data_parallel
        if expected != self.global_batch_size:
            raise FormatError(
                f"training.global_batch_size ({self.global_batch_size}) must equal microbatch_size x "
                f"num_microbatches x data_parallel ({expected})"
            )

    @property
    def numerics(self) -> Numerics:
        """The precision and optimizer the plan was counted for (an optimizer given as bytes per parameter: it)."""
        try:
            return numerics(float(self.optimizer), self.precision)
        except ValueError:
            return numerics(self.optimizer, self.precision)

    @property
    def overlap_options(self) -> Overlap:
        """The communication overlap the step was predicted with (`overlap`, parsed)."""
        return Overlap.parse(self.overlap)

    @property
    def groups(self) -> DeviceGroups:
        """The t x cp devices each rank of the plan stands for."""
        return DeviceGroups(tensor_parallel=self.tensor_parallel, context_parallel=self.context_parallel)

    def unplanned_optimizer_bytes(self, name: str) -> float:
        """Bytes per parameter (weights, gradients, state) optimizer `name` needs beyond what the plan counted."""
        return max(0.0, bytes_per_param(numerics(name, self.precision)) - self.optimizer_bytes_per_param)


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    index: int
    first_layer: int
    last_layer: int  # inclusive
    layer_names: tuple[str, ...]
    node_names: tuple[str, ...]  # FX node names this stage computes
    replicas: int = 1  # inside one pipeline
    forward_ms: float = 0.0  # predicted per microbatch
    input_grad_ms: float = 0.0
    weight_grad_ms: float = 0.0
    backward_ms: float | None = None  # fused B (1F1B-style schedules); None: input_grad_ms + weight_grad_ms
    param_count: int = 0
    memory_bytes: int = 0  # predicted peak on one device holding this stage (the simulator's, static included)
    comm_ms: float = 0.0  # transfer to the next stage as simulated (activations forward, gradients backward)
    activation_bytes: int = 0  # saved for backward per microbatch (what F adds to its device's memory)
    activation_freed_by_input_grad_bytes: int = 0  # the part of it I frees (W frees the rest, B all)
    allreduce_ms: float = 0.0  # its gradients' all-reduce over all its holders (ZeRO-1: reduce-scatter + all-gather)
    recompute: str = "none"  # activation recomputation the runtime applies to this stage (pipeplan.recompute)
    recompute_ms: float = 0.0  # what recomputation adds per microbatch, included in input_grad_ms / backward_ms
    kept_bytes: int | None = None  # held from F to I or B under `recompute` (None: activation_bytes)
    recompute_bytes: int = 0  # re-created on top of kept_bytes while I or B runs (partition.costs.recompute)
    optimizer_ms: float = 0.0  # predicted optimizer update on one device holding the stage (after its exchange)
    expert_param_count: int = 0  # of param_count: routed-expert weights (ZeRO-1 shards their state over 1/ep)
    # one microbatch's F + B + recomputation by what it is spent on (profiling.retime.BREAKDOWN, "<part>_ms"; analytic
    # profiles: matmuls, attention, memory-bound kernels, launches, exposed collectives, other ops); {} when unknown
    compute_breakdown: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (problem := unknown_recompute(self.recompute)) is not None:
            raise FormatError(f"plan stage {self.index}: {problem}")
        if min(self.kept_bytes or 0, self.recompute_bytes, self.recompute_ms) < 0:
            raise FormatError(f"plan stage {self.index}: kept_bytes, recompute_bytes and recompute_ms must be >= 0")
        if not 0 <= self.expert_param_count <= self.param_count:
            raise FormatError(f"plan stage {self.index}: expert_param_count must be between 0 and param_count")


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    rank: int
    node: int
    pipeline: int  # data-parallel index
    stages: tuple[int, ...]  # stages (chunks) this rank holds, in chunk order
    stage_replica: int = 0  # index inside the stage's replica group


@dataclass(frozen=True, kw_only=True)
class Predicted:
    step_ms: float
    samples_per_s: float
    tokens_per_s: float | None = None
    bubble_rate: float = 0.0
    peak_memory_bytes: tuple[int, ...] = ()  # per rank: the simulator's peak (static + live activations)
    memory_limit_bytes: int = 0  # what the peaks were checked against: device memory less the reserve
    memory_reserve_bytes: int = 0  # kept free for what the model does not count (CUDA context, buffers, ...)


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: ModelRef
    cluster: Cluster
    training: TrainingConfig
    schedule: str
    chunks: int  # stages per pipeline device (1, or v for interleaved / zbv / dualpipev)
    stages: tuple[StagePlan, ...]
    ranks: tuple[RankInfo, ...]
    rank_ops: tuple[tuple[str, ...], ...]
    predicted: Predicted
    alternatives: tuple[dict[str, Any], ...] = ()
    rationale: str = ""
    memory_choices: tuple[str, ...] = ()  # each memory option used (recomputation per stage, ZeRO-1) and why
    pipeplan_version: str = ""
    torch_version: str = ""
    profile: ProfileRef | None = None  # None: older plans, plans not made by the search (manual_plan)

    def __post_init__(self) -> None:
        _check_plan(self)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def num_op_microbatches(self) -> int:
        """Microbatches the op lists cover: one step's, or an asynchronous schedule's whole stream."""
        if not schedule_info(self.schedule).asynchronous:
            return self.training.num_microbatches
        parts = (o for ops in self.rank_ops for text in ops for o in Op.parse(text).parts)
        return 1 + max((o.microbatch for o in parts), default=-1)

    @property
    def runnable(self) -> bool:
        """Whether `pipeplan run` can execute this plan (`not_runnable_reason` says why not)."""
        return self.not_runnable_reason() is None

    def not_runnable_reason(self) -> str | None:
        """Why `pipeplan run` cannot execute this plan, in one line, or None: made from a profile file alone (no
        model to trace, so no FX node names per stage), tensor-, context- or expert-parallel (the runtime has no
        such layers), or predicted with gradient or parameter collectives hidden behind compute (the runtime reduces
        gradients after the flush)."""
        t, cp = self.training.tensor_parallel, self.training.context_parallel
        if t > 1:
            return (
                f"this plan uses tensor parallelism (t={t}), which `run` does not execute: the runtime has no "
                "tensor-parallel layers (column/row-parallel Linear, head-parallel attention, vocab-parallel "
                "embedding and loss) or their collectives; re-plan with --parallel tp=1 to run it"
            )
        if cp > 1:
            return (
                f"this plan uses context parallelism (cp={cp}), which `run` does not execute (no ring attention); "
                "re-plan with --parallel cp=1 to run it"
            )
        if self.training.expert_parallel > 1:
            return (
                f"this plan uses expert parallelism (ep={self.training.expert_parallel}), which `run` does not "
                "execute (no all-to-all dispatch of tokens to experts on other ranks); re-plan with "
                "--parallel ep=1 to run it"
            )
        overlap = Overlap.parse(self.training.overlap)
        if overlap.grad_reduce or overlap.param_gather:
            return (
                f"this plan was predicted with --overlap {self.training.overlap}, but `run` reduces gradients and "
                "updates parameters after the pipeline flush; re-plan with --overlap none or p2p to run it"
            )
        if not all(stage.node_names for stage in self.stages):
            return (
                "this plan was made from a profile without a model, so its stages name no FX nodes; re-plan with "
                "MODEL (e.g. `pipeplan plan gpt ...`) instead of --profile to get a runnable plan"
            )
        return None

    def require_runnable(self) -> None:
        """Raise RunError unless `pipeplan run` can execute this plan."""
        reason = self.not_runnable_reason()
        if reason:
            raise RunError(reason)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)  # training.step_checks_ms written only when learned: older plans keep their fingerprint
        data["training"] = {k: v for k, v in data["training"].items() if k != "step_checks_ms" or v}
        return {"schema_version": PLAN_SCHEMA_VERSION, **data}

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_dict())

    @property
    def fingerprint(self) -> str:
        """Of its plan.json content (`jsonio.fingerprint`): a run's trace records the plan it ran."""
        return fingerprint(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "plan") -> Plan:
        """Every field type- and range-checked (build_dataclass), then the plan's own consistency (_check_plan)."""
        return build_dataclass(cls, {k: v for k, v in data.items() if k != "schema_version"}, where=where)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        data = read_json(path, kind="plan", schema_version=PLAN_SCHEMA_VERSION)
        return cls.from_dict(data, where=f"plan file {str(path)!r}")


def _check_plan(plan: Plan) -> None:
    """One clear FormatError per inconsistency a hand-edited or truncated plan.json could have."""
    try:
        schedule_info(plan.schedule)
    except UnknownScheduleError as exc:
        raise FormatError(f"plan file: {exc}") from None
    if not plan.stages:
        raise FormatError("plan has no stages")
    if [s.index for s in plan.stages] != list(range(len(plan.stages))):
        raise FormatError("plan stages must be numbered 0..S-1 in order")
    for prev, nxt in zip(plan.stages, plan.stages[1:], strict=False):
        if nxt.first_layer != prev.last_layer + 1:
            raise FormatError(f"plan stage {nxt.index} must start at layer {prev.last_layer + 1}")
    if [r.rank for r in plan.ranks] != list(range(len(plan.ranks))):
        raise FormatError("plan ranks must be numbered 0..N-1 in order")
    if len(plan.rank_ops) != len(plan.ranks):
        raise FormatError(f"plan has {len(plan.ranks)} ranks but {len(plan.rank_ops)} rank_ops lists")
    group = plan.training.groups.size  # devices per rank of `ranks` (t x cp)
    if len(plan.ranks) * group > plan.cluster.num_devices:
        raise FormatError(
            f"plan uses {len(plan.ranks) * group} devices but its cluster has {plan.cluster.num_devices} devices"
        )
    num_stages = len(plan.stages)
    for info in plan.ranks:
        bad = [s for s in info.stages if not 0 <= s < num_stages]
        if bad or not info.stages:
            raise FormatError(f"plan rank {info.rank} holds invalid stages {list(info.stages)}")
        if not 0 <= info.pipeline < plan.training.data_parallel:
            raise FormatError(f"plan rank {info.rank} has pipeline {info.pipeline} >= data_parallel")
    if plan.chunks < 1:
        raise FormatError("plan chunks must be >= 1")
    for info in plan.ranks:
        if info.node != info.rank * group // plan.cluster.devices_per_node:
            raise FormatError(
                f"plan rank {info.rank} is on node {info.node}; expected rank x t x cp // devices_per_node"
            )
    _check_replicas(plan)
    _check_asynchronous(plan)
    _check_rank_ops(plan)
    check_schedule_fields(plan)  # the schedule and chunks fields are its op lists'


def _check_asynchronous(plan: Plan) -> None:
    """What asynchronous schedules do not run with: replicated stages, ZeRO-1, fp16 loss scaling."""
    if not schedule_info(plan.schedule).asynchronous:
        return
    problem = None
    if any(stage.replicas > 1 for stage in plan.stages):
        problem = "replicated stages (their replicas would have to agree on every update mid-stream)"
    elif plan.training.zero:
        problem = "ZeRO-1 (its flat parameter buffers cannot keep stashed weight versions); use --memory zero=0"
    elif any(stage.recompute != "none" for stage in plan.stages):
        problem = "recomputation (a stream keeps every activation); use --memory recompute=none"
    elif plan.training.precision == "fp16-mixed":
        problem = "fp16-mixed (loss scaling skips whole steps; a stream has none); use bf16-mixed or fp32"
    if problem:
        raise FormatError(f"plan schedule {plan.schedule} is asynchronous and runs without {problem}")


def _check_replicas(plan: Plan) -> None:
    """Every pipeline holds each stage on exactly `replicas` ranks, numbered 0..replicas-1 (once per copy: a
    mirrored schedule holds each stage twice, `placement.stage_copies`)."""
    copies = stage_copies(schedule_info(plan.schedule).placement)
    for pipeline in range(plan.training.data_parallel):
        holders: dict[int, list[int]] = {}
        for info in (info for info in plan.ranks if info.pipeline == pipeline):
            for held in info.stages:
                holders.setdefault(held, []).append(info.stage_replica)
        for stage in plan.stages:
            found = sorted(holders.get(stage.index, []))
            if found != sorted(list(range(stage.replicas)) * copies):
                raise FormatError(
                    f"plan pipeline {pipeline} holds stage {stage.index} on {len(found)} rank(s) with replica "
                    f"indices {found}; stage {stage.index} declares {stage.replicas} replica(s) x {copies} copies"
                )


def _check_rank_ops(plan: Plan) -> None:
    """Each rank runs only its own stages; in each pipeline every (stage, microbatch) runs F once and B or I+W
    once (`schedules.validate.check_complete`). (Deadlock freedom is the generator's invariant; the runtime
    checks it again before running.)"""
    num_mb = plan.num_op_microbatches
    if num_mb % plan.training.num_microbatches:
        raise FormatError(
            f"plan rank_ops cover {num_mb} microbatches, not whole steps of {plan.training.num_microbatches}"
        )
    pipeline_ops: list[list[Op]] = [[] for _ in range(plan.training.data_parallel)]
    for info, ops in zip(plan.ranks, plan.rank_ops):
        for text in ops:
            try:
                parts = Op.parse(text).parts  # an OVERLAP_F_B op: both halves
            except PipeplanError as exc:
                raise FormatError(f"plan rank {info.rank}: {exc}") from None
            for op in parts:
                if op.stage not in info.stages:
                    raise FormatError(
                        f"plan rank {info.rank} runs op {text} of stage {op.stage}, which it does not hold"
                    )
                if op.microbatch >= num_mb:  # (never for a stream: num_op_microbatches counts its highest)
                    raise FormatError(f"plan rank {info.rank} runs op {text} but a step has {num_mb} microbatches")
            pipeline_ops[info.pipeline].extend(parts)
    for pipeline, pipeline_parts in enumerate(pipeline_ops):
        try:
            check_complete(pipeline_parts, len(plan.stages), num_mb)
        except ScheduleError as exc:
            raise FormatError(f"plan pipeline {pipeline}: {exc}") from None
