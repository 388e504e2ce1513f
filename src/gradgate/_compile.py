"""torch.compile recipe for per-minibatch depth (stub: not built yet)."""

from __future__ import annotations

from typing import Any


def compile_blocks(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("compile_blocks")
