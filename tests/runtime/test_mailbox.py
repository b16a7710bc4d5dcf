"""The mailbox keeps each peer's next `post_ahead` receives posted, always in the sender's order (no processes: the
point-to-point calls are recorded)."""

from __future__ import annotations

import pytest
import torch

from pipeplan.runtime.step import comm
from pipeplan.runtime.step.comm import Mailbox, TensorMeta
from pipeplan.runtime.step.messages import Message, Routing


class _Work:
    def wait(self) -> bool:
        return True


def _messages(src: int, count: int) -> list[Message]:
    return [Message("act", 0, mb, 0, 1, "x", src, 0) for mb in range(count)]


@pytest.fixture
def posted(monkeypatch) -> list[tuple[int, int]]:
    """(src, tag) of every receive posted, in order."""
    calls: list[tuple[int, int]] = []

    def irecv(buffer, src, tag, group=None):
        calls.append((src, tag))
        return _Work()

    monkeypatch.setattr(comm.dist, "irecv", irecv)
    return calls


def _mailbox(post_ahead: int) -> tuple[Mailbox, list[Message], list[Message]]:
    one, two = _messages(1, 4), _messages(2, 1)
    tags = {m: i for i, m in enumerate(one)} | {m: i for i, m in enumerate(two)}
    routing = Routing(owner={}, producer={}, consumers={}, sends={}, tags=tags)
    meta = TensorMeta(shape=(2,), dtype=torch.float32)
    box = Mailbox(rank=0, routing=routing, meta_of=lambda m: meta, device=torch.device("cpu"), post_ahead=post_ahead)
    return box, one, two


def test_keeps_the_next_receives_posted(posted):
    box, one, two = _mailbox(post_ahead=2)
    box.reset()
    assert posted == [(1, 0), (1, 1), (2, 0)]  # each peer's first two (peer 2 sends only one)
    box.receive(one[0])
    assert posted[3:] == [(1, 2)]  # one arrived: the next one is posted
    box.receive(one[1])
    box.receive(one[2])
    box.receive(two[0])
    box.receive(one[3])
    assert posted[3:] == [(1, 2), (1, 3)]  # never past the step's last message
    box.reset()  # every posted receive was consumed
    assert posted[5:] == [(1, 0), (1, 1), (2, 0)]


def test_without_posting_ahead_receives_are_posted_on_demand_in_sender_order(posted):
    box, one, _ = _mailbox(post_ahead=0)
    box.reset()
    assert posted == []
    box.receive(one[1])
    assert posted == [(1, 0), (1, 1)]
