"""Backward twice through one graph: the error, explained, and the two fixes compared."""

import torch
from torch import nn

import gradgate as gg


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(4, 3)
    try:
        with gg.explain(model):
            loss = model(x).sum()
            loss.backward()
            loss.backward()  # the saved activations were freed by the first backward
    except gg.GradgateError as err:
        print(f"raised: {type(err).__name__}")
        print(err)

    model.zero_grad()
    loss = model(x).sum()
    loss.backward(retain_graph=True)  # fix 1: keep the graph (and its memory)
    loss.backward()
    retained = model[0].weight.grad.clone()

    model.zero_grad()
    for _ in range(2):  # fix 2: run the forward again
        model(x).sum().backward()
    print(
        f"retain_graph and a second forward agree: {torch.allclose(retained, model[0].weight.grad)}"
    )


if __name__ == "__main__":
    main()
