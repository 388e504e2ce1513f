"""The cut: exact gradients, no waste, caller's grad mode respected, clear errors."""

from __future__ import annotations

import contextlib
import re
import warnings

import pytest
import torch
from measure import forward_and_backward
from models import REAL_MODELS, conv_stack, gpt2, long_skip
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradgate as gg

# Modules that run after the last block, per real model: they learn at every depth.
AFTER_BLOCKS = {
    "gpt2": ["transformer.ln_f", "lm_head"],
    "bert": ["bert.pooler", "classifier"],
    "llama": ["model.norm", "lm_head"],
    "cnn_bn": [],
    "long_skip": ["head"],
}


def expected_learners(model: nn.Module, name: str, depth: int | None) -> set[str]:
    params = [n for n, _ in model.named_parameters()]
    if depth is None:
        return set(params)
    blocks = gg.blocks(model)
    learning = blocks[len(blocks) - depth :] + AFTER_BLOCKS[name]
    return {p for p in params if any(p.startswith(f"{m}.") for m in learning)}


def reference_grads(model: nn.Module, batch, loss_fn) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters())
    grads = torch.autograd.grad(loss_fn(model, batch), list(named.values()), allow_unused=True)
    return {n: g for n, g in zip(named, grads, strict=True) if g is not None}


@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_every_depth_matches_plain_autograd(name: str) -> None:
    model, batch, loss_fn = REAL_MODELS[name]()
    reference = reference_grads(model, batch, loss_fn)
    n = len(gg.blocks(model))
    for depth in [None, *range(n + 1)]:
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            if not expected_learners(model, name, depth):  # explained by a BlockCallWarning
                warnings.simplefilter("ignore", gg.BlockCallWarning)
            with gg.backprop_depth(model, depth):
                loss = loss_fn(model, batch)
        if loss.requires_grad:
            loss.backward()
        learned = {p for p, t in model.named_parameters() if t.grad is not None}
        assert learned == expected_learners(model, name, depth), (name, depth)
        for param_name in learned:
            torch.testing.assert_close(
                dict(model.named_parameters())[param_name].grad,
                reference[param_name],
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, p=param_name, d=depth: f"{name} depth={d} {p}: {m}",
            )


def _gpt2_ideal(model: nn.Module, ids: torch.Tensor, depth: int) -> torch.Tensor:
    """GPT-2 written by hand: embeddings and the first blocks under no_grad, then the rest."""
    tr = model.transformer
    cut = len(tr.h) - depth
    with torch.no_grad():
        h = tr.drop(tr.wte(ids) + tr.wpe(torch.arange(ids.shape[1])))
        for block in tr.h[:cut]:
            h = block(h)
    for block in tr.h[cut:]:
        h = block(h)
    logits = model.lm_head(tr.ln_f(h))
    return logits.pow(2).mean() + logits[..., 0].mean()


def _sequential_ideal(model: nn.Sequential, x: torch.Tensor, depth: int) -> torch.Tensor:
    cut = len(model) - depth
    with torch.no_grad():
        x = model[:cut](x)
    return model[cut:](x).mean()


def _long_skip_ideal(model: nn.Module, x: torch.Tensor, depth: int) -> torch.Tensor:
    n = len(model.blocks)
    cut = n - depth
    saved = []
    with torch.no_grad():
        h = model.stem(x)
    for i, block in enumerate(model.blocks):
        with torch.set_grad_enabled(i >= cut):
            if i >= n // 2:
                h = h + saved[n - 1 - i]
            h = block(h)
        saved.append(h)
    return model.head(h).pow(2).mean()


IDEALS = {
    "gpt2": (gpt2, lambda m, b, d: _gpt2_ideal(m, b["input_ids"], d)),
    "conv_stack": (conv_stack, _sequential_ideal),
    "long_skip": (long_skip, _long_skip_ideal),
}


@pytest.mark.parametrize("name", sorted(IDEALS))
def test_flops_and_saved_bytes_equal_the_hand_written_ideal(name: str) -> None:
    factory, ideal = IDEALS[name]
    model, batch, loss_fn = factory()
    n = len(gg.blocks(model))
    for depth in range(n + 1):
        if depth == 0 and name == "conv_stack":
            continue  # nothing runs after the last conv: there is no backward at all
        with gg.backprop_depth(model, depth):
            gated = forward_and_backward(lambda: loss_fn(model, batch))
        hand_written = forward_and_backward(lambda d=depth: ideal(model, batch, d))
        full = forward_and_backward(lambda: loss_fn(model, batch))
        assert gated == hand_written, (name, depth)
        if depth < n:
            assert gated[0] < full[0] and gated[1] < full[1], (name, depth)


@pytest.mark.parametrize("name", ["bert", "llama", "cnn_bn"])
def test_cut_costs_the_same_as_freezing_the_prefix_before_the_forward(name: str) -> None:
    # Freezing every prefix parameter before the forward records no prefix graph either.
    model, batch, loss_fn = REAL_MODELS[name]()
    blocks = gg.blocks(model)
    for depth in range(1, len(blocks) + 1):
        with gg.backprop_depth(model, depth):
            gated = forward_and_backward(lambda: loss_fn(model, batch))
        learners = expected_learners(model, name, depth)
        frozen = [n for n, _ in model.named_parameters() if n not in learners]
        with gg.frozen(model, *frozen) if frozen else contextlib.nullcontext():
            toggled = forward_and_backward(lambda: loss_fn(model, batch))
        assert gated == toggled, (name, depth)


def test_depth_changes_every_step_on_one_gate() -> None:
    model, x, loss_fn = conv_stack(6)
    gate = gg.BackpropGate(model)
    for depth in [3, None, 0, 6, 1]:
        model.zero_grad(set_to_none=True)
        gate.depth = depth
        if depth == 0:  # nothing runs after the last conv: explained, not silently graphless
            with pytest.warns(gg.BlockCallWarning, match="nothing that runs after the cut"):
                assert not loss_fn(model, x).requires_grad
        else:
            loss_fn(model, x).backward()
        learned = [i for i, conv in enumerate(model) if conv.weight.grad is not None]
        assert learned == list(range(6 - (6 if depth is None else depth), 6))
    gate.remove()
    assert not model._forward_pre_hooks and not model[0]._forward_pre_hooks


def test_callers_no_grad_is_respected() -> None:
    model, x, _ = conv_stack(4)
    with gg.backprop_depth(model, 2), torch.no_grad():
        out = model(x)
    assert not out.requires_grad
    assert torch.is_grad_enabled()


def test_grad_mode_is_restored_when_the_forward_raises() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), Boom(), nn.Linear(2, 2))
    for depth in [0, 1, 2, 4]:
        gate = gg.backprop_depth(model, depth, blocks=["0", "1", "2", "3"])
        with gate, pytest.raises(ValueError, match="boom"):
            model(torch.randn(1, 2))
        assert torch.is_grad_enabled()


def test_prefix_mode_sets_and_restores_train_flags() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.Linear(3, 3), nn.Dropout(0.5))
    seen = []
    model[1].register_forward_pre_hook(lambda m, a: seen.append(m.training))
    model[3].register_forward_pre_hook(lambda m, a: seen.append(m.training))
    model.train()
    blocks = ["0", "1", "2", "3"]
    with gg.backprop_depth(model, 2, blocks, prefix_mode="eval"):
        model(torch.randn(2, 3))
    assert seen == [False, True]
    assert all(m.training for m in model.modules())
    model.eval()
    seen.clear()
    with gg.backprop_depth(model, 2, blocks, prefix_mode="train"):
        model(torch.randn(2, 3))
    assert seen == [True, False]
    assert not any(m.training for m in model.modules())


def test_explicit_blocks_and_stop_gradient_at() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))
    with gg.backprop_depth(model, 1, blocks=["0", "1", "2"]):
        model(torch.randn(3, 2)).sum().backward()
    assert [layer.weight.grad is not None for layer in model] == [False, False, True, True]
    model.zero_grad(set_to_none=True)
    with gg.stop_gradient_at(model, "1"):
        model(torch.randn(3, 2)).sum().backward()
    assert [layer.weight.grad is not None for layer in model] == [False, True, True, True]


def test_nested_gates_on_a_model_inside_a_model() -> None:
    # Two cuts: nothing before either records a graph, whichever gate is outside.
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    outer = nn.Sequential(nn.Linear(2, 2), inner, nn.Linear(2, 1))
    for outer_cut, inner_cut, learners in [
        ("1.1", "2", ["1.2", "2"]),  # the outer cut lies inside the inner gate's prefix
        ("1.2", "1", ["1.2", "2"]),  # the inner cut lies inside the outer gate's prefix
        ("2", "0", ["2"]),
    ]:
        outer.zero_grad(set_to_none=True)
        with gg.stop_gradient_at(outer, outer_cut), gg.stop_gradient_at(inner, inner_cut):
            outer(torch.randn(3, 2)).sum().backward()
        learned = {n.rpartition(".")[0] for n, p in outer.named_parameters() if p.grad is not None}
        assert learned == set(learners), (outer_cut, inner_cut)
        assert torch.is_grad_enabled()


def test_a_second_gate_on_the_same_blocks_is_refused_with_the_fix() -> None:
    """A notebook cell run twice: BackpropGate(llama) with depth 1, then with depth 3."""
    from models import llama

    model, batch, loss_fn = llama(layers=4)
    first = gg.BackpropGate(model, depth=1)
    hooks = [(dict(m._forward_pre_hooks), m.__dict__.get("forward")) for m in model.modules()]
    message = (
        "LlamaForCausalLM already has a gate on the same blocks ('model.layers.0', ...): "
        "<gradgate.BackpropGate depth=1 of 4 blocks>. A second one would cut too (only the "
        "blocks both let learn would learn); a re-run notebook cell makes one. Change the "
        "first gate's plan (gate.depth = 3), or remove it first (gate.remove()), then gate "
        "again."
    )
    for again in (
        lambda: gg.BackpropGate(model, depth=3),
        lambda: gg.BackpropGate(model, "model.layers.2:4", depth=3),  # some of the same blocks
        lambda: gg.backprop_depth(model, 3),
    ):
        with pytest.raises(gg.AlreadyGatedError, match=re.escape(message)):
            again()
    assert [(dict(m._forward_pre_hooks), m.__dict__.get("forward")) for m in model.modules()] == (
        hooks
    )  # nothing half-applied
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_fn(model, batch).backward()
    learned = {n.split(".")[2] for n, p in model.named_parameters() if p.grad is not None
               and n.startswith("model.layers.")}  # fmt: skip
    assert learned == {"3"}  # the first gate, as it was
    first.remove()
    gg.BackpropGate(model, depth=3).remove()  # once removed, a new gate is welcome
    gg.BackpropGate(copy_of(model), depth=3).remove()  # a copy has no gate


def copy_of(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def test_gates_on_other_blocks_or_modules_of_a_gated_model_still_compose() -> None:
    torch.manual_seed(0)
    stack = [nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)]) for _ in range(2)]
    model = nn.Sequential(nn.Linear(2, 2), *stack, nn.Linear(2, 1))
    with (
        gg.backprop_depth(model, 2, "1.*"),
        gg.backprop_depth(model, 1, "2.*"),  # the same model, other blocks
        gg.backprop_depth(model[2], 3),  # a gate inside: the same blocks, another model
        gg.stop_gradient_at(model, "2.2"),  # a cut at one of the gated blocks
    ):
        model(torch.randn(3, 2)).sum().backward()
    learned = {n.rpartition(".")[0] for n, p in model.named_parameters() if p.grad is not None}
    assert learned == {"2.2", "3"}  # nothing before any of the cuts


@pytest.mark.parametrize(
    ("depth", "message"),
    [
        (5, "depth 5 is out of range: Sequential has 4 blocks; expected an integer 0..4"),
        (-1, "depth -1 is out of range"),
        (1.5, "depth 1.5 has type float; expected an integer 0..4 or None"),
        (True, "depth True has type bool"),
        ("2", "depth '2' has type str"),
    ],
)
def test_bad_depth_is_rejected_and_nothing_is_registered(depth: object, message: str) -> None:
    model, _, _ = conv_stack(4)
    with pytest.raises(gg.InvalidDepthError, match=re.escape(message)):
        gg.backprop_depth(model, depth)  # type: ignore[arg-type]
    assert not model._forward_pre_hooks and not model[0]._forward_pre_hooks
    gate = gg.BackpropGate(model, depth=2)
    with pytest.raises(gg.InvalidDepthError):
        gate.depth = depth  # type: ignore[assignment]
    assert gate.depth == 2
    gate.remove()


def test_bad_names_and_options_are_rejected_with_clear_messages() -> None:
    model, _, _ = gpt2()
    with pytest.raises(gg.UnknownModuleError, match=r"'transformer\.h\.9' matches no module"):
        gg.stop_gradient_at(model, "transformer.h.9")
    with pytest.raises(gg.AmbiguousNameError, match="'attn' matches 3 modules"):
        gg.stop_gradient_at(model, "attn")
    with pytest.raises(gg.InvalidOptionError, match="prefix_mode='off' is not allowed"):
        gg.backprop_depth(model, 1, prefix_mode="off")  # type: ignore[arg-type]
    with pytest.raises(gg.NoBlocksError, match="Pass the blocks explicitly"):
        gg.backprop_depth(nn.Linear(2, 2), 1)
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_tied_embedding_warns_once_per_gate_naming_both_uses() -> None:
    model, batch, loss_fn = gpt2(tied=True)
    expected = "shared by 'transformer.wte' and 'lm_head' is used before the cut and again after"
    with pytest.warns(gg.SharedParameterWarning, match=re.escape(expected)) as caught:
        gate = gg.BackpropGate(model, depth=2)
        loss_fn(model, batch)
        gate.depth = 1
        loss_fn(model, batch)
    assert len(caught) == 1
    gate.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gg.backprop_depth(model, None):
            loss_fn(model, batch)


class CheckpointedBlock(nn.Module):
    def __init__(self, *, reentrant: bool) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
def test_reentrant_checkpoint_after_the_cut_is_detected() -> None:
    model = nn.Sequential(*[CheckpointedBlock(reentrant=True) for _ in range(3)])
    with (
        gg.backprop_depth(model, 1),
        pytest.warns(gg.CheckpointAfterCutWarning, match=r"use_reentrant=False"),
    ):
        model(torch.randn(2, 4))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
def test_reentrant_checkpoint_around_the_block_call_is_detected() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=True)
            return x

    model = Wrapper()
    with (
        gg.backprop_depth(model, 1),
        pytest.warns(gg.CheckpointAfterCutWarning, match=r"use_reentrant=False"),
    ):
        model(torch.randn(2, 4))
    assert torch.is_grad_enabled()


def test_non_reentrant_checkpoint_after_the_cut_is_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[CheckpointedBlock(reentrant=False) for _ in range(3)])
    x = torch.randn(2, 4)
    reference = torch.autograd.grad(model(x).sum(), list(model[2].parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gg.backprop_depth(model, 1):
            model(x).sum().backward()
    assert model[1].inner[0].weight.grad is None
    for param, expected in zip(model[2].parameters(), reference, strict=True):
        torch.testing.assert_close(param.grad, expected)
