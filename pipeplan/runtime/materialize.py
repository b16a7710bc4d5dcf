"""Materialize parameters of a meta-built model deterministically, submodule by submodule.

A rank owns only some layers, so it cannot run the model's constructor-time initialization on real memory. Instead
every submodule that holds a parameter the rank needs is re-initialized with its own seed, derived from (plan seed,
submodule qualified name): `reset_parameters()` if it has one, then `ModelSpec.init_module` if set. The
single-process reference runs the same procedure over every submodule, in the same (module tree) order, so each
parameter ends with the same values on every rank that holds it. Tied parameters (one Parameter object reachable
under two names) stay one object: replacements are applied by identity across every module given.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable, Iterable

import torch
from torch import nn


def submodule_seed(seed: int, qualified_name: str) -> int:
    """A stable 63-bit seed for submodule `qualified_name` (independent of Python's hash randomization)."""
    return (int(seed) * 1_000_003 + zlib.crc32(qualified_name.encode())) % (2**63 - 1)


def _direct_tensors(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    found = [("param", name, p) for name, p in module._parameters.items() if p is not None]
    found += [("buffer", name, b) for name, b in module._buffers.items() if b is not None]
    return found


def _replace_everywhere(roots: Iterable[nn.Module], old: torch.Tensor, new: torch.Tensor) -> None:
    for root in roots:
        for module in root.modules():
            for store in (module._parameters, module._buffers):
                for key, value in store.items():
                    if value is old:
                        store[key] = new


def _initialize(module: nn.Module, name: str, init_module: Callable[[nn.Module], None] | None, seed: int) -> bool:
    """Run the module's own initializers under its seed; False when it has none."""
    has_reset = callable(getattr(module, "reset_parameters", None))
    if not has_reset and init_module is None:
        return False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(submodule_seed(seed, name))
        with torch.no_grad():
            if has_reset:
                module.reset_parameters()
            if init_module is not None:
                init_module(module)
    return True


def _fallback_init(module: nn.Module, name: str, seed: int) -> None:
    warnings.warn(
        f"submodule {name or '<root>'!r} ({type(module).__name__}) has no reset_parameters(); its tensors are "
        "filled with normal(0, 0.02) (give the ModelSpec an init_module to control this)",
        stacklevel=3,
    )
    generator = torch.Generator().manual_seed(submodule_seed(seed, name))
    with torch.no_grad():
        for _, _, tensor in _direct_tensors(module):
            if tensor.is_floating_point():
                values = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype) * 0.02
                tensor.copy_(values.to(tensor.device))
            else:
                tensor.zero_()


def materialize(
    model: nn.Module,
    *,
    needed: Iterable[torch.Tensor] | None,
    seed: int,
    device: torch.device | str = "cpu",
    init_module: Callable[[nn.Module], None] | None = None,
    also_replace_in: Iterable[nn.Module] = (),
) -> set[int]:
    """Allocate on `device` and initialize every submodule of `model` holding a tensor in `needed` (all tensors
    when None). Replacements are applied in `model` and `also_replace_in` (e.g. the FX GraphModule, which keeps
    its own references). Returns the ids of the new tensors."""
    keep_alive = None if needed is None else list(needed)  # ids stay unique while the old tensors live
    needed_ids = None if keep_alive is None else {id(t) for t in keep_alive}
    roots = [model, *also_replace_in]
    new_ids: set[int] = set()
    # A submodule sharing a tensor with a needed one (tied weights) is initialized too, in module-tree order, so the
    # last initializer to write a shared tensor is the same one the whole-model reference runs last.
    for name, module in model.named_modules(remove_duplicate=False):
        direct = _direct_tensors(module)
        if not direct:
            continue
        if needed_ids is not None and not any(id(t) in needed_ids or id(t) in new_ids for _, _, t in direct):
            continue
        for kind, _, tensor in direct:
            if id(tensor) in new_ids:
                continue
            new = _allocate(tensor, kind, device)
            new_ids.add(id(new))
            _replace_everywhere(roots, tensor, new)
        if not _initialize(module, name, init_module, seed):
            _fallback_init(module, name, seed)
    del keep_alive
    return new_ids


def _allocate(tensor: torch.Tensor, kind: str, device: torch.device | str) -> torch.Tensor:
    data = torch.zeros_like(tensor, device=device)  # deterministic even where an initializer skips a tensor
    if kind == "param":
        return nn.Parameter(data, requires_grad=tensor.requires_grad)
    return data
