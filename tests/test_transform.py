"""Each gradient transform against a hand-computed float64 reference, on both kinds of gradient."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from torch import nn

import gradgate as gg
from gradgate._tools.capture import NoTensorError
from gradgate._tools.transform import TransformError


def _net() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    return net, x


def _grads(net: nn.Sequential, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x.grad and every parameter gradient after one plain backward."""
    net.zero_grad(set_to_none=True)
    x.grad = None
    net(x).pow(2).sum().backward()
    out = {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}
    out["x"] = x.grad.clone()
    return out


def _reference(net: nn.Sequential, x: torch.Tensor) -> dict[str, torch.Tensor]:
    return _grads(net, x)


def test_reverse_grad_on_input_is_minus_lambda_upstream_only() -> None:
    net, x = _net()
    ref = _reference(net, x)
    with gg.reverse_grad(net, "2", 0.7):
        got = _grads(net, x)
    for name in ("2.weight", "2.bias"):  # the module itself learns normally
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)
    for name in ("0.weight", "0.bias", "x"):  # everything before it gets -λ × reference
        torch.testing.assert_close(got[name], -0.7 * ref[name], rtol=1e-12, atol=0)


def test_scale_grad_on_params_leaves_upstream_alone() -> None:
    net, x = _net()
    ref = _reference(net, x)
    with gg.scale_grad(net, "2", 0.1):
        got = _grads(net, x)
    torch.testing.assert_close(got["2.weight"], 0.1 * ref["2.weight"], rtol=1e-12, atol=0)
    torch.testing.assert_close(got["2.bias"], 0.1 * ref["2.bias"], rtol=1e-12, atol=0)
    for name in ("0.weight", "0.bias", "x"):
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)


def test_scale_grad_both() -> None:
    net, x = _net()
    ref = _reference(net, x)
    with gg.scale_grad(net, "2", 3.0, on="both"):
        got = _grads(net, x)
    for name in ("2.weight", "0.weight", "x"):
        torch.testing.assert_close(got[name], 3.0 * ref[name], rtol=1e-12, atol=0)


def test_input_transform_does_not_touch_other_uses_of_the_tensor() -> None:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2).double()

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.inner(h)

    model = Residual()
    h = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    model(h).sum().backward()
    skip = torch.ones(3, 2, dtype=torch.float64)
    through = h.grad - skip
    h.grad = None
    with gg.zero_grad_of(model, "inner", on="input"):
        model(h).sum().backward()
    torch.testing.assert_close(h.grad, skip)  # the skip path is untouched
    assert through.abs().sum() > 0


def test_clip_by_value_and_by_norm() -> None:
    net, x = _net()
    ref = _reference(net, x)
    with gg.clip_grad(net, "0", max_value=0.05):
        got = _grads(net, x)
    torch.testing.assert_close(got["0.weight"], ref["0.weight"].clamp(-0.05, 0.05))
    torch.testing.assert_close(got["x"], ref["x"])
    with gg.clip_grad(net, "0", max_norm=0.1):
        got = _grads(net, x)
    for name in ("0.weight", "0.bias"):
        norm = ref[name].norm()
        expected = ref[name] * min(1.0, 0.1 / (norm.item() + 1e-6))
        torch.testing.assert_close(got[name], expected, rtol=1e-12, atol=0)
    with gg.clip_grad(net, "2", max_norm=0.1, on="input"):
        got = _grads(net, x)
    assert got["x"].norm() < ref["x"].norm()


def test_zero_every_other_step_across_four_steps() -> None:
    net, x = _net()
    ref = _reference(net, x)
    handle = gg.zero_grad_of(net, "0", when=lambda step: step % 2 == 0)
    seen = []
    for _ in range(4):
        got = _grads(net, x)
        seen.append(bool(got["0.weight"].abs().sum() == 0))
        expected = torch.zeros_like(ref["0.weight"]) if seen[-1] else ref["0.weight"]
        torch.testing.assert_close(got["0.weight"], expected, rtol=0, atol=0)
        torch.testing.assert_close(got["2.weight"], ref["2.weight"], rtol=0, atol=0)
    assert seen == [True, False, True, False]
    assert handle.step_count == 4
    handle.remove()


def test_manual_step_counter() -> None:
    net, x = _net()
    ref = _reference(net, x)
    handle = gg.grad_transform(
        net, "2", lambda g: 2 * g, when=lambda step: step == 1, count="manual", on="input"
    )
    first = _grads(net, x)
    second = _grads(net, x)  # no handle.step(): still step 0
    handle.step()
    third = _grads(net, x)
    handle.remove()
    torch.testing.assert_close(first["x"], ref["x"])
    torch.testing.assert_close(second["x"], ref["x"])
    torch.testing.assert_close(third["x"], 2 * ref["x"], rtol=1e-12, atol=0)


def test_nesting_order_is_registration_order() -> None:
    net, x = _net()
    ref = _reference(net, x)
    for on, name in [("params", "2.weight"), ("input", "x")]:
        add_then_double = [
            gg.grad_transform(net, "2", lambda g: g + 1, on=on),
            gg.grad_transform(net, "2", lambda g: 2 * g, on=on),
        ]
        got = _grads(net, x)
        for handle in add_then_double:
            handle.remove()
        if on == "params":
            expected = 2 * (ref[name] + 1)
        else:  # d x = (2 * (dh + 1)) @ W, with dh the gradient entering module "2"'s input
            hidden = torch.tanh(net[0](x))
            (dh,) = torch.autograd.grad(net[2](hidden).pow(2).sum(), hidden)
            (expected,) = torch.autograd.grad(hidden, x, 2 * (dh + 1))
        torch.testing.assert_close(got[name], expected, rtol=1e-12, atol=1e-12)


def test_remove_twice_is_noop_and_restores_plain_gradients() -> None:
    net, x = _net()
    ref = _reference(net, x)
    handle = gg.reverse_grad(net, "2", on="both")
    handle.remove()
    handle.remove()
    got = _grads(net, x)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)
    assert not net._forward_pre_hooks and not net[2]._forward_pre_hooks


def test_frozen_parameters_are_skipped_and_picked_up_after_unfreeze() -> None:
    net, x = _net()
    ref = _reference(net, x)
    with gg.frozen(net, "0"):
        handle = gg.scale_grad(net, "0", 2.0)
        assert _grads(net, x)["2.weight"].equal(ref["2.weight"])
    got = _grads(net, x)
    torch.testing.assert_close(got["0.weight"], 2 * ref["0.weight"], rtol=1e-12, atol=0)
    handle.remove()


def test_bad_input_messages() -> None:
    net, _ = _net()
    with pytest.raises(gg.UnknownModuleError, match="'head' matches no module"):
        gg.scale_grad(net, "head", 0.5)
    with pytest.raises(TransformError, match="fn=3 is not callable"):
        gg.grad_transform(net, "0", 3)  # type: ignore[arg-type]
    with pytest.raises(TransformError, match="when=1 is not callable"):
        gg.grad_transform(net, "0", torch.neg, when=1)  # type: ignore[arg-type]
    with pytest.raises(gg.InvalidOptionError, match="on='output' is not allowed"):
        gg.scale_grad(net, "0", 0.5, on="output")  # type: ignore[arg-type]
    with pytest.raises(gg.InvalidOptionError, match="exactly one of them"):
        gg.clip_grad(net, "0")
    with pytest.raises(gg.InvalidOptionError, match="max_norm=-1 must be positive"):
        gg.clip_grad(net, "0", max_norm=-1)
    with pytest.raises(NoTensorError, match="has no parameters"):
        gg.scale_grad(net, "1", 0.5)


def test_when_that_raises_and_fn_that_fails() -> None:
    net, x = _net()
    with (
        gg.grad_transform(net, "0", torch.neg, when=lambda step: 1 / 0),
        pytest.raises(TransformError, match="ZeroDivisionError: division by zero at step 0"),
    ):
        net(x)
    with (
        gg.grad_transform(net, "0", lambda g: g[:1]),
        pytest.raises(
            TransformError,
            match=r"returned a tensor of shape \(1,\) for the gradient of 0.bias; expected",
        ),
    ):
        net(x).sum().backward()
    with (
        gg.grad_transform(net, "2", lambda g: g.nope, on="input"),
        pytest.raises(TransformError, match="raised AttributeError"),
    ):
        net(x).sum().backward()


def test_no_tensor_input_raises() -> None:
    class Constant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, n: int) -> torch.Tensor:
            return self.w * n

    model = nn.ModuleDict({"c": Constant()})
    with gg.reverse_grad(model, "c"), pytest.raises(NoTensorError, match="received no tensor"):
        model["c"](3)


# -- issue 14: valid values accepted, bad ones refused before anything is applied, copies ------


@pytest.mark.parametrize(
    "factor",
    [np.float32(0.25), np.float64(0.25), np.int64(2), torch.tensor(0.25), torch.tensor(2)],
    ids=["np.float32", "np.float64", "np.int64", "0-d float tensor", "0-d int tensor"],
)
def test_numpy_and_zero_dim_tensor_factors_are_numbers(factor) -> None:
    net, x = _net()
    ref = _reference(net, x)
    with gg.scale_grad(net, "2", factor):
        got = _grads(net, x)
    torch.testing.assert_close(got["2.weight"], float(factor) * ref["2.weight"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("norm_type", [math.inf, "inf", 1.0, np.float64(3.0)])
def test_clip_norm_type_inf_and_friends_match_the_formula(norm_type) -> None:
    net, x = _net()
    ref = _reference(net, x)
    with gg.clip_grad(net, "2", max_norm=0.01, norm_type=norm_type):
        got = _grads(net, x)
    order = math.inf if norm_type == "inf" else float(norm_type)
    for name in ("2.weight", "2.bias"):
        norm = torch.linalg.vector_norm(ref[name], order)
        expected = ref[name] * torch.clamp(0.01 / (norm + 1e-6), max=1.0)
        torch.testing.assert_close(got[name], expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda net: gg.scale_grad(net, "", 0.5), "which names no module"),
        (lambda net: gg.scale_grad(net, "2", torch.ones(2)), "expected a real number"),
        (lambda net: gg.scale_grad(net, "2", True), "expected a real number"),
        (lambda net: gg.clip_grad(net, "2", max_norm=1.0, norm_type=-1.0), "norm_type=-1.0"),
        (lambda net: gg.clip_grad(net, "2", max_norm=1.0, norm_type="l2"), "norm_type='l2'"),
        (lambda net: gg.scale_grad(torch.ones(2), "2", 0.5), "expected a torch.nn.Module"),
    ],
)
def test_bad_values_are_refused_before_any_hook(call, message) -> None:
    net, _ = _net()
    with pytest.raises(gg.GradgateError, match=re.escape(message)):
        call(net)
    assert not any(m._forward_pre_hooks for m in net.modules())
    assert all(not p._backward_hooks for p in net.parameters())


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_of_a_transformed_model_is_plain_and_the_original_stays_transformed(how) -> None:
    import copy as copying
    import io
    import pickle

    net, x = _net()
    ref = _reference(net, x)
    handle = gg.scale_grad(net, "2", 0.5, on="both")
    _grads(net, x)  # the transform has hooked the parameters
    if how == "deepcopy":
        twin = copying.deepcopy(net)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(net))
    else:
        buffer = io.BytesIO()
        torch.save(net, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    got_twin = _grads(twin, x)
    for name in ref:
        torch.testing.assert_close(got_twin[name], ref[name], rtol=0, atol=0)
    assert not any(m._forward_pre_hooks for m in twin.modules())
    got = _grads(net, x)
    torch.testing.assert_close(got["2.weight"], 0.5 * ref["2.weight"], rtol=1e-12, atol=0)
    handle.remove()
