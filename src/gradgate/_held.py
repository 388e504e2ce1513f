"""Parameters a gated forward froze, kept frozen until backward is done with its graph."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ._autograd import tensors_in
from ._torch_internals import queue_after_backward


class HeldFrozen:
    """Blocks frozen during a forward look frozen until its backward (activation checkpointing
    recomputes them there, with no module hook around, and must see the same flags).

    A parameter that learned in an earlier forward whose backward has not run yet (micro-batches
    with their own plans, one backward of the summed loss) is given back at once instead:
    autograd skips a leaf that no longer requires grad, and that forward's gradient would be lost.
    """

    def __init__(self) -> None:
        self.params: list[nn.Parameter] = []
        self._learners: set[int] = set()  # ids of parameters pending forwards learn

    def hold(self, params: list[nn.Parameter], output: Any, learners: Iterable[Any]) -> None:
        graph = [t for t in tensors_in(output) if t.requires_grad]
        if not graph:
            _give_back(params)
            return
        pending = self._learners
        _give_back([p for p in params if id(p) in pending])
        self.params.extend(p for p in params if id(p) not in pending)
        pending.update(id(p) for p in learners)
        queued: list[bool] = []

        def at_backward(grad: torch.Tensor) -> None:
            if not queued:
                queued.append(True)
                queue_after_backward(self.backward_done)  # else released at the next forward

        for tensor in graph:
            tensor.register_hook(at_backward)

    def release(self) -> None:
        """Give back every parameter held frozen."""
        held, self.params = self.params, []
        _give_back(held)

    def backward_done(self) -> None:
        self.release()
        self._learners.clear()


def _give_back(params: list[nn.Parameter]) -> None:
    for param in params:
        param.requires_grad_(True)
