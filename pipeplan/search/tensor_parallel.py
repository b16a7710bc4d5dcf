"""Tensor parallelism in the analytic planner: a profile as one tensor-parallel rank of t sees it, and the cluster
the pipeline search then runs on — `tensor_parallel_profile(profile, t, link)`, `tensor_parallel_cluster`.

Model: Megatron-LM tensor parallelism inside a node with sequence parallelism (Shoeybi et al., "Megatron-LM",
2019, §3; Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023, §4).

- Which layers: the profile must be a transformer stack at block granularity — its first layer an embedding (a
  lookup: parameters, no FLOPs), then a uniform run of blocks (every one with the same parameter count and FLOPs,
  taking and producing the hidden state: the cut before it equals the cut after it, and its output is as large as
  the embedding's), then the LM head (parameters and FLOPs). Anything else is refused with one line: the
  collectives below are those of that stack (`transformer_layers`).
- Compute: a block's matmuls split by columns/rows over t ranks and its attention by heads; with sequence
  parallelism its norms, dropouts and residual adds split along the sequence. So every op of a block, the
  embedding (vocab-parallel rows) and the head (vocab-parallel columns, vocab-parallel cross entropy, its norm
  sequence-parallel) runs on 1/t of its data: F, I, W, B and both recompute times divide by t. The roofline times
  of analytic profiles are per-op max(FLOPs / rate, bytes / rate) and scale exactly; a calibrated kernel-launch
  floor and smaller matmuls' lower efficiency are not modelled (optimistic for large t on small layers).
- Memory: Korthikanti et al. Table 2 with sequence parallelism: a block keeps s·b·h·(34/t + 5·a·s/(h·t)) bytes,
  i.e. exactly 1/t of what it keeps without parallelism (`memory_formulas.activation_bytes_per_layer`), and 34/t
  under selective recompute; full recompute keeps the sequence-sharded input, 2·s·b·h/t. So every kept-bytes
  field (none, selective, full, I's share) divides by t, rounded up; so do the autocast weight copies profiles
  count with activations (the weights are sharded). Parameters divide by t, rounded up (the norms' weights and a
  learned position table, which Megatron replicates, count as sharded: 2h of a block's ~12h² parameters). A stage
  boundary sends each rank's sequence shard to its counterpart (Narayanan et al. 2021, §4.1 scatter/gather): cut
  bytes / t.
- Communication on the critical path (`memory_formulas.tensor_parallel_comm_per_layer`, sequence parallel): a
  block's forward runs 2 all-gathers + 2 reduce-scatters of its s·b·h hidden state (the profile's output bytes),
  its backward the same, over the intra-node link (`Link` ring formulas): added to F, and to I and B (the input
  gradient's path; W waits on nothing new). Full recompute re-runs the forward's collectives. The embedding
  reduce-scatters its output forward and all-gathers the output's gradient backward (on W, the only backward work a
  lookup has); the head all-gathers its input forward, and its vocab-parallel cross entropy all-reduces 3 fp32
  values per token (max logit, sum of exponentials, target logit: Megatron-LM's vocab_parallel_cross_entropy);
  its backward reduce-scatters the input gradient.

`tensor_parallel_cluster` turns the cluster into groups of t devices: each search "device" is a tensor-parallel
group of t consecutive ranks of one node (tensor parallelism innermost, as Megatron orders ranks), with one
device's memory and links (each rank sends its own shard of every transfer and all-reduce over its own link).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeplan.cluster import Cluster, Link
from pipeplan.costs import all_gather_ms, allreduce_ms, reduce_scatter_ms
from pipeplan.costs.transformer import tensor_parallel_comm_per_layer
from pipeplan.errors import ConfigError
from pipeplan.profiling.profile import LayerProfile, Profile

TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)  # what `auto` tries (each must divide the devices per node)
CROSS_ENTROPY_ALLREDUCES = 3  # max logit, sum of exponentials, target logit; fp32 per token
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
    """The roles of a profile's layers: embedding 0, blocks 1..n-2, head n-1; `hidden_bytes`: one block's output
    (s·b·h elements in the profile's dtype), the message of every tensor-parallel collective."""

    num_layers: int
    hidden_bytes: int

    @property
    def blocks(self) -> range:
        return range(1, self.num_layers - 1)


def transformer_layers(profile: Profile) -> TransformerLayers:
    """The stack's roles (see the module docstring), or ConfigError naming the first layer that does not fit."""
    problem = stack_problem(profile)
    if problem is not None:
        raise ConfigError(f"--tensor-parallel > 1 models a transformer stack: {problem}; use --tensor-parallel 1")
    return TransformerLayers(num_layers=profile.num_layers, hidden_bytes=profile.layers[0].output_bytes)


def stack_problem(profile: Profile) -> str | None:
    """Why the profile is not a transformer stack at block granularity (one clause), or None when it is."""
    layers = profile.layers
    if len(layers) < 3:
        return f"the profile has {len(layers)} layer(s), not an embedding, blocks and an LM head"
    embedding, head, blocks = layers[0], layers[-1], layers[1:-1]
    if embedding.param_count == 0 or embedding.flops > 0:
        return f"layer {embedding.name!r} is not an embedding lookup (parameters, no FLOPs)"
    for index, block in enumerate(blocks, start=1):
        before, after = profile.cut_bytes[index - 1], profile.cut_bytes[index]
        if block.param_count == 0 or block.flops <= 0 or block.output_bytes != embedding.output_bytes:
            return f"layer {block.name!r} is not a transformer block (hidden state in and out, parameters, FLOPs)"
        if before != after:
            return f"layer {block.name!r} is not a transformer block (hidden state in and out, parameters, FLOPs)"
        if (block.param_count, block.flops) != (blocks[0].param_count, blocks[0].flops):
            return f"layer {block.name!r} differs from {blocks[0].name!r} (profile at block granularity)"
    if head.param_count == 0 or head.flops <= 0:
        return f"layer {head.name!r} is not an LM head (parameters, FLOPs)"
    return None


def tensor_parallel_problem(profile: Profile, t: int, *, devices_per_node: int, num_devices: int) -> str | None:
    """Why `t` cannot split this model on this cluster (one clause), or None when it can."""
    if t < 1:
        return f"tensor parallel size must be >= 1, got {t}"
    if t == 1:
        return None
    if devices_per_node % t:
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


def _int_option(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def check_tensor_parallel(profile: Profile, t: int, *, devices_per_node: int, num_devices: int) -> None:
    """ConfigError naming --tensor-parallel when `t` cannot be used (sizes, or a profile that is not a stack)."""
    problem = tensor_parallel_problem(profile, t, devices_per_node=devices_per_node, num_devices=num_devices)
    if problem is not None:
        raise ConfigError(f"--tensor-parallel {t}: {problem}")
    if t > 1:
        transformer_layers(profile)


@dataclass(frozen=True, kw_only=True)
class LayerComm:
    """Milliseconds of tensor-parallel collectives one layer adds to its forward and to its backward."""

    forward_ms: float
    backward_ms: float


def block_comm(hidden_bytes: int, t: int, link: Link) -> LayerComm:
    """A block's collectives (Korthikanti et al. §4.2.2 with sequence parallelism), ring times on `link`."""
    comm = tensor_parallel_comm_per_layer(
        seq=1, batch=1, hidden=hidden_bytes, tensor_parallel=t, sequence_parallel=True, bytes_per_element=1
    )  # the formula's message is s·b·h elements x bytes: the profiled hidden-state bytes, passed whole
    return LayerComm(
        forward_ms=_collectives_ms(comm.forward, t, link), backward_ms=_collectives_ms(comm.backward, t, link)
    )


def _collectives_ms(collectives, t: int, link: Link) -> float:
    time = {"all-gather": all_gather_ms, "reduce-scatter": reduce_scatter_ms, "all-reduce": allreduce_ms}
    return sum(c.count * time[c.kind](c.message_bytes, t, link) for c in collectives)


def layer_comms(profile: Profile, stack: TransformerLayers, t: int, link: Link) -> list[LayerComm]:
    """Per layer: the embedding's, each block's and the head's collectives (see the module docstring)."""
    hidden = stack.hidden_bytes
    tokens = profile.provenance.batch_size * (profile.provenance.tokens_per_sample or 1)
    embedding = LayerComm(forward_ms=reduce_scatter_ms(hidden, t, link), backward_ms=all_gather_ms(hidden, t, link))
    losses = CROSS_ENTROPY_ALLREDUCES * allreduce_ms(4 * tokens, t, link)
    head = LayerComm(forward_ms=all_gather_ms(hidden, t, link) + losses, backward_ms=reduce_scatter_ms(hidden, t, link))
    return [embedding, *[block_comm(hidden, t, link)] * len(stack.blocks), head]


def _split(value: int, t: int) -> int:
    return -(-value // t)


def _shard_layer(layer: LayerProfile, t: int, comm: LayerComm) -> LayerProfile:
    """One rank's share of `layer` plus its collectives (backward ones on I when it has input-gradient work)."""
    on_input = layer.input_grad_ms > 0
    params = _split(layer.param_count, t)
    return replace(
        layer,
        forward_ms=layer.forward_ms / t + comm.forward_ms,
        input_grad_ms=layer.input_grad_ms / t + (comm.backward_ms if on_input else 0.0),
        weight_grad_ms=layer.weight_grad_ms / t + (0.0 if on_input else comm.backward_ms),
        backward_ms=layer.backward_ms / t + comm.backward_ms,
        activation_bytes=_split(layer.activation_bytes, t),
        activation_freed_by_input_grad_bytes=_split(layer.activation_freed_by_input_grad_bytes, t),
        param_count=params,
        param_bytes=round(layer.param_bytes * params / layer.param_count) if layer.param_count else 0,
        output_bytes=_split(layer.output_bytes, t),
        flops=layer.flops / t,
        peak_memory_bytes=_split(layer.peak_memory_bytes, t),
        selective_activation_bytes=_split(layer.selective_activation_bytes, t),
        full_activation_bytes=_split(layer.full_activation_bytes, t),
        full_recompute_ms=layer.full_recompute_ms / t + comm.forward_ms,
        selective_recompute_ms=layer.selective_recompute_ms / t,
    )


def tensor_parallel_profile(profile: Profile, t: int, link: Link) -> Profile:
    """`profile` as each of t tensor-parallel ranks runs it, collectives over `link` (the intra-node one)
    included; t = 1 returns it unchanged. Raises ConfigError when the profile is not a transformer stack."""
    if t < 1:
        raise ConfigError(f"--tensor-parallel must be >= 1, got {t}")
    if t == 1:
        return profile
    stack = transformer_layers(profile)
    comms = layer_comms(profile, stack, t, link)
    notes = f"{profile.provenance.notes}; tensor parallel t={t} (sequence parallel), per rank".lstrip("; ")
    return replace(
        profile,
        layers=tuple(_shard_layer(layer, t, comm) for layer, comm in zip(profile.layers, comms, strict=True)),
        cut_bytes=tuple(_split(b, t) for b in profile.cut_bytes),
        whole_forward_ms=None,
        whole_backward_ms=None,
        provenance=replace(profile.provenance, notes=notes),
    )


def tensor_parallel_inputs(profile: Profile, cluster: Cluster, t: int) -> tuple[Profile, Cluster]:
    """What the pipeline search runs on under tensor parallelism t: one rank's profile (collectives over the
    intra-node link) and the cluster of t-device groups; (profile, cluster) unchanged for t = 1. Refuses a t the
    cluster or model cannot take (`check_tensor_parallel`)."""
    check_tensor_parallel(profile, t, devices_per_node=cluster.devices_per_node, num_devices=cluster.num_devices)
    if t == 1:
        return profile, cluster
    return tensor_parallel_profile(profile, t, cluster.intra_link), tensor_parallel_cluster(cluster, t)


def tensor_parallel_profiles(
    profiles: dict[int, Profile], cluster: Cluster, t: int
) -> tuple[dict[int, Profile], Cluster]:
    """`tensor_parallel_inputs` for the search's profiles by microbatch size: each is sharded after its scaling, so
    the collectives' latency is counted once per message, not scaled with the microbatch."""
    sharded = {b: tensor_parallel_inputs(profile, cluster, t)[0] for b, profile in profiles.items()}
    return sharded, tensor_parallel_cluster(cluster, t)


def tensor_parallel_cluster(cluster: Cluster, t: int) -> Cluster:
    """The cluster as the pipeline search sees it under tensor parallelism t: N / t devices (tensor-parallel groups
    of t consecutive ranks), devices_per_node / t of them per node, one device's memory and links."""
    if t == 1:
        return cluster
    assert cluster.devices_per_node % t == 0 and cluster.num_devices % t == 0, "checked by tensor_parallel_problem"
    return replace(cluster, num_devices=cluster.num_devices // t, devices_per_node=cluster.devices_per_node // t)


def devices_cluster(cluster: Cluster, t: int) -> Cluster:
    """The inverse of `tensor_parallel_cluster`: the devices themselves."""
    if t == 1:
        return cluster
    return replace(cluster, num_devices=cluster.num_devices * t, devices_per_node=cluster.devices_per_node * t)


def devices_phrase(num_groups: int, t: int) -> str:
    """How messages name `num_groups` groups of t devices: `64 device(s) with tensor parallelism t=8`."""
    tensor = f" with tensor parallelism t={t}" if t > 1 else ""
    return f"{num_groups * t} device(s){tensor}"
