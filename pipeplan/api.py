"""The Python API: the whole chain (profile -> plan -> simulate -> run) as functions, for a notebook or a training
script. Each takes the keyword arguments of its CLI command, named as the fields of the command's options dataclass
(`--global-batch-size` -> `global_batch_size`, `-a layers=2` -> `assignments=["layers=2"]` or `{"layers": 2}`) or as
its flags (`log=` for `--log`: `options.flag_keywords`), with
the same defaults and the same checks: the dataclass is the one declaration (`ProfileOptions`, `PlanOptions`,
`SimulateOptions`, `RunOptions`), and the CLI commands call the same library functions. Errors are the same
one-line `PipeplanError` subclasses.

Each resolves its options as its command does and calls the same library function (`plan`: `search.plan_job.
prepare_plan` -> `search.planner.plan`). Differences from the CLI, where a function returns what a command prints:
`plan` writes its directory (plan.json, launch.sh, ...) only when `output=` is given (`Plan.save` writes plan.json)
and takes a Profile object as it is (no file); `profile` and `plan` also take a
`ModelSpec` or an `nn.Module` (with `example_batch=` and `loss_fn=`), registered in this process as `object:NAME`:
such a plan is planned and simulated here, but `run` starts fresh rank processes that rebuild the model from its
reference, so it needs a built-in name, `file.py:factory` or `pkg.mod:factory`.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeplan.errors import ConfigError, RunError

if TYPE_CHECKING:
    from pipeplan.artifact.plan import Plan
    from pipeplan.models.module_spec import module_spec
    from pipeplan.models.spec import ModelSpec
    from pipeplan.profiling.profile import Profile
    from pipeplan.runtime.train.trainer import RunResult
    from pipeplan.schedules.uniform import Ranking, Simulation

__all__ = ["ModelSpec", "Plan", "Profile", "module_spec", "plan", "profile", "run", "simulate"]
_CLASSES = {  # loaded on first use: ModelSpec and module_spec import torch, Plan and Profile numpy
    "ModelSpec": "pipeplan.models.spec",
    "Plan": "pipeplan.artifact.plan",
    "Profile": "pipeplan.profiling.profile",
    "module_spec": "pipeplan.models.module_spec",
}
_RENDER_ONLY = ("as_json", "json_output")  # how a command prints, not what it computes


def __getattr__(name: str) -> Any:
    if name not in _CLASSES:
        raise AttributeError(f"module 'pipeplan.api' has no attribute {name!r}")
    return getattr(importlib.import_module(_CLASSES[name]), name)


def _options(options_type: type, function: str, given: dict[str, Any], **fixed: Any):
    """`options_type` built from the keyword arguments `given`, each named as its field or its CLI flag (`log=` or
    `log_path=`; unknown names: one ConfigError line listing the known ones) and checked against the field's type
    (`_checked`), and `fixed` (what the API sets itself)."""
    from pipeplan.options import flag_keywords

    names = [f.name for f in dataclasses.fields(options_type) if f.init and f.name not in _RENDER_ONLY]
    aliases = {k: field for k, field in flag_keywords(options_type).items() if field in names}
    flag_of = {field: keyword for keyword, field in reversed(aliases.items())}  # a field's first flag
    unknown = sorted(set(given) - set(names) - set(aliases))
    if unknown:
        known = ", ".join(f"{n} ({flag_of[n]})" if n in flag_of else n for n in names)
        raise ConfigError(f"pipeplan.{function}() got unknown option(s) {', '.join(unknown)}; options: {known}")
    hints = typing.get_type_hints(options_type)
    values: dict[str, Any] = {}
    for name, value in given.items():
        field = aliases.get(name, name)
        if field in values:
            raise ConfigError(f"pipeplan.{function}() got {field}= and {flag_of[field]}= (the same option): give one")
        if field == "assignments" and isinstance(value, dict):
            value = [f"{key}={item}" for key, item in value.items()]
        values[field] = _checked(function, name, hints[field], value)
    missing = [
        f.name
        for f in dataclasses.fields(options_type)
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name not in values and f.name not in fixed
    ]
    if missing:
        raise ConfigError(f"pipeplan.{function}() needs {' and '.join(f'{name}=' for name in missing)}")
    return options_type(**values, **fixed)


_WORDS = {int: "a whole number", float: "a number", str: "text", bool: "True or False", Path: "a path"}


def _checked(function: str, name: str, hint: Any, value: Any) -> Any:
    kinds = (
        typing.get_args(hint)
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        else (hint,)
    )
    if value is None and type(None) in kinds:
        return value
    for kind in (kind for kind in kinds if kind is not type(None)):
        accepted, converted = _accepts(kind, value)
        if accepted:
            return converted
    expected = " or ".join(_describe(kind) for kind in kinds if kind is not type(None))
    raise ConfigError(f"pipeplan.{function}({name}={value!r}): expected {expected}, got {type(value).__name__}")


def _accepts(kind: Any, value: Any) -> tuple[bool, Any]:
    if typing.get_origin(kind) is list:  # list[str]: a list or tuple of text
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        return ok, list(value) if ok else value
    if kind is bool:
        return isinstance(value, bool), value
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool), value
    if kind is str:
        if isinstance(value, list | tuple) and all(_plain(v) for v in value):
            return True, ",".join(str(v) for v in value)
        return _plain(value), str(value) if _plain(value) else value
    if kind is Path:
        return isinstance(value, str | os.PathLike), Path(value) if isinstance(value, str | os.PathLike) else value
    return True, value  # anything else: the option's own checks


def _plain(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _describe(kind: Any) -> str:
    if typing.get_origin(kind) is list:
        return "a list of text"
    return _WORDS.get(kind, getattr(kind, "__name__", str(kind)))


def _model_reference(model: Any, example_batch: Any, loss_fn: Any) -> str:
    """A model reference load_model resolves: a string as given; a ModelSpec or an nn.Module (with its example
    batch and loss) registered in this process as `object:NAME`."""
    if isinstance(model, str):
        if example_batch is not None or loss_fn is not None:
            raise ConfigError("example_batch= and loss_fn= go with an nn.Module model, not a model name")
        return model
    from pipeplan.models.module_spec import module_spec, register_object
    from pipeplan.models.spec import ModelSpec

    if not isinstance(model, ModelSpec):
        if example_batch is None or loss_fn is None:
            raise ConfigError("an nn.Module model needs example_batch=((inputs, ...), target) and loss_fn=")
        model = module_spec(model, example_batch, loss_fn)
    return register_object(model)


def profile(model: str | ModelSpec | Any, *, example_batch: Any = None, loss_fn: Any = None, **options: Any) -> Profile:
    """Profile `model` layer by layer, as `pipeplan profile` does: a built-in name, file.py:factory,
    pkg.mod:factory or hf:..., a ModelSpec, or an nn.Module with `example_batch=((inputs, ...), target)` and
    `loss_fn=`. Options: `pipeplan profile`'s (batch_size=1, device="cpu", hardware=None, output=None, ...)."""
    from pipeplan.profiling.profile_job import profile_from_options
    from pipeplan.profiling.profile_options import ProfileOptions

    reference = _model_reference(model, example_batch, loss_fn)
    return profile_from_options(_options(ProfileOptions, "profile", options, model=reference, as_json=True))


def plan(
    model: str | ModelSpec | Any = None,
    *,
    profile: Profile | str | os.PathLike | None = None,
    example_batch: Any = None,
    loss_fn: Any = None,
    output: str | os.PathLike | None = None,
    **options: Any,
) -> Plan:
    """Search layouts and return the chosen Plan, as `pipeplan plan` does: MODEL profiled on the spot, or
    `profile=` (a Profile or a profile file; give the model too for a runnable plan). Writes the plan directory
    only when `output=` names one. Options: `pipeplan plan`'s (devices=None, global_batch_size=None, ...)."""
    from pipeplan.search.plan_job import prepare_plan, write_plan
    from pipeplan.search.plan_options import PlanOptions
    from pipeplan.search.planner import plan as plan_layouts

    reference = None if model is None else _model_reference(model, example_batch, loss_fn)
    in_memory, path = None, None
    if isinstance(profile, str | os.PathLike):
        path = Path(profile)
    elif profile is not None:
        from pipeplan.profiling.profile import Profile

        if not isinstance(profile, Profile):
            raise ConfigError(f"pipeplan.plan(profile=...): expected a Profile or a path, got {type(profile).__name__}")
        in_memory = profile
    given = {**options, "profile": path}
    request = _options(PlanOptions, "plan", given, model=reference, output=output, json_output=True)
    job = prepare_plan(request, profile=in_memory)
    chosen = plan_layouts(job.source, job.cluster, job.config)
    if job.output is not None:
        write_plan(chosen, job.output, job.source.profile)
    return chosen


def simulate(**options: Any) -> Simulation | Ranking:
    """Simulate a schedule with uniform per-device costs, as `pipeplan simulate` does: a Simulation (schedule,
    timeline, metrics; `to_dict()` is what `--json` prints), or with compare=True a Ranking of every schedule.
    Options: `pipeplan simulate`'s (schedule=, stages=, microbatches=, f=1.0, b=1.0, w=1.0, ...)."""
    from pipeplan.schedules.simulate_options import SimulateOptions
    from pipeplan.schedules.uniform import simulate_schedules

    return simulate_schedules(_options(SimulateOptions, "simulate", options))


def run(plan: Plan | str | os.PathLike, **options: Any) -> list[RunResult]:
    """Run the plan's ranks on this machine, as `pipeplan run` does, and return each rank's RunResult (losses,
    step times, ...) in rank order. `plan`: a Plan or a plan.json path. Options: `pipeplan run`'s (steps=10,
    trace_path=None, checkpoint_dir=None, lr=None, threads=None, ...)."""
    from pipeplan.artifact.plan import Plan
    from pipeplan.models.module_spec import OBJECT_PREFIX
    from pipeplan.runtime.launch.local import launch_local
    from pipeplan.runtime.launch.run_options import RunOptions

    _check_main_guard()
    loaded = plan if isinstance(plan, Plan) else Plan.load(plan)
    if loaded.model.ref.startswith(OBJECT_PREFIX):
        raise RunError(
            f"the plan's model {loaded.model.ref!r} is an object of this process; the ranks `run` starts rebuild the "
            "model from its reference: plan it as a built-in name, file.py:factory or pkg.mod:factory to run it"
        )
    with tempfile.TemporaryDirectory(prefix="pipeplan-api-") as folder:
        path = Path(folder) / "plan.json"
        if isinstance(plan, Plan):
            plan.save(path)
        else:
            path = Path(plan)
        run_options = _options(RunOptions, "run", options, plan=path)
        return launch_local(run_options.plan, run_options, threads=run_options.threads)


def _check_main_guard() -> None:
    """`run` starts its ranks through multiprocessing (forkserver or spawn), which re-imports the main script in each
    rank: a call at the script's top level, not under `if __name__ == "__main__":`, would run again in every rank
    and fail there with two tracebacks. Refuse it here, before any rank starts, naming the line."""
    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if path is None or frame is None:
        return  # an interactive session or `python -c`, or no call from the script's top level
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return
    line = frame.f_lineno
    guards = [node for node in tree.body if isinstance(node, ast.If) and _is_main_test(node.test)]
    guarded = any(node.body[0].lineno <= line <= (node.body[-1].end_lineno or 0) for node in guards)
    if not guarded:
        raise RunError(
            f"pipeplan.run() is called at the top level of {Path(path).name} (line {line}): its ranks re-import the "
            'script and would run it again; put the call under `if __name__ == "__main__":`'
        )


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"` (either order)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
        isinstance(x, ast.Constant) and x.value == "__main__" for x in sides
    )
