"""The three classic autograd errors, triggered as in the seeds, come back explained."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradgate as gg
from gradgate._observe.explain import (
    GraphFreedError,
    InferenceTensorError,
    SavedTensorModifiedError,
)


class Affine(nn.Module):
    """The seed's C = A * B + B, with B learnable and A a plain integer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.tensor([2.0, 3.0, 4.0]))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a * self.b + self.b


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 3)
        self.l2 = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.l1(x))


def test_in_place_change_of_saved_tensor_outside_modules() -> None:
    a = torch.tensor([1, 2, 3])
    b = torch.tensor([2.0, 3.0, 4.0], requires_grad=True)
    with pytest.raises(SavedTensorModifiedError) as info, gg.explain():
        d = torch.sum(a * b + b)
        a[0] = 5
        d.backward()
    text = str(info.value)
    assert "saved by MulBackward0: op 'mul' outside any module" in text
    assert "torch.LongTensor of shape [3], saved at version 0, now at version 1" in text
    assert "modified in place by op '__setitem__'" in text
    assert "Fix: do not change the tensor in place" in text
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "modified by an inplace operation" in str(info.value.__cause__)


def test_in_place_change_names_the_module() -> None:
    model = nn.ModuleDict({"affine": Affine()})
    a = torch.tensor([1, 2, 3])
    with (
        pytest.raises(SavedTensorModifiedError, match="in module 'affine'") as info,
        gg.explain(model),
    ):
        d = model["affine"](a).sum()
        a[0] = 5
        d.backward()
    assert "test_explain.py" in str(info.value)  # the line of code that saved it


def test_backward_twice() -> None:
    model = nn.ModuleDict({"affine": Affine()})
    a = torch.tensor([1, 2, 3])
    with pytest.raises(GraphFreedError) as info, gg.explain(model):
        d = model["affine"](a).sum()
        d.backward()
        d.backward()
    text = str(info.value)
    assert "already used: MulBackward0: op 'mul' in module 'affine'" in text
    assert "retain_graph=True" in text and "run the forward again" in text
    assert "second time" in str(info.value.__cause__)


def test_backward_twice_from_a_carried_over_state() -> None:
    cell = nn.Linear(2, 2)
    model = nn.ModuleDict({"cell": cell})
    hidden = torch.zeros(1, 2)
    with pytest.raises(GraphFreedError, match=r"\.detach\(\) it"), gg.explain(model):
        for _ in range(2):
            hidden = torch.tanh(cell(hidden))
            hidden.sum().backward()


def test_inference_mode_tensor_used_in_autograd() -> None:
    model = TwoLayers()
    with torch.inference_mode():
        tmp = model.l1(torch.randn(4, 3))
    with pytest.raises(InferenceTensorError) as info, gg.explain(model):
        model.l2(tmp)
    text = str(info.value)
    assert "failing op: op 'linear' in module 'l2'" in text
    assert "inference tensor of shape [4, 3]" in text
    assert ".clone() the inference tensor" in text and "torch.no_grad()" in text
    with gg.explain(model):  # the fix: a clone is a normal tensor
        model.l2(tmp.clone()).sum().backward()


def test_forward_outside_the_context_still_gets_the_fix() -> None:
    x = torch.ones(3, requires_grad=True)
    y = x.exp()
    y.add_(1)
    with pytest.raises(SavedTensorModifiedError, match="wrap it too") as info, gg.explain():
        y.sum().backward()
    assert "an output of Exp" in str(info.value)


def test_other_errors_pass_through_and_nothing_is_left_behind() -> None:
    registered = dict(torch.nn.modules.module._global_forward_hooks)

    @gg.explain()
    def broken() -> None:
        torch.ones(2) @ torch.ones(3)

    with pytest.raises(RuntimeError, match="inconsistent tensor size"):
        broken()
    with pytest.raises(ValueError, match="plain"), gg.explain():
        raise ValueError("plain")
    assert dict(torch.nn.modules.module._global_forward_hooks) == registered
    assert not torch.overrides._get_current_function_mode_stack()


def test_clean_step_is_unchanged() -> None:
    model = TwoLayers()
    x = torch.randn(4, 3)
    with gg.explain(model):
        model(x).sum().backward()
    got = model.l1.weight.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    assert torch.equal(got, model.l1.weight.grad)


def test_a_model_that_is_not_a_module_is_refused() -> None:
    with pytest.raises(
        gg.InvalidOptionError, match=r"gg.explain\(model='model'\) got str; expected"
    ):
        gg.explain("model")  # type: ignore[arg-type]
