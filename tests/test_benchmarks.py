"""Every script in benchmarks/ parses its arguments before it imports anything heavy or runs anything: `--help`
prints its usage and exits 0, importing nothing but the standard library and the shared `arguments` helper (run
here in this process: a script that ran its benchmark on --help, or imported torch, rich or pipeplan first, fails
the test)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
HELPERS = {"arguments.py", "timing.py", "byte_gpt.py"}  # modules the scripts import, not scripts
SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if path.name not in HELPERS)


def test_every_python_file_is_a_script_or_a_known_helper():
    assert len(SCRIPTS) >= 16
    for path in SCRIPTS:
        assert 'if __name__ == "__main__":' in path.read_text(), f"{path.name}: a script, or add it to HELPERS"
    for name in HELPERS:
        assert 'if __name__ == "__main__":' not in (BENCHMARKS / name).read_text()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_help_prints_usage_and_runs_nothing(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    sys.modules.pop("arguments", None)
    before = set(sys.modules)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 0
    output = capsys.readouterr().out
    assert output.startswith(f"usage: {script.name}") and "--help" in output
    loaded = {name.split(".")[0] for name in set(sys.modules) - before} - set(sys.stdlib_module_names)
    assert loaded <= {"arguments"}, f"imported {sorted(loaded)} before parsing its arguments"


@pytest.mark.parametrize("script", SCRIPTS[:3], ids=lambda path: path.name)
def test_an_unknown_argument_is_a_usage_error(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [str(script), "--no-such-option"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


CHECK_FRESH = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
for script in sys.argv[2:]:
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        assert done.code == 0, script
    heavy = sorted({"torch", "pipeplan", "rich", "numpy"} & {name.split(".")[0] for name in sys.modules})
    assert not heavy, f"{script} imported {heavy} before parsing its arguments"
"""


@pytest.mark.slow
def test_help_imports_no_torch_in_a_fresh_interpreter():
    """This process has torch loaded already; a fresh one sees a script import it (or pipeplan, rich) early."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", CHECK_FRESH, str(BENCHMARKS), *map(str, SCRIPTS)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
