"""Prefix replay: a block before the cut is simulated once, then replayed in later rows.

Blocks before the cut run with grad off and do the same work at every depth. The first time
block ``i`` runs that way, its forward is simulated and recorded: how far the live bytes rose
above their level at entry, and the shapes of what it returned. In later rows the block's
``forward`` raises the counter's peak by as much and returns fresh fake tensors of those
shapes, without running. This is exact when the block leaves nothing behind but its outputs
(checked when recording; autocast's weight cache, a KV cache or a block returning its input
are run every time), and the same inputs (shapes, dtypes, other arguments) come in.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._plumbing.torch_internals import storage_key
from .._plumbing.torch_internals.trees import tree_flatten, tree_unflatten
from .counter import StepCounter


@dataclass(frozen=True)
class _Record:
    """What one run of a block with grad off did to the live bytes, and what it returned."""

    key: tuple[Any, ...]
    rise: int  # the block's peak above the live bytes at its entry
    leaves: list[Any]  # the output's leaves: tensors as (shape, stride, dtype), others as is
    spec: Any

    def replay(self, counter: StepCounter) -> Any:
        counter.raise_peak(self.rise)
        leaves = [
            torch.empty_strided(leaf[1], leaf[2], dtype=leaf[3])
            if isinstance(leaf, tuple) and leaf and leaf[0] is _TENSOR
            else leaf
            for leaf in self.leaves
        ]
        return tree_unflatten(leaves, self.spec)


_TENSOR = object()  # marks a tensor's description among the output's leaves


class PrefixReplay:
    """Records and replays ``blocks`` while they run with grad off (see the module)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.counter: StepCounter | None = None  # the running row's; None: no replay
        self.records: dict[int, _Record | None] = {}  # None: seen, cannot be replayed
        self._blocks = blocks
        for index, block in enumerate(blocks):
            if "forward" not in block.__dict__:  # installed before the gate wraps forward
                object.__setattr__(block, "forward", _BlockForward(self, index, block.forward))

    def remove(self) -> None:
        for block in self._blocks:
            if isinstance(block.__dict__.get("forward"), _BlockForward):
                del block.__dict__["forward"]


class _BlockForward:
    """A block's ``forward`` that the planner can record and replay."""

    def __init__(self, replay: PrefixReplay, index: int, inner: Any) -> None:
        self._replay, self._index, self.inner = replay, index, inner

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.inner)  # what callers that inspect ``forward`` rely on

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        counter = self._replay.counter
        if counter is None or torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        key = _signature(args, kwargs)
        records = self._replay.records
        record = records.get(self._index)
        if record is not None and record.key == key:
            return record.replay(counter)
        if self._index in records and record is None:
            return self.inner(*args, **kwargs)
        entry, outer_window = counter.live, counter.window
        counter.window = entry
        output = self.inner(*args, **kwargs)
        records[self._index] = _recorded(output, key, counter, entry)
        counter.window = max(outer_window, counter.window)
        return output


def _recorded(
    output: Any, key: tuple[Any, ...], counter: StepCounter, entry: int
) -> _Record | None:
    """The record of a block run that left only its outputs behind, else ``None``."""
    leaves, spec = tree_flatten(output)
    described: list[Any] = []
    storages: dict[int, int] = {}
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            described.append(leaf)
            continue
        storage = leaf.untyped_storage()
        whole = leaf.storage_offset() == 0 and storage.nbytes() == _span(leaf)
        if not whole or leaf.requires_grad or storage_key(storage) in storages:
            return None  # a view into more memory, or shared: not described by its shape
        storages[storage_key(storage)] = counter.size_of(storage)
        described.append((_TENSOR, tuple(leaf.shape), leaf.stride(), leaf.dtype))
    if counter.live - entry != sum(storages.values()):
        return None  # something else outlived the block (a cache, the input returned)
    return _Record(key, counter.window - entry, described, spec)


def _span(tensor: torch.Tensor) -> int:
    """The bytes a tensor of this shape and stride reaches from its first element."""
    if tensor.numel() == 0:
        return 0
    last = sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return (last + 1) * tensor.element_size()


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a block's inputs look like: tensors by shape, stride and dtype, the rest by type
    (or value, for numbers, strings and None)."""
    leaves, _ = tree_flatten((args, kwargs))
    return tuple(
        (tuple(leaf.shape), leaf.stride(), leaf.dtype)
        if isinstance(leaf, torch.Tensor)
        else leaf
        if isinstance(leaf, (int, float, str, bool, type(None)))
        else type(leaf)
        for leaf in leaves
    ) + tuple(kwargs)
