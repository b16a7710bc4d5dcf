"""A plan's stages in the module names (FQNs) of the model torchtitan builds: `module_fqns_per_model_part`.

torchtitan's stage builder (`pipeline_module_split`, 0.2 and 0.3 alike) deep-copies the whole model and, for each
top-level child, keeps it when its name is listed, keeps the listed entries of a top-level ModuleList/ModuleDict
(`layers.3`), and drops every other child (None, or an Identity in 0.3) — so a name must be a top-level module or an
entry of a top-level container, and a name it does not know drops that module from the stage silently.

- pipeplan's built-in `llama` family is torchtitan's `llama3` and the `moe` family its `deepseek_v3` (both built
  from `tok_embeddings`, `layers.N`, `norm` and the output projection, `output` in 0.2 and `lm_head` in 0.3):
  `embed` -> tok_embeddings, `blocks.N` -> layers.N, `head` -> norm + the output projection;
- an `hf:` causal LM is, in torchtitan 0.3, its `transformers_modeling_backend` (experiments): it builds the user's
  *ForCausalLM from the Hugging Face config (`--hf_model`) and shows the stage builder five top-level children
  (`HFTransformerModel.named_children`): model.embed_tokens -> tok_embeddings, model.layers.N -> layers.N (a
  ModuleDict keyed by the layer index), model.norm -> norm, lm_head -> lm_head and
  model.rotary_emb -> rotary_emb, RoPE's tables (no parameters), which every stage's forward calls and so lists, as
  the backend's own stage generator does. Other `hf:` structures (gpt2's `transformer.h.N`, encoders, a layer
  the backend keeps in every stage, phi's model.embed_dropout) and torchtitan
  0.2, which has no such model, are refused;
- a `file.py:factory` / `pkg.mod:factory` / `object:` model keeps its own names (torchtitan must build the same
  module tree): they must be top-level modules or entries of a top-level container; a top-level helper no stage
  lists (one the plan has no layer for) is dropped from every stage, which the file says;
- the other built-ins (gpt, mlp, resnet) have no torchtitan model: refused.
A layer inside a block (--granularity) names its block, in the stage where the block starts (a cut inside a block is
a `cannot express` note, `stage_layers.cannot_express`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.artifact.plan import Plan
from pipeplan.artifact.stage_layers import BlockLayout, StageMembers, block_of
from pipeplan.errors import ConfigError
from pipeplan.models.builtins import builtin_family

TORCHTITAN_MODELS = {"llama": "llama3", "moe": "deepseek_v3"}  # pipeplan family -> torchtitan model (both versions)
_OUTPUT = {"0.2": "output", "0.3": "lm_head"}  # the output projection's name in torchtitan's decoder
HF_BACKEND = "transformers_modeling_backend"  # torchtitan 0.3's model of a transformers *ForCausalLM
HF_CONTAINER = "model.layers"
_HF_NAMES = {  # the user's module -> the backend's top-level child (HFTransformerModel's properties)
    "model.embed_tokens": "tok_embeddings",
    "model.norm": "norm",
    "lm_head": "lm_head",
}
HF_EVERY_STAGE = ("rotary_emb",)  # model.rotary_emb: listed in every stage (the backend's generator does the same)


@dataclass(frozen=True, kw_only=True)
class TorchtitanModel:
    module: str | None  # torchtitan's model (0.2 [model] name, 0.3 --module); None: the user's own model
    fqns: tuple[tuple[str, ...], ...]  # per stage (model part), in stage order
    mapping: tuple[str, ...]  # how the plan's layer names became these, and what the user runs: the file's comments
    sources: tuple[tuple[str, str], ...] = ()  # hf: each torchtitan name (a prefix) -> the module in the user's model


def torchtitan_model(plan: Plan, layout: BlockLayout, version: str) -> TorchtitanModel:
    """The torchtitan model and stage FQNs for `plan`; ConfigError for a model torchtitan's stages cannot name."""
    ref = plan.model.ref
    family = builtin_family(ref)
    if family is None:
        return _hf_model(plan, layout, version) if ref.startswith("hf:") else _own_model(ref, layout)
    if family not in TORCHTITAN_MODELS:
        raise ConfigError(
            f"torchtitan has no model like pipeplan's built-in {ref} ({family} family); its exports name torchtitan's "
            f"llama3 for llama* plans, deepseek_v3 for moe* plans, {HF_BACKEND} (0.3) for hf: causal LMs, or a "
            "file.py:factory model's own modules"
        )
    output = _OUTPUT[version]
    fqns = tuple(_mapped_names(stage, layout, output) for stage in layout.stages)
    module = TORCHTITAN_MODELS[family]
    mapping = (
        f"module FQNs are torchtitan {version}'s {module} (pipeplan {ref}): embed -> tok_embeddings, "
        f"{layout.container}.N -> layers.N, head -> norm, {output}"
    )
    return TorchtitanModel(module=module, fqns=fqns, mapping=(mapping,))


def _own_model(ref: str, layout: BlockLayout) -> TorchtitanModel:
    fqns = tuple(_own_names(stage, layout) for stage in layout.stages)
    mapping = (
        f"module FQNs are {ref}'s own: register this model with torchtitan as it is (the same module tree; "
        "torchtitan's stage builder keeps only the top-level modules and container entries listed)",
        "a top-level module of yours that no stage lists (a parameter-free helper your forward calls, e.g. rotary "
        "tables) is dropped from every stage: add it to each stage's list; your forward must skip the modules a "
        "stage lacks (None in 0.2, an Identity in 0.3), as torchtitan's own models do",
    )
    return TorchtitanModel(module=None, fqns=fqns, mapping=mapping)


def _hf_model(plan: Plan, layout: BlockLayout, version: str) -> TorchtitanModel:
    ref, task = plan.model.ref, plan.model.options.get("task", "causal-lm")
    refuse = "; export it with --format megatron or run it with pipeplan run"
    if version == "0.2":
        raise ConfigError(
            f"torchtitan 0.2 has no model for {ref} (its stage builder keeps top-level modules only and {ref} nests "
            f"its layers under `model.`); export it with --format torchtitan-0.3 (torchtitan 0.3's {HF_BACKEND})"
        )
    if task != "causal-lm" or layout.container != HF_CONTAINER:
        what = f"-a task={task}" if task != "causal-lm" else f"its blocks are {layout.container}.N"
        raise ConfigError(
            f"torchtitan 0.3's {HF_BACKEND} trains a causal LM with blocks {HF_CONTAINER}.N, but {ref}'s plan has "
            f"{what}{refuse}"
        )
    fqns = tuple((*_hf_names(stage, layout, ref), *HF_EVERY_STAGE) for stage in layout.stages)
    mapping = (
        f"module FQNs are torchtitan 0.3's {HF_BACKEND} (your {ref} *ForCausalLM, built from --hf_model's config): "
        "model.embed_tokens -> tok_embeddings, model.layers.N -> layers.N, model.norm -> norm, lm_head -> lm_head, "
        "model.rotary_emb -> rotary_emb (RoPE's tables, in every stage)",
        f"run with --module {HF_BACKEND} --config CONFIG --hf_model YOUR_MODEL (a hub id or a directory holding the "
        f"config.json of {ref} as planned; {HF_BACKEND}_full takes every size from it); the backend unties a tied "
        "lm_head and sets the config's attention_bias and mlp_bias to False",
    )
    sources = (
        ("tok_embeddings", "model.embed_tokens"),
        ("layers", HF_CONTAINER),
        ("norm", "model.norm"),
        ("lm_head", "lm_head"),
        ("rotary_emb", "model.rotary_emb"),
    )
    return TorchtitanModel(module=HF_BACKEND, fqns=fqns, mapping=mapping, sources=sources)


def _hf_names(stage: StageMembers, layout: BlockLayout, ref: str) -> tuple[str, ...]:
    names: list[str] = []
    for name in stage.layers:
        block = block_of(name, layout.container)
        if block is not None:
            names += [f"layers.{block}"] if block in stage.blocks else []
        elif name in _HF_NAMES:
            names.append(_HF_NAMES[name])
        elif name != "model.rotary_emb":  # listed in every stage
            raise ConfigError(
                f"torchtitan 0.3's {HF_BACKEND} splits a model at model.embed_tokens, {HF_CONTAINER}.N, model.norm "
                f"and lm_head only; stage {stage.index}'s layer {name} of {ref} is none of them; export it with "
                "--format megatron or run it with pipeplan run"
            )
    return tuple(dict.fromkeys(names))


def _mapped_names(stage: StageMembers, layout: BlockLayout, output: str) -> tuple[str, ...]:
    names: list[str] = []
    for name in stage.layers:
        block = block_of(name, layout.container)
        if block is not None:
            names += [f"layers.{block}"] if block in stage.blocks else []
        elif name == "embed" or name.startswith("embed."):
            names.append("tok_embeddings")
        elif name == "head":
            names += ["norm", output]
        elif name in ("head.norm", "head.proj"):
            names.append("norm" if name == "head.norm" else output)
        else:
            raise ConfigError(f"layer {name} of stage {stage.index} has no torchtitan counterpart")
    return tuple(dict.fromkeys(names))


def _own_names(stage: StageMembers, layout: BlockLayout) -> tuple[str, ...]:
    names: list[str] = []
    for name in stage.layers:
        block = block_of(name, layout.container)
        if block is not None and "." not in layout.container:
            names += [f"{layout.container}.{block}"] if block in stage.blocks else []
        elif "." not in name:
            names.append(name)
        else:
            raise ConfigError(
                f"torchtitan's stage builder keeps top-level modules and entries of top-level "
                f"ModuleLists/ModuleDicts only; stage {stage.index}'s layer {name} is nested deeper (its parent "
                f"would be dropped whole); re-plan without --granularity or export for Megatron (a plain "
                "transformers *ForCausalLM: plan it as hf:DIR, DIR holding its config.json, and export with "
                "--format torchtitan-0.3)"
            )
    return tuple(dict.fromkeys(names))
