"""The planner as a library call: `plan(profile, cluster, config) -> Plan` — the search over tensor/context/expert
parallel sizes (`search.tensor_search`) and layouts, the chosen candidate built into a Plan; or a `--layout`-pinned
candidate alone (no search beside it: `capacity --layout` compares the two).
Commands and the Python API turn their options into these objects (`search.plan_job.prepare_plan`) and call it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeplan.artifact.plan import Plan
from pipeplan.artifact.scripts import with_profile
from pipeplan.cluster import Cluster
from pipeplan.errors import InfeasibleError
from pipeplan.profiling.profile import Profile
from pipeplan.search.config import SearchConfig
from pipeplan.search.emit import build_plan
from pipeplan.search.inputs import PlanInput, graph_at_microbatch, profile_input
from pipeplan.search.pinned import PinnedLayout, evaluate_pinned
from pipeplan.search.search import SearchResult
from pipeplan.search.tensor_search import (
    chosen_try,
    search_tensor_parallel,
    tensor_parallel_reason,
    tensor_parallel_sizes,
)


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """What to plan: the search's training-side inputs (`search`), the schedules it may use (None: every synchronous
    one), the tensor / context / expert parallel sizes to try (auto or one each: `search.tensor_search`), and a layout
    to plan exactly (None: the search's choice)."""

    search: SearchConfig
    schedules: tuple[str, ...] | None = None
    tensor_parallel: str | int = "auto"
    context_parallel: str | int = 1
    expert_parallel: str | int = "auto"
    layout: PinnedLayout | None = None


def plan(
    source: Profile | PlanInput,
    cluster: Cluster,
    config: PlanConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> Plan:
    """The plan for `source` (a profile; with its model's graph, a runnable plan) on `cluster`: the search's choice
    over every tensor-parallel size tried, or `config.layout` alone (pinned: no search beside it)."""
    source = source if isinstance(source, PlanInput) else profile_input(source)
    profile = source.profile
    if config.layout is not None:  # the pinned layout alone (`capacity --layout` sets the search's choice beside it)
        result, why = _pinned_result(profile, cluster, config)
    else:
        sizes = tensor_parallel_sizes(
            config.tensor_parallel, profile, cluster, config.context_parallel, config.expert_parallel
        )
        tries = search_tensor_parallel(profile, cluster, config.search, sizes, config.schedules, progress=progress)
        found = chosen_try(tries).result
        assert found is not None, "search_tensor_parallel raises when no size gives a plan"
        result, why = found, tensor_parallel_reason(tries, lambda r: f"{r.best.samples_per_s:,.2f} samples/s")
    source = graph_at_microbatch(source, result.best.layout.microbatch_size)
    chosen = build_plan(result, model=source.model, layer_graph=source.layer_graph, tensor_parallel_reason=why)
    return with_profile(chosen, profile)  # the profile it was made from (`refine` starts from it)


def _pinned_result(profile: Profile, cluster: Cluster, config: PlanConfig) -> tuple[SearchResult, str]:
    """The pinned layout as a one-candidate result, and the sentence that says it was pinned. The free search is
    not run beside it (minutes at 100B+ scale): `pipeplan capacity ... --layout` compares the two."""
    assert config.layout is not None
    found = evaluate_pinned(profile, cluster, config.search, config.layout)
    if found.evaluation is None:
        assert found.rejection is not None
        raise InfeasibleError(f"--layout {config.layout.label}: {found.rejection.reason}")
    why = (
        f"Layout pinned by --layout ({config.layout.label}); the search's own choice was not run beside it "
        "(`pipeplan capacity` with the same --layout compares the two)."
    )
    return found.as_search_result(config.search), why
