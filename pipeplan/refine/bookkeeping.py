"""A run's measured ops turned into per-layer costs, exactly: op -> stage -> layers.

Each traced op names its global stage (`{stage}{kind}{mb}`; interleaved, zbv and dualpipev chunks are stages of
their own, placed on ranks as the plan's rank map says, V or looped), and the plan's stage holds layers
[first_layer..last_layer]. Every op is checked against the plan (the rank holds the stage; a synchronous step's ops
are the rank's op list in order) before any is counted. Per (stage, kind) the measured cost is the median over
every rank running it (a replicated stage's replicas and every data-parallel pipeline run the same full op) and
every traced step except the run's first (warm-up). An overlapped F&B pair (dualpipev) is one op for two
stages and cannot be split: it is left out, and its stages' F and B are taken from their unpaired ops.

Then each stage's layers are scaled, pass by pass, so that the stage's op times (`costs.stage_op_ms`, the one
formula the partitioner and the plan use) become the measured medians, keeping the profile's proportions between
the stage's layers:
- F: every layer's forward x (measured F / the stage's F);
- split backward (I and W ops), a stage after the first: I = the layers' I + recomputation, so both scale by
  measured I / planned I; W by measured W / planned W. The model's first stage computes no input gradient: its I
  only recomputes (scaled to measured I when it recomputes) and its W runs the layers' I + W, which scale by
  measured W / planned W; without recomputation its I does no work, and what it measured is added to W;
- fused backward (B ops): every layer's I, W, B and recomputation x (measured B / planned B);
- what the schedule did not run follows: B (under a split backward) by the layers' I + W, recomputation modes the
  stage did not use by the forward's factor.
Communication is not touched: transfers stay the simulator's (the cut bytes over the links).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from pipeplan.artifact.measured import MeasuredRun, warm_up_step
from pipeplan.artifact.plan import Plan, StagePlan
from pipeplan.costs import LayerArrays, StageOpMs, stage_op_ms
from pipeplan.errors import FormatError
from pipeplan.profiling.profile import LayerProfile, Profile
from pipeplan.schedules.registry import schedule_info
from pipeplan.search.scaling import scale_profile

Medians = dict[tuple[int, str], float]  # (stage, kind) -> median measured ms


def measured_medians(plan: Plan, run: MeasuredRun) -> Medians:
    """Per (stage, kind), the median measured op time (module docstring); ops checked against `plan` first."""
    _check_ops(plan, run)
    warm = warm_up_step(run.steps)
    samples: dict[tuple[int, str], list[float]] = {}
    for traced in run.ops:
        if traced.step != warm and traced.op.halves is None:
            samples.setdefault((traced.op.stage, traced.op.kind), []).append(traced.ms)
    return {key: statistics.median(values) for key, values in samples.items()}


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


def _ratio(measured: float | None, planned: float) -> float | None:
    return measured / planned if measured is not None and planned > 0 else None


def stage_factors(ops: StageOpMs, sums: tuple[float, float], measured: dict[str, float], first: bool) -> StageFactors:
    """The factors that make stage `ops` (planned; `sums`: its layers' I and W without recomputation) the
    `measured` medians by kind (F, I, W, B: those the schedule ran)."""
    forward = _ratio(measured.get("F"), ops.forward) or 1.0
    if "B" in measured:  # a fused backward: everything behind B scales alike
        factor = _ratio(measured["B"], ops.backward) or 1.0
        return StageFactors(forward, factor, factor, factor, factor)
    input_grad = weight_grad = recompute = None
    if first:  # I = the recomputation only, W = the layers' I + W
        busy = measured.get("I") if ops.recompute > 0 else None
        recompute = _ratio(busy, ops.recompute)
        idle = measured.get("I", 0.0) if ops.recompute == 0 else 0.0  # a no-op I's time goes to W
        input_grad = weight_grad = _ratio(measured.get("W", 0.0) + idle if "W" in measured else None, ops.weight_grad)
    else:
        input_grad = recompute = _ratio(measured.get("I"), ops.input_grad)
        weight_grad = _ratio(measured.get("W"), ops.weight_grad)
    input_grad, weight_grad = input_grad or 1.0, weight_grad or 1.0
    grads = sums[0] + sums[1]
    backward = (input_grad * sums[0] + weight_grad * sums[1]) / grads if grads > 0 else 1.0
    return StageFactors(forward, input_grad, weight_grad, backward, recompute or forward)


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


def refined_layers(plan: Plan, profile: Profile, medians: Medians) -> tuple[LayerProfile, ...]:
    """`profile`'s layers (at the plan's microbatch size) scaled stage by stage to the measured medians."""
    scaled = scale_profile(profile, plan.training.microbatch_size)
    arrays = LayerArrays.from_profile(scaled)
    layers = list(scaled.layers)
    for stage in plan.stages:
        a, b = stage.first_layer, stage.last_layer
        ops = stage_op_ms(arrays, a, b, stage.recompute)
        sums = (float(arrays.span("input_grad", a, b)), float(arrays.span("weight_grad", a, b)))
        measured = {kind: ms for (s, kind), ms in medians.items() if s == stage.index}
        factors = stage_factors(ops, sums, measured, first=a == 0)
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
