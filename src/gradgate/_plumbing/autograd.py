"""Autograd plumbing shared by every module: the node walk, leaves, saved tensors, storages.

One place answers each of these questions, so audit, graph, check and explain agree:

* :func:`walk` — every node reachable from some roots, once, depth first;
* :func:`leaf_variable` — the tensor an ``AccumulateGrad`` node accumulates into;
* :func:`saved_tensors` — the tensors a node saved for backward;
* :func:`storage_key` / :class:`StorageBytes` — counting each storage once;
* :func:`observe_saved` — a ``saved_tensors_hooks`` pair that sees every saved tensor without
  keeping it alive (no reference cycle) and without hiding hooks installed outside it;
* :func:`tensors_in` — the tensors inside a nested value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch

from .torch_internals import (
    knows_saved_tensors_hooks,
    needs,
    outer_saved_tensors_hooks,
    saved_tensors_hooks_active,
)
from .torch_internals.trees import tree_leaves

Node = Any  # torch.autograd.graph.Node; its Python API is only partly typed
# The on_save callbacks of the observe_saved blocks active in this context, outermost first.
_OBSERVERS: ContextVar[tuple[Callable[[torch.Tensor], object], ...]] = ContextVar(
    "gradgate_saved_observers", default=()
)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested value, in order; mappings the pytree does not know (such as
    transformers' ``ModelOutput``) are opened too.

    >>> import torch
    >>> [t.shape[0] for t in tensors_in((torch.ones(1), {"a": torch.ones(2)}, "x"))]
    [1, 2]
    """
    if isinstance(value, torch.Tensor):  # a block's usual output: no tree to walk
        return [value]
    found: list[torch.Tensor] = []
    _collect_tensors(value, found)
    return found


_NO_TENSORS = (str, bytes, int, float, complex, type(None))


def _collect_tensors(value: Any, found: list[torch.Tensor]) -> None:
    """Plain tuples, lists and mappings opened here, as the pytree would, in a third of its
    bytecode (the root's exit runs this on every forward's output); other types by the pytree,
    which knows namedtuples and the types registered with it."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif type(value) is tuple or type(value) is list:
        for item in value:
            _collect_tensors(item, found)
    elif isinstance(value, Mapping):
        for item in value.values():
            _collect_tensors(item, found)
    elif not isinstance(value, _NO_TENSORS):
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                found.append(leaf)
            elif isinstance(leaf, Mapping):
                _collect_tensors(leaf, found)


def inputs_of(node: Node) -> list[Node]:
    """The nodes ``node`` passes gradients to (its ``next_functions``), ``None`` slots left out."""
    return [fn for fn, _ in node.next_functions if fn is not None]


def walk(
    roots: Iterable[Node | None], *, enter: Callable[[Node], bool] | None = None
) -> Iterator[Node]:
    """Every node reachable from ``roots`` through ``next_functions``, each once, depth first
    (a node before its inputs, inputs in order).

    A node for which ``enter(node)`` is false is neither yielded nor walked through. ``enter``
    is asked when the node is reached, after the consumer has handled every node yielded
    before it, so it may read what the consumer wrote.

    >>> import torch
    >>> w = torch.ones(2, requires_grad=True)
    >>> [node.name() for node in walk([(w * 2).sum().grad_fn])]
    ['SumBackward0', 'MulBackward0', 'torch::autograd::AccumulateGrad']
    """
    stack = [root for root in reversed(list(roots)) if root is not None]
    seen: set[Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if enter is not None and not enter(node):
            continue
        yield node
        stack.extend(reversed(inputs_of(node)))


def root_node(tensor: torch.Tensor) -> Node:
    """The node a gradient for ``tensor`` enters the graph at: its ``grad_fn``, or for a leaf
    that requires grad, its ``AccumulateGrad`` node."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    return torch.autograd.graph.get_gradient_edge(tensor).node


def leaf_variable(node: Node) -> torch.Tensor | None:
    """The leaf tensor an ``AccumulateGrad`` node accumulates into, else ``None``."""
    variable = getattr(node, "variable", None)
    return variable if isinstance(variable, torch.Tensor) else None


def is_leaf(node: Node) -> bool:
    """Whether ``node`` is an ``AccumulateGrad`` node (the end of a path, at a leaf tensor)."""
    return hasattr(node, "variable")


def saved_attributes(node: Node) -> list[str]:
    """The names of the attributes under which ``node`` exposes what it saved for backward."""
    return [name for name in dir(node) if name.startswith("_saved_")]


def saved_tensors(node: Node) -> list[torch.Tensor]:
    """The tensors ``node`` saved for backward (none once a backward has freed them)."""
    found: list[torch.Tensor] = []
    for attribute in saved_attributes(node):
        try:
            value = getattr(node, attribute)
        except RuntimeError:  # freed by an earlier backward
            continue
        found.extend(tensors_in(value))
    return found


def storage_key(tensor: torch.Tensor) -> int:
    """A key shared by every tensor viewing the same memory (its storage's address)."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without storage (some subclasses)
        return id(tensor)


def storage_bytes(tensor: torch.Tensor) -> int:
    """The size of the whole storage behind ``tensor`` (0 where it has none)."""
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return 0


class StorageBytes:
    """Bytes of distinct storages: each live storage counted once, ``exclude`` keys never.

    A storage freed and its memory reused by a new one counts again (a weak reference tells).

    >>> import torch
    >>> counter, x = StorageBytes(), torch.ones(4)
    >>> counter.add(x), counter.add(x[:2]), counter.total
    (16, 0, 16)
    """

    def __init__(self, exclude: Iterable[int] = ()) -> None:
        self.exclude = set(exclude)
        self.total = 0
        self._alive: dict[int, Any] = {}

    def add(self, tensor: torch.Tensor) -> int:
        """Count the storage of ``tensor``; returns the bytes added (0: counted before)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        key = storage_key(tensor)
        earlier = self._alive.get(key)
        if key in self.exclude or (earlier is not None and not earlier.expired()):
            return 0
        try:
            self._alive[key] = StorageWeakRef(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return 0
        size = storage_bytes(tensor)
        self.total += size
        return size


class _Chained:
    """What the outer hooks packed, kept for their unpack hook."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


@contextlib.contextmanager
def observe_saved(on_save: Callable[[torch.Tensor], object]) -> Iterator[None]:
    """Call ``on_save(tensor)`` for every tensor autograd saves for backward inside the block.

    The packed value never holds the tensor itself (autograd saving an output, as ``sigmoid``
    does, would otherwise make a reference cycle through the output's ``grad_fn`` that keeps
    it alive even after ``gc.collect()``). Hooks already installed outside the block (another
    audit, a CPU-offload hook) keep working: their pack and unpack run too.

    With :class:`StorageBytes` it measures the bytes a step saves for backward:

    >>> import torch
    >>> weight = torch.ones(4, 4, requires_grad=True)
    >>> saved = StorageBytes(exclude=[storage_key(weight)])  # the model holds it anyway
    >>> with observe_saved(saved.add):
    ...     y = (torch.ones(2, 4) @ weight).sigmoid()  # saves the input and the output
    >>> saved.total
    64
    """
    outer = outer_saved_tensors_hooks()
    if outer is None:
        # No hooks outside, or a torch that cannot say which: then this pair replaces those of
        # an enclosing observe_saved, so their callbacks are called from here.
        enclosing = () if knows_saved_tensors_hooks() else _OBSERVERS.get()
        if not knows_saved_tensors_hooks() and not enclosing and saved_tensors_hooks_active():
            raise needs(
                "Seeing saved tensors inside saved_tensors_hooks of your own (an audit inside "
                "activation offloading)",
                "torch._C._autograd._top_saved_tensors_default_hooks",
                since="2.7",
            )

        def pack(tensor: torch.Tensor) -> Any:
            for observer in (*enclosing, on_save):
                observer(tensor)
            return tensor.detach()

        def unpack(packed: Any) -> torch.Tensor:
            return packed  # type: ignore[no-any-return]

    else:
        outer_pack, outer_unpack = outer

        def pack(tensor: torch.Tensor) -> Any:
            on_save(tensor)
            return _Chained(outer_pack(tensor))

        def unpack(packed: Any) -> torch.Tensor:
            return outer_unpack(packed.packed)  # type: ignore[no-any-return]

    token = _OBSERVERS.set((*_OBSERVERS.get(), on_save))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _OBSERVERS.reset(token)
