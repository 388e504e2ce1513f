"""The audit as a text table: the seeds' kernel table reborn, one row per module."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._audit import AuditReport, ModuleRecord

HEADERS = ("module", "type", "wgrad", "dgrad", "backward FLOPs", "saved bytes", "ms")


def render_table(report: AuditReport, *, depth: int | None = None) -> str:
    """Rows for the modules (nested ones indented, deeper than ``depth`` left out), the
    work outside the model, the totals, and any wasted gradients."""
    rows = [_row(_label(r.name), r) for r in report.modules if _shown(r.name, depth)]
    rows.append(_row(report.outside.name, report.outside))
    lines = _align([HEADERS, *rows])
    lines.insert(1, "-" * len(lines[0]))
    totals = report.totals
    lines.append("")
    lines.append(
        f"model totals: {totals['wgrad']} wgrad, {totals['dgrad']} dgrad, "
        f"{totals['backward_flops']:,} backward FLOPs, {totals['saved_bytes']:,} bytes saved"
    )
    if not report.forward_seen:
        lines.append("forward not audited: saved bytes unknown, nodes attributed by parameter")
    lines.extend(_wasted_lines(report))
    return "\n".join(lines)


def _wasted_lines(report: AuditReport) -> list[str]:
    if not report.wasted:
        return ["wasted gradients: none"]
    lines = [f"wasted gradients: {len(report.wasted)} ({report.wasted_flops:,} FLOPs)"]
    for item in report.wasted:
        lines.append(f"  {item.parameter}: {item.flops:,} FLOPs, {item.message}")
    return lines


def _shown(name: str, depth: int | None) -> bool:
    return depth is None or _depth(name) <= depth


def _depth(name: str) -> int:
    return 0 if not name else name.count(".") + 1


def _label(name: str) -> str:
    return "  " * _depth(name) + (name or "(model)")


def _row(label: str, record: ModuleRecord) -> tuple[str, ...]:
    return (
        label,
        record.type,
        str(record.wgrad),
        str(record.dgrad),
        f"{record.backward_flops:,}",
        f"{record.saved_bytes:,}",
        f"{record.seconds * 1e3:.3f}",
    )


def _align(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(width) for cell, width in zip(row[2:], widths[2:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return lines
