"""Asynchronous 1F1B streams: PipeDream and PipeDream-2BW. No flush: a run of `steps` steps is one stream of
steps x m microbatches in 1F1B order (each device: a warm-up of p-1-d forwards, then one forward and one backward
in turn, then the drain), and every op carries the weight version it computes with (`ops.py`).

- pipedream (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP 2019): weight
  stashing, each stage updates its weights after every microbatch's backward (update_every = 1). A forward uses
  the newest version of its stage, the backward the version its forward used (stashed). On device d the forward of
  microbatch k follows the backwards of microbatches 0..k-p+d, so it reads version max(0, k-(p-1-d)): stage d's
  weights are p-1-d updates stale, and device d holds up to p-d versions (p on the first).
- pipedream-2bw (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021): double-buffered
  weights. Gradients are accumulated over the m microbatches of a step and each stage makes one new version per
  step (update_every = m); every microbatch of step t computes, forward and backward, with version max(0, t-1) on
  every stage, so the update is the paper's one-step-stale rule W(t+1) = W(t) - lr * grad f(W(t-1)) (with AdamW in
  place of the plain step, and W(-1) = W(0)). t-1 is the newest version when step t's first microbatch enters the
  first stage (its warm-up forwards run before step t-1's last backward), and every stage uses it, so the delay is
  one step everywhere. Two versions per stage suffice when m >= p-1 (step t+1 starts on a device only after step
  t-1's last backward there); with fewer microbatches a third would be needed, which the generator refuses.
Makespan of the stream with uniform costs: (steps x m + p - 1)(F + B); in steady state one microbatch per F + B.
"""

from __future__ import annotations

from pipeplan.errors import ScheduleError
from pipeplan.schedules.generators.one_f_one_b import one_f_one_b
from pipeplan.schedules.ops import Op, Schedule, make_schedule


def _stream(name: str, num_devices: int, num_microbatches: int, steps: int) -> list[tuple[Op, ...]]:
    if steps < 1:
        raise ScheduleError(f"{name} needs --steps >= 1, got {steps}")
    return list(one_f_one_b(num_devices, steps * num_microbatches).device_ops)  # the 1F1B order, no flush


def pipedream(num_devices: int, num_microbatches: int, steps: int = 1) -> Schedule:
    total = steps * num_microbatches
    device_ops = []
    for device, ops in enumerate(_stream("pipedream", num_devices, num_microbatches, steps)):
        warmup = num_devices - 1 - device  # backwards this device lags its forwards by
        device_ops.append([Op(o.kind, o.stage, o.microbatch, max(0, o.microbatch - warmup)) for o in ops])
    # a backward carries its forward's version: the same formula of the same microbatch
    return make_schedule(
        "pipedream", total, tuple(range(num_devices)), device_ops, update_every=1, weight_versions=num_devices
    )


def pipedream_2bw(num_devices: int, num_microbatches: int, steps: int = 1) -> Schedule:
    if steps > 1 and num_microbatches < num_devices - 1:
        raise ScheduleError(
            f"pipedream-2bw keeps two weight versions only with at least p-1 = {num_devices - 1} microbatches per "
            f"step; got {num_microbatches} (raise --microbatches / the global batch, or use fewer --stages)"
        )
    m = num_microbatches
    device_ops = [
        [Op(o.kind, o.stage, o.microbatch, max(0, o.microbatch // m - 1)) for o in ops]
        for ops in _stream("pipedream-2bw", num_devices, m, steps)
    ]
    return make_schedule(
        "pipedream-2bw", steps * m, tuple(range(num_devices)), device_ops, update_every=m, weight_versions=2
    )
