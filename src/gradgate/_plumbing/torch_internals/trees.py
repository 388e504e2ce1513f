"""Nested args and outputs: torch's pytree where present, an exact fallback of gradgate's own
for plain tuples, lists and mappings where not."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from . import _lookup

PYTREE = _lookup("torch.utils._pytree")
# takes a type off the pytree's registry; only the tests use it (None on torch 2.6)
PYTREE_DEREGISTER = _lookup("torch.utils._pytree", "_deregister_pytree_node")


def tree_flatten(value: Any) -> tuple[list[Any], Any]:
    """The leaves of a nested value and a spec to rebuild it (torch's pytree where present)."""
    if PYTREE is not None:
        return PYTREE.tree_flatten(value)  # type: ignore[no-any-return]
    leaves: list[Any] = []
    return leaves, _flatten(value, leaves)


def tree_leaves(value: Any) -> list[Any]:
    """The leaves of a nested value. torch's ``tree_flatten`` leaves a reference cycle behind
    at every call (its recursive helper), garbage for the cycle collector: this makes none."""
    leaves = getattr(PYTREE, "tree_leaves", None)
    return tree_flatten(value)[0] if leaves is None else leaves(value)  # type: ignore[no-any-return]


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """The nested value ``spec`` describes, with ``leaves`` in its leaf slots."""
    if PYTREE is not None and not isinstance(spec, _Spec):
        return PYTREE.tree_unflatten(leaves, spec)
    return _unflatten(iter(leaves), spec)


class _Spec:
    """The fallback's spec: a container (``None`` for a leaf) and its children's specs."""

    __slots__ = ("children", "container", "keys")

    def __init__(self, container: Any, keys: list[Any], children: list[_Spec]) -> None:
        self.container, self.keys, self.children = container, keys, children


def _flatten(value: Any, leaves: list[Any]) -> _Spec:
    if isinstance(value, (list, tuple)):
        return _Spec(value, list(range(len(value))), [_flatten(v, leaves) for v in value])
    if isinstance(value, dict):
        keys = list(value)
        return _Spec(value, keys, [_flatten(value[k], leaves) for k in keys])
    leaves.append(value)
    return _Spec(None, [], [])


def _unflatten(leaves: Iterator[Any], spec: _Spec) -> Any:
    if spec.container is None:
        return next(leaves)
    children = [_unflatten(leaves, child) for child in spec.children]
    container = spec.container
    if isinstance(container, dict):
        rebuilt = copy.copy(container)  # keeps a dict subclass and its attributes
        for key, child in zip(spec.keys, children, strict=True):
            rebuilt[key] = child
        return rebuilt
    if isinstance(container, list):
        return type(container)(children)
    if hasattr(container, "_fields"):  # a namedtuple
        return type(container)(*children)
    return type(container)(children)
