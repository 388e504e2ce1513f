"""Model X feeds model Y and only Y learns: no_grad, freeze or a cut — what does each compute?

Compares four ways, by Y's gradients (all equal) and by backward FLOPs (counted by
``torch.utils.flop_counter.FlopCounterMode``):

* nothing: X runs with autograd and Y alone is in the optimizer (X's wgrad is wasted);
* ``torch.no_grad()`` around X;
* ``gg.freeze`` of X (its parameters stop requiring grad);
* ``gg.stop_gradient_at(model, "y")``: a cut at Y's input.
"""

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gradgate as gg


class XThenY(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        self.y = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        return self.y(self.x(data))


def backward_flops(loss: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def main() -> None:
    torch.manual_seed(0)
    model = XThenY()
    data = torch.randn(32, 64)
    results = {}

    model.zero_grad(set_to_none=True)
    results["nothing"] = backward_flops(model(data).pow(2).mean())
    wasted = model.x[0].weight.grad is not None
    y_reference = model.y[0].weight.grad.clone()
    opt = torch.optim.SGD(model.y.parameters(), lr=0.1)
    wasted_findings = {f.code for f in gg.check(model, opt)}

    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        hidden = model.x(data)
    results["no_grad"] = backward_flops(model.y(hidden).pow(2).mean())
    same = [torch.allclose(model.y[0].weight.grad, y_reference)]

    model.zero_grad(set_to_none=True)
    with gg.frozen(model, "x"):
        results["freeze"] = backward_flops(model(data).pow(2).mean())
    same.append(torch.allclose(model.y[0].weight.grad, y_reference))

    model.zero_grad(set_to_none=True)
    with gg.stop_gradient_at(model, "y"):
        results["cut"] = backward_flops(model(data).pow(2).mean())
    same.append(torch.allclose(model.y[0].weight.grad, y_reference))

    # audit evidence: in Y's update under the cut, X computes no wgrad and no dgrad
    with gg.audit(model) as report:
        with gg.stop_gradient_at(model, "y"):
            out = model(data)
        out.pow(2).mean().backward()
    audited_x = report.module("x")

    print(f"backward FLOPs: {results}")
    print(f"without no_grad or freeze, X's wgrad is computed and wasted: {wasted}")
    print(f"gg.check flags it: {'not-in-optimizer' in wasted_findings}")
    print(f"Y's gradients equal in all four ways: {all(same)}")
    print(
        "no_grad, freeze and cut compute the same backward: "
        f"{results['no_grad'] == results['freeze'] == results['cut'] < results['nothing']}"
    )
    print(f"X's .grad stays None after the cut: {model.x[0].weight.grad is None}")
    print(f"Y update audit: X wgrad={audited_x.wgrad} dgrad={audited_x.dgrad}")


if __name__ == "__main__":
    main()
