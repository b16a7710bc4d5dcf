"""`pipeplan calibrate`: measurements, the hardware-file entry they make, the analytic model using it, bad inputs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from pipeplan.calibrate.fit import model_seconds
from pipeplan.calibrate.hardware_file import hardware_entry, kernel_terms, nearest_preset, write_hardware_file
from pipeplan.calibrate.measure import median_seconds
from pipeplan.calibrate.spec import SIZES, CalibrateConfig, Calibration, LinkResult, MatmulSample, MemorySample
from pipeplan.cli import app
from pipeplan.hardware import Hardware, load_hardware, load_hardware_file
from pipeplan.profiling.analytic import AnalyticConfig
from pipeplan.profiling.opcount import Roofline
from pipeplan.profiling.profile import Profile

GPT = ["gpt", "-a", "layers=2", "-a", "hidden=64", "-a", "heads=4", "-a", "seq=32"]


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def cpu_file(tmp_path_factory):
    """One real (quick) CPU calibration, links included (gloo between two processes), shared by the tests."""
    path = tmp_path_factory.mktemp("cal") / "hw.json"
    result = _run("calibrate", "--device", "cpu", "--quick", "--name", "MyCPU", "-o", path)
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and f"--hardware {path}:mycpu" in "".join(result.output.split("\n"))
    return path


@pytest.mark.slow
def test_cpu_calibration_loads_through_the_hardware_file_loader(cpu_file):
    entry = json.loads(cpu_file.read_text())["hardware"]["mycpu"]
    spec = load_hardware_file(cpu_file)["mycpu"]
    raw = entry["calibration"]
    assert raw["device"] == "cpu" and set(raw["matmul"]) == {"fp32", "bf16"}
    assert raw["links"]["backend"] == "gloo" and raw["links"]["ranks"] == 2
    # the measured figures are what the analytic model will use, and peak x efficiency agrees with them on a CPU
    assert spec.measured_bf16_flops == pytest.approx(entry["measured_bf16_tflops"] * 1e12)
    assert spec.measured_tf32_flops == pytest.approx(entry["measured_tf32_tflops"] * 1e12)
    assert spec.peak_bf16_flops * spec.matmul_efficiency == pytest.approx(spec.measured_bf16_flops)
    assert spec.hbm_bandwidth * spec.memory_efficiency == pytest.approx(spec.measured_hbm_bandwidth)
    assert spec.kernel_launch_s == pytest.approx(raw["kernel_launch_us"] * 1e-6) and spec.kernel_launch_s > 0
    assert spec.nvlink_bandwidth == pytest.approx(raw["links"]["p2p_gb_per_s"] * 1e9)
    assert spec.intra_node_latency_s == pytest.approx(raw["links"]["latency_us"] * 1e-6)
    # the measurement is the link; collectives reach the measured all-reduce's share of it (at most all)
    fraction = min(raw["links"]["allreduce_bus_gb_per_s"] / raw["links"]["p2p_gb_per_s"], 1.0)
    assert spec.nvlink_efficiency == spec.network_efficiency == pytest.approx(fraction)
    assert "link efficiency" in spec.sources
    assert "gloo" in spec.sources and "measured" in spec.sources
    # a CPU has no SMs: no quantization, so the measured median rates stand (today's behaviour)
    assert spec.sm_count is None and raw["sm_count"] is None and "matmul_fit" not in raw


@pytest.mark.slow
def test_profile_meta_with_the_calibrated_file(cpu_file, tmp_path):
    target = tmp_path / "p.json"
    args = ("profile", *GPT, "--device", "meta", "--hardware", "mycpu", "--hardware-file", cpu_file, "-o", target)
    result = _run(*args)
    assert result.exit_code == 0, result.output
    profile = Profile.load(target)
    spec = load_hardware("mycpu", hardware_file=cpu_file)
    assert profile.provenance.hardware == "mycpu"
    assert "calibrated" in profile.provenance.notes
    assert f"{spec.measured_bf16_flops / 1e12:.1f} TFLOP/s" in profile.provenance.notes


@pytest.mark.slow
def test_plan_with_the_calibrated_file_uses_its_memory_and_links(cpu_file, tmp_path):
    args = ("plan", *GPT, "--device", "meta", "--hardware", f"{cpu_file}:mycpu", "--devices", "2")
    result = _run(*args, "-o", tmp_path / "plan", "--json")
    assert result.exit_code == 0, result.output
    cluster = json.loads((tmp_path / "plan" / "plan.json").read_text())["cluster"]
    spec = load_hardware("mycpu", hardware_file=cpu_file)
    assert cluster["hardware"] == "mycpu" and cluster["memory_per_device"] == spec.memory_bytes
    assert cluster["intra_node_bandwidth"] == pytest.approx(spec.nvlink_bandwidth * spec.nvlink_efficiency)
    alone = _run("plan", *GPT, "--device", "meta", "--hardware", cpu_file, "--devices", "2", "-o", tmp_path / "p2")
    assert alone.exit_code == 0, alone.output  # the file's one entry
    assert json.loads((tmp_path / "p2" / "plan.json").read_text())["cluster"] == cluster


@pytest.mark.slow
def test_calibrate_json_prints_only_the_file(tmp_path):
    result = _run("calibrate", "--device", "cpu", "--quick", "--dtype", "fp32", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    (entry,) = data["hardware"].values()
    assert list(data["hardware"]) == ["cpu"] and set(entry["calibration"]["matmul"]) == {"fp32"}
    # bf16 not measured: its peak copies the fp32 figure, and the file says so
    assert entry["peak_bf16_tflops"] == entry["measured_tf32_tflops"] and "measured_bf16_tflops" not in entry
    assert "not measured" in entry["sources"]


GPU_SHAPES = SIZES[("cuda", False)].matmul_shapes


def _samples(dtype: str, full_wave_tflops: float, sm_count: int, terms=None, shapes=GPU_SHAPES) -> list[MatmulSample]:
    """Matmuls timed as the kernel model times them when a full wave runs at `full_wave_tflops` (with a matched
    preset's per-kernel `terms`, as calibrate fits them)."""
    return [
        MatmulSample(dtype, shape, model_seconds(shape, full_wave_tflops * 1e12, sm_count, terms)) for shape in shapes
    ]


def _synthetic(
    device_name: str,
    memory_gb: float,
    *,
    bf16: float,
    tf32: float,
    links: LinkResult | None = None,
    sm_count: int = 132,
):
    """A GPU calibration whose matmuls run, in the kernel model (with the matched preset's per-kernel terms), at
    full-wave rates `bf16` and `tf32` TFLOP/s."""
    cal = Calibration(
        device="cuda",
        device_name=device_name,
        memory_bytes=int(memory_gb * 1e9),
        sm_count=sm_count,
        matmul=[],
        memory=[
            MemorySample(1 << 30, 2.9e12, 3.1e12),
            MemorySample(1 << 24, 2.0e12, 2.2e12),
            MemorySample(1 << 26, 2.8e12, 3.2e12),
        ],
        launch_s=4e-6,
        links=links,
        notes=["links not measured: 1 GPU visible (point-to-point and all-reduce need 2+)"] if links is None else [],
    )
    preset, matched = nearest_preset(device_name, cal.memory_bytes)
    terms = kernel_terms(cal, preset if matched else None)
    cal.matmul = _samples("bf16", bf16, sm_count, terms) + _samples("tf32", tf32, sm_count, terms)
    return cal


def _load(tmp_path, entry: dict, name: str = "gpu") -> Hardware:
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"schema_version": 1, "hardware": {name: entry}}))
    return load_hardware(name, hardware_file=path)


def test_a_known_gpu_keeps_datasheet_peaks_and_fits_the_full_wave_efficiency(tmp_path):
    entry = hardware_entry(_synthetic("NVIDIA H100 80GB HBM3", 85.0, bf16=700.0, tf32=380.0))
    spec = _load(tmp_path, entry)
    h100 = load_hardware("h100")
    assert spec.peak_bf16_flops == h100.peak_bf16_flops and spec.hbm_bandwidth == h100.hbm_bandwidth
    assert spec.sm_count == 132 and spec.matmul_efficiency == pytest.approx(700.0 / 989.4)
    assert spec.memory_efficiency == pytest.approx(3.0 / 3.35)
    assert spec.memory_bytes == 85_000_000_000
    # no measured matmul rates beside sm_count (the kernel model would count quantization twice): raw records only
    assert spec.measured_bf16_flops is None and spec.measured_tf32_flops is None
    fits = [record["full_wave_tflops"] for record in entry["calibration"]["matmul_fit"]["bf16"]]
    assert fits == pytest.approx([700.0] * len(GPU_SHAPES))
    assert f"tf32 alone {380 / 494.7:.3f}" in spec.sources
    # what calibrate does not measure is the preset's, and the file says so
    assert spec.attention_efficiency == h100.attention_efficiency and spec.peak_fp8_flops == h100.peak_fp8_flops
    assert spec.flash2_attention_efficiency == h100.flash2_attention_efficiency == 0.31  # --attention flash2's rate
    # one GPU: the links are the h100 preset's (with its efficiencies), and the file says they were not measured
    assert spec.nvlink_bandwidth == h100.nvlink_bandwidth and spec.network_bandwidth == h100.network_bandwidth
    assert spec.nvlink_efficiency == h100.nvlink_efficiency and spec.network_efficiency == h100.network_efficiency
    assert "links NOT measured" in spec.sources and "'h100'" in spec.sources
    # the fit ran with the preset's per-kernel terms, and the entry keeps them and its clocks: a calibration's short
    # runs are at the boost clock, and a training run at the training clock (clock_ratio)
    assert (spec.gemm_overhead_s, spec.epilogue_exposed) == (h100.gemm_overhead_s, h100.epilogue_exposed)
    assert spec.tile_reuse_half == h100.tile_reuse_half and spec.stream_k and spec.clock_ratio == h100.clock_ratio
    roofline = AnalyticConfig(batch_size=1, hardware=spec).roofline
    assert roofline.flops_per_s == pytest.approx(700e12 * h100.clock_ratio)
    assert roofline.bytes_per_s == pytest.approx(3.0e12)
    assert roofline.launch_s == pytest.approx(4e-6) and roofline.sm_count == 132
    f32 = AnalyticConfig(batch_size=1, hardware=spec, dtype="float32").roofline  # one efficiency for every dtype
    assert f32.flops_per_s == pytest.approx(494.7e12 * 700.0 / 989.4 * h100.clock_ratio)
    # an explicit efficiency still means peak x that efficiency (at the training clock)
    forced = AnalyticConfig(batch_size=1, hardware=spec, matmul_efficiency=0.5).roofline
    assert forced.flops_per_s == pytest.approx(989.4e12 * 0.5 * h100.clock_ratio)


def test_a_known_gpu_measured_in_tf32_only_keeps_the_bf16_peak_unmeasured(tmp_path):
    cal = _synthetic("NVIDIA H100 80GB HBM3", 85.0, bf16=1.0, tf32=400.0)
    cal.matmul = [sample for sample in cal.matmul if sample.dtype == "tf32"]
    spec = _load(tmp_path, hardware_entry(cal))
    assert spec.measured_bf16_flops is None and spec.peak_bf16_flops == load_hardware("h100").peak_bf16_flops
    assert spec.matmul_efficiency == pytest.approx(400.0 / 494.7)
    ratio = load_hardware("h100").clock_ratio
    assert AnalyticConfig(batch_size=1, hardware=spec).roofline.flops_per_s == pytest.approx(
        989.4e12 * 400 / 494.7 * ratio
    )


def test_an_unknown_gpu_uses_its_full_wave_rates_as_peaks_and_names_the_link_fallback(tmp_path):
    spec = _load(tmp_path, hardware_entry(_synthetic("NVIDIA H100 PCIe", 40.0, bf16=400.0, tf32=200.0, sm_count=114)))
    assert spec.peak_bf16_flops == pytest.approx(400e12) and spec.matmul_efficiency == 1.0
    assert spec.peak_tf32_flops == pytest.approx(200e12) and spec.sm_count == 114
    assert spec.hbm_bandwidth == pytest.approx(3.0e12) and spec.memory_efficiency == 1.0
    assert spec.peak_fp8_flops is None and spec.attention_efficiency is None  # no datasheet: nothing copied
    assert nearest_preset("NVIDIA H100 PCIe", 40_000_000_000) == (load_hardware("a100-40gb"), False)
    assert spec.nvlink_bandwidth == load_hardware("a100-40gb").nvlink_bandwidth and "'a100-40gb'" in spec.sources


def test_measured_links_and_a_rate_above_the_preset_peak(tmp_path):
    link = LinkResult(
        backend="nccl",
        ranks=8,
        p2p_bytes_per_s=380e9,
        allreduce_bus_bytes_per_s=360e9,
        latency_s=12e-6,
        message_bytes=1 << 28,
    )
    entry = hardware_entry(_synthetic("NVIDIA H200", 150.0, bf16=1200.0, tf32=400.0, links=link))
    spec = _load(tmp_path, entry)
    h200 = load_hardware("h200")
    # a known GPU keeps the datasheet link; the measured all-reduce bus bandwidth gives its efficiency
    assert spec.nvlink_bandwidth == h200.nvlink_bandwidth and spec.nvlink_efficiency == pytest.approx(360 / 450)
    assert spec.intra_node_latency_s == pytest.approx(12e-6) and "nvlink_efficiency 0.800" in spec.sources
    assert spec.network_bandwidth == h200.network_bandwidth and spec.network_efficiency == h200.network_efficiency
    assert "network NOT measured" in spec.sources
    assert spec.peak_bf16_flops == pytest.approx(1200e12) and "peak is raised" in spec.sources
    assert spec.matmul_efficiency == 1.0
    assert entry["calibration"]["links"]["allreduce_bus_gb_per_s"] == pytest.approx(360.0)


def test_nvlink_sharp_above_the_wire_caps_the_efficiency_and_an_unknown_gpu_keeps_its_p2p(tmp_path):
    sharp = LinkResult(
        backend="nccl",
        ranks=8,
        p2p_bytes_per_s=380e9,
        allreduce_bus_bytes_per_s=480e9,
        latency_s=12e-6,
        message_bytes=1 << 28,
    )
    spec = _load(tmp_path, hardware_entry(_synthetic("NVIDIA H100 80GB HBM3", 85.0, bf16=700, tf32=380, links=sharp)))
    assert spec.nvlink_efficiency == 1.0 and "NVLink SHARP" in spec.sources
    (tmp_path / "other").mkdir()
    other = _synthetic("NVIDIA H100 PCIe", 40.0, bf16=400.0, tf32=200.0, links=sharp, sm_count=114)
    spec = _load(tmp_path / "other", hardware_entry(other))
    assert spec.nvlink_bandwidth == pytest.approx(380e9) and spec.nvlink_efficiency == 1.0  # 480 / 380, capped
    (tmp_path / "slower").mkdir()
    slower = dataclasses.replace(sharp, allreduce_bus_bytes_per_s=190e9)
    other = _synthetic("NVIDIA H100 PCIe", 40.0, bf16=400.0, tf32=200.0, links=slower, sm_count=114)
    spec = _load(tmp_path / "slower", hardware_entry(other))
    assert spec.nvlink_bandwidth == pytest.approx(380e9) and spec.nvlink_efficiency == pytest.approx(0.5)
    assert "link efficiency 0.500" in spec.sources


def test_calibrated_hardware_round_trips_through_its_file_entry(tmp_path):
    spec = _load(tmp_path, hardware_entry(_synthetic("NVIDIA H100 80GB HBM3", 85.0, bf16=700.0, tf32=380.0)))
    (tmp_path / "sub").mkdir()
    assert _load(tmp_path / "sub", spec.to_file_entry()) == spec
    assert "measured_fp16_tflops" not in spec.to_file_entry()  # not measured: left out, not written as null


def test_write_keeps_other_entries_of_an_existing_file(tmp_path):
    path = tmp_path / "hw.json"
    write_hardware_file(path, "a", hardware_entry(_synthetic("NVIDIA H100 80GB HBM3", 85.0, bf16=700, tf32=380)))
    write_hardware_file(path, "b", hardware_entry(_synthetic("NVIDIA A100-SXM4-40GB", 42.0, bf16=250, tf32=120)))
    merged = load_hardware_file(path)
    assert merged["a"].peak_bf16_flops == load_hardware("h100").peak_bf16_flops
    assert merged["b"].peak_bf16_flops == load_hardware("a100-40gb").peak_bf16_flops


def test_kernel_launch_floor_applies_to_kernels_only():
    roofline = Roofline(flops_per_s=1e12, bytes_per_s=1e12, launch_s=5e-6)
    assert roofline.seconds(0, 0) == 0.0  # a view launches nothing
    assert roofline.seconds(1e3, 1e3) == 5e-6  # a tiny kernel costs its launch
    assert roofline.seconds(1e9, 0) == pytest.approx(1e-3)  # a big one its roofline


def test_median_seconds_runs_warmup_then_repeats_of_inner_calls():
    calls = []
    seconds = median_seconds(lambda: calls.append(1), torch.device("cpu"), warmup=2, repeats=3, inner=4)
    assert len(calls) == 2 + 3 * 4 and seconds >= 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--device", "tpu"], "--device must be cpu or cuda"),
        (["--device", "cpu", "--dtype", "tf32"], "--dtype tf32 needs --device cuda"),
        (["--device", "cpu", "--dtype", "int8"], "--dtype 'int8' is not supported"),
        (["--device", "cpu", "--name", " "], "--name must be non-empty"),
    ],
)
def test_bad_options_are_one_line_errors(args, match):
    result = _run("calibrate", "--quick", *args)
    assert result.exit_code == 1 and match in result.output and len(result.output.strip().splitlines()) == 1


def test_cuda_without_cuda_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = _run("calibrate", "--device", "cuda", "--quick")
    assert result.exit_code == 1 and "CUDA is not available" in result.output
    with pytest.raises(Exception, match="CUDA is not available"):
        CalibrateConfig(device="cuda:0")


def test_bad_output_paths_are_refused_before_measuring(tmp_path):
    other = tmp_path / "notes.json"
    other.write_text('{"something": "else"}')
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for target, match in [(tmp_path, "is a directory"), (other, "schema_version"), (blocker / "hw.json", "cannot")]:
        result = _run("calibrate", "--device", "cpu", "--quick", "-o", target)
        assert result.exit_code == 1 and match in result.output, result.output
        assert "matmul" not in result.output
    assert other.read_text() == '{"something": "else"}'


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("options", "batch_size"),
    [(dict(layers=8, hidden=1024, heads=16, seq=1024), 8), (dict(layers=4, hidden=4096, heads=32, seq=2048), 2)],
)
def test_cuda_calibration_makes_analytic_match_bf16_autocast(tmp_path_factory, options, batch_size):
    """Calibrate this GPU, then the analytic whole-model F+B is within 10% of the measured bf16-mixed time."""
    from helpers.calibration_check import analytic_step_ms, measured_step_ms

    from pipeplan.models import load_model

    path = tmp_path_factory.getbasetemp() / "cuda-hw.json"
    if not path.exists():
        result = _run("calibrate", "--device", "cuda", "--name", "thisgpu", "-o", path)
        assert result.exit_code == 0, result.output
    spec = load_model("gpt", {k: str(v) for k, v in options.items()})
    hardware = load_hardware("thisgpu", hardware_file=path)
    measured = measured_step_ms(spec, batch_size, "cuda", dtype=torch.bfloat16)
    predicted = analytic_step_ms(spec, batch_size, hardware)
    assert measured / predicted == pytest.approx(1.0, abs=0.10), (measured, predicted)


@pytest.mark.slow
def test_a_failing_link_process_is_one_error_naming_the_rank():
    from pipeplan.calibrate.links import _run
    from pipeplan.calibrate.spec import SIZES
    from pipeplan.errors import RunError

    with pytest.raises(RunError, match=r"bogus link measurement between 2 processes failed \(rank \d: "):
        _run(2, "bogus", SIZES[("cpu", True)])


@pytest.mark.parametrize("autocast", [True, False])
def test_whole_model_check_runs_on_cpu_in_bf16(autocast):
    """The helpers the gpu test and bench_calibrate use, on a tiny model (autocast, or bf16 parameters)."""
    from helpers.calibration_check import analytic_step_ms, measured_step_ms

    from pipeplan.models import load_model

    spec = load_model("gpt", {"layers": "1", "hidden": "32", "heads": "2", "seq": "16"})
    measured = measured_step_ms(spec, 2, "cpu", dtype=torch.bfloat16, autocast=autocast, warmup=0, repeats=1)
    predicted = analytic_step_ms(spec, 2, load_hardware("h100"))
    assert measured > 0 and predicted > 0


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("measured_bf16_tflops", 0, "must be positive and finite"),
        ("measured_hbm_tb_per_s", float("inf"), "must be positive and finite"),
        ("kernel_launch_us", -1, "must be >= 0"),
        ("calibration", "text", "calibration must be a JSON object"),
    ],
)
def test_bad_calibrated_fields_are_format_errors(tmp_path, field, value, match):
    from pipeplan.errors import FormatError

    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"schema_version": 1, "hardware": {"h100": {field: value}}}))
    with pytest.raises(FormatError, match=match):
        load_hardware_file(path)
