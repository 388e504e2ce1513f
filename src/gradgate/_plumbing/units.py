"""Numbers as people read them: the unit is chosen after rounding, so a value just under a unit
reads ``1.00`` of it, never ``1024.00`` (or ``1e+03``) of the unit below."""

from __future__ import annotations

from collections.abc import Callable, Sequence


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
