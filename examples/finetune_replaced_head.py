"""Fine-tuning with a replaced head: freeze the backbone, train only the new classifier.

The optimizer is given every parameter (a common habit) and uses momentum; gradgate's freeze
leaves the frozen parameters' ``.grad`` as ``None`` so the optimizer never moves them.
"""

import torch
from torch import nn

import gradgate as gg


def pretrained() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),  # the old 10-class head
    )


def main() -> None:
    model = pretrained()
    handle = gg.freeze(model, "0:5", norm="eval")
    model[5] = nn.Linear(8, 2)  # the new 2-class head: fresh parameters, not frozen
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    backbone = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("5")}
    stats = model[1].running_mean.clone()
    head = model[5].weight.detach().clone()
    for _ in range(3):
        x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 2, (4,))
        opt.zero_grad()
        nn.functional.cross_entropy(model.train()(x), y).backward()
        opt.step()

    unchanged = all(
        torch.equal(p, backbone[n]) for n, p in model.named_parameters() if n in backbone
    )
    print(f"trainable parameters: {[n for n, p in model.named_parameters() if p.requires_grad]}")
    print(f"backbone bit-identical after 3 steps: {unchanged}")
    print(f"BatchNorm running statistics unchanged: {torch.equal(model[1].running_mean, stats)}")
    frozen = [p for n, p in model.named_parameters() if n in backbone]
    print(f"frozen .grad are None: {all(p.grad is None for p in frozen)}")
    print(f"head changed: {not torch.equal(model[5].weight, head)}")
    print(f"gg.check findings: {[f.code for f in gg.check(model, opt)]}")
    handle.undo()


if __name__ == "__main__":
    main()
