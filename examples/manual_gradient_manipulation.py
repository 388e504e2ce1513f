"""Manual gradient manipulation: zero the encoder's gradients every other step.

Written by hand, this is a loop over parameters between ``backward()`` and ``step()``; with
gradgate it is one removable transform whose ``when`` sees the step number (one step per
forward of the model).
"""

import torch
from torch import nn

import gradgate as gg


def make() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def main() -> None:
    data = [
        torch.randn(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        for i in range(4)
    ]

    model, opt = make()
    for step, x in enumerate(data):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if step % 2 == 0:
            for p in model[0].parameters():
                p.grad.zero_()
        opt.step()
    by_hand = [p.detach().clone() for p in model.parameters()]

    model, opt = make()
    zeroed = []
    with gg.zero_grad_of(model, "0", when=lambda step: step % 2 == 0):
        for x in data:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            zeroed.append(bool(model[0].weight.grad.abs().sum() == 0))
            opt.step()
    same = all(torch.equal(a, b) for a, b in zip(by_hand, model.parameters(), strict=True))
    print(f"encoder gradient zeroed per step: {zeroed}")
    print(f"identical to the hand-written loop: {same}")


if __name__ == "__main__":
    main()
