"""What Transformer Engine's FP8 linears keep for backward, counted on the meta device (precision `fp8`).

Under FP8 (delayed scaling, the recipe's weight gradient not overridden to 16 bits) Transformer Engine casts a
linear's input to FP8 for its forward GEMM and saves that FP8 copy — 1 byte per element — for the weight-gradient
GEMM, not the 16-bit input (transformer_engine/pytorch/module/linear.py, `_Linear.forward`: `saved_inputmat =
inputmat` (the FP8 cast) or its FP8 transpose, `inputmat_no_fp8` only without FP8; layernorm_linear.py saves the
norm's FP8 output `ln_out` beside the 16-bit norm input; TE 1.x, what NeMo 24.x containers ship). So:

- a 16-bit tensor that only FP8 linears saved is kept as its FP8 copy instead (the norm output feeding QKV and
  fc1, the activation output feeding fc2): 2 bytes -> 1 per element;
- a tensor another op saves too keeps its 16-bit self and gains the FP8 copy (attention's output, which the
  attention kernel saves and the output projection casts: 2 -> 3 bytes per element);
- linears reading the same tensor share one FP8 copy: Megatron-Core runs q, k, v as one fused linear and gate, up
  as one fc1 (TE's LayerNormLinear), one cast each;
- the copy is read by the weight-gradient GEMM only, so it is kept until W.

`Fp8Linears` (in `gpu_ops.GpuSemantics` with `fp8_linears`) records each linear with a parameter weight as it runs;
`fp8_saved_split` turns the 16-bit `SavedSplit` into the FP8 run's. The per-tensor scale kept beside each copy (a
few floats) is not counted. Grouped expert matmuls are not linears here: their inputs stay counted at 16 bits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from pipeplan.graph.saved_tensors import SavedSplit, node_saved_tensors, storage_key

FP8_BYTES = 1  # float8_e4m3fn / e5m2: one byte per element
_SEARCH_DEPTH = 3  # a linear's matmul node lies behind at most its output's view nodes


@dataclass
class Fp8Linears:
    """The linears an FP8 recipe runs, as (input, output) pairs, in call order."""

    calls: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def record(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self.calls.append((x, out))


def _matmul_node(out: torch.Tensor, key: int):
    """The autograd node of a linear's matmul: the first node behind `out` that saved its input's storage."""
    frontier = [out.grad_fn] if out.grad_fn is not None else []
    for _ in range(_SEARCH_DEPTH):
        for node in frontier:
            if any(storage_key(t) == key for t in node_saved_tensors(node)):
                return node
        frontier = [n for node in frontier for n, _ in node.next_functions if n is not None]
    return None


def _all_nodes(roots: Iterable[torch.Tensor]) -> list:
    """Every autograd node reachable from `roots`."""
    seen: dict[int, object] = {}
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return list(seen.values())


def _copies(calls: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[int, dict[tuple, int]]:
    """Storage key -> the FP8 copies made of it: one per distinct view read (offset, shape, strides) -> elements."""
    found: dict[int, dict[tuple, int]] = {}
    for x, _ in calls:
        view = (x.storage_offset(), tuple(x.shape), tuple(x.stride()))
        found.setdefault(storage_key(x), {})[view] = x.numel()
    return found


def fp8_saved_split(
    split: SavedSplit,
    held: dict[int, int],
    *,
    linears: Fp8Linears,
    roots: Sequence[torch.Tensor],
    weight_grad_nodes: Iterable,
) -> SavedSplit:
    """`split` (the 16-bit count: `held` storage key -> bytes, the storages the W pass's nodes saved) as an FP8 run
    keeps it (module docstring). Call before running backward."""
    matmuls = {id(n) for x, out in linears.calls if (n := _matmul_node(out, storage_key(x))) is not None}
    savers: dict[int, set[int]] = {}
    for node in _all_nodes(roots):
        for tensor in node_saved_tensors(node):
            savers.setdefault(storage_key(tensor), set()).add(id(node))
    kept = {storage_key(t) for node in weight_grad_nodes for t in node_saved_tensors(node)}
    kept_by_others = {
        storage_key(t) for node in weight_grad_nodes if id(node) not in matmuls for t in node_saved_tensors(node)
    }
    total, until_w = split.total_bytes, split.kept_until_weight_grad_bytes
    for key, views in _copies(linears.calls).items():
        if key not in held or not savers.get(key, set()) & matmuls:
            continue  # not saved by its linear (no weight gradient), or a parameter
        fp8 = FP8_BYTES * sum(views.values())
        if savers[key] <= matmuls:  # only the linears saved it: the 16-bit tensor goes
            total -= held[key]
            until_w -= held[key] if key in kept else 0
        elif key in kept and key not in kept_by_others:  # the 16-bit tensor is freed with I after all
            until_w -= held[key]
        total += fp8
        until_w += fp8
    return SavedSplit(total_bytes=total, kept_until_weight_grad_bytes=until_w)
