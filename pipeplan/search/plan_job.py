"""What `pipeplan plan` (and the Python API's `plan()`) do before and after the library call: resolve the options into
the objects `search.planner.plan` takes (the profile to plan from, the cluster, a `PlanConfig` with every default
filled in: `prepare_plan`), and write the plan directory (`write_plan`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeplan.artifact.plan import Plan
from pipeplan.artifact.scripts import write_plan_dir
from pipeplan.artifact.timing import plan_steps_timeline, timeline_rows
from pipeplan.cluster import Cluster, cpu_threads_per_rank
from pipeplan.costs import numerics
from pipeplan.errors import ConfigError
from pipeplan.hardware import resolve_hardware
from pipeplan.models.assignments import parse_assignments
from pipeplan.precision import default_precision
from pipeplan.profiling.consistency import warn_if_other_threads, warn_if_out_of_bounds
from pipeplan.profiling.profile import Profile
from pipeplan.profiling.profile_job import ProfileRequest
from pipeplan.schedules.registry import SCHEDULE_NAMES, schedule_info
from pipeplan.schedules.simulate import Timeline
from pipeplan.search.config import searched_schedules
from pipeplan.search.flags import parse_memory, parse_parallel, parse_precision, parse_schedules, search_config
from pipeplan.search.inputs import (
    PlanInput,
    attach_model,
    check_profile_precision,
    load_profile_input,
    make_cluster,
    microbatch_candidates,
    profile_input,
    profile_model_input,
)
from pipeplan.search.pinned import check_pinned_experts, parse_layout, pinned_layout
from pipeplan.search.plan_options import PlanOptions
from pipeplan.search.planner import PlanConfig

DEFAULT_BATCH_PER_DEVICE = 4  # --global-batch-size defaults to 4 samples per device
SYNCHRONOUS = tuple(name for name in SCHEDULE_NAMES if not schedule_info(name).asynchronous)  # `-s auto`
PLAN_INTERLEAVE = (2,)  # `--parallel vp=auto`: the interleaved schedule with 2 chunks per device


@dataclass(frozen=True, kw_only=True)
class PlanJob:
    """A resolved `pipeplan plan`: what to plan (`search.planner.plan`'s arguments) and where to write it."""

    source: PlanInput
    cluster: Cluster
    config: PlanConfig
    output: Path | None  # None: write no plan directory (the Python API's default)


def prepare_plan(options: PlanOptions, *, profile: Profile | None = None) -> PlanJob:
    """Fill in the defaults, check the config, then load or profile the model (the slow part, last). `profile`: an
    in-memory profile in place of `--profile FILE` (the Python API's)."""
    if options.model is None and options.profile is None and profile is None:
        raise ConfigError("give MODEL (e.g. gpt), --profile FILE, or both (the model's graph, the file's costs)")
    hardware = resolve_hardware(options.hardware)  # a calibrate entry: links, memory, rates
    memory = parse_memory(options.memory)
    cluster = make_cluster(devices=options.devices, memory=memory.per_device, hardware=hardware)
    source = _profile_source(options, profile)
    mode, optimizer = parse_precision(options.precision)
    if source is not None:
        precision = check_profile_precision(source.profile, mode)
    else:
        precision = mode or default_precision(options.device)
    sizes = microbatch_candidates(options.microbatch_size, source.profile.provenance.batch_size if source else 1)
    if options.layout is not None and source is None:  # MODEL profiled at the pinned microbatch size (-b ignored)
        sizes = (parse_layout(options.layout).mbs,)
    config = _plan_config(options, cluster, numerics(optimizer, precision), sizes)  # checked before profiling
    if source is None:
        threads = cpu_threads_per_rank(_local_ranks(cluster))  # as each of this plan's ranks here will run
        source = profile_model_input(_profile_request(options, hardware, min(sizes), precision, threads))
    else:
        warn_if_other_threads(source.profile, _local_ranks(cluster))
    if config.layout is not None:
        check_pinned_experts(config.layout, source.profile, cluster)
    output = Path(options.output) if options.output is not None else None
    return PlanJob(source=source, cluster=cluster, config=config, output=output)


def _plan_config(options: PlanOptions, cluster: Cluster, held, sizes: tuple[int, ...]) -> PlanConfig:
    """The plan's PlanConfig from its options (the precision and microbatch sizes decided), checked against the
    cluster (pipeline depths, a pinned layout)."""
    names, named = parse_schedules(options.schedule, SYNCHRONOUS)
    names = searched_schedules(names, allow_async=True, zero=parse_memory(options.memory).zero, named=named)
    batch = options.global_batch_size
    search = search_config(
        options,
        numerics=held,
        global_batch_size=batch if batch is not None else DEFAULT_BATCH_PER_DEVICE * cluster.num_devices,
        microbatch_sizes=sizes,
        memory_bytes=cluster.memory_bytes,
        schedules=names,
        interleave=PLAN_INTERLEAVE,
        replication=True,
        post_validate=options.post_validate,
    )
    search.check_devices(cluster.num_devices)
    search.budget(cluster.memory_bytes)  # a reserve that leaves nothing: one line
    pinned = parse_layout(options.layout) if options.layout is not None else None
    if pinned is not None:
        pinned_layout(pinned, search, cluster)
    parallel = parse_parallel(options.parallel)
    return PlanConfig(
        search=search,
        schedules=names,
        tensor_parallel=parallel.tensor,
        context_parallel=parallel.context,
        expert_parallel=parallel.expert,
        layout=pinned,
    )


def _profile_source(options: PlanOptions, profile: Profile | None) -> PlanInput | None:
    """--profile's costs, or `profile`'s (with MODEL's traced graph when MODEL is given too); None without either."""
    if profile is None and options.profile is None:
        return None
    if profile is not None:
        warn_if_out_of_bounds(profile, "the Profile object")  # as `plan --profile` warns of a file
        source = profile_input(profile)
    else:
        source = load_profile_input(str(options.profile))
    if options.model is None:
        return source
    model_options = parse_assignments(options.assignments)
    return attach_model(source, options.model, model_options, options.granularity, options.tracer)


def _local_ranks(cluster: Cluster) -> int:
    """The plan's ranks on one machine (a CPU plan runs on this one)."""
    return min(cluster.num_devices, cluster.devices_per_node)


def _profile_request(options: PlanOptions, hardware, batch_size: int, precision: str, threads: int) -> ProfileRequest:
    assert options.model is not None  # prepare_plan requires MODEL or a profile
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
        threads=threads,
    )


def write_plan(chosen: Plan, output: Path | None, profile: Profile | None = None) -> Timeline:
    """The plan's predicted steps (several, until their period repeats: what `show` draws), and DIR/plan.json,
    launch.sh, job.sbatch, timeline.json and profile.json (`profile`: the one the plan was made from, which
    `pipeplan refine` starts from) when `output` names a directory."""
    timeline = plan_steps_timeline(chosen)
    if output is not None:
        write_plan_dir(chosen, timeline_rows(chosen, timeline), output, profile)
    return timeline
