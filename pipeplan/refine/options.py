"""`pipeplan refine`'s options, declared once and checked before anything is read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeplan.errors import ConfigError
from pipeplan.options import argument, option
from pipeplan.schedules.registry import SCHEDULE_NAMES

SAME, AUTO = "same", "auto"
SCHEDULE_HELP = (
    "same (default: the schedule the run ran, whose ops the costs were measured in), auto (every schedule) or "
    "one schedule's name."
)
OUTPUT_HELP = "Directory for the refined plan and its profile (default: the run's plan directory + -refined)."


@dataclass(frozen=True, kw_only=True)
class RefineOptions:
    trace: Path = argument(help="The measured trace `pipeplan run PLAN --trace FILE` wrote.")
    pooled_with: list[Path] | None = option(
        None,
        "--with",
        help="Another trace of the same plan (repeatable): the medians over every run's steps (e.g. --with run2.json).",
    )
    output: str | None = option(None, "--output", "-o", help=OUTPUT_HELP)
    plan: Path | None = option(None, "--plan", help="The plan.json the run ran (default: the one its trace names).")
    profile: Path | None = option(
        None, "--profile", help="The profile that plan was made from (default: profile.json beside it)."
    )
    schedule: str = option(SAME, "--schedule", "-s", help=SCHEDULE_HELP)
    json_output: bool = option(False, "--json", help="Print only the result as JSON.")

    def __post_init__(self) -> None:
        if self.schedule not in (SAME, AUTO, *SCHEDULE_NAMES):
            raise ConfigError(f"--schedule must be same, auto or one of: {', '.join(SCHEDULE_NAMES)}")

    def schedules(self, ran: str) -> tuple[str, ...] | None:
        """The schedules to plan with: the run's (`ran`), every one (None) or the one named."""
        if self.schedule == AUTO:
            return None
        return (ran,) if self.schedule == SAME else (self.schedule,)
