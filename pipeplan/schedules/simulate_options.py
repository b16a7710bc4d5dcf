"""`pipeplan simulate`'s options, declared once and checked before anything is generated."""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.errors import ConfigError
from pipeplan.options import option
from pipeplan.paths import check_output_file
from pipeplan.schedules.registry import SCHEDULE_NAMES, schedule_info
from pipeplan.schedules.simulate import PAPER_INPUT_GRAD_FREES

MEMORY_LIMIT_HELP = (
    "Max live activations per device, in microbatches of a device's full slice (zb-auto is generated under it, "
    "default p = 1F1B's; other schedules are checked against it). E.g. --memory-limit 8."
)
INPUT_GRAD_FREES_HELP = (
    "Fraction of a microbatch's activations the input-gradient pass I frees (W frees the rest); 0.5 is the Zero "
    "Bubble paper's setting. E.g. --input-grad-frees 0.4."
)
OVERLAP_HELP = (
    "dualpipev: the time of each overlapped F&B op, its forward and backward run at once (default: F + B, no gain "
    "counted from the overlap). E.g. --overlap-ms 2.5."
)

POST_VALIDATE_HELP = (
    "Steps post-validated (`run --post-validate`): zb-auto and zbv rank their candidates by the period of steps that "
    "each device starts at its own end, and the period is printed beside the makespan."
)

STEPS_HELP = (
    "pipedream schedules: steps of --microbatches in the simulated stream (default: enough to measure the steady "
    "state)."
)


@dataclass(frozen=True, kw_only=True)
class SimulateOptions:
    schedule: str | None = option(
        None, "--schedule", "-s", help=f"One of: {', '.join(SCHEDULE_NAMES)} (default: all of them, --compare)."
    )
    stages: int = option(..., "--stages", "--pipeline-depth", "-p", help="Pipeline devices P.")
    microbatches: int = option(..., "--microbatches", "-m", help="Microbatches per step M.")
    chunks: int | None = option(None, "--chunks", "-v", help="Stages per device (interleaved; default per schedule).")
    f: float = option(1.0, "--f", help="Forward ms of one device's model slice.")
    b: float = option(1.0, "--b", help="Input-gradient (I) ms of one device's slice; full B = I + W.")
    w: float = option(1.0, "--w", help="Weight-gradient (W) ms of one device's slice.")
    comm: float = option(0.0, "--comm", help="Transfer ms across each device boundary.")
    memory_limit: float | None = option(None, "--memory-limit", help=MEMORY_LIMIT_HELP)
    input_grad_frees: float = option(PAPER_INPUT_GRAD_FREES, "--input-grad-frees", help=INPUT_GRAD_FREES_HELP)
    overlap_ms: float | None = option(None, "--overlap-ms", help=OVERLAP_HELP)
    steps: int | None = option(None, "--steps", help=STEPS_HELP)
    post_validate: bool = option(False, "--post-validate", help=POST_VALIDATE_HELP)
    compare: bool = option(
        False,
        "--compare",
        help="Simulate every schedule and rank them by makespan (by the period with --post-validate).",
    )
    json_output: bool = option(False, "--json", help="Print only JSON (metrics + op lists).")
    trace: str | None = option(None, "--trace", help="Write a Chrome trace (chrome://tracing, Perfetto).")

    def __post_init__(self) -> None:
        if self.trace is not None:  # checked, and the path kept as it will be written (~ expanded)
            object.__setattr__(self, "trace", str(check_output_file(self.trace, "--trace")))
        if self.schedule is None:  # no schedule named: every one, ranked
            object.__setattr__(self, "compare", True)
        if self.compare and self.trace is not None:
            raise ConfigError("--trace writes one schedule's timeline: pass --schedule NAME (not --compare)")
        if self.schedule is not None:
            schedule_info(self.schedule)  # an unknown name is refused here, in one line listing the known ones
        if self.f + self.b + self.w <= 0:
            raise ConfigError("--f, --b and --w are all 0: give at least one op a time > 0")
