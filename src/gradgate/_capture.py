"""Gradients of intermediate activations (stub: not built yet)."""

from __future__ import annotations

from typing import Any


def capture_grads(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("capture_grads")
