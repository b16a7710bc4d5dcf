"""`export --format torchtitan` (0.2, TOML) and `--format torchtitan-0.3` (command-line arguments): the stages named
in the FQNs of the model torchtitan builds, every layout on torchtitan's parallel dimensions or refused in one line,
what it cannot express noted; torchtitan 0.2's own config loader parses the TOML here, and both versions' loaders and
ParallelDims (the mesh built at the plan's world size) check every layout in one subprocess each. (torchtitan
running an exported plan: tests/artifact/test_export_torchtitan_run.py.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types

import pytest
import tomllib
from helpers.torchtitan_env import run_check
from typer.testing import CliRunner

from pipeplan.artifact.export_torchtitan import torchtitan_export
from pipeplan.artifact.manual import manual_plan
from pipeplan.cli import app
from pipeplan.errors import ConfigError

runner = CliRunner()
LLAMA = {"layers": 4, "hidden": 32, "heads": 2, "kv_heads": 2, "intermediate": 64, "vocab": 64, "seq": 16}
MOE = {"layers": 4, "hidden": 32, "heads": 2, "kv_heads": 2, "vocab": 64, "seq": 16}


def _config_manager():
    """torchtitan.config's ConfigManager without running torchtitan/__init__.py, which imports its GPU kernels
    (triton) — the config loader itself needs neither."""
    pytest.importorskip("tyro")
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        pytest.skip("torchtitan is not installed")
    if "torchtitan" not in sys.modules:
        package = types.ModuleType("torchtitan")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = package
    from torchtitan.config import ConfigManager

    return ConfigManager


def _export(tmp_path, plan, fmt="torchtitan", name="job.toml"):
    plan.save(tmp_path / "plan.json")
    out = tmp_path / name
    result = runner.invoke(app, ["export", str(tmp_path / "plan.json"), "-f", fmt, "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out, result


def _with(plan, devices=None, **training):
    """`plan` with tensor / context / expert parallelism (analytic-only settings manual_plan does not make)."""
    devices = devices or len(plan.ranks) * training.get("tensor_parallel", 1) * training.get("context_parallel", 1)
    cluster = dataclasses.replace(plan.cluster, num_devices=devices, devices_per_node=devices)
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, **training), cluster=cluster)


def test_torchtitan_parses_the_job_config(tmp_path, monkeypatch):
    config_manager = _config_manager()
    layout = {"pipeline_devices": 2, "num_microbatches": 4, "microbatch_size": 2, "data_parallel": 2}
    plan = manual_plan("llama", LLAMA, schedule="interleaved", precision="bf16-mixed", recompute=["full"] * 4, **layout)
    monkeypatch.chdir(tmp_path)  # a relative --output: the CSV is named by its absolute path all the same
    (tmp_path / "out").mkdir()
    plan.save(tmp_path / "plan.json")
    result = runner.invoke(app, ["export", "plan.json", "-f", "torchtitan", "-o", "out/job.toml"])
    assert result.exit_code == 0, result.output
    config = config_manager().parse_args(["--job.config_file", "out/job.toml"])
    parallelism = config.parallelism
    assert parallelism.module_fqns_per_model_part == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3"],
        ["norm", "output"],
    ]
    assert (parallelism.pipeline_parallel_degree, parallelism.pipeline_parallel_schedule) == (2, "Interleaved1F1B")
    assert config.model.name == "llama3" and parallelism.pipeline_parallel_microbatch_size == 2
    # 0.2 runs DDP alone only: the 2 pipelines are FSDP ranks beside pp
    assert (parallelism.data_parallel_replicate_degree, parallelism.data_parallel_shard_degree) == (1, 2)
    assert (config.training.local_batch_size, config.training.global_batch_size) == (8, 16)
    assert config.training.mixed_precision_param == "bfloat16" and config.activation_checkpoint.mode == "full"
    csv = tmp_path / "out" / "job.csv"
    assert parallelism.pipeline_parallel_schedule_csv == str(csv) and str(csv) in result.stdout.replace("\n", "")
    assert csv.read_text().splitlines() == [",".join(ops) for ops in plan.rank_ops[:2]]


def test_stage_names_are_the_target_models():
    plan = manual_plan("moe", MOE, schedule="1f1b", pipeline_devices=2, num_microbatches=4)
    for version, output in (("0.2", "output"), ("0.3", "lm_head")):
        exported = torchtitan_export(plan, "/x.csv", version)
        assert exported.module == "deepseek_v3", version
        fqns = exported.config["parallelism"]["module_fqns_per_model_part"]
        assert fqns == [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", output]]
    # --granularity: a block cut between stages is named in the stage it starts in; head's parts apart
    stages = list(plan.stages)
    split = [("embed", "blocks.0", "blocks.1", "blocks.2.attn"), ("blocks.2.mlp", "blocks.3", "head.norm", "head.proj")]
    fine = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, layer_names=n) for s, n in zip(stages, split)))
    exported = torchtitan_export(fine, "/x.csv", "0.2")
    assert exported.config["parallelism"]["module_fqns_per_model_part"] == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2"],
        ["layers.3", "norm", "output"],
    ]
    assert any("stage 0 ends inside blocks.2" in note for note in exported.notes)
    # a factory model keeps its own names (top-level modules and entries of top-level containers)
    own = [("tok", "layers.0", "layers.1"), ("layers.2", "layers.3", "final")]
    factory = dataclasses.replace(
        plan,
        model=dataclasses.replace(plan.model, ref="/abs/model.py:build"),
        stages=tuple(dataclasses.replace(s, layer_names=n) for s, n in zip(stages, own)),
    )
    exported = torchtitan_export(factory, "/x.csv", "0.3")
    assert exported.module is None and exported.config["parallelism"]["module_fqns_per_model_part"] == [
        list(names) for names in own
    ]
    assert "/abs/model.py:build's own" in exported.render() and "--module YOUR_MODULE" in exported.render()
    assert (
        "-m torchtitan.train --module llama3 --config CONFIG"
        in torchtitan_export(plan_llama(), "/x.csv", "0.3").render()
    )


def plan_llama():
    return manual_plan("llama", LLAMA, schedule="1f1b", pipeline_devices=2, num_microbatches=4)


def test_models_torchtitan_cannot_name_are_refused():
    gpt = manual_plan("gpt", schedule="1f1b", pipeline_devices=2, num_microbatches=4)
    with pytest.raises(ConfigError, match="torchtitan has no model like pipeplan's built-in gpt"):
        torchtitan_export(gpt, "/x.csv")
    llama = manual_plan("llama", LLAMA, schedule="1f1b", pipeline_devices=2, num_microbatches=4)
    hf_names = [("model.embed_tokens", "model.layers.0", "model.layers.1"), ("model.layers.2", "model.norm", "lm_head")]
    hf = dataclasses.replace(
        llama,
        model=dataclasses.replace(llama.model, ref="hf:llama"),
        stages=tuple(dataclasses.replace(s, layer_names=n) for s, n in zip(llama.stages, hf_names)),
    )
    with pytest.raises(ConfigError, match="nests its layers under `model.`"):
        torchtitan_export(hf, "/x.csv")
    nested = dataclasses.replace(hf, model=dataclasses.replace(llama.model, ref="pkg.mod:build"))
    with pytest.raises(ConfigError, match="stage 0's layer model.embed_tokens is nested deeper"):
        torchtitan_export(nested, "/x.csv", "0.3")


def test_layouts_torchtitan_cannot_place_are_refused():
    uneven = manual_plan("llama", LLAMA, schedule="1f1b", pipeline_devices=2, num_microbatches=4, replicas=[2, 1])
    needle = r"different numbers of times \(stage 0: 2, stage 1: 1\).*--parallel replicate=off"
    with pytest.raises(ConfigError, match=needle):
        torchtitan_export(uneven, "/x.csv")
    odd = manual_plan("llama", LLAMA, schedule="1f1b", pipeline_devices=1, num_microbatches=4, replicas=[3])
    with pytest.raises(ConfigError, match="splits 4 microbatches over 3 replicas"):
        torchtitan_export(odd, "/x.csv")
    moe = manual_plan("moe", MOE, schedule="1f1b", pipeline_devices=2, num_microbatches=4, data_parallel=2)
    for zero in (0, 1):  # ZeRO-1's FSDP over every data-parallel rank does not lift the rule
        plan = _with(moe, context_parallel=2, expert_parallel=3, zero=zero)
        with pytest.raises(ConfigError, match="ep % cp == 0"):
            torchtitan_export(plan, "/x.csv", "0.2")
        with pytest.raises(ConfigError, match=r"ep=3 expert ranks from the data-parallel x cp ranks \(2 x 2\)"):
            torchtitan_export(plan, "/x.csv", "0.3")


def test_what_torchtitan_cannot_express_is_noted():
    plan = manual_plan(
        "llama", LLAMA, schedule="zb-h1", pipeline_devices=2, num_microbatches=4, data_parallel=2, zero=1
    )
    plan = dataclasses.replace(
        plan, stages=tuple(dataclasses.replace(s, recompute=r) for s, r in zip(plan.stages, ["selective", "none"]))
    )
    for version in ("0.2", "0.3"):
        exported = torchtitan_export(plan, "/x.csv", version)
        parallelism = exported.config["parallelism"]
        assert (parallelism["data_parallel_shard_degree"], parallelism["fsdp_reshard_after_forward"]) == (2, "never")
        notes = " | ".join(exported.notes)
        assert "ZeRO-1" in notes and "differs per stage" in notes and "selective" in notes, version
        assert "--overlap" not in notes  # the plan predicted none
    overlapped = dataclasses.replace(plan, training=dataclasses.replace(plan.training, overlap="grad-reduce,p2p"))
    assert "--overlap grad-reduce,p2p: the plan's step was predicted with it" in " ".join(
        torchtitan_export(overlapped, "/x.csv", "0.2").notes
    )
    assert exported.activation_checkpoint == "selective" and exported.render().endswith(
        "activation-checkpoint:selective\n"
    )
    toml = torchtitan_export(plan, "/x.csv", "0.2").render()
    assert tomllib.loads(toml)["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert "# stage 0: embed, blocks.0-1" in toml and "# world size 4 GPUs" in toml


def _layouts():
    """Replicated, ZeRO-1, vp (with recomputation) and ep plans: (plan, base config module, devices)."""
    common = {"num_microbatches": 4}
    llama = lambda **kw: manual_plan("llama", LLAMA, **{**common, **kw})  # noqa: E731
    moe = manual_plan("moe", MOE, schedule="1f1b", pipeline_devices=2, data_parallel=4, **common)
    return {
        "replicated": llama(schedule="1f1b", pipeline_devices=1, replicas=[2], num_microbatches=4),
        "pipelines": llama(schedule="1f1b", pipeline_devices=2, data_parallel=2),
        "zero": llama(schedule="1f1b", pipeline_devices=2, data_parallel=2, zero=1),
        "vp": llama(schedule="interleaved", pipeline_devices=2, recompute=["full"] * 4),
        "zbv": llama(schedule="zbv", pipeline_devices=2, data_parallel=2),
        "ep": _with(moe, expert_parallel=2),
        "ep-tp": _with(moe, tensor_parallel=2, expert_parallel=2),
        "ep-cp": _with(moe, context_parallel=2, expert_parallel=2),
    }


@pytest.mark.slow  # two subprocesses (torchtitan 0.2 and 0.3 and their imports)
def test_both_torchtitan_versions_load_and_place_every_layout(tmp_path):
    fields = ["pipeline_parallel_degree", "data_parallel_replicate_degree", "data_parallel_shard_degree"]
    fields += ["tensor_parallel_degree", "context_parallel_degree", "expert_parallel_degree"]
    fields += ["module_fqns_per_model_part", "pipeline_parallel_schedule_csv"]
    for version, fmt, suffix in (("0.2", "torchtitan", "toml"), ("0.3", "torchtitan-0.3", "args")):
        cases, expected = {}, {}
        for label, plan in _layouts().items():
            (tmp_path / label).mkdir(exist_ok=True)
            out, _ = _export(tmp_path / label, plan, fmt, f"job.{suffix}")
            exported = torchtitan_export(plan, str((tmp_path / label / "job.csv").resolve()), version)
            training = plan.training
            devices = len(plan.ranks) * training.tensor_parallel * training.context_parallel
            base = "llama3_debugmodel" if exported.module == "llama3" else "deepseek_v3_debugmodel"
            cases[label] = {"config": str(out), "module": exported.module, "base": base, "world_size": devices}
            cases[label]["fields"] = fields
            expected[label] = exported
        read = run_check(version, cases)
        for label, exported in expected.items():
            got, parallelism = read[label], exported.config["parallelism"]
            assert got["mesh_built"] and not got["ddp_on_many_dims"], (version, label)
            for name in fields:
                if name in parallelism:
                    assert got["parallelism"][name] == parallelism[name], (version, label, name)
            assert got["global_batch_size"] == exported.config["training"]["global_batch_size"], (version, label)
            assert got["checkpoint"].lower().startswith(exported.activation_checkpoint[:4]), (version, label)
            assert (got["lr"], got["weight_decay"]) == (1e-3, 0.01), (version, label)
