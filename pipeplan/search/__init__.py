"""The search over layouts (tensor parallel size x pipeline depth x data-parallel pipelines x microbatches x schedule,
recomputation, ZeRO): candidates evaluated through `predict`, the choice and its rationale, the library call
`search.plan(profile, cluster, PlanConfig) -> Plan` (`planner.py`), and the `plan` command that resolves its options
into those objects and writes the winner's plan directory. `plan` loads on first use: `--help` imports no numpy."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "plan":
        from pipeplan.search.planner import plan

        return plan
    raise AttributeError(f"module 'pipeplan.search' has no attribute {name!r}")
