"""Hardware presets, --hardware-file merging and validation, and clusters built from a preset."""

from __future__ import annotations

import json

import pytest
import torch

from pipeplan.errors import ConfigError, FormatError
from pipeplan.hardware import (
    Hardware,
    cluster_for,
    hardware_presets,
    load_hardware,
    load_hardware_file,
)

NAMES = ("h100", "h200", "a100-40gb", "a100-80gb", "b200")


def test_every_preset_is_present_and_cites_sources():
    presets = hardware_presets()
    assert set(NAMES) <= set(presets)
    for name in NAMES:
        assert "datasheet" in presets[name].sources.lower(), name


def test_preset_figures_match_datasheets():
    h100, h200, a100, b200 = (load_hardware(n) for n in ("h100", "h200", "a100-80gb", "b200"))
    assert h100.peak_bf16_flops == pytest.approx(989.4e12)
    assert h100.hbm_bandwidth == pytest.approx(3.35e12) and h100.memory_bytes == 80 * 10**9
    assert h200.memory_bytes == 141 * 10**9 and h200.hbm_bandwidth == pytest.approx(4.8e12)
    assert a100.peak_bf16_flops == pytest.approx(312e12) and a100.hbm_bandwidth == pytest.approx(2.039e12)
    assert load_hardware("a100-40gb").memory_bytes == 40 * 10**9
    assert b200.peak_bf16_flops > 2 * h100.peak_bf16_flops
    assert h100.network_bandwidth == pytest.approx(50e9)  # 400 Gb/s InfiniBand per GPU
    assert h100.nvlink_bandwidth == pytest.approx(450e9)  # 900 GB/s bidirectional
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
        hbm_gb=24,
        hbm_tb_per_s=1.0,
        nvlink_gb_per_s=32,
        network_gb_per_s=12.5,
        sources="lab measurement",
    )
    path = _write(tmp_path, {"h100": {"matmul_efficiency": 0.5}, "MyGPU": new_entry})
    merged = load_hardware_file(path)
    assert merged["h100"].matmul_efficiency == 0.5
    assert merged["h100"].peak_bf16_flops == hardware_presets()["h100"].peak_bf16_flops  # other fields kept
    assert merged["mygpu"].memory_bytes == 24 * 10**9 and merged["mygpu"].matmul_efficiency == 0.6
    assert set(NAMES) <= set(merged)
    assert load_hardware("mygpu", hardware_file=path).network_bandwidth == pytest.approx(12.5e9)
    assert hardware_presets()["h100"].matmul_efficiency == 0.6  # presets themselves are untouched


@pytest.mark.parametrize(
    "entries, match",
    [
        ({"x": {"hbm_gb": 10}}, "missing field"),
        ({"h100": {"hbm_bw": 1}}, "unknown field"),
        ({"h100": {"matmul_efficiency": 1.5}}, "matmul_efficiency must lie in"),
        ({"h100": {"hbm_gb": -1}}, "memory_bytes must be positive"),
        ({"h100": {"hbm_gb": "lots"}}, "must be a number"),
        ({"h100": []}, "must be a JSON object"),
        ({}, "non-empty 'hardware'"),
    ],
)
def test_bad_hardware_files_are_format_errors(tmp_path, entries, match):
    with pytest.raises(FormatError, match=match):
        load_hardware_file(_write(tmp_path, entries))


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
    assert cluster.intra_node_bandwidth == h100.nvlink_bandwidth
    assert cluster.inter_node_bandwidth == h100.network_bandwidth
    assert cluster.hardware == "h100"
    one_gb = 1e9
    assert cluster.transfer_s(one_gb, same_node=True) < cluster.transfer_s(one_gb, same_node=False)
    assert cluster_for(h100, 4, devices_per_node=4).num_nodes == 1
    with pytest.raises(ConfigError, match="multiple of --devices-per-node"):
        cluster_for("a100-80gb", 12)
