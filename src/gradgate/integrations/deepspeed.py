"""DeepSpeed ZeRO with a plan that changes every step: only what learned is stepped.

A plain torch optimizer leaves a parameter whose ``.grad`` is ``None`` alone. DeepSpeed's ZeRO
optimizers do not: they reduce every gradient into one flat partition per rank (zeros where a
parameter got none) and step that flat tensor whole, so a block that a gradgate plan cut,
froze or skipped still moves (weight decay, momentum) and its Adam step count advances.
:func:`step_learners_only` makes the step exact::

    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(...), config=cfg)
    gate = gg.BackpropGate(engine.module)
    handle = gg.integrations.deepspeed.step_learners_only(engine)
    for step, batch in enumerate(loader):
        schedule.apply(gate, step)
        engine.backward(loss_fn(engine(batch)))
        engine.step()

Each parameter's stretch of the flat partition is handed to the torch optimizer as a tensor of
its own (a view: no copy), with its stretch of the flat gradient when the parameter got a
gradient on any rank since the last step, else with ``.grad = None``. So each stretch has its
own optimizer state and step count, as in plain torch, and state exists only for parameters
that learned at least once. This module imports deepspeed only when it is called. A gate on a
model that ZeRO steps without this handle warns at the first step whose plan leaves a block out
(``gradgate._cut.stale_grads``), with the line to add.

**Masters only for what learns.** ZeRO normally keeps an fp32 master of every parameter in its
flat partitions. With ``"bf16": {"enabled": true, "bf16_master_weights_and_grads": true,
"bf16_optimizer_states": true}`` (DeepSpeed 0.18.3 and later) it keeps them in bf16, the
weights' own dtype, and with :class:`gradgate.optim.LearnerMasters` as the optimizer the handle
hands LearnerMasters the bf16 stretches: it makes an fp32 master and AdamW state for each
stretch that learns and drops them when it rests, so each rank holds them only for its share
of the learners. ZeRO-3's own copy of its partitions is pointed at the partitions themselves
(:func:`~gradgate.integrations._zero_partitions.share_partitions`), so ZeRO-3 keeps the bf16
weights and gradients sharded and nothing else per parameter.

Why this design, rather than rebuilding ZeRO's fp32 partitions for the new learners at each
switch as BAdam does: it is exact for any plan, including plans that change at every step or
micro-batch (a rebuild is made for a learning set known ahead, and re-partitions, re-hooks and
re-traces the model each time); it holds no master for what rests; it works the same at stages
1, 2 and 3; and it rests on one documented DeepSpeed option and on the flat partitions'
attributes that :func:`step_learners_only` already reads, not on ZeRO-3's private set-up
functions. What it leaves: ZeRO keeps a bf16 gradient partition for every trainable parameter
(2 bytes a parameter over the ranks), and at stages 1 and 2 a bf16 copy of its partition.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._cut.stale_grads import LEARNERS_ONLY as _ATTRIBUTE  # read by the gate's step hook
from .._plumbing.errors import InvalidOptionError
from .._plumbing.handles import Handle
from .._tools.masters import LearnerMasters
from . import _zero_partitions as parts
from ._zero_setups import check_masters, deepspeed_optimizer, kind_of

__all__ = ["LearnersOnly", "step_learners_only", "step_learners_only_if_deepspeed"]


def step_learners_only(engine: Any, *, keep_state: bool = True) -> LearnersOnly:
    """Make ``engine.step()`` step only the parameters that got a gradient, as plain torch does.

    ``engine`` is what ``deepspeed.initialize`` returned first (or its optimizer, or the
    Hugging Face / accelerate wrapper around that optimizer). Works with ZeRO stages 1, 2 and
    3 and with stage 0 in fp32, with any plan (``gate.depth``, ``gate.learn``, ``gate.skip``,
    every schedule), gradient accumulation (a parameter that got a gradient in any
    micro-batch of the step is stepped) and gradient clipping. Ranks agree on what learned
    with one all-reduce of a byte per parameter at each step. Set-ups where this cannot be
    exact raise :class:`~gradgate.InvalidOptionError` naming the option that works.
    ``handle.remove()`` gives DeepSpeed back its own step, with the state gathered back into
    its flat tensors.

    ``keep_state=False`` drops a parameter's optimizer state at every step in which it does not
    learn, as BAdam does when it switches blocks: the state then exists only for the current
    learners, and a block that learns again starts it afresh.

    With :class:`gradgate.optim.LearnerMasters` as the optimizer (and ZeRO told to keep no fp32
    copy, see the module's notes), each rank holds fp32 masters and state only for its
    stretches of the learners; ``optimizer.master_bytes()`` counts them on this rank.
    """
    return LearnersOnly(engine, keep_state=keep_state)


def step_learners_only_if_deepspeed(optimizer: Any) -> LearnersOnly | None:
    """:func:`step_learners_only` for the HF Trainer's optimizer when it runs DeepSpeed, else
    ``None`` (what ``GateCallback`` calls when training begins)."""
    if type(optimizer).__name__ != "DeepSpeedOptimizerWrapper":
        return None
    return LearnersOnly(optimizer)


class LearnersOnly(Handle):
    """The handle of :func:`step_learners_only`; ``remove()`` restores DeepSpeed's step.

    ``kind`` is ``"zero12"``, ``"zero3"`` or ``"plain"`` (stage 0); ``params`` the parameters
    DeepSpeed steps, in its order; ``steps`` the optimizer steps taken so far and ``stepped``
    the positions in ``params`` that the last one stepped; ``segments`` maps each flat
    partition (by ``id``) to this rank's stretches of it, whose tensors key the optimizer state.
    """

    def __init__(self, engine: Any, *, keep_state: bool = True) -> None:
        if not isinstance(keep_state, bool):
            raise InvalidOptionError(f"keep_state={keep_state!r}; expected True or False.")
        outer = deepspeed_optimizer(engine)
        if getattr(outer, _ATTRIBUTE, None) is not None:
            raise InvalidOptionError(
                f"step_learners_only({engine!r:.60}) is already active on this optimizer; "
                "expected one handle per DeepSpeed optimizer: keep the first handle."
            )
        self.kind, self.base = kind_of(outer)
        self.outer = outer
        self.masters = isinstance(self.base, LearnerMasters)
        self.params = parts.params_of(outer, self.kind, self.base)
        self.flats, self.segments = parts.segments_of(outer, self.kind, self.params)
        if self.masters:
            check_masters(outer, self.kind, list(self.flats.values()))
        self.keep_state = keep_state
        self.steps = 0
        self.stepped: list[int] = []  # positions in params stepped by the last step
        self._got = torch.zeros(len(self.params), dtype=torch.uint8)
        self._agreed: torch.Tensor | None = None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._noter(i))
            for i, p in enumerate(self.params)
            if p.requires_grad
        ]
        self._shared = parts.share_partitions(outer) if self.kind == "zero3" else []
        self._patch(outer, "step", self._outer_step)
        if self.kind != "plain":
            parts.split_state(self.base, self.flats, self.segments)
            if isinstance(self.base, LearnerMasters):
                self.base._take(self._tensors())
            self._patch(self.base, "step", self._base_step)
            self._patch(self.base, "state_dict", self._base_state)
            self._patch(self.base, "load_state_dict", self._base_state)
        for target in {id(outer): outer, id(self.base): self.base}.values():
            setattr(target, _ATTRIBUTE, self)  # the gate's step hook sees the base optimizer
        super().__init__(self._restore, description=f"step_learners_only ({self.kind})")

    def _tensors(self, learned: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The stretches' tensors (of the parameters that learned, if ``learned`` is given)."""
        return [
            segment.tensor
            for segments in self.segments.values()
            for segment in segments
            if learned is None or learned[segment.index]
        ]

    # -- what learned -------------------------------------------------------------------------
    def _noter(self, index: int) -> Callable[[torch.Tensor], None]:
        def note(_: torch.Tensor) -> None:
            self._got[index] = 1

        return note

    def _learned(self) -> torch.Tensor:
        """Per parameter, 1 if it got a gradient on any rank since the last step."""
        if self._agreed is None:
            flags = self._got.clone()
            group = getattr(self.outer, "dp_process_group", None)
            if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
                moved = flags.to(parts.agreement_device(self.params))
                dist.all_reduce(moved, op=dist.ReduceOp.MAX, group=group)
                flags = moved.cpu()
            self._agreed = flags
            self.stepped = [i for i, flag in enumerate(flags.tolist()) if flag]
        return self._agreed

    # -- the steps ------------------------------------------------------------------------------
    def _outer_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.kind == "plain":
            learned = self._learned()
            for index, param in enumerate(self.params):
                if not learned[index]:
                    param.grad = None  # DeepSpeed filled it with zeros
        try:
            return original(*args, **kwargs)
        finally:
            if not self.keep_state and self._agreed is not None:
                self._drop_state(self._agreed)
            self._got.zero_()
            self._agreed = None
            self.steps += 1
            if self.kind == "zero3":
                parts.clear_zero3_gradients(self.outer)

    def _drop_state(self, learned: torch.Tensor) -> None:
        """Forget the optimizer state of what did not learn in this step."""
        if self.kind == "plain":
            keys: list[Any] = [p for i, p in enumerate(self.params) if not learned[i]]
        else:
            learning = set(self._tensors(learned))
            keys = [t for t in self._tensors() if t not in learning]
        for key in keys:
            self.base.state.pop(key, None)

    def _base_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        swapped = self._as_segments(self._learned())
        if self.masters:  # ZeRO steps one group (or ZeRO-3 sub-group) at a time: these
            stepped = [t for g in self.base.param_groups for t in g["params"] if t.grad is not None]
            parts.drop_stale_masters(self.base.state, stepped)
        try:
            return original(*args, **kwargs)
        finally:
            self._as_flats(swapped)

    def _base_state(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``state_dict`` / ``load_state_dict`` of the torch optimizer, per stretch."""
        swapped = self._as_segments(None)
        try:
            return original(*args, **kwargs)
        finally:
            self._as_flats(swapped)

    def _as_segments(self, learned: torch.Tensor | None) -> list[Any]:
        """Put each flat partition's stretches in its place in the torch optimizer's groups,
        with their gradients where ``learned`` says so."""
        swapped = []
        for group in self.base.param_groups:
            flats = group["params"]
            pieces: list[torch.Tensor] = []
            for flat in flats:
                segments = self.segments.get(id(flat))
                if segments is None:
                    pieces.append(flat)
                    continue
                for segment in segments:
                    piece = segment.point_at(flat)
                    if learned is not None and flat.grad is not None and learned[segment.index]:
                        piece.grad = flat.grad.detach().narrow(0, segment.start, segment.numel)
                    pieces.append(piece)
            swapped.append(flats)
            group["params"] = pieces
        for flat_id in self.segments:
            flat = self.flats[flat_id]
            if flat in self.base.state and not self.base.state[flat]:
                del self.base.state[flat]  # made empty by DeepSpeed's look-up, not by a step
        return swapped

    def _as_flats(self, swapped: list[Any]) -> None:
        # by position: load_state_dict replaces the group dicts with new ones
        for group, flats in zip(self.base.param_groups, swapped, strict=True):
            group["params"] = flats
        for segments in self.segments.values():
            for segment in segments:
                segment.tensor.grad = None

    # -- install and undo -----------------------------------------------------------------------
    def _patch(self, target: Any, name: str, wrapper: Callable[..., Any]) -> None:
        original = getattr(target, name)

        def patched(*args: Any, **kwargs: Any) -> Any:
            return wrapper(original, *args, **kwargs)

        setattr(target, name, patched)

    def _restore(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for target in (self.outer, self.base):
            for name in ("step", "state_dict", "load_state_dict"):
                if name in vars(target):
                    delattr(target, name)
        for target in {id(self.outer): self.outer, id(self.base): self.base}.values():
            delattr(target, _ATTRIBUTE)
        if isinstance(self.base, LearnerMasters) and self.kind != "plain":
            tensors = self._tensors()  # it stepped only these: the masters go with them
            for tensor in tensors:
                self.base.state.pop(tensor, None)
            self.base._take(tensors, taken=False)
        elif self.kind != "plain":
            parts.gather_state(self.base, self.flats, self.segments)
        parts.unshare_partitions(self._shared)

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return (
            f"<gradgate.integrations.deepspeed.LearnersOnly {self.kind}, {len(self.params)} "
            f"parameters, {self.steps} steps ({state})>"
        )
