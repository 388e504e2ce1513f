"""A progress bar on stderr: tqdm when installed, one line per step otherwise."""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    """Advance by one named step at a time."""

    def __init__(self, *, total: int) -> None:
        self._bar: Any = None
        self._done = 0
        self._total = total
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc="gradgate demo", file=sys.stderr, leave=False)

    def advance(self, what: str) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(what)
            self._bar.update(1)
        else:
            print(f"[{self._done}/{self._total}] {what}", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
