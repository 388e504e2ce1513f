"""A Hugging Face ``TrainerCallback`` that sets a schedule's plan on a gate every step.

Usage (``n`` is the number of blocks, ``len(gg.blocks(model))``)::

    from gradgate.integrations.transformers import GateCallback

    callback = GateCallback(gg.schedules.LISA(n, k=2, every=20))
    trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
    callback.put_first(trainer)  # so that reporters (wandb, TensorBoard) see the numbers too
    trainer.train()
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from . import Driver, cache_gate, require

require("transformers", "transformers")

from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.utils import logging  # noqa: E402

from .._cut.gate import BackpropGate  # noqa: E402
from .._cut.prefix_cache import PrefixCache  # noqa: E402
from .._plumbing.errors import GradgateWarning, InvalidOptionError, warn  # noqa: E402
from .._select.names import Pattern  # noqa: E402
from ..schedules import Plan, Schedule  # noqa: E402

__all__ = ["GateCallback"]

STATE_FILE = "gradgate_schedule.json"  # the schedule's state_dict() in each checkpoint


class GateCallback(TrainerCallback):  # type: ignore[misc]
    """Drive a :class:`gradgate.BackpropGate` with a schedule inside ``transformers.Trainer``.

    The plan for optimizer step ``state.global_step`` is set in ``on_step_begin``, before the
    step's first forward; every micro-batch of a gradient-accumulation step uses it. Without a
    ``gate`` the callback gates the trainer's model (``blocks`` as for ``BackpropGate``) when
    training begins and removes that gate when it ends. ``on_pre_optimizer_step`` (after the
    gradients are accumulated, unscaled and clipped) calls ``schedule.observe(model)``, which
    :class:`gradgate.schedules.Importance` scores modules by. ``on_log`` (the Trainer's
    ``logging_steps``) adds the step's numbers to the logs, the same keys as the Lightning
    callback's: ``gradgate/depth`` (for depth plans), ``gradgate/learning_blocks``,
    ``gradgate/skipped_blocks``, ``gradgate/learning_share``, ``gradgate/learning_parameters``,
    ``gradgate/learns/<block>`` for each block that learns (absent, not 0, for one that does
    not), with ``grad_norms=True`` ``gradgate/grad_norm/<block>`` (Importance:
    ``gradgate/learning_modules``, ``gradgate/budget_used``, ``gradgate/score/<module>`` and
    ``gradgate/picks/<module>``); reporters registered before this callback (those of
    ``report_to``) see them only after :meth:`put_first`. When training begins, the callback
    logs the number of parameters that learn under the first step's plan under the Trainer's
    own "Number of trainable parameters", which counts ``requires_grad`` and so ignores the
    gate (see :func:`gradgate.learning`). ``drop_state=True`` frees the
    optimizer state of blocks the schedule says never learn again (and of the modules
    Importance did not draw for the next step).

    Each checkpoint gets the schedule's ``state_dict()`` as ``gradgate_schedule.json``;
    ``trainer.train(resume_from_checkpoint=...)`` loads it back (the callback must have been
    given to the Trainer, or placed with :meth:`put_first`), so that Importance's scores and
    draw continue where they were.

    Works with non-reentrant gradient checkpointing
    (``activation_checkpointing_kwargs={"use_reentrant": False}``, named
    ``gradient_checkpointing_kwargs`` before transformers 5.23): then (or with
    ``freeze_for_step=True``) the blocks that do not learn in a step are kept frozen
    (``requires_grad=False``) for the whole step, so that the backward's recomputation of a
    block sees the flags its forward saw; they are given back at the next step and at the end.

    transformers has no exception event: so that an exception inside ``trainer.train()`` (a
    ``KeyboardInterrupt``) still removes the gate and gives back the parameters held frozen,
    the callback wraps ``trainer.train`` when the Trainer is built with it (or at
    :meth:`put_first`, for one added later with ``add_callback``).

    When the Trainer runs DeepSpeed (``TrainingArguments(deepspeed=...)``), the callback makes
    its ZeRO optimizer step only the parameters that learned
    (:func:`gradgate.integrations.deepspeed.step_learners_only`), until training ends.

    ``cache=gg.PrefixCache(gate)`` drives that cache's gate; train on
    ``gg.PrefixCache.keyed(dataset)``, whose items carry their index as ``gradgate_key``: the
    Trainer passes it to the model call (the cached model's forward names it, so
    ``remove_unused_columns`` keeps it), where the cache takes it out.
    """

    def __init__(
        self,
        schedule: Schedule,
        gate: BackpropGate | None = None,
        *,
        blocks: Sequence[Pattern] | str | None = None,
        log: bool = True,
        drop_state: bool = True,
        freeze_for_step: bool | None = None,
        cache: PrefixCache | None = None,
        grad_norms: bool = False,
    ) -> None:
        gate = cache_gate(cache, gate)
        self._cache = cache
        self._driver = Driver(
            schedule, gate, blocks=blocks, log=log, drop_state=drop_state, grad_norms=grad_norms
        )
        if freeze_for_step is not None and not isinstance(freeze_for_step, bool):
            raise InvalidOptionError(
                f"freeze_for_step={freeze_for_step!r}; expected True, False or None (None: "
                "True when the model uses gradient checkpointing)."
            )
        self._freeze_for_step = freeze_for_step
        self._deepspeed: Any = None  # LearnersOnly while the Trainer runs DeepSpeed
        self._resume: Any = None  # train()'s resume_from_checkpoint, for the schedule's state

    @property
    def gate(self) -> BackpropGate | None:
        """The gate this callback drives (made at train begin when none was given)."""
        return self._driver.gate

    @property
    def plan(self) -> Plan | None:
        """The plan of the current (or last) step."""
        return self._driver.plan

    def put_first(self, trainer: Any) -> GateCallback:
        """Move this callback to the front of ``trainer``'s callbacks (adding it if absent).

        ``report_to`` reporters are registered before user callbacks, and each sees ``logs`` in
        ``on_log`` when its turn comes: first place lets them see the gate's numbers.
        """
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        self._guard_train(trainer)
        return self

    def _guard_train(self, trainer: Any) -> None:
        """Wrap ``trainer.train`` so that an exception (``KeyboardInterrupt``) inside it removes
        what the callback did: transformers has no exception event and skips ``on_train_end``.
        Under DeepSpeed, keep a LearnerMasters given in ``optimizers`` (transformers would
        replace it with an AdamW of its own)."""
        from ._zero_setups import keep_given_masters

        keep_given_masters(trainer)
        train = trainer.train
        cleaners = getattr(train, "_gradgate_cleaners", None)
        if cleaners is not None:
            if self not in cleaners:
                cleaners.append(self)
            return
        cleaners = [self]

        @functools.wraps(train)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            resume = args[0] if args else kwargs.get("resume_from_checkpoint")
            for callback in cleaners:
                callback._resume = resume
            try:
                return train(*args, **kwargs)
            except BaseException:
                for callback in cleaners:
                    callback._clean_up()
                raise

        guarded._gradgate_cleaners = cleaners  # type: ignore[attr-defined]
        trainer.train = guarded

    def _clean_up(self) -> None:
        self._driver.detach()
        if self._deepspeed is not None:
            self._deepspeed.remove()
            self._deepspeed = None

    # -- Trainer events --------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _constructing_trainer()
        if trainer is not None:
            self._guard_train(trainer)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        self._driver.attach(model)
        self._load_schedule(args)
        from .deepspeed import step_learners_only_if_deepspeed

        self._deepspeed = step_learners_only_if_deepspeed(kwargs.get("optimizer"))
        hold = self._freeze_for_step
        if hold is None:
            hold = _checkpointing(model)
        self._driver.hold_frozen = hold
        self._driver.begin_step(state.global_step)  # the first step's plan, for the count
        if state.is_world_process_zero:
            count = self._driver.learning().count
            logging.get_logger("transformers.trainer").info(
                f"  Number of parameters learning under the gradgate plan = {count:,} (the "
                "trainable count above reads requires_grad and ignores the gate)"
            )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._driver.begin_step(state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._driver.observe()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._cache is not None and state.global_step == 1:
            self._cache._warn_if_unkeyed()
        optimizer = kwargs.get("optimizer")
        self._driver.end_step([] if optimizer is None else [optimizer], state.global_step)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if not self._driver.log or logs is None or "loss" not in logs:
            return  # train logs only; evaluation and the final summary carry no plan
        metrics = self._driver.logged()  # the step's numbers (see _metrics)
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)  # the Trainer copied logs there just before

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not (state.is_world_process_zero and os.path.isdir(folder)):
            return
        schedule = self._driver.schedule
        try:
            text = json.dumps(schedule.state_dict())
        except (TypeError, ValueError) as error:  # a custom schedule's config
            warn(
                f"the checkpoint {folder!r} keeps no schedule state: {schedule!r}'s state_dict() "
                f"is not JSON ({error}); return JSON types from its _config() to resume it.",
                GradgateWarning,
            )
            return
        with open(os.path.join(folder, STATE_FILE), "w", encoding="utf-8") as file:
            file.write(text)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._clean_up()

    def _load_schedule(self, args: Any) -> None:
        """Continue the schedule from the checkpoint train() resumes from, if it has one."""
        folder, self._resume = self._resume, None
        if folder is True:
            from transformers.trainer_utils import get_last_checkpoint

            folder = get_last_checkpoint(args.output_dir)
        path = os.path.join(folder, STATE_FILE) if isinstance(folder, str) else None
        if path is not None and os.path.isfile(path):
            with open(path, encoding="utf-8") as file:
                self._driver.schedule.load_state_dict(json.load(file))


def _constructing_trainer() -> Any:
    """The ``Trainer`` whose ``__init__`` calls ``on_init_end`` (the event does not pass it)."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _checkpointing(model: Any) -> bool:
    """Whether transformers checkpoints the model's layers (5.23 renamed the flag and deprecated
    the old name, which 4.x and earlier 5.x releases have alone)."""
    for flag in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), flag):
            return bool(getattr(model, flag))
    return False
