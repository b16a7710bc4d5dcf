"""`pipeplan models`: list the built-in models with their description and default parameter count."""

from __future__ import annotations

import functools
from typing import Any

import typer
from rich.table import Table

from pipeplan.console import out, print_json
from pipeplan.units import format_count


@functools.cache
def count_parameters(name: str) -> int:
    """Parameters of a built-in model with its default options, built on the meta device (no memory, instant)."""
    import torch

    from pipeplan.models.registry import load_model  # the models: imported when listed (they import torch)

    spec = load_model(name, {})
    with torch.device("meta"):
        module = spec.build()
    return sum(p.numel() for p in module.parameters())  # parameters() yields a tied weight once


def model_rows() -> list[dict[str, Any]]:
    from pipeplan.models.builtins import BUILTINS

    rows = []
    for name, builtin in BUILTINS.items():
        rows.append(
            {
                "name": name,
                "description": builtin.description,
                "params": count_parameters(name),
                "preset": dict(builtin.preset) if builtin.preset else None,
            }
        )
    return rows


def models(as_json: bool = typer.Option(False, "--json", help="Print only JSON on stdout.")) -> None:
    """List the built-in models (use one as MODEL; `-a key=value` changes its options).

    Example: pipeplan models --json
    """
    rows = model_rows()
    if as_json:
        print_json(rows)
        return
    table = Table(title="built-in models (parameters at default options)", title_justify="left")
    table.add_column("name")
    table.add_column("description")
    table.add_column("params", justify="right")
    for row in rows:
        table.add_row(row["name"], row["description"], format_count(row["params"]))
    out.print(table)
    out.print("Custom models: MODEL may also be path/to/file.py:factory or package.module:factory.", highlight=False)
    out.print(
        "Hugging Face (pip install 'pipeplan\\[hf]'): hf:gpt2, hf:llama, hf:bert, hf:<model_type>, hf:path/to/dir or "
        "a preset's shapes as its transformers type (hf:llama-3.1-70b); -a sets config fields (e.g. -a n_layer=4).",
        highlight=False,
    )
