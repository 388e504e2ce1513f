"""gg.schedules.Importance: MISA-style module sampling within a budget, exact with the gate."""

from __future__ import annotations

import copy
import itertools
import json
import math
import warnings
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import llama
from torch import nn

import gradgate as gg

Importance = gg.schedules.Importance


def chain(widths: list[int]) -> nn.Module:
    """Blocks of one Linear each, of the given widths (sizes differ per block)."""
    return nn.Sequential(*[nn.Linear(a, b) for a, b in itertools.pairwise(widths)])


def pairs(n: int = 4, width: int = 4) -> nn.Module:
    """``n`` blocks of two equal Linear layers each: 2n equal candidates '*.0', '*.1'."""
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
          for _ in range(n)]
    )  # fmt: skip


def with_scores(sched: Importance, scores: dict[str, float | None]) -> None:
    """Set the scores through the public resume path."""
    state = sched.state_dict()
    state["scores"] = {**state["scores"], **scores}
    sched.load_state_dict(state)


def drawn_names(sched: Importance, plan: gg.schedules.Plan) -> set[str]:
    by_position = {i: n for i, n in enumerate(sched.candidates)} if sched._positions else {}
    return {by_position.get(item, item) for item in plan.learn}


# -- the budget and the floor --------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    widths=st.lists(st.integers(1, 9), min_size=3, max_size=8),
    budget=st.floats(0.05, 1.0),
    scores=st.lists(st.floats(0.0, 1e3), min_size=7, max_size=7),
    floor=st.floats(0.0, 1.0),
    temperature=st.floats(0.1, 10.0),
    seed=st.integers(0, 10**6),
)
def test_learning_parameters_never_exceed_the_budget(
    widths, budget, scores, floor, temperature, seed
) -> None:
    net = chain(widths)
    sizes = [sum(p.numel() for p in block.parameters()) for block in net]
    gate = gg.BackpropGate(net)
    if max(sizes) > budget * sum(sizes):
        with pytest.raises(gg.InvalidOptionError, match=r"expected a budget that fits every"):
            Importance([str(i) for i in range(len(net))], budget).apply(gate, 0)
        gate.remove()
        return
    sched = Importance([str(i) for i in range(len(net))], budget, temperature, floor, seed)
    sched.apply(gate, 0)
    with_scores(sched, {str(i): s for i, s in enumerate(scores[: len(net)])})
    for step in range(1, 30):
        plan = sched.apply(gate, step)
        assert plan.learn and all(isinstance(i, int) for i in plan.learn)  # blocks: positions
        used = sum(sizes[i] for i in plan.learn)
        assert used <= budget * sum(sizes)
        # nothing left out that would still fit: the budget is filled greedily
        assert all(used + sizes[i] > budget * sum(sizes) or i in plan.learn
                   for i in range(len(sizes)) if sched.weights[str(i)] > 0)  # fmt: skip
    gate.remove()


def test_each_candidate_is_drawn_at_least_at_the_floor_rate() -> None:
    net = pairs(4)
    gate = gg.BackpropGate(net)
    sched = Importance(["*.0", "*.2"], budget=0.25, floor=0.2, seed=1)
    sched.apply(gate, 0)
    names = sched.candidates
    assert len(names) == 8
    scores = {name: 1e6 for name in names}
    scores[names[3]] = 1e-9  # almost no gradient: only the floor keeps it drawn
    with_scores(sched, scores)
    weights = sched.weights
    assert weights[names[3]] == pytest.approx(0.2 / 8, rel=1e-6)
    assert math.fsum(weights.values()) == pytest.approx(1.0)
    counts = Counter(name for w in range(4000) for name in drawn_names(sched, sched.plan(w)))
    # two of eight fit: the first draw alone includes names[3] with probability 0.025
    assert counts[names[3]] / 4000 >= 0.025 * 0.75
    assert counts[names[0]] / 4000 > 0.25
    gate.remove()


def test_with_one_module_per_step_the_frequencies_are_the_weights() -> None:
    net = pairs(3)
    gate = gg.BackpropGate(net)
    sched = Importance(["*.0", "*.2"], budget=1 / 6, temperature=0.5, floor=0.3, seed=2)
    sched.apply(gate, 0)
    raw = [1.0, 2.0, 3.0, 4.0, 0.0, 5.0]
    with_scores(sched, dict(zip(sched.candidates, raw, strict=True)))
    tempered = [s**2 for s in raw]  # score ** (1 / temperature)
    expected = [0.3 / 6 + 0.7 * t / sum(tempered) for t in tempered]
    assert list(sched.weights.values()) == pytest.approx(expected)
    draws = 6000
    counts = Counter(n for w in range(draws) for n in drawn_names(sched, sched.plan(w)))
    for name, p in zip(sched.candidates, expected, strict=True):
        assert abs(counts[name] / draws - p) < 4 * math.sqrt(p * (1 - p) / draws), name
    gate.remove()


def test_floor_one_or_equal_scores_draw_uniformly_and_unobserved_counts_as_the_best() -> None:
    net = pairs(2)
    gate = gg.BackpropGate(net)
    sched = Importance(["*.0", "*.2"], floor=1.0)
    sched.apply(gate, 0)
    with_scores(sched, dict(zip(sched.candidates, [1.0, 100.0, 3.0, 4.0], strict=True)))
    assert list(sched.weights.values()) == [0.25] * 4
    greedy = Importance(["*.0", "*.2"], floor=0.0)
    greedy.apply(gate, 0)
    assert list(greedy.weights.values()) == [0.25] * 4  # nothing observed yet
    with_scores(greedy, dict(zip(greedy.candidates, [2.0, None, 1.0, 0.0], strict=True)))
    assert list(greedy.weights.values()) == pytest.approx([0.4, 0.4, 0.2, 0.0])
    gate.remove()


# -- seeded and resumable --------------------------------------------------------------------
def run(sched: Importance, net: nn.Module, steps: range, gate=None) -> list:
    gate = gate or gg.BackpropGate(net)
    torch.manual_seed(1)
    seen = []
    for step in steps:
        plan = sched.apply(gate, step)
        net(torch.randn(3, 4)).pow(2).sum().backward()
        sched.observe(net)
        net.zero_grad(set_to_none=True)
        seen.append((plan, dict(sched.scores)))
    gate.remove()
    return seen


def test_same_seed_and_observations_draw_the_same_and_another_seed_differs() -> None:
    first = run(Importance(["*.0", "*.2"], seed=4), pairs(4), range(12))
    second = run(Importance(["*.0", "*.2"], seed=4), pairs(4), range(12))
    other = run(Importance(["*.0", "*.2"], seed=5), pairs(4), range(12))
    assert first == second
    assert [p for p, _ in first] != [p for p, _ in other]


def test_resume_mid_window_continues_exactly() -> None:
    whole = run(Importance(["*.0", "*.2"], 0.25, 0.5, every=3, seed=7), pairs(4), range(10))
    net = pairs(4)
    sched = Importance(["*.0", "*.2"], 0.25, 0.5, every=3, seed=7)
    gate = gg.BackpropGate(net)
    head = run(sched, net, range(4), gate)
    state = json.loads(json.dumps(sched.state_dict()))  # JSON-serialisable
    assert state["window"] == 1 and state["next_step"] == 4 and len(state["drawn"]) == 2
    resumed = Importance(["*.0", "*.2"], 0.25, 0.5, every=3, seed=7)
    resumed.load_state_dict(state)
    torch.manual_seed(1)
    for _ in range(4):  # the same random inputs as the whole run
        torch.randn(3, 4)
    tail = []
    gate = gg.BackpropGate(net)
    for _step in range(4, 10):
        plan = resumed.apply(gate)
        net(torch.randn(3, 4)).pow(2).sum().backward()
        resumed.observe(net)
        net.zero_grad(set_to_none=True)
        tail.append((plan, dict(resumed.scores)))
    gate.remove()
    assert head + tail == whole
    assert resumed.picks == {n: sum(n in p.learn for p, _ in whole) for n in resumed.candidates}


def test_load_state_dict_refuses_another_configuration_or_a_broken_state() -> None:
    sched = Importance(["*.0"], 0.5, every=2)
    state = sched.state_dict()
    with pytest.raises(
        gg.InvalidOptionError, match=r"the state's config is .* but this Importance"
    ):
        Importance(["*.0"], 0.5, every=3).load_state_dict(state)
    with pytest.raises(gg.InvalidOptionError, match=r"lacks \['scores'\]"):
        Importance(["*.0"], 0.5, every=2).load_state_dict(
            {k: v for k, v in state.items() if k != "scores"}
        )
    broken = {**state, "picks": {"0.0": -1}}
    with pytest.raises(gg.InvalidOptionError, match=r"not what Importance.state_dict\(\) writes"):
        Importance(["*.0"], 0.5, every=2).load_state_dict(broken)
    net = pairs(2)
    gate = gg.BackpropGate(net)
    bound = Importance(["*.0"], 0.5, every=2)
    bound.apply(gate, 0)
    with pytest.raises(gg.InvalidOptionError, match=r"names \['9.0'\], which are not candidates"):
        bound.load_state_dict({**state, "scores": {"9.0": 1.0}})
    assert bound.next_step == 1  # left as it was
    gate.remove()


# -- exact with the gate -----------------------------------------------------------------------
def test_with_the_gate_only_the_drawn_modules_and_the_head_learn_exactly() -> None:
    model, batch, loss_fn = llama(layers=4)
    model.train()
    reference = copy.deepcopy(model)
    gate = gg.BackpropGate(model)
    candidates = ["model.layers.*.mlp.*_proj", "model.layers.*.self_attn.*_proj"]
    sched = Importance(candidates, budget=0.2, seed=3)
    params = dict(reference.named_parameters())
    for step in range(4):
        plan = sched.apply(gate, step)
        assert all(isinstance(name, str) for name in plan.learn)
        loss_fn(model, batch).backward()
        sched.observe(model)
        expected = dict(
            zip(
                params,
                torch.autograd.grad(loss_fn(reference, batch), list(params.values())),
                strict=True,
            )
        )
        learning = {f"{n}.weight" for n in plan.learn} | {"model.norm.weight", "lm_head.weight"}
        for name, param in model.named_parameters():
            if name in learning:
                torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-7)
            else:
                assert param.grad is None, (step, name)
        rms = {n: expected[f"{n}.weight"].norm().item() / math.sqrt(expected[f"{n}.weight"].numel())
               for n in plan.learn}  # fmt: skip
        if step == 0:
            assert {n: s for n, s in sched.scores.items() if s is not None} == pytest.approx(rms)
        model.zero_grad(set_to_none=True)
    total = sum(model.get_submodule(n).weight.numel() for n in sched.candidates)
    assert len(sched.candidates) == 28
    metrics = sched.metrics(plan, 4)
    used = sum(model.get_submodule(n).weight.numel() for n in plan.learn)
    assert metrics["learning_modules"] == len(plan.learn)
    assert metrics["budget_used"] == round(used / total, 6) and used <= 0.2 * total
    assert sum(v for k, v in metrics.items() if k.startswith("picks/")) == sum(sched.picks.values())
    gate.remove()


def test_observe_keeps_an_ema_replaces_a_second_call_and_warns_without_gradients() -> None:
    net = pairs(2)
    gate = gg.BackpropGate(net)
    sched = Importance(["*.0", "*.2"], budget=1.0, decay=0.75)
    values = []
    for step in range(2):
        sched.apply(gate, step)
        net(torch.full((1, 4), float(step + 1))).sum().backward()
        g = net[0][0].weight.grad
        bias = net[0][0].bias.grad
        values.append(math.sqrt((g.square().sum() + bias.square().sum()).item() / 20))
        sched.observe(net)
        sched.observe(net)  # the same step again: replaces, does not count twice
        net.zero_grad(set_to_none=True)
    assert sched.scores["0.0"] == pytest.approx(0.75 * values[0] + 0.25 * values[1])
    assert sched.picks == dict.fromkeys(sched.candidates, 2)
    sched.apply(gate, 2)
    with pytest.warns(
        gg.NoBackwardWarning,
        match=r"found no gradient on the 4 modules drawn "
        r"for step 2 \('0.0', \.\.\.\); call it after backward\(\) and before",
    ):
        sched.observe(net)
    gate.remove()


def test_observe_before_apply_or_on_another_model_raises() -> None:
    net = pairs(2)
    sched = Importance(["*.0"], 0.5)
    with pytest.raises(gg.InvalidOptionError, match=r"observe\(\) was called before any apply"):
        sched.observe(net)
    with pytest.raises(
        gg.InvalidOptionError, match=r"has not seen a gate yet.*apply\(gate, step\)"
    ):
        sched.plan(0)
    gate = gg.BackpropGate(net)
    sched.apply(gate, 0)
    with pytest.raises(
        gg.InvalidOptionError,
        match=r"observe\(model=Sequential\): this schedule "
        r"drives a gate on a Sequential, which that model neither is nor contains",
    ):
        sched.observe(pairs(2))
    wrapper = nn.ModuleDict({"net": net})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gg.NoBackwardWarning)
        sched.observe(wrapper)  # a model that contains the gated one is fine
    gate.remove()


def test_resting_names_the_candidates_not_drawn_next() -> None:
    net = pairs(4)
    gate = gg.BackpropGate(net)
    blocks = Importance([0, 1, 2, 3], budget=0.5, seed=1)
    plan = blocks.apply(gate, 0)
    assert blocks.resting(0) == frozenset(range(4)) - plan.learn and len(plan.learn) == 2
    assert blocks.resting_modules(0) == frozenset()
    inner = Importance(["*.0", "*.2"], budget=0.5, seed=1)
    plan = inner.apply(gate, 0)
    assert inner.resting(0) == frozenset()
    assert inner.resting_modules(0) == frozenset(inner.candidates) - plan.learn
    assert len(inner.resting_modules(0)) == 4
    gate.remove()


def test_apply_counts_a_step_once_and_draws_once_per_window() -> None:
    net = pairs(4)
    gate = gg.BackpropGate(net)
    sched = Importance(["*.0", "*.2"], every=5, seed=9)
    first = sched.apply(gate, 0)
    assert sched.apply(gate, 0) == first and sched.apply(gate, 4) == first
    assert sum(sched.picks.values()) == 2 * len(first.learn)
    assert sched.plan(3) == first and gate.learn == first.learn
    assert "Importance(['*.0', '*.2'], budget=0.25" in repr(sched)
    gate.remove()


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"modules": []}, r"modules=\[\] is empty; expected at least one candidate module"),
        ({"modules": ["a", 3.5]}, r"modules contains 3.5 \(float\); expected module names"),
        ({"modules": 7.0}, r"modules=7.0; expected the candidate modules"),
        ({"budget": 0}, r"budget=0 is out of range; expected a number in \(0, 1\], the share"),
        ({"budget": 1.5}, r"budget=1.5 is out of range"),
        ({"budget": math.nan}, r"budget=nan; expected a number in \(0, 1\]"),
        ({"temperature": 0}, r"temperature=0 is out of range; expected a finite number > 0"),
        ({"temperature": math.inf}, r"temperature=inf; expected a finite number > 0"),
        ({"temperature": "1"}, r"temperature='1'; expected a finite number > 0"),
        ({"floor": 1.5}, r"floor=1.5 is out of range; expected \[0, 1\]"),
        ({"floor": -0.1}, r"floor=-0.1 is out of range"),
        ({"seed": 1.5}, r"seed=1.5 \(float\); expected an integer"),
        ({"seed": True}, r"seed=True \(bool\); expected an integer"),
        ({"every": 0}, r"every=0 is out of range; expected >= 1"),
        ({"decay": 1.0}, r"decay=1.0; expected a number in \[0, 1\)"),
    ],
)
def test_bad_options_raise_clear_errors(kwargs: dict, message: str) -> None:
    options = {"modules": ["*.0"], **kwargs}
    with pytest.raises(gg.InvalidOptionError, match=message):
        Importance(**options)


@pytest.mark.parametrize(
    ("modules", "error", "message"),
    [
        (["0", "0.0"], gg.InvalidOptionError, r"the candidates '0' and '0.0' share parameters"),
        ([""], gg.InvalidOptionError, r"modules contains ''"),
        (["*.1"], gg.InvalidOptionError, r"the candidate '0.1' \(Tanh\) holds no parameters"),
        (["0.O"], gg.UnknownModuleError, r"'0.O' matches no module.*Did you mean .*'0.0'"),
    ],
)
def test_bad_candidates_are_refused_at_the_first_apply(modules, error, message) -> None:
    net = pairs(2)
    gate = gg.BackpropGate(net)
    with pytest.raises(error, match=message):
        Importance(modules).apply(gate, 0)
    assert gate.learn is None and gate.depth is None  # nothing applied
    gate.remove()


def test_a_container_of_the_blocks_or_a_too_small_budget_is_refused() -> None:
    outer = nn.Sequential(pairs(2), nn.Linear(4, 4))
    gate = gg.BackpropGate(outer, "0.*")
    with pytest.raises(gg.InvalidOptionError, match=r"the candidate '0' holds the gate's blocks"):
        Importance(["0"]).apply(gate, 0)
    gate.remove()
    net = chain([2, 8, 2, 2])  # sizes 24, 18, 6
    gate = gg.BackpropGate(net)
    with pytest.raises(
        gg.InvalidOptionError,
        match=r"budget=0.25 allows 12 of the candidates' "
        r"48 parameters per step, fewer than '0' holds \(24\); expected a budget "
        r"that fits every candidate: budget >= 0.5, or smaller candidates",
    ):
        Importance(["0", "1", "2"]).apply(gate, 0)
    gate.remove()


# -- a loop that forgets observe() -------------------------------------------------------------
def test_a_loop_without_observe_warns_once_when_the_next_window_starts() -> None:
    net = pairs(4)
    gate = gg.BackpropGate(net)
    sched = Importance(["*.0", "*.2"], budget=0.25, every=2, seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with pytest.warns(gg.NoBackwardWarning) as record:
        for step in range(30):
            sched.apply(gate, step)  # the hand-written loop forgets sched.observe(net)
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert len(record) == 1  # once, not at every window
    message = str(record[0].message)
    assert "window of steps 0-1 ran with no Importance.observe()" in message
    assert "every score stays None and the draw is uniform" in message
    assert "call sched.observe(model) after backward()" in message
    assert "GateCallback" in message  # or let the trainer callbacks call it
    assert record[0].filename == __file__  # attributed to the loop's line
    assert set(sched.scores.values()) == {None}
    gate.remove()


def test_observe_at_each_step_or_once_per_window_or_no_training_warns_nothing() -> None:
    net = pairs(4)
    gate = gg.BackpropGate(net)
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for every, observed in ((1, range(12)), (3, range(2, 12, 3))):
            sched = Importance(["*.0", "*.2"], budget=0.25, every=every, seed=0)
            for step in range(12):
                sched.apply(gate, step)
                net(x).sum().backward()
                if step in observed:  # once per window is enough (gradient accumulation)
                    sched.observe(net)
                net.zero_grad(set_to_none=True)
        planning = Importance(["*.0", "*.2"], budget=0.25, seed=0)
        for step in range(12):  # draws looked at, nothing trained: nothing to observe
            planning.apply(gate, step)
        resumed = Importance(["*.0", "*.2"], budget=0.25, every=3, seed=0)
        resumed.apply(gate, 0)
        net(x).sum().backward()
        resumed.load_state_dict(sched.state_dict())  # a resumed run starts a fresh count
        resumed.apply(gate, 12)
    gate.remove()


def test_block_positions_are_the_gate_s_blocks_not_the_model_s() -> None:
    """A position counts the gate's blocks, as a depth or a learning set does: on a gate over
    layers 2 and 3 of a Sequential, candidate 0 is layer 2 (block discovery would say layer 0,
    a module before the gate's blocks, which would then learn nothing of the plan's)."""
    net = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])
    gate = gg.BackpropGate(net, blocks=["2", "3"])
    plan = gg.schedules.Importance([0], budget=1.0).apply(gate, 0)
    assert plan.learn == frozenset({0})  # the gate's block 0: layer 2
    net(torch.randn(2, 3)).sum().backward()
    assert [layer.weight.grad is not None for layer in net] == [False, False, True, False]
    with pytest.raises(gg.GradgateError, match="position 2, but the gate has 2 blocks"):
        gg.schedules.Importance([2], budget=1.0).apply(gate, 0)
    gate.remove()
