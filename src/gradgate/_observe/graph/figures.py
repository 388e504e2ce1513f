"""Audit figures (wgrad, dgrad, backward FLOPs) and state notes on the cluster titles."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from ..._plumbing.errors import InvalidOptionError
from .parts import GraphCluster, format_flops


def audit_figures(audit: Any) -> dict[str, dict[str, float]]:
    """``{module name: {figure: value}}`` from an audit report's ``.modules`` records."""
    if audit is None:
        return {}
    records = getattr(audit, "modules", None)
    if records is None:
        raise InvalidOptionError(
            f"audit has type {type(audit).__name__} and no .modules; expected a report from "
            "gg.audit(model) (records with name, wgrad, dgrad, backward_flops) or None."
        )
    if isinstance(records, Mapping):
        records = [{"name": name, **_record_dict(record)} for name, record in records.items()]
    figures: dict[str, dict[str, float]] = {}
    for record in records:
        values = _record_dict(record)
        name = str(values.get("name", ""))
        figures[name] = {
            key: float(values[key])
            for key in ("wgrad", "dgrad", "backward_flops")
            if isinstance(values.get(key), (int, float))
        }
    return figures


def _record_dict(record: Any) -> dict[str, Any]:
    if isinstance(record, Mapping):
        return dict(record)
    keys = ("name", "wgrad", "dgrad", "backward_flops")
    return {key: getattr(record, key) for key in keys if hasattr(record, key)}


def decorate(
    clusters: dict[str, GraphCluster], figures: dict[str, dict[str, float]]
) -> dict[str, GraphCluster]:
    """Cluster titles with state notes and audit figures (summed over collapsed members)."""
    result = {}
    for name, cluster in clusters.items():
        lines = [cluster.title]
        if cluster.state == "cut":
            lines.append("cut: no graph")
        elif cluster.state == "frozen":
            lines.append("frozen")
        summary = _figure_line([figures[m] for m in cluster.members if m in figures])
        if summary:
            lines.append(summary)
        result[name] = replace(cluster, title="\n".join(lines))
    return result


def _figure_line(records: Iterable[dict[str, float]]) -> str:
    totals: Counter[str] = Counter()
    found = False
    for record in records:
        found = True
        totals.update(record)
    if not found:
        return ""
    parts = [f"{key} {totals[key]:g}" for key in ("wgrad", "dgrad") if key in totals]
    if "backward_flops" in totals:
        parts.append(f"{format_flops(totals['backward_flops'])} backward")
    return " · ".join(parts)
