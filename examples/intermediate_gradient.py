"""The gradient of an intermediate tensor, taken in the same backward that trains the model.

Plain autograd keeps ``.grad`` only for leaf tensors; ``gg.capture_grads`` records the gradient
of any module's output during the ordinary ``backward()``: no ``retain_graph``, no second pass.
"""

import warnings

import torch
from torch import nn

import gradgate as gg


class Scale(nn.Module):
    """y = x * w, elementwise, with a learnable w."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def main() -> None:
    model = nn.Sequential(Scale(), nn.Tanh())
    x = torch.tensor([1.0, 2.0, 3.0])

    y = model[0](x)
    model[1](y).sum().backward()
    with warnings.catch_warnings():  # torch warns that a non-leaf .grad is never filled
        warnings.simplefilter("ignore", UserWarning)
        print(f"plain autograd, .grad of the intermediate y: {y.grad}")

    model.zero_grad()
    with gg.capture_grads(model, "0") as grads:
        loss = model(x).sum()
        loss.backward()
    y = model[0](x)
    (reference,) = torch.autograd.grad(model[1](y).sum(), y)
    print(f"captured d loss / d y: {grads['0']}")
    print(f"equals torch.autograd.grad: {torch.allclose(grads['0'], reference)}")
    print(f"parameters trained in the same backward: {model[0].w.grad is not None}")


if __name__ == "__main__":
    main()
