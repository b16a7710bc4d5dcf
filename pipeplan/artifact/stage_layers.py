"""A plan's stages as the training engines see them (Megatron-Core, torchtitan): which layers are the model's
repeated blocks (decoder layers), which come before them (embedding) and after them (final norm, head, loss),
and each stage's module FQNs.

A layer name is a module path (`embed`, `blocks.3`, `model.layers.0`, or `blocks.3.attn` under --granularity).
The block container is the path prefix most layer names share before a numeric component (`blocks`,
`model.layers`); a layer under it is (part of) block N. A stage whose last layer is part of a block the next stage
continues cuts inside that block, which neither engine can express (`split_blocks`).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from pipeplan.artifact.plan import Plan
from pipeplan.errors import ConfigError

_BLOCK = re.compile(r"^(?P<container>.+?)\.(?P<index>\d+)(?:\..+)?$")


@dataclass(frozen=True, kw_only=True)
class StageMembers:
    index: int
    layers: tuple[str, ...]  # module FQNs, in order
    blocks: tuple[int, ...]  # blocks this stage starts (their first layer is here)
    before: tuple[str, ...]  # layers before the first block (embedding)
    after: tuple[str, ...]  # layers after the last block (final norm, head)
    between: tuple[str, ...]  # layers between blocks that are not blocks themselves
    split_blocks: tuple[int, ...]  # blocks that start here and continue in the next stage


@dataclass(frozen=True, kw_only=True)
class BlockLayout:
    container: str  # the repeated-block container's path, e.g. "blocks" or "model.layers"
    num_blocks: int
    stages: tuple[StageMembers, ...]

    @property
    def first_block_stage(self) -> int:
        return next(s.index for s in self.stages if s.blocks)


def block_of(name: str, container: str) -> int | None:
    """The block number `name` belongs to under `container`, or None."""
    match = _BLOCK.match(name)
    if match and match["container"] == container:
        return int(match["index"])
    return None


def block_layout(plan: Plan, engine: str) -> BlockLayout:
    """The plan's stages split into embedding / blocks / head; ConfigError when its layers name no repeated blocks."""
    names = [name for stage in plan.stages for name in stage.layer_names]
    containers = Counter(m["container"] for name in names if (m := _BLOCK.match(name)))
    if not containers:
        raise ConfigError(
            f"{engine} counts a model's repeated blocks, but this plan's layers ({', '.join(names[:4])}, ...) name "
            "none (like blocks.0 or model.layers.0); re-plan without --granularity"
        )
    container = containers.most_common(1)[0][0]
    positions = [i for i, name in enumerate(names) if block_of(name, container) is not None]
    first, last = positions[0], positions[-1]
    blocks = sorted({b for i in positions if (b := block_of(names[i], container)) is not None})
    stages: list[StageMembers] = []
    seen: set[int] = set()
    offset = 0
    for stage in plan.stages:
        layers = stage.layer_names
        where = range(offset, offset + len(layers))
        own = [block_of(n, container) for n in layers]
        starts = tuple(b for b in dict.fromkeys(own) if b is not None and b not in seen)
        seen.update(b for b in own if b is not None)
        following = names[offset + len(layers)] if offset + len(layers) < len(names) else ""
        last_block = own[-1]
        split = last_block is not None and block_of(following, container) == last_block
        stages.append(
            StageMembers(
                index=stage.index,
                layers=tuple(layers),
                blocks=starts,
                before=tuple(n for i, n in zip(where, layers) if i < first),
                after=tuple(n for i, n in zip(where, layers) if i > last),
                between=tuple(n for i, n, b in zip(where, layers, own) if first < i < last and b is None),
                split_blocks=(last_block,) if split and last_block is not None else (),
            )
        )
        offset += len(layers)
    return BlockLayout(container=container, num_blocks=len(blocks), stages=tuple(stages))


def describe_members(stage: StageMembers, container: str) -> str:
    """`embed, blocks.0-3, head`: a stage's layers with runs of whole blocks abbreviated."""
    parts: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            parts.append(f"{container}.{run[0]}" if len(run) == 1 else f"{container}.{run[0]}-{run[-1]}")
            run.clear()

    for name in stage.layers:
        block = block_of(name, container)
        if block is not None and name == f"{container}.{block}" and (not run or run[-1] + 1 == block):
            run.append(block)
            continue
        flush()
        if block is not None and name == f"{container}.{block}":
            run.append(block)
        else:
            parts.append(name)
    flush()
    return ", ".join(parts)


def cannot_express(layout: BlockLayout, engine: str) -> list[str]:
    """One line per stage boundary `engine` cannot place where the plan does."""
    lines = []
    for stage in layout.stages:
        for block in stage.split_blocks:
            lines.append(
                f"stage {stage.index} ends inside {layout.container}.{block} (the plan cuts a block); {engine} "
                "places whole blocks: the block is counted in the stage it starts in"
            )
        if stage.between:
            lines.append(
                f"stage {stage.index} holds {', '.join(stage.between)} between blocks, which {engine} has no slot for"
            )
    return lines
