"""A removable handle that is also a context manager, shared by every gradgate mechanism."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

from .errors import HandleUsedError, InvalidOptionError

_H = TypeVar("_H", bound="Handle")


class Handle:
    """Undoes what a gradgate call did to a model, exactly once.

    ``remove()`` and ``undo()`` are the same; calling either again is a no-op. Used as a
    context manager, the handle undoes on exit, also when the body raises. Entering a handle
    that was already undone raises :class:`HandleUsedError` (it would change nothing): call
    gradgate again for a fresh handle. So does entering it again inside its own ``with``
    block: the inner exit would undo it while the outer block still runs.

    >>> import torch, gradgate as gg
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> with gg.freeze(model, "0"):
    ...     model[0].weight.requires_grad
    False
    >>> model[0].weight.requires_grad
    True
    """

    def __init__(self, undo: Callable[[], None], *, description: str = "") -> None:
        if not callable(undo):
            raise InvalidOptionError(
                f"undo={undo!r:.60} is not callable; expected a function of no arguments that "
                "undoes what was applied, e.g. Handle(hook.remove)."
            )
        if not isinstance(description, str):
            raise InvalidOptionError(
                f"description={description!r:.60} has type {type(description).__name__}; "
                "expected a str that names what the handle undoes."
            )
        self._undo: Callable[[], None] | None = undo
        self._description = description
        self._entered = False

    @property
    def active(self) -> bool:
        """``True`` until the handle has been undone."""
        return self._undo is not None

    def remove(self) -> None:
        """Undo everything this handle applied; a second call does nothing."""
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    undo = remove

    def __enter__(self: _H) -> _H:
        if not self.active:
            raise HandleUsedError(
                f"{self!r} was already undone, so entering it again would do nothing; "
                "expected a live handle. To apply the same thing again, call gradgate again "
                "for a fresh handle: put the call itself inside the loop, e.g. "
                "`for batch in data: with gg.frozen(model, ...): ...`."
            )
        if self._entered:
            raise HandleUsedError(
                f"{self!r} is already entered in a `with` block that has not exited; entering "
                "it again would undo it at the inner exit while the outer block still runs; "
                "expected one `with` per handle. Drop the inner `with`, or call gradgate again "
                "for a second, independent handle."
            )
        self._entered = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._entered = False
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<gradgate.Handle {self._description} ({state})>"


def undo_all(handles: list[Callable[[], None]]) -> Callable[[], None]:
    """One callable that runs the given undo steps in reverse order."""

    def run() -> None:
        for step in reversed(handles):
            step()

    return run
