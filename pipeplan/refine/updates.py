"""What a run's step tails teach. After each rank's last op come its stages' gradient exchange, the global checks
(the gradient-norm row and the all-gather every rank waits in) and its optimizer update; a synchronized run's
trace marks where each ends (`MeasuredRun.tail_parts_ms`), and each part is learned on its own, so that a re-plan
with another data-parallel layout or stage count counts each by its own rule (`LearnedTail`):

- the exchange: its speed against the link model's (`costs.gradient_sync_ms` over the plan's links, nothing learned):
  the largest over the ranks of the planned exchange over the measured one, `Provenance.exchange_efficiency`, by
  which `predict.gradient_sync.stage_allreduce_ms` divides every later exchange (a re-plan's exchange follows its
  own bytes and group size at that speed); ranks with nothing to exchange are left out. A rank that finished its
  ops first waits in the exchange for its replicas to arrive, and the replica that arrived last (the slowest, whose
  ops the stage is costed with: `bookkeeping.measured_medians`) waits for nobody: its exchange is the exchange, and
  the others' excess is the skew between replicas, which the simulated step has in the slowest replica's ops;
- the checks: a fixed cost per synchronized step, the smallest of the ranks' medians (the rank that reaches the
  all-gather last waits for nobody: the others' longer checks are the wait for it, which the simulated step end
  already has), `Provenance.step_checks_ms`, which every device of a synchronized step counts before its update
  (`predict.StepInputs.step_checks_ms`); one run of one world size cannot show a per-rank-count term, so none is
  fitted;
- the update: the bytes the rank's stages' updates move (`costs.overlap.update_bytes_per_param` per parameter
  updated on one device) over its measured update part: a rate per rank, and the slowest rank's is
  `Provenance.update_bytes_per_s`, which `predict.gradient_sync.stage_optimizer_ms` times every later update with
  (a synchronized step goes at its slowest rank's pace, as its ops do).

A trace without marks (a post-validated run: its checks settle during the next step; older traces) teaches the
update alone, as what each tail leaves after the plan's exchange, at the fastest rank's rate (that part holds the
waits in the exchange too, and the replica that arrived last waited least); under post-validation that part is
the eager update with its undo copy (`costs.overlap.eager_update_ms`), so the rate is taken over those bytes."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeplan.artifact.measured import MeasuredRun
from pipeplan.artifact.plan import Plan, StagePlan
from pipeplan.costs.overlap import eager_update_ms, optimizer_step_ms, update_bytes_per_param
from pipeplan.predict.gradient_sync import SyncGroup, updated_params
from pipeplan.schedules.placement import stage_copies
from pipeplan.schedules.registry import schedule_info


@dataclass(frozen=True)
class LearnedTail:
    """What a run's step tails teach (module docstring); None: not learned from this run."""

    update_bytes_per_s: float | None = None
    exchange_efficiency: float | None = None
    step_checks_ms: float | None = None


def _moved_per_param(plan: Plan) -> float:
    numerics = plan.training.numerics
    if not numerics.named:
        return 0.0
    return update_bytes_per_param(numerics)


def _updated_params(plan: Plan, stage: StagePlan) -> float:
    """Parameters one device holding `stage` updates (`predict.gradient_sync.updated_params`, as predicted)."""
    training = plan.training
    group = SyncGroup(
        data_parallel=training.data_parallel,
        context_parallel=training.context_parallel,
        expert_parallel=training.expert_parallel,
        mirrored=stage_copies(schedule_info(plan.schedule).placement) > 1,
    )
    return updated_params(
        stage.param_count, stage.expert_param_count, replicas=stage.replicas, zero=training.zero, group=group
    )


def learned_tail(plan: Plan, run: MeasuredRun, prior_efficiency: float | None = None) -> LearnedTail:
    """The tail's parts learned from `run` of `plan` (module docstring); `prior_efficiency`: the exchange efficiency
    the plan's exchanges were already timed with (a plan made from a refined profile), None: the link model's."""
    if len(run.tail_ms) != len(plan.ranks):
        return LearnedTail()
    if len(run.tail_parts_ms) != len(plan.ranks):
        return LearnedTail(update_bytes_per_s=_rate_from_tails(plan, run))
    exchanged = [part[0] for part in run.tail_parts_ms]
    updated = [part[2] for part in run.tail_parts_ms]
    return LearnedTail(
        update_bytes_per_s=_update_rate(plan, updated),
        exchange_efficiency=_exchange_efficiency(plan, exchanged, prior_efficiency or 1.0),
        step_checks_ms=min(part[1] for part in run.tail_parts_ms),
    )


def _rank_exchange_ms(plan: Plan) -> list[float]:
    return [sum(plan.stages[s].allreduce_ms for s in info.stages) for info in plan.ranks]


def _exchange_efficiency(plan: Plan, measured: list[float], prior: float) -> float | None:
    """The link model's exchange time over the measured one, the largest over the ranks that exchange (module
    docstring: the replica that arrived last waited for nobody)."""
    ratios = [planned * prior / ms for planned, ms in zip(_rank_exchange_ms(plan), measured) if planned > 0 and ms > 0]
    return max(ratios) if ratios else None


def _update_rate(plan: Plan, update_ms: list[float], pick=min) -> float | None:
    """Bytes/s: `pick` (the slowest: min) over the ranks that update of the bytes its update moves over its
    measured time."""
    moved = _moved_per_param(plan)
    if moved <= 0:
        return None
    rates = []
    for info, ms in zip(plan.ranks, update_ms):
        params = sum(_updated_params(plan, plan.stages[s]) for s in info.stages)
        if ms > 0 and params > 0:
            rates.append(params * moved / (ms / 1e3))
    return pick(rates) if rates else None


def _rate_from_tails(plan: Plan, run: MeasuredRun) -> float | None:
    """Without marks: the part of each rank's median tail the plan's exchange leaves, taken as its update (eager,
    with the undo copy, when the run post-validated); None when nothing is left or no update is timed. That part
    also holds the rank's wait in the exchange for its slowest replica (whose ops the stage is costed with): the
    fastest rate is the rank's that waited least, the replica that arrived last."""
    left = [tail - exchange for tail, exchange in zip(run.tail_ms, _rank_exchange_ms(plan))]
    if run.record.post_validate:
        scale = eager_update_ms([1.0], plan.training.numerics)[0]
        left = [ms / scale for ms in left]
    return _update_rate(plan, left, pick=max)


def with_learned_tail(plan: Plan, learned: LearnedTail, prior_efficiency: float | None = None) -> Plan:
    """`plan` with its updates at the learned rate, its exchanges at the learned efficiency (they were timed at
    `prior_efficiency`) and its synchronized steps' checks; what was not learned stays as planned."""
    moved = _moved_per_param(plan)
    ratio = (prior_efficiency or 1.0) / learned.exchange_efficiency if learned.exchange_efficiency else 1.0
    stages = tuple(
        replace(
            stage,
            allreduce_ms=stage.allreduce_ms * ratio,
            optimizer_ms=(
                optimizer_step_ms(_updated_params(plan, stage), moved, learned.update_bytes_per_s)
                if learned.update_bytes_per_s
                else stage.optimizer_ms
            ),
        )
        for stage in plan.stages
    )
    checks = plan.training.step_checks_ms if learned.step_checks_ms is None else learned.step_checks_ms
    return replace(plan, stages=stages, training=replace(plan.training, step_checks_ms=checks))
