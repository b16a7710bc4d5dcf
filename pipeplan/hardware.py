"""Hardware presets for analytic profiles and cluster descriptions: h100 (SXM5 80GB), h200, a100-40gb, a100-80gb,
b200 and mi300x.

The figures live in `hardware.json` beside this file, in datasheet units, with a `sources` note per entry that
names where every figure comes from: peaks, memory and link bandwidths and `sm_count` from vendor datasheets and
whitepapers; the efficiencies from published measurements (cuBLAS / hipBLASLt large matmuls, BabelStream copy,
FlashAttention forward+backward, nccl-tests / rccl-tests bus bandwidth), each marked where no measurement of that
GPU exists and the nearest documented figure stands in. What the efficiencies mean (the analytic model's terms):

- `matmul_efficiency`: the fraction of the dense peak a FULL WAVE of large matmul tiles reaches (FP8 matmuls:
  `fp8_matmul_efficiency` of the FP8 peak where measured);
  `profiling.kernels` adds tile and wave quantization over `sm_count` SMs (AMD: compute units) on top, so small and
  skinny matmuls come out below it. `attention_efficiency`: the same for FlashAttention's thread blocks (None: as
  matmuls); `flash2_attention_efficiency`: FlashAttention-2's, where the GPU's usual kernel is a later one (Hopper).
- `memory_efficiency`: the fraction of HBM bandwidth a streaming kernel reaches (STREAM-like copy / datasheet).
- `nvlink_efficiency`, `network_efficiency`: collectives' achieved bus bandwidth / the link's datasheet bandwidth
  (`cluster_for` multiplies them in). `nvlink_gb_per_s` is the intra-node fabric whatever its name (MI300X:
  Infinity Fabric, 7 links summed; see its `sources`).

A user file (`--hardware-file`) has the same shape: `{"schema_version": 1, "hardware": {name: {...}}}`; an entry
named like a preset overrides only the fields it gives, a new name must give them all. `pipeplan calibrate` writes
such entries (see pipeplan/calibrate/hardware_file.py): on a GPU the fitted `matmul_efficiency` and `sm_count`, on a
CPU (no SMs) `measured_*` matmul figures, which `Hardware.matmul_flops_per_s` prefers over peak x efficiency. A
measured matmul rate already contains the quantization of the shapes it was measured at, so an entry may not
combine `measured_bf16/fp16/tf32_tflops` with `sm_count` (the kernel model would count it twice).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeplan.cluster import Cluster
from pipeplan.errors import ConfigError, FormatError, PipeplanError
from pipeplan.jsonio import read_json

if TYPE_CHECKING:
    import torch

HARDWARE_SCHEMA_VERSION = 1


def _dtype_name(dtype: torch.dtype) -> str:
    """float32, bfloat16, float16: a torch dtype's name, read without importing torch (plans from files do not)."""
    return str(dtype).removeprefix("torch.")


_PRESETS_PATH = Path(__file__).with_name("hardware.json")

# JSON field -> (Hardware attribute, scale to SI units)
_FILE_FIELDS: dict[str, tuple[str, float]] = {
    "peak_bf16_tflops": ("peak_bf16_flops", 1e12),
    "peak_tf32_tflops": ("peak_tf32_flops", 1e12),
    "memory_mib": ("memory_bytes", 2**20),  # as nvidia-smi / rocm-smi report it (H100 80GB: 81,559 MiB)
    "hbm_tb_per_s": ("hbm_bandwidth", 1e12),
    "nvlink_gb_per_s": ("nvlink_bandwidth", 1e9),
    "network_gb_per_s": ("network_bandwidth", 1e9),
    "intra_node_latency_us": ("intra_node_latency_s", 1e-6),
    "inter_node_latency_us": ("inter_node_latency_s", 1e-6),
    "matmul_efficiency": ("matmul_efficiency", 1.0),
    "memory_efficiency": ("memory_efficiency", 1.0),
    "attention_efficiency": ("attention_efficiency", 1.0),
    "flash2_attention_efficiency": ("flash2_attention_efficiency", 1.0),
    "nvlink_efficiency": ("nvlink_efficiency", 1.0),
    "network_efficiency": ("network_efficiency", 1.0),
    "sm_count": ("sm_count", 1.0),
    "peak_fp8_tflops": ("peak_fp8_flops", 1e12),
    "fp8_matmul_efficiency": ("fp8_matmul_efficiency", 1.0),
    # optional, written by `pipeplan calibrate` (pipeplan/calibrate/hardware_file.py): what this machine achieved;
    # the matmul rates only without sm_count (a CPU), see the module docstring
    "measured_bf16_tflops": ("measured_bf16_flops", 1e12),
    "measured_fp16_tflops": ("measured_fp16_flops", 1e12),
    "measured_tf32_tflops": ("measured_tf32_flops", 1e12),
    "measured_hbm_tb_per_s": ("measured_hbm_bandwidth", 1e12),
    "kernel_launch_us": ("kernel_launch_s", 1e-6),
    # the kernel model's per-kernel terms and clocks (profiling.kernels): optional, 0 / None when not given
    "gemm_overhead_us": ("gemm_overhead_s", 1e-6),
    "gemm_epilogue_exposed": ("epilogue_exposed", 1.0),
    "gemm_tile_reuse_half": ("tile_reuse_half", 1.0),
    "boost_clock_mhz": ("boost_clock_hz", 1e6),
    "training_clock_mhz": ("training_clock_hz", 1e6),
}
_READ_ONLY_FIELDS = {"hbm_gb": ("memory_bytes", 1e9)}  # older files: memory in decimal GB (never written)
_TEXT_FIELDS = ("description", "sources")
_BOOL_FIELDS = ("stream_k",)  # JSON true / false
_RECORD_FIELDS = ("calibration",)  # free-form JSON objects kept in the file for people; the model reads none
_REQUIRED_ATTRS = frozenset(
    ("peak_bf16_flops", "peak_tf32_flops", "memory_bytes", "hbm_bandwidth", "nvlink_bandwidth", "network_bandwidth")
)


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator kind, in SI units (FLOP/s, bytes, bytes/s one direction per GPU, seconds)."""

    name: str
    peak_bf16_flops: float  # dense tensor-core bf16/fp16
    peak_tf32_flops: float  # dense tensor-core tf32 (float32 matmuls)
    memory_bytes: int
    hbm_bandwidth: float
    nvlink_bandwidth: float  # per GPU, one direction
    network_bandwidth: float  # per GPU, one direction (e.g. 400 Gb/s InfiniBand = 50e9)
    intra_node_latency_s: float = 10e-6
    inter_node_latency_s: float = 20e-6
    matmul_efficiency: float = 0.6  # fraction of peak a full wave of large matmul tiles reaches (profiling.kernels)
    memory_efficiency: float = 0.75  # fraction of HBM bandwidth a memory-bound kernel reaches
    attention_efficiency: float | None = None  # fraction of peak FlashAttention reaches (None: matmul_efficiency)
    # FlashAttention-2's fraction where `attention_efficiency` is a later kernel's (Hopper: FlashAttention-3 / cuDNN);
    # what `--attention flash2` times (None: attention_efficiency)
    flash2_attention_efficiency: float | None = None
    nvlink_efficiency: float = 1.0  # fraction of the intra-node link's bandwidth collectives reach (bus bandwidth)
    network_efficiency: float = 1.0  # the same for the inter-node network
    sm_count: int | None = None  # streaming multiprocessors (compute units): tile and wave quantization
    peak_fp8_flops: float | None = None  # dense FP8 tensor-core peak (None: no FP8)
    fp8_matmul_efficiency: float | None = None  # matmul_efficiency of FP8 matmuls (None: the bf16 one)
    # measured by `pipeplan calibrate`; when given they replace peak x efficiency (see `matmul_flops_per_s`)
    measured_bf16_flops: float | None = None
    measured_fp16_flops: float | None = None
    measured_tf32_flops: float | None = None  # float32 matmuls (TF32 on tensor cores; plain fp32 on a CPU)
    measured_hbm_bandwidth: float | None = None
    kernel_launch_s: float = 0.0  # GPU: what one more kernel launch adds; CPU calibration: an op's time floor
    gemm_overhead_s: float = 0.0  # a matmul or attention kernel's launch and ramp (profiling.kernels)
    epilogue_exposed: float = 0.0  # the share of a matmul tile's output write that does not hide behind math
    tile_reuse_half: float = 0.0  # the operand reuse at which a matmul tile's loads take as long as its math
    stream_k: bool = False  # its matmul library spreads a partial last wave over every SM (profiling.kernels)
    boost_clock_hz: float | None = None  # the SM clock the efficiencies were measured at (short runs: max boost)
    training_clock_hz: float | None = None  # the SM clock a training GPU holds at its power limit
    description: str = ""
    sources: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("hardware name must be non-empty")
        positive = ("peak_bf16_flops", "peak_tf32_flops", "memory_bytes", "hbm_bandwidth")
        for attr in (
            *positive,
            "nvlink_bandwidth",
            "network_bandwidth",
            "sm_count",
            "peak_fp8_flops",
            "boost_clock_hz",
            "training_clock_hz",
            *_MEASURED_ATTRS,
        ):
            value = getattr(self, attr)
            if value is not None and not 0 < value < math.inf:
                raise ConfigError(f"hardware {self.name!r}: {attr} must be positive and finite, got {value!r}")
        for attr in ("kernel_launch_s", "gemm_overhead_s", "epilogue_exposed", "tile_reuse_half"):
            if not 0 <= getattr(self, attr) < math.inf:
                raise ConfigError(
                    f"hardware {self.name!r}: {attr} must be >= 0 and finite, got {getattr(self, attr)!r}"
                )
        for attr in ("intra_node_latency_s", "inter_node_latency_s"):
            if not getattr(self, attr) >= 0:
                raise ConfigError(f"hardware {self.name!r}: {attr} must be >= 0, got {getattr(self, attr)!r}")
        for attr in ("matmul_efficiency", "memory_efficiency", "nvlink_efficiency", "network_efficiency"):
            if not 0 < getattr(self, attr) <= 1:
                raise ConfigError(f"hardware {self.name!r}: {attr} must lie in (0, 1], got {getattr(self, attr)!r}")
        for attr in ("attention_efficiency", "flash2_attention_efficiency", "fp8_matmul_efficiency"):
            if getattr(self, attr) is not None and not 0 < getattr(self, attr) <= 1:
                raise ConfigError(f"hardware {self.name!r}: {attr} must lie in (0, 1]")
        if self.sm_count is not None and self.sm_count != int(self.sm_count):
            raise ConfigError(f"hardware {self.name!r}: sm_count must be a whole number, got {self.sm_count!r}")
        measured = [attr for attr in _MEASURED_MATMUL_ATTRS if getattr(self, attr) is not None]
        if self.sm_count is not None and measured:
            raise ConfigError(
                f"hardware {self.name!r}: {measured[0]} with sm_count would count tile and wave quantization twice "
                "(a measured matmul rate already contains it); give matmul_efficiency instead (pipeplan calibrate "
                "writes it on a GPU) or leave out sm_count (an entry named like a preset inherits its sm_count: "
                "choose another name)"
            )

    @property
    def attention_fraction(self) -> float:
        return self.matmul_efficiency if self.attention_efficiency is None else self.attention_efficiency

    @property
    def clock_ratio(self) -> float:
        """The SM clock a training GPU holds over the clock its efficiencies were measured at (1 when either is
        not given): tensor-core work (matmuls, attention) runs this much slower in a training run than in the short
        benchmarks the efficiencies come from; memory-bound kernels, paced by HBM, do not."""
        if self.boost_clock_hz is None or self.training_clock_hz is None:
            return 1.0
        return self.training_clock_hz / self.boost_clock_hz

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Dense matmul peak for `dtype`: bf16/fp16 tensor cores, else TF32 (float32 matmuls on tensor cores)."""
        if _dtype_name(dtype) in ("bfloat16", "float16"):
            return self.peak_bf16_flops
        return self.peak_tf32_flops

    def measured_flops(self, dtype: torch.dtype) -> float | None:
        """The calibrated dense matmul FLOP/s for `dtype` (None when not calibrated)."""
        if _dtype_name(dtype) == "bfloat16":
            return self.measured_bf16_flops
        if _dtype_name(dtype) == "float16":
            return self.measured_fp16_flops or self.measured_bf16_flops
        return self.measured_tf32_flops

    def matmul_flops_per_s(self, dtype: torch.dtype, efficiency: float | None = None) -> float:
        """The matmul rate the analytic model uses: peak x `efficiency` when one is given (an explicit override),
        else the calibrated figure when there is one (entries without `sm_count` only: a CPU calibration), else peak
        x matmul_efficiency (with `sm_count`: a full wave's rate, which profiling.kernels quantizes)."""
        measured = self.measured_flops(dtype)
        if efficiency is None and measured is not None:
            return measured
        return self.peak_flops(dtype) * (efficiency or self.matmul_efficiency) * self.clock_ratio

    def attention_flops_per_s(self, dtype: torch.dtype, *, flash2: bool = False) -> float:
        """FlashAttention's rate the analytic model uses: peak x attention efficiency x `clock_ratio`; `flash2`:
        FlashAttention-2's kernels (`flash2_attention_efficiency` where the preset gives one)."""
        fraction = (flash2 and self.flash2_attention_efficiency) or self.attention_fraction
        return self.peak_flops(dtype) * fraction * self.clock_ratio

    def fp8_matmul_flops_per_s(self, efficiency: float | None = None) -> float | None:
        """FP8 linears' full-wave rate: the FP8 peak x `efficiency` when one is given (an explicit override), else
        x fp8_matmul_efficiency (cuBLASLt's FP8 GEMMs reach a lower fraction of their peak than bf16's), else x
        matmul_efficiency. None without an FP8 peak."""
        if self.peak_fp8_flops is None:
            return None
        fraction = efficiency or self.fp8_matmul_efficiency or self.matmul_efficiency
        return self.peak_fp8_flops * fraction * self.clock_ratio

    def memory_bytes_per_s(self, efficiency: float | None = None) -> float:
        """The memory-bound rate the analytic model uses (same precedence as `matmul_flops_per_s`)."""
        if efficiency is None and self.measured_hbm_bandwidth is not None:
            return self.measured_hbm_bandwidth
        return self.hbm_bandwidth * (efficiency or self.memory_efficiency)

    def to_file_entry(self) -> dict[str, Any]:
        """The entry as `hardware.json` writes it (datasheet units; unset optional figures left out)."""
        entry: dict[str, Any] = {key: getattr(self, key) for key in _TEXT_FIELDS}
        entry.update({key: True for key in _BOOL_FIELDS if getattr(self, key)})
        for key, (attr, scale) in _FILE_FIELDS.items():
            value = getattr(self, attr)
            if value is not None and not (attr in _ZERO_DEFAULTS and value == 0):
                entry[key] = value / scale
        return entry


_ZERO_DEFAULTS = ("kernel_launch_s", "gemm_overhead_s", "epilogue_exposed", "tile_reuse_half")  # 0: not written
_MEASURED_MATMUL_ATTRS = ("measured_bf16_flops", "measured_fp16_flops", "measured_tf32_flops")
_MEASURED_ATTRS = (*_MEASURED_MATMUL_ATTRS, "measured_hbm_bandwidth")


def _entry_to_kwargs(entry: Any, *, where: str, base: dict[str, Any] | None) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise FormatError(f"{where} must be a JSON object")
    known = set(_FILE_FIELDS) | set(_TEXT_FIELDS) | set(_RECORD_FIELDS) | set(_BOOL_FIELDS)
    unknown = sorted(set(entry) - known - set(_READ_ONLY_FIELDS))
    if unknown:
        raise FormatError(f"{where} has unknown field(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    if "hbm_gb" in entry and "memory_mib" in entry:
        raise FormatError(f"{where} gives both memory_mib and hbm_gb: keep memory_mib (the driver's figure)")
    kwargs = dict(base or {})
    for key, value in entry.items():
        if key in _RECORD_FIELDS:
            if not isinstance(value, dict):
                raise FormatError(f"{where}: {key} must be a JSON object")
            continue
        if key in _TEXT_FIELDS:
            if not isinstance(value, str):
                raise FormatError(f"{where}: {key} must be a string")
            kwargs[key] = value
            continue
        if key in _BOOL_FIELDS:
            if not isinstance(value, bool):
                raise FormatError(f"{where}: {key} must be true or false, got {value!r}")
            kwargs[key] = value
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise FormatError(f"{where}: {key} must be a number, got {value!r}")
        attr, scale = _FILE_FIELDS.get(key) or _READ_ONLY_FIELDS[key]
        if attr == "sm_count" and not float(value).is_integer():
            raise FormatError(f"{where}: sm_count must be a whole number, got {value!r}")
        kwargs[attr] = int(value * scale) if attr in ("memory_bytes", "sm_count") else float(value * scale)
    required = [key for key, (attr, _) in _FILE_FIELDS.items() if attr not in kwargs and attr in _REQUIRED_ATTRS]
    if required:
        raise FormatError(f"{where} is missing field(s): {', '.join(required)}")
    return kwargs


def _parse_entries(data: dict[str, Any], *, where: str, base: dict[str, Hardware]) -> dict[str, Hardware]:
    entries = data.get("hardware")
    if not isinstance(entries, dict) or not entries:
        raise FormatError(f"{where} needs a non-empty 'hardware' object mapping names to entries")
    result = dict(base)
    for raw_name, entry in entries.items():
        name = str(raw_name).strip().lower()
        previous = base.get(name)
        start = {f.name: getattr(previous, f.name) for f in fields(Hardware)} if previous else None
        kwargs = _entry_to_kwargs(entry, where=f"{where} entry {name!r}", base=start)
        kwargs["name"] = name
        try:
            result[name] = Hardware(**kwargs)
        except ConfigError as exc:
            raise FormatError(f"{where}: {exc}") from None
    return result


_PRESETS: dict[str, Hardware] | None = None


def hardware_presets() -> dict[str, Hardware]:
    """The built-in presets by name (read once from hardware.json)."""
    global _PRESETS
    if _PRESETS is None:
        data = json.loads(_PRESETS_PATH.read_text())
        assert data.get("schema_version") == HARDWARE_SCHEMA_VERSION, "hardware.json schema mismatch"
        _PRESETS = _parse_entries(data, where="hardware.json", base={})
    return dict(_PRESETS)


def validate_hardware_data(data: dict[str, Any], *, where: str) -> dict[str, Hardware]:
    """The entries a hardware-file's contents would give (presets merged); a bad entry is a FormatError."""
    return _parse_entries(data, where=where, base=hardware_presets())


def load_hardware_file(path: str | os.PathLike) -> dict[str, Hardware]:
    """Presets merged with the entries of a `--hardware-file` (file entries override presets field by field)."""
    where = f"hardware file {str(path)!r}"
    data = read_json(path, kind="hardware", schema_version=HARDWARE_SCHEMA_VERSION)
    return _parse_entries(data, where=where, base=hardware_presets())


def load_hardware(name: str | Hardware, *, hardware_file: str | os.PathLike | None = None) -> Hardware:
    """A preset (or an entry of `hardware_file`) by name; an unknown name is a ConfigError listing the names."""
    if isinstance(name, Hardware):
        return name
    available = load_hardware_file(hardware_file) if hardware_file is not None else hardware_presets()
    key = name.strip().lower()
    if not key:
        raise ConfigError(f"--hardware NAME is needed; choose one of: {', '.join(sorted(available))}")
    if key not in available:
        raise ConfigError(f"unknown --hardware {name!r}; choose one of: {', '.join(sorted(available))}")
    return available[key]


def resolve_hardware(name: str | None, hardware_file: str | os.PathLike | None = None) -> Hardware | None:
    """`--hardware` as every command reads it, once: a preset by name, or `FILE.json[:NAME]` (an entry of a file of
    `pipeplan calibrate`: its only one when NAME is left out), or NAME with `--hardware-file FILE`; None when neither
    is given. A file with several entries and no name is refused in one line listing them."""
    if name is None and hardware_file is None:
        return None
    if hardware_file is None and name is not None:
        path, sep, entry = name.rpartition(":")
        if _names_file(name):
            hardware_file, name = name, _only_entry(name)
        elif sep and _names_file(path):
            hardware_file, name = path, entry
    return load_hardware(name or "", hardware_file=hardware_file)


def _names_file(text: str) -> bool:
    return text.lower().endswith(".json") or os.path.isfile(text)  # no name: one line listing the file's names


def _only_entry(path: str) -> str:
    """The name of the one entry a hardware file adds ("" when it has none or several: the caller lists them)."""
    try:
        data = read_json(path, kind="hardware", schema_version=HARDWARE_SCHEMA_VERSION)
    except PipeplanError:
        return ""  # load_hardware_file says what is wrong with it, in one line
    entries = data.get("hardware") if isinstance(data, dict) else None
    return next(iter(entries)) if isinstance(entries, dict) and len(entries) == 1 else ""


def cluster_for(hardware: str | Hardware, num_devices: int, devices_per_node: int = 8) -> Cluster:
    """A Cluster of `num_devices` such GPUs: memory = HBM, intra-node = NVLink, inter-node = network."""
    spec = load_hardware(hardware)
    return Cluster(
        num_devices=num_devices,
        devices_per_node=devices_per_node,
        memory_per_device=spec.memory_bytes,
        intra_node_bandwidth=spec.nvlink_bandwidth * spec.nvlink_efficiency,
        inter_node_bandwidth=spec.network_bandwidth * spec.network_efficiency,
        intra_node_latency_s=spec.intra_node_latency_s,
        inter_node_latency_s=spec.inter_node_latency_s,
        hardware=spec.name,
    )
