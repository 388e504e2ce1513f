"""An audit as a small table with words a newcomer reads: one row per top-level layer."""

from __future__ import annotations

import html
import math

import gradgate as gg

from .._plumbing.units import in_units

COLUMNS = (
    "layer",
    "weight gradient (wgrad)",
    "input gradient (dgrad)",
    "backward FLOPs",
    "activations saved for backward",
)


_PREFIXES = ("k", "M", "G", "T", "P", "E")


def human_count(value: float, unit: str = "") -> str:
    """``1234567`` -> ``1.23 M``: three significant digits, with the prefix their rounded value
    needs (``999_999_999`` is ``1.00 G``); small numbers stay exact.

    >>> human_count(0), human_count(999), human_count(1_234_567), human_count(2048, "B")
    ('0', '999', '1.23 M', '2.05 kB')
    >>> human_count(999_999_999), human_count(1000)
    ('1.00 G', '1.00 k')
    """
    if abs(value) < 1000:
        return f"{value:,.0f}" + (f" {unit}" if unit and value else "")
    return in_units(value / 1000, [prefix + unit for prefix in _PREFIXES], 1000, _three_digits)


def _three_digits(value: float) -> str:
    """Rounded to three significant digits, trailing zeros kept: ``1.00``, ``12.3``, ``999``."""
    rounded = float(f"{value:.3g}")
    decimals = max(0, 2 - math.floor(math.log10(abs(rounded)))) if rounded else 2
    return f"{rounded:.{decimals}f}"


def layer_rows(report: gg.AuditReport) -> list[tuple[str, str, str, str, str]]:
    """One row per child of the model (its layers), then the whole model."""
    wasted = {item.module for item in report.wasted}
    rows = []
    for record in report.modules:
        if not record.name or "." in record.name:
            continue
        wgrad = _counted(record.wgrad)
        if record.name in wasted:
            wgrad += ", wasted"
        rows.append(
            (
                f"{record.name} ({record.type})",
                wgrad,
                _counted(record.dgrad),
                human_count(record.backward_flops),
                human_count(record.saved_bytes, "B"),
            )
        )
    totals = report.totals
    rows.append(
        (
            "whole model",
            str(totals["wgrad"]),
            str(totals["dgrad"]),
            human_count(totals["backward_flops"]),
            human_count(totals["saved_bytes"], "B"),
        )
    )
    return rows


def _counted(count: int) -> str:
    return "—" if count == 0 else "computed" if count == 1 else f"computed ({count})"


def html_table(report: gg.AuditReport) -> str:
    """The rows as an HTML table; the last row (the whole model) is set in bold."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    body = []
    rows = layer_rows(report)
    for i, row in enumerate(rows):
        cells = "".join(
            f"<td class='{'n' if j >= 3 else ('w' if 'wasted' in cell else '')}'>"
            f"{html.escape(cell)}</td>"
            for j, cell in enumerate(row)
        )
        body.append(f"<tr class='{'total' if i == len(rows) - 1 else ''}'>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def summary(report: gg.AuditReport) -> str:
    """One line: the counts, and the wasted gradients if any.

    >>> print(summary(gg.AuditReport()))
    0 wgrad, 0 dgrad, 0 backward FLOPs, 0 saved for backward
    """
    totals = report.totals
    line = (
        f"{totals['wgrad']} wgrad, {totals['dgrad']} dgrad, "
        f"{human_count(totals['backward_flops'])} backward FLOPs, "
        f"{human_count(totals['saved_bytes'], 'B')} saved for backward"
    )
    if report.wasted:
        names = ", ".join(item.parameter for item in report.wasted)
        line += f"; wasted: {names} ({human_count(report.wasted_flops)} FLOPs)"
    return line
