"""What `pipeplan plan` does between parsing and printing: resolve its options into a search (cluster, search
config, the profile to plan from, with every default filled in), search, and write the plan directory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeplan.cluster import Cluster
from pipeplan.costs.overlap import Overlap
from pipeplan.errors import InfeasibleError
from pipeplan.hardware import resolve_hardware
from pipeplan.models.assignments import parse_assignments
from pipeplan.plan.plan import Plan
from pipeplan.plan.scripts import write_plan_dir
from pipeplan.plan.timing import plan_steps_timeline, timeline_rows
from pipeplan.precision import default_precision
from pipeplan.profiling.profile_job import ProfileRequest
from pipeplan.schedules.simulate import Timeline
from pipeplan.search.config import SearchConfig, parse_zero
from pipeplan.search.emit import build_plan
from pipeplan.search.inputs import (
    PlanInput,
    attach_model,
    check_profile_precision,
    graph_at_microbatch,
    load_profile_input,
    make_cluster,
    memory_reserve_bytes,
    microbatch_candidates,
    pipeline_depth_candidates,
    profile_model_input,
)
from pipeplan.search.pinned import (
    PinnedLayout,
    check_pinned_experts,
    evaluate_pinned,
    parse_layout,
    pinned_layout,
)
from pipeplan.search.plan_options import PlanOptions
from pipeplan.search.search import SearchResult
from pipeplan.search.tensor_search import (
    TensorParallelTry,
    chosen_try,
    search_tensor_parallel,
    tensor_parallel_reason,
    tensor_parallel_sizes,
)

DEFAULT_BATCH_PER_DEVICE = 4  # --global-batch-size defaults to 4 samples per device


@dataclass(frozen=True, kw_only=True)
class PlanJob:
    """A resolved `pipeplan plan`: what to search and where to write the result."""

    source: PlanInput
    cluster: Cluster
    config: SearchConfig
    schedules: tuple[str, ...] | None  # None: every schedule (--schedule auto)
    output: Path | None  # None: write no plan directory (the Python API's default)
    tensor_parallel: tuple[TensorParallelTry, ...]  # the sizes to search (search.tensor_search)
    layout: PinnedLayout | None = None  # --layout: plan exactly this (the search's choice is compared)


def prepare_plan(options: PlanOptions) -> PlanJob:
    """Fill in the defaults, check the search config, then load or profile the model (the slow part, last)."""
    hardware = resolve_hardware(options.hardware, options.hardware_file)  # a calibrate entry: links, memory, rates
    cluster = make_cluster(
        devices=options.devices,
        devices_per_node=options.devices_per_node,
        memory_per_device=options.memory_per_device,
        hardware=hardware,
    )
    source = _profile_file(options)
    if source is not None:
        precision = check_profile_precision(source.profile, options.precision)
    else:
        precision = options.precision or default_precision(options.device)
    default_size = source.profile.provenance.batch_size if source is not None else 1
    sizes = microbatch_candidates(options.microbatch_size, default_size)
    batch = options.global_batch_size
    config = SearchConfig(  # checked before the (slow) profiling
        global_batch_size=batch if batch is not None else DEFAULT_BATCH_PER_DEVICE * cluster.num_devices,
        microbatch_sizes=sizes,
        optimizer=options.optimizer,
        precision=precision,
        replication=not options.no_replication,
        pipeline_depths=pipeline_depth_candidates(options.pipeline_depth),
        memory_reserve_bytes=memory_reserve_bytes(options.memory_reserve, cluster.memory_per_device),
        zero=parse_zero(options.zero),
        recompute=options.recompute,
        allow_async=options.allow_async,
        overlap=Overlap.parse(options.overlap),
        post_validate=options.post_validate,
    )
    config.check_devices(cluster.num_devices)
    pinned = parse_layout(options.layout) if options.layout is not None else None
    if pinned is not None:  # checked before the (slow) profiling
        pinned_layout(pinned, config, cluster)
    if source is None:
        source = profile_model_input(_profile_request(options, hardware, min(sizes), precision))
    if pinned is not None:
        check_pinned_experts(pinned, source.profile, cluster)
    schedules = None if options.schedule == "auto" else (options.schedule,)
    tensor_sizes = tensor_parallel_sizes(
        options.tensor_parallel, source.profile, cluster, options.context_parallel, options.expert_parallel
    )
    return PlanJob(
        source=source,
        cluster=cluster,
        config=config,
        schedules=schedules,
        output=Path(options.output) if options.output is not None else None,
        tensor_parallel=tensor_sizes,
        layout=pinned,
    )


def _pinned_result(job: PlanJob, free: SearchResult) -> tuple[SearchResult, str]:
    """The pinned layout as a one-candidate result, and a sentence comparing it with the search's choice."""
    found = evaluate_pinned(job.source.profile, job.cluster, job.config, job.layout)
    if found.evaluation is None:
        raise InfeasibleError(f"--layout {job.layout.label}: {found.rejection.reason}")
    pinned = found.evaluation
    gap = pinned.step_ms / free.best.step_ms - 1.0
    faster = "faster" if gap < 0 else "slower"
    why = (
        f"Layout pinned by --layout ({job.layout.label}): {abs(gap):.1%} {faster} than the search's choice "
        f"{free.best.label_with_replicas} ({free.best.step_ms:,.2f} ms/step)."
    )
    return found.as_search_result(job.config), why


def _profile_file(options: PlanOptions) -> PlanInput | None:
    """--profile's costs (with MODEL's traced graph when MODEL is given too), or None without --profile."""
    if options.profile is None:
        return None
    source = load_profile_input(str(options.profile), options.profile_format)
    if options.model is None:
        return source
    model_options = parse_assignments(options.assignments)
    return attach_model(source, options.model, model_options, options.granularity, options.tracer)


def _profile_request(options: PlanOptions, hardware, batch_size: int, precision: str) -> ProfileRequest:
    assert options.model is not None  # PlanOptions requires MODEL or --profile
    return ProfileRequest(
        model=options.model,
        options=parse_assignments(options.assignments),
        batch_size=batch_size,
        device=options.device,
        hardware=hardware,
        granularity=options.granularity,
        precision=precision,
        progress=not options.json_output,
        tracer=options.tracer,
        attention=options.attention,
    )


def run_plan_job(job: PlanJob, *, progress: Callable[[int, int], None] | None = None) -> tuple[Plan, Timeline]:
    """Search (each tensor-parallel size), build the chosen Plan and write DIR/plan.json, launch.sh, job.sbatch and
    timeline.json (when the job has a directory); return the plan and its predicted steps' timeline."""
    tries = search_tensor_parallel(
        job.source.profile, job.cluster, job.config, job.tensor_parallel, job.schedules, progress=progress
    )
    result = chosen_try(tries).result
    why = tensor_parallel_reason(tries, lambda r: f"{r.best.samples_per_s:,.2f} samples/s")
    if job.layout is not None:  # the pinned layout is the plan; the search's choice is what it is compared with
        result, why = _pinned_result(job, result)
    source = graph_at_microbatch(job.source, result.best.layout.microbatch_size)
    chosen = build_plan(result, model=source.model, layer_graph=source.layer_graph, tensor_parallel_reason=why)
    timeline = plan_steps_timeline(chosen)  # several steps of the op lists (`show` draws the same)
    if job.output is not None:
        write_plan_dir(chosen, timeline_rows(chosen, timeline), job.output)
    return chosen, timeline
