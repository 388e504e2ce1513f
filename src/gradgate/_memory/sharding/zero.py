"""DeepSpeed ZeRO 1, 2 and 3 (the rules of DeepSpeed 0.19), stepped by a torch optimizer through
``gg.integrations.deepspeed.step_learners_only``: optimizer state only for the learners'
stretches of each rank's partition.

ZeRO 1 and 2 flatten every trainable parameter into one buffer in the model's dtype, padded to a
multiple of 2 x world elements (every rank holds it whole: the parameters are views into it),
and give each rank an equal partition of it: an fp32 master copy of its partition, and optimizer
state for the learners' stretches inside it. In backward a bucket of ``reduce_bucket_size``
elements (two with ``overlap_comm``) reduces the gradients; ZeRO 2 keeps the averaged gradients
of the parameters touching its partition in one buffer and drops the rest, ZeRO 1 keeps them
all; both give a zero gradient to the parameters touching the partition that got none. The
step turns the partition's gradients into one fp32 buffer.

ZeRO 3 divides each parameter into ``ceil(numel / world)``-element partitions (padded), one flat
buffer of them per rank, with an fp32 master copy and a gradient partition (the model's dtype)
of every trainable parameter, and a reduce bucket. A parameter of at most
``stage3_param_persistence_threshold`` elements stays gathered on every rank. Each module's
parameters are gathered whole before it runs (in forward and in backward), with the next
modules' prefetched up to ``stage3_prefetch_bucket_size`` elements, and released after it,
unless backward uses them again within ``stage3_max_reuse_distance`` elements. A gradient is
reduce-scattered into the partition as soon as it is made.

The rows describe the rank holding the most: the one whose partition holds the most learners.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._plumbing.errors import InvalidOptionError
from ..counter import StepCounter
from ..options import planned_optimizer
from .engine import Engine

_KNOBS = {  # DeepSpeed's name -> ours; the stage 3 ones with their stage3_ prefix
    "reduce_bucket_size": "reduce_bucket_size",
    "overlap_comm": "overlap_comm",
    "contiguous_gradients": "contiguous_gradients",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "sub_group_size": "sub_group_size",
}


@dataclass(frozen=True)
class ZeroKnobs:
    """The ``zero_optimization`` settings the plan follows (DeepSpeed's defaults)."""

    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None  # None: True at stage 3, False below (DeepSpeed's rule)
    contiguous_gradients: bool = True
    prefetch_bucket_size: int = 50_000_000
    persistence_threshold: int = 100_000
    model_persistence_threshold: int = sys.maxsize
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000  # ZeRO-3 steps its partition in groups of this many


def zero_knobs(config: object, stage: int, hidden: int | None) -> ZeroKnobs:
    """The knobs of a DeepSpeed config (a dict, or the path of its JSON file; ``None``:
    DeepSpeed's defaults). ``"auto"`` values are filled as the Hugging Face Trainer fills them
    from the model's ``hidden_size``."""
    if config is None:
        return ZeroKnobs()
    if isinstance(config, (str, Path)):
        try:
            config = json.loads(Path(config).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise InvalidOptionError(
                f"gg.estimate(deepspeed={str(config)!r}) cannot be read ({error}); expected a "
                "DeepSpeed config: a dict or the path of its JSON file."
            ) from None
    if not isinstance(config, dict):
        raise InvalidOptionError(
            f"gg.estimate(deepspeed={config!r:.60}) is not a DeepSpeed config; expected a dict "
            "(or the path of a JSON file) with a 'zero_optimization' section."
        )
    section = config.get("zero_optimization", {})
    given = section.get("stage")
    if given not in (None, "auto", stage):
        raise InvalidOptionError(
            f"gg.estimate(shard='zero{stage}') plans ZeRO stage {stage}, but the DeepSpeed "
            f"config says stage {given!r}; expected the same stage in both (shard='zero{given}')."
        )
    auto = _auto(hidden)
    values: dict[str, Any] = {}
    for name, ours in _KNOBS.items():
        value = section.get(name, section.get(name.removeprefix("stage3_")))
        if value == "auto":
            value = auto.get(name)
        if value is not None:
            values[ours] = (
                bool(value) if ours in ("overlap_comm", "contiguous_gradients") else int(value)
            )
    known = {f.name for f in fields(ZeroKnobs)}
    return ZeroKnobs(**{k: v for k, v in values.items() if k in known})


def _auto(hidden: int | None) -> dict[str, int]:
    """The Hugging Face Trainer's ``"auto"``: buckets from the model's hidden size."""
    if hidden is None:
        return {}
    return {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }


def _unique(params: Any) -> list[nn.Parameter]:
    seen: set[int] = set()
    found = []
    for param in params:
        if id(param) not in seen and param.requires_grad:
            seen.add(id(param))
            found.append(param)
    return found


class _Zero(Engine):
    """What ZeRO 1, 2 and 3 share: the masters ZeRO keeps itself, and the step: the
    partition's gradients flattened into one buffer, the torch optimizer stepping the
    learners' stretches of the partition (``step_learners_only``), state made for those."""

    def __init__(
        self, stage: int, world: int, knobs: ZeroKnobs, optimizer: str, masters: bool = False
    ) -> None:
        self.stage, self.world, self.knobs = stage, world, knobs
        self.masters = masters  # LearnerMasters: ZeRO keeps its partitions in the model's dtype
        self.dtype = torch.float32  # the model's (its parameters')
        self.name = f"zero{stage}"
        self.params: list[nn.Parameter] = []
        self.counter: StepCounter | None = None
        self.gloo = False  # a CPU plan: gloo's collectives copy their input
        entry = planned_optimizer(optimizer)
        slots = entry.slots  # fp32 state tensors per element of a flat stretch
        self.per_element = 4 * (slots + 1) if masters else 4 * slots  # LearnerMasters: + master
        self.per_stretch = 4 if entry.step_count else 0  # a step count per stretch
        self._held: list[torch.Tensor] = []
        self._hooks: list[Any] = []

    def hook(self, learnable: list[nn.Parameter], reduced: Any) -> None:
        """``reduced(param)`` when a gradient is made, this row only."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = [p.register_post_accumulate_grad_hook(reduced) for p in learnable]

    def partition(self) -> int:
        """Elements of this rank's partition."""
        raise NotImplementedError

    def segments(self, learners: list[nn.Parameter]) -> list[int]:
        """Elements of each learner's stretch of this rank's partition (those stepped)."""
        raise NotImplementedError

    def stepped_at_once(self) -> int:
        """Elements of the partition the step flattens at once (ZeRO-3: a sub-group)."""
        return self.partition()

    def masters_held(self) -> int:
        """ZeRO's own masters: a copy of the partition in fp32, or with LearnerMasters
        (``bf16_master_weights_and_grads``) in the model's dtype; none at stage 3 where that
        is the partition's dtype (shared with it)."""
        dtype = self.dtype if self.masters else torch.float32
        if self.stage == 3 and dtype == self.dtype:
            return 0  # shared: step_learners_only points ZeRO-3's copy at the partition
        return dtype.itemsize * self.partition()

    def stepped(self, learnable: list[nn.Parameter], counter: StepCounter) -> list[nn.Parameter]:
        """The partition's gradients flattened into one buffer (fp32, or the model's dtype
        with LearnerMasters), then the model's freed; stand-ins for the learners' stretches
        (their bytes are the masters' and the buffer's), which the optimizer steps."""
        learners = [p for p in learnable if p.grad is not None]
        sizes = self.segments(learners)
        dtype = self.dtype if self.masters else torch.float32  # the partition's
        flat = torch.empty(self.stepped_at_once(), dtype=dtype) if sizes else None
        self.drop_grads(learnable)
        if flat is None:
            return []
        stand_ins = []
        for size in sizes:
            with counter.paused():
                part = nn.Parameter(torch.empty(size, dtype=dtype))
                part.grad = torch.empty_like(part)
            counter.track(part, "state", size=0)
            counter.track(part.grad, "other", size=0)
            stand_ins.append(part)
        self._held = [flat]
        return stand_ins

    def drop_grads(self, learnable: list[nn.Parameter]) -> None:
        for param in learnable:
            param.grad = None

    def finish(self, learnable: list[nn.Parameter]) -> None:
        self._held = []


def ceil_part(numel: int, world: int) -> int:
    """ZeRO-3's partition of a parameter: ``numel`` padded to a multiple of ``world``, divided.

    >>> ceil_part(513, 2), ceil_part(512, 2)
    (257, 256)
    """
    return math.ceil(numel / world)
