"""Which matmuls and attention calls a layer's forward runs, and how Megatron-style tensor parallelism with sequence
parallelism splits each (Shoeybi et al. 2019, §3; Korthikanti et al. 2022, §4.2.2), found by following which
activations are split while the forward runs on the meta device:

- a linear (a matmul with a parameter operand) whose activation input is whole is column-parallel: each rank
  computes n / t output features, and its output is split; one whose input is split is row-parallel: each rank
  contracts k / t features and the output is reduced (whole again);
- any other op's output is split when one of its inputs is (attention's inputs come from column-parallel linears,
  so attention splits its heads: `b`, the batch of samples x heads);
- views and casts of a parameter stay parameters (a linear's `weight.t()`, a router's `weight.float()`, autocast's
  bf16 weight);
- a column-parallel linear whose output features are then reduced over (a norm's statistics, a router's softmax
  or top-k: found by following which activations still hold its output features, through elementwise ops and
  slices of the last dimension, but not a reshape to heads) cannot be split by features: Megatron duplicates it
  (MLA's q and kv down-projections before their norms, a MoE router). It is changed to a duplicated linear, its
  output to whole, and it keeps its rows split by t (sequence parallelism runs it on each rank's tokens);
  `duplicated_params` are its weights, held whole by every rank. Roles are thus found by structure, whatever the
  model's names: q/k/v (column), o (row), MLP up/gate (column) and down (row), experts, router, norms.

Token positions (what context parallelism splits, `cp`) are a linear's rows (`m`: samples x positions) and
attention's query positions; the microbatch grows a linear's rows and attention's batch (`tokens`). Every matmul
and attention call becomes one `Kernel` at the shape it ran (t = cp = 1).

A batched matmul whose second operand is a 3-D parameter is a grouped expert matmul (`Kernel.experts`: one matmul
per expert over its stacked weights, `models.moe.Experts`); so is a grouped-mm call (`aten._grouped_mm`,
transformers' `grouped_mm_fallback`: tokens sorted by expert x (experts, in, out) weights, per-expert offsets),
whose rows are taken as balanced over the experts (the offsets hold no data on the meta device). Those parameters
are the layer's expert weights (`expert_params`), which expert parallelism splits over its ranks."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.utils._pytree import tree_flatten

from pipeplan.graph.saved_tensors import storage_key
from pipeplan.profiling.kernels import Kernel

aten = torch.ops.aten
GEMM_OPS = {aten.mm.default: 0, aten.addmm.default: 1, aten.bmm.default: 0, aten.baddbmm.default: 1}  # first operand
# fused attention kernels: (op, the position of its is_causal argument)
ATTENTION_CAUSAL_ARG = {
    aten._scaled_dot_product_flash_attention.default: 4,
    aten._scaled_dot_product_efficient_attention.default: 6,
}
ATTENTION_OPS = frozenset(ATTENTION_CAUSAL_ARG)
ATTENTION_BACKWARD_OPS = (
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
)
KERNEL_OPS = frozenset((*GEMM_OPS, *ATTENTION_OPS, *ATTENTION_BACKWARD_OPS))
GROUPED_MM = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")  # (tokens, in) x (experts, in, out)
GROUPED_MM_BACKWARD = ("transformers::grouped_mm_fallback_backward",)  # timed from the forward's Kernel
REPEAT_CARRIERS = frozenset((aten.clone.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default))


def _op_name(func) -> str:
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else ""


def is_grouped_mm(func) -> bool:
    """A grouped expert matmul (by name: transformers registers its op when a model is built)."""
    return _op_name(func) in GROUPED_MM


def is_kernel_op(func) -> bool:
    """An op timed as (part of) a Kernel, not by the roofline of the rest."""
    return func in KERNEL_OPS or _op_name(func) in GROUPED_MM + GROUPED_MM_BACKWARD


def grouped_mm_flops(args: tuple) -> float:
    """2 x tokens x in x out: each sorted token row runs through one expert's (in, out) matrix."""
    tokens, weight = args[0], args[1]
    return 2.0 * tokens.shape[0] * weight.shape[-2] * weight.shape[-1]


def _is_view(func) -> bool:
    """An op whose output aliases an input (view, t, transpose, expand, ...)."""
    return any(a.alias_info is not None and not a.alias_info.is_write for a in func._schema.arguments)


def _tensors(value) -> list[torch.Tensor]:
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]


# ops that reduce a tensor over its last dimension (a norm's statistics, a router's softmax); the loss's
# log-softmax over a vocabulary-parallel head is not one of them (Megatron's vocab-parallel cross entropy)
# (a router's top-k selection too), and where the op takes the dimensions
_REDUCE_DIM = {
    "mean": 1,
    "sum": 1,
    "var": 1,
    "var_mean": 1,
    "amax": 1,
    "amin": 1,
    "_softmax": 1,
    "softmax": 1,
    "topk": 2,
}
_CASTS = frozenset((aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout))  # a cast of a parameter is one
_REDUCE_LAST = ("native_layer_norm", "_fused_rms_norm", "rms_norm", "native_group_norm")


def _rows(tensor: torch.Tensor) -> int:
    return tensor.numel() // tensor.shape[-1] if tensor.dim() and tensor.shape[-1] else -1


def _reduces_last_dim(func, args: tuple) -> bool:
    """Whether `func` reduces its first argument over the last dimension (module docstring)."""
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else ""
    if name in _REDUCE_LAST:
        return True
    if name not in _REDUCE_DIM or not args or not isinstance(args[0], torch.Tensor) or len(args) < 2:
        return False
    dims = args[_REDUCE_DIM[name]] if len(args) > _REDUCE_DIM[name] else -1
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    last = args[0].dim() - 1
    return any(d % max(args[0].dim(), 1) == last for d in dims)


class KernelTracer:
    """Follows one forward's ops (`see`), returning a Kernel for each matmul or attention call; `kernels` holds
    them as the layer finally splits them (a linear found duplicated after it ran is changed there)."""

    def __init__(self, params) -> None:
        self._params = {id(p): p for p in params}  # views of parameters join this
        self._held: dict[int, torch.Tensor] = {}  # every tensor an entry below names (keeps ids unique)
        self._origins: dict[int, frozenset[int]] = {}  # split activations: the kernels that split them
        self._feature: dict[int, int] = {}  # activations holding a column-parallel kernel's output features
        self._active: set[int] = set()  # kernels whose outputs are split (column-parallel, heads)
        self._weights: dict[int, torch.Tensor] = {}  # kernel index -> its weight operand
        self._duplicated: set[int] = set()  # kernels of linears every tensor-parallel rank holds whole
        self.kernels: list[Kernel] = []
        self.expert_params: dict[int, torch.Tensor] = {}  # stacked expert weights (a grouped matmul's operand)
        self._repeated: dict[int, tuple[torch.Tensor, int]] = {}  # heads repeated for grouped-query attention
        self._inputs: dict[tuple, torch.Tensor] = {}  # the linears' activation operands: (source, offset, elements)
        self._copies: dict[int, tuple[int, torch.Tensor]] = {}  # a cast's storage -> its source's (and the copy)

    def _source(self, tensor: torch.Tensor) -> int:
        """The storage whose values `tensor` holds: its own, or, for a cast copy (autocast casts a linear's input
        for each linear), its source's. Linears reading one source read one input (`Kernel.shared_input`)."""
        storage = storage_key(tensor)
        return self._copies[storage][0] if storage in self._copies else storage

    def _is_param(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and id(tensor) in self._params

    def _split_by(self, tensor) -> frozenset[int]:
        if not isinstance(tensor, torch.Tensor):
            return frozenset()
        return frozenset(o for o in self._origins.get(id(tensor), ()) if o in self._active)

    def _is_split(self, tensor) -> bool:
        return bool(self._split_by(tensor))

    @property
    def duplicated_params(self) -> int:
        """Elements of the weights of linears found duplicated (each tensor-parallel rank holds them whole)."""
        found = {storage_key(self._weights[i]): self._weights[i].numel() for i in self._duplicated}
        return sum(found.values())

    def _mark(self, outputs, origins: frozenset[int], feature: int | None = None) -> None:
        for tensor in outputs:
            if origins:
                self._origins[id(tensor)] = origins
                self._held[id(tensor)] = tensor
            if feature is not None and feature in self._active:
                self._feature[id(tensor)] = feature
                self._held[id(tensor)] = tensor

    def _emit(self, kernel: Kernel, weight: torch.Tensor | None = None) -> int:
        self.kernels.append(kernel)
        if weight is not None:
            self._weights[len(self.kernels) - 1] = weight
        return len(self.kernels) - 1

    def _duplicate(self, index: int) -> None:
        """Kernel `index`, a column-parallel linear whose output features are reduced over (a norm, a router's
        softmax or top-k), is duplicated as Megatron runs it: every rank holds its whole weight and, under sequence
        parallelism, runs it on its own s / t token rows (MLA's down-projections; the small latent is then
        gathered); nothing it made is split by features."""
        kernel = self.kernels[index]
        self.kernels[index] = replace(kernel, tp=kernel.tokens)
        self._duplicated.add(index)
        self._active.discard(index)

    def see(self, func, args: tuple, out) -> Kernel | None:
        inputs, outputs = _tensors(args), _tensors(out)
        self._follow_repeats(func, args, out)
        floats = [t for t in outputs if t.is_floating_point()]
        if func in GEMM_OPS or is_grouped_mm(func):
            index = self._gemm(func, args) if func in GEMM_OPS else self._grouped(args)
            kernel = self.kernels[index]
            if kernel.weight and kernel.tp in ("n", "m"):  # column-parallel: its output is split
                self._active.add(index)
                self._mark(floats, frozenset((index,)), index if kernel.tp == "n" else None)
            elif not kernel.weight:
                self._mark(floats, frozenset().union(*(self._split_by(t) for t in inputs)))
            return kernel
        if func in ATTENTION_OPS:
            index = self._emit(self._attention(args, ATTENTION_CAUSAL_ARG[func]))
            self._mark(floats, self._split_by(args[0]))
            return self.kernels[index]
        if (_is_view(func) or func in _CASTS) and any(self._is_param(t) for t in inputs):
            for tensor in outputs:
                self._params[id(tensor)] = tensor
            return None
        if func in _CASTS and inputs and outputs:  # a copy in another dtype holds the same values
            self._copies[storage_key(outputs[0])] = (self._source(inputs[0]), outputs[0])
        if _reduces_last_dim(func, args) and self._feature.get(id(args[0])) in self._active:
            self._duplicate(self._feature[id(args[0])])
        # indices (integer tensors) are not features: they split nothing
        origins = frozenset().union(*(self._split_by(t) for t in inputs if t.is_floating_point()))
        features = [self._feature[id(t)] for t in inputs if id(t) in self._feature]
        keeps = features and all(_rows(t) == _rows(inputs[0]) and t.shape[-1] <= inputs[0].shape[-1] for t in floats)
        self._mark(floats, origins, features[0] if keeps else None)
        return None

    def _follow_repeats(self, func, args: tuple, out) -> None:
        """Key/value heads repeated for the query heads (`repeat_interleave` on meta: expand, clone, view): how
        many times, so attention records its key/value share (`Kernel.kv_share`)."""
        if not isinstance(out, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
            return
        if func is aten.expand.default and out.numel() > args[0].numel() > 0:
            self._repeated[id(out)] = (out, out.numel() // args[0].numel())
        elif func in REPEAT_CARRIERS and id(args[0]) in self._repeated:
            self._repeated[id(out)] = (out, self._repeated[id(args[0])][1])

    def _gemm(self, func, args: tuple) -> int:
        """Emit a matmul's Kernel; its index."""
        first = GEMM_OPS[func]
        a, b = args[first], args[first + 1]
        batched = a.dim() == 3
        batch, m, k = (a.shape[0], a.shape[1], a.shape[2]) if batched else (1, a.shape[0], a.shape[1])
        n = b.shape[-1]
        common = dict(m=m, n=n, k=k, batch=batch, element_bytes=a.element_size())
        weight_b, weight_a = self._is_param(b), self._is_param(a)
        if not (weight_a or weight_b):  # activations only: attention's matmuls, split by heads
            split = self._is_split(a) or self._is_split(b)
            grad = a.requires_grad or b.requires_grad
            kernel = Kernel(
                kind="gemm", tp="b" if split else "", cp="m", tokens="b", input_grad=grad, core=True, **common
            )
            return self._emit(kernel)
        activation = a if weight_b else b
        row = self._is_split(activation)  # a split input: row-parallel (contract k / t), output whole again
        tp = "k" if row else ("n" if weight_b else "m")
        rows = "m" if weight_b else "n"  # the activation's token rows
        experts = batched and weight_b and b.dim() == 3  # a grouped matmul over stacked expert weights
        if experts:
            self.expert_params[id(b)] = b
        key = (self._source(activation), activation.storage_offset(), activation.numel())
        kernel = Kernel(
            kind="gemm",
            tp=tp,
            cp=rows,
            tokens=rows,
            weight=True,
            input_grad=activation.requires_grad,
            experts=experts,
            shared_input=key in self._inputs,
            **common,
        )
        self._inputs.setdefault(key, activation)
        return self._emit(kernel, b if weight_b else a)

    def _grouped(self, args: tuple) -> int:
        """A grouped-mm call as one grouped expert Kernel: batch = experts, m = the rows each gets when balanced."""
        tokens, weight = args[0], args[1]
        experts, k, n = weight.shape
        self.expert_params[id(weight)] = weight
        row = self._is_split(tokens)
        kernel = Kernel(
            kind="gemm",
            m=-(-tokens.shape[0] // experts),
            n=n,
            k=k,
            batch=experts,
            element_bytes=tokens.element_size(),
            tp="k" if row else "n",
            cp="m",
            tokens="m",
            weight=True,
            input_grad=tokens.requires_grad,
            experts=True,
        )
        return self._emit(kernel, weight)

    def _attention(self, args: tuple, causal_arg: int) -> Kernel:
        q, k, v = args[0], args[1], args[2]
        causal = bool(args[causal_arg]) if len(args) > causal_arg else False
        batch, heads, seq_q, head_dim = q.shape
        repeats = self._repeated[id(k)][1] if id(k) in self._repeated else 1
        return Kernel(
            kind="attention",
            m=seq_q,
            n=k.shape[2],
            k=(head_dim + v.shape[-1]) // 2,  # QKᵀ over q's head size, PV over v's (MLA: 192 and 128)
            batch=batch * heads,
            tp="b" if self._is_split(q) else "",
            cp="m",
            tokens="b",
            input_grad=q.requires_grad,
            causal=causal,
            element_bytes=q.element_size(),
            core=True,
            kv_share=1.0 / repeats,
        )
