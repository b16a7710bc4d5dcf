"""Tensor and context parallelism in the analytic planner: a profile as one rank of a t x cp group sees it, and the
cluster of such groups the pipeline search then runs on — `split_inputs(profile, cluster, t, cp)`.

Model: Megatron-LM tensor parallelism with sequence parallelism (Shoeybi et al., "Megatron-LM", 2019, §3;
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023, §4) and
Megatron-Core context parallelism (ring attention over cp ranks with load-balanced causal chunks: each rank holds
2 of 2·cp sequence chunks; docs "context_parallel", Transformer Engine `AttnFuncWithCPAndKVP2P`).

- Which layers: the profile must be a transformer stack at block granularity, its layers' roles found by structure
  (`search.stack.transformer_layers`): embedding lookups and helpers, a uniform run of blocks (same parameters and
  FLOPs, the hidden state in and out), a final norm, the LM head — whether the model is a built-in, a Hugging
  Face type or a user's factory. Anything else is refused with one line naming the layer.
- Compute: a layer's times come from its work (`profiling.retime.reshaped_layer`: every matmul at the rank's
  shape — column-parallel linears n / t, row-parallel ones k / t, attention heads / t; context parallelism: token
  rows / cp, attention queries / cp against all keys, causal work balanced — tile and wave quantization included;
  the other ops / (t·cp)). A layer without work (a measured profile) divides its times by t·cp.
- Memory: every kept-bytes field (none, selective, full, I's share) divides by t·cp, rounded up (Korthikanti Table
  2 with sequence parallelism is 1/t of the unsplit bytes; context parallelism splits every position); parameters
  by t (context-parallel ranks hold the same weights), but for the weights of linears Megatron duplicates
  (`LayerProfile.replicated_param_count`: MLA's down-projections, routers), which every rank holds whole; a stage
  boundary sends each rank's shard: cut bytes / t·cp.
- Communication (`layer_comms`): per block the tensor-parallel collectives of `costs.tensor_parallel.
  tensor_parallel_comm_per_layer` with sequence parallelism, each message the rank's s/cp positions; forward on F,
  backward on I (W when the layer has no input gradient); under an FP8 recipe every all-gather moves FP8
  (inputs, their re-gathers and output gradients: `fp8_gathers`); the wgrad re-gathers overlap the input-gradient
  matmuls (only what exceeds them is exposed). With `--overlap tensor` (Megatron's tp_comm_overlap, off by default as in
  Megatron-Core) each collective hides behind its layer's linears at the rank's shape, pipelined in c chunks
  (`Overlap.tensor_chunks`: t, or `chunks=N`), at a cost (`costs.overlap.overlapped_ms`): exposed max(comm - matmul
  time, comm / c), plus the matmul time its `Overlap.comm_sms` SMs take while it runs, plus what running the
  linears as c chunks of their tokens costs (the
  forward's, and the input gradients of row-parallel ones: Transformer Engine's ring-exchange overlap). Context
  parallelism's ring sends each rank's K and V chunk cp - 1 times forward and K, V, dK, dV backward over the
  context-parallel link, overlapped with attention (exposed: what exceeds attention's time).
  The (vocabulary-parallel) embedding reduce-scatters forward and all-gathers backward; helpers and a final norm
  have none (sequence parallel: each rank's s / t rows); the head all-gathers its input and its vocab-parallel
  cross entropy all-reduces 3 fp32 values per token (Megatron-LM's vocab_parallel_cross_entropy).

The pipeline search then runs on groups of t·cp consecutive ranks (`cluster.DeviceGroups`: tensor parallelism
innermost, then context parallelism, as Megatron orders ranks); groups larger than a node span whole nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeplan.cluster import Cluster, DeviceGroups, Link
from pipeplan.costs import all_gather_ms, all_to_all_ms, allreduce_ms, reduce_scatter_ms, transfer_ms
from pipeplan.costs.overlap import Overlap, overlapped_ms
from pipeplan.costs.tensor_parallel import tensor_parallel_comm_per_layer
from pipeplan.errors import ConfigError
from pipeplan.profiling.experts import expert_count, routed_share
from pipeplan.profiling.kernels import DIMS, KernelRates, kernel_seconds, kernels_seconds, pass_kernels
from pipeplan.profiling.profile import LayerProfile, Profile
from pipeplan.profiling.retime import reshaped_layer
from pipeplan.search.stack import stack_problem, transformer_layers

NO_OVERLAP = Overlap()
CROSS_ENTROPY_ALLREDUCES = 3  # max logit, sum of exponentials, target logit; fp32 per token


@dataclass(frozen=True, kw_only=True)
class LayerComm:
    """Milliseconds of collectives one layer adds to its forward and to its backward."""

    forward_ms: float = 0.0
    backward_ms: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Links:
    """The links a group's collectives run on."""

    tensor: Link
    context: Link
    expert: Link | None = None  # the expert-parallel group's (all-to-all)


def group_links(cluster: Cluster, t: int, cp: int, ep: int = 1) -> Links:
    """Tensor parallelism inside a node when t fits one; context-parallel peers t ranks apart: inside a node when
    t·cp fits one; expert-parallel peers t·cp ranks apart (Megatron-Core's order: ep next to cp): inside a node when
    t·cp·ep fits one."""
    return Links(
        tensor=cluster.link_for_consecutive(t),
        context=cluster.link_for_consecutive(t * cp),
        expert=cluster.link_for_consecutive(t * cp * ep),
    )


def _collectives_ms(collectives, t: int, link: Link, positions: int) -> float:
    time = {"all-gather": all_gather_ms, "reduce-scatter": reduce_scatter_ms, "all-reduce": allreduce_ms}
    return sum(c.count * time[c.kind](c.message_bytes / positions, t, link) for c in collectives)


def block_comm(
    layer: LayerProfile,
    hidden_bytes: int,
    t: int,
    cp: int,
    links: Links,
    rates,
    overlap: Overlap,
) -> LayerComm:
    """A block's collectives on one rank (module docstring), exposed parts only; with `overlap.tensor` what
    overlapping costs (`costs.overlap.overlapped_ms`: `overlap.comm_sms` SMs taken while a collective runs, the
    linears run as `overlap.tensor_chunks(t)` chunks of their tokens)."""
    fp8 = rates is not None and rates.fp8_flops_per_s is not None  # an FP8 recipe: FP8 gathers
    comm = tensor_parallel_comm_per_layer(
        seq=1,
        batch=1,
        hidden=hidden_bytes,
        tensor_parallel=t,
        sequence_parallel=True,
        bytes_per_element=1,
        fp8_gathers=fp8,
    )  # the formula's message is s·b·h elements x bytes: the profiled hidden-state bytes, passed whole
    forward = _collectives_ms(comm.forward, t, links.tensor, cp)
    backward = _collectives_ms(comm.backward, t, links.tensor, cp)
    regather = _collectives_ms(comm.regather, t, links.tensor, cp)
    work = layer.work.reshaped(t=t, cp=cp) if layer.work is not None else None
    matmul = {name: 0.0 for name in ("forward", "input_grad")}
    attention = {name: 0.0 for name in ("forward", "input_grad")}
    split = {name: 0.0 for name in ("forward", "input_grad")}
    pieces = overlap.tensor_chunks(t)
    if work is not None and rates is not None:
        for name in matmul:
            kernels = pass_kernels(work.kernels, name)
            matmul[name] = kernels_seconds([k for k in kernels if k.weight], rates) * 1e3
            attention[name] = kernels_seconds([k for k in kernels if k.kind == "attention" or k.core], rates) * 1e3
            chunked = [k for k in kernels if k.weight and (name == "forward" or k.tp == "n")]
            split[name] = _chunks_ms(chunked, pieces, rates)
    if overlap.tensor:
        share = overlap.comm_sms / rates.sm_count if rates is not None and rates.sm_count else 0.0
        forward = overlapped_ms(forward, matmul["forward"], chunks=pieces, sm_share=share, split_ms=split["forward"])
        backward = overlapped_ms(
            backward, matmul["input_grad"], chunks=pieces, sm_share=share, split_ms=split["input_grad"]
        )
    backward += max(regather - matmul["input_grad"], 0.0)
    ring = context_ring_ms(layer, cp, links.context, t)
    forward += max(ring - attention["forward"], 0.0)
    backward += max(2 * ring - attention["input_grad"], 0.0)
    return LayerComm(forward_ms=forward, backward_ms=backward)


def _chunks_ms(kernels, chunks: int, rates: KernelRates) -> float:
    """What running each of `kernels` as `chunks` matmuls of 1/chunks of its tokens costs over running it whole
    (TE's ring exchange and pipelined overlap: the linears beside an overlapped collective, forward, and the
    input gradients of row-parallel ones)."""
    extra = 0.0
    for kernel in kernels:
        dim = DIMS[kernel.tokens[0]] if kernel.tokens else "m"
        size = getattr(kernel, dim)
        if chunks <= 1 or size < chunks:
            continue
        piece = replace(kernel, **{dim: -(-size // chunks)})
        extra += chunks * kernel_seconds(piece, rates) - kernel_seconds(kernel, rates)
    return max(extra, 0.0) * 1e3


def context_ring_ms(layer: LayerProfile, cp: int, link: Link, t: int = 1) -> float:
    """Forward ring of context parallelism: cp - 1 transfers of the rank's K and V chunk (per attention call of the
    layer, from its kernel at the rank's shape: samples x key/value heads / t x positions / cp x head size); 0 for
    cp = 1."""
    if cp == 1 or layer.work is None:
        return 0.0
    total = 0.0
    for kernel in layer.work.kernels:
        if kernel.kind == "attention" or (kernel.core and kernel.kind == "gemm" and kernel.k <= kernel.n):
            rank = kernel.on_rank(t=t, cp=cp)
            kv_bytes = 2 * rank.batch * kernel.kv_share * (rank.n / cp) * rank.k * rank.element_bytes
            total += (cp - 1) * transfer_ms(kv_bytes, link)
            if kernel.kind == "gemm":
                break  # math attention: one K and one V per layer, however many matmuls read them
    return total


def layer_comms(profile: Profile, t: int, cp: int, links: Links, overlap: Overlap, ep: int = 1) -> list[LayerComm]:
    """Per layer: the embedding's, each block's and the head's collectives (see the module docstring), and each
    MoE block's all-to-alls (`expert_comms`)."""
    if t == 1 and cp == 1:
        return expert_comms(profile, t, cp, ep, links, [LayerComm()] * profile.num_layers)
    stack = transformer_layers(profile)
    hidden = stack.hidden_bytes
    rates = profile.provenance.kernel_rates
    tokens = profile.provenance.batch_size * (profile.provenance.tokens_per_sample or 1) / cp
    split = hidden / cp
    comms = [LayerComm()] * profile.num_layers  # helpers and a final norm: none (sequence parallel, s / t rows)
    comms[stack.embedding] = LayerComm(
        forward_ms=reduce_scatter_ms(split, t, links.tensor), backward_ms=all_gather_ms(split, t, links.tensor)
    )
    losses = CROSS_ENTROPY_ALLREDUCES * allreduce_ms(4 * tokens, t, links.tensor)
    comms[stack.head] = LayerComm(
        forward_ms=all_gather_ms(split, t, links.tensor) + losses, backward_ms=reduce_scatter_ms(split, t, links.tensor)
    )
    for i in stack.blocks:
        comms[i] = block_comm(profile.layers[i], hidden, t, cp, links, rates, overlap)
    return expert_comms(profile, t, cp, ep, links, comms)


def expert_comms(profile: Profile, t: int, cp: int, ep: int, links: Links, comms: list[LayerComm]) -> list[LayerComm]:
    """`comms` plus, per MoE block under ep > 1, the all-to-all dispatch and combine: forward 2, backward 2 (their
    gradients), each moving the rank's token slots (its tokens x top_k, balanced routing) of the hidden state over
    the ep group's link, exposed."""
    if ep == 1:
        return comms
    assert links.expert is not None
    tokens = profile.provenance.batch_size * (profile.provenance.tokens_per_sample or 1)
    hidden = profile.layers[0].output_bytes / (t * cp)  # the rank's hidden state (sequence parallel under t)
    out = []
    for layer, comm in zip(profile.layers, comms, strict=True):
        a2a = all_to_all_ms(hidden * routed_share(layer, tokens) * expert_count(layer), ep, links.expert)
        moe = layer.expert_param_count > 0
        out.append(
            replace(comm, forward_ms=comm.forward_ms + 2 * a2a, backward_ms=comm.backward_ms + 2 * a2a) if moe else comm
        )
    return out


def _split(value: int, parts: int) -> int:
    return -(-value // parts)


def _shard_layer(
    layer: LayerProfile, t: int, cp: int, comm: LayerComm, rates: KernelRates | None, ep: int = 1
) -> LayerProfile:
    """One rank's share of `layer` plus its collectives (backward ones on I when it has input-gradient work)."""
    ranks = t * cp
    timed = reshaped_layer(layer, rates, t=t, cp=cp, ep=ep) or _divided_times(layer, ranks)
    on_input = timed.input_grad_ms > 0
    experts = _split(layer.expert_param_count, t * ep)
    whole = layer.replicated_param_count  # duplicated linears (MLA's down-projections, routers): every rank's
    params = _split(layer.param_count - layer.expert_param_count - whole, t) + whole + experts
    return replace(
        timed,
        forward_ms=timed.forward_ms + comm.forward_ms,
        input_grad_ms=timed.input_grad_ms + (comm.backward_ms if on_input else 0.0),
        weight_grad_ms=timed.weight_grad_ms + (0.0 if on_input else comm.backward_ms),
        backward_ms=timed.backward_ms + comm.backward_ms,
        full_recompute_ms=timed.recompute_ms("full") + comm.forward_ms,
        activation_bytes=_split(layer.activation_bytes, ranks),
        activation_freed_by_input_grad_bytes=_split(layer.activation_freed_by_input_grad_bytes, ranks),
        param_count=params,
        param_bytes=round(layer.param_bytes * params / layer.param_count) if layer.param_count else 0,
        output_bytes=_split(layer.output_bytes, ranks),
        flops=layer.flops / ranks,
        peak_memory_bytes=_split(layer.peak_memory_bytes, ranks),
        selective_activation_bytes=_split(layer.kept_bytes("selective"), ranks),
        full_activation_bytes=_split(layer.kept_bytes("full"), ranks),
        expert_param_count=experts,
        replicated_param_count=whole,
    )


def _divided_times(layer: LayerProfile, ranks: int) -> LayerProfile:
    """A layer without work: its times / ranks (exact for compute-bound rooflines; optimistic for small shards)."""
    return replace(
        layer,
        forward_ms=layer.forward_ms / ranks,
        input_grad_ms=layer.input_grad_ms / ranks,
        weight_grad_ms=layer.weight_grad_ms / ranks,
        backward_ms=layer.backward_ms / ranks,
        full_recompute_ms=layer.recompute_ms("full") / ranks,
        selective_recompute_ms=layer.selective_recompute_ms / ranks,
    )


def split_profile(
    profile: Profile, t: int, cp: int, links: Links, *, overlap: Overlap = NO_OVERLAP, ep: int = 1
) -> Profile:
    """`profile` as each rank of a t x cp group (and of an ep expert-parallel group) runs it, collectives over
    `links` included; t = cp = ep = 1 returns it unchanged. Raises ConfigError when the profile is not a
    transformer stack."""
    if t < 1 or cp < 1 or ep < 1:
        raise ConfigError(f"--parallel tp, cp and ep must be >= 1, got {t}, {cp}, {ep}")
    if t == 1 and cp == 1 and ep == 1:
        return profile
    comms = layer_comms(profile, t, cp, links, overlap, ep)
    rates = profile.provenance.kernel_rates
    layers = tuple(
        _shard_layer(layer, t, cp, comm, rates, ep) for layer, comm in zip(profile.layers, comms, strict=True)
    )
    experts = f", expert parallel ep={ep}" if ep > 1 else ""
    split = f"tensor parallel t={t} (sequence parallel), context parallel cp={cp}{experts}"
    notes = f"{profile.provenance.notes}; {split}, per rank"
    return replace(
        profile,
        layers=layers,
        cut_bytes=tuple(_split(b, t * cp) for b in profile.cut_bytes),
        whole_forward_ms=None,
        whole_backward_ms=None,
        provenance=replace(profile.provenance, notes=notes.lstrip("; ")),
    )


def split_inputs(
    profile: Profile,
    cluster: Cluster,
    t: int,
    cp: int = 1,
    *,
    overlap: Overlap = NO_OVERLAP,
    ep: int = 1,
) -> tuple[Profile, Cluster]:
    """What the pipeline search runs on: one rank's profile and the cluster of t·cp groups; unchanged for t = cp =
    ep = 1. Refuses what the cluster or model cannot take (`search.stack.check_split`)."""
    from pipeplan.search.stack import check_split

    check_split(profile, t, cp, devices_per_node=cluster.devices_per_node, num_devices=cluster.num_devices, ep=ep)
    if t * cp * ep == 1:
        return profile, cluster
    links = group_links(cluster, t, cp, ep)
    groups = DeviceGroups(tensor_parallel=t, context_parallel=cp)
    return split_profile(profile, t, cp, links, overlap=overlap, ep=ep), groups.of(cluster)


__all__ = ["stack_problem", "split_inputs", "split_profile", "group_links"]
