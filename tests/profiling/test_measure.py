"""Measured profiler: structure of the Profile, memory accounting, parameter ownership and (loose) fidelity."""

from __future__ import annotations

import time

import pytest
import torch

from pipeplan.errors import ConfigError
from pipeplan.graph.trace import trace_model
from pipeplan.models import load_model
from pipeplan.profiling import rounds
from pipeplan.profiling.consistency import sums_over_whole
from pipeplan.profiling.measure import MeasureConfig, profile_model, profile_traced
from pipeplan.profiling.measured_times import SPLIT_UNIT
from pipeplan.profiling.profile import Profile
from pipeplan.profiling.timed_units import LayerUnit, WholeUnit

SMALL_GPT = dict(layers=2, hidden=32, heads=2, seq=16, vocab=64)


def _quick(ref, options, batch_size=2, **kwargs):
    kwargs = {"precision": "fp32", **kwargs}
    return profile_model(load_model(ref, options), batch_size=batch_size, warmup=0, repeats=1, progress=False, **kwargs)


def test_profile_structure_and_provenance(tmp_path):
    profile = _quick("gpt", SMALL_GPT, batch_size=3)
    assert [layer.name for layer in profile.layers] == ["embed", "blocks.0", "blocks.1", "head"]
    assert profile.cut_bytes == (3 * 16 * 32 * 4,) * 3
    assert profile.input_bytes == 3 * 16 * 8  # int64 token ids
    for layer in profile.layers:
        for value in (layer.forward_ms, layer.input_grad_ms, layer.weight_grad_ms, layer.backward_ms):
            assert value >= 0
        assert layer.activation_kept_until_weight_grad_bytes >= 0
    block = profile.layers[1]
    assert block.forward_ms > 0 and block.backward_ms > 0 and block.weight_grad_ms > 0
    assert block.flops > 0 and block.output_bytes == 3 * 16 * 32 * 4
    assert block.peak_memory_bytes == 0  # only measured on CUDA
    source = profile.provenance
    assert source.source == "measured" and source.device == "cpu" and source.dtype == "float32"
    assert source.batch_size == 3 and source.torch_version == torch.__version__
    assert source.tokens_per_sample == 16 and source.model == "gpt" and source.model_options["hidden"] == 32
    assert len(source.graph_fingerprint) == 16 and "timer=wall" in source.notes
    assert profile.whole_forward_ms > 0 and profile.whole_backward_ms > 0 and profile.whole_split_backward_ms > 0
    assert profile.measurement.rounds == 1 and profile.measurement.clock == "wall"
    assert all(layer.spread.samples >= 1 for layer in profile.layers)
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile


def test_first_layer_with_token_ids_has_no_input_gradient_work():
    profile = _quick("gpt", SMALL_GPT)
    embed = profile.layers[0]
    assert embed.activation_freed_by_input_grad_bytes == 0  # everything embed saves is for W


def test_mlp_activation_accounting_is_exact():
    """Linear + ReLU: Linear saves its input (kept for W: dW = x^T g); ReLU saves its output (only I needs it). The
    last layer's loss, mse_loss(output, target), saves both: the output is ReLU's (counted once), the target is
    one more tensor, freed by I."""
    batch, hidden = 4, 16
    profile = _quick("mlp", dict(layers=3, hidden=hidden), batch_size=batch)
    tensor = batch * hidden * 4
    for layer, loss in zip(profile.layers, (0, 0, tensor), strict=True):
        assert layer.activation_bytes == 2 * tensor + loss
        assert layer.activation_freed_by_input_grad_bytes == tensor + loss
        assert layer.param_count == hidden * hidden + hidden
        assert layer.param_bytes == 4 * layer.param_count
    assert profile.cut_bytes == (tensor, tensor)


def test_tied_parameters_are_counted_once_in_the_first_layer():
    tied = _quick("gpt", {**SMALL_GPT, "tie_embeddings": True})
    untied = _quick("gpt", SMALL_GPT)
    assert tied.layers[0].param_count == untied.layers[0].param_count
    assert tied.layers[-1].param_count == untied.layers[-1].param_count - 64 * 32
    module = load_model("gpt", {**SMALL_GPT, "tie_embeddings": True}).build()
    assert sum(layer.param_count for layer in tied.layers) == sum(p.numel() for p in module.parameters())


def test_resnet_profile_and_granularity():
    profile = _quick("resnet", dict(blocks=2, channels=8, image=8))
    assert len(profile.layers) == 4 and len(profile.cut_bytes) == 3
    assert profile.cut_bytes[1] == 2 * (2 * 8 * 8 * 8 * 4)  # block output + long skip
    coarse = _quick("resnet", dict(blocks=2, channels=8, image=8), granularity=1)
    assert [layer.name for layer in coarse.layers] == ["stem", "blocks", "head"]


def test_bad_settings_raise_config_errors():
    with pytest.raises(ConfigError, match="--repeats"):
        MeasureConfig(batch_size=1, repeats=0)
    with pytest.raises(ConfigError, match="--warmup"):
        MeasureConfig(batch_size=1, warmup=-1)
    with pytest.raises(ConfigError, match="--batch-size"):
        MeasureConfig(batch_size=0)
    with pytest.raises(ConfigError, match="--hardware"):
        MeasureConfig(batch_size=1, device="meta")
    with pytest.raises(ConfigError, match="--timer"):
        MeasureConfig(batch_size=1, timer="sundial")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            MeasureConfig(batch_size=1, device="cuda")


def test_layer_sums_agree_with_the_whole_model_loosely():
    """The benchmark holds the real targets (15% / 25%) and the profiler re-measures outside 0.8-1.25; here 1.5x
    for F, I+W (against the whole model's split backward) and B, any of 4 attempts (the shared 2-core VM)."""
    spec = load_model("gpt", dict(layers=2, hidden=128, heads=4, seq=64, vocab=256))
    attempts = []
    for _ in range(4):
        profile = profile_model(spec, batch_size=4, warmup=1, repeats=5, progress=False, timer="cpu", precision="fp32")
        ratios = sums_over_whole(profile)
        attempts.append(ratios)
        if all(1 / 1.5 <= ratio <= 1.5 for ratio in ratios.values()):
            return
    pytest.fail(f"layer sums far from whole-model timings in every attempt: {attempts}")


def _traced(options: dict, batch_size: int = 2):
    traced = trace_model(load_model("gpt", options), batch_size=batch_size, device="cpu")
    traced.module.train()
    return traced


class StandInEvent:
    """torch.cuda.Event's timing API on the host clock; reading a pair before a synchronize fails (CUDA: the
    events may not have been reached yet)."""

    synced = False

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()
        StandInEvent.synced = False

    def elapsed_time(self, end: StandInEvent) -> float:
        assert StandInEvent.synced, "event pair read before synchronize"
        return (end.at - self.at) * 1e3


def test_the_cuda_event_path_runs_the_same_rounds_without_a_gpu():
    syncs = []

    def synchronize() -> None:
        syncs.append(1)
        StandInEvent.synced = True

    config = MeasureConfig(batch_size=2, warmup=1, repeats=3, precision="fp32")
    clock = rounds.EventClock(StandInEvent, synchronize)
    profile = profile_traced(_traced(SMALL_GPT), config, progress=False, clock=clock)
    assert profile.measurement.clock == "cuda-events" and len(syncs) >= 1 + 3  # one per round
    assert all(layer.forward_ms > 0 and layer.backward_ms > 0 for layer in profile.layers)
    assert profile.whole_forward_ms > 0 and profile.whole_split_backward_ms > 0


THREE_BLOCKS = {**SMALL_GPT, "layers": 3}  # embed, 3 peers, head


def _synthetic_times(monkeypatch, slowed_samples: int) -> None:
    """Every layer pass takes 1 ms and the whole-model references their layers' sums (the real passes still run);
    blocks.1's forward takes 50 ms more in its first `slowed_samples` samples (warm-up included)."""
    layer_sample, whole_sample = LayerUnit.sample, WholeUnit.sample
    layers, calls = 5, {"blocks.1": 0}

    def timed_layer(self, clock):
        readings = layer_sample(self, clock)
        ms = {key: float(layers - 1 if self.name == SPLIT_UNIT else 1) for key in readings}
        if self.name == "blocks.1":
            calls["blocks.1"] += 1
            ms["forward"] += 50.0 * (calls["blocks.1"] <= slowed_samples)
        return ms

    def timed_whole(self, clock):
        return {key: float(layers) for key in whole_sample(self, clock)}

    monkeypatch.setattr(LayerUnit, "sample", timed_layer)
    monkeypatch.setattr(WholeUnit, "sample", timed_whole)


def test_a_layer_slowed_through_its_first_measurement_is_re_measured(monkeypatch, console_warnings):
    _synthetic_times(monkeypatch, slowed_samples=1 + 5)
    config = MeasureConfig(batch_size=2, warmup=1, repeats=5, precision="fp32")
    profile = profile_traced(_traced(THREE_BLOCKS), config, progress=False, clock=rounds.HostClock())
    assert profile.layers[2].name == "blocks.1" and profile.layers[2].forward_ms == 1.0
    assert profile.measurement.attempts == 2 and "blocks.1" in profile.measurement.remeasured
    assert profile.whole_split_backward_ms == 2 * 5 and console_warnings() == []


def test_a_layer_slowed_throughout_is_kept_with_a_warning_naming_it(monkeypatch, console_warnings):
    _synthetic_times(monkeypatch, slowed_samples=10**6)
    config = MeasureConfig(batch_size=2, warmup=0, repeats=3, precision="fp32")
    profile = profile_traced(_traced(THREE_BLOCKS), config, progress=False, clock=rounds.HostClock())
    assert profile.layers[2].forward_ms == 51.0
    assert 2 <= profile.measurement.attempts <= 1 + rounds.MAX_REMEASUREMENTS
    (warning,) = console_warnings()
    assert warning.startswith("warning: profile timings out of bounds after") and "blocks.1 F 51.00x" in warning


@pytest.mark.gpu
def test_cuda_profile():
    profile = _quick("gpt", SMALL_GPT, device="cuda")
    assert profile.provenance.device.startswith("cuda:")
    assert all(layer.forward_ms > 0 for layer in profile.layers[1:])
    assert profile.layers[1].peak_memory_bytes > 0
