"""The other ops of a layer on a GPU (profiling.stack_traffic): eager (one kernel per op) against Megatron/TE fusion
(one kernel between two matmul or attention kernels), their bytes and kernel launches; and the memory-bound time
retime takes from them: bytes / the memory rate plus one launch per kernel."""

from __future__ import annotations

import pytest

from pipeplan.models import load_model
from pipeplan.profiling.analytic import profile_analytic
from pipeplan.profiling.kernels import KernelRates
from pipeplan.profiling.profile import LayerWork, PassTraffic
from pipeplan.profiling.retime import pass_breakdown, rest_ms
from pipeplan.profiling.stack_traffic import OpTraffic, traffic

MB = 2**20


def _op(reads=(), writes=(), kernel=False):
    return OpTraffic(kernel=kernel, reads=tuple(reads), writes=tuple(writes))


def test_a_fused_region_reads_what_enters_and_writes_what_leaves_once():
    """A norm-like chain between two matmuls: x (1) -> t (2) -> y (3), y read by the next matmul. Eager: 3 kernels,
    every read and write; fused: 1 kernel reading x and writing y — the temporary t stays on chip."""
    calls = [
        _op(reads=[(0, MB)], writes=[(1, MB)], kernel=True),  # matmul writes x
        _op(reads=[(1, MB)], writes=[(2, 4 * MB)]),  # fp32 temporary
        _op(reads=[(2, 4 * MB)], writes=[(3, MB)]),
        _op(reads=[(3, MB)], writes=[(4, MB)], kernel=True),  # the next matmul reads y
    ]
    eager, fused = traffic(calls, "eager"), traffic(calls, "megatron")
    assert (eager.bytes, eager.kernels) == (10 * MB, 2)
    assert (fused.bytes, fused.kernels) == (2 * MB, 1)


def test_what_backward_needs_or_the_pass_produces_is_written_and_a_dead_temporary_is_not():
    """A dropout-like op makes a mask the forward saves (kept) and an output; a recomputed intermediate nobody reads
    (silu(gate) before the fused SwiGLU replaces it) costs nothing fused."""
    calls = [
        _op(reads=[(1, MB)], writes=[(2, MB), (3, MB // 2)]),  # out 2, mask 3
        _op(reads=[(1, MB)], writes=[(9, MB)]),  # read by nobody, not kept: not made
    ]
    fused = traffic(calls, "megatron", keep={2, 3})
    assert fused.bytes == MB + MB + MB // 2  # x in, out and mask written
    assert traffic(calls, "eager").bytes == 4.5 * MB


def test_boundaries_split_regions_and_an_in_place_write_goes_back_to_hbm():
    calls = [
        _op(reads=[(1, MB)], writes=[(2, MB)]),
        _op(reads=[(2, MB)], writes=[(3, MB)], kernel=True),
        _op(reads=[(3, MB), (1, MB)], writes=[(1, MB)]),  # residual added in place into x (1)
    ]
    fused = traffic(calls, "megatron", keep={1})
    assert fused.kernels == 2
    assert fused.bytes == (MB + MB) + (2 * MB + MB)  # region 1: x in, t out; region 2: both in, x written back


def test_memory_bound_time_is_bytes_over_the_rate_plus_a_launch_per_kernel():
    rates = KernelRates(
        gemm_flops_per_s=1e15, attention_flops_per_s=1e15, bytes_per_s=2e12, sm_count=132, launch_s=1e-6
    )
    work = LayerWork(
        kernels=(),
        rest_forward_ms=99.0,  # the roofline ms a CPU profile would use: not used on a GPU
        rest_input_grad_ms=0.0,
        rest_weight_grad_ms=0.0,
        rest_backward_ms=0.0,
        forward_traffic=PassTraffic(bytes=4e9, kernels=7, compute_ms=0.25),
    )
    assert rest_ms(work, rates, "forward") == pytest.approx(4e9 / 2e12 * 1e3 + 7 * 1e-3 + 0.25)
    parts = pass_breakdown(work, rates, "forward")
    assert (parts.memory, parts.launch, parts.other) == pytest.approx((2.0, 0.007, 0.25))
    cpu = KernelRates(gemm_flops_per_s=1e12, attention_flops_per_s=1e12, bytes_per_s=1e11)
    assert rest_ms(work, cpu, "forward") == 99.0  # no SMs: each op's roofline, as profiled
    assert rest_ms(work.reshaped(t=4, batch_scale=2.0), rates, "forward") == pytest.approx(
        2e9 / 2e12 * 1e3 + 7e-3 + 0.125
    )  # bytes and FLOPs follow the rank's share, the launches do not


def test_megatron_precisions_fuse_and_autocast_does_not():
    """The same llama block: Megatron's precision (bf16-main) moves fewer bytes in fewer kernels than the autocast
    one pipeplan's runtime executes (bf16-mixed), and both are timed from their traffic on a GPU preset."""
    spec = load_model("llama", dict(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, seq=128, vocab=512))
    works = {}
    for precision in ("bf16-main", "bf16-mixed"):
        profile = profile_analytic(spec, batch_size=2, hardware="h100", precision=precision)
        works[precision] = profile.layers[1].work
        assert works[precision].forward_traffic is not None
    fused, eager = works["bf16-main"], works["bf16-mixed"]
    for name in ("forward", "backward"):
        assert fused.traffic(name).kernels < eager.traffic(name).kernels / 2
        assert fused.traffic(name).bytes < eager.traffic(name).bytes


def test_an_op_reads_a_broadcast_operand_once_and_not_the_slice_it_overwrites():
    """What `op_call` records for stack_traffic: an index expanded over the hidden size (Megatron-Core's and
    torchtitan's scatter_add combine) is read once per distinct element, as `op_cost` counts it; `copy_` into a
    slice of a new tensor (a key built by slice assignment, transformers' MLA) writes the slice and does not read
    its old values — as a concatenation of the parts moves the same bytes."""
    import torch

    from pipeplan.profiling.opcount import op_call

    aten = torch.ops.aten
    tokens, hidden = 8, 16
    out, src = torch.zeros(tokens, hidden), torch.ones(2 * tokens, hidden)
    index = torch.arange(2 * tokens).remainder(tokens).unsqueeze(-1).expand(-1, hidden)
    result = aten.scatter_add.default(out, 0, index, src)
    call = op_call(aten.scatter_add.default, (out, 0, index, src), {}, result)
    expected = (tokens * hidden * 4, 2 * tokens * 8, 2 * tokens * hidden * 4)  # out, the index once, src
    assert sorted(size for _, size in call.reads) == sorted(expected)
    key = torch.empty(tokens, 6)
    part = key[:, :4]
    nope = torch.ones(tokens, 4)  # (every tensor held: a freed storage's key could be taken again)
    call = op_call(aten.copy_.default, (part, nope), {}, aten.copy_.default(part, nope))
    assert [size for _, size in call.reads] == [tokens * 4 * 4]  # the source only
    assert [size for _, size in call.writes] == [tokens * 4 * 4]
    rest, rope = key[:, 4:], torch.ones(tokens, 1).expand(-1, 2)  # the rotary part, one column for all
    second = op_call(aten.copy_.default, (rest, rope), {}, aten.copy_.default(rest, rope))
    up = torch.ones(6, 3)
    matmul = op_call(aten.mm.default, (key, up), {}, product := key @ up)
    assert product.shape == (tokens, 3)
    fused = traffic([call, second, matmul], "megatron")
    assert fused.bytes == tokens * 4 * 4 + tokens * 4 + tokens * 6 * 4  # both parts read, the whole key written
