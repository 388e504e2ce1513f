"""The keys of a batch's samples: what ``cache.keys(ids)`` accepts, and the dataset wrapper that
carries each sample's index to the step (``PrefixCache.keyed``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import Dataset

from ..._plumbing.errors import InvalidOptionError

Key = int | str
KEY_COLUMN = "gradgate_key"  # the batch entry (and forward keyword) that carries the keys


def normalize_keys(ids: object) -> list[Key]:
    """One key per sample: ints or strings, in a list, a tuple, a range, an integer tensor or
    array; no key twice. Anything else raises, naming the bad value.

    >>> normalize_keys(torch.tensor([3, 1])), normalize_keys(["a", "b"])
    ([3, 1], ['a', 'b'])
    """
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise InvalidOptionError(
                f"keys are a tensor of {ids.dtype}; expected integers or strings, one stable key "
                "per sample (a dataset index, e.g. torch.tensor([4, 17]) or ['img_4', 'img_17'])."
                " Floats are refused: they are not stable keys."
            )
        if ids.dim() != 1:
            raise InvalidOptionError(
                f"keys are a tensor of shape {tuple(ids.shape)}; expected one dimension, one key "
                "per sample of the batch."
            )
        items: list[Any] = ids.tolist()
    elif isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise InvalidOptionError(
            f"keys={ids!r:.80}; expected a sequence with one key per sample of the batch (ints or "
            "strings, e.g. a list of dataset indices), not a single value."
        )
    else:
        items = list(ids)
    keys = [_one_key(item) for item in items]
    if len(set(keys)) != len(keys):
        seen: set[Key] = set()
        twice = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise InvalidOptionError(
            f"key {twice!r} appears twice in one batch; expected one distinct key per sample (a "
            "sample drawn twice in a batch needs a key per draw, e.g. f'{index}/{draw}')."
        )
    return keys


def _one_key(item: object) -> Key:
    if isinstance(item, str):
        return item
    if isinstance(item, bool) or not hasattr(item, "__index__"):
        kind = type(item).__name__
        hint = " (floats are not stable keys)" if isinstance(item, float) else ""
        raise InvalidOptionError(
            f"key {item!r:.60} has type {kind}{hint}; expected an int or a str, one stable key "
            "per sample, such as its index in the dataset."
        )
    if isinstance(item, torch.Tensor) and (item.is_floating_point() or item.dim()):
        raise InvalidOptionError(
            f"key {item!r:.60} is not one integer; expected an int or a str per sample."
        )
    return int(item)  # type: ignore[call-overload]


def check_count(keys: list[Key], batch: int | None) -> None:
    """The forward's batch (the first dimension of its first tensor input) has one key each."""
    if batch is not None and len(keys) != batch:
        raise InvalidOptionError(
            f"{len(keys)} keys for a batch of {batch} samples (the first dimension of the "
            "model's first tensor input); expected one key per sample, in the batch's order: "
            "`with cache.keys(ids): model(x)` with len(ids) == x.shape[0]."
        )


class KeyedDataset(Dataset):  # type: ignore[type-arg]
    """A dataset whose items carry their index as the key: dict items get a ``gradgate_key``
    entry; tuple and list items get the key appended as their last element. A
    ``transformers.Trainer`` passes the batch's keys to the model call, where the cache takes
    them out; in a loop of your own, pass them to ``cache.keys``.

    >>> data = KeyedDataset([{"x": 1}, {"x": 2}])
    >>> data[1], len(data)
    ({'x': 2, 'gradgate_key': 1}, 2)
    """

    def __init__(self, dataset: Any, *, offset: int = 0) -> None:
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise InvalidOptionError(
                f"{type(dataset).__name__} has no __getitem__ and __len__; expected a map-style "
                "dataset (an IterableDataset has no stable index: key its samples yourself)."
            )
        self.dataset, self.offset = dataset, offset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        item = self.dataset[index]
        key = self.offset + int(index)
        if isinstance(item, dict):
            if KEY_COLUMN in item:
                raise InvalidOptionError(
                    f"the dataset's items already have a {KEY_COLUMN!r} entry; expected items "
                    "without it (wrap the dataset once)."
                )
            return {**item, KEY_COLUMN: key}
        if isinstance(item, (tuple, list)):
            return type(item)([*item, key]) if type(item) in (tuple, list) else (*item, key)
        return (item, key)

    def __getattr__(self, name: str) -> Any:  # column_names and other attributes of the data
        if name in ("dataset", "offset"):
            raise AttributeError(name)
        return getattr(self.dataset, name)
