"""LearnerMasters follows whatever learns: depth plans, learning sets, LISA, DropBP skips,
gradient accumulation across plans, the stale-gradient guard; each bit for bit against the
hand-written reference, with resting parameters unchanged at every step."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_masters import OPTS, N, Reference, assert_same_params, badam_run, batches, loss_of, make
from test_masters import same as same_bits

import gradgate as gg

Planner = Callable[[gg.BackpropGate, int, int], object]  # (gate, step, micro-batch)


def run_pair(plan: Planner, steps: int, *, accumulate: int = 1, offload=None, after=None):
    """The same plans on LearnerMasters and on the reference; compared after every step."""
    ours, twin = make(), make()
    gates = [gg.BackpropGate(m, "blocks.*") for m in (ours, twin)]
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, ours.parameters(), offload=offload, **OPTS)
    ref = Reference(twin, keep=offload == "cpu")
    data = batches(steps * accumulate)
    resting = []
    for t in range(steps):
        for micro in range(accumulate):
            x, y = data[t * accumulate + micro]
            for model, gate in zip((ours, twin), gates, strict=True):
                plan(gate, t, micro)
                loss_of(model, x, y).backward()
        before = {n: p.detach().clone() for n, p in ours.named_parameters() if p.grad is None}
        resting.append(frozenset(before))
        opt.step()
        opt.zero_grad()
        ref.step()
        if after is not None:
            after(opt, gates[0], t)
        assert_same_params(ours, twin, f"step {t}")
        for name, p in ours.named_parameters():
            assert name not in before or same_bits(before[name], p), f"step {t}: {name} moved"
    for gate in gates:
        gate.remove()
    return opt, ours, resting


def scheduled(sched: gg.schedules.Schedule) -> Planner:
    def plan(gate: gg.BackpropGate, step: int, micro: int) -> None:
        sched.apply(gate, step)

    return plan


def test_depth_plans() -> None:
    _, _, resting = run_pair(scheduled(gg.schedules.RandomDepth(N, low=0, high=N, seed=2)), 10)
    assert len({len(names) for names in resting}) > 2  # the depth changed what learned


def test_learning_sets_of_blocks_and_modules() -> None:
    sets = [{0, 2}, {1}, {3, "embed"}, {0, 1, 2, 3}, {2}, {"blocks.1.fc2"}]

    def plan(gate: gg.BackpropGate, step: int, micro: int) -> None:
        gate.learn = sets[step]

    run_pair(plan, len(sets))


def test_lisa_with_drop_finished() -> None:
    sched = gg.schedules.LISA(N, k=2, every=2, seed=1)

    def drop(opt, gate, step):
        gg.optim.drop_finished(opt, gate, sched, step + 1)

    opt, model, _ = run_pair(scheduled(sched), 8, after=drop)
    for i in sched.resting(8):  # dropped before step 8: only the blocks drawn for it are held
        assert not set(model.blocks[i].parameters()) & set(opt.state), i
    assert sched.resting(8)


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_dropbp_skips(offload) -> None:
    sched = gg.schedules.DropBP(N, rate=0.5, seed=4)
    run_pair(scheduled(sched), 10, offload=offload)
    assert any(sched.plan(t).skip for t in range(10))


def test_gradient_accumulation_across_plans_steps_the_union() -> None:
    depths = [(1, 3), (0, 2), (4, 1), (2, 2)]  # a different depth per micro-batch

    def plan(gate: gg.BackpropGate, step: int, micro: int) -> None:
        gate.depth = depths[step][micro]

    opt, model, _ = run_pair(plan, len(depths), accumulate=2)
    assert model.blocks[1].fc1.weight not in opt.state  # depth 2 at the last step: blocks 2, 3
    assert "master" in opt.state[model.blocks[2].fc1.weight]


@pytest.mark.parametrize("freeze", [False, True])
def test_zero_grad_set_to_none_false_gives_no_masters_to_what_did_not_learn(freeze) -> None:
    """The gate's stale-gradient guard drops the zero .grad of a block that did not learn before
    LearnerMasters looks for learners: the run is the one with set_to_none=True."""
    model = make()
    handle = gg.freeze(model, "embed") if freeze else None
    gate = gg.BackpropGate(model, "blocks.*")
    sched = gg.schedules.BAdam(N, 2, order="random", seed=3)
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, model.parameters(), **OPTS)
    for t, (x, y) in enumerate(batches(12)):
        sched.apply(gate, t)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        active = [*model.blocks[sched.active(t)].parameters(), *model.head.parameters()]
        assert opt.master_bytes() == sum(12 * p.numel() + 4 for p in active), t
    expected, _ = badam_run("random", 12, 2, drop=False)
    assert_same_params(model, expected)
    gate.remove()
    if handle is not None:
        handle.remove()


def test_importance_sampled_modules() -> None:
    """MISA-style sampling of modules inside blocks (the schedule observes the gradients)."""
    if not hasattr(gg.schedules, "Importance"):
        pytest.skip("gg.schedules.Importance is not there yet")
    sched = gg.schedules.Importance("blocks.*.fc*", budget=0.3, seed=1)
    twin_sched = gg.schedules.Importance("blocks.*.fc*", budget=0.3, seed=1)
    schedules = iter([sched, twin_sched] * 8)  # run_pair plans ours, then the reference

    def plan(gate: gg.BackpropGate, step: int, micro: int) -> None:
        next(schedules).apply(gate, step)

    # no observe(): the draws need not follow the gradients here, and each schedule says so once
    with pytest.warns(gg.NoBackwardWarning, match=r"ran with no Importance.observe\(\)") as said:
        _, _, resting = run_pair(plan, 8)
    assert len(said) == 2
    assert len(set(resting)) > 2  # modules, not whole blocks, came and went
