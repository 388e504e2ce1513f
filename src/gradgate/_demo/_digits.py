"""A real small training run on scikit-learn's bundled digits: full vs a random depth."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gradgate as gg

BLOCKS = 6
DEPTHS: list[int | None] = [1, 2, 3, 4, 6, None]


@dataclass
class Run:
    name: str
    accuracy: list[float] = field(default_factory=list)  # test accuracy after each epoch
    step_seconds: list[float] = field(default_factory=list)
    depths: list[int | None] = field(default_factory=list)
    backward_flops: int = 0

    @property
    def median_step(self) -> float:
        return statistics.median(self.step_seconds)

    def summary(self) -> str:
        return (
            f"{self.name:<22} test accuracy {self.accuracy[-1]:.3f}   backward FLOPs "
            f"{self.backward_flops:>13,}   median step {self.median_step * 1e3:.2f} ms"
        )


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits (8x8 images, 10 classes) split 75/25, features scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = len(y) * 3 // 4
    return x[:cut], y[:cut], x[cut:], y[cut:]


class ResidualBlock(nn.Module):
    """A pre-norm residual MLP block, the shape of a transformer's feed-forward half."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.mlp(self.norm(x))
        return out


def make_net(seed: int) -> nn.Sequential:
    """Stem, six residual blocks, head: ``gg.blocks`` finds ``1.0`` … ``1.5``."""
    torch.manual_seed(seed)
    blocks = nn.Sequential(*[ResidualBlock(64) for _ in range(BLOCKS)])
    return nn.Sequential(
        nn.Linear(64, 64), blocks, nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 10))
    )


def train_digits(*, epochs: int, seed: int, batch_size: int = 32) -> list[Run]:
    """Full backprop and a random depth per minibatch, side by side: the same initial weights
    and batches, steps interleaved so that both see the same machine load."""
    x, y, x_test, y_test = digits_tensors()
    runs = [Run("full backprop"), Run("random depth per batch")]
    nets = [make_net(seed), make_net(seed)]
    optimizers = [torch.optim.Adam(net.parameters(), lr=3e-3) for net in nets]
    gates = [gg.BackpropGate(net) for net in nets]
    rng = random.Random(seed)
    flops: dict[tuple[int | None, int], int] = {}
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for step, batch in enumerate(torch.randperm(len(y), generator=generator).split(batch_size)):
            gates[1].depth = rng.choice(DEPTHS)
            order = (0, 1) if step % 2 == 0 else (1, 0)
            for i in order:
                key = (gates[i].depth, len(batch))
                if key not in flops:
                    flops[key] = _backward_flops(nets[i], x[batch], y[batch])
                runs[i].backward_flops += flops[key]
                runs[i].depths.append(gates[i].depth)
                runs[i].step_seconds.append(_step(nets[i], optimizers[i], x[batch], y[batch]))
        for net, run in zip(nets, runs, strict=True):
            with torch.no_grad():
                run.accuracy.append((net(x_test).argmax(1) == y_test).float().mean().item())
    for gate in gates:
        gate.remove()
    return runs


def _step(
    net: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    start = time.perf_counter()
    optimizer.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    optimizer.step()
    return time.perf_counter() - start


def _backward_flops(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    loss = nn.functional.cross_entropy(net(x), y)
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    net.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())
