"""``gg.learning(model)``: what learns under the current plan equals what a real backward gives a
``.grad``, on every zoo architecture, at depths, learning sets, skips and freezes; its table;
and no module above the cut reads a gate's fields (see test_layout)."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import REAL_MODELS
from models.zoo import ZOO
from torch import nn

import gradgate as gg

# zoo models whose blocks can be skipped (residual blocks that keep their shape) and whose every
# parameter keeps a path to the loss when all of one stack skips (not an encoder whose output
# reaches the loss only through the decoder blocks' cross-attention)
RESIDUAL = {"clip", "llama", "mistral", "qwen2", "gemma", "vit", "gpt2_tied"}


@functools.cache
def _built(name: str) -> tuple[nn.Module, Any, Any, Any]:
    """A zoo (or real) model in float64 and eval mode (every block runs), its batch, loss and
    blocks=, and the names of the parameters full backprop reaches."""
    torch.manual_seed(0)
    if name in ZOO:
        entry = ZOO[name]
        model, loss, blocks = entry.build(), entry.loss, entry.blocks
        batch = entry.batch(0)
    else:
        model, batch, loss = OURS[name]()
        blocks = None
    model = model.double().eval()
    batch = _double(batch)
    reached = _reached(model, batch, loss)
    return model, batch, loss, (blocks, reached)


def _double(batch: Any) -> Any:
    if isinstance(batch, dict):
        return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    return batch.double()


def _reached(model: nn.Module, batch: Any, loss: Any) -> frozenset[str]:
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss(model, batch), list(named.values()), allow_unused=True)
    return frozenset(n for n, g in zip(named, grads, strict=True) if g is not None)


def _learned(name: str, plan: dict[str, Any], *, seen: bool, frozen: list[str]) -> None:
    """Set ``plan`` on a gate over a copy of the model, compare gg.learning with a backward."""
    base, batch, loss, (blocks, reached) = _built(name)
    model = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gg.GradgateWarning)  # tied weights, blocks run reversed
        gate = gg.BackpropGate(model, blocks)
        if seen:  # a first forward shows the gate where the embeddings and heads run
            loss(model, batch)
        for option, value in plan.items():
            setattr(gate, option, value)
        handle = gg.freeze(model, *frozen) if frozen else None
        predicted = gg.learning(model)
        out = loss(model, batch)
        if out.requires_grad:
            out.backward()
        got = {n for n, p in model.named_parameters() if p.grad is not None}
        if handle is not None:
            handle.undo()
        gate.remove()
    expected = set(predicted.names) & reached
    assert got == expected, (name, plan, seen, frozen, sorted(got ^ expected))
    assert predicted.count == sum(
        p.numel() for n, p in model.named_parameters() if n in set(predicted.names)
    )


OURS = {**REAL_MODELS, "gpt2_tied": functools.partial(REAL_MODELS["gpt2"], tied=True)}
NAMES = [*sorted(ZOO), "gpt2_tied", "bert", "cnn_bn", "long_skip"]


def _every_depth(name: str, seen: bool) -> None:
    model, _, _, (blocks, _) = _built(name)
    n = len(gg.blocks(model) if blocks is None else gg.select(model, *blocks))
    for depth in sorted({0, 1, n // 2, n}):
        _learned(name, {"depth": depth}, seen=seen, frozen=[])
    _learned(name, {"depth": None}, seen=seen, frozen=[])


@pytest.mark.parametrize("name", ["clip", "two_towers", "long_skip"])
def test_learning_equals_the_backward_at_every_depth(name: str) -> None:
    _every_depth(name, seen=False)  # before any forward: what the model's code says


@pytest.mark.slow
@pytest.mark.parametrize("seen", [True, False], ids=["after a forward", "before any forward"])
@pytest.mark.parametrize("name", NAMES)
def test_learning_equals_the_backward_at_every_depth_on_the_whole_zoo(
    name: str, seen: bool
) -> None:
    _every_depth(name, seen)


def test_learning_sets_skips_and_freezes_on_a_tied_gpt2() -> None:
    plans: list[dict[str, Any]] = [
        {"learn": {0, "lm_head"}},
        {"learn": {2}, "skip": {1}},
        {"learn": {"transformer.h.1.ln_1", "transformer.wte"}},
        {"depth": 2, "skip": {2}},
    ]
    for plan in plans:
        _learned("gpt2_tied", plan, seen=True, frozen=["transformer.h.2.mlp"])


def test_without_a_gate_it_is_the_requires_grad_view_and_prints_a_table() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    net[0].bias.requires_grad_(False)
    found = gg.learning(net)
    assert dict(found) == {"0": 12, "2": 10}
    assert (found.count, found.total, found.blocks) == (22, 26, {})
    assert found.names == ["0.weight", "2.weight", "2.bias"]
    assert found.learns("0.weight") and not found.learns(net[0].bias)
    assert (
        str(found)
        == repr(found)
        == (
            "module  learning  of\n"
            "0             12  16\n"
            "2             10  10\n"
            "learning 22 of 26 parameters (84.62%) under no gate: requires_grad only"
        )
    )
    with pytest.raises(gg.InvalidOptionError, match=r"learns\('0.wieght'\): no parameter of"):
        found.learns("0.wieght")
    with pytest.raises(AttributeError):
        found.within("3")


def test_nested_gates_both_count_and_the_blocks_are_named_from_the_model() -> None:
    inner = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    outer = nn.Sequential(nn.Linear(2, 2), inner, nn.Linear(2, 1))
    gates = [gg.BackpropGate(inner, depth=2), gg.stop_gradient_at(outer, "1")]
    found = gg.learning(outer)
    assert list(found) == ["1.2", "1.3", "2"]
    assert found.blocks == {"1.2": 6, "1.3": 6, "1": 12}
    outer(torch.randn(3, 2)).sum().backward()
    assert {n for n, p in outer.named_parameters() if p.grad is not None} == set(found.names)
    for gate in gates:
        gate.remove()
    assert gg.learning(outer).count == sum(p.numel() for p in outer.parameters())


def test_a_named_container_with_no_forward_learns_through_its_members() -> None:
    """``learn`` naming a ``ModuleList`` inside a block (never called itself, so its hook could
    not open the cut): its members open it (failed first: nothing in it learned)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
            self.rest = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for part in self.parts:
                x = part(x)
            return self.rest(x)

    net = nn.Sequential(Block(), Block(), nn.Linear(2, 1))
    gate = gg.BackpropGate(net, ["0", "1"])
    gate.learn = {"0.parts"}
    assert gate.learn == frozenset({"0.parts.0", "0.parts.1"})
    net(torch.randn(3, 2)).sum().backward()
    learned = {n for n, p in net.named_parameters() if p.grad is not None}
    assert learned == {"0.parts.0.weight", "0.parts.0.bias", "0.parts.1.weight", "0.parts.1.bias",
                       "2.weight", "2.bias"}  # fmt: skip
    assert learned == set(gg.learning(net).names)
    gate.remove()


@pytest.mark.slow
@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_learning_equals_the_backward_for_any_plan(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(NAMES), label="model")
    model, _, _, (blocks, _) = _built(name)
    n = len(gg.blocks(model) if blocks is None else gg.select(model, *blocks))
    positions = st.sets(st.integers(0, n - 1), max_size=n)
    plan: dict[str, Any] = {}
    kind = data.draw(st.sampled_from(["depth", "learn", "none"]), label="kind")
    if kind == "depth":
        plan["depth"] = data.draw(st.integers(0, n), label="depth")
    elif kind == "learn":
        block_names = gg.blocks(model) if blocks is None else gg.select(model, *blocks)
        modules = [  # any module that holds no block: an embedding, a head, a norm in a block
            m
            for m, module in model.named_modules()
            if m
            and not any(b == m or b.startswith(f"{m}.") for b in block_names)
            and any(True for _ in module.parameters())
        ]
        names = data.draw(st.sets(st.sampled_from(modules), max_size=1), label="named")
        plan["learn"] = data.draw(positions, label="learn") | names
    if name in RESIDUAL:
        plan["skip"] = data.draw(positions, label="skip")
    leaves = sorted({n.rpartition(".")[0] for n, _ in model.named_parameters()} - {""})
    frozen = data.draw(st.lists(st.sampled_from(leaves), max_size=2, unique=True), label="freeze")
    seen = data.draw(st.booleans(), label="seen")
    _learned(name, plan, seen=seen, frozen=frozen)
