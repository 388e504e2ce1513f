"""The result of :func:`gradgate.estimate`: one row of bytes per depth or learning set, the
budget question (``fits``) and its renderings (text table, JSON, HTML)."""

from __future__ import annotations

import contextlib
import html
import json
import warnings
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from .._plumbing.errors import GradgateWarning, InvalidDepthError
from .._plumbing.units import in_units
from .budget import default_headroom, needed_bytes, parse_bytes, plan_around, unsettled

_COLUMNS = ("params", "grads", "optimizer", "saved", "other", "peak", "phase")
# opens a planner of the model as it was estimated; inside, it plans one more depth per call
Replanner = Callable[[], AbstractContextManager[Callable[[int], "MemoryRow"]]]


@dataclass(frozen=True)
class MemoryRow:
    """Bytes of one training step at one depth (or for one learning set).

    ``param_bytes`` (every parameter), ``grad_bytes`` and ``optimizer_bytes`` (the learners'
    gradients and optimizer state, masters included) and ``saved_bytes`` (activations saved for
    backward, over the whole forward) are exact totals. ``peak_bytes`` is the most memory live
    at once in the simulated step (forward, backward, ``optimizer.step()``, ``zero_grad``),
    reached in ``peak_phase``; ``other_bytes`` is what is live then beyond the model, the
    gradients, the optimizer state and the saved activations (the loss's transients,
    recomputed checkpointed blocks, the optimizer's temporaries, autocast's weight copies).
    The peak is not the sum of the parts: when it happens, some saved activations may be
    freed already and some gradients not made yet. ``depth`` and ``learn`` are both ``None``
    for a full fine-tune (no cut: every parameter learns).
    """

    depth: int | None
    learn: frozenset[int | str] | None
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    saved_bytes: int
    peak_bytes: int
    other_bytes: int = 0
    peak_phase: str | None = None

    @property
    def label(self) -> str:
        """``"3"`` for depth 3, ``"learn {1, 4}"`` for a learning set, ``"full"`` for a full
        fine-tune."""
        if self.learn is not None:
            return "learn {" + ", ".join(map(str, _ordered(self.learn))) + "}"
        return "full" if self.depth is None else str(self.depth)

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
            "other_bytes": self.other_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
        }

    def _figures(self) -> tuple[int, ...]:
        return (
            self.param_bytes,
            self.grad_bytes,
            self.optimizer_bytes,
            self.saved_bytes,
            self.other_bytes,
            self.peak_bytes,
        )


def _ordered(items: frozenset[int | str]) -> list[int | str]:
    """Block positions in order, then module names."""
    numbers = sorted(item for item in items if isinstance(item, int))
    return [*numbers, *sorted(item for item in items if isinstance(item, str))]


class MemoryPlan:
    """Predicted memory of a training step per depth (or learning set): ``plan.rows``,
    ``plan[depth]``, ``plan.fits("24GiB")``, ``plan.table()``, ``plan.to_json()``. With
    ``plan.shard`` set (``"ddp"``, ``"fsdp2"``, ``"zero1"``...), every row is one of
    ``plan.world`` ranks.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    >>> plan = gg.estimate(net, torch.randn(8, 256), optimizer="sgd")
    >>> [row.depth for row in plan.rows], plan[1].grad_bytes
    ([0, 1, 2, 4], 263168)
    >>> plan.fits("2MiB"), [row.depth for row in plan.rows]
    (3, [0, 1, 2, 3, 4])
    """

    def __init__(
        self,
        model: str,
        rows: Sequence[MemoryRow],
        *,
        optimizer: str,
        dtype: str,
        blocks: int,
        amp: str | None = None,
        masters: str | None = None,
        device: str = "cpu",
        world: int = 1,
        shard: str | None = None,
    ) -> None:
        self.model = model
        self.rows: tuple[MemoryRow, ...] = tuple(rows)
        self.optimizer = optimizer
        self.dtype = dtype
        self.blocks = blocks
        self.amp = amp
        self.masters = masters
        self.device = device
        self.world = world  # ranks; every row is one rank's bytes (rank 0: it holds the most)
        self.shard = shard  # None (one device), "ddp", "fsdp2", "zero1", "zero2" or "zero3"
        self.labels: dict[MemoryRow, str] = {}  # a row's name in the table, if not its label
        self.notes: list[str] = []  # lines under the table, after the plan's own
        self._replanner: Replanner | None = None  # plans more depths (fits), set by the planner

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

    def fits(
        self, budget: int | float | str, headroom: int | float | str | None = None
    ) -> int | frozenset[int | str] | None:
        """The largest depth whose peak plus ``headroom`` is at most ``budget`` (bytes, or a
        string such as ``"24GiB"`` or ``"80 GB"``), among all depths ``0..blocks``; ``None``
        when none fits.

        The depths that decide the answer and were not planned yet are planned now, on the
        copy of the model ``gg.estimate`` took (the model as it was then), and join
        :attr:`rows`: the largest depth that fits and the next one, which does not, are rows
        of the plan afterwards. The peak grows with the depth, so a few rows settle it (a
        plan not made by ``gg.estimate`` cannot plan more: it warns when its rows do not
        settle the answer). A plan of learning sets only answers with the planned set with
        the most gradient bytes that fits; none is planned for it. A full fine-tune row
        (``gradgate plan`` adds one) is not a depth: its own ``peak_bytes`` answers for it.

        ``headroom=None`` is the default of the plan's device (:meth:`headroom_for`): on CUDA
        512 MiB + 5% of the peak, on the CPU 5% of the peak. Pass ``headroom=0`` for the bare
        peak, or bytes of your own.
        """
        limit = parse_bytes(budget)
        extra = None if headroom is None else parse_bytes(headroom, "headroom")

        def fitting(row: MemoryRow) -> bool:
            return needed_bytes(row, self.device, extra) <= limit

        self._plan_around(fitting)
        candidates = [
            row
            for row in self.rows
            if (row.depth is not None or row.learn is not None) and fitting(row)
        ]
        if not candidates:
            return None
        best = max(candidates, key=lambda r: (r.grad_bytes, -1 if r.depth is None else r.depth))
        return best.depth if best.learn is None else best.learn

    def _plan_around(self, fitting: Callable[[MemoryRow], bool]) -> None:
        """Plan the depths between the largest planned one that fits and the next planned one
        that does not (:func:`budget.plan_around`); the depth rows stay ordered by depth. The
        planner opens only if a row is missing."""
        rows = {row.depth: row for row in self.rows if row.learn is None}
        depths = {depth: row for depth, row in rows.items() if depth is not None}
        if not depths:
            return
        if self._replanner is None:
            low, high = unsettled(depths, self.blocks, fitting)
            if high - low > 1:
                warnings.warn(
                    f"plan.fits answered among the planned depths {sorted(depths)} only: this "
                    "plan cannot plan more (it was not made by gg.estimate), and the answer "
                    f"may be one of depths {low + 1}..{high - 1}, which were not planned. Plan "
                    f"them with gg.estimate(..., depths=range({low + 1}, {high})).",
                    GradgateWarning,
                    stacklevel=3,
                )
            return
        count, replanner = len(depths), self._replanner
        with contextlib.ExitStack() as stack:
            opened: list[Callable[[int], MemoryRow]] = []

            def plan_row(depth: int) -> MemoryRow:
                if not opened:
                    opened.append(stack.enter_context(replanner()))
                return opened[0](depth)

            plan_around(depths, plan_row, self.blocks, fitting)
        if len(depths) > count:
            others = [row for row in self.rows if row.learn is not None or row.depth is None]
            self.rows = (*(depths[depth] for depth in sorted(depths)), *others)

    def headroom_for(self, row: MemoryRow) -> int:
        """The default headroom :meth:`fits` adds to ``row``'s peak, in bytes. Provisional:
        512 MiB + 5% on CUDA (workspaces, allocator fragmentation), 5% on the CPU; see
        docs/depth-fits.md."""
        return default_headroom(row.peak_bytes, self.device)

    def _label(self, row: MemoryRow) -> str:
        if row in self.labels:
            return self.labels[row]
        if row.learn is None and row.depth is None:
            return "full fine-tune"
        if row.learn is None and row.depth == self.blocks:
            return f"{row.depth} (all blocks)"
        return row.label

    def _notes(self) -> list[str]:
        labels = [self._label(row) for row in self.rows]
        notes = []
        if any(label.endswith("(all blocks)") for label in labels):
            notes.append(
                "all blocks: what runs before the first block (the embeddings) stays frozen"
            )
        own = any(note.startswith("full fine-tune:") for note in self.notes)
        if "full fine-tune" in labels and not own:
            notes.append("full fine-tune: no cut, every parameter learns, embeddings included")
        return [*notes, *self.notes]

    def _title(self) -> str:
        how = [f"{self.blocks} blocks", self.dtype]
        if self.amp:
            how.append(f"autocast {self.amp}")
        if self.masters:
            how.append(f"{self.masters} masters")
        how += [f"optimizer {self.optimizer}", f"planned for {self.device}"]
        if self.shard is not None:
            how.append(f"per rank: {self.shard} over {self.world} ranks")
        return f"{self.model}: memory of one training step per depth ({', '.join(how)})"

    def table(self) -> str:
        """A text table: one line per row, sizes in binary units."""
        cells = [
            [self._label(row), *map(format_bytes, row._figures()), row.peak_phase or ""]
            for row in self.rows
        ]
        first = max([len("depth"), *(len(c[0]) for c in cells)])
        widths = [
            max([len(name), *(len(c[i + 1]) for c in cells)]) for i, name in enumerate(_COLUMNS)
        ]

        def line(label: str, values: Sequence[str]) -> str:
            right = [v.rjust(w) for v, w in zip(values[:-1], widths, strict=False)]
            return "  ".join([label.ljust(first), *right, values[-1].ljust(widths[-1])]).rstrip()

        lines = [
            self._title(),
            "peak = the most bytes live at once in the simulated step (forward, backward, "
            "optimizer step); other = live then beyond params, grads, optimizer state and "
            "saved activations",
            line("depth", _COLUMNS),
            line("-" * first, ["-" * w for w in widths]),
            *(line(cell[0], cell[1:]) for cell in cells),
        ]
        return "\n".join([*lines, *self._notes()])

    def to_json(self) -> str:
        """The plan as JSON: model, dtype, amp, masters, optimizer, device, blocks and the rows
        in bytes."""
        return json.dumps(
            {
                "model": self.model,
                "dtype": self.dtype,
                "amp": self.amp,
                "masters": self.masters,
                "optimizer": self.optimizer,
                "device": self.device,
                "world": self.world,
                "shard": self.shard,
                "blocks": self.blocks,
                "rows": [row.as_dict() for row in self.rows],
            },
            indent=2,
        )

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{name}</th>" for name in ("depth", *_COLUMNS))
        body = "".join(
            "<tr>"
            + f"<td>{html.escape(self._label(row))}</td>"
            + "".join(
                f'<td style="text-align:right">{format_bytes(v)}</td>' for v in row._figures()
            )
            + f"<td>{html.escape(row.peak_phase or '')}</td>"
            + "</tr>"
            for row in self.rows
        )
        caption = html.escape(self._title())
        return f"<table><caption>{caption}</caption><tr>{head}</tr>{body}</table>"

    def __repr__(self) -> str:
        return f"<MemoryPlan {self.model}: {len(self.rows)} rows>\n{self.table()}"


def format_bytes(size: int) -> str:
    """``1536`` -> ``"1.50 KiB"``; whole bytes below 1 KiB. The unit is chosen after rounding,
    so a size just under a unit reads ``1.00`` of it, never ``1024.00`` of the one below.

    >>> format_bytes(512), format_bytes(3 * 2**29), format_bytes(2**20 - 1)
    ('512 B', '1.50 GiB', '1.00 MiB')
    """
    if size < 1024:
        return f"{size} B"
    return in_units(size / 1024, ("KiB", "MiB", "GiB", "TiB"), 1024, "{:.2f}".format)
