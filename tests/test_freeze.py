"""Freezing: exact gradients, None for frozen parameters, norm layers, exact undo, clear errors."""

from __future__ import annotations

import re

import pytest
import torch
from models import bert, cnn_with_batchnorm, conv_stack
from torch import nn

import gradgate as gg


def test_non_consecutive_freeze_matches_plain_autograd_on_bert() -> None:
    model, batch, loss_fn = bert()
    named = dict(model.named_parameters())
    reference = torch.autograd.grad(loss_fn(model, batch), list(named.values()))
    with gg.freeze(model, "encoder.layer.0", "encoder.layer.2.attention", "classifier.*"):
        loss_fn(model, batch).backward()
    frozen_prefixes = ("bert.encoder.layer.0.", "bert.encoder.layer.2.attention.", "classifier.")
    for (name, param), expected in zip(named.items(), reference, strict=True):
        if name.startswith(frozen_prefixes):
            assert param.grad is None, name
        else:
            torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-6)
    assert all(p.requires_grad for p in model.parameters())


def test_frozen_middle_layer_still_passes_gradient_through() -> None:
    model, x, loss_fn = conv_stack(3)
    reference = torch.autograd.grad(loss_fn(model, x), [model[0].weight])[0]
    with gg.frozen(model, "1"):
        loss_fn(model, x).backward()
    assert model[1].weight.grad is None and model[1].bias.grad is None
    torch.testing.assert_close(model[0].weight.grad, reference)


def test_freeze_clears_stale_gradients_so_no_optimizer_moves_the_weight() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    model(torch.randn(4, 2)).sum().backward()
    optimizer.step()
    before = model[0].weight.detach().clone()
    with gg.freeze(model, "0"):
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(4, 2)).sum().backward()
            optimizer.step()
    assert torch.equal(model[0].weight, before)


def test_norm_eval_survives_train_calls_and_undo_restores_the_requested_mode() -> None:
    model, x, _ = cnn_with_batchnorm()
    bn = model[0][1]
    stats = bn.running_mean.clone()
    handle = gg.freeze(model, "0", norm="eval")
    model.train()
    model(x)
    assert not bn.training and torch.equal(bn.running_mean, stats)
    assert model[1][1].training  # outside the frozen region
    model.eval()
    handle.undo()
    assert not bn.training  # the last mode asked of it while frozen
    model.train()
    assert bn.training
    assert "train" not in bn.__dict__


def test_norm_keep_is_the_default_and_leaves_statistics_updating() -> None:
    model, x, _ = cnn_with_batchnorm()
    bn = model[0][1]
    stats = bn.running_mean.clone()
    with gg.freeze(model, "0"):
        model(x)
    assert bn.training and not torch.equal(bn.running_mean, stats)


def test_undo_is_exact_and_happens_once() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].bias.requires_grad_(False)  # frozen by the user, not by gradgate
    handle = gg.freeze(model, "**")
    assert handle.parameters == ["0.weight", "0.bias", "1.weight"]
    handle.undo()
    handle.undo()
    assert [p.requires_grad for p in model.parameters()] == [True, True, True, False]
    assert not hasattr(model[0].weight, "_gradgate_frozen_by")


def test_context_exit_undoes_also_on_exception() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(KeyError), gg.frozen(model, "**", norm="eval"):
        raise KeyError("boom")
    assert all(p.requires_grad for p in model.parameters())
    assert model[1].training and "train" not in model[1].__dict__


def test_unfreeze_releases_parameters_from_their_handle() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    handle = gg.freeze(model, "0", "1", norm="eval")
    back = gg.unfreeze(model, "1")
    assert handle.parameters == ["0.weight", "0.bias"]
    assert model[1].weight.requires_grad and model[1].training
    back.undo()
    assert not model[1].weight.requires_grad and not model[1].training  # the freeze is live
    handle.undo()
    assert model[1].weight.requires_grad and model[0].weight.requires_grad
    assert model[1].training and "train" not in model[1].__dict__


def test_freezing_what_another_handle_holds_is_refused_and_nothing_is_applied() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    first = gg.freeze(model, "0")
    message = "parameter '0.weight' is already frozen by <gradgate.Handle freeze '0' (active)>"
    with pytest.raises(gg.AlreadyFrozenError, match=re.escape(message)):
        gg.freeze(model, "1", "0")
    assert model[1].weight.requires_grad
    first.undo()
    gg.freeze(model, "1", "0").undo()


def test_unknown_pattern_is_refused_with_close_matches_and_nothing_is_applied() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(gg.UnknownModuleError, match=r"'0\.wieght' matches no module or parameter"):
        gg.freeze(model, "1", "0.wieght")
    assert model[1].weight.requires_grad
    with pytest.raises(gg.UnknownModuleError, match=r"Did you mean '0\.weight'"):
        gg.freeze(model, "0.wieght")


def test_bad_norm_option_names_the_allowed_values() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(
        gg.InvalidOptionError, match="norm='frozen' is not allowed; expected one of"
    ):
        gg.freeze(model, "0", norm="frozen")  # type: ignore[arg-type]
    assert model[0].weight.requires_grad


# -- issue 14: nothing lost ------------------------------------------------------------------


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.body = nn.Linear(3, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb(ids))))


def test_freezing_a_tied_alias_by_its_own_name_freezes_the_shared_parameter() -> None:
    model = Tied()
    with (
        pytest.warns(gg.SharedParameterWarning, match="'emb.weight' too"),
        gg.frozen(model, "head.weight") as handle,
    ):
        assert handle.parameters == ["head.weight"]
        assert not model.emb.weight.requires_grad
        model(torch.tensor([1, 2])).sum().backward()
    assert model.emb.weight.grad is None and model.body.weight.grad is not None
    assert model.emb.weight.requires_grad


def test_freeze_keeps_gradient_accumulated_by_earlier_micro_batches() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    batches = [torch.randn(4, 3, dtype=torch.float64) for _ in range(3)]
    plan = [(), ("0",), ("2",)]  # a different freeze set per micro-batch
    expected = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for x, frozen_set in zip(batches, plan, strict=True):
        named = dict(model.named_parameters())
        learning = [n for n in named if not n.startswith(tuple(f"{f}." for f in frozen_set))]
        grads = torch.autograd.grad(model(x).sum(), [named[n] for n in learning])
        for name, grad in zip(learning, grads, strict=True):
            expected[name] += grad
    for x, frozen_set in zip(batches, plan, strict=True):
        if frozen_set:
            with gg.frozen(model, *frozen_set):
                model(x).sum().backward()
        else:
            model(x).sum().backward()
    with gg.frozen(model, "**"):
        pass  # freezing and unfreezing with no backward loses nothing either
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-12, atol=0)


@pytest.mark.parametrize("call", [gg.freeze, gg.frozen, gg.unfreeze])
def test_no_pattern_is_refused_and_an_empty_slice_is_the_empty_set(call) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].bias.requires_grad_(False)
    with pytest.raises(gg.InvalidOptionError, match="no pattern"):
        call(model, *[])
    handle = call(model, slice(0, 0))
    assert handle.parameters == []
    assert [p.requires_grad for p in model.parameters()] == [True, False, True, True]
    handle.undo()
    assert [p.requires_grad for p in model.parameters()] == [True, False, True, True]


@pytest.mark.parametrize("pattern", ["", " "])
def test_empty_pattern_does_not_match_the_root(pattern) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(gg.UnknownModuleError, match="which names no module"):
        gg.freeze(model, "0", pattern)
    assert all(p.requires_grad for p in model.parameters())


def test_whole_model_is_double_star() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with gg.frozen(model, "**"):
        assert not any(p.requires_grad for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())


def _frozen_bn_model() -> tuple[nn.Module, gg.FreezeHandle]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    handle = gg.freeze(model, "0", "1", norm="eval")
    model.train()
    return model, handle


def _plain_copy(copy: nn.Module) -> None:
    """A copy of a frozen model: the flags as they were, no gradgate state, train() works."""
    assert not copy[0].weight.requires_grad and copy[2].weight.requires_grad
    assert not copy[1].training
    copy.train()
    assert copy[1].training and "train" not in copy[1].__dict__
    copy(torch.randn(4, 2)).sum().backward()
    assert copy[0].weight.grad is None and copy[2].weight.grad is not None


def test_torch_save_and_load_of_a_frozen_model_round_trips(tmp_path) -> None:
    import io

    model, handle = _frozen_bn_model()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=False)
    _plain_copy(copy)
    assert not model[1].training  # the original stays locked until undone
    handle.undo()
    assert model[1].training and all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_of_a_frozen_model_are_plain_models(how) -> None:
    import copy as copying
    import pickle

    model, handle = _frozen_bn_model()
    copy = copying.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    handle.undo()
    assert not copy[0].weight.requires_grad  # undoing the original leaves the copy alone
    _plain_copy(copy)


def test_load_state_dict_assign_while_frozen_is_restored_by_undo() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    fresh = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)).state_dict()
    handle = gg.freeze(model, "0")
    model.load_state_dict(fresh, assign=True)
    assert not model[0].weight.requires_grad  # the module's flag is kept by torch
    handle.undo()
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01),
    ],
    ids=["sgd-momentum", "adamw"],
)
def test_unfreeze_with_optimizer_adds_what_it_never_held(make) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    gg.freeze(model, "0")
    optimizer = make([p for p in model.parameters() if p.requires_grad])
    optimizer.param_groups[0]["lr"] = 0.05  # the group's options, not the defaults
    handle = gg.unfreeze(model, "0", optimizer=optimizer)
    assert handle.added_to_optimizer == ["0.weight", "0.bias"]
    assert len(optimizer.param_groups) == 2 and optimizer.param_groups[1]["lr"] == 0.05
    before = model[0].weight.detach().clone()
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 2)).sum().backward()
        optimizer.step()
    assert not torch.equal(model[0].weight, before)
    handle.undo()
    assert len(optimizer.param_groups) == 1 and model[0].weight not in optimizer.state
    assert not model[0].weight.requires_grad  # the freeze is still live


def test_unfreeze_optimizer_must_be_an_optimizer() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    handle = gg.freeze(model, "0")
    with pytest.raises(gg.InvalidOptionError, match=r"optimizer='sgd'.*expected a torch\.optim"):
        gg.unfreeze(model, "0", optimizer="sgd")  # type: ignore[arg-type]
    assert not model[0].weight.requires_grad
    handle.undo()


def test_unfreeze_adds_parameter_names_to_an_optimizer_built_with_names() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    gg.freeze(model, "0")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(named, lr=0.1)
    gg.unfreeze(model, "0", optimizer=optimizer)
    assert optimizer.param_groups[1]["param_names"] == ["0.weight", "0.bias"]
    assert optimizer.param_groups[1]["params"] == [model[0].weight, model[0].bias]
