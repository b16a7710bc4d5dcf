"""The loss in the last layer's profile: a pipeline's last stage runs `loss_fn` on the model's output, so what the
loss saves for backward (cross-entropy keeps its log-softmax, b·s·V values per microbatch, and its target), its
FLOPs and its time belong to the last layer, in both profilers and under every recompute mode it keeps them
(`none`, `selective`: the runtime recomputes only attention; `full` re-runs the loss with the stage, keeping only
the inputs, as the runtime's executor does).

- `last_layer_stage(traced, node_names)`: the last layer as a stage returning every value the model's output is
  built from (earlier layers' passed through from its inputs, as the runtime's last stage returns them).
- `model_loss(traced, stage, loss_fn, target)`: `loss(outputs) -> scalar`, the stage's outputs to the loss.
- `LossStage`: the stage followed by its loss, `forward(*inputs) -> (loss,)` (what the measured profiler times and
  records).

Under a mixed precision the GPU runs the loss in fp32: CUDA autocast computes log_softmax, softmax and the losses
(nll_loss, mse_loss, l1_loss, kl_div, binary_cross_entropy_with_logits, ...) in fp32 whatever their inputs'
dtype, so cross-entropy of bf16 logits keeps an fp32 log-softmax (b·s·V·4 bytes). The measured profiler runs the
loss under the precision's real autocast; the analytic one (meta tensors, no autocast) gives the loss fp32 copies
of the outputs (`upcast=True`), which saves what autocast saves (the copies' `_to_copy` saves nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pipeplan.graph.stage import StageModule, build_stage_module, last_stage_outputs
from pipeplan.graph.trace import TracedModel


def last_layer_stage(traced: TracedModel, node_names: Iterable[str]) -> StageModule:
    """The last layer as a stage whose outputs are all the values `loss_fn` needs."""
    names = list(node_names)
    return build_stage_module(traced, names, outputs=last_stage_outputs(traced, names))


def _fp32(value):
    return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def model_loss(
    traced: TracedModel, stage: StageModule, loss_fn: Callable, target, *, upcast: bool = False
) -> Callable[[tuple], torch.Tensor]:
    """`loss(outputs)`: `loss_fn` on the model's output built from `stage`'s outputs (in `stage.outputs` order) and
    `target`; `upcast` gives it fp32 copies of the floating-point outputs (autocast's loss dtype, see above)."""

    def loss(outputs: tuple) -> torch.Tensor:
        values = dict(zip(stage.outputs, outputs, strict=True))
        if upcast:
            values = {name: _fp32(value) for name, value in values.items()}
        return loss_fn(traced.build_output(values), target)

    return loss


class LossStage(nn.Module):
    """The last layer's stage and then its loss: `forward(*stage inputs) -> (loss,)`. Holds the stage (its
    parameters and buffers are this module's), not a copy."""

    def __init__(self, stage: StageModule, loss: Callable[[tuple], torch.Tensor]) -> None:
        super().__init__()
        self.stage = stage
        self.loss = loss

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.stage.inputs

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.stage.outputs

    def forward(self, *inputs) -> tuple[torch.Tensor]:
        return (self.loss(self.stage(*inputs)),)
