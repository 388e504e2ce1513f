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


# -- the no-trace contract over plan changes, forwards and backwards -----------------------------
def full_snapshot(model: nn.Module) -> tuple[object, ...]:
    """Everything a gate may touch, exactly: every module hook dict (the hooks themselves, not
    their counts), each parameter's tensor hooks and requires_grad, training flags, what each
    module holds in its __dict__ (a forward attribute), and grad mode."""
    hook_dicts = (
        "_forward_hooks",
        "_forward_pre_hooks",
        "_forward_hooks_always_called",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_load_state_dict_pre_hooks",
    )
    modules = [
        (
            m.training,
            [dict(getattr(m, d)) for d in hook_dicts],
            sorted(m.__dict__),
            m.__dict__.get("forward"),
        )
        for m in model.modules()
    ]
    params = [
        (
            p.requires_grad,
            dict(p._backward_hooks or {}),
            dict(getattr(p, "_post_accumulate_grad_hooks", None) or {}),
        )
        for p in model.parameters()
    ]
    return torch.is_grad_enabled(), modules, params


@st.composite
def plans(draw: st.DrawFn, n: int, names: list[str]) -> tuple[str, object]:
    """One plan change: a depth (or None), a learning set of positions and names, a skip set."""
    kind = draw(st.sampled_from(["depth", "learn", "skip", "none"]))
    if kind == "depth":
        return kind, draw(st.integers(0, n))
    if kind == "learn":
        positions = draw(st.sets(st.integers(0, n - 1), max_size=n))
        return kind, positions | draw(st.sets(st.sampled_from(names), max_size=2))
    if kind == "skip":
        return kind, draw(st.sets(st.integers(0, n - 1), max_size=n))
    return kind, None


@st.composite
def steps(draw: st.DrawFn, n: int, names: list[str]) -> list[tuple[object, ...]]:
    return draw(
        st.lists(
            st.tuples(
                plans(n, names),
                st.sampled_from(["backward", "forward only", "no_grad"]),
                st.booleans(),  # the model in train mode for this step
            ),
            min_size=1,
            max_size=6,
        )
    )


def plain_block(kind: str) -> nn.Module:
    """A block with no Tripwire (this test raises nothing) that keeps its input's shape."""
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH)]
    if kind == "norm":
        layers.append(nn.BatchNorm1d(WIDTH))
    if kind == "dropout":
        layers.append(nn.Dropout(0.3))
    layers.append(nn.Tanh())
    body = nn.Sequential(*layers)
    return Residual(body) if kind == "residual" else body


@PROPERTY
@given(kinds=st.lists(block_kinds, min_size=1, max_size=4), data=st.data())
def test_any_plan_sequence_then_remove_leaves_no_trace(kinds: list[str], data) -> None:
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, WIDTH), nn.Sequential(*[plain_block(k) for k in kinds]), nn.Linear(WIDTH, 2)
    ).train(data.draw(st.booleans()))
    before = full_snapshot(model)
    # named learners: the stem, the head and the layers inside the blocks
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    gate = gg.BackpropGate(model, "1.*")
    with warnings.catch_warnings():
        # what the plans warn of (nothing learns, a plan set after a forward) is not the point
        warnings.simplefilter("ignore", gg.GradgateWarning)
        for (kind, value), run, train in data.draw(steps(len(kinds), names)):
            if kind == "depth":
                gate.depth = value
            elif kind == "learn":
                gate.learn = value or None
            elif kind == "skip":
                gate.skip = value
            else:
                gate.depth = None
                gate.skip = None
            model.train(train)
            try:
                with torch.set_grad_enabled(run != "no_grad"):
                    loss = model(torch.randn(4, 3)).pow(2).mean()
            except gg.BlockCallError:  # a skipped block with no residual path: refused
                assert any(kinds[i] != "residual" for i in gate.skip)
                continue
            if run == "backward" and loss.requires_grad:
                loss.backward()
            model.zero_grad(set_to_none=True)
    model.train(before[1][0][0])  # the mode it had: the steps set it, the gate must not
    gate.remove()
    assert full_snapshot(model) == before
