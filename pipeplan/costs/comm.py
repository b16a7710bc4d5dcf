"""Communication costs in milliseconds, the partitioner's and planner's unit. The link formulas themselves
(latency + bytes / bandwidth, ring collectives) live once in `pipeplan.cluster.Link`; these convert
their seconds, element for element, so a DP column and a single boundary get the same numbers.

PipeDream's cost model (`cost_model='pipedream'`, optimizer_graph_hierarchical.py of PipeDream, SOSP'19, with
activation_compression_ratio=1) has its own terms, without latency: a cut is sent twice (activations forward,
gradients backward) and a stage replicated r times synchronizes its weights with 4 (r-1) / r x bytes."""

from __future__ import annotations

from pipeplan.cluster import Link

MS_PER_S = 1e3


def transfer_ms(num_bytes, link: Link):
    """One cut's bytes sent point-to-point over `link` (per boundary, one way)."""
    return link.transfer_s(num_bytes) * MS_PER_S


def allreduce_ms(num_bytes, group_size, link: Link):
    """Ring all-reduce of `num_bytes` (e.g. a stage's gradients) over `group_size` devices."""
    return link.allreduce_s(num_bytes, group_size) * MS_PER_S


def reduce_scatter_ms(num_bytes, group_size, link: Link):
    """Ring reduce-scatter of `num_bytes` over `group_size` devices (each keeps its reduced 1/n)."""
    return link.reduce_scatter_s(num_bytes, group_size) * MS_PER_S


def all_gather_ms(num_bytes, group_size, link: Link):
    """Ring all-gather of `num_bytes` in total over `group_size` devices (each contributes 1/n)."""
    return link.all_gather_s(num_bytes, group_size) * MS_PER_S


def all_to_all_ms(num_bytes, group_size, link: Link):
    """All-to-all of `num_bytes` per device over `group_size` devices (`Link.all_to_all_s`)."""
    return link.all_to_all_s(num_bytes, group_size) * MS_PER_S


def pipedream_transfer_ms(cut_bytes, replicas, bandwidth: float):
    """PipeDream's transfer term of a cut feeding r replicas: 2 x bytes / (bandwidth x r)."""
    return 2 * cut_bytes / (bandwidth * replicas) * MS_PER_S


def pipedream_sync_ms(param_bytes, replicas, bandwidth: float):
    """PipeDream's weight-synchronization term of a stage replicated r times: 4 (r-1) x bytes / (bandwidth x r)."""
    return 4 * (replicas - 1) * param_bytes / (bandwidth * replicas) * MS_PER_S


def zero1_exchange_ms(grad_bytes, param_bytes, group_size, link: Link):
    """ZeRO-1's exchange per step in place of the gradient all-reduce: a ring reduce-scatter of the gradients and,
    after the optimizer step, a ring all-gather of the updated parameters. With equal bytes it moves what the ring
    all-reduce does (Rajbhandari et al. 2020, section 7.2.1), the all-gather after the optimizer step."""
    return (link.reduce_scatter_s(grad_bytes, group_size) + link.all_gather_s(param_bytes, group_size)) * MS_PER_S


def gradient_sync_ms(grad_bytes, param_bytes, group_size, link: Link, zero: int):
    """A stage's gradient synchronization per step over the `group_size` devices holding it: the ring all-reduce
    of its gradients, or with ZeRO-1 (`zero` 1) `zero1_exchange_ms`."""
    if zero:
        return zero1_exchange_ms(grad_bytes, param_bytes, group_size, link)
    return allreduce_ms(grad_bytes, group_size, link)
