"""A plan as a torchtitan job config (TOML, torchtitan 0.2's `--job.config_file`): `pipeplan export PLAN --format
torchtitan`.

Each stage's module FQNs go into `parallelism.module_fqns_per_model_part` (torchtitan's per-stage membership; it
replaced `pipeline_parallel_split_points`). The op lists go into the torch CSV schedule beside the TOML
(`pipeline_parallel_schedule_csv`, run by torch's `_PipelineScheduleRuntime`), so torchtitan runs the plan's op
order; `pipeline_parallel_schedule` still names the torch schedule whose stage placement the plan uses (torchtitan
reads loop or V placement from it). Plans torch's CSV runtime cannot run (replicated stages, asynchronous
schedules) get the nearest named schedule and a note. Each plan setting torchtitan cannot express is a `notes` line,
written as a `#` comment at the top of the TOML.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pipeplan.plan.plan import Plan
from pipeplan.plan.stage_layers import block_layout, cannot_express, describe_members
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


@dataclass(frozen=True, kw_only=True)
class TorchtitanExport:
    config: dict[str, dict[str, Any]]  # TOML section -> key -> value
    notes: tuple[str, ...]
    members: tuple[str, ...]
    needs_csv: bool  # the config points at the plan's torch CSV schedule

    def render(self) -> str:
        lines = ["# pipeplan export --format torchtitan: a torchtitan job config (--job.config_file)"]
        lines += [f"# cannot express: {note}" for note in self.notes]
        lines += [f"# {member}" for member in self.members]
        for section, values in self.config.items():
            lines += ["", f"[{section}]"]
            lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)  # strings and lists of strings: JSON's quoting is TOML's basic strings


def torchtitan_export(plan: Plan, csv_path: str) -> TorchtitanExport:
    """The job config for `plan`; `csv_path`: where the torch CSV schedule is written (when the plan has one)."""
    layout = block_layout(plan, ENGINE)
    training, info = plan.training, schedule_info(plan.schedule)
    notes = cannot_express(layout, ENGINE)
    needs_csv = not info.asynchronous and all(stage.replicas == 1 for stage in plan.stages)
    if not needs_csv:
        notes.append(
            f"torch's CSV runtime runs each stage on one rank with a flush every step; {plan.schedule} with these "
            f"stages runs as torch's {info.torch_name} over one rank per stage"
        )
    parallelism: dict[str, Any] = {
        "pipeline_parallel_degree": len(plan.stages) // plan.chunks,
        "pipeline_parallel_schedule": info.torch_name,  # the torch schedule with the plan's stage placement
        "pipeline_parallel_microbatch_size": training.microbatch_size,
        "module_fqns_per_model_part": [list(stage.layer_names) for stage in plan.stages],
        "tensor_parallel_degree": training.tensor_parallel,
        "context_parallel_degree": training.context_parallel,
        "expert_parallel_degree": training.expert_parallel,
    }
    if needs_csv:
        parallelism["pipeline_parallel_schedule_csv"] = csv_path
    parallelism.update(_data_parallel(plan, notes))
    train = {
        "local_batch_size": training.microbatch_size * training.num_microbatches,
        "global_batch_size": training.global_batch_size,
    }
    if plan.model.tokens_per_sample:
        train["seq_len"] = plan.model.tokens_per_sample
    precision, note = _PRECISIONS.get(training.precision, _OTHER_PRECISION)
    train.update(precision)
    if note:
        notes.append(f"--precision {training.precision}: {note}")
    config = {
        "job": {"description": f"pipeplan plan: {plan.schedule}, {len(plan.stages)} stages"},
        "training": train,
        "optimizer": _optimizer(plan, notes),
        "parallelism": parallelism,
        "activation_checkpoint": _checkpointing(plan, notes),
    }
    members = [f"stage {stage.index}: {describe_members(stage, layout.container)}" for stage in layout.stages]
    return TorchtitanExport(config=config, notes=tuple(notes), members=tuple(members), needs_csv=needs_csv)


def _data_parallel(plan: Plan, notes: list[str]) -> dict[str, int]:
    dp = plan.training.data_parallel
    if plan.training.zero:
        notes.append(
            "ZeRO-1 has no torchtitan setting; exported as FSDP over the data-parallel ranks "
            "(data_parallel_shard_degree: parameters and gradients sharded too, more communication)"
        )
        return {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": dp}
    return {"data_parallel_replicate_degree": dp, "data_parallel_shard_degree": 1}


def _optimizer(plan: Plan, notes: list[str]) -> dict[str, Any]:
    training = plan.training
    if training.optimizer != "adamw":
        notes.append(f"optimizer {training.optimizer}: torchtitan's built-in optimizers are Adam and AdamW")
    return {"name": "AdamW", "lr": training.lr, "weight_decay": training.weight_decay}


def _checkpointing(plan: Plan, notes: list[str]) -> dict[str, str]:
    modes = [stage.recompute for stage in plan.stages]
    mode = "full" if "full" in modes else "selective" if "selective" in modes else "none"
    if len(set(modes)) > 1:
        which = ", ".join(f"stage {s.index}: {s.recompute}" for s in plan.stages)
        notes.append(f"recomputation differs per stage ({which}); torchtitan applies one mode: exported as {mode}")
    if mode == "full":
        notes.append("full recomputation: torchtitan checkpoints each block (keeps every block's input)")
    if mode != "selective":
        return {"mode": mode}
    notes.append(
        "selective recomputation: torchtitan's op-level selective checkpointing keeps matmul outputs and "
        "recomputes the rest (pipeplan's recomputes attention only)"
    )
    return {"mode": "selective", "selective_ac_option": "op"}
