"""Each check finding: a test that triggers it and a test that its fix clears it."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

import gradgate as gg


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))


def _codes(findings: list[gg.Finding]) -> list[str]:
    return [finding.code for finding in findings]


def _train_step(net: nn.Module, opt: torch.optim.Optimizer, *, set_to_none: bool) -> None:
    opt.zero_grad(set_to_none=set_to_none)
    net(torch.randn(4, 3)).pow(2).mean().backward()
    opt.step()


def test_finding_is_a_frozen_dataclass() -> None:
    finding = gg.Finding("code", "where", "message", "fix")
    with pytest.raises(dataclasses.FrozenInstanceError):
        finding.code = "other"  # type: ignore[misc]
    assert str(finding) == "[code] where: message Fix: fix"


def test_clean_model_has_no_findings() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _train_step(net, opt, set_to_none=True)
    assert gg.check(net, opt, loss=net.train()(torch.randn(4, 3)).sum()) == []


def test_frozen_weight_drifts_with_zero_grad_tensor() -> None:
    """The classic drift: requires_grad=False by hand and zero-tensor grads under SGD."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    _train_step(net, opt, set_to_none=True)  # momentum buffers now exist
    for p in net[0].parameters():
        p.requires_grad = False
    before = net[0].weight.detach().clone()
    _train_step(net, opt, set_to_none=False)  # .grad of the frozen layer: zero tensors
    assert not torch.equal(net[0].weight, before)  # it moved although "frozen"
    findings = [f for f in gg.check(net, opt) if f.code == "frozen-in-optimizer"]
    assert [f.where for f in findings] == ["0.weight", "0.bias"]
    assert "momentum=0.9, weight_decay=0.01" in findings[0].message
    assert "a zero tensor (not None)" in findings[0].message
    assert "gg.freeze(model, '0.weight')" in findings[0].fix


def test_gradgate_freeze_keeps_weight_bit_identical() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    _train_step(net, opt, set_to_none=True)
    with gg.frozen(net, "0"):
        before = net[0].weight.detach().clone()
        for _ in range(3):
            _train_step(net, opt, set_to_none=True)
        assert torch.equal(net[0].weight, before)
        assert "frozen-in-optimizer" not in _codes(gg.check(net, opt))


def test_a_gradient_kept_by_freeze_then_zeroed_in_place_moves_nothing() -> None:
    # freeze keeps a gradient already held (micro-batch accumulation); zero_grad(set_to_none=
    # False) turns it into a zero tensor, which the next step drops: nothing moves, nothing to
    # report
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    _train_step(net, opt, set_to_none=True)
    with gg.frozen(net, "0"):
        before = net[0].weight.detach().clone()
        _train_step(net, opt, set_to_none=False)
        assert torch.equal(net[0].weight, before)
        assert "frozen-in-optimizer" not in _codes(gg.check(net, opt))


def test_adam_state_is_named() -> None:
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    _train_step(net, opt, set_to_none=True)
    net[2].weight.requires_grad_(False)
    net[2].weight.grad = torch.zeros_like(net[2].weight)
    (finding,) = [f for f in gg.check(net, opt) if f.code == "frozen-in-optimizer"]
    assert "Adam state (exp_avg, exp_avg_sq, step)" in finding.message


def test_plain_requires_grad_attribute() -> None:
    net = _net()
    net[0].requires_grad = False  # does nothing
    (finding,) = gg.check(net)
    assert finding.code == "requires-grad-attr" and finding.where == "0"
    assert net[0].weight.requires_grad
    assert "0.requires_grad_(False)" in finding.fix
    del net[0].requires_grad
    net[0].requires_grad_(False)
    assert gg.check(net) == []


def test_norm_in_frozen_region() -> None:
    net = _net().train()
    net[1].requires_grad_(False)
    (finding,) = gg.check(net)
    assert (finding.code, finding.where) == ("norm-in-frozen", "1")
    assert "running mean and variance" in finding.message
    net[1].requires_grad_(True)
    with gg.frozen(net, "1", norm="eval"):
        net.train()
        assert gg.check(net) == []


def test_not_in_optimizer_and_fix() -> None:
    net = _net()
    opt = torch.optim.SGD(net[2].parameters(), lr=0.1)
    findings = gg.check(net, opt)
    assert _codes(findings) == ["not-in-optimizer"] * 4
    assert [f.where for f in findings] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    with gg.frozen(net, "0", "1", norm="eval"):
        assert gg.check(net, opt) == []


def test_same_parameter_in_two_groups_or_optimizers() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt.param_groups[0]["params"].append(net[2].weight)  # torch only checks at construction
    (finding,) = gg.check(net, opt)
    assert (finding.code, finding.where) == ("param-in-two-groups", "2.weight")
    opt.param_groups[0]["params"].pop()
    assert gg.check(net, opt) == []
    second = torch.optim.Adam([net[0].weight], lr=0.1)
    (finding,) = gg.check(net, [opt, second])
    assert "optimizer 0 param_groups[0] and again in optimizer 1 param_groups[0]" in (
        finding.message
    )


def test_eval_still_builds_a_graph() -> None:
    net = _net().eval()
    out = net(torch.randn(4, 3))
    (finding,) = gg.check(net, loss=out)
    assert finding.code == "eval-builds-graph"
    assert "torch.no_grad()" in finding.fix
    with torch.no_grad():
        out = net(torch.randn(4, 3))
    assert gg.check(net, loss=out) == []


def test_requires_grad_changed_after_forward() -> None:
    net = _net()
    loss = net(torch.randn(4, 3)).sum()
    net[0].weight.requires_grad_(False)  # too late: the graph already has its AccumulateGrad
    (finding,) = gg.check(net, loss=loss)
    assert (finding.code, finding.where) == ("late-freeze", "0.weight")
    assert "run the forward again" in finding.fix
    net[0].weight.requires_grad_(True)
    with gg.frozen(net, "0.weight"):
        loss = net(torch.randn(4, 3)).sum()
        assert gg.check(net, loss=loss) == []


def test_check_never_prints(capsys: pytest.CaptureFixture[str]) -> None:
    net = _net()
    net[0].requires_grad = False
    gg.check(net, torch.optim.SGD(net[2].parameters(), lr=0.1))
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("net",), {}, "gg.check(model=...) got str; expected a torch.nn.Module"),
        ((nn.Linear(2, 2), "sgd"), {}, "gg.check(optimizer=...) got str 'sgd'; expected"),
        ((nn.Linear(2, 2), [None]), {}, "gg.check(optimizer=...) got NoneType None; expected"),
        ((nn.Linear(2, 2),), {"loss": 3.0}, "gg.check(loss=3.0) got float; expected the torch"),
    ],
)
def test_arguments_of_the_wrong_kind_are_named(
    args: tuple[object, ...], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(gg.InvalidOptionError, match=re.escape(message)):
        gg.check(*args, **kwargs)  # type: ignore[arg-type]


def test_a_list_of_optimizers_is_checked() -> None:
    net = _net()
    first = torch.optim.SGD(net[0].parameters(), lr=0.1)
    second = torch.optim.SGD(net.parameters(), lr=0.1)
    codes = [(f.code, f.where) for f in gg.check(net, [first, second])]
    assert codes == [("param-in-two-groups", "0.weight"), ("param-in-two-groups", "0.bias")]
