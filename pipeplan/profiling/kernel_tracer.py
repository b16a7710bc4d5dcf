"""Which matmuls and attention calls a layer's forward runs, and how Megatron-style tensor parallelism with sequence
parallelism splits each (Shoeybi et al. 2019, §3; Korthikanti et al. 2022, §4.2.2), found by following which
activations are split while the forward runs on the meta device:

- a linear (a matmul with a parameter operand) whose activation input is whole is column-parallel: each rank
  computes n / t output features, and its output is split; one whose input is split is row-parallel: each rank
  contracts k / t features and the output is reduced (whole again);
- any other op's output is split when one of its inputs is (attention's inputs come from column-parallel linears,
  so attention splits its heads: `b`, the batch of samples x heads);
- views of a parameter stay parameters (a linear's `weight.t()`).

Token positions (what context parallelism splits, `cp`) are a linear's rows (`m`: samples x positions) and
attention's query positions; the microbatch grows a linear's rows and attention's batch (`tokens`). Every matmul
and attention call becomes one `Kernel` at the shape it ran (t = cp = 1).

A batched matmul whose second operand is a 3-D parameter is a grouped expert matmul (`Kernel.experts`: one matmul
per expert over its stacked weights, `models.moe.Experts`); so is a grouped-mm call (`aten._grouped_mm`,
transformers' `grouped_mm_fallback`: tokens sorted by expert x (experts, in, out) weights, per-expert offsets),
whose rows are taken as balanced over the experts (the offsets hold no data on the meta device). Those parameters
are the layer's expert weights (`expert_params`), which expert parallelism splits over its ranks."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from pipeplan.profiling.kernels import Kernel

aten = torch.ops.aten
GEMM_OPS = {aten.mm.default: 0, aten.addmm.default: 1, aten.bmm.default: 0, aten.baddbmm.default: 1}  # first operand
ATTENTION_OPS = frozenset((aten._scaled_dot_product_flash_attention.default,))
KERNEL_OPS = frozenset((*GEMM_OPS, *ATTENTION_OPS, aten._scaled_dot_product_flash_attention_backward.default))
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


class KernelTracer:
    """Follows one forward's ops (`see`), returning a Kernel for each matmul or attention call."""

    def __init__(self, params) -> None:
        self._params = {id(p): p for p in params}  # views of parameters join this
        self._split: dict[int, torch.Tensor] = {}  # activations a tensor-parallel rank holds a part of
        self.expert_params: dict[int, torch.Tensor] = {}  # stacked expert weights (a grouped matmul's operand)
        self._repeated: dict[int, tuple[torch.Tensor, int]] = {}  # heads repeated for grouped-query attention

    def _is_param(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and id(tensor) in self._params

    def _is_split(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and id(tensor) in self._split

    def _mark(self, outputs, *, split: bool, param: bool = False) -> None:
        for tensor in outputs:
            if param:
                self._params[id(tensor)] = tensor
            elif split:
                self._split[id(tensor)] = tensor

    def see(self, func, args: tuple, out) -> Kernel | None:
        inputs, outputs = _tensors(args), _tensors(out)
        self._follow_repeats(func, args, out)
        kernel = None
        if func in GEMM_OPS:
            kernel, split = self._gemm(func, args)
        elif is_grouped_mm(func):
            kernel, split = self._grouped(args)
        elif func in ATTENTION_OPS:
            kernel, split = self._attention(args), self._is_split(args[0])
        elif _is_view(func) and any(self._is_param(t) for t in inputs):
            self._mark(outputs, split=False, param=True)
            return None
        else:  # indices (integer tensors) are not features: they split nothing
            split = any(self._is_split(t) for t in inputs if t.is_floating_point())
        self._mark([t for t in outputs if t.is_floating_point()], split=split)
        return kernel

    def _follow_repeats(self, func, args: tuple, out) -> None:
        """Key/value heads repeated for the query heads (`repeat_interleave` on meta: expand, clone, view): how
        many times, so attention records its key/value share (`Kernel.kv_share`)."""
        if not isinstance(out, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
            return
        if func is aten.expand.default and out.numel() > args[0].numel() > 0:
            self._repeated[id(out)] = (out, out.numel() // args[0].numel())
        elif func in REPEAT_CARRIERS and id(args[0]) in self._repeated:
            self._repeated[id(out)] = (out, self._repeated[id(args[0])][1])

    def _gemm(self, func, args: tuple) -> tuple[Kernel, bool]:
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
            return kernel, split
        activation = a if weight_b else b
        row = self._is_split(activation)  # a split input: row-parallel (contract k / t), output whole again
        tp = "k" if row else ("n" if weight_b else "m")
        rows = "m" if weight_b else "n"  # the activation's token rows
        experts = batched and weight_b and b.dim() == 3  # a grouped matmul over stacked expert weights
        if experts:
            self.expert_params[id(b)] = b
        kernel = Kernel(
            kind="gemm",
            tp=tp,
            cp=rows,
            tokens=rows,
            weight=True,
            input_grad=activation.requires_grad,
            experts=experts,
            **common,
        )
        return kernel, not row

    def _grouped(self, args: tuple) -> tuple[Kernel, bool]:
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
        return kernel, not row

    def _attention(self, args: tuple) -> Kernel:
        q, k = args[0], args[1]
        causal = bool(args[4]) if len(args) > 4 else False
        batch, heads, seq_q, head_dim = q.shape
        repeats = self._repeated[id(k)][1] if id(k) in self._repeated else 1
        return Kernel(
            kind="attention",
            m=seq_q,
            n=k.shape[2],
            k=head_dim,
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
