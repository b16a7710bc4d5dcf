"""`export --format megatron`: the flags and Megatron-Core's own config dataclasses built from the exported Python
file alone, plus the model's shape fields (their __post_init__ validation runs: pp > 1, vp, ep, recompute plans),
notes for what Megatron cannot express, stage membership, and the layouts refused."""

from __future__ import annotations

import dataclasses
import runpy
import warnings

import pytest
import torch
from typer.testing import CliRunner

from pipeplan.artifact.export_megatron import megatron_export
from pipeplan.artifact.manual import manual_plan
from pipeplan.cli import app
from pipeplan.errors import ConfigError

runner = CliRunner()


def _megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = pytest.importorskip("megatron.core.transformer.transformer_config")
        distributed = pytest.importorskip("megatron.core.distributed")
        optimizer = pytest.importorskip("megatron.core.optimizer")
    return transformer.TransformerConfig, distributed.DistributedDataParallelConfig, optimizer.OptimizerConfig


def _accepted_by_megatron(exported, tmp_path, **model):
    """Megatron-Core's dataclasses built from the exported keyword-argument file alone, plus the model's shape
    (hidden_size, num_attention_heads: a plan does not hold them)."""
    transformer_config, ddp_config, optimizer_config = _megatron()
    path = tmp_path / "megatron_mcore.py"
    path.write_text(exported.render_core("megatron.args"))
    kwargs = runpy.run_path(str(path))
    config = transformer_config(**kwargs["TRANSFORMER"], hidden_size=64, num_attention_heads=4, **model)
    ddp_config(**kwargs["DDP"])
    optimizer_config(**kwargs["OPTIMIZER"])
    return config


def _flag(exported, name):
    values = [flag.split(" ", 1)[1] if " " in flag else True for flag in exported.flags if flag.split()[0] == name]
    return values[0] if values else None


def test_even_stages_need_no_layout(tmp_path):
    exported = megatron_export(manual_plan("gpt", schedule="1f1b", pipeline_devices=2, num_microbatches=4))
    config = _accepted_by_megatron(exported, tmp_path)
    assert config.pipeline_model_parallel_size == 2 and config.num_layers == 4
    assert config.pipeline_dtype == torch.float32 == config.params_dtype
    assert _flag(exported, "--pipeline-model-parallel-layout") is None and not exported.notes
    assert _flag(exported, "--global-batch-size") == "4" and _flag(exported, "--micro-batch-size") == "1"
    assert exported.members[1:] == (
        "stage 0 (pipeline rank 0, virtual stage 0): embed, blocks.0-1",
        "stage 1 (pipeline rank 1, virtual stage 0): blocks.2-3, head",
    )


def test_uneven_interleaved_stages_go_into_the_layout(tmp_path):
    plan = manual_plan("gpt", schedule="interleaved", pipeline_devices=2, num_microbatches=4, recompute=["full"] * 4)
    exported = megatron_export(plan)
    config = _accepted_by_megatron(exported, tmp_path)
    assert _flag(exported, "--pipeline-model-parallel-layout") == "Et|tt|t|L"
    layout = config.pipeline_model_parallel_layout  # Megatron's parsed layout: [pipeline rank][virtual stage]
    assert config.virtual_pipeline_model_parallel_size == 2
    assert [[len([x for x in chunk if x.name == "decoder"]) for chunk in rank] for rank in layout.layout] == [
        [1, 1],
        [2, 0],
    ]
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == (
        "full",
        "uniform",
        2,
    )


def test_sharded_zero_overlap_precision_and_what_megatron_cannot_express(tmp_path):
    recompute = ["selective", "none"]
    layout = {"pipeline_devices": 2, "num_microbatches": 4, "cuts": [(0, 1), (2, 5)], "recompute": recompute}
    plan = manual_plan("moe", schedule="zb-h1", zero=1, precision="bf16-mixed", **layout)
    training = dataclasses.replace(
        plan.training, tensor_parallel=2, context_parallel=2, expert_parallel=2, overlap="grad-reduce,param-gather"
    )
    plan = dataclasses.replace(
        plan, training=training, cluster=dataclasses.replace(plan.cluster, num_devices=8, devices_per_node=8)
    )
    exported = megatron_export(plan)
    config = _accepted_by_megatron(exported, tmp_path, add_bias_linear=False)  # num_moe_experts: the export's
    assert config.num_moe_experts == 4 and _flag(exported, "--num-experts") == "4"  # the moe factory's default
    assert config.pipeline_dtype == torch.bfloat16 == config.params_dtype
    assert (config.tensor_model_parallel_size, config.context_parallel_size, config.expert_model_parallel_size) == (
        2,
        2,
        2,
    )
    assert config.sequence_parallel and config.bf16 and config.recompute_granularity == "selective"
    for flag in ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--bf16"):
        assert _flag(exported, flag) is True, flag
    notes = " | ".join(exported.notes)
    assert "zb-h1" in notes and "recomputation differs per stage" in notes and "bf16-mixed" in notes
    assert exported.members[0].startswith("world size 8 GPUs: tp 2 x cp 2 x pp 2 x dp 1")


def test_userbuffers_settings_are_noted_not_dropped():
    """`--overlap tensor,chunks=N,sms=N` shaped the prediction: the export says Megatron takes them from a file."""
    plan = manual_plan("gpt", schedule="1f1b", pipeline_devices=2, num_microbatches=4)
    for overlap, noted in (("tensor", False), ("tensor,chunks=4", True), ("all,sms=16", True)):
        training = dataclasses.replace(plan.training, tensor_parallel=2, overlap=overlap)
        cluster = dataclasses.replace(plan.cluster, num_devices=4, devices_per_node=4)
        exported = megatron_export(dataclasses.replace(plan, training=training, cluster=cluster))
        assert _flag(exported, "--tp-comm-overlap") is True
        assert ("--tp-comm-overlap-cfg" in " ".join(exported.notes)) == noted, overlap


def test_replicas_are_data_parallel_ranks_or_refused(tmp_path):
    replicated = manual_plan("gpt", schedule="1f1b", pipeline_devices=1, num_microbatches=6, replicas=[3])
    exported = megatron_export(replicated)
    assert exported.members[0].startswith("world size 3 GPUs: tp 1 x cp 1 x pp 1 x dp 3")
    assert "3 replicas: exported as data parallelism over 1 pipeline(s) x 3 = 3 ranks, 2 microbatches" in " ".join(
        exported.notes
    )
    _accepted_by_megatron(exported, tmp_path)
    uneven = manual_plan("gpt", schedule="1f1b", pipeline_devices=2, num_microbatches=4, replicas=[2, 1])
    with pytest.raises(ConfigError, match=r"different numbers of times.*re-plan with --parallel replicate=off"):
        megatron_export(uneven)
    moe = manual_plan("moe", {"experts": 8}, schedule="1f1b", pipeline_devices=2, num_microbatches=4)
    moe = dataclasses.replace(moe, training=dataclasses.replace(moe.training, expert_parallel=2))
    with pytest.raises(ConfigError, match=r"ep=2 expert ranks from the data-parallel x cp ranks \(1 x 1\)"):
        megatron_export(moe)


def test_expert_count_from_the_models_options_or_preset():
    moe = manual_plan("moe", {"experts": 8}, schedule="1f1b", pipeline_devices=2, num_microbatches=4, data_parallel=2)
    moe = dataclasses.replace(moe, training=dataclasses.replace(moe.training, expert_parallel=2))
    assert megatron_export(moe).transformer["num_moe_experts"] == 8  # given
    preset = dataclasses.replace(moe, model=dataclasses.replace(moe.model, ref="deepseek-v3", options={}))
    assert megatron_export(preset).transformer["num_moe_experts"] == 256  # the preset's (no model loaded)
    own = dataclasses.replace(moe, model=dataclasses.replace(moe.model, ref="pkg.mod:build"))
    exported = megatron_export(own)
    assert "num_moe_experts" not in exported.transformer and "expert count" in " ".join(exported.notes)


def test_cuts_inside_a_block_are_noted():
    plan = manual_plan("gpt", schedule="1f1b", pipeline_devices=2, num_microbatches=4)
    stages = list(plan.stages)
    stages[0] = dataclasses.replace(stages[0], layer_names=(*stages[0].layer_names[:-1], "blocks.1.attn"))
    stages[1] = dataclasses.replace(stages[1], layer_names=("blocks.1.mlp", *stages[1].layer_names[1:]))
    notes = megatron_export(dataclasses.replace(plan, stages=tuple(stages))).notes
    assert any("stage 0 ends inside blocks.1" in note for note in notes)
    hf_names = [("model.embed_tokens", "model.layers.0", "model.layers.1.mlp"), ("model.norm", "lm_head")]
    hf = tuple(dataclasses.replace(stage, layer_names=names) for stage, names in zip(stages, hf_names))
    assert _flag(megatron_export(dataclasses.replace(plan, stages=hf)), "--pipeline-model-parallel-layout") == "Ett|L"
    no_blocks = tuple(dataclasses.replace(stage, layer_names=(f"part{stage.index}",)) for stage in stages)
    with pytest.raises(ConfigError, match="re-plan without --granularity"):
        megatron_export(dataclasses.replace(plan, stages=no_blocks))


def test_cli_writes_the_args_file_with_comments(tmp_path):
    plan = manual_plan("gpt", schedule="gpipe", pipeline_devices=2, num_microbatches=4, cuts=[(0, 3), (4, 5)])
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "megatron.args"
    result = runner.invoke(app, ["export", str(tmp_path / "plan.json"), "-f", "megatron", "-o", str(out)])
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    assert str(tmp_path / "megatron_mcore.py") in result.stdout.replace("\n", "")  # a long tmp path wraps at 80
    assert runpy.run_path(str(tmp_path / "megatron_mcore.py"))["TRANSFORMER"]["pipeline_model_parallel_size"] == 2
    flags = [line for line in lines if not line.startswith("#")]
    assert all(line.startswith("--") for line in flags) and "--pipeline-model-parallel-layout Ettt|tL" in flags
    assert any(line.startswith("# cannot express: schedule gpipe") for line in lines)
    assert "--pipeline-model-parallel-size 2" in result.stdout


def test_optimizer_state_precision_exports_the_precision_aware_optimizer(tmp_path):
    plan = manual_plan("gpt", schedule="1f1b", pipeline_devices=2, num_microbatches=4, zero=1, precision="bf16-main")
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, optimizer="adamw-bf16moments"))
    exported = megatron_export(plan)
    assert _flag(exported, "--use-precision-aware-optimizer") is True
    assert _flag(exported, "--exp-avg-dtype") == "bf16" == _flag(exported, "--exp-avg-sq-dtype")
    assert _flag(exported, "--main-params-dtype") is None and _flag(exported, "--optimizer") == "adam"
    core = exported.render_core("megatron.args")
    assert "'exp_avg_dtype': torch.bfloat16" in core and "'use_precision_aware_optimizer': True" in core
    path = tmp_path / "megatron_mcore.py"
    path.write_text(core)
    kwargs = runpy.run_path(str(path))
    # Megatron-Core's OptimizerConfig has these fields (building it needs Transformer Engine's FusedAdam: not here)
    assert set(kwargs["OPTIMIZER"]) <= {field.name for field in dataclasses.fields(_megatron()[2])}
    assert kwargs["OPTIMIZER"]["exp_avg_sq_dtype"] == torch.bfloat16
    assert "main_params_dtype" not in kwargs["OPTIMIZER"]


def test_bf16_main_params_are_refused_not_exported_as_fp16(tmp_path):
    """adamw-bf16state keeps bf16 main params; Megatron's --main-params-dtype takes fp32 or fp16 only: one line
    naming the optimizer to plan with instead, and nothing written (the CLI's exit 1)."""
    plan = manual_plan("gpt", schedule="1f1b", pipeline_devices=2, num_microbatches=4, zero=1, precision="bf16-main")
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, optimizer="adamw-bf16state"))
    with pytest.raises(ConfigError, match="adamw-bf16moments") as refused:
        megatron_export(plan)
    assert "\n" not in str(refused.value)
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "megatron.args"
    result = runner.invoke(app, ["export", str(tmp_path / "plan.json"), "-f", "megatron", "-o", str(out)])
    assert result.exit_code == 1 and "bf16 main params" in result.output and not out.exists()


def test_precision_aware_optimizer_without_the_distributed_one_is_refused():
    plan = manual_plan("gpt", schedule="1f1b", pipeline_devices=2, num_microbatches=4, precision="bf16-main")
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, optimizer="adamw-bf16moments"))
    with pytest.raises(ConfigError, match="zero=1") as refused:
        megatron_export(plan)
    assert "\n" not in str(refused.value)
