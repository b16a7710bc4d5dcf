"""Closed-form transformer costs used as references for analytic profiles and capacity estimates.

- Activation memory per layer (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", 2022, eq. 1, no tensor/sequence parallelism): `s·b·h·(34 + 5·a·s/h)` bytes = 34·s·b·h + 5·a·s²·b
  with 16-bit activations and 1-byte dropout masks. The 5·a·s²·b term is the attention scores (2), softmax
  dropout mask (1) and dropped probabilities (2); FlashAttention (like selective recomputation) removes it.
- Forward FLOPs per layer (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", 2021): 24·b·s·h² (the four h×h-scaled matmuls: qkv 6, projection 2, MLP 8 + 8) plus
  4·b·s²·h (scores and scores × values), counting 2 FLOPs per multiply-add and full (non-causal) attention, as
  torch.utils.flop_counter does.
"""

from __future__ import annotations

from pipeplan.errors import ConfigError


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")


def activation_bytes_per_layer(*, seq: int, batch: int, hidden: int, heads: int, flash_attention: bool) -> int:
    """Bytes one transformer layer saves for backward: 34·s·b·h (+ 5·a·s²·b without flash attention)."""
    _check_positive(seq=seq, batch=batch, hidden=hidden, heads=heads)
    total = 34 * seq * batch * hidden
    if not flash_attention:
        total += 5 * heads * seq * seq * batch
    return total


def forward_flops_per_layer(*, seq: int, batch: int, hidden: int) -> int:
    """Forward matmul FLOPs of one GPT layer (4h MLP): 24·b·s·h² + 4·b·s²·h."""
    _check_positive(seq=seq, batch=batch, hidden=hidden)
    return 24 * batch * seq * hidden**2 + 4 * batch * seq**2 * hidden


def lm_head_flops(*, seq: int, batch: int, hidden: int, vocab: int) -> int:
    """Forward FLOPs of the logits matmul: 2·b·s·h·V."""
    _check_positive(seq=seq, batch=batch, hidden=hidden, vocab=vocab)
    return 2 * batch * seq * hidden * vocab
