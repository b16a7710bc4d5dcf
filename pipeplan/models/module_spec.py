"""A ModelSpec for a module object a user already holds (the Python API's `pipeplan.profile(module,
example_batch=..., loss_fn=...)`), and the in-process registration that lets every step that rebuilds a model by
name (profiling, the plan's tracing at the chosen microbatch size) find an object given to the API."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from pipeplan.errors import ModelError
from pipeplan.models.builtins import register
from pipeplan.models.spec import ModelSpec, check_batch

OBJECT_PREFIX = "object:"  # the reference an object model is registered under (this process only)


def module_spec(
    module: nn.Module,
    example_batch,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    name: str | None = None,
    tokens_per_sample: int | None = None,
) -> ModelSpec:
    """`module` as a ModelSpec: build() returns a copy of it (on the meta device under `torch.device("meta")`),
    sample_batch(b) the example batch `((inputs, ...), target)` cut or repeated along dim 0 to b samples."""
    if not isinstance(module, nn.Module):
        raise ModelError(f"a model object must be a torch.nn.Module or a ModelSpec, got {type(module).__name__}")
    if not callable(loss_fn):
        raise ModelError("give loss_fn=(output, target) -> loss with a module (e.g. torch.nn.functional.mse_loss)")
    inputs, target = check_batch(example_batch, "example_batch")
    template = copy.deepcopy(module)

    def build() -> nn.Module:
        copied = copy.deepcopy(template)
        return copied.to("meta") if torch.empty(()).device.type == "meta" else copied

    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        return tuple(_resized(x, batch_size) for x in inputs), _resized(target, batch_size)

    return ModelSpec(
        name=name or type(module).__name__,
        build=build,
        sample_batch=sample_batch,
        loss_fn=loss_fn,
        tokens_per_sample=tokens_per_sample,
    )


def _resized(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """The first `size` samples of `tensor`, repeated when it holds fewer."""
    repeats = -(-size // tensor.shape[0])
    return tensor.repeat(repeats, *([1] * (tensor.dim() - 1)))[:size].clone()


def register_object(spec: ModelSpec) -> str:
    """Register `spec` for this process under `object:NAME` and return that reference. Rank processes that `run`
    starts do not see it: a plan of an object model is planned and simulated here, run from a file.py:factory."""
    ref = f"{OBJECT_PREFIX}{spec.name}"
    register(ref, lambda: spec, f"model object {spec.name!r} given to the Python API")
    return ref
