"""The cut follows what runs: skipped, repeated, reordered blocks, two stacks, outside calls.

Each check compares against plain full backprop on an unmodified float64 copy: a parameter that
gets a gradient gets exactly the full one (never a partial one), learning blocks that ran learn,
blocks that do not learn get ``None``.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models.zoo import ZOO, Entry, LayerDropMLP, Reversed, TwoTowers
from torch import nn

import gradgate as gg


def _double(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}


def _reference(model: nn.Module, entry: Entry, batch: dict[str, Any], seed: int) -> dict:
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    torch.manual_seed(seed)
    loss = entry.loss(model, batch)
    grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    return dict(zip(named, grads, strict=True)) | {
        n: None for n, p in model.named_parameters() if not p.requires_grad
    }


def _owned_by(names: list[str], module_names: list[str]) -> list[str]:
    return [n for n in names if any(n.startswith(f"{m}.") for m in module_names)]


def _check_plan(
    entry: Entry, model: nn.Module, reference_model: nn.Module, gate, seed: int, caught: list
) -> None:
    batch = _double(entry.batch(seed))
    expected = _reference(reference_model, entry, batch, seed)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    before = len(caught)
    loss = entry.loss(model, batch)
    if loss.requires_grad:
        loss.backward()
    never_opened = any("the cut never opened" in str(w.message) for w in caught[before:])
    assert never_opened != loss.requires_grad or gate.depth is None, gate.depth
    shared_warned = any(issubclass(w.category, gg.SharedParameterWarning) for w in caught)
    got = {n: p.grad for n, p in model.named_parameters()}
    plan = (gate.depth, seed)
    for name, grad in got.items():
        if grad is None:
            continue
        assert expected[name] is not None, (name, plan)
        if shared_warned and not torch.allclose(grad, expected[name], rtol=1e-6, atol=1e-9):
            continue  # a tied parameter used on both sides of the cut: warned, partial by design
        torch.testing.assert_close(
            grad, expected[name], rtol=1e-6, atol=1e-9, msg=str((name, plan))
        )
    if gate.depth is None:
        assert all((got[n] is None) == (g is None) for n, g in expected.items()), plan
        return
    n = len(gate.blocks)
    learning = gate.blocks[n - gate.depth :]
    frozen = gate.blocks[: n - gate.depth]
    for name in _owned_by(list(got), learning + entry.after):
        if expected[name] is not None and not never_opened:
            assert got[name] is not None, (name, plan)
    for name in _owned_by(list(got), frozen):
        if name not in _owned_by(list(got), learning):
            assert got[name] is None, (name, plan)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_zoo_model_is_exact_at_every_depth(name: str) -> None:
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.build().double().train()
    reference_model = copy.deepcopy(model)
    gate = gg.BackpropGate(model, entry.blocks)
    n = len(gate.blocks)
    seeds = range(8) if name in {"bart", "whisper", "wav2vec2", "layerdrop_mlp"} else range(1)
    with warnings.catch_warnings(record=True) as caught:  # SharedParameterWarning: once a gate
        warnings.simplefilter("always")
        model.eval()  # one forward with every block: the gate sees what runs after each stack
        entry.loss(model, _double(entry.batch(0)))
        model.train()
        for depth in [*sorted({0, 1, n // 2, n}), None]:
            gate.depth = depth
            for seed in seeds:
                _check_plan(entry, model, reference_model, gate, seed, caught)
    gate.remove()
    unexpected = [w for w in caught if issubclass(w.category, gg.BlockCallWarning)]
    assert not unexpected or name == "reversed", [str(w.message) for w in unexpected]


@pytest.mark.parametrize(
    ("name", "paste"),
    [
        ("bart", "blocks=['model.encoder.layers.*', 'model.decoder.layers.*']"),
        ("t5", "blocks=['encoder.block.*', 'decoder.block.*']"),
        ("clip", "blocks=['text_model.encoder.layers.*', 'vision_model.encoder.layers.*']"),
        ("two_towers", "blocks=['text.*', 'image.*']"),
    ],
)
def test_two_stacks_are_never_a_silent_pick(name: str, paste: str) -> None:
    model = ZOO[name].build()
    with pytest.raises(gg.AmbiguousBlocksError, match=re.escape(paste)) as raised:
        gg.blocks(model)
    assert "Pass them in the order your model runs them" in str(raised.value)
    pasted = eval(paste.removeprefix("blocks="))
    assert gg.BackpropGate(model, pasted).blocks == gg.select(model, *pasted)


def test_no_blocks_hint_names_modules_that_exist() -> None:
    model = ZOO["albert"].build()
    with pytest.raises(gg.NoBlocksError) as raised:
        gg.blocks(model)
    suggested = re.search(r"blocks=(\[.*?\])", str(raised.value)).group(1)
    assert gg.select(model, *eval(suggested))


def test_parallel_leaves_inside_a_layer_are_not_blocks() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query, self.key, self.value = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    with pytest.raises(gg.NoBlocksError):
        gg.blocks(Attention())


def test_layerdrop_skipping_learning_blocks_never_breaks_backward() -> None:
    model = LayerDropMLP(n=4, p=0.5).train()
    reference = copy.deepcopy(model)
    gate = gg.BackpropGate(model, depth=1)
    skipped_last = none_ran = 0
    for seed in range(40):
        ran: list[int] = []
        hooks = [
            b.register_forward_hook(lambda m, a, o, i=i, ran=ran: ran.append(i))
            for i, b in enumerate(model.layers)
        ]
        model.zero_grad(set_to_none=True)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        model(x).sum().backward()  # also when LayerDrop skipped every block: the head learns
        for hook in hooks:
            hook.remove()
        torch.manual_seed(seed)
        head_grad = torch.autograd.grad(reference(x).sum(), reference.head.weight)[0]
        torch.testing.assert_close(model.head.weight.grad, head_grad)
        skipped_last += 3 not in ran
        none_ran += not ran
        assert (model.layers[3][0].weight.grad is not None) == (3 in ran)
        assert all(model.layers[i][0].weight.grad is None for i in range(3))
        assert model.embed.weight.grad is None
    assert skipped_last > 5 and none_ran  # the cases that used to fail did happen
    gate.remove()


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_layerdrop_skipping_the_whole_stack_trains_what_runs_after_it(depth: int) -> None:
    model = LayerDropMLP(n=4, p=0.5).train()
    reference = copy.deepcopy(model)
    gate = gg.BackpropGate(model, depth=depth)
    model.eval()
    model(torch.randn(3, 4)).sum().backward()  # a forward where the stack ran: what runs after it
    model.train()
    whole_stack_skipped = 0
    for seed in range(60):
        model.zero_grad(set_to_none=True)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        out = model(x)
        torch.manual_seed(seed)
        ran = [i for i in range(4) if torch.rand(()) >= 0.5]
        whole_stack_skipped += not ran
        out.sum().backward()
        torch.manual_seed(seed)
        named = dict(reference.named_parameters())
        grads = torch.autograd.grad(reference(x).sum(), list(named.values()), allow_unused=True)
        for (name, expected), param in zip(
            zip(named, grads, strict=True), model.parameters(), strict=True
        ):
            learns = name.startswith("head.") or (
                name.startswith("layers.") and int(name.split(".")[1]) >= 4 - depth
            )
            if learns and expected is not None:
                torch.testing.assert_close(param.grad, expected, msg=f"{name} seed {seed}")
            else:
                assert param.grad is None, (name, seed)
    assert whole_stack_skipped >= 2  # the case that used to leave the head without a graph
    gate.remove()


def _runs_any_block(seed: int) -> bool:
    torch.manual_seed(seed)
    return bool((torch.stack([torch.rand(()) for _ in range(4)]) >= 0.5).any())


def test_two_stacks_listed_against_their_run_order_are_an_error_with_the_right_paste() -> None:
    model = TwoTowers()  # the image tower runs first
    gate = gg.BackpropGate(model, ["text.*", "image.*"], depth=0)
    with pytest.raises(
        gg.BlockCallError, match=re.escape("blocks=['image.*', 'text.*']")
    ) as raised:
        model(torch.randn(2, 6), torch.randn(2, 6))
    assert "run in another order than listed" in str(raised.value)
    assert torch.is_grad_enabled() and all(p.requires_grad for p in model.parameters())
    gate.remove()
    gate = gg.BackpropGate(model, ["image.*", "text.*"], depth=0)
    model(torch.randn(2, 6), torch.randn(2, 6)).sum().backward()
    assert model.head.weight.grad is not None
    gate.remove()


def test_the_fused_transformer_encoder_path_is_kept_before_the_cut() -> None:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.Sequential(
        nn.TransformerEncoder(layer, 4, enable_nested_tensor=False), nn.Linear(16, 1)
    ).eval()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)

    def fused_calls(run: Callable[[], object]) -> int:
        with torch.profiler.profile() as prof:
            run()
        events = prof.key_averages()
        return sum(e.count for e in events if "_transformer_encoder_layer_fwd" in e.key)

    with torch.no_grad():
        per_layer = fused_calls(lambda: model(x)) // 4  # whether this torch fuses on this device
    gate = gg.BackpropGate(model, depth=1)
    assert gate.blocks == [f"0.layers.{i}" for i in range(4)]
    fused = fused_calls(lambda: model(x).sum().backward())
    # the three cut-off layers, as under torch.no_grad; the learning one is not
    assert fused == 3 * per_layer
    named = dict(reference.named_parameters())
    grads = torch.autograd.grad(reference(x).sum(), list(named.values()))
    for (name, expected), param in zip(
        zip(named, grads, strict=True), model.parameters(), strict=False
    ):
        if name.startswith(("0.layers.3.", "1.")):
            torch.testing.assert_close(param.grad, expected, msg=name)
        else:
            assert param.grad is None, name
    gate.remove()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all("forward" not in vars(m) for m in model.modules())


def test_blocks_run_out_of_listed_order_warn_and_stay_exact() -> None:
    model = Reversed(4)
    with (
        pytest.warns(gg.BlockCallWarning, match="out of the listed order"),
        gg.backprop_depth(model, 1),
    ):
        model(torch.randn(2, 6)).sum().backward()
    # only blocks.3 (listed last, run first) learns; the rest pass gradients but get none
    assert [b[0].weight.grad is not None for b in model.blocks] == [False, False, False, True]


def test_a_block_called_outside_the_gated_call_is_reported() -> None:
    from models import gpt2

    model, batch, _ = gpt2()
    gate = gg.BackpropGate(model, depth=1)
    with pytest.warns(
        gg.BlockCallWarning, match=r"ran outside a call of the gated GPT2LMHeadModel"
    ):
        model.transformer(**batch)
    gate.remove()


def test_a_skip_only_plan_on_a_block_called_outside_the_gated_call_warns() -> None:
    # DropBP's plan (no cut, only skip) is as ignored there as a depth: it must say so too.
    from models import gpt2

    model, batch, _ = gpt2()
    gate = gg.BackpropGate(model)
    gate.skip = {1}
    with pytest.warns(
        gg.BlockCallWarning, match=r"ran outside a call of the gated GPT2LMHeadModel, so the plan"
    ):
        model.transformer(**batch)
    gate.remove()


def test_a_tied_weight_registered_after_the_blocks_straddling_the_cut_warns() -> None:
    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.head = nn.Linear(4, 10, bias=False)
            self.embed = nn.Embedding(10, 4)  # registered last, runs first
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    model = Late()
    with (
        pytest.warns(
            gg.SharedParameterWarning,
            match=r"shared by 'embed' and 'head' is used before .* only the use after the cut "
            r"\(by 'head'\)",
        ),
        gg.backprop_depth(model, 1),
    ):
        model(torch.tensor([[1, 2]])).sum().backward()


def test_prefix_mode_follows_the_tower_that_runs_first() -> None:
    model = TwoTowers().train()
    seen: dict[str, bool] = {}
    for name, block in [*model.image.named_children(), *model.text.named_children()]:
        tower = "image" if any(block is b for b in model.image) else "text"
        block.register_forward_pre_hook(
            lambda m, a, k=f"{tower}.{name}": seen.__setitem__(k, m.training)
        )
    with gg.backprop_depth(model, 3, ["image.*", "text.*"], prefix_mode="eval"):
        model(torch.randn(2, 6), torch.randn(2, 6))
    assert seen == {f"image.{i}": False for i in range(3)} | {f"text.{i}": True for i in range(3)}
    assert all(m.training for m in model.modules())


def test_nothing_trainable_after_the_cut_is_explained() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))
    model[2].requires_grad_(False)  # e.g. LoRA at depth 0: the frozen head is all that learns
    with (
        pytest.warns(gg.BlockCallWarning, match="nothing that runs after the cut has trainable"),
        gg.backprop_depth(model, 0, ["0", "1"]),
    ):
        out = model(torch.randn(2, 2))
    assert not out.requires_grad


def test_a_gate_on_a_container_without_forward_says_what_to_gate() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    holder = nn.ModuleList([model[0], model[1]])
    with pytest.raises(gg.BlockCallError, match="has no forward of its own"):
        gg.BackpropGate(holder)
    with pytest.raises(gg.BlockCallError, match="has no forward of its own"):
        gg.BackpropGate(nn.ModuleList([nn.Linear(2, 2)]))  # not a sequence of blocks either
