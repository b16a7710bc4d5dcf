"""A run's measured ops turned into per-layer costs, exactly: op -> stage -> layers.

Each traced op names its global stage (`{stage}{kind}{mb}`; interleaved, zbv and dualpipev chunks are stages of
their own, placed on ranks as the plan's rank map says, V or looped), and the plan's stage holds layers
[first_layer..last_layer]. Every op is checked against the plan (the rank holds the stage; a synchronous step's ops
are the rank's op list in order) before any is counted. Per (stage, kind) the measured cost is, for each rank
running it, the median over every traced step except the run's first (warm-up), scaled to what the rank's steps
cost: by the median over its steps of the step's op time over its ops' medians summed. On a time-sliced CPU a
short op either runs whole or waits a whole slice for a core, so its median leaves the waits out while every step
pays them: on this 2-core VM the ops' medians summed were 0.78-1.06 of a rank's median step's op time (a zbv step
of twelve ops 0.81), and the run's plan timed with them predicted its own run 3-16% fast. A replicated stage's
replicas and every data-parallel pipeline run the same op, and a synchronized step waits for the slowest of them:
the stage's cost is the slowest rank's (with CPU ranks pinned to cores, one replica may share its core with other
work for the whole run at twice the others' op times, and a median over all replicas' samples was their mean). An
overlapped F&B pair (dualpipev) is one op for two stages and cannot be split: it is left out (of the factor too),
and its stages' F and B are taken from their unpaired ops.

Each op costs its layers' work plus a term paid once per op whatever its size (the executor's bookkeeping, the
sends it starts, the trace's own timing): `op_overhead_ms`, the intercept of the measured medians against the
work the profile gives each (stage, kind) op (least squares over every measured one; a model's first stage's I
without recomputation does no work, so it measures the term alone), at least 0 and at most the smallest median.
It is stored in the refined profile (`Provenance.op_overhead_ms`) and `costs.stage_op_ms` counts it once per op,
so a re-plan that groups the layers into other stages (or chunks) counts it per op again, not per layer.

Then each stage's layers are scaled, pass by pass, so that the stage's op times (`costs.stage_op_ms`, the one
formula the partitioner and the plan use) become the measured medians, keeping the profile's proportions between
the stage's layers; each factor is (measured - the per-op term) / the op's work:
- F: every layer's forward;
- split backward (I and W ops), a stage after the first: I = the layers' I + recomputation, so both scale by
  I's factor; W by W's. The model's first stage computes no input gradient: its I only recomputes (scaled to
  measured I when it recomputes; without recomputation it is the per-op term alone) and its W runs the whole
  backward in one pass, costed as the layers' fused B (`costs.stage_grad_ms`): the layers' B, I and W scale by
  W's factor;
- fused backward (B ops): every layer's I, W, B and recomputation by B's factor;
- what the schedule did not run follows: B (under a split backward) by the layers' I + W, recomputation modes the
  stage did not use by the forward's factor.
Communication is not touched: transfers stay the simulator's (the cut bytes over the links).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from pipeplan.artifact.measured import MeasuredRun, TracedOp, warm_up_step
from pipeplan.artifact.plan import Plan, StagePlan
from pipeplan.costs import LayerArrays, StageOpMs, stage_op_ms
from pipeplan.errors import FormatError
from pipeplan.profiling.profile import LayerProfile, Profile
from pipeplan.schedules.registry import schedule_info
from pipeplan.search.scaling import scale_profile

Medians = dict[tuple[int, str], float]  # (stage, kind) -> its slowest rank's median ms, scaled to its median step


def measured_medians(plan: Plan, run: MeasuredRun) -> Medians:
    """Per (stage, kind), the slowest of the ranks running it: each rank's median op time scaled to its median
    step (module docstring); ops checked against `plan` first."""
    _check_ops(plan, run)
    warm = warm_up_step(run.steps)
    kept = [traced for traced in run.ops if traced.step != warm and traced.op.halves is None]
    samples: dict[tuple[int, int, str], list[float]] = {}  # (rank, stage, kind) -> its op times
    for traced in kept:
        samples.setdefault((traced.rank, traced.op.stage, traced.op.kind), []).append(traced.ms)
    per_rank = {key: statistics.median(values) for key, values in samples.items()}
    factor = _step_factors(kept, per_rank)
    medians: Medians = {}
    for (rank, stage, kind), ms in per_rank.items():
        medians[(stage, kind)] = max(medians.get((stage, kind), 0.0), ms * factor[rank])
    return medians


def _step_factors(kept: list[TracedOp], per_rank: dict[tuple[int, int, str], float]) -> dict[int, float]:
    """Per rank, the median over its steps of the step's op time over the sum of its ops' medians: what a step
    costs beyond the ops' medians (an op that waits for a core waits a whole time slice, which the median of a
    short op's samples leaves out; module docstring)."""
    took: dict[tuple[int, int], float] = {}  # (rank, step) -> its ops' measured time
    typical: dict[tuple[int, int], float] = {}  # (rank, step) -> its ops' medians summed
    for traced in kept:
        at = (traced.rank, traced.step)
        took[at] = took.get(at, 0.0) + traced.ms
        typical[at] = typical.get(at, 0.0) + per_rank[(traced.rank, traced.op.stage, traced.op.kind)]
    ratios: dict[int, list[float]] = {}
    for (rank, step), ms in took.items():
        if typical[(rank, step)] > 0:
            ratios.setdefault(rank, []).append(ms / typical[(rank, step)])
    return {rank: statistics.median(ratios[rank]) if rank in ratios else 1.0 for rank, _ in took}


def _check_ops(plan: Plan, run: MeasuredRun) -> None:
    """Every traced op is one the plan gives its rank; a synchronous step runs exactly the rank's op list."""
    where = f"trace {run.path!r}"
    if max(o.rank for o in run.ops) >= plan.world_size:
        raise FormatError(f"{where} has ranks the plan does not ({plan.world_size} ranks); give the plan it ran")
    synchronous = not schedule_info(plan.schedule).asynchronous
    by_step: dict[tuple[int, int], list[str]] = {}
    for traced in run.ops:
        held = plan.ranks[traced.rank].stages
        for part in traced.op.parts:
            if part.stage not in held:
                raise FormatError(
                    f"{where}: rank {traced.rank} ran {traced.op}, but the plan puts stage {part.stage} on other "
                    "ranks; give the plan it ran (--plan)"
                )
        by_step.setdefault((traced.rank, traced.step), []).append(str(traced.op))
    for (rank, step), ops in by_step.items() if synchronous else ():
        if tuple(ops) != plan.rank_ops[rank]:
            raise FormatError(
                f"{where}: rank {rank}'s step {step} ran other ops than the plan's op list; give the plan it ran"
            )


@dataclass(frozen=True)
class StageFactors:
    """What a stage's layers' times are multiplied by (module docstring)."""

    forward: float = 1.0
    input_grad: float = 1.0
    weight_grad: float = 1.0
    backward: float = 1.0
    recompute: float = 1.0  # the stage's own recomputation mode's time


def _ratio(measured: float | None, planned: float, per_op: float) -> float | None:
    return max(measured - per_op, 0.0) / planned if measured is not None and planned > 0 else None


def _known(factor: float | None, otherwise: float = 1.0) -> float:
    return otherwise if factor is None else factor


def stage_factors(
    ops: StageOpMs, sums: tuple[float, float], measured: dict[str, float], first: bool, per_op: float = 0.0
) -> StageFactors:
    """The factors that make stage `ops` (its work as planned, no per-op term; `sums`: its layers' I and W without
    recomputation) the `measured` medians by kind (F, I, W, B: those the schedule ran) once `per_op` is added."""
    forward = _known(_ratio(measured.get("F"), ops.forward, per_op))
    if "B" in measured:  # a fused backward: everything behind B scales alike
        factor = _known(_ratio(measured["B"], ops.backward, per_op))
        return StageFactors(forward, factor, factor, factor, factor)
    if first:  # I = the recomputation only, W = the layers' fused backward in one pass
        recompute = _ratio(measured.get("I"), ops.recompute, per_op) if ops.recompute > 0 else None
        whole = _known(_ratio(measured.get("W"), ops.weight_grad, per_op))
        return StageFactors(forward, whole, whole, whole, _known(recompute, forward))
    found = _ratio(measured.get("I"), ops.input_grad, per_op)
    input_grad, weight_grad = _known(found), _known(_ratio(measured.get("W"), ops.weight_grad, per_op))
    grads = sums[0] + sums[1]
    backward = (input_grad * sums[0] + weight_grad * sums[1]) / grads if grads > 0 else 1.0
    return StageFactors(forward, input_grad, weight_grad, backward, _known(found, forward))


def op_overhead_ms(points: list[tuple[float, float]]) -> float:
    """The per-op term (module docstring): the least-squares intercept of measured against planned work over
    `points` (work, measured median), kept within [0, the smallest median]; 0 when the works do not differ (no
    line to fit) or the fit's slope is not positive."""
    if len({work for work, _ in points}) < 2:
        return 0.0
    mean_w = statistics.fmean(work for work, _ in points)
    mean_m = statistics.fmean(ms for _, ms in points)
    var = sum((work - mean_w) ** 2 for work, _ in points)
    slope = sum((work - mean_w) * (ms - mean_m) for work, ms in points) / var
    if slope <= 0:
        return 0.0
    return min(max(mean_m - slope * mean_w, 0.0), min(ms for _, ms in points))


def _scaled_layer(layer: LayerProfile, factors: StageFactors, mode: str) -> LayerProfile:
    """`layer` with its passes scaled; recomputation: the stage's mode by `factors.recompute`, others by F's."""
    full = factors.recompute if mode == "full" else factors.forward
    selective = factors.recompute if mode == "selective" else factors.forward
    return replace(
        layer,
        forward_ms=layer.forward_ms * factors.forward,
        input_grad_ms=layer.input_grad_ms * factors.input_grad,
        weight_grad_ms=layer.weight_grad_ms * factors.weight_grad,
        backward_ms=layer.backward_ms * factors.backward,
        full_recompute_ms=(layer.forward_ms if layer.full_recompute_ms is None else layer.full_recompute_ms) * full,
        selective_recompute_ms=layer.selective_recompute_ms * selective,
        work=None,  # measured in place: no longer the analytic kernels' times
        spread=None,
    )


_WORK = {"F": "forward", "I": "input_grad", "W": "weight_grad", "B": "backward"}


def _work_arrays(profile: Profile, plan: Plan) -> LayerArrays:
    """`profile` at the plan's microbatch size as the cost formula reads it, without any per-op term: the work."""
    return replace(LayerArrays.from_profile(scale_profile(profile, plan.training.microbatch_size)), op_ms=0.0)


def learned_op_overhead(plan: Plan, profile: Profile, medians: Medians) -> float:
    """`op_overhead_ms` over every measured (stage, kind): the work `profile` gives it against its median."""
    arrays = _work_arrays(profile, plan)
    points = []
    for stage in plan.stages:
        ops = stage_op_ms(arrays, stage.first_layer, stage.last_layer, stage.recompute)
        points += [(getattr(ops, _WORK[k]), ms) for (s, k), ms in medians.items() if s == stage.index]
    return op_overhead_ms(points)


def refined_layers(plan: Plan, profile: Profile, medians: Medians, per_op: float = 0.0) -> tuple[LayerProfile, ...]:
    """`profile`'s layers (at the plan's microbatch size) scaled stage by stage to the measured medians, each op's
    `per_op` term taken off first."""
    arrays = _work_arrays(profile, plan)
    layers = list(scale_profile(profile, plan.training.microbatch_size).layers)
    for stage in plan.stages:
        a, b = stage.first_layer, stage.last_layer
        ops = stage_op_ms(arrays, a, b, stage.recompute)
        sums = (float(arrays.span("input_grad", a, b)), float(arrays.span("weight_grad", a, b)))
        measured = {kind: ms for (s, kind), ms in medians.items() if s == stage.index}
        factors = stage_factors(ops, sums, measured, first=bool(arrays.first_in_model(a, b)), per_op=per_op)
        layers[a : b + 1] = [_scaled_layer(layer, factors, stage.recompute) for layer in layers[a : b + 1]]
    return tuple(layers)


def retimed_plan(plan: Plan, profile: Profile) -> Plan:
    """`plan` with every stage's op times taken again from `profile` (`costs.stage_op_ms` at the plan's microbatch
    size): the same layout, schedule, transfers, reductions and updates, the refined op costs."""
    arrays = LayerArrays.from_profile(scale_profile(profile, plan.training.microbatch_size))
    return replace(plan, stages=tuple(_retimed_stage(stage, arrays) for stage in plan.stages))


def _retimed_stage(stage: StagePlan, arrays: LayerArrays) -> StagePlan:
    ops = stage_op_ms(arrays, stage.first_layer, stage.last_layer, stage.recompute)
    return replace(
        stage,
        forward_ms=ops.forward,
        input_grad_ms=ops.input_grad,
        weight_grad_ms=ops.weight_grad,
        backward_ms=ops.backward if stage.backward_ms is not None else None,
        recompute_ms=ops.recompute,
    )
