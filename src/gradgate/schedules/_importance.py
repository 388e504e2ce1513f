"""Importance: MISA-style sampling of modules by their recent gradient size, within a budget."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .._cut.gate import forward_count, gate_points, gated_model
from .._plumbing.errors import InvalidOptionError, NoBackwardWarning, warn
from .._plumbing.validate import (
    count_option,
    fraction_option,
    integer_option,
    probability_option,
)
from ._candidates import (
    candidates_option,
    check_budget,
    check_known,
    decay_option,
    norm,
    resolve,
    restored,
    same_model,
    temperature_option,
    tempered,
)
from ._plan import Gate, Plan, Schedule, require_gate


class Importance(Schedule):
    """Modules sampled per step, more often where the gradient is large (MISA, NeurIPS 2025).

    ``modules`` are the candidates: names or globs of modules (``"model.layers.*.mlp.*_proj"``,
    the list :func:`gradgate.choose.top` returns) or whole blocks, resolved on the gated model at
    the first :meth:`apply`. At each window of ``every`` steps a set is drawn: one candidate at a
    time, with probability ``floor / B + (1 - floor) * q`` (``B`` candidates, ``q`` in proportion
    to ``score ** (1 / temperature)``) among those that still fit, until none fits. So the
    parameters that learn at one step never exceed ``budget`` times the candidates' parameters,
    and each candidate is drawn with probability at least ``floor / B``. With a gate, only the
    drawn modules (and what runs after the last block, the head) learn; the backward starts at
    the earliest drawn module.

    The score of a module is an exponential moving average (weight ``decay`` on the past) of its
    gradient's root mean square, ``||g|| / sqrt(numel)``, read by :meth:`observe` after each
    backward from the modules that learned; a module not observed yet counts as the best one
    observed, so each is tried early. The trainer callbacks call :meth:`observe`; a window in
    which the gated model ran with no :meth:`observe` warns once (``NoBackwardWarning``). A draw
    depends on the seed, the window and the scores at the window's first :meth:`apply`; it is
    kept for the window, and :meth:`state_dict` saves scores, pick counts and the current
    draw, so a resumed run continues exactly.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4),
    ...                             torch.nn.Linear(4, 4)) for _ in range(4)])
    >>> gate = gg.BackpropGate(net)
    >>> sched = gg.schedules.Importance(["*.0", "*.1"], budget=0.25, seed=0)
    >>> plan = sched.apply(gate, 0)
    >>> len(plan.learn)  # 2 of the 8 equal candidates fit in a quarter of their parameters
    2
    >>> net(torch.randn(2, 4)).sum().backward()
    >>> sched.observe(net)
    >>> sorted(name for name, score in sched.scores.items() if score is not None) == sorted(
    ...     plan.learn)
    True
    >>> gate.remove()
    """

    def __init__(
        self,
        modules: Iterable[str | int] | str,
        budget: float = 0.25,
        temperature: float = 1.0,
        floor: float = 0.1,
        seed: int = 0,
        *,
        every: int = 1,
        decay: float = 0.9,
    ) -> None:
        # no Schedule.__init__: the block count comes from the gate, at the first apply
        self.modules = candidates_option(modules)
        self.budget = fraction_option(
            "budget", budget, meaning="the share of the candidates' parameters that learn"
        )
        self.temperature = temperature_option(temperature)
        self.floor = probability_option("floor", floor)
        self.seed = integer_option("seed", seed)
        self.every = count_option("every", every, low=1)
        self.decay = decay_option(decay)
        self.next_step = 0
        self.n = 0  # the gate's number of blocks, once bound
        self._model: nn.Module | None = None
        self._names: list[str] = []
        self._params: list[list[nn.Parameter]] = []
        self._sizes: list[int] = []
        self._positions: dict[str, int] = {}  # candidates that are blocks
        self._inside: frozenset[str] = frozenset()  # candidates inside blocks
        self._ema: dict[str, float | None] = {}
        self._seen: dict[str, int] = {}
        self._picks: dict[str, int] = {}
        self._window: int | None = None
        self._drawn: tuple[str, ...] = ()
        self._step: int | None = None
        self._undo: dict[str, tuple[float | None, int]] | None = None
        # a loop that forgets observe(): the gate's forward count at the window's start, and
        # whether observe() ran since (see _check_observed)
        self._window_forwards: int | None = None
        self._observed = False
        self._said_unobserved = False

    # -- what users read -----------------------------------------------------------------------
    @property
    def candidates(self) -> list[str]:
        """The candidates' module names, in model order (empty until the first apply)."""
        return list(self._names)

    @property
    def scores(self) -> dict[str, float | None]:
        """Each candidate's score: the EMA of its gradient's RMS, ``None`` until observed."""
        return dict(self._ema)

    @property
    def picks(self) -> dict[str, int]:
        """How many steps each candidate learned at (counted once per applied step)."""
        return dict(self._picks)

    @property
    def weights(self) -> dict[str, float]:
        """Each candidate's weight in the next draw: the probability that it is drawn first."""
        return dict(zip(self._names, self._weights(), strict=True))

    # -- the plan ------------------------------------------------------------------------------
    def apply(self, gate: Gate, step: int | None = None) -> Plan:
        """Draw (or keep, within a window) the modules that learn at ``step`` and set them on
        ``gate``; without ``step``, ``next_step``."""
        require_gate(gate, "Importance")
        self._bind(gate)
        step = self.next_step if step is None else count_option("step", step, low=0)
        window = step // self.every
        drawn = self._drawn if window == self._window else self._draw(window)
        plan = self._plan_of(drawn)
        plan.apply(gate)
        if window != self._window:
            self._check_observed(gate)
        if step != self._step:
            for name in drawn:
                self._picks[name] += 1
            self._undo = None
        self._window, self._drawn, self._step = window, drawn, step
        self.next_step = step + 1
        return plan

    def _check_observed(self, gate: Gate) -> None:
        """A window starts: warn (once) if the last one trained with no observe(), which
        leaves the scores where they were (``None`` at first: the draw stays uniform)."""
        forwards = forward_count(gate)  # the gated model's forwards so far
        trained = forwards is None or forwards != self._window_forwards
        last, self._window_forwards = self._window, forwards
        observed, self._observed = self._observed, False
        if last is None or observed or not trained or self._said_unobserved:
            return
        self._said_unobserved = True
        first = last * self.every
        span = f"step {first}" if self.every == 1 else f"the window of steps {first}-"
        span += "" if self.every == 1 else f"{first + self.every - 1}"
        effect = (
            "every score stays None and the draw is uniform"
            if all(score is None for score in self._ema.values())
            else "the scores stop following the gradients"
        )
        warn(
            f"{span} ran with no Importance.observe(): the schedule never read its gradients, "
            f"so {effect}. In a hand-written loop call sched.observe(model) after backward() "
            "and before zero_grad(), once per step; the trainer callbacks (GateCallback in "
            "gradgate.integrations.transformers and .lightning) call it. Said once.",
            NoBackwardWarning,
        )

    def _plan(self, step: int) -> Plan:
        """The applied window's draw; for another window the draw the scores give now."""
        return self._plan_of(self._drawn_for(step))

    def resting(self, step: int) -> frozenset[int]:
        """Candidate blocks not drawn for ``step`` (their optimizer state may go)."""
        step = count_option("step", step, low=0)
        if self._model is None:
            return frozenset()
        drawn = set(self._drawn_for(step))
        return frozenset(i for name, i in self._positions.items() if name not in drawn)

    def resting_modules(self, step: int) -> frozenset[str]:
        """Candidates inside blocks not drawn for ``step`` (their optimizer state may go)."""
        step = count_option("step", step, low=0)
        if self._model is None:
            return frozenset()
        return self._inside - set(self._drawn_for(step))

    def metrics(self, plan: Plan, n: int) -> dict[str, float]:
        """Modules learning, the share of the candidates' parameters they hold, and each
        candidate's score (once observed) and pick count."""
        learn = plan.learn or frozenset()
        by_position = {i: name for name, i in self._positions.items()}
        drawn = {item if isinstance(item, str) else by_position.get(item, "") for item in learn}
        used = sum(size for name, size in zip(self._names, self._sizes, strict=True)
                   if name in drawn)  # fmt: skip
        found: dict[str, float] = {
            "learning_modules": len(drawn),
            "budget_used": round(used / max(sum(self._sizes), 1), 6),
        }
        for name in self._names:
            score = self._ema.get(name)
            if score is not None:
                found[f"score/{name}"] = score
            found[f"picks/{name}"] = self._picks.get(name, 0)
        return found

    # -- the gradients -------------------------------------------------------------------------
    def observe(self, model: nn.Module) -> None:
        """Update the scores from the gradients of the modules that learned at this step.

        Call it after ``backward()`` and before ``zero_grad()`` (with gradient accumulation,
        once per optimizer step); a second call in the same step replaces the first.
        """
        if self._model is None or self._step is None:
            raise InvalidOptionError(
                "Importance.observe() was called before any apply(); expected "
                "sched.apply(gate, step) before the forward, then backward(), then observe(model)."
            )
        if not isinstance(model, nn.Module) or not same_model(model, self._model):
            raise InvalidOptionError(
                f"observe(model={type(model).__name__}): this schedule drives a gate on a "
                f"{type(self._model).__name__}, which that model neither is nor contains; "
                "pass the gated model."
            )
        self._observed = True
        for name, (score, seen) in (self._undo or {}).items():  # a second call replaces
            self._ema[name], self._seen[name] = score, seen
        self._undo = {}
        found = self._grad_rms(self._drawn)
        if not found:
            warn(
                f"Importance.observe() found no gradient on the {len(self._drawn)} modules "
                f"drawn for step {self._step} ({self._drawn[0]!r}, ...); call it after "
                "backward() and before zero_grad() (the trainer callbacks do).",
                NoBackwardWarning,
            )
            return
        for name, value in found.items():
            if not math.isfinite(value):
                continue  # an overflowing fp16 step must not poison the average
            old = self._ema[name]
            self._undo[name] = (old, self._seen[name])
            self._ema[name] = value if old is None else self.decay * old + (1 - self.decay) * value
            self._seen[name] += 1

    def _grad_rms(self, names: Iterable[str]) -> dict[str, float]:
        """``||g|| / sqrt(numel)`` of each named candidate with a gradient: one transfer per
        device, not one per module."""
        index = {name: i for i, name in enumerate(self._names)}
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        counts: dict[str, int] = {}
        for name in names:
            grads = [p.grad for p in self._params[index[name]] if p.grad is not None]
            if not grads:
                continue
            norms = [norm(g) for g in grads]
            squared = torch.stack([n.to(norms[0].device) for n in norms]).square().sum()
            counts[name] = sum(g.numel() for g in grads)
            by_device.setdefault(squared.device, []).append((name, squared))
        found = {}
        for items in by_device.values():
            values = torch.stack([t for _, t in items]).tolist()
            for (name, _), value in zip(items, values, strict=True):
                found[name] = math.sqrt(value / counts[name])
        return found

    # -- drawing -------------------------------------------------------------------------------
    def _drawn_for(self, step: int) -> tuple[str, ...]:
        if self._model is None:
            raise InvalidOptionError(
                f"{self!r} has not seen a gate yet: its candidates are resolved on the gated "
                "model; call sched.apply(gate, step) first."
            )
        window = step // self.every
        return self._drawn if window == self._window else self._draw(window)

    def _draw(self, window: int) -> tuple[str, ...]:
        """Candidates drawn one at a time by weight among those that still fit the budget."""
        rng = self._rng(window)
        weights = self._weights()
        capacity = self.budget * sum(self._sizes)
        used, chosen, left = 0, [], list(range(len(self._names)))
        while True:
            fitting = [i for i in left if used + self._sizes[i] <= capacity]
            total = math.fsum(weights[i] for i in fitting)
            if total <= 0:
                break
            point, pick = rng.random() * total, fitting[-1]
            for i in fitting:
                point -= weights[i]
                if point < 0:
                    pick = i
                    break
            chosen.append(pick)
            left.remove(pick)
            used += self._sizes[pick]
        return tuple(self._names[i] for i in sorted(chosen))

    def _weights(self) -> list[float]:
        scores = [self._ema.get(name) for name in self._names]
        observed = [s for s in scores if s is not None]
        best = max(observed) if observed else 1.0
        shares = tempered([best if s is None else s for s in scores], self.temperature)
        count = len(scores)
        return [self.floor / count + (1 - self.floor) * q for q in shares]

    def _plan_of(self, drawn: tuple[str, ...]) -> Plan:
        return Plan(learn=frozenset(self._positions.get(name, name) for name in drawn))

    # -- the model -----------------------------------------------------------------------------
    def _check_gate(self, gate: Gate) -> None:
        """Any number of blocks: the candidates are resolved on the gated model."""

    def _bind(self, gate: Any) -> None:
        model = gated_model(gate)
        if model is self._model:
            return
        points = gate_points(gate)
        names, params, positions, inside = resolve(model, points, self.modules)
        sizes = [sum(p.numel() for p in group) for group in params]
        check_budget(names, sizes, self.budget)
        check_known(set(names), self._ema, self._drawn)
        self._model, self.n = model, len(points)
        self._names, self._params, self._sizes = names, params, sizes
        self._positions, self._inside = positions, inside
        for name in names:
            self._ema.setdefault(name, None)
            self._seen.setdefault(name, 0)
            self._picks.setdefault(name, 0)

    # -- resuming ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The base keys, and the scores, observation and pick counts, and the current draw."""
        state = super().state_dict()
        state.update(
            scores=dict(self._ema),
            observations=dict(self._seen),
            picks=dict(self._picks),
            window=self._window,
            drawn=list(self._drawn),
            step=self._step,
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: scores, counts and the current window's draw included."""
        parts = restored(state)
        if self._model is not None:
            check_known(set(self._names), parts[0], parts[4])
        super().load_state_dict(state)
        scores, seen, picks, window, drawn, step = parts
        for name in self._names:
            scores.setdefault(name, None)
            seen.setdefault(name, 0)
            picks.setdefault(name, 0)
        self._ema, self._seen, self._picks = scores, seen, picks
        self._window, self._drawn, self._step, self._undo = window, drawn, step, None
        self._observed = True  # the count starts afresh with the resumed run

    def _config(self) -> dict[str, Any]:
        return {
            "modules": list(self.modules),
            "budget": self.budget,
            "temperature": self.temperature,
            "floor": self.floor,
            "every": self.every,
            "decay": self.decay,
        }

    def __repr__(self) -> str:
        return (
            f"Importance({list(self.modules)!r}, budget={self.budget}, "
            f"temperature={self.temperature}, floor={self.floor}, seed={self.seed}, "
            f"every={self.every}, decay={self.decay})"
        )
