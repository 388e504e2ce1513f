"""Validation of user options, with messages that name the value and the allowed ones.

Every check here runs before anything is applied to a model, so a rejected call leaves no trace.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable

from .errors import InvalidOptionError


def check_choice(option: str, value: object, allowed: Iterable[object]) -> None:
    """Raise :class:`InvalidOptionError` unless ``value`` is one of ``allowed``."""
    allowed = tuple(allowed)
    if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
        choices = ", ".join(repr(a) for a in allowed)
        raise InvalidOptionError(f"{option}={value!r} is not allowed; expected one of {choices}.")


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


def fraction_option(option: str, value: object, *, meaning: str) -> float:
    """A real number in (0, 1] (a share of something), else :class:`InvalidOptionError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidOptionError(
            f"{option}={value!r}; expected a number in (0, 1], {meaning}, e.g. 0.25."
        )
    if not 0 < value <= 1:
        raise InvalidOptionError(
            f"{option}={value!r} is out of range; expected a number in (0, 1], {meaning}, "
            "e.g. 0.25."
        )
    return float(value)
