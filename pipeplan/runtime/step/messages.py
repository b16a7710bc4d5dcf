"""Who runs what and who sends what to whom, read off the plan's per-rank op lists (the single source of truth).

- `owner[(pipeline, stage, microbatch)]` is the rank whose list holds that F op (its backward ops must be on the
  same rank: the activations live there);
- every value crossing a cut goes straight from its producing stage to each consuming stage (skip connections are
  not relayed), and its gradient straight back;
- the messages between each ordered pair of ranks form one sequence in the *sender's* op order. A message's tag is
  its index in that sequence, and the receiver posts its receives in the same order, so matching is unambiguous for
  gloo (matches by peer and tag) and for NCCL (matches by issue order per peer).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from pipeplan.errors import RunError, ScheduleError
from pipeplan.plan.plan import Plan
from pipeplan.schedules.ops import Op
from pipeplan.schedules.validate import check_complete


@dataclass(frozen=True, kw_only=True)
class StageIO:
    """Value names a stage reads (`inputs`, in forward-argument order) and produces (`outputs`)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Message:
    """One tensor on the wire: `kind` "act" (forward, producer -> consumer) or "grad" (consumer -> producer)."""

    kind: str
    pipeline: int
    microbatch: int
    producer: int  # stage producing the value
    consumer: int  # stage consuming it
    value: str
    src: int  # sending rank
    dst: int  # receiving rank


@dataclass(frozen=True, kw_only=True)
class Routing:
    owner: dict[tuple[int, int, int], int]
    producer: dict[str, int]  # value -> producing stage (model inputs are absent)
    consumers: dict[tuple[int, str], tuple[int, ...]]  # (producer stage, value) -> consuming stages, ascending
    sends: dict[tuple[int, Op], tuple[Message, ...]]  # (rank, op) -> messages it sends after running op
    tags: dict[Message, int]  # message -> index in its (src, dst) sequence

    def receive_order(self, rank: int) -> dict[int, list[Message]]:
        """Per peer: the messages `rank` receives from it, in the order the peer sends them."""
        order: dict[int, list[Message]] = defaultdict(list)
        for message, _ in sorted(self.tags.items(), key=lambda item: item[1]):
            if message.dst == rank:
                order[message.src].append(message)
        return dict(order)


def parse_rank_ops(plan: Plan) -> list[list[Op]]:
    return [[Op.parse(text) for text in ops] for ops in plan.rank_ops]


def op_owners(plan: Plan, rank_ops: list[list[Op]]) -> dict[tuple[int, int, int], int]:
    """(pipeline, stage, microbatch) -> rank, checking each pipeline's ops are complete (F once, B or I+W once:
    `schedules.validate.check_complete`) and each backward runs on its forward's rank."""
    owner: dict[tuple[int, int, int], int] = {}
    pipeline_ops: list[list[Op]] = [[] for _ in range(plan.training.data_parallel)]
    for rank, ops in enumerate(rank_ops):
        pipeline = plan.ranks[rank].pipeline
        held = set(plan.ranks[rank].stages)
        for o in (part for op in ops for part in op.parts):  # an OVERLAP_F_B op: both halves
            if o.stage not in held:
                raise RunError(f"plan rank {rank} runs {o} but holds stages {sorted(held)}; re-create the plan")
            pipeline_ops[pipeline].append(o)
            if o.kind == "F":
                owner[(pipeline, o.stage, o.microbatch)] = rank
    for pipeline, ops in enumerate(pipeline_ops):
        try:
            check_complete(ops, len(plan.stages), plan.num_op_microbatches)
        except ScheduleError as exc:
            raise RunError(f"plan pipeline {pipeline}: {exc}; re-create the plan") from None
    for rank, ops in enumerate(rank_ops):
        pipeline = plan.ranks[rank].pipeline
        for o in (part for op in ops for part in op.parts):
            if o.kind != "F" and owner[(pipeline, o.stage, o.microbatch)] != rank:
                raise RunError(f"plan rank {rank} runs {o} but the forward ran on another rank; re-create the plan")
    return owner


def value_producers(stage_io: list[StageIO], model_inputs: tuple[str, ...]) -> dict[str, int]:
    producer: dict[str, int] = {}
    for stage, io in enumerate(stage_io):
        for name in io.outputs:
            producer.setdefault(name, stage)
    for stage, io in enumerate(stage_io):
        for name in io.inputs:
            if name in model_inputs:
                continue
            if name not in producer or producer[name] >= stage:
                raise RunError(f"stage {stage} reads {name!r}, which no earlier stage produces; re-create the plan")
    return producer


def build_routing(
    plan: Plan, stage_io: list[StageIO], model_inputs: tuple[str, ...], differentiable: set[str]
) -> Routing:
    """Route every cut value of every microbatch; `differentiable` names the values whose gradients flow back."""
    rank_ops = parse_rank_ops(plan)
    owner = op_owners(plan, rank_ops)
    producer = value_producers(stage_io, model_inputs)
    consumers_of: dict[tuple[int, str], list[int]] = defaultdict(list)
    for stage, io in enumerate(stage_io):
        for name in io.inputs:
            if name not in model_inputs:
                consumers_of[(producer[name], name)].append(stage)
    consumers = {key: tuple(sorted(stages)) for key, stages in consumers_of.items()}
    sends: dict[tuple[int, Op], tuple[Message, ...]] = {}
    tags: dict[Message, int] = {}
    counters: dict[tuple[int, int], int] = defaultdict(int)
    for rank, ops in enumerate(rank_ops):
        pipeline = plan.ranks[rank].pipeline
        for o in (part for op in ops for part in op.parts):  # an OVERLAP_F_B's halves send as their own ops
            messages = _messages_after(o, rank, pipeline, stage_io, consumers, producer, owner, differentiable)
            sends[(rank, o)] = tuple(messages)
            for message in messages:
                tags[message] = counters[(message.src, message.dst)]
                counters[(message.src, message.dst)] += 1
    return Routing(owner=owner, producer=producer, consumers=consumers, sends=sends, tags=tags)


def _messages_after(
    o: Op,
    rank: int,
    pipeline: int,
    stage_io: list[StageIO],
    consumers: dict[tuple[int, str], tuple[int, ...]],
    producer: dict[str, int],
    owner: dict[tuple[int, int, int], int],
    differentiable: set[str],
) -> list[Message]:
    """Messages `rank` sends once op `o` is done: activations after F, input gradients after B or I."""
    messages: list[Message] = []
    if o.kind == "F":
        for name in stage_io[o.stage].outputs:
            for consumer in consumers.get((o.stage, name), ()):
                dst = owner[(pipeline, consumer, o.microbatch)]
                if dst != rank:
                    messages.append(Message("act", pipeline, o.microbatch, o.stage, consumer, name, rank, dst))
    elif o.kind in ("B", "I"):
        for name in stage_io[o.stage].inputs:
            if name not in producer or name not in differentiable:
                continue
            dst = owner[(pipeline, producer[name], o.microbatch)]
            if dst != rank:
                messages.append(Message("grad", pipeline, o.microbatch, producer[name], o.stage, name, rank, dst))
    return messages
