"""Module paths retired by moves and renames stay retired: none of them imports, and no doc, docstring, script or
test names one as a code path (a reader following it would find nothing, or a different module).

When a module moves, add its old dotted path here with where it went."""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_RUNTIME = {  # runtime/ split into rooms by concept (issue 33)
    "materialize": "weights.materialize",
    "init_weights": "weights.init_weights",
    "weights_output": "weights.weights_output",
    "checkpoint": "weights.checkpoint",
    "routing": "step.messages",  # clashed with profiling/routing (MoE tokens)
    "comm": "step.comm",
    "overlap": "step.pair_runner",  # clashed with costs/overlap
    "recompute_run": "step.recompute_run",
    "stages": "step.stages",
    "executor": "step.executor",
    "grads": "step.grads",
    "zero": "step.zero",
    "precision_run": "step.precision_run",
    "async_weights": "step.async_weights",
    "train": "train.loop",
    "trainer": "train.trainer",
    "asynchronous": "train.asynchronous",
    "post_validate": "train.post_validate",
    "step_checks": "train.step_checks",
    "optim": "train.optim",
    "metrics": "train.metrics",
    "trace_io": "train.trace_io",
    "config": "train.config",
    "launch": "launch.local",
    "worker": "launch.worker",
    "watchdog": "launch.watchdog",
    "prelaunch": "launch.prelaunch",
    "run_options": "launch.run_options",
}
_GENERATORS = (
    "gpipe",
    "one_f_one_b",
    "interleaved",
    "zb_h1",
    "zb_h2",
    "zb_auto",
    "zb_heuristic",
    "zbv",
    "zbv_greedy",
    "dualpipev",
    "pipedream",
)
RETIRED: dict[str, str] = {  # old dotted path -> where it went
    **{f"pipeplan.runtime.{old}": f"pipeplan.runtime.{new}" for old, new in _RUNTIME.items()},
    **{f"pipeplan.schedules.{name}": f"pipeplan.schedules.generators.{name}" for name in _GENERATORS},
    "pipeplan.partition.api": "pipeplan.partition.partitioner",  # clashed with pipeplan.api
    "pipeplan.costs.transformer": "tests/helpers/transformer_reference.py (a test oracle); costs.tensor_parallel",
}
# old module paths that are packages now (runtime/launch.py -> runtime/launch/local.py, runtime/train.py -> .../loop.py)
NOW_PACKAGES = {"pipeplan.runtime.launch", "pipeplan.runtime.train"}
SCANNED = ("README.md", "ARCHITECTURE.md", "docs", "pipeplan", "tests", "benchmarks", "examples")
SUFFIXES = {".md", ".py", ".sh", ".sbatch", ".toml", ".txt"}


def live_module(dotted: str) -> bool:
    """Whether `dotted` still names a module file (a package now standing at the old path does not count)."""
    spec = importlib.util.find_spec(dotted)
    return spec is not None and not (dotted in NOW_PACKAGES and spec.submodule_search_locations is not None)


@functools.cache
def _pattern(dotted: str) -> re.Pattern:
    """The old path written as code: dotted (`pipeplan.runtime.routing`, `pipeplan.runtime.routing.Message`) or as a
    file (`runtime/routing.py`, `pipeplan/runtime/routing.py`, `runtime/routing.build_routing`). For a path that is a
    package now, only the file forms and its old module's names count (`pipeplan.runtime.launch.local` is new)."""
    parts = dotted.split(".")
    room_file = "/".join(parts[1:])  # runtime/routing
    file_form = rf"(?:(?<=pipeplan/)|(?<![\w/])){re.escape(room_file)}(?:\.py\b|\.[A-Za-z_])"
    if dotted in NOW_PACKAGES:
        return re.compile(file_form)
    return re.compile(rf"\b{re.escape(dotted)}\b(?![/])|{file_form}")


def mentions(text: str, dotted: str) -> list[str]:
    room_file = "/".join(dotted.split(".")[1:])
    if dotted not in text and room_file not in text:  # the cheap test first: most files name no old path
        return []
    return [match.group(0) for match in _pattern(dotted).finditer(text)]


def _scanned_files():
    this = Path(__file__).resolve()
    for entry in SCANNED:
        path = ROOT / entry
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for file in files:
            if file.is_file() and file.suffix in SUFFIXES and file.resolve() != this and "golden" not in file.parts:
                yield file


@pytest.mark.parametrize("dotted", sorted(RETIRED))
def test_retired_module_does_not_import(dotted):
    assert not live_module(dotted), f"{dotted} is retired (moved to {RETIRED[dotted]}); remove it again"


def test_no_file_names_a_retired_path():
    found = []
    for file in _scanned_files():
        text = file.read_text(errors="replace")
        for dotted, new in RETIRED.items():
            found += [f"{file.relative_to(ROOT)}: {hit} (now {new})" for hit in mentions(text, dotted)]
    assert not found, "retired module paths named:\n" + "\n".join(found)


def test_golden_launch_scripts_start_the_current_worker():
    for script in sorted((ROOT / "tests/plan/golden").glob("*")):
        assert "pipeplan.runtime.worker" not in script.read_text(), script.name


def test_the_checks_catch_a_live_or_named_path():
    """The checks can fail: a module that exists is live, and each way of writing an old path is found."""
    assert live_module("pipeplan.runtime.commands") and live_module("pipeplan.schedules.registry")
    assert not live_module("pipeplan.runtime.launch")  # a package now
    text = (
        "see runtime/routing.py, pipeplan/runtime/overlap.py and `runtime/executor.forward_seed`; "
        "python -m pipeplan.runtime.worker; from pipeplan.schedules.zbv import zbv; pipeplan/runtime/launch.py"
    )
    assert mentions(text, "pipeplan.runtime.routing") == ["runtime/routing.py"]
    assert mentions(text, "pipeplan.runtime.overlap") == ["runtime/overlap.py"]
    assert mentions(text, "pipeplan.runtime.executor") == ["runtime/executor.f"]
    assert mentions(text, "pipeplan.runtime.worker") == ["pipeplan.runtime.worker"]
    assert mentions(text, "pipeplan.schedules.zbv") == ["pipeplan.schedules.zbv"]
    assert mentions(text, "pipeplan.runtime.launch") == ["runtime/launch.py"]
    new = "tests/runtime/test_mailbox.py, runtime/step/comm.py, pipeplan.runtime.launch.local, "
    new += "schedules/generators/zbv.py"
    assert not any(mentions(new, dotted) for dotted in RETIRED)
