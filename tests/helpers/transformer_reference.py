"""Closed-form transformer references the tests check measured and analytic profiles, capacity estimates and the
search against (test oracles, not used by pipeplan itself).

Symbols: s sequence length, b microbatch size, h hidden size, a attention heads, t tensor-parallel size, d
data-parallel size; activations in 16-bit (2 bytes per element) with 1-byte dropout masks, as the paper assumes.

- Activation memory per transformer layer (Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", MLSys 2023, arXiv:2205.05198, §4 and Table 2), in bytes:

      no parallelism (eq. 1)                       s·b·h·(34 + 5·a·s/h)
      tensor parallel t (eq. 2)                    s·b·h·(10 + 24/t + 5·a·s/(h·t))
      tensor + sequence parallel (eq. 4)           s·b·h·(34/t + 5·a·s/(h·t))
      tensor parallel + selective recompute        s·b·h·(10 + 24/t)
      tensor + sequence parallel + selective       s·b·h·34/t
      full recompute                               s·b·h·2

  34·s·b·h: attention block 11 (QKV input 2, Q and K 4, V 2, projection input 2, dropout mask 1), MLP 19 (input 2,
  GELU input 8, second Linear input 8, dropout mask 1), two LayerNorm inputs 4; of these, 10 (the LayerNorm and
  dropout parts and the inputs of the first Linear of each block) are not split by tensor parallelism, and
  sequence parallelism splits them too. 5·a·s²·b: softmax output 2, its dropout mask 1, dropped probabilities 2;
  selective recomputation drops it, and so does a fused (flash) attention kernel. Full recomputation keeps each
  layer's input, 2·s·b·h (Table 2's row, stated there without parallelism); with sequence parallelism that input
  is sequence-sharded on each rank, 2·s·b·h/t (not a row of Table 2: Megatron checkpoints the sharded hidden
  states), and without it every tensor-parallel rank holds the whole input.
- Forward FLOPs per layer (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", 2021): 24·b·s·h² (the four h×h-scaled matmuls: qkv 6, projection 2, MLP 8 + 8) plus
  4·b·s²·h (scores and scores × values), counting 2 FLOPs per multiply-add and full (non-causal) attention, as
  torch.utils.flop_counter does. The 4·b·s²·h part is what selective recomputation runs again.
- Tensor-parallel communication per layer is a cost the search uses: `pipeplan.costs.tensor_parallel`.
- Megatron-LM's optimizer bytes per parameter, with and without its distributed optimizer: `megatron_bytes.py`.
"""

from __future__ import annotations

from pipeplan.errors import ConfigError

RECOMPUTE = ("none", "selective", "full")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")


def _check_tensor_parallel(*, hidden: int, heads: int, tensor_parallel: int) -> None:
    _check_positive(tensor_parallel=tensor_parallel)
    if hidden % tensor_parallel or heads % tensor_parallel:
        raise ConfigError(
            f"tensor parallel size {tensor_parallel} must divide hidden ({hidden}) and heads ({heads}) "
            "(Megatron splits whole heads)"
        )


def activation_bytes_per_layer(
    *,
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    flash_attention: bool,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> int:
    """Bytes one transformer layer keeps for backward on one tensor-parallel rank (Korthikanti et al. Table 2, see
    the module docstring): 10·s·b·h + 24·s·b·h/t, all 34·s·b·h/t with sequence parallelism, + 5·a·s²·b/t unless
    `flash_attention` or selective recompute drops it; full recompute keeps 2·s·b·h (/t with sequence
    parallelism)."""
    _check_positive(seq=seq, batch=batch, hidden=hidden, heads=heads)
    _check_tensor_parallel(hidden=hidden, heads=heads, tensor_parallel=tensor_parallel)
    if recompute not in RECOMPUTE:
        raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    t = tensor_parallel
    sbh_split = seq * batch * (hidden // t)  # s·b·h/t, exact since t divides h
    if recompute == "full":
        return 2 * (sbh_split if sequence_parallel else seq * batch * hidden)
    total = 34 * sbh_split if sequence_parallel else 10 * seq * batch * hidden + 24 * sbh_split
    if not flash_attention and recompute == "none":
        total += 5 * (heads // t) * seq * seq * batch
    return total


def llama_activation_bytes_per_layer(
    *, seq: int, batch: int, hidden: int, heads: int, kv_heads: int, intermediate: int, tensor_parallel: int = 1
) -> int:
    """Bytes a Llama-style layer (RMSNorm, grouped-query attention, SwiGLU, no dropout) keeps for backward with
    FlashAttention and fused norm and SwiGLU kernels, 16-bit activations, sequence parallelism over t ranks:
    s·b/t x (12h + 4h·g/a + 6F) — two norm inputs and outputs (8h), q (2h), k and v of the g key/value heads
    (4h·g/a), the attention output (2h), SwiGLU's gate and up (4F) and its output (2F). Megatron-LM's
    `compute_activation_memory` counts the GPT-style 34·s·b·h/t instead and notes it ignores grouped-query
    attention and SwiGLU (its TODO); this is the same accounting for those blocks (the fp32 reciprocal RMSs and
    logsumexp, s·b·(2 + a)·4 bytes, are left out)."""
    _check_positive(seq=seq, batch=batch, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate)
    per_token = 12 * hidden + 4 * hidden * kv_heads // heads + 6 * intermediate
    return seq * batch * per_token // tensor_parallel


def forward_flops_per_layer(*, seq: int, batch: int, hidden: int, causal: bool = False) -> int:
    """Forward matmul FLOPs of one GPT layer (4h MLP): 24·b·s·h² + 4·b·s²·h (Korthikanti et al. 2022, Appendix
    A), the attention term halved when a causal kernel skips the masked half (`attention_core_flops`)."""
    _check_positive(seq=seq, batch=batch, hidden=hidden)
    return 24 * batch * seq * hidden**2 + attention_core_flops(seq=seq, batch=batch, hidden=hidden, causal=causal)


def attention_core_flops(*, seq: int, batch: int, hidden: int, causal: bool = False) -> int:
    """Forward FLOPs of QKᵀ and the product with V, 4·b·s²·h: what selective recomputation re-runs; half under a
    causal mask as FlashAttention computes it (its benchmarks' `flops(..., causal)`: 4·b·s²·h / 2)."""
    _check_positive(seq=seq, batch=batch, hidden=hidden)
    return 4 * batch * seq**2 * hidden // (2 if causal else 1)


def lm_head_flops(*, seq: int, batch: int, hidden: int, vocab: int) -> int:
    """Forward FLOPs of the logits matmul: 2·b·s·h·V."""
    _check_positive(seq=seq, batch=batch, hidden=hidden, vocab=vocab)
    return 2 * batch * seq * hidden * vocab
