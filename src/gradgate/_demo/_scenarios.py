"""The seeds' conv stacks, audited: which gradients does backward compute?"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .._audit import AuditReport, audit
from .._dot import GraphvizNotFoundError
from .._freeze import frozen
from .._gate import backprop_depth
from .._graph import graph


@dataclass
class Scenario:
    title: str
    report: AuditReport
    svg: str | None  # the graph, drawn while the scenario's freeze or cut was in place


def graph_svg(loss: torch.Tensor, model: nn.Module, report: AuditReport | None) -> str | None:
    """The autograd graph as inline SVG, or None when Graphviz's ``dot`` is not installed."""
    try:
        return graph(loss, model=model, audit=report).to_svg()
    except GraphvizNotFoundError:
        return None


def conv_stack(n: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Conv2d(3, 3, 3) for _ in range(n)])


def _audited(
    title: str, model: nn.Module, step: Callable[[torch.Tensor], torch.Tensor]
) -> Scenario:
    x = torch.randn(16, 3, 24, 24, generator=torch.Generator().manual_seed(0))
    with audit(model) as report:
        loss = step(x)
        loss.backward(retain_graph=True)
    return Scenario(title, report, graph_svg(loss, model, report))


def _late_freeze(model: nn.Sequential) -> Callable[[torch.Tensor], torch.Tensor]:
    first = model.get_parameter("0.weight")

    def step(x: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = model(x).mean()
        first.requires_grad_(False)  # too late: the graph already wants it
        return loss

    return step


def seed_scenarios() -> list[Scenario]:
    """The five scenarios: all learn, last one, last two (cut), middle frozen, late freeze."""
    scenarios = []
    model = conv_stack(10)
    scenarios.append(
        _audited("10 convs, all learn (seed: 10 wgrad, 9 dgrad)", model, lambda x: model(x).mean())
    )
    model = conv_stack(10)
    with frozen(model, "0:9"):
        scenarios.append(
            _audited(
                "10 convs, first 9 frozen (seed: 1 wgrad, 0 dgrad)",
                model,
                lambda x: model(x).mean(),
            )
        )
    model = conv_stack(10)
    with backprop_depth(model, 2):
        scenarios.append(
            _audited(
                "10 convs, backprop_depth 2 (seed: 2 wgrad, 1 dgrad)",
                model,
                lambda x: model(x).mean(),
            )
        )
    model = conv_stack(3)
    with frozen(model, "1"):
        scenarios.append(
            _audited(
                "3 convs, middle frozen (seed: 2 wgrad, 2 dgrad)", model, lambda x: model(x).mean()
            )
        )
    model = conv_stack(3)
    scenarios.append(
        _audited(
            "3 convs, requires_grad turned off after the forward (wasted)",
            model,
            _late_freeze(model),
        )
    )
    model[0].weight.requires_grad_(True)
    return scenarios
