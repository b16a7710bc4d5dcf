"""The `pipeplan` command line: a thin typer app. Each command lives beside its library code
(`pipeplan/<subpackage>/commands.py`) as parse -> library call -> render; this file registers them and turns
`PipeplanError` into one red line and exit code 1 (usage errors exit 2, as click does)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import typer
from rich.markup import escape

from pipeplan.console import err
from pipeplan.errors import PipeplanError

app = typer.Typer(
    name="pipeplan",
    help="Plan and run pipeline-parallel training for PyTorch models: profile -> partition -> schedule -> run.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)

# (command name, "module:function"); every function's docstring ends with an example.
_COMMANDS: list[tuple[str, str]] = [  # in pipeline order, as `pipeplan --help` lists them
    ("models", "pipeplan.models.commands:models"),
    ("profile", "pipeplan.profiling.commands:profile"),
    ("simulate", "pipeplan.schedules.commands:simulate"),
    ("plan", "pipeplan.planner.commands:plan"),
    ("show", "pipeplan.planner.commands:show"),
    ("export", "pipeplan.planner.commands:export"),
    ("run", "pipeplan.runtime.commands:run"),
    ("capacity", "pipeplan.planner.capacity_commands:capacity"),
]


def _one_line_errors(func: Callable) -> Callable:
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except PipeplanError as exc:
            err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None

    return wrapper


def _register() -> None:
    for name, target in _COMMANDS:
        module_name, func_name = target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        app.command(name=name)(_one_line_errors(func))


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the pipeplan version and exit."),
) -> None:
    if version:
        from pipeplan import __version__

        typer.echo(__version__)
        raise typer.Exit(0)


_register()


def main() -> None:
    app()
