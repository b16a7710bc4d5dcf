"""Hugging Face transformers models as pipeplan models: `hf:gpt2`, `hf:llama`, `hf:bert`, any `hf:<model_type>`
that `AutoConfig.for_model` knows, or `hf:path/to/dir` (a local model directory: its config.json, and its
*.safetensors as initial weights). Nothing is downloaded: a model type is built from its default config.

`-a key=value` sets a config field (converted to the type of the field's default: `-a n_layer=4 -a n_embd=128`);
two options belong to the adapter itself:
- `task`: `causal-lm` (shifted next-token cross-entropy on the logits; the target is the input ids) or
  `classification` (cross-entropy of `num_labels` classes); default causal-lm for decoder model types (gpt2,
  llama, ...), classification for encoders (bert, roberta, ...);
- `seq_len`: tokens per sample of the synthetic batch (default min(128, the config's maximum positions));
- `data`: `fixed` (default: every training step sees the same synthetic batch, so the loss visibly falls) or
  `random` (a fresh random batch each step: random tokens have nothing to learn beyond their frequencies).
`use_cache` is turned off (a training step needs no key/value cache). The model returns its ModelOutput and the
loss reads `.logits` from it. transformers is an optional dependency: `pip install 'pipeplan[hf]'`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.errors import ModelError
from pipeplan.models.spec import ModelSpec

TASKS = ("causal-lm", "classification")
DATA = ("fixed", "random")
ADAPTER_OPTIONS = ("task", "seq_len", "data")
_POSITION_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx")
# mixture-of-experts types the adapter is tested with (tiny configs, profile -> plan -> exact 2-rank runs); their
# experts run as transformers' grouped-matmul implementation inside each decoder layer (docs/moe.md)
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ModelError("hf: models need transformers: pip install 'pipeplan[hf]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


def _base_config(target: str):
    transformers = _transformers()
    directory = Path(target)
    if (directory / "config.json").is_file():
        return transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True), directory
    if os.sep in target or target.startswith("."):
        raise ModelError(f"hf:{target}: no config.json in that directory (hf:DIR needs a local model directory)")
    try:
        return transformers.AutoConfig.for_model(target), None
    except ValueError:
        raise ModelError(
            f"hf:{target}: unknown model type; use a transformers model_type (gpt2, llama, bert, ...) or hf:path/to/dir"
        ) from None


def _convert(config, key: str, raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    default = getattr(config, key)
    kinds = [type(default)] if default is not None else [int, float]
    for kind in kinds:
        try:
            if kind is bool:
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(raw)
                return raw.lower() in ("true", "1", "yes")
            if kind in (int, float):
                return kind(raw)
        except ValueError:
            continue
        if kind is str:
            return raw
    if default is None:
        return raw
    raise ModelError(f"hf option {key}={raw!r} must be {type(default).__name__} (the type of the config's default)")


def _configure(target: str, options: dict[str, Any]):
    """(config with the options applied, model directory or None, adapter options, options as converted)."""
    config, directory = _base_config(target)
    adapter = {key: options[key] for key in ADAPTER_OPTIONS if key in options}
    applied: dict[str, Any] = {}
    for key, raw in options.items():
        if key in ADAPTER_OPTIONS:
            continue
        if not hasattr(config, key):
            raise ModelError(
                f"hf:{target} has no config field {key!r} (see transformers' {type(config).__name__}); adapter "
                f"options: {', '.join(ADAPTER_OPTIONS)}"
            )
        applied[key] = _convert(config, key, raw)
        setattr(config, key, applied[key])
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config, directory, adapter, applied


def _task(config, requested: Any) -> str:
    mappings = _transformers().models.auto.modeling_auto
    causal = type(config) in mappings.MODEL_FOR_CAUSAL_LM_MAPPING
    encoder = type(config) in mappings.MODEL_FOR_MASKED_LM_MAPPING  # BERT-like: has an LM head only as a decoder
    task = str(requested) if requested is not None else ("causal-lm" if causal and not encoder else "classification")
    if task not in TASKS:
        raise ModelError(f"hf option task={task!r} must be one of {', '.join(TASKS)}")
    if task == "causal-lm" and not causal:
        raise ModelError(f"hf model type {config.model_type!r} has no causal-LM head; use -a task=classification")
    return task


def _seq_len(config, requested: Any) -> int:
    limit = next((int(getattr(config, f)) for f in _POSITION_FIELDS if getattr(config, f, None)), None)
    seq = int(requested) if requested is not None else min(128, limit or 128)
    if seq < 2 or (limit is not None and seq > limit):
        raise ModelError(f"hf option seq_len={seq} must lie in [2, {limit}] (the config's maximum positions)")
    return seq


def _logits(output: Any) -> torch.Tensor:
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, dict):
        return output["logits"]
    return output[0] if isinstance(output, tuple | list) else output


def causal_lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position t predicts token t+1 of the target (the input ids)."""
    logits = _logits(output)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))


def with_router_aux_loss(loss_fn, coef: float):
    """`loss_fn` plus `coef` times the model's router load-balancing loss (`output.aux_loss`), as a transformers
    MoE model adds it to its loss when given labels and `output_router_logits` is on."""

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        aux = getattr(output, "aux_loss", None)
        return loss_fn(output, target) if aux is None else loss_fn(output, target) + coef * aux

    return loss


def classification_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_logits(output), target)


def _builder(config, directory: Path | None, task: str):
    transformers = _transformers()
    auto = transformers.AutoModelForCausalLM if task == "causal-lm" else transformers.AutoModelForSequenceClassification
    weights = sorted(directory.glob("*.safetensors")) if directory is not None else []

    def build() -> nn.Module:
        if weights and torch.get_default_device().type != "meta":
            model = auto.from_pretrained(str(directory), config=config, local_files_only=True)
        else:
            model = auto.from_config(config)
        return model.train()

    return build


def hf_model(target: str, options: dict[str, Any] | None = None) -> ModelSpec:
    """The ModelSpec of `hf:<target>` (see the module docstring)."""
    if not target:
        raise ModelError("hf: needs a model type or directory, e.g. hf:gpt2, hf:llama, hf:bert or hf:path/to/dir")
    config, directory, adapter, applied = _configure(target, dict(options or {}))
    task = _task(config, adapter.get("task"))
    seq = _seq_len(config, adapter.get("seq_len"))
    vocab, labels = int(config.vocab_size), int(getattr(config, "num_labels", 2))
    data = str(adapter.get("data", "fixed"))
    if data not in DATA:
        raise ModelError(f"hf option data={data!r} must be one of {', '.join(DATA)}")
    if task == "classification" and getattr(config, "pad_token_id", None) is None and hasattr(config, "pad_token_id"):
        config.pad_token_id = 0  # sequence classification of a decoder finds each row's last non-pad token

    loss_fn = causal_lm_loss if task == "causal-lm" else classification_loss
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", None):
        loss_fn = with_router_aux_loss(loss_fn, float(config.router_aux_loss_coef))

    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        ids = torch.randint(0, vocab, (batch_size, seq), generator=generator)
        if task == "causal-lm":
            return (ids,), ids.clone()
        return (ids,), torch.randint(0, labels, (batch_size,), generator=generator)

    def fixed_batches(batch_size: int, seed: int):
        batch = sample_batch(batch_size, generator=torch.Generator().manual_seed(seed))
        while True:
            yield batch

    return ModelSpec(
        name=f"hf:{target}",
        data=fixed_batches if data == "fixed" else None,
        build=_builder(config, directory, task),
        sample_batch=sample_batch,
        loss_fn=loss_fn,
        options={**applied, "task": task, "seq_len": seq, "data": data},
        tokens_per_sample=seq,
    )
