"""Learning-rate schedulers that follow the parameter groups added to their optimizer mid-run.

torch's schedulers keep a list per group (``base_lrs``, ``LambdaLR``'s ``lr_lambdas``,
``ReduceLROnPlateau``'s ``min_lrs``) and ``OneCycleLR`` keeps keys in each group (``max_lr``,
``min_lr``); a group added after the scheduler was built is missing from them, so the scheduler
skips it, or fails on it (OneCycleLR, ReduceLROnPlateau with a list of ``min_lr``). Here each
list grows by the new group, whose base rate is the rate it was added with, and the group's rate
is set to what the schedule gives at the current step, as if it had been there from the start
(what Lightning's fine-tuning scheduler does at a phase change). A scheduler of another kind
is refused before anything changes.
"""

from __future__ import annotations

import bisect
import math
import warnings
from typing import Any

import torch
from torch.optim import lr_scheduler as schedulers

from .._plumbing.errors import InvalidOptionError
from .._plumbing.torch_internals.schedulers import sequential_parts

# what each kind's rate is at step t for base rate b (the chainable kinds compute the next rate
# from the current one, so a new group starts from this value and then follows them)
_CLOSED = {
    schedulers.StepLR: lambda s, b, t: b * s.gamma ** (t // s.step_size),
    schedulers.MultiStepLR: lambda s, b, t: (
        b * s.gamma ** bisect.bisect_right(sorted(s.milestones.elements()), t)
    ),
    schedulers.ConstantLR: lambda s, b, t: b * (s.factor if t < s.total_iters else 1.0),
    schedulers.LinearLR: lambda s, b, t: (
        b
        * (s.start_factor + (s.end_factor - s.start_factor) * min(s.total_iters, t) / s.total_iters)
    ),
    schedulers.ExponentialLR: lambda s, b, t: b * s.gamma**t,
    schedulers.PolynomialLR: lambda s, b, t: (
        b * (1.0 - min(s.total_iters, t) / s.total_iters) ** s.power
    ),
    schedulers.CosineAnnealingLR: lambda s, b, t: (
        s.eta_min + (b - s.eta_min) * (1 + math.cos(math.pi * t / s.T_max)) / 2
    ),
    schedulers.CosineAnnealingWarmRestarts: lambda s, b, t: (
        s.eta_min + (b - s.eta_min) * (1 + math.cos(math.pi * s.T_cur / s.T_i)) / 2
    ),
    schedulers.LambdaLR: lambda s, b, t: b * s.lr_lambdas[-1](t),
    schedulers.MultiplicativeLR: lambda s, b, t: (
        b * math.prod(s.lr_lambdas[-1](k) for k in range(1, t + 1))
    ),
}
_KINDS = (*_CLOSED, schedulers.OneCycleLR, schedulers.SequentialLR, schedulers.ReduceLROnPlateau)
_FIX = (
    "build the scheduler after adding the groups (for a scheduler that resumes mid-run: pass "
    "last_epoch=<the current step>), or leave scheduler= out"
)


def schedulers_option(scheduler: object, optimizer: torch.optim.Optimizer) -> list[Any]:
    """``scheduler=``: ``None``, one torch LR scheduler of ``optimizer`` or several; each must
    be of a kind that can take a new group, else it is refused here, before any change."""
    if scheduler is None:
        return []
    found = list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]
    for item in found:
        refusal = _refusal(item, optimizer)
        if refusal:
            raise InvalidOptionError(f"scheduler={_shown(item)} {refusal}; {_FIX}.")
    return found


def _refusal(scheduler: object, optimizer: torch.optim.Optimizer) -> str:
    kind = type(scheduler)
    if kind not in _KINDS:  # a subclass may compute its rates otherwise
        known = ", ".join(k.__name__ for k in _KINDS)
        return f"is a {kind.__name__}, which gradgate cannot extend by a group (it can: {known})"
    if getattr(scheduler, "optimizer", None) is not optimizer:
        return "schedules another optimizer; expected a scheduler of the optimizer given"
    lambdas = getattr(scheduler, "lr_lambdas", [])  # LambdaLR, MultiplicativeLR
    if len({id(f) for f in lambdas}) > 1:
        return "has one lr_lambda per group, so none of them is the new group's"
    if isinstance(scheduler, schedulers.SequentialLR):
        parts = sequential_parts(scheduler)
        if parts is None:
            return "keeps its schedulers where this torch does not show them"
        for child in parts[0]:
            reason = _refusal(child, optimizer)
            if reason:
                return f"holds a scheduler that {reason}"
    return ""


def follow_groups(
    schedulers_: list[Any],
    groups: list[dict[str, Any]],
    *,
    like: list[dict[str, Any] | None] | None = None,
) -> None:
    """Extend each scheduler by each new group (the optimizer's last ones, in order) and set
    the group's rate to the schedule's at the current step. A group made ``like`` another (its
    options copied: ``unfreeze``) takes that group's place in the schedule: its entries, its
    rate."""
    for group, sibling in zip(groups, like or [None] * len(groups), strict=True):
        if sibling is not None:
            for scheduler in schedulers_:
                _copy(scheduler, _index(scheduler.optimizer, sibling))
            continue
        base = group.get("initial_lr", group["lr"])
        if isinstance(base, torch.Tensor):
            base = base.clone()
        for scheduler in schedulers_:
            base = _extend(scheduler, group, base)
        group["initial_lr"] = base


def forget_groups(schedulers_: list[Any], indices: list[int]) -> None:
    """Take the entries of the groups at ``indices`` out of each scheduler's lists (before the
    groups leave the optimizer: a handle's undo)."""
    for scheduler in schedulers_:
        for index in sorted(indices, reverse=True):
            _forget(scheduler, index)


def _extend(scheduler: Any, group: dict[str, Any], base: Any) -> Any:
    """One scheduler takes one new group; returns its base rate (OneCycleLR: from max_lr)."""
    if isinstance(scheduler, schedulers.ReduceLROnPlateau):
        reference = scheduler.optimizer.param_groups[0]
        start = reference.get("initial_lr", scheduler.optimizer.defaults.get("lr"))
        ratio = float(reference["lr"]) / float(start) if start else 1.0
        if len(scheduler.min_lrs) < len(scheduler.optimizer.param_groups):
            scheduler.min_lrs.append(scheduler.min_lrs[0])
        group["lr"] = max(base * ratio, scheduler.min_lrs[-1])
        return base
    if isinstance(scheduler, schedulers.SequentialLR):
        children, milestones = sequential_parts(scheduler) or ([], [])
        for child in children:
            _grow(child, group, base)
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs.append(base)
        active = children[bisect.bisect_right(milestones, scheduler.last_epoch)]
        group["lr"] = _rate(active, group, base)
        return base
    base = _grow(scheduler, group, base)
    group["lr"] = _rate(scheduler, group, base)
    return base


def _grow(scheduler: Any, group: dict[str, Any], base: Any) -> Any:
    if isinstance(scheduler, (schedulers.LambdaLR, schedulers.MultiplicativeLR)):
        scheduler.lr_lambdas.append(scheduler.lr_lambdas[0])
    if isinstance(scheduler, schedulers.OneCycleLR):
        reference = scheduler.optimizer.param_groups[0]
        ratio = float(reference["max_lr"]) / float(reference["initial_lr"])
        if "max_lr" in group:  # given with the group: its peak; its base follows
            base = group["max_lr"] / ratio
        group["max_lr"] = base * ratio
        group["min_lr"] = base * float(reference["min_lr"]) / float(reference["initial_lr"])
        if scheduler.cycle_momentum:
            group.setdefault("max_momentum", reference["max_momentum"])
            group.setdefault("base_momentum", reference["base_momentum"])
        group["initial_lr"] = base
    scheduler.base_lrs.append(base)
    return base


def _rate(scheduler: Any, group: dict[str, Any], base: Any) -> Any:
    """The schedule's rate for the new group (the optimizer's last) at the current step."""
    closed = _CLOSED.get(type(scheduler))
    if closed is not None:
        return closed(scheduler, base, scheduler.last_epoch)
    with warnings.catch_warnings():  # OneCycleLR: get_lr() outside step() says so
        warnings.simplefilter("ignore", UserWarning)
        return scheduler.get_lr()[-1]


def _index(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    return next(i for i, g in enumerate(optimizer.param_groups) if g is group)


def _copy(scheduler: Any, index: int) -> None:
    """Give the optimizer's new last group the entries of group ``index``."""
    for child in (sequential_parts(scheduler) or ([], []))[0]:
        _copy(child, index)
    for name in ("base_lrs", "lr_lambdas", "min_lrs"):
        values = getattr(scheduler, name, None)
        if isinstance(values, list) and index < len(values):
            values.append(values[index])


def _forget(scheduler: Any, index: int) -> None:
    for child in (sequential_parts(scheduler) or ([], []))[0]:
        _forget(child, index)
    for name in ("base_lrs", "lr_lambdas", "min_lrs"):
        values = getattr(scheduler, name, None)
        if isinstance(values, list) and index < len(values):
            del values[index]


def _shown(value: object) -> str:
    text = repr(value)
    return text if "\n" not in text and len(text) <= 60 else f"a {type(value).__name__}"
