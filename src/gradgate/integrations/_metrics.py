"""What the trainer callbacks log, one path for both: the keys are the same whatever the trainer.

At every optimizer step the driver takes the plan's numbers (:meth:`StepMetrics.planned`) and,
after backward, the gradients' (:meth:`StepMetrics.observed`); each callback hands
:meth:`StepMetrics.logged` to its trainer's own logger (TensorBoard, W&B, CSV: whatever the user
set) at its logging steps. Keys, all under ``gradgate/``:

- the schedule's: ``depth`` (depth plans), ``learning_blocks``, ``skipped_blocks``,
  ``learning_share``; Importance's ``learning_modules``, ``budget_used``, ``score/<module>``
  (once observed) and ``picks/<module>``;
- ``learning_parameters``: how many parameters learn under the plan (:func:`gradgate.learning`);
- ``learns/<block>``: the learning parameters of each block that learns (a block that does not
  is absent, never 0: a chart shows a gap where it rested);
- with ``grad_norms=True``, ``grad_norm/<block>``: the L2 norm of the gradients of each block
  that got some at this step (absent for the others).

A new metric is one entry here: both callbacks log it, under the same key.
"""

from __future__ import annotations

from typing import Any

import torch

from .._cut.gate import gate_points, gated_model
from .._tools.learning import Learning, learning
from ..schedules import Plan, Schedule

PREFIX = "gradgate/"


class StepMetrics:
    """The numbers of the current optimizer step, as both callbacks log them."""

    def __init__(self, *, grad_norms: bool) -> None:
        self.grad_norms = grad_norms
        self._planned: dict[str, float] = {}
        self._observed: dict[str, float] = {}

    def planned(self, gate: Any) -> Learning:
        """Take what learns under a step's plan, just set on ``gate``, and return it."""
        found = learning(gated_model(gate))
        numbers = {f"learns/{block}": count for block, count in found.blocks.items()}
        numbers["learning_parameters"] = found.count
        self._planned = {f"{PREFIX}{key}": float(value) for key, value in numbers.items()}
        self._observed = {}
        return found

    def observed(self, gate: Any) -> None:
        """After backward, before the optimizer step: each block's gradient norm (if asked)."""
        if not self.grad_norms:
            return
        model = gated_model(gate)
        names = {id(m): name for name, m in model.named_modules()}
        blocks, norms = [], []
        for _, block in gate_points(gate):
            grads = [p.grad for p in block.parameters() if p.grad is not None]
            if grads:
                blocks.append(names.get(id(block), ""))
                norms.append(torch.linalg.vector_norm(torch.stack([_norm(g) for g in grads])))
        if norms:  # one transfer for all the blocks
            values = torch.stack([n.to(norms[0].device) for n in norms]).tolist()
            self._observed = {
                f"{PREFIX}grad_norm/{block}": value
                for block, value in zip(blocks, values, strict=True)
            }

    def logged(self, schedule: Schedule, plan: Plan, gate: Any) -> dict[str, float]:
        """Everything to log for the current step: the schedule's numbers as they are now
        (Importance's scores include this step's gradients once observed), then ours."""
        numbers = schedule.metrics(plan, len(gate.blocks))
        found = {f"{PREFIX}{key}": float(value) for key, value in numbers.items()}
        return {**found, **self._planned, **self._observed}

    def clear(self) -> None:
        self._planned, self._observed = {}, {}


def _norm(grad: torch.Tensor) -> torch.Tensor:
    norm: torch.Tensor = torch.linalg.vector_norm(grad.detach().float())
    return norm
