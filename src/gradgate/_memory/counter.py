"""The live bytes of a simulated step: a dispatch mode that follows every storage an op makes.

:class:`StepCounter` sits above ``FakeTensorMode``. Each op's outputs have their storages noted
(each storage once, by category) until the storage dies (a weak reference to it tells), and
after each op the running total is compared with the peak of the current phase. Autograd
freeing saved tensors, ``.grad`` accumulation, checkpoint recomputation and the optimizer's
temporaries all happen on fake tensors as on real ones, so the total follows a real step.

Two things make the fake step match a real one where fake tensors alone would not:

* **small integer tensors stay real.** An op whose tensor inputs are all real, small and
  integer (token ids, masks, positions, or none: ``arange``) and whose result is too runs for
  real, below the fake mode. Code that looks at values (transformers skipping the causal mask
  of an unpadded batch, ``.item()`` on a mask) then sees what a real run sees.
* **grouped matrix products in float32.** torch's meta kernel of ``aten._grouped_mm`` (MoE
  experts) takes only bfloat16 while the real kernel takes float32: the output is shaped by
  the meta kernel on bfloat16 stand-ins and made in the real dtype.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from .._plumbing.torch_internals import TorchDispatchMode, storage_key
from .._plumbing.torch_internals import planner as planner_internals
from .._plumbing.torch_internals.planner import (
    GROUPED_MM,
    fake_tensor_type,
    grouped_mm_refuses,
    outside_modes,
    value_dependent_errors,
)
from .._plumbing.torch_internals.trees import tree_leaves

CATEGORIES = ("model", "grad", "state", "saved", "other")
HOST = "host"  # noted but not counted: memory the target keeps off the device


class StepCounter(TorchDispatchMode):
    """Live bytes by category while ops run; the peak per phase with its categories.

    ``round_to`` rounds each storage up as the target's allocator does (512 on CUDA).
    ``real_limit`` is the most elements an integer result kept real may have (0: none).
    """

    def __init__(self, *, round_to: int = 1, real_limit: int = 0) -> None:
        super().__init__()
        self.bytes = dict.fromkeys((*CATEGORIES, HOST), 0)
        self.live = 0
        self.phase = "forward"
        self.peaks: dict[str, int] = {}
        self.window = 0  # the most live bytes since a caller set it (a block's own peak)
        self.at_peak: dict[str, dict[str, int]] = {}
        self._round = round_to
        self._real_limit = real_limit if planner_internals.DISABLE_MODES is not None else 0
        self._fake = fake_tensor_type()
        self._paused = 0
        # storage key -> [bytes, category, weak reference, whether the bytes were told]
        self._info: dict[int, list[Any]] = {}

    # -- noting storages ----------------------------------------------------------------------
    def track(self, tensor: torch.Tensor, category: str = "other", size: int | None = None) -> None:
        """Count ``tensor``'s storage in ``category`` (a storage counted before changes
        category only through :meth:`relabel`). ``size``: count it as that many bytes from now
        on, whatever the storage holds (this rank's share of a sharded parameter or gradient;
        0 for a stand-in whose bytes are counted elsewhere)."""
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        info = self._info.get(key)
        fixed = size is not None
        size = self._size(storage) if size is None else -(-size // self._round) * self._round
        if info is None:
            reference = weakref.ref(storage, partial(self._free, key))
            self._info[key] = [size, category, reference, fixed]
            self._add(category, size)
        elif (fixed or not info[3]) and size != info[0]:  # resized in place, or told
            self._add(info[1], size - info[0])
            info[0], info[3] = size, info[3] or fixed

    def relabel(self, tensor: torch.Tensor, category: str, *, only: str | None = None) -> None:
        """Move ``tensor``'s storage to ``category`` (only from category ``only`` if given)."""
        info = self._info.get(storage_key(tensor.untyped_storage()))
        if info is None:
            self.track(tensor, category)
        elif info[1] != category and (only is None or info[1] == only):
            self._add(info[1], -info[0])
            self._add(category, info[0])
            info[1] = category

    def saved(self, tensor: torch.Tensor) -> None:
        """A pack hook's view: an activation autograd keeps for backward."""
        self.relabel(tensor, "saved", only="other")

    def grad_ready(self, parameter: torch.Tensor) -> None:
        """A post-accumulate-grad hook: ``parameter.grad`` now holds a gradient."""
        if parameter.grad is not None:
            self.relabel(parameter.grad, "grad")

    def size_of(self, storage: Any) -> int:
        """The bytes ``storage`` counts for (rounded as the target's allocator rounds)."""
        info = self._info.get(storage_key(storage))
        return self._size(storage) if info is None else int(info[0])

    def _size(self, storage: Any) -> int:
        size = int(storage.nbytes())
        return -(-size // self._round) * self._round

    def _add(self, category: str, size: int) -> None:
        self.bytes[category] += size
        if category != HOST:
            self.live += size

    def _free(self, key: int, reference: Any = None) -> None:
        """The weak reference's callback: the storage is gone."""
        size, category, *_ = self._info.pop(key)
        self._add(category, -size)

    # -- peaks --------------------------------------------------------------------------------
    def mark(self) -> None:
        """Compare the live bytes now with the current phase's peak."""
        if self.live > self.window:
            self.window = self.live
        if self.live > self.peaks.get(self.phase, -1):
            self.peaks[self.phase] = self.live
            self.at_peak[self.phase] = dict(self.bytes)

    def raise_peak(self, extra: int) -> None:
        """A peak ``extra`` bytes above the live bytes now (``other`` bytes), reached by work
        that is not run again here."""
        total = self.live + extra
        self.window = max(self.window, total)
        if total > self.peaks.get(self.phase, -1):
            self.peaks[self.phase] = total
            self.at_peak[self.phase] = {**self.bytes, "other": self.bytes["other"] + extra}

    # -- the ops ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops inside are neither counted nor compared with the peak (stand-ins for bytes
        counted elsewhere)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        if self._real_limit and self._fake not in types:
            out = self._maybe_real(func, args, kwargs)
        elif func is GROUPED_MM and args[0].dtype != torch.bfloat16:
            out = self._grouped_mm(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self.track(out)
        elif isinstance(out, (tuple, list)):
            for item in tree_leaves(out):
                if isinstance(item, torch.Tensor):
                    self.track(item)
        self.mark()
        return out

    def _maybe_real(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Run ``func`` for real where its inputs and result are small integer tensors."""
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not all(self._small_integers(t) for t in inputs):
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)  # fake: the result's shape, no memory
        except value_dependent_errors():
            pass  # .item(), nonzero(): needs values, and the inputs have them
        else:
            results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if not all(self._small_integers(t) for t in results):
                return out
        with outside_modes():
            return func(*args, **kwargs)

    def _small_integers(self, tensor: torch.Tensor) -> bool:
        return (
            not tensor.is_floating_point()
            and not tensor.is_complex()
            and (tensor.numel() <= self._real_limit)
        )

    def _grouped_mm(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A float32 grouped product: shaped by the meta kernel, made in the input's dtype."""
        a, b = args[0], args[1]
        if not grouped_mm_refuses(a.dtype):
            return func(*args, **kwargs)
        stand_a, stand_b = (
            torch.empty_strided(t.shape, t.stride(), dtype=torch.bfloat16) for t in (a, b)
        )
        options = {k: v for k, v in kwargs.items() if k != "out_dtype"}
        shaped = func(stand_a, stand_b, *args[2:], **options)
        return torch.empty_strided(shaped.shape, shaped.stride(), dtype=a.dtype)
