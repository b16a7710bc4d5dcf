"""Megatron tensor parallelism's collectives in one transformer layer (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", MLSys 2023, arXiv:2205.05198, §4.2.2; Shoeybi et al., "Megatron-LM",
2019, §3): what `search/sharding.py` adds per block for a tensor-parallel split (the link times: `costs/comm.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.errors import ConfigError


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class Collective:
    """`count` collectives of one kind, each over a `message_bytes` tensor (its whole, unsharded size)."""

    kind: str  # all-reduce | all-gather | reduce-scatter
    count: int
    message_bytes: int


@dataclass(frozen=True)
class TensorParallelComm:
    """The tensor-parallel collectives of one transformer layer, forward and backward."""

    forward: tuple[Collective, ...]
    backward: tuple[Collective, ...]
    regather: tuple[Collective, ...] = ()  # backward: sequence-parallel inputs gathered again for the wgrads


FP8_GATHER_FRACTION = 0.5  # an FP8 all-gather moves 1 byte per element where the 16-bit one moves 2


def tensor_parallel_comm_per_layer(
    *,
    seq: int,
    batch: int,
    hidden: int,
    tensor_parallel: int,
    sequence_parallel: bool,
    bytes_per_element: int = 2,
    fp8_gathers: bool = False,
) -> TensorParallelComm:
    """Megatron tensor parallelism's collectives in one transformer layer (Korthikanti et al. §4.2.2; Shoeybi et
    al., "Megatron-LM", 2019, §3): without sequence parallelism 2 all-reduces in the forward (after the attention
    projection and after the MLP) and 2 in the backward (the conjugate operators before the QKV and first MLP
    Linear); with it each all-reduce becomes a reduce-scatter and each identity before a block an all-gather: 2
    all-gathers + 2 reduce-scatters forward, the same backward. Every message is the whole s·b·h activation;
    a ring all-reduce is a reduce-scatter followed by an all-gather, so both cost the same bandwidth. With sequence
    parallelism Megatron also all-gathers each column-parallel Linear's sequence-sharded input again in the
    backward for its weight gradient (Korthikanti §4.2.2: "an extra all-gather ... overlapped with gradient
    computation"): 2 per layer, `regather`. No collectives for t = 1.

    `fp8_gathers` (an FP8 recipe, 16-bit activations): Transformer Engine casts a column-parallel linear's
    sequence-parallel input to FP8 before gathering it and keeps that FP8 copy, which the backward gathers again
    (transformer_engine/pytorch/module/linear.py, `_Linear`: `cast_to_fp8` then `gather_along_first_dim` in the
    forward, the saved FP8 `inputmat` gathered in the backward; layernorm_linear.py gathers its FP8 `ln_out`), and
    a row-parallel linear's output gradient is cast to FP8 before the backward gathers it (module/base.py,
    `grad_output_preprocess`, "FP8 case with gather": `cast_to_fp8` then `gather_along_first_dim`, or the FP8
    userbuffer), so every all-gather moves half the bytes; the reduce-scatters (16-bit GEMM outputs) keep theirs."""
    _check_positive(seq=seq, batch=batch, hidden=hidden, tensor_parallel=tensor_parallel)
    _check_positive(bytes_per_element=bytes_per_element)
    if tensor_parallel == 1:
        return TensorParallelComm(forward=(), backward=())
    message = seq * batch * hidden * bytes_per_element
    one_pass: tuple[Collective, ...]
    if sequence_parallel:
        gathered = int(message * FP8_GATHER_FRACTION) if fp8_gathers else message
        one_pass = (Collective("all-gather", 2, gathered), Collective("reduce-scatter", 2, message))
        regather = (Collective("all-gather", 2, gathered),)
        return TensorParallelComm(forward=one_pass, backward=one_pass, regather=regather)
    one_pass = (Collective("all-reduce", 2, message),)
    return TensorParallelComm(forward=one_pass, backward=one_pass)
