"""capture_grads equals torch.autograd.grad with respect to the same intermediate tensors."""

from __future__ import annotations

import pytest
import torch
from models import bert, cnn_with_batchnorm, gpt2
from torch import nn

import gradgate as gg
from gradgate._capture import NoTensorError


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
    calls = grads["layer"]
    assert isinstance(calls, list) and len(calls) == 2
    # d loss / d second = 3; d loss / d first = 1 + 3 * (column sums of W)
    torch.testing.assert_close(calls[1], torch.full((1, 2), 3.0))
    torch.testing.assert_close(calls[0], 1.0 + 3.0 * layer.weight.sum(0, keepdim=True))
    assert all(a is b for a, b in zip(grads.calls("layer"), calls, strict=True))


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
        assert "0" not in grads


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
