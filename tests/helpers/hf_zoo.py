"""Tiny configs of every `hf:` type the adapter lists (pipeplan.models.hf_types.SUPPORTED): 2 layers, hidden 32,
4 heads (2 key/value heads where the type has the field), feed-forward 64, vocabulary 128, 8 tokens, no dropout
(it would differ between processes). A field a type keeps independent of hidden_size (Gemma's and Qwen3's
head_dim) is given too, so that every shape follows from these options alone."""

from __future__ import annotations

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, SEQ = 2, 32, 4, 2, 64, 128, 8
FFN_FIELDS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "hidden_dim")
INDEPENDENT_HEAD_DIM = ("gemma", "gemma2", "gemma3_text", "qwen3")
VIT = {"image_size": "16", "patch_size": "8", "num_labels": "3"}
EXTRA = {
    "phi3": {"pad_token_id": "0"},  # its default pad id 32000 lies outside a 128-token vocabulary
    "gptj": {"rotary_dim": "4"},  # default 64 > the head size 8
    "gpt_neo": {"attention_types": '[[["global", "local"], 1]]'},  # one global and one local layer
    "vit": VIT,
}


def tiny_options(model_type: str) -> dict[str, str]:
    """`-a` options of a tiny `hf:<model_type>`, as strings (the CLI's form)."""
    import transformers

    default = transformers.AutoConfig.for_model(model_type)
    options = {"num_hidden_layers": str(LAYERS), "hidden_size": str(HIDDEN), "num_attention_heads": str(HEADS)}
    if hasattr(default, "vocab_size"):
        options.update(vocab_size=str(VOCAB), seq_len=str(SEQ))
    options.update({field: str(FFN) for field in FFN_FIELDS if field in default.to_dict()})
    if "num_key_value_heads" in default.to_dict():
        options["num_key_value_heads"] = str(KV_HEADS)
    if model_type in INDEPENDENT_HEAD_DIM:
        options["head_dim"] = str(HIDDEN // HEADS)
    for field, value in default.to_dict().items():
        if ("drop" in field) and isinstance(value, float) and value:
            options[field] = "0"
    return {**options, **EXTRA.get(model_type, {})}


def cli_args(options: dict[str, str]) -> list[str]:
    return [arg for key, value in options.items() for arg in ("-a", f"{key}={value}")]
