"""`pipeplan capacity --plot`: against device count, MFU and the busiest device's memory per layout family — one
line per tensor-parallel size t (its best plan at each count, `CapacityReport.per_tensor_parallel`), the device
memory limit dashed — and MFU per schedule (each schedule's best plan over the sizes); matplotlib's Agg backend,
PNG."""

from __future__ import annotations

import os

from pipeplan.capacity.report import CapacityReport, CapacityRow
from pipeplan.jsonio import atomic_write
from pipeplan.units import GIB


def _fitting(rows: tuple[CapacityRow, ...]) -> tuple[list[int], list[float], list[float]]:
    """The fitting rows' device counts, MFU (%) and peak memory per device (GiB)."""
    fits = [(row.num_devices, row.mfu, row.memory) for row in rows if row.fits]
    points = [(n, mfu, memory) for n, mfu, memory in fits if mfu is not None and memory is not None]
    return [n for n, _, _ in points], [100 * mfu for _, mfu, _ in points], [m.total / GIB for _, _, m in points]


def plot_capacity(report: CapacityReport, path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (mfu, memory, schedules) = plt.subplots(1, 3, figsize=(17, 4.5))
    for t, rows in report.per_tensor_parallel.items():
        counts, mfus, peaks = _fitting(rows)
        if counts:
            mfu.plot(counts, mfus, marker="o", label=f"t={t}")
            memory.plot(counts, peaks, marker="o", label=f"t={t}")
    for name, rows in report.per_schedule.items():
        counts, mfus, _ = _fitting(rows)
        if counts:
            schedules.plot(counts, mfus, marker="o", label=name)
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
