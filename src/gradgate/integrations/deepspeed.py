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
model that ZeRO steps without this handle warns at the first step whose plan leaves a block
out (``gradgate._cut.stale_grads``), with the line to add. :class:`gradgate.optim.LearnerMasters`
is refused: ZeRO keeps fp32 masters of every parameter itself (``keep_state=False`` gives
BAdam's state reset with them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._cut.stale_grads import LEARNERS_ONLY as _ATTRIBUTE  # read by the gate's step hook
from .._plumbing.errors import InvalidOptionError
from .._plumbing.handles import Handle
from .._tools.masters import LearnerMasters

__all__ = ["LearnersOnly", "step_learners_only", "step_learners_only_if_deepspeed"]

_WORKS = "ZeRO stage 1, 2 or 3 with a torch optimizer and no optimizer offload"


class Segment:
    """One parameter's stretch of a flat fp32 partition, stepped as a tensor of its own."""

    __slots__ = ("index", "numel", "start", "tensor")

    def __init__(self, index: int, start: int, numel: int, flat: torch.Tensor) -> None:
        self.index = index  # position of the parameter in LearnersOnly.params
        self.start = start
        self.numel = numel
        self.tensor = flat.detach().narrow(0, start, numel)

    def point_at(self, flat: torch.Tensor) -> torch.Tensor:
        """The stretch, re-pointed at the flat tensor's current storage."""
        self.tensor.data = flat.detach().narrow(0, self.start, self.numel)
        return self.tensor


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
    the positions in ``params`` that the last one stepped; ``segments`` maps each flat fp32
    partition (by ``id``) to this rank's stretches of it, whose tensors key the optimizer state.
    """

    def __init__(self, engine: Any, *, keep_state: bool = True) -> None:
        if not isinstance(keep_state, bool):
            raise InvalidOptionError(f"keep_state={keep_state!r}; expected True or False.")
        outer = _deepspeed_optimizer(engine)
        if getattr(outer, _ATTRIBUTE, None) is not None:
            raise InvalidOptionError(
                f"step_learners_only({engine!r:.60}) is already active on this optimizer; "
                "expected one handle per DeepSpeed optimizer: keep the first handle."
            )
        self.kind, self.base = _kind(outer)
        self.outer = outer
        self.params = _params(outer, self.kind, self.base)
        self.flats, self.segments = _segments(outer, self.kind, self.params)
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
        self._patch(outer, "step", self._outer_step)
        if self.kind != "plain":
            _split_state(self.base, self.flats, self.segments)
            self._patch(self.base, "step", self._base_step)
            self._patch(self.base, "state_dict", self._base_state)
            self._patch(self.base, "load_state_dict", self._base_state)
        for target in {id(outer): outer, id(self.base): self.base}.values():
            setattr(target, _ATTRIBUTE, self)  # the gate's step hook sees the base optimizer
        super().__init__(self._restore, description=f"step_learners_only ({self.kind})")

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
                device = _device(self.params)
                moved = flags.to(device)
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
                _clear_zero3_gradients(self.outer)

    def _drop_state(self, learned: torch.Tensor) -> None:
        """Forget the optimizer state of what did not learn in this step."""
        if self.kind == "plain":
            keys: list[Any] = [p for i, p in enumerate(self.params) if not learned[i]]
        else:
            keys = [
                segment.tensor
                for segments in self.segments.values()
                for segment in segments
                if not learned[segment.index]
            ]
        for key in keys:
            self.base.state.pop(key, None)

    def _base_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        swapped = self._as_segments(self._learned())
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
        if self.kind != "plain":
            _gather_state(self.base, self.flats, self.segments)

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return (
            f"<gradgate.integrations.deepspeed.LearnersOnly {self.kind}, {len(self.params)} "
            f"parameters, {self.steps} steps ({state})>"
        )


# -- what DeepSpeed built -------------------------------------------------------------------------
def _deepspeed_optimizer(engine: Any) -> Any:
    """The DeepSpeed optimizer behind an engine, an accelerate wrapper, or itself."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    found = engine
    if isinstance(found, DeepSpeedEngine) or type(found).__name__ == "DeepSpeedOptimizerWrapper":
        found = found.optimizer  # the second: accelerate's, in the HF Trainer
    _refuse_masters(found)  # stage 0 in fp32 steps the client optimizer itself
    if not type(found).__module__.startswith(("deepspeed.", "torch.optim")):
        raise InvalidOptionError(
            f"engine={engine!r:.80}; expected what deepspeed.initialize returned (the engine or "
            "its optimizer), built with an optimizer: pass optimizer=torch.optim.AdamW(...) or "
            'an "optimizer" section in the config.'
        )
    return found


def _kind(outer: Any) -> tuple[str, torch.optim.Optimizer]:
    """``"zero12"``, ``"zero3"`` or ``"plain"``, and the torch optimizer that steps."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(outer, DeepSpeedZeroOptimizer):
        stage = 2 if outer.partition_gradients else 1
        _refuse(outer.cpu_offload, stage, "offload_optimizer (its CPU step is not split)")
        _refuse(outer.elastic_checkpoint, stage, "elastic_checkpoint (it saves flat state)")
        kind = "zero12"
    elif isinstance(outer, DeepSpeedZeroOptimizer_Stage3):
        stage = 3
        _refuse(outer.offload_optimizer, stage, "offload_optimizer (its CPU step is not split)")
        kind = "zero3"
    elif isinstance(outer, torch.optim.Optimizer):
        return "plain", outer
    else:
        raise InvalidOptionError(
            f"{type(outer).__name__} (ZeRO stage 0 with fp16 or bf16) steps one flat fp32 copy "
            f"that gradgate cannot split; expected {_WORKS}: set zero_optimization.stage to 1."
        )
    _refuse(bool(getattr(outer, "zenflow", False)), stage, "zenflow")
    _refuse(bool(getattr(outer, "use_muon", False)), stage, "Muon (not element-wise)")
    base = outer.optimizer
    _refuse_masters(base)
    _refuse(isinstance(base, torch.optim.Adagrad), stage, "Adagrad (state made eagerly)")
    if not isinstance(base, torch.optim.Optimizer):
        raise InvalidOptionError(
            f"the optimizer {type(base).__name__} under ZeRO stage {stage} is no "
            f"torch.optim.Optimizer; expected {_WORKS}."
        )
    return kind, base


def _refuse_masters(optimizer: object) -> None:
    """ZeRO owns the mixed precision: an fp32 master of every parameter, and its flat fp32
    partitions in the client optimizer's groups, where LearnerMasters expects bf16 weights."""
    if isinstance(optimizer, LearnerMasters):
        raise InvalidOptionError(
            "gg.optim.LearnerMasters under DeepSpeed: ZeRO keeps its own fp32 master of every "
            "parameter and hands the optimizer its flat fp32 partitions, never the model's "
            "bf16 weights, so masters only for what learns cannot be made; expected a torch "
            "optimizer: deepspeed.initialize(optimizer=torch.optim.AdamW(...)) with "
            "gg.integrations.deepspeed.step_learners_only(engine, keep_state=False) (Adam "
            "state only for the current learners, as BAdam), or LearnerMasters without "
            "DeepSpeed (DDP works)."
        )


def _refuse(present: bool, stage: int, what: str) -> None:
    if present:
        raise InvalidOptionError(
            f"ZeRO stage {stage} with {what} cannot step only the parameters that learn; "
            f"expected {_WORKS}: turn it off in the DeepSpeed config."
        )


def _params(outer: Any, kind: str, base: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters DeepSpeed steps, in one order on every rank."""
    if kind == "zero12":
        groups = outer.bit16_groups
    elif kind == "zero3":
        groups = outer.fp16_groups
    else:
        groups = [group["params"] for group in base.param_groups]
    return [param for group in groups for param in group]


def _segments(
    outer: Any, kind: str, params: list[nn.Parameter]
) -> tuple[dict[int, torch.Tensor], dict[int, list[Segment]]]:
    """The flat fp32 partitions and, per flat (by id), each parameter's stretch of it."""
    index = {id(param): i for i, param in enumerate(params)}
    found: dict[int, list[Segment]] = {}
    flats: list[torch.Tensor] = []
    if kind == "zero12":
        flats = list(outer.single_partition_of_fp32_groups)
        for flat, group in zip(flats, outer.bit16_groups, strict=True):
            segments = []
            for param in group:
                mapping = getattr(param, "_hp_mapping", None)
                if mapping is not None:  # None: the parameter lies on other ranks
                    where = mapping.hp_fragment_address
                    segments.append(Segment(index[id(param)], where.start, where.numel, flat))
            found[id(flat)] = segments
    elif kind == "zero3":
        flats = list(outer.fp32_partitioned_groups_flat)
        for flat, group in zip(flats, outer.fp16_groups, strict=True):
            segments, start = [], 0
            for param in group:
                numel = int(param.partition_numel())
                segments.append(Segment(index[id(param)], start, numel, flat))
                start += numel
            found[id(flat)] = segments
    return {id(flat): flat for flat in flats}, found


def _clear_zero3_gradients(outer: Any) -> None:
    """Zero ZeRO-3's gradient partitions after a step.

    ZeRO-3 copies a parameter's gradient into its partition at the first micro-batch of an
    accumulation window and adds to it at the others, without clearing in between: a
    parameter whose first gradient of a window comes at a later micro-batch gets the last
    window's added, and one that gets none keeps the last window's (in the norm that
    gradient clipping uses).
    """
    buffer = getattr(outer, "grad_partitions_flat_buffer", None)
    if isinstance(buffer, torch.Tensor):
        buffer.zero_()


def _device(params: list[nn.Parameter]) -> torch.device:
    backend = dist.get_backend()
    return torch.device("cpu") if backend == "gloo" or not params else params[0].device


def _split_state(
    base: torch.optim.Optimizer,
    flats: dict[int, torch.Tensor],
    segments: dict[int, list[Segment]],
) -> None:
    """Give each stretch its part of state DeepSpeed's own steps made for the flat tensor."""
    for flat_id, pieces in segments.items():
        state = base.state.pop(flats[flat_id], None)
        if not state:
            continue
        for segment in pieces:
            base.state[segment.tensor] = {
                key: value.narrow(0, segment.start, segment.numel).clone()
                if torch.is_tensor(value) and value.shape == flats[flat_id].shape
                else (value.clone() if torch.is_tensor(value) else value)
                for key, value in state.items()
            }


def _gather_state(
    base: torch.optim.Optimizer,
    flats: dict[int, torch.Tensor],
    segments: dict[int, list[Segment]],
) -> None:
    """Put the stretches' optimizer state back into flat tensors, for DeepSpeed's own step.

    Element-wise state is copied into place (zeros where a stretch never learned); a
    scalar such as Adam's step count takes the largest value, the count DeepSpeed's flat
    step would have had for the stretches that learned most.
    """
    for flat_id, pieces in segments.items():
        states = [(s, base.state.pop(s.tensor)) for s in pieces if s.tensor in base.state]
        flat = flats.get(flat_id)
        if flat is None or not states:
            continue
        merged: dict[str, Any] = {}
        for segment, state in states:
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == segment.tensor.shape:
                    target = merged.setdefault(key, torch.zeros_like(flat, dtype=value.dtype))
                    target.narrow(0, segment.start, segment.numel).copy_(value)
                elif key not in merged or (torch.is_tensor(value) and value > merged[key]):
                    merged[key] = value
        base.state[flat] = merged
