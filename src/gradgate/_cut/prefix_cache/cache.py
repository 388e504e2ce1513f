"""``PrefixCache``: skip the frozen prefix. From the second time a sample is seen at a cut, its
input to the first learner comes from the cache and the blocks before the cut do not run."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

import torch

from ..._plumbing.errors import InvalidOptionError, PrefixCacheError, PrefixCacheWarning, warn
from ..._plumbing.handles import Handle
from ..._plumbing.units import parse_bytes
from ..._plumbing.validate import check_choice, probability_option
from ..gate import BackpropGate
from .fingerprint import Hasher, input_fingerprints, tensors_of, weights_state
from .keys import Key, KeyedDataset, check_count, normalize_keys
from .messages import UNKEYED, changed_input_message, mismatch_message
from .prefix import (
    CutState,
    cut_of,
    modules_named,
    named_tensors,
    prefix_modules,
    random_message,
    random_parts,
    watch_registrations,
)
from .rows import Padding, batch_size
from .run import Mode, Run
from .stores import DiskStore, Entry, MemoryStore, disk_root
from .wrappers import BlockForward, CacheForward

StoreKind = Literal["memory", "disk"]


@dataclass(frozen=True)
class CacheStats:
    """What a cache did so far: samples served (``hits``) and run (``misses``), bytes held
    (``stored_bytes``), forward FLOPs of the blocks it did not run (``skipped_flops``), entries
    held, hits recomputed to check them, and misses not stored (past ``max_bytes``)."""

    hits: int
    misses: int
    stored_bytes: int
    skipped_flops: int
    entries: int
    checked: int
    not_stored: int

    def __getitem__(self, name: str) -> int:
        return int(getattr(self, name))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class PrefixCache(Handle):
    """Skip the frozen prefix: inside ``with cache.keys(ids):`` (one stable key per sample),
    each sample's input to the first learning block is stored the first time it runs at a cut,
    and later forwards read it instead of running the blocks before the cut.

    Exact: the learner gets the very tensor the prefix would compute, so loss and gradients
    equal the gate alone's (see docs/prefix-cache.md for when a prefix is not deterministic).
    Never stale: entries are kept per cut, and dropped when the prefix's weights change (a
    checkpoint loaded in place, an optimizer step); a key whose input changed raises, and
    ``check`` (a share of hits) recomputes hits and compares them bit for bit.

    ``store``: ``"memory"`` (host memory) or ``"disk"`` (memory-mapped files under ``path``,
    found again by a later run of the same model and cut); ``max_bytes`` bounds it (a size such
    as ``"8GiB"``; past it, misses are not stored). ``cache.stats``: hits, misses, stored bytes,
    skipped forward FLOPs. ``remove()`` (or leaving a ``with`` block) takes it off the model.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    >>> gate = gg.BackpropGate(net, depth=1)
    >>> cache = gg.PrefixCache(gate)
    >>> x = torch.randn(3, 4)
    >>> for epoch in range(2):
    ...     with cache.keys([0, 1, 2]):
    ...         net(x).sum().backward()
    >>> cache.stats.hits, cache.stats.misses
    (3, 3)
    """

    def __init__(
        self,
        gate: BackpropGate,
        store: StoreKind = "memory",
        path: str | os.PathLike[str] | None = None,
        max_bytes: int | float | str | None = None,
        check: float = 0.01,
    ) -> None:
        if not isinstance(gate, BackpropGate) or not gate.active:
            raise InvalidOptionError(
                f"gate={gate!r:.80} (a {type(gate).__name__}); expected a live "
                "gg.BackpropGate: the cache skips the blocks "
                "before its cut, e.g. gg.PrefixCache(gg.BackpropGate(model, depth=1))."
            )
        check_choice("store", store, get_args(StoreKind))
        if store == "disk" and path is None:
            raise InvalidOptionError(
                "store='disk' needs a path: the directory of the memory-mapped entries, e.g. "
                "gg.PrefixCache(gate, store='disk', path='prefix-cache/')."
            )
        if store == "memory" and path is not None:
            raise InvalidOptionError(
                f"path={path!r} with store='memory'; expected no path (a memory store keeps "
                "nothing on disk), or store='disk' to keep the entries under that path."
            )
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise InvalidOptionError(f"path={path!r}; expected a directory name (str or Path).")
        limit = None if max_bytes is None else parse_bytes(max_bytes, "max_bytes")
        self.check = probability_option("check", check)
        self.gate = gate
        model = gate._model
        if store == "disk":
            identity = {"model": type(model).__qualname__, "blocks": gate.blocks}
            self._store: MemoryStore = DiskStore(disk_root(path), limit, identity)  # type: ignore[arg-type]
        else:
            self._store = MemoryStore(limit)
        self.store, self.path, self.max_bytes = store, path, limit
        self._states: dict[int, CutState] = {}
        self._local = threading.local()
        self._hasher = Hasher()
        self._rng = random.Random(0)  # which batches are checked; never torch's generator
        self._counts = {"hits": 0, "misses": 0, "checked": 0, "not_stored": 0}
        self._skipped = 0.0
        self._keyed = 0  # forwards that had keys (a trainer callback looks after a step)
        self._block_flops: dict[tuple[Any, ...], int] = {}  # per kind of block call
        self._registered = 0  # assignments to a prefix module (its tensors are walked again)
        self._watched: set[int] = set()  # the ids of every known prefix's modules
        self._watches = watch_registrations(self._watched, self._assigned)
        self._warned: set[str] = set()
        self._training: bool | None = None
        self._store_device = torch.device("cpu")
        self._wrappers: list[CacheForward | BlockForward] = [CacheForward(model, self)]
        seen: set[int] = set()
        for position, (_, block) in enumerate(gate._points):
            if id(block) not in seen:
                seen.add(id(block))
                self._wrappers.append(BlockForward(block, self, position))
        for wrapper in self._wrappers:
            wrapper.install()
        super().__init__(self._take_off, description=f"prefix cache on {type(model).__name__}")
        cut = cut_of(gate)
        if cut is not None:
            modules, _ = prefix_modules(gate, set(range(min(cut, len(gate._points)))), set())
            self._warn_random(modules, cut)

    # -- the public side ---------------------------------------------------------------------
    @contextmanager
    def keys(self, ids: Any) -> Iterator[None]:
        """Inside this block, the model's forwards see these keys, one per sample of the batch
        (ints or strings, e.g. dataset indices), in the batch's order."""
        keys = normalize_keys(ids)
        stack = self._keys_stack()
        stack.append(keys)
        try:
            yield
        finally:
            stack.pop()

    @property
    def stats(self) -> CacheStats:
        """Hits, misses, stored bytes and skipped forward FLOPs so far; also the entries held,
        the hits checked and the misses not stored."""
        return CacheStats(
            hits=self._counts["hits"],
            misses=self._counts["misses"],
            stored_bytes=self._store.stored_bytes,
            skipped_flops=int(self._skipped),
            entries=self._store.count(),
            checked=self._counts["checked"],
            not_stored=self._counts["not_stored"],
        )

    def clear(self) -> None:
        """Drop every entry (a disk store's files too) and what the cache learned of each cut."""
        for state in list(self._states.values()):
            self._store.drop(state.position)
        self._states.clear()

    @staticmethod
    def keyed(dataset: Any, *, offset: int = 0) -> KeyedDataset:
        """``dataset`` with each item's index as its key (``offset`` added): a ``gradgate_key``
        entry in dict items (``model(**batch)`` hands it to the cache), or a last element in
        tuple items."""
        return KeyedDataset(dataset, offset=offset)

    def __repr__(self) -> str:
        where = "memory" if self.store == "memory" else f"disk at {str(self.path)!r}"
        state = "" if self.active else " (removed)"
        return f"<gradgate.PrefixCache in {where}, {self.stats.entries} entries{state}>"

    # -- a forward ---------------------------------------------------------------------------
    def _keys_stack(self) -> list[list[Key]]:
        stack: list[list[Key]] | None = getattr(self._local, "keys", None)
        if stack is None:
            stack = self._local.keys = []
        return stack

    def _forward(self, inner: Any, args: Any, kwargs: dict[str, Any], keys: Any) -> Any:
        given = normalize_keys(keys) if keys is not None else None
        stack = self._keys_stack()
        active = given if given is not None else (stack[-1] if stack else None)
        self._keyed += active is not None
        run = None if active is None or not self.active else self._begin(args, kwargs, active)
        if run is None:
            return inner(*args, **kwargs)
        outer = getattr(self._local, "run", None)
        self._local.run = run
        try:
            output = inner(*args, **kwargs)
        finally:
            self._local.run = outer
        run.finish(output)
        return output

    def _begin(self, args: Any, kwargs: dict[str, Any], keys: list[Key]) -> Run | None:
        batch = batch_size(args, kwargs)
        check_count(keys, batch)
        cut = cut_of(self.gate)
        if cut is None or batch is None:
            return None
        state = self._states.get(cut)
        if state is None:
            state = self._states[cut] = CutState(cut)
        if state.uncacheable is not None:
            return None
        self._load(state)
        if self.gate._model.training is not self._training and state.modules is not None:
            self._training = self.gate._model.training
            self._warn_random(state.modules, cut)
        fresh = snapshot = None
        if state.modules is not None:
            fresh = weights_state(self._tensors(state))
            if state.fingerprint is not None and fresh != state.fingerprint:
                self._forget(state)  # the prefix's weights changed: recompute
        else:
            everything = tensors_of(self.gate._model.modules())
            snapshot = {id(t): (id(t), t._version, t.data_ptr()) for t in everything}
        padding = Padding.of(kwargs, batch)
        starts, lengths = (padding.starts, padding.lengths) if padding else (None, None)
        inputs = input_fingerprints(self._hasher, args, kwargs, batch, starts, lengths)
        entries: list[Entry | None] = [None] * batch
        if state.fingerprint is not None:
            for i, key in enumerate(keys):
                entry = self._store.get(cut, key)
                if entry is None:
                    continue
                if entry.inputs != inputs[i]:
                    self._changed_input(key)
                if not entry.fits(padding, i):
                    continue  # its tokens sit elsewhere now (left padding): run it again
                entries[i] = entry
        hits = sum(entry is not None for entry in entries)
        if not hits:
            mode = Mode.MISS
        elif self.check and (not state.checked or self._rng.random() < self.check):
            mode = Mode.CHECK
            state.checked = True
        elif hits == batch:
            mode = Mode.HIT
        else:  # the misses alone, where that computes them as the whole batch would
            mode = Mode.SOME if state.sub_batches else Mode.CHECK
        run = Run(self, state, keys, entries, padding, inputs, mode, fresh)
        run.snapshot = snapshot
        return run

    def _load(self, state: CutState) -> None:
        """A disk store's entries of this cut written by an earlier run, if their prefix has
        the weights the model has now (else the directory is refused)."""
        store = self._store
        if not isinstance(store, DiskStore) or store.loaded(state.position):
            return
        manifest = store.manifest(state.position)
        if manifest is None:
            return
        model = self.gate._model
        modules = modules_named(model, manifest["prefix"])
        weights = (
            None
            if modules is None
            else self._hasher.named(named_tensors(model, manifest["prefix"]))
        )
        if weights != manifest["weights"]:
            raise PrefixCacheError(
                f"{str(store.root)!r} holds entries for the cut at block {state.position} "
                "computed with other weights before the cut (another checkpoint, or weights "
                f"trained since: fingerprint {manifest['weights']} there, {weights} now); "
                "expected the weights it was made with. Use another path, or delete "
                f"{str(store.root / f'cut-{state.position}')!r} to compute them again."
            )
        state.modules, state.names = modules, manifest["prefix"]
        self._watched.update(id(m) for m in modules)  # type: ignore[union-attr]
        state.leaves, state.spec, state.flops = (
            manifest["leaves"],
            manifest["spec"],
            manifest["flops"],
        )
        state.fingerprint = weights_state(self._tensors(state))
        store.load(state.position)

    def _put(self, run: Run, entries: dict[Key, Entry]) -> None:
        """Store a forward's misses, under the weights they were computed with."""
        state = run.state
        if state.modules is None:  # the first store at this cut: its prefix is what ran before
            frame = self.gate._own_frame()
            outside = {call[0] for call in frame.outside_calls} if frame else set()
            positions = set(range(min(state.position, len(self.gate._points))))
            state.modules, state.names = prefix_modules(self.gate, positions, outside)
            self._watched.update(id(m) for m in state.modules)
            assert run.snapshot is not None
            tensors = self._tensors(state)
            then = [run.snapshot.get(id(t), (id(t), t._version, t.data_ptr())) for t in tensors]
            run.fresh = tuple(value for part in zip(*then, strict=True) for value in part)
            self._warn_random(state.modules, state.position)
        if state.fingerprint is None:
            state.fingerprint = run.fresh
            self._store.begin(state.position, self._manifest(state))
        for key, entry in entries.items():
            if not self._room(state.position, key, entry.nbytes):
                self._counts["not_stored"] += 1
                continue
            self._store.put(state.position, key, entry)
        self._store.flush()

    def _room(self, cut: int, key: Key, nbytes: int) -> bool:
        if self._store.room_for(cut, key, nbytes):
            return True
        for state in list(self._states.values()):  # cuts whose prefix has changed since
            known = state.position != cut and state.modules is not None and state.fingerprint
            if known and weights_state(self._tensors(state)) != state.fingerprint:
                self._forget(state)
        return self._store.room_for(cut, key, nbytes)

    def _manifest(self, state: CutState) -> dict[str, Any]:
        if not isinstance(self._store, DiskStore):
            return {}
        assert state.names is not None
        weights = self._hasher.named(named_tensors(self.gate._model, state.names))
        return {
            "cut": state.position,
            "prefix": state.names,
            "weights": weights,
            "leaves": state.leaves,
            "spec": state.spec,
            "flops": state.flops,
        }

    def _tensors(self, state: CutState) -> list[torch.Tensor]:
        """The parameters and buffers of a cut's prefix, walked again after an assignment to
        one of its modules (a parameter replaced, a submodule swapped)."""
        if state.tensors is None or state.walked != self._registered:
            assert state.names is not None and state.modules is not None
            if state.walked != -1:  # a module may have been swapped: find them again by name
                state.modules = modules_named(self.gate._model, state.names) or state.modules
                self._watched.update(id(m) for m in state.modules)
            state.tensors, state.walked = tensors_of(state.modules), self._registered
        return state.tensors

    def _assigned(self) -> None:
        self._registered += 1

    def _forget(self, state: CutState) -> None:
        """Drop a cut's entries: they no longer hold (new weights, another call)."""
        self._store.drop(state.position)
        state.fingerprint = None

    def _count(self, run: Run) -> None:
        counts = self._counts
        counts["misses"] += len(run.misses)
        counts["hits"] += len(run.hits)
        if run.mode is Mode.CHECK:
            counts["checked"] += len(run.hits)
        elif run.state.flops is not None:
            self._skipped += run.state.flops * len(run.hits)
        if run.flops is not None and run.state.flops is not None and run.reached:
            store = self._store
            if isinstance(store, DiskStore) and run.state.fingerprint is not None:
                manifest = store.manifest(run.state.position)
                if manifest is not None and manifest.get("flops") is None:
                    store.rewrite(run.state.position, {**manifest, "flops": run.state.flops})

    # -- what goes wrong ---------------------------------------------------------------------
    def _warn_if_unkeyed(self) -> None:
        """After a trainer's first step: say so if no forward had keys (the cache did nothing)."""
        if not self._keyed:
            self._warn_once("unkeyed", UNKEYED)

    def _unusable(self, state: CutState, reason: str) -> None:
        state.uncacheable = reason
        self._forget(state)
        name = self._cut_name(state.position)
        self._warn_once(
            f"cut-{state.position}",
            f"the prefix cache cannot serve the cut at {name!r}: {reason}. Forwards at this cut "
            "run the prefix as usual (no entries are stored).",
        )

    def _warn_random(self, modules: list[Any], cut: int) -> None:
        names = {id(m): n for n, m in self.gate._model.named_modules()}
        found = random_parts(modules, names, self.gate.prefix_mode)
        if found:
            self._warn_once(f"random-{found}", random_message(found, cut, self.gate.blocks))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message, PrefixCacheWarning)

    def _cut_name(self, position: int) -> str:
        blocks = self.gate.blocks
        return blocks[position] if position < len(blocks) else "the end of the blocks"

    def _changed_input(self, key: Key) -> None:
        raise PrefixCacheError(changed_input_message(key))

    def _mismatch(self, state: CutState, key: Key, cached: torch.Tensor, now: torch.Tensor) -> None:
        names = {id(m): n for n, m in self.gate._model.named_modules()}
        found = random_parts(state.modules or [], names, self.gate.prefix_mode)
        where = self._cut_name(state.position)
        raise PrefixCacheError(mismatch_message(where, key, cached, now, found))

    def _take_off(self) -> None:
        for handle in self._watches:
            handle.remove()
        for wrapper in reversed(self._wrappers):
            wrapper.uninstall()
        self._wrappers = []
        self._store.close()
        self._states.clear()
