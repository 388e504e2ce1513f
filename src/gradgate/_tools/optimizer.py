"""Optimizer plumbing shared by ``unfreeze(optimizer=)`` and ``gg.optim``: which parameters an
optimizer holds, and adding or removing parameter groups."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._plumbing.errors import InvalidOptionError


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


def add_missing_near(
    model: nn.Module, optimizer: torch.optim.Optimizer, params: list[tuple[str, nn.Parameter]]
) -> tuple[list[dict[str, Any]], list[str], list[dict[str, Any] | None]]:
    """Add the parameters the optimizer lacks, grouped like their module's other parameters
    (``unfreeze(optimizer=)``); returns the groups added, the names in them, and the group
    each copied its options from (``None``: the optimizer's defaults)."""
    group_of = held(optimizer)
    new_groups: dict[int, tuple[dict[str, Any] | None, list[tuple[str, nn.Parameter]]]] = {}
    for name, param in params:
        if id(param) not in group_of:
            sibling = _sibling_group(model, name, group_of)
            new_groups.setdefault(id(sibling), (sibling, []))[1].append((name, param))
    added = [
        add_group(optimizer, members, sibling or {}) for sibling, members in new_groups.values()
    ]
    names = [name for _, members in new_groups.values() for name, _ in members]
    return added, names, [sibling for sibling, _ in new_groups.values()]


def _sibling_group(
    model: nn.Module, name: str, group_of: dict[int, dict[str, Any]]
) -> dict[str, Any] | None:
    """The group of the nearest module (the owner, then its ancestors) with a parameter in it."""
    owner = name.rpartition(".")[0]
    while True:
        for param in model.get_submodule(owner).parameters():
            if id(param) in group_of:
                return group_of[id(param)]
        if not owner:
            return None
        owner = owner.rpartition(".")[0]


def refuse_foreign(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that holds parameters, none of them the model's: adding this model's
    parameters to it would train them with another model's optimizer (or a stale copy's)."""
    group_of = held(optimizer)
    ours = {id(p) for p in model.parameters()}
    if not group_of or not ours or not group_of.keys().isdisjoint(ours):
        return
    raise InvalidOptionError(
        f"optimizer={type(optimizer).__name__} holds none of the {len(ours)} parameters of "
        f"{type(model).__name__} (its {len(group_of)} parameters are other tensors: another "
        "model's, a copy's made with copy.deepcopy or reloaded after the optimizer was built, "
        "or a DeepSpeed or FSDP optimizer's flat copies); expected the optimizer that trains "
        "this model: build it from model.parameters() after the model's last copy. To train "
        "them with this optimizer on purpose, unfreeze without optimizer= and then call "
        "gg.optim.add_missing(optimizer, model)."
    )
