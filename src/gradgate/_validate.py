"""Validation of user options, with messages that name the value and the allowed ones.

Every check here runs before anything is applied to a model, so a rejected call leaves no trace.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any

from ._errors import InvalidOptionError, UnknownModuleError


def check_choice(option: str, value: object, allowed: Iterable[object]) -> None:
    """Raise :class:`InvalidOptionError` unless ``value`` is one of ``allowed``."""
    allowed = tuple(allowed)
    if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
        choices = ", ".join(repr(a) for a in allowed)
        raise InvalidOptionError(f"{option}={value!r} is not allowed; expected one of {choices}.")


def check_patterns(
    function: str,
    patterns: tuple[Any, ...],
    *,
    model: Any = None,
    allow_root: bool = False,
    allow_none: bool = False,
) -> tuple[Any, ...]:
    """The patterns with integer-like block indices made ``int``; refuses ``''`` and, unless
    ``allow_none`` (an empty set of patterns means "nothing"), no pattern at all.

    ``allow_root`` lets ``''`` name the model itself (where a name is a key, as in capture).
    With ``model``, a slice over its blocks must stay within them (``slice(0, 0)`` is the
    empty set; ``slice(10, 20)`` on four blocks is refused).

    >>> check_patterns("freeze", ("encoder", __import__("numpy").int64(2)))
    ('encoder', 2)
    """
    if not patterns and not allow_none:
        raise InvalidOptionError(
            f"{function}() got no pattern; expected at least one module or parameter name, "
            f"glob or range, e.g. {function}(model, 'encoder.layer.0'). For every module of "
            f"the model pass '**': {function}(model, '**')."
        )
    checked = tuple(_pattern(function, pattern, allow_root) for pattern in patterns)
    positional = [p for p in checked if isinstance(p, (int, slice)) and not isinstance(p, bool)]
    if model is not None and positional:
        from ._select import blocks  # the block list is only needed for positions

        count = len(blocks(model))
        for pattern in positional:
            if isinstance(pattern, slice):
                check_block_slice(function, pattern, count)
            elif not -count <= pattern < count:
                raise UnknownModuleError(
                    f"{function}() got the block index {pattern}, but the model has {count} "
                    f"blocks; expected an index in -{count}..{count - 1}, e.g. -1 for the last "
                    "block (gg.blocks(model) lists them)."
                )
    return checked


def check_block_slice(function: str, pattern: slice, count: int) -> None:
    """Refuse a slice over ``count`` blocks whose bounds or step are not integers in range.

    >>> check_block_slice("freeze", slice(-2, None), 4)
    >>> check_block_slice("freeze", slice(2, 9), 4)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gradgate.UnknownModuleError: freeze() got the block slice slice(2, 9, None), ...
    """
    bounds = (pattern.start, pattern.stop)
    step = pattern.step
    ints = all(b is None or (isinstance(b, int) and not isinstance(b, bool)) for b in bounds)
    good_step = step is None or (isinstance(step, int) and not isinstance(step, bool) and step)
    in_range = ints and all(b is None or -count <= b <= count for b in bounds)  # type: ignore[operator]
    if not (ints and good_step and in_range):
        raise UnknownModuleError(
            f"{function}() got the block slice {pattern!r}, which does not fit the model's "
            f"{count} blocks; expected integer bounds in -{count}..{count} and a non-zero "
            f"step, e.g. slice(-2, None) for the last two blocks (gg.blocks(model) lists them)."
        )


def _pattern(function: str, pattern: Any, allow_root: bool) -> Any:
    if isinstance(pattern, str):
        if not pattern.strip() and not (allow_root and pattern == ""):
            raise UnknownModuleError(
                f"{function}() got the pattern {pattern!r}, which names no module; expected a "
                "module or parameter name, a glob such as 'layer.*' or a range such as "
                f"'layer.0:4'. For every module of the model pass '**'."
            )
        return pattern
    if isinstance(pattern, (bool, slice)) or not hasattr(pattern, "__index__"):
        return pattern  # slices as given; other types are refused by the selection with a hint
    try:
        return operator.index(pattern)  # numpy integers, 0-d integer tensors
    except TypeError:
        return pattern


# -- schedule options ----------------------------------------------------------------------
def integer_option(option: str, value: object) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidOptionError(
            f"{option}={value!r} ({type(value).__name__}); expected an integer."
        )
    return operator.index(value)  # type: ignore[arg-type]


def count_option(option: str, value: object, *, low: int, high: int | None = None) -> int:
    number = integer_option(option, value)
    if number < low or (high is not None and number > high):
        bounds = f"{low}..{high}" if high is not None else f">= {low}"
        raise InvalidOptionError(f"{option}={number} is out of range; expected {bounds}.")
    return number


def probability_option(option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidOptionError(f"{option}={value!r}; expected a number in [0, 1].")
    if not 0.0 <= value <= 1.0:
        raise InvalidOptionError(f"{option}={value!r} is out of range; expected [0, 1].")
    return float(value)


def learn_items_option(option: str, items: Iterable[int | str], n: int) -> frozenset[int | str]:
    if isinstance(items, (str, int)):
        items = [items]
    found: set[int | str] = set()
    for item in items:
        if isinstance(item, str):
            found.add(item)
        else:
            found.add(count_option(f"{option} entry", item, low=-n, high=n - 1) % n)
    return frozenset(found)
