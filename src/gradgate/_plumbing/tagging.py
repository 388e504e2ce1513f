"""Which module created an autograd node? One answer, shared by audit and graph.

While a :class:`ModuleTagger` is active, every module call is watched: when the call returns,
the nodes reachable from its outputs that were created during the call (autograd numbers nodes
in creation order) and not yet tagged by an inner call are tagged with the module's name. So
each node belongs to the innermost module whose forward created it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from .autograd import Node, is_leaf, tensors_in, walk
from .hook_set import HookSet
from .hooks import GateHook
from .torch_internals import next_sequence_nr, sequence_nr


def runs_itself(module: nn.Module) -> bool:
    """Whether ``module`` has a forward of its own. Containers (``nn.ModuleList``,
    ``nn.ModuleDict``, ``nn.ParameterList``, ``nn.ParameterDict``) have none and are never
    called, so a forward hook on one never runs, not even to remove itself from a copy.

    >>> runs_itself(nn.Linear(2, 2)), runs_itself(nn.ModuleList([nn.Linear(2, 2)]))
    (True, False)
    """
    return "forward" in vars(module) or type(module).forward is not nn.Module.forward


@dataclass
class _Call:
    name: str
    module: nn.Module
    start: int  # the sequence number the first node created inside the call gets


class ModuleTagger:
    """Tags autograd nodes with the qualified name of the module that created them.

    ``labels`` maps node -> module name; ``on_tag(node, name)`` is called for each new tag.
    ``current()`` names the innermost module running now (``None`` outside the model).
    Hooks are registered on ``__enter__`` (not on containers such as ``nn.ModuleList``, which
    are never called) and all removed on ``__exit__``; a copy of the model made meanwhile
    (``copy.deepcopy``, ``torch.save``) sheds them at its first forward.

        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> with ModuleTagger(net) as tagger:
        ...     y = net(torch.randn(1, 2))
        >>> tagger.labels[y.grad_fn]
        '1'
    """

    def __init__(
        self, model: nn.Module, on_tag: Callable[[Node, str], object] | None = None
    ) -> None:
        self.model = model
        self.labels: dict[Node, str] = {}
        self.forward_seen = False
        self._on_tag = on_tag
        self._local = threading.local()
        self._hooks = HookSet()
        self._active = False

    # -- registration ------------------------------------------------------------------------
    def __enter__(self) -> ModuleTagger:
        try:
            for name, module in self.model.named_modules():
                if not runs_itself(module):
                    continue  # a container: it is never called, its members are
                # from a wrapper around forward while the module has no other hook: a module
                # hook would turn off nn.TransformerEncoderLayer's fused kernel (see HookSet)
                entered, left = GateHook(self, "_entered", name), GateHook(self, "_left", name)
                self._hooks.around(module, entered, left, always=True)
        except BaseException:
            self.remove()
            raise
        self._active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove every hook this tagger registered (a second call does nothing)."""
        self._hooks.remove()
        self._active = False
        self._local = threading.local()

    @property
    def active(self) -> bool:
        """Whether the hooks are registered."""
        return self._active

    # -- the calls ---------------------------------------------------------------------------
    def _stack(self) -> list[_Call]:
        stack: list[_Call] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def current(self) -> str | None:
        """The innermost module of the model running now in this thread, else ``None``."""
        stack = self._stack()
        return stack[-1].name if stack else None

    def _entered(self, name: str, module: nn.Module, args: Any) -> None:
        self.forward_seen = True
        self._stack().append(_Call(name, module, next_sequence_nr()))

    def _left(self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        stack = self._stack()
        if not stack or stack[-1].module is not module:
            return  # our pre-hook did not run for this call (an earlier hook raised)
        call = stack.pop()
        self.tag(tensors_in(output), call.name, call.start)

    def tag(self, outputs: list[torch.Tensor], name: str, start: int) -> None:
        """Tag the nodes behind ``outputs`` created since sequence number ``start`` and not
        tagged yet with ``name``."""

        def created_here(node: Node) -> bool:
            return not is_leaf(node) and sequence_nr(node) >= start

        roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
        for node in walk(roots, enter=created_here):
            if node not in self.labels:
                self.labels[node] = name
                if self._on_tag is not None:
                    self._on_tag(node, name)
