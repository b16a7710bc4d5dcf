"""Exact materialization: every tensor a rank's stages use is bit-for-bit what the user's factory builds for the
whole model with the plan's seed.

Mechanism (the default, exact by construction): each rank builds the *whole* model on the CPU exactly as the
single-process reference does (`build_whole`: `torch.manual_seed(seed)` then `spec.build()`), takes the tensors its
stages use -- matched by their qualified names (parameters, persistent and non-persistent buffers, plain tensor
attributes), never by tracer internals -- moves them to the run device, swaps them in for the meta tensors of the
traced model, and drops the rest. Whatever the factory does (custom `nn.Parameter` init, buffers computed in
`__init__`, an `_init_weights` pass after construction) is therefore reproduced; tied weights (one tensor under two
names) stay one tensor.

Meta path (only for models too large to build whole on one host): where the whole model, times the ranks sharing
the host, would not fit in its available memory, a factory that declares a complete per-submodule initializer
(`ModelSpec.init_module`) has each needed submodule initialized on its own (`reset_parameters()`, then
`init_module`, under a seed derived from the plan seed and the submodule's name); the run says so on stderr.
Without `init_module` such a model is refused with one line. The whole-model reference build never takes this path.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pipeplan.errors import ModelError, RunError
from pipeplan.graph.host_memory import host_memory_available
from pipeplan.models.spec import ModelSpec
from pipeplan.units import format_bytes

HOST_MEMORY_FRACTION = 0.8  # of the host's available memory the simultaneous whole-model builds may use


def build_whole(spec: ModelSpec, seed: int) -> nn.Module:
    """The whole model as the factory builds it: `torch.manual_seed(seed)` then `spec.build()` on the CPU (the
    caller's RNG state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            with torch.device("cpu"):
                return spec.build()
        except Exception as exc:  # a user's factory may raise anything
            raise ModelError(f"building model {spec.name!r} failed: {type(exc).__name__}: {exc}") from None


def named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (qualified name, tensor) of `module`: parameters and buffers (persistent or not), duplicates kept."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def find(module: nn.Module, name: str) -> torch.Tensor | None:
    """The tensor at qualified `name` of `module` (a parameter, a buffer or a plain tensor attribute), or None."""
    owner: object = module
    for part in name.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner if isinstance(owner, torch.Tensor) else None


def lookup(*modules: nn.Module | None, name: str) -> torch.Tensor:
    """The tensor at qualified `name` of the first of `modules` that has one; one RunError line if none does."""
    for module in modules:
        found = None if module is None else find(module, name)
        if found is not None:
            return found
    raise RunError(
        f"the model built by the factory has no tensor {name!r} that the traced graph uses (a constant created "
        "inside forward?); register it in __init__ (register_buffer) so every rank can build it"
    )


def whole_model_bytes(module: nn.Module) -> int:
    """Bytes of the model's distinct tensors (works on a meta-built module)."""
    seen: dict[int, int] = {}
    for _, tensor in named_tensors(module):
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def whole_build_fits(meta_module: nn.Module, ranks_on_host: int) -> tuple[bool, int, int]:
    """(fits, bytes needed by all ranks of this host building the whole model at once, bytes available)."""
    needed = whole_model_bytes(meta_module) * max(1, ranks_on_host)
    available = host_memory_available()
    return needed <= HOST_MEMORY_FRACTION * available, needed, available


def materialize_from_whole(
    whole: nn.Module,
    stages: Iterable[nn.Module],
    *,
    roots: Iterable[nn.Module],
    device: torch.device | str,
    constants: Callable[[], nn.Module] | None = None,
) -> None:
    """Swap every tensor the `stages` use (named by model-qualified names) for the same-named tensor of `whole`,
    moved to `device`, everywhere in `roots` and `stages` (by identity). Tensors one object in `whole` (ties) become
    one object on the rank. A name `whole` lacks (a constant the tracer computed while tracing, such as torch.fx's
    `_tensor_constant0` from an op on buffers) is taken from `constants()`: the tracer's output for `whole` itself,
    where the constant was computed from the real tensors."""
    stages = list(stages)
    traced_whole: list[nn.Module] = []

    def source_of(name: str) -> torch.Tensor:
        found = find(whole, name)
        if found is not None or constants is None:
            return found if found is not None else lookup(whole, name=name)
        if not traced_whole:
            traced_whole.append(constants())
        return lookup(traced_whole[0], name=name)

    by_old: dict[int, torch.Tensor] = {}  # id(meta tensor) -> new tensor
    by_source: dict[int, torch.Tensor] = {}  # id(whole-model tensor) -> new tensor
    keep_alive: list[torch.Tensor] = []  # ids stay unique while the old tensors live
    for stage in stages:
        for name, old in named_tensors(stage):
            source = source_of(name)
            if tuple(source.shape) != tuple(old.shape) or source.dtype != old.dtype:
                raise RunError(
                    f"the factory built {name!r} as {tuple(source.shape)} {source.dtype} but the traced model has "
                    f"{tuple(old.shape)} {old.dtype}; the factory must build the same model on every call"
                )
            new = by_source.get(id(source))
            if new is None:
                new = _moved(source, old, device)
                by_source[id(source)] = new
            if by_old.setdefault(id(old), new) is not new:
                raise RunError(f"{name!r} is tied to another tensor in the traced model but not in the factory's build")
            keep_alive.append(old)
    replace_tensors([*roots, *stages], by_old)
    del keep_alive


def _moved(source: torch.Tensor, old: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    data = source.detach().to(device)
    if isinstance(old, nn.Parameter):
        return nn.Parameter(data, requires_grad=old.requires_grad)
    return data


def replace_tensors(roots: Iterable[nn.Module], new_by_old_id: dict[int, torch.Tensor]) -> None:
    """Replace, in every module under `roots`, each parameter, buffer or plain tensor attribute whose id is a key."""
    if not new_by_old_id:
        return
    for root in roots:
        for module in root.modules():
            stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)  # a Parameter's is one
            for store in stores:
                for key, value in store.items():
                    if value is not None and id(value) in new_by_old_id:
                        store[key] = new_by_old_id[id(value)]
            for key, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and id(value) in new_by_old_id:
                    object.__setattr__(module, key, new_by_old_id[id(value)])


# ----- the meta path: per-submodule initialization, only for a factory that declares a complete initializer -----


def submodule_seed(seed: int, qualified_name: str) -> int:
    """A stable 63-bit seed for submodule `qualified_name` (independent of Python's hash randomization)."""
    return (int(seed) * 1_000_003 + zlib.crc32(qualified_name.encode())) % (2**63 - 1)


def _direct_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    found = [("param", p) for p in module._parameters.values() if p is not None]
    return found + [("buffer", b) for b in module._buffers.values() if b is not None]


def _initialize(module: nn.Module, name: str, init_module: Callable[[nn.Module], None], seed: int) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(submodule_seed(seed, name))
        with torch.no_grad():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
            init_module(module)


def materialize(
    model: nn.Module,
    *,
    needed: Iterable[torch.Tensor] | None,
    seed: int,
    init_module: Callable[[nn.Module], None],
    device: torch.device | str = "cpu",
    also_replace_in: Iterable[nn.Module] = (),
) -> set[int]:
    """The meta path: allocate on `device` and initialize (reset_parameters, then `init_module`, per-submodule
    seeds) every submodule of a meta-built `model` holding a tensor in `needed` (all when None). Replacements are
    applied in `model` and `also_replace_in`. Returns the ids of the new tensors."""
    keep_alive = None if needed is None else list(needed)
    needed_ids = None if keep_alive is None else {id(t) for t in keep_alive}
    roots = [model, *also_replace_in]
    new_ids: set[int] = set()
    # a submodule sharing a tensor with a needed one (tied weights) is initialized too, in module-tree order, so the
    # last initializer to write a shared tensor is the same on every rank
    for name, module in model.named_modules(remove_duplicate=False):
        direct = _direct_tensors(module)
        if not direct:
            continue
        if needed_ids is not None and not any(id(t) in needed_ids or id(t) in new_ids for _, t in direct):
            continue
        fresh: dict[int, torch.Tensor] = {}
        for kind, tensor in direct:
            if id(tensor) not in new_ids:
                data = torch.zeros_like(tensor, device=device)
                fresh[id(tensor)] = nn.Parameter(data, tensor.requires_grad) if kind == "param" else data
        new_ids.update(id(t) for t in fresh.values())
        replace_tensors(roots, fresh)
        _initialize(module, name, init_module, seed)
    del keep_alive
    return new_ids


def refuse_or_announce_meta_path(spec: ModelSpec, *, rank: int, needed: int, available: int, ranks: int) -> None:
    """The whole model does not fit on this host: refuse without a complete initializer, else say so once."""
    sizes = f"{format_bytes(needed)} for {ranks} rank(s) building it whole, {format_bytes(available)} available"
    if spec.init_module is None:
        raise RunError(
            f"model {spec.name!r} is too large to build whole on this host ({sizes}); give its ModelSpec an "
            "init_module that initializes every parameter and buffer of a submodule, or start fewer ranks per host"
        )
    if rank == 0:
        print(
            f"pipeplan: model {spec.name!r} is too large to build whole on this host ({sizes}); each rank "
            "initializes its part from the meta device with ModelSpec.init_module",
            file=sys.stderr,
            flush=True,
        )
