"""Every command's flag set, frozen: adding or removing a flag fails here until this table (and the docs) say so.
`plan` stays at 19 options or fewer (the issue's 20 less one planned addition, `--profile-from-run`), and the flags
`plan` and `capacity` share are declared once (`search.flags.SearchFlags`), with one default each."""

from __future__ import annotations

import dataclasses

import typer

from pipeplan.capacity.options import CapacityOptions
from pipeplan.cli import app
from pipeplan.search.flags import SearchFlags
from pipeplan.search.plan_options import PlanOptions

COMMANDS = typer.main.get_command(app).commands
SHARED = {
    "--arg",
    "--attention",
    "--global-batch-size",
    "--hardware",
    "--json",
    "--layout",
    "--memory",
    "--microbatch-size",
    "--overlap",
    "--parallel",
    "--precision",
    "--schedule",
}
FROZEN: dict[str, set[str]] = {
    "models": {"--json"},
    "profile": {
        "--arg",
        "--attention",
        "--concurrent",
        "--device",
        "--granularity",
        "--hardware",
        "--hardware-file",
        "--json",
        "--microbatch-size",
        "--output",
        "--precision",
        "--repeats",
        "--threads",
        "--timer",
        "--tracer",
        "--warmup",
    },
    "simulate": {
        "--b",
        "--chunks",
        "--comm",
        "--compare",
        "--f",
        "--input-grad-frees",
        "--json",
        "--memory-limit",
        "--microbatches",
        "--overlap-ms",
        "--pipeline-depth",
        "--post-validate",
        "--schedule",
        "--steps",
        "--trace",
        "--w",
    },
    "plan": SHARED | {"--device", "--devices", "--granularity", "--output", "--post-validate", "--profile", "--tracer"},
    "show": {"--json"},
    "export": {"--format", "--output"},
    "run": {
        "--check-every",
        "--checkpoint-dir",
        "--checkpoint-every",
        "--clip-grad-norm",
        "--decay-steps",
        "--device",
        "--heartbeat-timeout",
        "--init-from",
        "--log",
        "--lr",
        "--lr-schedule",
        "--momentum",
        "--optimizer",
        "--overlap-pairs",
        "--post-validate",
        "--precision",
        "--quiet",
        "--resume",
        "--seed",
        "--steps",
        "--tensorboard",
        "--threads",
        "--trace",
        "--trace-steps",
        "--warmup-steps",
        "--weight-decay",
    },
    "export-weights": {"--force", "--output", "--plan", "--shard-gb", "--step"},
    "capacity": SHARED | {"--days", "--devices", "--devices-per-node", "--plot", "--seq", "--target-tokens"},
    "refine": {"--json", "--output", "--plan", "--profile", "--schedule", "--with"},
    "calibrate": {"--device", "--dtype", "--json", "--name", "--output", "--quick"},
}
MAX_PLAN_OPTIONS = 19


def _long_flags(command) -> set[str]:
    """Each option's longest flag (`--microbatch-size` for profile's `--batch-size/--microbatch-size/-b`)."""
    return {max(param.opts, key=len) for param in command.params if param.param_type_name == "option"}


def test_every_command_has_its_frozen_flags():
    assert set(COMMANDS) == set(FROZEN), "a command was added or removed: freeze its flags here"
    for name, command in COMMANDS.items():
        found = _long_flags(command)
        assert found == FROZEN[name], (
            f"{name}: added {sorted(found - FROZEN[name])}, removed {sorted(FROZEN[name] - found)}"
        )


def test_plan_has_few_options():
    assert len(_long_flags(COMMANDS["plan"])) <= MAX_PLAN_OPTIONS


def test_plan_and_capacity_declare_their_shared_flags_once():
    shared = {field.name: field for field in dataclasses.fields(SearchFlags)}
    for options in (PlanOptions, CapacityOptions):
        fields = {field.name: field for field in dataclasses.fields(options)}
        for name, field in shared.items():  # the same Field: one flag spelling, default and help
            assert fields[name] is field, f"{options.__name__}.{name} is declared again"
    plan, capacity = _long_flags(COMMANDS["plan"]), _long_flags(COMMANDS["capacity"])
    assert plan & capacity == SHARED | {"--devices"}  # --devices: one count (or NxP) in plan, counts in capacity
