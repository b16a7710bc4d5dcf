"""Every registered schedule reaches every consumer: `simulate`, `show` (the plan's re-simulation and description),
each `export` format (torch-csv, megatron, torchtitan) and what `run` does before and while building a rank (the
checks before any rank starts, the step strategy's checks, each rank's stages and messages read off its op lists)
either handles it or refuses it with one line naming what to change. A consumer keeping its own table of schedule
names (a KeyError for a schedule it lacks) fails here; the fake schedule below shows it. The runs themselves:
tests/runtime/test_distributed.py (every synchronous schedule, from the registry) and test_async_run.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pipeplan.artifact import exports
from pipeplan.artifact.manual import manual_plan
from pipeplan.artifact.plan import Plan
from pipeplan.cli import app
from pipeplan.errors import PipeplanError
from pipeplan.runtime.step.messages import build_routing
from pipeplan.runtime.step.stages import build_pipeline_model, check_plan_runs, load_spec
from pipeplan.runtime.train.asynchronous import AsynchronousSteps
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.train.loop import SynchronousSteps
from pipeplan.runtime.train.optim import check_training
from pipeplan.schedules import registry
from pipeplan.schedules.generators.one_f_one_b import one_f_one_b
from pipeplan.schedules.registry import SCHEDULE_NAMES, ScheduleInfo, schedule_info

runner = CliRunner()
LLAMA = dict(
    layers=4, hidden=16, heads=2, kv_heads=2, intermediate=32, seq=8, vocab=32
)  # torchtitan's llama3 counterpart: every export maps it
EXPORTS = ("torch-csv", "megatron", "torchtitan")


OK, REFUSED = "ok", "refused"


def _cli(args: list[str]) -> str:
    """OK, REFUSED (one `error:` line naming what to change) or, for anything else, what went wrong."""
    result = runner.invoke(app, args)
    if result.exit_code == 0:
        return OK
    lines = [line for line in result.output.splitlines() if line.strip()]
    one_line = result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error:")
    # the plans here are built-ins: no line may blame pipeplan or "your code" (a consumer patched in by a test)
    crashed = "pipeplan bug" in result.output or "your code raised" in result.output
    return REFUSED if one_line and not crashed else f"exit {result.exit_code}: {result.output[-300:]}"


def _runtime(plan: Plan) -> None:
    """What `run` does with the plan on this process before and while building each rank (no process group)."""
    config = RunConfig(steps=1, quiet=True)
    check_plan_runs(plan)
    check_training(plan, load_spec(plan), config)
    strategy = AsynchronousSteps if schedule_info(plan.schedule).asynchronous else SynchronousSteps
    strategy.check(plan, config)
    for rank in range(plan.world_size):
        model = build_pipeline_model(plan, rank, torch.device("cpu"))
        build_routing(plan, model.stage_io, model.model_inputs, model.differentiable)


def _consumers(plan_path: Path, out: Path) -> dict[str, Callable[[], str]]:
    name = Plan.load(plan_path).schedule
    consumers: dict[str, Callable[[], str]] = {
        "simulate": lambda: _cli(["simulate", "--schedule", name, "--stages", "2", "--microbatches", "4"]),
        "show": lambda: _cli(["show", str(plan_path)]),
    }
    for fmt in EXPORTS:
        target = out / f"export.{fmt}"
        consumers[f"export {fmt}"] = lambda fmt=fmt, target=target: _cli(
            ["export", str(plan_path), "-f", fmt, "-o", str(target)]
        )
    consumers["run"] = lambda: _outcome(lambda: _runtime(Plan.load(plan_path)))
    return consumers


def _outcome(call: Callable[[], None]) -> str:
    try:
        call()
    except PipeplanError as exc:  # a refusal: one line naming what to change
        lines = str(exc).strip().splitlines()
        return REFUSED if len(lines) == 1 else f"a refusal of {len(lines)} lines: {exc}"
    except Exception as exc:  # noqa: BLE001 - anything else is a consumer that does not know the schedule
        return f"{type(exc).__name__}: {exc}"
    return OK


def consumer_outcomes(name: str, tmp_path: Path) -> dict[str, str]:
    """Each consumer's answer to a plan of schedule `name`: OK, REFUSED, or what went wrong."""
    plan = manual_plan("llama", LLAMA, schedule=name, pipeline_devices=2, num_microbatches=4)
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    return {consumer: check() for consumer, check in _consumers(plan_path, tmp_path).items()}


def consumer_problems(name: str, tmp_path: Path) -> list[str]:
    """Each consumer that neither handles schedule `name` nor refuses it in one line, with what it did."""
    outcomes = consumer_outcomes(name, tmp_path)
    return [f"{consumer}: {found}" for consumer, found in outcomes.items() if found not in (OK, REFUSED)]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_consumer_handles_or_refuses_every_schedule(name, tmp_path):
    outcomes = consumer_outcomes(name, tmp_path)
    info = schedule_info(name)
    expected = {"export torch-csv": REFUSED} if info.asynchronous else {}  # torch has no asynchronous ones
    if info.not_exportable:  # dualpipe: no engine places a stage on two ranks
        expected = {f"export {fmt}": REFUSED for fmt in EXPORTS}
    assert {consumer: found for consumer, found in outcomes.items() if found != OK} == expected


def _fake_schedule(monkeypatch) -> str:
    """A schedule added to the registry only (1F1B's op lists under another name): one place, as the next one is."""
    name = "fake-1f1b"

    def generator(num_devices: int, num_microbatches: int):
        return dataclasses.replace(one_f_one_b(num_devices, num_microbatches), name=name)

    info = dataclasses.replace(schedule_info("1f1b"), name=name, generator=generator)
    assert isinstance(info, ScheduleInfo)
    monkeypatch.setitem(registry._BY_NAME, name, info)
    return name


def test_a_schedule_added_to_the_registry_reaches_every_consumer(monkeypatch, tmp_path):
    assert set(consumer_outcomes(_fake_schedule(monkeypatch), tmp_path).values()) == {OK}  # as 1f1b's plans


def test_a_consumer_with_its_own_name_table_is_caught(monkeypatch, tmp_path):
    """The coverage check can fail: the torchtitan export looking schedules up in a table of its own (as it did
    before the registry held torch's names) crashes on the new schedule, and the check names it."""
    name = _fake_schedule(monkeypatch)
    table = {known: schedule_info(known).torch_name for known in SCHEDULE_NAMES}
    real = exports.torchtitan_export

    def with_own_table(plan, csv_path, *args, **kwargs):
        table[plan.schedule]  # noqa: B018 - the KeyError a stale table gives
        return real(plan, csv_path, *args, **kwargs)

    monkeypatch.setattr(exports, "torchtitan_export", with_own_table)
    problems = consumer_problems(name, tmp_path)
    assert len(problems) == 1 and problems[0].startswith("export torchtitan: exit 1") and "KeyError" in problems[0]
