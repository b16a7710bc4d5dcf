"""What `pipeplan capacity` does between parsing and printing: resolve its options (device counts, schedules, the
analytic profile, the default global batch) into a sweep, run it, and plot it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pipeplan.capacity.options import CAPACITY_PRECISION, CapacityOptions
from pipeplan.capacity.pinned import PinnedReport, pinned_report
from pipeplan.capacity.report import CapacityReport
from pipeplan.capacity.sweep import CapacityConfig, capacity_sweep, default_global_batch
from pipeplan.console import warn
from pipeplan.costs.overlap import Overlap
from pipeplan.errors import ConfigError
from pipeplan.hardware import Hardware, cluster_for, resolve_hardware
from pipeplan.models.assignments import parse_assignments
from pipeplan.models.presets import preset_fields
from pipeplan.plan.asynchronous import searched_schedules
from pipeplan.profiling.profile import Profile
from pipeplan.profiling.profile_job import ProfileRequest, profile_request
from pipeplan.schedules.registry import SCHEDULE_NAMES, schedule_info, schedule_names
from pipeplan.search.config import SearchConfig, parse_zero
from pipeplan.search.inputs import memory_reserve_bytes, microbatch_candidates
from pipeplan.search.pinned import PinnedLayout, check_pinned_experts, parse_layout
from pipeplan.search.tensor_search import tensor_parallel_sizes
from pipeplan.units import parse_count, parse_int_list

if TYPE_CHECKING:
    from pipeplan.models.spec import ModelSpec


def parse_device_counts(text: str) -> tuple[int, ...]:
    """`"8,64,512"` -> (8, 64, 512)."""
    return parse_int_list(text, option="--devices", example="8,64,512")


def parse_schedules(text: str) -> tuple[str, ...]:
    """`auto` (the registry's capacity_default schedules: all but zb-auto), `all`, or names like 1f1b,zbv."""
    if text == "auto":
        return schedule_names(capacity_default=True)
    if text == "all":
        return SCHEDULE_NAMES
    return tuple(part.strip() for part in text.split(",") if part.strip())


def capacity_profile(
    model: str,
    options: dict[str, str],
    *,
    seq: int | None,
    hardware: Hardware,
    batch_size: int,
    quiet: bool,
    batch_given: bool = True,
    precision: str = CAPACITY_PRECISION,
    attention: str = "auto",
) -> Profile:
    """The analytic profile (meta device, flash attention, `precision`) through the one model -> profile path;
    `seq` replaces the model's (a preset's too). Without `batch_given` the default global batch counts tokens, so
    the model must say its tokens per sample."""
    hf = model.startswith("hf:")
    key = "seq_len" if hf else "seq"  # the hf: adapter's option (models/hf.py)
    if seq is not None:
        if seq < 1:
            raise ConfigError(f"--seq must be >= 1, got {seq}")
        if key in options:
            warn(f"-a {key}={options[key]} ignored: --seq {seq} given")
        options = {**options, key: str(seq)}
    elif hf and key not in options and preset_fields(model.removeprefix("hf:")) is None:
        raise ConfigError(
            f"capacity {model}: give --seq N, the sequence length to plan for (the hf: adapter's own default, "
            "128 tokens, is for tests)"
        )
    request = ProfileRequest(
        model=model,
        options=options,
        batch_size=batch_size,
        precision=precision,
        device="meta",
        hardware=hardware,
        progress=not quiet,
        preset_overridable=("seq",) if seq is not None else (),
        attention=attention,
    )

    def check(spec: ModelSpec) -> None:
        if spec.tokens_per_sample is None:
            if not batch_given:
                raise ConfigError(f"model {model!r} does not say its tokens per sample; give --global-batch-size")
            warn(f"model {model!r} does not say its tokens per sample; counting one token per sample")

    return profile_request(request, check=check)[0]


@dataclass(frozen=True, kw_only=True)
class CapacityJob:
    """A resolved `pipeplan capacity`: the analytic profile, what to sweep, where to plot (None: no plot), and a
    pinned layout to predict beside the planner's choice (None: a sweep)."""

    model: str
    profile: Profile
    config: CapacityConfig
    plot: Path | None
    layout: PinnedLayout | None = None


def prepare_capacity(options: CapacityOptions) -> CapacityJob:
    """Check the sweep before profiling, profile, then fill in the default global batch (it needs the profile)."""
    pinned = parse_layout(options.layout) if options.layout is not None else None
    counts = parse_device_counts(options.devices) if options.devices is not None else (pinned.devices,)
    if pinned is not None and counts != (pinned.devices,):
        raise ConfigError(f"--layout uses {pinned.devices} devices; drop --devices or give --devices {pinned.devices}")
    hardware = resolve_hardware(options.hardware, options.hardware_file)
    size_text = options.microbatch_size if pinned is None else str(pinned.mbs)
    sizes = microbatch_candidates(size_text, options.global_batch_size or 1)
    target = parse_count(options.target_tokens, option="--target-tokens") if options.target_tokens is not None else None
    search = SearchConfig(
        global_batch_size=options.global_batch_size or math.lcm(*sizes),
        microbatch_sizes=sizes,
        precision=options.precision,
        optimizer=options.optimizer,
        replication=options.replication,
        memory_reserve_bytes=memory_reserve_bytes(options.memory_reserve, hardware.memory_bytes),
        zero=parse_zero(options.zero),
        recompute=options.recompute,
        allow_async=options.allow_async,
        overlap=Overlap.parse(options.overlap),
        interleave=parse_int_list(options.interleave, option="--interleave", example="2,3,4"),
    )
    config = CapacityConfig(
        hardware=hardware,
        device_counts=counts,
        search=search,
        devices_per_node=options.devices_per_node,
        schedules=searched_schedules(  # an asynchronous one named without --allow-async: refused
            parse_schedules(options.schedule),
            allow_async=options.allow_async,
            named=options.schedule not in ("auto", "all"),
        ),
        per_schedule=options.plot is not None,
        target_tokens=target,
        days=options.days,
        tensor_parallel=options.tensor_parallel,
        context_parallel=options.context_parallel,
        expert_parallel=options.expert_parallel,
    )
    if options.replication and not any(schedule_info(name).replicable for name in config.schedules):
        warn(f"--replication ignored: none of {', '.join(config.schedules)} can replicate stages")
    batch_given = options.global_batch_size is not None
    profile = capacity_profile(
        options.model,
        parse_assignments(options.assignments),
        seq=options.seq,
        hardware=hardware,
        batch_size=min(sizes),
        quiet=options.json_output,
        batch_given=batch_given,
        precision=options.precision,
        attention=options.attention,
    )
    if not batch_given:
        batch = default_global_batch(profile.provenance.tokens_per_sample or 1, sizes)
        config = replace(config, search=replace(search, global_batch_size=batch))
    _check_sizes(config, profile, pinned)
    plot = Path(options.plot) if options.plot is not None else None
    return CapacityJob(model=options.model, profile=profile, config=config, plot=plot, layout=pinned)


def _check_sizes(config: CapacityConfig, profile: Profile, pinned: PinnedLayout | None) -> None:
    """A given --tensor-parallel, --context-parallel or --expert-parallel (or --layout ep=) the model or a count
    cannot take: refused before the sweep."""
    if pinned is not None:
        check_pinned_experts(pinned, profile, cluster_for(config.hardware, pinned.devices, config.devices_per_node))
    for count in config.device_counts:
        cluster = cluster_for(config.hardware, count, config.devices_per_node)
        tensor_parallel_sizes(config.tensor_parallel, profile, cluster, config.context_parallel, config.expert_parallel)


def run_capacity_job(
    job: CapacityJob, *, progress: Callable[[int, int, str], None] | None = None
) -> CapacityReport | PinnedReport:
    """The sweep, and its plot when --plot asked for one; with --layout, that layout beside the planner's choice."""
    if job.layout is not None:
        return pinned_report(job.profile, job.config, job.layout)
    report = capacity_sweep(job.profile, job.config, model=job.model, progress=progress)
    if job.plot is not None:
        from pipeplan.capacity.plot import plot_capacity

        plot_capacity(report, job.plot)
    return report
