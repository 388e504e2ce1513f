"""capture_grads equals torch.autograd.grad with respect to the same intermediate tensors."""

from __future__ import annotations

import pytest
import torch
from models import bert, cnn_with_batchnorm, gpt2
from torch import nn

import gradgate as gg
from gradgate._plumbing.errors import GradientNotReadyError, UnknownCaptureError
from gradgate._tools.capture import NoTensorError


class Product(nn.Module):
    """The seed's C = A * B as a module, with B a learnable parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.tensor([2.0, 3.0, 4.0]))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a * self.b


def _outputs(model: nn.Module, names: list[str], run) -> dict[str, list[torch.Tensor]]:
    """Run the forward once, keeping each named module's output tensors (the reference)."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    lookup = dict(model.named_modules())
    hooks = [
        lookup[name].register_forward_hook(
            lambda m, a, out, name=name: seen[name].append(
                out[0] if isinstance(out, tuple) else out
            )
        )
        for name in names
    ]
    loss = run()
    for hook in hooks:
        hook.remove()
    return loss, seen


def test_seed_example_gradient_of_intermediate() -> None:
    model = Product()
    a = torch.tensor([1, 2, 3])
    with gg.capture_grads(model, "") as grads:
        model(a).sum().backward()
    assert torch.equal(grads[""], torch.ones(3))
    assert torch.equal(model.b.grad, torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.parametrize(
    ("factory", "names"),
    [
        (gpt2, ["transformer.h.0", "transformer.h.2", "transformer.ln_f"]),
        (bert, ["bert.encoder.layer.1", "bert.pooler"]),
        (cnn_with_batchnorm, ["0", "1.3", "3.2"]),
    ],
)
def test_equals_autograd_on_real_models(factory, names) -> None:
    model, batch, loss_fn = factory()
    model = model.double()
    if isinstance(batch, torch.Tensor):
        batch = batch.double()
    loss, outputs = _outputs(model, names, lambda: loss_fn(model, batch))
    reference = torch.autograd.grad(loss, [outputs[n][0] for n in names])
    with gg.capture_grads(model, *names) as grads:
        loss_fn(model, batch).backward()
    for name, expected in zip(names, reference, strict=True):
        got = grads[name]
        got = got[0] if isinstance(got, tuple) else got
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_one_backward_no_retain_graph() -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    with gg.capture_grads(net, "0", "1") as grads:
        loss = net(torch.randn(2, 3)).sum()
        loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()
    assert set(grads) == {"0", "1"}


def test_module_called_twice_gives_list_in_call_order() -> None:
    layer = nn.Linear(2, 2)
    model = nn.ModuleDict({"layer": layer})
    x = torch.randn(1, 2)
    with gg.capture_grads(model, "layer") as grads:
        first = layer(x)
        second = layer(first)
        (1.0 * first.sum() + 3.0 * second.sum()).backward()
    calls = grads.calls("layer")
    assert isinstance(calls, list) and len(calls) == 2
    assert grads["layer"] is calls[1]  # indexing gives the latest call, always one value
    # d loss / d second = 3; d loss / d first = 1 + 3 * (column sums of W)
    torch.testing.assert_close(calls[1], torch.full((1, 2), 3.0))
    torch.testing.assert_close(calls[0], 1.0 + 3.0 * layer.weight.sum(0, keepdim=True))


class TupleAndDict(nn.Module):
    def forward(self, x: torch.Tensor):
        return (2 * x, x.detach()), {"sq": x**2}


def test_tuple_and_dict_outputs() -> None:
    model = nn.ModuleDict({"m": TupleAndDict()})
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    with gg.capture_grads(model, "m", inputs=True) as grads:
        (pair, table) = model["m"](x)
        (pair[0].sum() + 5 * table["sq"].sum()).backward()
    (doubled, detached), out_dict = grads["m"]
    assert torch.equal(doubled, torch.ones(2))
    assert detached is None
    assert torch.equal(out_dict["sq"], torch.full((2,), 5.0))
    (args, kwargs) = grads.inputs["m"]
    assert torch.equal(args[0], x.grad) and kwargs == {}


def test_input_gradient_matches_autograd() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 3, dtype=torch.float64)
    net = net.double()
    with gg.capture_grads(net, "2", inputs=True) as grads:
        net(x).pow(2).sum().backward()
    hidden = net[1](net[0](x))
    (expected,) = torch.autograd.grad(net[2](hidden).pow(2).sum(), hidden)
    torch.testing.assert_close(grads.inputs["2"][0][0], expected)


def test_remove_is_idempotent_and_stops_capture() -> None:
    net = nn.Sequential(nn.Linear(2, 2))
    handle = gg.capture_grads(net, "0")
    handle.remove()
    handle.remove()
    net(torch.randn(1, 2)).sum().backward()
    assert len(handle) == 0
    assert not net[0]._forward_hooks


def test_clear_between_steps() -> None:
    net = nn.Sequential(nn.Linear(2, 2))
    with gg.capture_grads(net, "0") as grads:
        for _ in range(3):
            net(torch.randn(1, 2)).sum().backward()
        assert len(grads.calls("0")) == 3
        grads.clear()
        assert "0" not in grads and grads.calls("0") == []


def test_unknown_name_and_no_tensor_output() -> None:
    net = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(gg.UnknownModuleError, match="'nope' matches no module"):
        gg.capture_grads(net, "nope")

    class Silent(nn.Module):
        def forward(self, x: torch.Tensor) -> None:
            return None

    model = nn.ModuleDict({"s": Silent()})
    with gg.capture_grads(model, "s"), pytest.raises(NoTensorError, match="holds no tensor"):
        model["s"](torch.ones(1))


# -- issue 14/15: reading captured gradients ---------------------------------------------------


def test_reading_before_any_backward_is_a_clear_error_and_get_gives_none() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    grads = gg.capture_grads(net, "0")
    with pytest.raises(GradientNotReadyError, match="'0' has not run yet"):
        grads["0"]
    out = net(torch.randn(3, 2)).sum()
    with pytest.raises(GradientNotReadyError, match=r"no gradient has reached .*backward\(\)"):
        grads["0"]
    assert grads.get("0") is None and isinstance(GradientNotReadyError("x"), KeyError)
    out.backward()
    assert grads["0"].shape == (3, 2)
    grads.remove()


def test_output_that_does_not_require_grad_says_why() -> None:
    net = nn.Sequential(nn.Linear(2, 2))
    with gg.capture_grads(net, "0") as grads, torch.no_grad():
        net(torch.randn(3, 2))
    with pytest.raises(GradientNotReadyError, match="did not require grad"):
        grads["0"]


def test_value_keeps_its_type_across_steps_and_is_the_latest_step() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1))
    with gg.capture_grads(net, "1") as grads:
        for step in range(3):
            x = torch.randn(3, 2)
            hidden = torch.tanh(net[0](x))  # not through net[1]: that call would be captured
            (expected,) = torch.autograd.grad(net[2](hidden).pow(2).sum(), hidden)
            net(x).pow(2).sum().backward()
            assert isinstance(grads["1"], torch.Tensor), step
            torch.testing.assert_close(grads["1"], expected)
            assert len(grads.calls("1")) == step + 1


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential()
        self.body.add_module("layer3", nn.Linear(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_short_name_as_asked_works_and_a_typo_gets_close_matches() -> None:
    model = Outer()
    with gg.capture_grads(model, "layer3") as grads:
        model(torch.randn(1, 2)).sum().backward()
    assert grads["layer3"] is grads["body.layer3"]
    assert "layer3" in grads and list(grads) == ["body.layer3"]
    with pytest.raises(UnknownCaptureError, match=r"'layr3' was not captured.*'body\.layer3'"):
        grads["layr3"]
    with pytest.raises(KeyError):
        grads.inputs["layer3"]
    assert grads.get("layr3") is None and "layr3" not in grads


def test_no_pattern_is_refused_and_empty_string_is_the_model_itself() -> None:
    net = nn.Sequential(nn.Linear(2, 1))
    with pytest.raises(gg.InvalidOptionError, match="capture_grads\\(\\) got no pattern"):
        gg.capture_grads(net)
    assert not net._forward_hooks
    with gg.capture_grads(net, "") as grads:
        net(torch.randn(2, 2)).sum().backward()
    assert torch.equal(grads[""], torch.ones(2, 1))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_model_under_capture_carries_no_capture(how) -> None:
    import copy as copying
    import pickle

    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with gg.capture_grads(net, "0", inputs=True) as grads:
        twin = copying.deepcopy(net) if how == "deepcopy" else pickle.loads(pickle.dumps(net))
        twin(torch.randn(3, 2)).sum().backward()
        assert len(grads) == 0 and len(grads.inputs) == 0
        assert not twin[0]._forward_hooks and not twin[0]._forward_pre_hooks
        net(torch.randn(3, 2)).sum().backward()
        assert grads["0"].shape == (3, 2)
