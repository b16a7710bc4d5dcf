"""What the measured profiler times in each round (`profiling.rounds.Unit`), on CPU or CUDA alike:

- `LayerUnit`: one layer as its own stage: F (under SavedTensors, as the runtime runs it), I and W
  (split_backward), then the forward again (what full recomputation re-runs, with autograd) and B on it, and the
  attention core's ops replayed (selective recomputation) when the layer has one. A multi-layer stage timed the
  same way without B (`fused=False`) is the whole model's split-backward reference.
- `WholeUnit`: the whole model's forward with its loss, and its backward (`loss.backward()`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipeplan.graph.saved_tensors import SavedTensors
from pipeplan.graph.split_backward import SplitCache, backward_full, backward_input, backward_weight
from pipeplan.profiling.recompute import replay
from pipeplan.profiling.rounds import Clock


def grad_outputs(outs: Sequence[object], generator: torch.Generator) -> list:
    """Gradients for a stage's outputs (noise from `generator`; None where no gradient flows)."""
    grads: list[torch.Tensor | None] = []
    for out in outs:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            noise = torch.randn(out.shape, generator=generator, dtype=out.dtype)
            grads.append(noise.to(out.device))
        else:
            grads.append(None)
    return grads


class LayerUnit:
    """A stage's passes, one sample each per call; its gradients are noise fixed once."""

    def __init__(
        self,
        name: str,
        stage: Callable,
        inputs: list,
        params: list,
        autocast: Callable,
        *,
        fused: bool = True,
        core_calls: Sequence = (),
    ) -> None:
        self.name, self.stage, self.inputs, self.params = name, stage, inputs, params
        self.autocast, self.fused, self.core_calls = autocast, fused, core_calls
        self.split_cache = SplitCache()  # as the runtime's executor keeps one per stage: I's graph analysis is warm
        with autocast():  # with autograd on: which outputs need a gradient
            self.grads = grad_outputs(stage(*inputs), torch.Generator().manual_seed(0))

    def _clear(self) -> None:
        for p in self.params:
            p.grad = None

    def sample(self, clock: Clock) -> dict[str, object]:
        """B and the recompute timings first, then F, I and W: the forward a plan counts most (F) runs on the
        weights and inputs this layer just used, as in a stage's run of its layers one after another, not on caches
        the previous unit in the round filled (which made it 15% slower on a 2-core CPU); the forward again, as
        recomputation runs it inside a backward, comes first, after the other units."""
        readings = self._fused(clock) if self.fused else {}
        self._clear()
        clock.start()
        with SavedTensors(hold=False) as saved, self.autocast():  # as the runtime runs it
            outs = self.stage(*self.inputs)
        readings["forward"] = clock.stop()
        clock.start()
        _, state = backward_input(outs, self.grads, self.inputs, self.params, saved=saved, cache=self.split_cache)
        readings["input_grad"] = clock.stop()
        clock.start()
        backward_weight(state)
        readings["weight_grad"] = clock.stop()
        del outs, state, saved
        self._clear()
        return readings

    def _fused(self, clock: Clock) -> dict[str, object]:
        clock.start()
        with self.autocast():  # the forward again, as full recomputation (checkpointing) re-runs it
            outs = self.stage(*self.inputs)
        readings = {"full_recompute": clock.stop()}
        clock.start()
        backward_full(outs, self.grads, self.inputs, self.params)
        readings["backward"] = clock.stop()
        del outs
        self._clear()
        if self.core_calls:
            clock.start()
            replay(self.core_calls)
            readings["selective_recompute"] = clock.stop()
        return readings


@dataclass
class WholeUnit:
    """The whole model: its forward and loss, then `loss.backward()`."""

    name: str
    module: torch.nn.Module
    loss_fn: Callable
    inputs: tuple
    target: object
    autocast: Callable

    def sample(self, clock: Clock) -> dict[str, object]:
        self.module.zero_grad(set_to_none=True)
        clock.start()
        with self.autocast():
            loss = self.loss_fn(self.module(*self.inputs), self.target)
        readings = {"forward": clock.stop()}
        clock.start()
        loss.backward()
        readings["backward"] = clock.stop()
        del loss
        self.module.zero_grad(set_to_none=True)
        return readings
