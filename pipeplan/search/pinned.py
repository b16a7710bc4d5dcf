"""A pinned layout: `--layout "tp=8,cp=2,pp=9,vp=7,dp=4,mbs=1,recompute=none"` predicted exactly as given — the
step, each stage's memory, what binds — beside the planner's own choice.

Keys (`parse_layout`): tp, cp, pp, vp (chunks per pipeline device: vp > 1 runs the interleaved schedule, 1 runs
1f1b unless `schedule=` names another), dp, mbs (microbatch size), recompute (none | selective | full, or one mode
per stage joined by `/`), zero (0, or 1: the distributed optimizer), schedule, split (even: Megatron's equal runs
of blocks, the embedding with the first stage and the head with the last; balanced: pipeplan's partitioner on the
same costs), ep (expert parallelism of a mixture-of-experts model: its routed experts split over ep of the dp x cp
ranks; ep must divide dp x cp and the experts), blocks (transformer blocks per stage in model order, pp x vp counts
joined by `/`, as Megatron's `--pipeline-model-parallel-layout` gives uneven stages: e.g. `blocks=3/4/4/3`; 0 in the
first or last count leaves that stage the embedding or the head alone). tp x cp x pp x dp must be the device count;
the global batch must be mbs x microbatches x dp. Tensor parallelism may span nodes here (when tp is larger than a
node): its collectives then run on the inter-node link.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeplan.cluster import Cluster
from pipeplan.costs import LayerArrays
from pipeplan.errors import ConfigError, InfeasibleError, ScheduleError
from pipeplan.graph.recompute_modes import RECOMPUTE_MODES
from pipeplan.partition.baselines import even_blocks_partition
from pipeplan.profiling.profile import Profile
from pipeplan.schedules.placement import V_SHAPED
from pipeplan.schedules.registry import schedule_info
from pipeplan.search.candidate import Evaluation, Layout, Rejection, partition_config, partition_layout
from pipeplan.search.config import SearchConfig
from pipeplan.search.evaluate import evaluate_partition
from pipeplan.search.recompute_choice import with_modes
from pipeplan.search.scaling import scale_profile
from pipeplan.search.sharding import split_inputs
from pipeplan.search.stack import expert_parallel_problem

KEYS = ("tp", "cp", "ep", "pp", "vp", "dp", "mbs", "recompute", "zero", "schedule", "split", "blocks")
SPLITS = ("even", "balanced")


@dataclass(frozen=True, kw_only=True)
class PinnedLayout:
    tp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism (mixture-of-experts models): ranks of dp x cp the routed experts split over
    pp: int = 1
    vp: int = 1
    dp: int = 1
    mbs: int = 1
    recompute: tuple[str, ...] = ("none",)  # one mode for every stage, or one per stage
    zero: int = 0
    schedule: str | None = None
    split: str = "even"
    blocks: tuple[int, ...] | None = None  # blocks per stage in model order (pp x vp), or None: Megatron's even runs

    @property
    def schedule_name(self) -> str:
        return self.schedule or ("interleaved" if self.vp > 1 else "1f1b")

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def label(self) -> str:
        modes = "/".join(self.recompute)
        return (
            f"tp={self.tp},cp={self.cp},pp={self.pp},vp={self.vp},dp={self.dp},mbs={self.mbs},recompute={modes},"
            f"zero={self.zero}"
            + (f",ep={self.ep}" if self.ep > 1 else "")
            + (f",blocks={'/'.join(map(str, self.blocks))}" if self.blocks else "")
        )


def parse_layout(text: str) -> PinnedLayout:
    """`key=value` pairs joined by commas (module docstring); one ConfigError line naming the bad part."""
    counts: dict[str, int] = {}
    texts: dict[str, str] = {}
    recompute: tuple[str, ...] | None = None
    blocks: tuple[int, ...] | None = None
    seen: set[str] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or key not in KEYS:
            raise ConfigError(f"--layout part {part!r} must be key=value with key one of {', '.join(KEYS)}")
        if key in seen:  # the last would win silently
            raise ConfigError(f"--layout gives {key} twice ({part!r}); give each key once")
        seen.add(key)
        if key == "recompute":
            recompute = _recompute_modes(value)
        elif key in ("schedule", "split"):
            texts[key] = value
        elif key == "blocks":
            blocks = _block_counts(value)
        else:
            counts[key] = _count(key, value)
    default = PinnedLayout()
    layout = PinnedLayout(
        **{key: counts.get(key, getattr(default, key)) for key in ("tp", "cp", "ep", "pp", "vp", "dp", "mbs", "zero")},
        recompute=recompute or default.recompute,
        schedule=texts.get("schedule"),
        split=texts.get("split", default.split),
        blocks=blocks,
    )
    _check(layout)
    return layout


def _recompute_modes(value: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in value.split("/"))
    bad = [m for m in modes if m not in RECOMPUTE_MODES]
    if bad:
        raise ConfigError(f"--layout recompute={bad[0]!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    return modes


def _count(key: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"--layout {key}={value!r} must be a whole number") from None
    if number < (0 if key == "zero" else 1):
        raise ConfigError(f"--layout {key} must be >= {0 if key == 'zero' else 1}, got {value}")
    return number


def _block_counts(value: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in value.split("/"))
    except ValueError:
        raise ConfigError(f"--layout blocks={value!r} must be whole numbers joined by '/', one per stage") from None
    if any(c < 0 for c in counts):
        raise ConfigError(f"--layout blocks={value!r} must not be negative")
    return counts


def _check(layout: PinnedLayout) -> None:
    if layout.split not in SPLITS:
        raise ConfigError(f"--layout split={layout.split!r} is not one of {', '.join(SPLITS)}")
    if layout.zero not in (0, 1):
        raise ConfigError(f"--layout zero={layout.zero} is not supported: 0, or 1 (the distributed optimizer)")
    info = schedule_info(layout.schedule_name)
    if info.placement == V_SHAPED and layout.vp != 2:  # dualpipev, zbv: two chunks per device, in a V
        raise ConfigError(f"--layout schedule={info.name} holds 2 chunks per device in a V: give vp=2")
    if layout.vp > 1 and info.placement not in ("looped", V_SHAPED):
        raise ConfigError(f"--layout vp={layout.vp} needs a looped schedule (interleaved), not {info.name}")
    if info.placement == "looped" and layout.vp < 2:  # else the partition leaves devices empty
        raise ConfigError(f"--layout schedule={info.name} loops 2 or more chunks over each device: give vp=2 or more")
    if info.asynchronous and layout.zero:  # the plan file refuses it: ZeRO-1 cannot keep stashed weight versions
        raise ConfigError(f"--layout schedule={info.name} is asynchronous and runs without ZeRO-1: give zero=0")
    if info.asynchronous and set(layout.recompute) != {"none"}:  # a stream keeps every activation (plan file)
        raise ConfigError(
            f"--layout schedule={info.name} is asynchronous and runs without recomputation: give recompute=none"
        )
    if (layout.dp * layout.cp) % layout.ep:
        raise ConfigError(
            f"--layout ep={layout.ep} must divide dp x cp = {layout.dp * layout.cp} (its ranks come from them)"
        )
    stages = layout.pp * layout.vp
    if len(layout.recompute) not in (1, stages):
        raise ConfigError(f"--layout recompute names {len(layout.recompute)} stages; give one mode or {stages}")
    if layout.blocks is not None:
        _check_blocks(layout.blocks, stages, layout.split)


def _check_blocks(blocks: tuple[int, ...], stages: int, split: str) -> None:
    """Blocks per stage: one count per stage; only the first (embedding alone) and last (head alone) may be 0."""
    if split != "even":
        raise ConfigError("--layout blocks= sets the cuts itself: leave out split=balanced")
    if len(blocks) != stages:
        raise ConfigError(f"--layout blocks names {len(blocks)} stages; pp x vp = {stages}")
    if 0 in blocks[1:-1]:
        raise ConfigError(
            "--layout blocks: only the first stage (the embedding alone) or the last (the head alone) may hold 0 blocks"
        )


def _check_block_total(pinned: PinnedLayout, stages: int, blocks: int) -> None:
    if pinned.blocks is not None and sum(pinned.blocks) != blocks:
        raise ConfigError(f"--layout blocks adds up to {sum(pinned.blocks)} blocks, but the model has {blocks}")
    if pinned.blocks is None and stages > blocks:
        raise ConfigError(f"--layout pp x vp = {stages} stages, but the model has {blocks} blocks")


def pinned_layout(layout: PinnedLayout, config: SearchConfig, cluster: Cluster) -> Layout:
    """The search's Layout for `layout` on `cluster` (the devices, before grouping), checked against the batch."""
    if layout.devices != cluster.num_devices:
        raise ConfigError(
            f"--layout tp x cp x pp x dp = {layout.devices} devices, but --devices is {cluster.num_devices}"
        )
    per_step = layout.mbs * layout.dp
    if config.global_batch_size % per_step:
        raise ConfigError(
            f"--global-batch-size {config.global_batch_size} is not a multiple of mbs x dp = {per_step} (--layout)"
        )
    return Layout(
        schedule=layout.schedule_name,
        microbatch_size=layout.mbs,
        data_parallel=layout.dp,
        pipeline_devices=layout.pp,
        num_microbatches=config.global_batch_size // per_step,
        tensor_parallel=layout.tp,
        context_parallel=layout.cp,
        expert_parallel=layout.ep,
        chunks=layout.vp if layout.vp > 1 else None,
    )


def check_pinned_experts(pinned: PinnedLayout, profile: Profile, cluster: Cluster) -> None:
    """One ConfigError line naming `--layout ep=` when ep cannot split this model's experts (a dense model, ep not
    dividing the experts; `search.stack.expert_parallel_problem`)."""
    problem = expert_parallel_problem(profile, pinned.tp, pinned.cp, pinned.ep, num_devices=cluster.num_devices)
    if problem is not None:
        raise ConfigError(f"--layout ep={pinned.ep}: {problem}")


@dataclass(frozen=True, kw_only=True)
class PinnedResult:
    """A pinned layout evaluated: `evaluation` (None when it does not run or fit: `rejection` says why), the profile
    of one rank it ran on and the cluster (its devices; the layout's t x cp groups are the search's)."""

    layout: Layout
    evaluation: Evaluation | None
    rejection: Rejection | None
    profile: Profile
    cluster: Cluster

    def as_search_result(self, config: SearchConfig):
        """The evaluation as a one-candidate SearchResult (what capacity rows and plans are built from)."""
        from pipeplan.search.search import SearchResult

        assert self.evaluation is not None
        split = replace(
            config,
            tensor_parallel=self.layout.tensor_parallel,
            context_parallel=self.layout.context_parallel,
            expert_parallel=self.layout.expert_parallel,
            zero=self.evaluation.zero,  # pinned: the plan's memory lines say so, not "no plan without it fits"
        )
        rejected = () if self.rejection is None else (self.rejection,)
        profiles = {self.layout.microbatch_size: self.profile}
        return SearchResult(
            ranked=(self.evaluation,), rejected=rejected, profiles=profiles, cluster=self.cluster, config=split
        )


def evaluate_pinned(profile: Profile, cluster: Cluster, config: SearchConfig, pinned: PinnedLayout) -> PinnedResult:
    """`pinned` on `cluster` (its devices) under `config` (batch, precision, optimizer, reserve, overlap)."""
    layout, sharded, found = _evaluate(profile, cluster, config, pinned)
    fits = isinstance(found, Evaluation)
    return PinnedResult(
        layout=layout,
        evaluation=found if fits else None,
        rejection=None if fits else found,
        profile=sharded,
        cluster=cluster,
    )


def _evaluate(profile: Profile, cluster: Cluster, config: SearchConfig, pinned: PinnedLayout):
    layout = pinned_layout(pinned, config, cluster)
    check_pinned_experts(pinned, profile, cluster)
    scaled = scale_profile(profile, pinned.mbs)
    sharded, groups = split_inputs(scaled, cluster, pinned.tp, pinned.cp, overlap=config.overlap, ep=pinned.ep)
    usable = config.budget(cluster.memory_bytes).usable
    stages = pinned.pp * pinned.vp
    try:
        if pinned.split == "balanced":  # pipeplan's partitioner picks the cuts (costed with recomputation allowed)
            recompute = "auto" if pinned.recompute != ("none",) else "none"
            part = partition_layout(
                layout,
                sharded,
                groups,
                config,
                memory_limit=usable,
                zero=pinned.zero,
                recompute=recompute,
                explain=False,
            )
            if isinstance(part, Rejection):
                return layout, sharded, part
        else:
            _check_block_total(pinned, stages, sharded.num_layers - 2)
            part_config = partition_config(layout, config, zero=pinned.zero, memory_limit=usable)
            part = even_blocks_partition(sharded, groups, part_config, stages, pinned.blocks)
        modes = pinned.recompute * stages if len(pinned.recompute) == 1 else pinned.recompute  # exactly as pinned
        part_config = replace(partition_config(layout, config, zero=pinned.zero, memory_limit=usable), recompute="auto")
        part = with_modes(part, LayerArrays.from_profile(sharded), modes, part_config)
        result = evaluate_partition(layout, part, sharded, groups, config, memory_limit=usable, zero=pinned.zero)
    except (InfeasibleError, ScheduleError) as exc:
        return layout, sharded, Rejection(layout=layout, kind="schedule", reason=str(exc))
    return layout, sharded, result
