"""Writing a whole state_dict as transformers lays it out: `-o FILE.safetensors` one file; `-o DIR` a directory of
`model-0000i-of-0000n.safetensors` shards (at most --shard-gb each, keys in state_dict order) and
`model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map": {key: shard}}), plus the model's
config.json for an `hf:` model. Nothing half-written is ever visible: a file is written to a temp name beside it and
renamed; a directory is built under a temp name beside it and renamed into place (with --force, an earlier export
it replaces is moved aside first and removed after)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from pipeplan.errors import ConfigError, OutputError
from pipeplan.jsonio import atomic_write, atomic_write_text
from pipeplan.paths import check_output_dir, check_output_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
METADATA = {"format": "pt"}  # what transformers' from_pretrained expects in a safetensors header


def _save_file():
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError("export-weights writes .safetensors files: pip install 'pipeplan[hf]'") from None
    return save_file


def check_target(output: str, *, force: bool) -> Path:
    """The output path, checked before any work: a `.safetensors` file or a directory; an existing one only with
    --force (and a directory only if it is empty or an earlier export)."""
    single = output.endswith(".safetensors")
    target = check_output_file(output, "--output") if single else check_output_dir(output, "--output")
    if target.exists() and not force:
        raise ConfigError(f"--output {output!r} exists; add --force to replace it")
    if not single and target.is_dir() and any(target.iterdir()) and not (target / INDEX).is_file():
        raise ConfigError(
            f"--output {output!r} is a directory that holds other files (no {INDEX}); give a new or empty directory"
        )
    return target


def hf_config(model: nn.Module):
    """The transformers config of an `hf:` model, as its save_pretrained would write it (None for other models)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string") or not hasattr(model, "base_model_prefix"):
        return None
    config.architectures = [type(model).__name__]
    return config


def write_weights(tensors: dict[str, torch.Tensor], target: Path, *, shard_gb: float, config=None) -> list[Path]:
    """Write `tensors` to `target` (see the module docstring); returns the files written."""
    if target.name.endswith(".safetensors"):
        _atomic_file(tensors, target)
        return [target]
    return _atomic_directory(tensors, target, shard_bytes=int(shard_gb * 1e9), config=config)


def _atomic_file(tensors: dict[str, torch.Tensor], target: Path) -> None:
    save_file = _save_file()
    atomic_write(target, lambda tmp: save_file(tensors, tmp, metadata=METADATA))


def shards(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[list[str]]:
    """Keys in order, cut into runs of at most `shard_bytes` (a larger tensor is a shard of its own)."""
    runs: list[list[str]] = [[]]
    size = 0
    for key, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if runs[-1] and size + nbytes > shard_bytes:
            runs.append([])
            size = 0
        runs[-1].append(key)
        size += nbytes
    return runs


def _atomic_directory(tensors: dict[str, torch.Tensor], target: Path, *, shard_bytes: int, config) -> list[Path]:
    save_file = _save_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        runs = shards(tensors, shard_bytes)
        weight_map: dict[str, str] = {}
        for index, keys in enumerate(runs, start=1):
            name = f"model-{index:05d}-of-{len(runs):05d}.safetensors"
            save_file({key: tensors[key] for key in keys}, str(building / name), metadata=METADATA)
            weight_map |= dict.fromkeys(keys, name)
        total = sum(value.numel() * value.element_size() for value in tensors.values())
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write_text(building / INDEX, json.dumps(index_json, indent=2) + "\n")
        if config is not None:
            atomic_write_text(building / CONFIG, config.to_json_string())
        written = sorted(p.name for p in building.iterdir())
        _swap_in(building, target)
    except OSError as exc:
        shutil.rmtree(building, ignore_errors=True)
        raise OutputError(f"cannot write {str(target)!r}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return [target / name for name in written]


def _swap_in(building: Path, target: Path) -> None:
    """Rename the finished directory into place; an existing one (checked by check_target) is moved aside first."""
    if not target.exists():
        os.replace(building, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.replace(target, old / "previous")
    try:
        os.replace(building, target)
    except BaseException:
        os.replace(old / "previous", target)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
