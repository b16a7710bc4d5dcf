"""`-a key=value` model options as a dict, parsed without building (or importing) any model: options are checked
before anything slow, and by commands that never import torch."""

from __future__ import annotations

from pipeplan.errors import ModelError


def parse_assignments(pairs: list[str] | None) -> dict[str, str]:
    """`["layers=4", "hidden=256"]` -> `{"layers": "4", "hidden": "256"}`."""
    options: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ModelError(f"model option {pair!r} must look like key=value (e.g. -a layers=4)")
        options[key.strip()] = value.strip()
    return options
