"""The result of :func:`gradgate.estimate`: one row of bytes per depth or learning set, the
budget question (``fits``) and its renderings (text table, JSON, HTML)."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .._plumbing.errors import InvalidDepthError, InvalidOptionError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_BUDGET = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
_COLUMNS = ("params", "grads", "optimizer", "saved", "peak")


@dataclass(frozen=True)
class MemoryRow:
    """Bytes of one training step at one depth (or for one learning set).

    ``peak_bytes`` is the sum of the four others: parameters, gradients (learners only),
    optimizer state (learners only) and the activations saved for backward.
    """

    depth: int | None
    learn: frozenset[int | str] | None
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    saved_bytes: int
    peak_bytes: int

    @property
    def label(self) -> str:
        """``"3"`` for depth 3, ``"learn {1, 4}"`` for a learning set."""
        if self.learn is None:
            return str(self.depth)
        return "learn {" + ", ".join(map(str, _ordered(self.learn))) + "}"

    def as_dict(self) -> dict[str, object]:
        """The row as plain JSON values (a learning set as a sorted list)."""
        learn = None if self.learn is None else _ordered(self.learn)
        return {
            "depth": self.depth,
            "learn": learn,
            "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "saved_bytes": self.saved_bytes,
            "peak_bytes": self.peak_bytes,
        }

    def _figures(self) -> tuple[int, ...]:
        return (
            self.param_bytes,
            self.grad_bytes,
            self.optimizer_bytes,
            self.saved_bytes,
            self.peak_bytes,
        )


def _ordered(items: frozenset[int | str]) -> list[int | str]:
    """Block positions in order, then module names."""
    numbers = sorted(item for item in items if isinstance(item, int))
    return [*numbers, *sorted(item for item in items if isinstance(item, str))]


class MemoryPlan:
    """Predicted memory of a training step per depth (or learning set): ``plan.rows``,
    ``plan[depth]``, ``plan.fits("24GiB")``, ``plan.table()``, ``plan.to_json()``.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    >>> plan = gg.estimate(net, torch.randn(8, 256), optimizer="sgd")
    >>> [row.depth for row in plan.rows], plan[1].grad_bytes
    ([0, 1, 2, 4], 263168)
    >>> plan.fits("2MiB")
    2
    """

    def __init__(
        self, model: str, rows: Sequence[MemoryRow], *, optimizer: str, dtype: str, blocks: int
    ) -> None:
        self.model = model
        self.rows: tuple[MemoryRow, ...] = tuple(rows)
        self.optimizer = optimizer
        self.dtype = dtype
        self.blocks = blocks

    def __getitem__(self, key: int | Iterable[int | str]) -> MemoryRow:
        """The row of depth ``key`` (an integer) or of the learning set ``key``."""
        for row in self.rows:
            if isinstance(key, int) and row.learn is None and row.depth == key:
                return row
            if not isinstance(key, (int, str)) and row.learn == frozenset(key):
                return row
        known = [row.depth if row.learn is None else set(row.learn) for row in self.rows]
        raise InvalidDepthError(
            f"this plan has no row for depth {key!r}; its rows are {known}: pick one of "
            "those, or plan that depth with gg.estimate(..., depths=[...])."
        )

    def __len__(self) -> int:
        return len(self.rows)

    def fits(self, budget: int | float | str) -> int | frozenset[int | str] | None:
        """The largest depth (or learning set with the most gradient bytes) whose predicted
        peak is at most ``budget`` (bytes, or a string such as ``"24GiB"`` or ``"80 GB"``);
        ``None`` when no row fits."""
        limit = parse_bytes(budget)
        fitting = [row for row in self.rows if row.peak_bytes <= limit]
        if not fitting:
            return None
        best = max(fitting, key=lambda r: (r.grad_bytes, -1 if r.depth is None else r.depth))
        return best.depth if best.learn is None else best.learn

    def table(self) -> str:
        """A text table: one line per row, sizes in binary units."""
        cells = [[row.label, *map(format_bytes, row._figures())] for row in self.rows]
        first = max([len("depth"), *(len(c[0]) for c in cells)])
        widths = [
            max([len(name), *(len(c[i + 1]) for c in cells)]) for i, name in enumerate(_COLUMNS)
        ]
        lines = [
            f"{self.model}: memory of one training step per depth ({self.blocks} blocks, "
            f"{self.dtype}, optimizer {self.optimizer})",
            "peak = params + grads + optimizer state + activations saved for backward",
            "  ".join(
                ["depth".ljust(first), *(n.rjust(w) for n, w in zip(_COLUMNS, widths, strict=True))]
            ),
            "  ".join(["-" * first, *("-" * w for w in widths)]),
        ]
        for cell in cells:
            lines.append(
                "  ".join(
                    [
                        cell[0].ljust(first),
                        *(c.rjust(w) for c, w in zip(cell[1:], widths, strict=True)),
                    ]
                )
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        """The plan as JSON: model, dtype, optimizer, blocks and the rows in bytes."""
        return json.dumps(
            {
                "model": self.model,
                "dtype": self.dtype,
                "optimizer": self.optimizer,
                "blocks": self.blocks,
                "rows": [row.as_dict() for row in self.rows],
            },
            indent=2,
        )

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{name}</th>" for name in ("depth", *_COLUMNS))
        body = "".join(
            "<tr>"
            + f"<td>{html.escape(row.label)}</td>"
            + "".join(
                f'<td style="text-align:right">{format_bytes(v)}</td>' for v in row._figures()
            )
            + "</tr>"
            for row in self.rows
        )
        caption = html.escape(
            f"{self.model}: {self.dtype}, optimizer {self.optimizer}, {self.blocks} blocks"
        )
        return f"<table><caption>{caption}</caption><tr>{head}</tr>{body}</table>"

    def __repr__(self) -> str:
        return f"<MemoryPlan {self.model}: {len(self.rows)} rows>\n{self.table()}"


def parse_bytes(budget: object) -> int:
    """Bytes from ``24GiB``, ``"80 GB"``, ``"512"`` or a number; bad values raise.

    >>> parse_bytes("24GiB"), parse_bytes("1.5 kB"), parse_bytes(7)
    (25769803776, 1500, 7)
    """
    value: float | None = None
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        value = float(budget)
    elif isinstance(budget, str) and (match := _BUDGET.fullmatch(budget)):
        unit = _UNITS.get(match[2].lower())
        value = None if unit is None else float(match[1]) * unit
    if value is None or not value >= 0 or value == float("inf"):
        raise InvalidOptionError(
            f"memory budget {budget!r} is not a size; expected bytes as a number >= 0 or a "
            "string with a unit, e.g. '24GiB', '80 GB' or '512MiB' (units: B, kB, MB, GB, TB, "
            "KiB, MiB, GiB, TiB)."
        )
    return int(value)


def format_bytes(size: int) -> str:
    """``1536`` -> ``"1.50 KiB"``; whole bytes below 1 KiB. The unit is chosen after rounding,
    so a size just under a unit reads ``1.00`` of it, never ``1024.00`` of the one below.

    >>> format_bytes(512), format_bytes(3 * 2**29), format_bytes(2**20 - 1)
    ('512 B', '1.50 GiB', '1.00 MiB')
    """
    if size < 1024:
        return f"{size} B"
    units = ("KiB", "MiB", "GiB", "TiB")
    for power, unit in enumerate(units, start=1):
        shown = f"{size / 1024**power:.2f}"
        if float(shown) < 1024 or unit == units[-1]:
            return f"{shown} {unit}"
    raise AssertionError("unreachable")
