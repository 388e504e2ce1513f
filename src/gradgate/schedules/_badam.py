"""BAdam's block-coordinate schedule: one block learns for ``switch_every`` steps, then the next."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from .._cut.gate import gate_parts
from .._plumbing.errors import InvalidOptionError
from .._plumbing.validate import check_choice, count_option, learn_items_option
from ._plan import Plan, Schedule, always_as_positions, sorted_items

ORDERS = ("random", "ascending", "descending")


class BAdam(Schedule):
    """BAdam (Luo et al. 2024): one block learns for ``switch_every`` steps, then the next.

    ``order="ascending"`` sweeps the blocks first to last, ``"descending"`` last to first,
    ``"random"`` draws a fresh permutation every cycle (a pure function of the seed and the
    cycle, the same on every rank), never starting a cycle with the block that ended the last
    one, so the block changes at every switch. Every block learns exactly ``switch_every``
    steps per cycle. ``always`` holds module names and/or block positions that learn at every
    step (a new head); blocks named there leave the rotation and keep their optimizer state.
    What runs after the last block (the final norm, the head) learns at every step, as with any
    learning set: freeze it (``gg.freeze(model, "lm_head")``) to train the blocks only, as
    BAdam does by default.

    With :class:`gradgate.optim.LearnerMasters` only the active block (and what learns always)
    holds fp32 masters and optimizer state; :func:`gradgate.optim.drop_finished` and the trainer
    callbacks drop the rest at each switch (``resting``).

    >>> sched = BAdam(4, switch_every=2, order="ascending")
    >>> [sched.active(step) for step in range(10)]
    [0, 0, 1, 1, 2, 2, 3, 3, 0, 0]
    >>> sched.plan(2), sorted(sched.resting(2))
    (Plan(learn=[1]), [0, 2, 3])
    >>> drawn = BAdam(4, switch_every=1, seed=3)
    >>> [sorted(drawn.active(s) for s in range(c, c + 4)) for c in (0, 4, 8)]
    [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    """

    def __init__(
        self,
        n: int,
        switch_every: int = 50,
        *,
        order: Literal["random", "ascending", "descending"] = "random",
        always: Iterable[int | str] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(n, seed=seed)
        self.switch_every = count_option("switch_every", switch_every, low=1)
        check_choice("order", order, ORDERS)
        self.order = order
        self.always = learn_items_option("always", () if always is None else always, self.n)
        self._always = self.always  # names that are blocks become positions in _bind
        self._rotation = _rotation(self.n, self.always)
        self._bound: Any = None

    def active(self, step: int) -> int:
        """The block that learns at ``step``."""
        window = count_option("step", step, low=0) // self.switch_every
        cycle, position = divmod(window, len(self._rotation))
        return self._cycle(cycle)[position]

    def _cycle(self, cycle: int) -> list[int]:
        blocks = self._rotation
        if self.order == "ascending":
            return list(blocks)
        if self.order == "descending":
            return blocks[::-1]
        if len(blocks) <= 2:  # the first cycle's order every cycle: it alternates
            return self._rng(0).sample(blocks, len(blocks))
        drawn = self._rng(cycle).sample(blocks, len(blocks))
        # a swap of the first two never moves a cycle's last block: compare with the raw draw
        if cycle and drawn[0] == self._rng(cycle - 1).sample(blocks, len(blocks))[-1]:
            drawn[0], drawn[1] = drawn[1], drawn[0]
        return drawn

    def _plan(self, step: int) -> Plan:
        return Plan(learn=frozenset({self.active(step)}) | self._always)

    def resting(self, step: int) -> frozenset[int]:
        """The rotation's blocks other than the active one: their state goes at a switch."""
        return frozenset(self._rotation) - {self.active(step)}

    def _bind(self, gate: Any) -> None:
        """Names in ``always`` that are blocks learn as those positions and leave the rotation."""
        parts = gate_parts(gate)
        if parts is None or self._bound is parts[0]:
            return
        model, points = parts
        always = always_as_positions(self.always, model, points)
        rotation = _rotation(self.n, always)  # refuses before changing anything
        self._always, self._rotation, self._bound = frozenset(always), rotation, model

    def _config(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "switch_every": self.switch_every,
            "order": self.order,
            "always": sorted_items(self.always),
        }


def _rotation(n: int, always: Iterable[int | str]) -> list[int]:
    rotation = [i for i in range(n) if i not in set(always)]
    if not rotation:
        raise InvalidOptionError(
            f"always={sorted_items(always)} holds all {n} blocks, so no block is left to "
            "rotate; expected at least one block outside always= (name the head or a few "
            "blocks there, not all of them)."
        )
    return rotation
