"""Turn a `Calibration` into a `--hardware-file` entry (every required field present) and write it.

How the measured figures map in (the analytic model then uses them; see `Hardware.matmul_flops_per_s`):

- matmuls on a GPU (an SM count was read): `sm_count` and the full-wave `matmul_efficiency` that `calibrate.fit`
  fits to the measured shapes through the kernel model (profiling.kernels: tile and wave quantization), so that the
  model times the measured shapes as measured. No `measured_*_tflops` are written there: a measured rate already
  contains its shapes' quantization and the model would count it twice (`Hardware` refuses the two together); the
  raw per-shape figures stay in `calibration`. One efficiency serves every dtype (bf16, else fp16, else tf32 is
  fitted; `sources` gives the tf32 fit beside it).
- matmuls on a CPU (no SMs, no quantization): `measured_bf16_tflops` / `measured_fp16_tflops` /
  `measured_tf32_tflops` (float32 matmuls) hold the median over shapes of what was measured, which the analytic
  roofline uses in place of peak x efficiency. `measured_hbm_tb_per_s` and `kernel_launch_us` likewise on both.
- peaks: a GPU recognized by name (H100/H200/A100/B200 SXM, MI300X; memory within 15%) keeps that preset's datasheet
  peaks, FP8 peak and `attention_efficiency` (not measured here; `sources` says so), and its efficiencies are the
  fitted full-wave rate / peak and measured bandwidth / peak. Any other device has no datasheet here, so its peak
  fields ARE the fitted full-wave (GPU) or median measured (CPU) rates, with efficiency 1.0. A rate above the
  preset's peak raises the peak (efficiency 1.0), and `sources` says so.
- links: on a recognized GPU with 2+ GPUs, `nvlink_gb_per_s` stays the datasheet's and `nvlink_efficiency` is the
  measured nccl all-reduce bus bandwidth / it (capped at 1: NVLink SHARP reports more than the wire);
  `intra_node_latency_us` is measured. On another GPU the measured point-to-point bandwidth is `nvlink_gb_per_s`,
  on a CPU the local gloo figures (also used for the inter-node fields: one machine), and there the efficiency is
  the measured all-reduce bus bandwidth / that point-to-point figure (capped at 1): what collectives reach of the
  link, as on a known GPU (gloo on a CPU sums on the cores it shares with the ranks: 0.36 of its point-to-point
  speed on a 2-core VM with a busy core; `cluster_for` multiplies it in, so transfers between stages are timed at
  it too, as on a GPU; at the sizes of a CPU run's activations their latency dominates). Whatever was
  not measured (all links with one GPU; the network on a GPU node) is copied from the nearest preset with its
  efficiency, named in `sources`.
- `calibration` keeps every raw measurement (and, on a GPU, each shape's fitted full-wave rate); the loader reads
  none of it.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from pathlib import Path
from typing import Any

from pipeplan.calibrate.fit import KernelTerms, full_wave_flops_per_s
from pipeplan.calibrate.spec import Calibration, LinkResult
from pipeplan.errors import ConfigError, FormatError, OutputError
from pipeplan.hardware import HARDWARE_SCHEMA_VERSION, Hardware, hardware_presets, validate_hardware_data
from pipeplan.jsonio import read_json, write_json

_FAMILIES = ("h100", "h200", "a100", "b200", "mi300x")
_OTHER_VARIANTS = ("pcie", "nvl", "mig")  # same family, other peaks than the SXM presets


def slug(text: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `nvidia-h100-80gb-hbm3`."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def default_name(calibration: Calibration) -> str:
    return slug(calibration.device_name) if calibration.device == "cuda" else "cpu"


def nearest_preset(device_name: str, memory_bytes: int) -> tuple[Hardware, bool]:
    """(preset, matched): the SXM preset of the device's family with memory within 15% (matched), else the preset
    with the nearest memory size (a fallback for figures that cannot be measured here)."""
    presets = sorted(hardware_presets().values(), key=lambda h: (abs(h.memory_bytes - memory_bytes), h.name))
    lowered = device_name.lower()
    if not any(variant in lowered for variant in _OTHER_VARIANTS):
        for preset in presets:
            family = preset.name.split("-")[0]
            if family in _FAMILIES and family in lowered and abs(preset.memory_bytes / memory_bytes - 1) <= 0.15:
                return preset, True
    return presets[0], False


def _rate(measured: float | None, peak: float | None, what: str, notes: list[str]) -> tuple[float, float | None]:
    """(peak, efficiency) for one measured rate; a measurement above the preset's peak raises the peak; efficiency
    None when the rate was not measured (the preset's peak stands)."""
    if peak is None:
        assert measured is not None, f"{what}: neither measured nor a preset's peak"
        return measured, 1.0
    if measured is None:
        return peak, None
    if measured > peak:
        notes.append(f"measured {what} exceeds the preset peak, so the peak is raised to the measurement")
        return measured, 1.0
    return peak, measured / peak


def kernel_terms(cal: Calibration, preset: Hardware | None) -> KernelTerms | None:
    """The per-kernel terms a GPU's matmuls are fitted with: its matched preset's, at the measured memory rate
    (None: an unmatched GPU or a CPU, fitted on compute alone)."""
    if preset is None or not cal.sm_count or not cal.memory_bytes_per_s:
        return None
    return KernelTerms(
        bytes_per_s=cal.memory_bytes_per_s,
        gemm_overhead_s=preset.gemm_overhead_s,
        epilogue_exposed=preset.epilogue_exposed,
        tile_reuse_half=preset.tile_reuse_half,
        stream_k=preset.stream_k,
    )


def _achieved(cal: Calibration, dtype: str, preset: Hardware | None = None) -> float | None:
    """One dtype's matmul rate for the model: a full wave's (the kernel-model fit, with the matched preset's
    per-kernel terms) with an SM count, else the median measured rate; None when the dtype was not measured."""
    samples = [sample for sample in cal.matmul if sample.dtype == dtype]
    if not samples:
        return None
    if not cal.sm_count:
        return cal.matmul_flops_per_s(dtype)
    terms = kernel_terms(cal, preset)
    peak = _peak(preset, dtype) if terms else 1.0
    return full_wave_flops_per_s(samples, cal.sm_count, terms, peak)


def _compute_fields(cal: Calibration, preset: Hardware | None, notes: list[str]) -> dict[str, Any]:
    low = _achieved(cal, "bf16", preset) or _achieved(cal, "fp16", preset)
    f32 = _achieved(cal, "tf32" if cal.device == "cuda" else "fp32", preset)
    any_f32 = f32 or _achieved(cal, "fp32", preset)
    if preset is None and (low is None or any_f32 is None):  # no datasheet: a peak must come from somewhere
        notes.append("peak_bf16/peak_tf32: one precision not measured, so its peak copies the other's measurement")
        low, any_f32 = low or any_f32, any_f32 or low
    peak_low, eff_low = _rate(low, preset.peak_bf16_flops if preset else None, "bf16 matmul", notes)
    peak_f32, eff_f32 = _rate(any_f32, preset.peak_tf32_flops if preset else None, "tf32 matmul", notes)
    peak_mem, eff_mem = _rate(
        cal.memory_bytes_per_s, preset.hbm_bandwidth if preset else None, "memory bandwidth", notes
    )
    fields: dict[str, Any] = {
        "peak_bf16_tflops": peak_low / 1e12,
        "peak_tf32_tflops": peak_f32 / 1e12,
        "memory_mib": cal.memory_bytes / 2**20,
        "hbm_tb_per_s": peak_mem / 1e12,
        "matmul_efficiency": eff_low or eff_f32 or (preset.matmul_efficiency if preset else 1.0),
        "memory_efficiency": eff_mem,
        "measured_hbm_tb_per_s": cal.memory_bytes_per_s / 1e12,
        "kernel_launch_us": cal.launch_s * 1e6,
    }
    if cal.sm_count:
        fields["sm_count"] = cal.sm_count
        fields.update(_kernel_term_fields(kernel_terms(cal, preset), preset, notes))
        tf32 = f", tf32 alone {eff_f32:.3f}" if eff_low and eff_f32 else ""
        notes.append(
            f"matmul_efficiency {fields['matmul_efficiency']:.3f}: the full-wave fraction of peak fitted to the "
            f"measured matmuls over {cal.sm_count} SMs (median over shapes of the kernel model's time at peak / the "
            f"measured time; calibrate/fit.py){tf32}; one efficiency for every dtype"
        )
        return fields
    for key, value in (("bf16", cal.matmul_flops_per_s("bf16")), ("fp16", cal.matmul_flops_per_s("fp16"))):
        if value is not None:
            fields[f"measured_{key}_tflops"] = value / 1e12
    if f32 is not None:
        fields["measured_tf32_tflops"] = f32 / 1e12
    return fields


def _kernel_term_fields(terms: KernelTerms | None, preset: Hardware | None, notes: list[str]) -> dict[str, Any]:
    """The per-kernel terms and clocks the fit ran with, written into the entry (so an entry under a new name
    times matmuls as the fit did); an unmatched GPU gets none (its fit had none)."""
    if terms is None or preset is None:
        return {}
    notes.append(
        f"gemm_overhead_us, gemm_epilogue_exposed, gemm_tile_reuse_half, stream_k and the clocks: preset "
        f"{preset.name!r}'s, the terms the matmul fit ran with"
    )
    fields: dict[str, Any] = {
        "gemm_overhead_us": terms.gemm_overhead_s * 1e6,
        "gemm_epilogue_exposed": terms.epilogue_exposed,
        "gemm_tile_reuse_half": terms.tile_reuse_half,
        "stream_k": terms.stream_k,
    }
    if preset.boost_clock_hz is not None:
        fields["boost_clock_mhz"] = preset.boost_clock_hz / 1e6
    if preset.training_clock_hz is not None:
        fields["training_clock_mhz"] = preset.training_clock_hz / 1e6
    return fields


def _copied_links(preset: Hardware) -> dict[str, Any]:
    return {
        "nvlink_gb_per_s": preset.nvlink_bandwidth / 1e9,
        "network_gb_per_s": preset.network_bandwidth / 1e9,
        "intra_node_latency_us": preset.intra_node_latency_s * 1e6,
        "inter_node_latency_us": preset.inter_node_latency_s * 1e6,
        "nvlink_efficiency": preset.nvlink_efficiency,
        "network_efficiency": preset.network_efficiency,
    }


def _link_fields(cal: Calibration, fallback: Hardware, matched: bool, notes: list[str]) -> dict[str, Any]:
    copied = _copied_links(fallback)
    link = cal.links
    if link is None:
        notes.append(f"links NOT measured ({', '.join(cal.notes) or 'skipped'}): copied from preset {fallback.name!r}")
        return copied
    latency = link.latency_s * 1e6
    if cal.device == "cpu":
        notes.append(f"links: {link.backend} between {link.ranks} local processes, also used for the inter-node fields")
        bandwidth, efficiency = link.p2p_bytes_per_s / 1e9, _p2p_efficiency(link, notes)
        return {
            "nvlink_gb_per_s": bandwidth,
            "network_gb_per_s": bandwidth,
            "intra_node_latency_us": latency,
            "inter_node_latency_us": latency,
            "nvlink_efficiency": efficiency,
            "network_efficiency": efficiency,
        }
    notes.append(f"links: {link.backend} over {link.ranks} GPUs, network NOT measured: copied from {fallback.name!r}")
    if not matched:  # no datasheet link bandwidth: the measured point-to-point figure is the link
        return {
            **copied,
            "nvlink_gb_per_s": link.p2p_bytes_per_s / 1e9,
            "intra_node_latency_us": latency,
            "nvlink_efficiency": _p2p_efficiency(link, notes),
        }
    fraction = link.allreduce_bus_bytes_per_s / fallback.nvlink_bandwidth
    notes.append(
        f"nvlink_efficiency {min(fraction, 1.0):.3f}: measured all-reduce bus bandwidth "
        f"{link.allreduce_bus_bytes_per_s / 1e9:.1f} GB/s over {link.ranks} GPUs / the datasheet's "
        f"{fallback.nvlink_bandwidth / 1e9:.0f} GB/s"
        + (" (above the wire: NVLink SHARP; capped at 1)" if fraction > 1 else "")
    )
    return {**copied, "intra_node_latency_us": latency, "nvlink_efficiency": min(fraction, 1.0)}


def _p2p_efficiency(link: LinkResult, notes: list[str]) -> float:
    """Where the measured point-to-point bandwidth is the link: the efficiency is what collectives reach of it (the
    measured all-reduce bus bandwidth / it, capped at 1), as a datasheet link's is of the datasheet figure."""
    fraction = link.allreduce_bus_bytes_per_s / link.p2p_bytes_per_s
    notes.append(
        f"link efficiency {min(fraction, 1.0):.3f}: measured all-reduce bus bandwidth "
        f"{link.allreduce_bus_bytes_per_s / 1e9:.2f} GB/s / the point-to-point {link.p2p_bytes_per_s / 1e9:.2f} GB/s"
    )
    return min(fraction, 1.0)


def _preset_only_fields(preset: Hardware, notes: list[str]) -> dict[str, Any]:
    """What a recognized GPU keeps from its preset because calibrate does not measure it."""
    fields: dict[str, Any] = {"attention_efficiency": preset.attention_fraction}
    if preset.peak_fp8_flops is not None:
        fields["peak_fp8_tflops"] = preset.peak_fp8_flops / 1e12
    if preset.flash2_attention_efficiency is not None:  # what --attention flash2 times
        fields["flash2_attention_efficiency"] = preset.flash2_attention_efficiency
    if preset.fp8_matmul_efficiency is not None:
        fields["fp8_matmul_efficiency"] = preset.fp8_matmul_efficiency
    notes.append(
        f"attention_efficiency (and FlashAttention-2's), the FP8 peak and efficiency: preset {preset.name!r}'s "
        "(not measured here)"
    )
    return fields


def _peak(preset: Hardware | None, dtype: str) -> float:
    """The matched preset's datasheet peak for a measured dtype (tf32 for fp32 matmuls)."""
    assert preset is not None, "kernel terms come from a matched preset"
    return preset.peak_tf32_flops if dtype in ("tf32", "fp32") else preset.peak_bf16_flops


def _matmul_fit_record(cal: Calibration, preset: Hardware | None) -> dict[str, Any]:
    """Each measured shape's full-wave rate (the record behind the fitted matmul_efficiency)."""
    record: dict[str, Any] = {"sm_count": cal.sm_count}
    terms = kernel_terms(cal, preset)
    for sample in cal.matmul:
        peak = _peak(preset, sample.dtype) if terms else 1.0
        rate = full_wave_flops_per_s([sample], cal.sm_count, terms, peak)
        record.setdefault(sample.dtype, []).append({"shape_mnk": list(sample.shape), "full_wave_tflops": rate / 1e12})
    return record


def hardware_entry(cal: Calibration) -> dict[str, Any]:
    """The `--hardware-file` entry for a calibration (see the module docstring for the mapping)."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    notes: list[str] = []
    extra: dict[str, Any] = {}
    matched = False
    if cal.device == "cuda":
        preset, matched = nearest_preset(cal.device_name, cal.memory_bytes)
        if matched:
            notes.append(f"peaks: datasheet figures of preset {preset.name!r} (matched by device name and memory)")
            extra = _preset_only_fields(preset, notes)
        else:
            notes.append("peaks: no datasheet for this GPU here, so the peak fields are the measured (full-wave) rates")
        compute = _compute_fields(cal, preset if matched else None, notes)
        links = _link_fields(cal, preset, matched, notes)
    else:
        notes.append(
            "peaks: no datasheet for a CPU, so the peak fields are the measured figures (fp32 in the tf32 ones)"
        )
        compute = _compute_fields(cal, None, notes)
        links = _link_fields(cal, _cpu_fallback(), False, notes)
    raw = cal.to_dict()
    if cal.sm_count:
        raw["matmul_fit"] = _matmul_fit_record(cal, preset if cal.device == "cuda" and matched else None)
    return {
        "description": f"{cal.device_name} ({cal.device}), measured by pipeplan calibrate on {stamp}, "
        f"torch {cal.torch_version}",
        **compute,
        **extra,
        **links,
        "sources": "pipeplan calibrate: " + "; ".join(notes),
        "calibration": raw,
    }


def _cpu_fallback() -> Hardware:
    return hardware_presets()["h100"]  # only reached when links were skipped on a CPU; named in `sources`


def check_entry_target(name: str | None, output: Path | None) -> None:
    """Refuse, before measuring anything, an empty --name or an -o that cannot take the entry."""
    if name is not None and not name.strip():
        raise ConfigError("--name must be non-empty")
    if output is not None:
        check_output(output)


def entry_name(name: str | None, calibration: Calibration) -> str:
    """The hardware entry's key: --name, or the measured device's (lower case)."""
    return (name or default_name(calibration)).strip().lower()


def check_output(path: Path) -> None:
    """Refuse, before measuring anything, an -o that cannot be written or is some other kind of file."""
    if path.is_dir():
        raise OutputError(f"-o {str(path)!r} is a directory; give a file name such as hw.json")
    if path.exists():
        read_json(path, kind="hardware", schema_version=HARDWARE_SCHEMA_VERSION)  # a bad file: one FormatError
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise OutputError(f"-o {str(path)!r}: cannot write under {str(parent)!r}")


def write_hardware_file(path: Path, name: str, entry: dict[str, Any]) -> None:
    """Add (or replace) `name` in the hardware file at `path`, keeping its other entries; validated before writing."""
    data: dict[str, Any] = {"schema_version": HARDWARE_SCHEMA_VERSION, "hardware": {}}
    if path.exists():
        data = read_json(path, kind="hardware", schema_version=HARDWARE_SCHEMA_VERSION)
        if not isinstance(data.setdefault("hardware", {}), dict):
            raise FormatError(f"hardware file {str(path)!r}: 'hardware' must be an object; choose another -o")
    data["hardware"][name] = entry
    validate_hardware_data(data, where=f"calibrated hardware for {str(path)!r}")
    write_json(path, data)
