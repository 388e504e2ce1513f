"""Training-framework callbacks that drive a gate with a schedule (imported only when used).

``from gradgate.integrations.transformers import GateCallback`` (an HF ``TrainerCallback``) and
``from gradgate.integrations.lightning import GateCallback`` (a Lightning ``Callback``) set the
schedule's plan before every optimizer step's first forward (the same plan for every
micro-batch of a step under gradient accumulation), let the schedule observe the gradients
before the optimizer step (``Importance`` scores modules by them), log the plan to the
trainer's own loggers, and drop the optimizer state of blocks that will never learn again. The
plan follows the trainer's ``global_step``, so a run resumed from a checkpoint continues the
same sequence.

This package imports neither transformers nor lightning; each submodule imports its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from importlib import import_module
from typing import Any

import torch
from torch import nn

from .._cut.gate import BackpropGate, gate_points, gated_model
from .._plumbing.errors import AlreadyGatedError, InvalidOptionError, MissingExtraError
from .._select.names import Pattern
from .._tools.learning import Learning, learning
from ..optim import drop_finished
from ..schedules import Plan, Schedule
from ._metrics import StepMetrics

__all__: list[str] = []
_FRAMEWORKS = ("deepspeed", "lightning", "transformers")


def __getattr__(name: str) -> Any:
    if name in _FRAMEWORKS:  # gg.integrations.transformers imports it on first use
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module 'gradgate.integrations' has no attribute {name!r}")


def require(module: str, pip_name: str) -> None:
    """Raise :class:`MissingExtraError` with the pip command when ``module`` is absent."""
    try:
        __import__(module)
    except ImportError:
        raise MissingExtraError(
            f"gradgate.integrations.{module} needs {pip_name}, which is not installed; install "
            f"it with: pip install {pip_name}"
        ) from None


class Driver:
    """What both callbacks do: plan per optimizer step, metrics, optimizer state to drop."""

    def __init__(
        self,
        schedule: Schedule,
        gate: BackpropGate | None,
        *,
        blocks: Sequence[Pattern] | str | None,
        log: bool,
        drop_state: bool,
        grad_norms: bool = False,
    ) -> None:
        if not isinstance(schedule, Schedule):
            raise InvalidOptionError(
                f"schedule={schedule!r}; expected a gradgate.schedules schedule, e.g. "
                "gg.schedules.LISA(n, k=2, every=20)."
            )
        if gate is not None and not isinstance(gate, BackpropGate):
            raise InvalidOptionError(
                f"gate={gate!r}; expected a gradgate.BackpropGate or None (the callback then "
                "gates the trainer's model)."
            )
        for option, value in (("log", log), ("drop_state", drop_state), ("grad_norms", grad_norms)):
            if not isinstance(value, bool):
                raise InvalidOptionError(f"{option}={value!r}; expected True or False.")
        self.schedule = schedule
        self.gate = gate
        self.blocks = blocks
        self.log = log
        self.drop_state = drop_state
        self.owns_gate = False
        self.step: int | None = None
        self.plan: Plan | None = None
        self.dropped: frozenset[int] = frozenset()
        self.dropped_modules: frozenset[str] = frozenset()
        self.hold_frozen = False  # freeze non-learning blocks for the whole step (checkpointing)
        self._held: list[nn.Parameter] = []
        self.metrics = StepMetrics(grad_norms=grad_norms)  # what both callbacks log

    def attach(self, model: nn.Module) -> None:
        """Gate ``model`` unless a gate was given (or made already)."""
        if self.gate is not None and self.gate.active:
            _require_same_model(gated_model(self.gate), model)
        if self.gate is None or not self.gate.active:
            try:
                self.gate = BackpropGate(model, self.blocks)
            except AlreadyGatedError as error:  # the user's own gate: the callback can use it
                hint = "Or give that gate to the callback: GateCallback(schedule, gate=gate)."
                raise AlreadyGatedError(f"{error} {hint}") from None
            self.owns_gate = True
        self.schedule._check_gate(self.gate)

    def begin_step(self, step: int) -> Plan:
        """Set the plan of optimizer step ``step`` (once per step, whatever the micro-batches)."""
        assert self.gate is not None, "attach() first"
        if step != self.step or self.plan is None:
            self.plan = self.schedule.apply(self.gate, step)
            self.step = step
            self._release()  # what the last step held frozen learns again if the plan says so
            learns = self.metrics.planned(self.gate)
            self._hold(learns)
        return self.plan

    def learning(self) -> Learning:
        """What learns in the gated model now (its plan, its freezing)."""
        assert self.gate is not None, "attach() first"
        return learning(gated_model(self.gate))

    def preview(self, step: int) -> None:
        """Set the plan of ``step`` on the gate without moving the schedule on (for a summary
        shown before training: the first step sets it again, the schedule's way)."""
        assert self.gate is not None, "attach() first"
        if self.plan is None:
            self.schedule._bind(self.gate)
            self.schedule.plan(step).apply(self.gate)

    def _hold(self, learns: Learning) -> None:
        """With activation checkpointing, keep the non-learning blocks frozen for the step.

        The gate freezes a non-learning block only while it runs; checkpointing recomputes the
        block's forward in the backward, outside that call, where its parameters would require
        grad again and the recomputed graph would differ from the saved one (CheckpointError).
        Frozen for the whole step, the recomputation sees what the forward saw.
        """
        if not self.hold_frozen or self.gate is None:
            return
        for _, module in gate_points(self.gate):
            for param in module.parameters():
                if param.requires_grad and not learns.learns(param):
                    param.requires_grad_(False)
                    self._held.append(param)

    def _release(self) -> None:
        for param in self._held:
            param.requires_grad_(True)
        self._held = []

    def observe(self) -> None:
        """Let the schedule read this step's gradients (after backward, before the step)."""
        if self.gate is not None and self.plan is not None:
            self.schedule.observe(gated_model(self.gate))
            self.metrics.observed(self.gate)

    def end_step(self, optimizers: Iterable[Any], next_step: int) -> None:
        """Drop the state of the blocks (and modules) the schedule rests from ``next_step`` on."""
        if not self.drop_state or self.gate is None:
            return
        finished = self.schedule.resting(next_step)
        modules = self.schedule.resting_modules(next_step)
        if finished == self.dropped and modules == self.dropped_modules:
            return
        for optimizer in optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate / Lightning wrappers
            if isinstance(inner, torch.optim.Optimizer):
                drop_finished(inner, self.gate, self.schedule, next_step)
        self.dropped, self.dropped_modules = finished, modules

    def logged(self) -> dict[str, float]:
        """What the callbacks log for the current step (see ``_metrics``), ``gradgate/...``."""
        if self.gate is None or self.plan is None:
            return {}
        return self.metrics.logged(self.schedule, self.plan, self.gate)

    def detach(self) -> None:
        """Give back the parameters held frozen; remove the gate if this driver made it."""
        self._release()
        if self.owns_gate and self.gate is not None:
            self.gate.remove()
            self.gate = None
            self.owns_gate = False
        self.step = self.plan = None
        self.metrics.clear()


def cache_gate(cache: Any, gate: BackpropGate | None) -> BackpropGate | None:
    """The gate a callback drives with ``cache=``: the cache's (``gate`` must be it, or None)."""
    if cache is None:
        return gate
    from .._cut.prefix_cache import PrefixCache

    if not isinstance(cache, PrefixCache):
        raise InvalidOptionError(
            f"cache={cache!r:.80}; expected a gg.PrefixCache (on the gate to drive) or None."
        )
    if gate is not None and gate is not cache.gate:
        raise InvalidOptionError(
            f"gate={gate!r} is not the cache's gate ({cache.gate!r}); pass cache= alone: the "
            "callback drives the cache's gate."
        )
    return cache.gate


def _require_same_model(gated: nn.Module, trained: nn.Module) -> None:
    """A gate on a model the trainer does not run would log plans that never happen."""
    if any(m is gated for m in trained.modules()) or any(m is trained for m in gated.modules()):
        return
    raise InvalidOptionError(
        f"the callback's gate is on a {type(gated).__name__} that the Trainer does not train "
        f"(it trains a {type(trained).__name__}); gate the trainer's model, or leave gate= out "
        "so that the callback gates it when training begins."
    )
