"""Temporary: the old import path of two names the demo uses; removed once it imports
``page`` from ``gradgate._html`` and ``AuditReport.html()`` instead of ``audit_sections``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._html import page

if TYPE_CHECKING:
    from .._audit import AuditReport


def audit_sections(report: AuditReport) -> str:
    """The audit's HTML sections (now ``report.html()``)."""
    return report.html()


__all__ = ["audit_sections", "page"]
