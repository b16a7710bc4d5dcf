"""Every closed form of the test oracle (helpers/transformer_reference.py) and the tensor-parallel collectives
(costs/tensor_parallel.py) against values computed by hand from its source: Korthikanti et al. 2022
Table 2 for GPT-3 175B (their Table 3: a = 96, h = 12288, s = 2048, t = 8, b = 1) and the tensor-parallel
collectives of §4.2.2 (Megatron-LM's distributed-optimizer table is tested with the cost model, test_zero_costs)."""

from __future__ import annotations

import pytest
from helpers.transformer_reference import (
    activation_bytes_per_layer,
    attention_core_flops,
    forward_flops_per_layer,
    lm_head_flops,
)

from pipeplan.costs.tensor_parallel import Collective, tensor_parallel_comm_per_layer
from pipeplan.errors import ConfigError

GPT3 = dict(seq=2048, batch=1, hidden=12288, heads=96)
SBH = 2048 * 12288  # 25,165,824; 5·a·s/h = 5·96·2048/12288 = 80


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, 2_868_903_936),  # sbh·(34 + 80) = 114·sbh
        ({"flash_attention": True}, 855_638_016),  # 34·sbh
        ({"tensor_parallel": 8}, 578_813_952),  # sbh·(10 + 24/8 + 80/8) = 23·sbh
        ({"tensor_parallel": 8, "sequence_parallel": True}, 358_612_992),  # sbh·(34/8 + 80/8) = 14.25·sbh
        ({"tensor_parallel": 8, "recompute": "selective"}, 327_155_712),  # sbh·(10 + 24/8) = 13·sbh
        ({"tensor_parallel": 8, "sequence_parallel": True, "recompute": "selective"}, 106_954_752),  # 4.25·sbh
        ({"recompute": "full"}, 50_331_648),  # 2·sbh
        ({"tensor_parallel": 8, "recompute": "full"}, 50_331_648),  # every rank holds the whole input
        ({"tensor_parallel": 8, "sequence_parallel": True, "recompute": "full"}, 6_291_456),  # 2·sbh/8
        ({"recompute": "selective"}, 855_638_016),  # 34·sbh
    ],
)
def test_activation_bytes_match_korthikanti_table_2(options, expected):
    flash = options.pop("flash_attention", False)
    assert activation_bytes_per_layer(**GPT3, flash_attention=flash, **options) == expected


def test_sequence_parallel_and_selective_cut_the_baseline_by_5x():
    """The paper's headline: tensor parallel baseline (eq. 2) over TP + SP + selective (34·sbh/t), here 23/4.25."""
    baseline = activation_bytes_per_layer(**GPT3, flash_attention=False, tensor_parallel=8)
    both = activation_bytes_per_layer(
        **GPT3, flash_attention=False, tensor_parallel=8, sequence_parallel=True, recompute="selective"
    )
    assert baseline / both == pytest.approx(23 / 4.25) and baseline / both > 5


def test_activation_formula_refuses_splits_megatron_cannot_make():
    with pytest.raises(ConfigError, match="must divide hidden"):
        activation_bytes_per_layer(**GPT3, flash_attention=False, tensor_parallel=7)
    with pytest.raises(ConfigError, match="recompute must be one of"):
        activation_bytes_per_layer(**GPT3, flash_attention=False, recompute="partial")
    with pytest.raises(ConfigError, match="seq must be >= 1"):
        activation_bytes_per_layer(seq=0, batch=1, hidden=8, heads=2, flash_attention=True)


def test_flops_match_narayanan():
    # 24·b·s·h² + 4·b·s²·h for b = 1, s = 2048, h = 12288
    assert forward_flops_per_layer(seq=2048, batch=1, hidden=12288) == 7_421_703_487_488 + 206_158_430_208
    assert attention_core_flops(seq=2048, batch=1, hidden=12288) == 206_158_430_208
    assert lm_head_flops(seq=2048, batch=1, hidden=12288, vocab=51200) == 2_576_980_377_600  # 2·b·s·h·V


def test_tensor_parallel_collectives_per_layer():
    message = 2048 * 1 * 12288 * 2  # one bf16 s·b·h activation: 50,331,648 bytes
    plain = tensor_parallel_comm_per_layer(seq=2048, batch=1, hidden=12288, tensor_parallel=8, sequence_parallel=False)
    assert plain.forward == plain.backward == (Collective("all-reduce", 2, 50_331_648),)
    sp = tensor_parallel_comm_per_layer(seq=2048, batch=1, hidden=12288, tensor_parallel=8, sequence_parallel=True)
    assert sp.forward == sp.backward == (Collective("all-gather", 2, message), Collective("reduce-scatter", 2, message))
    single = tensor_parallel_comm_per_layer(seq=2048, batch=1, hidden=12288, tensor_parallel=1, sequence_parallel=True)
    assert single.forward == single.backward == ()


def test_sequence_parallel_moves_as_many_bytes_as_all_reduces():
    """Ring collectives over t ranks: all-reduce 2(t-1)/t·M per rank, all-gather and reduce-scatter (t-1)/t·M each
    (a ring all-reduce is a reduce-scatter then an all-gather), so SP's 2 + 2 equal the 2 all-reduces."""
    t = 8
    per_rank = {"all-reduce": 2 * (t - 1) / t, "all-gather": (t - 1) / t, "reduce-scatter": (t - 1) / t}

    def volume(comm):
        return sum(c.count * c.message_bytes * per_rank[c.kind] for c in comm.forward + comm.backward)

    shape = dict(seq=2048, batch=1, hidden=12288, tensor_parallel=t)
    with_sp = volume(tensor_parallel_comm_per_layer(**shape, sequence_parallel=True))
    assert with_sp == volume(tensor_parallel_comm_per_layer(**shape, sequence_parallel=False))
    assert with_sp == 4 * 2 * (t - 1) / t * 50_331_648  # 4 all-reduces' worth per layer


def test_fp8_recipes_gather_fp8_inputs():
    """Transformer Engine casts a column-parallel linear's sequence-parallel input to FP8 before its all-gather and
    gathers that saved FP8 copy again for the weight gradient, and casts a row-parallel linear's output gradient to
    FP8 before the backward gathers it (1 byte per element); the reduce-scatters of 16-bit outputs keep their
    bytes."""
    message = 2048 * 1 * 12288 * 2
    shape = dict(seq=2048, batch=1, hidden=12288, tensor_parallel=8, sequence_parallel=True)
    bf16 = tensor_parallel_comm_per_layer(**shape)
    fp8 = tensor_parallel_comm_per_layer(**shape, fp8_gathers=True)
    assert fp8.forward == (Collective("all-gather", 2, message // 2), Collective("reduce-scatter", 2, message))
    assert fp8.regather == (Collective("all-gather", 2, message // 2),) and bf16.regather[0].message_bytes == message
    assert fp8.backward == fp8.forward and bf16.backward == bf16.forward


def test_fp8_profiles_split_with_fp8_gathers():
    """Through the tensor-parallel split: an fp8 profile's block moves fewer collective bytes than the bf16-main
    profile of the same model (its forward all-gathers at half), the reduce-scatter side unchanged."""
    from pipeplan.costs.overlap import Overlap
    from pipeplan.hardware import cluster_for
    from pipeplan.models import load_model
    from pipeplan.profiling.analytic import profile_analytic
    from pipeplan.search import sharding

    options = dict(layers=1, hidden=1024, heads=8, kv_heads=8, intermediate=4096, seq=1024, vocab=512)
    spec = load_model("llama", {k: str(v) for k, v in options.items()})
    comms = {}
    for precision in ("bf16-main", "fp8"):
        profile = profile_analytic(spec, batch_size=1, hardware="h100", precision=precision)
        links = sharding.group_links(cluster_for("h100", 8), 8, 1)
        block = next(i for i, layer in enumerate(profile.layers) if layer.name.startswith("blocks."))
        comms[precision] = sharding.layer_comms(profile, 8, 1, links, Overlap())[block]
    assert comms["fp8"].forward_ms < comms["bf16-main"].forward_ms
    assert comms["fp8"].backward_ms < comms["bf16-main"].backward_ms  # the re-gathers beyond the matmuls
