"""Weight versions at run time (asynchronous schedules, `schedules/ops.py` states the rule): which tensors each op
computes with, and the mid-stream optimizer step that makes a stage's next version.

The stage's Parameters (what AdamW steps and checkpoints save) always hold its newest version. An op of version v
computes with a *leaf set* of v: plain tensors that alias the storage holding v (`param.data`, with autocast and
autograd seeing ordinary leaves), put in the stage's parameter slots for the call (as `torch.func.functional_call`
does). The autograd
graph of a forward keeps its leaf set, so the backward runs on exactly the weights the forward used (PipeDream's
weight stashing). When the stage makes version v+1 while ops still to finish or still to come read v, the
Parameters first move to a copy of their storage and the leaf set of v keeps the old one: that copy is the stashed
version, freed when the last op reading v is done. So a stage holds the versions `schedules.versions` counts, and
no more.

Gradients: each microbatch's last backward leaves its weight gradients in the leaf set, which are moved into the
accumulator of its update group; when a group is complete the stage's gradients are summed over the ranks holding
the same parameters (GradientSync: data-parallel pipelines, tied weights), checked for NaN/inf and stepped.
Buffers (e.g. BatchNorm statistics) are not versioned: every forward updates the one copy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from pipeplan.errors import RunError
from pipeplan.runtime.step.stages import PipelineModel
from pipeplan.runtime.step.zero import FullOptimizer
from pipeplan.schedules.ops import Op

Key = tuple[int, int]  # (stage, version) or (stage, update group)


def _version_key(o: Op) -> Key:
    """(stage, weight version) of an op of an asynchronous schedule (`schedules.versions`: each carries one)."""
    assert o.version is not None, f"{o} carries no weight version"
    return (o.stage, o.version)


class VersionStore:
    """This rank's stages' weight versions over one stream segment (`ops`: this rank's op list)."""

    def __init__(
        self,
        model: PipelineModel,
        ops: list[Op],
        *,
        update_every: int,
        optimizer: FullOptimizer,
        describe_group: Callable[[int, int], str],
        before_update: Callable[[int], None] = lambda group: None,
        capture: dict[int, dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.model, self.update_every, self.optimizer = model, update_every, optimizer
        self.describe_group = describe_group  # (stage, group) -> "step 12" for messages
        self.before_update = before_update  # (group) -> None: sets the learning rate of that group's step
        self.capture = capture  # microbatch -> its weight gradients (tests)
        self.params = {s: [model.params[n] for n in model.stage_params[s]] for s in model.modules}
        self.slots = {s: _parameter_slots(model.modules[s], self.params[s]) for s in model.modules}
        self.readers: Counter[Key] = Counter(_version_key(o) for o in ops if o.kind == "F")
        self.pending: Counter[Key] = Counter((o.stage, o.microbatch // update_every) for o in ops if o.kind == "B")
        self.groups = {s: 1 + max(u for (stage, u) in self.pending if stage == s) for s in {o.stage for o in ops}}
        self.made = dict.fromkeys(self.params, 0)
        self.leafsets: dict[Key, list[torch.Tensor]] = {}
        self.accumulated: dict[Key, list[torch.Tensor | None]] = {}

    def leaves(self, stage: int, version: int) -> list[torch.Tensor]:
        """The tensors version `version` of `stage` computes with (aligned with `model.stage_params[stage]`)."""
        key = (stage, version)
        if key not in self.leafsets:
            assert version == self.made[stage], f"stage {stage} version {version} was not stashed"
            self.leafsets[key] = [p.data.requires_grad_(p.requires_grad) for p in self.params[stage]]
        return self.leafsets[key]

    def call(self, o: Op, args: list[torch.Tensor]):
        """Run stage `o.stage` on `args` with the weights of `o.version`: each parameter slot of its submodules
        holds the version's leaf during the call (what `torch.func.functional_call` does, with the slots looked
        up once instead of on every call), and its Parameter again after it."""
        leaves = self.leaves(*_version_key(o))
        slots = self.slots[o.stage]
        try:
            for owner, attr, index in slots:
                owner._parameters[attr] = leaves[index]  # type: ignore[assignment]  # a leaf in a Parameter's slot
            return self.model.modules[o.stage](*args)
        finally:
            params = self.params[o.stage]
            for owner, attr, index in slots:
                owner._parameters[attr] = params[index]

    def grad_leaves(self, o: Op) -> list[torch.Tensor]:
        return [leaf for leaf in self.leafsets[_version_key(o)] if leaf.requires_grad]

    def backward_done(self, o: Op, global_microbatch: int) -> None:
        """Microbatch `o.microbatch`'s last backward on its stage ran: take its weight gradients, release its
        version if nothing else reads it, and make every version whose update group is now complete."""
        stage, group, key = o.stage, o.microbatch // self.update_every, _version_key(o)
        summed = self.accumulated.setdefault((stage, group), [None] * len(self.params[stage]))
        names = self.model.stage_params[stage]
        for index, leaf in enumerate(self.leafsets[key]):
            grad, leaf.grad = leaf.grad, None
            if grad is None:
                continue
            if self.capture is not None:
                self.capture.setdefault(global_microbatch, {})[names[index]] = grad.detach().cpu().clone()
            previous = summed[index]
            summed[index] = grad if previous is None else previous.add_(grad)
        self.readers[key] -= 1
        if not self.readers[key] and key[1] != self.made[stage]:
            del self.leafsets[key]
        self.pending[(stage, group)] -= 1
        while self.made[stage] < self.groups[stage] and not self.pending[(stage, self.made[stage])]:
            self._update(stage)

    def _update(self, stage: int) -> None:
        """Make version made+1 of `stage`: the group's gradients summed over the holders, checked, stepped."""
        version = self.made[stage]
        params = self.params[stage]
        for param, grad in zip(params, self.accumulated.pop((stage, version)), strict=True):
            param.grad = grad
        self.optimizer.reduce_gradients()  # collective over each group of ranks holding the same parameters
        grads = self.optimizer.grads()
        if grads and not bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()):
            raise RunError(
                f"{self.describe_group(stage, version)}: stage {stage}'s gradients are not finite; stopped before its "
                "update (asynchronous stages step on their own: nothing saved): lower --lr or check the model and data"
            )
        if self.readers[(stage, version)]:  # ops still read this version: keep its storage, step a copy
            self.leaves(stage, version)
            with torch.no_grad():
                for param in params:
                    param.data = param.data.clone()
        else:
            self.leafsets.pop((stage, version), None)
        self.before_update(version)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.made[stage] = version + 1

    def finished(self) -> bool:
        """Every update of the segment made and no stashed version left."""
        return all(self.made[s] == n for s, n in self.groups.items()) and all(
            version == self.made[stage] for stage, version in self.leafsets
        )


def _parameter_slots(
    module: torch.nn.Module, params: list[torch.nn.Parameter]
) -> list[tuple[torch.nn.Module, str, int]]:
    """(submodule, attribute, index in the stage's canonical parameters) of every parameter slot of `module`,
    tied slots included."""
    index = {id(p): i for i, p in enumerate(params)}
    slots = []
    for _, owner in module.named_modules(remove_duplicate=False):
        for attr, param in owner._parameters.items():
            if param is not None:
                slots.append((owner, attr, index[id(param)]))
    return slots
