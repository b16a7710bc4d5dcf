"""Shared terminal output: rich consoles (stdout for results, stderr for progress and errors) and JSON."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# emoji=False: rich would turn `:name:` into an emoji, and model references say `hf:llama:` (a llama appeared)
out = Console(emoji=False)
err = Console(stderr=True, emoji=False)


def wide(console: Console, width: int = 180) -> Console:
    """`console` for a wide table: a terminal as it is, or, into a pipe or file, at least `width` columns (the whole
    table, not wrapped to the default 80)."""
    return console if console.is_terminal else Console(file=console.file, width=max(console.width, width), emoji=False)


_warned: set[str] = set()  # messages printed with once=True in this process


def warn(message: str, *, once: bool = False) -> None:
    """The one way pipeplan warns a user (an input ignored, a fallback taken): `warning: MESSAGE`, one line on
    stderr, so that stdout stays clean for `--json`. `once`: print a message at most once per process (for
    warnings raised inside loops, e.g. per microbatch)."""
    if once:
        if message in _warned:
            return
        _warned.add(message)
    err.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def print_json(data: Any) -> None:
    """Print only JSON on stdout (what `--json` promises)."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def progress(*, quiet: bool = False) -> Progress:
    """A progress bar on stderr; disabled when `quiet` (e.g. under --json) or stderr is not a terminal."""
    return Progress(
        TextColumn("[bold blue]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        disable=quiet,
        transient=False,
    )


@contextmanager
def progress_task(description: str, *, total: int | None = None, quiet: bool = False) -> Iterator[Callable[..., None]]:
    """One task's progress bar on stderr; yields the function that moves it (rich's `update`: completed=, total=,
    advance=, description=)."""
    with progress(quiet=quiet) as bar:
        task = bar.add_task(description, total=total)
        yield functools.partial(bar.update, task)
