"""Communication overlap options, blocking pipeline transfers, the per-device end of a step, the optimizer update,
and Megatron's mixed precision bytes."""

from __future__ import annotations

import pytest
from helpers.megatron_bytes import MEGATRON_SPLITS, MEGATRON_TABLE

from pipeplan.costs import numerics, static_split
from pipeplan.costs.optimizer import undo_copy_bytes
from pipeplan.costs.overlap import (
    COMM_SMS,
    DeviceStep,
    Overlap,
    blocking_transfers,
    eager_update_ms,
    optimizer_bytes_per_param,
    optimizer_step_ms,
    overlapped_ms,
    step_end_ms,
)
from pipeplan.errors import ConfigError
from pipeplan.schedules.simulate import StageCosts


def test_overlap_options_parse_and_default_to_megatron_core_s_none():
    assert Overlap() == Overlap.parse("none") and Overlap().label == "none"
    assert Overlap.parse("all") == Overlap(tensor=True, p2p=True, grad_reduce=True, param_gather=True)
    assert Overlap.parse("grad-reduce,p2p") == Overlap(grad_reduce=True, p2p=True)
    assert Overlap.parse(Overlap(tensor=True, p2p=True).label) == Overlap(tensor=True, p2p=True)
    with pytest.raises(ConfigError, match="--overlap 'nccl'"):
        Overlap.parse("nccl")
    assert Overlap.parse("all").comm_sms == COMM_SMS == 8  # NeMo's H100 userbuffers setting (its source: the module)
    assert Overlap.parse("tensor,sms=24") == Overlap(tensor=True, comm_sms=24)
    assert Overlap.parse(Overlap.parse("all,sms=2").label) == Overlap.parse("all,sms=2")
    with pytest.raises(ConfigError, match="sms= takes a whole number"):
        Overlap.parse("tensor,sms=many")
    assert Overlap.parse("tensor,sms=0").comm_sms == 0  # a collective on the copy engines takes no SM
    # chunks=N: the matmuls an overlapped linear runs as (default t: Transformer Engine's ring exchange)
    assert Overlap.parse("tensor,chunks=4") == Overlap(tensor=True, chunks=4)
    assert Overlap.parse("all,chunks=4").label == "tensor,p2p,grad-reduce,param-gather,chunks=4"
    assert Overlap.parse(Overlap.parse("all,chunks=4").label) == Overlap.parse("all,chunks=4")
    assert Overlap().tensor_chunks(8) == 8 and Overlap(chunks=4).tensor_chunks(8) == 4
    with pytest.raises(ConfigError, match="chunks= sets how overlapped tensor-parallel collectives run: add tensor"):
        Overlap.parse("grad-reduce,chunks=4")  # would be ignored: refused
    for bad in ("chunks=0", "chunks=two"):
        with pytest.raises(ConfigError, match="chunks= takes a whole number of chunks"):
            Overlap.parse(f"tensor,{bad}")


def test_an_overlapped_collective_hides_but_takes_sms_and_chunks_from_the_matmuls():
    """comm 2 ms beside 8 ms of matmuls in 4 chunks on a GPU whose collective takes 8 of 132 SMs: the first chunk
    (0.5) shows, the matmuls lose 2 ms x 8/132 while both run, and the chunked matmuls' extra time adds."""
    share = 8 / 132
    assert overlapped_ms(2.0, 8.0, chunks=4, sm_share=share) == pytest.approx(0.5 + 2.0 * share)
    assert overlapped_ms(2.0, 8.0, chunks=4, sm_share=share, split_ms=0.3) == pytest.approx(0.8 + 2.0 * share)
    assert overlapped_ms(20.0, 8.0, chunks=4, sm_share=share) == pytest.approx(12.0 + 8.0 * share)  # the excess
    assert overlapped_ms(2.0, 8.0, chunks=4, sm_share=0.0) == 0.5  # free SMs: the earlier model
    assert overlapped_ms(0.0, 8.0, chunks=4, sm_share=share, split_ms=0.3) == 0.0  # nothing to overlap


def test_blocking_transfers_busy_the_sender_where_stages_cross_devices():
    costs = StageCosts(forward_ms=2.0, input_grad_ms=1.0, weight_grad_ms=1.0, comm_ms=(0.5, 0.25))
    blocked = blocking_transfers(costs, [True, False])
    assert blocked.forward_ms == (2.5, 2.0, 2.0)  # stage 0 sends its activations; stage 1's boundary stays on-device
    assert blocked.input_grad_ms == (1.0, 1.5, 1.0) and blocked.backward_ms == (2.0, 2.5, 2.0)
    assert blocked.comm_ms == (0.0, 0.0)


def test_the_step_ends_with_each_device_s_exchange_and_update():
    first = DeviceStep(ops_end_ms=100.0, sync_ms=10.0, overlap_window_ms=6.0, optimizer_ms=2.0)
    devices = [first, DeviceStep(ops_end_ms=95.0, sync_ms=20.0, overlap_window_ms=25.0, optimizer_ms=2.0)]
    assert step_end_ms(devices, Overlap()) == 117.0  # device 1: 95 + 20 + 2
    assert step_end_ms(devices, Overlap(grad_reduce=True)) == 106.0  # device 0: 100 + (10 - 6) + 2; device 1 hides


def test_megatron_mixed_precision_is_megatron_s_table():
    """Megatron Core's distributed-optimizer table (16-bit parameters, fp32 gradients: 18 -> 6 + 12/d)."""
    for precision in ("bf16-main", "fp16-main"):
        split = static_split(numerics("adamw", precision))
        assert split == MEGATRON_SPLITS["float16 param, fp32 grads"]
        assert sum(split) == MEGATRON_TABLE["float16 param, fp32 grads"][0]
    assert static_split(numerics("adamw", "fp8")) == (4.0, 4.0, 12.0)  # + the FP8 weight and its transpose
    assert static_split(numerics("adamw", "bf16-mixed")) == (4.0, 4.0, 8.0)  # autocast: fp32 parameters are the master


def test_optimizer_update_moves_its_state_twice():
    assert optimizer_bytes_per_param((2.0, 4.0, 12.0), weights_are_master=False) == 2 * 12 + 4 + 2
    assert optimizer_bytes_per_param((4.0, 4.0, 8.0), weights_are_master=True) == 2 * 8 + 4 + 2 * 4
    assert optimizer_step_ms(1e9, 30.0, 3e12) == pytest.approx(10.0)
    assert optimizer_step_ms(1e9, 30.0, None) == 0.0


def test_a_post_validated_update_adds_the_undo_copy_at_the_update_s_memory_rate():
    # AdamW in fp32 (weights 4, gradients 4, moments 8 bytes per parameter): the update reads and writes the moments
    # and the weights and reads the gradient (16 + 4 + 8 = 28 bytes); the undo copy reads and writes the weights and
    # moments once (24 bytes), before the update, at the same rate
    assert eager_update_ms([28.0, 0.0], numerics("adamw", "fp32")) == pytest.approx([52.0, 0.0])


def test_the_undo_copy_holds_weights_optimizer_state_and_the_eager_step_s_gradients():
    # run --post-validate keeps a copy of the weights (4) and AdamW moments (8) and the gradients the eager step
    # used (4) while the next step's backward fills fresh ones: 16 bytes per parameter in fp32, per device
    assert undo_copy_bytes([10, 20, 30], [[0, 2], [1]], numerics("adamw", "fp32")) == (640.0, 320.0)
