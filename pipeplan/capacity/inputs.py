"""What `pipeplan capacity` does between parsing and printing: resolve its options (device counts, schedules, the
analytic profile, the default global batch) into a sweep, run it, and plot it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pipeplan.capacity.options import CapacityOptions
from pipeplan.capacity.report import CapacityReport
from pipeplan.capacity.sweep import CapacityConfig, capacity_sweep, default_global_batch
from pipeplan.console import warn
from pipeplan.errors import ConfigError, ModelError
from pipeplan.hardware import cluster_for, load_hardware
from pipeplan.models import parse_assignments
from pipeplan.plan.asynchronous import searched_schedules
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.registry import SCHEDULE_NAMES, schedule_info, schedule_names
from pipeplan.search.config import parse_zero
from pipeplan.search.inputs import memory_reserve_bytes, microbatch_candidates
from pipeplan.search.tensor_search import tensor_parallel_sizes
from pipeplan.units import parse_count, parse_int_list


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
    hardware,
    batch_size: int,
    quiet: bool,
    batch_given: bool = True,
) -> Profile:
    """The analytic profile (meta device, bf16, flash attention); `seq` replaces the model's (a preset's too).
    Without `batch_given` the default global batch counts tokens, so the model must say its tokens per sample."""
    from pipeplan.models import load_model
    from pipeplan.models.builtins import BUILTINS
    from pipeplan.models.registry import call_factory
    from pipeplan.profiling.analytic import profile_analytic

    if seq is not None:
        if seq < 1:
            raise ConfigError(f"--seq must be >= 1, got {seq}")
        if "seq" in options:
            warn(f"-a seq={options['seq']} ignored: --seq {seq} given")
        options = {**options, "seq": str(seq)}
    builtin = BUILTINS.get(model)
    if seq is not None and builtin is not None and builtin.preset and "seq" in builtin.preset:
        fixed = sorted((set(options) - {"seq"}) & set(builtin.preset))
        if fixed:
            raise ModelError(f"preset {model!r} fixes {', '.join(fixed)}; use the base model to change them")
        spec = call_factory(builtin.factory, {**builtin.preset, **options}, ref=model)
    else:
        spec = load_model(model, options)
    if spec.tokens_per_sample is None:
        if not batch_given:
            raise ConfigError(f"model {model!r} does not say its tokens per sample; give --global-batch-size")
        warn(f"model {model!r} does not say its tokens per sample; counting one token per sample")
    return profile_analytic(spec, batch_size=batch_size, hardware=hardware, precision="bf16-mixed", progress=not quiet)


@dataclass(frozen=True, kw_only=True)
class CapacityJob:
    """A resolved `pipeplan capacity`: the analytic profile, what to sweep, and where to plot (None: no plot)."""

    model: str
    profile: Profile
    config: CapacityConfig
    plot: Path | None


def prepare_capacity(options: CapacityOptions) -> CapacityJob:
    """Check the sweep before profiling, profile, then fill in the default global batch (it needs the profile)."""
    counts = parse_device_counts(options.devices)
    hardware = load_hardware(options.hardware, hardware_file=options.hardware_file)
    sizes = microbatch_candidates(options.microbatch_size, options.global_batch_size or 1)
    target = parse_count(options.target_tokens, option="--target-tokens") if options.target_tokens is not None else None
    config = CapacityConfig(
        hardware=hardware,
        device_counts=counts,
        global_batch_size=options.global_batch_size or math.lcm(*sizes),
        devices_per_node=options.devices_per_node,
        microbatch_sizes=sizes,
        schedules=searched_schedules(  # an asynchronous one named without --allow-async: refused
            parse_schedules(options.schedule),
            allow_async=options.allow_async,
            named=options.schedule not in ("auto", "all"),
        ),
        allow_async=options.allow_async,
        optimizer=options.optimizer,
        replication=options.replication,
        per_schedule=options.plot is not None,
        target_tokens=target,
        days=options.days,
        memory_reserve_bytes=memory_reserve_bytes(options.memory_reserve, hardware.memory_bytes),
        tensor_parallel=options.tensor_parallel,
        recompute=options.recompute,
        zero=parse_zero(options.zero),
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
    )
    if not batch_given:
        batch = default_global_batch(profile.provenance.tokens_per_sample or 1, sizes)
        config = replace(config, global_batch_size=batch)
    for count in config.device_counts:  # a given --tensor-parallel the model or a count cannot take: refused now
        tensor_parallel_sizes(config.tensor_parallel, profile, cluster_for(hardware, count, config.devices_per_node))
    plot = Path(options.plot) if options.plot is not None else None
    return CapacityJob(model=options.model, profile=profile, config=config, plot=plot)


def run_capacity_job(job: CapacityJob, *, progress: Callable[[int, int, str], None] | None = None) -> CapacityReport:
    """The sweep, and its plot when --plot asked for one."""
    report = capacity_sweep(job.profile, job.config, model=job.model, progress=progress)
    if job.plot is not None:
        from pipeplan.capacity.plot import plot_capacity

        plot_capacity(report, job.plot)
    return report
