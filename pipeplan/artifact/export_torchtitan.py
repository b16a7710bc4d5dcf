"""A plan as a torchtitan config: `pipeplan export PLAN --format torchtitan` (torchtitan 0.2: a TOML job config,
`--job.config_file`) or `--format torchtitan-0.3` (torchtitan 0.3 reads no TOML: `--module M --config C` names a
config function of its registry and `--section.field` arguments override it; the file holds those arguments).

Each stage's module FQNs, in the names of the model torchtitan builds (`plan.torchtitan_names`), go into
`parallelism.module_fqns_per_model_part`. The op lists go into the torch CSV schedule beside the config
(`pipeline_parallel_schedule_csv`, an absolute path; run by torch's `_PipelineScheduleRuntime`), so torchtitan runs
the plan's op order; `pipeline_parallel_schedule` still names the torch schedule whose stage placement the plan uses
(torchtitan's stage builder reads loop or V placement from it). Plans torch's CSV runtime cannot run (replicated
stages, asynchronous schedules) get the nearest named schedule and a note. The degrees are `plan.engine_dims`'s.
Each plan setting torchtitan cannot express is a `notes` line, written as a `#` comment at the top of the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pipeplan.artifact.engine_dims import TORCHTITAN_VERSIONS, TorchtitanDims, torchtitan_dims
from pipeplan.artifact.plan import Plan
from pipeplan.artifact.stage_layers import block_layout, cannot_express, describe_members
from pipeplan.artifact.torchtitan_names import torchtitan_model
from pipeplan.schedules.registry import schedule_info

ENGINE = "torchtitan"
_PRECISIONS = {  # pipeplan precision -> ([training] values, note)
    "fp32": ({"dtype": "float32", "mixed_precision_param": "float32"}, ""),
    "bf16-mixed": ({"dtype": "float32", "mixed_precision_param": "bfloat16"}, ""),
    "bf16": ({"dtype": "bfloat16"}, ""),
    "fp16-mixed": (
        {"dtype": "float32", "mixed_precision_param": "float32"},
        "torchtitan has no fp16; exported as fp32",
    ),
}

_OTHER_PRECISION = (  # bf16-main, fp16-main, fp8 and their bf16-gradient forms
    {"dtype": "float32", "mixed_precision_param": "bfloat16"},
    "exported as fp32 weights with bf16 mixed precision; fp8 is torchtitan's [quantize] float8 (GPU only)",
)


_USE = {  # how each version's file is used (the header's first lines)
    "0.2": (
        "# pipeplan export --format torchtitan: a torchtitan 0.2 job config; run as",
        "#   torchrun --nproc_per_node=GPUS_PER_NODE ... -m torchtitan.train --job.config_file THIS_FILE",
    ),
    "0.3": (
        "# pipeplan export --format torchtitan-0.3: torchtitan 0.3 command-line overrides; run as",
        "#   torchrun ... -m torchtitan.train --module MODULE --config CONFIG [your --section.field ...] "
        "$(grep -v '^#' THIS_FILE)",
        "# (the last line is a subcommand: your own overrides go before it)",
    ),
}


@dataclass(frozen=True, kw_only=True)
class TorchtitanExport:
    version: str  # "0.2" (TOML) or "0.3" (command-line arguments)
    config: dict[str, dict[str, Any]]  # section -> field -> value, in the version's own field names
    activation_checkpoint: str  # none | full | selective (0.3: the subcommand; 0.2: in `config`)
    module: str | None  # torchtitan's model (llama3, deepseek_v3); None: the user's own
    comments: tuple[str, ...]  # how the names map, the world size, each stage's layers
    notes: tuple[str, ...]  # plan settings torchtitan cannot express (or expresses differently)
    needs_csv: bool  # the config points at the plan's torch CSV schedule

    def render(self) -> str:
        lines = [line.replace("MODULE", self.module or "YOUR_MODULE") for line in _USE[self.version]]
        lines += [f"# {line}" for line in self.comments]
        lines += [f"# cannot express: {note}" for note in self.notes]
        if self.version == "0.2":
            for section, values in self.config.items():
                lines += ["", f"[{section}]"]
                lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        else:
            for section, values in self.config.items():
                lines += [_argument(f"--{section}.{key}", value) for key, value in values.items()]
            lines.append(f"activation-checkpoint:{self.activation_checkpoint}")
        return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)  # strings and lists of strings: JSON's quoting is TOML's basic strings


def _argument(flag: str, value: Any) -> str:
    """One tyro argument: a flag for True, comma-joined lists (torchtitan's list[str] rule), groups space-separated."""
    if value is True:
        return flag
    if isinstance(value, list):
        return " ".join([flag, *(",".join(group) for group in value)])
    return f"{flag} {value}"


def torchtitan_export(plan: Plan, csv_path: str, version: str = "0.2") -> TorchtitanExport:
    """The config of torchtitan `version` for `plan`; `csv_path`: where the torch CSV schedule is written (when the
    plan has one). ConfigError when torchtitan cannot run the plan's model or layout."""
    assert version in TORCHTITAN_VERSIONS, version
    layout = block_layout(plan, ENGINE)
    target = torchtitan_model(plan, layout, version)
    dims = torchtitan_dims(plan, version)
    notes = [*dims.notes, *cannot_express(layout, ENGINE)]
    training = plan.training
    parallelism = _pipeline(plan, target.fqns, csv_path, notes)
    needs_csv = "pipeline_parallel_schedule_csv" in parallelism
    parallelism.update(_degrees(dims))
    train: dict[str, Any] = {
        "local_batch_size": training.microbatch_size * dims.microbatches,
        "global_batch_size": training.global_batch_size,
    }
    if plan.model.tokens_per_sample:
        train["seq_len"] = plan.model.tokens_per_sample
    precision, note = _PRECISIONS.get(training.precision, _OTHER_PRECISION)
    train.update(precision)
    if note:
        notes.append(f"--precision {training.precision}: {note}")
    if training.overlap != "none":
        notes.append(
            f"--overlap {training.overlap}: the plan's step was predicted with it; torchtitan's overlap is its own "
            "(FSDP's prefetching; asynchronous tensor parallelism under torch.compile), not set by this export"
        )
    if version == "0.3" and (dims.pp > 1 or dims.ep > 1):
        train["disable_cuda_graphs"] = True  # 0.3 refuses CUDA graphs with pp (and with ep's default dispatcher)
    checkpoint = _checkpointing(plan, notes)
    config: dict[str, dict[str, Any]] = {}
    if version == "0.2":
        config["job"] = {"description": f"pipeplan plan: {plan.schedule}, {len(plan.stages)} stages"}
        config.update({"model": {"name": target.module}} if target.module else {})
    config.update(training=train, optimizer=_optimizer(plan, version, notes), parallelism=parallelism)
    if version == "0.2":
        config["activation_checkpoint"] = {"mode": checkpoint}
        config["activation_checkpoint"].update({"selective_ac_option": "op"} if checkpoint == "selective" else {})
    comments = [*target.mapping, _world_line(dims, target.module, version)]
    comments += [f"stage {stage.index}: {describe_members(stage, layout.container)}" for stage in layout.stages]
    return TorchtitanExport(
        version=version,
        config=config,
        activation_checkpoint=checkpoint,
        module=target.module,
        comments=tuple(comments),
        notes=tuple(notes),
        needs_csv=needs_csv,
    )


def _world_line(dims: TorchtitanDims, module: str | None, version: str) -> str:
    model = f"model {module}" if module else "your model"
    how = "[model] flavor" if version == "0.2" else "--config"
    return (
        f"world size {dims.world_size} GPUs: pp {dims.pp} x dp_replicate {dims.dp_replicate} x dp_shard "
        f"{dims.dp_shard} x cp {dims.cp} x tp {dims.tp}; {model}, its size ({how}) and data are yours to set"
    )


def _pipeline(plan: Plan, fqns, csv_path: str, notes: list[str]) -> dict[str, Any]:
    """The pipeline settings: the stages' FQNs, the torch schedule and, when torch's CSV runtime can run the op
    lists, the CSV's path."""
    pp = len(plan.stages) // plan.chunks
    if len(plan.stages) == 1:
        return {"pipeline_parallel_degree": 1}
    info = schedule_info(plan.schedule)
    values: dict[str, Any] = {
        "pipeline_parallel_degree": pp,
        "pipeline_parallel_schedule": info.torch_name,
        "pipeline_parallel_microbatch_size": plan.training.microbatch_size,
        "module_fqns_per_model_part": [list(names) for names in fqns],
    }
    if info.asynchronous or any(stage.replicas > 1 for stage in plan.stages):
        notes.append(
            f"torch's CSV runtime runs each stage on one rank with a flush every step; {plan.schedule} with these "
            f"stages runs as torch's {info.torch_name} over one rank per stage"
        )
    else:
        values["pipeline_parallel_schedule_csv"] = csv_path
    return values


def _degrees(dims: TorchtitanDims) -> dict[str, Any]:
    values: dict[str, Any] = {
        "data_parallel_replicate_degree": dims.dp_replicate,
        "data_parallel_shard_degree": dims.dp_shard,
        "tensor_parallel_degree": dims.tp,
        "context_parallel_degree": dims.cp,
        "expert_parallel_degree": dims.ep,
    }
    if dims.reshard_after_forward:
        values["fsdp_reshard_after_forward"] = dims.reshard_after_forward
    if dims.etp is not None:
        values["expert_tensor_parallel_degree"] = dims.etp
    return values


def _optimizer(plan: Plan, version: str, notes: list[str]) -> dict[str, Any]:
    training = plan.training
    if training.optimizer != "adamw":
        notes.append(f"optimizer {training.optimizer}: torchtitan's built-in optimizers are Adam and AdamW")
    if version == "0.2":
        return {"name": "AdamW", "lr": training.lr, "weight_decay": training.weight_decay}
    group = "param_groups.0"  # the config function's one parameter group (torchtitan's default_adamw)
    return {
        f"{group}.optimizer_name": "AdamW",
        f"{group}.optimizer_kwargs.lr": training.lr,
        f"{group}.optimizer_kwargs.weight_decay": training.weight_decay,
    }


def _checkpointing(plan: Plan, notes: list[str]) -> str:
    modes = [stage.recompute for stage in plan.stages]
    mode = "full" if "full" in modes else "selective" if "selective" in modes else "none"
    if len(set(modes)) > 1:
        which = ", ".join(f"stage {s.index}: {s.recompute}" for s in plan.stages)
        notes.append(f"recomputation differs per stage ({which}); torchtitan applies one mode: exported as {mode}")
    if mode == "full":
        notes.append("full recomputation: torchtitan checkpoints each block (keeps every block's input)")
    if mode == "selective":
        notes.append(
            "selective recomputation: torchtitan's op-level selective checkpointing keeps matmul outputs and "
            "recomputes the rest (pipeplan's recomputes attention only)"
        )
    return mode
