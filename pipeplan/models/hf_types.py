"""Which Hugging Face model types the `hf:` adapter supports: each listed type goes profile -> plan -> a 2-rank run
with losses and gradients equal to a single process (tests/models/test_hf_zoo.py runs every one from a tiny
config). A type not listed is tried with a warning; a refused kind is one ModelError line saying what is missing."""

from __future__ import annotations

# decoder-only language models (task causal-lm) and encoders (task classification), dense
DENSE = (
    "bloom",
    "cohere",
    "falcon",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gpt2",
    "gpt_neo",
    "gpt_neox",
    "gptj",
    "granite",
    "llama",
    "mistral",
    "olmo",
    "olmo2",
    "opt",
    "phi",
    "phi3",
    "qwen2",
    "qwen3",
    "stablelm",
    "starcoder2",
    # encoders: sequence classification
    "bert",
    "distilbert",
    "roberta",
    # vision: image classification on synthetic images
    "vit",
)

# mixture-of-experts types (router and experts inside each decoder layer, run as transformers' grouped-matmul
# experts: docs/models.md); tested by tests/graph/test_moe_trace.py and tests/runtime/test_moe_run.py
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")

SUPPORTED = DENSE + MOE


def refusal(config) -> str | None:
    """Why the adapter cannot train this config (one clause), or None."""
    if getattr(config, "is_encoder_decoder", False):
        return (
            "encoder-decoder models (seq2seq: the decoder reads the encoder's output and its own shifted labels) are "
            "not supported; use a decoder-only (llama, gpt2, ...) or an encoder (bert, ...) type"
        )
    if hasattr(config, "text_config") or hasattr(config, "vision_config"):
        return (
            "multimodal models (a config made of a text and a vision config) are not supported; use the text "
            "model's own type (e.g. gemma3_text for gemma3)"
        )
    return None
