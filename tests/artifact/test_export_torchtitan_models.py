"""The torchtitan exports of models that are not pipeplan's built-ins: an `hf:` causal LM exported for torchtitan
0.3's transformers_modeling_backend (`--format torchtitan-0.3`), a factory model in its own names (`--format
torchtitan` and `torchtitan-0.3`). Every exported FQN names a module of the user's model (through the mapping the
file states), every parameter is in exactly one stage, each stage holds the plan's stage — checked in process against
the model built on meta, and by torchtitan's own loader and stage builder (helpers/torchtitan_split.py). What has no
torchtitan counterpart is refused in one line."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
from helpers.torchtitan_env import SPLIT, run_check
from typer.testing import CliRunner

from pipeplan.artifact.export_torchtitan import torchtitan_export
from pipeplan.artifact.manual import manual_plan
from pipeplan.artifact.torchtitan_names import HF_BACKEND
from pipeplan.cli import app
from pipeplan.errors import ConfigError
from pipeplan.models.registry import load_model

runner = CliRunner()
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHAPE = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2, "seq_len": 16}
HF = {  # tiny configs
    "llama": {**SHAPE, "num_key_value_heads": 1, "intermediate_size": 64},
    "qwen2": {**SHAPE, "num_key_value_heads": 1, "intermediate_size": 64},
    "mixtral": {
        **SHAPE,
        "num_key_value_heads": 1,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "qwen3": {**SHAPE, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64},
}
DECODER = {"layers": 4, "hidden": 32, "heads": 2, "kv_heads": 1, "ffn": 64, "vocab": 64, "seq": 16}
LAYOUTS = {  # model type -> (schedule, pipeline devices): loop and V placements, 2 and 4 stages
    "llama": ("interleaved", 2),
    "qwen2": ("1f1b", 2),
    "mixtral": ("zbv", 2),
    "qwen3": ("1f1b", 4),
}


@functools.cache  # the plans are frozen: both tests read the same ones
def _hf_plan(model_type: str):
    schedule, devices = LAYOUTS[model_type]
    return manual_plan(
        f"hf:{model_type}", HF[model_type], schedule=schedule, pipeline_devices=devices, num_microbatches=4
    )


def _params(model: torch.nn.Module, modules) -> list[str]:
    return [f"{name}.{p}" for name in modules for p, _ in model.get_submodule(name).named_parameters()]


def _user_name(fqn: str, sources: dict[str, str]) -> str:
    head, _, rest = fqn.partition(".")
    base = sources.get(head, head)
    return f"{base}.{rest}" if rest else base


def _check_stages(plan, fqns, sources: dict[str, str], model: torch.nn.Module) -> list[list[str]]:
    """Each exported name resolves in `model` (through `sources`), each stage holds exactly its plan stage's
    parameters, every parameter once; returns each stage's parameter names."""
    per_stage = []
    for stage, names in zip(plan.stages, fqns, strict=True):
        modules = [_user_name(name, sources) for name in names]
        for module in modules:
            model.get_submodule(module)  # raises AttributeError for a name that matches nothing
        params = _params(model, modules)
        assert sorted(params) == sorted(_params(model, stage.layer_names)), stage.index
        per_stage.append(params)
    every = [name for params in per_stage for name in params]
    assert len(every) == len(set(every)) and set(every) == {name for name, _ in model.named_parameters()}
    return per_stage


def test_hf_models_export_to_torchtitans_transformers_backend():
    for model_type in HF:
        plan = _hf_plan(model_type)
        exported = torchtitan_export(plan, "/x.csv", "0.3")
        fqns = exported.config["parallelism"]["module_fqns_per_model_part"]
        assert exported.module == HF_BACKEND and all(names[-1] == "rotary_emb" for names in fqns), model_type
        sources = _sources(plan)
        with torch.device("meta"):
            model = load_model(plan.model.ref, dict(plan.model.options)).build()
        _check_stages(plan, fqns, sources, model)
        assert model.get_submodule("model.rotary_emb") is not None and not list(
            model.get_submodule("model.rotary_emb").parameters()
        )
        text = exported.render()
        assert "model.embed_tokens -> tok_embeddings, model.layers.N -> layers.N, model.norm -> norm" in text
        assert f"--module {HF_BACKEND} --config CONFIG" in text and "--hf_model" in text


def _sources(plan) -> dict[str, str]:
    from pipeplan.artifact.stage_layers import block_layout
    from pipeplan.artifact.torchtitan_names import torchtitan_model

    return dict(torchtitan_model(plan, block_layout(plan, "torchtitan"), "0.3").sources)


def _renamed(plan, ref: str, names, **options):
    model = dataclasses.replace(plan.model, ref=ref, options={**plan.model.options, **options})
    stages = tuple(dataclasses.replace(s, layer_names=n) for s, n in zip(plan.stages, names, strict=True))
    return dataclasses.replace(plan, model=model, stages=stages)


def test_what_torchtitan_has_no_counterpart_for_is_refused_in_one_line(tmp_path):
    plan = manual_plan(
        "llama",
        {"layers": 2, "hidden": 32, "heads": 2, "kv_heads": 2, "vocab": 64, "seq": 16},
        schedule="1f1b",
        pipeline_devices=2,
        num_microbatches=4,
    )
    hf = [("model.embed_tokens", "model.layers.0"), ("model.layers.1", "model.norm", "lm_head")]
    cases = {  # plan, version -> the refusal
        "0.2 has no hf model": (_renamed(plan, "hf:llama", hf), "0.2", "torchtitan 0.2 has no model for hf:llama"),
        "gpt2's blocks": (
            _renamed(plan, "hf:gpt2", [("transformer.wte", "transformer.h.0"), ("transformer.h.1", "lm_head")]),
            "0.3",
            "blocks model.layers.N, but hf:gpt2's plan has its blocks are transformer.h.N",
        ),
        "a classifier": (
            _renamed(plan, "hf:llama", [hf[0], ("model.layers.1", "model.norm", "score")], task="classification"),
            "0.3",
            "hf:llama's plan has -a task=classification",
        ),
        "phi's embed_dropout": (
            _renamed(plan, "hf:phi", [("model.embed_tokens", "model.embed_dropout", "model.layers.0"), hf[1]]),
            "0.3",
            "stage 0's layer model.embed_dropout of hf:phi is none of them",
        ),
        "a factory's HF model": (_renamed(plan, "/abs/net.py:build", hf), "0.3", "plan it as hf:DIR"),
    }
    for label, (refused, version, message) in cases.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
            torchtitan_export(refused, "/x.csv", version)
        refused.save(tmp_path / "plan.json")
        fmt = "torchtitan" if version == "0.2" else "torchtitan-0.3"
        out = tmp_path / f"{label}.out"
        result = runner.invoke(app, ["export", str(tmp_path / "plan.json"), "-f", fmt, "-o", str(out)])
        assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, (label, result.output)
        assert not out.exists() and not out.with_suffix(".csv").exists(), label


def _factory_plan():
    return manual_plan(
        f"{EXAMPLES / 'decoder_model.py'}:build",
        DECODER,
        schedule="interleaved",
        pipeline_devices=2,
        num_microbatches=4,
    )


def test_factory_models_export_their_own_names(tmp_path):
    plan = _factory_plan()
    with torch.device("meta"):
        model = load_model(plan.model.ref, dict(plan.model.options)).build()
    for version in ("0.2", "0.3"):
        exported = torchtitan_export(plan, "/x.csv", version)
        assert exported.module is None
        fqns = exported.config["parallelism"]["module_fqns_per_model_part"]
        assert fqns[0][0] == "tok_embeddings" and fqns[-1][-1] == "output"  # the module's own names
        _check_stages(plan, fqns, {}, model)
        assert "register this model with torchtitan as it is" in exported.render()


@pytest.mark.slow  # one subprocess per torchtitan version (its imports, and a tiny model built on meta)
def test_torchtitans_stage_builder_keeps_each_stages_parameters(tmp_path):
    """torchtitan's loader reads the exported file and its own stage builder splits the model on it: each stage
    keeps exactly the plan's stage's parameters (the builder drops names it does not know silently)."""
    factory = _factory_plan()
    with torch.device("meta"):
        model = load_model(factory.model.ref, dict(factory.model.options)).build()
    expected = {"factory": [sorted(_params(model, s.layer_names)) for s in factory.stages]}
    own = {"kind": "own", "ref": factory.model.ref, "options": dict(factory.model.options)}
    cases = {"0.2": {}, "0.3": {}}
    for version, fmt in (("0.2", "torchtitan"), ("0.3", "torchtitan-0.3")):
        cases[version]["factory"] = {**own, "config": str(_export(tmp_path / version, factory, fmt))}
    for model_type in ("llama", "mixtral"):
        plan = _hf_plan(model_type)
        with torch.device("meta"):
            model = load_model(plan.model.ref, dict(plan.model.options)).build()
        expected[model_type] = [sorted(_params(model, s.layer_names)) for s in plan.stages]
        directory = tmp_path / model_type
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(directory)  # what --hf_model names
        path = _export(directory, plan, "torchtitan-0.3")
        cases["0.3"][model_type] = {"kind": "hf", "hf_model": str(directory), "config": str(path)}
    for version, version_cases in cases.items():
        read = run_check(version, version_cases, SPLIT)
        for label in version_cases:
            stages = read[label]["stages"]
            assert [sorted(stage["params"]) for stage in stages] == expected[label], (version, label)
            if label != "factory":  # the backend's rotary tables stay in every stage
                assert all("rotary_emb" in stage["children"] for stage in stages), (version, label)


def _export(directory: Path, plan, fmt: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    plan.save(directory / "plan.json")
    out = directory / ("job.toml" if fmt == "torchtitan" else "job.args")
    result = runner.invoke(app, ["export", str(directory / "plan.json"), "-f", fmt, "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out
