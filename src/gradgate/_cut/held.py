"""Parameters a gated forward froze, kept frozen until backward is done with its graph."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .._plumbing.autograd import tensors_in
from .._plumbing.torch_internals import queue_after_backward


class Learners:
    """The modules one forward's graph gives gradients to: ``find()`` names them, only when a
    later forward before the backward freezes something (rarely: most steps have one forward and
    freeze nothing). Forwards with equal ``key`` have the same learners."""

    __slots__ = ("_find", "key")

    def __init__(
        self, key: tuple[Any, ...] = (), find: Callable[[], Iterable[nn.Module]] = tuple
    ) -> None:
        self.key, self._find = key, find

    @classmethod
    def of_run(
        cls,
        points: list[tuple[str, nn.Module]],
        ran: set[int],
        learn: range | frozenset[int] | None,
        skip: frozenset[int],
        extra: tuple[nn.Module, ...],
    ) -> Learners:
        """The blocks at ``ran`` (positions) that learn and are not skipped, and ``extra``."""

        def find() -> list[nn.Module]:
            blocks = [p for p in ran if learn is not None and p in learn and p not in skip]
            return [*(points[p][1] for p in blocks), *extra]

        return cls((learn, skip, extra, ran), find)

    def parameter_ids(self) -> set[int]:
        return {id(param) for module in self._find() for param in module.parameters()}


def graph_of(output: Any) -> list[torch.Tensor]:
    """The tensors in ``output`` that backward can start from."""
    return [tensor for tensor in tensors_in(output) if tensor.requires_grad]


class HeldFrozen:
    """Blocks frozen during a forward look frozen until its backward (activation checkpointing
    recomputes them there, with no module hook around, and must see the same flags).

    A parameter that learned in an earlier forward whose backward has not run yet (micro-batches
    with their own plans, one backward of the summed loss) is given back at once instead:
    autograd skips a leaf that no longer requires grad, and that forward's gradient would be lost.
    """

    def __init__(self) -> None:
        self.params: list[nn.Parameter] = []
        # what the forwards whose backward is pending learn: ids, and modules not looked up yet
        self._learned: set[int] = set()
        self._learners: list[Learners] = []
        # a plan changed after a forward: told when a backward starts (see _Cut._plan_changing)
        self.watch: weakref.WeakMethod[Callable[[], None]] | None = None

    def hold(
        self, params: list[nn.Parameter], graph: list[torch.Tensor], learners: Learners
    ) -> None:
        """Hold ``params`` frozen until the backward from ``graph`` (a forward's output tensors
        that require grad) is done."""
        if not graph:
            _give_back(params)
            return
        if params and (self._learners or self._learned):
            pending = self._pending()
            _give_back([p for p in params if id(p) in pending])
            params = [p for p in params if id(p) not in pending]
        self.params.extend(params)
        if not self._learners or self._learners[-1].key != learners.key:
            self._learners.append(learners)
        if len(self._learners) > 16:  # forwards with no backward (an evaluation with grad on)
            self._pending()
        queued: list[bool] = []

        def at_backward(*grads: Any) -> None:
            if not queued:
                queued.append(True)
                if self.watch is not None:
                    _call(self.watch)
                queue_after_backward(self.backward_done)  # else released at the next forward

        for tensor in graph:
            node = tensor.grad_fn  # a hook on the node: cheaper than a tensor's first hook
            (tensor.register_hook if node is None else node.register_prehook)(at_backward)

    def release(self) -> None:
        """Give back every parameter held frozen."""
        held, self.params = self.params, []
        _give_back(held)

    def backward_done(self) -> None:
        self.release()
        self._learned.clear()
        self._learners.clear()

    def _pending(self) -> set[int]:
        for learners in self._learners:
            self._learned |= learners.parameter_ids()
        self._learners.clear()
        return self._learned


def call_at_backward(
    callback: weakref.WeakMethod[Callable[[], None]],
    nodes: Iterable[Any] = (),
    param: nn.Parameter | None = None,
) -> Any:
    """Have ``callback`` called when a backward reaches one of the autograd ``nodes`` (their
    hooks go with their graph) or ``param`` (its hook comes off when that backward ends). Held
    weakly: a graph may outlive the gate that watches it. Returns the handle of ``param``'s
    hook (``None`` without one): a backward may never reach it, and the caller removes it."""

    def reached(*grads: Any) -> None:
        _call(callback)

    for node in nodes:
        node.register_prehook(reached)
    if param is None:
        return None
    handles: list[Any] = []

    def once(grad: torch.Tensor) -> None:
        queue_after_backward(handles[0].remove)  # not while autograd runs the hooks
        reached()

    handles.append(param.register_hook(once))
    return handles[0]


def _call(callback: weakref.WeakMethod[Callable[[], None]]) -> None:
    method = callback()
    if method is not None:
        method()


def _give_back(params: list[nn.Parameter]) -> None:
    for param in params:
        param.requires_grad_(True)
