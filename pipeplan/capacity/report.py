"""What `pipeplan capacity` reports: one row per device count (the best plan, or why none fits), the step's time
split, and how many devices a token budget needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeplan.capacity.memory import MemorySplit
from pipeplan.cluster import MemoryBudget

SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True, kw_only=True)
class TimeSplit:
    """The step (ms) as compute of the busiest device + its bubble + exposed communication; they sum to the step."""

    compute_ms: float
    bubble_ms: float
    comm_ms: float


@dataclass(frozen=True, kw_only=True)
class CapacityRow:
    """The best plan on `num_devices` devices, or (schedule None) why none fits and what would. The layout:
    `tensor_parallel` t devices per group x `pipeline_devices` groups per pipeline x `data_parallel` pipelines;
    `recompute`: each stage's activation recomputation (none | selective | full); `zero`: the ZeRO stage the
    evaluation assumed (0: full optimizer state on every replica). `tensor_parallel_reason`: why this t."""

    num_devices: int
    binding: str  # memory | bubble | communication | compute | does-not-fit
    reason: str = ""
    schedule: str | None = None
    pipeline_devices: int | None = None
    data_parallel: int | None = None
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    step_ms: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    bubble_rate: float | None = None
    memory: MemorySplit | None = None
    time: TimeSplit | None = None
    needed_memory_bytes: int | None = None  # lower bound on the memory per device (rows that do not fit)
    needed_devices: int | None = None  # the smallest swept count that fits (rows that do not fit)
    extended: bool = False  # a count added by doubling beyond the listed ones
    tensor_parallel: int | None = None
    context_parallel: int | None = None
    expert_parallel: int | None = None
    recompute: tuple[str, ...] | None = None  # per stage of the chosen plan
    zero: int | None = None
    tensor_parallel_reason: str = ""
    # the busiest pipeline device's compute per step by part (capacity.rows.device_breakdown); None: no plan
    compute_breakdown: dict[str, float] | None = None

    @property
    def recompute_label(self) -> str:
        """`none`, `full`, or per-mode stage counts when stages differ, e.g. `full:6 none:2`."""
        modes = self.recompute or ()
        counts = {mode: modes.count(mode) for mode in dict.fromkeys(modes)}
        if len(counts) <= 1:
            return next(iter(counts), "")
        return " ".join(f"{mode}:{n}" for mode, n in sorted(counts.items(), key=lambda kv: -kv[1]))

    @property
    def fits(self) -> bool:
        return self.schedule is not None

    def to_dict(self) -> dict:
        data = {k: v for k, v in self.__dict__.items() if k not in ("memory", "time")}
        data["fits"] = self.fits
        data["recompute"] = list(self.recompute) if self.recompute is not None else None
        data["memory"] = self.memory.to_dict() if self.memory else None
        data["time"] = dict(self.time.__dict__) if self.time else None
        return data


@dataclass(frozen=True, kw_only=True)
class TargetAnswer:
    """How many devices reach `target_tokens` in `days` (None: no count searched does)."""

    target_tokens: float
    days: float
    tokens_per_s_needed: float
    num_devices: int | None
    tokens_per_s: float | None
    days_needed: float | None
    message: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True, kw_only=True)
class CapacityReport:
    model: str
    hardware: str
    budget: MemoryBudget  # a device's memory: physical, the reserve kept free, the usable rest plans fit in
    global_batch_size: int
    tokens_per_sample: int
    param_count: int
    flops_per_token: float
    active_param_count: int | None = None  # mixture-of-experts models: parameters one token uses (None: dense)
    attention: str = ""  # what the profile's attention ran as (flash, memory-efficient, math; provenance.attention)
    rows: tuple[CapacityRow, ...]  # listed counts, then any added by doubling
    per_schedule: dict[str, tuple[CapacityRow, ...]] = field(default_factory=dict)
    per_tensor_parallel: dict[str, tuple[CapacityRow, ...]] = field(default_factory=dict)  # `8`, `8x2` (t x cp)
    answer: TargetAnswer | None = None

    @property
    def memory_per_device(self) -> int:
        return self.budget.physical

    @property
    def memory_reserve_bytes(self) -> int:
        return self.budget.reserve

    @property
    def usable_memory_bytes(self) -> int:
        return self.budget.usable

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "memory_per_device": self.memory_per_device,
            "memory_reserve_bytes": self.memory_reserve_bytes,
            "global_batch_size": self.global_batch_size,
            "tokens_per_sample": self.tokens_per_sample,
            "param_count": self.param_count,
            "flops_per_token": self.flops_per_token,
            "attention": self.attention,
            "rows": [row.to_dict() for row in self.rows],
            "per_schedule": {name: [r.to_dict() for r in rows] for name, rows in self.per_schedule.items()},
            "per_tensor_parallel": {key: [r.to_dict() for r in rows] for key, rows in self.per_tensor_parallel.items()},
            "answer": self.answer.to_dict() if self.answer else None,
        }


def answer_devices(rows: list[CapacityRow] | tuple[CapacityRow, ...], tokens_per_s_needed: float) -> int | None:
    """The smallest device count whose best plan reaches `tokens_per_s_needed` (None: none does)."""
    enough = [r.num_devices for r in rows if r.fits and (r.tokens_per_s or 0.0) >= tokens_per_s_needed]
    return min(enough) if enough else None


def target_answer(
    rows: tuple[CapacityRow, ...], *, target_tokens: float, days: float, tokens_per_s_needed: float
) -> TargetAnswer:
    """How many devices reach `target_tokens` in `days`, as a TargetAnswer with its one-line message."""
    needed, target = tokens_per_s_needed, target_tokens
    n = answer_devices(rows, needed)
    head = f"{target:.3g} tokens in {days:g} days need {needed:,.0f} tokens/s"
    if n is None:
        fastest = max((r for r in rows if r.fits), key=lambda r: r.tokens_per_s or 0.0, default=None)
        best = (
            f"; the fastest, {fastest.num_devices} devices, reaches {fastest.tokens_per_s:,.0f} tokens/s"
            if fastest
            else ""
        )
        message = (
            f"{head}: no device count up to {max(r.num_devices for r in rows)} reaches it{best} "
            "(raise --days or --global-batch-size, or list more --devices)"
        )
        return TargetAnswer(
            target_tokens=target,
            days=days,
            tokens_per_s_needed=needed,
            num_devices=None,
            tokens_per_s=None,
            days_needed=None,
            message=message,
        )
    row = next(r for r in rows if r.num_devices == n)
    assert row.tokens_per_s is not None, "answer_devices picks a fitting row"
    days_needed = target / row.tokens_per_s / SECONDS_PER_DAY
    extended = " (beyond the listed counts)" if row.extended else ""
    message = f"{head}: {n} devices{extended} reach {row.tokens_per_s:,.0f} tokens/s, {days_needed:.1f} days"
    return TargetAnswer(
        target_tokens=target,
        days=days,
        tokens_per_s_needed=needed,
        num_devices=n,
        tokens_per_s=row.tokens_per_s,
        days_needed=days_needed,
        message=message,
    )
