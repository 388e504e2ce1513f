"""Traps around the cut that a new user still hit (issue 37): a gate on one block of a bigger
model, a plan that cannot act, code between the blocks before the first learner, the fused
encoder path under a dispatch mode, ``skip`` given one integer, block positions at the
boundaries, and a tied head under a learning set.

Gradients are checked against plain autograd on a hand-written cut of an unmodified copy; costs
against ``gg.audit`` (or ``FlopCounterMode``) of the same hand-written cut.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable

import models
import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gradgate as gg


class Residual(nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Stack(nn.Module):
    def __init__(self, n: int = 4, width: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, width)
        self.blocks = nn.ModuleList(Residual(width) for _ in range(n))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _learned(model: nn.Module) -> set[str]:
    return {name for name, param in model.named_parameters() if param.grad is not None}


# -- item 3: a gate on one block of a bigger model ---------------------------------------------
def test_a_gate_on_one_block_whose_input_carries_a_graph_warns_naming_the_model() -> None:
    model = Stack()
    gate = gg.BackpropGate(model.blocks[3], ["mlp.0", "mlp.2"], depth=1)
    x = torch.randn(2, 3)
    with pytest.warns(gg.PlanNotAppliedWarning) as caught:
        model(x).sum().backward()
    message = str(caught[0].message)
    assert "input already carries a graph" in message
    assert "'blocks.3' of Stack" in message and "gg.BackpropGate(model" in message
    # what it says: the blocks before it learned fully
    assert {"blocks.0.mlp.0.weight", "embed.weight"} <= _learned(model)
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()  # said once per gate
    gate.remove()


def test_a_pasted_block_list_inside_one_gpt2_block_warns() -> None:
    model, batch, loss_fn = models.gpt2(layers=3)
    block = model.transformer.h[2]
    gate = gg.BackpropGate(block, blocks=["ln_1", "attn", "ln_2"], depth=1)
    with pytest.warns(gg.PlanNotAppliedWarning, match=re.escape("'transformer.h.2' of GPT2")):
        loss_fn(model, batch).backward()
    assert model.transformer.h[0].attn.c_attn.weight.grad is not None  # as the warning says
    gate.remove()


@pytest.mark.parametrize("how", ["no graph", "a leaf", "no grad", "no plan"])
def test_a_gated_model_whose_input_has_nothing_before_it_is_silent(how: str) -> None:
    model = Stack()
    gate = gg.BackpropGate(model, blocks="blocks.*", depth=None if how == "no plan" else 1)
    x = torch.randn(2, 3, requires_grad=how == "a leaf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if how == "no grad":
            with torch.no_grad():
                model(x)
        else:
            model(x).sum().backward()
    gate.remove()


# -- item 4: a plan that cannot act -----------------------------------------------------------
def test_a_depth_context_around_a_backward_whose_forward_ran_before_warns() -> None:
    model = Stack()
    loss = model(torch.randn(2, 3)).sum()
    with (
        pytest.warns(gg.PlanNotAppliedWarning, match="no forward of Stack ran inside it"),
        gg.backprop_depth(model, 1, blocks="blocks.*"),
    ):
        loss.backward()
    assert "blocks.0.mlp.0.weight" in _learned(model)  # the warning's point: all learned
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gg.backprop_depth(model, 1, blocks="blocks.*"):
            loss = model(torch.randn(2, 3)).sum()
        loss.backward()
        with pytest.raises(ValueError), gg.backprop_depth(model, 1, blocks="blocks.*"):
            raise ValueError  # an exception leaving the block says enough
    assert "blocks.0.mlp.0.weight" not in _learned(model)


@pytest.mark.parametrize("before", [None, 0, 2, "learn"])
def test_a_plan_changed_between_a_forward_and_its_backward_warns(before: object) -> None:
    model = Stack()
    gate = gg.BackpropGate(model, blocks="blocks.*")
    if before == "learn":
        gate.learn = {0, 2}
    else:
        gate.depth = before  # type: ignore[assignment]
    model(torch.randn(2, 3))  # an earlier forward at the same plan, with its backward below
    out = model(torch.randn(2, 3))
    gate.depth = 1
    with pytest.warns(gg.PlanNotAppliedWarning, match="changed after a forward"):
        out.sum().backward()
    # the backward followed the plan its forward ran under (block 3 learns only under it)
    learned_3 = "blocks.3.mlp.0.weight" in _learned(model)
    assert learned_3 == (before is None or before == 2)
    gate.remove()


def test_a_loop_that_sets_the_plan_after_each_backward_is_silent() -> None:
    model = Stack()
    gate = gg.BackpropGate(model, blocks="blocks.*")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for depth in [None, 0, 2, 0, None, 3, 1, None, 2]:
            loss = model(torch.randn(2, 3)).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            gate.depth = depth  # loss (and its graph's nodes) still alive here
        # micro-batches with their own plans, one backward of the summed loss
        losses = [model(torch.randn(2, 3)).sum()]
        gate.learn = {1}
        losses.append(model(torch.randn(2, 3)).sum())
        sum(losses).backward()
        # a plan set and set back before the backward changes nothing
        gate.depth = 2
        out = model(torch.randn(2, 3))
        gate.depth, gate.depth = 1, 2
        out.sum().backward()
    gate.remove()


# -- item 5: code between the blocks, before the first learner -------------------------------
class Normed(nn.Module):
    """Each block followed, in the model's own loop, by a scale row and a LayerNorm."""

    def __init__(self, n: int = 4, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(n))
        self.scales = nn.ParameterList(nn.Parameter(torch.rand(width) + 0.5) for _ in range(n))
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = self.norms[i](torch.tanh(block(x)) * self.scales[i])
        return self.head(x)


def _normed_ideal(model: Normed, x: torch.Tensor, first: int, only: bool) -> torch.Tensor:
    """The hand-written cut: blocks before ``first`` and the code after each of them under
    no_grad (at depth 0 only the last block: what runs after it learns); with ``only``, the
    blocks after ``first`` frozen (a learning set of one block)."""
    n = len(model.blocks)
    for block in model.blocks[first + 1 :] if only else ():
        block.requires_grad_(False)
    upto = min(first, n - 1)
    with torch.no_grad():
        for i in range(upto):
            x = model.norms[i](torch.tanh(model.blocks[i](x)) * model.scales[i])
        if first == n:
            x = model.blocks[n - 1](x)
    if first == n:
        return model.head(model.norms[n - 1](torch.tanh(x) * model.scales[n - 1]))
    for i in range(first, n):
        x = model.norms[i](torch.tanh(model.blocks[i](x)) * model.scales[i])
    return model.head(x)


@pytest.mark.parametrize(
    ("field", "value", "first"),
    [("depth", 1, 3), ("depth", 2, 2), ("learn", {3}, 3), ("depth", 0, 4), ("learn", {1}, 1)],
)
def test_code_between_the_blocks_before_the_first_learner_records_nothing(
    field: str, value: object, first: int
) -> None:
    model = Normed().double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    gate = gg.BackpropGate(model, blocks="blocks.*")
    setattr(gate, field, value)
    with gg.audit(model) as gated:  # the gate's first forward
        model(x).pow(2).sum().backward()
    gate.remove()
    only = field == "learn"
    with gg.audit(reference) as ideal:
        loss = _normed_ideal(reference, x, first, only).pow(2).sum()
        named = {n: p for n, p in reference.named_parameters() if p.requires_grad}
        learners = [n for n in named if _after_cut(n, first, len(model.blocks), only)]
        expected = torch.autograd.grad(loss, [named[n] for n in learners])
    assert _learned(model) == set(learners)
    for name, want in zip(learners, expected, strict=True):
        torch.testing.assert_close(model.get_parameter(name).grad, want, msg=name)
    assert gated.totals["saved_bytes"] == ideal.totals["saved_bytes"]
    assert gated.totals["backward_flops"] == ideal.totals["backward_flops"]


def _after_cut(name: str, first: int, n: int, only: bool) -> bool:
    if name.startswith("head."):
        return True
    index = int(name.split(".")[1])
    if name.startswith("blocks."):  # under a learning set only the named block learns
        return index == first if only else index >= first
    # a norm or scale runs right after its block: it learns from the first learner on (the
    # last one after the last block at depth 0)
    return index >= min(first, n - 1)


class SharedAct(nn.Module):
    """One PReLU, an attribute of the model, applied after every block."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(5, 5) for _ in range(n))
        self.act = nn.PReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.act(block(x))
        return x


def test_a_module_used_after_every_block_learns_only_from_its_uses_after_the_cut() -> None:
    model = SharedAct().double()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 5, dtype=torch.float64)
    gate = gg.BackpropGate(model, blocks="blocks.*", depth=1)
    model(x).pow(2).sum().backward()  # the first forward: its use after block 2 was seen before
    gate.remove()
    with torch.no_grad():
        h = x
        for block in reference.blocks[:3]:
            h = reference.act(block(h))
    loss = reference.act(reference.blocks[3](h)).pow(2).sum()
    want = torch.autograd.grad(loss, [reference.act.weight, reference.blocks[3].weight])
    torch.testing.assert_close(model.act.weight.grad, want[0])
    torch.testing.assert_close(model.blocks[3].weight.grad, want[1])


class Tailed(nn.Module):
    """Heads in a list after the blocks, and a forward that may stop before the last block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(5, 5) for _ in range(4))
        self.heads = nn.ModuleList([nn.Linear(5, 1)])

    def forward(self, x: torch.Tensor, run: int = 4) -> torch.Tensor:
        for block in self.blocks[:run]:
            x = torch.tanh(block(x))
        return self.heads[0](x)


def test_a_listed_module_that_runs_after_the_last_block_that_ran_learns_from_then_on() -> None:
    """Taken for code between the blocks at first sight, it is not once a forward shows it."""
    model = Tailed()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 5)
    gate = gg.BackpropGate(model, blocks="blocks.*", depth=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(x, run=3)  # block 3, the learner, does not run: the head came next
    said = [str(w.message) for w in caught if issubclass(w.category, gg.BlockCallWarning)]
    assert any("'heads.0' ran after the last block that ran" in m for m in said), said
    assert not out.requires_grad
    model(x, run=3).sum().backward()
    with torch.no_grad():
        h = x
        for block in reference.blocks[:3]:
            h = torch.tanh(block(h))
    want = torch.autograd.grad(reference.heads[0](h).sum(), reference.heads[0].weight)[0]
    torch.testing.assert_close(model.heads[0].weight.grad, want)
    assert all(block.weight.grad is None for block in model.blocks)
    gate.remove()


# -- item 9: the fused encoder kernel under a dispatch mode ----------------------------------
def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.TransformerEncoder(layer, 4, enable_nested_tensor=False), nn.Linear(16, 1)
    ).eval()


def _forward_flops(run: Callable[[], torch.Tensor]) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


@pytest.mark.parametrize("depth", [0, 1])
def test_under_a_flop_counter_the_prefix_keeps_the_fused_encoder_kernel(depth: int) -> None:
    """The fused kernel has no FLOP formula: a prefix that leaves it counts every matmul."""
    model, ideal = _encoder(), _encoder()
    x = torch.randn(2, 5, 16)

    def hand_written() -> torch.Tensor:
        layers = ideal[0].layers
        with torch.no_grad():
            h = x
            for layer in layers[: 4 - depth]:
                h = layer(h)
        for layer in layers[4 - depth :]:
            h = layer(h)
        return ideal[1](h)

    gate = gg.BackpropGate(model, depth=depth)
    model(x)  # the hooks settle at the first forward
    assert _forward_flops(lambda: model(x)) == _forward_flops(hand_written)
    with gg.audit(model) as report:  # the audit's own hooks leave the kernel too
        flops = _forward_flops(lambda: model(x))
        model(x).sum().backward()
    assert flops == _forward_flops(hand_written)
    assert report.totals["wgrad"] > 0
    gate.remove()


# -- item 11: skip given one integer ------------------------------------------------------------
@pytest.mark.parametrize("value", [3, torch.tensor(3)])
def test_skip_given_one_integer_refuses_with_the_set_to_write(value: object) -> None:
    model = Stack()
    gate = gg.BackpropGate(model, blocks="blocks.*", depth=2)
    gate.skip = {1}
    with pytest.raises(gg.InvalidDepthError, match=re.escape("gate.skip = {3}")):
        gate.skip = value  # type: ignore[assignment]
    assert gate.skip == {1} and gate.depth == 2  # nothing half-applied
    gate.skip = None
    assert gate.skip == frozenset()
    gate.remove()


# -- item 19: block positions at the boundaries; a tied head under a learning set -----------
@pytest.mark.parametrize("option", ["learn", "skip"])
def test_block_positions_at_the_boundaries(option: str) -> None:
    model = Stack(n=4)
    gate = gg.BackpropGate(model, blocks="blocks.*")
    for bad in (4, -5):
        with pytest.raises(gg.InvalidDepthError, match=f"block position {bad}, out of range"):
            setattr(gate, option, {bad})
        assert getattr(gate, option) in (None, frozenset())
    for good, position in ((-4, 0), (3, 3), (-1, 3), (0, 0)):
        setattr(gate, option, {good})
        assert getattr(gate, option) == {position}
        setattr(gate, option, None)
    gate.remove()


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.f(x))


class TiedEncoderDecoder(nn.Module):
    """The embedding feeds the encoder and the decoder, and is tied to the head."""

    def __init__(self, vocab: int = 11, width: int = 6, n: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.encoder = nn.ModuleList(Block(width) for _ in range(n))
        self.decoder = nn.ModuleList(Block(width) for _ in range(n))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        h = self.embed(src)
        for block in self.encoder:
            h = block(h)
        d = self.embed(tgt) + h.mean(1, keepdim=True)
        for block in self.decoder:
            d = block(d)
        return self.head(d)


def _tied_reference(model: TiedEncoderDecoder, src, tgt, learn: set[int]) -> torch.Tensor:
    """The hand-written plan: nothing before the first learner records a graph; blocks that do
    not learn are frozen (gradients pass through them); the tied weight learns."""
    blocks = [*model.encoder, *model.decoder]
    for i, block in enumerate(blocks):
        block.requires_grad_(i in learn)
    first, n = min(learn), len(model.encoder)
    with torch.no_grad():
        h = model.embed(src)
        for block in blocks[: min(first, n)]:
            h = block(h)
    for block in blocks[min(first, n) : n]:
        h = block(h)
    with torch.no_grad() if first >= n else torch.enable_grad():
        d = model.embed(tgt) + h.mean(1, keepdim=True)
        for block in blocks[n : max(first, n)]:
            d = block(d)
    for block in blocks[max(first, n) :]:
        d = block(d)
    return model.head(d).pow(2).sum()


@pytest.mark.parametrize("learn", [{0}, {1}, {2}, {3}, {1, 3}])
def test_a_tied_head_learns_under_a_learning_set(learn: set[int]) -> None:
    model = TiedEncoderDecoder()
    reference = copy.deepcopy(model)
    src, tgt = torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 4))
    gate = gg.BackpropGate(model, ["encoder.*", "decoder.*"])
    gate.learn = learn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gg.SharedParameterWarning)  # its use before the cut
        model(src, tgt).pow(2).sum().backward()
    gate.remove()
    loss = _tied_reference(reference, src, tgt, learn)
    expected = torch.autograd.grad(loss, reference.embed.weight)[0]
    assert model.head.weight.grad is not None
    torch.testing.assert_close(model.head.weight.grad, expected)
    blocks = [*model.encoder, *model.decoder]
    for i, block in enumerate(blocks):
        assert (block.f.weight.grad is not None) == (i in learn), i


class MidNorm(nn.Module):
    """A LayerNorm of the model's own (no list member) applied between blocks 0 and 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(5, 5) for _ in range(3))
        self.mid = nn.LayerNorm(5)
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.blocks[0](x))
        x = self.mid(x)
        for block in self.blocks[1:]:
            x = torch.tanh(block(x))
        return self.head(x)


def test_code_between_blocks_taken_for_code_after_them_at_the_first_forward_is_said() -> None:
    """At its first forward the gate cannot tell code between the blocks from code after the
    last block that ran (LayerDrop skipped the rest): it takes `mid` for the latter, so `mid`
    learns in that forward though it runs before the first learner. That is said, once; from
    the next forward on `mid` is frozen there."""
    x = torch.randn(3, 5)
    model = MidNorm()
    gate = gg.BackpropGate(model, "blocks.*")
    gate.learn = {2}  # block 1 does not learn: the cut closes there again, `mid` gets nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()
    assert model.mid.weight.grad is None and model.blocks[2].weight.grad is not None
    gate.remove()
    model = MidNorm()
    gate = gg.BackpropGate(model, "blocks.*")
    gate.learn = {1}  # the first learner right after it: its first run gets a graph
    with pytest.warns(
        gg.BlockCallWarning,
        match=r"'mid.weight' and 'mid.bias' got a gradient though they run before the first "
        r"learner \('blocks.1'\): at its first run gradgate took 'mid' for code after the last "
        r"block that ran \(LayerDrop\).*From the next forward on they are frozen there.*run "
        r"one forward with grad on before training",
    ) as said:
        loss = model(x).sum()
        loss.backward()  # said by the backward: a forward with no backward gives no gradient
    assert said[0].filename == __file__  # the user's backward line
    assert model.mid.weight.grad is not None  # what was said
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()
    assert model.mid.weight.grad is None and model.blocks[1].weight.grad is not None
    gate.remove()
    model = MidNorm()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gg.BackpropGate(model, "blocks.*") as gate:
            gate.learn = {1}
            model(x)  # the forward that shows the gate where `mid` runs: no backward, no word
            model(x).sum().backward()
    assert model.mid.weight.grad is None and model.blocks[1].weight.grad is not None
