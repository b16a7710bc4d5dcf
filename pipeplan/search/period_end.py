"""The end of a candidate's steps: the period with or without post-validation (`--post-validate on|off|auto`) and
the memory post-validation costs (the undo copy `run --post-validate` keeps: `costs.optimizer.undo_copy_bytes`)."""

from __future__ import annotations

from pipeplan.costs.optimizer import undo_copy_bytes
from pipeplan.plan.asynchronous import predicted_step
from pipeplan.plan.layout import layout_steps, transfer_costs
from pipeplan.search.gradient_sync import per_device, step_end


def period_end(layout, part, pipe, timeline, profile, cluster, simulated, options, reject):  # type: ignore[no-untyped-def]
    """(peak bytes per device, `gradient_sync.step_end`'s tuple) of a candidate `simulated` as (its costs with
    transfers as timed, stage parameter counts, peak bytes), or the rejection `reject(bytes)` returns (None when
    they fit): of the peaks, or of a post-validation turned `on` whose undo copy does not fit (`auto` then keeps
    post-validation off). `options`: `step_end`'s (optimizer, precision, zero, overlap, post_validate)."""
    timed, counts, device_bytes = simulated
    over = reject(device_bytes)
    if over is not None:
        return over
    steps = layout_steps(pipe, layout.schedule, part.num_stages, layout.num_microbatches, timed)
    ended = step_end(layout, part, pipe, timeline, profile, cluster, **options, steps=steps)
    if not ended[4]:
        return device_bytes, ended
    undo = undo_copy_bytes(counts, pipe.device_stages, options["optimizer"], options["precision"])
    eager_bytes = tuple(int(round(b + u)) for b, u in zip(timeline.peak_memory_bytes, undo))
    over = reject(eager_bytes)
    if over is None:
        return eager_bytes, ended
    if options["post_validate"] == "on":
        return over
    options = {**options, "post_validate": "off"}
    return device_bytes, step_end(layout, part, pipe, timeline, profile, cluster, **options, steps=steps)


def synchronized_period_ms(evaluation) -> float:  # type: ignore[no-untyped-def]
    """The period of a `search.candidate.Evaluation`'s op lists had its steps been synchronized (what a
    post-validated plan's rationale compares its period with: `search.rationale`)."""
    layout, pipe = evaluation.layout, evaluation.pipeline
    m, stages = layout.num_microbatches, pipe.device_stages
    timed = transfer_costs(evaluation.costs, pipe, evaluation.overlap)
    steps = layout_steps(pipe, layout.schedule, evaluation.partition.num_stages, m, timed)
    updates = per_device(evaluation.stage_optimizer_ms, stages)
    args = (layout.schedule, evaluation.timeline, m, stages, evaluation.stage_allreduce_ms, updates, evaluation.overlap)
    return predicted_step(*args, steps=steps, post_validate=False)[0]
