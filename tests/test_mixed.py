"""The cut under autocast and activation checkpointing: never more memory than the plain idioms."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from measure import forward_and_backward
from models import gpt2
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradgate as gg


def test_autocast_does_not_cache_prefix_weight_copies() -> None:
    # Autocast keeps a low-precision copy of each leaf weight that requires grad until the
    # autocast region ends, even under no_grad: the prefix must not feed that cache.
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    seen = []
    for block in model:
        block.register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_cache_enabled()))
    with torch.autocast("cpu", dtype=torch.bfloat16), gg.backprop_depth(model, 1):
        model(torch.randn(2, 8)).float().sum().backward()
    assert seen == [False, False, False, True]
    assert torch.is_autocast_cache_enabled()
    assert model[3].weight.grad is not None and model[2].weight.grad is None


class _WeightCopies(TorchDispatchMode):
    """Weak references to the bfloat16 copies autocast makes of given weights."""

    def __init__(self, weights: dict[int, str]) -> None:
        super().__init__()
        self.weights, self.copies = weights, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.weights:
            self.copies[self.weights[id(args[0])]] = weakref.ref(out)
        return out


def _prefix_copies_alive_when_the_suffix_starts(gated: bool) -> list[str]:
    """Which prefix weights' bfloat16 copies are still alive when the learning block starts."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    alive: list[str] = []
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        _WeightCopies({id(block.weight): name for name, block in model.named_children()}) as copies,
    ):
        model[3].register_forward_pre_hook(
            lambda m, a: alive.extend(n for n, ref in copies.copies.items() if ref() is not None)
        )
        x = torch.randn(2, 8)
        if gated:
            with gg.backprop_depth(model, 1):
                out = model(x)
        else:  # the hand-written ideal: the prefix under no_grad
            with torch.no_grad():
                h = model[:3](x)
            out = model[3](h)
        out.float().sum().backward()
        assert set(copies.copies) == {"0", "1", "2", "3"}  # autocast did cast every weight
    return sorted(alive)


def test_prefix_weight_copies_are_freed_before_the_suffix_runs() -> None:
    assert _prefix_copies_alive_when_the_suffix_starts(gated=False) == ["0", "1", "2"]
    assert _prefix_copies_alive_when_the_suffix_starts(gated=True) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_autocast_peak_memory_is_at_most_the_toggle_idiom_on_cuda() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(48)]).cuda()
    x = torch.randn(64, 1024, device="cuda")

    def peak(step) -> int:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    def gated() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16), gg.backprop_depth(model, 1):
            loss = model(x).float().sum()
        loss.backward()

    def toggled() -> None:
        for layer in model[:-1]:
            layer.requires_grad_(False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().sum()
        loss.backward()
        model.requires_grad_(True)

    gated(), toggled()  # warm-up
    cut, toggle = peak(gated), peak(toggled)
    assert cut <= toggle, f"gated peak {cut / 2**20:.1f} MiB > toggle {toggle / 2**20:.1f} MiB"


def _enable_non_reentrant_checkpointing(model: nn.Module) -> None:
    non_reentrant = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer transformers name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)


@pytest.mark.parametrize("depth", [1, 2])
def test_hf_gradient_checkpointing_covers_every_learning_block(depth: int) -> None:
    model, batch, loss_fn = gpt2(layers=4)
    _enable_non_reentrant_checkpointing(model)
    model.train()
    reference = copy.deepcopy(model)
    named = dict(reference.named_parameters())
    full = torch.autograd.grad(loss_fn(reference, batch), list(named.values()))
    with gg.backprop_depth(model, depth):
        gated_saved, _ = forward_and_backward(lambda: loss_fn(model, batch))
    learners = {f"transformer.h.{i}." for i in range(4 - depth, 4)} | {
        "transformer.ln_f.",
        "lm_head.",
    }
    frozen = [n for n in named if not n.startswith(tuple(learners))]
    with gg.frozen(model, *frozen):  # the toggle idiom: every block checkpointed
        toggled_saved, _ = forward_and_backward(lambda: loss_fn(model, batch))
    assert gated_saved <= toggled_saved  # the learning blocks are checkpointed too
    model.zero_grad(set_to_none=True)
    with gg.backprop_depth(model, depth):
        loss_fn(model, batch).backward()
    for (name, param), expected in zip(model.named_parameters(), full, strict=True):
        if name.startswith(tuple(learners)):
            torch.testing.assert_close(param.grad, expected, msg=name)
        else:
            assert param.grad is None, name


class LoopCheckpointed(nn.Module):
    """transformers 4.x style: the model's loop calls checkpoint(layer, ...) around each call."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 16)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(n)
        )
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
        return self.head(h)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_checkpoint_called_around_the_block_still_checkpoints_every_learner(depth: int) -> None:
    torch.manual_seed(0)
    model, x = LoopCheckpointed(), torch.randn(8, 4)
    with gg.backprop_depth(model, depth):
        gated_saved, _ = forward_and_backward(lambda: model(x).sum())
    prefix = [f"layers.{i}" for i in range(4 - depth)] + ["embed"]
    with gg.frozen(model, *prefix):
        toggled_saved, _ = forward_and_backward(lambda: model(x).sum())
    assert gated_saved <= toggled_saved


def test_blocks_frozen_for_their_call_survive_checkpoint_recomputation() -> None:
    # transformers >= 5 checkpoints a layer's forward with the module hooks outside: backward
    # recomputes the forward, so a non-learning block must still look frozen then.
    from models import llama

    model, batch, loss_fn = llama(layers=4)
    reference = copy.deepcopy(model)
    named = dict(reference.named_parameters())
    full = dict(
        zip(
            named, torch.autograd.grad(loss_fn(reference, batch), list(named.values())), strict=True
        )
    )
    _enable_non_reentrant_checkpointing(model)
    model.train()
    gate = gg.BackpropGate(model)
    gate.learn = {1, "model.embed_tokens"}
    for _ in range(2):  # also the step after
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        learned = {n for n, p in model.named_parameters() if p.grad is not None}
        assert {n.split(".")[2] for n in learned if n.startswith("model.layers.")} == {"1"}
        for name in learned:
            torch.testing.assert_close(
                dict(model.named_parameters())[name].grad, full[name], msg=name
            )
        assert all(p.requires_grad for p in model.parameters())
    gate.remove()
