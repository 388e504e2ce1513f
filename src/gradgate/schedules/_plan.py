"""A schedule's plan for one step: a depth or a learning set, and a skip set."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

from .._cut.stacks import outside_modules
from .._plumbing.errors import InvalidOptionError


class Gate(Protocol):
    @property
    def blocks(self) -> list[str]: ...

    depth: int | None
    learn: Any
    skip: Any


@dataclass(frozen=True)
class Plan:
    """What one step trains: ``depth`` or ``learn`` (not both), and ``skip``.

    ``depth=None`` with ``learn=None`` means no cut (every block learns). ``learn`` holds block
    positions and/or module names; ``skip`` holds block positions that run with no graph while
    the gradient passes around them (DropBP). ``embeddings=True`` (with ``learn``) lets the
    modules with parameters around the blocks learn too: the embeddings, the final norm, the
    head (LISA's default); :meth:`apply` names them on the gate.

    >>> Plan(learn=frozenset({1, 3})).learning(5)
    frozenset({1, 3})
    >>> Plan(depth=2, skip=frozenset({4})).metrics(5)
    {'depth': 2, 'learning_blocks': 1, 'skipped_blocks': 1, 'learning_share': 0.2}
    """

    depth: int | None = None
    learn: frozenset[int | str] | None = None
    skip: frozenset[int] = field(default_factory=frozenset)
    embeddings: bool = False

    def __post_init__(self) -> None:
        if self.depth is not None and self.learn is not None:
            raise InvalidOptionError(
                f"Plan(depth={self.depth!r}, learn={set(self.learn)!r}) sets both; expected "
                "one of them (depth=k is learn={n-k, ..., n-1})."
            )
        if self.embeddings is not False and (self.embeddings is not True or self.learn is None):
            raise InvalidOptionError(
                f"Plan(embeddings={self.embeddings!r}, learn={self.learn!r}); expected "
                "embeddings=True only with a learn set (depth=None already trains everything)."
            )

    def apply(self, gate: Gate) -> None:
        """Set this plan on a gate (one field write each); all of it or, on error, none."""
        before = Plan(depth=gate.depth, learn=gate.learn, skip=gate.skip)
        try:
            self._write(gate)
        except BaseException:
            before._write(gate)
            raise

    def _write(self, gate: Gate) -> None:
        if self.learn is not None:
            gate.learn = self.learn | around_blocks(gate) if self.embeddings else self.learn
        else:
            gate.depth = self.depth
        gate.skip = self.skip

    def learning(self, n: int) -> frozenset[int]:
        """Positions of the blocks that get weight gradients in a model of ``n`` blocks."""
        if self.learn is not None:
            planned = {i % n for i in self.learn if isinstance(i, int)}
        elif self.depth is not None:
            planned = set(range(n - self.depth, n))
        else:
            planned = set(range(n))
        return frozenset(planned - self.skip)

    def metrics(self, n: int) -> dict[str, float]:
        """Numbers to log for this plan: depth (for a depth plan), counts and learning share."""
        learning = len(self.learning(n))
        found: dict[str, float] = {} if self.depth is None else {"depth": self.depth}
        found.update(
            learning_blocks=learning,
            skipped_blocks=len(self.skip),
            learning_share=round(learning / n, 6),
        )
        return found

    def __repr__(self) -> str:
        parts = []
        if self.learn is not None:
            parts.append(f"learn={sorted_items(self.learn)}")
        else:
            parts.append(f"depth={self.depth}")
        if self.skip:
            parts.append(f"skip={sorted(self.skip)}")
        if self.embeddings:
            parts.append("embeddings=True")
        return f"Plan({', '.join(parts)})"


Plan.__module__ = "gradgate.schedules"  # documented and pickled as gg.schedules.Plan


def around_blocks(gate: Any) -> frozenset[str]:
    """Names of the modules with parameters around a gate's blocks (embeddings, final norms,
    heads): what LISA trains at every step besides its drawn blocks."""
    model: nn.Module = gate._model
    names = {id(module): name for name, module in model.named_modules()}
    return frozenset(
        names[id(module)]
        for module in outside_modules(model, gate._points)
        if id(module) in names and any(True for _ in module.parameters())
    )


def sorted_items(items: Iterable[int | str]) -> list[int | str]:
    return sorted(items, key=lambda v: (isinstance(v, str), v))  # type: ignore[return-value]
