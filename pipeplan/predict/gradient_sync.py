"""The end of a step, per stage: the gradient exchange over the ranks holding the same parameters, and the
optimizer update (the formulas are the cost module's: `costs.gradient_sync_ms`, `costs.overlap`).

A stage's parameters are held by its replicas in every data-parallel pipeline (dualpipe: by both its mirrored
copies, devices d and P-1-d, in each) and, under context parallelism, by each of the cp ranks of a group (they
split the sequence, not the weights): the exchange runs over replicas x copies x pipelines x cp ranks, over the
slowest link among them: inter-node when the pipelines' groups sit in different
nodes, or when context-parallel groups fill whole nodes on a cluster of several (the search's cluster then has one
group per node; a group of exactly one node's devices is counted inter-node too: pessimistic when cp ranks share
the node and there is one pipeline). Its bytes are the stage's gradients in the precision's gradient dtype;
ZeRO-1 (the distributed optimizer) reduce-scatters them and all-gathers the parameters in their own dtype. Under
expert parallelism ep the routed experts' gradients are exchanged over the expert data-parallel group, 1/ep of the
holders (Megatron-Core), and ZeRO-1 shards their update over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeplan.cluster import Cluster
from pipeplan.costs import (
    Numerics,
    busiest_device_ms,
    expert_holders,
    gradient_sync_ms,
    stages_per_device,
)
from pipeplan.costs.overlap import optimizer_step_ms, update_bytes_per_param
from pipeplan.partition.result import Partition
from pipeplan.profiling.profile import Profile


@dataclass(frozen=True, kw_only=True)
class SyncGroup:
    """Who else holds a stage's parameters: `data_parallel` pipelines, `context_parallel` ranks per group."""

    data_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1  # routed experts are held by 1/ep of the others
    mirrored: bool = False  # dualpipe: each stage also on device P-1-d (its copy for the other direction)

    def stage_devices(self, devices: Sequence[int], num_devices: int) -> tuple[int, ...]:
        """The pipeline devices holding a stage the partition put on `devices` (and their mirrors)."""
        return tuple(devices) + (tuple(num_devices - 1 - d for d in devices) if self.mirrored else ())


def stage_param_count(profile: Profile, first_layer: int, last_layer: int) -> int:
    return sum(layer.param_count for layer in profile.layers[first_layer : last_layer + 1])


def stage_expert_count(profile: Profile, first_layer: int, last_layer: int) -> int:
    return sum(layer.expert_param_count for layer in profile.layers[first_layer : last_layer + 1])


def stage_allreduce_ms(
    profile: Profile, cluster: Cluster, part: Partition, group: SyncGroup, *, numerics: Numerics, zero: int = 0
) -> tuple[float, ...]:
    """Per stage, the ring all-reduce of its gradients over its holders (pipeline k's device d is global rank k x P
    + d; see the module docstring), or ZeRO-1's reduce-scatter + all-gather (`costs.gradient_sync_ms`), at the
    exchange efficiency a refined profile learned from its run (`exchange_efficiency`)."""
    mode = numerics.precision
    times = []
    for stage in part.stages:
        held = group.stage_devices(stage.devices, part.num_devices)
        devices = [k * part.num_devices + d for k in range(group.data_parallel) for d in held]
        whole_nodes = group.context_parallel > 1 and cluster.devices_per_node == 1 and cluster.num_nodes > 1
        link = cluster.inter_link if whole_nodes else cluster.link_between(devices)
        count = stage_param_count(profile, stage.first_layer, stage.last_layer)
        size = len(devices) * group.context_parallel
        experts = stage_expert_count(profile, stage.first_layer, stage.last_layer) if group.expert_parallel > 1 else 0
        dense = count - experts
        time = gradient_sync_ms(dense * mode.grad_bytes, dense * mode.param_bytes, size, link, zero)
        ep_size = int(expert_holders(size, group.expert_parallel))  # the expert data-parallel group
        time += gradient_sync_ms(experts * mode.grad_bytes, experts * mode.param_bytes, ep_size, link, zero)
        times.append(time / exchange_efficiency(profile))
    return tuple(times)


def exchange_efficiency(profile: Profile) -> float:
    """How fast gradient exchanges ran in the run `profile` was refined from, over the link model's time for them
    (`Provenance.exchange_efficiency`, `refine.updates`); 1 when not learned."""
    return profile.provenance.exchange_efficiency or 1.0


def step_checks_ms(profile: Profile) -> float:
    """A synchronized step's global checks, learned from a run (`Provenance.step_checks_ms`); 0 when not learned."""
    return profile.provenance.step_checks_ms or 0.0


def stage_optimizer_ms(
    part: Partition, profile: Profile, *, numerics: Numerics, zero: int, group: SyncGroup
) -> tuple[float, ...]:
    """Per stage, one of its devices' optimizer update: its parameters (its 1/holders share under ZeRO-1) times the
    bytes an update moves per parameter, at the profile's memory rate (0 when the profile does not know it: a
    measured profile, unless `refine` learned the rate from a run: `Provenance.update_bytes_per_s`)."""
    rates = profile.provenance.kernel_rates
    bytes_per_s = rates.bytes_per_s if rates is not None else profile.provenance.update_bytes_per_s
    if not bytes_per_s or not numerics.named:
        return tuple(0.0 for _ in part.stages)
    moved = update_bytes_per_param(numerics)
    times = []
    for stage in part.stages:
        experts = stage_expert_count(profile, stage.first_layer, stage.last_layer) if group.expert_parallel > 1 else 0
        params = stage_param_count(profile, stage.first_layer, stage.last_layer)
        count = updated_params(params, experts, replicas=stage.replicas, zero=zero, group=group)
        times.append(optimizer_step_ms(count, moved, bytes_per_s))
    return tuple(times)


def updated_params(params: int, experts: int, *, replicas: int, zero: int, group: SyncGroup) -> float:
    """Parameters one device holding a stage updates: all of the stage's `params` (of which `experts` are routed
    experts), or under ZeRO-1 its share: the dense ones over every holder (its replicas in every pipeline, the cp
    ranks, dualpipe's mirrored copy), the experts over the holders of the same expert (`expert_holders`)."""
    if not zero:
        return float(params)
    shards = replicas * group.data_parallel * group.context_parallel * (2 if group.mirrored else 1)
    experts = experts if group.expert_parallel > 1 else 0
    return (params - experts) / shards + experts / float(expert_holders(shards, group.expert_parallel))


def allreduce_step_ms(part: Partition, per_stage_ms: tuple[float, ...]) -> float:
    """After the flush each device reduces its stages (chunks) one after another; devices run in parallel."""
    return busiest_device_ms(per_stage_ms, stages_per_device([s.devices for s in part.stages]))
