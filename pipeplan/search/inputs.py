"""What `pipeplan plan` searches over, from its options: the cluster (with machine defaults), the microbatch size
candidates, and the profile (a file, or the model profiled on the spot)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pipeplan.artifact.plan import ModelRef
from pipeplan.artifact.scripts import PLAN_DIR_FILES
from pipeplan.cluster import CPU_DEFAULT_DEVICES, Cluster
from pipeplan.errors import ConfigError
from pipeplan.hardware import Hardware, cluster_for
from pipeplan.paths import check_output_dir
from pipeplan.precision import profile_precision
from pipeplan.profiling.consistency import warn_if_out_of_bounds
from pipeplan.profiling.profile import Profile
from pipeplan.profiling.profile_job import ProfileRequest, profile_request
from pipeplan.units import parse_int_list

if TYPE_CHECKING:
    from pipeplan.graph.trace import LayerGraph


def default_devices() -> int:
    """The local GPU count on a GPU machine, else 2 CPU processes."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else CPU_DEFAULT_DEVICES


def default_memory_per_device(devices_per_node: int) -> int:
    """The first GPU's memory, else this machine's RAM shared by the processes of one node."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // devices_per_node


def parse_devices(text: str | None) -> tuple[int | None, int | None]:
    """`--devices`: (devices, devices per node) from `16` or `2x8` (nodes x devices per node); None: the defaults."""
    if text is None:
        return None, None
    nodes, sep, per_node = str(text).strip().lower().partition("x")
    try:
        counts = (int(nodes), int(per_node)) if sep else (int(nodes), None)
    except ValueError:
        raise ConfigError(f"--devices must be a count or NODESxPER_NODE like 2x8, got {text!r}") from None
    if min(c for c in counts if c is not None) < 1:
        raise ConfigError(f"--devices must be >= 1, got {text!r}")
    return (counts[0] * counts[1], counts[1]) if counts[1] is not None else counts


def make_cluster(*, devices: str | None, memory: int | None, hardware: Hardware | None) -> Cluster:
    """Cluster from the CLI options: `--devices` (N or NxP; default: local GPUs, min(N, 8) per node), a --hardware
    preset's links and memory, `--memory`'s size over both (default without --hardware: this machine's RAM)."""
    count, per_node = parse_devices(devices)
    num_devices = default_devices() if count is None else count
    per_node = per_node if per_node is not None else min(num_devices, 8)
    if hardware is not None:
        if memory is not None:
            hardware = replace(hardware, memory_bytes=memory)
        return cluster_for(hardware, num_devices, per_node)
    physical = memory if memory is not None else default_memory_per_device(per_node)
    return Cluster(num_devices=num_devices, devices_per_node=per_node, memory_per_device=physical)


def microbatch_candidates(text: str | None, default: int) -> tuple[int, ...]:
    """`"2"` or `"1,2,4"`; by default only `default`, the batch size the profile is (or will be) measured at:
    linear scaling cannot show a bigger microbatch's better device efficiency, so searching sizes is opt-in."""
    if text is None:
        return (default,)
    return parse_int_list(text, option="--microbatch-size", example="1,2,4")


def check_plan_options(*, output: str | os.PathLike | None, granularity: int | None = None) -> None:
    """Options `pipeplan plan` can check before it profiles anything (profiling may take minutes)."""
    if granularity is not None and granularity < 1:
        raise ConfigError(f"--granularity must be >= 1 (module depth), got {granularity}")
    if output is not None:  # None: the Python API's plan(), which writes no directory unless asked
        check_output_dir(output, "--output", files=PLAN_DIR_FILES)


@dataclass(frozen=True, kw_only=True)
class PlanInput:
    """The profile to plan from, what to record as the model, and its layers' FX nodes (None: not runnable)."""

    profile: Profile
    model: ModelRef
    layer_graph: LayerGraph | None


def load_profile_input(path: str) -> PlanInput:
    """A profile file: pipeplan's JSON, or a PipeDream graph.txt (told apart by its first character)."""
    if _first_character(path) == "{":
        profile = Profile.load(path)
        warn_if_out_of_bounds(profile, f"profile file {str(path)!r}")  # the profiler's warning again
        return profile_input(profile, where=str(path))
    from pipeplan.profiling.pipedream import read_pipedream_graph

    return profile_input(read_pipedream_graph(path), where=str(path))


def _first_character(path: str) -> str:
    """The file's first non-blank character ("{" when unreadable: `Profile.load` then says why in one line)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(4096).lstrip()[:1]
    except OSError:
        return "{"


def profile_input(profile: Profile, *, where: str = "(a Profile object)") -> PlanInput:
    """A profile to plan from without a model graph (the plan is not runnable); `where` names it when the profile
    names no model."""
    prov = profile.provenance
    model = ModelRef(
        ref=prov.model or where,
        options=dict(prov.model_options),
        fingerprint=prov.graph_fingerprint,
        tokens_per_sample=prov.tokens_per_sample,
        tracer=prov.tracer,
    )
    return PlanInput(profile=profile, model=model, layer_graph=None)


def check_profile_precision(profile: Profile, precision: str | None) -> str:
    """The precision to plan for: the profile's; a different --precision is refused (its costs are not those)."""
    found = profile_precision(profile.provenance)
    if precision is not None and precision != found:
        raise ConfigError(
            f"--precision {precision} but the profile was made for {found}; profile again with --precision "
            f"{precision} or drop --precision"
        )
    return found


def profile_model_input(request: ProfileRequest) -> PlanInput:
    """Profile the model on the spot (`profiling.profile_job`, the path `pipeplan profile` takes) and trace its
    graph on the meta device: the plan names each stage's FX nodes."""
    from pipeplan.graph.run_dtypes import export_dtype
    from pipeplan.graph.trace import trace_model
    from pipeplan.models.registry import canonical_ref, recorded_options

    profile, spec = profile_request(request)
    tracer = profile.provenance.tracer or request.tracer
    traced = trace_model(
        spec,
        batch_size=request.batch_size,
        granularity=request.granularity,
        device="meta",
        tracer=tracer,
        dtype=export_dtype(request.precision),
    )
    profile = selective_where_runnable(profile, traced)
    ref, digest = canonical_ref(request.model)
    model = ModelRef(
        ref=ref,
        file_sha256=digest,
        options=recorded_options(request.model, spec, request.options),
        fingerprint=traced.layer_graph.fingerprint,
        granularity=request.granularity,
        tokens_per_sample=spec.tokens_per_sample,
        tracer=traced.tracer,
    )
    return PlanInput(profile=profile, model=model, layer_graph=traced.layer_graph)


def selective_where_runnable(profile: Profile, traced) -> Profile:
    """`profile` with selective recomputation data only on layers that call scaled_dot_product_attention: the
    runtime recomputes only those calls (runtime/step/recompute_run.py), so elsewhere selective keeps what none keeps
    and the planner never offers it (a hand-written attention's internals stay saved)."""
    from pipeplan.graph.recompute_modes import is_attention

    targets = {node.name: node.target for node in traced.graph_module.graph.nodes if node.op == "call_function"}
    layers = tuple(
        layer
        if any(is_attention(targets.get(name)) for name in graph_layer.nodes)
        else replace(layer, selective_activation_bytes=layer.activation_bytes, selective_recompute_ms=0.0)
        for layer, graph_layer in zip(profile.layers, traced.layer_graph.layers, strict=True)
    )
    return profile if layers == profile.layers else replace(profile, layers=layers)


def attach_model(
    source: PlanInput, model: str, options: dict[str, str], granularity: int | None, tracer: str = "auto"
) -> PlanInput:
    """A profile file's costs with MODEL's traced graph (stage node names): the plan becomes runnable. The
    profile must have been made from the same graph (layer names, and its fingerprint when it records one)."""
    from pipeplan.graph.run_dtypes import export_dtype
    from pipeplan.graph.trace import trace_model
    from pipeplan.models import load_model
    from pipeplan.models.registry import canonical_ref, recorded_options

    spec = load_model(model, options)
    prov = source.profile.provenance
    if tracer == "auto" and prov.tracer:
        tracer = prov.tracer
    dtype = export_dtype(profile_precision(prov))
    traced = trace_model(
        spec, batch_size=prov.batch_size, granularity=granularity, device="meta", tracer=tracer, dtype=dtype
    )
    graph = traced.layer_graph
    recorded = prov.graph_fingerprint
    names = [layer.name for layer in source.profile.layers]
    if (recorded and recorded != graph.fingerprint) or names != [layer.name for layer in graph.layers]:
        raise ConfigError(
            f"--profile was made from another graph than MODEL {model!r} with these options; profile this model "
            "again (same -a options, --granularity and --tracer) or drop MODEL"
        )
    canonical, digest = canonical_ref(model)
    ref = ModelRef(
        ref=canonical,
        file_sha256=digest,
        options=recorded_options(model, spec, options),
        fingerprint=graph.fingerprint,
        granularity=granularity,
        tokens_per_sample=spec.tokens_per_sample,
        tracer=graph.tracer,
    )
    return PlanInput(profile=selective_where_runnable(source.profile, traced), model=ref, layer_graph=graph)


def graph_at_microbatch(source: PlanInput, microbatch_size: int) -> PlanInput:
    """torch.export specializes shapes to the batch size, so an exported graph's nodes (and fingerprint) are those
    of the batch size it runs at: trace it again at the chosen microbatch size, as the runtime will (unless the
    graph was traced at it: `profile_model_input` and `attach_model` trace at the profile's batch size)."""
    if source.layer_graph is None or source.layer_graph.tracer != "export":
        return source
    if microbatch_size == source.profile.provenance.batch_size:
        return source
    from pipeplan.graph.run_dtypes import export_dtype
    from pipeplan.graph.trace import trace_model
    from pipeplan.models import load_model

    model = source.model
    spec = load_model(model.ref, dict(model.options))
    dtype = export_dtype(profile_precision(source.profile.provenance))
    graph = trace_model(
        spec, batch_size=microbatch_size, granularity=model.granularity, device="meta", tracer="export", dtype=dtype
    ).layer_graph
    if [layer.name for layer in graph.layers] != [layer.name for layer in source.layer_graph.layers]:
        raise ConfigError(
            f"model {model.ref!r} exports to other layers at microbatch size {microbatch_size}; give "
            f"--microbatch-size {microbatch_size} and profile at that batch size"
        )
    return replace(source, model=replace(model, fingerprint=graph.fingerprint), layer_graph=graph)
