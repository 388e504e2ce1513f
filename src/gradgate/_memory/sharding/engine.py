"""What a planned step asks of the engine that runs it: the bytes each rank holds of a
parameter, the buffers the engine keeps, what it does around each unit's forward and backward,
and the tensors the optimizer steps. :class:`Engine` itself is one device (nothing divided)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..._plumbing.torch_internals.trees import tree_flatten, tree_unflatten
from ..counter import StepCounter


class Engine:
    """One device: every parameter whole, no buffers, nothing around the units.

    The step calls, per row: :meth:`start` (inside the counter, before the forward), the
    forward and backward with the hooks :meth:`attach` put on the twin, :meth:`after_backward`,
    :meth:`stepped` (what the optimizer gets), the optimizer's step and ``zero_grad``, then
    :meth:`finish`.
    """

    name: str | None = None
    world = 1
    rank = 0  # the rank the rows describe: the one holding the most

    def attach(self, twin: nn.Module, blocks: list[nn.Module]) -> None:
        """Hooks on the twin's units, once (the twin is thrown away after planning)."""

    def param_bytes(self, param: torch.Tensor) -> int:
        """The bytes this rank holds of ``param``."""
        return param.nbytes

    def model_extra(self) -> int:
        """Bytes of the model this rank holds beyond its parameters' own (alignment padding,
        parameters kept gathered): made as buffers by :meth:`start`."""
        return 0

    def grads_held(self, learners: list[nn.Parameter]) -> int:
        """The gradient bytes this rank holds when backward ends (``learners``: the
        parameters that got a gradient)."""
        return sum(p.nbytes for p in learners)

    def masters_held(self) -> int:
        """Bytes of master weights the engine keeps itself (DeepSpeed's fp32 partition)."""
        return 0

    def start(self, counter: StepCounter, learnable: list[nn.Parameter]) -> list[Any]:
        """The engine's buffers alive through the whole step, made now (kept by the caller)."""
        return []

    def after_backward(self) -> None:
        """What the engine does when backward ends (FSDP2's final callback)."""

    def stepped(self, learnable: list[nn.Parameter], counter: StepCounter) -> list[nn.Parameter]:
        """The tensors the optimizer steps, with their gradients: this rank's shards."""
        return learnable

    def finish(self, learnable: list[nn.Parameter]) -> None:
        """After ``zero_grad``: the twin's gradients dropped where the optimizer stepped
        stand-ins."""


def end_at_inputs_backward(done: Callable[[], None], args: Any, kwargs: Any) -> Any:
    """``(args, kwargs)`` with the tensors that need grad passed through one node whose backward
    calls ``done``: the engines' way to learn that a module's backward ended (FSDP2 and ZeRO-3
    do the same). ``None`` when no input needs grad."""
    leaves, spec = tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not where:
        return None
    wrapped = _InputsBackward.apply(done, *(leaves[i] for i in where))
    for i, tensor in zip(where, wrapped, strict=True):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


class _InputsBackward(torch.autograd.Function):
    """The inputs pass through; their backward is the end of the module they enter."""

    @staticmethod
    def forward(ctx: Any, done: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.done = done
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.done()
        return (None, *grads)
