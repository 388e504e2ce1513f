"""``gradgate bench`` (stub: not built yet)."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    """Run the benchmark; returns the exit status."""
    raise NotImplementedError("gradgate bench")
