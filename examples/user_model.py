"""A user model for pipeplan: a tiny conv + transformer-ish classifier, written as a factory.

Use it anywhere pipeplan takes MODEL:

    pipeplan profile examples/user_model.py:build -a depth=3 -a width=32 --batch-size 8
    pipeplan plan examples/user_model.py:build -a depth=6 --devices 2
    pipeplan run plan/plan.json --steps 10                       # trains exactly what build() makes (plan's seed)
    pipeplan run plan/plan.json --init-from mixer.pt             # or a saved state_dict (.pt / .safetensors)

The factory takes typed keyword arguments (pipeplan converts `-a key=value` strings with these annotations) and
returns a ModelSpec: how to build the module, a sample batch `((inputs, ...), target)`, and the loss. Layers:
`patch`, `blocks.{i}`, `head`. The file may import modules that sit beside it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.models.spec import ModelSpec


class Patchify(nn.Module):
    """Cut a (batch, channels, size, size) image into patch tokens of `width` features."""

    def __init__(self, channels: int, width: int, patch: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(channels, width, patch, stride=patch)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)


class MixerBlock(nn.Module):
    """Token mixing then channel mixing, each with a residual connection."""

    def __init__(self, tokens: int, width: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.token_mix = nn.Linear(tokens, tokens)
        self.norm2 = nn.LayerNorm(width)
        self.channel_mix = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mix(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mix(self.norm2(x))


class Classifier(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))


class TinyMixer(nn.Module):
    def __init__(self, *, depth: int, width: int, image: int, patch: int, classes: int) -> None:
        super().__init__()
        tokens = (image // patch) ** 2
        self.patch = Patchify(3, width, patch)
        self.blocks = nn.ModuleList(MixerBlock(tokens, width) for _ in range(depth))
        self.head = Classifier(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(depth: int = 4, width: int = 64, image: int = 16, patch: int = 4, classes: int = 10) -> ModelSpec:
    """A small MLP-Mixer on `image` x `image` RGB images with `depth` blocks of `width` features."""
    if min(depth, width, image, patch, classes) < 1:
        raise ValueError("depth, width, image, patch and classes must be positive")
    if image % patch:
        raise ValueError(f"image ({image}) must be divisible by patch ({patch})")
    options = dict(depth=depth, width=width, image=image, patch=patch, classes=classes)

    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        images = torch.randn(batch_size, 3, image, image, generator=generator)
        labels = torch.randint(0, classes, (batch_size,), generator=generator)
        return (images,), labels

    return ModelSpec(
        name="tiny-mixer",
        build=lambda: TinyMixer(**options),
        sample_batch=sample_batch,
        loss_fn=F.cross_entropy,
        options=options,
    )
