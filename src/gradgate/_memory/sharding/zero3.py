"""ZeRO 3 on the fake twin: per-parameter partitions, each module's parameters gathered
around its forward and backward with DeepSpeed's prefetch, reuse and persistence rules, and
gradients reduce-scattered as they are made (see ``zero``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..._plumbing.autograd import tensors_in
from ..counter import StepCounter
from .engine import end_at_inputs_backward
from .zero import ZeroKnobs, _unique, _Zero, ceil_part


class Zero3(_Zero):
    """ZeRO stage 3 over ``world`` ranks (every rank holds the same: partitions are padded)."""

    def __init__(self, world: int, knobs: ZeroKnobs, optimizer: str, masters: bool = False) -> None:
        super().__init__(3, world, knobs, optimizer, masters)
        self.persistent: set[int] = set()
        self.modules: list[_Module] = []
        self.gathered: dict[int, list[torch.Tensor]] = {}  # parameter id -> its full data
        self.backward = False
        self.gloo = False

    def attach(self, twin: nn.Module, blocks: list[nn.Module]) -> None:
        self.params = _unique(twin.parameters())
        self.dtype = self.params[0].dtype if self.params else torch.float32
        kept = 0
        for _, param in twin.named_parameters():  # DeepSpeed's mark_persistent_parameters
            numel = param.numel()
            if numel <= self.knobs.persistence_threshold and (
                kept + numel <= self.knobs.model_persistence_threshold
            ):
                self.persistent.add(id(param))
                kept += numel
        order = [m for m in twin.modules() if any(True for _ in m.parameters(recurse=False))]
        self.modules = [_Module(self, m, i) for i, m in enumerate(order)]
        remaining = 0
        for module in reversed(self.modules):  # elements run after each module in forward
            module.after = remaining
            remaining += module.numel

    # -- the division -------------------------------------------------------------------------
    def param_bytes(self, param: torch.Tensor) -> int:
        return ceil_part(param.numel(), self.world) * param.element_size()

    def model_extra(self) -> int:
        return sum(p.nbytes for p in self.params if id(p) in self.persistent)

    def partition(self) -> int:
        return sum(ceil_part(p.numel(), self.world) for p in self.params)

    def grads_held(self, learners: list[nn.Parameter]) -> int:
        return sum(self.param_bytes(p) for p in self.params)  # a partition for every one

    def segments(self, learners: list[nn.Parameter]) -> list[int]:
        return [ceil_part(p.numel(), self.world) for p in learners]

    def stepped_at_once(self) -> int:
        """The largest sub-group: parameters in order until their partitions reach
        ``sub_group_size`` elements (DeepSpeed steps one sub-group at a time)."""
        largest = current = 0
        for param in self.params:
            current += ceil_part(param.numel(), self.world)
            if current >= self.knobs.sub_group_size:
                largest, current = max(largest, current), 0
        return max(largest, current)

    # -- the step ------------------------------------------------------------------------------
    def start(self, counter: StepCounter, learnable: list[nn.Parameter]) -> list[Any]:
        self.counter, self.backward, self.gathered = counter, False, {}
        dtype = self.params[0].dtype if self.params else torch.float32
        kept = [
            torch.empty(p.numel(), dtype=p.dtype) for p in self.params if id(p) in self.persistent
        ]
        for tensor in kept:
            counter.relabel(tensor, "model")
        masters = torch.empty(self.masters_held(), dtype=torch.uint8)  # 0: shared
        counter.relabel(masters, "state")
        grads = torch.zeros(self.partition(), dtype=dtype)
        counter.relabel(grads, "grad")
        bucket = torch.empty(self.knobs.reduce_bucket_size, dtype=dtype)
        self.hook(learnable, self._reduced)
        for module in self.modules:
            module.reset()
        return [*kept, masters, grads, bucket]

    def _reduced(self, param: torch.Tensor) -> None:
        """A gradient made: reduce-scattered into its partition, then freed."""
        counter = self.counter
        assert counter is not None and param.grad is not None
        if self.gloo:  # gloo copies the gradient while it reduces
            copy = torch.empty_like(param.grad)
            del copy
        counter.track(param.grad, "grad", size=0)

    def after_backward(self) -> None:
        self.backward = False
        self.gathered = {}  # DeepSpeed releases what backward left gathered

    # -- gathering -----------------------------------------------------------------------------
    def fetch(self, modules: list[_Module]) -> None:
        """Gather the parameters of ``modules`` not gathered yet: one flat all-gather buffer
        (world x their partitions), copied out into each parameter's full data."""
        params = [
            p
            for m in modules
            for p in m.params
            if id(p) not in self.persistent and id(p) not in self.gathered
        ]
        if not params:
            return
        dtype = params[0].dtype
        flat = torch.empty(
            self.world * sum(ceil_part(p.numel(), self.world) for p in params), dtype=dtype
        )
        for param in params:
            self.gathered[id(param)] = [torch.empty(param.numel(), dtype=param.dtype)]
        del flat

    def release(self, module: _Module) -> None:
        for param in module.params:
            self.gathered.pop(id(param), None)

    def prefetch(self, start: int, step: int) -> None:
        """Gather the modules after ``start`` (in the direction ``step``) up to the prefetch
        bucket, as DeepSpeed's coordinator does along its trace."""
        budget, found = self.knobs.prefetch_bucket_size, []
        index = start + step
        while 0 <= index < len(self.modules) and budget > 0:
            module = self.modules[index]
            if not self.backward or module.in_backward:
                missing = sum(
                    p.numel()
                    for p in module.params
                    if id(p) not in self.persistent and id(p) not in self.gathered
                )
                if missing > budget:
                    break
                budget -= missing
                found.append(module)
            index += step
        self.fetch(found)


class _Module:
    """One module with parameters of its own: DeepSpeed gathers them around its runs."""

    def __init__(self, engine: Zero3, module: nn.Module, index: int) -> None:
        self.engine, self.index = engine, index
        self.params = list(module.parameters(recurse=False))
        self.numel = sum(p.numel() for p in self.params)
        self.after = 0
        self.reset()
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        module.register_forward_hook(self._post_forward)

    def reset(self) -> None:
        self.in_backward = False
        self.done = False

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        engine = self.engine
        engine.fetch([self])
        if engine.backward:
            return None
        engine.prefetch(self.index, +1)
        if not torch.is_grad_enabled():
            return None
        return end_at_inputs_backward(self.after_backward, args, kwargs)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        engine = self.engine
        if engine.backward:
            return
        grads = [t for t in tensors_in(output) if t.requires_grad]
        self.in_backward, self.done = bool(grads), False
        # kept gathered if backward uses it again within the reuse distance
        distance = 2 * self.after
        if not grads or distance >= engine.knobs.max_reuse_distance:
            engine.release(self)
        for tensor in grads:
            tensor.register_hook(self._pre_backward)

    def _pre_backward(self, grad: torch.Tensor) -> None:
        engine = self.engine
        if self.done:
            return
        engine.backward = True
        engine.fetch([self])
        engine.prefetch(self.index, -1)

    def after_backward(self) -> None:
        self.done = True
        self.engine.release(self)
