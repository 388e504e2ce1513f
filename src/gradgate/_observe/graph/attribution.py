"""Which module does each autograd node belong to, when no forward was recorded?

Ops that use a parameter belong to its module (by identity); every other node goes to the
common ancestor of the modules whose parameter-using ops were created just before and just
after it (autograd numbers nodes in creation order).
"""

from __future__ import annotations

import bisect
import functools

from torch import nn

from ..._plumbing.autograd import Node, is_leaf, storage_key
from ..._plumbing.torch_internals import sequence_nr
from .parts import Walk, ancestors_and_self, common


class ParamIndex:
    """The model's parameters by identity, with qualified names and owning modules."""

    def __init__(self, model: nn.Module | None) -> None:
        named = [] if model is None else list(model.named_parameters())
        self.named: list[tuple[str, nn.Parameter]] = named
        self.by_id: dict[int, str] = {id(p): name for name, p in named}
        if model is not None:
            for name, p in model.named_parameters(remove_duplicate=False):
                self.by_id.setdefault(id(p), name)
        self.pointers = {storage_key(p) for _, p in named}

    def owner(self, node: Node) -> str | None:
        """The owning module of the parameter behind an AccumulateGrad node, if any."""
        name = self.by_id.get(id(node.variable)) if is_leaf(node) else None
        return None if name is None else name.rpartition(".")[0]


def attribute(
    walk: Walk, params: ParamIndex, model: nn.Module | None, recorded: dict[Node, str] | None
) -> dict[Node, str | None]:
    """The module name of every op node (None: outside the model)."""
    if model is None:
        return {}
    if recorded is not None:
        return {node: recorded.get(node) for node in walk.order if not is_leaf(node)}
    return _attribute_by_order(walk, params, model)


def _attribute_by_order(walk: Walk, params: ParamIndex, model: nn.Module) -> dict[Node, str | None]:
    """Ops that use a parameter belong to its module; the others to the common ancestor of
    the parameter ops created just before and after them (autograd numbers nodes in order)."""
    anchors: list[tuple[int, str]] = []
    for node in walk.order:
        if is_leaf(node):
            continue
        owners = [params.owner(fn) for fn in walk.inputs[node]]
        owners += [_param_only_owner(fn, params) for fn in walk.inputs[node]]
        found = [owner for owner in owners if owner is not None]
        if found:
            anchors.append((sequence_nr(node), functools.reduce(common, found)))
    anchors.sort()
    numbers = [number for number, _ in anchors]
    layout = _Layout(model)
    labels: dict[Node, str | None] = {}
    for node in walk.order:
        if is_leaf(node):
            continue
        number = sequence_nr(node)
        at = bisect.bisect_left(numbers, number)
        if at < len(numbers) and numbers[at] == number:
            labels[node] = anchors[at][1]
        elif 0 < at < len(numbers):
            labels[node] = layout.between(anchors[at - 1][1], anchors[at][1])
        else:
            labels[node] = None
    return labels


def _param_only_owner(node: Node, params: ParamIndex) -> str | None:
    """The owner when ``node`` only transforms parameters (``weight.t()``), else None."""
    if is_leaf(node):
        return None
    slots = [fn for fn, _ in node.next_functions]
    owners = [None if fn is None else params.owner(fn) for fn in slots]
    if not owners or any(owner is None for owner in owners):
        return None
    return functools.reduce(common, [o for o in owners if o is not None])


class _Layout:
    """The model's modules in order, and those whose parameters are all frozen."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = dict(model.named_modules())
        self.position = {name: i for i, name in enumerate(self.modules)}
        self.frozen = [
            name
            for name, module in self.modules.items()
            if (own := list(module.parameters(recurse=False)))
            and not any(p.requires_grad for p in own)
        ]

    def between(self, before: str, after: str) -> str:
        """Where an op created between the parameter ops of two modules belongs.

        A frozen module between them in model order ran it (its own parameter ops are not in
        the graph); else their common ancestor; but when the earlier one lies in an element
        of a container that runs no code (a block of a ``ModuleList``), that element: the
        code between two blocks runs at the end of the earlier one.
        """
        first, last = self.position[before], self.position[after]
        frozen = [n for n in self.frozen if first < self.position[n] < last]
        if frozen:
            return str(functools.reduce(common, frozen))
        shared = common(before, after)
        below = [n for n in ancestors_and_self(before) if n != shared and _inside(n, shared)]
        for name in reversed(below):
            parent = self.modules.get(name.rpartition(".")[0])
            if parent is not None and type(parent).forward is nn.Module.forward:
                return name
        return shared


def _inside(name: str, ancestor: str) -> bool:
    return not ancestor or name == ancestor or name.startswith(f"{ancestor}.")
