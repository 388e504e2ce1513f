"""A plan as integers that every rank can compare (``BackpropGate(..., check_ranks=True)``)."""

from __future__ import annotations

from torch import nn


class PlanKey:
    """Learning blocks, skipped blocks and the learning modules that are not blocks.

    A module is named by its position in ``model.named_modules()``, the same on every rank that
    built the same model. Positions are looked up once per plan (a new ``extra`` tuple), not
    every step.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> key = PlanKey(model)
    >>> key(frozenset({1}), frozenset(), (model[0],))
    (1, -2, -3, 1)
    >>> key(None, frozenset(), ())
    (-1, -2, -3)
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._extra: tuple[nn.Module, ...] = ()
        self._extra_key: tuple[int, ...] = ()

    def __call__(
        self,
        learn: range | frozenset[int] | None,
        skip: frozenset[int],
        extra: tuple[nn.Module, ...],
    ) -> tuple[int, ...]:
        if extra is not self._extra:
            order = {id(m): i for i, (_, m) in enumerate(self._model.named_modules())}
            self._extra_key = tuple(sorted(order.get(id(m), -4) for m in extra))
            self._extra = extra
        blocks = (-1,) if learn is None else tuple(sorted(learn))
        return (*blocks, -2, *sorted(skip), -3, *self._extra_key)
