"""The LR schedulers' private fields that keep a scheduler in step with a new param group."""

from __future__ import annotations

from typing import Any


def sequential_parts(scheduler: Any) -> tuple[list[Any], list[int]] | None:
    """``SequentialLR``'s schedulers and milestones (private fields); ``None`` where absent."""
    parts = vars(scheduler).get("_schedulers"), vars(scheduler).get("_milestones")
    return None if None in parts else (list(parts[0]), list(parts[1]))
