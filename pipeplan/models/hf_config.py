"""The config of an `hf:` model, built from the merged `-a` options the way `AutoConfig.for_model(model_type,
**fields)` builds it: every field is set before the config derives others from it (head_dim from hidden_size and
num_attention_heads, num_key_value_heads from num_attention_heads, ...), so the model is exactly the one asked
for. The default config is read only to know which fields exist and their types. `effective_fields` are the
fields that define the model's shapes, as built (recorded in the profile and the plan)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeplan.errors import ModelError
from pipeplan.models.presets import preset_fields

ADAPTER_OPTIONS = ("task", "seq_len", "data")

# Fields that define parameter and activation shapes (transformers' common names; a config's attribute_map turns
# them into its own, e.g. GPT-2's n_embd). Each is recorded where the config has it and it is set.
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "ffn_hidden_size",
    "hidden_dim",
    "max_position_embeddings",
    "partial_rotary_factor",
    "rotary_dim",
    "rotary_pct",
    "num_labels",
    "image_size",
    "patch_size",
    "num_channels",
    "d_ff",
    "num_decoder_layers",
)


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise ModelError("hf: models need transformers: pip install 'pipeplan[hf]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


def given_line(target: str, options: dict[str, Any]) -> str:
    """`hf:llama -a hidden_size=32 -a ...` (the model as the user asked for it, for error lines)."""
    shown = " ".join(f"-a {key}={value}" for key, value in options.items())
    return f"hf:{target} {shown}".rstrip()


def _default_config(target: str):
    """(the type's default config, a preset's (models/presets.py) or the directory's config, the directory or
    None)."""
    transformers = transformers_module()
    preset = preset_fields(target)
    if preset is not None:
        return transformers.AutoConfig.for_model(preset[0], **preset[1]), None
    directory = Path(target)
    if (directory / "config.json").is_file():
        _check_model_type(target, directory / "config.json")
        try:
            return transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True), directory
        except (ValueError, KeyError, TypeError, OSError) as exc:
            first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            raise ModelError(f"hf:{target}: transformers cannot read its config.json ({first}); fix the file") from None
    if os.sep in target or target.startswith("."):
        raise ModelError(f"hf:{target}: no config.json in that directory (hf:DIR needs a local model directory)")
    try:
        return transformers.AutoConfig.for_model(target), None
    except ValueError:
        raise ModelError(
            f"hf:{target}: unknown model type; use a transformers model_type (gpt2, llama, bert, ...) or hf:path/to/dir"
        ) from None


# config fields that count or size something: a value < 1 given with -a is refused (n_layer=-1 looped forever)
SIZE_FIELDS = frozenset(
    {
        "vocab_size",
        "n_positions",
        "n_ctx",
        "max_position_embeddings",
        "n_layer",
        "num_hidden_layers",
        "n_embd",
        "hidden_size",
        "d_model",
        "n_head",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "n_inner",
        "num_local_experts",
        "num_experts",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "num_layers",
        "num_heads",
    }
)


def _check_model_type(target: str, path: Path) -> None:
    """A config directory's config.json names one known transformers model type (as a string)."""
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelError(f"hf:{target}: {str(path)!r} is not valid JSON ({exc}); fix or replace it") from None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if not isinstance(model_type, str) or not model_type:
        found = "has none" if model_type is None else f"holds {model_type!r}"
        raise ModelError(
            f'hf:{target}: config.json needs a "model_type" string (gpt2, llama, ...) and {found}; add the type '
            "its model was saved as"
        )
    if model_type not in transformers_module().CONFIG_MAPPING:
        raise ModelError(
            f"hf:{target}: config.json's model_type {model_type!r} is not a type this transformers "
            f"({transformers_module().__version__}) knows; fix model_type or upgrade transformers"
        )


def _convert(config, key: str, raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    if raw.lower() in ("null", "none"):  # a field that may be unset (Mistral's sliding_window=null)
        return None
    default = getattr(config, key)
    if isinstance(default, list | dict):  # e.g. GPT-Neo's attention_types=[[["global","local"],1]]: JSON
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, type(default)):
            kind_name = type(default).__name__
            raise ModelError(f"hf option {key}={raw!r} must be a JSON {kind_name} (as the config's default)")
        return value
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


def _fields(target: str, default, options: dict[str, Any]) -> dict[str, Any]:
    """The config fields among `options`, converted to their defaults' types (one line per unknown field)."""
    fields: dict[str, Any] = {}
    for key, raw in options.items():
        if key in ADAPTER_OPTIONS:
            continue
        if not hasattr(default, key):
            raise ModelError(
                f"hf:{target} has no config field {key!r} (see transformers' {type(default).__name__}); adapter "
                f"options: {', '.join(ADAPTER_OPTIONS)}"
            )
        fields[key] = _convert(default, key, raw)
        value = fields[key]
        if key in SIZE_FIELDS and isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ModelError(f"hf option {key}={value} must be >= 1 (a size or count of {type(default).__name__})")
    return fields


def build_config(target: str, options: dict[str, Any], check: Callable[[Any, Path | None], None] | None = None):
    """(config built from the merged fields, model directory or None, the fields as converted); `check(default
    config, directory)` runs first (a refused kind of model is refused before its fields are looked at)."""
    default, directory = _default_config(target)
    if check is not None:
        check(default, directory)
    fields = _fields(target, default, options)
    merged = {**fields, **({"use_cache": False} if hasattr(default, "use_cache") else {})}
    try:
        preset = preset_fields(target)
        if directory is not None:
            config = type(default).from_dict({**default.to_dict(), **merged})
        elif preset is not None:  # the preset's fields, the given ones over them
            config = transformers_module().AutoConfig.for_model(preset[0], **{**preset[1], **merged})
        else:
            config = transformers_module().AutoConfig.for_model(target, **merged)
    except Exception as exc:  # a config's own validation of the fields (ValueError, AssertionError, ...)
        raise ModelError(
            f"{given_line(target, fields)}: the config refuses these options: {type(exc).__name__}: {first_line(exc)}"
        ) from None
    check_fields(target, config, fields)
    return config, directory, fields


def check_fields(target: str, config, fields: dict[str, Any]) -> None:
    """Fields whose mismatch the model only meets far from the cause (an embedding's padding_idx assertion, a
    broadcast inside rotary attention): one line naming them."""
    rotary, hidden, heads = (getattr(config, k, None) for k in ("rotary_dim", "hidden_size", "num_attention_heads"))
    if (
        isinstance(rotary, int)
        and isinstance(hidden, int)
        and isinstance(heads, int)
        and heads
        and rotary > hidden // heads
    ):
        whose = "given" if "rotary_dim" in fields else "the config's default"
        raise ModelError(
            f"hf:{target}: rotary_dim={rotary} ({whose}) exceeds the head size hidden_size / num_attention_heads = "
            f"{hidden // heads}; give -a rotary_dim={hidden // heads} or less"
        )
    # (MLA, DeepSeek's: every head's keys and values come from one latent, kv_lora_rank; the field groups nothing)
    kv = None if getattr(config, "kv_lora_rank", None) else getattr(config, "num_key_value_heads", None)
    if isinstance(kv, int) and isinstance(heads, int) and kv > 0 and heads % kv:  # grouped-query attention's groups
        whose = "given" if "num_key_value_heads" in fields else "the config's default"
        raise ModelError(
            f"hf:{target}: num_key_value_heads={kv} ({whose}) does not divide num_attention_heads={heads}; give "
            f"-a num_key_value_heads={next(d for d in range(min(kv, heads), 0, -1) if heads % d == 0)} (or another "
            f"divisor of {heads})"
        )
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int) and not 0 <= pad < vocab:  # the embedding's padding_idx: the model cannot be built
        whose = "given" if "pad_token_id" in fields else "the config's default"
        raise ModelError(
            f"hf:{target}: vocab_size={vocab} but pad_token_id={pad} ({whose}) must be a token of the vocabulary; "
            f"give -a vocab_size above {pad} or -a pad_token_id below {vocab}"
        )


def first_line(exc: BaseException) -> str:
    """The message's first line, with the next one where the first only announces it (ends with a colon, as
    transformers' config validation errors do), on one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return text if len(text) <= 400 else text[:397] + "..."


def effective_fields(config) -> dict[str, Any]:
    """The shape-defining fields of `config` under its own names (GPT-2: n_embd, n_layer, ...), as built: each a
    field the config serializes, so that giving them all again as -a options rebuilds the same config."""
    aliases = getattr(config, "attribute_map", {}) or {}
    settable = {*config.to_dict(), "num_labels"}  # not a read-only property (Falcon's head_dim): -a can give it
    found: dict[str, Any] = {}
    for name in SHAPE_FIELDS:
        own = aliases.get(name, name)
        value = getattr(config, own, None)
        if own in settable and isinstance(value, int | float) and not isinstance(value, bool):
            found[own] = value
    return found
