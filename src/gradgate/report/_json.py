"""The audit as JSON, schema ``gradgate.audit/1``.

::

    {"schema": "gradgate.audit/1",
     "totals": {"wgrad": int, "dgrad": int, "backward_flops": int, "saved_bytes": int},
     "forward_seen": bool,
     "modules": [{"name": str, "type": str, "leaf": bool, "wgrad": int, "dgrad": int,
                  "backward_flops": int, "saved_bytes": int, "seconds": float}, ...],
     "outside": {same fields as a module},
     "wasted": [{"parameter": str, "module": str,
                 "reason": "late_freeze" | "not_in_optimizer", "flops": int}, ...]}

``totals`` is derived (the root module's row) and written for readers; loading ignores it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from .._errors import GradgateError

if TYPE_CHECKING:
    from .._audit import AuditReport

SCHEMA = "gradgate.audit/1"


def dumps(report: AuditReport) -> str:
    """The report as a JSON string (keys in a fixed order)."""
    document = {
        "schema": SCHEMA,
        "totals": report.totals,
        "forward_seen": report.forward_seen,
        "modules": [dataclasses.asdict(record) for record in report.modules],
        "outside": dataclasses.asdict(report.outside),
        "wasted": [dataclasses.asdict(item) for item in report.wasted],
    }
    return json.dumps(document, indent=1)


def loads(text: str) -> dict[str, Any]:
    """The fields of a report from :func:`dumps` output; checks the schema name."""
    document = json.loads(text)
    schema = document.get("schema") if isinstance(document, dict) else None
    if schema != SCHEMA:
        raise GradgateError(
            f"audit JSON has schema {schema!r}; expected {SCHEMA!r}. Write it with "
            "report.to_json() from this version of gradgate."
        )
    return {key: document[key] for key in ("modules", "outside", "wasted", "forward_seen")}
