"""`pipeplan capacity --plot`: tokens/s and the busiest device's memory against device count, one line per schedule
(its best plan at each count), with the device memory limit; matplotlib's Agg backend, PNG."""

from __future__ import annotations

import os

from pipeplan.capacity.report import CapacityReport
from pipeplan.units import GIB


def plot_capacity(report: CapacityReport, path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in report.per_schedule.items():
        fits = [row for row in rows if row.fits]
        if not fits:
            continue
        counts = [row.num_devices for row in fits]
        speed.plot(counts, [row.tokens_per_s for row in fits], marker="o", label=name)
        memory.plot(counts, [row.memory.total / GIB for row in fits], marker="o", label=name)
    memory.axhline(report.memory_per_device / GIB, color="black", linestyle="--", linewidth=1, label="device memory")
    for axis, label in ((speed, "tokens/s"), (memory, "peak memory per device (GiB)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("devices")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
    speed.set_title(f"{report.model} on {report.hardware}: throughput (best plan per schedule)")
    memory.set_title("busiest device's memory")
    if any(row.fits for rows in report.per_schedule.values() for row in rows):
        speed.legend(fontsize="small")
    memory.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
