"""A Plan for a hand-chosen layout without profiling or search: the traced layers cut into contiguous stages
(evenly by default, or at given layer boundaries), a named schedule's op lists, optional stage replicas and
data-parallel pipelines. Used by the runtime tests and benchmarks to run every schedule on a fixed split; the
planner (`pipeplan plan`) is the way to get a chosen, predicted plan."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeplan.artifact.plan import ModelRef, Plan, Predicted, StagePlan, TrainingConfig
from pipeplan.artifact.ranks import rank_infos
from pipeplan.cluster import Cluster
from pipeplan.costs.optimizer import bytes_per_param, numerics
from pipeplan.errors import ConfigError
from pipeplan.graph.recompute_modes import unknown_recompute
from pipeplan.graph.trace import LayerGraph, trace_model
from pipeplan.models import load_model
from pipeplan.models.registry import canonical_ref, recorded_options
from pipeplan.predict.layout import pipeline_layout
from pipeplan.schedules.registry import generate


def even_cuts(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """(first, last) layer of each stage, sizes differing by at most one."""
    if num_stages > num_layers:
        raise ConfigError(f"{num_stages} stages need at least as many layers; the model has {num_layers}")
    base, extra = divmod(num_layers, num_stages)
    cuts, first = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        cuts.append((first, first + size - 1))
        first += size
    return cuts


def _stages(
    graph: LayerGraph, cuts: Sequence[tuple[int, int]], replicas: Sequence[int], recompute: Sequence[str]
) -> tuple[StagePlan, ...]:
    return tuple(
        StagePlan(
            index=index,
            first_layer=first,
            last_layer=last,
            layer_names=tuple(layer.name for layer in graph.layers[first : last + 1]),
            node_names=tuple(node for layer in graph.layers[first : last + 1] for node in layer.nodes),
            replicas=replicas[index],
            recompute=recompute[index],
        )
        for index, (first, last) in enumerate(cuts)
    )


def _replicas(replicas: Sequence[int] | None, num_stages: int) -> tuple[int, ...]:
    found = tuple(replicas or (1,) * num_stages)
    if len(found) != num_stages:
        raise ConfigError(f"replicas gives {len(found)} values for {num_stages} stages")
    return found


def _recompute_modes(recompute: Sequence[str] | None, num_stages: int) -> tuple[str, ...]:
    modes = tuple(recompute or ("none",) * num_stages)
    if len(modes) != num_stages:
        raise ConfigError(f"recompute gives {len(modes)} modes for {num_stages} stages")
    for mode in modes:
        if (problem := unknown_recompute(mode)) is not None:
            raise ConfigError(problem)
    return modes


def _model_ref(model: str, options: dict[str, Any], spec, graph) -> ModelRef:
    ref, digest = canonical_ref(model)
    return ModelRef(
        ref=ref,
        options=recorded_options(model, spec, options),
        fingerprint=graph.fingerprint,
        tokens_per_sample=spec.tokens_per_sample,
        file_sha256=digest,
        tracer=graph.tracer,
    )


def manual_plan(
    model: str,
    options: dict[str, Any] | None = None,
    *,
    schedule: str,
    pipeline_devices: int,
    num_microbatches: int,
    microbatch_size: int = 1,
    data_parallel: int = 1,
    replicas: Sequence[int] | None = None,
    chunks: int | None = None,
    cuts: Sequence[tuple[int, int]] | None = None,
    seed: int = 0,
    lr: float = 1e-3,
    predicted_step_ms: float = 0.0,
    tracer: str = "auto",
    precision: str = "fp32",
    zero: int = 0,
    recompute: Sequence[str] | None = None,
) -> Plan:
    """A runnable plan: `schedule` on `pipeline_devices` devices per pipeline (before replication); `recompute`
    gives each stage's activation recomputation mode (pipeplan.recompute; default none)."""
    options = dict(options or {})
    spec = load_model(model, options)
    graph = trace_model(spec, batch_size=microbatch_size, device="meta", tracer=tracer).layer_graph
    generated = generate(schedule, num_devices=pipeline_devices, num_microbatches=num_microbatches, chunks=chunks)
    num_stages = generated.num_stages
    replicas = _replicas(replicas, num_stages)
    cuts = list(cuts or even_cuts(graph.num_layers, num_stages))
    layout = pipeline_layout(generated, replicas)
    world = layout.num_devices * data_parallel
    cluster = Cluster(num_devices=world, devices_per_node=world, memory_per_device=None)  # None: no memory limit
    global_batch = microbatch_size * num_microbatches * data_parallel
    held = numerics("adamw", precision)  # the optimizer `run` steps by default
    return Plan(
        model=_model_ref(model, options, spec, graph),
        cluster=cluster,
        training=TrainingConfig(
            global_batch_size=global_batch,
            microbatch_size=microbatch_size,
            num_microbatches=num_microbatches,
            data_parallel=data_parallel,
            lr=lr,
            seed=seed,
            precision=precision,
            optimizer_bytes_per_param=bytes_per_param(held),
            dtype=held.precision.compute_dtype_name,
            zero=zero,
        ),
        schedule=schedule,
        chunks=generated.num_chunks,
        stages=_stages(graph, cuts, replicas, _recompute_modes(recompute, num_stages)),
        ranks=rank_infos(layout, data_parallel, cluster),
        rank_ops=tuple(layout.device_ops[rank % layout.num_devices] for rank in range(world)),
        predicted=Predicted(
            step_ms=predicted_step_ms,
            samples_per_s=global_batch / (predicted_step_ms / 1000.0) if predicted_step_ms > 0 else 0.0,
        ),
    )
