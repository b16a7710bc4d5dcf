"""A plan's layout on an engine's parallel dimensions (Megatron-Core; torchtitan 0.2 and 0.3), or the one line that
says why it cannot be placed there.

Data parallelism (both engines): the plan's pipelines times its stage replicas. PipeDream replication splits a
pipeline's m microbatches over r copies of every stage, which computes the gradients of r times the pipelines with
m / r microbatches each; stages replicated different numbers of times have no engine counterpart (both run every
stage on the same number of ranks) and are refused.

torchtitan's rules, read from its code (`distributed/parallel_dims.py`, `models/llama3/.../parallelize.py`):
- dp_replicate x dp_shard x cp x tp x pp = the world size (both versions' `ParallelDims._validate`);
- 0.2 applies DDP (plain replication) only when it is the sole parallelism (`parallelize_llama`: "DDP has not
  supported > 1D parallelism"); 0.3 always wraps with FSDP2, whose replicate dimension is plain replication;
- FSDP shards over dp_shard x cp: with context parallelism the weights are sharded over the cp ranks whatever the
  data-parallel setting;
- expert parallelism takes its ranks from the dense ranks: 0.2 with expert_tensor_parallel_degree = tp (pipeplan's
  and Megatron's experts split over t too) needs ep % cp == 0 and (dp_shard x cp) % ep == 0 (`_validate`); 0.3 has
  no expert tensor parallelism and needs (dp_shard x cp x tp) % ep == 0 (its sparse mesh in `build_mesh`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.artifact.plan import Plan
from pipeplan.errors import ConfigError

TORCHTITAN_VERSIONS = ("0.2", "0.3")


@dataclass(frozen=True, kw_only=True)
class DataParallel:
    size: int  # the engine's data-parallel ranks: pipelines x replicas
    microbatches: int  # per data-parallel rank and step: the plan's microbatches / replicas
    notes: tuple[str, ...]


def data_parallel(plan: Plan, engine: str) -> DataParallel:
    """The engine's data parallelism for `plan`; ConfigError for replication it cannot express."""
    counts = sorted({stage.replicas for stage in plan.stages})
    m, pipelines = plan.training.num_microbatches, plan.training.data_parallel
    if len(counts) > 1:
        per_stage = ", ".join(f"stage {s.index}: {s.replicas}" for s in plan.stages)
        raise ConfigError(
            f"this plan replicates its stages different numbers of times ({per_stage}), which {engine} cannot run "
            "(it places every stage on the same number of ranks); re-plan with --parallel replicate=off to export it"
        )
    replicas = counts[0]
    if m % replicas:
        raise ConfigError(
            f"this plan splits {m} microbatches over {replicas} replicas of every stage, but {engine} gives each "
            "data-parallel rank the same number; re-plan with --parallel replicate=off or a --global-batch-size "
            f"giving a multiple of {replicas} microbatches per pipeline"
        )
    notes: tuple[str, ...] = ()
    if replicas > 1:
        notes = (
            f"every stage has {replicas} replicas: exported as data parallelism over {pipelines} pipeline(s) x "
            f"{replicas} = {pipelines * replicas} ranks, {m // replicas} microbatches each (the same gradients)",
        )
    return DataParallel(size=pipelines * replicas, microbatches=m // replicas, notes=notes)


@dataclass(frozen=True, kw_only=True)
class TorchtitanDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    ep: int  # expert_parallel_degree as the version counts it (0.3: ranks of whole experts, ep x tp)
    etp: int | None  # 0.2's expert_tensor_parallel_degree (set with ep > 1); None: not written
    reshard_after_forward: str | None  # fsdp_reshard_after_forward when FSDP shards (dp_shard x cp > 1)
    microbatches: int  # per data-parallel rank and step
    notes: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp


_ZERO_NOTE = (
    "ZeRO-1 has no torchtitan setting; exported as FSDP over the {n} data-parallel ranks (data_parallel_shard_degree) "
    "with fsdp_reshard_after_forward = never: weights gathered once per step and kept through the backward, "
    "gradients and optimizer state sharded (ZeRO-2: the same reduce-scatter + all-gather, less memory than planned)"
)


def torchtitan_dims(plan: Plan, version: str) -> TorchtitanDims:
    """torchtitan `version`'s parallel degrees for `plan` (module docstring); ConfigError when it has none."""
    assert version in TORCHTITAN_VERSIONS, version
    dp = data_parallel(plan, "torchtitan")
    training = plan.training
    t, cp, ep = training.tensor_parallel, training.context_parallel, training.expert_parallel
    pp = len(plan.stages) // plan.chunks
    notes = list(dp.notes)
    expert_shard = _expert_shard(dp.size, cp, ep, version) if ep > 1 else 1  # refuses what it cannot place
    if training.zero and dp.size > 1:
        shard = dp.size  # a multiple of expert_shard: ep divides dp x cp as it divides expert_shard x cp
        notes.append(_ZERO_NOTE.format(n=dp.size))
    elif ep > 1:
        shard = expert_shard
        if shard > 1:
            notes.append(
                f"expert parallelism: torchtitan takes the ep={ep} ranks from data_parallel_shard_degree x cp, so "
                f"the dense weights are FSDP-sharded over dp_shard={shard} (the plan replicates them)"
            )
    elif version == "0.2" and dp.size > 1 and cp == 1 and (pp > 1 or t > 1):
        shard = dp.size
        notes.append(
            f"torchtitan 0.2 replicates (DDP) only when data parallelism is its one parallelism ('DDP has not "
            f"supported > 1D parallelism'); the {dp.size} data-parallel ranks are exported as FSDP "
            "(data_parallel_shard_degree) with fsdp_reshard_after_forward = never: ZeRO-2, the plan's gradient "
            "all-reduce as a reduce-scatter + all-gather, optimizer state sharded (less memory than planned)"
        )
    else:
        shard = 1
    if cp > 1:
        notes.append(f"context parallelism: torchtitan shards the weights over the cp={cp} ranks too (FSDP)")
    if version == "0.3" and ep > 1 and t > 1:
        notes.append(
            f"torchtitan 0.3 has no expert tensor parallelism: ep={ep} with t={t} is exported as "
            f"expert_parallel_degree {ep * t}, each rank holding whole experts (the same experts' weights per rank)"
        )
    return TorchtitanDims(
        pp=pp,
        dp_replicate=dp.size // shard,
        dp_shard=shard,
        tp=t,
        cp=cp,
        ep=ep * t if version == "0.3" and ep > 1 else ep,
        etp=t if version == "0.2" and ep > 1 else None,
        reshard_after_forward="never" if shard * cp > 1 else None,
        microbatches=dp.microbatches,
        notes=tuple(notes),
    )


def _expert_shard(dp: int, cp: int, ep: int, version: str) -> int:
    """The fewest data-parallel ranks torchtitan must shard (FSDP) for its experts to take ep ranks from them."""
    if version == "0.2" and ep % cp:
        raise ConfigError(
            f"torchtitan 0.2's expert parallelism takes every context-parallel rank (ep % cp == 0), but this plan "
            f"has ep={ep}, cp={cp}; re-plan with --parallel ep=N, N a multiple of {cp}"
        )
    shard = next((k for k in range(1, dp + 1) if dp % k == 0 and (k * cp) % ep == 0), None)
    if shard is None:
        raise ConfigError(
            f"torchtitan takes the ep={ep} expert ranks from the data-parallel x cp ranks ({dp} x {cp}), which ep "
            "does not divide; re-plan with a --parallel ep=N that divides them"
        )
    return shard  # (0.3 counts ep x tp ranks in dp_shard x cp x tp: the same condition)


def megatron_expert_problem(plan: Plan, dp: int) -> str | None:
    """Why Megatron-Core cannot place the plan's experts (its expert grid: tp x ep x expert-dp x pp = the world, with
    expert tensor parallelism = tp, so ep must divide dp x cp), or None."""
    ep, cp = plan.training.expert_parallel, plan.training.context_parallel
    if ep > 1 and (dp * cp) % ep:
        return (
            f"Megatron-Core takes the ep={ep} expert ranks from the data-parallel x cp ranks ({dp} x {cp}), which ep "
            "does not divide; re-plan with a --parallel ep=N that divides them"
        )
    return None
