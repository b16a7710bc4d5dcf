"""The tracers `--tracer` names, checked without importing torch (options are checked before anything slow, and by
commands that never trace)."""

from __future__ import annotations

from pipeplan.errors import ConfigError

TRACERS = ("auto", "fx", "export")


def check_tracer(tracer: str) -> str:
    if tracer not in TRACERS:
        raise ConfigError(f"--tracer must be one of {', '.join(TRACERS)}, got {tracer!r}")
    return tracer
