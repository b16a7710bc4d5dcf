"""ModelSpec: what pipeplan needs to know about a model, built-in or user-supplied."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
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
      (parameters and buffers) for its stages, whatever build() does to make them (see runtime/weights/materialize.py).
      `with torch.device("meta"): spec.build()` must also work (tracing and planning allocate nothing).
    - `sample_batch(batch_size, generator)` returns `((inputs, ...), target)`: a tuple of input tensors for
      `forward` and the target tensor for `loss_fn(output, target)`. Deterministic for a given generator state.
    - `data(batch_size, seed)` optionally yields real `((inputs, ...), target)` batches for training (default:
      synthetic batches from `sample_batch`): global batches of `batch_size` samples, the same stream on every rank;
      data-parallel pipeline p of d trains on samples [p*B/d, (p+1)*B/d) of each. A `data` that also takes a keyword
      `shard=(p, d)` is called that way instead and yields only pipeline p's B/d samples of each global batch (each
      pipeline then reads only its own shard). `seed` is the run's (`--seed`, default the plan's); a resumed run
      draws and drops the batches of the steps already done.
    - `optimizer(named_parameters, lr, weight_decay)` optionally builds the optimizer over a rank's parameters (a
      list of (whole-model name, parameter), e.g. to exempt norms and biases from weight decay) instead of the
      plan's; `lr` and `weight_decay` are the run's (--lr, --weight-decay, default the plan's). Not with ZeRO-1.
      The plan counted memory for its own optimizer (`plan --precision MODE,OPTIMIZER`: give the bytes per
      parameter yours keeps).
    - `lr_lambda(step)` optionally gives the learning-rate factor at 0-based `step` (as
      torch.optim.lr_scheduler.LambdaLR's lr_lambda; a function of the step alone, so resuming is exact) instead
      of --lr-schedule / --warmup-steps / --decay-steps.
    - `leaf_modules`: module classes torch.fx must not trace into (e.g. one with data-dependent control flow).
    - `trace_context()`: a context manager every trace of the model runs in (profile, plan and each rank of `run`
      alike), e.g. the `hf:` adapter's, under which transformers leaves a plain causal mask to the attention
      kernel while exporting as it does in an eager run (models/hf.py).
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
    data: Callable[..., Iterator[Batch]] | None = None
    init_module: Callable[[nn.Module], None] | None = None
    optimizer: Callable[[list[tuple[str, nn.Parameter]], float, float], torch.optim.Optimizer] | None = None
    lr_lambda: Callable[[int], float] | None = None
    trace_context: Callable[[], AbstractContextManager] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ModelSpec.name must be non-empty")
        for attr in ("build", "sample_batch", "loss_fn"):
            if not callable(getattr(self, attr)):
                raise TypeError(f"ModelSpec.{attr} must be callable")
        for attr in ("data", "init_module", "optimizer", "lr_lambda", "trace_context"):
            if getattr(self, attr) is not None and not callable(getattr(self, attr)):
                raise TypeError(f"ModelSpec.{attr} must be callable or None")

    def tracing(self) -> AbstractContextManager:
        """The context a trace of this model runs in (`trace_context`; none by default)."""
        return self.trace_context() if self.trace_context is not None else nullcontext()

    def batches(self, batch_size: int, seed: int = 0) -> Iterator[Batch]:
        """Global training batches: the factory's real data if it supplies some, else endless synthetic ones."""
        if self.data is not None:
            sharded = takes_shard(self.data)
            for batch in self.data(batch_size, seed, shard=(0, 1)) if sharded else self.data(batch_size, seed):
                yield check_batch(batch, f"model {self.name!r}: data")
            return
        generator = torch.Generator().manual_seed(seed)
        while True:
            yield self.sample_batch(batch_size, generator=generator)

    def shard_batches(self, batch_size: int, seed: int, shard: tuple[int, int]) -> Iterator[Batch]:
        """Data-parallel pipeline `shard` = (p, d)'s samples of each global batch of `batch_size`: [p*B/d,
        (p+1)*B/d), read by the factory's `data(..., shard=(p, d))` where it takes `shard`, else cut from the global
        batch. The shards of one step, joined in pipeline order, are `batches()`'s global batch."""
        index, count = shard
        size = batch_size // count
        if self.data is not None and takes_shard(self.data):
            where = f"{self.name!r}: data(shard={shard})"
            for batch in self.data(batch_size, seed, shard=shard):
                yield _sized(check_batch(batch, f"model {where}"), size, where)
            return
        for batch in self.batches(batch_size, seed):
            inputs, target = _sized(batch, batch_size, f"{self.name!r}: data")
            cut = slice(index * size, (index + 1) * size)
            yield tuple(x[cut] for x in inputs), target[cut]


def takes_shard(data: Callable) -> bool:
    """Whether a `data` function accepts the keyword `shard` (then it reads one pipeline's part of each batch)."""
    try:
        parameters = inspect.signature(data).parameters
    except (TypeError, ValueError):
        return False
    return "shard" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _sized(batch: Batch, size: int, where: str) -> Batch:
    inputs, target = batch
    found = inputs[0].shape[0] if inputs else target.shape[0]
    if found != size or target.shape[0] != size:
        raise ModelError(f"model {where} gave a batch of {found} samples; the run needs {size}")
    return batch
