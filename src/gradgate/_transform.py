"""Per-module gradient transforms (stub: not built yet)."""

from __future__ import annotations

from typing import Any


def clip_grad(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("clip_grad")


def grad_transform(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("grad_transform")


def reverse_grad(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("reverse_grad")


def scale_grad(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("scale_grad")


def zero_grad_of(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("zero_grad_of")
