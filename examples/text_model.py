"""Train on real text: a byte-level language model whose batches are tokenized on the fly from a small corpus built
into this file (or any text file you name), with no download.

    pipeplan profile examples/text_model.py:text_lm -b 2 -o text.json
    pipeplan plan examples/text_model.py:text_lm --profile text.json -n 2 -B 8 -o text-plan
    pipeplan run text-plan/plan.json --steps 30 --lr 3e-3 --lr-schedule cosine --warmup-steps 3 --log train.jsonl
    pipeplan run ... -a corpus=notes.txt                                  # (the same -a options as the plan's)

The tokenizer is the identity on UTF-8 bytes (vocabulary 256). A sample is a window of `seq` + 1 bytes of the
corpus: the model reads the first `seq` and predicts the next byte at every position. Windows are drawn without
replacement in a seeded random order (a new order each pass over the corpus), `batch_size` per global batch.

Data-parallel shards: `data` takes `shard=(p, d)`, so pipeline p of d builds only its own windows, the p-th
`batch_size / d` of each global batch's (every pipeline draws the same seeded order, so together they read the
global batch a single process would). A resumed run draws and drops the windows of the steps already done, so it
continues exactly where it stopped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pipeplan.models.gpt import gpt
from pipeplan.models.spec import ModelSpec

CORPUS = """\
A pipeline cuts a model into stages and gives each stage its own device. A microbatch enters the first stage, and
while the second stage works on it the first stage takes the next one, so every device keeps busy once the pipe
is full. The time before it fills and after it drains is the bubble. Schedules differ in how they order forward
and backward passes: one forward one backward keeps few activations alive, zero bubble schedules split the
backward pass into the gradient for the input and the gradient for the weights, and fill the bubble with the
latter. A planner measures how long each layer takes, tries the cuts, the depths and the schedules, and keeps the
fastest layout that fits in memory. Then it runs that layout and compares the measured step with its prediction.
Data parallel pipelines each take a share of the batch and add up their gradients before the optimizer steps.
"""


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes as token ids (0..255)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def text_lm(layers: int = 2, hidden: int = 32, heads: int = 2, seq: int = 32, corpus: str = "") -> ModelSpec:
    """pipeplan's gpt over bytes, trained on `corpus` (a text file; default: the built-in one)."""
    tokens = encode(Path(corpus).read_text(encoding="utf-8") if corpus else CORPUS)
    windows = len(tokens) - seq  # window i is tokens[i : i + seq + 1]
    if windows < 1:
        raise ValueError(f"the corpus has {len(tokens)} bytes; seq={seq} needs at least {seq + 1}")
    spec = gpt(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=256)

    def window_starts(seed: int):
        """Every window's start once per pass, in a seeded order, pass after pass."""
        generator = torch.Generator().manual_seed(seed)
        while True:
            yield from torch.randperm(windows, generator=generator).tolist()

    def data(batch_size: int, seed: int, shard: tuple[int, int] = (0, 1)):
        index, count = shard
        size = batch_size // count
        starts = window_starts(seed)
        while True:
            chosen = [next(starts) for _ in range(batch_size)][index * size : (index + 1) * size]
            rows = torch.stack([tokens[s : s + seq + 1] for s in chosen])
            yield (rows[:, :-1].contiguous(),), rows[:, 1:].contiguous()

    options = dict(layers=layers, hidden=hidden, heads=heads, seq=seq, corpus=corpus)  # the factory's arguments
    return dataclasses.replace(spec, name="text-lm", data=data, options=options)
