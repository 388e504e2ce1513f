"""Optimizer plumbing shared by ``unfreeze(optimizer=)`` and ``gg.optim``: which parameters an
optimizer holds, and adding or removing parameter groups."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def held(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """The group that holds each parameter, by parameter identity."""
    return {id(p): group for group in optimizer.param_groups for p in group["params"]}


def add_group(
    optimizer: torch.optim.Optimizer,
    members: list[tuple[str, nn.Parameter]],
    options: dict[str, Any],
) -> dict[str, Any]:
    """Add one group of ``(name, parameter)`` pairs; names are kept where the optimizer keeps
    them (one built from ``named_parameters()``). Returns the group as the optimizer holds it."""
    group = {k: v for k, v in options.items() if k not in ("params", "param_names")}
    if any("param_names" in g for g in optimizer.param_groups):
        group["param_names"] = [name for name, _ in members]
    optimizer.add_param_group({**group, "params": [p for _, p in members]})
    return optimizer.param_groups[-1]


def remove_groups(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Take groups (and their parameters' state) out of the optimizer again."""
    for group in groups:
        index = next((i for i, g in enumerate(optimizer.param_groups) if g is group), None)
        if index is not None:
            del optimizer.param_groups[index]
            for param in group["params"]:
                optimizer.state.pop(param, None)
