"""Shared by the bench_*.py scripts: each parses its arguments first, before it imports torch or pipeplan, so that
`--help` prints its usage (the script's docstring: what it runs, its targets, what it writes) and exits at once,
running nothing; an unknown argument is a usage error (exit 2)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def parse_args(
    doc: str | None, add: Callable[[argparse.ArgumentParser], None] | None = None, argv: list[str] | None = None
) -> argparse.Namespace:
    """The script's options: `add(parser)` declares them; `doc` is the description."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if add is not None:
        add(parser)
    return parser.parse_args(argv)
