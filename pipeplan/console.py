"""Shared terminal output: rich consoles (stdout for results, stderr for progress and errors) and JSON."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

out = Console()
err = Console(stderr=True)


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
