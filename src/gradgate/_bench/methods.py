"""The five ways to train with depth ``k``, each one optimizer step on one model.

* ``full``: ordinary full backprop (depth is ignored);
* ``late-freeze``: ``requires_grad=False`` set on the prefix *after* the forward;
* ``toggle``: ``requires_grad`` set on every parameter before each forward (the usual idiom);
* ``gradgate``: a :class:`gradgate.BackpropGate` whose ``depth`` is set every step;
* ``ideal``: the hand-written prefix under ``torch.no_grad()``, then the suffix.

Every method trains its own copy of the model (``gradgate``'s also keeps its hooks away from
the others): the rounds interleave the methods, and a method sharing a copy would find weights
in the cache that another method's step had just used (``tools/bench_aa.py``,
``benchmarks/RESULTS.md``).

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
    """Holds a workload's model, a copy per other method (the gated one among them), their
    optimizers; runs steps."""

    def __init__(self, workload: Workload, *, lr: float = 1e-4, amp: str | None = None) -> None:
        self.workload = workload
        self.amp = amp
        self.model = workload.model  # full backprop's
        self._models = {
            method: self.model if method == "full" else copy.deepcopy(workload.model)
            for method in METHODS
        }
        self.gated = self._models["gradgate"]
        self.gate = gg.BackpropGate(self.gated, blocks=workload.blocks)
        self._optimizers = {
            method: torch.optim.SGD(model.parameters(), lr=lr)
            for method, model in self._models.items()
        }
        self._prefix: dict[tuple[int, Depth], list[torch.Tensor]] = {}
        self._steps: dict[str, Callable[[Depth, Callable[[torch.Tensor], None]], None]] = {
            "full": self._full,
            "late-freeze": self._late_freeze,
            "toggle": self._toggle,
            "gradgate": self._gradgate,
            "ideal": self._ideal,
        }

    def model_for(self, method: str) -> nn.Module:
        """The model instance a method trains."""
        return self._models[method]

    def prefix(self, depth: Depth, model: nn.Module | None = None) -> list[torch.Tensor]:
        """The parameters of ``model`` (full backprop's by default) that must not learn at this
        depth (computed once per model and depth)."""
        model = self.model if model is None else model
        key = (id(model), depth)
        if key not in self._prefix:
            self._prefix[key] = self.workload.prefix_parameters(model, depth)
        return self._prefix[key]

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
        optimizer = self._optimizers[method]
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
        model = self._models["late-freeze"]
        loss = self.loss(model)
        prefix = self.prefix(depth, model)
        for param in prefix:
            param.requires_grad_(False)
        try:
            backward(loss)
        finally:
            for param in prefix:
                param.requires_grad_(True)

    def _toggle(self, depth: Depth, backward: Callable[[torch.Tensor], None]) -> None:
        model = self._models["toggle"]
        frozen = {id(param) for param in self.prefix(depth, model)}
        for param in model.parameters():
            param.requires_grad_(id(param) not in frozen)
        try:
            backward(self.loss(model))
        finally:
            for param in model.parameters():
                param.requires_grad_(True)

    def _gradgate(self, depth: Depth, backward: Callable[[torch.Tensor], None]) -> None:
        self.gate.depth = depth
        backward(self.loss(self.gated))

    def _ideal(self, depth: Depth, backward: Callable[[torch.Tensor], None]) -> None:
        backward(self.loss(self._models["ideal"], depth, ideal=True))


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()
