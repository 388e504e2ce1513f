"""``gg.MissingGradientWarning``: after the backward of a plan's first forward, a parameter the
plan says learns that got no gradient is named, with the cause the forward showed (reentrant
checkpointing with inputs that need no grad, a detach, ``requires_grad`` changed after the
forward), once per cause; a parameter outside the loss's graph by design is never named."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

import gradgate as gg


class Net(nn.Module):
    """An embedding, four blocks (optionally called through reentrant checkpointing, or with a
    detach after one, or inside one), two heads the forward picks from by ``task``."""

    def __init__(self, *, reentrant: bool = False, detach_after: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(4, 1)
        self.other_head = nn.Linear(4, 1)
        self.reentrant, self.detach_after = reentrant, detach_after

    def forward(self, x: torch.Tensor, task: int = 0, both: bool = False) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            h = checkpoint.checkpoint(block, h, use_reentrant=True) if self.reentrant else block(h)
            if i == self.detach_after:
                h = h.detach()
        if both:  # both heads run; the loss uses one of them
            first, second = self.head(h), self.other_head(h)
            return first if task == 0 else second
        return self.head(h) if task == 0 else self.other_head(h)


class DetachInside(nn.Module):
    """A block whose first layer's output is detached inside it (a residual keeps the block's
    output connected)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.inner(h).detach()


@contextmanager
def caught() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        yield found


def missing(found: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in found if issubclass(w.category, gg.MissingGradientWarning)]


def step(net: nn.Module, **kwargs: object) -> None:
    net(torch.randn(2, 3), **kwargs).sum().backward()


def test_reentrant_checkpointing_with_inputs_that_need_no_grad_is_named() -> None:
    net = Net(reentrant=True)
    frozen = gg.freeze(net, "embed")  # the blocks' input needs no grad
    gate = gg.BackpropGate(net)  # no plan: every parameter that requires grad learns
    with caught() as found:
        step(net)
        step(net)
    (message,) = missing(found)  # once, at the plan's first backward
    assert message.startswith(
        "'blocks.0', 'blocks.1', 'blocks.2', 'blocks.3' learn under the plan but got no "
        "gradient: they ran with grad off inside a forward that had it on, as reentrant "
        "activation checkpointing runs them (torch.utils.checkpoint with use_reentrant=True)"
    )
    assert "checkpoint(..., use_reentrant=False)" in message
    assert "model.enable_input_require_grads()" in message
    assert all(b[0].weight.grad is None for b in net.blocks)  # what it says is true
    gate.remove()
    frozen.undo()


@pytest.mark.parametrize("input_grads", [True, False], ids=["transformers' fix", "without it"])
def test_reentrant_checkpointing_on_a_transformers_model(input_grads: bool) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    reentrant = {"use_reentrant": True}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer transformers name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=reentrant)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=reentrant)
    if not input_grads:  # transformers makes the embeddings' output require grad; older did not
        model.disable_input_require_grads()
    frozen = gg.freeze(model, "model.embed_tokens")  # as adapters-only fine-tunes do
    gate = gg.BackpropGate(model)
    with caught() as found:
        model(input_ids=torch.randint(0, 32, (2, 6))).logits.sum().backward()
    learned = model.model.layers[0].mlp.up_proj.weight.grad is not None
    if input_grads:
        assert learned and not missing(found)
    else:
        (message,) = missing(found)
        assert not learned
        assert message.startswith("'model.layers.0', 'model.layers.1' learn under the plan but")
        assert "reentrant checkpointing whose input needs no grad" in message
    gate.remove()
    frozen.undo()


def test_a_detach_between_blocks_is_named() -> None:
    net = Net(detach_after=1)
    gate = gg.BackpropGate(net, depth=4)
    with caught() as found:
        step(net)
    (message,) = missing(found)
    assert message == (
        "'blocks.0', 'blocks.1' learn under the plan but got no gradient: the input of the block "
        "after 'blocks.1' was a detached copy of its output (the same storage, needing no grad), "
        "so the backward stopped there. Remove the .detach() (or .data) between the blocks."
    )
    gate.depth = 3  # a new plan, the same cause: said once per gate
    with caught() as found:
        step(net)
    assert not missing(found) and net.blocks[1][0].weight.grad is None
    gate.remove()


def test_a_detach_inside_a_block_is_named() -> None:
    net = nn.Sequential(nn.Linear(3, 4), DetachInside(), DetachInside(), nn.Linear(4, 1))
    gate = gg.BackpropGate(net, ["1", "2"])  # no plan: everything learns
    with caught() as found:
        net(torch.randn(2, 3)).sum().backward()
    (message,) = missing(found)
    assert message.startswith(
        "parameters of '1', '2' learn under the plan but got no gradient, though the gradient "
        "reached the block's output: inside it, a detach"
    )
    gate.remove()


def test_requires_grad_switched_off_after_the_forward_is_named() -> None:
    net = Net()
    gate = gg.BackpropGate(net, depth=2)
    with caught() as found:
        out = net(torch.randn(2, 3))
        net.blocks[3][0].weight.requires_grad_(False)  # too late: backward still computes it
        out.sum().backward()
    (message,) = missing(found)
    assert message.startswith(
        "'blocks.3.0.weight' learn under the plan and required grad when the forward ran, but "
        "not at its backward: requires_grad changed after the forward"
    )
    net.blocks[3][0].weight.requires_grad_(True)
    gate.remove()


@pytest.mark.parametrize("both", [False, True], ids=["other head not run", "other head unused"])
@pytest.mark.parametrize(
    "plan", [{"depth": 2}, {"depth": None}, {"learn": {3, "head", "other_head"}}]
)
def test_an_unused_head_is_never_named(plan: dict, both: bool) -> None:
    net = Net()
    gate = gg.BackpropGate(net)
    for option, value in plan.items():
        setattr(gate, option, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing warns at all
        for task in (0, 1, 0):
            net.zero_grad(set_to_none=True)
            step(net, task=task, both=both)  # the head the loss does not use gets nothing
            unused = net.other_head if task == 0 else net.head
            assert unused.weight.grad is None
    gate.remove()


def test_a_block_whose_output_the_loss_ignores_is_never_named() -> None:
    class Parallel(nn.Module):  # blocks side by side; the loss takes one of them
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            outputs = [block(x) for block in self.blocks]
            return outputs[1]

    net = Parallel()
    gate = gg.BackpropGate(net, depth=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net(torch.randn(2, 3)).sum().backward()
    assert [b.weight.grad is not None for b in net.blocks] == [False, True, False]
    gate.remove()


def test_the_guard_watches_only_a_plans_first_forward() -> None:
    net = Net()
    gate = gg.BackpropGate(net, depth=2)
    watched = []
    arm = gate._missing.arm
    gate._missing.arm = lambda key: watched.append(key) or arm(key)  # type: ignore[method-assign]
    for depth in [2, 2, 3, 2, 3, 1, 2]:
        gate.depth = depth
        step(net)
    assert [sorted(key[0]) for key in watched] == [[2, 3], [1, 2, 3], [3]]
    assert gate._missing.pending is False  # the forwards in between read this flag only
    gate.remove()


def test_its_message_names_at_most_six_modules() -> None:
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(9)])

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i == 7:
                    x = x.detach()
            return x

    model = Stack()
    gate = gg.BackpropGate(model, depth=9)
    with caught() as found:
        model(torch.randn(1, 2)).sum().backward()
    (message,) = missing(found)
    assert re.match(r"'layers\.0', .*'layers\.5' and 2 more learn under the plan", message)
    gate.remove()


def test_a_backward_for_some_inputs_only_is_never_named() -> None:
    net = Net()
    gate = gg.BackpropGate(net, depth=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = net(torch.randn(2, 3)).sum()
        torch.autograd.grad(out, [net.blocks[3][0].weight])  # no .grad anywhere, by design
        gate.depth = 3
        net(torch.randn(2, 3)).sum().backward(inputs=[net.blocks[2][0].weight])
    assert net.blocks[3][0].weight.grad is None and net.blocks[2][0].weight.grad is not None
    gate.remove()


def test_a_watched_forward_with_no_backward_leaves_no_hook_after_remove() -> None:
    net = Net()
    gate = gg.BackpropGate(net, depth=2)
    net(torch.randn(2, 3))  # watched (the plan's first forward with grad), never backward
    assert any(p._backward_hooks for p in net.parameters())  # the guard waits for a backward
    gate.remove()
    assert not any(p._backward_hooks for p in net.parameters())
