"""A Hugging Face model in your own factory: a tiny Llama built from a LlamaConfig (nothing downloaded).

The built-in adapter already covers the common case without any code (`pipeplan profile hf:llama -a
num_hidden_layers=4 ...`, see examples/README.md); write a factory like this one when you need your own config,
head, data or loss. Needs transformers: pip install 'pipeplan[hf]'.

    pipeplan profile examples/hf_model.py:build -a layers=4 --batch-size 2 -o llama-profile.json
    pipeplan plan examples/hf_model.py:build -a layers=4 --profile llama-profile.json --devices 2 -o llama-plan
    pipeplan run llama-plan/plan.json --steps 10

torch.fx cannot trace transformers' code, so pipeplan traces it with torch.export (automatically; `--tracer export`
forces it) and groups layers by module: `model.embed_tokens`, `model.layers.{i}`, `model.norm`, `lm_head`. The
forward returns a `CausalLMOutputWithPast`; `loss_fn` receives it exactly as returned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from pipeplan.models.spec import ModelSpec


def build(layers: int = 4, hidden: int = 128, heads: int = 4, seq: int = 64, vocab: int = 1000) -> ModelSpec:
    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        intermediate_size=4 * hidden,
        vocab_size=vocab,
        max_position_embeddings=seq,
        use_cache=False,  # a training step needs no key/value cache
    )

    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        ids = torch.randint(0, vocab, (batch_size, seq), generator=generator)
        return (ids,), ids  # next-token prediction: the target is the input, shifted in the loss

    def loss_fn(output, ids: torch.Tensor) -> torch.Tensor:
        logits = output.logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))

    return ModelSpec(
        name="hf-llama-tiny",
        build=lambda: LlamaForCausalLM(config).train(),
        sample_batch=sample_batch,
        loss_fn=loss_fn,
        tokens_per_sample=seq,
    )
