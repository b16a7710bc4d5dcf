"""`pipeplan capacity --plot`: against device count, MFU and the busiest device's memory per layout family — one
line per tensor-parallel size t (its best plan at each count, `CapacityReport.per_tensor_parallel`), the device
memory limit dashed — and MFU per schedule (each schedule's best plan over the sizes); matplotlib's Agg backend,
PNG."""

from __future__ import annotations

import os

from pipeplan.capacity.report import CapacityReport, CapacityRow
from pipeplan.jsonio import atomic_write
from pipeplan.units import GIB


def _fitting(rows) -> tuple[list[int], list[CapacityRow]]:
    fits = [row for row in rows if row.fits]
    return [row.num_devices for row in fits], fits


def plot_capacity(report: CapacityReport, path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (mfu, memory, schedules) = plt.subplots(1, 3, figsize=(17, 4.5))
    for t, rows in report.per_tensor_parallel.items():
        counts, fits = _fitting(rows)
        if fits:
            mfu.plot(counts, [100 * row.mfu for row in fits], marker="o", label=f"t={t}")
            memory.plot(counts, [row.memory.total / GIB for row in fits], marker="o", label=f"t={t}")
    for name, rows in report.per_schedule.items():
        counts, fits = _fitting(rows)
        if fits:
            schedules.plot(counts, [100 * row.mfu for row in fits], marker="o", label=name)
    memory.axhline(report.memory_per_device / GIB, color="black", linestyle="--", linewidth=1, label="device memory")
    labels = ((mfu, "MFU (%)"), (memory, "peak memory per device (GiB)"), (schedules, "MFU (%)"))
    for axis, label in labels:
        axis.set_xscale("log", base=2)
        axis.set_xlabel("devices")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize="small")
    mfu.set_title(f"{report.model} on {report.hardware}: MFU per tensor-parallel size")
    memory.set_title("busiest device's memory per tensor-parallel size")
    schedules.set_title("MFU per schedule (best size)")
    fig.tight_layout()
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
