"""Handles: undone exactly once, in any order, and never silently re-entered."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from torch import nn

import gradgate as gg
from gradgate._plumbing.errors import HandleUsedError


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, affine=False), nn.Linear(2, 1))


def _state(model: nn.Module) -> tuple[object, ...]:
    return (
        [p.requires_grad for p in model.parameters()],
        [m.training for m in model.modules()],
        [sorted(m.__dict__) for m in model.modules()],
    )


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_freeze_unfreeze_freeze_undone_in_any_order_restores_the_original(order) -> None:
    model = _net().train()
    before = _state(model)
    handles = [
        gg.freeze(model, "0", "1", norm="eval"),
        gg.unfreeze(model, "0"),
        gg.freeze(model, "2"),
    ]
    assert model[0].weight.requires_grad and not model[2].weight.requires_grad
    for index in order:
        handles[index].undo()
        live = [i for i in range(3) if handles[i].active]
        # a parameter is frozen exactly when the latest live handle that touches it froze it
        expected_0 = 0 not in live or 1 in live
        assert model[0].weight.requires_grad == expected_0, (order, live)
        assert model[2].weight.requires_grad == (2 not in live)
    assert _state(model) == before


@pytest.mark.parametrize("first_undone", [0, 1])
def test_two_freezes_sharing_a_parameter_free_norm_layer_undo_cleanly(first_undone) -> None:
    model = _net().train()
    handles = [gg.freeze(model, "0", "1", norm="eval"), gg.freeze(model, "1", "2", norm="eval")]
    model.train()
    assert not model[1].training
    handles[first_undone].undo()
    assert not model[1].training  # the other freeze still holds it in eval
    model.train()
    assert not model[1].training
    handles[1 - first_undone].undo()
    assert model[1].training and "train" not in model[1].__dict__


def test_unfreeze_then_freeze_undo_leaves_no_parameter_frozen_without_a_live_handle() -> None:
    model = _net()
    freeze = gg.freeze(model, "**")
    unfreeze = gg.unfreeze(model, "**")
    unfreeze.undo()
    assert not any(p.requires_grad for p in model.parameters())  # the freeze is live again
    freeze.undo()
    assert all(p.requires_grad for p in model.parameters())


def _used_handles(model: nn.Sequential) -> dict[str, gg.Handle]:
    return {
        "frozen": gg.frozen(model, "0"),
        "unfreeze": gg.unfreeze(model, "0"),
        "capture_grads": gg.capture_grads(model, "0"),
        "scale_grad": gg.scale_grad(model, "0", 0.5),
        "Handle": gg.Handle(lambda: None, description="plain"),
    }


@pytest.mark.parametrize("kind", ["frozen", "unfreeze", "capture_grads", "scale_grad", "Handle"])
def test_reentering_a_used_handle_is_refused(kind) -> None:
    model = _net()
    handle = _used_handles(model)[kind]
    with handle:
        pass
    before = _state(model), [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model]
    message = "was already undone, so entering it again would do nothing"
    with pytest.raises(HandleUsedError, match=re.escape(message)), handle:
        pass  # pragma: no cover
    after = _state(model), [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model]
    assert after == before


def test_used_handle_message_names_the_handle_and_the_fix() -> None:
    handle = gg.Handle(lambda: None, description="demo")
    handle.undo()
    with pytest.raises(HandleUsedError) as info:
        handle.__enter__()
    text = str(info.value)
    assert "<gradgate.Handle demo (removed)>" in text
    assert "call gradgate again" in text


def test_a_live_handle_can_be_entered_and_undone_once() -> None:
    calls: list[int] = []
    handle = gg.Handle(lambda: calls.append(1))
    with handle as same:
        assert same is handle and handle.active
    handle.undo()
    assert calls == [1] and not handle.active


def test_the_latest_live_handle_wins_even_when_it_changed_nothing_at_first() -> None:
    model = _net()
    freeze = gg.freeze(model, "0")
    first = gg.unfreeze(model, "0")
    second = gg.unfreeze(model, "0")  # already learning: still a live "learn" for 0
    first.undo()
    assert model[0].weight.requires_grad  # `second` is the latest live handle touching it
    second.undo()
    assert not model[0].weight.requires_grad  # now `freeze` is
    freeze.undo()
    assert model[0].weight.requires_grad


@pytest.mark.parametrize("fault", [KeyboardInterrupt, SystemExit])
def test_context_managers_undo_on_keyboard_interrupt_and_system_exit(fault) -> None:
    model = _net().train()
    before = _state(model), [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model]
    with (
        pytest.raises(fault),
        gg.frozen(model, "0", "1", norm="eval"),
        gg.capture_grads(model, "2"),
        gg.scale_grad(model, "2", 0.5, on="both"),
    ):
        model(torch.randn(3, 2))
        raise fault()
    after = _state(model), [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model]
    assert after == before


@pytest.mark.parametrize("kind", ["freeze", "unfreeze", "capture_grads", "scale_grad", "Handle"])
def test_entering_a_handle_that_is_already_entered_is_refused_and_keeps_it(kind) -> None:
    model = _net()
    undone: list[int] = []
    handle = {
        "freeze": lambda: gg.freeze(model, "0"),
        "unfreeze": lambda: (gg.freeze(model, "0"), gg.unfreeze(model, "0"))[1],
        "capture_grads": lambda: gg.capture_grads(model, "0"),
        "scale_grad": lambda: gg.scale_grad(model, "0", 0.5),
        "Handle": lambda: gg.Handle(lambda: undone.append(1), description="plain"),
    }[kind]()
    message = "is already entered in a `with` block that has not exited"
    with handle:
        inside = _state(model), [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model]
        with pytest.raises(HandleUsedError, match=re.escape(message)), handle:
            pass  # pragma: no cover
        # the rest of the outer block still runs under the handle
        assert handle.active and undone == []
        after = _state(model), [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model]
        assert after == inside
        assert model[0].weight.requires_grad == (kind != "freeze")
    assert not handle.active and undone == ([1] if kind == "Handle" else [])


def test_a_handle_can_be_entered_again_only_while_live_and_not_inside_its_own_block() -> None:
    model = _net()
    handle = gg.freeze(model, "0")
    handle.__enter__()
    with pytest.raises(HandleUsedError) as info:
        handle.__enter__()
    text = str(info.value)
    assert "<gradgate.Handle freeze" in text and "(active)>" in text
    assert "expected" in text and "call gradgate again" in text
    assert not model[0].weight.requires_grad and handle.active
    handle.__exit__(None, None, None)
    assert model[0].weight.requires_grad and not handle.active
