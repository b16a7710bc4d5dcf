"""What a run's step tails teach: after each rank's last op come its stages' gradient exchange and optimizer update
(and the waits around them). A measured profile does not time updates (no memory rate); the run did. The part of
each rank's tail the plan's gradient exchange does not explain is taken as its update, and the bytes its stages'
updates move (`costs.overlap.update_bytes_per_param` per parameter updated on one device) over that time give
the rate updates ran at: `Provenance.update_bytes_per_s`, which `predict.gradient_sync.stage_optimizer_ms` times
every later update with (the re-plan's too), and which times the run's own plan again here."""

from __future__ import annotations

from dataclasses import replace

from pipeplan.artifact.measured import MeasuredRun
from pipeplan.artifact.plan import Plan, StagePlan
from pipeplan.costs.overlap import optimizer_step_ms, update_bytes_per_param
from pipeplan.predict.gradient_sync import SyncGroup, updated_params
from pipeplan.schedules.placement import stage_copies
from pipeplan.schedules.registry import schedule_info


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


def learned_update_rate(plan: Plan, run: MeasuredRun) -> float | None:
    """Bytes/s of the run's optimizer updates: over the ranks, the bytes their stages' updates move over the part of
    their median step tails (`run.tail_ms`) the plan's gradient exchange leaves. None when nothing is left or the
    optimizer is given as bytes per parameter (no update to time)."""
    moved = _moved_per_param(plan)
    if moved <= 0 or len(run.tail_ms) != len(plan.ranks):
        return None
    total_bytes = total_s = 0.0
    for info, tail in zip(plan.ranks, run.tail_ms):
        stages = [plan.stages[s] for s in info.stages]
        left_ms = tail - sum(stage.allreduce_ms for stage in stages)
        params = sum(_updated_params(plan, stage) for stage in stages)
        if left_ms > 0 and params > 0:
            total_bytes += params * moved
            total_s += left_ms / 1e3
    return total_bytes / total_s if total_s > 0 else None


def with_learned_updates(plan: Plan, bytes_per_s: float | None) -> Plan:
    """`plan` with every stage's optimizer update timed at `bytes_per_s` (unchanged when None)."""
    if not bytes_per_s:
        return plan
    moved = _moved_per_param(plan)
    stages = tuple(
        replace(stage, optimizer_ms=optimizer_step_ms(_updated_params(plan, stage), moved, bytes_per_s))
        for stage in plan.stages
    )
    return replace(plan, stages=stages)
