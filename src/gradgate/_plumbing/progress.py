"""A progress bar on stderr: tqdm when installed, one line per step otherwise."""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    """Advance by one named step at a time; ``enabled=False`` prints nothing.

    >>> bar = Progress(total=2, description="example", enabled=False)
    >>> bar.advance("first"); bar.advance("second"); bar.close()
    """

    def __init__(self, *, total: int, description: str, enabled: bool = True) -> None:
        self._bar: Any = None
        self._done = 0
        self._total = total
        self._description = description
        self._enabled = enabled
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=description, file=sys.stderr, leave=False)

    def advance(self, what: str) -> None:
        """Mark one more step done, named ``what``."""
        self._done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(what)
            self._bar.update(1)
        elif self._enabled:
            print(f"{self._description} [{self._done}/{self._total}] {what}", file=sys.stderr)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()
