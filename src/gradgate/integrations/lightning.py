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
from lightning.pytorch.callbacks import ModelSummary  # noqa: E402
from lightning.pytorch.utilities.model_summary.model_summary import (  # noqa: E402
    get_human_readable_count,
)
from torch import nn  # noqa: E402

from .._cut.gate import BackpropGate  # noqa: E402
from .._cut.prefix_cache import PrefixCache  # noqa: E402
from .._cut.prefix_cache.keys import KEY_COLUMN  # noqa: E402
from .._plumbing.errors import InvalidOptionError  # noqa: E402
from .._select.names import Pattern, find_module  # noqa: E402
from .._tools.learning import learning  # noqa: E402
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
    :class:`gradgate.schedules.Importance` scores modules by. The step's numbers are logged with
    ``pl_module.log`` (so through the trainer's loggers, at its ``log_every_n_steps``) after
    each batch, the same keys as the Hugging Face callback's: ``gradgate/depth`` (for depth
    plans), ``gradgate/learning_blocks``, ``gradgate/skipped_blocks``,
    ``gradgate/learning_share``, ``gradgate/learning_parameters``, ``gradgate/learns/<block>``
    for each block that learns (absent, not 0, for one that does not), with ``grad_norms=True``
    ``gradgate/grad_norm/<block>`` (Importance: ``gradgate/learning_modules``,
    ``gradgate/budget_used``, ``gradgate/score/<module>`` and ``gradgate/picks/<module>``).
    The trainer's model summary counts as trainable the parameters that learn under the plan of
    the first step and has a ``Learns`` column (see :func:`gradgate.learning`).
    ``drop_state=True`` frees the optimizer state of blocks the
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
        grad_norms: bool = False,
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
        self._driver = Driver(
            schedule, gate, blocks=blocks, log=log, drop_state=drop_state, grad_norms=grad_norms
        )
        self._summaries: list[Any] = []  # the trainer's ModelSummary callbacks, while fitting
        self._attached: Any = None  # the LightningModule attached to in this fit
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
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._summaries = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
            for summary in self._summaries:  # it may run before on_fit_start gates the model
                columns = type(summary).summarize is ModelSummary.summarize  # any columns
                summary.summarize = _PlanSummary(
                    self, trainer, pl_module, summary.summarize, column=columns
                )

    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        self._attach(pl_module)

    def _attach(self, pl_module: nn.Module) -> None:
        """Attach once per fit (the summary may ask first): gate the model, or check the gate."""
        if self._attached is not pl_module:
            target = pl_module if self._model is None else find_module(pl_module, self._model)[1]
            self._driver.attach(target)
            self._attached = pl_module

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._driver.begin_step(trainer.global_step)
        if self._cache is not None and isinstance(batch, dict) and KEY_COLUMN in batch:
            self._keys = self._cache.keys(batch.pop(KEY_COLUMN))  # the step's forwards see them
            self._keys.__enter__()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._driver.observe()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._release_keys()
        if self._cache is not None and batch_idx == 0:
            self._cache._warn_if_unkeyed()
        step = self._driver.step
        stepped = step is not None and trainer.global_step > step  # the last micro-batch
        if self._driver.log and step is not None and stepped and _logs_at(trainer, step):
            logged = self._driver.logged()  # the step's numbers, gradient norms included
            for logger in trainer.loggers:  # not pl_module.log: it would repeat a key that
                logger.log_metrics(logged, step=step)  # rests at later steps, not leave it out
        self._driver.end_step(trainer.optimizers, trainer.global_step)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._release_keys()
        self._driver.detach()
        self._attached = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._release_keys()
        self._driver.detach()
        self._attached = None
        self._restore_summaries()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._restore_summaries()

    def _restore_summaries(self) -> None:
        for summary in self._summaries:
            if isinstance(vars(summary).get("summarize"), _PlanSummary):
                del summary.summarize  # the class's own again
        self._summaries = []

    def _release_keys(self) -> None:
        keys, self._keys = self._keys, None
        if keys is not None:
            keys.__exit__(None, None, None)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self._driver.schedule.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._driver.schedule.load_state_dict(state_dict["schedule"])


def _logs_at(trainer: Any, step: int) -> bool:
    """Whether the trainer writes its logs at optimizer step ``step`` (its rule: every
    ``log_every_n_steps``, and the last step)."""
    every = trainer.log_every_n_steps
    return bool(every) and ((step + 1) % every == 0 or trainer.should_stop)


class _PlanSummary:
    """The trainer's ``ModelSummary.summarize`` with the plan in it: its trainable count is
    :func:`gradgate.learning`'s (the parameters that learn under the first step's plan, not
    those that require grad), and where the table takes any columns (``ModelSummary``'s; not
    ``RichModelSummary``'s fixed ones) a ``Learns`` column gives each layer's."""

    def __init__(
        self, owner: GateCallback, trainer: Any, pl_module: Any, inner: Any, *, column: bool
    ) -> None:
        self.owner, self.trainer, self.pl_module, self.inner = owner, trainer, pl_module, inner
        self.column = column

    def __call__(
        self,
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self.owner._attach(self.pl_module)
        self.owner._driver.preview(self.trainer.global_step)
        found = learning(self.pl_module)
        columns = dict(summary_data)
        learns = [get_human_readable_count(found.within(name)) for name in columns.get("Name", [])]
        at = next((i + 1 for i, (title, _) in enumerate(summary_data) if title == "Params"), None)
        data = list(summary_data)
        if self.column and at is not None and learns:
            data.insert(at, ("Learns", learns))
        self.inner(data, total_parameters, found.count, *args, **kwargs)
