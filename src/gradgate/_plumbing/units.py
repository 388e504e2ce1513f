"""Numbers as people read them: the unit is chosen after rounding, so a value just under a unit
reads ``1.00`` of it, never ``1024.00`` (or ``1e+03``) of the unit below."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from .errors import InvalidOptionError


def in_units(value: float, units: Sequence[str], base: int, figure: Callable[[float], str]) -> str:
    """``value`` (counted in ``units[0]``) in the first unit whose figure, as ``figure``
    rounds it, stays below ``base``; each unit is ``base`` times the one before, and the last
    takes any size.

    >>> in_units(2**20 - 1, ("B", "KiB", "MiB"), 1024, "{:.2f}".format)
    '1.00 MiB'
    >>> in_units(1536, ("B", "KiB"), 1024, "{:.1f}".format)
    '1.5 KiB'
    """
    for power, unit in enumerate(units):
        shown = figure(value / base**power)
        if abs(float(shown)) < base or power == len(units) - 1:
            return f"{shown} {unit}"
    raise ValueError("in_units needs at least one unit")


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_bytes(size: object, what: str = "memory budget") -> int:
    """Bytes from ``24GiB``, ``"80 GB"``, ``"512"`` or a number; a bad value raises, naming
    ``what`` it was given as (the planner's budget, a prefix cache's ``max_bytes``).

    >>> parse_bytes("24GiB"), parse_bytes("1.5 kB"), parse_bytes(7)
    (25769803776, 1500, 7)
    """
    value: float | None = None
    if isinstance(size, (int, float)) and not isinstance(size, bool):
        value = float(size)
    elif isinstance(size, str) and (match := _SIZE.fullmatch(size)):
        unit = _UNITS.get(match[2].lower())
        value = None if unit is None else float(match[1]) * unit
    if value is None or not value >= 0 or value == float("inf"):
        raise InvalidOptionError(
            f"{what} {size!r} is not a size; expected bytes as a number >= 0 or a string "
            "with a unit, e.g. '24GiB', '80 GB' or '512MiB' (units: B, kB, MB, GB, TB, KiB, "
            "MiB, GiB, TiB); a percentage is not a size."
        )
    return int(value)
