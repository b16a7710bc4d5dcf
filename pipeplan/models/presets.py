"""Shapes of the models people plan now, as config field sets with their sources (no weights): each is a built-in
model (`pipeplan capacity llama-3.1-70b`: the `llama` or `moe` factory with fixed options) and a Hugging Face shape
(`hf:llama-3.1-70b`: the transformers model type built from the same fields as its config.json on the Hugging
Face Hub). `published_params` is the parameter count its authors state, which tests/models/test_presets.py holds
both builds to within 1%.

`seq` is the sequence length a plan uses by default (`--seq` / `-a seq_len` replace it): the pretraining length the
source states, or, where none is published, 4096 (marked so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    name: str
    description: str
    model_type: str  # transformers' model_type of the config.json
    fields: dict[str, Any]  # config.json fields that set its shapes
    factory: str  # the built-in factory ("llama", "moe") that builds the same shapes
    options: dict[str, Any]  # the factory's options (seq included)
    published_params: float
    source: str


_LLAMA3 = dict(vocab_size=128256, num_key_value_heads=8)
_LLAMA3_SOURCE = (
    "Hugging Face Hub config.json of meta-llama/{repo}; parameters and the 8K-token pretraining sequence: Llama Team, "
    "'The Llama 3 Herd of Models' (arXiv 2407.21783, 2024), Table 3 and §3.4.1"
)


def _llama3(name: str, repo: str, hidden: int, layers: int, heads: int, ffn: int, params: float, what: str):
    positions = 131072 if name.startswith("llama-3.1") else 8192  # 3.1: extended to 128K after pretraining
    fields = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ffn)
    fields["max_position_embeddings"] = positions
    options = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=8, intermediate=ffn, vocab=128256)
    return ModelPreset(
        name=name,
        description=what,
        model_type="llama",
        fields={**fields, **_LLAMA3},
        factory="llama",
        options={**options, "seq": 8192, "rope_theta": 500000.0},
        published_params=params,
        source=_LLAMA3_SOURCE.format(repo=repo),
    )


def _qwen25(name: str, hidden: int, layers: int, heads: int, kv: int, ffn: int, params: float, repo: str):
    return ModelPreset(
        name=name,
        description=f"Qwen2.5 {name.split('-')[-1].upper()} shapes (q/k/v biases, untied head)",
        model_type="qwen2",
        fields=dict(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            intermediate_size=ffn,
            vocab_size=152064,
            tie_word_embeddings=False,
        ),
        factory="llama",
        options=dict(
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv,
            intermediate=ffn,
            vocab=152064,
            qkv_bias=True,
            seq=4096,
            rope_theta=1000000.0,
        ),
        published_params=params,
        source=(
            f"Hugging Face Hub config.json of Qwen/{repo}; parameters and the 4,096-token initial pretraining "
            "sequence: Qwen Team, 'Qwen2.5 Technical Report' (arXiv 2412.15115, 2024), Table 1 and §3.2"
        ),
    )


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        _llama3("llama-3-8b", "Meta-Llama-3-8B", 4096, 32, 32, 14336, 8.03e9, "Llama 3 8B shapes"),
        _llama3("llama-3.1-8b", "Llama-3.1-8B", 4096, 32, 32, 14336, 8.03e9, "Llama 3.1 8B shapes"),
        _llama3("llama-3-70b", "Meta-Llama-3-70B", 8192, 80, 64, 28672, 70.6e9, "Llama 3 70B shapes"),
        _llama3("llama-3.1-70b", "Llama-3.1-70B", 8192, 80, 64, 28672, 70.6e9, "Llama 3.1 70B shapes"),
        _llama3("llama-3.1-405b", "Llama-3.1-405B", 16384, 126, 128, 53248, 405e9, "Llama 3.1 405B shapes"),
        _qwen25("qwen2.5-7b", 3584, 28, 28, 4, 18944, 7.61e9, "Qwen2.5-7B"),
        _qwen25("qwen2.5-72b", 8192, 80, 64, 8, 29568, 72.7e9, "Qwen2.5-72B"),
        ModelPreset(
            name="mistral-7b",
            description="Mistral 7B v0.3 shapes (grouped-query attention, 32768-token vocabulary, no sliding window)",
            model_type="mistral",
            fields=dict(
                hidden_size=4096,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                intermediate_size=14336,
                vocab_size=32768,
                sliding_window=None,
            ),
            factory="llama",
            options=dict(
                layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=32768, seq=8192, rope_theta=1e6
            ),
            published_params=7.25e9,
            source=(
                "Hugging Face Hub config.json of mistralai/Mistral-7B-v0.3 (7.25B parameters on its model page); "
                "the 8192-token context: Jiang et al., 'Mistral 7B' (arXiv 2310.06825, 2023), Table 1"
            ),
        ),
        ModelPreset(
            name="mixtral-8x22b",
            description="Mixtral 8x22B shapes: 8 experts, top-2, softmax gates, no shared experts",
            model_type="mixtral",
            fields=dict(
                hidden_size=6144,
                num_hidden_layers=56,
                num_attention_heads=48,
                num_key_value_heads=8,
                intermediate_size=16384,
                num_local_experts=8,
                num_experts_per_tok=2,
                vocab_size=32000,
                max_position_embeddings=65536,
            ),
            factory="moe",
            options=dict(
                layers=56,
                hidden=6144,
                heads=48,
                kv_heads=8,
                experts=8,
                top_k=2,
                expert_intermediate=16384,
                shared_experts=0,
                dense_layers=0,
                intermediate=16384,
                gate="softmax",
                vocab=32000,
                seq=4096,
                rope_theta=1e6,
            ),
            published_params=141e9,
            source=(
                "Hugging Face Hub config.json of mistral-community/Mixtral-8x22B-v0.1; 141B parameters (39B active): "
                "Mistral AI, 'Cheaper, Better, Faster, Stronger' (2024-04-17); no pretraining sequence length is "
                "published: seq 4096 (give --seq)"
            ),
        ),
        ModelPreset(
            name="gemma-2-27b",
            description=(
                "Gemma 2 27B shapes (head size 128, GeGLU, tied embeddings); the built-in leaves out its sliding "
                "windows, logit soft-capping and post-norms (no parameters to speak of)"
            ),
            model_type="gemma2",
            fields=dict(
                hidden_size=4608,
                num_hidden_layers=46,
                num_attention_heads=32,
                num_key_value_heads=16,
                head_dim=128,
                intermediate_size=36864,
                vocab_size=256000,
                query_pre_attn_scalar=144,
            ),
            factory="llama",
            options=dict(
                layers=46,
                hidden=4608,
                heads=32,
                kv_heads=16,
                head_dim=128,
                intermediate=36864,
                vocab=256000,
                activation="gelu_tanh",
                tie_embeddings=True,
                seq=8192,
            ),
            published_params=27.2e9,
            source=(
                "Hugging Face Hub config.json of google/gemma-2-27b; parameters (1,179,648,000 embedding + "
                "26,047,480,320 non-embedding) and the 8192-token context: Gemma Team, 'Gemma 2: Improving Open "
                "Language Models at a Practical Size' (arXiv 2408.00118, 2024), Tables 1 and 2"
            ),
        ),
    )
}


def preset_fields(name: str) -> tuple[str, dict[str, Any], int] | None:
    """(model_type, config fields, sequence length) of preset `name` as an `hf:` shape, or None."""
    preset = PRESETS.get(name)
    if preset is None:
        return None
    return preset.model_type, dict(preset.fields), int(preset.options["seq"])
