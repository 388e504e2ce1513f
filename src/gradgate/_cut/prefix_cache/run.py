"""One forward of a model with a prefix cache: which samples hit, and what each block call
becomes. With every sample a hit, the blocks before the cut do not run (each returns a stand-in
of its output's shape) and the first learner gets the cached input; with some hits, the blocks
before the cut run on the other samples only; with none (or a checked batch), everything runs
and the misses are stored."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch

from ..._plumbing.autograd import tensors_in
from ..._plumbing.errors import PrefixCacheError
from ..._plumbing.torch_internals.trees import tree_flatten, tree_unflatten
from .keys import Key
from .prefix import CutState
from .rows import Padding, Template, assemble, narrow_batch, sample_rows, widen_batch
from .stores import Entry


class Mode(Enum):
    MISS = "miss"  # no sample hits: everything runs, the samples are stored
    HIT = "hit"  # every sample hits: no block before the cut runs
    SOME = "some"  # the blocks before the cut run on the missing samples only
    CHECK = "check"  # everything runs; the hits are compared with what runs


class Run:
    """The state of one forward: its keys, hits and mode, and where the cut point is."""

    def __init__(
        self,
        cache: Any,  # the PrefixCache (which imports this module)
        state: CutState,
        keys: list[Key],
        entries: list[Entry | None],
        padding: Padding | None,
        inputs: list[int],
        mode: Mode,
        fresh: tuple[int, ...] | None,
    ) -> None:
        self.cache, self.state, self.keys = cache, state, keys
        self.cut, self.n = state.position, len(cache.gate._points)
        self.batch = len(keys)
        self.entries, self.padding, self.inputs, self.mode = entries, padding, inputs, mode
        self.fresh = fresh  # the weights' state that new entries are stored under
        self.hits = [i for i, e in enumerate(entries) if e is not None]
        self.misses = [i for i, e in enumerate(entries) if e is None]
        self._index: torch.Tensor | None = None
        self.reached = False
        self.ran: set[int] = set()  # prefix blocks that ran (or stood in)
        self.snapshot: dict[int, tuple[int, int, int]] | None = None  # weights at the start
        probing = mode is not Mode.HIT and not state.probed
        self.outputs: dict[int, weakref.ref[torch.Tensor]] | None = {} if probing else None
        self.allowed: set[int] = set()
        self.leak: str | None = None
        self.flops = 0.0 if state.flops is None and mode is not Mode.HIT else None
        # a first batch with hits and misses, run whole: do the blocks compute the misses alike
        # on their own? (see _probe_parts)
        self.probing_parts = mode is Mode.CHECK and bool(self.misses) and state.sub_batches is None

    @property
    def index(self) -> torch.Tensor:
        """The misses' rows, as a tensor (to narrow a batch to them)."""
        if self._index is None:
            self._index = torch.tensor(self.misses, dtype=torch.long)
        return self._index

    # -- block calls -------------------------------------------------------------------------
    def block(self, position: int, call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """What a call of block ``position`` becomes in this forward."""
        if self.reached:
            if self.outputs is not None:
                self._look_for_leak(position, (args, kwargs))
            return call(*args, **kwargs)
        if position == self.cut:
            return self._first_learner(call, args, kwargs)
        if position > self.cut:
            self._learner_before_cut(position)
            return call(*args, **kwargs)
        self.ran.add(position)
        last = position == self.n - 1  # the cut is after the last block: its output is cached
        if self.mode is Mode.HIT:
            template = self.state.templates.get(position)
            if template is not None and template.usable:
                output = template.fake(args, kwargs)
            else:  # no stand-in yet (a disk store's first forward): it runs, and leaves one
                output = call(*args, **kwargs)
                self.state.templates[position] = Template(args, kwargs, output)
        elif self.mode is Mode.SOME:
            part = narrow_batch((args, kwargs), self.index, self.batch)
            output = self._measured(position, call, *part)
            output = widen_batch(output, self.index, len(self.misses), self.batch)
        else:
            part = self._part(call, args, kwargs) if self.probing_parts else None
            output = self._measured(position, call, args, kwargs)
            if part is not None:
                self._compare_part(part, output)
        if last:
            output = self._last_output(output)
        elif self.outputs is not None:
            for tensor in tensors_in(output):
                self.outputs[id(tensor)] = weakref.ref(tensor)
        return output

    def _measured(self, position: int, call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """The block's call; at a cut's first miss, also its forward FLOPs, counted once per
        kind of call (block class, input and parameter shapes: a transformer's layers are
        counted once)."""
        if self.flops is None:
            output = call(*args, **kwargs)
        else:
            block = self.cache.gate._points[position][1]
            kind = (
                type(block),
                *((t.shape, t.dtype) for t in tensors_in((args, kwargs))),
                *(p.shape for p in block.parameters()),
            )
            known = self.cache._block_flops.get(kind)
            if known is None:
                from torch.utils.flop_counter import FlopCounterMode

                with FlopCounterMode(display=False) as counter:
                    output = call(*args, **kwargs)
                known = self.cache._block_flops[kind] = counter.get_total_flops()
            else:
                output = call(*args, **kwargs)
            self.flops += known
        if position not in self.state.templates:
            self.state.templates[position] = Template(args, kwargs, output)
        return output

    def _part(self, call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """The block on the misses alone (before it runs on the whole batch: the gate's state
        after the block is then the whole batch's)."""
        part_args, part_kwargs = narrow_batch((args, kwargs), self.index, self.batch)
        with torch.no_grad():
            return call(*part_args, **part_kwargs)

    def _compare_part(self, part: Any, output: Any) -> None:
        """Whether the block computed the misses alone as it did in the whole batch, bit for
        bit (kernels whose blocking depends on the batch's size do not): if every block does,
        later batches with some hits run the blocks before the cut on their misses only."""
        whole = tensors_in(narrow_batch(output, self.index, self.batch))
        alone = tensors_in(part)
        same = len(whole) == len(alone) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(whole, alone, strict=True)
        )
        if not same:
            self.state.sub_batches = False

    def _learner_before_cut(self, position: int) -> None:
        name = self.cache.gate._points[position][0]
        if self.mode in (Mode.HIT, Mode.SOME):
            raise PrefixCacheError(
                f"block {name!r}, after the cut, ran before the first learner "
                f"{self._cut_name()!r} in a forward served from the cache (LayerDrop skipped the "
                "first learner, or the blocks run in another order than listed): its input "
                "comes from blocks the cache did not run. Turn LayerDrop off before the cut, "
                "or do not cache this model."
            )
        self.cache._unusable(
            self.state,
            f"block {name!r} (after the cut) ran before the first learner {self._cut_name()!r}",
        )

    def _cut_name(self) -> str:
        points = self.cache.gate._points
        return points[self.cut][0] if self.cut < len(points) else "the end of the blocks"

    # -- the cut point -------------------------------------------------------------------------
    def _first_learner(self, call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """The first learner's call: its cached arguments come from the cache (hits) and are
        stored (misses). Its arguments are looked at one level deep: the hidden state, not
        inside a tuple of rotary embeddings."""
        leaves = [*args, *kwargs.values()]
        shape = call_shape(args, kwargs)
        if self.mode in (Mode.HIT, Mode.SOME):
            if shape != self.state.spec or self.state.leaves is None:
                raise PrefixCacheError(
                    f"the first learner {self._cut_name()!r} was called with other arguments "
                    "than when its inputs were cached (another structure of positional and "
                    "keyword arguments); expected the same call at every forward. Clear the "
                    "cache (cache.clear()) after changing how the model is called."
                )
            live = [leaves[i] for i in self.state.leaves]
            self._store(live)
            for j, index in enumerate(self.state.leaves):
                leaves[index] = self._served(j, leaves[index])
        else:
            chosen = self._choose(leaves)
            if chosen is not None:
                self._adopt(chosen, shape)
                live = [leaves[i] for i in chosen]
                self._compare(live)
                self._store(live)
        self.reached = True
        count = len(args)
        return call(*leaves[:count], **dict(zip(kwargs, leaves[count:], strict=True)))

    def _last_output(self, output: Any) -> Any:
        """The last block's output when the cut is after it: every tensor in it is cached."""
        leaves, spec = tree_flatten(output)
        chosen = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.reached = True
        if self.mode in (Mode.HIT, Mode.SOME):
            if self.state.leaves != chosen:
                raise PrefixCacheError(
                    "the last block returned another structure than when its output was "
                    "cached; expected the same at every forward. Clear the cache "
                    "(cache.clear()) after changing how the model is called."
                )
            self._store([leaves[i] for i in chosen])
            for j, index in enumerate(chosen):
                leaves[index] = self._served(j, leaves[index])
            return tree_unflatten(leaves, spec)
        if self._checked_leaves(leaves, chosen):
            self._adopt(chosen, str(spec))
            live = [leaves[i] for i in chosen]
            self._compare(live)
            self._store(live)
            self.allowed.update(id(leaves[i]) for i in chosen)
        return output

    def _choose(self, leaves: list[Any]) -> list[int] | None:
        """The cut point's cached tensors: its first tensor argument (the hidden state), and
        any other that a block before the cut returned (a bias computed once and passed on)."""
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not tensors:
            self.cache._unusable(self.state, f"{self._cut_name()!r} got no tensor argument")
            return None
        chosen = [tensors[0]]
        if self.outputs is not None:
            chosen += [
                i
                for i in tensors[1:]
                if (ref := self.outputs.get(id(leaves[i]))) is not None and ref() is leaves[i]
            ]
        elif self.state.leaves is not None:
            chosen = self.state.leaves
        return chosen if self._checked_leaves(leaves, chosen) else None

    def _checked_leaves(self, leaves: list[Any], chosen: list[int]) -> bool:
        for i in chosen:
            tensor = leaves[i]
            if tensor.dim() == 0 or tensor.shape[0] != self.batch:
                self.cache._unusable(
                    self.state,
                    f"a cached value at {self._cut_name()!r} has shape {tuple(tensor.shape)}, "
                    f"with no first dimension of the batch ({self.batch} samples)",
                )
                return False
            if tensor.requires_grad:
                self.cache._unusable(
                    self.state,
                    f"the input of {self._cut_name()!r} carries a graph: something before the "
                    "cut learns",
                )
                return False
        return True

    def _adopt(self, chosen: list[int], shape: str) -> None:
        state = self.state
        if state.leaves != chosen or state.spec != shape:
            if state.leaves is not None:
                self.cache._forget(state)  # entries of another call structure
            state.leaves, state.spec = chosen, shape

    def _served(self, j: int, live: torch.Tensor) -> torch.Tensor:
        """Cached value ``j`` for the whole batch: the hits' rows from their entries, the other
        rows (under SOME) from ``live``."""
        rows = self.hits
        entries = [self.entries[i].tensors[j] for i in rows]  # type: ignore[union-attr]
        return assemble(entries, rows, live, self.padding, keep=self.mode is Mode.SOME)

    def _compare(self, live: list[torch.Tensor]) -> None:
        """A checked batch: each hit's entry against what the prefix computed now, bit for bit."""
        if self.mode is not Mode.CHECK:
            return
        for j, tensor in enumerate(live):
            rows = sample_rows(tensor, self.hits, self.padding, tensor.device)
            for i, row in zip(self.hits, rows, strict=True):
                cached = self.entries[i].tensors[j]  # type: ignore[union-attr]
                if cached.shape != row.shape or not torch.equal(cached.to(row.device), row):
                    self.cache._mismatch(self.state, self.keys[i], cached, row)

    def _store(self, live: list[torch.Tensor]) -> None:
        """Store the misses of this forward (computed by the prefix now)."""
        rows = self.misses
        if not rows:
            return
        device = self.cache._store_device
        per_leaf = [sample_rows(t, rows, self.padding, device) for t in live]
        padding = self.padding
        entries = {}
        for k, i in enumerate(rows):
            tensors = tuple(leaf[k] for leaf in per_leaf)
            if padding is None:
                entries[self.keys[i]] = Entry(tensors, self.inputs[i])
            else:
                start = padding.starts[i]
                steps = None if start == 0 else padding.steps  # left padding: kept whole
                entries[self.keys[i]] = Entry(tensors, self.inputs[i], start, steps)
        self.cache._put(self, entries)

    # -- after the forward ---------------------------------------------------------------------
    def _look_for_leak(self, position: int, value: Any) -> None:
        if self.leak is None and self._from_prefix(value):
            name = self.cache.gate._points[position][0]
            self.leak = (
                f"block {name!r}, after the cut, reads an output of a block before it other "
                "than through the first learner's input"
            )

    def _from_prefix(self, value: Any) -> bool:
        assert self.outputs is not None
        for tensor in tensors_in(value):
            ref = self.outputs.get(id(tensor))
            if ref is not None and ref() is tensor and id(tensor) not in self.allowed:
                return True
        return False

    def finish(self, output: Any) -> None:
        state = self.state
        if self.mode in (Mode.HIT, Mode.SOME) and not self.reached:
            raise PrefixCacheError(
                f"the first learner {self._cut_name()!r} did not run in a forward served from "
                "the cache (LayerDrop skipped it?), so what ran after the cut got stand-ins "
                "for the blocks before it. Turn LayerDrop off before the cut, or do not cache "
                "this model."
            )
        if self.outputs is not None and self.reached:
            if self.leak is None and self._from_prefix(output):
                self.leak = (
                    "the model returns an output of a block before the cut "
                    "(output_hidden_states=True, or a key/value cache of every layer?)"
                )
            state.probed = True
            if self.leak is not None:
                self.cache._unusable(state, self.leak)
        if self.flops is not None and self.reached and self.ran:
            rows = len(self.misses) if self.mode is Mode.SOME else self.batch
            state.flops = self.flops / max(rows, 1)
        if self.probing_parts and self.reached and state.sub_batches is None:
            state.sub_batches = True
        self.outputs = None
        self.cache._count(self)


def rounding_apart(cached: torch.Tensor, now: torch.Tensor) -> bool:
    """Whether two computations of one value differ only as far as the order of floating-point
    sums can make them: a sample computed in another batch, by kernels whose blocking depends on
    the batch (CPU matrix products of 2-D inputs), not a stale entry (dropout, augmentation and
    changed weights move values far more).

    >>> a = torch.tensor([1.0, -2.0, 3.0])
    >>> rounding_apart(a, a + 1e-6), rounding_apart(a, a * 1.01)
    (True, False)
    """
    if cached.shape != now.shape or not cached.is_floating_point():
        return False
    scale = float(now.float().abs().max()) if now.numel() else 0.0
    tolerance = 1e-4 if now.dtype in (torch.float32, torch.float64) else 2e-2
    difference = (cached.float() - now.float()).abs()
    return bool(torch.isfinite(difference).all()) and float(difference.max()) <= tolerance * scale


def call_shape(args: Any, kwargs: Any) -> str:
    """A call's structure: how many positional arguments, the keywords, and which arguments are
    tensors (``T``), ``None`` (``N``) or other values (``O``).

    >>> call_shape((torch.ones(1), None), {"mask": torch.ones(1), "cache": (1, 2)})
    '2|mask,cache|TNTO'
    """
    kinds = "".join(
        "T" if isinstance(v, torch.Tensor) else "N" if v is None else "O"
        for v in (*args, *kwargs.values())
    )
    return f"{len(args)}|{','.join(kwargs)}|{kinds}"
