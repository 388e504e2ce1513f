"""LR schedulers follow a param group added mid-run (``gg.optim.add_missing(scheduler=)`` and
``gg.unfreeze(optimizer=, scheduler=)``): at every later step the new group's rate equals what
the same scheduler gives a group that was there from the start with the same base rate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as lrs

import gradgate as gg

# torch 2.6's own SequentialLR.step() calls step(0) on a scheduler at each milestone, which warns
# that the epoch argument is deprecated (its code, not the test's nor gradgate's; 2.13 and 2.15
# do not)
pytestmark = pytest.mark.filterwarnings(
    r"ignore:The epoch parameter in `scheduler.step\(\)` was not necessary:UserWarning"
)

LR, NEW = 0.1, 0.02  # the first group's rate, the added group's
STEPS = 14
Factory = Callable[[torch.optim.Optimizer, list[float]], Any]  # (optimizer, base rates)


def _shared(t: int) -> float:
    return 0.9**t


SCHEDULERS: dict[str, Factory] = {
    "LambdaLR": lambda opt, rates: lrs.LambdaLR(opt, _shared),
    "StepLR": lambda opt, rates: lrs.StepLR(opt, step_size=3, gamma=0.5),
    "CosineAnnealingLR": lambda opt, rates: lrs.CosineAnnealingLR(opt, T_max=10, eta_min=0.001),
    "OneCycleLR": lambda opt, rates: lrs.OneCycleLR(
        opt, max_lr=[r * 25 for r in rates], total_steps=STEPS + 1
    ),
    "LinearLR": lambda opt, rates: lrs.LinearLR(opt, start_factor=0.2, total_iters=6),
    "SequentialLR": lambda opt, rates: lrs.SequentialLR(
        opt,
        [lrs.LinearLR(opt, start_factor=0.1, total_iters=4), lrs.CosineAnnealingLR(opt, T_max=8)],
        milestones=[4],
    ),
    "ReduceLROnPlateau": lambda opt, rates: lrs.ReduceLROnPlateau(opt, factor=0.5, patience=1),
    # and a few more kinds, for the same price
    "MultiStepLR": lambda opt, rates: lrs.MultiStepLR(opt, milestones=[2, 5, 9], gamma=0.3),
    "ExponentialLR": lambda opt, rates: lrs.ExponentialLR(opt, gamma=0.8),
    "MultiplicativeLR": lambda opt, rates: lrs.MultiplicativeLR(opt, lambda t: 0.95),
    "PolynomialLR": lambda opt, rates: lrs.PolynomialLR(opt, total_iters=8, power=2.0),
    "ConstantLR": lambda opt, rates: lrs.ConstantLR(opt, factor=0.5, total_iters=5),
    "CosineAnnealingWarmRestarts": lambda opt, rates: lrs.CosineAnnealingWarmRestarts(opt, T_0=4),
}


def _step(optimizer: torch.optim.Optimizer, scheduler: Any, loss: float) -> None:
    optimizer.step()
    if isinstance(scheduler, lrs.ReduceLROnPlateau):
        scheduler.step(loss)  # a loss that stops improving: the rate halves every few steps
    else:
        scheduler.step()


def _rates(factory: Factory, added_at: int, *, unfreeze: bool) -> list[tuple[float, float]]:
    """Per step from ``added_at`` on: (the added group's rate, the rate of a group that was
    there from the start with the same base rate). ``unfreeze``: added by gg.unfreeze, with its
    sibling's options (base rate LR), and taken out again at the end."""
    new = LR if unfreeze else NEW
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with_both = torch.optim.AdamW(
        [{"params": net[0].parameters()}, {"params": net[1].parameters(), "lr": new}], lr=LR
    )
    reference = factory(with_both, [LR, new])
    frozen = gg.freeze(net, "1") if unfreeze else None
    optimizer = torch.optim.AdamW(net[0].parameters(), lr=LR)
    scheduler = factory(optimizer, [LR])
    found, back = [], None
    for step in range(STEPS):
        if step == added_at and unfreeze:
            back = gg.unfreeze(net, "1", optimizer=optimizer, scheduler=scheduler)
        elif step == added_at:
            gg.optim.add_missing(optimizer, net, scheduler=scheduler, lr=NEW)
        if step >= added_at:
            assert optimizer.param_groups[0]["lr"] == pytest.approx(with_both.param_groups[0]["lr"])
            found.append((optimizer.param_groups[1]["lr"], with_both.param_groups[1]["lr"]))
        loss = 1.0 if step > 2 else 3.0 - step
        _step(optimizer, scheduler, loss)
        _step(with_both, reference, loss)
    if back is not None and frozen is not None:
        back.undo()  # the group goes, and the scheduler forgets it: it steps on as before
        assert len(optimizer.param_groups) == 1
        assert len(getattr(scheduler, "base_lrs", [0])) == 1
        assert len(getattr(scheduler, "lr_lambdas", [0])) == 1
        _step(optimizer, scheduler, 1.0)
        frozen.undo()
    return found


@pytest.mark.parametrize("added_at", [3, 7])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_a_group_added_mid_run_follows_the_schedule(name: str, added_at: int) -> None:
    rates = _rates(SCHEDULERS[name], added_at, unfreeze=False)
    assert len(rates) == STEPS - added_at
    for got, expected in rates:
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12), (name, rates)
    if added_at == 3:  # it still moves then (at 7 some have ended their ramp)
        assert len({round(e, 12) for _, e in rates}) > 1


@pytest.mark.parametrize("name", ["OneCycleLR", "SequentialLR", "ReduceLROnPlateau", "LambdaLR"])
def test_unfreeze_with_a_scheduler_follows_and_its_undo_forgets(name: str) -> None:
    for got, expected in _rates(SCHEDULERS[name], 5, unfreeze=True):
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12), name


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda opt: lrs.CyclicLR(opt, base_lr=0.01, max_lr=0.1),
            r"scheduler=.*CyclicLR.* is a CyclicLR, which gradgate cannot extend by a group "
            r"\(it can: StepLR, .*ReduceLROnPlateau\); build the scheduler after adding the "
            r"groups \(for a scheduler that resumes mid-run: pass last_epoch=<the current "
            r"step>\), or leave scheduler= out\.",
        ),
        (
            lambda opt: lrs.ChainedScheduler([lrs.StepLR(opt, 2), lrs.ExponentialLR(opt, 0.9)]),
            "is a ChainedScheduler, which gradgate cannot extend",
        ),
        (
            lambda opt: lrs.LambdaLR(opt, [lambda t: 1.0, lambda t: 0.5]),
            "has one lr_lambda per group, so none of them is the new group's",
        ),
        (
            lambda opt: lrs.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1), 2),
            "schedules another optimizer; expected a scheduler of the optimizer given",
        ),
        (
            lambda opt: type("MyLR", (lrs.StepLR,), {})(opt, 2),
            "is a MyLR, which gradgate cannot extend",
        ),
        (
            lambda opt: lrs.SequentialLR(
                opt, [lrs.StepLR(opt, 2), lrs.CyclicLR(opt, 0.01, 0.1)], milestones=[3]
            ),
            "SequentialLR holds a scheduler that is a CyclicLR, which gradgate cannot",
        ),
    ],
)
def test_a_scheduler_that_cannot_follow_is_refused_before_any_change(build, message) -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = torch.optim.SGD(
        [{"params": net[0].parameters()}, {"params": net[1].parameters()}], lr=LR, momentum=0.9
    )
    scheduler = build(optimizer)
    before = [dict(g) for g in optimizer.param_groups]
    with pytest.raises(gg.InvalidOptionError, match=message):
        gg.optim.add_missing(optimizer, net, scheduler=scheduler, lr=NEW)
    handle = gg.freeze(net, "2")
    with pytest.raises(gg.InvalidOptionError, match=message):
        gg.unfreeze(net, "2", optimizer=optimizer, scheduler=scheduler)
    assert [dict(g) for g in optimizer.param_groups] == before  # nothing half-applied
    assert not net[2].weight.requires_grad
    handle.undo()


def test_unfreeze_with_a_scheduler_needs_the_optimizer() -> None:
    net = nn.Sequential(nn.Linear(2, 2))
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    with pytest.raises(gg.InvalidOptionError, match=r"without optimizer=; expected both"):
        gg.unfreeze(net, "0", scheduler=lrs.StepLR(optimizer, 2))
