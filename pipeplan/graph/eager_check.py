"""Eager diagnosis: when no tracer can capture a model, run it once, eagerly, on its own sample batch. A model
that fails there (a config whose fields disagree, a forward that raises) is reported as that failure, naming the
user's file and line or, for an `hf:` model, its shape-defining config fields, instead of the tracers' messages
about data-dependent code. On the meta device only shape errors can show: an error that needs real data (a
data-dependent op on meta) says nothing about the model and leaves the tracers' message."""

from __future__ import annotations

import torch
from torch import nn

from pipeplan.errors import ModelError, PipeplanError, user_code_location
from pipeplan.models.spec import ModelSpec

_NEEDS_DATA = ("meta", "data-dependent", "Data dependent", "DataDependent", "unbacked", "item()")


def check_runs_eagerly(module: nn.Module, spec: ModelSpec, inputs: tuple) -> None:
    """Run `module(*inputs)` without gradients; a failure that is the model's own is one ModelError line."""
    try:
        with torch.no_grad():
            module(*inputs)
    except PipeplanError:
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "(no message)"
        on_meta = any(t.is_meta for t in inputs if isinstance(t, torch.Tensor))
        if on_meta and any(mark in f"{type(exc).__name__} {exc}" for mark in _NEEDS_DATA):
            return
        raise ModelError(f"{spec.name}: {_what_failed(spec, exc)} {type(exc).__name__}: {text}{_hint(spec)}") from None


def _what_failed(spec: ModelSpec, exc: BaseException) -> str:
    where = user_code_location(exc)
    if where is not None:
        return f"your model's forward fails on its own sample batch (at {where}), before any tracing:"
    return "the model's forward fails on its own sample batch, before any tracing:"


def _hint(spec: ModelSpec) -> str:
    """For an `hf:` model, the config fields that shape it (the -a options to check)."""
    if not spec.name.startswith("hf:"):
        return ""
    skip = {"task", "data", "seq_len"}
    fields = ", ".join(f"{k}={v}" for k, v in spec.options.items() if k not in skip and isinstance(v, int | float))
    return f"; its config: {fields}: check these -a options" if fields else "; check the -a options"
