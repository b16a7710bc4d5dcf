"""Plan again from a refined profile with the settings a plan records: the one call into the search's entry point
(`search.plan_job`), kept in one function so that a change of that entry point changes only this."""

from __future__ import annotations

from pathlib import Path

from pipeplan.artifact.plan import Plan
from pipeplan.costs.overlap import Overlap
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.registry import schedule_info
from pipeplan.schedules.simulate import Timeline
from pipeplan.search.config import SearchConfig
from pipeplan.search.inputs import PlanInput, attach_model
from pipeplan.search.plan_job import write_plan
from pipeplan.search.planner import PlanConfig
from pipeplan.search.planner import plan as plan_layouts


def replan(
    profile: Profile, plan: Plan, *, schedules: tuple[str, ...] | None, output: Path | None
) -> tuple[Plan, Timeline]:
    """The plan `pipeplan plan MODEL --profile REFINED` would choose with `plan`'s recorded settings: its model
    (traced again for the stages' FX nodes), cluster, global batch, microbatch size (the refined costs were
    measured at it), tensor / context / expert parallel sizes, optimizer, precision, overlap and memory reserve;
    `schedules` (None: every one); pipeline depth, pipelines, cuts, replication, recomputation, ZeRO and
    post-validation searched again. Writes the plan directory (with the refined profile as its profile.json) when
    `output` is given."""
    training = plan.training
    config = SearchConfig(
        global_batch_size=training.global_batch_size,
        microbatch_sizes=(training.microbatch_size,),
        numerics=training.numerics,
        memory_reserve_bytes=plan.predicted.memory_reserve_bytes,
        overlap=Overlap.parse(training.overlap),
        allow_async=any(schedule_info(name).asynchronous for name in schedules or ()),
    )
    config.check_devices(plan.cluster.num_devices)
    model = plan.model
    source = PlanInput(profile=profile, model=model, layer_graph=None)
    source = attach_model(source, model.ref, dict(model.options), model.granularity, model.tracer or "auto")
    planned = PlanConfig(  # the run's own parallel sizes: its measured costs are per t x cp group and ep split
        search=config,
        schedules=schedules,
        tensor_parallel=training.tensor_parallel,
        context_parallel=training.context_parallel,
        expert_parallel=training.expert_parallel,
    )
    chosen = plan_layouts(source, plan.cluster, planned)
    return chosen, write_plan(chosen, output, source.profile)
