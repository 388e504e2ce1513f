"""Three seed questions answered in a sentence each, with the evidence measured just now."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .._audit import AuditReport, audit
from .._capture import capture_grads
from .._freeze import freeze
from .._gate import stop_gradient_at


@dataclass
class Answer:
    question: str
    sentence: str
    report: AuditReport | None = None


def answers() -> list[Answer]:
    return [intermediate_gradient(), optimizer_drift(), actor_critic()]


def intermediate_gradient() -> Answer:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(3, 5)
    hidden = net[1](net[0](x))
    (reference,) = torch.autograd.grad(net[2](hidden).sum(), hidden)
    with capture_grads(net, "1") as grads:
        net(x).sum().backward()
    difference = (grads["1"] - reference).abs().max().item()
    return Answer(
        "How do I get the gradient of an intermediate tensor?",
        "gg.capture_grads(net, '1') returned d loss / d (output of module '1') from one "
        f"ordinary backward; largest difference from torch.autograd.grad: {difference:.1e}.",
    )


def _drift(use_gradgate: bool) -> float:
    torch.manual_seed(0)
    first = nn.Linear(4, 4)
    net = nn.Sequential(first, nn.Linear(4, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    x = torch.randn(8, 4)
    net(x).sum().backward()
    optimizer.step()  # one ordinary step: momentum buffers now exist
    before = first.weight.detach().clone()
    handle = freeze(net, "0") if use_gradgate else None
    if handle is None:
        for param in first.parameters():
            param.requires_grad_(False)
    for _ in range(5):
        optimizer.zero_grad(set_to_none=use_gradgate)  # by hand: grads kept as zero tensors
        net(x).sum().backward()
        optimizer.step()
    if handle is not None:
        handle.undo()
    return (first.weight.detach() - before).abs().max().item()


def optimizer_drift() -> Answer:
    by_hand, with_gradgate = _drift(False), _drift(True)
    return Answer(
        "Why did my frozen layer still change?",
        f"frozen by hand (requires_grad=False, grads zeroed not None), SGD with momentum and "
        f"weight decay still moved the weights by up to {by_hand:.2e} in 5 steps; frozen with "
        f"gg.freeze (grads None) they moved by {with_gradgate:.1e}.",
    )


def actor_critic() -> Answer:
    torch.manual_seed(0)
    pair = nn.Sequential()
    pair.add_module("actor", nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2)))
    pair.add_module("critic", nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)))
    state = torch.randn(32, 3)
    with stop_gradient_at(pair, "critic"), audit(pair) as report:
        pair(state).pow(2).mean().backward()
    actor = report.module("actor")
    critic = report.module("critic")
    return Answer(
        "Actor-critic: how do I keep the critic's loss away from the actor?",
        f"with gg.stop_gradient_at(pair, 'critic') the critic update computed {actor.wgrad} "
        f"wgrad, {actor.dgrad} dgrad and {actor.backward_flops} backward FLOPs in the actor "
        f"(critic: {critic.wgrad} wgrad, {critic.dgrad} dgrad, "
        f"{critic.backward_flops:,} FLOPs).",
        report,
    )
