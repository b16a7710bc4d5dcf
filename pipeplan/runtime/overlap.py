"""DualPipe's overlapped F&B pair on CPU (and any device): one half on a second thread while the calling thread
runs the other. torch ops release the GIL, so the forward of one chunk and the backward of the other compute at
once on the rank's cores; the caller keeps every send and receive on its own thread (the mailbox is not shared).

Exact: each half runs the same ops on the same tensors as it would alone; the two touch different stages'
parameters and saved tensors; the RNG (seeded per stage forward) is held by one forward at a time
(`Executor.seeded`); grad mode, autocast and saved-tensor hooks are per thread in torch.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

First = TypeVar("First")
Second = TypeVar("Second")


class PairWorker:
    """A one-thread pool for the second half of overlapped pairs (started once per executor)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeplan-pair")

    def run(self, first: Callable[[], First], second: Callable[[], Second]) -> tuple[First, Second]:
        """`second()` on the worker thread while `first()` runs here; both results once both are done (an error
        of either is raised after both have stopped)."""
        pending = self._pool.submit(second)
        try:
            result = first()
        finally:
            other = pending.result()
        return result, other
