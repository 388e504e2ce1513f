"""ZeRO 1 and 2 on the fake twin: one flat buffer of every trainable parameter, equal
partitions of it, the reduce bucket, and the gradients each stage keeps (see ``zero``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..counter import StepCounter
from .zero import ZeroKnobs, _unique, _Zero


class Zero12(_Zero):
    """ZeRO stage 1 or 2 over ``world`` ranks; the rank planned is chosen when backward ends
    (the one holding the most gradients and optimizer state)."""

    def __init__(
        self, stage: int, world: int, knobs: ZeroKnobs, optimizer: str, masters: bool = False
    ) -> None:
        super().__init__(stage, world, knobs, optimizer, masters)
        self.rank = world - 1
        self.starts: dict[int, int] = {}
        self.total = self.aligned = self.size = 0
        self._bucket: list[torch.Tensor] = []
        self._kept: torch.Tensor | None = None  # ZeRO 2's averaged gradients
        self._zeros: list[torch.Tensor] = []

    def attach(self, twin: nn.Module, blocks: list[nn.Module]) -> None:
        self.params = _unique(twin.parameters())
        offset = 0
        for param in self.params:
            self.starts[id(param)] = offset
            offset += param.numel()
        self.total = offset
        alignment = 2 * self.world  # DeepSpeed: nccl_start_alignment_factor x world
        self.aligned = math.ceil(offset / alignment) * alignment
        self.size = self.aligned // self.world
        self.dtype = self.params[0].dtype if self.params else torch.float32

    # -- the division -------------------------------------------------------------------------
    def overlap(self, param: torch.Tensor, rank: int) -> int:
        """Elements of ``param`` inside rank ``rank``'s partition."""
        start = self.starts[id(param)]
        low, high = rank * self.size, (rank + 1) * self.size
        return max(0, min(start + param.numel(), high) - max(start, low))

    def partition(self) -> int:
        return self.size

    def model_extra(self) -> int:
        return (self.aligned - self.total) * self.dtype.itemsize

    def _touching(self, rank: int) -> list[nn.Parameter]:
        return [p for p in self.params if self.overlap(p, rank)]

    def _kept_elements(self, rank: int, learners: set[int]) -> int:
        """The averaged gradients ``rank`` keeps: every parameter touching its partition,
        whole, once one of them learns (and the flat's padding, on the last rank)."""
        touching = self._touching(rank)
        if not any(id(p) in learners for p in touching):
            return 0
        padding = self.aligned - self.total if rank == self.world - 1 else 0  # the flat's tail
        return sum(p.numel() for p in touching) + padding

    def _zero_elements(self, rank: int, learners: set[int]) -> int:
        return sum(p.numel() for p in self._touching(rank) if id(p) not in learners)

    def grads_held(self, learners: list[nn.Parameter]) -> int:
        return self._grads(self.rank, {id(p) for p in learners})

    def _grads(self, rank: int, learners: set[int]) -> int:
        """Gradient bytes ``rank`` holds when backward ends: ZeRO 1 every learner's averaged
        gradient, ZeRO 2 those touching its partition; both a zero gradient for each
        parameter touching the partition that got none."""
        zeros = self._zero_elements(rank, learners)
        kept = self._kept_elements(rank, learners)
        return (kept + zeros) * self.dtype.itemsize

    def segments(self, learners: list[nn.Parameter]) -> list[int]:
        found = [self.overlap(p, self.rank) for p in learners]
        return [size for size in found if size]

    def _load(self, rank: int, learners: set[int]) -> tuple[int, int]:
        """What ``rank`` holds beyond the parts every rank holds: gradients, and optimizer
        state (masters too, with LearnerMasters) for its stretches of the learners."""
        parts = [self.overlap(p, rank) for p in self.params if id(p) in learners]
        state = sum(self.per_element * n + self.per_stretch for n in parts if n)
        return (self._grads(rank, learners) + state, rank)

    # -- the step ------------------------------------------------------------------------------
    def start(self, counter: StepCounter, learnable: list[nn.Parameter]) -> list[Any]:
        self.counter, self._bucket, self._kept, self._zeros = counter, [], None, []
        padding = torch.empty(self.aligned - self.total, dtype=self.dtype)
        counter.relabel(padding, "model")
        masters = torch.empty(self.size, dtype=self.dtype if self.masters else torch.float32)
        counter.relabel(masters, "state")
        self.hook(learnable, self._reduced)
        return [padding, masters]

    def _reduced(self, param: torch.Tensor) -> None:
        """A gradient made: into the reduce bucket; ZeRO 2 keeps the partition's share."""
        counter = self.counter
        assert counter is not None and param.grad is not None
        if not self._bucket and self.knobs.contiguous_gradients:  # made as backward starts
            count = 2 if self.knobs.overlap_comm else 1
            self._bucket = [
                torch.empty(self.knobs.reduce_bucket_size, dtype=self.dtype) for _ in range(count)
            ]
        if self.stage == 2:
            if self._kept is None:
                most = max(self._kept_elements(r, {id(param)}) for r in range(self.world))
                self._kept = torch.empty(most, dtype=self.dtype)
                counter.relabel(self._kept, "grad")
            counter.track(param.grad, "grad", size=0)  # copied into the kept buffer, or dropped

    def after_backward(self) -> None:
        """Now that the learners are known: the rank holding the most of them, its averaged
        gradients, and zero gradients for its partition's parameters that got none."""
        counter = self.counter
        assert counter is not None
        learners = {id(p) for p in self.params if p.grad is not None}
        self.rank = max(range(self.world), key=lambda r: self._load(r, learners))
        if self.stage == 2 and self._kept is not None:
            size = self._kept_elements(self.rank, learners) * self.dtype.itemsize
            counter.track(self._kept, "grad", size=size)
        for param in self._touching(self.rank):
            if id(param) not in learners:
                zero = torch.zeros(param.numel(), dtype=self.dtype)
                counter.relabel(zero, "grad")
                self._zeros.append(zero)

    def drop_grads(self, learnable: list[nn.Parameter]) -> None:
        super().drop_grads(learnable)
        self._kept, self._zeros, self._bucket = None, [], []  # freed once flattened
