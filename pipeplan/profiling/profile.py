"""Profile: per-layer costs the partitioner and simulator consume. Versioned JSON, read with one clear error.

Times are milliseconds for one microbatch of `batch_size` samples; bytes are per microbatch (activations) or
totals (parameters). `cut_bytes[i]` is everything live across the cut between layer i and layer i+1 (skip
connections included), so `len(cut_bytes) == len(layers) - 1`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeplan.errors import FormatError
from pipeplan.jsonio import build_dataclass, read_json, write_json

PROFILE_SCHEMA_VERSION = 1
SOURCES = ("measured", "analytic", "pipedream")


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    name: str
    forward_ms: float
    input_grad_ms: float  # I: gradient w.r.t. the layer's inputs only
    weight_grad_ms: float  # W: gradient w.r.t. the layer's parameters only
    backward_ms: float  # B: fused backward (I and W together)
    activation_bytes: int  # saved for backward per microbatch (parameters excluded, storages de-duplicated)
    activation_freed_by_input_grad_bytes: int  # part of activation_bytes no longer needed once I is done
    param_count: int
    param_bytes: int
    output_bytes: int = 0  # bytes of this layer's outputs per microbatch
    flops: float = 0.0  # forward FLOPs per microbatch
    peak_memory_bytes: int = 0  # measured on CUDA: peak allocation growth during the forward (0 = not measured)
    module_path: str = ""

    def __post_init__(self) -> None:
        for f in ("forward_ms", "input_grad_ms", "weight_grad_ms", "backward_ms"):
            if getattr(self, f) < 0:
                raise FormatError(f"layer {self.name!r}: {f} must be >= 0")
        if not 0 <= self.activation_freed_by_input_grad_bytes <= max(self.activation_bytes, 0):
            raise FormatError(
                f"layer {self.name!r}: activation_freed_by_input_grad_bytes must lie in [0, activation_bytes]"
            )

    @property
    def activation_kept_until_weight_grad_bytes(self) -> int:
        return self.activation_bytes - self.activation_freed_by_input_grad_bytes


@dataclass(frozen=True, kw_only=True)
class Provenance:
    source: str  # measured | analytic | pipedream
    device: str = "cpu"  # cpu, cuda:NAME, meta
    hardware: str | None = None  # hardware preset for analytic profiles
    dtype: str = "float32"  # compute dtype (the precision's)
    precision: str = ""  # pipeplan.precision mode ("" in older profiles: see precision.profile_precision)
    batch_size: int = 1  # samples per profiled microbatch
    torch_version: str = ""
    model: str = ""  # model reference (name, file.py:factory, pkg.mod:factory)
    model_options: dict[str, Any] = field(default_factory=dict)
    graph_fingerprint: str = ""
    tracer: str = ""  # fx | export: how the graph was traced ("" in older profiles: fx)
    tokens_per_sample: int | None = None
    notes: str = ""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise FormatError(f"provenance.source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.batch_size < 1:
            raise FormatError("provenance.batch_size must be >= 1")


@dataclass(frozen=True, kw_only=True)
class Profile:
    layers: tuple[LayerProfile, ...]
    cut_bytes: tuple[int, ...]
    provenance: Provenance
    input_bytes: int = 0  # model inputs per microbatch
    whole_forward_ms: float | None = None  # whole-model reference timings (fidelity checks)
    whole_backward_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise FormatError("profile has no layers")
        if len(self.cut_bytes) != len(self.layers) - 1:
            raise FormatError(
                f"profile has {len(self.layers)} layers but {len(self.cut_bytes)} cut_bytes (need layers-1)"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {"schema_version": PROFILE_SCHEMA_VERSION, **data}

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "profile") -> Profile:
        return build_dataclass(cls, {k: v for k, v in data.items() if k != "schema_version"}, where=where)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        data = read_json(path, kind="profile", schema_version=PROFILE_SCHEMA_VERSION)
        return cls.from_dict(data, where=f"profile file {str(path)!r}")
