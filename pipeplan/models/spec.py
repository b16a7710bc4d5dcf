"""ModelSpec: what pipeplan needs to know about a model, built-in or user-supplied."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model pipeplan can trace, profile, partition and run.

    - `build()` constructs the module on the current default device, so `with torch.device("meta"): spec.build()`
      builds it without memory and each runtime rank can materialize only its own parameters.
    - `sample_batch(batch_size, generator)` returns `(inputs, target)`: a tuple of input tensors for `forward` and
      the target for `loss_fn(output, target)`. Deterministic for a given generator state.
    - `data(batch_size, seed)` optionally yields real `(inputs, target)` batches for training (default: synthetic
      batches from `sample_batch`).
    - `leaf_modules`: module classes torch.fx must not trace into (e.g. one with data-dependent control flow).
    - `init_module(module)` initializes one submodule's own parameters in place (default: its
      `reset_parameters()`); applied submodule by submodule after materializing from the meta device, so a rank
      that owns only some layers initializes them exactly as a whole-model build would with the same seeds.
    """

    name: str
    build: Callable[[], nn.Module]
    sample_batch: Callable[..., Batch]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    options: dict[str, Any] = field(default_factory=dict)
    tokens_per_sample: int | None = None
    leaf_modules: tuple[type[nn.Module], ...] = ()
    data: Callable[[int, int], Iterator[Batch]] | None = None
    init_module: Callable[[nn.Module], None] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ModelSpec.name must be non-empty")
        for attr in ("build", "sample_batch", "loss_fn"):
            if not callable(getattr(self, attr)):
                raise TypeError(f"ModelSpec.{attr} must be callable")

    def batches(self, batch_size: int, seed: int = 0) -> Iterator[Batch]:
        """Training batches: the factory's real data if it supplies some, else endless synthetic ones."""
        if self.data is not None:
            yield from self.data(batch_size, seed)
            return
        generator = torch.Generator().manual_seed(seed)
        while True:
            yield self.sample_batch(batch_size, generator=generator)
