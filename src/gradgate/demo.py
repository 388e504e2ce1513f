"""``gradgate demo``: a small model trained with a different backprop depth every minibatch."""

from __future__ import annotations

import random

import torch
from torch import nn

from ._gate import BackpropGate


def run_demo(*, out: str, steps: int = 12, seed: int = 0) -> int:
    """Train a 6-block MLP, picking a random depth per minibatch; print who learned."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
    head = nn.Linear(16, 1)
    net = nn.Sequential(model, head)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    data, target = torch.randn(256, 16), torch.randn(256, 1)
    print("gradgate demo: a random backprop depth every minibatch")
    print(f"{'step':>4}  {'depth':>5}  {'loss':>8}  blocks that learned")
    with BackpropGate(net, blocks="0.*") as gate:
        for step in range(steps):
            depth = rng.choice([None, 0, 1, 2, 3, 6])
            gate.depth = depth
            batch = torch.randint(0, 256, (32,))
            loss = nn.functional.mse_loss(net(data[batch]), target[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            learned = [
                name.split(".")[1]
                for name in gate.blocks
                if net.get_submodule(f"{name}.0").weight.grad is not None
            ]
            print(f"{step:>4}  {depth!s:>5}  {loss.item():8.4f}  [{', '.join(learned)}]")
    return 0
