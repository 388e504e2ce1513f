"""The budget question: what a row needs (its peak plus a headroom), sizes written by people
(``"24GiB"``), and the search that plans the depths around a budget, so that the answer is the
largest depth that fits among all depths, not only among those planned so far.

One rule serves :meth:`MemoryPlan.fits` and ``gradgate plan --memory``.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Protocol, TypeVar

from .._plumbing.units import parse_bytes as parse_bytes  # one rule for sizes people write


class Peaked(Protocol):
    """A planned row, as far as the budget is concerned (a ``MemoryRow``)."""

    @property
    def peak_bytes(self) -> int: ...


Row = TypeVar("Row", bound=Peaked)

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
