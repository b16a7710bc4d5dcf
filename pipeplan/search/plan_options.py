"""`pipeplan plan`'s options: the flags it shares with `capacity` (`search.flags.SearchFlags`) and its own, declared
once and checked before anything slow (profiling may take minutes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeplan.console import warn
from pipeplan.errors import ConfigError
from pipeplan.graph.tracers import check_tracer
from pipeplan.options import argument, option
from pipeplan.profiling.profile_options import check_attention, unknown_device
from pipeplan.search.flags import AUTO, SearchFlags, parse_memory, parse_parallel, parse_schedules

DEFAULT_OUTPUT = "plan"
MODEL_HELP = "Built-in model, path/to/file.py:factory or package.module:factory."
PROFILE_HELP = "Plan from a profile file (pipeplan's JSON, or a PipeDream graph.txt) instead of, or with, MODEL."
DEVICES_HELP = "Devices, or NODESxPER_NODE, e.g. 16 or 2x8 (default: local GPUs, or 2 on CPU; min(N, 8) per node)."
POST_VALIDATE_HELP = (
    "auto, on or off: predict steps whose optimizer step is post-validated (`run --post-validate`: each rank starts "
    "its next step at its own end) — auto where that shortens the period (synchronous schedules, ZeRO 0, the undo "
    "copy within memory)."
)
TRACER_HELP = "fx, export (torch.export) or auto: fx, else export (e.g. --tracer export)."
POST_VALIDATE_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True, kw_only=True)
class PlanOptions(SearchFlags):
    model: str | None = argument(None, help=MODEL_HELP)
    profile: Path | None = option(None, "--profile", help=PROFILE_HELP)
    devices: str | None = option(None, "--devices", "-n", help=DEVICES_HELP)
    device: str = option("cpu", "--device", help="Profile MODEL on cpu or cuda (measured) or meta (analytic).")
    post_validate: str = option("auto", "--post-validate", help=POST_VALIDATE_HELP)
    granularity: int | None = option(None, "--granularity", help="Layer grouping depth when tracing the model.")
    tracer: str = option("auto", "--tracer", help=TRACER_HELP)
    output: str | None = option(DEFAULT_OUTPUT, "--output", "-o", help="Directory for plan.json and scripts.")

    def __post_init__(self) -> None:
        super().__post_init__()
        # here, not at the top: `pipeplan --help` imports this file, and these import the search (numpy)
        from pipeplan.search.config import searched_schedules
        from pipeplan.search.inputs import check_plan_options, parse_devices
        from pipeplan.search.pinned import parse_layout

        check_plan_options(output=self.output, granularity=self.granularity)
        parse_devices(self.devices)
        if self.post_validate not in POST_VALIDATE_CHOICES:
            choices = ", ".join(POST_VALIDATE_CHOICES)
            raise ConfigError(f"--post-validate must be one of {choices}, got {self.post_validate!r}")
        if self.profile is not None:
            without_model = self.model is None
            flags: tuple[tuple[str, object], ...] = (
                ("-a", self.assignments),
                ("--granularity", self.granularity),
                ("--device", self.device != "cpu"),
                ("--attention", self.attention != "auto"),
            )
            ignored = [
                flag for flag, given in flags if given and (without_model or flag in ("--device", "--attention"))
            ]
            if ignored:
                warn(f"{', '.join(ignored)} ignored: --profile plans with the file's costs")
        check_tracer(self.tracer)
        if self.device.partition(":")[0] not in ("cpu", "cuda", "meta"):
            raise unknown_device(self.device, count_flag="--devices")
        if self.profile is None:
            check_attention(self.attention, self.device)
        names, named = parse_schedules(self.schedule, ())
        zero = parse_memory(self.memory).zero
        searched_schedules(names, allow_async=True, zero=zero, named=named)  # refusals
        if self.layout is not None:  # its schedule, named as in --schedule: asynchronous allowed, not with its ZeRO-1
            pinned = parse_layout(self.layout)
            searched_schedules((pinned.schedule_name,), allow_async=True, zero=pinned.zero)
            self._warn_ignored_by_layout()
        parallel = parse_parallel(self.parallel)
        for key, size in (("tp", parallel.tensor), ("cp", parallel.context), ("ep", parallel.expert)):
            if isinstance(size, int) and size > 1 and self.profile is None and self.device != "meta":
                raise ConfigError(
                    f"--parallel {key}={size} plans analytically: profile with --device meta --hardware NAME (or give "
                    "an analytic --profile)"
                )

    def _warn_ignored_by_layout(self) -> None:
        """`--layout` plans that layout alone (no search): the flags that only steer the search are ignored."""
        memory = parse_memory(self.memory)
        given = (
            ("--parallel", self.parallel is not None),
            ("--schedule", self.schedule != AUTO),
            ("-b/--microbatch-size", self.microbatch_size is not None),
            ("--memory zero=", memory.zero != AUTO),
            ("--memory recompute=", memory.recompute != AUTO),
        )
        ignored = [flag for flag, on in given if on]
        if ignored:
            warn(
                f"{', '.join(ignored)} ignored: --layout plans exactly its layout, without a search (`pipeplan "
                "capacity` with the same flags searches beside it)"
            )
