"""The audit as one self-contained HTML page (no scripts, no external files).

Sections are built by small functions so later features (the graph view) can add their own.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING

from ._text import HEADERS, _depth

if TYPE_CHECKING:
    from .._audit import AuditReport, ModuleRecord

_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:2em}"
    "table{border-collapse:collapse}td,th{padding:2px 10px;border-bottom:1px solid #ddd}"
    "td.n{text-align:right;font-variant-numeric:tabular-nums}.waste{color:#b00}"
    "svg{max-width:100%;height:auto}.note{color:#666}"
)


def html_page(report: AuditReport, *, title: str = "gradgate audit", extra: str = "") -> str:
    """The page as a string; ``extra`` is trusted HTML appended after the tables."""
    return page(title, f"<h1>{html.escape(title)}</h1>{audit_sections(report)}{extra}")


def page(title: str, body: str) -> str:
    """A complete self-contained HTML document around trusted ``body`` HTML."""
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>"
        f"<body>{body}</body></html>\n"
    )


def audit_sections(report: AuditReport) -> str:
    """The totals, the per-module table and the wasted gradients, as HTML sections."""
    return _totals_section(report) + _modules_section(report) + _wasted_section(report)


def write_html(report: AuditReport, path: Path) -> Path:
    """Write :func:`html_page` to ``path``; returns it."""
    path.write_text(html_page(report), encoding="utf-8")
    return path


def _totals_section(report: AuditReport) -> str:
    items = "".join(
        f"<li>{html.escape(key)}: {value:,}</li>" for key, value in report.totals.items()
    )
    return f"<h2>Totals</h2><ul>{items}</ul>"


def _modules_section(report: AuditReport) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADERS)
    rows = "".join(_module_row(r, indent=_depth(r.name)) for r in report.modules)
    rows += _module_row(report.outside, indent=0)
    return f"<h2>Modules</h2><table><tr>{head}</tr>{rows}</table>"


def _module_row(record: ModuleRecord, *, indent: int) -> str:
    label = html.escape(record.name or "(model)")
    numbers = (
        record.wgrad,
        record.dgrad,
        record.backward_flops,
        record.saved_bytes,
    )
    cells = "".join(f"<td class='n'>{value:,}</td>" for value in numbers)
    return (
        f"<tr><td style='padding-left:{indent}em'>{label}</td>"
        f"<td>{html.escape(record.type)}</td>{cells}"
        f"<td class='n'>{record.seconds * 1e3:.3f}</td></tr>"
    )


def _wasted_section(report: AuditReport) -> str:
    if not report.wasted:
        return "<h2>Wasted gradients</h2><p>none</p>"
    items = "".join(
        f"<li class='waste'>{html.escape(w.parameter)}: {w.flops:,} FLOPs, "
        f"{html.escape(w.message)}</li>"
        for w in report.wasted
    )
    return f"<h2>Wasted gradients</h2><ul>{items}</ul>"
