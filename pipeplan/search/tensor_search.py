"""The outer loop over how a group of devices splits each layer: the pipeline search (`search_plans`) once per
tensor-parallel size t and context-parallel size cp, the choice between them and why —
`search_tensor_parallel(profile, cluster, config, tries)`.

Sizes (`tensor_parallel_sizes`): `auto` tries t in TENSOR_PARALLEL_SIZES dividing the devices per node and the
device count, and cp in CONTEXT_PARALLEL_SIZES, for analytic profiles only (a measured profile plans t = cp = 1:
the runtime measured and runs whole layers); a size the model or cluster cannot take (heads, hidden size or
sequence not divisible, not a transformer stack, groups that do not tile nodes) is recorded with its reason and
not searched. A given size is checked and refused with one line.

Choice: the fastest predicted step over all (t, cp); sizes within the search's PREDICTION_MARGIN of it are ties,
and the smallest group wins (fewer devices per group, less communication; then the smaller cp; t = cp = 1 stays
runnable by `pipeplan run`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from pipeplan.cluster import Cluster
from pipeplan.errors import ConfigError, InfeasibleError
from pipeplan.profiling.experts import is_moe
from pipeplan.profiling.profile import Profile
from pipeplan.search.config import PREDICTION_MARGIN, SearchConfig
from pipeplan.search.search import Progress, SearchResult, search_plans
from pipeplan.search.stack import (
    CONTEXT_PARALLEL_SIZES,
    EXPERT_PARALLEL_SIZES,
    TENSOR_PARALLEL_SIZES,
    check_split,
    context_parallel_problem,
    expert_parallel_problem,
    stack_problem,
    tensor_parallel_problem,
)

AUTO = "auto"


@dataclass(frozen=True, kw_only=True)
class TensorParallelTry:
    """One (t, cp): its search result, or why it gave none: not applicable to the cluster or model (not
    searched), or the search's InfeasibleError."""

    tensor_parallel: int
    context_parallel: int = 1
    expert_parallel: int = 1
    result: SearchResult | None = None
    reason: str = ""
    searched: bool = False

    @property
    def step_ms(self) -> float:
        return self.result.best.step_ms if self.result is not None else float("inf")

    @property
    def label(self) -> str:
        label = f"t={self.tensor_parallel}" + (f" cp={self.context_parallel}" if self.context_parallel > 1 else "")
        return label + (f" ep={self.expert_parallel}" if self.expert_parallel > 1 else "")


def parse_tensor_parallel(text: str | int | None, *, option: str = "--parallel tp") -> str | int:
    """`auto` or a size >= 1 (`--parallel` tp, cp, ep)."""
    if text is None or str(text).strip().lower() == AUTO:
        return AUTO
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"{option} must be auto or a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise ConfigError(f"{option} must be >= 1, got {value}")
    return value


def tensor_parallel_sizes(
    request: str | int, profile: Profile, cluster: Cluster, context: str | int = 1, expert: str | int = 1
) -> tuple[TensorParallelTry, ...]:
    """The (t, cp) to search (tries without a result yet), and those `auto` leaves out with their reasons."""
    request = parse_tensor_parallel(request)
    context = parse_tensor_parallel(context, option="--parallel cp")
    expert = parse_tensor_parallel(expert, option="--parallel ep")
    analytic = profile.provenance.source == "analytic"
    for value, option in ((request, "--parallel tp"), (context, "--parallel cp")):
        if isinstance(value, int) and value > 1 and not analytic:
            raise ConfigError(
                f"{option}={value} plans analytically: give an analytic profile (--device meta --hardware NAME); "
                f"this one is {profile.provenance.source}"
            )
    ts = _sizes(request, TENSOR_PARALLEL_SIZES if analytic else (1,))
    cps = _sizes(context, CONTEXT_PARALLEL_SIZES if analytic else (1,))
    given = request != AUTO and context != AUTO
    if given:
        check_split(profile, ts[0], cps[0], devices_per_node=cluster.devices_per_node, num_devices=cluster.num_devices)
    elif request != AUTO:  # a given t is refused in one line even while cp is searched
        check_split(profile, ts[0], 1, devices_per_node=cluster.devices_per_node, num_devices=cluster.num_devices)
    tries = []
    for t in ts:
        if request == AUTO and (cluster.devices_per_node % t or cluster.num_devices % t):
            continue  # the cluster's shape: not worth a word
        for cp in cps:
            if context == AUTO and cluster.num_devices % (t * cp):
                continue
            problem = None if given else _problem(profile, t, cp, cluster)
            for ep in _expert_sizes(expert, profile, cluster, t, cp, given=given):
                tries.append(
                    TensorParallelTry(tensor_parallel=t, context_parallel=cp, expert_parallel=ep, reason=problem or "")
                )
    return tuple(tries)


def _expert_sizes(
    expert: str | int, profile: Profile, cluster: Cluster, t: int, cp: int, *, given: bool = True
) -> tuple[int, ...]:
    """The ep to try beside (t, cp): a given one (checked: one line when it cannot split this model, or the devices
    with the given t and cp; a (t, cp) that `auto` tries and the given ep does not fit is left out), or with `auto`
    those of EXPERT_PARALLEL_SIZES that split a mixture-of-experts model's experts and the devices (1 for a dense
    model)."""
    if expert != AUTO:
        n = cluster.num_devices
        problem = expert_parallel_problem(profile, t if given else 1, cp if given else 1, int(expert), num_devices=n)
        if problem is not None:
            raise ConfigError(f"--parallel ep={expert}: {problem}")
        return () if expert_parallel_problem(profile, t, cp, int(expert), num_devices=n) else (int(expert),)
    if not is_moe(profile) or profile.provenance.source != "analytic":
        return (1,)
    n = cluster.num_devices
    return tuple(ep for ep in EXPERT_PARALLEL_SIZES if not expert_parallel_problem(profile, t, cp, ep, num_devices=n))


def _sizes(request: str | int, auto: tuple[int, ...]) -> tuple[int, ...]:
    return auto if request == AUTO else (int(request),)


def _problem(profile: Profile, t: int, cp: int, cluster: Cluster) -> str | None:
    per_node, devices = cluster.devices_per_node, cluster.num_devices
    problem = tensor_parallel_problem(profile, t, devices_per_node=per_node, num_devices=devices)
    problem = problem or context_parallel_problem(profile, t, cp, devices_per_node=per_node, num_devices=devices)
    if problem is None and t * cp > 1:
        problem = stack_problem(profile)
    return problem


def search_tensor_parallel(
    profile: Profile,
    cluster: Cluster,
    config: SearchConfig,
    sizes: tuple[TensorParallelTry, ...],
    schedules: tuple[str, ...] | list[str] | None = None,
    *,
    progress: Progress | None = None,
) -> tuple[TensorParallelTry, ...]:
    """`search_plans` for every (t, cp) without a reason; InfeasibleError when none gives a plan (the message of the
    largest group searched, which has the most memory per device)."""
    done: list[TensorParallelTry] = []
    for item in sizes:
        if item.reason:
            done.append(item)
            continue
        pruned = dominated_reason(profile, cluster, config, item, done)
        if pruned:
            done.append(replace(item, reason=pruned))
            continue
        split = replace(
            config,
            tensor_parallel=item.tensor_parallel,
            context_parallel=item.context_parallel,
            expert_parallel=item.expert_parallel,
        )
        try:
            result = search_plans(profile, cluster, split, schedules, progress=progress)
            done.append(replace(item, result=result, searched=True))
        except InfeasibleError as exc:
            done.append(replace(item, reason=str(exc), searched=True))
    if not any(item.result is not None for item in done):
        searched = sorted((item for item in done if item.searched), key=_group_key)
        if not searched:  # every (t, cp, ep) asked for was refused before searching (e.g. cp not dividing devices)
            raise InfeasibleError(next((item.reason for item in done if item.reason), "no layout to search"))
        raise InfeasibleError(searched[-1].reason)
    return tuple(done)


def compute_floor_ms(profile: Profile, cluster: Cluster, config: SearchConfig, item: TensorParallelTry) -> float:
    """A lower bound on any plan's step with `item`'s (t, cp, ep): each device's share of the global batch's compute
    (F + the cheaper of B and I + W per layer, on one rank's split profile at the microbatch size doing a sample
    fastest). Every schedule, replication, recomputation and communication only adds to the busiest device's ops,
    which the step is at least."""
    from pipeplan.search.scaling import scale_profile
    from pipeplan.search.sharding import split_inputs

    t, cp, ep = item.tensor_parallel, item.context_parallel, item.expert_parallel
    per_sample = math.inf
    for b in config.microbatch_sizes:
        rank = split_inputs(scale_profile(profile, b), cluster, t, cp, overlap=config.overlap, ep=ep)[0]
        work = sum(la.forward_ms + min(la.backward_ms, la.input_grad_ms + la.weight_grad_ms) for la in rank.layers)
        per_sample = min(per_sample, work / b)
    return per_sample * config.global_batch_size * t * cp / cluster.num_devices


def dominated_reason(
    profile: Profile, cluster: Cluster, config: SearchConfig, item: TensorParallelTry, done: list[TensorParallelTry]
) -> str:
    """Why an expert-parallel `item` (ep > 1) need not be searched: its `compute_floor_ms` is over the fastest step
    found so far by more than PREDICTION_MARGIN, so it can be neither the fastest nor within the margin of it (the
    choice, `chosen_try`, is the same with or without it); "" otherwise (ep = 1 tries are always searched)."""
    found = [d.step_ms for d in done if d.result is not None]
    if item.expert_parallel == 1 or not found:
        return ""
    floor = compute_floor_ms(profile, cluster, config, item)
    best = min(found)
    if floor <= best * (1.0 + PREDICTION_MARGIN):
        return ""
    return f"not searched: its compute alone is at least {floor:,.1f} ms/step, over the fastest found ({best:,.1f})"


def _group_key(item: TensorParallelTry) -> tuple[int, int, int]:
    return item.tensor_parallel * item.context_parallel, item.context_parallel, item.expert_parallel


def chosen_try(tries: tuple[TensorParallelTry, ...]) -> TensorParallelTry:
    """The smallest group within PREDICTION_MARGIN of the fastest step (see the module docstring)."""
    fastest = min(item.step_ms for item in tries)
    return min((item for item in tries if item.step_ms <= fastest * (1.0 + PREDICTION_MARGIN)), key=_group_key)


def tensor_parallel_reason(tries: tuple[TensorParallelTry, ...], score: Callable[[SearchResult], str]) -> str:
    """Why the chosen (t, cp), one sentence, e.g. `t=8: MFU 41% vs MFU 33% at t=4; t=1, t=2: no plan fits in
    memory` (the others fastest first); `score` words a result (its throughput or MFU). Empty when only one size
    was tried."""
    if len(tries) < 2:
        return ""
    chosen = chosen_try(tries)
    if chosen.result is None:  # no size gave a plan: nothing was chosen
        return ""
    others = sorted((item for item in tries if item.result is not None and item is not chosen), key=lambda i: i.step_ms)
    head = f"{chosen.label}: {score(chosen.result)}"
    if others:
        runner = others[0]
        tie = runner.step_ms <= chosen.step_ms * (1.0 + PREDICTION_MARGIN) and _group_key(runner) > _group_key(chosen)
        note = " (within the prediction margin: the smaller group is preferred)" if tie else ""
        compared = [f"{score(item.result)} at {item.label}" for item in others if item.result is not None]
        head += f" vs {compared[0]}{note}" + "".join(f", {text}" for text in compared[1:])
    failed = [item for item in tries if item.result is None]
    memory = [item for item in failed if item.searched and "memory" in item.reason]
    parts = [head]
    if memory:
        parts.append(f"{', '.join(i.label for i in memory)}: no plan fits in memory")
    grouped: dict[str, list[str]] = {}  # the same reason for several sizes is said once
    for item in failed:
        if item not in memory:
            reason = item.reason.removeprefix(f"t={item.tensor_parallel} ").removeprefix(f"cp={item.context_parallel} ")
            grouped.setdefault(reason, []).append(item.label)
    parts += [f"{', '.join(labels)}: {reason}" for reason, labels in grouped.items()]
    return "; ".join(parts)
