"""Hardware presets, --hardware-file merging and validation, and clusters built from a preset."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import pipeplan.hardware
from pipeplan.errors import ConfigError, FormatError
from pipeplan.hardware import (
    Hardware,
    cluster_for,
    hardware_presets,
    load_hardware,
    load_hardware_file,
)

NAMES = ("h100", "h800", "h200", "a100-40gb", "a100-80gb", "b200", "mi300x")
EFFICIENCIES = (
    "matmul_efficiency",
    "memory_efficiency",
    "attention_efficiency",
    "nvlink_efficiency",
    "network_efficiency",
)
FP8 = ("h100", "h800", "h200", "b200", "mi300x")  # datasheets: FP8 dense = 2 x BF16 dense; A100 has no FP8
RAW = json.loads(Path(pipeplan.hardware.__file__).with_name("hardware.json").read_text())["hardware"]


def test_every_preset_is_present_and_cites_sources():
    presets = hardware_presets()
    assert set(NAMES) == set(presets)
    for name in NAMES:
        assert "datasheet" in presets[name].sources.lower(), name


@pytest.mark.parametrize("name", NAMES)
def test_every_preset_gives_every_field_itself(name):
    """Written out in hardware.json (not the dataclass defaults): peaks, memory, links, SMs, all efficiencies."""
    required = {
        "description",
        "sources",
        "peak_bf16_tflops",
        "peak_tf32_tflops",
        "memory_mib",
        "hbm_tb_per_s",
        "nvlink_gb_per_s",
        "network_gb_per_s",
        "intra_node_latency_us",
        "inter_node_latency_us",
        "sm_count",
        *EFFICIENCIES,
    }
    assert required <= set(RAW[name]), required - set(RAW[name])
    assert ("peak_fp8_tflops" in RAW[name]) == (name in FP8)
    assert not [key for key in RAW[name] if key.startswith("measured_")]  # datasheets, not one machine's run


@pytest.mark.parametrize("name", NAMES)
def test_sources_state_and_justify_each_efficiency(name):
    """Each efficiency is named in `sources` with the value the entry uses, followed by where it comes from."""
    sources = RAW[name]["sources"]
    for key in (*EFFICIENCIES, *(["fp8_matmul_efficiency"] if "fp8_matmul_efficiency" in RAW[name] else [])):
        stated = re.findall(rf"(?<![a-z0-9_]){key} ([0-9.]+): (\S+)", sources)
        assert len(stated) == 1, (name, key)
        assert float(stated[0][0]) == pytest.approx(RAW[name][key]), (name, key)
    assert f"sm_count {RAW[name]['sm_count']}:" in sources


@pytest.mark.parametrize("name", NAMES)
def test_preset_efficiencies_are_sane(name):
    spec = load_hardware(name)
    assert 0.5 < spec.matmul_efficiency < 1  # cuBLAS / hipBLASLt large GEMMs: 51% (MI300X) to 82% (A100)
    assert 0.5 < spec.memory_efficiency < 1
    assert 0.3 < spec.attention_efficiency <= spec.matmul_efficiency  # attention's matmuls, plus softmax and masking
    assert 0.5 < spec.nvlink_efficiency < 1 and 0.5 < spec.network_efficiency < 1
    assert spec.peak_tf32_flops == pytest.approx(spec.peak_bf16_flops / 2, rel=0.03)  # B200's is 1.1 of 2.25 PF


def test_fp8_peak_is_twice_bf16_where_the_datasheet_says_so():
    for name in NAMES:
        spec = load_hardware(name)
        if name in FP8:
            assert spec.peak_fp8_flops == pytest.approx(2 * spec.peak_bf16_flops, rel=1e-4), name
        else:
            assert spec.peak_fp8_flops is None, name
    assert "no FP8" in load_hardware("a100-80gb").sources


def test_fp8_matmuls_reach_a_lower_fraction_of_their_peak():
    """Measured cuBLASLt FP8 GEMMs: 0.71 of the FP8 peak on H100 against 0.87 of bf16's (both at the boost clock,
    both run at the training clock's share of it); without a measurement (MI300X) FP8 uses the bf16 fraction."""
    h100, mi300x = load_hardware("h100"), load_hardware("mi300x")
    assert h100.fp8_matmul_flops_per_s() == pytest.approx(0.71 * 1978.9e12 * 1575 / 1980)
    assert h100.fp8_matmul_flops_per_s() < 2 * h100.matmul_flops_per_s(torch.bfloat16)
    assert h100.fp8_matmul_flops_per_s(0.5) == pytest.approx(0.5 * 1978.9e12 * 1575 / 1980)  # an override
    assert mi300x.fp8_matmul_flops_per_s() == pytest.approx(mi300x.peak_fp8_flops * mi300x.matmul_efficiency)
    assert load_hardware("a100-80gb").fp8_matmul_flops_per_s() is None


def test_tensor_core_work_runs_at_the_training_clock_and_memory_at_the_hbm_rate():
    """H100: the efficiencies are short benchmarks at the 1980 MHz boost clock; a training GPU holds 1575 MHz
    (hardware.json's sources), so matmuls and attention run at 1575 / 1980 of them; memory-bound kernels do not
    slow down. A100's efficiency is measured at its power-limited clock: ratio 1."""
    h100, a100 = load_hardware("h100"), load_hardware("a100-80gb")
    assert h100.clock_ratio == pytest.approx(1575 / 1980)
    assert h100.matmul_flops_per_s(torch.bfloat16) == pytest.approx(989.4e12 * 0.87 * 1575 / 1980)
    assert h100.attention_flops_per_s(torch.bfloat16) == pytest.approx(989.4e12 * 0.58 * 1575 / 1980)
    assert h100.memory_bytes_per_s() == pytest.approx(3.35e12 * 0.87)
    assert a100.clock_ratio == 1.0 and a100.matmul_flops_per_s(torch.bfloat16) == pytest.approx(312e12 * 0.83)


@pytest.mark.parametrize("name", NAMES)
def test_the_kernel_model_terms_are_stated_with_their_source(name):
    """Every preset gives the kernel model's per-kernel terms, each named in `sources` with the value it uses."""
    raw, sources = RAW[name], RAW[name]["sources"]
    for key in ("gemm_overhead_us", "gemm_epilogue_exposed", "gemm_tile_reuse_half", "kernel_launch_us"):
        assert key in raw, key
        assert re.search(rf"(?<![a-z0-9_]){key} {raw[key]:g}\b", sources.replace(".0 ", " ").replace(".0,", ",")), key
    for key in ("boost_clock_mhz", "training_clock_mhz"):
        assert (key not in raw) or f"{key} {raw[key]}" in sources, key
    spec = load_hardware(name)
    assert spec.gemm_overhead_s > 0 and spec.epilogue_exposed > 0 and spec.kernel_launch_s > 0


def test_sm_counts_and_the_mi300x_fabric():
    assert {name: load_hardware(name).sm_count for name in NAMES} == {
        "a100-40gb": 108,
        "a100-80gb": 108,
        "h100": 132,
        "h800": 132,
        "h200": 132,
        "b200": 148,
        "mi300x": 304,
    }
    mi300x = load_hardware("mi300x")
    assert mi300x.nvlink_bandwidth == pytest.approx(7 * 64e9)  # 7 Infinity Fabric links x 64 GB/s per direction
    assert "one peer" in mi300x.sources and mi300x.memory_bytes == 196288 * 2**20  # rocm-smi: 205,822,885,888 B
    assert mi300x.peak_bf16_flops == pytest.approx(1307.4e12) and mi300x.hbm_bandwidth == pytest.approx(5.3e12)


def test_preset_figures_match_datasheets():
    h100, h200, a100, b200 = (load_hardware(n) for n in ("h100", "h200", "a100-80gb", "b200"))
    assert h100.peak_bf16_flops == pytest.approx(989.4e12)
    assert h100.hbm_bandwidth == pytest.approx(3.35e12) and h100.memory_bytes == 81559 * 2**20  # nvidia-smi
    assert h200.memory_bytes == 143771 * 2**20 and h200.hbm_bandwidth == pytest.approx(4.8e12)
    assert a100.peak_bf16_flops == pytest.approx(312e12) and a100.hbm_bandwidth == pytest.approx(2.039e12)
    assert load_hardware("a100-40gb").memory_bytes == 40 * 2**30
    assert b200.peak_bf16_flops > 2 * h100.peak_bf16_flops
    assert h100.network_bandwidth == pytest.approx(50e9)  # 400 Gb/s InfiniBand per GPU
    assert h100.nvlink_bandwidth == pytest.approx(450e9)  # 900 GB/s bidirectional
    h800 = load_hardware("h800")  # H100 SXM compute and memory, NVLink 400 GB/s bidirectional
    assert h800.nvlink_bandwidth == pytest.approx(200e9) and h800.network_bandwidth == h100.network_bandwidth
    assert (h800.peak_bf16_flops, h800.peak_fp8_flops, h800.memory_bytes, h800.hbm_bandwidth) == (
        h100.peak_bf16_flops,
        h100.peak_fp8_flops,
        h100.memory_bytes,
        h100.hbm_bandwidth,
    )
    for spec in (h100, h200, a100, b200):
        assert spec.nvlink_bandwidth > spec.network_bandwidth
        assert spec.intra_node_latency_s <= spec.inter_node_latency_s


def test_peak_depends_on_dtype():
    h100 = load_hardware("H100")  # names are case-insensitive
    assert h100.peak_flops(torch.bfloat16) == h100.peak_flops(torch.float16) == h100.peak_bf16_flops
    assert h100.peak_flops(torch.float32) == h100.peak_tf32_flops < h100.peak_bf16_flops


def test_unknown_name_lists_the_presets():
    with pytest.raises(ConfigError, match=r"unknown --hardware 'tpu'.*a100-40gb.*h100"):
        load_hardware("tpu")


def _write(tmp_path, entries, version=1):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"schema_version": version, "hardware": entries}))
    return path


def test_hardware_file_overrides_fields_and_adds_entries(tmp_path):
    new_entry = dict(
        peak_bf16_tflops=100,
        peak_tf32_tflops=50,
        memory_mib=24576,
        hbm_tb_per_s=1.0,
        nvlink_gb_per_s=32,
        network_gb_per_s=12.5,
        sources="lab measurement",
    )
    path = _write(tmp_path, {"h100": {"matmul_efficiency": 0.5}, "MyGPU": new_entry})
    merged = load_hardware_file(path)
    assert merged["h100"].matmul_efficiency == 0.5
    assert merged["h100"].peak_bf16_flops == hardware_presets()["h100"].peak_bf16_flops  # other fields kept
    assert merged["mygpu"].memory_bytes == 24 * 2**30 and merged["mygpu"].matmul_efficiency == 0.6
    assert set(NAMES) <= set(merged)
    assert load_hardware("mygpu", hardware_file=path).network_bandwidth == pytest.approx(12.5e9)
    assert hardware_presets()["h100"].matmul_efficiency == RAW["h100"]["matmul_efficiency"]  # presets untouched


@pytest.mark.parametrize(
    "entries, match",
    [
        ({"x": {"memory_mib": 10}}, "missing field"),
        ({"h100": {"memory_mib": 80000, "hbm_gb": 80}}, "both memory_mib and hbm_gb"),
        ({"h100": {"hbm_bw": 1}}, "unknown field"),
        ({"h100": {"matmul_efficiency": 1.5}}, "matmul_efficiency must lie in"),
        ({"h100": {"memory_mib": -1}}, "memory_bytes must be positive"),
        ({"h100": {"sm_count": 132.5}}, "sm_count must be a whole number"),
        ({"h100": {"measured_bf16_tflops": 700}}, "would count tile and wave quantization twice"),
        ({"h100": {"hbm_gb": "lots"}}, "must be a number"),
        ({"h100": []}, "must be a JSON object"),
        ({}, "non-empty 'hardware'"),
    ],
)
def test_bad_hardware_files_are_format_errors(tmp_path, entries, match):
    with pytest.raises(FormatError, match=match):
        load_hardware_file(_write(tmp_path, entries))


def test_older_files_give_memory_in_decimal_gb(tmp_path):
    """`hbm_gb` (decimal GB, the datasheets' rounding) is still read; files are written with `memory_mib`."""
    merged = load_hardware_file(_write(tmp_path, {"h100": {"hbm_gb": 80}}))
    assert merged["h100"].memory_bytes == 80 * 10**9
    assert "hbm_gb" not in merged["h100"].to_file_entry() and merged["h100"].to_file_entry()["memory_mib"] > 76000


def test_presets_hold_the_memory_the_driver_reports():
    """nvidia-smi on an H100 80GB HBM3 reports 81,559 MiB (85.5e9 B, not the datasheet's 80e9)."""
    assert hardware_presets()["h100"].memory_bytes == 81559 * 2**20
    assert hardware_presets()["a100-80gb"].memory_bytes == 80 * 2**30


def test_hardware_file_version_and_existence(tmp_path):
    with pytest.raises(FormatError, match="schema_version"):
        load_hardware_file(_write(tmp_path, {"h100": {}}, version=7))
    with pytest.raises(FormatError, match="does not exist"):
        load_hardware_file(tmp_path / "missing.json")


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match="hbm_bandwidth must be positive"):
        Hardware(
            name="x",
            peak_bf16_flops=1,
            peak_tf32_flops=1,
            memory_bytes=1,
            hbm_bandwidth=0,
            nvlink_bandwidth=1,
            network_bandwidth=1,
        )


def test_round_trip_through_file_entry(tmp_path):
    h200 = load_hardware("h200")
    path = _write(tmp_path, {"copy": h200.to_file_entry()})
    copy = load_hardware("copy", hardware_file=path)
    assert copy.peak_bf16_flops == pytest.approx(h200.peak_bf16_flops)
    assert copy.memory_bytes == h200.memory_bytes and copy.sources == h200.sources


def test_cluster_for_uses_hbm_nvlink_and_network():
    cluster = cluster_for("h100", 16)
    h100 = load_hardware("h100")
    assert cluster.num_nodes == 2 and cluster.devices_per_node == 8
    assert cluster.memory_per_device == h100.memory_bytes
    # collectives reach the datasheet bandwidth x the measured bus-bandwidth fraction
    assert cluster.intra_node_bandwidth == pytest.approx(h100.nvlink_bandwidth * 0.82)
    assert cluster.inter_node_bandwidth == pytest.approx(h100.network_bandwidth * 0.94)
    assert cluster.hardware == "h100"
    one_gb = 1e9
    assert cluster.transfer_s(one_gb, same_node=True) < cluster.transfer_s(one_gb, same_node=False)
    assert cluster_for(h100, 4, devices_per_node=4).num_nodes == 1
    with pytest.raises(ConfigError, match="multiple of the devices per node"):
        cluster_for("a100-80gb", 12)
