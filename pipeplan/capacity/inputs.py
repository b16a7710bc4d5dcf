"""What `pipeplan capacity` does between parsing and printing: resolve its options (device counts, schedules, the
analytic profile, the default global batch) into a sweep, run it, and plot it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pipeplan.capacity.options import CapacityOptions
from pipeplan.capacity.pinned import PinnedReport, pinned_report
from pipeplan.capacity.report import CapacityReport
from pipeplan.capacity.sweep import CapacityConfig, capacity_sweep, default_global_batch
from pipeplan.console import warn
from pipeplan.costs import numerics
from pipeplan.errors import ConfigError
from pipeplan.hardware import Hardware, cluster_for, resolve_hardware
from pipeplan.models.assignments import parse_assignments
from pipeplan.models.presets import preset_fields
from pipeplan.precision import ANALYTIC_PRECISION, default_precision
from pipeplan.profiling.profile import Profile
from pipeplan.profiling.profile_job import ProfileRequest, profile_request
from pipeplan.schedules.registry import schedule_info, schedule_names
from pipeplan.search.config import searched_schedules
from pipeplan.search.flags import parse_memory, parse_parallel, parse_precision, parse_schedules, search_config
from pipeplan.search.inputs import microbatch_candidates
from pipeplan.search.pinned import PinnedLayout, check_pinned_experts, parse_layout
from pipeplan.search.tensor_search import tensor_parallel_sizes
from pipeplan.units import parse_count, parse_int_list

CAPACITY_INTERLEAVE = (2, 3, 4)  # `--parallel vp=auto`: the interleaved schedule with 2, 3 and 4 chunks per device

if TYPE_CHECKING:
    from pipeplan.models.spec import ModelSpec


def parse_device_counts(text: str) -> tuple[int, ...]:
    """`"8,64,512"` -> (8, 64, 512)."""
    return parse_int_list(text, option="--devices", example="8,64,512")


def capacity_profile(
    model: str,
    options: dict[str, str],
    *,
    seq: int | None,
    hardware: Hardware,
    batch_size: int,
    quiet: bool,
    batch_given: bool = True,
    precision: str = ANALYTIC_PRECISION,
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
    if options.devices is not None:
        counts = parse_device_counts(options.devices)
    else:
        assert pinned is not None, "CapacityOptions requires --devices or --layout"
        counts = (pinned.devices,)
    if pinned is not None and counts != (pinned.devices,):
        raise ConfigError(f"--layout uses {pinned.devices} devices; drop --devices or give --devices {pinned.devices}")
    hardware = resolve_hardware(options.hardware)
    assert hardware is not None  # CapacityOptions requires --hardware
    memory = parse_memory(options.memory)
    if memory.per_device is not None:  # --memory SIZE: the preset's device with that much memory
        hardware = replace(hardware, memory_bytes=memory.per_device)
    sizes = microbatch_candidates(options.microbatch_size if pinned is None else str(pinned.mbs), 1)
    mode, optimizer = parse_precision(options.precision)
    precision = mode or default_precision("meta")  # capacity is analytic
    config = _capacity_config(options, hardware, counts, numerics(optimizer, precision), sizes)
    batch_given = options.global_batch_size is not None
    profile = capacity_profile(
        options.model,
        parse_assignments(options.assignments),
        seq=options.seq,
        hardware=hardware,
        batch_size=min(sizes),
        quiet=options.json_output,
        batch_given=batch_given,
        precision=precision,
        attention=options.attention,
    )
    if not batch_given:
        batch = default_global_batch(profile.provenance.tokens_per_sample or 1, sizes)
        config = replace(config, search=replace(config.search, global_batch_size=batch))
    _check_sizes(config, profile, pinned)
    plot = Path(options.plot) if options.plot is not None else None
    return CapacityJob(model=options.model, profile=profile, config=config, plot=plot, layout=pinned)


def _capacity_config(
    options: CapacityOptions, hardware: Hardware, counts: tuple[int, ...], held, sizes: tuple[int, ...]
) -> CapacityConfig:
    """The sweep's CapacityConfig from the options (precision and microbatch sizes decided; the batch until the
    profile says its tokens per sample: their least common multiple)."""
    names, named = parse_schedules(options.schedule, schedule_names(capacity_default=True))
    names = searched_schedules(names, allow_async=True, zero=parse_memory(options.memory).zero, named=named)
    parallel = parse_parallel(options.parallel)
    search = search_config(
        options,
        numerics=held,
        global_batch_size=options.global_batch_size or math.lcm(*sizes),
        microbatch_sizes=sizes,
        memory_bytes=hardware.memory_bytes,
        schedules=names,
        interleave=CAPACITY_INTERLEAVE,
        replication=False,  # `replicate=auto`: not in capacity sweeps (slow at scale)
    )
    target = parse_count(options.target_tokens, option="--target-tokens") if options.target_tokens is not None else None
    config = CapacityConfig(
        hardware=hardware,
        device_counts=counts,
        search=search,
        devices_per_node=options.devices_per_node,
        schedules=names,
        per_schedule=options.plot is not None,
        target_tokens=target,
        days=options.days,
        tensor_parallel=parallel.tensor,
        context_parallel=parallel.context,
        expert_parallel=parallel.expert,
    )
    if search.replication and not any(schedule_info(name).replicable for name in config.schedules):
        warn(f"--parallel replicate=on ignored: none of {', '.join(config.schedules)} can replicate stages")
    return config


def _check_sizes(config: CapacityConfig, profile: Profile, pinned: PinnedLayout | None) -> None:
    """A given --parallel tp=, cp= or ep= (or --layout ep=) the model or a count
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
