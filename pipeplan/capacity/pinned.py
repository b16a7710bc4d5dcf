"""`pipeplan capacity --layout ...`: one pinned layout predicted exactly (`search.pinned`) — its step, tokens/s, MFU,
each pipeline device's memory and what binds — beside the planner's own choice on the same devices and batch, and
why they differ."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeplan.capacity.report import CapacityRow
from pipeplan.capacity.rows import result_row
from pipeplan.capacity.sweep import CapacityConfig, model_flops_per_token, plan_device_count
from pipeplan.hardware import cluster_for
from pipeplan.profiling.profile import Profile
from pipeplan.search.pinned import PinnedLayout, evaluate_pinned


@dataclass(frozen=True, kw_only=True)
class PinnedReport:
    """The pinned layout's row and each of its pipeline devices' simulated peak bytes (empty when it does not fit),
    the planner's row on the same count, and why they differ."""

    layout: PinnedLayout
    row: CapacityRow
    device_memory_bytes: tuple[int, ...]
    free: CapacityRow
    comparison: str

    def to_dict(self) -> dict:
        return {
            "layout": self.layout.label,
            "pinned": self.row.to_dict(),
            "pinned_device_memory_bytes": list(self.device_memory_bytes),
            "planner": self.free.to_dict(),
            "comparison": self.comparison,
        }


def pinned_report(profile: Profile, config: CapacityConfig, layout: PinnedLayout) -> PinnedReport:
    """Evaluate `layout` on its device count and run the planner's search there (same batch and options)."""
    n = layout.devices
    cluster = cluster_for(config.hardware, n, config.devices_per_node)
    flops = model_flops_per_token(profile)
    found = evaluate_pinned(profile, cluster, config.search, layout)
    if found.evaluation is None:
        assert found.rejection is not None
        row = CapacityRow(num_devices=n, binding="does-not-fit", reason=found.rejection.reason)
        memory: tuple[int, ...] = ()
    else:
        result = found.as_search_result(config.search)
        row = result_row(result, n, config.hardware.peak_bf16_flops, flops, [])
        memory = found.evaluation.device_memory_bytes
    free = plan_device_count(profile, replace(config, device_counts=(n,)), n, flops)
    return PinnedReport(layout=layout, row=row, device_memory_bytes=memory, free=free, comparison=compare(row, free))


def describe(row: CapacityRow) -> str:
    """`interleaved 9x4 m=63 b=1 t=8 cp=2 recompute none`: a row's layout in one phrase."""
    split = f" t={row.tensor_parallel}" + (f" cp={row.context_parallel}" if (row.context_parallel or 1) > 1 else "")
    split += f" ep={row.expert_parallel}" if (row.expert_parallel or 1) > 1 else ""
    return (
        f"{row.schedule} {row.pipeline_devices}x{row.data_parallel} m={row.num_microbatches} b={row.microbatch_size}"
        f"{split} recompute {row.recompute_label or 'none'}"
    )


def compare(pinned: CapacityRow, free: CapacityRow) -> str:
    """One sentence: which is faster and by how much, or which of them does not fit."""
    if not free.fits:
        return "the planner finds no plan that fits on these devices" + ("" if pinned.fits else "; neither does this")
    if not pinned.fits:
        return f"the pinned layout does not fit; the planner's choice does: {describe(free)}"
    assert pinned.step_ms is not None and free.step_ms is not None
    gap = pinned.step_ms / free.step_ms - 1.0
    if abs(gap) < 0.005:
        return f"the planner's choice ({describe(free)}) is as fast as the pinned layout"
    if gap > 0:
        return f"the planner's choice ({describe(free)}) is {gap:.1%} faster than the pinned layout"
    return (
        f"the pinned layout is {-gap:.1%} faster than the planner's choice ({describe(free)}): widen the search "
        "(--parallel vp=, cp=, --microbatch-size) to reach it"
    )
