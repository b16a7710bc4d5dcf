"""The optimizer step of `pipeplan run`, with the plan's `training.zero` setting: 0 keeps a full AdamW state on every
rank, 1 shards it (ZeRO-1, Rajbhandari et al. 2020) over the ranks that hold the same parameters.

Which ranks hold a parameter is GradientSync's business (grads.py): the replicas of its stage, the same stage in every
data-parallel pipeline, and for tied weights the ranks of every stage using it; parameters with one set of holders
form one bucket. With zero=1 each bucket of d > 1 holders works as Megatron's distributed optimizer does:
- its parameters live in one flat buffer, padded to a multiple of d, that the Parameters view into; so do their
  gradients during the step (a second flat buffer AccumulateGrad adds into, in place);
- after the backward passes the gradient buffer is reduce-scattered: rank i of the group gets the sum over holders of
  slice i (the 1/d of the buffer it owns) and the full gradients are dropped;
- AdamW steps only that slice, so its state (exp_avg, exp_avg_sq) exists for 1/d of the bucket on each rank;
- an all-gather brings every rank's updated slice back into the full parameter buffer.
AdamW is elementwise, so this is the unsharded step, up to the order in which the collectives add the holders'
gradients. Parameters one rank holds alone keep a per-parameter state, as with zero=0; zero=1 where every group has
one rank is zero=0. Padding elements have zero gradient, so AdamW leaves them at zero.

Checkpoints hold each parameter's full state either way (`gathered_states` gathers a bucket's slices on save,
`load_states` slices them on resume): the files are the same for zero=0 and zero=1 and resume into either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeplan.errors import RunError
from pipeplan.runtime.step.grads import GradientSync

MakeOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
State = dict[str, Any]


def _reduce_scatter(output: torch.Tensor, flat: torch.Tensor, group) -> None:
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    collective(output, flat, op=dist.ReduceOp.SUM, group=group)


def _all_gather(output: torch.Tensor, piece: torch.Tensor, group) -> None:
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    collective(output, piece, group=group)


def _to_device(state: State, device: torch.device) -> State:
    """A saved state on `device`; 0-dim tensors (AdamW's step) stay where the optimizer keeps them."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in state.items()}


def _numel(state: State) -> int:
    return sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


class FullOptimizer:
    """zero=0: all-reduce the shared gradients, then step AdamW over every parameter this rank holds."""

    def __init__(self, sync: GradientSync, params: dict[str, nn.Parameter], make: MakeOptimizer) -> None:
        self.sync, self.params = sync, params
        self.local = params  # parameters stepped with a per-parameter state
        self.optimizer = make([params[name] for name in sorted(params)])

    def zero_grad(self) -> None:
        for param in self.params.values():
            param.grad = None

    def reduce_gradients(self) -> None:
        self.sync.all_reduce()

    def grads(self) -> list[torch.Tensor]:
        """The gradients the step uses (for the finiteness check and fp16 unscaling)."""
        return [p.grad for p in self.local.values() if p.grad is not None]

    def step(self) -> None:
        self.optimizer.step()

    def owned_grads(self) -> list[torch.Tensor]:
        """The gradients this rank counts in the global gradient norm: every element of every parameter's summed
        gradient is counted by exactly one rank (a shared parameter by the first of its holders)."""
        elsewhere = {name for ranks, _, _, names in self.sync.buckets if ranks[0] != self.sync.rank for name in names}
        return [p.grad for name, p in self.local.items() if p.grad is not None and name not in elsewhere]

    def written_by_step(self) -> list[torch.Tensor]:
        """The parameter storage `step()` writes (what post-validation copies to undo a step exactly)."""
        return list(self.local.values())

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Every held parameter's summed gradient, on the CPU (tests compare them with a reference)."""
        return {n: (p.grad.detach().cpu().clone() if p.grad is not None else None) for n, p in self.params.items()}

    def gathered_states(self, wanted: Iterable[str]) -> dict[str, State]:
        """name -> that parameter's optimizer state (CPU tensors) for the `wanted` names."""
        return {name: _cpu(self.optimizer.state.get(self.params[name], {})) for name in wanted}

    def load_states(self, states: dict[str, State]) -> None:
        """Install saved per-parameter states (names this rank holds)."""
        for name, state in states.items():
            if name in self.local:
                param = self.local[name]
                self.optimizer.state[param] = _to_device(state, param.device)

    def state_numel(self) -> int:
        """Elements of optimizer state on this rank (the tensors AdamW keeps per element)."""
        return sum(_numel(state) for state in self.optimizer.state.values())


def _own_copy(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _cpu(state: State) -> State:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


class FlatBucket:
    """One bucket's parameters in a flat buffer they view into; `shard` (this rank's slice) is what AdamW steps."""

    def __init__(self, ranks: tuple[int, ...], group, names: list[str], params: list[nn.Parameter], rank: int):
        dtypes, devices = {p.dtype for p in params}, {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise RunError(
                f"ZeRO-1 needs the parameters shared by ranks {list(ranks)} in one dtype on one device, found "
                f"{sorted(map(str, dtypes))}; re-plan with --memory zero=0"
            )
        self.ranks, self.group, self.names, self.params = ranks, group, names, params
        self.numels = [p.numel() for p in params]
        self.shard_numel = -(-sum(self.numels) // len(ranks))  # ceil: the buffer is padded to d x this
        self.flat = torch.zeros(self.shard_numel * len(ranks), dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for param, view in zip(params, self._views(self.flat), strict=True):
                view.copy_(param)
                param.data = view  # the Parameter now lives in the buffer (same object, same module)
        self.index = ranks.index(rank)  # this rank's slice of the buffer
        start = self.index * self.shard_numel
        self.shard = self.flat[start : start + self.shard_numel]  # a leaf view: AdamW's update lands in `flat`
        self.grad_buffer: torch.Tensor | None = None

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        views, offset = [], 0
        for param, count in zip(self.params, self.numels, strict=True):
            views.append(flat[offset : offset + count].view_as(param))
            offset += count
        return views

    def zero_grad(self) -> None:
        """Point every parameter's .grad at a zeroed flat buffer: backward accumulates into it in place."""
        self.shard.grad = None
        self.grad_buffer = torch.zeros_like(self.flat)
        for param, view in zip(self.params, self._views(self.grad_buffer), strict=True):
            param.grad = view

    def reduce_scatter(self) -> None:
        assert self.grad_buffer is not None, "zero_grad() starts every step"
        summed = torch.empty_like(self.shard)
        _reduce_scatter(summed, self.grad_buffer, self.group)
        for param in self.params:
            param.grad = None
        self.grad_buffer = None
        self.shard.grad = summed

    def all_gather_params(self) -> None:
        _all_gather(self.flat, self.shard.detach().clone(), self.group)

    def gather(self, piece: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `piece` (a shard-sized tensor), joined and cut back into per-parameter tensors."""
        full = torch.empty(self.shard_numel * len(self.ranks), dtype=piece.dtype, device=piece.device)
        _all_gather(full, piece.contiguous(), self.group)
        return self._views(full)

    def slice_of(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's slice of the per-parameter `tensors` laid out as the buffer is."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        padded = torch.zeros(self.flat.numel(), dtype=flat.dtype)
        padded[: flat.numel()] = flat
        start = self.index * self.shard_numel
        return padded[start : start + self.shard_numel].clone()


class ShardedOptimizer(FullOptimizer):
    """zero=1: reduce-scatter each bucket's gradients, step AdamW on this rank's slice, all-gather the parameters."""

    def __init__(self, sync: GradientSync, params: dict[str, nn.Parameter], make: MakeOptimizer, rank: int) -> None:
        self.sync, self.params = sync, params
        self.buckets = [FlatBucket(ranks, group, names, plist, rank) for ranks, group, plist, names in sync.buckets]
        shared = {name for bucket in self.buckets for name in bucket.names}
        self.local = {name: p for name, p in params.items() if name not in shared}
        self.optimizer = make([self.local[name] for name in sorted(self.local)] + [b.shard for b in self.buckets])

    def zero_grad(self) -> None:
        for param in self.local.values():
            param.grad = None
        for bucket in self.buckets:
            bucket.zero_grad()

    def reduce_gradients(self) -> None:
        for bucket in self.buckets:  # in GradientSync's order: the same on every rank of every group
            bucket.reduce_scatter()

    def grads(self) -> list[torch.Tensor]:
        return super().grads() + [b.shard.grad for b in self.buckets if b.shard.grad is not None]

    def step(self) -> None:
        self.optimizer.step()
        for bucket in self.buckets:
            bucket.all_gather_params()

    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's unshared gradients and its slice of each bucket's summed gradient (slices are disjoint)."""
        return self.grads()

    def written_by_step(self) -> list[torch.Tensor]:
        """Unshared parameters and each bucket's whole flat buffer (the all-gather rewrites every slice)."""
        return list(self.local.values()) + [bucket.flat for bucket in self.buckets]

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Collective (every rank calls it): the buckets' gradient slices gathered, plus the local gradients."""
        found = {n: (p.grad.detach().cpu().clone() if p.grad is not None else None) for n, p in self.local.items()}
        for bucket in self.buckets:
            assert bucket.shard.grad is not None, "full_grads() follows reduce_gradients()"
            for name, grad in zip(bucket.names, bucket.gather(bucket.shard.grad), strict=True):
                found[name] = grad.cpu().clone()
        return found

    def gathered_states(self, wanted: Iterable[str]) -> dict[str, State]:
        """Collective (every rank calls it, whatever it wants): each bucket's state slices gathered into full
        per-parameter states; scalars (AdamW's step) copied to every parameter of the bucket."""
        wanted = set(wanted)
        states = super().gathered_states(wanted & set(self.local))
        for bucket in self.buckets:
            state = self.optimizer.state.get(bucket.shard, {})
            per_param: list[State] = [{} for _ in bucket.names]
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    pieces = [t.cpu().clone() for t in bucket.gather(value)]
                else:
                    pieces = [_own_copy(value) for _ in bucket.names]  # AdamW bumps each step in place
                for target, piece in zip(per_param, pieces, strict=True):
                    target[key] = piece
            states.update({n: s for n, s in zip(bucket.names, per_param, strict=True) if n in wanted})
        return states

    def load_states(self, states: dict[str, State]) -> None:
        super().load_states(states)
        for bucket in self.buckets:
            state = _bucket_state(bucket, [states.get(name, {}) for name in bucket.names])
            if state:
                self.optimizer.state[bucket.shard] = _to_device(state, bucket.flat.device)


def _bucket_state(bucket: FlatBucket, saved: list[State]) -> State:
    """This rank's slice of a bucket's saved per-parameter states ({} when none has a state yet)."""
    if not any(saved):
        return {}
    keys = set(saved[0])
    if not all(saved) or any(set(s) != keys for s in saved):
        raise RunError(
            f"the checkpoint's optimizer state differs in kind between parameters {bucket.names[:2]} shared by "
            f"ranks {list(bucket.ranks)}; resume from an intact checkpoint"
        )
    state: State = {}
    for key in sorted(keys):
        values = [s[key] for s in saved]
        if all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
            if [v.shape for v in values] != [p.shape for p in bucket.params]:
                raise RunError(f"the checkpoint's optimizer state {key!r} of {bucket.names[0]!r} has another shape")
            state[key] = bucket.slice_of(values)
            continue
        first = values[0]
        if any(not _same_scalar(first, v) for v in values):
            raise RunError(
                f"the checkpoint's optimizer {key!r} differs between parameters {bucket.names[:2]} shared by ranks "
                f"{list(bucket.ranks)}; resume from an intact checkpoint"
            )
        state[key] = first.clone() if isinstance(first, torch.Tensor) else first
    return state


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


def make_step_optimizer(
    zero: int, sync: GradientSync, params: dict[str, nn.Parameter], make: MakeOptimizer, rank: int
) -> FullOptimizer:
    """The plan's `training.zero` (0 or 1; plan.json validation refuses others) as an optimizer step."""
    if zero == 1:
        return ShardedOptimizer(sync, params, make, rank)
    return FullOptimizer(sync, params, make)
