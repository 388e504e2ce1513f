"""Schedules: plans as pure functions of (seed, step), resumable, applied to a real gate."""

from __future__ import annotations

import copy
import pickle
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradgate as gg
from gradgate.schedules import (
    _REGISTRY,
    LISA,
    DropBP,
    FreezeOut,
    GradualUnfreeze,
    Plan,
    RandomDepth,
    Schedule,
)

N = 6
STEPS = 40  # the run the registered schedules are built for

# Every registered schedule as the registry builds it, and other options of some of them.
SCHEDULES: dict[str, Callable[[int], Schedule]] = {
    **{kind.__name__: partial(build, N, STEPS) for kind, build in _REGISTRY.items()},
    "RandomDepth(low=1, high=4)": lambda seed: RandomDepth(N, low=1, high=4, seed=seed),
    "LISA(always=['0'])": lambda seed: LISA(N, k=2, every=3, always=["0"], seed=seed),
    "DropBP(rates=...)": lambda seed: DropBP(N, rates=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], seed=seed),
    "FreezeOut(spacing='cubic')": lambda seed: FreezeOut(
        N, total_steps=500, first=0.3, spacing="cubic", seed=seed
    ),
    "GradualUnfreeze(then_all=True)": lambda seed: GradualUnfreeze(
        N, every=50, start=0, then_all=True, seed=seed
    ),
}
# The schedules that draw nothing: their plans are the same for every seed.
DRAW_NOTHING = (FreezeOut, GradualUnfreeze)


def every_schedule(seed: int = 0) -> list[Schedule]:
    return [build(seed) for build in SCHEDULES.values()]


def seen_a_gate(schedule: Schedule) -> Schedule:
    """``schedule`` once applied to a gate of N blocks: Importance resolves its candidates on
    the gated model before it plans; the other schedules plan the same either way."""
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(N)])
    with gg.BackpropGate(net) as gate:
        schedule.apply(gate, 0)
    return schedule


def test_the_registry_holds_every_schedule_the_package_exports() -> None:
    exported = {getattr(gg.schedules, name) for name in gg.schedules.__all__}
    kinds = {k for k in exported if isinstance(k, type) and issubclass(k, Schedule)}
    assert set(_REGISTRY) == kinds - {Schedule}
    for kind, build in _REGISTRY.items():
        assert type(build(N, STEPS, 0)) is kind


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("kind", list(_REGISTRY), ids=lambda kind: kind.__name__)
def test_each_registered_schedule_plans_a_gate_of_any_size(kind: type, n: int) -> None:
    """The registry's options fit a model of any block count, one block too (the property test
    below draws the sizes, and a draw it misses would go unnoticed)."""
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(n)])
    with gg.BackpropGate(net, [str(i) for i in range(n)]) as gate:
        plan = _REGISTRY[kind](n, STEPS, 0).apply(gate, 0)
        assert plan.learning(n) <= set(range(n))


def residual_net(n: int = N) -> nn.Module:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.f(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(3, 4)
            self.blocks = nn.ModuleList([Residual() for _ in range(n)])
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def test_the_docs_table_names_exactly_the_registered_schedules() -> None:
    page = (Path(__file__).parent.parent / "docs" / "schedules.md").read_text()
    rows = re.findall(r"^\| `(\w+)\(", page, re.MULTILINE)
    assert rows == [kind.__name__ for kind in _REGISTRY], "docs/schedules.md's table"


# -- determinism and resuming ------------------------------------------------------------------
@pytest.mark.parametrize("name", SCHEDULES)
def test_same_seed_same_plans_over_1000_steps(name: str) -> None:
    first, second = (seen_a_gate(SCHEDULES[name](7)) for _ in range(2))
    plans = [first.plan(step) for step in range(1000)]
    assert plans == [second.plan(step) for step in range(1000)]
    # out of order and repeated queries give the same plan: no hidden RNG state
    assert [first.plan(step) for step in reversed(range(1000))] == plans[::-1]


@pytest.mark.parametrize("name", SCHEDULES)
def test_plans_depend_on_the_seed_only(name: str) -> None:
    torch.manual_seed(123)
    import random

    random.seed(5)
    a = [seen_a_gate(SCHEDULES[name](1)).plan(s) for s in range(200)]
    torch.manual_seed(999)
    random.seed(77)
    b = [seen_a_gate(SCHEDULES[name](1)).plan(s) for s in range(200)]
    c = [seen_a_gate(SCHEDULES[name](2)).plan(s) for s in range(200)]
    assert a == b
    if isinstance(SCHEDULES[name](0), DRAW_NOTHING):
        assert a == c
    else:
        assert a != c
        assert len(set(a)) > 3  # it does vary over the steps


@pytest.mark.parametrize("name", SCHEDULES)
def test_resume_from_state_dict_continues_the_sequence(name: str) -> None:
    gate_model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(N)])
    gate = gg.BackpropGate(gate_model)
    original = SCHEDULES[name](3)
    plans = [original.apply(gate) for _ in range(300)]
    state = pickle.loads(pickle.dumps(original.state_dict()))
    resumed = SCHEDULES[name](0)  # another seed: the state's seed wins
    resumed.load_state_dict(state)
    assert resumed.next_step == 300
    later = [resumed.apply(gate) for _ in range(300)]
    uninterrupted = copy.deepcopy(original)
    assert later == [uninterrupted.apply(gate) for _ in range(300)]
    fresh = SCHEDULES[name](3)
    fresh.apply(gate, 0)  # LISA looks its always=["0"] up on the gate: block 0, not a draw
    assert plans + later == [fresh.plan(s) for s in range(600)]
    gate.remove()


def test_load_state_dict_of_another_configuration_raises() -> None:
    state = LISA(N, k=2, every=3).state_dict()
    with pytest.raises(gg.InvalidOptionError, match=r"config is .*'k': 2.* but this LISA has"):
        LISA(N, k=3, every=3).load_state_dict(state)
    with pytest.raises(gg.InvalidOptionError, match="schedule is 'LISA' but this RandomDepth"):
        RandomDepth(N).load_state_dict(state)


# -- what each schedule plans ------------------------------------------------------------------
def test_random_depth_covers_its_range_uniformly() -> None:
    depths = [RandomDepth(N, low=2, high=4, seed=0).plan(s).depth for s in range(3000)]
    counts = {d: depths.count(d) for d in set(depths)}
    assert set(counts) == {2, 3, 4}
    assert all(900 < c < 1100 for c in counts.values())


def test_lisa_draws_k_blocks_per_window_and_always_learns_the_rest() -> None:
    sched = LISA(N, k=2, every=4, always=["embed", -1], seed=0)
    windows = []
    for step in range(400):
        plan = sched.plan(step)
        assert plan.depth is None and plan.skip == frozenset()
        assert "embed" in plan.learn and N - 1 in plan.learn
        drawn = {i for i in plan.learn if isinstance(i, int)} - {N - 1}
        assert len(drawn) == 2  # drawn among the blocks that do not always learn
        if step % 4:
            assert plan == sched.plan(step - 1)  # fixed within a window
        else:
            windows.append(frozenset(drawn))
    assert len(set(windows)) > 5
    chosen = [i for w in windows for i in w]
    assert set(chosen) == set(range(N - 1))


def test_dropbp_drops_each_block_at_its_rate() -> None:
    rates = [0.0, 0.25, 0.5, 0.75, 1.0, 0.5]
    sched = DropBP(N, rates=rates, seed=0)
    plans = [sched.plan(s) for s in range(4000)]
    for i, rate in enumerate(rates):
        share = sum(i in p.skip for p in plans) / len(plans)
        assert abs(share - rate) < 0.03, (i, share)
    assert all(p.depth is None and p.learn is None for p in plans)
    assert DropBP(N, 0.5).rates == [0.5] * N


def test_freezeout_stops_the_first_blocks_first_and_never_restarts() -> None:
    sched = FreezeOut(4, total_steps=100, first=0.5)
    assert sched.stops == [50, 67, 83, 100]
    depths = [sched.plan(s).depth for s in range(120)]
    assert depths == [4] * 50 + [3] * 17 + [2] * 16 + [1] * 17 + [0] * 20
    cubic = FreezeOut(4, total_steps=100, first=0.5, spacing="cubic").stops
    assert cubic[0] == 50 and cubic[-1] == 100 and cubic[1] < 67
    for step in range(120):
        gone = sched.finished(step)
        later = [sched.plan(s).learning(4) for s in range(step, 130)]
        assert all(not (gone & learning) for learning in later)
        assert gone == frozenset(range(4 - depths[step]))


def test_gradual_unfreeze_grows_by_every_steps() -> None:
    sched = GradualUnfreeze(4, every=3, start=1, by=2)
    assert [sched.plan(s).depth for s in range(10)] == [1, 1, 1, 3, 3, 3, 4, 4, 4, 4]
    assert GradualUnfreeze(2, every=1, start=2, then_all=True).plan(1) == Plan(depth=None)
    assert GradualUnfreeze(2, every=1, start=2).plan(1) == Plan(depth=2)


def test_plan_metrics() -> None:
    assert Plan(depth=None).metrics(4) == {
        "learning_blocks": 4,
        "skipped_blocks": 0,
        "learning_share": 1.0,
    }
    assert Plan(learn=frozenset({0, "embed", -1})).metrics(4)["learning_blocks"] == 2
    assert Plan(depth=3, skip=frozenset({3})).metrics(4) == {
        "depth": 3,
        "learning_blocks": 2,
        "skipped_blocks": 1,
        "learning_share": 0.5,
    }


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: RandomDepth(0), r"n=0 is out of range; expected >= 1"),
        (lambda: RandomDepth(4, low=3, high=2), r"high=2 is out of range; expected 3..4"),
        (lambda: RandomDepth(4, low=5), r"low=5 is out of range; expected 0..4"),
        (lambda: RandomDepth(4, seed=1.5), r"seed=1.5 \(float\); expected an integer"),
        (lambda: LISA(4, k=5), r"k=5 is out of range; expected 0..4"),
        (lambda: LISA(4, every=0), r"every=0 is out of range; expected >= 1"),
        (lambda: LISA(4, always=[7]), r"always entry=7 is out of range; expected -4..3"),
        (lambda: DropBP(4), r"rate=None and rates=None; expected exactly one"),
        (lambda: DropBP(4, 0.5, rates=[0.5] * 4), r"expected exactly one"),
        (lambda: DropBP(4, 1.5), r"rates\[0\]=1.5 is out of range; expected \[0, 1\]"),
        (
            lambda: DropBP(4, rates=[0.1]),
            r"rates=\[0.1\] has 1 entries; expected one per block \(4\)",
        ),
        (lambda: FreezeOut(4), r"total_steps=None and stops=None; expected exactly one"),
        (lambda: FreezeOut(2, stops=[5, 3]), r"stops=\[5, 3\] decreases"),
        (lambda: FreezeOut(2, total_steps=9, spacing="log"), r"spacing='log' is not allowed"),
        (lambda: GradualUnfreeze(4, every=2, by=0), r"by=0 is out of range; expected >= 1"),
        (lambda: Plan(depth=1, learn=frozenset({2})), r"sets both; expected one of them"),
        (lambda: RandomDepth(4).plan(-1), r"step=-1 is out of range; expected >= 0"),
    ],
)
def test_bad_arguments_raise_clear_errors(build, message: str) -> None:
    with pytest.raises(gg.InvalidOptionError, match=message):
        build()


def test_apply_to_a_gate_of_another_size_raises() -> None:
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
    message = r"plans over 6 blocks but the gate has 3"
    with gg.BackpropGate(net) as gate, pytest.raises(gg.InvalidOptionError, match=message):
        RandomDepth(6).apply(gate, 0)


@pytest.mark.parametrize(
    "schedule",
    [
        *every_schedule(),
        gg.schedules.Importance(["*"], budget=0.5),
        Plan(depth=1),
    ],
    ids=lambda s: type(s).__name__,
)
@pytest.mark.parametrize("wrong", ["model", "stop_gradient_at", "None"])
def test_apply_to_a_model_instead_of_its_gate_says_pass_the_gate(schedule, wrong: str) -> None:
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(N)])
    before = dict(net.__dict__)
    handle = gg.stop_gradient_at(net, "3") if wrong == "stop_gradient_at" else None
    given = {"model": net, "stop_gradient_at": handle, "None": None}[wrong]
    shown = {"model": "a Sequential", "None": "None"}.get(wrong, r"<gradgate.StopGradient")
    name = type(schedule).__name__
    message = (
        rf"{name}.apply\(gate={shown}.*\): expected the gradgate.BackpropGate that drives the "
        r"model; pass the gate: gate = gg.BackpropGate\(model\), then "
    )
    args = () if isinstance(schedule, Plan) else (0,)
    with pytest.raises(gg.InvalidOptionError, match=message):
        schedule.apply(given, *args)
    if handle is not None:
        handle.remove()
    assert net.__dict__ == before
    if not isinstance(schedule, Plan):
        assert schedule.next_step == 0  # nothing counted


def test_a_plan_that_does_not_fit_leaves_the_gate_as_it_was() -> None:
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
    with gg.BackpropGate(net) as gate:
        Plan(learn=frozenset({0}), skip=frozenset({2})).apply(gate)
        with pytest.raises(gg.InvalidDepthError, match="skip contains block position 7"):
            Plan(depth=1, skip=frozenset({7})).apply(gate)
        assert (gate.depth, gate.learn, gate.skip) == (None, {0}, {2})


# -- on a real gate ----------------------------------------------------------------------------
def test_depth_schedules_set_the_gate_depth() -> None:
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(N)])
    with gg.BackpropGate(net) as gate:
        for sched in [
            RandomDepth(N, seed=4),
            FreezeOut(N, total_steps=30),
            GradualUnfreeze(N, every=4),
        ]:
            for step in range(30):
                plan = sched.apply(gate, step)
                assert gate.depth == plan.depth
                net.zero_grad(set_to_none=True)
                net(torch.randn(2, 2)).sum().backward()
                learned = {i for i, layer in enumerate(net) if layer.weight.grad is not None}
                assert learned == plan.learning(N)


def test_lisa_on_a_gate_trains_exactly_the_drawn_blocks() -> None:
    net = residual_net()
    sched = LISA(N, k=2, every=1, seed=0)  # the embedding learns by default (the paper's LISA)
    x = torch.randn(5, 3)
    with gg.BackpropGate(net, "blocks.*") as gate:
        for step in range(8):
            plan = sched.apply(gate, step)
            net.zero_grad(set_to_none=True)
            net(x).pow(2).sum().backward()
            got = {name: p.grad for name, p in net.named_parameters() if p.grad is not None}
            learning = {f"blocks.{i}." for i in plan.learning(N)} | {"embed.", "head."}
            assert {n for n in got} == {
                n for n, _ in net.named_parameters() if any(n.startswith(s) for s in learning)
            }
            full = copy.deepcopy(net)
            names = [n for n, _ in full.named_parameters()]
            grads = torch.autograd.grad(full(x).pow(2).sum(), list(full.parameters()))
            for name, grad in zip(names, grads, strict=True):
                if name in got:
                    torch.testing.assert_close(got[name], grad)


def test_dropbp_on_a_gate_matches_the_hand_written_reference() -> None:
    net = residual_net()
    sched = DropBP(N, 0.5, seed=3)
    x = torch.randn(5, 3)
    with gg.BackpropGate(net, "blocks.*") as gate:
        for step in range(6):
            plan = sched.apply(gate, step)
            net.zero_grad(set_to_none=True)
            net(x).pow(2).sum().backward()
            ref = copy.deepcopy(net)
            h = ref.embed(x)
            for i, block in enumerate(ref.blocks):
                h = h + torch.tanh(block.f(h)).detach() if i in plan.skip else block(h)
            grads = torch.autograd.grad(
                ref.head(h).pow(2).sum(), list(ref.parameters()), allow_unused=True
            )
            for (name, param), grad in zip(net.named_parameters(), grads, strict=True):
                if grad is None:
                    assert param.grad is None, name
                else:
                    torch.testing.assert_close(param.grad, grad)
            skipped = {f"blocks.{i}.f.weight" for i in plan.skip}
            assert skipped == {
                n for n, p in net.named_parameters() if p.grad is None and n.endswith("weight")
            }


# -- properties --------------------------------------------------------------------------------
@st.composite
def schedules(draw) -> tuple[int, Schedule]:
    """A block count and a schedule for it: random options for the schedules drawn here, the
    registry's own for the others (a new schedule is checked from the start)."""
    n = draw(st.integers(1, 8))
    seed = draw(st.integers(-(2**40), 2**40))
    kind = draw(st.sampled_from(list(_REGISTRY)))
    if kind is RandomDepth:
        low = draw(st.integers(0, n))
        return n, RandomDepth(n, low, draw(st.integers(low, n)), seed=seed)
    if kind is LISA:
        always = draw(st.sets(st.integers(0, n - 1), max_size=n))
        k = draw(st.integers(0, n - len(always)))
        return n, LISA(n, k, every=draw(st.integers(1, 5)), always=always, seed=seed)
    if kind is DropBP:
        rates = draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))
        return n, DropBP(n, rates=rates, seed=seed)
    if kind is FreezeOut:
        first = draw(st.floats(0, 1))
        return n, FreezeOut(n, total_steps=draw(st.integers(1, 50)), first=first, seed=seed)
    if kind is GradualUnfreeze:
        every, start = draw(st.integers(1, 5)), draw(st.integers(0, n))
        return n, GradualUnfreeze(n, every=every, start=start)
    return n, _REGISTRY[kind](n, draw(st.integers(1, 50)), seed)


@settings(max_examples=60, deadline=None)
@given(drawn=schedules(), steps=st.lists(st.integers(0, 10**6), min_size=1, max_size=5))
def test_every_plan_fits_its_gate_and_is_reproducible(
    drawn: tuple[int, Schedule], steps: list[int]
) -> None:
    n, schedule = drawn
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(n)])
    twin = copy.deepcopy(schedule)
    with gg.BackpropGate(net, [str(i) for i in range(n)]) as gate:
        twin.apply(gate, steps[0])  # Importance resolves its candidates on the gated model
        for step in steps:
            plan = schedule.apply(gate, step)
            assert plan == twin.plan(step)
            assert plan.learning(n) <= set(range(n))
            assert plan.skip <= set(range(n))
            assert gate.skip == plan.skip
            if plan.learn is None:
                assert gate.depth == plan.depth
            else:  # a Sequential of Linear layers: no module around the blocks to name
                assert gate.learn == plan.learn
            assert not (schedule.finished(step) & plan.learning(n))


ALWAYS_ITEMS = [0, 3, "blocks.1", "blocks.4", "blocks.*.f", "blocks.2.f", "embed"]


@settings(max_examples=40, deadline=None)
@given(
    always=st.sets(st.sampled_from(ALWAYS_ITEMS), max_size=3),
    k=st.integers(0, 2),
    seed=st.integers(0, 100),
)
def test_lisa_always_of_positions_block_names_and_inner_names(always, k, seed) -> None:
    # Whatever mix of positions and names `always` holds, the blocks it names learn at every
    # step and are never drawn or rested; k other blocks are drawn per window.
    model = residual_net(5)
    net_names = {f"blocks.{i}": i for i in range(5)}
    blocks = {
        i if isinstance(i, int) else net_names[i]
        for i in always
        if i in net_names or isinstance(i, int)
    }
    sched = LISA(5, k=k, every=2, always=sorted(always, key=str), seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with gg.BackpropGate(model, "blocks.*") as gate:
        for step in range(6):
            plan = sched.apply(gate, step)
            learning = plan.learning(5)
            assert blocks <= learning and len(learning - blocks) == k, (step, plan)
            assert not sched.resting(step + 1) & blocks
            model(torch.randn(2, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            gg.optim.drop_finished(optimizer, gate, sched, step + 1)
            for name in (a for a in always if isinstance(a, str) and ".f" in a):
                for module_name, module in model.named_modules():
                    if module_name == name or (name == "blocks.*.f" and module_name.endswith(".f")):
                        assert all(p in optimizer.state for p in module.parameters()), name


# -- LISA is the paper's method by default; embeddings=False is the cheaper variant ------------
def tiny_lm(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
            bos_token_id=0, eos_token_id=0, use_cache=False, tie_word_embeddings=False,
        )  # fmt: skip
        return GPT2LMHeadModel(config).eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=4, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=64, max_position_embeddings=16, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


LAYERS = {"gpt2": "transformer.h", "llama": "model.layers"}
EMBEDDINGS = {"gpt2": {"transformer.wte", "transformer.wpe"}, "llama": {"model.embed_tokens"}}


def _lmflow_grads(model: nn.Module, kind: str, drawn: set[int], ids: torch.Tensor) -> dict:
    """LMFlow's LISA by hand: the layers not drawn have requires_grad=False, the rest learns."""
    reference = copy.deepcopy(model)
    for i, layer in enumerate(reference.get_submodule(LAYERS[kind])):
        layer.requires_grad_(i in drawn)
    named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(reference(ids).logits.pow(2).mean(), [p for _, p in named])
    return {n: g for (n, _), g in zip(named, grads, strict=True)}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_lisa_by_default_trains_the_embeddings_norm_and_head_at_every_step(kind: str) -> None:
    model = tiny_lm(kind)
    sched = LISA(4, k=1, every=1, seed=5)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with gg.BackpropGate(model) as gate:
        for step in range(6):
            plan = sched.apply(gate, step)
            assert plan.embeddings and EMBEDDINGS[kind] <= gate.learn  # named on the gate
            model.zero_grad(set_to_none=True)
            model(ids).logits.pow(2).mean().backward()
            expected = _lmflow_grads(model, kind, set(plan.learning(4)), ids)
            got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            assert sorted(got) == sorted(expected), step
            for name, grad in expected.items():
                torch.testing.assert_close(got[name], grad)


def test_lisa_without_embeddings_stops_the_backward_at_the_earliest_drawn_block() -> None:
    model = tiny_lm("gpt2")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    flops = {}
    for embeddings in (True, False):
        sched = LISA(4, k=1, every=1, embeddings=embeddings, seed=2)
        with gg.BackpropGate(model) as gate:
            plan = sched.apply(gate, 0)
            gate_learn = gate.learn
            model.zero_grad(set_to_none=True)
            with gg.audit(model) as report:
                model(ids).logits.pow(2).mean().backward()
        flops[embeddings] = report.totals["backward_flops"]
        learned = {n.rsplit(".", 1)[0] for n, p in model.named_parameters() if p.grad is not None}
        assert ("transformer.wte" in learned) is embeddings
        assert ("transformer.wpe" in learned) is embeddings
        assert {"transformer.ln_f", "lm_head"} <= learned  # after the last block: always
        assert bool(EMBEDDINGS["gpt2"] & gate_learn) is embeddings
    assert plan.learning(4) == {3}  # seed 2 draws the last block: nothing below it runs backward
    assert flops[False] < 0.6 * flops[True]


def test_lisa_embeddings_option_is_in_its_config_state_and_repr() -> None:
    assert LISA(4).embeddings is True
    cheap = LISA(4, k=1, embeddings=False)
    assert cheap.state_dict()["config"]["embeddings"] is False
    assert "embeddings=False" in repr(cheap)
    with pytest.raises(gg.InvalidOptionError, match=r"config is .*'embeddings': True.* but this"):
        cheap.load_state_dict(LISA(4, k=1).state_dict())
    with pytest.raises(gg.InvalidOptionError, match=r"embeddings='yes'; expected True or False"):
        LISA(4, embeddings="yes")  # type: ignore[arg-type]


def test_lisa_embeddings_keep_their_optimizer_state_when_blocks_rest() -> None:
    model = residual_net()
    sched = LISA(N, k=1, every=1, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with gg.BackpropGate(model, "blocks.*") as gate:
        for step in range(4):
            plan = sched.apply(gate, step)
            model(torch.randn(2, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            gg.optim.drop_finished(optimizer, gate, sched, step + 1)
            assert all(p in optimizer.state for p in model.embed.parameters())
            assert all(p in optimizer.state for p in model.head.parameters())
            with_state = {i for i, b in enumerate(model.blocks) if b.f.weight in optimizer.state}
            assert with_state <= plan.learning(N) & sched.plan(step + 1).learning(N)


# -- integer options: a bool is not an integer; block positions stop at n - 1 and -n -----------
@pytest.mark.parametrize(
    "build",
    [
        lambda: LISA(True),
        lambda: LISA(4, k=True),
        lambda: LISA(4, True),
        lambda: LISA(4, every=True),
        lambda: LISA(4, always=[True]),
        lambda: LISA(4, seed=True),
        lambda: RandomDepth(4, low=True),
        lambda: RandomDepth(4, 1, True),
        lambda: GradualUnfreeze(4, every=True),
        lambda: GradualUnfreeze(4, every=2, start=True),
        lambda: GradualUnfreeze(4, every=2, by=True),
        lambda: FreezeOut(4, total_steps=True),
        lambda: FreezeOut(4, stops=[True, 1, 2, 3]),
        lambda: DropBP(4, True),
        lambda: GradualUnfreeze(4, every=2).plan(True),
        lambda: LISA(4).finished(True),
        lambda: LISA(4).resting(True),
        lambda: FreezeOut(4, total_steps=9).finished(True),
    ],
)
def test_a_bool_is_refused_as_an_integer_option(build) -> None:
    with pytest.raises(gg.InvalidOptionError, match=r"=True"):
        build()


def test_apply_and_load_state_dict_refuse_a_bool_step_and_leave_the_state() -> None:
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    sched = GradualUnfreeze(4, every=2)
    with gg.BackpropGate(net) as gate:
        with pytest.raises(gg.InvalidOptionError, match=r"step=True \(bool\)"):
            sched.apply(gate, True)
        assert (gate.depth, sched.next_step) == (None, 0)
    for key in ("next_step", "seed"):
        state = {**sched.state_dict(), key: True}
        with pytest.raises(gg.InvalidOptionError, match=rf"{key}=True \(bool\)"):
            sched.load_state_dict(state)
        assert (sched.next_step, sched.seed) == (0, 0)


@pytest.mark.parametrize("n", [1, 4])
def test_lisa_always_positions_stop_at_the_block_count(n: int) -> None:
    for bad in (n, -n - 1):
        with pytest.raises(gg.InvalidOptionError, match=rf"always entry={bad} is out of range"):
            LISA(n, k=0, always=[bad])
    assert LISA(n, k=0, always=[n - 1]).plan(0).learn == {n - 1}
    assert LISA(n, k=0, always=[-n]).plan(0).learn == {0}


def test_lisa_plans_stay_a_pure_function_of_seed_and_step_once_applied() -> None:
    model = residual_net()
    applied = LISA(N, k=2, every=2, seed=4)
    with gg.BackpropGate(model, "blocks.*") as gate:
        plans = [applied.apply(gate, step) for step in range(8)]
        assert gate.learn == plans[-1].learn | {"embed", "head"}
    fresh = LISA(N, k=2, every=2, seed=4)  # never saw a gate: the same plans
    assert plans == [fresh.plan(step) for step in range(8)]
    assert all(plan.embeddings for plan in plans)


def test_a_plan_with_embeddings_names_the_modules_around_the_blocks() -> None:
    model = residual_net()
    with gg.BackpropGate(model, "blocks.*") as gate:
        Plan(learn=frozenset({2}), embeddings=True).apply(gate)
        assert gate.learn == {2, "embed", "head"}
        Plan(learn=frozenset({2})).apply(gate)
        assert gate.learn == {2}
    assert repr(Plan(learn=frozenset({2}), embeddings=True)) == "Plan(learn=[2], embeddings=True)"
    for bad in ({"depth": 1, "embeddings": True}, {"embeddings": 1, "learn": frozenset({1})}):
        with pytest.raises(gg.InvalidOptionError, match=r"expected embeddings=True only with"):
            Plan(**bad)  # type: ignore[arg-type]


def test_every_schedule_has_the_base_hooks_for_observing_and_logging() -> None:
    net = residual_net()
    gate = gg.BackpropGate(net)
    for schedule in every_schedule():
        plan = schedule.apply(gate, 3)
        net.zero_grad(set_to_none=True)
        net(torch.randn(2, 3)).sum().backward()
        assert schedule.observe(net) is None  # Importance keeps scores; the others ignore it
        metrics = schedule.metrics(plan, N)
        assert metrics and all(isinstance(v, (int, float)) for v in metrics.values()), metrics
        if type(schedule).metrics is Schedule.metrics:  # Importance logs its draw and scores
            assert metrics == plan.metrics(N)
        assert schedule.resting_modules(3) == frozenset()  # only whole blocks rest here
    with pytest.raises(gg.InvalidOptionError, match=r"step=-1 is out of range"):
        RandomDepth(N).resting_modules(-1)
    assert gg.schedules.Schedule.__module__ == "gradgate.schedules"
    assert {"Importance", "Schedule", "Plan"} <= set(gg.schedules.__all__)
    gate.remove()
