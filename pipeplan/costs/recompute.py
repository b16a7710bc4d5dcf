"""Activation recomputation per stage: what a stage keeps from F to its backward, what recomputing re-creates while
the backward runs, and what it costs, under each mode of `profiling.profile.RECOMPUTE_MODES` — as `pipeplan run`
executes them (runtime/step/executor.py, runtime/step/recompute_run.py) over the per-layer data of the profiles:

    mode       kept K (F to I/B)               re-created R while I/B runs          added to I (or B)
    none       A = sum activation_bytes        0                                    0
    selective  sum selective_activation_bytes  the largest one layer's attention    sum selective_recompute_ms
                                               internals (re-run one call at a time)
    full       the bytes entering the stage    A - K (the stage's forward re-run    sum full_recompute_ms
               (its inputs; the model's inputs  with grad right before I or B)      (the forward again)
               for the first stage)
After I a stage holds A - f (kept until W) in every mode (`stage_freed_bytes`: the first stage's I frees nothing,
or only the attention internals selective recomputation dropped). `schedules.simulate.MemoryCosts` (kept_bytes,
recompute_bytes) carries K and R into the simulator's memory model; the partitioner's screen bounds the same.

Full recomputation layer by layer (`per_layer`: what Megatron-LM's `--recompute-granularity full --recompute-method
uniform --recompute-num-layers 1` and torchtitan's full activation checkpointing do, the engines that run analytic
plans pipeplan's runtime cannot — tensor or context parallel, Megatron's mixed precision) keeps every layer's
input (K = the sum of its layers' entering bytes) and re-creates one layer at a time (R = the largest layer's
activations less its input); pipeplan's runtime re-runs a whole stage at once (the table above).

Full recomputation keeps the stage's inputs: the bytes crossing the cut before it, which is exact for sequential
models (a GPT, llama) and a bound where a skip connection passes through the stage to a later one. R = A - K takes
the inputs to be among the saved tensors (the stage's first op saves its input: a norm, linear or embedding).
Selective is offered only where it keeps less than none (a stage with a math-path attention core); the runtime
refuses it on a stage without scaled_dot_product_attention, and the planner drops it there (search/candidate).
"""

from __future__ import annotations

import numpy as np

from pipeplan.costs.arrays import LayerArrays
from pipeplan.graph.recompute_modes import RECOMPUTE_MODES

RECOMPUTE_CHOICES = ("none", "auto")  # the partitioner's option: no recomputation, or the cheapest mode that fits


def stage_kept_bytes(
    arrays: LayerArrays, mode: str, first: np.ndarray | int, last: np.ndarray | int, *, per_layer: bool = False
) -> np.ndarray:
    """K: bytes one microbatch of stage [first..last] holds from its F to its I (or B), vectorized over `first`."""
    if mode == "full" and per_layer:
        return arrays.span("inputs", first, last)
    if mode == "full":
        return np.broadcast_to(arrays.stage_start(first, last), np.shape(first)).astype(np.float64)
    return arrays.span("selective" if mode == "selective" else "activation", first, last)


def stage_freed_bytes(arrays: LayerArrays, mode: str, first: np.ndarray | int, last: np.ndarray | int) -> np.ndarray:
    """f: bytes the stage's I frees, leaving A - f until W. Its layers' `freed` (what no weight-gradient node
    saved), except on the model's first stage, whose inputs are the model's own: its I has no input gradient to
    compute, so W runs the whole backward and keeps everything — less, under selective recomputation, the attention
    internals that were never kept (`LayerArrays.stage_freed`)."""
    base = arrays.stage_freed(first, last)
    if mode != "selective":
        return base
    dropped = arrays.span("activation", first, last) - arrays.span("selective", first, last)
    return np.maximum(base, dropped)


def stage_recompute_bytes(
    arrays: LayerArrays, mode: str, first: np.ndarray | int, last: np.ndarray | int, *, per_layer: bool = False
) -> np.ndarray:
    """R: bytes recomputation re-creates on top of K while the stage's I (or B) runs."""
    if mode == "full" and per_layer:
        return arrays.span_max("regrowth", first, last)
    if mode == "full":
        return np.maximum(arrays.span("activation", first, last) - stage_kept_bytes(arrays, mode, first, last), 0.0)
    if mode == "selective":
        return arrays.span_max("internals", first, last)
    return np.zeros(np.shape(first))


def stage_recompute_ms(arrays: LayerArrays, mode: str, first: np.ndarray | int, last: np.ndarray | int) -> np.ndarray:
    """Time recomputation adds to the stage's I (or B) per microbatch: the attention cores again (selective), the
    forward again (full)."""
    if mode == "full":
        return arrays.span("full_recompute", first, last)
    if mode == "selective":
        return arrays.span("selective_recompute", first, last)
    return np.zeros(np.shape(first))


def mode_offered(arrays: LayerArrays, mode: str, first: np.ndarray | int, last: np.ndarray | int) -> np.ndarray:
    """Whether the partitioner may give stage [first..last] `mode`: none and full always, selective only where it
    keeps fewer bytes than none (an attention core whose internals it drops)."""
    if mode == "selective":
        return arrays.span("selective", first, last) < arrays.span("activation", first, last)
    return np.ones(np.shape(first), dtype=bool)


def modes_for(choice: str) -> tuple[str, ...]:
    """The modes a partitioner option lets it choose from, cheapest first."""
    assert choice in RECOMPUTE_CHOICES, choice
    return RECOMPUTE_MODES if choice == "auto" else ("none",)
