"""Four more questions, each answered by running the code the report shows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import gradgate as gg


@dataclass
class Answer:
    """A question, the code run to answer it, and the answer with the numbers just measured."""

    question: str
    code: str
    sentence: str
    doc: str
    report: gg.AuditReport | None = None
    table_html: str = ""


_INTERMEDIATE = """\
import torch, gradgate as gg
from torch import nn

net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))
x = torch.randn(3, 5)
with gg.capture_grads(net, "1") as grads:  # the output of the Tanh
    net(x).sum().backward()

# the same gradient with plain autograd, for comparison
hidden = net[1](net[0](x))
(reference,) = torch.autograd.grad(net[2](hidden).sum(), hidden)
difference = (grads["1"] - reference).abs().max().item()
"""

_DRIFT = """\
import torch, gradgate as gg
from torch import nn

def train_frozen(fixed):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    x = torch.randn(8, 4)
    net(x).sum().backward(); opt.step()  # one ordinary step: momentum now exists
    before = net[0].weight.detach().clone()
    if fixed:
        handle = gg.freeze(net, "0")
    else:
        net[0].requires_grad_(False)  # by hand
    for _ in range(5):
        opt.zero_grad(set_to_none=fixed)  # by hand: zero tensors are kept
        net(x).sum().backward(); opt.step()
    findings = [finding.code for finding in gg.check(net, opt)]
    return (net[0].weight.detach() - before).abs().max().item(), findings

(by_hand, by_hand_findings), (fixed, fixed_findings) = train_frozen(False), train_frozen(True)
"""

_ACTOR_CRITIC = """\
import torch, gradgate as gg
from torch import nn

pair = nn.Sequential()
pair.add_module("actor", nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2)))
pair.add_module("critic", nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)))
state = torch.randn(32, 3)
with gg.stop_gradient_at(pair, "critic"), gg.audit(pair) as report:  # the critic's update
    pair(state).pow(2).mean().backward()
actor, critic = report.module("actor"), report.module("critic")
"""

_DEPTH_FITS = """\
import torch, gradgate as gg
from torch import nn

with torch.device("meta"):  # shapes only: no weight memory, nothing computed
    layers = [nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True) for _ in range(24)]
    net = nn.Sequential(nn.Sequential(*layers), nn.Linear(1024, 32000))
tokens = torch.empty(8, 1024, 1024, device="meta")  # batch 8, sequence 1024, width 1024
plan = gg.estimate(net, tokens, optimizer="adamw")
depth = plan.fits("16GiB")
"""


def _intermediate_sentence(ns: dict[str, Any]) -> str:
    return (
        "gg.capture_grads gave the gradient of the loss with respect to the Tanh's output, "
        "from one ordinary backward that also trained the weights. Largest difference from "
        f"torch.autograd.grad: {ns['difference']:.1e}."
    )


def _drift_sentence(ns: dict[str, Any]) -> str:
    return (
        "Frozen by hand (requires_grad = False, gradients zeroed but kept as zero tensors), "
        f"SGD with momentum and weight decay still moved the frozen weights by up to "
        f"{ns['by_hand']:.2e} in 5 steps, and gg.check named the cause: "
        f"{', '.join(sorted(set(ns['by_hand_findings'])))}. Frozen with gg.freeze and "
        "gradients cleared to None (zero_grad's default), the optimizer skipped them: they "
        f"moved by {ns['fixed']:.1e}, and gg.check found {len(ns['fixed_findings'])} problems."
    )


def _actor_critic_sentence(ns: dict[str, Any]) -> str:
    actor, critic = ns["actor"], ns["critic"]
    return (
        f"The critic's update computed {actor.wgrad} weight gradients, {actor.dgrad} input "
        f"gradients and {actor.backward_flops} backward FLOPs in the actor; the critic got "
        f"{critic.wgrad} weight gradients ({critic.backward_flops:,} backward FLOPs)."
    )


def _depth_fits_sentence(ns: dict[str, Any]) -> str:
    plan, depth = ns["plan"], ns["depth"]
    row, full = plan[depth], plan.rows[-1]
    return (
        f"Planned on fake tensors in seconds, with no weight memory: backprop through all "
        f"{plan.blocks} blocks needs about {full.peak_bytes / 2**30:.1f} GiB, mostly "
        f"activations saved for backward ({full.saved_bytes / 2**30:.1f} GiB); the largest "
        f"depth that fits in 16 GiB is {depth} ({row.peak_bytes / 2**30:.1f} GiB)."
    )


_ANSWERS: list[tuple[str, str, Callable[[dict[str, Any]], str], str]] = [
    (
        "How do I get the gradient of an intermediate tensor?",
        _INTERMEDIATE,
        _intermediate_sentence,
        "questions/intermediate-gradients.md",
    ),
    (
        "Why did my frozen layer still change?",
        _DRIFT,
        _drift_sentence,
        "questions/why-did-my-frozen-layer-change.md",
    ),
    (
        "Actor-critic: how do I keep the critic's loss away from the actor?",
        _ACTOR_CRITIC,
        _actor_critic_sentence,
        "questions/actor-critic.md",
    ),
    (
        "Which depth fits my GPU?",
        _DEPTH_FITS,
        _depth_fits_sentence,
        "depth-fits.md",
    ),
]


def answers() -> list[Answer]:
    """Run each answer's code (fixed seed) and word its result."""
    found = []
    for question, code, sentence, doc in _ANSWERS:
        torch.manual_seed(0)
        namespace: dict[str, Any] = {"__name__": "gradgate_demo"}
        exec(compile(code, f"<gradgate demo: {question}>", "exec"), namespace)
        report = namespace.get("report")
        plan = namespace.get("plan")
        table = plan._repr_html_() if isinstance(plan, gg.MemoryPlan) else ""
        found.append(Answer(question, code, sentence(namespace), doc, report, table))
    return found
