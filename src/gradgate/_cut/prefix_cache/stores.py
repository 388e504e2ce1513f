"""Where entries live: ``MemoryStore`` (tensors in host memory) and ``DiskStore`` (memory-mapped
``.npy`` files under a directory, found again by a later run).

An entry is one sample's input to the first learner at one cut: a tensor per cached argument.
``max_bytes`` bounds what a store holds: past it, new entries are not stored (the misses still
compute), so the entries kept are the first ones seen, the same ones every epoch (an evicting
store would evict exactly the entries the next epoch asks for first).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..._plumbing.errors import MissingExtraError, PrefixCacheError
from .keys import Key
from .rows import Padding

CHUNK_BYTES = 64 * 2**20  # a disk chunk: one .npy file, filled entry after entry
FORMAT = "gradgate-prefix-cache"
VERSION = 1


@dataclass
class Entry:
    """One sample's cached tensors and its inputs' fingerprint; from a padded batch, where its
    tokens began (``start``) and, for a row kept whole (left padding: the tokens' places depend
    on the padding), the padded length (``steps``). A right-padded row keeps only its tokens."""

    tensors: tuple[torch.Tensor, ...]
    inputs: int
    start: int | None = None
    steps: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def fits(self, padding: Padding | None, row: int) -> bool:
        """Whether the entry serves sample ``row`` of a batch padded as ``padding``."""
        if self.start is None:
            return padding is None
        if padding is None or padding.starts[row] != self.start:
            return False
        return self.steps is None or padding.steps == self.steps


class MemoryStore:
    """Entries as tensors in host memory, per cut."""

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self.stored_bytes = 0
        self._cuts: dict[int, dict[Key, Entry]] = {}

    def get(self, cut: int, key: Key) -> Entry | None:
        entries = self._cuts.get(cut)
        return None if entries is None else entries.get(key)

    def count(self) -> int:
        return sum(len(entries) for entries in self._cuts.values())

    def room_for(self, cut: int, key: Key, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` (replacing ``key``'s, if any) fits in ``max_bytes``."""
        if self.max_bytes is None:
            return True
        return self.stored_bytes - self._bytes_of(cut, key) + nbytes <= self.max_bytes

    def _bytes_of(self, cut: int, key: Key) -> int:
        old = self.get(cut, key)
        return 0 if old is None else old.nbytes

    def put(self, cut: int, key: Key, entry: Entry) -> None:
        entries = self._cuts.setdefault(cut, {})
        old = entries.get(key)
        self.stored_bytes += entry.nbytes - (old.nbytes if old else 0)
        entries[key] = entry

    def drop(self, cut: int) -> None:
        entries = self._cuts.pop(cut, {})
        self.stored_bytes -= sum(e.nbytes for e in entries.values())

    def manifest(self, cut: int) -> dict[str, Any] | None:
        return None  # nothing outlives the process

    def begin(self, cut: int, manifest: dict[str, Any]) -> None:
        """Start a cut afresh (its entries were dropped)."""

    def loaded(self, cut: int) -> bool:
        return True

    def rewrite(self, cut: int, manifest: dict[str, Any]) -> None:
        """Replace a cut's manifest (a disk store's)."""

    def flush(self) -> None:
        """Make what was stored readable by another process (a disk store's)."""

    def close(self) -> None:
        self._cuts.clear()
        self.stored_bytes = 0


class DiskStore(MemoryStore):
    """Entries in memory-mapped ``.npy`` chunks under ``root/cut-<position>/``, with an index of
    JSON lines (key, chunk, offset, dtypes, shapes) and a manifest naming the prefix and its
    weights' fingerprint; ``root/cache.json`` names the model and its blocks. Reading an entry
    maps its bytes (warm in the page cache, no read at all)."""

    def __init__(self, root: Path, max_bytes: int | None, identity: dict[str, Any]) -> None:
        super().__init__(max_bytes)
        try:
            import numpy
        except ImportError:
            raise MissingExtraError(
                "store='disk' needs numpy (memory-mapped .npy files); install it with: "
                "pip install numpy"
            ) from None
        self._np = numpy
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._identify(identity)
        self._where: dict[int, dict[Key, dict[str, Any]]] = {}  # loaded cuts: key -> record
        self._chunks: dict[tuple[int, int], Any] = {}  # (cut, chunk) -> memmap
        self._end: dict[int, tuple[int, int]] = {}  # cut -> (chunk, offset) to write at
        self._index: dict[int, Any] = {}  # cut -> open index file

    def _identify(self, identity: dict[str, Any]) -> None:
        path = self.root / "cache.json"
        identity = {"format": FORMAT, "version": VERSION, **identity}
        if not path.exists():
            path.write_text(json.dumps(identity, indent=1), encoding="utf-8")
            return
        found = json.loads(path.read_text(encoding="utf-8"))
        if found != identity:
            differs = sorted(k for k in {*found, *identity} if found.get(k) != identity.get(k))
            raise PrefixCacheError(
                f"{str(self.root)!r} holds a prefix cache of another model or blocks "
                f"({', '.join(differs)} differ: {found.get(differs[0])!r} there, "
                f"{identity.get(differs[0])!r} here); expected a directory of this model. "
                "Use another path, or delete that directory to start again."
            )

    def _cut_dir(self, cut: int) -> Path:
        return self.root / f"cut-{cut}"

    def manifest(self, cut: int) -> dict[str, Any] | None:
        path = self._cut_dir(cut) / "manifest.json"
        if not path.exists():
            return None
        manifest: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return manifest

    def begin(self, cut: int, manifest: dict[str, Any]) -> None:
        """Start cut ``cut`` afresh (its old entries, if any, are gone) under ``manifest``."""
        self.drop(cut)
        self._cut_dir(cut).mkdir(parents=True)
        self.rewrite(cut, manifest)
        self._where[cut] = {}
        self._end[cut] = (0, 0)

    def rewrite(self, cut: int, manifest: dict[str, Any]) -> None:
        path = self._cut_dir(cut) / "manifest.json"
        path.write_text(json.dumps(manifest, indent=1), encoding="utf-8")

    def load(self, cut: int) -> None:
        """Read the index of a cut written by this or an earlier run (last line per key wins;
        a line cut short by a crash is ignored)."""
        index = self._cut_dir(cut) / "index.jsonl"
        lines = index.read_text(encoding="utf-8").splitlines() if index.exists() else []
        where: dict[Key, dict[str, Any]] = {}
        end = (0, 0)
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            where[record["key"]] = record
            end = max(end, (record["chunk"], record["offset"] + _size(record)))
        self.stored_bytes += sum(_size(record) for record in where.values())
        self._where[cut] = where
        self._end[cut] = end

    def loaded(self, cut: int) -> bool:
        return cut in self._where

    def flush(self) -> None:
        """Make the index lines written so far readable by another process."""
        for index in self._index.values():
            index.flush()

    def get(self, cut: int, key: Key) -> Entry | None:
        record = self._where.get(cut, {}).get(key)
        if record is None:
            return None
        data = self._chunk(cut, record["chunk"])
        offset = record["offset"]
        tensors = []
        for dtype, shape, nbytes in record["tensors"]:
            raw = torch.from_numpy(data[offset : offset + nbytes])
            tensors.append(raw.view(getattr(torch, dtype)).view(shape))
            offset += nbytes
        return Entry(tuple(tensors), record["inputs"], record["start"], record.get("steps"))

    def count(self) -> int:
        return sum(len(where) for where in self._where.values())

    def _bytes_of(self, cut: int, key: Key) -> int:
        found = self._where.get(cut, {}).get(key)
        return 0 if found is None else _size(found)

    def put(self, cut: int, key: Key, entry: Entry) -> None:
        size = entry.nbytes
        chunk, offset = self._end[cut]
        if offset and offset + size > CHUNK_BYTES:
            chunk, offset = chunk + 1, 0
        data = self._chunk(cut, chunk, create=max(CHUNK_BYTES, size))
        described = []
        at = offset
        for tensor in entry.tensors:
            raw = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8)
            data[at : at + raw.numel()] = raw.numpy()
            described.append(
                [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), raw.numel()]
            )
            at += raw.numel()
        record: dict[str, Any] = {"key": key, "chunk": chunk, "offset": offset}
        record |= {"tensors": described, "inputs": entry.inputs}
        record |= {"start": entry.start, "steps": entry.steps}
        index = self._index.get(cut)
        if index is None:  # kept open: a line per entry stored
            index = open(self._cut_dir(cut) / "index.jsonl", "a", encoding="utf-8")  # noqa: SIM115
            self._index[cut] = index
        index.write(json.dumps(record) + "\n")  # after the bytes it points to (the page cache
        # holds both for any process; flush() makes the lines visible to a later run)
        self.stored_bytes += size - self._bytes_of(cut, key)
        self._where[cut][key] = record
        self._end[cut] = (chunk, at)

    def _chunk(self, cut: int, chunk: int, *, create: int = 0) -> Any:
        data = self._chunks.get((cut, chunk))
        if data is not None:
            return data
        path = self._cut_dir(cut) / f"chunk-{chunk:05d}.npy"
        np = self._np
        if path.exists():
            data = np.load(path, mmap_mode="r+")
        else:
            data = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(create,))
        self._chunks[(cut, chunk)] = data
        return data

    def drop(self, cut: int) -> None:
        where = self._where.pop(cut, {})
        self.stored_bytes -= sum(_size(record) for record in where.values())
        self._close_cut(cut)
        self._end.pop(cut, None)
        shutil.rmtree(self._cut_dir(cut), ignore_errors=True)

    def _close_cut(self, cut: int) -> None:
        for key in [k for k in self._chunks if k[0] == cut]:
            self._chunks.pop(key).flush()
        index = self._index.pop(cut, None)
        if index is not None:
            index.close()

    def close(self) -> None:
        for cut in list(self._index):
            self._close_cut(cut)
        self._chunks.clear()
        self._where.clear()
        self.stored_bytes = 0


def disk_root(path: str | os.PathLike[str]) -> Path:
    """The directory of this process: ``path``, or ``path/rank-<r>`` when several processes
    train together (each rank caches the samples it sees)."""
    root = Path(path)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and torch.distributed.get_world_size() > 1:
        return root / f"rank-{torch.distributed.get_rank()}"
    return root


def _size(record: dict[str, Any]) -> int:
    return sum(int(nbytes) for _, _, nbytes in record["tensors"])
