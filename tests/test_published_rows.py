"""benchmarks/bench_published.py's row set, without running it (each row is a `pipeplan capacity` subprocess of
about two minutes): Korthikanti et al.'s Table 5 (8 rows) and the DGX Cloud NeMo H100 rows (11), each a command a
user types whose layout parses and spans the run's own GPU count; each with the attention its run used."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeplan.search.flags import parse_precision
from pipeplan.search.pinned import parse_layout

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import bench_published as bench  # noqa: E402

GPUS = {"22B": 8, "175B": 64, "530B": 280, "1T": 512, "8B@8": 8, "70B@64": 64, "405B@576": 576}
GPUS |= {"175B@128": 128, "175B@2048": 2048, "15B@16": 16, "340B@128": 128}


def test_the_row_set_is_the_issues():
    rows = bench.korthikanti_rows() + bench.nemo_rows()
    assert [r.source for r in rows].count("korthikanti") == 8 and [r.source for r in rows].count("nemo") == 11
    assert len({r.name for r in rows}) == 19


@pytest.mark.parametrize("row", bench.korthikanti_rows() + bench.nemo_rows(), ids=lambda r: r.name)
def test_each_row_is_a_capacity_command_on_its_runs_gpus(row):
    args = bench.command(row)
    assert args[1:3] == ["capacity", row.model] and args[-1] == "--json"
    assert args[args.index("--layout") + 1] == row.layout
    mode, optimizer = parse_precision(args[args.index("--precision") + 1])
    assert (mode, optimizer) == (row.precision, row.optimizer)
    size = next(gpus for key, gpus in GPUS.items() if row.name.split(" ")[0].endswith(key) or row.name.startswith(key))
    assert parse_layout(row.layout).devices == size


def test_each_row_asks_for_the_attention_its_run_used():
    """Korthikanti: Megatron's math attention (2022); NeMo's GPT-3 recipe: FlashAttention-2 (its launch script turns
    cuDNN attention off, NVTE_FUSED_ATTN=0); the Llama and Nemotron recipes: auto (cuDNN's, FlashAttention-3 level)."""
    for row in bench.korthikanti_rows() + bench.nemo_rows():
        args = bench.command(row)
        if row.source == "korthikanti":
            assert args[args.index("--attention") + 1] == "math"
        elif row.name.startswith("GPT3"):
            assert args[args.index("--attention") + 1] == "flash2"
        else:
            assert "--attention" not in args


def test_only_the_recipe_that_states_it_keeps_bf16_optimizer_state():
    """nemotron/nemotron4-340b-synth.yaml sets optim.dtype bf16 (distributed_fused_adam); the others keep fp32."""
    stated = {r.name for r in bench.nemo_rows() + bench.korthikanti_rows() if r.optimizer != "adamw"}
    assert stated == {"Nemotron4-340B@128 bf16"}
