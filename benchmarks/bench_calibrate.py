"""Calibration accuracy: measured / analytic whole-model forward+backward after `pipeplan calibrate`.

With CUDA: calibrates this GPU, then for the two GPT models of issue 11 (`layers=8 hidden=1024 heads=16 seq=1024`
batch 8, `layers=4 hidden=4096 heads=32 seq=2048` batch 2) prints the measured bf16-autocast time, the analytic
F+B for the calibrated entry and for the datasheet preset it matched, and measured / analytic (target: within 10%
for the calibrated entry under bf16 autocast; bf16 parameters, which the analytic bf16 profile models directly,
are shown beside it). Without CUDA: calibrates the CPU and does the same for a small GPT in fp32 and bf16
autocast (CPU figures; no target). Writes results/calibrate.json, naming the device.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

from arguments import parse_args

if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    parse_args(__doc__)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GPU_CASES = [
    ("gpt-8x1024", dict(layers=8, hidden=1024, heads=16, seq=1024), 8),
    ("gpt-4x4096", dict(layers=4, hidden=4096, heads=32, seq=2048), 2),
]
CPU_CASES = [("gpt-2x256", dict(layers=2, hidden=256, heads=4, seq=128), 4)]
TARGET = 0.10


def _calibrated(device: str):
    from pipeplan.calibrate.hardware_file import hardware_entry
    from pipeplan.calibrate.measure import calibrate
    from pipeplan.calibrate.spec import CalibrateConfig
    from pipeplan.hardware import validate_hardware_data

    cal = calibrate(CalibrateConfig(device=device))
    entry = hardware_entry(cal)
    hardware = validate_hardware_data({"hardware": {"calibrated": entry}}, where="calibration")["calibrated"]
    return cal, entry, hardware


def _rows(device: str, hardware, reference, cases, dtypes) -> list[dict]:

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.calibration_check import analytic_step_ms, measured_step_ms

    from pipeplan.models import load_model

    rows = []
    for case, options, batch in cases:
        spec = load_model("gpt", {k: str(v) for k, v in options.items()})
        for name, torch_dtype in dtypes:
            mixed = name != "bf16-params"
            measured = measured_step_ms(spec, batch, device, dtype=torch_dtype, autocast=mixed)
            analytic = analytic_step_ms(spec, batch, hardware, dtype=str(torch_dtype).removeprefix("torch."))
            row = dict(case=case, batch=batch, dtype=name, measured_ms=measured, analytic_ms=analytic)
            row["measured_over_analytic"] = measured / analytic
            if reference is not None:
                preset = analytic_step_ms(spec, batch, reference, dtype=str(torch_dtype).removeprefix("torch."))
                row.update(preset=reference.name, preset_ms=preset, measured_over_preset=measured / preset)
            rows.append(row)
    return rows


def main() -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from pipeplan.calibrate.hardware_file import nearest_preset
    from pipeplan.jsonio import write_json

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cal, entry, hardware = _calibrated(device)
    reference = None
    if cuda:
        preset, matched = nearest_preset(cal.device_name, cal.memory_bytes)
        reference = preset if matched else None
        dtypes = [("bf16-autocast", torch.bfloat16), ("bf16-params", torch.bfloat16)]
        rows = _rows(device, hardware, reference, GPU_CASES, dtypes)
    else:
        dtypes = [("fp32", torch.float32), ("bf16-autocast", torch.bfloat16), ("bf16-params", torch.bfloat16)]
        rows = _rows(device, hardware, None, CPU_CASES, dtypes)
    table = Table(title=f"calibrated analytic vs measured F+B on {cal.device_name} ({device})")
    for column in ("case", "batch", "dtype", "measured ms", "analytic ms", "measured/analytic", "vs preset"):
        table.add_column(column, justify="right")
    for row in rows:
        preset = f"{row['measured_over_preset']:.2f} ({row['preset']})" if "preset" in row else "-"
        table.add_row(
            row["case"],
            str(row["batch"]),
            row["dtype"],
            f"{row['measured_ms']:.2f}",
            f"{row['analytic_ms']:.2f}",
            f"{row['measured_over_analytic']:.2f}",
            preset,
        )
    Console().print(table)
    figures = {k: entry[k] for k in entry if k.startswith(("measured_", "kernel_", "peak_", "hbm_", "nvlink"))}
    print("calibrated:", ", ".join(f"{k}={v:.4g}" for k, v in figures.items()))
    met = None
    if cuda:
        autocast_rows = [row for row in rows if row["dtype"] == "bf16-autocast"]
        met = all(abs(row["measured_over_analytic"] - 1) <= TARGET for row in autocast_rows)
        print(f"target measured/analytic within {TARGET:.0%}: {'met' if met else 'MISSED'}")
    write_json(
        ROOT / "benchmarks" / "results" / "calibrate.json",
        dict(
            schema_version=1,
            machine=platform.platform(),
            device=device,
            device_name=cal.device_name,
            torch=torch.__version__,
            target=TARGET if cuda else None,
            target_met=met,
            hardware_entry=entry,
            results=rows,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
