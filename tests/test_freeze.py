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
    handle.undo()
    assert model[1].weight.requires_grad and model[0].weight.requires_grad
    back.undo()
    assert not model[1].weight.requires_grad  # unfreeze's own undo puts back what it found


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
