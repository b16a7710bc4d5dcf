"""The built-in gpt on a fixed small token dataset (bench_async.py loads it as `benchmarks/byte_gpt.py:byte_gpt`).

The dataset is 65,536 tokens drawn once from a fixed random bigram language over a 64-token vocabulary (each token
has 4 possible successors, with probabilities 0.55, 0.25, 0.15 and 0.05), so a model can learn it: the loss floor is
the bigram entropy, about 1.11 nats per token, against log(64) = 4.16 for a uniform guess. Training batches are
windows of seq + 1 tokens at random offsets (a generator seeded with the plan's seed): the same stream for every
schedule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch

from pipeplan.models.gpt import gpt

VOCAB, CORPUS_TOKENS, CORPUS_SEED = 64, 65_536, 1234
SUCCESSOR_PROBS = (0.55, 0.25, 0.15, 0.05)


def corpus() -> torch.Tensor:
    generator = torch.Generator().manual_seed(CORPUS_SEED)
    successors = [torch.randperm(VOCAB, generator=generator)[: len(SUCCESSOR_PROBS)].tolist() for _ in range(VOCAB)]
    picks = torch.multinomial(torch.tensor(SUCCESSOR_PROBS), CORPUS_TOKENS, replacement=True, generator=generator)
    tokens = [0]
    for pick in picks[1:].tolist():
        tokens.append(successors[tokens[-1]][pick])
    return torch.tensor(tokens, dtype=torch.long)


def entropy_floor() -> float:
    """The bigram language's entropy per token (nats): the best loss any model can reach."""
    return -sum(p * math.log(p) for p in SUCCESSOR_PROBS)


def byte_gpt(layers: int = 4, hidden: int = 64, heads: int = 4, seq: int = 32):
    spec = gpt(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=VOCAB)
    tokens = corpus()

    def data(batch_size: int, seed: int) -> Iterator:
        generator = torch.Generator().manual_seed(seed)
        while True:
            starts = torch.randint(0, CORPUS_TOKENS - seq - 1, (batch_size,), generator=generator)
            windows = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])
            yield (windows[:, :-1].contiguous(),), windows[:, 1:].contiguous()

    return dataclasses.replace(spec, data=data)
