"""The per-rank executor: runs the rank's op list for one step, in order (F, B, I, W), exactly as planned.

F receives its stage's inputs (model inputs from the batch, activations from the producing stage: locally when the
producer is on this rank, else over the wire), runs the stage and sends each output straight to every consuming
stage. B / I gather the output gradients from every consumer, backpropagate and send input gradients straight
back to each producer; W later computes the weight gradients from what I kept. An OVERLAP_F_B op (dualpipev's F&B
pair) gathers both halves' inputs, then runs the backward on a second thread while the forward runs and sends, as
DualPipe overlaps them, or the two in order, as `run --overlap-pairs` says (`overlap.PairRunner`). B, I and W are
the profiler's implementation (graph/split_backward.py), so what was measured is what runs; I releases every saved
tensor W does not read (the profiles' kept-until-W rule). Saved state is dropped as soon as its last use is done.
The loss (last stage) is loss_fn(out, target) / (num_microbatches x data_parallel), so the gradients summed over
microbatches, replicas and pipelines are those of the mean loss over the global batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pipeplan.artifact.plan import Plan
from pipeplan.graph.saved_tensors import SavedTensors, storage_bytes, storage_key
from pipeplan.graph.split_backward import (
    SplitCache,
    WeightGradState,
    backward_full,
    backward_input,
    backward_weight,
)
from pipeplan.runtime.step.comm import Mailbox
from pipeplan.runtime.step.messages import Message, Routing, parse_rank_ops
from pipeplan.runtime.step.pair_runner import PairRunner
from pipeplan.runtime.step.recompute_run import SelectiveRecompute
from pipeplan.runtime.step.stages import PipelineModel
from pipeplan.schedules.ops import Op

MicroBatch = tuple[tuple[torch.Tensor, ...], torch.Tensor]  # (model inputs, target)


class MicroBatches(Protocol):
    """What a step reads its microbatches from: a dict by microbatch, or an asynchronous segment's stream."""

    def __getitem__(self, microbatch: int, /) -> MicroBatch: ...


@dataclass
class _Saved:
    inputs: list[torch.Tensor]  # leaves whose gradients go back to producers (differentiable cut inputs)
    input_names: list[str]
    output_names: list[str]  # differentiable outputs whose gradients consumers send back
    outputs: dict[str, torch.Tensor]  # (empty under full recomputation: the forward is rerun)
    loss: torch.Tensor | None
    tensors: SavedTensors  # what autograd saved (I keeps only what W reads)
    rerun: tuple[list, torch.Tensor] | None = None  # full recomputation: (every stage input, target)


@dataclass
class StepRecord:
    loss_sum: torch.Tensor | None = None  # float64 sum of the scaled microbatch losses (no host sync per op)
    op_times: list[tuple[str, float, float]] = field(default_factory=list)  # (op, start_s, end_s) from `began`
    began: float = 0.0  # time.perf_counter() when the step began
    saved_peak_bytes: int = 0  # with Executor.track_saved: the most `held_activation_bytes` after any op


class Executor:
    def __init__(
        self,
        plan: Plan,
        rank: int,
        model: PipelineModel,
        routing: Routing,
        device: torch.device,
        direction_groups: dict | None = None,
        overlap_pairs: str = "auto",
    ) -> None:
        self.plan = plan
        self.rank = rank
        self.model = model
        self.routing = routing
        self.device = device
        self.pipeline = plan.ranks[rank].pipeline
        self.ops: list[Op] = parse_rank_ops(plan)[rank]
        self.differentiable = model.differentiable
        self.output_stage = model.output_stage()
        self.loss_scale = 1.0 / (plan.training.num_microbatches * plan.training.data_parallel)
        self.mailbox = Mailbox(
            rank=rank, routing=routing, meta_of=self._meta_of, device=device, direction_groups=direction_groups
        )
        self.receives = [[m for part in o.parts for m in self._receives_of(part)] for o in self.ops]
        paired = any(o.halves is not None for o in self.ops)
        self.pairs = PairRunner(overlap_pairs, device_type=device.type) if paired else None
        self.cuda_events = False  # CUDA --trace: time each op with a pair of CUDA events, read after the step
        self.track_saved = False  # record the peak of held_activation_bytes over the step's ops (a diagnostic)
        # the precision's autocast around each stage forward and the loss
        self.autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.loss_grad = 1.0  # the loss's seed gradient: fp16 loss scaling's scale
        self.stage_params = {s: [model.params[n] for n in model.stage_params[s]] for s in model.modules}
        self.recompute = {s: plan.stages[s].recompute for s in model.modules}  # none | selective | full
        self.split_caches = {s: SplitCache() for s in model.modules}  # each stage's I/W graph analysis, by shape
        self.seeded = threading.Lock()  # the global RNG's seed-and-draw of one stage forward at a time

    def _meta_of(self, message: Message):
        return self.model.value_meta[message.value]

    def _owner(self, stage: int, microbatch: int) -> int:
        return self.routing.owner[(self.pipeline, stage, microbatch)]

    def _receives_of(self, o: Op) -> list[Message]:
        """Messages op `o` consumes from other ranks."""
        found: list[Message] = []
        io = self.model.stage_io[o.stage]
        mb, me, p = o.microbatch, self.rank, self.pipeline
        if o.kind == "F":
            for name in io.inputs:
                producer = self.routing.producer.get(name)
                if producer is not None and (src := self._owner(producer, mb)) != me:
                    found.append(Message("act", p, mb, producer, o.stage, name, src, me))
        elif o.kind in ("B", "I"):
            for name in io.outputs:
                if name not in self.differentiable:
                    continue
                for consumer in self.routing.consumers.get((o.stage, name), ()):
                    if (src := self._owner(consumer, mb)) != me:
                        found.append(Message("grad", p, mb, o.stage, consumer, name, src, me))
        return found

    def run_step(self, microbatches: MicroBatches, step: int = 0) -> StepRecord:
        """Run this rank's op list once; `microbatches[m]` holds what its stages need of microbatch m. `step`
        seeds the random ops (dropout) of each forward, see `forward_seed`."""
        self.step = step
        self.mailbox.reset()
        self._local: dict[tuple, torch.Tensor] = {}  # (consumer stage, value, mb) -> activation
        self._local_grads: dict[tuple, torch.Tensor] = {}  # (producer stage, value, mb, consumer) -> gradient
        self._saved: dict[tuple[int, int], _Saved] = {}
        self._weight_state: dict[tuple[int, int], tuple[WeightGradState, SavedTensors]] = {}
        record = StepRecord()
        start = record.began = time.perf_counter()
        events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        origin = self._event() if self.cuda_events else None
        for index, o in enumerate(self.ops):
            if index + 1 < len(self.ops):
                self.mailbox.prefetch(self.receives[index + 1])
            self.mailbox.release_sent()
            self._began = time.perf_counter()  # moved past any receive wait by _computing()
            self._start_event = self._event() if self.cuda_events else None
            if o.kind == "F" or o.halves is not None:
                loss = (
                    self._forward(o, microbatches[o.microbatch])
                    if o.halves is None
                    else self._overlapped(o, microbatches)
                )
                if loss is not None:
                    record.loss_sum = loss if record.loss_sum is None else record.loss_sum + loss
            elif o.kind == "W":
                backward_weight(self._weight_state.pop((o.stage, o.microbatch))[0])
                self._backward_done(o)
            else:
                self._backward(o)
                if o.kind == "B":
                    self._backward_done(o)
            if self.cuda_events:
                assert self._start_event is not None, "recorded at each op's start with cuda_events"
                events.append((str(o), self._start_event, self._event()))
            else:
                record.op_times.append((str(o), self._began - start, time.perf_counter() - start))
            if self.track_saved:
                record.saved_peak_bytes = max(record.saved_peak_bytes, self.held_activation_bytes())
        self.mailbox.drain()
        if self.pairs is not None:
            self.pairs.step_done(time.perf_counter() - start)
        if origin is not None:
            torch.cuda.synchronize(self.device)
            record.op_times = [(n, origin.elapsed_time(a) / 1e3, origin.elapsed_time(b) / 1e3) for n, a, b in events]
        assert not self._saved and not self._weight_state and not self._local and not self._local_grads
        return record

    def held_activation_bytes(self) -> int:
        """Bytes held on this rank for the backward passes still to run (B, I or W): what autograd saved, or a
        fully recomputed stage's inputs; storages counted once, parameters and buffers left out. Recomputation
        lowers it (as the profiles' selective and full bytes say); I lowers it to what W reads."""
        held: dict[int, int] = {}
        recorders = [((s, m), v.tensors) for (s, m), v in self._saved.items()]
        recorders += [(key, tensors) for key, (_, tensors) in self._weight_state.items()]
        for (stage, _), tensors in recorders:
            module = self.model.modules[stage]
            held.update(tensors.storage_bytes(exclude=[*self.stage_params[stage], *module.buffers()]))
        for saved in self._saved.values():
            inputs = saved.rerun[0] if saved.rerun is not None else ()
            held.update({storage_key(v): storage_bytes(v) for v in inputs if isinstance(v, torch.Tensor)})
        return sum(held.values())

    def _computing(self) -> None:
        """The op's inputs are here: its measured time starts now (waiting is the pipeline's bubble, not the op's).
        On CUDA the start event is recorded on the compute stream after the receives' waits were queued on it."""
        if self.cuda_events:
            self._start_event = self._event()
        self._began = time.perf_counter()

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _input_value(self, o: Op, name: str, batch: MicroBatch) -> torch.Tensor:
        if name in self.model.model_inputs:
            return batch[0][self.model.model_inputs.index(name)]
        producer = self.routing.producer[name]
        src = self._owner(producer, o.microbatch)
        if src == self.rank:
            value = self._local.pop((o.stage, name, o.microbatch))
        else:
            value = self.mailbox.receive(
                Message("act", self.pipeline, o.microbatch, producer, o.stage, name, src, self.rank)
            )
        if name in self.differentiable:
            value = value.detach().requires_grad_(True)
        return value

    def _forward(self, o: Op, batch: MicroBatch) -> torch.Tensor | None:
        args = [self._input_value(o, name, batch) for name in self.model.stage_io[o.stage].inputs]
        self._computing()
        return self._forward_finish(o, args, batch, *self._forward_compute(o, args, batch))

    def _overlapped(self, o: Op, microbatches: MicroBatches) -> torch.Tensor | None:
        """An OVERLAP_F_B op: both halves' inputs first (as DualPipe waits for both), then the backward's compute
        on the pair worker's thread while this one runs the forward and sends its outputs; the backward's input
        gradients are sent once it is done. Each half computes what it computes alone (same kernels, same seeds)."""
        forward, backward = o.parts
        batch = microbatches[forward.microbatch]
        args = [self._input_value(forward, name, batch) for name in self.model.stage_io[forward.stage].inputs]
        saved = self._saved.pop((backward.stage, backward.microbatch))
        output_grads = {name: self._output_grad(backward, name) for name in saved.output_names}
        self._computing()
        assert self.pairs is not None
        loss, input_grads = self.pairs.run(
            lambda: self._forward_finish(forward, args, batch, *self._forward_compute(forward, args, batch)),
            lambda: self._backward_compute(backward, saved, output_grads),
        )
        self._backward_finish(backward, saved, input_grads)
        self._backward_done(backward)
        return loss

    def _forward_compute(
        self, o: Op, args: list, batch: MicroBatch
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, SavedTensors]:
        tensors = SavedTensors(hold=False)
        full = self.recompute[o.stage] == "full"  # keep only the inputs; rerun with grad before I or B
        outputs, loss = self._run_stage(o, args, batch[1], tensors, grad=not full)
        return outputs, loss, tensors

    def _forward_finish(
        self, o: Op, args: list, batch: MicroBatch, outputs: dict, loss: torch.Tensor | None, tensors: SavedTensors
    ) -> torch.Tensor | None:
        io = self.model.stage_io[o.stage]
        full = self.recompute[o.stage] == "full"
        for message in self.routing.sends[(self.rank, o)]:
            self.mailbox.send(message, outputs[message.value])
        for name, value in outputs.items():
            for consumer in self.routing.consumers.get((o.stage, name), ()):
                if self._owner(consumer, o.microbatch) == self.rank:
                    self._local[(consumer, name, o.microbatch)] = value.detach()
        names = [n for n in io.inputs if n in self.differentiable and n not in self.model.model_inputs]
        leaves = [args[io.inputs.index(n)] for n in names]
        kept = [n for n in outputs if n in self.differentiable and self.routing.consumers.get((o.stage, n))]
        self._saved[(o.stage, o.microbatch)] = _Saved(
            inputs=leaves,
            input_names=names,
            output_names=kept,
            outputs={} if full else {n: outputs[n] for n in kept},
            loss=None if full else loss,
            tensors=tensors,
            rerun=(args, batch[1]) if full else None,
        )
        return None if loss is None else loss.detach().double()

    def _run_stage(
        self, o: Op, args: list, target: torch.Tensor, tensors: SavedTensors, *, grad: bool = True
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """One forward of `o`'s stage (without a graph when not `grad`), its random ops seeded by `forward_seed`
        (dropout repeats exactly, a recomputation draws what the forward drew), what autograd saves recorded in
        `tensors`: (outputs by name, the scaled loss on the last stage)."""
        io = self.model.stage_io[o.stage]
        selective = SelectiveRecompute() if self.recompute[o.stage] == "selective" else contextlib.nullcontext()
        with self.seeded, torch.set_grad_enabled(grad), self.autocast(), tensors, selective:
            self._seed_generators(self._forward_seed(o))  # (held: an overlapped pair's other half may seed meanwhile)
            results = self._call_stage(o, args)
            outputs = dict(zip(io.outputs, results, strict=True))
            loss = None
            if o.stage == self.output_stage:
                output = self.model.build_output({name: outputs[name] for name in self.model.model_outputs})
                loss = self.model.spec.loss_fn(output, target) * self.loss_scale
        return outputs, loss

    def _seed_generators(self, seed: int) -> None:
        """What torch.manual_seed seeds for the generators a run can draw from (the CPU's, and CUDA's on a CUDA
        run), without its lazy per-backend calls: each of those formats a stack trace while its backend is not
        initialized (CUDA, MTIA, XPU on a CPU run), ~0.1 ms per forward."""
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed_all(seed)

    def _output_grad(self, o: Op, name: str) -> torch.Tensor:
        total = None
        for consumer in self.routing.consumers[(o.stage, name)]:
            src = self._owner(consumer, o.microbatch)
            if src == self.rank:
                grad = self._local_grads.pop((o.stage, name, o.microbatch, consumer))
            else:
                message = Message("grad", self.pipeline, o.microbatch, o.stage, consumer, name, src, self.rank)
                grad = self.mailbox.receive(message)
            total = grad if total is None else total + grad
        assert total is not None
        return total

    def _backward(self, o: Op) -> None:
        saved = self._saved.pop((o.stage, o.microbatch))
        output_grads = {name: self._output_grad(o, name) for name in saved.output_names}
        self._computing()
        self._backward_finish(o, saved, self._backward_compute(o, saved, output_grads))

    def _backward_compute(
        self, o: Op, saved: _Saved, output_grads: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward of `o` (B or I) from its output gradients; its input gradients (no communication)."""
        if saved.rerun is not None:  # full recomputation: the forward again, with grad, right before I or B
            args, target = saved.rerun
            outputs, saved.loss = self._run_stage(o, args, target, saved.tensors)
            saved.outputs = {name: outputs[name] for name in saved.output_names}
            saved.rerun = None
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if saved.loss is not None:
            roots.append(saved.loss)
            grads.append(torch.full_like(saved.loss, self.loss_grad))
        for name, value in saved.outputs.items():
            if value.requires_grad:
                roots.append(value)
                grads.append(output_grads[name])
        params = self._grad_params(o)
        if o.kind == "B":
            input_grads = backward_full(roots, grads, saved.inputs, params)
        else:
            cache = self.split_caches[o.stage]
            input_grads, state = backward_input(roots, grads, saved.inputs, params, saved=saved.tensors, cache=cache)
            self._weight_state[(o.stage, o.microbatch)] = (state, saved.tensors)
        del saved.outputs, saved.loss
        return input_grads

    def _backward_finish(self, o: Op, saved: _Saved, input_grads: Sequence[torch.Tensor | None]) -> None:
        grads = [grad for grad in input_grads if grad is not None]
        assert len(grads) == len(input_grads), "differentiable stage inputs all get a gradient (zeros where unused)"
        by_name = dict(zip(saved.input_names, grads, strict=True))
        for message in self.routing.sends[(self.rank, o)]:
            self.mailbox.send(message, by_name[message.value])
        for name, grad in by_name.items():
            producer = self.routing.producer[name]
            if self._owner(producer, o.microbatch) == self.rank:
                self._local_grads[(producer, name, o.microbatch, o.stage)] = grad

    # ---- what asynchronous schedules change (runtime/train/asynchronous.py): the weights an op uses, its seed, and a
    # hook after each microbatch's last backward (B, or W) on this rank
    def _call_stage(self, o: Op, args: list[torch.Tensor]):
        return self.model.modules[o.stage](*args)

    def _grad_params(self, o: Op) -> list[torch.Tensor]:
        return [p for p in self.stage_params[o.stage] if p.requires_grad]

    def _forward_seed(self, o: Op) -> int:
        return forward_seed(self.plan.training.seed, self.step, self.pipeline, o.stage, o.microbatch)

    def _backward_done(self, o: Op) -> None:
        pass


def forward_seed(seed: int, step: int, pipeline: int, stage: int, microbatch: int) -> int:
    """The RNG seed of one forward op: a function of what it computes, not of which rank runs it or when, so runs
    with dropout repeat exactly, and a resumed run draws what the uninterrupted one would have."""
    key = f"{seed}/{step}/{pipeline}/{stage}/{microbatch}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)
