"""FSDP2 with a per-step plan: no backward all-gather for blocks backward does not run through."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from itertools import count
from typing import Any

import torch
from torch import nn

from .._plumbing.errors import GradgateError
from .._plumbing.hook_set import HookSet
from .._plumbing.torch_internals import queue_after_backward
from .held import graph_of


def apply_plan_to_fsdp(
    block_modules: Sequence[nn.Module], in_backward: Sequence[bool]
) -> Callable[[], None]:
    """Stop FSDP2 from all-gathering blocks that backward does not run through this step.

    ``in_backward[i]`` is whether block ``i`` takes part in backward: it learns, or a block
    before it learns so the gradient passes through it. Blocks that ran with no graph (before
    the cut, or skipped) do not, yet FSDP2's backward prefetch all-gathers the last of them;
    ``set_unshard_in_backward(False)`` on them makes backward all-gather exactly the learning
    units. Returns a function that restores the previous settings. Blocks that are not
    ``fully_shard``-ed are left alone.

    >>> restore = apply_plan_to_fsdp([nn.Linear(2, 2)], [False])  # not FSDP: no-op
    >>> restore()
    """
    if len(block_modules) != len(in_backward):
        raise GradgateError(
            f"apply_plan_to_fsdp got {len(block_modules)} blocks and {len(in_backward)} "
            "in_backward flags; expected one flag per block."
        )
    previous: list[tuple[Any, bool]] = []
    for module, needed in zip(block_modules, in_backward, strict=True):
        for group in [] if needed else _fsdp_param_groups(module):
            previous.append((group, group.unshard_in_backward))
            group.unshard_in_backward = False

    def restore() -> None:
        for group, value in reversed(previous):
            group.unshard_in_backward = value
        previous.clear()

    return restore


def _fsdp_param_groups(module: nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    if not isinstance(module, FSDPModule):
        return []
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # newer torch: several per module
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)  # earlier: at most one
        groups = [] if group is None else [group]
    # torch before set_unshard_in_backward has no such setting: nothing to change there
    return [group for group in groups if hasattr(group, "unshard_in_backward")]


class FsdpPlan:
    """A gate's FSDP2 settings: backward all-gathers the blocks it runs through.

    That is the union of what every forward whose backward is still to come needed (the plan
    may change between a forward and its backward, or between several forwards summed into one
    loss), or, with none to come, what the plan now needs. Blocks ``fully_shard``-ed after the
    gate was made are found at the next forward. ``needs()`` says, per block, whether backward
    runs through it; ``hooks`` are the gate's, to be put around FSDP2's.
    """

    def __init__(
        self, blocks: list[nn.Module], needs: Callable[[], list[bool]], hooks: HookSet
    ) -> None:
        self._blocks, self._needs, self._hooks = blocks, needs, hooks
        self._sharded = _any_sharded(blocks)
        self._wanted: list[bool] | None = None  # the current plan's, computed once sharded
        self._pending: dict[int, list[bool]] = {}  # per forward whose backward is to come
        self._keys = count()
        self._original: dict[Any, bool] | None = None  # each group's setting before the gate

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 shards a block (its parameters then change between calls)."""
        return self._sharded

    def plan_changed(self) -> None:
        if self._sharded:
            self._wanted = self._needs()
            self._apply()

    def before_forward(self) -> None:
        """Find blocks ``fully_shard``-ed since the gate was made (called while a process group
        runs): the gate's hooks then go around FSDP2's, as if the gate came after (its
        pre-forward sees what the gate froze), and the plan applies."""
        if self._sharded:
            return
        if _any_sharded(self._blocks):
            self._sharded = True
            self._hooks.outermost()
            self.plan_changed()

    def after_forward(self, output: Any) -> None:
        """Keep this forward's blocks all-gathered in backward until its backward is done."""
        if not self._sharded:
            return
        self._wanted = self._needs()  # also learns where named modules ran
        graph = graph_of(output)
        if graph:
            key = next(self._keys)
            self._pending[key] = self._wanted
            done = _AtBackward(self._pending, key)
            # an output dropped with no backward frees the hook, and with it the entry
            weakref.finalize(done, self._pending.pop, key, None)
            for tensor in graph:
                tensor.register_hook(done)
        self._apply()

    def _apply(self) -> None:
        assert self._wanted is not None
        # a plan set after a forward is for the next forward, not for this one's backward
        needs = list(self._pending.values()) or [self._wanted]
        groups = [_fsdp_param_groups(block) for block in self._blocks]
        if self._original is None:
            self._original = {g: g.unshard_in_backward for block in groups for g in block}
        # every flag is set each time, so a setting changed by hand in between is no trap
        for block, needed in zip(groups, map(any, zip(*needs, strict=True)), strict=True):
            for group in block:
                group.unshard_in_backward = needed and self._original.get(group, True)

    def restore(self) -> None:
        original, self._original = self._original or {}, None
        for group, value in original.items():
            group.unshard_in_backward = value


class _AtBackward:
    """A hook on a forward's outputs: at the end of the backward that reaches them, the forward
    no longer needs its blocks all-gathered."""

    def __init__(self, pending: dict[int, list[bool]], key: int) -> None:
        self._pending, self._key, self._queued = pending, key, False

    def __call__(self, grad: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            if not queue_after_backward(self._done):  # every torch with FSDP2 can, in fact
                self._done()

    def _done(self) -> None:
        self._pending.pop(self._key, None)


def _any_sharded(blocks: list[nn.Module]) -> bool:
    # a class attribute: fully_shard swaps the module's class, and no __getattr__ runs
    return any(getattr(type(m), "set_unshard_in_backward", None) for m in blocks)
