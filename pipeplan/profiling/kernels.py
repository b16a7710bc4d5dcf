"""Matmul and attention kernels: what an analytic profile records of each layer so that its times can be taken
again at another shape — one tensor-parallel rank (t), one context-parallel rank (cp), another microbatch size —
and how long one kernel takes on a GPU.

A `Kernel` is one forward matmul (`gemm`: m x k times k x n, `batch` of them) or one attention call (`attention`:
`batch` = samples x heads, m query and n key positions, head size k), at the shape the profile ran (t = cp = 1).
Its fields name which dimensions one rank divides: `tp` by t (Megatron tensor parallelism: a column-parallel
linear splits n, a row-parallel one k, attention its heads) and `cp` by cp (context parallelism splits the
sequence: a linear's token rows, attention's query positions); `tokens` names the dimensions that grow with the
microbatch size. The backward kernels follow from the forward ones (`backward_kernels`): a matmul's input gradient
(m x n times n x k, in I; absent when its input needs no gradient) and weight gradient (n x m times m x k, in W,
for linears only); attention's backward (in I) does 2.5 times its forward's work (FlashAttention-2: recomputed
scores, dV, dP, dQ and dK; Dao 2023, §3.1; the FLOP counter of its benchmarks).

Time of one kernel (`kernel_seconds`), on a GPU with S streaming multiprocessors (datasheet):
- a matmul is cut into output tiles of 128 x 256, 256 x 128, 128 x 128, 64 x 128, 128 x 64 or 64 x 64 elements
  (cuBLAS/CUTLASS tile shapes on A100 and H100; a side narrowed to the power of two covering a skinny dimension),
  one tile per SM at a time; with T tiles the kernel runs ceil(T / S) waves. A tile's time is its
  2·tm·tn·(k + k0) FLOPs at the SM's share of the full-wave rate R (peak x `matmul_efficiency` x the clock a
  training GPU holds, `Hardware.clock_ratio`) x its operand reuse factor:
  - k0 is the part of the tile's epilogue that does not hide behind its math, in steps of k: writing its output
    (b bytes per element: 2 for a 16-bit result; a weight gradient that Megatron's gradient-accumulation fusion
    adds into its gradient buffer reads and writes it, 2 x the buffer's bytes) at the SM's share of the memory
    rate BW takes b·R / (2·BW) steps, of which `epilogue_exposed` shows — why a small-K matmul runs below the
    rate, and a weight gradient over few tokens accumulating into fp32 even more so;
  - a tile does r = tm·tn / (tm + tn) multiply-adds per operand element it loads and runs at
    (1 + R' / r_max) / (1 + R' / r) of the largest tile's rate (R': `tile_reuse_half`, the reuse at which loading
    operands takes as long as the multiply-adds; r_max: 128 x 256's) — small tiles are no free way out of
    quantization.
  An output of fewer tiles than SMs is split along k (split-K, s = 2, 4, ... while T·s <= S and k / s >= 256),
  each split's partial sums written and read back in fp32; with `stream_k` (cuBLAS 12 on Hopper and later) a
  partial last wave is spread over every SM instead (each SM an equal share of all tiles' k-steps, the tiles cut
  between SMs exchanging fp32 partial sums). Tile padding, the last partial wave and k0 are why small, skinny and
  small-K matmuls — tensor-parallel shards, weight gradients over few tokens — run below the full-wave rate
  (NVIDIA, "Matrix Multiplication Background User's Guide": tile and wave quantization). The tiling giving the
  shortest time is taken, as cuBLAS's heuristics pick one. The time is at least the bytes it moves over HBM
  bandwidth (a roofline), plus `gemm_overhead_s` per kernel (its launch and ramp: what a matmul of almost no work
  still takes). `hardware.json`'s h100 entry gives the sources: a fit to a published table of measured matmuls
  over m, n, k from 256 to 4096.
- a grouped expert matmul (`experts`: a mixture-of-experts layer's experts, `batch` of them, balanced routing
  giving each m token rows) is one grouped kernel (GroupedGEMM, as Megatron-Core and DeepGEMM run experts): each
  expert's matmul is cut into tiles (tile quantization per expert), and the tiles of all experts share the waves.
- attention (FlashAttention-2/3, cuDNN) runs one thread block per 128 query rows of each (sample, head): blocks =
  batch x ceil(m / 128), each doing 4·128·n·k FLOPs (QKᵀ and PV), half of them under a causal mask; waves as above
  at the peak x `attention_efficiency` x the clock ratio (FlashAttention's measured fraction of peak), plus the
  kernel overhead.
- Without an SM count (a CPU, or a hardware file that gives none) a kernel is its FLOPs at peak x efficiency:
  no quantization, no overheads; its time is at least `launch_s` (a calibrated CPU's dispatch floor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

GEMM_TILES = ((128, 256), (256, 128), (128, 128), (64, 128), (128, 64), (64, 64))
LARGEST_REUSE = 128 * 256 / (128 + 256)  # multiply-adds per loaded operand element of the largest tile
SPLIT_K_MIN = 256  # the least k one split-K slice keeps
PARTIAL_BYTES = 4  # split-K partial sums are fp32
ATTENTION_BLOCK = 128  # query rows per FlashAttention thread block
ATTENTION_BACKWARD = 2.5  # FlashAttention-2's backward work / forward work
PASSES = ("forward", "input_grad", "weight_grad")
DIMS = {"m": "m", "n": "n", "k": "k", "b": "batch"}  # tag letter -> attribute


@dataclass(frozen=True, kw_only=True)
class Kernel:
    """One matmul or attention call of a layer (see the module docstring); `fp8`: a linear's matmul that an FP8
    recipe runs in FP8 (attention and the embedding stay in 16 bits, and so does the LM head: Megatron-Core's output
    layer is a plain ColumnParallelLinear, not a Transformer Engine module; torchtitan's float8 skips `output`)."""

    kind: str  # "gemm" or "attention"
    m: int
    n: int
    k: int
    batch: int = 1
    tp: str = ""  # the dimension (m, n, k or b: batch) one tensor-parallel rank divides by t ("" none)
    cp: str = ""  # the dimensions context parallelism divides (sequence positions)
    tokens: str = ""  # the dimension that grows with the microbatch size
    weight: bool = False  # a linear's matmul (one operand is a parameter): it has a weight gradient
    input_grad: bool = True  # its activation operand(s) need a gradient
    causal: bool = False  # attention under a causal mask: half the work
    element_bytes: int = 2  # bytes per element of its operands
    work: float = 1.0  # multiple of the shape's FLOPs (attention's backward: 2.5)
    core: bool = False  # part of the attention core (re-run by selective recomputation)
    experts: bool = False  # a grouped matmul over `batch` experts' stacked weights (expert parallelism splits it)
    accumulates: bool = False  # a linear's weight gradient (added into the gradient buffer under the Megatron stack)
    kv_share: float = 1.0  # attention: key/value heads over query heads (grouped-query attention: < 1)
    output_grad: bool = False  # a linear's input gradient: its m x k operand is the output's gradient
    shared_input: bool = False  # a linear reading the input an earlier linear of its layer read (q, k, v; gate, up)
    fp8: bool = True  # a linear an FP8 recipe runs in FP8 (False: the LM head, kept in 16 bits)

    def __post_init__(self) -> None:
        assert self.kind in ("gemm", "attention"), self.kind
        for tag in self.tp + self.cp + self.tokens:
            assert tag in DIMS, tag

    @property
    def flops(self) -> float:
        if self.kind == "attention":
            return 4.0 * self.batch * self.m * self.n * self.k * (0.5 if self.causal else 1.0) * self.work
        return 2.0 * self.batch * self.m * self.n * self.k * self.work

    @property
    def bytes(self) -> float:
        """HBM traffic: the operands and the result; attention reads q, k, v and writes its output (the m x n
        scores never leave the chip: FlashAttention's tiling)."""
        if self.kind == "attention":
            return float(self.element_bytes * self.batch * (2 * self.m * self.k + 2 * self.n * self.k))
        return float(self.element_bytes * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n))

    def on_rank(self, *, t: int = 1, cp: int = 1, batch_scale: float = 1.0, ep: int = 1) -> Kernel:
        """This kernel as one rank of t x cp runs it, for a microbatch `batch_scale` times as large; a grouped expert
        matmul under expert parallelism `ep` runs experts / ep matmuls, each on the tokens of ep ranks (balanced
        routing: ep times its rows)."""
        sizes = {attr: float(getattr(self, attr)) for attr in DIMS.values()}
        for tag in self.tp:
            sizes[DIMS[tag]] /= t
        for tag in self.cp:
            sizes[DIMS[tag]] /= cp
        grow = batch_scale * (ep if self.experts else 1)
        for tag in self.tokens:
            sizes[DIMS[tag]] *= grow
        if self.experts:
            sizes["batch"] /= ep
        dims: dict[str, Any] = {attr: max(1, math.ceil(value)) for attr, value in sizes.items()}
        return replace(self, **dims)


def backward_kernels(kernel: Kernel) -> dict[str, list[Kernel]]:
    """The kernels of `kernel`'s backward, by pass (`input_grad`, `weight_grad`); see the module docstring."""
    if kernel.kind == "attention":
        work = replace(kernel, work=kernel.work * ATTENTION_BACKWARD)
        return {"input_grad": [work] if kernel.input_grad else [], "weight_grad": []}
    # C (m x n) = A (m x k) B (k x n): dA = dC Bᵀ is m x n times n x k, dB = Aᵀ dC is k x m times m x n
    grad_a = _renamed(kernel, m=kernel.m, n=kernel.k, k=kernel.n, names={"m": "m", "n": "k", "k": "n"})
    grad_b = _renamed(kernel, m=kernel.k, n=kernel.n, k=kernel.m, names={"m": "k", "n": "n", "k": "m"})
    grad_a = replace(grad_a, output_grad=kernel.weight)
    grad_b = replace(grad_b, accumulates=kernel.weight)
    if not kernel.weight:  # both operands are activations (attention's matmuls): two input gradients
        return {"input_grad": [grad_a, grad_b] if kernel.input_grad else [], "weight_grad": []}
    return {"input_grad": [grad_a] if kernel.input_grad else [], "weight_grad": [grad_b]}


def _renamed(kernel: Kernel, *, m: int, n: int, k: int, names: dict[str, str]) -> Kernel:
    """`kernel` at a new shape whose dimension `names[old]` is the old dimension `old` (tags follow them)."""

    def move(tags: str) -> str:
        return "".join({**names, "b": "b"}[tag] for tag in tags)

    return replace(kernel, m=m, n=n, k=k, tp=move(kernel.tp), cp=move(kernel.cp), tokens=move(kernel.tokens))


def pass_kernels(kernels: tuple[Kernel, ...], name: str) -> list[Kernel]:
    """The kernels of one pass (`forward`, `input_grad` or `weight_grad`) of a layer's forward kernels."""
    if name == "forward":
        return list(kernels)
    return [k for forward in kernels for k in backward_kernels(forward)[name]]


@dataclass(frozen=True, kw_only=True)
class KernelRates:
    """What a kernel's time depends on: rates (FLOP/s) by kind at the clock a training GPU holds, HBM bytes/s, SM
    count (None: no quantization), the per-kernel overheads (module docstring) and, for the other ops of a layer,
    the time one more kernel launch adds (`launch_s`)."""

    gemm_flops_per_s: float  # peak x matmul efficiency x clock ratio (a full wave of large tiles)
    attention_flops_per_s: float  # peak x attention efficiency x clock ratio
    bytes_per_s: float
    sm_count: int | None = None
    launch_s: float = 0.0  # one kernel of the other ops (GPU), or the floor of any op (CPU calibration)
    fp8_flops_per_s: float | None = None  # linears' matmuls in FP8 at this rate (None: in 16 bits)
    gemm_overhead_s: float = 0.0  # a matmul or attention kernel's launch and ramp (GPU)
    epilogue_exposed: float = 0.0  # the share of a tile's output write that does not hide behind math (GPU)
    tile_reuse_half: float = 0.0  # R: the operand reuse at which a tile's loads take as long as its math (GPU)
    stream_k: bool = False  # the matmul library may spread a partial last wave over every SM (stream-K)
    grad_bytes: int = 0  # a weight gradient accumulates into a buffer of these bytes per element (0: it is written)


def kernel_seconds(kernel: Kernel, rates: KernelRates) -> float:
    """One kernel's time (module docstring). Under FP8 (`rates.fp8_flops_per_s`, precision fp8) a linear's matmul
    runs at the FP8 rate on 1-byte operands, beside the memory-bound kernels in which Transformer Engine quantizes
    its activation operand (`fp8_cast_bytes`; the weights' cast is kept for the step and not counted per matmul)."""
    fp8_rate = rates.fp8_flops_per_s if kernel.weight and kernel.fp8 else None
    fp8 = fp8_rate is not None
    if kernel.kind == "attention":
        work = _attention_seconds(kernel, rates)
    else:
        work = _gemm_seconds(kernel, rates.gemm_flops_per_s if fp8_rate is None else fp8_rate, rates)
    memory = replace(kernel, element_bytes=1 if fp8 else kernel.element_bytes).bytes / rates.bytes_per_s
    memory += _accumulated(kernel, rates) * kernel.batch * kernel.m * kernel.n / rates.bytes_per_s
    cast = fp8_cast_bytes(kernel) * kernel.batch * kernel.m * kernel.k / rates.bytes_per_s if fp8 else 0.0
    if not rates.sm_count:
        return max(work, memory, rates.launch_s) + cast
    return max(work, memory) + rates.gemm_overhead_s + cast


def fp8_cast_bytes(kernel: Kernel) -> float:
    """Bytes per element of a linear's m x k operand that Transformer Engine's FP8 casts move for its matmul (TE
    1.x `Linear`, `LayerNormLinear`, `LayerNormMLP`): a forward's input is cast (read in 16 bits, written in 8: 3),
    but a column-parallel linear's input comes from the norm before it, whose kernel writes FP8 itself (0; with
    sequence parallelism the FP8 copy is what is gathered); an input gradient's operand, the output's gradient, is
    cast and transposed in one kernel (read 2, write 1 + 1: 4) whose transposed copy the weight gradient uses; a
    weight gradient's operand, the saved FP8 input, is transposed (read 1, write 1: 2). Linears that read one
    input (`shared_input`: q, k and v; a gated MLP's gate and up) are one linear there (fused QKV, fc1): its input
    is cast and transposed once."""
    if kernel.output_grad:
        return 4.0
    if kernel.shared_input:
        return 0.0
    if kernel.accumulates:
        return 2.0
    return 0.0 if kernel.tp in ("n", "m") and not kernel.experts else 3.0


def _accumulated(kernel: Kernel, rates: KernelRates) -> int:
    """Bytes per output element a weight gradient moves beyond writing its result: reading and writing the
    gradient buffer it accumulates into, less the result's own write."""
    if not (kernel.accumulates and rates.grad_bytes):
        return 0
    return 2 * rates.grad_bytes - kernel.element_bytes


def _gemm_seconds(kernel: Kernel, rate: float, rates: KernelRates) -> float:
    sms = rates.sm_count
    if not sms:
        return kernel.flops / rate
    out_bytes = kernel.element_bytes + _accumulated(kernel, rates)
    k0 = rates.epilogue_exposed * out_bytes * rate / (2.0 * rates.bytes_per_s)
    best = math.inf
    for tile_m, tile_n in GEMM_TILES:
        tm, tn = _fitted(tile_m, kernel.m), _fitted(tile_n, kernel.n)
        tiles = kernel.batch * math.ceil(kernel.m / tm) * math.ceil(kernel.n / tn)
        tile_rate = rate / sms * _reuse_factor(tm, tn, rates.tile_reuse_half)
        for splits in _splits(tiles, kernel.k, sms):
            waves = math.ceil(tiles * splits / sms)
            tile_flops = 2.0 * tm * tn * (kernel.k / splits + k0) * kernel.work
            partials = 2.0 * tiles * splits * tm * tn * PARTIAL_BYTES / rates.bytes_per_s if splits > 1 else 0.0
            best = min(best, waves * tile_flops / tile_rate + partials)
        if rates.stream_k and tiles % sms:
            best = min(best, _stream_k_seconds(kernel, (tm, tn, tiles, k0), tile_rate, rates))
    return best


def _stream_k_seconds(
    kernel: Kernel, tiling: tuple[int, int, int, float], tile_rate: float, rates: KernelRates
) -> float:
    """Stream-K: every SM takes an equal share of all tiles' k-steps (its share crossing a tile boundary pays
    that tile's fixed cost k0 again), and the tiles cut between SMs exchange fp32 partial sums."""
    tm, tn, tiles, k0 = tiling
    sms = rates.sm_count or 1
    steps = tiles * (kernel.k + k0) / sms + k0
    fixup = 2.0 * sms * tm * tn * PARTIAL_BYTES / rates.bytes_per_s
    return 2.0 * tm * tn * steps * kernel.work / tile_rate + fixup


def _reuse_factor(tm: int, tn: int, reuse_half: float) -> float:
    """A tile's rate relative to the largest tile's (module docstring): 1 without `reuse_half`."""
    return (1.0 + reuse_half / LARGEST_REUSE) / (1.0 + reuse_half * (tm + tn) / (tm * tn))


def _splits(tiles: int, k: int, sms: int) -> list[int]:
    """Split-K factors tried for an output of `tiles` tiles: 1, and while the splits still fit one wave and keep
    SPLIT_K_MIN of k each, 2, 4, ..."""
    found, splits = [1], 1
    while tiles * splits * 2 <= sms and k / (splits * 2) >= SPLIT_K_MIN:
        splits *= 2
        found.append(splits)
    return found


def _fitted(tile: int, size: int) -> int:
    """A tile side no larger than the power of two covering `size` (at least 16): libraries pick narrow tiles for
    skinny matmuls instead of padding them to 128."""
    return min(tile, max(16, 1 << max(size - 1, 1).bit_length()))


def _attention_seconds(kernel: Kernel, rates: KernelRates) -> float:
    per_block = 4.0 * ATTENTION_BLOCK * kernel.n * kernel.k * (0.5 if kernel.causal else 1.0) * kernel.work
    if not rates.sm_count:
        return kernel.flops / rates.attention_flops_per_s
    blocks = kernel.batch * math.ceil(kernel.m / ATTENTION_BLOCK)
    return math.ceil(blocks / rates.sm_count) * per_block / (rates.attention_flops_per_s / rates.sm_count)


def kernels_seconds(kernels, rates: KernelRates) -> float:
    return sum(kernel_seconds(k, rates) for k in kernels)
