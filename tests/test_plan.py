"""Any set of blocks learns (``gate.learn``), and residual blocks skip backward (``gate.skip``).

References are written by hand with plain autograd: the prefix under ``torch.no_grad``,
non-learning blocks after the cut with ``requires_grad=False``, skipped blocks as
``x + f(x).detach()`` (DropBP).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from measure import forward_and_backward
from models import gpt2
from torch import nn

import gradgate as gg

N = 5


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(6, 6), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 6)
        self.blocks = nn.ModuleList(Residual() for _ in range(N))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _ideal(model: Net, x: torch.Tensor, learn: set[int], skip: set[int]) -> torch.Tensor:
    """The plan written by hand."""
    opened = sorted(learn - skip)
    first = opened[0] if opened else N
    with torch.no_grad():
        h = model.embed(x)
        for block in model.blocks[:first]:
            h = block(h)
    for i in range(first, N):
        block = model.blocks[i]
        if i in skip:  # DropBP: x + f(x).detach(), with f run without a graph at all
            with torch.no_grad():
                fh = block.f(h)
            h = h + fh
        elif i in learn:
            h = block(h)
        else:
            block.requires_grad_(False)
            h = block(h)
            block.requires_grad_(True)
    return model.head(h).pow(2).sum()


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@settings(max_examples=60, deadline=None)
@given(
    learn=st.sets(st.integers(0, N - 1)),
    skip=st.sets(st.integers(0, N - 1)),
    seed=st.integers(0, 2**16),
)
def test_any_learn_and_skip_plan_equals_the_hand_written_reference(
    learn: set[int], skip: set[int], seed: int
) -> None:
    torch.manual_seed(seed)
    model = Net().double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    _ideal(reference, x, learn, skip).backward()
    gate = gg.BackpropGate(model)
    gate.learn, gate.skip = learn, skip
    model(x).pow(2).sum().backward()
    gate.remove()
    got, want = _grads(model), _grads(reference)
    assert {n for n, g in got.items() if g is not None} == {
        n for n, g in want.items() if g is not None
    }
    for name, grad in got.items():
        if grad is not None:
            torch.testing.assert_close(grad, want[name], msg=name)
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(
    ("learn", "skip"), [({1, 3}, set()), ({0, 4}, {2}), (set(), {3}), ({2}, {2, 4})]
)
def test_plans_cost_what_the_hand_written_ideal_costs(learn: set[int], skip: set[int]) -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 3)
    gate = gg.BackpropGate(model)
    gate.learn, gate.skip = learn, skip
    model(x).pow(2).sum().backward()  # a skipped block's first call keeps its graph: the check
    gated = forward_and_backward(lambda: model(x).pow(2).sum())
    gate.remove()
    assert gated == forward_and_backward(lambda: _ideal(model, x, learn, skip))
    full = forward_and_backward(lambda: model(x).pow(2).sum())
    assert gated[0] < full[0] and gated[1] < full[1]


def test_learn_on_a_real_gpt2_with_a_module_name() -> None:
    model, batch, loss_fn = gpt2(layers=4)
    reference = copy.deepcopy(model)
    named = dict(reference.named_parameters())
    full = dict(
        zip(
            named, torch.autograd.grad(loss_fn(reference, batch), list(named.values())), strict=True
        )
    )
    gate = gg.BackpropGate(model)
    gate.learn = {"transformer.wte", 2}
    assert gate.learn == frozenset({2, "transformer.wte"}) and gate.depth is None
    loss_fn(model, batch).backward()
    learned = {n for n, p in model.named_parameters() if p.grad is not None}
    blocks_learning = {n.split(".")[2] for n in learned if n.startswith("transformer.h.")}
    assert blocks_learning == {"2"}
    assert {"transformer.wte.weight", "lm_head.weight", "transformer.ln_f.weight"} <= learned
    assert "transformer.wpe.weight" not in learned  # runs after wte, not in the learning set
    for name in learned:
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, full[name], msg=name)
    gate.depth = 1  # a depth replaces the learning set
    assert gate.learn is None
    gate.remove()


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.l2(torch.tanh(self.l1(h)))


class Nested(nn.Module):
    """Token and position embeddings, blocks of two layers each, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Linear(3, 6), nn.Linear(3, 6)
        self.blocks = nn.ModuleList(TwoLayers() for _ in range(4))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.mark.parametrize(
    ("learn", "learners"),
    [
        ({"blocks.2.l1"}, {"blocks.2.l1", "head"}),  # a layer inside a block, not its neighbour
        ({"blocks.*.l2"}, {f"blocks.{i}.l2" for i in range(4)} | {"head"}),  # one in each block
        ({"tok", 2}, {"tok", "blocks.2", "head"}),  # pos runs after tok: frozen for the step
        ({"pos", 3}, {"pos", "blocks.3", "head"}),
        ({1, "blocks.3.l2"}, {"blocks.1", "blocks.3.l2", "head"}),
    ],
)
def test_learn_with_module_names_trains_exactly_those_modules(
    learn: set[int | str], learners: set[str]
) -> None:
    torch.manual_seed(0)
    model = Nested()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 3)
    named = dict(reference.named_parameters())
    full = dict(
        zip(named, torch.autograd.grad(reference(x).sum(), list(named.values())), strict=True)
    )
    gate = gg.BackpropGate(model)
    gate.learn = learn
    for _ in range(2):  # the second step: nothing frozen for the first one stays frozen
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        for name, param in model.named_parameters():
            if any(name.startswith(f"{learner}.") for learner in learners):
                torch.testing.assert_close(param.grad, full[name], msg=name)
            else:
                assert param.grad is None, name
    gate.remove()
    assert all(p.requires_grad for p in model.parameters())


NAMES = ["tok", "pos", *(f"blocks.{i}.{layer}" for i in range(4) for layer in ("l1", "l2"))]


@settings(max_examples=80, deadline=None)
@given(
    names=st.sets(st.sampled_from(NAMES)),
    positions=st.sets(st.integers(0, 3)),
    seed=st.integers(0, 2**16),
)
def test_any_learning_set_of_blocks_and_module_names_equals_full_backprop_on_its_learners(
    names: set[str], positions: set[int], seed: int
) -> None:
    torch.manual_seed(seed)
    model = Nested().double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    named = dict(reference.named_parameters())
    full = torch.autograd.grad(reference(x).sum(), list(named.values()))
    gate = gg.BackpropGate(model)
    gate.learn = names | positions
    model(x).sum().backward()
    gate.remove()
    learners = ("head.", *(f"{n}." for n in names), *(f"blocks.{i}." for i in positions))
    for (name, want), param in zip(zip(named, full, strict=True), model.parameters(), strict=True):
        if name.startswith(learners):
            torch.testing.assert_close(param.grad, want, msg=name)
        else:
            assert param.grad is None, name
    assert all(p.requires_grad for p in model.parameters())


def test_skipping_a_block_that_changes_shape_raises() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 1))
    gate = gg.BackpropGate(model, depth=3)
    gate.skip = {1}
    with pytest.raises(gg.BlockCallError, match=r"block '1' cannot be skipped: its output shape"):
        model(torch.randn(2, 3))
    gate.remove()
    assert torch.is_grad_enabled()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("learn", {7}, "learn contains block position 7, out of range"),
        ("learn", {1.5}, "learn contains 1.5 (float)"),
        ("learn", {"nope"}, "'nope' matches no module"),
        ("skip", {"blocks.1"}, "skip contains 'blocks.1' (str)"),
        ("learn", 3.0, "learn=3.0 is not a set"),
        ("learn", {"blocks"}, "learn='blocks' names the container of the blocks"),
        ("learn", {1, "blocks"}, "name the blocks themselves ('blocks.*', positions) or use depth"),
    ],
)
def test_bad_plans_are_rejected_and_the_plan_is_unchanged(
    field: str, value: object, message: str
) -> None:
    gate = gg.BackpropGate(Net(), depth=2)
    with pytest.raises(gg.GradgateError, match=re.escape(message)):
        setattr(gate, field, value)
    assert gate.depth == 2 and gate.skip == frozenset()
    gate.remove()


@pytest.mark.parametrize("plans", [({0}, {3}), ({3}, {0}), ({1, 2}, {2}), ({4}, {0, 4})])
def test_two_forwards_with_different_learning_sets_then_one_backward(plans) -> None:
    # Micro-batches with their own plans and one backward of the summed loss: each block gets
    # the gradient of the forwards in which it learned (plain autograd on the unmodified model).
    torch.manual_seed(0)
    model = Net().double()
    reference = copy.deepcopy(model)
    xs = [torch.randn(3, 3, dtype=torch.float64) for _ in plans]
    gate = gg.BackpropGate(model, "blocks.*")
    losses = []
    for learn, x in zip(plans, xs, strict=True):
        gate.learn = learn
        losses.append(model(x).pow(2).sum())
    sum(losses).backward()
    gate.remove()
    for i in range(N):
        params = list(reference.blocks[i].parameters())
        expected = [torch.zeros_like(p) for p in params]
        for learn, x in zip(plans, xs, strict=True):
            if i in learn:
                grads = torch.autograd.grad(reference(x).pow(2).sum(), params)
                expected = [e + g for e, g in zip(expected, grads, strict=True)]
        if not any(i in learn for learn in plans):
            assert all(p.grad is None for p in model.blocks[i].parameters()), i
            continue
        for p, e in zip(model.blocks[i].parameters(), expected, strict=True):
            torch.testing.assert_close(p.grad, e, msg=f"block {i}")


class Gapped(nn.Module):
    """Code between blocks, in the root's forward: a parameter and a norm applied there."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(N))
        self.scale = nn.Parameter(torch.full((6,), 1.5))
        self.mid = nn.LayerNorm(6)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            h = h + torch.tanh(block(h))
            h = h * self.scale if i == 0 else self.mid(h) if i == 1 else h
        return self.head(h)

    def cut_by_hand(self, x: torch.Tensor, first: int) -> torch.Tensor:
        with torch.no_grad():
            h = self.embed(x)
            for i in range(first):
                h = h + torch.tanh(self.blocks[i](h))
                h = h * self.scale if i == 0 else self.mid(h) if i == 1 else h
        for i in range(first, N):
            h = h + torch.tanh(self.blocks[i](h))
            h = h * self.scale if i == 0 else self.mid(h) if i == 1 else h
        return self.head(h)


@pytest.mark.parametrize("plan", [{"depth": 3}, {"depth": 2}, {"learn": {2, 4}}, {"learn": {3}}])
def test_code_between_the_cut_off_blocks_and_the_first_learner_does_not_learn(plan) -> None:
    # README: a cut is a point before which no graph is recorded; at depth k it is the input of
    # the first learning block, so a scale or norm applied just before it neither learns nor
    # saves activations (the hand-written cut: that code under no_grad).
    torch.manual_seed(0)
    model = Gapped().double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    with gg.BackpropGate(model, "blocks.*") as gate:
        for field, value in plan.items():
            setattr(gate, field, value)
        model(x).sum()  # a first forward shows that `mid` runs between blocks, not after them
        model(x).pow(2).sum().backward()
    learning = set(range(N - plan["depth"], N)) if "depth" in plan else plan["learn"]
    first = min(learning)
    reference.cut_by_hand(x, first).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        block = int(name.split(".")[1]) if name.startswith("blocks.") else None
        if (block is not None and block not in learning) or q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


LEARN_ITEMS = [
    *range(N),
    *(f"blocks.{i}" for i in range(N)),
    "blocks.2.f",  # the whole inside of block 2
    "blocks.3.f.0",  # one layer inside block 3
    "blocks.*.f.0",  # that layer in every block
    "embed",
    "blocks",  # the container: refused
]


def _learners(model: Net, items: set) -> set[str]:
    """Parameter names a learning set trains (the semantics, written out): named blocks and
    modules, and the head (it runs after the last block)."""
    names = {"head.weight", "head.bias"}
    for item in items:
        prefix = f"blocks.{item}." if isinstance(item, int) else f"{item}."
        names |= {n for n, _ in model.named_parameters() if n.startswith(prefix)}
        if item == "blocks.*.f.0":
            names |= {n for n, _ in model.named_parameters() if ".f.0." in n}
    return names


@settings(max_examples=60, deadline=None)
@given(
    plans=st.lists(
        st.sets(st.sampled_from(LEARN_ITEMS), min_size=1, max_size=3), min_size=1, max_size=3
    ),
    seed=st.integers(0, 2**16),
)
def test_forwards_with_learning_sets_of_positions_and_names_then_one_backward(
    plans: list[set], seed: int
) -> None:
    # Several forwards, each with its own learning set (positions, names of blocks, of modules
    # inside blocks, of the container), then one backward of the summed loss: every parameter
    # gets the sum of the plain-autograd gradients of the forwards in which it learned.
    torch.manual_seed(seed)
    model = Net().double()
    reference = copy.deepcopy(model)
    xs = [torch.randn(3, 3, dtype=torch.float64) for _ in plans]
    gate = gg.BackpropGate(model, "blocks.*")
    losses, used = [], []
    for items, x in zip(plans, xs, strict=True):
        if "blocks" in items:
            before = gate.learn
            with pytest.raises(gg.InvalidDepthError, match="names the container of the blocks"):
                gate.learn = items
            assert gate.learn == before
            continue
        gate.learn = items
        losses.append(model(x).pow(2).sum())
        used.append((items, x))
    if losses:
        sum(losses).backward()
    gate.remove()
    assert all(p.requires_grad for p in model.parameters())
    params = dict(reference.named_parameters())
    expected: dict[str, torch.Tensor] = {}
    for items, x in used:
        names = sorted(_learners(reference, items))
        grads = torch.autograd.grad(reference(x).pow(2).sum(), [params[n] for n in names])
        for name, grad in zip(names, grads, strict=True):
            expected[name] = expected.get(name, 0) + grad
    for name, param in model.named_parameters():
        if name not in expected:
            assert param.grad is None, name
        else:
            torch.testing.assert_close(param.grad, expected[name], msg=name)
