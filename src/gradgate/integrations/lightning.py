"""A Lightning ``Callback`` that sets a schedule's plan on a gate every optimizer step.

Usage (``n`` is the number of blocks)::

    from gradgate.integrations.lightning import GateCallback

    callback = GateCallback(gg.schedules.GradualUnfreeze(n, every=100), model="backbone")
    lightning.Trainer(callbacks=[callback], ...).fit(module, data)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import Driver, cache_gate, require

require("lightning", "lightning")

from lightning.pytorch import Callback  # noqa: E402
from torch import nn  # noqa: E402

from .._cut.gate import BackpropGate  # noqa: E402
from .._cut.prefix_cache import PrefixCache  # noqa: E402
from .._cut.prefix_cache.keys import KEY_COLUMN  # noqa: E402
from .._plumbing.errors import InvalidOptionError  # noqa: E402
from .._select.names import Pattern, find_module  # noqa: E402
from ..schedules import Plan, Schedule  # noqa: E402

__all__ = ["GateCallback"]


class GateCallback(Callback):  # type: ignore[misc]
    """Drive a :class:`gradgate.BackpropGate` with a schedule inside ``lightning.Trainer``.

    The plan for ``trainer.global_step`` is set in ``on_train_batch_start``, before the
    batch's forward; under ``accumulate_grad_batches`` every batch of one optimizer step gets
    the same plan. Without a ``gate`` the callback gates, when fitting starts, the submodule
    named ``model`` (the one ``training_step`` calls, e.g. ``"net"``; ``None``: the
    LightningModule itself, for modules whose ``training_step`` calls ``self(...)``) and
    removes that gate when fitting ends. ``on_before_optimizer_step`` (after accumulation, with
    the gradients unscaled) calls ``schedule.observe(model)``, which
    :class:`gradgate.schedules.Importance` scores modules by. The plan's numbers are logged with
    ``pl_module.log`` as ``gradgate/depth`` (for depth plans), ``gradgate/learning_blocks``,
    ``gradgate/skipped_blocks`` and ``gradgate/learning_share`` (Importance:
    ``gradgate/learning_modules``, ``gradgate/budget_used``, ``gradgate/score/<module>`` and
    ``gradgate/picks/<module>``). ``drop_state=True`` frees the optimizer state of blocks the
    schedule says never learn again (and of the modules Importance did not draw for the next
    step). Checkpoints keep the schedule's ``state_dict()``. With non-reentrant
    activation checkpointing inside the blocks, pass ``freeze_for_step=True``: the blocks that
    do not learn in a step stay frozen for the whole step, so the backward's recomputation sees
    the flags their forward saw.

    ``cache=gg.PrefixCache(gate)`` drives that cache's gate; train on
    ``gg.PrefixCache.keyed(dataset)`` (dict items): the callback takes each batch's
    ``gradgate_key`` out before ``training_step`` and the model's forwards in that step see
    those keys.
    """

    def __init__(
        self,
        schedule: Schedule,
        gate: BackpropGate | None = None,
        *,
        model: str | None = None,
        blocks: Sequence[Pattern] | str | None = None,
        log: bool = True,
        drop_state: bool = True,
        freeze_for_step: bool = False,
        cache: PrefixCache | None = None,
    ) -> None:
        if model is not None and cache is not None:
            raise InvalidOptionError(
                f"model={model!r} with cache=...; expected one of them: the callback drives the "
                "cache's gate."
            )
        gate = cache_gate(cache, gate)
        self._cache = cache
        self._keys: Any = None  # the keys' context, open for a batch's step
        if model is not None and (gate is not None or not isinstance(model, str)):
            raise InvalidOptionError(
                f"model={model!r} with gate={gate!r}; expected the name of the LightningModule's "
                "submodule to gate (a string), and no gate, or a gate and no model."
            )
        self._model = model
        self._driver = Driver(schedule, gate, blocks=blocks, log=log, drop_state=drop_state)
        if not isinstance(freeze_for_step, bool):
            raise InvalidOptionError(
                f"freeze_for_step={freeze_for_step!r}; expected True or False."
            )
        self._driver.hold_frozen = freeze_for_step

    @property
    def gate(self) -> BackpropGate | None:
        """The gate this callback drives (made when fitting starts if none was given)."""
        return self._driver.gate

    @property
    def plan(self) -> Plan | None:
        """The plan of the current (or last) step."""
        return self._driver.plan

    # -- Trainer hooks ---------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        target = pl_module if self._model is None else find_module(pl_module, self._model)[1]
        self._driver.attach(target)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._driver.begin_step(trainer.global_step)
        if self._cache is not None and isinstance(batch, dict) and KEY_COLUMN in batch:
            self._keys = self._cache.keys(batch.pop(KEY_COLUMN))  # the step's forwards see them
            self._keys.__enter__()
        if self._driver.log:
            metrics = self._driver.metrics()
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._driver.observe()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._release_keys()
        if self._cache is not None and batch_idx == 0:
            self._cache._warn_if_unkeyed()
        self._driver.end_step(trainer.optimizers, trainer.global_step)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._release_keys()
        self._driver.detach()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._release_keys()
        self._driver.detach()

    def _release_keys(self) -> None:
        keys, self._keys = self._keys, None
        if keys is not None:
            keys.__exit__(None, None, None)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self._driver.schedule.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._driver.schedule.load_state_dict(state_dict["schedule"])
