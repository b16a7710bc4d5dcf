"""The built-in models `pipeplan models` lists: each factory, with a description and, for a named shape, its fixed
options (a preset). `registry.register` adds more at run time.

A built-in names its factory by family (`llama`: `pipeplan.models.llama.llama`), imported on first use: listing the
built-ins or asking a reference's family (the engine exports map a family onto the engine's model) imports no
torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeplan.models.presets import PRESETS

if TYPE_CHECKING:
    from pipeplan.models.spec import ModelSpec

FAMILIES = ("gpt", "mlp", "resnet", "llama", "moe")  # pipeplan.models.<family>.<family>: the built-in factories


@dataclass(frozen=True, kw_only=True)
class BuiltinModel:
    name: str
    family: str | None  # the built-in factory (one of FAMILIES); None for a factory registered at run time
    description: str
    preset: dict[str, Any] | None = None  # fixed options for a named shape (gpt2-355m, llama-7b, ...)
    registered: Callable[..., ModelSpec] | None = None  # a factory registered at run time

    @property
    def factory(self) -> Callable[..., ModelSpec]:
        if self.registered is not None:
            return self.registered
        return getattr(importlib.import_module(f"pipeplan.models.{self.family}"), str(self.family))


BUILTINS: dict[str, BuiltinModel] = {}


def register(name: str, factory: Callable[..., ModelSpec] | str, description: str, preset: dict | None = None) -> None:
    """Add (or replace) a built-in model: `factory` is a built-in family's name or a callable."""
    if isinstance(factory, str):
        assert factory in FAMILIES, factory
        BUILTINS[name] = BuiltinModel(name=name, family=factory, description=description, preset=preset)
    else:
        BUILTINS[name] = BuiltinModel(
            name=name, family=None, description=description, preset=preset, registered=factory
        )


def builtin_family(ref: str) -> str | None:
    """The built-in family of a model reference (`llama-7b` -> `llama`), or None for any other model."""
    builtin = BUILTINS.get(ref)
    return builtin.family if builtin is not None else None


register("gpt", "gpt", "decoder-only transformer (embedding, pre-LN blocks, LM head)")
register("mlp", "mlp", "stack of Linear + activation layers (a chain)")
register("resnet", "resnet", "small residual CNN with skip connections (a DAG)")
register("llama", "llama", "LLaMA-style decoder (RMSNorm, rotary, grouped-query attention, SwiGLU, untied head)")
_GPT2 = dict(seq=1024, vocab=50257, tie_embeddings=True)
register(
    "gpt2-124m",
    "gpt",
    "GPT-2 small shapes (Radford et al. 2019)",
    preset=dict(layers=12, hidden=768, heads=12, **_GPT2),
)
register("gpt2-355m", "gpt", "GPT-2 medium shapes", preset=dict(layers=24, hidden=1024, heads=16, **_GPT2))
register("gpt2-774m", "gpt", "GPT-2 large shapes", preset=dict(layers=36, hidden=1280, heads=20, **_GPT2))
register("gpt2-1.5b", "gpt", "GPT-2 XL shapes", preset=dict(layers=48, hidden=1600, heads=25, **_GPT2))
_LLAMA = dict(vocab=32000, seq=4096)
register(
    "llama-7b",
    "llama",
    "Llama 2 7B shapes (Touvron et al. 2023)",
    preset=dict(layers=32, hidden=4096, heads=32, kv_heads=32, intermediate=11008, **_LLAMA),
)
register(
    "llama-13b",
    "llama",
    "Llama 2 13B shapes",
    preset=dict(layers=40, hidden=5120, heads=40, kv_heads=40, intermediate=13824, **_LLAMA),
)
register(
    "llama-70b",
    "llama",
    "Llama 2 70B shapes (grouped-query attention, 8 kv heads)",
    preset=dict(layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672, **_LLAMA),
)
register(
    "moe",
    "moe",
    "mixture-of-experts decoder (LLaMA-style attention, shared + top-k routed SwiGLU experts, first layers dense)",
)
register(
    "mixtral-8x7b",
    "moe",
    "Mixtral 8x7B shapes (Jiang et al. 2024): 8 experts, top-2, softmax gates, no shared experts",
    preset=dict(
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        experts=8,
        top_k=2,
        expert_intermediate=14336,
        shared_experts=0,
        dense_layers=0,
        intermediate=14336,
        gate="softmax",
        vocab=32000,
        seq=4096,
        rope_theta=1e6,
    ),
)
register(
    "deepseek-v3",
    "moe",
    "DeepSeek-V3 shapes (2024): multi-head latent attention, 3 dense then 58 MoE layers, 1 shared + 256 routed "
    "experts, top-8 sigmoid gates",
    preset=dict(
        layers=61,
        hidden=7168,
        heads=128,
        kv_heads=128,
        experts=256,
        top_k=8,
        expert_intermediate=2048,
        shared_experts=1,
        dense_layers=3,
        intermediate=18432,
        gate="sigmoid",
        scale=2.5,
        vocab=129280,
        seq=4096,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
    ),
)

for _preset in PRESETS.values():  # the shapes of models people plan now (models/presets.py: fields and sources)
    register(_preset.name, _preset.factory, _preset.description, preset=dict(_preset.options))
