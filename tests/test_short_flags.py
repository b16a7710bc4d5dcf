"""A short flag means one thing in every command: `-b` is the microbatch size wherever it exists, `-p` the pipeline
depth, and so on. And every `Example:` line of a command's --help parses with that command's options."""

from __future__ import annotations

import re
import shlex
from collections import defaultdict
from pathlib import Path

import pytest
import typer

from pipeplan.cli import app

COMMANDS = typer.main.get_command(app).commands


def _flags(command) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(long flags, short flags) of each option of a click command."""
    found = []
    for param in command.params:
        if param.param_type_name != "option":
            continue
        names = [*param.opts, *param.secondary_opts]
        found.append((tuple(n for n in names if n.startswith("--")), tuple(n for n in names if not n.startswith("--"))))
    return found


def short_flag_meanings() -> dict[str, dict[str, frozenset[str]]]:
    """short flag -> {command: the long flags of the option it abbreviates there}."""
    meanings: dict[str, dict[str, frozenset[str]]] = defaultdict(dict)
    for name, command in COMMANDS.items():
        for longs, shorts in _flags(command):
            for short in shorts:
                meanings[short][name] = frozenset(longs)
    return meanings


def disagreements(meanings: dict[str, dict[str, frozenset[str]]]) -> list[str]:
    """The short flags that abbreviate options sharing no long flag in two commands."""
    found = []
    for short, per_command in sorted(meanings.items()):
        if not frozenset.intersection(*per_command.values()):
            uses = ", ".join(f"{cmd}: {'/'.join(sorted(longs))}" for cmd, longs in sorted(per_command.items()))
            found.append(f"{short} means different options ({uses})")
    return found


def test_each_short_flag_stands_for_one_long_option_everywhere():
    assert not disagreements(short_flag_meanings()), "\n".join(disagreements(short_flag_meanings()))


def test_a_long_option_has_the_same_short_flags_in_every_command():
    shorts_of: dict[str, dict[str, tuple[str, ...]]] = defaultdict(dict)
    for name, command in COMMANDS.items():
        for longs, shorts in _flags(command):
            for long in longs:
                shorts_of[long][name] = tuple(sorted(shorts))
    differing = {long: per for long, per in shorts_of.items() if len(set(per.values())) > 1}
    assert not differing, f"options abbreviated in some commands only: {differing}"


def test_the_check_sees_a_disagreement():
    """What the real map held before the flags were made consistent: -b and -p each meant two options."""
    before = {
        "-b": {"profile": frozenset({"--batch-size"}), "plan": frozenset({"--microbatch-size"})},
        "-p": {"simulate": frozenset({"--stages"}), "plan": frozenset({"--pipeline-depth"})},
        "-o": {"profile": frozenset({"--output"}), "export": frozenset({"--output"})},
    }
    assert [line.split()[0] for line in disagreements(before)] == ["-b", "-p"]
    meanings = short_flag_meanings()
    assert meanings["-b"].keys() == {"profile", "plan", "capacity"} and meanings["-p"].keys() == {"simulate"}


def _help_examples() -> list[tuple[str, list[str]]]:
    examples = []
    for name, command in COMMANDS.items():
        for line in (command.help or "").splitlines():
            line = line.strip()
            if line.startswith("Example: pipeplan "):
                argv = shlex.split(line.removeprefix("Example: pipeplan "), comments=True)
                examples.append((name, argv))
    return examples


def test_every_command_shows_an_example():
    assert {name for name, _ in _help_examples()} == set(COMMANDS)


@pytest.mark.parametrize(
    "name,argv", _help_examples(), ids=lambda value: " ".join(value) if isinstance(value, list) else value
)
def test_help_examples_parse(name, argv):
    """An example's flags exist and its values convert (parsing only: several examples need a GPU or big models;
    the documents' commands run in tests/test_docs.py)."""
    assert argv[0] == name, f"`{name} --help` shows an example of `{argv[0]}`"
    with COMMANDS[name].make_context(name, argv[1:]) as context:
        assert context.params


def test_version_prints_without_a_command():
    from typer.testing import CliRunner

    from pipeplan import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == __version__


def test_the_short_flag_table_in_docs_matches_the_commands():
    """docs/cli.md's table: each short flag, the long option it stands for, and the commands that have it."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    rows = re.findall(r"^\| `(-\w)` \| `(--[\w-]+)`[^|]*\| ([^|]+) \|$", text, flags=re.MULTILINE)
    documented = {short: (long, {c.strip() for c in commands.split(",")}) for short, long, commands in rows}
    assert documented.pop("-h", None) == ("--help", {"every command"})
    meanings = short_flag_meanings()
    assert set(documented) == set(meanings), "docs/cli.md lists other short flags than the commands have"
    for short, per_command in meanings.items():
        long, commands = documented[short]
        assert long in frozenset.intersection(*per_command.values()), f"docs/cli.md: {short} is not {long}"
        assert commands == set(per_command), f"docs/cli.md: {short} is in {sorted(per_command)}"
