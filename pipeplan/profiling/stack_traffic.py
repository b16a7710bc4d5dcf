"""A layer's other ops (everything but its matmul and attention kernels, `profiling.kernels`) as a GPU runs them: the
HBM bytes they move and the kernels they launch, under the fusions of the stack that runs the model. Each of
those kernels is memory-bound: its time is bytes / the measured memory rate plus one launch
(`profiling.retime`).

Two stacks:
- `eager` (PyTorch eager, what `pipeplan run` executes: the autocast and plain precisions): every op is one kernel
  that reads its inputs and writes its outputs; nothing is fused.
- `megatron` (Megatron-Core with Transformer Engine, what the Megatron precisions bf16-main, fp16-main, fp8 and
  their -bf16grads variants stand for): the elementwise work between two matmul or attention kernels of a pass
  runs as one fused kernel that reads what enters it and writes what leaves it once — what TE's fused
  LayerNorm / RMSNorm, TE's fused RoPE, Megatron's bias-GeLU and bias-SwiGLU fusions, its bias-dropout-add
  fusion, its fused scale-mask-softmax (math attention) and the vocabulary-parallel cross-entropy do for a
  transformer layer, forward and backward (Megatron runs two such kernels where a norm follows a
  bias-dropout-add; counting one reads the residual once less). A tensor made inside the region is written to
  HBM when an op outside the region reads it, when the forward saves it for backward (a dropout mask, softmax's
  probabilities, a norm's statistics), or when it is what the pass produces (the layer's output, a gradient); one
  made and read inside stays on chip, and one nothing reads is not made at all (an intermediate the meta trace
  computes before a fused replacement recomputes it, e.g. silu(gate) before the fused SwiGLU).

Ops that do FLOPs but are not matmul or attention kernels (convolutions) are boundaries too, timed by their
roofline (`compute_seconds`). Views move nothing. The accounting is a pure function over the recorded calls
(`OpTraffic`), so the analytic profiler's passes and the selective-recompute core share it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

STACKS = ("eager", "megatron")


@dataclass(frozen=True)
class OpTraffic:
    """One op of a pass: a matmul / attention kernel (a boundary, timed elsewhere), an op whose FLOPs bind
    (`compute_seconds` > 0: a boundary timed by its roofline) or a memory-bound op; the storages it reads and
    writes as (storage key, bytes)."""

    kernel: bool
    reads: tuple[tuple[int, int], ...] = ()
    writes: tuple[tuple[int, int], ...] = ()
    compute_seconds: float = 0.0
    extents: tuple[tuple[int, int], ...] = ()  # (storage key, its whole bytes) of what it writes: what slices sum to

    @property
    def moved(self) -> int:
        return sum(size for _, size in self.reads) + sum(size for _, size in self.writes)


@dataclass
class Traffic:
    """What a pass's other ops cost on a GPU: HBM bytes and kernels of the memory-bound ones, seconds of those
    whose FLOPs bind."""

    bytes: float = 0.0
    kernels: int = 0
    compute_seconds: float = 0.0


def traffic(calls: Sequence[OpTraffic], stack: str, keep: Iterable[int] = ()) -> Traffic:
    """The other ops of `calls` under `stack` (module docstring); `keep`: storage keys a fused kernel must write
    even when no later op of the pass reads them — what the forward saves for backward, the pass's outputs."""
    assert stack in STACKS, stack
    found = Traffic(compute_seconds=sum(c.compute_seconds for c in calls if not c.kernel))
    if stack == "eager":
        memory = [c for c in calls if _memory_op(c)]
        found.bytes, found.kernels = float(sum(c.moved for c in memory)), len(memory)
        return found
    regions = _regions(calls)
    kept = set(keep)
    for region in regions:
        found.bytes += region.bytes(kept)
    found.kernels = sum(1 for region in regions if region.ops)
    return found


def _memory_op(call: OpTraffic) -> bool:
    return not call.kernel and call.compute_seconds == 0.0 and call.moved > 0


@dataclass
class _Region:
    """The memory-bound ops between two boundaries: what they read from outside, what they make."""

    index: int
    ops: int = 0
    inputs: dict[int, int] = field(default_factory=dict)  # storage -> bytes read from outside the region
    made: dict[int, int] = field(default_factory=dict)  # storage -> bytes written inside the region
    readers: dict[int, set] = field(default_factory=dict)  # storage made here -> where it is read

    def bytes(self, keep: set[int]) -> float:
        written = sum(
            size for key, size in self.made.items() if key in keep or self.readers.get(key, set()) - {self.index}
        )
        return float(sum(self.inputs.values()) + written)


def _regions(calls: Sequence[OpTraffic]) -> list[_Region]:
    regions = [_Region(0)]
    origin: dict[int, _Region] = {}  # storage -> the region that made it
    for position, call in enumerate(calls):
        if not _memory_op(call):
            for key, _ in call.reads:  # a boundary reading a region's tensor: the region writes it
                if key in origin:
                    origin[key].readers.setdefault(key, set()).add(("boundary", position))
            if call.kernel or call.compute_seconds:
                regions.append(_Region(len(regions)))
            continue
        region = regions[-1]
        region.ops += 1
        for key, size in call.reads:
            if key in origin:
                origin[key].readers.setdefault(key, set()).add(region.index)
            if origin.get(key) is not region:
                region.inputs[key] = max(region.inputs.get(key, 0), size)
        extents = dict(call.extents)
        for key, size in call.writes:
            if origin.get(key) is not region and key in region.inputs:
                region.made[key] = max(region.made.get(key, 0), size)  # written in place: back to HBM
                region.readers.setdefault(key, set()).add(("outside", position))
                continue
            if origin.get(key) is region and key in extents:  # another slice of a tensor made here (a key built
                # by slice assignment): the slices add up, to the tensor's whole size at most
                region.made[key] = min(region.made[key] + size, extents[key])
                continue
            origin[key] = region
            region.made[key] = max(region.made.get(key, 0), size)
    return regions
