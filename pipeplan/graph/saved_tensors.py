"""The tensors autograd saves for backward: one recorder, one walker, one "kept until W" rule, shared by the measured
profiler, the analytic profiler and the runtime's executor.

- `SavedTensors` (saved_tensors_hooks) records every tensor autograd saves inside the block it wraps and can
  `release` those a pass no longer needs: the runtime drops what only I reads as soon as I is done, so memory
  between I and W is what the profile says W keeps.
- `node_saved_tensors(node)` lists what one autograd node saved (C++ nodes' `_saved_*` attributes, custom
  Functions' `saved_tensors`).
- The rule: a storage is kept until W when an autograd node the weight-gradient pass runs saved it
  (`SplitAnalysis.weight_grad_nodes`, see split_backward); everything else saved is freed once I is done.
  Parameters and buffers are not activations and are never counted.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (works on meta tensors, which have no data pointer)."""
    return tensor.untyped_storage()._cdata


def storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


def node_saved_tensors(node) -> list[torch.Tensor]:
    """Tensors one autograd node saved for its backward (empty once they were released)."""
    kind = type(node)
    if kind not in _SAVED_ATTRS:
        _SAVED_ATTRS[kind] = tuple(name for name in dir(node) if name.startswith("_saved_"))
    found: list[torch.Tensor] = []
    for name in _SAVED_ATTRS[kind]:
        try:
            value = getattr(node, name)
        except RuntimeError:  # already freed, or not applicable
            continue
        values = value if isinstance(value, tuple | list) else (value,)
        found.extend(v for v in values if isinstance(v, torch.Tensor))
    with contextlib.suppress(RuntimeError):  # custom autograd.Function nodes (raises once freed)
        found.extend(t for t in getattr(node, "saved_tensors", ()) or () if isinstance(t, torch.Tensor))
    return found


def storages_saved_by(nodes: Iterable) -> set[int]:
    """Storage keys of everything `nodes` saved."""
    return {storage_key(t) for node in nodes for t in node_saved_tensors(node)}


class _Slot:
    """What the graph holds for one saved tensor: releasing it frees the tensor even while the graph lives."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor


class SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Records every tensor autograd saves in the block it wraps (each detached, in a slot the graph holds).

    `hold=True` (the profilers) keeps the slots after the graph is gone, to inspect them; `hold=False` (the
    runtime, and the profiler timing what the runtime runs) only follows them, so a tensor goes as soon as autograd
    drops its node, as without the recorder. The hooks close over the slot list, not over self: no reference cycle
    for gc to break."""

    def __init__(self, *, hold: bool = True) -> None:
        slots: list = []
        self._slots = slots
        self._hold = hold

        def pack(tensor: torch.Tensor) -> _Slot:
            slot = _Slot(tensor.detach())
            slots.append(slot if hold else weakref.ref(slot))
            return slot

        def unpack(slot: _Slot) -> torch.Tensor:
            assert slot.tensor is not None, "a saved tensor released after I was read again (W needs more than it kept)"
            return slot.tensor

        super().__init__(pack, unpack)

    def __enter__(self) -> SavedTensors:  # type: ignore[override]  # torch's hooks return None; this the recorder
        super().__enter__()
        return self

    def _live(self) -> list[tuple[_Slot, torch.Tensor]]:
        """(slot, its tensor) of every recorded tensor still held, in the order autograd saved them."""
        found = self._slots if self._hold else [ref() for ref in self._slots]
        return [(slot, slot.tensor) for slot in found if slot is not None and slot.tensor is not None]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The recorded tensors still held, in the order autograd saved them."""
        return [tensor for _, tensor in self._live()]

    def release(self, keep: set[int]) -> None:
        """Drop every recorded tensor whose storage is not in `keep`."""
        for slot, tensor in self._live():
            if storage_key(tensor) not in keep:
                slot.tensor = None

    def storage_bytes(self, exclude: Iterable[torch.Tensor] = ()) -> dict[int, int]:
        """Storage key -> bytes of what is still held, storages of `exclude` (parameters, buffers) left out."""
        excluded = {storage_key(t) for t in exclude}
        held: dict[int, int] = {}
        for tensor in self.tensors:
            if (key := storage_key(tensor)) not in excluded:
                held[key] = storage_bytes(tensor)
        return held


@dataclass(frozen=True, kw_only=True)
class SavedSplit:
    total_bytes: int  # de-duplicated storages saved for backward, parameters and buffers excluded
    kept_until_weight_grad_bytes: int  # storages a node of the weight-gradient pass saved


def saved_split(saved: SavedTensors, weight_grad_nodes: Iterable, exclude: Iterable[torch.Tensor]) -> SavedSplit:
    """Split what `saved` recorded into freed-by-I and kept-until-W bytes; call before running backward.
    `weight_grad_nodes`: the nodes W runs (`split_backward.analyze(...).weight_grad_nodes`)."""
    held = saved.storage_bytes(exclude)
    kept = storages_saved_by(weight_grad_nodes)
    kept_bytes = sum(size for key, size in held.items() if key in kept)
    return SavedSplit(total_bytes=sum(held.values()), kept_until_weight_grad_bytes=kept_bytes)
