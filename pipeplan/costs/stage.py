"""Stage time: what one stage (a contiguous range of layers, r replicas) costs per microbatch, and the step terms
built from per-stage figures. Milliseconds per microbatch of the profile's batch, so the DP objective is the
steady-state time between successive microbatches leaving the pipeline (its inverse is the throughput).

`pipeplan` (default), stage [a..b] with r replicas, M microbatches per step:
    compute = F + B (F + I + W for schedules that split the backward), summed over the layers
    time    = max(compute / r + allreduce(params, r) / M,  (transfer(in cut) + transfer(out cut)) / r)
where transfer = latency + bytes / bandwidth of the link the cut crosses (inside or across nodes), counted once per
direction (activations forward, gradients backward on a full-duplex link), and the ring all-reduce of the stage's
parameter gradients over its r replicas runs once per step (amortized over the M microbatches). The cut before the
first layer and after the last carry nothing.

`pipedream`: PipeDream's optimizer (optimizer_graph_hierarchical.py, one level, activation_compression_ratio=1):
    time = max((compute + 4 (r-1) params / (bandwidth r)) / r,  2 in_cut / (bandwidth r),  2 out_cut / (bandwidth r))
with compute = F + B and no latency; as in PipeDream, the first stage is charged no communication at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeplan.cluster import Link
from pipeplan.costs.arrays import LayerArrays
from pipeplan.costs.comm import allreduce_ms, pipedream_sync_ms, pipedream_transfer_ms, transfer_ms
from pipeplan.costs.options import CostOptions
from pipeplan.costs.recompute import stage_recompute_ms


def compute_ms(forward, input_grad, weight_grad, backward, *, split_backward: bool):
    """One microbatch's compute on one device: F + I + W when the schedule runs I and W as separate ops, else
    F + B (elementwise over arrays). With recomputation, I and B are `backward_op_ms`'s."""
    return forward + (input_grad + weight_grad if split_backward else backward)


def backward_op_ms(input_grad_or_backward, recompute_ms):
    """An I (or B) op's time with recomputation: the backward plus the recomputation that runs right before it
    (`costs.recompute.stage_recompute_ms`; elementwise). The partitioner's stage times, the planner's op times
    and so `simulate`, `show` and `run`'s prediction all take I and B from here."""
    return input_grad_or_backward + recompute_ms


def stage_grad_ms(arrays: LayerArrays, first: int, last: int, recompute_ms: float) -> tuple[float, float]:
    """A stage's I and W op times per microbatch, I with its recomputation (`backward_op_ms`). The model's first
    stage has no input gradient to compute (its inputs are the model's own): at run time its I only recomputes and
    W runs the whole backward in one pass (graph/split_backward.py: every output is weight side), so I = the
    recomputation and W = its layers' fused backward B (not their I + W: two passes per layer as profiled)."""
    if arrays.first_in_model(first, last):
        return float(backward_op_ms(0.0, recompute_ms)), float(arrays.span("backward", first, last))
    input_grad = float(arrays.span("input_grad", first, last))
    return float(backward_op_ms(input_grad, recompute_ms)), float(arrays.span("weight_grad", first, last))


@dataclass(frozen=True)
class StageOpMs:
    """One stage's op times per microbatch on one device (`stage_op_ms`): F, I and W (as `stage_grad_ms` splits
    them), B, and what recomputation adds to I and B."""

    forward: float
    input_grad: float
    weight_grad: float
    backward: float
    recompute: float


def stage_op_ms(arrays: LayerArrays, first: int, last: int, recompute: str) -> StageOpMs:
    """The op times of stage [first..last] under recomputation mode `recompute`: what the partitioner gives each
    stage, the plan stores and `refine` times again from a refined profile. Each op (F, I, W, B) also costs
    `arrays.op_ms` once (a refined profile's per-op term: what an op costs beyond its layers' work, whatever layers
    the stage groups); recomputation runs inside I or B and adds none."""
    added = float(stage_recompute_ms(arrays, recompute, first, last))
    input_grad, weight_grad = stage_grad_ms(arrays, first, last, added)
    per_op = arrays.op_ms
    return StageOpMs(
        forward=float(arrays.span("forward", first, last)) + per_op,
        input_grad=input_grad + per_op,
        weight_grad=weight_grad + per_op,
        backward=float(backward_op_ms(arrays.span("backward", first, last), added)) + per_op,
        recompute=added,
    )


def span_compute_ms(arrays: LayerArrays, config: CostOptions, first: np.ndarray | int, last: int) -> np.ndarray:
    """`compute_ms` of items first..last (vectorized over `first`), each op's `arrays.op_ms` included (3 ops under
    a split backward, 2 else): the sum of `stage_op_ms`'s F, I and W (or F and B) without recomputation.
    PipeDream's model always uses F + B."""
    split = config.splits_backward and config.cost_model == "pipeplan"
    forward = arrays.span("forward", first, last)
    if not split:
        return compute_ms(forward, None, None, arrays.span("backward", first, last), split_backward=False) + (
            2 * arrays.op_ms
        )
    grads = np.where(
        arrays.first_in_model(first, last),  # the model's first stage: W runs the fused backward (stage_grad_ms)
        arrays.span("backward", first, last),
        arrays.span("input_grad", first, last) + arrays.span("weight_grad", first, last),
    )
    return compute_ms(forward, grads, 0.0, None, split_backward=True) + 3 * arrays.op_ms


def exposed_transfer_ms(in_ms, out_ms, replicas):
    """A stage's transfers per microbatch, shared by its replicas: (input cut + output cut) / r."""
    return (in_ms + out_ms) / replicas


def stage_ms(compute, replicas, *, allreduce, num_microbatches: int, transfers):
    """pipeplan's stage time: max(compute / r + all-reduce / M, transfers) with `transfers` from
    `exposed_transfer_ms` (elementwise)."""
    return np.maximum(compute / replicas + allreduce / num_microbatches, transfers)


def pipedream_stage_ms(compute, sync, comm, replicas):
    """PipeDream's stage time: max((compute + weight sync) / r, comm), comm the larger PipeDream transfer term."""
    return np.maximum((compute + sync) / replicas, comm)


@dataclass(frozen=True, kw_only=True)
class StageCostModel:
    """Stage times for one DP level. `compute_override` (level 2) replaces compute by a sub-pipeline time."""

    arrays: LayerArrays
    config: CostOptions
    link: Link  # for replica all-reduce
    num_microbatches: int

    def times(
        self,
        last: int,
        replicas: np.ndarray,
        *,
        in_link: Link | np.ndarray,
        out_link: Link | None,
        compute: np.ndarray | None = None,
        allreduce_bytes_scale: float = 1.0,
        recompute_ms: np.ndarray | None = None,
    ) -> np.ndarray:
        """Times of stages [a..last] for every a in 0..last (rows) and replica count in `replicas` (columns).

        `in_link`: the link the input cut crosses (a Link, or per-row transfer ms already computed);
        `out_link`: None when the output cut is not charged at this level; `recompute_ms` (rows x columns): what
        recomputation adds to each stage's I or B (`backward_op_ms`), inf where no mode fits memory."""
        firsts = np.arange(last + 1)
        r = np.asarray(replicas, dtype=np.float64)[None, :]
        comp = None if compute is None else compute[:, None]
        if self.config.cost_model == "pipedream":
            if comp is None:
                comp = span_compute_ms(self.arrays, self.config, firsts, last)[:, None]
            if recompute_ms is not None:
                comp = backward_op_ms(comp, recompute_ms)
            params = self.arrays.span("param_bytes", firsts, last)[:, None] * allreduce_bytes_scale
            return self._pipedream(comp, params, r, firsts)
        t_in = in_link if isinstance(in_link, np.ndarray) else transfer_ms(self.arrays.cut[firsts], in_link)
        t_out = transfer_ms(self.arrays.cut[last + 1], out_link) if out_link is not None else 0.0
        return self.cell_times(
            firsts[:, None],
            last,
            r,
            t_in=t_in[:, None],
            t_out=t_out,
            compute=comp,
            allreduce_bytes_scale=allreduce_bytes_scale,
            recompute_ms=recompute_ms,
        )

    def cell_times(
        self,
        first,
        last,
        replicas,
        *,
        t_in,
        t_out,
        compute=None,
        allreduce_bytes_scale: float = 1.0,
        recompute_ms=None,
    ) -> np.ndarray:
        """pipeplan's time of stage [first..last] with `replicas` replicas, elementwise over all arguments (they
        broadcast): `t_in` / `t_out` the transfer ms of its input / output cut, `compute` (default: the span's
        `span_compute_ms`), `recompute_ms` as in `times`, which reads its table from here."""
        comp = span_compute_ms(self.arrays, self.config, first, last) if compute is None else compute
        if recompute_ms is not None:
            comp = backward_op_ms(comp, recompute_ms)
        params = self.arrays.span("param_bytes", first, last) * allreduce_bytes_scale
        reduce = allreduce_ms(params, replicas, self.link)
        transfers = exposed_transfer_ms(t_in, t_out, replicas)
        return stage_ms(comp, replicas, allreduce=reduce, num_microbatches=self.num_microbatches, transfers=transfers)

    def _pipedream(self, comp: np.ndarray, params: np.ndarray, r: np.ndarray, firsts: np.ndarray) -> np.ndarray:
        bw = self.link.bandwidth
        last_cut = self.arrays.cut[firsts[-1] + 1]  # cut after `last` (0 after the final layer)
        t_in = pipedream_transfer_ms(self.arrays.cut[firsts][:, None], r, bw)
        comm = np.maximum(t_in, pipedream_transfer_ms(last_cut, r, bw))
        comm[0, :] = 0.0  # PipeDream's base case: the stage that starts the pipeline carries no transfer
        return pipedream_stage_ms(comp, pipedream_sync_ms(params, r, bw), comm, r)


def device_totals(per_stage: Sequence, device_stages) -> list:
    """Per device, the sum over the stages (chunks) it holds, in stage order: a device runs its stages' work one
    after another while the devices run in parallel."""
    return [sum(per_stage[s] for s in stages) for stages in device_stages]


def busiest_device_ms(per_stage_ms: Sequence[float], device_stages) -> float:
    """The largest `device_totals`: e.g. the gradient all-reduce after the flush, each device reducing its stages
    in turn."""
    return max(device_totals(per_stage_ms, device_stages), default=0.0)


def stages_per_device(stage_devices: Sequence[Sequence[int]]) -> list[list[int]]:
    """Inverts a stage -> devices map (one device per replica) into the stages of each device id 0..max, in stage
    order (a device that holds nothing has none)."""
    held: list[list[int]] = [[] for _ in range(max((d for devices in stage_devices for d in devices), default=-1) + 1)]
    for stage, devices in enumerate(stage_devices):
        for device in devices:
            held[device].append(stage)
    return held
