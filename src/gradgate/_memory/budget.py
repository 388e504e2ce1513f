"""The budget question: what a row needs (its peak plus a headroom), sizes written by people
(``"24GiB"``), and the search that plans the depths around a budget, so that the answer is the
largest depth that fits among all depths, not only among those planned so far.

One rule serves :meth:`MemoryPlan.fits` and ``gradgate plan --memory``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, MutableMapping
from typing import Protocol, TypeVar

from .._plumbing.errors import InvalidOptionError


class Peaked(Protocol):
    """A planned row, as far as the budget is concerned (a ``MemoryRow``)."""

    @property
    def peak_bytes(self) -> int: ...


Row = TypeVar("Row", bound=Peaked)

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
# fits()'s default headroom over the peak, per target: (bytes, fraction of the peak). Provisional
# until measured on a GPU: CUDA's cuBLAS/cuDNN workspaces and allocator fragmentation, which
# no simulation sees (the CUDA context is outside the budget torch can allocate anyway); on the
# CPU, kernel scratch such as oneDNN's (+1.3% measured on a CNN).
HEADROOM = {"cuda": (512 * 2**20, 0.05), "cpu": (0, 0.05)}


def needed_bytes(row: Peaked, device: str, headroom: int | None = None) -> int:
    """What ``row`` needs on ``device``: its peak plus ``headroom`` bytes, by default the
    device's (:func:`default_headroom`)."""
    room = default_headroom(row.peak_bytes, device) if headroom is None else headroom
    return row.peak_bytes + room


def default_headroom(peak_bytes: int, device: str) -> int:
    """The headroom :meth:`MemoryPlan.fits` adds by default to a peak on ``device``.

    >>> default_headroom(2**30, "cuda") == 512 * 2**20 + 2**30 // 20, default_headroom(100, "cpu")
    (True, 5)
    """
    fixed, fraction = HEADROOM.get(device, HEADROOM["cuda"])
    return fixed + int(fraction * peak_bytes)


def parse_bytes(size: object, what: str = "memory budget") -> int:
    """Bytes from ``24GiB``, ``"80 GB"``, ``"512"`` or a number; a bad value raises, naming
    ``what`` it was given as.

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


def plan_around(
    rows: MutableMapping[int, Row],
    plan_row: Callable[[int], Row],
    blocks: int,
    fits: Callable[[Row], bool],
) -> None:
    """Add to ``rows`` (by depth) the depths that decide the largest one that ``fits``: depth 0
    if missing, then, by halving the gap between the largest planned depth that fits and the
    next planned one that does not (``blocks + 1`` if none), each depth between, until they
    are neighbours. The peak grows with the depth (each deeper cut adds learners and saved
    activations), so the largest depth that fits is then in ``rows``."""
    if 0 not in rows:
        rows[0] = plan_row(0)
    low, high = unsettled(rows, blocks, fits)
    while high - low > 1:
        middle = (low + high) // 2
        rows[middle] = found = plan_row(middle)
        low, high = (middle, high) if fits(found) else (low, middle)


def unsettled(
    rows: MutableMapping[int, Row], blocks: int, fits: Callable[[Row], bool]
) -> tuple[int, int]:
    """The largest planned depth that fits (-1: none) and the next planned depth that does not
    (``blocks + 1``: none); the answer is settled when they are neighbours."""
    low = max((depth for depth, row in rows.items() if fits(row)), default=-1)
    high = min(
        (depth for depth in rows if depth > low and not fits(rows[depth])), default=blocks + 1
    )
    return low, high
