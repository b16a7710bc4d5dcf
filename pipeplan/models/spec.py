"""ModelSpec: what pipeplan needs to know about a model, built-in or user-supplied."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeplan.errors import ModelError

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


EXPECTED_BATCH = "((inputs, ...), target): a tuple of input tensors for forward, then the loss target tensor"


# Upper bounds of the built-in models' size options: past them a model cannot be built, traced or partitioned in
# reasonable time or memory (the partitioner is quadratic in layers; llama-405b has 126 layers, hidden 16384).
SIZE_LIMITS = {
    "layers": 1024,
    "blocks": 1024,
    "hidden": 131_072,
    "intermediate": 524_288,
    "channels": 65_536,
    "heads": 1024,
    "kv_heads": 1024,
    "seq": 1 << 20,
    "vocab": 1 << 22,
    "image": 8192,
    "classes": 1 << 20,
}


def check_sizes(**sizes: int) -> None:
    """Each size option is >= 1 and at most its SIZE_LIMITS bound (ValueError naming the option otherwise)."""
    for name, value in sizes.items():
        if not 1 <= value <= SIZE_LIMITS[name]:
            raise ValueError(f"{name} must be positive and at most {SIZE_LIMITS[name]:,}, got {value:,}")


def check_batch(batch: Any, where: str) -> Batch:
    """`batch` if it has the `((inputs, ...), target)` structure, else one ModelError line showing it."""
    ok = (
        isinstance(batch, tuple | list)
        and len(batch) == 2
        and isinstance(batch[0], tuple | list)
        and all(isinstance(x, torch.Tensor) for x in batch[0])
        and isinstance(batch[1], torch.Tensor)
    )
    if not ok:
        raise ModelError(f"{where} returned {_structure(batch)}; it must return {EXPECTED_BATCH}")
    return tuple(batch[0]), batch[1]


def _structure(value: Any, depth: int = 0) -> str:
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if isinstance(value, tuple | list) and depth < 2:
        items = ", ".join(_structure(v, depth + 1) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"({items})" if isinstance(value, tuple) else f"[{items}]"
    return type(value).__name__


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model pipeplan can trace, profile, partition and run.

    - `build()` constructs the module on the current default device. `torch.manual_seed(seed)` then `build()` on
      the CPU defines the model's initial state: every rank of `pipeplan run` holds exactly those tensors
      (parameters and buffers) for its stages, whatever build() does to make them (see runtime/materialize.py).
      `with torch.device("meta"): spec.build()` must also work (tracing and planning allocate nothing).
    - `sample_batch(batch_size, generator)` returns `((inputs, ...), target)`: a tuple of input tensors for
      `forward` and the target tensor for `loss_fn(output, target)`. Deterministic for a given generator state.
    - `data(batch_size, seed)` optionally yields real `((inputs, ...), target)` batches for training (default:
      synthetic batches from `sample_batch`).
    - `leaf_modules`: module classes torch.fx must not trace into (e.g. one with data-dependent control flow).
    - `init_module(module)`: a *complete* per-submodule initializer (after the submodule's own
      `reset_parameters()`, it sets every parameter and buffer of that submodule), declared only for models too
      large to build whole on one host: there, and only there, each rank builds its part on the meta device and
      initializes it with this (seeded per submodule), and says so. Without it such a model is refused.
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
            for batch in self.data(batch_size, seed):
                yield check_batch(batch, f"model {self.name!r}: data")
            return
        generator = torch.Generator().manual_seed(seed)
        while True:
            yield self.sample_batch(batch_size, generator=generator)
