"""A plan's stages in the module names (FQNs) of the model torchtitan builds: `module_fqns_per_model_part`.

torchtitan's stage builder (`pipeline_module_split`, 0.2 and 0.3 alike) deep-copies the whole model and, for each
top-level child, keeps it when its name is listed, keeps the listed entries of a top-level ModuleList/ModuleDict
(`layers.3`), and drops every other child (None, or an Identity in 0.3) — so a name must be a top-level module or an
entry of a top-level container, and a name it does not know drops that module from the stage silently.

- pipeplan's built-in `llama` family is torchtitan's `llama3` and the `moe` family its `deepseek_v3` (both built
  from `tok_embeddings`, `layers.N`, `norm` and the output projection, `output` in 0.2 and `lm_head` in 0.3):
  `embed` -> tok_embeddings, `blocks.N` -> layers.N, `head` -> norm + the output projection;
- a `file.py:factory` / `pkg.mod:factory` / `object:` model keeps its own names (torchtitan must build the same
  module tree): they must be top-level modules or entries of a top-level container;
- `hf:` models nest everything under `model.` (transformers' `model.layers.N`), which the stage builder would drop
  whole, and the other built-ins (gpt, mlp, resnet) have no torchtitan model: both are refused.
A layer inside a block (--granularity) names its block, in the stage where the block starts (a cut inside a block is
a `cannot express` note, `stage_layers.cannot_express`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.errors import ConfigError
from pipeplan.models.builtins import builtin_family
from pipeplan.plan.plan import Plan
from pipeplan.plan.stage_layers import BlockLayout, StageMembers, block_of

TORCHTITAN_MODELS = {"llama": "llama3", "moe": "deepseek_v3"}  # pipeplan family -> torchtitan model (both versions)
_OUTPUT = {"0.2": "output", "0.3": "lm_head"}  # the output projection's name in torchtitan's decoder


@dataclass(frozen=True, kw_only=True)
class TorchtitanModel:
    module: str | None  # torchtitan's model (0.2 [model] name, 0.3 --module); None: the user's own model
    fqns: tuple[tuple[str, ...], ...]  # per stage (model part), in stage order
    mapping: str  # how the plan's layer names became these, one line written in the config


def torchtitan_model(plan: Plan, layout: BlockLayout, version: str) -> TorchtitanModel:
    """The torchtitan model and stage FQNs for `plan`; ConfigError for a model torchtitan's stages cannot name."""
    ref = plan.model.ref
    family = builtin_family(ref)
    if family is None:
        if ref.startswith("hf:"):
            raise ConfigError(
                f"torchtitan's stage builder keeps top-level modules only, but {ref} nests its layers under "
                "`model.` (model.layers.N), which it would drop whole; run hf: models with `pipeplan run` or export "
                "them for Megatron (--format megatron)"
            )
        fqns = tuple(_own_names(stage, layout) for stage in layout.stages)
        mapping = f"module FQNs are {ref}'s own: torchtitan must build this model (the same module tree)"
        return TorchtitanModel(module=None, fqns=fqns, mapping=mapping)
    if family not in TORCHTITAN_MODELS:
        raise ConfigError(
            f"torchtitan has no model like pipeplan's built-in {ref} ({family} family); its exports name torchtitan's "
            f"llama3 for llama* plans and deepseek_v3 for moe* plans, or a file.py:factory model's own modules"
        )
    output = _OUTPUT[version]
    fqns = tuple(_mapped_names(stage, layout, output) for stage in layout.stages)
    module = TORCHTITAN_MODELS[family]
    mapping = (
        f"module FQNs are torchtitan {version}'s {module} (pipeplan {ref}): embed -> tok_embeddings, "
        f"{layout.container}.N -> layers.N, head -> norm, {output}"
    )
    return TorchtitanModel(module=module, fqns=fqns, mapping=mapping)


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
                f"would be dropped whole); re-plan without --granularity or export for Megatron"
            )
    return tuple(dict.fromkeys(names))
