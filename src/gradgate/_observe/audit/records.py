"""The figures an audit records, and the columns that show them.

A new audit column is one field in :class:`ModuleRecord` and one :class:`Column` in
``COLUMNS``: the text table, the HTML table, the JSON document and the totals all follow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

OUTSIDE = "(outside model)"
WasteReason = Literal["late_freeze", "not_in_optimizer"]
_WASTE_MESSAGES: dict[str, str] = {
    "late_freeze": "requires_grad was turned off after the forward: computed, then dropped",
    "not_in_optimizer": "no optimizer holds this parameter: computed, never used",
}


@dataclass
class ModuleRecord:
    """What backward computed for one module (and, for a parent, everything inside it)."""

    name: str
    type: str
    leaf: bool = True
    wgrad: int = 0
    dgrad: int = 0
    backward_flops: int = 0
    saved_bytes: int = 0
    wgrad_bytes: int = 0  # the parameter gradients its wgrad nodes computed (rows: rows-sized)
    seconds: float = 0.0

    def add(self, other: ModuleRecord) -> None:
        """Add another record's figures (every column that sums) to this one."""
        for column in COLUMNS:
            setattr(self, column.field, getattr(self, column.field) + getattr(other, column.field))


@dataclass(frozen=True)
class Column:
    """One figure of a record: its field, its header, how a cell shows it, whether it is a
    total of the whole model (``report.totals``)."""

    field: str
    header: str
    cell: Callable[[float], str]
    total: bool = True


def _count(value: float) -> str:
    return f"{int(value):,}"


def _milliseconds(value: float) -> str:
    return f"{value * 1e3:.3f}"


COLUMNS: tuple[Column, ...] = (
    Column("wgrad", "wgrad", _count),
    Column("dgrad", "dgrad", _count),
    Column("backward_flops", "backward FLOPs", _count),
    Column("saved_bytes", "saved bytes", _count),
    # not in report.totals (their keys are a contract): a figure of each module's record
    Column("wgrad_bytes", "wgrad bytes", _count, total=False),
    Column("seconds", "ms", _milliseconds, total=False),
)
HEADERS: tuple[str, ...] = ("module", "type", *(column.header for column in COLUMNS))


def totals_of(record: ModuleRecord) -> dict[str, int]:
    """The model totals (``wgrad``, ``dgrad``, ``backward_flops``, ``saved_bytes``) of a row."""
    return {c.field: int(getattr(record, c.field)) for c in COLUMNS if c.total}


def cells(record: ModuleRecord) -> list[str]:
    """The figure cells of one row, formatted, in column order."""
    return [column.cell(getattr(record, column.field)) for column in COLUMNS]


@dataclass(frozen=True)
class WastedGradient:
    """A parameter gradient backward computed although nothing will use it."""

    parameter: str
    module: str
    reason: WasteReason
    flops: int

    @property
    def message(self) -> str:
        """Why this gradient is wasted, in words."""
        return _WASTE_MESSAGES[self.reason]


def as_dict(record: ModuleRecord | WastedGradient) -> dict[str, object]:
    """A record as a plain dict (for JSON)."""
    return dataclasses.asdict(record)
