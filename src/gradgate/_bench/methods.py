"""The five ways to train with depth ``k``, each one optimizer step on one model.

* ``full``: ordinary full backprop (depth is ignored);
* ``late-freeze``: ``requires_grad=False`` set on the prefix *after* the forward;
* ``toggle``: ``requires_grad`` set on every parameter before each forward (the usual idiom);
* ``gradgate``: a :class:`gradgate.BackpropGate` whose ``depth`` is set every step;
* ``ideal``: the hand-written prefix under ``torch.no_grad()``, then the suffix.

``gradgate`` runs on its own copy of the model so that its hooks never touch the others.
With ``amp`` set, every method runs its forward and loss under ``torch.autocast`` (the
backward and the optimizer step outside it, as usual); the parameters stay float32.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradgate as gg

from .workloads import Depth, Workload

METHODS = ("full", "late-freeze", "toggle", "gradgate", "ideal")
AMP_DTYPES = {"bf16": torch.bfloat16}


def configurations(depths: list[Depth]) -> list[tuple[str, Depth]]:
    """(method, depth) pairs to measure; ``full``, and depth ``None`` for every method but
    ``late-freeze`` and ``toggle`` (which are full backprop there), once each.

    >>> configurations([0, None])
    [('full', None), ('late-freeze', 0), ('toggle', 0), ('gradgate', 0), ('ideal', 0), \
('gradgate', None), ('ideal', None)]
    """
    pairs: list[tuple[str, Depth]] = [("full", None)]
    for depth in depths:
        for method in METHODS[1:]:
            if depth is not None or method in ("gradgate", "ideal"):
                pairs.append((method, depth))
    return pairs


class Runner:
    """Holds a workload's plain model, a gated copy, their optimizers; runs steps."""

    def __init__(self, workload: Workload, *, lr: float = 1e-4, amp: str | None = None) -> None:
        self.workload = workload
        self.amp = amp
        self.model = workload.model
        self.gated = copy.deepcopy(workload.model)
        self.gate = gg.BackpropGate(self.gated, blocks=workload.blocks)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.gated_optimizer = torch.optim.SGD(self.gated.parameters(), lr=lr)
        self._prefix: dict[Depth, list[torch.Tensor]] = {}
        self._steps: dict[str, Callable[[Depth, Callable[[torch.Tensor], None]], None]] = {
            "full": self._full,
            "late-freeze": self._late_freeze,
            "toggle": self._toggle,
            "gradgate": self._gradgate,
            "ideal": self._ideal,
        }

    def model_for(self, method: str) -> nn.Module:
        """The model instance a method trains."""
        return self.gated if method == "gradgate" else self.model

    def prefix(self, depth: Depth) -> list[torch.Tensor]:
        """The parameters that must not learn at this depth (computed once per depth)."""
        if depth not in self._prefix:
            self._prefix[depth] = self.workload.prefix_parameters(self.model, depth)
        return self._prefix[depth]

    def step(
        self,
        method: str,
        depth: Depth,
        *,
        backward: Callable[[torch.Tensor], None] | None = None,
        keep_grads: bool = False,
    ) -> None:
        """One training step; ``backward(loss)`` replaces ``loss.backward()`` (for counting).

        ``keep_grads=True`` skips the optimizer and leaves the ``.grad`` fields for inspection.
        """
        run_backward = backward or _plain_backward
        self._steps[method](depth, run_backward)
        if keep_grads:
            return
        optimizer = self.gated_optimizer if method == "gradgate" else self.optimizer
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` on the workload's device when ``amp`` is set, else nothing."""
        if self.amp is None:
            return contextlib.nullcontext()
        device_type = self.workload.batch.device.type
        return torch.autocast(device_type, dtype=AMP_DTYPES[self.amp])

    def loss(self, model: nn.Module, depth: Depth = None, *, ideal: bool = False) -> torch.Tensor:
        """The loss of one forward (the hand-written ideal one with ``ideal=True``)."""
        w = self.workload
        with self.autocast():
            output = w.ideal_forward(model, w.batch, depth) if ideal else w.forward(model, w.batch)
            return w.loss(output)

    def close(self) -> None:
        """Remove the gate's hooks."""
        self.gate.remove()

    # -- the methods -------------------------------------------------------------------------
    def _full(self, depth: Depth, backward: Callable[[torch.Tensor], None]) -> None:
        backward(self.loss(self.model))

    def _late_freeze(self, depth: Depth, backward: Callable[[torch.Tensor], None]) -> None:
        loss = self.loss(self.model)
        prefix = self.prefix(depth)
        for param in prefix:
            param.requires_grad_(False)
        try:
            backward(loss)
        finally:
            for param in prefix:
                param.requires_grad_(True)

    def _toggle(self, depth: Depth, backward: Callable[[torch.Tensor], None]) -> None:
        frozen = {id(param) for param in self.prefix(depth)}
        for param in self.model.parameters():
            param.requires_grad_(id(param) not in frozen)
        try:
            backward(self.loss(self.model))
        finally:
            for param in self.model.parameters():
                param.requires_grad_(True)

    def _gradgate(self, depth: Depth, backward: Callable[[torch.Tensor], None]) -> None:
        self.gate.depth = depth
        backward(self.loss(self.gated))

    def _ideal(self, depth: Depth, backward: Callable[[torch.Tensor], None]) -> None:
        backward(self.loss(self.model, depth, ideal=True))


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()
