"""Built-in models and model loading. `load_model(ref, options)` returns a ModelSpec.

The names below load on first use (module `__getattr__`): importing a submodule that needs no model (e.g.
`pipeplan.models.assignments`) does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeplan.models.assignments import parse_assignments
    from pipeplan.models.builtins import BUILTINS, register
    from pipeplan.models.gpt import gpt
    from pipeplan.models.llama import llama
    from pipeplan.models.mlp import mlp
    from pipeplan.models.registry import load_model
    from pipeplan.models.resnet import resnet
    from pipeplan.models.spec import ModelSpec

_WHERE = {
    "BUILTINS": "builtins",
    "ModelSpec": "spec",
    "gpt": "gpt",
    "llama": "llama",
    "load_model": "registry",
    "mlp": "mlp",
    "parse_assignments": "assignments",
    "register": "builtins",
    "resnet": "resnet",
}
__all__ = ["BUILTINS", "ModelSpec", "gpt", "llama", "load_model", "mlp", "parse_assignments", "register", "resnet"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pipeplan.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pipeplan.models.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
