"""Point-to-point transfers for one rank: receives posted early, in each peer's send order; sends asynchronous.

A `Mailbox` knows, per peer, the sequence of messages that peer sends this rank in a step (from `Routing`). Asking
for a message posts every not-yet-posted receive from that peer up to it (so receives are always posted in the
sender's order) and `prefetch` posts them ahead of need, letting transfers overlap compute. Besides, each peer's
next `post_ahead` messages always have a receive posted (from the step's start, and again whenever one arrives):
a transfer then starts the moment its sender sends it. gloo moves a message's data only once both sides have
posted (the receiver's "ready to receive" notice reaching the sender): a send that finds its receive already posted
writes the data at once, while one posted first waits for the notice, handled by the sender's gloo thread — a
round trip and two thread wake-ups more on the critical path, several ms each on busy cores. Posting only the next
op's receives, about a third of zbv's messages found their receive posted (2 gloo ranks, bench_runtime (a)'s model,
traced per message); two ahead per peer, about nine in ten. It holds at most `post_ahead` more buffers per peer.
`send` is an isend whose handle is kept (with its tensor) until it completes.

With `direction_groups` (the default on every backend; required on NCCL) each ordered pair of ranks talks over its own
process group, i.e. its own communicator and stream (on gloo, its own connection, so the two directions' transfers of a
V-shaped or interleaved schedule do not queue behind each other): NCCL matches point-to-point operations in issue order
per communicator, and a stream shared by both directions could wait in a cycle (A waits to receive from B before its
send to B is issued, and B likewise); one direction per stream leaves only the schedule's own dependencies, which
`validate` checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeplan.errors import RunError
from pipeplan.runtime.step.messages import Message, Routing


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype


POST_AHEAD = 2  # receives kept posted per peer beyond the ones the current op needs


class Mailbox:
    def __init__(
        self,
        *,
        rank: int,
        routing: Routing,
        meta_of: Callable[[Message], TensorMeta],
        device: torch.device,
        direction_groups: dict[tuple[int, int], dist.ProcessGroup] | None = None,
        post_ahead: int = POST_AHEAD,
    ) -> None:
        self.rank = rank
        self.post_ahead = post_ahead
        self._groups = direction_groups or {}
        self.routing = routing
        self.device = device
        self._meta_of = meta_of
        self._incoming = routing.receive_order(rank)
        self._position = dict.fromkeys(self._incoming, 0)
        self._index = {m: i for messages in self._incoming.values() for i, m in enumerate(messages)}
        self._posted: dict[Message, tuple[torch.Tensor, dist.Work]] = {}
        self._sent: dict[Message, tuple[torch.Tensor, dist.Work]] = {}
        # message received -> our sends its sender consumed before sending it (done: waited and dropped on receipt).
        # gloo's send handles report completion only once waited, so without this a stream keeps every send.
        self.settled_by: dict[Message, tuple[Message, ...]] = {}

    def reset(self) -> None:
        """Start a new step: every peer's sequence starts again at its first message."""
        assert not self._posted, f"unconsumed receives at end of step: {list(self._posted)[:3]}"
        self._position = dict.fromkeys(self._incoming, 0)
        if self.post_ahead > 0:
            for sequence in self._incoming.values():
                self.post_up_to(sequence[min(self.post_ahead, len(sequence)) - 1])

    def post_up_to(self, message: Message) -> None:
        peer = message.src
        target = self._index[message]
        sequence = self._incoming[peer]
        while self._position[peer] <= target:
            pending = sequence[self._position[peer]]
            meta = self._meta_of(pending)
            buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            work = dist.irecv(
                buffer, src=peer, tag=self.routing.tags[pending], group=self._groups.get((peer, self.rank))
            )
            assert work is not None, "irecv returns no Work only to a rank outside the group"
            self._posted[pending] = (buffer, work)
            self._position[peer] += 1

    def receive(self, message: Message) -> torch.Tensor:
        """Block until `message` has arrived and return its tensor."""
        if message not in self._posted:
            self.post_up_to(message)
        buffer, work = self._posted.pop(message)
        if self.post_ahead > 0:  # keep the next post_ahead messages from this peer posted
            sequence = self._incoming[message.src]
            self.post_up_to(sequence[min(self._index[message] + self.post_ahead, len(sequence) - 1)])
        work.wait()
        for sent in self.settled_by.get(message, ()):
            done = self._sent.pop(sent, None)
            if done is not None:
                done[1].wait()  # the peer had received it before sending `message`: no wait in fact
        return buffer

    def prefetch(self, messages: list[Message]) -> None:
        for message in messages:
            if message not in self._posted and self._index[message] >= self._position[message.src]:
                self.post_up_to(message)

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        payload = tensor.detach().contiguous()
        meta = self._meta_of(message)
        if payload.dtype != meta.dtype or tuple(payload.shape) != meta.shape:
            raise RunError(
                f"{message.value!r} is {tuple(payload.shape)} {payload.dtype} but its receiver expects {meta.shape} "
                f"{meta.dtype}; the model computes another value than traced (try --precision fp32)"
            )
        group = self._groups.get((self.rank, message.dst))
        work = dist.isend(payload, dst=message.dst, tag=self.routing.tags[message], group=group)
        assert work is not None, "isend returns no Work only to a rank outside the group"
        self._sent[message] = (payload, work)

    def release_sent(self) -> None:
        """Drop completed sends, so a sent activation's memory goes as soon as the receiver has it."""
        if self._sent:
            self._sent = {m: (t, w) for m, (t, w) in self._sent.items() if not w.is_completed()}

    def drain(self) -> None:
        """Wait for every send of the step (their receivers consumed them)."""
        for _, work in self._sent.values():
            work.wait()
        self._sent.clear()


def make_direction_groups(routing: Routing) -> dict[tuple[int, int], dist.ProcessGroup]:
    """One process group per ordered (src, dst) pair that exchanges messages. Collective: every rank creates every
    group, in the same (sorted) order, and keeps those it belongs to."""
    rank = dist.get_rank()
    groups: dict[tuple[int, int], dist.ProcessGroup] = {}
    for src, dst in sorted({(m.src, m.dst) for m in routing.tags}):
        group = dist.new_group([src, dst])
        if rank in (src, dst):
            groups[(src, dst)] = group
    return groups
