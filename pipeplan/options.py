"""Command-line options declared once, as the fields of a frozen dataclass.

`option(default, "--flag", help=...)` gives a field its default and its typer flag; `@command(Options)` turns
`def cmd(options: Options)` into the typer command whose parameters are those fields, so the command function gets
one checked object; `parse_options(Options, argv)` parses an argument list the same way outside the typer app (the
per-rank worker parses `pipeplan run`'s options with it). The dataclass's `__post_init__` checks the values,
wherever they come from, before any slow work starts.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import typer

_PARAMETER = "pipeplan.options"  # field metadata key: the field's typer Option / Argument
Options = TypeVar("Options")


def option(default: Any, *flags: str, help: str, **settings: Any) -> Any:
    """A dataclass field that is a command-line option: `steps: int = option(10, "--steps", help="Steps.")`."""
    parameter = typer.Option(default, *flags, help=help, **settings)
    field_default = dataclasses.MISSING if default is ... else default  # `...`: a required option
    return dataclasses.field(default=field_default, metadata={_PARAMETER: parameter})


def argument(default: Any = ..., *, help: str) -> Any:
    """A dataclass field that is a positional argument; required unless it has a default."""
    field_default = dataclasses.MISSING if default is ... else default
    return dataclasses.field(default=field_default, metadata={_PARAMETER: typer.Argument(default, help=help)})


def _parameters(options_type: type) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(options_type)
    return [
        inspect.Parameter(
            field.name, inspect.Parameter.KEYWORD_ONLY, default=field.metadata[_PARAMETER], annotation=hints[field.name]
        )
        for field in dataclasses.fields(options_type)
        if _PARAMETER in field.metadata
    ]


def command(options_type: type[Options]) -> Callable[[Callable[[Options], Any]], Callable[..., Any]]:
    """Decorator: the typer command taking `options_type`'s fields as its parameters (typer reads the signature
    set here) and calling the decorated function with one `options_type` built from them."""

    def decorate(func: Callable[[Options], Any]) -> Callable[..., Any]:
        parameters = _parameters(options_type)

        @functools.wraps(func)
        def typer_command(**values: Any) -> Any:
            return func(options_type(**values))

        # typer reads inspect.signature, which honours __signature__ (an attribute functions are not typed with)
        typer_command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        typer_command.__annotations__ = {p.name: p.annotation for p in parameters}
        return typer_command

    return decorate


def parse_options(options_type: type[Options], argv: Sequence[str] | None, *, prog: str, help: str) -> Options:
    """`argv` (default: sys.argv[1:]) parsed into `options_type` exactly as its typer command parses it. `--help`
    prints the usage and exits 0; a usage error prints it and exits 2, as click does."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    parsed: list[Options] = []
    app.command(help=help)(command(options_type)(parsed.append))
    try:  # standalone, click prints usage errors and help itself, and ends every parse with SystemExit
        args = list(argv) if argv is not None else None
        typer.main.get_command(app).main(args=args, prog_name=prog, standalone_mode=True)
    except SystemExit as exc:
        if parsed and not exc.code:
            return parsed[0]
        raise
    raise AssertionError("click's standalone main always exits")


def flag_keywords(options_type: type) -> dict[str, str]:
    """{keyword: field} for the long flags that name an option otherwise than its field (`--log` -> `log` for
    `log_path`, `--arg` -> `arg` for `assignments`): the Python API takes either name."""
    keywords = {}
    for field in dataclasses.fields(options_type):
        parameter = field.metadata.get(_PARAMETER)
        flags = [flag for decl in getattr(parameter, "param_decls", None) or () for flag in decl.split("/")]
        longs = [flag[2:].replace("-", "_") for flag in flags if flag.startswith("--") and not flag.startswith("--no-")]
        keywords.update({keyword: field.name for keyword in longs if keyword != field.name})
    return keywords
