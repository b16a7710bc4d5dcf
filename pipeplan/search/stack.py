"""What tensor and context parallelism need of a model and a cluster, and why a size cannot be used (one clause).

- The profile must be a transformer stack at block granularity (`stack_problem`), its layers' roles found by
  structure: embedding lookups (parameters, no FLOPs) and helpers (no parameters) before the blocks, a uniform run
  of blocks (the hidden state in and out, the same parameters and FLOPs; dense and MoE blocks apart), a final norm
  (no FLOPs) and an LM head. Helpers that only make constant values (rotary cos/sin, masks, positions) leave no
  layer: the trace makes them again in each block (graph.constants).
- Tensor parallelism t splits heads and the hidden size, so t must divide them (read from the model's options),
  the sequence (sequence parallelism splits it) and the node: tensor-parallel ranks stay in one node, as Megatron
  places them (NVLink), unless the user asks for a size that fills whole nodes.
- Context parallelism cp splits the sequence into 2·cp load-balanced chunks, so 2·cp must divide the sequence
  length, which must be known (a sequence model); its ranks sit next to the tensor-parallel ones: a t·cp group
  fills whole nodes when larger than one.
- Expert parallelism ep splits a mixture-of-experts model's routed experts (ep must divide them) over ranks carved
  from the data-parallel x context-parallel ones (Megatron-Core); dense and MoE blocks may differ from each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.errors import ConfigError
from pipeplan.profiling.experts import expert_count
from pipeplan.profiling.profile import Profile

TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)  # what `auto` tries (each must divide the devices per node)
EXPERT_PARALLEL_SIZES = (1, 2, 4, 8, 16, 32, 64)  # what `auto` tries for a mixture-of-experts model
CONTEXT_PARALLEL_SIZES = (1, 2, 4, 8)  # what `auto` tries
# model options that name the sizes t must divide (built-in gpt/llama, Hugging Face configs)
DIVIDED_OPTIONS = (
    ("heads", "attention heads"),
    ("hidden", "hidden size"),
    ("kv_heads", "key/value heads"),
    ("num_attention_heads", "attention heads"),
    ("hidden_size", "hidden size"),
    ("num_key_value_heads", "key/value heads"),
    ("n_head", "attention heads"),
    ("n_embd", "hidden size"),
)


@dataclass(frozen=True, kw_only=True)
class TransformerLayers:
    """The roles of a profile's layers, found by structure (`stack_problem`): the layers before the first block
    (embedding lookups and parameter-free helpers: GPT-2's position embedding and dropout), the blocks, the layers
    after them (a final norm; helpers) and the LM head, the last layer; `embedding`: the first lookup (the
    vocabulary-parallel one); `hidden_bytes`: one block's output (s·b·h elements in the profile's dtype), the
    message of every tensor-parallel collective."""

    num_layers: int
    first_block: int
    end_block: int  # one past the last block
    embedding: int
    hidden_bytes: int

    @property
    def blocks(self) -> range:
        return range(self.first_block, self.end_block)

    @property
    def head(self) -> int:
        return self.num_layers - 1


def transformer_layers(profile: Profile) -> TransformerLayers:
    """The stack's roles (see TransformerLayers), or ConfigError naming the first layer that does not fit."""
    found = _roles(profile)
    if isinstance(found, str):
        raise ConfigError(
            f"tensor and context parallelism model a transformer stack: {found}; use --tensor-parallel 1 "
            "--context-parallel 1"
        )
    return found


def stack_problem(profile: Profile) -> str | None:
    """Why the profile is not a transformer stack at block granularity (one clause), or None when it is."""
    found = _roles(profile)
    return found if isinstance(found, str) else None


def _roles(profile: Profile) -> TransformerLayers | str:
    """The stack's roles, or why there are none: the layers without matrix products (FLOPs) before the first
    block must be lookups (parameters) or helpers (none), those after the last block up to the head likewise
    (a final norm); the blocks between them take the hidden state in and out and have the same parameters and
    FLOPs (dense and MoE blocks apart)."""
    layers = profile.layers
    if len(layers) < 3:
        return f"the profile has {len(layers)} layer(s), not an embedding, blocks and an LM head"
    head = len(layers) - 1
    first = next((i for i, layer in enumerate(layers[:head]) if layer.flops > 0), head)
    end = next((i + 1 for i in range(head - 1, first - 1, -1) if layers[i].flops > 0), first)
    lookups = [i for i in range(first) if layers[i].param_count > 0]
    if not lookups:
        return f"layer {layers[0].name!r} is not an embedding lookup (parameters, no FLOPs)"
    if first == end:
        return "the profile has no transformer blocks (layers with parameters and FLOPs before the LM head)"
    hidden = layers[first - 1].output_bytes
    for index in range(first, end):
        problem = _block_problem(profile, index, hidden)
        if problem:
            return problem
    for index in range(end, head):
        if layers[index].output_bytes != hidden:
            return f"layer {layers[index].name!r} after the blocks does not keep the hidden state (a final norm)"
    if layers[head].param_count == 0 or layers[head].flops <= 0:
        return f"layer {layers[head].name!r} is not an LM head (parameters, FLOPs)"
    return TransformerLayers(
        num_layers=len(layers), first_block=first, end_block=end, embedding=lookups[0], hidden_bytes=hidden
    )


def _block_problem(profile: Profile, index: int, hidden: int) -> str | None:
    layers = profile.layers
    block = layers[index]
    if block.param_count == 0 or block.flops <= 0 or block.output_bytes != hidden:
        return f"layer {block.name!r} is not a transformer block (hidden state in and out, parameters, FLOPs)"
    if profile.cut_bytes[index - 1] != profile.cut_bytes[index]:
        return f"layer {block.name!r} is not a transformer block (hidden state in and out, parameters, FLOPs)"
    moe = block.expert_param_count > 0
    first = next(b for b in layers if b.flops > 0 and (b.expert_param_count > 0) == moe)
    if (block.param_count, block.flops) != (first.param_count, first.flops):  # dense and MoE blocks apart
        return f"layer {block.name!r} differs from {first.name!r} (profile at block granularity)"
    return None


def _int_option(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def tensor_parallel_problem(
    profile: Profile, t: int, *, devices_per_node: int, num_devices: int, spanning: bool = False
) -> str | None:
    """Why `t` cannot split this model on this cluster (one clause), or None when it can; `spanning` (a size the user
    gave) lets a group fill several whole nodes (its collectives then cross the network)."""
    if t < 1:
        return f"tensor parallel size must be >= 1, got {t}"
    if t == 1:
        return None
    if devices_per_node % t and not (spanning and t % devices_per_node == 0):
        return f"t={t} must divide the {devices_per_node} devices per node (tensor parallelism stays in a node)"
    if num_devices % t:
        return f"t={t} must divide the {num_devices} devices"
    options = profile.provenance.spec_options or profile.provenance.model_options  # older profiles: the given ones
    for key, what in DIVIDED_OPTIONS:
        value = _int_option(options.get(key))
        if value is not None and value % t:
            return f"t={t} must divide the model's {value} {what} ({key})"
    seq = profile.provenance.tokens_per_sample
    if seq is not None and seq % t:
        return f"t={t} must divide the sequence length {seq} (sequence parallelism splits it)"
    return None


def context_parallel_problem(profile: Profile, t: int, cp: int, *, devices_per_node: int, num_devices: int):
    """Why `cp` (beside t) cannot split this model on this cluster (one clause), or None when it can."""
    if cp < 1:
        return f"context parallel size must be >= 1, got {cp}"
    if cp == 1:
        return None
    size = t * cp
    if num_devices % size:
        return f"t={t} x cp={cp} = {size} must divide the {num_devices} devices"
    if size > devices_per_node and size % devices_per_node:
        return f"t={t} x cp={cp} = {size} devices must fill whole nodes of {devices_per_node}"
    if size < devices_per_node and devices_per_node % size:
        return f"t={t} x cp={cp} = {size} must divide the {devices_per_node} devices per node"
    seq = profile.provenance.tokens_per_sample
    if seq is None:
        return f"cp={cp} needs a sequence model (the profile does not say its tokens per sample)"
    if seq % (2 * cp * t):
        return f"cp={cp} must split the sequence length {seq} into 2·cp chunks of whole t={t} shards"
    return None


def expert_parallel_problem(profile: Profile, t: int, cp: int, ep: int, *, num_devices: int) -> str | None:
    """Why `ep` (beside t and cp) cannot split this model's experts on this cluster (one clause), or None when it
    can: the profile must be an analytic one of a mixture-of-experts model, ep must divide its experts, and t x cp x
    ep the devices (ep ranks come from the data-parallel x context-parallel ranks; the search also needs ep to divide
    pipelines x cp)."""
    if ep < 1:
        return f"expert parallel size must be >= 1, got {ep}"
    if ep == 1:
        return None
    experts = {expert_count(layer) for layer in profile.layers if layer.expert_param_count}
    if not experts:
        return f"ep={ep} needs an analytic profile of a mixture-of-experts model (this one has no routed experts)"
    if any(e % ep for e in experts):
        return f"ep={ep} must divide the model's {min(experts)} routed experts"
    if num_devices % (t * cp * ep):
        return f"t={t} x cp={cp} x ep={ep} = {t * cp * ep} must divide the {num_devices} devices"
    return None


def check_split(profile: Profile, t: int, cp: int, *, devices_per_node: int, num_devices: int, ep: int = 1) -> None:
    """ConfigError naming the option when (t, cp, ep) cannot be used (sizes, or a profile that is not a stack)."""
    problem = tensor_parallel_problem(
        profile, t, devices_per_node=devices_per_node, num_devices=num_devices, spanning=True
    )
    if problem is not None:
        raise ConfigError(f"--tensor-parallel {t}: {problem}")
    problem = context_parallel_problem(profile, t, cp, devices_per_node=devices_per_node, num_devices=num_devices)
    if problem is not None:
        raise ConfigError(f"--context-parallel {cp}: {problem}")
    problem = expert_parallel_problem(profile, t, cp, ep, num_devices=num_devices)
    if problem is not None:
        raise ConfigError(f"--expert-parallel {ep}: {problem}")
    if t * cp > 1:
        transformer_layers(profile)
