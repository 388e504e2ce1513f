"""A tensor saved for backward, changed in place before backward: the error, explained.

Multiplying by a tensor saves it for the backward pass (the gradient needs its value). Changing
it in place afterwards makes autograd refuse; ``gg.explain`` says which module and op saved
it, where it was changed, and how to fix it.
"""

import torch
from torch import nn

import gradgate as gg


class Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.weight


def main() -> None:
    model = nn.ModuleDict({"gain": Gain()})
    x = torch.tensor([4.0, 5.0, 6.0])
    try:
        with gg.explain(model):
            loss = model["gain"](x).sum()
            x[0] = 0.0  # changes a tensor the multiplication saved
            loss.backward()
    except gg.GradgateError as err:
        print(f"raised: {type(err).__name__}")
        print(err)
        print(f"original PyTorch error kept: {isinstance(err.__cause__, RuntimeError)}")

    x = torch.tensor([4.0, 5.0, 6.0])
    loss = model["gain"](x).sum()
    x = x.clone()
    x[0] = 0.0  # the fix: change a copy, the saved tensor stays intact
    loss.backward()
    print(f"after the fix, weight grad: {model['gain'].weight.grad.tolist()}")


if __name__ == "__main__":
    main()
