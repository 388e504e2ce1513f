"""What did backward compute? Per-module wgrad, dgrad, FLOPs, saved bytes (stub)."""

from __future__ import annotations

from typing import Any


class AuditReport:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("AuditReport")


def audit(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("audit")
