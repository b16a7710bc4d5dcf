"""pipeplan.options: one dataclass declares a command's options; typer and parse_options read the same fields."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import typer
from typer.testing import CliRunner

from pipeplan.errors import ConfigError
from pipeplan.options import argument, command, option, parse_options


@dataclass(frozen=True, kw_only=True)
class ToyOptions:
    name: str = argument(help="A name.")
    count: int = option(2, "--count", "-c", help="How many.")
    tags: list[str] | None = option(None, "--tag", help="Repeatable.")
    loud: bool = option(False, "--loud", help="Shout.")
    size: str = option(..., "--size", help="Required.")

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"--count must be >= 1, got {self.count}")


def _app() -> tuple[typer.Typer, list[ToyOptions]]:
    seen: list[ToyOptions] = []
    app = typer.Typer()

    @app.command()
    @command(ToyOptions)
    def toy(options: ToyOptions) -> None:
        """Toy command."""
        seen.append(options)

    return app, seen


def test_command_parses_fields_into_one_checked_object():
    app, seen = _app()
    result = CliRunner().invoke(app, ["ann", "-c", "3", "--tag", "x", "--tag", "y", "--loud", "--size", "4"])
    assert result.exit_code == 0, result.output
    assert seen == [ToyOptions(name="ann", count=3, tags=["x", "y"], loud=True, size="4")]
    assert CliRunner().invoke(app, ["ann", "--size", "1"]).exit_code == 0
    assert seen[-1] == ToyOptions(name="ann", size="1")  # the dataclass defaults are the command's


def test_command_usage_errors_and_checks():
    app, _ = _app()
    assert CliRunner().invoke(app, ["ann"]).exit_code == 2  # --size is required
    failed = CliRunner().invoke(app, ["ann", "--size", "1", "--count", "0"])
    assert isinstance(failed.exception, ConfigError)  # __post_init__ runs under the command
    assert "--count" in CliRunner().invoke(app, ["--help"]).output


def test_parse_options_matches_the_command():
    parsed = parse_options(ToyOptions, ["bob", "--count", "5", "--size", "2"], prog="toy", help="Toy.")
    assert parsed == ToyOptions(name="bob", count=5, size="2")
    with pytest.raises(ConfigError, match="--count"):
        parse_options(ToyOptions, ["bob", "--count", "0", "--size", "2"], prog="toy", help="Toy.")


@pytest.mark.parametrize(("argv", "code"), [(["--help"], 0), (["bob"], 2), (["bob", "--size", "1", "--nope"], 2)])
def test_parse_options_exits_like_click(argv, code, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_options(ToyOptions, argv, prog="toy", help="Toy.")
    assert stopped.value.code == code
    printed = capsys.readouterr()
    assert "Usage: toy" in printed.out + printed.err  # help on stdout, a usage error on stderr
