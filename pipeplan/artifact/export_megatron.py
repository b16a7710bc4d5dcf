"""A plan as Megatron-LM / Megatron-Core arguments: `pipeplan export PLAN --format megatron`.

`megatron_export(plan)` gives the command-line flags of Megatron-LM's `pretrain_gpt.py` (one per line in the
file) and, for the same values, the keyword arguments of Megatron-Core's dataclasses (`TransformerConfig`,
`DistributedDataParallelConfig`, `OptimizerConfig`), written beside the flags as a Python file (`render_core`) that
the tests import and construct, so Megatron-Core's own validation checks them: with the model's shape fields
(hidden_size, num_attention_heads, ...) they construct for every plan (pipeline_dtype for pp > 1, num_moe_experts
for ep > 1 when the plan's model says its expert count). Each plan setting Megatron cannot express is a `notes` line
(written as a `#` comment), and so is each stage's membership (its module FQNs).

Mapping: pipeline size = the plan's devices per pipeline; virtual stages = its chunks (interleaved); tensor,
context and expert sizes are the plan's t, cp and ep; data parallel (implied by the world size) is the plan's
pipelines times its replicas (`plan.engine_dims.data_parallel`). Uneven stages go into
`--pipeline-model-parallel-layout` (`E` embedding, `t` decoder layer, `L` final norm + output + loss; stages in
Megatron's order: virtual stage v of pipeline rank r is layout entry v x pp + r, which is pipeplan's looped
placement). Recomputation: Megatron applies one
setting to every stage: `selective` is Megatron's selective (core attention); `full` keeps only each stage's input
(`uniform` over chunks as long as the longest stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeplan.artifact.engine_dims import data_parallel, megatron_expert_problem
from pipeplan.artifact.plan import Plan
from pipeplan.artifact.stage_layers import BlockLayout, block_layout, cannot_express, describe_members
from pipeplan.costs.overlap import Overlap
from pipeplan.errors import ConfigError
from pipeplan.models.builtins import BUILTINS, builtin_family
from pipeplan.schedules.registry import schedule_info

ENGINE = "Megatron"
_DTYPE_FIELDS = (  # TransformerConfig and OptimizerConfig fields holding a torch dtype
    "params_dtype",
    "pipeline_dtype",
    "main_params_dtype",
    "exp_avg_dtype",
    "exp_avg_sq_dtype",
)
# pipeplan's 16-bit optimizer state (costs.optimizer.MAIN_STATE_BYTES) -> Megatron's precision-aware optimizer:
# (flags, OptimizerConfig keyword arguments). adamw-bf16state (NeMo's distributed Adam with optim.dtype bf16) keeps
# bf16 main params, which Megatron cannot hold (--main-params-dtype: fp32 or fp16): `_BF16_MAIN_PARAMS` refuses it
# rather than export fp16 main params, another format with another range.
_STATE_DTYPES: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "adamw-bf16moments": (("--exp-avg-dtype bf16", "--exp-avg-sq-dtype bf16"), {}),
}
_BF16_MAIN_PARAMS = (
    "optimizer adamw-bf16state keeps bf16 main params, which Megatron has no flag for (--main-params-dtype: fp32 "
    "or fp16); plan with --precision MODE,adamw-bf16moments (fp32 main params, bf16 moments) to export to Megatron"
)
_PRECISION_FLAGS = {  # pipeplan precision -> (flags, note when Megatron's mode differs)
    "fp32": ((), ""),
    "bf16-mixed": (
        ("--bf16",),
        "bf16-mixed autocasts over fp32 weights; Megatron's --bf16 keeps bf16 weights with "
        "fp32 main weights in the optimizer (pipeplan's bf16-main)",
    ),
    "bf16": (("--bf16",), "pure bf16 (no fp32 main weights) has no Megatron flag; --bf16 adds fp32 main weights"),
    "bf16-main": (("--bf16",), ""),
    "bf16-main-bf16grads": (
        ("--bf16",),
        "bf16 gradients need --use-precision-aware-optimizer --main-grads-dtype bf16 (and --use-distributed-optimizer)",
    ),
    "fp16-mixed": (
        ("--fp16",),
        "fp16-mixed autocasts over fp32 weights; Megatron's --fp16 keeps fp16 weights with "
        "fp32 main weights and dynamic loss scaling",
    ),
    "fp16-main": (("--fp16",), ""),
    "fp8": (("--bf16", "--fp8-format hybrid"), "fp8 needs Transformer Engine (--transformer-impl transformer_engine)"),
    "fp8-bf16grads": (
        ("--bf16", "--fp8-format hybrid"),
        "fp8 needs Transformer Engine; bf16 gradients need --use-precision-aware-optimizer --main-grads-dtype bf16",
    ),
}


@dataclass(frozen=True, kw_only=True)
class MegatronExport:
    flags: tuple[str, ...]  # "--name value" or "--name"
    notes: tuple[str, ...]  # plan settings Megatron cannot express (or expresses differently)
    members: tuple[str, ...]  # one line per stage: where it runs and its module FQNs
    transformer: dict[str, Any] = field(default_factory=dict)  # TransformerConfig keyword arguments (dtypes by name)
    ddp: dict[str, Any] = field(default_factory=dict)  # DistributedDataParallelConfig keyword arguments
    optimizer: dict[str, Any] = field(default_factory=dict)  # OptimizerConfig keyword arguments

    def render(self) -> str:
        """The args file: comments (notes, then members), then one flag per line."""
        lines = [
            f"# pipeplan export --format megatron: {len(self.flags)} flags for Megatron-LM's pretrain_gpt.py; use as",
            "# torchrun ... pretrain_gpt.py $(grep -v '^#' THIS_FILE) --hidden-size ... (the model's own flags)",
        ]
        lines += [f"# cannot express: {note}" for note in self.notes]
        lines += [f"# {member}" for member in self.members]
        return "\n".join([*lines, *self.flags]) + "\n"

    def render_core(self, args_name: str) -> str:
        """Megatron-Core's keyword arguments as a Python module (the same values as the flags in `args_name`)."""
        transformer, optimizer = (_render_kwargs(kwargs) for kwargs in (self.transformer, self.optimizer))
        return "\n".join(
            [
                f'"""pipeplan export --format megatron: Megatron-Core keyword arguments, the values of {args_name}.',
                "",
                "    from megatron.core.transformer.transformer_config import TransformerConfig",
                "    from megatron.core.distributed import DistributedDataParallelConfig",
                "    from megatron.core.optimizer import OptimizerConfig",
                "    config = TransformerConfig(**TRANSFORMER, hidden_size=..., num_attention_heads=...)  # your shape",
                "    ddp_config = DistributedDataParallelConfig(**DDP)",
                "    optimizer_config = OptimizerConfig(**OPTIMIZER)",
                '"""',
                "",
                "import torch",
                "",
                f"TRANSFORMER = {{{transformer}}}",
                f"DDP = {self.ddp!r}",
                f"OPTIMIZER = {{{optimizer}}}",
                "",
            ]
        )


def _render_kwargs(kwargs: dict[str, Any]) -> str:
    """A dict literal's body, dtype fields as torch dtypes."""
    return ", ".join(
        f"{key!r}: torch.{value}" if key in _DTYPE_FIELDS else f"{key!r}: {value!r}" for key, value in kwargs.items()
    )


def megatron_export(plan: Plan) -> MegatronExport:
    layout = block_layout(plan, ENGINE)
    t, cp, ep = plan.training.tensor_parallel, plan.training.context_parallel, plan.training.expert_parallel
    pp = len(plan.stages) // plan.chunks
    parallel = data_parallel(plan, ENGINE)
    dp = parallel.size
    if (problem := megatron_expert_problem(plan, dp)) is not None:
        raise ConfigError(problem)
    notes = [*_schedule_notes(plan), *cannot_express(layout, ENGINE), *parallel.notes]
    flags = [
        f"--tensor-model-parallel-size {t}",
        f"--pipeline-model-parallel-size {pp}",
        f"--context-parallel-size {cp}",
        f"--expert-model-parallel-size {ep}",
        f"--num-layers {layout.num_blocks}",
        f"--micro-batch-size {plan.training.microbatch_size}",
        f"--global-batch-size {plan.training.global_batch_size}",
    ]
    transformer: dict[str, Any] = {
        "tensor_model_parallel_size": t,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "expert_model_parallel_size": ep,
        "num_layers": layout.num_blocks,
    }
    if plan.model.tokens_per_sample:
        flags.append(f"--seq-length {plan.model.tokens_per_sample}")
    if t > 1:  # pipeplan's tensor-parallel cost model is Megatron's with sequence parallelism
        flags.append("--sequence-parallel")
        transformer["sequence_parallel"] = True
    if ep > 1:
        _expert_flags(plan, flags, transformer, notes)
    _layout_flags(plan, layout, flags, transformer, notes)
    _recompute_flags(plan, layout, flags, transformer, notes)
    ddp, optimizer = _optimizer_flags(plan, flags, notes)
    _precision_flags(plan, flags, transformer, optimizer, notes)
    members = [
        f"world size {t * cp * pp * dp} GPUs: tp {t} x cp {cp} x pp {pp} x dp {dp} (Megatron orders ranks tp-cp-dp-pp)"
    ]
    members += [_member_line(stage, layout, pp) for stage in layout.stages]
    return MegatronExport(
        flags=tuple(flags),
        notes=tuple(notes),
        members=tuple(members),
        transformer=transformer,
        ddp=ddp,
        optimizer=optimizer,
    )


def _member_line(stage, layout: BlockLayout, pp: int) -> str:
    return (
        f"stage {stage.index} (pipeline rank {stage.index % pp}, virtual stage {stage.index // pp}): "
        f"{describe_members(stage, layout.container)}"
    )


def _schedule_notes(plan: Plan) -> list[str]:
    note = schedule_info(plan.schedule).megatron_note(plan.chunks)  # "" for Megatron-Core's own schedules
    return [note] if note else []


def _expert_flags(plan: Plan, flags: list[str], transformer: dict, notes: list[str]) -> None:
    """The expert count Megatron-Core needs with ep > 1 (`num_moe_experts`), when the plan's model says it."""
    experts = _expert_count(plan)
    if experts is None:
        notes.append(
            "expert parallelism needs the model's expert count (--num-experts, TransformerConfig num_moe_experts), "
            "which this plan's model reference does not record: give it with the model's shape flags"
        )
        return
    flags.append(f"--num-experts {experts}")
    transformer["num_moe_experts"] = experts


def _expert_count(plan: Plan) -> int | None:
    """Routed experts of a built-in MoE model (its options, preset or factory default); None for other models."""
    ref, options = plan.model.ref, plan.model.options
    if builtin_family(ref) != "moe":
        return None
    builtin = BUILTINS[ref]
    given = options.get("experts", (builtin.preset or {}).get("experts"))
    if given is not None:
        return int(given)
    import inspect  # the factory's default: imports the model (torch), only for an ep plan of the default shape

    return int(inspect.signature(builtin.factory).parameters["experts"].default)


def _layout_flags(plan: Plan, layout: BlockLayout, flags: list[str], transformer: dict, notes: list[str]) -> None:
    counts = [len(stage.blocks) for stage in layout.stages]
    vpp, last = plan.chunks, len(layout.stages) - 1
    misplaced = any((s.before and s.index) or (s.after and s.index != last) for s in layout.stages)
    even = len(set(counts)) == 1 and not misplaced
    if even and vpp > 1:
        flags.append(f"--num-layers-per-virtual-pipeline-stage {counts[0]}")
        transformer["virtual_pipeline_model_parallel_size"] = vpp
    if even:
        return
    entries = []
    for stage in layout.stages:
        first, last = stage.index == 0, stage.index == len(layout.stages) - 1
        entries.append(("E" if first else "") + "t" * len(stage.blocks) + ("L" if last else ""))
        if (stage.before and not first) or (stage.after and not last):
            notes.append(
                f"stage {stage.index} holds {', '.join(stage.before + stage.after)}; Megatron keeps the embedding "
                "in the first stage and the final norm, output layer and loss in the last"
            )
    text = "|".join(entries)
    flags.append(f"--pipeline-model-parallel-layout {text}")
    transformer["pipeline_model_parallel_layout"] = text
    if vpp > 1:
        transformer["virtual_pipeline_model_parallel_size"] = vpp


def _recompute_flags(plan: Plan, layout: BlockLayout, flags: list[str], transformer: dict, notes: list[str]) -> None:
    modes = [stage.recompute for stage in plan.stages]
    chosen = "full" if "full" in modes else "selective" if "selective" in modes else "none"
    if chosen == "none":
        return
    if len(set(modes)) > 1:
        which = ", ".join(f"stage {s.index}: {s.recompute}" for s in plan.stages)
        notes.append(
            f"recomputation differs per stage ({which}); Megatron applies one setting to every stage: exported as "
            f"{chosen} everywhere (less memory, more compute than planned)"
        )
    flags.append(f"--recompute-granularity {chosen}")
    transformer["recompute_granularity"] = chosen
    if chosen == "full":  # one checkpoint per stage: chunks as long as the longest stage keep only its input
        longest = max(len(stage.blocks) for stage in layout.stages)
        flags += ["--recompute-method uniform", f"--recompute-num-layers {longest}"]
        transformer.update(recompute_method="uniform", recompute_num_layers=longest)


def _optimizer_flags(plan: Plan, flags: list[str], notes: list[str]) -> tuple[dict, dict]:
    training = plan.training
    overlap = Overlap.parse(training.overlap)
    ddp: dict[str, Any] = {}
    if training.zero:
        flags.append("--use-distributed-optimizer")
        ddp["use_distributed_optimizer"] = True
    if overlap.grad_reduce:
        flags.append("--overlap-grad-reduce")
        ddp["overlap_grad_reduce"] = True
    if overlap.param_gather:
        flags.append("--overlap-param-gather")
        ddp["overlap_param_gather"] = True
    if overlap.tensor:
        flags.append("--tp-comm-overlap")
        settings = [part for part in training.overlap.split(",") if "=" in part]  # sms=, chunks= (Overlap.label)
        if settings:
            notes.append(
                f"--overlap {','.join(settings)}: Megatron takes Transformer Engine's userbuffers settings (num_sm, "
                "aggregate, num_splits) from the YAML file of --tp-comm-overlap-cfg, which this export does not write"
            )
    if overlap.p2p and plan.chunks == 1:
        notes.append("--overlap p2p: Megatron overlaps pipeline transfers only for interleaved schedules")
    elif overlap.p2p:
        flags.append("--overlap-p2p-communication")
    names = {"adamw": "adam", "adamw-bf16moments": "adam", "adamw-bf16state": "adam", "sgd": "sgd"}
    name = {**names, "sgd-nomomentum": "sgd"}.get(training.optimizer)
    if name is None:
        notes.append(f"optimizer {training.optimizer} has no Megatron flag")
        return ddp, {"lr": training.lr, "weight_decay": training.weight_decay}
    flags += [f"--optimizer {name}", f"--lr {training.lr:g}", f"--weight-decay {training.weight_decay:g}"]
    if training.optimizer == "sgd-nomomentum":
        flags.append("--sgd-momentum 0")
    flags.append(f"--seed {training.seed}")
    optimizer = {"optimizer": name, "lr": training.lr, "weight_decay": training.weight_decay}
    if ddp.get("use_distributed_optimizer"):
        optimizer["use_distributed_optimizer"] = True
    _state_dtype_flags(training.optimizer, flags, optimizer, bool(training.zero))
    return ddp, optimizer


def _state_dtype_flags(name: str, flags: list[str], optimizer: dict, distributed: bool) -> None:
    """16-bit optimizer state (`_STATE_DTYPES`) as Megatron's precision-aware optimizer flags and kwargs; bf16 main
    params refused (`_BF16_MAIN_PARAMS`)."""
    if name == "adamw-bf16state":
        raise ConfigError(_BF16_MAIN_PARAMS)
    if name not in _STATE_DTYPES:
        return
    if not distributed:
        raise ConfigError(
            f"optimizer {name}: Megatron's precision-aware optimizer needs its distributed optimizer; plan with "
            "--memory zero=1 (or --layout ...,zero=1), or use adamw"
        )
    state_flags, kwargs = _STATE_DTYPES[name]
    flags += ["--use-precision-aware-optimizer", *state_flags]
    optimizer.update(use_precision_aware_optimizer=True, exp_avg_dtype="bfloat16", exp_avg_sq_dtype="bfloat16")
    optimizer.update(kwargs)


def _precision_flags(plan: Plan, flags: list[str], transformer: dict, optimizer: dict, notes: list[str]) -> None:
    precision_flags, note = _PRECISION_FLAGS[plan.training.precision]
    flags += precision_flags
    if note:
        notes.append(f"--precision {plan.training.precision}: {note}")
    dtype = "float32"
    for flag in precision_flags:
        key = {"--bf16": "bf16", "--fp16": "fp16"}.get(flag)
        if key:
            transformer[key] = optimizer[key] = True
            dtype = {"bf16": "bfloat16", "fp16": "float16"}[key]
    # Megatron-LM's core_transformer_config_from_args: params_dtype from --bf16 / --fp16, pipeline_dtype = params_dtype
    transformer.update(params_dtype=dtype, pipeline_dtype=dtype)
    if any(flag.startswith("--fp8-format") for flag in precision_flags):
        transformer["fp8"] = "hybrid"
