"""FSDP2 (``fully_shard`` on each block, then on the model) emulated on the fake twin.

Each rank holds dim-0 chunks of every parameter, padded to the first chunk's rows
(``torch.chunk``: rank 0 holds the padded size; later ranks may hold fewer rows, never more).
A unit (a block, or the root: every parameter outside the blocks) is all-gathered before its
forward into one flat buffer (world x its padded shard bytes), copied out into one unsharded
buffer per parameter, and freed again as FSDP2 does:

* forward: a block's flat buffer lives until the next unit's all-gather is copied out; its
  unsharded parameters are freed after its forward. The root is not resharded after forward:
  its parameters stay gathered until backward ends.
* backward: before a unit's backward (its output's gradient arrived) it is gathered again and
  the unit before it is prefetched (all-gathered, not copied out) if backward runs through it;
  after it (its inputs' gradients arrived, or when backward ends) it is resharded and its
  gradients reduce-scattered: a flat input of world x the padded shard bytes of the parameters
  with a gradient, kept until the next unit's reduce-scatter, and one flat output per unit
  that holds the sharded gradients. gloo (a CPU plan) copies the input once more while it
  reduces.

The optimizer steps rank 0's shards (stand-ins of the padded chunk's shape).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..._plumbing.autograd import tensors_in
from ..counter import StepCounter
from .engine import Engine, end_at_inputs_backward


def shard_numel(param: torch.Tensor, world: int) -> int:
    """Elements of rank 0's chunk of ``param`` (dim 0 divided as ``torch.chunk`` divides it),
    which is the padded size every rank's shard is stored in.

    >>> shard_numel(torch.empty(5, 3), 2), shard_numel(torch.empty(5, 3), 4)
    (9, 6)
    """
    rows = param.shape[0] if param.dim() else 1
    return -(-rows // world) * math.prod(param.shape[1:])


def shard_shape(param: torch.Tensor, world: int) -> tuple[int, ...]:
    if not param.dim():
        return ()
    return (-(-param.shape[0] // world), *param.shape[1:])


class Fsdp2(Engine):
    """FSDP2's division and its all-gathers and reduce-scatters, per unit (see the module)."""

    name = "fsdp2"

    def __init__(self, world: int, device: str) -> None:
        self.world = world
        self.gloo = device == "cpu"
        self.units: list[_Unit] = []
        self.counter: StepCounter | None = None
        self.kept: Any = None  # the last forward all-gather's flat buffer, until the next
        self.reducing: list[torch.Tensor] = []  # the last reduce-scatter's input
        self.order: list[_Unit] = []  # units in the order their forwards ended
        self.backward = False
        self._stand_ins: list[nn.Parameter] = []

    def attach(self, twin: nn.Module, blocks: list[nn.Module]) -> None:
        owned: set[int] = set()
        units = []
        for block in blocks:
            params = [p for p in block.parameters() if id(p) not in owned]
            owned.update(map(id, params))
            units.append(_Unit(self, block, params, root=False))
        rest = [p for p in twin.parameters() if id(p) not in owned]
        self.units = [_Unit(self, twin, rest, root=True), *units]

    def param_bytes(self, param: torch.Tensor) -> int:
        return shard_numel(param, self.world) * param.element_size()

    def grads_held(self, learners: list[nn.Parameter]) -> int:
        return sum(self.param_bytes(p) for p in learners)

    def start(self, counter: StepCounter, learnable: list[nn.Parameter]) -> list[Any]:
        self.counter, self.kept, self.reducing, self.order = counter, None, [], []
        self.backward = False
        for unit in self.units:
            unit.reset()
        return []

    def after_backward(self) -> None:
        """FSDP2's final callback: units whose inputs had no gradient reduce now, the root
        first, then the blocks in order; the last reduce-scatter's input is freed."""
        for unit in self.units:
            if not unit.reduced:
                unit.post_backward()
        self.reducing = []
        self.backward = False

    def stepped(self, learnable: list[nn.Parameter], counter: StepCounter) -> list[nn.Parameter]:
        stand_ins = []
        for param in learnable:
            with counter.paused():  # their bytes are the parameter's and its gradient's
                shard = nn.Parameter(torch.empty(shard_shape(param, self.world), dtype=param.dtype))
                if param.grad is not None:
                    shard.grad = torch.empty_like(shard)
            counter.track(shard, "model", size=0)
            if shard.grad is not None:
                counter.track(shard.grad, "grad", size=0)
            stand_ins.append(shard)
        self._stand_ins = stand_ins
        return stand_ins

    def finish(self, learnable: list[nn.Parameter]) -> None:
        for param in learnable:
            param.grad = None
        self._stand_ins = []

    def empty(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(nbytes // dtype.itemsize, dtype=dtype)


class _Unit:
    """One ``fully_shard``-ed module: its parameters' sizes and where its buffers are."""

    def __init__(self, engine: Fsdp2, module: nn.Module, params: list[nn.Parameter], *, root: bool):
        self.engine, self.params, self.root = engine, params, root
        world = engine.world
        self.shards = [shard_numel(p, world) * p.element_size() for p in params]
        self.dtype = params[0].dtype if params else torch.float32
        self.reset()
        if params:
            module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
            module.register_forward_hook(self._post_forward, prepend=True)

    def reset(self) -> None:
        self.flat: torch.Tensor | None = None  # an all-gather not copied out yet
        self.gathered: list[torch.Tensor] | None = None  # the unsharded parameters
        self.in_backward = False  # its forward's output requires grad
        self.pre_backward_done = False
        self.reduced = False  # its post-backward ran in this backward

    # -- all-gather and reshard ---------------------------------------------------------------
    def unshard(self) -> None:
        if self.flat is None and self.gathered is None:
            total = self.engine.world * sum(self.shards)
            self.flat = self.engine.empty(total, torch.uint8)

    def wait(self, *, forward: bool) -> None:
        """Copy the all-gather out into the unsharded parameters. In forward the flat buffer
        is kept until the next unit's copy-out; the one kept before is freed now."""
        if self.flat is None:
            return
        engine = self.engine
        previous = engine.kept if forward else None
        world = engine.world
        pairs = zip(self.params, self.shards, strict=True)
        self.gathered = [engine.empty(world * size, p.dtype) for p, size in pairs]
        if forward:
            engine.kept = self.flat
        self.flat = None
        del previous

    def reshard(self) -> None:
        self.gathered = None

    # -- hooks --------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if self.engine.backward:  # a checkpointed block recomputed: gathered already
            self.unshard()
            self.wait(forward=False)
            return None
        self.unshard()
        self.wait(forward=True)
        if not torch.is_grad_enabled():
            return None
        return end_at_inputs_backward(self.post_backward, args, kwargs)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        engine = self.engine
        if engine.backward:
            return
        if not self.root:
            self.reshard()
        engine.order.append(self)
        grads = [t for t in tensors_in(output) if t.requires_grad]
        self.in_backward = bool(grads)
        for tensor in grads:
            tensor.register_hook(self._pre_backward)
        if self.root:
            engine.kept = None  # the last block's flat buffer

    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.pre_backward_done:
            return
        self.pre_backward_done = True
        engine = self.engine
        engine.backward = True
        self.unshard()
        self.wait(forward=False)
        index = len(engine.order) - 1 - engine.order[::-1].index(self)
        if index > 0 and engine.order[index - 1].in_backward:
            engine.order[index - 1].unshard()  # backward prefetch: gathered, not copied out

    def post_backward(self) -> None:
        self.reduced = True
        engine = self.engine
        pairs = zip(self.params, self.shards, strict=True)
        grads = [(p, size) for p, size in pairs if p.grad is not None]
        self.reshard()
        engine.reducing = []  # the previous unit's reduce-scatter input
        if not grads:
            return
        dtype = grads[0][0].grad.dtype  # type: ignore[union-attr]
        total = sum(size for _, size in grads)
        reducing = engine.empty(engine.world * total, dtype)
        counter = engine.counter
        assert counter is not None
        for param, size in grads:
            counter.track(param.grad, "grad", size=size)  # type: ignore[arg-type]
        if engine.gloo:  # gloo copies the input while it reduces
            copy = engine.empty(engine.world * total, dtype)
            del copy
        engine.reducing = [reducing]
