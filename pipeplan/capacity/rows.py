"""One capacity row from a search's best plan: its layout, tokens/s and MFU, memory split, the step's time split
and what binds (see `capacity.sweep` for the definitions)."""

from __future__ import annotations

import math
from dataclasses import replace

from pipeplan.capacity.memory import device_memory_split
from pipeplan.capacity.report import CapacityRow, TimeSplit
from pipeplan.errors import InfeasibleError, ScheduleError
from pipeplan.predict.predict import compute_period_ms
from pipeplan.predict.step import busy_per_step
from pipeplan.profiling.profile import Profile
from pipeplan.profiling.retime import ComputeBreakdown, layers_breakdown
from pipeplan.schedules.registry import schedule_info
from pipeplan.schedules.simulate import stream_step_ms
from pipeplan.search.candidate import Evaluation, Rejection
from pipeplan.search.estimate import balanced_estimate_ms
from pipeplan.search.search import SearchResult

MINOR_SHARE = 0.05  # bubble and communication both below this share of the step: compute binds


def ceil_or_none(value: float) -> int | None:
    return int(math.ceil(value)) if math.isfinite(value) else None


def result_row(
    result: SearchResult | InfeasibleError,
    num_devices: int,
    peak_flops: float,
    flops_per_token: float,
    rejected: list[Rejection],
) -> CapacityRow:
    """The row of a search's best plan on `num_devices` devices (`peak_flops`: one device's, for MFU), or of its
    InfeasibleError; `rejected`: the layouts over memory, for what binds."""
    if isinstance(result, InfeasibleError):
        return CapacityRow(num_devices=num_devices, binding="does-not-fit", reason=str(result))
    best = result.best
    layout = best.layout
    time = time_split(best)
    binding, reason = _binding(best, time, rejected, result)
    return CapacityRow(
        num_devices=num_devices,
        binding=binding,
        reason=reason,
        schedule=layout.schedule,
        pipeline_devices=layout.pipeline_devices,
        data_parallel=layout.data_parallel,
        num_microbatches=layout.num_microbatches,
        microbatch_size=layout.microbatch_size,
        step_ms=best.step_ms,
        tokens_per_s=tokens_per_s(result),
        mfu=mfu(result, peak_flops, flops_per_token, num_devices),
        bubble_rate=best.timeline.bubble_rate,
        memory=device_memory_split(best, result.profiles[layout.microbatch_size], result.config.split),
        time=time,
        tensor_parallel=layout.tensor_parallel,
        context_parallel=layout.context_parallel,
        expert_parallel=layout.expert_parallel,
        recompute=tuple(stage.recompute for stage in best.partition.stages),
        zero=best.zero,
        compute_breakdown=device_breakdown(best, result.profiles[layout.microbatch_size]),
    )


def tokens_per_s(result: SearchResult) -> float:
    best = result.best
    return best.samples_per_s * (result.profiles[best.layout.microbatch_size].provenance.tokens_per_sample or 1)


def mfu(result: SearchResult, peak_flops: float, flops_per_token: float, num_devices: int) -> float:
    """Model FLOPs utilization of the search's best plan (see capacity.sweep's docstring)."""
    return tokens_per_s(result) * flops_per_token / (peak_flops * num_devices)


def device_breakdown(best: Evaluation, profile: Profile) -> dict[str, float]:
    """The busiest pipeline device's compute per step by part (`profiling.retime.layers_breakdown`: matmuls,
    attention, memory-bound kernels, launches, exposed collectives, other): each stage it holds, one microbatch's
    F + B + recomputation x the microbatches it runs (`profile`: the search's, at the layout's microbatch size)."""
    busy = best.timeline.device_busy
    device = max(range(len(busy)), key=lambda d: busy[d])
    rates, split = profile.provenance.kernel_rates, schedule_info(best.partition.schedule).split_backward
    total = ComputeBreakdown()
    for index in best.pipeline.device_stages[device]:
        stage = best.partition.stages[index]
        layers = profile.layers[stage.first_layer : stage.last_layer + 1]
        share = best.layout.num_microbatches / stage.replicas
        total = total + layers_breakdown(layers, rates, stage.recompute, split_backward=split).scaled(share)
    return {"device": device, **total.as_dict(), "total_ms": total.total_ms}


def time_split(best: Evaluation) -> TimeSplit:
    """compute = the busiest device's op time per step; bubble = the rest of the period with free transfers and no
    gradient exchange or update (post-validated or synchronized as the step was timed); comm = what transfers,
    exchanges and updates add to the predicted period (asynchronous schedules: per step of their steady state,
    and the all-reduces of their updates)."""
    free = replace(best.costs, comm_ms=0.0)
    if schedule_info(best.layout.schedule).asynchronous:
        m = best.layout.num_microbatches
        no_comm, compute = stream_step_ms(best.resimulate(free), m), max(busy_per_step(best.timeline, m))
        return TimeSplit(compute_ms=compute, bubble_ms=max(no_comm - compute, 0.0), comm_ms=best.step_ms - no_comm)
    no_comm = compute_period_ms(best.inputs, post_validate=best.post_validate)
    compute = max(best.timeline.device_busy)
    bubble = max(min(no_comm, best.step_ms) - compute, 0.0)
    return TimeSplit(compute_ms=compute, bubble_ms=bubble, comm_ms=max(best.step_ms - compute - bubble, 0.0))


def _binding(best: Evaluation, time: TimeSplit, rejected: list[Rejection], result: SearchResult) -> tuple[str, str]:
    for rejection in sorted((r for r in rejected if r.kind == "memory"), key=lambda r: r.layout.label):
        layout = rejection.layout
        try:
            estimate = balanced_estimate_ms(layout, result.profiles[layout.microbatch_size], result.group_cluster)
        except ScheduleError:
            continue
        if estimate < best.step_ms:
            return "memory", f"{layout.label} (~{estimate:.1f} ms/step) does not fit in memory"
    share = max(time.bubble_ms, time.comm_ms) / best.step_ms if best.step_ms > 0 else 0.0
    if share < MINOR_SHARE:
        return "compute", ""
    if time.bubble_ms >= time.comm_ms:
        return "bubble", f"the busiest device idles {time.bubble_ms / best.step_ms:.0%} of the step"
    return "communication", f"{time.comm_ms / best.step_ms:.0%} of the step in transfers and all-reduce"
