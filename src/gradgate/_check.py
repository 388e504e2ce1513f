"""Pitfall checks (stub: not built yet)."""

from __future__ import annotations

from typing import Any


class Finding:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("Finding")


def check(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("check")
