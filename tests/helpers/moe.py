"""Tiny mixture-of-experts models the MoE tests share: Hugging Face MoE types (2-3 decoder layers, hidden 32, 4
experts, top-2, router logits and the auxiliary loss on where the type has one) and the user factory in
tests/graph/moe_user_models.py (data-dependent dispatch, nothing declared)."""

from __future__ import annotations

from pathlib import Path

_COMMON = {"num_hidden_layers": "2", "hidden_size": "32", "intermediate_size": "64", "num_attention_heads": "4"}
_COMMON.update({"num_key_value_heads": "2", "vocab_size": "96", "seq_len": "8", "num_experts_per_tok": "2"})
_AUX = {"output_router_logits": "true"}

HF_MOE = {
    "mixtral": {**_COMMON, **_AUX, "num_local_experts": "4"},
    "qwen2_moe": {
        **_COMMON,
        **_AUX,
        "num_experts": "4",
        "moe_intermediate_size": "32",
        "shared_expert_intermediate_size": "32",
    },
    "qwen3_moe": {**_COMMON, **_AUX, "num_experts": "4", "moe_intermediate_size": "32"},
    # DeepSeek-V3: MLA attention, one dense layer then MoE layers of 4 routed + 1 shared expert (no aux loss)
    "deepseek_v3": {
        **_COMMON,
        "num_hidden_layers": "3",
        "num_key_value_heads": "4",
        "n_routed_experts": "4",
        "n_shared_experts": "1",
        "moe_intermediate_size": "32",
        "first_k_dense_replace": "1",
        "kv_lora_rank": "16",
        "q_lora_rank": "16",
        "qk_rope_head_dim": "4",
        "head_dim": "4",
        "qk_nope_head_dim": "4",
        "v_head_dim": "8",
        "n_group": "1",
        "topk_group": "1",
    },
}

USER_MOE = str(Path(__file__).parents[1] / "graph" / "moe_user_models.py") + ":moe_lm"
