"""One direct, deterministic test for each core mechanism that only one test file, or only a
slow randomized property, guarded: gradients against plain autograd on an unmodified copy.

* named modules inside blocks in a learning set (besides ``test_plan.py``);
* the freeze layering: handles freezing overlapping sets (an unfreeze between them), undone
  in every order, flags and norm modes (besides ``test_handles.py``);
* the saved-bytes rule, each storage once, in the audit and the planner (besides
  ``test_autograd.py``);
* gradient capture composed with gradient transforms, and capture under a cut (only the
  randomized lifecycle property of ``test_lifecycle.py`` composed them).
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn

import gradgate as gg


class Block(nn.Module):
    """A residual block of two layers: a learning set can name either."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _stack() -> nn.Sequential:
    """An embedding-like stem, four blocks ("1" to "4"), a head ("5")."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), *[Block(4) for _ in range(4)], nn.Linear(4, 2)).double()


def _reference_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Plain autograd on an unmodified copy: every parameter's gradient of the same loss."""
    twin = copy.deepcopy(model)
    for param in twin.parameters():
        param.requires_grad_(True)
    named = dict(twin.named_parameters())
    loss = twin(x).pow(2).sum()
    return dict(zip(named, torch.autograd.grad(loss, list(named.values())), strict=True))


# -- named modules inside blocks in a learning set ---------------------------------------------


@pytest.mark.parametrize(
    ("learn", "learners"),
    [
        ({"2.fc2"}, {"2.fc2", "5"}),  # half of a block: the rest of it and of the model cut
        ({"1.fc1", 2}, {"1.fc1", "3", "5"}),  # block "1"'s fc2 runs after the cut, frozen
        ({"4.fc1", "2.fc2", 1}, {"2", "4.fc1", "5"}),  # positions count from block "1"
    ],
)
def test_named_modules_inside_blocks_learn_alone_and_exactly(
    learn: set[int | str], learners: set[str]
) -> None:
    """Only the named modules, the named blocks and the head learn (a learning set freezes
    what runs after the cut unnamed, for the call), each with full backprop's gradient; the
    flags come back after the step."""
    model = _stack()
    x = torch.randn(5, 3, dtype=torch.float64)
    expected = _reference_grads(model, x)
    with gg.BackpropGate(model, [str(i) for i in range(1, 5)]) as gate:
        gate.learn = learn
        model(x).pow(2).sum().backward()
        assert all(p.requires_grad for p in model.parameters())  # the call's freeze undone
    for name, param in model.named_parameters():
        module = name.rpartition(".")[0]
        if module in learners or module.partition(".")[0] in learners:
            assert param.grad is not None, name
            torch.testing.assert_close(param.grad, expected[name], msg=name)
        else:
            assert param.grad is None, name


# -- the freeze layering -----------------------------------------------------------------------


def _normed() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1)
    ).double()


# Three layers over module "1" (a BatchNorm): frozen and held in eval, unfrozen, frozen again.
LAYERS = [("freeze", ("0", "1")), ("unfreeze", ("1",)), ("freeze", ("1", "2", "3"))]


def _expected(live: list[int], unit: str) -> tuple[bool, bool]:
    """(learns, norm held in eval) for a unit: what the latest live handle touching it says."""
    for index in reversed(live):
        kind, units = LAYERS[index]
        if unit in units:
            return kind == "unfreeze", kind == "freeze"
    return True, False


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_overlapping_freezes_undone_in_any_order_are_exact(order: tuple[int, ...]) -> None:
    """Two freezes hold module "1" (its norm in eval) with an unfreeze between them: after each
    undo, in any order, each unit learns and each norm layer trains as the latest live handle
    touching it says, and the gradients are plain autograd's with the same norm modes."""
    model = _normed().train()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 2, dtype=torch.float64)
    handles: list[Any] = [
        gg.freeze(model, *units, norm="eval") if kind == "freeze" else gg.unfreeze(model, *units)
        for kind, units in LAYERS
    ]
    live = [0, 1, 2]
    for undone in [None, *order]:
        if undone is not None:
            handles[undone].undo()
            live.remove(undone)
        model.train()  # a lock holds a norm layer in eval across train()
        for unit in ("1", "3"):
            reference[int(unit)].train(not _expected(live, unit)[1])
            assert model[int(unit)].training == reference[int(unit)].training, (live, unit)
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        named = dict(reference.named_parameters())
        found = torch.autograd.grad(reference(x).pow(2).sum(), list(named.values()))
        expected = dict(zip(named, found, strict=True))
        for name, param in model.named_parameters():
            learns = _expected(live, name.partition(".")[0])[0]
            assert param.requires_grad == learns, (live, name)
            if learns:
                torch.testing.assert_close(param.grad, expected[name], msg=f"{name} {live}")
            else:
                assert param.grad is None, (live, name)
        buffers = zip(model.named_buffers(), reference.buffers(), strict=True)
        for (name, buffer), want in buffers:
            torch.testing.assert_close(buffer, want, msg=name)  # statistics: the same modes
    assert all(p.requires_grad for p in model.parameters()) and model[1].training
    assert all("train" not in vars(module) for module in model)  # no lock left behind


# -- saved bytes: each storage once ------------------------------------------------------------


class SavesOneStorageThrice(nn.Module):
    """Its input is saved by two matrix products and, as a view, by a product."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.a(h) * h[:, :8] + self.b(h)


def _saver() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), SavesOneStorageThrice(), nn.Linear(8, 1))


# float32, batch 16. Full backprop saves x (16x4: 256 B), h = the first layer's output
# (512 B: three saves, one storage), a(h) (512 B) and the last layer's input (512 B): 1,792.
# With the cut before block "1", x is not saved and neither is a(h) (it is saved for h's
# gradient): 1,024. Counted per save, full backprop would be 2,816.
@pytest.mark.parametrize(("depth", "saved"), [(None, 1792), (2, 1024), (3, 1792)])
def test_the_audit_and_the_planner_count_each_saved_storage_once(
    depth: int | None, saved: int
) -> None:
    model, x = _saver(), torch.randn(16, 4)
    with gg.BackpropGate(model, ["0", "1", "2"], depth=depth), gg.audit(model) as report:
        model(x).sum().backward()
    assert report.totals["saved_bytes"] == saved
    plan = gg.estimate(model, x, depths=[3 if depth is None else depth], blocks=["0", "1", "2"])
    assert [row.saved_bytes for row in plan.rows] == [saved]


# -- gradient capture with transforms, and under a cut ------------------------------------------


def _units() -> nn.Sequential:
    torch.manual_seed(0)
    body = nn.Sequential(*[nn.Sequential(nn.Linear(3, 3), nn.Tanh()) for _ in range(3)])
    model = nn.Sequential(OrderedDict(stem=nn.Linear(2, 3), body=body, head=nn.Linear(3, 1)))
    return model.double()


def _reference(model: nn.Module, x: torch.Tensor, units: list[str]) -> tuple[dict, dict]:
    """Plain autograd on a copy: each parameter's gradient and each unit output's."""
    twin = copy.deepcopy(model)
    outputs: dict[str, torch.Tensor] = {}
    for unit in units:
        twin.get_submodule(unit).register_forward_hook(
            lambda m, a, out, unit=unit: outputs.__setitem__(unit, out)
        )
    loss = twin(x).pow(2).sum()
    named = dict(twin.named_parameters())
    grads = torch.autograd.grad(loss, [*named.values(), *outputs.values()])
    by_param = dict(zip(named, grads[: len(named)], strict=True))
    return by_param, dict(zip(outputs, grads[len(named) :], strict=True))


@pytest.mark.parametrize("depth", [None, 2])
def test_captured_gradients_compose_with_transforms_and_the_cut(depth: int | None) -> None:
    """The gradient captured at a module's output is what flows into it: scaled by a later
    module's input transform, not by its own parameter transform; a parameter gradient gets
    every transform on its way. Before the cut nothing is captured, and says why."""
    model, x = _units(), torch.randn(4, 2, dtype=torch.float64)
    want_params, want_outputs = _reference(model, x, ["body.0", "body.1"])
    with (
        gg.BackpropGate(model, "body.*", depth=depth),
        gg.capture_grads(model, "body.0", "body.1") as captured,
        gg.scale_grad(model, "body.2", -2.0, on="input"),
        gg.scale_grad(model, "body.1", 0.5),
    ):
        model(x).pow(2).sum().backward()
        torch.testing.assert_close(captured["body.1"], -2.0 * want_outputs["body.1"])
        if depth is None:
            torch.testing.assert_close(captured["body.0"], -2.0 * want_outputs["body.0"])
        else:  # body.0 ran before the cut: its output has no graph
            with pytest.raises(KeyError, match=r"produced no tensor that requires grad"):
                captured["body.0"]
    factors = {"stem": -2.0, "body.0": -2.0, "body.1": -1.0, "body.2": 1.0, "head": 1.0}
    for name, param in model.named_parameters():
        unit = name.rsplit(".", 2)[0] if name.startswith("body.") else name.partition(".")[0]
        if depth is not None and unit in ("stem", "body.0"):
            assert param.grad is None, name
        else:
            torch.testing.assert_close(param.grad, factors[unit] * want_params[name], msg=name)
