"""Property tests: random models, random depth sequences and freeze sets, injected exceptions.

Whatever happens, gradients equal plain autograd for every learning parameter, every other
``.grad`` is None, and afterwards the model and grad mode are exactly as before.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradgate as gg

WIDTH = 4


class Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class Tripwire(nn.Module):
    """Raises in the forward when armed: an exception in the middle of a model."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("tripwire")
        return x


def make_block(kind: str) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH)]
    if kind == "norm":
        layers.append(nn.BatchNorm1d(WIDTH))
    if kind == "dropout":
        layers.append(nn.Dropout(0.3))
    layers += [nn.Tanh(), Tripwire()]
    body = nn.Sequential(*layers)
    return Residual(body) if kind == "residual" else body


block_kinds = st.sampled_from(["plain", "residual", "norm", "dropout"])


@st.composite
def models(draw: st.DrawFn) -> nn.Module:
    kinds = draw(st.lists(block_kinds, min_size=1, max_size=5))
    torch.manual_seed(draw(st.integers(0, 1000)))
    body = nn.Sequential(*[make_block(kind) for kind in kinds])
    model = nn.Sequential(nn.Linear(3, WIDTH), body, nn.Linear(WIDTH, 2))
    return model.train(draw(st.booleans()))


def snapshot(model: nn.Module) -> tuple[object, ...]:
    hook_dicts = (
        "_forward_hooks",
        "_forward_pre_hooks",
        "_forward_hooks_always_called",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
        "_backward_hooks",
        "_backward_pre_hooks",
    )
    return (
        torch.is_grad_enabled(),
        [p.requires_grad for p in model.parameters()],
        [m.training for m in model.modules()],
        [tuple(len(getattr(m, d)) for d in hook_dicts) for m in model.modules()],
        [sorted(m.__dict__) for m in model.modules()],
    )


def loss_of(model: nn.Module, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(6, 3)
    return model(x).pow(2).mean()


def reference(model: nn.Module, seed: int) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss_of(model, seed), list(model.parameters())))


def block_of(model: nn.Module, name: str) -> str:
    return name.split(".")[1] if name.startswith("1.") else ""


PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(model=models(), data=st.data())
def test_random_depth_sequences_are_exact(model: nn.Module, data: st.DataObject) -> None:
    n = len(model[1])
    before = snapshot(model)
    depths = data.draw(st.lists(st.one_of(st.none(), st.integers(0, n)), min_size=1, max_size=4))
    gate = gg.BackpropGate(model, blocks="1.*")
    for step, depth in enumerate(depths):
        gate.depth = None
        expected = reference(model, step)
        model.zero_grad(set_to_none=True)
        gate.depth = depth
        loss = loss_of(model, step)
        if loss.requires_grad:
            loss.backward()
        for (name, param), grad in zip(model.named_parameters(), expected, strict=True):
            block = block_of(model, name)
            learns = depth is None or name.startswith("2.") or (block and int(block) >= n - depth)
            if learns:
                torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-6)
            else:
                assert param.grad is None, (name, depth)
    gate.remove()
    assert snapshot(model) == before


@PROPERTY
@given(model=models(), data=st.data())
def test_random_freeze_sets_are_exact(model: nn.Module, data: st.DataObject) -> None:
    before = snapshot(model)
    names = [name for name, _ in model.named_parameters()]
    chosen = data.draw(st.lists(st.sampled_from(names), unique=True, min_size=1))
    expected = reference(model, 0)
    model.zero_grad(set_to_none=True)
    with gg.frozen(model, *chosen):
        loss = loss_of(model, 0)
        assert loss.requires_grad == (len(chosen) < len(names))
        if loss.requires_grad:
            loss.backward()
        for (name, param), grad in zip(model.named_parameters(), expected, strict=True):
            if name in chosen:
                assert param.grad is None
            else:
                torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-6)
    assert snapshot(model) == before


@PROPERTY
@given(model=models(), data=st.data(), caller_grad=st.booleans())
def test_exceptions_mid_forward_leave_no_trace(
    model: nn.Module, data: st.DataObject, caller_grad: bool
) -> None:
    n = len(model[1])
    wires = [m for m in model.modules() if isinstance(m, Tripwire)]
    wire = data.draw(st.sampled_from(wires))
    depth = data.draw(st.one_of(st.none(), st.integers(0, n)))
    frozen = data.draw(
        st.lists(st.sampled_from([str(i) for i in range(3)]), unique=True, min_size=1)
    )
    norm = data.draw(st.sampled_from(["keep", "eval"]))
    with torch.set_grad_enabled(caller_grad):
        before = snapshot(model)
        wire.armed = True
        with (
            pytest.raises(RuntimeError, match="tripwire"),
            gg.frozen(model, *frozen, norm=norm),
            gg.backprop_depth(model, depth, "1.*"),
        ):
            loss_of(model, 0)
        wire.armed = False
        assert snapshot(model) == before
        gate = gg.BackpropGate(model, "1.*", depth=depth)
        wire.armed = True
        with pytest.raises(RuntimeError, match="tripwire"):
            loss_of(model, 0)
        wire.armed = False
        gate.remove()
        assert snapshot(model) == before
