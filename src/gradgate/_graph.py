"""The autograd graph grouped by module (stub: not built yet)."""

from __future__ import annotations

from typing import Any


class Graph:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("Graph")


def graph(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("graph")
