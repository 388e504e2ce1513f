"""First-contact traps (issue 24): every argument does what it says, or refuses.

Each test is one call a new user makes by mistake; it must either do what the user most
plausibly meant, raise a :class:`gradgate.GradgateError` naming the value and the fix, or (only
where it cannot be known before the forward) warn at the first forward naming the module.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import gradgate as gg


def chain(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


# -- BackpropGate(model, 2) ------------------------------------------------------------------
def test_a_bare_integer_for_blocks_asks_whether_depth_was_meant() -> None:
    net = chain()
    with pytest.raises(gg.InvalidDepthError, match=r"blocks=2.*depth=2"):
        gg.BackpropGate(net, 2)  # type: ignore[arg-type]
    assert not net._forward_pre_hooks and "forward" not in vars(net)


def test_one_block_position_in_a_list_is_still_a_gate_over_that_block() -> None:
    net = chain()
    with gg.BackpropGate(net, [2], depth=1) as gate:
        assert gate.blocks == ["2"]


# -- freeze / frozen / unfreeze with no pattern ------------------------------------------------
@pytest.mark.parametrize("function", [gg.freeze, gg.frozen, gg.unfreeze])
def test_freeze_functions_with_no_pattern_refuse(function: object) -> None:
    net = chain()
    with pytest.raises(gg.InvalidOptionError, match=r"no pattern.*'\*\*'"):
        function(net)  # type: ignore[operator]
    assert all(p.requires_grad for p in net.parameters())


# -- blocks=['**'] ---------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [["**"], "**", ["**", "0"]])
def test_blocks_naming_the_model_itself_refuse(spec: object) -> None:
    net = chain()
    with pytest.raises(gg.UnknownModuleError, match="the model itself"):
        gg.BackpropGate(net, spec)  # type: ignore[arg-type]
    assert "forward" not in vars(net)


# -- float / multi-element tensor for depth, learn, skip ---------------------------------------
@pytest.mark.parametrize(
    "depth", [1.5, 2.0, torch.tensor([1, 2]), torch.tensor(1.5), torch.tensor([])]
)
def test_depth_that_is_not_one_integer_refuses(depth: object) -> None:
    with pytest.raises(gg.InvalidDepthError, match="depth"):
        gg.BackpropGate(chain(), depth=depth)  # type: ignore[arg-type]
    gate = gg.BackpropGate(chain())
    with pytest.raises(gg.InvalidDepthError, match="depth"):
        gate.depth = depth  # type: ignore[assignment]
    assert gate.depth is None
    gate.remove()


@pytest.mark.parametrize(
    "value", [1.5, {1.5}, torch.tensor(1.5), torch.tensor([1.5, 2.0]), {torch.tensor([1, 2])}]
)
@pytest.mark.parametrize("option", ["learn", "skip"])
def test_learn_and_skip_that_are_not_positions_refuse(option: str, value: object) -> None:
    net = nn.Sequential(*[Residual() for _ in range(4)])
    with gg.BackpropGate(net) as gate:
        gate.learn = {3}
        with pytest.raises(gg.InvalidDepthError, match=option):
            setattr(gate, option, value)
        assert gate.learn == {3} and gate.skip == frozenset()


def test_an_integer_tensor_of_positions_is_a_set_of_positions() -> None:
    net = nn.Sequential(*[Residual() for _ in range(4)])
    with gg.BackpropGate(net) as gate:
        gate.skip = torch.tensor([1, 2])  # type: ignore[assignment]
        gate.learn = torch.tensor([2, 3])  # type: ignore[assignment]
        assert gate.skip == {1, 2} and gate.learn == {2, 3}


# -- AuditReport.from_json, compile_blocks ------------------------------------------------------
@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"totals": 3}', "", None, b"{}"])
def test_from_json_of_bad_text_refuses(text: object) -> None:
    with pytest.raises(gg.InvalidOptionError, match="to_json"):
        gg.AuditReport.from_json(text)  # type: ignore[arg-type]


def test_from_json_reads_what_to_json_wrote() -> None:
    net = chain()
    with gg.audit(net) as report:
        net(torch.randn(2, 4)).sum().backward()
    again = gg.AuditReport.from_json(report.to_json())
    assert again.totals == report.totals


def test_compile_blocks_with_a_mistyped_keyword_refuses() -> None:
    net = chain()
    with pytest.raises(gg.InvalidOptionError, match=r"bakend.*backend"):
        gg.compile_blocks(net, bakend="eager")
    assert not any("forward" in vars(m) for m in net.modules())


# -- a generator forward -------------------------------------------------------------------------
class Streaming(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        for layer in self.layers:
            x = layer(x)
            yield x


def test_a_generator_forward_refuses() -> None:
    net = Streaming()
    with pytest.raises(gg.BlockCallError, match="generator"):
        gg.BackpropGate(net, "layers.*", depth=1)
    assert "forward" not in vars(net) and not net.layers[0]._forward_pre_hooks


def test_no_warning_for_a_plain_forward() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gg.BackpropGate(chain(), depth=1) as gate:
            gate._model(torch.randn(2, 4)).sum().backward()


# -- the freeze promise: no optimizer step moves what gradgate keeps from learning --------------
def sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def step(net: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    net(torch.randn(3, 4)).pow(2).sum().backward()


def weights(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def test_freeze_after_zero_grad_keeping_zeros_moves_nothing() -> None:
    net = chain()
    opt = sgd(net)
    step(net, opt, 0)
    opt.step()  # momentum buffers now hold a velocity
    opt.zero_grad(set_to_none=False)
    handle = gg.freeze(net, "0")
    assert net[0].weight.grad is None  # an all-zero gradient carries nothing: dropped
    before = weights(net)
    for seed in (1, 2):
        step(net, opt, seed)
        opt.step()
        opt.zero_grad(set_to_none=False)
    assert torch.equal(net[0].weight, before[0]) and torch.equal(net[0].bias, before[1])
    assert not torch.equal(net[1].weight, before[2])
    handle.undo()


def test_freeze_between_step_and_zero_grad_moves_nothing_later() -> None:
    net = chain()
    opt = sgd(net)
    step(net, opt, 0)
    opt.step()
    handle = gg.freeze(net, "0")  # the stale gradient is still there, then zeroed in place
    opt.zero_grad(set_to_none=False)
    before = weights(net)
    step(net, opt, 1)
    opt.step()
    assert torch.equal(net[0].weight, before[0])
    handle.undo()


def test_freeze_mid_accumulation_keeps_the_earlier_micro_batches_gradient() -> None:
    net, ref = chain(), chain()
    opt, ref_opt = sgd(net), sgd(ref)
    for model, optimizer in ((net, opt), (ref, ref_opt)):
        step(model, optimizer, 0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    step(net, opt, 1)  # micro-batch 1: everything learns
    handle = gg.freeze(net, "0")
    step(net, opt, 2)  # micro-batch 2: layer 0 frozen
    opt.step()
    torch.manual_seed(1)
    loss1 = ref(torch.randn(3, 4)).pow(2).sum()
    g1 = torch.autograd.grad(loss1, list(ref.parameters()))
    torch.manual_seed(2)
    loss2 = ref(torch.randn(3, 4)).pow(2).sum()
    g2 = torch.autograd.grad(loss2, list(ref.parameters())[2:])
    for i, p in enumerate(ref.parameters()):
        p.grad = g1[i] + (g2[i - 2] if i >= 2 else 0)
    ref_opt.step()
    for mine, theirs in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)
    assert net[0].weight.grad is None  # used by its step, then dropped
    before = net[0].weight.detach().clone()
    opt.zero_grad(set_to_none=False)
    step(net, opt, 3)
    opt.step()
    assert torch.equal(net[0].weight, before)
    handle.undo()


def test_a_layer_frozen_then_unfrozen_steps_as_plain_torch_again() -> None:
    """Unfrozen, a layer's all-zero .grad (zero_grad(set_to_none=False), then a backward that
    does not reach it) is the optimizer's again: momentum and weight decay move it, as they
    would with no freeze ever made. Only the frozen layers' zeros are dropped."""
    net, ref = chain(), chain()
    opt, ref_opt = sgd(net), sgd(ref)
    handle = None
    for t, plan in enumerate(["all", "freeze", "frozen", "unfreeze", "head only", "head only"]):
        if plan == "freeze":
            handle = gg.freeze(net, "0")
            for p in ref[0].parameters():  # what gradgate promises, by hand
                p.requires_grad_(False)
                p.grad = None  # an all-zero gradient carries nothing
        if plan == "unfreeze":
            back = gg.unfreeze(net, "0")  # the freeze's handle stays live
            for p in ref[0].parameters():
                p.requires_grad_(True)
        for model, optimizer in ((net, opt), (ref, ref_opt)):
            torch.manual_seed(t)
            x = torch.randn(3, 4)
            if plan == "head only":  # a backward that does not reach layer 0
                model[3](model[2](x)).pow(2).sum().backward()
            else:
                model(x).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        for mine, theirs in zip(net.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(mine, theirs, msg=lambda m, t=t: f"step {t}: {m}")
    assert net[0].weight.grad is not None  # the unfrozen layer's zeros were kept
    back.undo()
    handle.undo()


def test_blocks_cut_off_by_a_gate_do_not_drift_under_zero_grad_keeping_zeros() -> None:
    net = chain()
    opt = sgd(net)
    with gg.BackpropGate(net) as gate:
        step(net, opt, 0)
        opt.step()
        before = weights(net)
        for seed in (1, 2):
            opt.zero_grad(set_to_none=False)
            gate.depth = 1
            step(net, opt, seed)
            opt.step()
        for i in range(6):  # blocks 0..2 were cut off in every forward of both steps
            assert torch.equal(list(net.parameters())[i], before[i]), i
        assert not torch.equal(net[3].weight, before[6])


def test_the_stale_gradient_guard_leaves_gradients_the_stepping_optimizer_does_not_hold() -> None:
    """The guard drops the left-over .grad of cut-off blocks only among the parameters of the
    optimizer that steps: a gradient written by hand, or got from a separate backward, on a
    block it does not hold is the user's to apply."""
    net = chain()
    opt = torch.optim.SGD([*net[2].parameters(), *net[3].parameters()], lr=0.1)
    with gg.BackpropGate(net, depth=2):  # blocks 0 and 1 cut off in every forward
        for seed in (1, 2):
            step(net, opt, seed)
            net[0].weight.grad = torch.ones_like(net[0].weight)  # written by the user
            torch.manual_seed(seed)
            (net[1].weight * torch.randn(4, 4)).sum().backward()  # a separate backward
            separate = net[1].weight.grad.clone()
            before = weights(net)
            opt.step()  # the guard runs here: neither gradient is this optimizer's
            assert torch.equal(net[0].weight.grad, torch.ones_like(net[0].weight)), seed
            assert torch.equal(net[1].weight.grad, separate), seed
            with torch.no_grad():  # the user's own update of the stem
                for layer in net[:2]:
                    layer.weight -= 0.5 * layer.weight.grad
            torch.testing.assert_close(net[0].weight, before[0] - 0.5, rtol=0, atol=1e-6)
            torch.testing.assert_close(net[1].weight, before[2] - 0.5 * separate)
            assert not torch.equal(net[3].weight, before[6])  # the optimizer's own step ran
            net.zero_grad(set_to_none=True)


def test_a_gate_keeps_what_earlier_micro_batches_of_the_step_accumulated() -> None:
    net, ref = chain(), chain()
    opt, ref_opt = sgd(net), sgd(ref)
    with gg.BackpropGate(net) as gate:
        step(net, opt, 1)  # micro-batch 1: no cut
        gate.depth = 1
        step(net, opt, 2)  # micro-batch 2: only block 3 learns
        opt.step()
    torch.manual_seed(1)
    g1 = torch.autograd.grad(ref(torch.randn(3, 4)).pow(2).sum(), list(ref.parameters()))
    torch.manual_seed(2)
    g2 = torch.autograd.grad(ref(torch.randn(3, 4)).pow(2).sum(), list(ref.parameters())[6:])
    for i, p in enumerate(ref.parameters()):
        p.grad = g1[i] + (g2[i - 6] if i >= 6 else 0)
    ref_opt.step()
    for mine, theirs in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)


def test_an_optimizer_of_other_parameters_is_left_alone() -> None:
    net, other = chain(), chain()
    opt = sgd(other)
    handle = gg.freeze(net, "0")
    net[0].weight.grad = torch.ones_like(net[0].weight)  # not this optimizer's business
    step(other, opt, 0)
    opt.step()
    assert net[0].weight.grad is not None
    handle.undo()


# -- freezing one of two tied modules ----------------------------------------------------------
class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids)))


def test_freezing_one_of_two_tied_modules_warns_naming_both() -> None:
    model = Tied()
    with pytest.warns(gg.SharedParameterWarning, match=r"'head.weight'.*'emb.weight'"):
        handle = gg.freeze(model, "head")
    assert not model.emb.weight.requires_grad  # what it says: the tensor is frozen
    handle.undo()
    assert model.emb.weight.requires_grad


@pytest.mark.parametrize("patterns", [("head", "emb"), ("**",), ("emb.weight", "head")])
def test_freezing_both_tied_modules_is_silent(patterns: tuple[str, ...]) -> None:
    model = Tied()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gg.freeze(model, *patterns).undo()


# -- gate.skip on a block with no residual path ---------------------------------------------------
class ScaledResidual(nn.Module):
    """A residual block that returns a tuple, reshapes, and records each call's grad mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.modes.append(torch.is_grad_enabled())
        h = self.fc(x)
        out = (x.reshape(-1) + torch.tanh(h).reshape(-1)).view_as(x)
        return out, h.sum()


class TupleStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ScaledResidual() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x, _ = layer(x)
        return x


@pytest.mark.parametrize("learn", [None, {0, 2, 3}])
def test_skip_of_a_block_with_no_residual_path_refuses(learn: set[int] | None) -> None:
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    with gg.BackpropGate(net) as gate:
        gate.learn = learn
        gate.skip = {1}
        with pytest.raises(gg.BlockCallError, match=r"'1'.*residual"):
            net(torch.randn(2, 8))
        assert torch.is_grad_enabled()
        gate.skip = set()
        net(torch.randn(2, 8)).sum().backward()  # nothing left behind


def test_dropbp_on_blocks_with_no_residual_path_refuses() -> None:
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    sched = gg.schedules.DropBP(4, rates=[0.0, 1.0, 0.0, 0.0])
    with gg.BackpropGate(net) as gate:
        sched.apply(gate, 0)
        with pytest.raises(gg.BlockCallError, match="residual"):
            net(torch.randn(2, 8))


def test_skip_of_a_residual_block_is_checked_once_and_then_runs_with_no_graph() -> None:
    torch.manual_seed(0)
    net = TupleStack()
    x = torch.randn(3, 4)
    with gg.BackpropGate(net, "layers.*") as gate:
        gate.skip = {1}
        for _ in range(3):
            net.zero_grad(set_to_none=True)
            net(x).sum().backward()
            assert net.layers[1].fc.weight.grad is None  # skipped: no gradient of its own
    assert net.layers[1].modes == [True, False, False]  # the graph only for the first check
    # the gradient passes around the skipped block as the identity (DropBP)
    layers = net.layers
    h0, _ = layers[0](x)
    with torch.no_grad():
        h1 = layers[1](h0)[0]
    h1 = h1 + (h0 - h0.detach())
    h3 = layers[3](layers[2](h1)[0])[0]
    expected = torch.autograd.grad(h3.sum(), list(layers[0].parameters()))
    net.zero_grad(set_to_none=True)
    with gg.BackpropGate(net, "layers.*") as gate:
        gate.skip = {1}
        net(x).sum().backward()
    for got, want in zip(layers[0].parameters(), expected, strict=True):
        torch.testing.assert_close(got.grad, want)


# -- blocks and modules the forward never calls ----------------------------------------------------
class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_learning_block_the_forward_never_calls_is_named() -> None:
    net = WithUnused()
    with (
        gg.BackpropGate(net, ["a", "b", "unused"], depth=1),
        pytest.warns(gg.BlockCallWarning, match=r"'unused'.*never ran"),
    ):
        out = net(torch.randn(2, 4))
    assert not out.requires_grad


def test_stop_gradient_at_a_module_the_forward_never_calls_is_named() -> None:
    net = WithUnused()
    with (
        gg.stop_gradient_at(net, "unused"),
        pytest.warns(gg.BlockCallWarning, match=r"'unused'.*never ran"),
    ):
        net(torch.randn(2, 4))


def test_a_learning_module_the_forward_never_calls_is_named() -> None:
    net = WithUnused()
    with gg.BackpropGate(net, ["a", "b"]) as gate:
        gate.learn = {"unused"}
        with pytest.warns(gg.BlockCallWarning, match=r"'unused'.*never ran"):
            net(torch.randn(2, 4))


def test_compile_blocks_with_a_backend_torch_does_not_know_refuses() -> None:
    net = chain()
    with pytest.raises(gg.InvalidOptionError, match="nope"):
        gg.compile_blocks(net, backend="nope")
    assert not any("forward" in vars(m) for m in net.modules())
