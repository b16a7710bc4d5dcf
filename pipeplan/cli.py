"""The `pipeplan` command line: a thin typer app. Each command lives beside its library code
(`pipeplan/<subpackage>/commands.py`) as parse -> library call -> render, under 40 lines (tests/test_code_shape.py);
a command with many options takes them as one checked dataclass (pipeplan.options). This file registers them and
turns `PipeplanError` into one red line and exit code 1 (usage errors exit 2, as click does)."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable

import typer
from rich.markup import escape

from pipeplan.console import err
from pipeplan.errors import DEBUG_ENV, PipeplanError, user_code_location

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
    ("plan", "pipeplan.search.commands:plan"),
    ("show", "pipeplan.artifact.commands:show"),
    ("export", "pipeplan.artifact.commands:export"),
    ("run", "pipeplan.runtime.commands:run"),
    ("export-weights", "pipeplan.runtime.commands:export_weights"),
    ("refine", "pipeplan.refine.commands:refine"),
    ("capacity", "pipeplan.capacity.commands:capacity"),
    ("calibrate", "pipeplan.calibrate.commands:calibrate"),
]


def _error_line(exc: BaseException) -> str:
    """One line for an error a user's input or machine caused; the last resort names the exception."""
    if isinstance(exc, PipeplanError):  # the first line; a detail table (e.g. a deadlock's) stays in the library
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, MemoryError) or "can't allocate memory" in str(exc) or type(exc).__name__ == "OutOfMemoryError":
        return "out of memory: the sizes asked for do not fit this machine; reduce the batch size or model options"
    if isinstance(exc, OSError):
        where = f" {exc.filename!r}" if exc.filename else ""
        return f"cannot read or write{where}: {exc.strerror or exc}"
    if isinstance(exc, OverflowError):
        return f"a number is too large: {exc}; give a smaller value"
    if isinstance(exc, RecursionError):
        return "the model or input is nested too deeply to process"
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    location = user_code_location(exc)
    if location is not None:  # raised in the user's own file (a model's forward, a loss, a factory's helper)
        return f"your code raised {type(exc).__name__}: {first} at {location}"
    return f"unexpected {type(exc).__name__}: {first} (a pipeplan bug; {DEBUG_ENV}=1 shows the traceback)"


def _is_usage_error(exc: Exception) -> bool:
    """typer / click's own exceptions (bad parameter, usage): they print their usage block and exit 2."""
    return type(exc).__module__.split(".")[0] in ("click", "typer")


def _one_line_errors(func: Callable) -> Callable:
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except KeyboardInterrupt:
            err.print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None
        except SystemExit as exc:  # the user's code (a model's forward, its loss) exiting is not the command's end
            where = user_code_location(exc)
            if where is None:
                raise
            line = f"your code called sys.exit({exc.code!r}) at {where}; a model's code must return or raise, not exit"
            err.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except Exception as exc:
            if _is_usage_error(exc) or (os.environ.get(DEBUG_ENV) and not isinstance(exc, PipeplanError)):
                raise
            err.print(f"[bold red]error:[/] {escape(_error_line(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper


def _register() -> None:
    for name, target in _COMMANDS:
        module_name, func_name = target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        app.command(name=name)(_one_line_errors(func))


def _print_version(value: bool) -> None:
    """`pipeplan --version`: eager, so that it prints before click asks for a command."""
    if value:
        from pipeplan.version import VERSION

        typer.echo(VERSION)
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the pipeplan version and exit."
    ),
) -> None:
    pass


_register()


def main() -> None:
    try:
        app()
    finally:
        _flush_stdout()


def _flush_stdout() -> None:
    """stdout that cannot be written (a full disk, a closed pipe) ends with one line, not an ignored-exception dump
    at interpreter exit."""
    try:
        sys.stdout.flush()
    except OSError as exc:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if not isinstance(exc, BrokenPipeError):
            err.print(f"[bold red]error:[/] cannot write to standard output: {exc.strerror or exc}", highlight=False)
            raise SystemExit(1) from None
