"""Measuring under a run's concurrency: sibling processes that keep the CPU as busy as a run's other ranks do.

A CPU profile measured by one process sees the machine's other work, but not the N - 1 other ranks that share its
cores in a run of N ranks on this machine (each running the same model's layers with the same threads). On a
2-core machine two ranks and one other busy process make three runnable threads on two cores, and every op a rank
runs costs what it costs under that contention, which a profile measured alone does not see. `--concurrent N`
(`sibling_load`) starts N - 1 processes that each build the same model (from the profile's model reference and
options: what a rank builds), set the same thread count and run its whole training step (forward with the loss,
backward) over and over on the sample batch until the measurement ends; the profile is timed while they run.

Under that load the operating system time-slices the cores: a thread gets a share of a core, in slices of a few
milliseconds, so a short op either runs whole (and its median shows no contention at all) or waits a whole slice,
while a stage's ops, many layers long, wait in proportion. Medians of wall-clock samples of single layers therefore
miss the contention a stage meets. What is measured instead, beside the siblings:
- every layer's passes in process CPU time (`--timer cpu`): the work on a core, with the siblings' cache and
  memory traffic in it, without the waits for a core;
- the model's whole training step (the same step every sibling runs): this process's CPU time per step, over
  `SHARE_STEPS` steps after the layers (`own_step_times`), and the wall-clock per step of every process, this one's
  over those steps and each sibling's over all the steps it ran during the measurement (`SiblingShares`);
and every time in the profile is the CPU time x the slowest process's wall-clock per step over this process's CPU
time per step (`slowest_share`; `provenance.wall_over_cpu`): what the same work costs the slowest of the N
processes in wall-clock. The processes do not fare alike: each is pinned to its own block of cores as a run's
ranks are (`cluster.cpu_core_blocks`: this process the first, sibling i the (i+1)-th), so one of them may share
its core with the machine's other work for the whole measurement (with one other busy process on a 2-core
machine, it gets half a core) while another has a core to itself, as in the run one rank does; and a
synchronized run goes at its slowest rank's pace, so the slowest process's time for the work is what a run's step
meets, whichever process the layers were timed in. The profile records N (`provenance.concurrent`) and the ratio.

A rank also updates its parameters every step, and a measured profile otherwise knows no rate to time that with.
Beside the siblings, `update_bytes_per_s` times torch's AdamW (the runtime's `adamw`) stepping the model's fp32
parameters, in process CPU time as the layers are, and its time is multiplied by the same ratio (the slowest
process's pace, whichever block of cores this process measured on): the bytes it moves per parameter
(`ADAMW_FP32_BYTES`: the parameter, its gradient and both moments read, the parameter and the moments written, 4
bytes each; the same count as `costs.overlap.optimizer_bytes_per_param` for fp32 AdamW, which
tests/profiling/test_siblings.py checks) over that time gives `provenance.update_bytes_per_s`, which
`predict.gradient_sync.stage_optimizer_ms` times a plan's updates with (as it does a refined profile's).

A sibling is busy all the time, a rank only while it has ops to run (not in its pipeline bubble, not while it
waits for a transfer): the contention measured is that of the ranks' busy phases, an upper bound on a run's.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from pipeplan.cluster import cpu_core_blocks, pin_process
from pipeplan.console import warn
from pipeplan.errors import ConfigError
from pipeplan.profiling.profile import Profile

SHARE_STEPS = 30  # training steps timed for the wall / CPU ratio (about 0.5 s for a small model)
UPDATE_STEPS = 20  # AdamW steps timed for the update rate
# fp32 AdamW per parameter: p, grad, exp_avg, exp_avg_sq read; p and both moments written (4 bytes each)
ADAMW_FP32_BYTES = 4 * (4 + 3)
READY_TIMEOUT_S = 300.0  # a sibling imports torch and builds the model once: minutes at most on a loaded machine
STOP_TIMEOUT_S = 10.0  # a sibling finishes its current step after the stop flag


@dataclass(frozen=True, kw_only=True)
class SiblingModel:
    """What a sibling builds and runs: the model as `load_model` rebuilds it, the microbatch, the threads."""

    model: str
    options: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 1
    precision: str = "fp32"
    threads: int = 1


def _sibling(model: SiblingModel, cores, ready, stop, shares) -> None:  # pragma: no cover - a child process
    """Build `model` and run its training step until `stop` is set, pinned to `cores` (None: where the OS puts
    it); report "ready" (or the error line) first, and at the end its steps' summed wall-clock and their count on
    `shares`."""
    import time

    if cores is not None:
        pin_process(cores)
    try:
        import torch

        torch.set_num_threads(model.threads)
        step = _training_step(model)
    except Exception as exc:  # the user's model: its own error is the line the parent prints
        ready.put(f"{type(exc).__name__}: {exc}")
        return
    ready.put("ready")
    wall, steps = 0.0, 0
    while not stop.is_set():
        began = time.perf_counter()
        step()
        wall, steps = wall + time.perf_counter() - began, steps + 1
    shares.put((wall, steps))


@dataclass
class SiblingShares:
    """Each sibling's wall-clock per training step over the steps it ran (module docstring), filled when the load
    stops."""

    step_walls_s: list[float] = field(default_factory=list)


def _training_step(model: SiblingModel) -> Callable[[], None]:
    """`model` built on the CPU in its precision, and one training step of it on its sample batch (forward with
    the loss under the precision's autocast, backward), as a function."""
    import torch

    from pipeplan.models.registry import load_model
    from pipeplan.precision import get_precision

    spec = load_model(model.model, model.options)
    module = spec.build()
    module.train()
    mode = get_precision(model.precision)
    if mode.param_dtype != torch.float32:
        module.to(mode.param_dtype)
    sample, target = spec.sample_batch(model.batch_size, generator=torch.Generator().manual_seed(1))
    low = mode.param_dtype if mode.param_dtype != torch.float32 else None
    inputs = tuple(t.to(low) if low is not None and t.is_floating_point() else t for t in sample)

    def step() -> None:
        with mode.autocast("cpu"):
            loss = spec.loss_fn(module(*inputs), target)
        loss.backward()
        module.zero_grad(set_to_none=True)

    return step


@contextmanager
def sibling_load(model: SiblingModel, count: int) -> Iterator[SiblingShares]:
    """`count` sibling processes running `model`'s training step from before the block until after it; a sibling
    that cannot build the model is refused in one line naming --concurrent. Yields the siblings' shares, filled
    once they stopped (after the block)."""
    shares = SiblingShares()
    if count <= 0:
        yield shares
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process whose torch threads already ran
    ready, stop, reported = context.Queue(), context.Event(), context.Queue()
    pinned = cpu_core_blocks(count + 1, model.threads)  # this process: the first block, sibling i the (i+1)-th
    blocks: list[frozenset[int] | None] = list(pinned) if pinned else [None] * (count + 1)
    children = [
        context.Process(target=_sibling, args=(model, cores, ready, stop, reported), daemon=True)
        for cores in blocks[1:]
    ]
    for child in children:
        child.start()
    before = pin_process(blocks[0]) if blocks[0] is not None else None
    try:
        for _ in children:
            _wait_ready(ready)
        yield shares
        stop.set()  # (a refused or failed block does not wait for reports)
        shares.step_walls_s += _reported_step_walls(reported, count)
        if len(shares.step_walls_s) < count:
            warn(
                f"--concurrent: {count - len(shares.step_walls_s)} of {count} sibling process(es) reported no step "
                "time; the profile is scaled by the slowest of the others"
            )
    finally:
        if before is not None:
            pin_process(before)
        stop.set()
        for child in children:
            child.join(STOP_TIMEOUT_S)
            if child.is_alive():
                child.terminate()
                child.join()


def _reported_step_walls(reported, count: int) -> list[float]:
    """The wall-clock per step the stopping siblings report (one that stepped nothing or does not answer in time:
    none)."""
    walls = []
    for _ in range(count):
        try:
            wall, steps = reported.get(timeout=STOP_TIMEOUT_S)
        except queue.Empty:
            break
        if steps > 0:
            walls.append(wall / steps)
    return walls


def slowest_share(own: tuple[float, float], sibling_walls_s: list[float]) -> float:
    """The ratio every CPU time is multiplied by: the slowest process's wall-clock per training step (this one's or
    a sibling's) over this process's CPU time per step, `own` = (wall, CPU) per step (module docstring). Below 1
    where this process's threads ran in parallel (its CPU time sums theirs): the layers' CPU times are then brought
    back to wall-clock the same way."""
    wall, cpu = own
    return max([wall, *sibling_walls_s]) / cpu if cpu > 0 else 1.0


def _wait_ready(ready) -> None:
    try:
        answer = ready.get(timeout=READY_TIMEOUT_S)
    except queue.Empty:
        raise ConfigError(
            f"--concurrent: a sibling process did not build the model within {READY_TIMEOUT_S:.0f} s; "
            "profile with --concurrent 1"
        ) from None
    if answer != "ready":
        raise ConfigError(
            f"--concurrent: a sibling process could not build the model ({answer}); profile with --concurrent 1"
        )


def own_step_times(model: SiblingModel, steps: int = SHARE_STEPS) -> tuple[float, float]:
    """Wall-clock and process CPU time per step of `model`'s training step (built here as the siblings build it),
    over `steps` steps after two untimed ones (module docstring)."""
    import time

    step = _training_step(model)
    for _ in range(2):
        step()
    wall = cpu = 0.0
    for _ in range(steps):
        began_wall, began_cpu = time.perf_counter(), time.process_time()
        step()
        wall += time.perf_counter() - began_wall
        cpu += time.process_time() - began_cpu
    return wall / steps, cpu / steps


def update_bytes_per_s(model: SiblingModel, steps: int = UPDATE_STEPS) -> float | None:
    """Bytes/s of torch's AdamW stepping `model`'s parameters (fp32 only: None otherwise), in process CPU time
    over `steps` steps after two untimed ones (module docstring)."""
    import time

    import torch

    from pipeplan.models.registry import load_model

    if model.precision != "fp32":
        return None
    params = [p for p in load_model(model.model, model.options).build().parameters() if p.requires_grad]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for _ in range(2):
        optimizer.step()
    began = time.process_time()
    for _ in range(steps):
        optimizer.step()
    seconds = time.process_time() - began
    count = sum(p.numel() for p in params)
    return count * ADAMW_FP32_BYTES * steps / seconds if seconds > 0 and count else None


def under_concurrency(profile: Profile, concurrent: int, ratio: float, update_rate: float | None) -> Profile:
    """`profile` (its times CPU times measured beside `concurrent` - 1 siblings) with every time x `ratio` (the
    slowest process's wall-clock over this one's CPU time per step), the AdamW update's too (`update_rate`, bytes
    per CPU second, / `ratio`), all recorded in its provenance."""
    times = ("forward_ms", "input_grad_ms", "weight_grad_ms", "backward_ms", "selective_recompute_ms")
    layers = tuple(
        replace(
            layer,
            **{name: getattr(layer, name) * ratio for name in times},
            full_recompute_ms=None if layer.full_recompute_ms is None else layer.full_recompute_ms * ratio,
        )
        for layer in profile.layers
    )

    def scaled(ms: float | None) -> float | None:
        return None if ms is None else ms * ratio

    return replace(
        profile,
        layers=layers,
        whole_forward_ms=scaled(profile.whole_forward_ms),
        whole_backward_ms=scaled(profile.whole_backward_ms),
        whole_split_backward_ms=scaled(profile.whole_split_backward_ms),
        provenance=replace(
            profile.provenance,
            concurrent=concurrent,
            wall_over_cpu=ratio,
            update_bytes_per_s=None if update_rate is None else update_rate / ratio,
        ),
    )
