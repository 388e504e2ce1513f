"""A schedule's plan for one step (a depth or a learning set, and a skip set), and the base
class of every schedule."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

from .._cut.gate import BackpropGate, gate_points, gated_model
from .._cut.stacks import outside_modules
from .._plumbing.errors import InvalidOptionError
from .._plumbing.validate import count_option, integer_option
from .._select.names import resolve_modules


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
        require_gate(gate, "Plan", "plan.apply(gate)")
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


class Schedule:
    """Base of every schedule: a plan per step, seeded, resumable.

    Subclasses implement ``_plan(step)`` and ``_config()``; ``finished(step)`` says which blocks
    will never learn again from ``step`` on (their optimizer state can go, see
    :func:`gradgate.optim.drop_finished`). A schedule that learns from the gradients
    (:class:`gradgate.schedules.Importance`) reads them in :meth:`observe`, which the trainer
    callbacks call after each backward; the others ignore it.
    """

    def __init__(self, n: int, *, seed: int = 0) -> None:
        self.n = count_option("n", n, low=1)
        self.seed = integer_option("seed", seed)
        self.next_step = 0

    # -- the plan ------------------------------------------------------------------------------
    def plan(self, step: int) -> Plan:
        """The plan for ``step`` (a pure function of the configuration, the seed and ``step``)."""
        return self._plan(count_option("step", step, low=0))

    def apply(self, gate: Gate, step: int | None = None) -> Plan:
        """Set the plan for ``step`` on ``gate`` and return it.

        Without ``step`` the schedule counts itself: ``next_step`` (saved by
        :meth:`state_dict`), then one more on each call.
        """
        require_gate(gate, type(self).__name__)
        self._check_gate(gate)
        self._bind(gate)
        step = self.next_step if step is None else step
        plan = self.plan(step)
        plan.apply(gate)
        self.next_step = step + 1
        return plan

    def observe(self, model: nn.Module) -> None:
        """Read the gradients of the step that just ran (after backward, before the optimizer
        step and ``zero_grad``); schedules that draw by gradient use them, the others ignore it."""

    def metrics(self, plan: Plan, n: int) -> dict[str, float]:
        """Numbers to log for ``plan`` on a gate of ``n`` blocks (see :meth:`Plan.metrics`)."""
        return plan.metrics(n)

    def finished(self, step: int) -> frozenset[int]:
        """Blocks that learn at no step ``>= step`` (none, unless the schedule says so)."""
        count_option("step", step, low=0)
        return frozenset()

    def resting(self, step: int) -> frozenset[int]:
        """Blocks whose optimizer state goes before ``step``: the finished ones here; LISA also
        lets the blocks it did not draw for ``step`` start afresh when drawn again."""
        return self.finished(step)

    def resting_modules(self, step: int) -> frozenset[str]:
        """Names of modules inside blocks whose optimizer state goes before ``step`` (none here;
        Importance: the candidates it did not draw for ``step``)."""
        count_option("step", step, low=0)
        return frozenset()

    # -- resuming ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue the same sequence."""
        return {
            "schedule": type(self).__name__,
            "config": self._config(),
            "seed": self.seed,
            "next_step": self.next_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the schedule must be built with the same configuration."""
        keys = ("schedule", "config", "seed", "next_step")
        missing = [k for k in keys if k not in state] if isinstance(state, dict) else list(keys)
        if missing:
            raise InvalidOptionError(
                f"state={state!r:.80} lacks {missing}; expected the dict that "
                f"{type(self).__name__}.state_dict() returned."
            )
        expected = {"schedule": type(self).__name__, "config": self._config()}
        for key, value in expected.items():
            if state.get(key) != value:
                raise InvalidOptionError(
                    f"the state's {key} is {state.get(key)!r} but this {type(self).__name__} "
                    f"has {value!r}; build the schedule with the same arguments as the run "
                    "that saved the state."
                )
        seed = integer_option("seed", state["seed"])
        self.next_step = count_option("next_step", state["next_step"], low=0)
        self.seed = seed

    # -- for subclasses ------------------------------------------------------------------------
    def _plan(self, step: int) -> Plan:
        raise NotImplementedError

    def _check_gate(self, gate: Gate) -> None:
        """Refuse a gate with another number of blocks than the schedule plans over."""
        blocks = len(gate.blocks)
        if blocks != self.n:
            raise InvalidOptionError(
                f"{self!r} plans over {self.n} blocks but the gate has {blocks}; build the "
                f"schedule with n={blocks} (len(gate.blocks))."
            )

    def _bind(self, gate: Any) -> None:
        """Look up what depends on the gated model (LISA: ``always`` names that are blocks)."""

    def _config(self) -> dict[str, Any]:
        return {"n": self.n}

    def _rng(self, *key: int) -> random.Random:
        """A generator that depends only on the schedule, its seed and ``key`` (no global RNG)."""
        text = ":".join(str(k) for k in (type(self).__name__, self.seed, *key))
        return random.Random(text)  # str seeds hash with SHA-512: stable across processes

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items() if k != "n")
        return f"{type(self).__name__}({self.n}{', ' if args else ''}{args}, seed={self.seed})"


Schedule.__module__ = "gradgate.schedules"  # documented as gg.schedules.Schedule


def require_gate(gate: object, owner: str, call: str = "sched.apply(gate, step)") -> None:
    """Refuse what is not a :class:`gradgate.BackpropGate` (the model itself, most often)
    before anything reads it or counts a step."""
    if isinstance(gate, BackpropGate):
        return
    text = repr(gate)
    shown = text if "\n" not in text and len(text) <= 60 else f"a {type(gate).__name__}"
    raise InvalidOptionError(
        f"{owner}.apply(gate={shown}): expected the gradgate.BackpropGate that drives the "
        f"model; pass the gate: gate = gg.BackpropGate(model), then {call}."
    )


def around_blocks(gate: Any) -> frozenset[str]:
    """Names of the modules with parameters around a gate's blocks (embeddings, final norms,
    heads): what LISA trains at every step besides its drawn blocks."""
    model = gated_model(gate)
    names = {id(module): name for name, module in model.named_modules()}
    return frozenset(
        names[id(module)]
        for module in outside_modules(model, gate_points(gate))
        if id(module) in names and any(True for _ in module.parameters())
    )


def sorted_items(items: Iterable[int | str]) -> list[int | str]:
    return sorted(items, key=lambda v: (isinstance(v, str), v))  # type: ignore[return-value]


def always_as_positions(
    always: Iterable[int | str], model: nn.Module, points: list[tuple[str, nn.Module]]
) -> set[int | str]:
    """``always`` with the names that resolve to blocks of ``points`` as those positions (no
    draw is spent on them and their state is never dropped); other names stay names."""
    by_id = {id(m): i for i, (_, m) in enumerate(points)}
    positions: set[int | str] = set()
    for item in always:
        found = resolve_modules(model, [item]) if isinstance(item, str) else []
        if found and all(id(m) in by_id for _, m in found):
            positions.update(by_id[id(m)] for _, m in found)
        else:
            positions.add(item)
    return positions
