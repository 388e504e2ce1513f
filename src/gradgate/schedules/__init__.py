"""Schedules: which blocks learn (or skip backward) at each training step.

A schedule turns a step number into a :class:`Plan` (a depth, a learning set, a skip set) and
sets it on a :class:`gradgate.BackpropGate`. The plan is a pure function of ``(seed, step)``:
every rank that builds the same schedule draws the same plan with no communication, and a run
resumed at step ``t`` continues the same sequence. :class:`Importance` also depends on the
gradients it observed (``observe``), which its ``state_dict`` keeps.

>>> import torch, gradgate as gg
>>> net = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(6)])
>>> gate = gg.BackpropGate(net)
>>> sched = gg.schedules.GradualUnfreeze(6, every=10)
>>> [sched.plan(step).depth for step in (0, 9, 10, 25)]
[1, 1, 2, 3]
>>> sched.apply(gate, 25)
Plan(depth=3)
>>> gate.depth
3
>>> gate.remove()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from .._cut.gate import gate_parts
from .._plumbing.errors import InvalidOptionError
from .._plumbing.validate import (
    check_choice,
    count_option,
    learn_items_option,
    probability_option,
)
from ._badam import BAdam
from ._importance import Importance
from ._plan import Plan, Schedule, always_as_positions, sorted_items

__all__ = [
    "LISA",
    "BAdam",
    "DropBP",
    "FreezeOut",
    "GradualUnfreeze",
    "Importance",
    "Plan",
    "RandomDepth",
    "Schedule",
]


class RandomDepth(Schedule):
    """A depth drawn uniformly from ``low..high`` (inclusive) at every step.

    >>> sched = RandomDepth(12, low=1, high=4, seed=0)
    >>> [sched.plan(step).depth for step in range(8)] == [sched.plan(s).depth for s in range(8)]
    True
    >>> all(1 <= sched.plan(step).depth <= 4 for step in range(100))
    True
    """

    def __init__(self, n: int, low: int = 1, high: int | None = None, *, seed: int = 0) -> None:
        super().__init__(n, seed=seed)
        self.low = count_option("low", low, low=0, high=self.n)
        self.high = (
            self.n if high is None else count_option("high", high, low=self.low, high=self.n)
        )

    def _plan(self, step: int) -> Plan:
        return Plan(depth=self._rng(step).randint(self.low, self.high))

    def _config(self) -> dict[str, Any]:
        return {"n": self.n, "low": self.low, "high": self.high}


class LISA(Schedule):
    """LISA: ``k`` random blocks learn, redrawn every ``every`` steps; all else learns always.

    As in the paper (Pan et al. 2024, Algorithm 1) and LMFlow, the modules with parameters
    around the blocks (the embeddings, the final norm, the head) learn at every step: the plan
    says ``embeddings=True`` and :meth:`apply` names them on the gate. The gradient then passes
    through every block; the blocks not drawn compute their input gradient but no weight
    gradient, and keep no optimizer state (:func:`gradgate.optim.drop_finished` and the trainer
    callbacks drop it at each redraw, as LMFlow's LISA does).

    ``embeddings=False`` is the cheaper variant: what runs before the blocks does not learn, so
    the backward stops at the earliest drawn block (no graph, no backward below it); what runs
    after the last block still learns.

    ``always`` holds block positions and/or module names that learn at every step too. Names of
    blocks (``"model.layers.0"``) count as their positions once the schedule has seen the gate
    (the first :meth:`apply`): no draw is spent on them and their optimizer state is kept;
    modules named inside blocks (``"model.layers.*.input_layernorm"``) learn at every step and
    keep their state too.

    >>> sched = LISA(8, k=2, every=5, seed=1)
    >>> sched.plan(0) == sched.plan(4), sched.plan(0).learning(8) == sched.plan(5).learning(8)
    (True, False)
    >>> sched.plan(0), LISA(8, k=2, every=5, embeddings=False, seed=1).plan(0)
    (Plan(learn=[0, 1], embeddings=True), Plan(learn=[0, 1]))
    >>> import torch, gradgate as gg
    >>> from collections import OrderedDict
    >>> blocks = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(8)])
    >>> parts = dict(embed=torch.nn.Linear(3, 3), blocks=blocks, head=torch.nn.Linear(3, 1))
    >>> net = torch.nn.Sequential(OrderedDict(parts))
    >>> gate = gg.BackpropGate(net, "blocks.*")
    >>> _ = sched.apply(gate, 0)
    >>> sorted(gate.learn, key=str)
    [0, 1, 'embed', 'head']
    >>> gate.remove()
    """

    def __init__(
        self,
        n: int,
        k: int = 2,
        *,
        every: int = 20,
        always: Iterable[int | str] = (),
        embeddings: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(n, seed=seed)
        self.every = count_option("every", every, low=1)
        self.always = learn_items_option("always", always, self.n)
        if not isinstance(embeddings, bool):
            raise InvalidOptionError(
                f"embeddings={embeddings!r}; expected True or False (False: what runs before "
                "the blocks does not learn, and the backward stops at the earliest drawn block)."
            )
        self.embeddings = embeddings
        self._always = self.always  # names that are blocks become positions in _bind
        self._bound: Any = None
        self._pool = [i for i in range(self.n) if i not in self.always]
        self.k = count_option("k", k, low=0, high=len(self._pool))

    def _plan(self, step: int) -> Plan:
        return Plan(learn=self._drawn(step) | self._always, embeddings=self.embeddings)

    def _bind(self, gate: Any) -> None:
        """Names in ``always`` that are blocks learn as those positions: no draw is spent on
        them, their state is never dropped, and ``Plan.learning`` counts them."""
        parts = gate_parts(gate)
        if parts is None or self._bound is parts[0]:
            return
        model, points = parts
        always = always_as_positions(self.always, model, points)
        pool = [i for i in range(self.n) if i not in always]
        count_option("k", self.k, low=0, high=len(pool))  # before changing anything
        self._always, self._pool, self._bound = frozenset(always), pool, model

    def resting(self, step: int) -> frozenset[int]:
        return frozenset(self._pool) - self._drawn(count_option("step", step, low=0))

    def _drawn(self, step: int) -> frozenset[int]:
        return frozenset(self._rng(step // self.every).sample(self._pool, self.k))

    def _config(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "k": self.k,
            "every": self.every,
            "always": sorted_items(self.always),
            "embeddings": self.embeddings,
        }


class DropBP(Schedule):
    """DropBP: each block skips its backward with its own probability, drawn anew every step.

    Give one ``rate`` for all blocks or ``rates`` per block. Skipped blocks run with no graph
    and the gradient passes around them through the residual path (see ``gate.skip``); the
    other blocks, and everything else, learn.

    >>> sched = DropBP(4, rates=[0.0, 0.0, 1.0, 1.0])
    >>> sched.plan(0)
    Plan(depth=None, skip=[2, 3])
    """

    def __init__(
        self,
        n: int,
        rate: float | None = None,
        *,
        rates: Sequence[float] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(n, seed=seed)
        if (rate is None) == (rates is None):
            raise InvalidOptionError(
                f"DropBP got rate={rate!r} and rates={rates!r}; expected exactly one: a drop "
                "rate for every block (rate=0.5) or one per block (rates=[...])."
            )
        if rates is None:
            rates = [rate] * self.n  # type: ignore[list-item]
        rates = list(rates)
        if len(rates) != self.n:
            raise InvalidOptionError(
                f"rates={list(rates)!r} has {len(rates)} entries; expected one per block "
                f"({self.n})."
            )
        self.rates = [probability_option(f"rates[{i}]", r) for i, r in enumerate(rates)]

    def _plan(self, step: int) -> Plan:
        rng = self._rng(step)
        return Plan(skip=frozenset(i for i, r in enumerate(self.rates) if rng.random() < r))

    def _config(self) -> dict[str, Any]:
        return {"n": self.n, "rates": self.rates}


class FreezeOut(Schedule):
    """FreezeOut: block ``i`` stops learning at its own step, the first blocks first.

    Block 0 stops at ``first * total_steps``, the last block at ``total_steps``; the blocks
    between are spaced ``"linear"`` or ``"cubic"`` (more steps for the later blocks). Or give
    the steps outright with ``stops=[...]`` (non-decreasing). The plan is a depth: what runs
    after the blocks keeps learning.

    >>> sched = FreezeOut(4, total_steps=100, first=0.4)
    >>> sched.stops
    [40, 60, 80, 100]
    >>> [sched.plan(step).depth for step in (0, 40, 79, 80, 100)]
    [4, 3, 2, 1, 0]
    >>> sorted(sched.finished(60))
    [0, 1]
    """

    def __init__(
        self,
        n: int,
        *,
        total_steps: int | None = None,
        first: float = 0.5,
        spacing: Literal["linear", "cubic"] = "linear",
        stops: Sequence[int] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(n, seed=seed)
        if (total_steps is None) == (stops is None):
            raise InvalidOptionError(
                f"FreezeOut got total_steps={total_steps!r} and stops={stops!r}; expected "
                "exactly one: total_steps=... (with first= and spacing=) or stops=[...]."
            )
        if stops is None:
            check_choice("spacing", spacing, ("linear", "cubic"))
            total = count_option("total_steps", total_steps, low=1)
            first = probability_option("first", first)
            self.stops = _spaced_stops(self.n, total, first, spacing)
        else:
            self.stops = [count_option(f"stops[{i}]", s, low=0) for i, s in enumerate(stops)]
            if len(self.stops) != self.n:
                raise InvalidOptionError(
                    f"stops has {len(self.stops)} entries; expected one per block ({self.n})."
                )
            if self.stops != sorted(self.stops):
                raise InvalidOptionError(
                    f"stops={self.stops} decreases; expected non-decreasing steps (the first "
                    "blocks stop first), e.g. stops=sorted(stops)."
                )

    def _plan(self, step: int) -> Plan:
        return Plan(depth=self.n - len(self.finished(step)))

    def finished(self, step: int) -> frozenset[int]:
        count_option("step", step, low=0)
        return frozenset(i for i, stop in enumerate(self.stops) if stop <= step)

    def _config(self) -> dict[str, Any]:
        return {"n": self.n, "stops": self.stops}


class GradualUnfreeze(Schedule):
    """Gradual unfreezing (ULMFiT, Lightning's BackboneFinetuning): the learning suffix grows.

    The depth is ``start``, then ``by`` more every ``every`` steps, up to all ``n`` blocks;
    with ``then_all=True`` the step after that has no cut at all (what runs before the
    blocks, such as the embeddings, learns too).

    >>> sched = GradualUnfreeze(3, every=2, start=0, then_all=True)
    >>> [sched.plan(step).depth for step in range(9)]
    [0, 0, 1, 1, 2, 2, 3, 3, None]
    """

    def __init__(
        self,
        n: int,
        *,
        every: int,
        start: int = 1,
        by: int = 1,
        then_all: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(n, seed=seed)
        self.every = count_option("every", every, low=1)
        self.start = count_option("start", start, low=0, high=self.n)
        self.by = count_option("by", by, low=1)
        if not isinstance(then_all, bool):
            raise InvalidOptionError(f"then_all={then_all!r}; expected True or False.")
        self.then_all = then_all

    def _plan(self, step: int) -> Plan:
        depth = self.start + (step // self.every) * self.by
        if depth > self.n and self.then_all:
            return Plan(depth=None)
        return Plan(depth=min(depth, self.n))

    def _config(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "every": self.every,
            "start": self.start,
            "by": self.by,
            "then_all": self.then_all,
        }


# The one list of schedules. The bench compares every one of them (or names it in its one
# exclusion, with the reason), the tests run each through the same checks and hold
# docs/schedules.md's table to it, and a test holds it to ``__all__``. Each entry builds the
# schedule for a model of ``n`` blocks trained for ``steps`` steps, drawing with ``seed``: a
# new schedule adds its line here.
_REGISTRY: dict[type[Schedule], Callable[[int, int, int], Schedule]] = {
    RandomDepth: lambda n, steps, seed: RandomDepth(n, seed=seed),
    LISA: lambda n, steps, seed: LISA(n, max(1, n // 3), every=max(1, steps // 2), seed=seed),
    BAdam: lambda n, steps, seed: BAdam(n, max(1, steps // n), seed=seed),
    DropBP: lambda n, steps, seed: DropBP(n, 0.5, seed=seed),
    FreezeOut: lambda n, steps, seed: FreezeOut(n, total_steps=steps, first=0.25, seed=seed),
    GradualUnfreeze: lambda n, steps, seed: GradualUnfreeze(n, every=max(1, steps // n), seed=seed),
    Importance: lambda n, steps, seed: Importance(range(n), budget=max(0.5, 1 / n), seed=seed),
}


def _spaced_stops(n: int, total: int, first: float, spacing: str) -> list[int]:
    stops = []
    for i in range(n):
        along = i / (n - 1) if n > 1 else 1.0
        if spacing == "linear":
            fraction = first + (1 - first) * along
        else:
            root = first ** (1 / 3)
            fraction = (root + (1 - root) * along) ** 3
        stops.append(round(fraction * total))
    return stops
