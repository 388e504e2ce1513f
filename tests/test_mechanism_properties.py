"""Second guards: one property test per core mechanism, against plain autograd or a reference
written out here by hand, independent of the mechanism's own test file.

Each draws a few random cases (models, plans, loops); together they would have found issue 45's
surviving one-line bugs. Kept fast: few examples, no deadline.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import gradgate as gg

FEW = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
W = 4


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.f(x))


class Around(nn.Module):
    """Residual blocks with parameters around them: a stem, a bare parameter of the model's own
    added before the blocks, and a head after them (its weight the stem's, when ``tied``)."""

    def __init__(self, n: int, seed: int, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Linear(W, W)
        self.shift = nn.Parameter(torch.randn(W))
        self.blocks = nn.Sequential(*[Residual() for _ in range(n)])
        self.head = nn.Linear(W, W)
        if tied:
            self.head.weight = self.stem.weight
        self.double()

    def start(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.stem(x)) + self.shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.start(x)))


def same_params(a: nn.Module, b: nn.Module, where: object) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=f"{where} {name}")


# -- DropBP: skipped blocks get no gradient, and no stale one moves them -----------------------
def dropbp_by_hand(model: Around, x: torch.Tensor, learn: set[int] | None, skip: set[int]):
    """The plan written out: with a cut (``learn``: the learning positions), what runs before
    the first learner under no_grad and the other blocks after it frozen (the gradient passes
    through them; their flags are the caller's to put back); a skipped block's residual branch
    with no graph (the gradient passes through the identity). The stem and the bare parameter
    learn only with no cut."""
    first = 0 if learn is None else min(learn, default=len(model.blocks))
    with torch.set_grad_enabled(learn is None):
        h = model.start(x)
    for i, block in enumerate(model.blocks):
        if i < first:
            with torch.no_grad():
                h = block(h)
        elif i in skip:
            with torch.no_grad():
                branch = torch.tanh(block.f(h))
            h = h + branch
        else:
            block.requires_grad_(learn is None or i in learn)
            h = block(h)
    return model.head(h).pow(2).mean()


def plans(n: int):
    """A depth (``None``: no cut) or a learning set, and a skip set."""
    depth = st.one_of(st.none(), st.integers(0, n)).map(lambda d: ("depth", d))
    learn = st.sets(st.integers(0, n - 1), min_size=1).map(lambda s: ("learn", s))
    return st.tuples(st.one_of(depth, learn), st.sets(st.integers(0, n - 1)))


@FEW
@given(
    n=st.integers(2, 4),
    data=st.data(),
    set_to_none=st.booleans(),
    optimizer=st.sampled_from(["sgd", "adamw"]),
    tied=st.booleans(),
)
def test_dropbp_steps_equal_the_hand_written_plan_whatever_zero_grad_leaves(
    n: int, data, set_to_none: bool, optimizer: str, tied: bool
) -> None:
    """A loop of random depths, learning sets and skip sets with zero_grad(set_to_none=...)
    either way: every step moves exactly what the hand-written plan (set_to_none=True) moves,
    the parameters around the blocks included (the stem and the bare parameter before them
    learn only with no cut; the head learns always, and with it the stem's weight it shares)."""
    steps = data.draw(st.lists(plans(n), min_size=2, max_size=5))
    ours, ref = Around(n, 0, tied), Around(n, 0, tied)
    make = {
        "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1),
        "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1),
    }[optimizer]
    opt, ref_opt = make(ours), make(ref)
    gate = gg.BackpropGate(ours, "blocks.*")
    for t, ((kind, plan), skip) in enumerate(steps):
        x = torch.randn(5, W, generator=torch.Generator().manual_seed(t), dtype=torch.float64)
        if kind == "depth":
            gate.depth, gate.skip = plan, skip
            learn = None if plan is None else set(range(n - plan, n))
        else:
            gate.learn, gate.skip = plan, skip
            learn = plan
        with warnings.catch_warnings():  # the tied weight's use before the cut: said, expected
            warnings.simplefilter("ignore", gg.SharedParameterWarning)
            ours(x).pow(2).mean().backward()
        dropbp_by_hand(ref, x, learn, skip).backward()
        ref.requires_grad_(True)
        for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=f"step {t}: {name}")
            else:  # none, or the zeros zero_grad left: the guard drops those at the step
                assert p.grad is None or not p.grad.any(), (t, name)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=True)
        same_params(ours, ref, t)
    gate.remove()


# -- tied parameters under a learning set ------------------------------------------------------
class Tied(nn.Module):
    """An embedding whose weight the head shares, used again between two blocks."""

    def __init__(self, n: int, again: int) -> None:
        super().__init__()
        torch.manual_seed(n + again)
        self.embed = nn.Embedding(7, W)
        self.blocks = nn.ModuleList(Residual() for _ in range(n))
        self.head = nn.Linear(W, 7, bias=False)
        self.head.weight = self.embed.weight
        self.again = again  # the block after which the embedding runs again

    def forward(self, ids: torch.Tensor, more: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == self.again:
                h = h + self.embed(more)
        return self.head(h)

    def by_hand(self, ids: torch.Tensor, more: torch.Tensor, learn: set[int]) -> torch.Tensor:
        """Nothing before the first learner records a graph; other blocks are frozen (the
        gradient passes); the tied weight learns from each of its uses after the cut."""
        first = min(learn)
        with torch.no_grad():
            h = self.embed(ids)
        for i, block in enumerate(self.blocks):
            with torch.set_grad_enabled(i >= first):
                block.requires_grad_(i in learn)
                h = block(h)
                if i == self.again:
                    h = h + self.embed(more)
        return self.head(h).pow(2).sum()


@FEW
@given(n=st.integers(2, 4), data=st.data())
def test_a_tied_weight_under_any_learning_set_gets_the_hand_written_gradient(n: int, data) -> None:
    again = data.draw(st.integers(0, n - 1))
    learn = data.draw(st.sets(st.integers(0, n - 1), min_size=1))
    model = Tied(n, again)
    ref = copy.deepcopy(model)
    ids, more = torch.randint(0, 7, (2, 3)), torch.randint(0, 7, (2, 3))
    gate = gg.BackpropGate(model, "blocks.*")
    gate.learn = learn
    with warnings.catch_warnings():  # its first use runs before the cut: said, and expected
        warnings.simplefilter("ignore", gg.SharedParameterWarning)
        model(ids, more)  # a first forward shows where its second use runs: between blocks
        model(ids, more).pow(2).sum().backward()
    gate.remove()
    ref.by_hand(ids, more, learn).backward()
    torch.testing.assert_close(model.head.weight.grad, ref.embed.weight.grad)
    for i in range(n):
        for p, q in zip(model.blocks[i].parameters(), ref.blocks[i].parameters(), strict=True):
            if i in learn:
                torch.testing.assert_close(p.grad, q.grad, msg=f"block {i}")
            else:
                assert p.grad is None and q.grad is None, i


# -- LearnerMasters after an outside write -------------------------------------------------------
class Masters:
    """fp32 masters by hand: one per learning bf16 parameter, each with its own
    AdamW(foreach=False); a parameter with no gradient at a step loses both; a parameter
    written from outside gets its master again from its value, its moments kept."""

    def __init__(self, params: list[nn.Parameter], **options: float) -> None:
        self.params, self.options = params, options
        self.masters: dict[nn.Parameter, tuple[torch.Tensor, torch.optim.Optimizer]] = {}
        self.written: set[nn.Parameter] = set()

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                self.masters.pop(p, None)
                continue
            if p not in self.masters:
                master = p.detach().float().clone()
                self.masters[p] = (master, torch.optim.AdamW([master], **self.options))
            master, inner = self.masters[p]
            if p in self.written:
                master.copy_(p.float())
            master.grad = p.grad.float()
            inner.step()
            master.grad = None
            p.copy_(master)
        self.written.clear()


@FEW
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("step"), st.sets(st.integers(0, 2), min_size=1)),
            st.tuples(st.just("write"), st.integers(0, 5)),
            st.tuples(st.just("load"), st.integers(0, 2)),
        ),
        min_size=2,
        max_size=8,
    )
)
def test_learner_masters_follow_outside_writes_like_the_hand_written_masters(ops) -> None:
    torch.manual_seed(0)
    ours = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)]).bfloat16()
    ref = copy.deepcopy(ours)
    options = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.99), "eps": 1e-8}
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, ours.parameters(), foreach=False, **options)
    hand = Masters(list(ref.parameters()), foreach=False, **options)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)).bfloat16()
    for t, (kind, value) in enumerate(ops):
        if kind == "step":  # the layers in `value` learn
            for model in (ours, ref):
                for i, layer in enumerate(model):
                    layer.requires_grad_(i in value)
                model(x).float().pow(2).mean().backward()
            opt.step()
            hand.step()
            ours.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
        elif kind == "write":  # a weight written in place (fill, as a user's fix-up would)
            for model in (ours, ref):
                with torch.no_grad():
                    list(model.parameters())[value].mul_(0.5).add_(0.25)
            hand.written.add(list(ref.parameters())[value])
        else:  # weights loaded into one layer (load_state_dict copies in place)
            saved = {
                k: torch.full_like(v, 0.1 * (t + 1)) for k, v in ours[value].state_dict().items()
            }
            ours[value].load_state_dict(saved)
            ref[value].load_state_dict(saved)
            hand.written.update(ref[value].parameters())
        for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.view(torch.int16), q.view(torch.int16)), (t, kind, name)


# -- drop_state clears .grad ---------------------------------------------------------------------
@FEW
@given(
    data=st.data(),
    optimizer=st.sampled_from(["sgd", "adamw"]),
    set_to_none=st.booleans(),
)
def test_dropped_parameters_keep_still_and_restart_like_new_ones(
    data, optimizer: str, set_to_none: bool
) -> None:
    """A loop of steps in which random layers learn and random layers' state is dropped: equal,
    step for step, to plain torch with that state popped and .grad set to None by hand."""
    torch.manual_seed(0)
    ours = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)]).double()
    ref = copy.deepcopy(ours)
    make = {
        # rates small enough that no drawn loop diverges (NaN weights never compare equal)
        "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=0.1),
        "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
    }[optimizer]
    opt, ref_opt = make(ours), make(ref)
    steps = data.draw(
        st.lists(
            st.tuples(st.sets(st.integers(0, 3), min_size=1), st.sets(st.integers(0, 3))),
            min_size=2,
            max_size=6,
        )
    )
    for t, (learning, dropped) in enumerate(steps):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(t), dtype=torch.float64)
        for model in (ours, ref):
            for i, layer in enumerate(model):
                layer.requires_grad_(i in learning)
            model(x).pow(2).mean().backward()  # a sum diverges (nan) in some loops
        opt.step()
        ref_opt.step()
        for optim in (opt, ref_opt):  # zeros left on every layer with set_to_none=False
            optim.zero_grad(set_to_none=set_to_none)
        freed = gg.optim.drop_state(opt, [p for i in sorted(dropped) for p in ours[i].parameters()])
        held = 0
        for i in dropped:  # by hand: the state goes, and the .grad (a zero would step it)
            for p in ref[i].parameters():
                state = ref_opt.state.pop(p, {})
                held += sum(v.numel() * v.element_size() for v in state.values()
                            if isinstance(v, torch.Tensor))  # fmt: skip
                p.grad = None
        assert freed == held, t
        for i in dropped:
            assert all(p.grad is None and p not in opt.state for p in ours[i].parameters()), t
        same_params(ours, ref, t)
        assert all(p.isfinite().all() for p in ours.parameters()), t  # a real comparison
        resting = [p for i in dropped for p in ours[i].parameters()]
        before = [p.detach().clone() for p in resting]
        opt.step()  # a step with no backward: the zeros left step, the dropped stay still
        ref_opt.step()
        assert all(map(torch.equal, resting, before)), t
        same_params(ours, ref, t)


# -- the gap freeze: code between the blocks, before the first learner ---------------------------
class Between(nn.Module):
    """Blocks with code of the root's own between them: a LayerNorm, a bare scale parameter
    and a Linear (attributes, not list members), each after the blocks ``after`` names."""

    def __init__(self, n: int, after: dict[int, str]) -> None:
        super().__init__()
        torch.manual_seed(n)
        self.stem = nn.Linear(3, W)
        self.blocks = nn.ModuleList(Residual() for _ in range(n))
        self.norm = nn.LayerNorm(W)
        self.scale = nn.Parameter(torch.rand(W) + 0.5)
        self.mix = nn.Linear(W, W)
        self.head = nn.Linear(W, 2)
        self.after = after

    def between(self, i: int, h: torch.Tensor) -> torch.Tensor:
        kind = self.after.get(i)
        if kind == "norm":
            return self.norm(h)
        if kind == "scale":
            return h * self.scale
        if kind == "mix":
            return h + torch.tanh(self.mix(h))
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for i, block in enumerate(self.blocks):
            h = self.between(i, block(h))
        return self.head(h)

    def by_hand(self, x: torch.Tensor, learn: set[int] | None) -> torch.Tensor:
        """No graph before the first learner, code between the blocks included; blocks that do
        not learn frozen after it; the code after a block learns from the first learner on
        (and after the last block always)."""
        n = len(self.blocks)
        first = 0 if learn is None else min(learn, default=n)
        with torch.set_grad_enabled(learn is None):
            h = self.stem(x)
        for i, block in enumerate(self.blocks):
            block.requires_grad_(learn is None or i in learn)
            with torch.set_grad_enabled(i >= first):
                h = block(h)
            with torch.set_grad_enabled(i >= first or i == n - 1):
                h = self.between(i, h)
        return self.head(h).pow(2).sum()


def gap_case(n: int, data, kind: str) -> tuple[Between, set[int] | None, dict[str, object]]:
    kinds = st.sampled_from(["norm", "scale", "mix"])
    after = data.draw(st.dictionaries(st.integers(0, n - 1), kinds))
    plan: dict[str, object] = {}
    learn: set[int] | None = None
    if kind == "depth":
        plan["depth"] = depth = data.draw(st.integers(0, n))
        learn = set(range(n - depth, n))
    elif kind == "learn":
        plan["learn"] = learn = data.draw(st.sets(st.integers(0, n - 1), min_size=1))
    if learn and min(learn) > 0 and data.draw(st.booleans()):  # code right before the learner
        after[min(learn) - 1] = data.draw(kinds)
    return Between(n, after).double(), learn, plan


def gap_mismatches(model: Between, ref: Between) -> list[str]:
    wrong = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if q.grad is None or (name.startswith("blocks.") and not q.requires_grad):
            if p.grad is not None:
                wrong.append(name)
        elif p.grad is None or not torch.allclose(p.grad, q.grad):
            wrong.append(name)
    return wrong


@FEW
@given(
    n=st.integers(2, 4),
    data=st.data(),
    kind=st.sampled_from(["depth", "learn", "none"]),
)
def test_code_between_the_blocks_learns_exactly_from_the_first_learner_on(n, data, kind) -> None:
    model, learn, plan = gap_case(n, data, kind)
    ref = copy.deepcopy(model)
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    with gg.BackpropGate(model, "blocks.*") as gate:
        for field, value in plan.items():
            setattr(gate, field, value)
        model(x)  # a first forward shows where the code between the blocks runs
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(x).pow(2).sum().backward()
    ref.by_hand(x, learn).backward()
    assert gap_mismatches(model, ref) == []


@FEW
@given(n=st.integers(2, 4), data=st.data(), kind=st.sampled_from(["depth", "learn"]))
def test_at_the_first_forward_code_between_the_blocks_is_exact_or_said(n, data, kind) -> None:
    """With no forward before, code of the model's own run just before the first learner is
    taken for code after the blocks: it learns in that step, and the backward says so."""
    model, learn, plan = gap_case(n, data, kind)
    ref = copy.deepcopy(model)
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    with gg.BackpropGate(model, "blocks.*") as gate:
        for field, value in plan.items():
            setattr(gate, field, value)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model(x).pow(2).sum().backward()
    ref.by_hand(x, learn).backward()
    wrong = gap_mismatches(model, ref)
    said = [str(w.message) for w in seen if issubclass(w.category, gg.BlockCallWarning)]
    assert [w.category for w in seen if not issubclass(w.category, gg.BlockCallWarning)] == []
    assert bool(wrong) == bool(said), (wrong, said)
    assert all(name.partition(".")[0] in ("norm", "scale", "mix") for name in wrong)
    assert all(f"{name!r}" in said[0] for name in wrong if len(wrong) < 3)


# -- BAdam's resting order ------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 7),
    switch_every=st.integers(1, 4),
    order=st.sampled_from(["random", "ascending", "descending"]),
    seed=st.integers(0, 10**6),
    data=st.data(),
)
def test_badam_rotates_every_block_once_per_cycle_and_rests_the_others(
    n, switch_every, order, seed, data
) -> None:
    always = data.draw(st.sets(st.integers(0, n - 1), max_size=n - 1))
    rotation = [i for i in range(n) if i not in always]
    sched = gg.schedules.BAdam(n, switch_every, order=order, always=always, seed=seed)
    m = len(rotation)
    cycles = 3
    active = [sched.active(step) for step in range(cycles * m * switch_every)]
    windows = active[::switch_every]
    for step, block in enumerate(active):  # constant within a window
        assert block == windows[step // switch_every]
        assert sched.resting(step) == frozenset(rotation) - {block}
        assert sched.plan(step).learn == frozenset({block, *always})
    for c in range(cycles):  # each cycle: every rotating block once
        cycle = windows[c * m : (c + 1) * m]
        assert sorted(cycle) == rotation
        if order == "ascending":
            assert cycle == rotation
        if order == "descending":
            assert cycle == rotation[::-1]
    if m > 1:  # the block changes at every switch, also from one cycle to the next
        assert all(a != b for a, b in itertools.pairwise(windows))
    again = gg.schedules.BAdam(n, switch_every, order=order, always=always, seed=seed)
    steps = list(range(len(active)))[::-1]  # asked in another order: the same answers
    assert [again.active(s) for s in steps] == active[::-1]


# -- Importance's weights ------------------------------------------------------------------------
@FEW
@given(
    steps=st.integers(1, 4),
    decay=st.floats(0.0, 0.95),
    floor=st.floats(0.0, 1.0),
    temperature=st.floats(0.2, 5.0),
    seed=st.integers(0, 1000),
)
def test_importance_weights_are_the_misa_formula_of_the_observed_gradients(
    steps, decay, floor, temperature, seed
) -> None:
    """Scores: the EMA of each drawn module's gradient RMS, read here from the gradients;
    weights: floor / B + (1 - floor) * score ** (1 / T) / sum, an unobserved module counted as
    the best observed, computed in numpy."""
    torch.manual_seed(seed)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
                          for _ in range(3)])  # fmt: skip
    gate = gg.BackpropGate(net)
    sched = gg.schedules.Importance(["*.0", "*.2"], budget=0.35, temperature=temperature,
                                    floor=floor, seed=seed, decay=decay)  # fmt: skip
    ema: dict[str, float | None] = {}
    for step in range(steps):
        plan = sched.apply(gate, step)
        net(torch.randn(4, 3)).pow(2).sum().backward()
        sched.observe(net)
        for name in plan.learn:
            grads = [p.grad.double() for p in net.get_submodule(name).parameters()]
            rms = math.sqrt(
                sum(g.square().sum().item() for g in grads) / sum(g.numel() for g in grads)
            )
            old = ema.get(name)
            ema[name] = rms if old is None else decay * old + (1 - decay) * rms
        net.zero_grad(set_to_none=True)
    gate.remove()
    names = sched.candidates
    assert {k: v for k, v in sched.scores.items() if v is not None} == pytest.approx(ema, rel=1e-5)
    observed = [ema[k] for k in names if k in ema]
    best = max(observed)
    scores = np.array([ema.get(k, best) for k in names], dtype=np.float64)
    powered = scores ** (1 / temperature) if scores.any() else np.ones_like(scores)
    expected = floor / len(names) + (1 - floor) * powered / powered.sum()
    assert [sched.weights[k] for k in names] == pytest.approx(list(expected), rel=1e-4, abs=1e-9)


# -- Spectrum's SNR -------------------------------------------------------------------------------
def spectrum_by_hand(matrix: np.ndarray) -> float:
    """Hartford et al. 2024: singular values above the Marchenko-Pastur edge over those at or
    below it, over the largest; sigma from the interquartile range."""
    values = np.linalg.svd(matrix.astype(np.float64), compute_uv=False)
    rows, cols = matrix.shape
    sigma = (np.quantile(values, 0.75) - np.quantile(values, 0.25)) / 1.349
    edge = sigma * (1 + math.sqrt(min(rows, cols) / max(rows, cols)))
    signal, noise = values[values > edge].sum(), values[values <= edge].sum()
    if values[0] == 0:
        return 0.0
    return math.inf if noise == 0 else float(signal / noise / values[0])


@FEW
@given(
    shapes=st.lists(st.tuples(st.integers(2, 24), st.integers(2, 24)), min_size=1, max_size=4),
    rank=st.integers(0, 3),
    strength=st.floats(0.0, 20.0),
    seed=st.integers(0, 1000),
)
def test_snr_is_spectrums_formula_computed_directly(shapes, rank, strength, seed) -> None:
    generator = np.random.default_rng(seed)
    layers = []
    for rows, cols in shapes:  # noise plus a planted low-rank signal
        matrix = generator.standard_normal((rows, cols))
        for _ in range(rank):
            matrix += (
                strength
                * np.outer(generator.standard_normal(rows), generator.standard_normal(cols))
                / math.sqrt(rows * cols)
            )
        layer = nn.Linear(cols, rows, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(matrix))
        layers.append(layer)
    model = nn.Sequential(*layers)
    scores = gg.choose.snr(model, progress=False)
    for name, layer in zip(scores, layers, strict=True):
        matrix = layer.weight.detach().numpy()
        values = np.linalg.svd(matrix.astype(np.float64), compute_uv=False)
        sigma = (np.quantile(values, 0.75) - np.quantile(values, 0.25)) / 1.349
        edge = sigma * (1 + math.sqrt(min(matrix.shape) / max(matrix.shape)))
        assume(np.abs(values - edge).min() > 1e-4 * values[0])  # float32 cannot split a tie
        expected = spectrum_by_hand(matrix)
        if math.isinf(expected):
            assert math.isinf(scores[name]), name
        else:
            assert scores[name] == pytest.approx(expected, rel=1e-4), name
