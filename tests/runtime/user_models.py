"""Models written the way users write them, for the tracing, profiling and runtime tests:

- `tv_resnet`: a torchvision-style ResNet (BasicBlock with `nn.ReLU(inplace=True)` and `out += identity`);
- `vgg`: a VGG-style `features` Sequential with in-place ReLUs (one layer per module at --granularity 2);
- `moe`: mixture-of-experts blocks whose routing is data-dependent (`argmax`, boolean-mask indexing, a Python
  branch on `mask.any()`), traced by fx with the MoE module as a leaf;
- `shape_branch`: a model fx cannot trace (a Python branch on a tensor's size) returning a dict.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.models.spec import ModelSpec


def _images(classes: int, size: int = 8):
    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        images = torch.randn(batch_size, 3, size, size, generator=generator)
        return (images,), torch.randint(0, classes, (batch_size,), generator=generator)

    return sample_batch


class BasicBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class TVResNet(nn.Module):
    def __init__(self, channels: int, blocks: int, classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(2)
        self.layer1 = nn.Sequential(*(BasicBlock(channels) for _ in range(blocks)))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def tv_resnet(channels: int = 8, blocks: int = 2, classes: int = 5) -> ModelSpec:
    return ModelSpec(
        name="tv_resnet",
        build=lambda: TVResNet(channels, blocks, classes),
        sample_batch=_images(classes),
        loss_fn=F.cross_entropy,
    )


class VGG(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(width * 16, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def vgg(width: int = 4, classes: int = 3) -> ModelSpec:
    return ModelSpec(
        name="vgg", build=lambda: VGG(width, classes), sample_batch=_images(classes), loss_fn=F.cross_entropy
    )


class MoE(nn.Module):
    """Top-1 routing: each token goes to the expert its gate scores highest, scaled by that gate probability."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.gate(flat).softmax(-1)
        choice = probs.argmax(-1)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            mask = choice == index
            if mask.any():  # data-dependent: needs real values
                out[mask] = expert(flat[mask]) * probs[mask, index : index + 1]
        return x + out.reshape(x.shape)


class MoEBlock(nn.Module):
    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.moe = MoE(width, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.norm(x))


class MoEModel(nn.Module):
    def __init__(self, width: int, layers: int, experts: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Linear(6, width)
        self.blocks = nn.ModuleList(MoEBlock(width, experts) for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


def moe(width: int = 8, layers: int = 4, experts: int = 3, classes: int = 4) -> ModelSpec:
    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        tokens = torch.randn(batch_size, 5, 6, generator=generator)
        return (tokens,), torch.randint(0, classes, (batch_size,), generator=generator)

    return ModelSpec(
        name="moe",
        build=lambda: MoEModel(width, layers, experts, classes),
        sample_batch=sample_batch,
        loss_fn=F.cross_entropy,
        leaf_modules=(MoE,),
    )


class ShapeBranch(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if x.shape[0] > 1:  # fx cannot branch on a traced size; export specializes it
            x = x * 0.5
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return {"logits": self.out(x), "features": x}


def shape_branch(width: int = 6) -> ModelSpec:
    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        return (torch.randn(batch_size, width, generator=generator),), torch.randint(0, 2, (batch_size,))

    return ModelSpec(
        name="shape_branch",
        build=lambda: ShapeBranch(width),
        sample_batch=sample_batch,
        loss_fn=lambda output, target: F.cross_entropy(output["logits"], target) + output["features"].pow(2).mean(),
    )


class Split(nn.Module):
    """Returns a pair: listed as a leaf, fx records one call whose value is a tuple."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.left = nn.Linear(width, width)
        self.right = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.left(x)), torch.sigmoid(self.right(x))


class Merge(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * width, width)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.proj(torch.cat(pair, dim=-1))  # the tuple itself is the argument


class PairModel(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.split = Split(width)
        self.merge = Merge(width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.merge(self.split(self.embed(x))))


def pair(width: int = 8) -> ModelSpec:
    def sample_batch(batch_size: int, generator: torch.Generator | None = None):
        return (torch.randn(batch_size, 4, generator=generator),), torch.randint(
            0, 3, (batch_size,), generator=generator
        )

    return ModelSpec(
        name="pair",
        build=lambda: PairModel(width),
        sample_batch=sample_batch,
        loss_fn=F.cross_entropy,
        leaf_modules=(Split,),
    )
