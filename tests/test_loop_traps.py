"""Traps of a training loop (issue 37): a warning raised as an error, a foreign optimizer, bad
arguments to the optim helpers, where a warning points, and stale gradients of skipped blocks."""

from __future__ import annotations

import copy
import inspect
import sysconfig
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradgate as gg
from gradgate._tools import freeze as _freeze

HERE = str(Path(__file__).resolve())


class TiedWithNorm(nn.Module):
    """An embedding tied to the head, with a BatchNorm in the head's part."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(5, 3)
        self.body = nn.Linear(3, 3)
        self.norm = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.body(self.emb(ids)))))


def _state(model: nn.Module) -> list[Any]:
    """Every flag a freeze may change: requires_grad, .grad, training, a train() stand-in."""
    flags = [(n, p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)]
    grads = [(n, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()]
    modes = [(n, m.training, "train" in vars(m)) for n, m in model.named_modules()]
    return [flags, modes, grads]


def _same(a: list[Any], b: list[Any]) -> bool:
    flags_a, modes_a, grads_a = a
    flags_b, modes_b, grads_b = b
    same_grads = all(
        n == m and (g is None) == (h is None) and (g is None or torch.equal(g, h))
        for (n, g), (m, h) in zip(grads_a, grads_b, strict=True)
    )
    return flags_a == flags_b and modes_a == modes_b and same_grads


# -- item 10: a warning raised as an error changes nothing ---------------------------------------
@pytest.mark.parametrize("norm", ["keep", "eval"])
def test_a_tied_freeze_warning_raised_as_an_error_leaves_the_model_as_it_was(norm: str) -> None:
    model = TiedWithNorm()
    model(torch.tensor([1, 2, 3])).sum().backward()
    for param in model.parameters():
        param.grad.zero_()  # what zero_grad(set_to_none=False) leaves: a freeze would drop it
    before = _state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(gg.SharedParameterWarning, match=r"'emb\.weight' too"):
            gg.freeze(model, "head", "norm", norm=norm)
    assert _same(_state(model), before)
    assert not any(module in _freeze._STATES for module in model.modules())
    with pytest.warns(gg.SharedParameterWarning):  # not held by a lost handle: freezes again
        handle = gg.freeze(model, "head", "norm", norm=norm)
    assert handle.parameters == ["norm.weight", "norm.bias", "head.weight"]
    assert model.norm.training == (norm == "keep")
    handle.undo()  # flags and modes back; the zero .grad the freeze dropped stays dropped
    assert _state(model)[:2] == before[:2]
    assert model.norm.weight.grad is None and model.body.weight.grad is not None


# -- item 15: an optimizer that holds none of the model's parameters ------------------------------
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))


def test_check_says_in_one_line_that_an_optimizer_holds_none_of_the_models_parameters() -> None:
    model = _net()
    optimizer = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)  # a copy's
    findings = gg.check(model, optimizer)
    assert [f.code for f in findings] == ["optimizer-not-for-model"]
    assert findings[0].where == "optimizer"
    assert "holds none of the 6 parameters of Sequential" in findings[0].message
    assert "its 6 parameters are other tensors" in findings[0].message
    # one optimizer of two holds none of them: said for that one, the rest as before
    own = torch.optim.SGD([*model[0].parameters(), *model[1].parameters()], lr=0.1)
    codes = [(f.code, f.where) for f in gg.check(model, [own, optimizer])]
    assert codes == [
        ("optimizer-not-for-model", "optimizer 1"),
        ("not-in-optimizer", "2.weight"),
        ("not-in-optimizer", "2.bias"),
    ]


def test_unfreeze_refuses_an_optimizer_that_holds_none_of_the_models_parameters() -> None:
    model = _net()
    other = torch.optim.AdamW(copy.deepcopy(model).parameters())
    groups = [list(group["params"]) for group in other.param_groups]
    handle = gg.freeze(model, "0")
    with pytest.raises(
        gg.InvalidOptionError,
        match=r"optimizer=AdamW holds none of the 6 parameters of Sequential.*"
        r"gg\.optim\.add_missing\(optimizer, model\)",
    ):
        gg.unfreeze(model, "0", optimizer=other)
    assert [list(group["params"]) for group in other.param_groups] == groups
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True, True, True]
    own = torch.optim.AdamW(model[1:].parameters())
    back = gg.unfreeze(model, "0", optimizer=own)  # the model's own optimizer: added to it
    assert back.added_to_optimizer == ["0.weight", "0.bias"]
    back.undo()
    handle.undo()


# -- item 11: drop_finished with an argument of the wrong kind ---------------------------------
@pytest.mark.parametrize("position", ["optimizer", "gate", "schedule"])
def test_drop_finished_names_the_argument_of_the_wrong_kind(position: str) -> None:
    model = _net()
    gate = gg.BackpropGate(model, blocks=["0", "1", "2"])
    schedule = gg.schedules.LISA(3, k=1)
    arguments: dict[str, Any] = {
        "optimizer": torch.optim.AdamW(model.parameters()),
        "gate": gate,
        "schedule": schedule,
    }
    arguments[position] = None
    with pytest.raises(gg.InvalidOptionError, match=rf"drop_finished\({position}=None\).*expected"):
        gg.optim.drop_finished(*arguments.values(), 1)
    assert schedule._bound is None  # refused before the schedule looked at anything
    gate.remove()


# -- item 17: a warning points at the line the user wrote ---------------------------------------
def _line_below() -> int:
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno + 1


def test_a_warning_in_a_gated_forward_points_at_the_callers_line() -> None:
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(3)])
    gate = gg.BackpropGate(model, depth=0)  # nothing runs after the cut: a warning
    with pytest.warns(gg.BlockCallWarning, match="nothing that runs after the cut") as caught:
        line = _line_below()
        model(torch.randn(2, 3))
    assert (caught[0].filename, caught[0].lineno) == (HERE, line)
    gate.remove()


def _library_function(body: str, name: str) -> Any:
    """A function whose code lies in an installed package (as transformers' modeling code)."""
    path = str(Path(sysconfig.get_paths()["purelib"]) / "somelibrary" / "modeling.py")
    namespace: dict[str, Any] = {"__name__": "somelibrary.modeling"}
    exec(compile(body, path, "exec"), namespace)
    return namespace[name], path


def test_a_warning_skips_the_library_code_between_the_user_and_gradgate() -> None:
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(3)])
    call, _ = _library_function("def call(model, x):\n    return model(x)\n", "call")
    gate = gg.BackpropGate(model, depth=0)
    with pytest.warns(gg.BlockCallWarning) as caught:
        line = _line_below()
        call(model, torch.randn(2, 3))
    assert (caught[0].filename, caught[0].lineno) == (HERE, line)
    gate.remove()


def test_a_warning_with_only_library_code_above_points_at_the_library_line() -> None:
    """In a thread that runs library code there is no line of the user's: the warning points at
    the library's line that called the model, not at torch's nor at the interpreter."""
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(3)])
    call, path = _library_function("def call(model, x):\n    return model(x)\n", "call")
    gate = gg.BackpropGate(model, depth=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker = threading.Thread(target=call, args=(model, torch.randn(2, 3)))
        worker.start()
        worker.join()
    assert [(w.category, w.filename, w.lineno) for w in caught] == [(gg.BlockCallWarning, path, 2)]
    gate.remove()


def test_a_freeze_warning_still_points_at_the_callers_line() -> None:
    model = TiedWithNorm()
    with pytest.warns(gg.SharedParameterWarning) as caught:
        line = _line_below()
        handle = gg.freeze(model, "head")
    assert (caught[0].filename, caught[0].lineno) == (HERE, line)
    handle.undo()


# -- item 19 (a): a skipped block keeps no stale gradient ---------------------------------------
class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def _residual_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Residual() for _ in range(4)], nn.Linear(4, 1))


PLANS = [{"depth": None}, {"depth": 3}, {"learn": {1, 3}}]


@pytest.mark.parametrize("plan", PLANS, ids=["no-depth", "depth-3", "learn-1-3"])
def test_a_skipped_block_is_not_moved_by_momentum_after_a_full_step(plan: dict[str, Any]) -> None:
    """After a step where every block learned, ``zero_grad(set_to_none=False)`` leaves a zero
    ``.grad`` on block 1; skipped at the next step, it must not move (SGD momentum would move
    it). The reference is the same loop with ``set_to_none=True``."""
    results = []
    for set_to_none in (False, True):
        model = _residual_net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        gate = gg.BackpropGate(model, blocks=["0", "1", "2", "3"])
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        for name, value in plan.items():
            setattr(gate, name, value)
        gate.skip = {1}
        before = [p.detach().clone() for p in model[1].parameters()]
        model(x).sum().backward()
        optimizer.step()
        assert all(map(torch.equal, model[1].parameters(), before)), set_to_none
        results.append([p.detach().clone() for p in model.parameters()])
        gate.remove()
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
