"""The Python API's argument-type class of the fuzz tests (issue 38 Deliver 8): every keyword of `pipeplan.profile`,
`plan`, `simulate` and `run`, named as its field or as its CLI flag, given values of every wrong kind (other types,
lists where a text is expected, bools where a count is, NaN and infinities, negative and zero counts, empty text):
the options each entry builds (`api._options`, the path every entry takes before any work) either accept the value
or refuse it with one PipeplanError line — never another exception from inside. Then a sample of whole calls."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pipeplan
from pipeplan import api
from pipeplan.errors import PipeplanError
from pipeplan.options import flag_keywords
from pipeplan.profiling.profile_options import ProfileOptions
from pipeplan.runtime.launch.run_options import RunOptions
from pipeplan.schedules.simulate_options import SimulateOptions
from pipeplan.search.plan_options import PlanOptions

WRONG = [  # values of every wrong kind; some are right for some keywords (then the options take them)
    object(),
    {"a": 1},
    [1.5],
    ["a", 1],
    [],
    2.5j,
    b"x",
    math.nan,
    math.inf,
    -math.inf,
    -1,
    0,
    10**30,
    2.5,
    True,
    "",
    " ",
    "nan",
    "-3",
    ",",
]
ENTRIES = {  # entry: (its options, what the entry itself fixes)
    "profile": (ProfileOptions, dict(model="mlp", as_json=True)),
    "plan": (PlanOptions, dict(model="mlp", output=None, json_output=True)),
    "simulate": (SimulateOptions, dict(stages=2, microbatches=4)),  # its required options, fuzzed by the last test
    "run": (RunOptions, dict(plan=None)),  # a plan file: the fixture's
}


def _keywords(options_type: type, fixed: dict) -> list[str]:
    names = [f.name for f in dataclasses.fields(options_type) if f.init and f.name not in (*fixed, *api._RENDER_ONLY)]
    return names + [k for k, field in flag_keywords(options_type).items() if field in names]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("api_fuzz")
    pipeplan.plan("mlp", assignments={"layers": 2, "hidden": 8}, devices=2, global_batch_size=4, output=folder)
    return folder / "plan.json"


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_every_keyword_with_every_wrong_kind_is_taken_or_one_line(entry, plan_file):
    options_type, fixed = ENTRIES[entry]
    fixed = {**fixed, "plan": plan_file} if entry == "run" else fixed
    outcomes = {"taken": 0, "refused": 0}
    for keyword in _keywords(options_type, fixed):
        for value in WRONG:
            try:
                api._options(options_type, entry, {keyword: value}, **fixed)
            except PipeplanError as exc:
                message = str(exc)
                assert message and "\n" not in message, (keyword, value, message)
                outcomes["refused"] += 1
            except Exception as exc:  # noqa: BLE001 - the point: nothing else may escape
                pytest.fail(f"pipeplan.{entry}({keyword}={value!r}) raised {type(exc).__name__}: {exc}")
            else:
                outcomes["taken"] += 1
    assert outcomes["refused"] > outcomes["taken"]  # most wrong kinds are refused (the test can fail)


def test_a_wrong_type_names_the_keyword_as_the_user_typed_it(plan_file):
    with pytest.raises(PipeplanError, match=r"pipeplan\.run\(log=2\.5\)"):
        api._options(RunOptions, "run", {"log": 2.5}, plan=plan_file)
    with pytest.raises(PipeplanError, match=r"log_path= and log="):
        api._options(RunOptions, "run", {"log_path": "a.log", "log": "b.log"}, plan=plan_file)
    with pytest.raises(PipeplanError, match=r"log_path \(log\)"):  # the unknown-keyword line lists both names
        api._options(RunOptions, "run", {"logfile": "a.log"}, plan=plan_file)


def test_every_cli_flag_is_an_api_keyword():
    """The API takes each option by its field name or its flag's name (`log=` for `--log`), derived from the one
    declaration, so the two cannot drift: every long flag of the four commands resolves to a field."""
    for options_type, _ in ENTRIES.values():
        aliases = flag_keywords(options_type)
        for field in dataclasses.fields(options_type):
            parameter = field.metadata.get("pipeplan.options")
            for decl in getattr(parameter, "param_decls", None) or ():
                for flag in (f for f in decl.split("/") if f.startswith("--") and not f.startswith("--no-")):
                    keyword = flag[2:].replace("-", "_")
                    assert aliases.get(keyword, keyword) == field.name, (options_type.__name__, flag)
    assert flag_keywords(RunOptions)["log"] == "log_path" and flag_keywords(PlanOptions)["arg"] == "assignments"


def test_whole_calls_with_wrong_kinds_are_one_line():
    with pytest.raises(PipeplanError, match=r"simulate\(\) needs stages= and microbatches="):
        pipeplan.simulate(schedule="1f1b")
    for kwargs in (dict(stages=math.nan), dict(microbatches=[]), dict(f=-math.inf), dict(schedule=3.5)):
        with pytest.raises(PipeplanError) as caught:
            pipeplan.simulate(**{"schedule": "1f1b", "stages": 2, "microbatches": 4, **kwargs})
        assert "\n" not in str(caught.value)


SCRIPT = """\
import pipeplan
{body}
"""
GUARDS = {  # script body: refused as unguarded?
    'pipeplan.run("missing/plan.json", steps=1)': True,
    'def main():\n    pipeplan.run("missing/plan.json", steps=1)\nmain()': True,
    'if __name__ == "__main__":\n    pipeplan.run("missing/plan.json", steps=1)': False,
    'def main():\n    pipeplan.run("missing/plan.json", steps=1)\nif "__main__" == __name__:\n    main()': False,
}


@pytest.mark.parametrize("body", list(GUARDS))
def test_run_at_a_scripts_top_level_is_one_line_before_any_rank_starts(body, tmp_path):
    """Without `if __name__ == "__main__":` each rank would re-import the script and run it again (two
    multiprocessing tracebacks): refused before anything starts; a guarded script gets past the check (here to the
    missing plan file)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(body=textwrap.dedent(body)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1
    if GUARDS[body]:
        assert last.startswith("pipeplan.errors.RunError: pipeplan.run() is called at the top level of train.py")
        assert 'if __name__ == "__main__":' in last
    else:
        assert "missing/plan.json" in last and "top level" not in last
