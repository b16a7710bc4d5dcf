"""`--init-from FILE`: a whole-model state_dict (.pt or .safetensors) sets every rank's initial weights (only its
stages' tensors are read); missing, unexpected or mis-shaped keys are one line; non-persistent buffers keep the
factory's values; a tie saved under one name fills both; --resume with --init-from is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.runtime import build_reference_model, make_plan

from pipeplan.errors import ConfigError
from pipeplan.graph.trace import trace_module
from pipeplan.models import load_model
from pipeplan.runtime.step.stages import build_pipeline_model
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.weights import materialize as mat

save_file = pytest.importorskip("safetensors.torch").save_file  # the [hf] extra
QUIRKY = f"{Path(__file__).with_name('exact_models.py')}:quirky_lm"


def _other_state(options: dict, seed: int = 99) -> dict[str, torch.Tensor]:
    """A state_dict unlike the plan-seed build (a different mask too): what a pretrained checkpoint would be."""
    whole = mat.build_whole(load_model(QUIRKY, options), seed)
    state = {k: v.detach() + 0.5 if v.is_floating_point() else v.clone() for k, v in whole.state_dict().items()}
    state["blocks.0.mask"] = torch.ones_like(state["blocks.0.mask"])  # used only through a torch.fx constant
    return state


def _assert_ranks_hold(plan, state: dict[str, torch.Tensor], init_from: str) -> None:
    """Every rank's tensors are the file's, the factory's (non-persistent buffers) or torch.fx constants computed
    from those; and the file differs from the plan-seed build, so the check can fail."""
    spec = load_model(QUIRKY, dict(plan.model.options))
    loaded = mat.build_whole(spec, plan.training.seed)
    seed_built = {k: v.clone() for k, v in loaded.state_dict().items()}
    loaded.load_state_dict(state, strict=False)
    constants = trace_module(loaded, spec).graph_module
    assert not torch.equal(constants.get_buffer("_tensor_constant1"), ~seed_built["blocks.0.mask"])
    for rank in range(plan.world_size):
        model = build_pipeline_model(plan, rank, torch.device("cpu"), init_from=init_from)
        for module in model.modules.values():
            for name, tensor in mat.named_tensors(module):
                assert torch.equal(tensor, mat.lookup(loaded, constants, name=name)), name
                if name in state and tensor.is_floating_point():
                    assert not torch.equal(tensor, seed_built[name]), name


def test_pt_state_dict_sets_every_ranks_weights(tmp_path):
    _, plan = make_plan(tmp_path, "p", QUIRKY, {}, schedule="1f1b", pipeline_devices=3)
    state = _other_state({})
    torch.save(state, tmp_path / "w.pt")
    _assert_ranks_hold(plan, state, str(tmp_path / "w.pt"))
    _, reference = build_reference_model(plan, init_from=str(tmp_path / "w.pt"))
    for name, value in state.items():
        assert torch.equal(reference.state_dict()[name], value)


def test_safetensors_with_a_tie_saved_once(tmp_path):
    _, plan = make_plan(tmp_path, "s", QUIRKY, {"tie": True}, schedule="zbv", pipeline_devices=2)
    state = _other_state({"tie": True})
    del state["head.proj.weight"]  # as save_pretrained does: a tie is stored under one name
    save_file(state, str(tmp_path / "w.safetensors"))
    _assert_ranks_hold(plan, state, str(tmp_path / "w.safetensors"))
    model = build_pipeline_model(plan, 0, torch.device("cpu"), init_from=str(tmp_path / "w.safetensors"))
    head = model.modules[3].get_parameter("head.proj.weight")
    assert head is model.modules[0].get_parameter("embed.tok.weight")
    assert torch.equal(head, state["embed.tok.weight"])


def test_a_directory_of_safetensors_shards(tmp_path):
    _, plan = make_plan(tmp_path, "d", QUIRKY, {}, schedule="1f1b", pipeline_devices=2)
    state = _other_state({})
    keys = sorted(state)
    shards = tmp_path / "hf-dir"
    shards.mkdir()
    save_file({k: state[k] for k in keys[::2]}, str(shards / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in keys[1::2]}, str(shards / "model-00002-of-00002.safetensors"))
    _assert_ranks_hold(plan, state, str(shards))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_missing_and_unexpected_keys_are_one_line(tmp_path, suffix):
    _, plan = make_plan(tmp_path, "m", QUIRKY, {}, schedule="1f1b", pipeline_devices=2)
    state = _other_state({})
    for key in ("blocks.0.gain", "blocks.1.gain", "blocks.2.gain", "blocks.3.gain", "head.norm.weight"):
        del state[key]
    state["extra.weight"] = torch.zeros(2)
    path = tmp_path / f"w{suffix}"
    torch.save(state, path) if suffix == ".pt" else save_file(state, str(path))
    with pytest.raises(ConfigError) as info:
        build_pipeline_model(plan, 0, torch.device("cpu"), init_from=str(path))
    message = str(info.value)
    assert "\n" not in message
    assert "misses 5 key(s)" in message and "blocks.0.gain" in message and "(5 in all)" in message
    assert "has 1 key(s) the model lacks: extra.weight" in message


def test_wrong_shape_and_wrong_content_are_refused(tmp_path):
    _, plan = make_plan(tmp_path, "w", QUIRKY, {}, schedule="1f1b", pipeline_devices=2)
    state = _other_state({})
    state["blocks.0.gain"] = torch.zeros(3)
    torch.save(state, tmp_path / "shape.pt")
    with pytest.raises(ConfigError, match="'blocks.0.gain' as \\(3,\\) torch.float32, but the model's is \\(16,\\)"):
        build_pipeline_model(plan, 0, torch.device("cpu"), init_from=str(tmp_path / "shape.pt"))
    torch.save({"model": state}, tmp_path / "nested.pt")
    with pytest.raises(ConfigError, match="not a state_dict of tensors"):
        build_pipeline_model(plan, 0, torch.device("cpu"), init_from=str(tmp_path / "nested.pt"))
    (tmp_path / "w.bin.txt").write_text("x")
    with pytest.raises(ConfigError, match="must be a .pt"):
        build_pipeline_model(plan, 0, torch.device("cpu"), init_from=str(tmp_path / "w.bin.txt"))


def test_tied_names_with_different_values_are_refused(tmp_path):
    _, plan = make_plan(tmp_path, "t", QUIRKY, {"tie": True}, schedule="1f1b", pipeline_devices=2)
    state = _other_state({"tie": True})
    state["head.proj.weight"] = state["embed.tok.weight"] + 1.0
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(ConfigError, match="tied tensors 'embed.tok.weight' and 'head.proj.weight' different values"):
        build_pipeline_model(plan, 0, torch.device("cpu"), init_from=str(tmp_path / "w.pt"))


def test_resume_with_init_from_is_refused():
    with pytest.raises(ConfigError, match="drop --init-from"):
        RunConfig(checkpoint_dir="c", resume=True, init_from="w.pt")
