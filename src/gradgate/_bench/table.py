"""The one table of ``gradgate bench``: ratios per model and depth, as text or Markdown.

Both formats come from the same cells (:func:`sections`), so the terminal table and the
tables of ``benchmarks/RESULTS.md`` never disagree.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any, Literal

Row = dict[str, Any]
Format = Literal["text", "markdown"]


@dataclass
class Section:
    """One titled table: a header row and body rows of cells."""

    title: str
    header: list[str]
    rows: list[list[str]]


def _ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    return "-" if a is None or not b else f"{a / b:.{digits}f}"


def _exact(a: int | None, b: int | None) -> str:
    """``1 (=)`` when equal, so an exact match stands out from a rounded 1.00."""
    if a is None or b is None:
        return "-"
    return "1 (=)" if a == b else _ratio(a, b, 4)


def _cell(at: dict[str, Row], column: tuple[str, str, str, str, int]) -> str:
    _, top, bottom, figure, digits = column
    a, b = _get(at.get(top), figure), _get(at.get(bottom), figure)
    return _exact(a, b) if digits == 0 else _ratio(a, b, digits)


def _get(row: Row | None, key: str) -> Any:
    return None if row is None else row[key]


# Every column: header, numerator method, denominator method, figure, digits (0: exact match).
COLUMNS: list[tuple[str, str, str, str, int]] = [
    ("time g/i", "gradgate", "ideal", "step_seconds", 3),
    ("time g/f", "gradgate", "full", "step_seconds", 2),
    ("time t/i", "toggle", "ideal", "step_seconds", 2),
    ("time l/i", "late-freeze", "ideal", "step_seconds", 2),
    ("FLOPs g/i", "gradgate", "ideal", "backward_flops", 0),
    ("FLOPs g/f", "gradgate", "full", "backward_flops", 2),
    ("FLOPs l/f", "late-freeze", "full", "backward_flops", 2),
    ("saved g/i", "gradgate", "ideal", "saved_bytes", 0),
    ("saved t/i", "toggle", "ideal", "saved_bytes", 2),
    ("peak g/i", "gradgate", "ideal", "peak_bytes", 3),
    ("peak g/t", "gradgate", "toggle", "peak_bytes", 3),
]
LEGEND = (
    "Ratios x/y of median step time, backward FLOPs, bytes saved for backward and step peak "
    "memory; g gradgate, i ideal (prefix under no_grad by hand), f full backprop, t toggle "
    "(requires_grad set before the forward), l late-freeze (requires_grad cleared after it); "
    "1 (=) marks an exact match."
)


def sections(document: dict[str, Any]) -> list[Section]:
    """The model tables, then the compile table, of a bench JSON document."""
    rows = document["results"]
    found = [_model_section(rows, model) for model in dict.fromkeys(r["model"] for r in rows)]
    if document["compile"]:
        hits = document["machine"].get("compile_recompile_limit_hits", {})
        found.append(
            Section(
                title="torch.compile over every depth (warm-up: depths all, 0, n)",
                header=["method", "graphs", "recompiles after warm-up", "hit recompile limit"],
                rows=[
                    [
                        r["method"],
                        str(r["graphs"]),
                        str(r["recompiles"]),
                        "yes" if hits.get(r["method"]) else "no",
                    ]
                    for r in document["compile"]
                ],
            )
        )
    return found


def _model_section(rows: list[Row], model: str) -> Section:
    mine = {(r["method"], r["depth"]): r for r in rows if r["model"] == model}
    full = mine["full", None]
    peak = full["peak_bytes"]
    title = (
        f"{model} (full backprop: {full['step_seconds'] * 1e3:.1f} ms per step, "
        f"{full['backward_flops'] / 1e9:.2f} backward GFLOP, "
        f"{full['saved_bytes'] / 2**20:.1f} MiB saved"
        + ("" if peak is None else f", {peak / 2**20:.1f} MiB step peak")
        + ")"
    )
    depths = list(dict.fromkeys(d for (m, d) in mine if m == "gradgate"))
    body = []
    for depth in depths:
        at = {method: row for (method, d), row in mine.items() if d == depth}
        at["full"] = full
        label = "all (None)" if depth is None else str(depth)
        body.append([label, *(_cell(at, column) for column in COLUMNS)])
    return Section(title=title, header=["depth", *(c[0] for c in COLUMNS)], rows=body)


def render(document: dict[str, Any], *, fmt: Format = "text") -> str:
    """The whole table: a heading naming the run, then every section.

    >>> row = dict(model="m", method="full", depth=None, step_seconds=0.1, backward_flops=10,
    ...            saved_bytes=2**20, peak_bytes=None)
    >>> doc = {"machine": {"command": "gradgate bench", "device_name": "cpu (x)", "amp": None},
    ...        "results": [row, {**row, "method": "gradgate"}, {**row, "method": "ideal"}],
    ...        "compile": []}
    >>> lines = render(doc).splitlines()
    >>> print(lines[0])
    gradgate bench on cpu (x), float32 (command: gradgate bench)
    >>> for line in lines[-3:]:
    ...     print(line[:44].rstrip())
    m (full backprop: 100.0 ms per step, 0.00 ba
         depth  time g/i  time g/f  time t/i  ti
    all (None)     1.000      1.00         -
    """
    legend = LEGEND if fmt == "markdown" else textwrap.fill(LEGEND, width=100)
    parts = [heading(document["machine"]), legend]
    for section in sections(document):
        if fmt == "markdown":
            parts.append(_markdown(section))
        else:
            parts.append(_text(section))
    overheads = overheads_line(document["machine"])
    if overheads:
        parts.append(overheads)
    return "\n\n".join(parts)


def heading(machine: dict[str, Any]) -> str:
    """One line naming the device, the precision and the command of the run."""
    amp = machine.get("amp")
    precision = "float32" if amp is None else f"{amp} autocast (float32 weights)"
    return (
        f"gradgate bench on {machine.get('device_name', 'cpu')}, {precision} "
        f"(command: {machine.get('command', 'gradgate bench')})"
    )


def overheads_line(machine: dict[str, Any]) -> str:
    """The depth-change and audit overheads, or an empty string when not measured."""
    over = machine.get("overheads")
    if not over:
        return ""
    audit = over["audit_ratio"]
    return (
        f"Depth change (48 blocks): {over['depth_change_seconds'] * 1e6:.2f} us per change, "
        f"{over['depth_change_step_fraction'] * 100:.4f}% of a step. Audit overhead "
        "(audited / plain step): " + ("not measured" if audit is None else f"{audit:.2f}") + "."
    )


def _text(section: Section) -> str:
    table = [section.header, *section.rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(section.header))]
    lines = [section.title]
    for row in table:
        lines.append("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
    return "\n".join(lines)


def _markdown(section: Section) -> str:
    lines = [f"### {section.title}", "", "| " + " | ".join(section.header) + " |"]
    lines.append("|" + "---:|" * len(section.header))
    for row in section.rows:
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
