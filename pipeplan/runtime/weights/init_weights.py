"""`pipeplan run --init-from FILE`: initial weights from a whole-model state_dict, a `.pt` file (torch.save of
`model.state_dict()`, read with `torch.load(weights_only=True, mmap=True)`) or a `.safetensors` file (read key by
key with `safetensors.safe_open`). Every rank checks the file's keys against the whole model's state_dict keys
(a missing or unexpected key is one ConfigError line naming them) and then reads only its own stages' tensors.
Tied weights may be saved under any one of their names (as Hugging Face's save_pretrained does). Tensors not in a
state_dict (non-persistent buffers) keep the factory's values. A checkpoint of a Hugging Face base model (keys
without the `model.` prefix, the model's `base_model_prefix`) maps onto a model with a head (`*ForCausalLM`) as
transformers' from_pretrained maps it: each key gains the prefix, and the head's tensors the file cannot hold keep
their initial values (`mapping_note` says so). `check_initial_weights` checks keys, shapes and dtypes against a
meta-built model before any rank starts, reading no tensor data."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipeplan.errors import ConfigError

if TYPE_CHECKING:
    from safetensors import safe_open

SHOWN_KEYS = 3


class WeightFile:
    """Keys and lazily read tensors of a .pt or .safetensors state_dict file, or of a directory of .safetensors
    shards (a Hugging Face model directory: model-00001-of-00002.safetensors, ...)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self._state: dict[str, torch.Tensor] | None = None
        self._handles: dict[str, safe_open] = {}  # key -> open safetensors file holding it
        if Path(self.path).is_dir():
            shards = sorted(Path(self.path).glob("*.safetensors"))
            if not shards:
                raise ConfigError(f"--init-from directory {self.path!r} holds no .safetensors file")
            for shard in shards:
                self._open_safetensors(str(shard))
        elif not Path(self.path).is_file():
            raise ConfigError(f"--init-from {self.path!r} does not exist")
        elif self.path.endswith(".safetensors"):
            self._open_safetensors(self.path)
        elif self.path.endswith((".pt", ".pth", ".bin")):
            self._open_torch()
        else:
            raise ConfigError(
                f"--init-from {self.path!r} must be a .pt (torch.save of a state_dict), a .safetensors file or a "
                "directory of .safetensors shards"
            )
        self.keys = set(self._state) if self._state is not None else set(self._handles)
        self._file_key: dict[str, str] = {}  # model key -> the file's key, where they differ (a base model's)
        self.optional: set[str] = set()  # model keys the file need not hold (a base model's head)
        self.mapping_note: str | None = None

    def _open_safetensors(self, file: str) -> None:
        try:
            from safetensors import safe_open
        except ImportError:
            raise ConfigError(
                "--init-from a .safetensors file needs the safetensors package: pip install 'pipeplan[hf]'"
            ) from None
        try:
            handle = safe_open(file, framework="pt", device="cpu")
            keys = list(handle.keys())
        except Exception as exc:  # a truncated or foreign file
            raise ConfigError(f"cannot read --init-from {file!r}: {type(exc).__name__}: {exc}") from None
        for key in keys:
            if key in self._handles:
                raise ConfigError(f"--init-from {self.path!r}: key {key!r} is in more than one .safetensors shard")
            self._handles[key] = handle

    def _open_torch(self) -> None:
        try:
            try:
                state = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
                state = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ConfigError(
                f"cannot read --init-from {self.path!r} with torch.load(weights_only=True): {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            keys = list(state)[:SHOWN_KEYS] if isinstance(state, dict) else []
            raise ConfigError(
                f"--init-from {self.path!r} is not a state_dict of tensors (found {type(state).__name__} "
                f"{keys or ''}); save it with torch.save(model.state_dict(), FILE)"
            )
        self._state = state

    def get(self, key: str) -> torch.Tensor:
        key = self._file_key.get(key, key)
        if self._state is not None:
            return self._state[key]
        return self._handles[key].get_tensor(key)

    def layout(self, key: str) -> tuple[tuple[int, ...], str, bool]:
        """(shape, dtype name, floating point) of `key`'s tensor, without reading its data."""
        key = self._file_key.get(key, key)
        if self._state is not None:
            value = self._state[key]
            return tuple(value.shape), str(value.dtype), value.is_floating_point()
        piece = self._handles[key].get_slice(key)
        dtype = piece.get_dtype()
        return tuple(piece.get_shape()), dtype, dtype.startswith(("F", "BF"))  # F16, F32, BF16, F8_E4M3, ...

    def map_onto(self, model: nn.Module, groups: dict[str, tuple[str, ...]]) -> None:
        """Where the file holds the model's base model (`model.` of a `*ForCausalLM` missing from every key, as
        `AutoModel` saves it), read each key under the prefixed name, as transformers maps it; the tensors outside
        the base model that the file cannot hold (the head, unless tied) keep their initial values."""
        prefix = getattr(model, "base_model_prefix", "") or ""
        if not prefix or self.keys <= set(groups) or any(key.startswith(f"{prefix}.") for key in self.keys):
            return
        mapped = {f"{prefix}.{key}": key for key in self.keys}
        if not set(mapped) <= set(groups):
            return
        self._file_key, self.keys = mapped, set(mapped)
        self.optional = {key for key in groups if not key.startswith(f"{prefix}.")}
        kept = sorted(key for key in self.optional if not any(name in self.keys for name in groups[key]))
        self.mapping_note = (
            f"--init-from {self.path!r} holds the base model (keys without the {prefix!r} prefix): read as "
            f"{prefix}.*, as transformers' from_pretrained maps it"
            + (f"; {_shown(kept)} keep their initial values (not in a base model)" if kept else "")
        )


def _shown(keys: list[str]) -> str:
    more = f", ... ({len(keys)} in all)" if len(keys) > SHOWN_KEYS else ""
    return ", ".join(keys[:SHOWN_KEYS]) + more


def alias_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """state_dict key -> every state_dict key naming the same tensor (itself included)."""
    by_id: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), []).append(key)
    return {key: tuple(keys) for keys in by_id.values() for key in keys}


def check_keys(weights: WeightFile, groups: dict[str, tuple[str, ...]]) -> None:
    """One line naming the missing and unexpected keys, if any (a tied tensor needs only one of its names)."""
    missing = [
        key
        for key, names in groups.items()
        if key not in weights.optional and not any(name in weights.keys for name in names)
    ]
    unexpected = sorted(weights.keys - set(groups))
    problems = []
    if missing:
        problems.append(f"misses {len(missing)} key(s) of the model: {_shown(missing)}")
    if unexpected:
        problems.append(f"has {len(unexpected)} key(s) the model lacks: {_shown(unexpected)}")
    if problems:
        raise ConfigError(
            f"--init-from {weights.path!r} {' and '.join(problems)}; give the whole model's state_dict for this "
            "model and options"
        )


def load_initial_weights(
    path: str | os.PathLike, *, model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Copy the file's values into `tensors` ((qualified name, tensor) of this rank; a name not in the state_dict
    is left as built). `model` is the whole model (meta-built is enough): its state_dict keys are the expected
    keys and its ties the aliases."""
    weights = WeightFile(path)
    groups = alias_groups(model)
    weights.map_onto(model, groups)
    check_keys(weights, groups)
    done: set[int] = set()
    with torch.no_grad():
        for name, tensor in tensors:
            if name not in groups or id(tensor) in done:
                continue
            done.add(id(tensor))
            present = [key for key in groups[name] if key in weights.keys]
            if not present:  # a base model's head: keeps its initial values
                continue
            value = weights.get(present[0])
            _check_layout(
                weights, present[0], (tuple(value.shape), str(value.dtype), value.is_floating_point()), tensor
            )
            for other in present[1:]:
                if not torch.equal(weights.get(other), value):
                    raise ConfigError(
                        f"--init-from {weights.path!r} gives tied tensors {present[0]!r} and {other!r} different "
                        "values; save them equal (or only one of them)"
                    )
            tensor.copy_(value)


def _check_layout(weights: WeightFile, key: str, found: tuple[tuple[int, ...], str, bool], tensor: torch.Tensor):
    shape, dtype, floating = found
    if shape != tuple(tensor.shape) or floating != tensor.is_floating_point():
        raise ConfigError(
            f"--init-from {weights.path!r} holds {key!r} as {shape} {dtype}, but the model's is "
            f"{tuple(tensor.shape)} {tensor.dtype}; give the state_dict of this model and options"
        )


def check_initial_weights(path: str | os.PathLike, model: nn.Module) -> str | None:
    """Check the file against the whole model (meta-built is enough) before any rank starts: its keys (a base
    model's mapped), then each tensor's shape and kind (floating or integer) in state_dict order, reading no data;
    one ConfigError line naming the first bad key. Returns the base-model mapping's note, if any."""
    weights = WeightFile(path)
    groups = alias_groups(model)
    weights.map_onto(model, groups)
    check_keys(weights, groups)
    for name, tensor in model.state_dict(keep_vars=True).items():
        present = [key for key in groups[name] if key in weights.keys]
        if present:
            _check_layout(weights, present[0], weights.layout(present[0]), tensor)
    return weights.mapping_note
