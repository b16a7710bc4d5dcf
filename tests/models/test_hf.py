"""The Hugging Face adapter: `-a` options as typed config fields, adapter options and their errors, GPT-2 traced by
torch.export into blocks whose stages compose to the model, BERT classification profiled and planned from the
CLI, and a local model directory (config.json + safetensors). Tiny configs, nothing downloaded."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.errors import ModelError
from pipeplan.graph.stage import build_stage_module
from pipeplan.graph.trace import trace_model
from pipeplan.models import load_model

transformers = pytest.importorskip("transformers")
runner = CliRunner()

NO_DROPOUT = {"resid_pdrop": "0", "embd_pdrop": "0", "attn_pdrop": "0"}
TINY_GPT2 = {"n_layer": "2", "n_embd": "32", "n_head": "2", "vocab_size": "64", "seq_len": "8", **NO_DROPOUT}
TINY_BERT = ["-a", "num_hidden_layers=2", "-a", "hidden_size=32", "-a", "num_attention_heads=2"]
TINY_BERT += ["-a", "intermediate_size=64", "-a", "vocab_size=64", "-a", "seq_len=8"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_options_are_config_fields_converted_to_their_types():
    spec = load_model("hf:gpt2", TINY_GPT2)
    with torch.device("meta"):
        model = spec.build()
    assert isinstance(model, transformers.GPT2LMHeadModel) and model.training
    assert model.config.n_layer == 2 and model.config.resid_pdrop == 0.0 and model.config.use_cache is False
    assert spec.options["task"] == "causal-lm" and spec.tokens_per_sample == 8
    (ids,), target = spec.sample_batch(3, generator=torch.Generator().manual_seed(0))
    assert ids.shape == (3, 8) and int(ids.max()) < 64 and torch.equal(target, ids)
    assert load_model("hf:bert", {"num_labels": "3"}).options["task"] == "classification"


@pytest.mark.parametrize(
    ("ref", "options", "match"),
    [
        ("hf:gpt2", {"layers": "2"}, "no config field 'layers'"),
        ("hf:gpt2", {"n_layer": "two"}, "n_layer='two' must be int"),
        ("hf:gpt2", {"task": "translate"}, "task='translate' must be one of"),
        ("hf:gpt2", {"seq_len": "5000"}, "seq_len=5000 must lie in"),
        ("hf:gpt2", {"data": "some"}, "data='some' must be one of"),
        ("hf:distilbert", {"task": "causal-lm"}, "no causal-lm head; use -a task=classification"),
        ("hf:no_such_type", {}, "unknown model type"),
        ("hf:./missing_dir", {}, "no config.json"),
    ],
)
def test_bad_options_are_one_line_model_errors(ref, options, match):
    with pytest.raises(ModelError, match=match) as info:
        load_model(ref, options)
    assert "\n" not in str(info.value)


def test_gpt2_exports_into_blocks_whose_stages_compose_to_the_model():
    spec = load_model("hf:gpt2", TINY_GPT2)
    torch.manual_seed(0)
    traced = trace_model(spec, batch_size=2)
    assert traced.tracer == "export"
    names = [layer.name for layer in traced.layer_graph.layers]
    assert names == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.drop",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
        "lm_head",
    ]
    (ids,), target = spec.sample_batch(2, generator=torch.Generator().manual_seed(1))
    env = {"input_ids": ids}
    for layer in traced.layer_graph.layers:
        stage = build_stage_module(traced, layer.nodes)
        env.update(zip(stage.outputs, stage(*[env[name] for name in stage.inputs])))
    output = traced.build_output(env)
    expected = traced.module(ids)
    assert type(output) is type(expected)
    torch.testing.assert_close(output.logits, expected.logits)
    torch.testing.assert_close(spec.loss_fn(output, target), spec.loss_fn(expected, target))


def test_bert_classification_profiles_and_plans_from_the_cli(tmp_path):
    profile = tmp_path / "bert.json"
    result = runner.invoke(
        app, ["profile", "hf:bert", *TINY_BERT, "-b", "2", "--warmup", "0", "--repeats", "1", "-o", str(profile)]
    )
    assert result.exit_code == 0, result.output
    assert "model built with: vocab_size=64, hidden_size=32, num_hidden_layers=2" in " ".join(result.output.split())
    provenance = json.loads(profile.read_text())["provenance"]
    assert provenance["tracer"] == "export" and provenance["model"] == "hf:bert"
    args = ["plan", "hf:bert", *TINY_BERT, "--profile", str(profile), "--devices", "2", "-o", str(tmp_path / "p")]
    result = runner.invoke(app, [*args, "--pipeline-depth", "2", "--global-batch-size", "8"])
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["model"]["tracer"] == "export" and all(stage["node_names"] for stage in plan["stages"])
    recorded = plan["model"]["options"]  # the effective config, derived fields included
    assert recorded["hidden_size"] == 32 and recorded["num_attention_heads"] == 2 and recorded["num_labels"] == 2
    assert plan["stages"][-1]["layer_names"][-1] == "classifier"


# a sliding window shorter than the sequence: transformers builds the mask (expanded to the batch) in each block
TINY_WINDOW = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=64,
    seq_len=8,
    sliding_window=4,
)


def test_exported_plan_names_the_nodes_of_its_microbatch_size(tmp_path):
    """torch.export specializes to the batch size (the mask's expand to the batch): a batch-1 profile planned at
    microbatch 2 must name the nodes the runtime traces at 2."""
    options = [f"{k}={v}" for k, v in TINY_WINDOW.items()]
    args = [a for option in options for a in ("-a", option)]
    profile = tmp_path / "m.json"
    result = runner.invoke(app, ["profile", "hf:mistral", *args, "--warmup", "0", "--repeats", "1", "-o", str(profile)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "p"
    result = runner.invoke(
        app, ["plan", "hf:mistral", *args, "--profile", str(profile), "-n", "2", "-p", "2", "-b", "2", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["training"]["microbatch_size"] == 2
    at_two = trace_model(load_model("hf:mistral", TINY_WINDOW), batch_size=2, device="meta").layer_graph
    at_one = trace_model(load_model("hf:mistral", TINY_WINDOW), batch_size=1, device="meta").layer_graph
    assert at_one.fingerprint != at_two.fingerprint
    assert plan["model"]["fingerprint"] == at_two.fingerprint


def test_local_directory_gives_config_and_initial_weights(tmp_path):
    config = transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    saved = transformers.AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(tmp_path, safe_serialization=True)
    assert list(tmp_path.glob("*.safetensors"))
    spec = load_model(f"hf:{tmp_path}", {"seq_len": "8"})
    built = spec.build()
    assert built.training and built.config.use_cache is False
    expected = saved.state_dict()
    for name, tensor in built.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    with torch.device("meta"):
        assert next(spec.build().parameters()).is_meta


def test_ranks_start_from_the_directory_weights(tmp_path):
    from pipeplan.plan.manual import manual_plan
    from pipeplan.runtime.step.stages import build_pipeline_model

    config = transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    saved = transformers.AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(tmp_path, safe_serialization=True)
    plan = manual_plan(f"hf:{tmp_path}", {"seq_len": "8"}, schedule="1f1b", pipeline_devices=2, num_microbatches=2)
    expected = saved.state_dict()
    for rank in range(2):
        model = build_pipeline_model(plan, rank, torch.device("cpu"))
        for name, param in model.params.items():
            assert torch.equal(param.detach(), expected[name]), name


def test_a_model_directory_is_recorded_absolute_with_its_config_hash(tmp_path, monkeypatch):
    from pipeplan.errors import RunError
    from pipeplan.plan.manual import manual_plan
    from pipeplan.runtime.step.stages import check_model_file

    config = transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model", safe_serialization=True)
    monkeypatch.chdir(tmp_path)
    plan = manual_plan("hf:model", {"seq_len": "8"}, schedule="1f1b", pipeline_devices=2, num_microbatches=2)
    assert plan.model.ref == f"hf:{(tmp_path / 'model').resolve()}" and plan.model.file_sha256
    monkeypatch.chdir(tmp_path.parent)
    check_model_file(plan)  # found from anywhere
    (tmp_path / "model" / "config.json").write_text((tmp_path / "model" / "config.json").read_text() + "\n")
    with pytest.raises(RunError, match="changed since the plan was made"):
        check_model_file(plan)
