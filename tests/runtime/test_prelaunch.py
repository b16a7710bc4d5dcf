"""`run` checks, before any rank starts, what every rank would fail on: --init-from keys, shapes and dtypes (no
tensor data read; one line naming the first bad key), and a model too large to build whole on this host without
an initializer for the meta path. None of these tests is marked slow: tests/conftest.py fails a test that starts a
process, so each refusal here is proven to come before the ranks. A Hugging Face base-model checkpoint (keys
without `model.`) maps onto the `*ForCausalLM` model as transformers maps it, says so, and every rank reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.runtime import build_reference_model, make_plan

from pipeplan.errors import ConfigError, RunError
from pipeplan.models import load_model
from pipeplan.runtime.launch.local import launch_local
from pipeplan.runtime.step.stages import build_pipeline_model
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.weights import materialize as mat

save_file = pytest.importorskip("safetensors.torch").save_file
QUIRKY = f"{Path(__file__).with_name('exact_models.py')}:quirky_lm"
LLAMA = {"num_hidden_layers": "2", "hidden_size": "32", "num_attention_heads": "4", "num_key_value_heads": "2"}
LLAMA.update({"intermediate_size": "64", "vocab_size": "64", "seq_len": "8"})


def _state(model: str, options: dict, seed: int = 7) -> dict[str, torch.Tensor]:
    whole = mat.build_whole(load_model(model, options), seed)
    return {k: v.detach().clone() for k, v in whole.state_dict().items()}


def _refused(plan_path: str, weights: Path) -> str:
    with pytest.raises(ConfigError) as info:
        launch_local(plan_path, RunConfig(steps=1, quiet=True, init_from=str(weights)))
    assert "\n" not in str(info.value)
    return str(info.value)


def test_bad_keys_shapes_and_dtypes_are_refused_before_any_rank_starts(tmp_path):
    path, _ = make_plan(tmp_path, "q", QUIRKY, {}, schedule="1f1b", pipeline_devices=2)
    state = _state(QUIRKY, {})
    missing = {k: v for k, v in state.items() if k != "blocks.1.gain"}
    torch.save(missing, tmp_path / "missing.pt")
    assert "misses 1 key(s) of the model: blocks.1.gain" in _refused(path, tmp_path / "missing.pt")
    shaped = {**state, "blocks.2.gain": torch.zeros(3)}
    save_file(shaped, str(tmp_path / "shape.safetensors"))
    message = _refused(path, tmp_path / "shape.safetensors")
    assert "holds 'blocks.2.gain' as (3,) F32, but the model's is (16,) torch.float32" in message
    integer = {**state, "blocks.0.gain": torch.zeros(16, dtype=torch.int64)}
    save_file(integer, str(tmp_path / "dtype.safetensors"))
    assert "holds 'blocks.0.gain' as (16,) I64" in _refused(path, tmp_path / "dtype.safetensors")


def test_a_model_too_large_for_this_host_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    path, _ = make_plan(tmp_path, "big", QUIRKY, {}, schedule="1f1b", pipeline_devices=2)
    monkeypatch.setattr(mat, "host_memory_available", lambda: 1024)
    with pytest.raises(RunError, match="too large to build whole on this host .* for 2 rank"):
        launch_local(path, RunConfig(steps=1, quiet=True))


def test_a_base_model_checkpoint_maps_onto_the_causal_lm(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    path, plan = make_plan(tmp_path, "llama", "hf:llama", LLAMA, schedule="1f1b", pipeline_devices=2)
    config = transformers.AutoConfig.for_model("llama", **{k: int(v) for k, v in LLAMA.items() if k != "seq_len"})
    torch.manual_seed(5)
    base = transformers.AutoModel.from_config(config)  # LlamaModel: keys without the "model." prefix
    base.save_pretrained(tmp_path / "base", safe_serialization=True)
    weights = next((tmp_path / "base").glob("*.safetensors"))
    saved = {k: v.clone() for k, v in base.state_dict().items()}
    assert not any(key.startswith("model.") for key in saved)

    from pipeplan.runtime.launch.prelaunch import check_before_launch

    check_before_launch(plan, RunConfig(steps=1, quiet=True, init_from=str(weights)))
    said = " ".join(capsys.readouterr().err.split())
    assert "holds the base model (keys without the 'model' prefix)" in said and "lm_head.weight keep" in said

    _, seeded = build_reference_model(plan)
    held = set()
    for rank in range(2):
        model = build_pipeline_model(plan, rank, torch.device("cpu"), init_from=str(weights))
        for name, param in model.params.items():
            expected = saved[name.removeprefix("model.")] if name.startswith("model.") else seeded.get_parameter(name)
            assert torch.equal(param.detach(), expected), name
            held.add(name)
    assert "lm_head.weight" in held and len(held) == len(saved) + 1  # the head keeps the plan seed's values
