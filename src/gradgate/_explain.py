"""Classic autograd errors re-raised with the module, op and fix (stub: not built yet)."""

from __future__ import annotations

from typing import Any


def explain(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("explain")
