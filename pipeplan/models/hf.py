"""Hugging Face transformers models as pipeplan models: `hf:gpt2`, `hf:llama`, `hf:bert`, `hf:vit`, any
`hf:<model_type>` that `AutoConfig.for_model` knows, a preset's shapes (`hf:llama-3.1-70b`: models/presets.py, its
sequence length the default seq_len), or `hf:path/to/dir` (a local model directory: its config.json, and its
*.safetensors as initial weights). Nothing is downloaded: a model type is built from its default config.
The types tested end to end are listed in models/hf_types.py; another type is tried with a warning, and
encoder-decoder and multimodal configs are refused in one line.

`-a key=value` sets a config field (converted to the type of the field's default, JSON for a list or dict field:
`-a n_layer=4 -a n_embd=128`); the config is built from the merged fields (models/hf_config.py), so derived fields
(head_dim, num_key_value_heads, layer_types, ...) follow the given ones; the spec's options, which the profile and
the plan record, hold the effective shape-defining fields. An error the config or the model build raises on these
fields is one ModelError line naming the -a options. Three options belong to the adapter itself:
- `task`: `causal-lm` (shifted next-token cross-entropy on the logits; the target is the input ids),
  `classification` (cross-entropy of `num_labels` classes over token sequences) or `image-classification`
  (cross-entropy of `num_labels` classes over synthetic images of the config's num_channels x image_size x
  image_size); default causal-lm for decoder model types (gpt2, llama, ...), classification for encoders (bert,
  roberta, ...), image-classification for vision types (vit);
- `seq_len`: tokens per sample of the synthetic batch (default min(128, the config's maximum positions));
- `data`: `fixed` (default: every training step sees the same synthetic batch, so the loss visibly falls) or
  `random` (a fresh random batch each step: random tokens have nothing to learn beyond their frequencies).
`use_cache` is turned off (a training step needs no key/value cache). The model returns its ModelOutput and the
loss reads `.logits` from it.

Attention runs as transformers runs it in an eager training step: the config's attention implementation (sdpa where
the type supports it), and a plain causal (or, for encoders, full) mask without padding left to the kernel
(`is_causal`, no mask tensor: FlashAttention on a GPU). transformers builds that mask when it is being exported,
since an exported graph may later meet other query lengths; pipeplan exports again for every shape it runs, so its
traces take the eager step's choice (`eager_masks`, the spec's trace context). A mask that is more than causal (a
sliding window shorter than the sequence) is still built and passed to the kernel.
transformers is an optional dependency: `pip install 'pipeplan[hf]'`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.console import warn
from pipeplan.errors import ModelError
from pipeplan.models.hf_config import (
    ADAPTER_OPTIONS,
    SHAPE_FIELDS,
    build_config,
    effective_fields,
    first_line,
    given_line,
    transformers_module,
)
from pipeplan.models.hf_types import MOE, SUPPORTED, refusal
from pipeplan.models.presets import preset_fields
from pipeplan.models.spec import ModelSpec

TASKS = ("causal-lm", "classification", "image-classification")
IGNORED = -100  # a label cross-entropy skips
DATA = ("fixed", "random")
_POSITION_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx")
MOE_TYPES = MOE  # mixture-of-experts types the adapter is tested with (models/hf_types.py)
_AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "classification": "AutoModelForSequenceClassification",
    "image-classification": "AutoModelForImageClassification",
}
_MAPPINGS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING",
    "classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING",
}


def _has_head(config, task: str) -> bool:
    mapping = getattr(transformers_module().models.auto.modeling_auto, _MAPPINGS[task])
    return type(config) in mapping


def _task(config, requested: Any) -> str:
    if requested is None:
        mappings = transformers_module().models.auto.modeling_auto
        encoder = type(config) in mappings.MODEL_FOR_MASKED_LM_MAPPING  # BERT-like: an LM head only as a decoder
        if _has_head(config, "causal-lm") and not encoder:
            return "causal-lm"
        return "image-classification" if _has_head(config, "image-classification") else "classification"
    task = str(requested)
    if task not in TASKS:
        raise ModelError(f"hf option task={task!r} must be one of {', '.join(TASKS)}")
    if not _has_head(config, task):
        heads = [t for t in TASKS if _has_head(config, t)]
        raise ModelError(
            f"hf model type {config.model_type!r} has no {task} head; use -a task={heads[0]}"
            if heads
            else f"hf model type {config.model_type!r} has no {task} head"
        )
    return task


def _seq_len(config, requested: Any, default: int | None = None, given: AbstractSet[str] = frozenset()) -> int:
    limit = next((int(getattr(config, f)) for f in _POSITION_FIELDS if getattr(config, f, None)), None)
    try:
        seq = int(requested) if requested is not None else (default or min(128, limit or 128))
    except (TypeError, ValueError):
        raise ModelError(f"hf option seq_len={requested!r} must be an integer (tokens per sample)") from None
    if limit is not None and seq > limit and _rotary_default(config, given):
        # rotary positions have no table: max_position_embeddings is only the config's default cap (recorded in the
        # spec's options with the other shape fields, so every rebuild has it)
        config.max_position_embeddings = seq
        limit = seq
    if seq < 2 or (limit is not None and seq > limit):
        raise ModelError(f"hf option seq_len={seq} must lie in [2, {limit}] (the config's maximum positions)")
    return seq


def _rotary_default(config, given: AbstractSet[str]) -> bool:
    """The position limit is max_position_embeddings of a rotary model, not given by the user (raising it
    changes no parameter)."""
    rotary = any(getattr(config, name, None) is not None for name in ("rope_parameters", "rope_theta", "rope_scaling"))
    table = any(getattr(config, name, None) for name in ("n_positions", "n_ctx"))
    return rotary and not table and "max_position_embeddings" not in given


def _logits(output: Any) -> torch.Tensor:
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, dict):
        return output["logits"]
    return output[0] if isinstance(output, tuple | list) else output


def causal_lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position t predicts token t+1 of the target (the input ids); the last position
    predicts nothing. The labels are shifted, not the logits (as transformers' loss does): slicing the logits would
    copy all b x (s-1) x vocab of them."""
    logits = _logits(output)
    labels = F.pad(target[:, 1:], (0, 1), value=IGNORED)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORED)


def with_router_aux_loss(loss_fn, coef: float):
    """`loss_fn` plus `coef` times the model's router load-balancing loss (`output.aux_loss`), as a transformers
    MoE model adds it to its loss when given labels and `output_router_logits` is on."""

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        aux = getattr(output, "aux_loss", None)
        return loss_fn(output, target) if aux is None else loss_fn(output, target) + coef * aux

    return loss


def classification_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_logits(output), target)


def _builder(config, directory: Path | None, task: str, asked: str):
    """build() of the model; an exception while building it from the config is one line naming the options."""
    auto = getattr(transformers_module(), _AUTO_CLASSES[task])
    weights = sorted(directory.glob("*.safetensors")) if directory is not None else []

    def build() -> nn.Module:
        try:
            if weights and torch.get_default_device().type != "meta":
                model = auto.from_pretrained(str(directory), config=config, local_files_only=True)
            else:
                model = auto.from_config(config)
        except ModelError:
            raise
        except Exception as exc:
            none = isinstance(exc, TypeError) and "NoneType" in str(exc)  # a field the model needs left unset
            unset = [n for n in SHAPE_FIELDS if none and n in config.to_dict() and getattr(config, n) is None]
            hint = f"its config leaves {', '.join(unset)} unset: give -a {unset[0]}=N" if unset else "check -a options"
            raise ModelError(
                f"{asked}: building the model from its config raised {type(exc).__name__}: {first_line(exc)}; {hint}"
            ) from None
        return model.train()

    return build


def _shapes(config, task: str) -> dict[str, Any]:
    """The config fields that define the model's shapes (num_labels only where a classifier head uses it)."""
    fields = effective_fields(config)
    if task == "causal-lm":
        fields.pop("num_labels", None)
    return fields


def _sampler(config, task: str, adapter: dict[str, Any], given: AbstractSet[str] = frozenset()):
    """(sample_batch(batch_size, generator), tokens per sample or None) of the task's synthetic batches."""
    labels = int(getattr(config, "num_labels", 2))
    if task == "image-classification":
        if "seq_len" in adapter:
            raise ModelError("hf option seq_len is for token models; an image's size is -a image_size (and patch_size)")
        size, channels = int(config.image_size), int(getattr(config, "num_channels", 3))

        def images(batch_size: int, generator: torch.Generator | None = None):
            pixels = torch.randn((batch_size, channels, size, size), generator=generator)
            return (pixels,), torch.randint(0, labels, (batch_size,), generator=generator)

        return images, None
    seq, vocab = _seq_len(config, adapter.get("seq_len"), given=given), int(config.vocab_size)

    def tokens(batch_size: int, generator: torch.Generator | None = None):
        ids = torch.randint(0, vocab, (batch_size, seq), generator=generator)
        if task == "causal-lm":
            return (ids,), ids.clone()
        return (ids,), torch.randint(0, labels, (batch_size,), generator=generator)

    return tokens, seq


# transformers' names its mask builders consult, and what an eager step of pipeplan's batches answers: not exporting,
# and no packed sequences (the adapter passes input ids only: every row's positions are 0..s-1)
_EAGER_ANSWERS = {"is_torchdynamo_exporting": lambda: False, "find_packed_sequence_indices": lambda position_ids: None}


@contextlib.contextmanager
def eager_masks() -> Iterator[None]:
    """Trace with transformers' eager-step masks (module docstring): its mask builders skip a plain causal mask
    unless it is being exported or the positions may pack several sequences (which it cannot tell from fake
    tensors); this context gives them an eager step's answers while a trace runs (a name a transformers version
    lacks is left alone: its mask is then traced as built)."""
    masking = transformers_module().masking_utils
    saved = {name: getattr(masking, name) for name in _EAGER_ANSWERS if hasattr(masking, name)}
    try:
        for name in saved:
            setattr(masking, name, _EAGER_ANSWERS[name])
        yield
    finally:
        for name, value in saved.items():
            setattr(masking, name, value)


def _check_type(target: str, config, directory: Path | None) -> None:
    reason = refusal(config)
    if reason is not None:
        raise ModelError(f"hf:{target} ({config.model_type}): {reason}")
    if directory is None and config.model_type not in SUPPORTED and "TORCHELASTIC_RUN_ID" not in os.environ:
        # said once, where the user runs a command (not again by each rank of `run`)
        warn(
            f"hf:{target} is not among the types tested end to end (pipeplan/models/hf_types.py); trying it", once=True
        )


def hf_model(target: str, options: dict[str, Any] | None = None) -> ModelSpec:
    """The ModelSpec of `hf:<target>` (see the module docstring)."""
    if not target:
        raise ModelError("hf: needs a model type or directory, e.g. hf:gpt2, hf:llama, hf:bert or hf:path/to/dir")
    options = dict(options or {})
    adapter = {key: options[key] for key in ADAPTER_OPTIONS if key in options}
    config, directory, applied = build_config(
        target, options, check=lambda default, at: _check_type(target, default, at)
    )
    task = _task(config, adapter.get("task"))
    data = str(adapter.get("data", "fixed"))
    if data not in DATA:
        raise ModelError(f"hf option data={data!r} must be one of {', '.join(DATA)}")
    if task == "classification" and getattr(config, "pad_token_id", None) is None and hasattr(config, "pad_token_id"):
        config.pad_token_id = 0  # sequence classification of a decoder finds each row's last non-pad token
    preset = preset_fields(target)
    if preset is not None and "seq_len" not in adapter:  # a preset's sequence length (models/presets.py)
        adapter["seq_len"] = preset[2]
    sample_batch, seq = _sampler(config, task, adapter, set(applied))
    loss_fn = causal_lm_loss if task == "causal-lm" else classification_loss
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", None):
        loss_fn = with_router_aux_loss(loss_fn, float(config.router_aux_loss_coef))

    def fixed_batches(batch_size: int, seed: int):
        batch = sample_batch(batch_size, generator=torch.Generator().manual_seed(seed))
        while True:
            yield batch

    shown = {"seq_len": seq} if seq is not None else {}
    return ModelSpec(
        name=f"hf:{target}",
        data=fixed_batches if data == "fixed" else None,
        build=_builder(config, directory, task, given_line(target, applied)),
        sample_batch=sample_batch,
        loss_fn=loss_fn,
        options={**_shapes(config, task), **applied, "task": task, **shown, "data": data},
        tokens_per_sample=seq,
        trace_context=eager_masks,
    )
