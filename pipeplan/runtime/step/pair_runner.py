"""DualPipe's F&B pairs: overlapped (one half on a second thread while the calling thread runs the other) or in order
(the forward, then the backward, as torch.distributed.pipelining runs OVERLAP_F_B), as `run --overlap-pairs` says.

Overlapped: torch ops release the GIL, so the forward of one chunk and the backward of the other compute at once
where the rank has cores to spare; the caller keeps every send and receive on its own thread (the mailbox is not
shared). On busy cores the two threads only compete: with one thread per rank and every core busy, 2 gloo ranks ran
bench_runtime's MLP 5-8% slower overlapped than in order, and bench_overlap's GPT 1-3% faster. So `auto` (the
default) measures: after two warm-up steps, every rank's steps alternate in order / overlapped (PROBE_STEPS, the same
steps on every rank), and each keeps the way whose step passes took less time (`Executor.run_step` from its start to
its last op's end: the pipeline as this rank sees it, waits included, so one rank's overlap slowing another's compute
counts; the time in the pairs alone favoured overlapping on a rank whose second thread slowed its peer). Overlapped
must win by MARGIN: at par it costs a thread and contention the probe may miss. On CUDA `auto` overlaps without
probing: host clocks do not see the kernels' time.

Exact either way: each half runs the same ops on the same tensors as it would alone; the two touch different
stages' parameters and saved tensors; the RNG (seeded per stage forward) is held by one forward at a time
(`Executor.seeded`); grad mode, autocast and saved-tensor hooks are per thread in torch.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

First = TypeVar("First")
Second = TypeVar("Second")

PAIR_MODES = ("auto", "on", "off")
WARMUP_STEPS = 2  # untimed: overlapped, then in order (each way's first run allocates and warms up)
PROBE_STEPS = 6  # then in order and overlapped by turns; each way's fastest step decides
MARGIN = 0.03  # overlapped is kept only when faster by more than this fraction (the probe's noise at par: <= 1.5%)


class PairRunner:
    """How one rank runs its F&B pairs; `overlapped` is the current way, `decided` says whether it is final."""

    def __init__(self, mode: str, *, device_type: str = "cpu") -> None:
        assert mode in PAIR_MODES, mode
        self.mode = mode
        self.decided = mode != "auto" or device_type != "cpu"
        self.overlapped = mode != "off"
        self._pool: ThreadPoolExecutor | None = None
        self._steps = 0  # steps run so far (auto)
        self.probed: dict[bool, list[float]] = {False: [], True: []}  # overlapped? -> seconds of each step's passes

    def run(self, first: Callable[[], First], second: Callable[[], Second]) -> tuple[First, Second]:
        """Both halves' results: `first()` then `second()` on this thread, or, overlapped, `second()` on the worker
        thread while `first()` runs here (an error of either is raised after both have stopped)."""
        if not self.overlapped:
            return first(), second()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeplan-pair")
        pending = self._pool.submit(second)
        try:
            result = first()
        finally:
            other = pending.result()
        return result, other

    def step_done(self, seconds: float) -> None:
        """A step's passes took `seconds`: under `auto`, record it and set how the next step runs."""
        if self.decided:
            return
        if self._steps >= WARMUP_STEPS:
            self.probed[self.overlapped].append(seconds)
        self._steps += 1
        if self._steps >= WARMUP_STEPS + PROBE_STEPS:
            self.decided = True
            self.overlapped = min(self.probed[True]) < (1.0 - MARGIN) * min(self.probed[False])
        else:
            self.overlapped = self._steps % 2 == 0  # odd steps in order, even ones overlapped

    def describe(self) -> str:
        """How the pairs ran, for the run's summary."""
        way = "overlapped" if self.overlapped else "in order"
        if self.mode != "auto":
            return f"{way} (--overlap-pairs {self.mode})"
        if self.decided and self._steps == 0:
            return f"{way} (auto: CUDA, not probed)"
        if self._steps <= WARMUP_STEPS:
            return f"overlapped{', then in order' if self._steps > 1 else ''} (auto: too few steps to probe)"
        times = ", ".join(
            f"{'overlapped' if key else 'in order'} {1000 * min(values):.1f} ms"
            for key, values in self.probed.items()
            if values
        )
        if not self.decided:
            return f"in order and overlapped by turns (auto: passes per step {times}, probe unfinished)"
        return f"{way} (auto: passes per step {times})"
