"""A small residual CNN: a DAG, not a chain. Each block has a residual skip; `long_skip` also adds the stem's
output to the last block's output, so a tensor crosses every cut between stem and head. GroupNorm (not BatchNorm)
keeps every sample independent, so microbatching does not change the maths."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.models.spec import ModelSpec, check_sizes


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(8, channels), channels)


class Stem(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.norm = _norm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = _norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = _norm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(x + self.norm2(self.conv2(y)))


class Classifier(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


class ResNet(nn.Module):
    def __init__(self, *, blocks: int, channels: int, classes: int, long_skip: bool) -> None:
        super().__init__()
        self.long_skip = long_skip
        self.stem = Stem(channels)
        self.blocks = nn.ModuleList(ResidualBlock(channels) for _ in range(blocks))
        self.head = Classifier(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stem = self.stem(x)
        y = stem
        for block in self.blocks:
            y = block(y)
        if self.long_skip:
            y = y + stem
        return self.head(y)


def resnet(
    blocks: int = 4, channels: int = 16, image: int = 16, classes: int = 10, long_skip: bool = True
) -> ModelSpec:
    """Residual CNN on `image` x `image` RGB inputs with `blocks` residual blocks of `channels` channels."""
    check_sizes(blocks=blocks, channels=channels, image=image, classes=classes)
    options = dict(blocks=blocks, channels=channels, image=image, classes=classes, long_skip=long_skip)

    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        x = torch.randn(batch_size, 3, image, image, generator=generator)
        target = torch.randint(0, classes, (batch_size,), generator=generator)
        return (x,), target

    build_options: dict[str, Any] = {k: v for k, v in options.items() if k != "image"}
    return ModelSpec(
        name="resnet",
        build=lambda: ResNet(**build_options),
        sample_batch=sample_batch,
        loss_fn=F.cross_entropy,
        options=options,
    )
