"""How a person sees an audit: a text table, HTML sections, and JSON (``gradgate.audit/1``).

JSON document::

    {"schema": "gradgate.audit/1",
     "totals": {"wgrad": int, "dgrad": int, "backward_flops": int, "saved_bytes": int},
     "forward_seen": bool, "backward_seen": bool,
     "modules": [{"name": str, "type": str, "leaf": bool, "wgrad": int, "dgrad": int,
                  "backward_flops": int, "saved_bytes": int, "wgrad_bytes": int,
                  "seconds": float}, ...],
     "outside": {same fields as a module},
     "wasted": [{"parameter": str, "module": str,
                 "reason": "late_freeze" | "not_in_optimizer", "flops": int}, ...],
     "uncounted_ops": [str, ...]}

``totals`` is derived (the root module's row) and written for readers; loading ignores it.
``backward_seen``, ``uncounted_ops`` (ops whose backward FLOPs no formula could count) and
``wgrad_bytes`` may be missing in documents of older versions (read as true, empty and 0).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Any

from ..._plumbing.errors import InvalidOptionError
from .records import COLUMNS, HEADERS, ModuleRecord, WastedGradient, as_dict, cells, totals_of

SCHEMA = "gradgate.audit/1"
NO_BACKWARD = (
    "no backward ran inside this audit: wgrad, dgrad, backward FLOPs and wasted gradients "
    "were not measured. Call loss.backward() inside the `with gg.audit(model) as report:` block."
)
NO_FORWARD = "forward not audited: saved bytes unknown, nodes attributed by parameter"


@dataclass
class Figures:
    """Everything an audit measured; what the renderers read."""

    modules: list[ModuleRecord]
    outside: ModuleRecord
    wasted: list[WastedGradient]
    forward_seen: bool
    backward_seen: bool
    uncounted_ops: list[str] = field(default_factory=list)

    @property
    def totals(self) -> dict[str, int]:
        return totals_of(self.modules[0] if self.modules else ModuleRecord("", ""))

    @property
    def wasted_flops(self) -> int:
        return sum(item.flops for item in self.wasted)


# -- text ------------------------------------------------------------------------------------
def render_table(figures: Figures, *, depth: int | None = None) -> str:
    """Rows for the modules (nested ones indented, deeper than ``depth`` left out), the
    work outside the model, the totals, notes, and any wasted gradients."""
    rows = [(_label(r.name), r.type, *cells(r)) for r in figures.modules if _shown(r.name, depth)]
    rows.append((figures.outside.name, figures.outside.type, *cells(figures.outside)))
    lines = _align([HEADERS, *rows])
    lines.insert(1, "-" * len(lines[0]))
    totals = figures.totals
    lines.append("")
    lines.append(
        f"model totals: {totals['wgrad']} wgrad, {totals['dgrad']} dgrad, "
        f"{totals['backward_flops']:,} backward FLOPs, {totals['saved_bytes']:,} bytes saved"
    )
    if not figures.forward_seen:
        lines.append(NO_FORWARD)
    if figures.uncounted_ops:
        lines.append(_uncounted(figures))
    if not figures.backward_seen:
        lines.append(NO_BACKWARD)
        return "\n".join(lines)
    lines.extend(_wasted_lines(figures))
    return "\n".join(lines)


def _uncounted(figures: Figures) -> str:
    ops = ", ".join(figures.uncounted_ops)
    return f"backward FLOPs not counted for {ops}: no FLOP formula worked for these ops"


def _wasted_lines(figures: Figures) -> list[str]:
    if not figures.wasted:
        return ["wasted gradients: none"]
    lines = [f"wasted gradients: {len(figures.wasted)} ({figures.wasted_flops:,} FLOPs)"]
    for item in figures.wasted:
        lines.append(f"  {item.parameter}: {item.flops:,} FLOPs, {item.message}")
    return lines


def _shown(name: str, depth: int | None) -> bool:
    return depth is None or _depth(name) <= depth


def _depth(name: str) -> int:
    return 0 if not name else name.count(".") + 1


def _label(name: str) -> str:
    return "  " * _depth(name) + (name or "(model)")


def _align(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS))]
    lines = []
    for row in rows:
        texts = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        texts += [cell.rjust(width) for cell, width in zip(row[2:], widths[2:], strict=True)]
        lines.append("  ".join(texts).rstrip())
    return lines


# -- HTML ------------------------------------------------------------------------------------
def html_sections(figures: Figures, *, heading: int = 2) -> str:
    """The totals, the per-module table and the wasted gradients as HTML (names escaped);
    ``heading`` is the level of the section headings."""
    notes = "".join(
        f"<p class='note'>{html.escape(text)}</p>"
        for text, shown in (
            (NO_FORWARD, not figures.forward_seen),
            (NO_BACKWARD, not figures.backward_seen),
        )
        if shown
    )
    return (
        _totals_section(figures, heading)
        + notes
        + _modules_section(figures, heading)
        + (_wasted_section(figures, heading) if figures.backward_seen else "")
    )


def _totals_section(figures: Figures, heading: int) -> str:
    items = "".join(
        f"<li>{html.escape(key)}: {value:,}</li>" for key, value in figures.totals.items()
    )
    return f"<h{heading}>Totals</h{heading}><ul>{items}</ul>"


def _modules_section(figures: Figures, heading: int) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADERS)
    rows = "".join(_module_row(r, indent=_depth(r.name)) for r in figures.modules)
    rows += _module_row(figures.outside, indent=0)
    return f"<h{heading}>Modules</h{heading}><table><tr>{head}</tr>{rows}</table>"


def _module_row(record: ModuleRecord, *, indent: int) -> str:
    label = html.escape(record.name or "(model)")
    numbers = "".join(f"<td class='n'>{html.escape(cell)}</td>" for cell in cells(record))
    return (
        f"<tr><td style='padding-left:{indent}em'>{label}</td>"
        f"<td>{html.escape(record.type)}</td>{numbers}</tr>"
    )


def _wasted_section(figures: Figures, heading: int) -> str:
    title = f"<h{heading}>Wasted gradients</h{heading}>"
    if not figures.wasted:
        return f"{title}<p>none</p>"
    items = "".join(
        f"<li class='waste'>{html.escape(w.parameter)}: {w.flops:,} FLOPs, "
        f"{html.escape(w.message)}</li>"
        for w in figures.wasted
    )
    return f"{title}<ul>{items}</ul>"


# -- JSON ------------------------------------------------------------------------------------
def dumps(figures: Figures) -> str:
    """The figures as a JSON string (keys in a fixed order)."""
    document = {
        "schema": SCHEMA,
        "totals": figures.totals,
        "forward_seen": figures.forward_seen,
        "backward_seen": figures.backward_seen,
        "modules": [as_dict(record) for record in figures.modules],
        "outside": as_dict(figures.outside),
        "wasted": [as_dict(item) for item in figures.wasted],
        "uncounted_ops": figures.uncounted_ops,
    }
    return json.dumps(document, indent=1)


def loads(text: str) -> Figures:
    """Figures from :func:`dumps` output; checks the schema name and the fields."""
    expected = "expected the text that report.to_json() wrote"
    if not isinstance(text, (str, bytes, bytearray)):
        raise InvalidOptionError(f"AuditReport.from_json got {type(text).__name__}; {expected}.")
    try:
        document: Any = json.loads(text)
    except ValueError as error:
        raise InvalidOptionError(
            f"AuditReport.from_json got text that is not JSON ({error}: {text[:40]!r}); {expected}."
        ) from None
    schema = document.get("schema") if isinstance(document, dict) else None
    if schema != SCHEMA:
        raise InvalidOptionError(
            f"audit JSON has schema {schema!r}; expected {SCHEMA!r}. Write it with "
            "report.to_json() from this version of gradgate."
        )
    try:
        return Figures(
            [ModuleRecord(**m) for m in document["modules"]],
            ModuleRecord(**document["outside"]),
            [WastedGradient(**w) for w in document["wasted"]],
            forward_seen=bool(document["forward_seen"]),
            backward_seen=bool(document.get("backward_seen", True)),
            uncounted_ops=list(document.get("uncounted_ops", [])),
        )
    except (KeyError, TypeError) as error:
        raise InvalidOptionError(
            f"audit JSON of schema {SCHEMA!r} lacks or garbles a field ({error!r}); {expected}, "
            "unedited."
        ) from None


__all__ = [
    "COLUMNS",
    "NO_BACKWARD",
    "SCHEMA",
    "Figures",
    "dumps",
    "html_sections",
    "loads",
    "render_table",
]
