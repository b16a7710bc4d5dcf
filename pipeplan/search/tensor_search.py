"""The outer tensor-parallel loop: the pipeline search (`search_plans`) once per tensor-parallel size t, the choice
between them and why — `search_tensor_parallel(profile, cluster, config, sizes)`.

Sizes (`tensor_parallel_sizes`): `auto` tries t in TENSOR_PARALLEL_SIZES that divide the devices per node and the
device count, for analytic profiles only (a measured profile plans t = 1: the runtime measured and runs whole
layers); a t the model cannot take (heads, hidden size or sequence not divisible, not a transformer stack) is
recorded with its reason and not searched. A given N is checked and refused with one line.

Choice: the fastest predicted step over all t; sizes within the search's PREDICTION_MARGIN of it are ties, and the
smallest such t wins (fewer devices per group, less communication; t = 1 stays runnable by `pipeplan run`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from pipeplan.cluster import Cluster
from pipeplan.errors import ConfigError, InfeasibleError
from pipeplan.profiling.profile import Profile
from pipeplan.search.config import PREDICTION_MARGIN, SearchConfig
from pipeplan.search.search import Progress, SearchResult, search_plans
from pipeplan.search.tensor_parallel import (
    TENSOR_PARALLEL_SIZES,
    check_tensor_parallel,
    stack_problem,
    tensor_parallel_problem,
)

AUTO = "auto"


@dataclass(frozen=True, kw_only=True)
class TensorParallelTry:
    """One size: its search result, or why it gave none: not applicable to the cluster or model (not searched),
    or the search's InfeasibleError."""

    tensor_parallel: int
    result: SearchResult | None = None
    reason: str = ""
    searched: bool = False

    @property
    def step_ms(self) -> float:
        return self.result.best.step_ms if self.result is not None else float("inf")


def parse_tensor_parallel(text: str | int | None) -> str | int:
    """`auto` or a size >= 1 (--tensor-parallel)."""
    if text is None or str(text).strip().lower() == AUTO:
        return AUTO
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"--tensor-parallel must be auto or a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise ConfigError(f"--tensor-parallel must be >= 1, got {value}")
    return value


def tensor_parallel_sizes(request: str | int, profile: Profile, cluster: Cluster) -> tuple[TensorParallelTry, ...]:
    """The sizes to search (tries without a result yet), and the sizes `auto` leaves out with their reasons."""
    request = parse_tensor_parallel(request)
    if request != AUTO:
        t = int(request)
        if t > 1 and profile.provenance.source != "analytic":
            raise ConfigError(
                f"--tensor-parallel {t} plans analytically: give an analytic profile (--device meta --hardware NAME); "
                f"this one is {profile.provenance.source}"
            )
        check_tensor_parallel(profile, t, devices_per_node=cluster.devices_per_node, num_devices=cluster.num_devices)
        return (TensorParallelTry(tensor_parallel=t),)
    if profile.provenance.source != "analytic":
        return (TensorParallelTry(tensor_parallel=1),)
    tries = []
    for t in TENSOR_PARALLEL_SIZES:
        if cluster.devices_per_node % t or cluster.num_devices % t:
            continue  # the cluster's shape: not worth a word
        problem = tensor_parallel_problem(
            profile, t, devices_per_node=cluster.devices_per_node, num_devices=cluster.num_devices
        )
        if problem is None and t > 1:
            problem = stack_problem(profile)
        tries.append(TensorParallelTry(tensor_parallel=t, reason=problem or ""))
    return tuple(tries)


def search_tensor_parallel(
    profile: Profile,
    cluster: Cluster,
    config: SearchConfig,
    sizes: tuple[TensorParallelTry, ...],
    schedules: tuple[str, ...] | list[str] | None = None,
    *,
    progress: Progress | None = None,
) -> tuple[TensorParallelTry, ...]:
    """`search_plans` for every size without a reason; InfeasibleError when none gives a plan (the message of the
    largest size searched, which has the most memory per device)."""
    done: list[TensorParallelTry] = []
    for item in sizes:
        if item.reason:
            done.append(item)
            continue
        try:
            result = search_plans(
                profile, cluster, replace(config, tensor_parallel=item.tensor_parallel), schedules, progress=progress
            )
            done.append(replace(item, result=result, searched=True))
        except InfeasibleError as exc:
            done.append(replace(item, reason=str(exc), searched=True))
    if not any(item.result is not None for item in done):
        searched = [item for item in done if item.searched]
        raise InfeasibleError(searched[-1].reason)
    return tuple(done)


def chosen_try(tries: tuple[TensorParallelTry, ...]) -> TensorParallelTry:
    """The smallest t within PREDICTION_MARGIN of the fastest step (see the module docstring)."""
    fastest = min(item.step_ms for item in tries)
    return min(
        (item for item in tries if item.step_ms <= fastest * (1.0 + PREDICTION_MARGIN)),
        key=lambda item: item.tensor_parallel,
    )


def tensor_parallel_reason(tries: tuple[TensorParallelTry, ...], score: Callable[[SearchResult], str]) -> str:
    """Why the chosen t, one sentence, e.g. `t=8: MFU 41% vs MFU 33% at t=4; t=1, t=2: no plan fits in memory`
    (the other sizes fastest first); `score` words a result (its throughput or MFU). Empty when only one size was
    tried."""
    if len(tries) < 2:
        return ""
    chosen = chosen_try(tries)
    others = sorted((item for item in tries if item.result is not None and item is not chosen), key=lambda i: i.step_ms)
    head = f"t={chosen.tensor_parallel}: {score(chosen.result)}"
    if others:
        runner = others[0]
        tie = (
            runner.step_ms <= chosen.step_ms * (1.0 + PREDICTION_MARGIN)
            and runner.tensor_parallel > chosen.tensor_parallel
        )
        note = " (within the prediction margin: the smaller t is preferred)" if tie else ""
        compared = [f"{score(item.result)} at t={item.tensor_parallel}" for item in others]
        head += f" vs {compared[0]}{note}" + "".join(f", {text}" for text in compared[1:])
    failed = [item for item in tries if item.result is None]
    memory = [item for item in failed if item.searched and "memory" in item.reason]
    parts = [head]
    if memory:
        parts.append(f"{', '.join(f't={i.tensor_parallel}' for i in memory)}: no plan fits in memory")
    grouped: dict[str, list[int]] = {}  # the same reason for several sizes is said once
    for item in failed:
        if item not in memory:
            grouped.setdefault(item.reason.removeprefix(f"t={item.tensor_parallel} "), []).append(item.tensor_parallel)
    parts += [f"{', '.join(f't={t}' for t in sizes)}: {reason}" for reason, sizes in grouped.items()]
    return "; ".join(parts)
