"""The conv-stack questions, each answered by running the code the report shows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import gradgate as gg

SETUP = """\
import torch, gradgate as gg

def convs(n):  # n small conv layers in a row
    return torch.nn.Sequential(*[torch.nn.Conv2d(3, 3, 3) for _ in range(n)])

x = torch.randn(16, 3, 24, 24)  # a batch of 16 small RGB images
"""


@dataclass
class Scenario:
    """One question, the code that answers it, and what backward computed when it ran."""

    question: str
    code: str  # run exactly as shown, after SETUP; it defines `report` and `picture`
    why: str  # the answer in words
    doc: str  # the docs page that treats the question, relative to docs/
    report: gg.AuditReport
    picture: gg.Graph | None = None


_QUESTIONS: list[tuple[str, str, str, str]] = [
    (
        "Training as usual: which gradients does backward compute?",
        """\
model = convs(10)
with gg.audit(model) as report:
    loss = model(x).mean()
    picture = gg.graph(loss, model=model)
    loss.backward()
""",
        "Every layer gets the gradient of its own weights (wgrad). Every layer except the "
        "first also computes the gradient for its input (dgrad), to pass it back to the layer "
        "before; the first layer's input is the data, which needs none.",
        "questions/what-are-wgrad-and-dgrad.md",
    ),
    (
        "If I freeze the first 9 layers, are their gradients still computed?",
        """\
model = convs(10)
with gg.frozen(model, "0:9"), gg.audit(model) as report:  # layers 0 to 8
    loss = model(x).mean()
    picture = gg.graph(loss, model=model)
    loss.backward()
""",
        "No. Only the last layer learns: its weight gradient is the only one computed, and "
        "no input gradient is needed at all, because nothing before it learns.",
        "questions/is-the-gradient-still-computed.md",
    ),
    (
        "How do I backprop through only the last 2 layers?",
        """\
model = convs(10)
with gg.backprop_depth(model, 2), gg.audit(model) as report:
    loss = model(x).mean()
    picture = gg.graph(loss, model=model)
    loss.backward()
""",
        "The first 8 layers run with no autograd graph: no gradients and no activations "
        "saved for them. The last 2 compute their weight gradients, and the input gradient "
        "between them.",
        "questions/backprop-last-k-layers.md",
    ),
    (
        "If I freeze a layer in the middle, does the gradient still flow through it?",
        """\
model = convs(3)
with gg.frozen(model, "1"), gg.audit(model) as report:  # the middle layer
    loss = model(x).mean()
    picture = gg.graph(loss, model=model)
    loss.backward()
""",
        "Yes. The frozen middle layer gets no weight gradient, but it still computes the "
        "gradient for its input, because the first layer learns and needs it.",
        "questions/freeze-non-consecutive-layers.md",
    ),
    (
        "I set requires_grad = False after computing the loss: does that save anything?",
        """\
model = convs(3)
with gg.audit(model) as report:
    loss = model(x).mean()
    model[0].weight.requires_grad_(False)  # too late: the graph is already recorded
    picture = gg.graph(loss, model=model)
    loss.backward()
""",
        "No. Backward still computes the first layer's weight gradient, then throws it away: "
        "the audit lists it as wasted. Freeze before the forward instead.",
        "questions/freeze-after-forward.md",
    ),
]


def conv_scenarios(*, draw: bool = True) -> list[Scenario]:
    """Run every question's code after SETUP (fixed seeds) and keep its audit and graph."""
    scenarios = []
    for question, code, why, doc in _QUESTIONS:
        torch.manual_seed(0)
        namespace: dict[str, object] = {"__name__": "gradgate_demo"}
        exec(compile(SETUP + code, f"<gradgate demo: {question}>", "exec"), namespace)
        picture = namespace["picture"] if draw else None
        report = namespace["report"]
        assert isinstance(report, gg.AuditReport)
        assert picture is None or isinstance(picture, gg.Graph)
        scenarios.append(Scenario(question, code, why, doc, report, picture))
    return scenarios
