"""Live bytes of a real step, counted by following storages: the tests' ground truth for memory.

This is a test utility, independent of gradgate's own accounting. It is a
``TorchDispatchMode``: every tensor an op returns has its storage noted (each storage once,
views included) with its size, until the storage is freed (a weak reference to the storage
tells). ``live`` is the sum over storages alive now, ``peak`` its largest value since the
counter was entered (or since ``reset_peak()``).

API::

    with LiveBytes(model, optimizer, batch) as counter:   # tensors alive before the step count
        loss = model(**batch).loss                        # run the real step
        counter.phase = "backward"                        # optional: name what runs now
        loss.backward()
        ...
    counter.peak            # largest live bytes seen (int)
    counter.peak_phase      # the phase that was set when the peak happened ("forward" first)
    counter.live            # live bytes now
    counter.phase_peaks     # {phase: its largest live bytes}
    counter.reset_peak()    # start a new peak from the live bytes now

``LiveBytes(*things)`` counts, from the start, the storages of every tensor in ``things``: an
``nn.Module`` (parameters, buffers and their ``.grad``), a ``torch.optim.Optimizer`` (its state,
recursively) and tensors in (nested) dicts, lists or tuples. Storages made inside the block by
ops are counted as they are made. ``LiveBytes(*things, round_to=512)`` rounds each storage up
to a multiple of 512 bytes, as CUDA's caching allocator does (default 1: exact bytes). What
kernels allocate inside themselves (oneDNN scratch, workspaces) is not seen: this is the memory
torch's tensors hold, not the allocator's.

Sharded steps: a ``DTensor`` (FSDP2's parameters, gradients and optimizer state) counts as its
local tensor, the bytes this rank holds (its own storage is a wrapper reporting the global
size); a ``meta`` tensor holds no memory and is not counted. ``LiveBytes(..., resizes=True)``
reads every storage's size again after each op: FSDP2 frees and re-allocates its unsharded
parameters by resizing storages, which no op reports.

>>> import torch
>>> weight = torch.ones(256, 256)
>>> with LiveBytes(weight) as counter:
...     product = weight @ weight          # +256 KiB
...     twice = product * 2                # +256 KiB
...     del product                        # -256 KiB
...     view = twice[:2]                   # a view: no new storage
>>> counter.peak == 3 * weight.nbytes, counter.live == 2 * weight.nbytes
(True, True)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive while the block runs, and their peak (see the module)."""

    def __init__(self, *things: Any, round_to: int = 1, resizes: bool = False) -> None:
        super().__init__()
        self.round_to = round_to
        self.resizes = resizes
        self.live = 0
        self.peak = 0
        self.phase = "forward"
        self.peak_phase = "forward"
        self.phase_peaks: dict[str, int] = {}
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, Any] = {}
        for tensor in _tensors(things):
            self._note(tensor)
        self.reset_peak()

    def reset_peak(self) -> None:
        """Forget the peak so far: the next peak starts from the live bytes now."""
        self.peak = self.live
        self.peak_phase = self.phase
        self.phase_peaks = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in _tensors([out]):
            self._note(tensor)
        if self.resizes:
            self._read_again()
        if self.live > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.live
        if self.live > self.peak:
            self.peak, self.peak_phase = self.live, self.phase
        return out

    def _read_again(self) -> None:
        for key, reference in list(self._refs.items()):
            storage = reference()
            if storage is not None:
                size = -(-int(storage.nbytes()) // self.round_to) * self.round_to
                self.live += size - self._sizes[key]
                self._sizes[key] = size

    def _note(self, tensor: torch.Tensor) -> None:
        tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor: this rank's part
        if tensor.is_meta:  # shapes only (DeepSpeed keeps some): no memory
            return
        storage = tensor.untyped_storage()
        key = StorageWeakRef(storage).cdata
        size = -(-int(storage.nbytes()) // self.round_to) * self.round_to
        known = self._sizes.get(key)
        if known is None:
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._forget(key))
        self._sizes[key] = size  # a storage resized in place (resize_) is read again
        self.live += size - (known or 0)

    def _forget(self, key: int) -> None:
        self.live -= self._sizes.pop(key)
        del self._refs[key]


def _tensors(things: Any) -> list[torch.Tensor]:
    """Every tensor in ``things`` (modules, optimizers, nested containers), each once."""
    found: dict[int, torch.Tensor] = {}
    todo = list(things)
    while todo:
        thing = todo.pop()
        if isinstance(thing, torch.Tensor):
            found.setdefault(id(thing), thing)
            if thing.grad is not None if thing.is_leaf else False:
                todo.append(thing.grad)
        elif isinstance(thing, nn.Module):
            todo.extend([*thing.parameters(), *thing.buffers()])
        elif isinstance(thing, torch.optim.Optimizer):
            todo.extend(thing.state.values())
        elif isinstance(thing, dict):
            todo.extend(thing.values())
        elif isinstance(thing, (list, tuple)):
            todo.extend(thing)
        elif hasattr(thing, "to_tuple"):  # a transformers ModelOutput
            todo.extend(thing.to_tuple())
    return list(found.values())
