"""Bad input to every public callable: a clear GradgateError at the call, and no trace.

Every case calls one public function (``gradgate.__all__``, ``gg.schedules``, ``gg.optim``,
``gg.distributed``) with one bad argument on a fresh model. The call must raise a
:class:`gradgate.GradgateError` subclass whose message names the bad value and says what was
expected, and must leave nothing behind: hook dictionaries of every module and the global ones,
``requires_grad``, ``training``, module attributes and grad mode are as before. Valid values
that look unusual (``norm_type=inf``, numpy scalars, 0-d tensors) must be accepted.

Cases whose fix belongs to another module's owner are ``xfail(strict=True)`` with the owner in
the reason: they start failing (XPASS) the moment the owner fixes them, so the marker goes.
``python tests/test_bad_input.py`` prints the counts by outcome.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradgate as gg

LEAD = "owner: lead"  # gate, select, compile, schedules, optim, distributed
AUDIT = "owner: audit helper"  # audit, graph, check, explain


class Model(nn.Module):
    """Four blocks, a norm layer and a head: enough for every option to mean something."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(3, 3), nn.Tanh()) for _ in range(4)])
        self.norm = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


X = torch.randn(4, 3)  # an input for Model


class Ctx:
    """A fresh model per case; the optimizer and a loss are made only when a case asks."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Model()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    @property
    def loss(self) -> torch.Tensor:
        return self.model(torch.randn(4, 3)).sum()


def _ctx() -> Ctx:
    return Ctx()


@dataclass
class Case:
    id: str
    call: Callable[[Ctx], Any]
    needle: str  # text the message must contain (the bad value, as the user wrote it)
    owner: str | None = None  # who must fix it, while it is not fixed


NOT_MODULES: list[tuple[str, Any]] = [
    ("None", None),
    ("str", "model"),
    ("tensor", torch.ones(2)),
    ("list", [nn.Linear(2, 2)]),
]

MODEL_FUNCTIONS: list[tuple[str, Callable[[Any, Ctx], Any], str | None]] = [
    ("blocks", lambda m, c: gg.blocks(m), None),
    ("select", lambda m, c: gg.select(m, "0"), None),
    ("backprop_depth", lambda m, c: gg.backprop_depth(m, 1), None),
    ("BackpropGate", lambda m, c: gg.BackpropGate(m), None),
    ("stop_gradient_at", lambda m, c: gg.stop_gradient_at(m, "head"), None),
    ("StopGradient", lambda m, c: gg.StopGradient(m, "head"), None),
    ("freeze", lambda m, c: gg.freeze(m, "head"), None),
    ("frozen", lambda m, c: gg.frozen(m, "head"), None),
    ("unfreeze", lambda m, c: gg.unfreeze(m, "head"), None),
    ("capture_grads", lambda m, c: gg.capture_grads(m, "head"), None),
    ("scale_grad", lambda m, c: gg.scale_grad(m, "head", 0.5), None),
    ("reverse_grad", lambda m, c: gg.reverse_grad(m, "head"), None),
    ("clip_grad", lambda m, c: gg.clip_grad(m, "head", max_norm=1.0), None),
    ("zero_grad_of", lambda m, c: gg.zero_grad_of(m, "head"), None),
    ("grad_transform", lambda m, c: gg.grad_transform(m, "head", torch.neg), None),
    ("audit", lambda m, c: gg.audit(m), None),
    ("estimate", lambda m, c: gg.estimate(m, torch.randn(4, 3)), None),
    ("check", lambda m, c: gg.check(m), None),
    ("compile_blocks", lambda m, c: gg.compile_blocks(m), None),
    ("graph(model=)", lambda m, c: gg.graph(c.loss, model=m), None),
    ("explain(model=)", lambda m, c: gg.explain(m), None),  # None is valid for these two
    ("optim.param_groups", lambda m, c: gg.optim.param_groups(m, lr=0.1), None),
    ("optim.add_missing", lambda m, c: gg.optim.add_missing(c.optimizer, m), None),
    ("distributed.allreduce_trained", lambda m, c: gg.distributed.allreduce_trained(m), None),
    ("learning", lambda m, c: gg.learning(m), None),
    ("learn_rows", lambda m, c: gg.learn_rows(m, "head", rows=[0]), None),
    ("PrefixCache", lambda m, c: gg.PrefixCache(m), None),  # takes a gate, not a model
]


def _not_module_cases() -> list[Case]:
    cases = []
    for fname, call, owner in MODEL_FUNCTIONS:
        for vname, value in NOT_MODULES:
            if value is None and fname.endswith("(model=)"):
                continue
            needle = type(value).__name__
            cases.append(
                Case(f"{fname}-model={vname}", lambda c, f=call, v=value: f(v, c), needle, owner)
            )
    return cases


PATTERN_FUNCTIONS: list[tuple[str, Callable[[Ctx, Any], Any]]] = [
    ("select", lambda c, p: gg.select(c.model, p)),
    ("freeze", lambda c, p: gg.freeze(c.model, p)),
    ("frozen", lambda c, p: gg.frozen(c.model, "head", p)),
    ("unfreeze", lambda c, p: gg.unfreeze(c.model, p)),
    ("capture_grads", lambda c, p: gg.capture_grads(c.model, "head", p)),
    ("scale_grad", lambda c, p: gg.scale_grad(c.model, p, 0.5)),
    ("grad_transform", lambda c, p: gg.grad_transform(c.model, p, torch.neg)),
    ("stop_gradient_at", lambda c, p: gg.stop_gradient_at(c.model, p)),
    ("BackpropGate(blocks=)", lambda c, p: gg.BackpropGate(c.model, blocks=[p])),
    ("compile_blocks(blocks=)", lambda c, p: gg.compile_blocks(c.model, blocks=[p])),
]

BAD_PATTERNS: list[tuple[str, Any, str]] = [
    ("unknown", "blocks.9", "'blocks.9'"),
    ("typo", "haed", "'haed'"),
    ("float", 1.5, "1.5"),
    ("none", None, "None"),
    ("bool", True, "True"),
    ("list", ["head"], "['head']"),
    ("out-of-range-int", 9, "9"),
    ("out-of-range-slice", slice(10, 20), "slice(10, 20"),
    ("zero-step-slice", slice(0, 4, 0), "slice(0, 4, 0"),
    ("whitespace", " ", "' '"),
    ("empty-range", "blocks.3:1", "'blocks.3:1'"),
    ("out-of-range-range", "blocks.0:99", "'blocks.0:99'"),
    ("out-of-range-negative-range", "blocks.-9:", "'blocks.-9:'"),
    ("bool-tensor", torch.tensor(True), "tensor(True)"),
]


def _pattern_cases() -> list[Case]:
    cases = []
    for fname, call in PATTERN_FUNCTIONS:
        for pname, pattern, needle in BAD_PATTERNS:
            cases.append(
                Case(f"{fname}-pattern={pname}", lambda c, f=call, p=pattern: f(c, p), needle)
            )
        if fname != "capture_grads":  # there, '' names the model itself (documented)
            cases.append(Case(f"{fname}-pattern=''", lambda c, f=call: f(c, ""), "''"))
    return cases


def _blocks_cases() -> list[Case]:
    calls: list[tuple[str, Callable[[Ctx, Any], Any]]] = [
        ("backprop_depth", lambda c, b: gg.backprop_depth(c.model, 1, blocks=b)),
        ("BackpropGate", lambda c, b: gg.BackpropGate(c.model, blocks=b)),
        ("compile_blocks", lambda c, b: gg.compile_blocks(c.model, blocks=b)),
        ("optim.param_groups", lambda c, b: gg.optim.param_groups(c.model, lr=0.1, blocks=b)),
    ]
    bad: list[tuple[str, Callable[[Ctx], Any], str]] = [
        ("module", lambda c: c.model.blocks, "Sequential"),
        ("empty-list", lambda c: [], "[]"),
        ("unknown", lambda c: ["blocks.9"], "'blocks.9'"),
        ("empty-string", lambda c: "", "''"),
        ("out-of-range-range", lambda c: "blocks.1:9", "'blocks.1:9'"),
        ("vector-tensor", lambda c: torch.tensor([1]), "tensor([1])"),
    ]
    return [
        Case(f"{fname}-blocks={bname}", lambda c, f=call, b=make: f(c, b(c)), needle)
        for fname, call in calls
        for bname, make, needle in bad
    ]


def _plan(c: Ctx, field: str, value: Any) -> None:
    """Set a plan field on a gate over the four blocks; the gate goes whatever happens."""
    gate = gg.BackpropGate(c.model, "blocks.*")
    try:
        setattr(gate, field, value)
    finally:
        gate.remove()


def _option_cases() -> list[Case]:
    m = lambda c: c.model  # noqa: E731
    raw: list[tuple[str, Callable[[Ctx], Any], str]] = [
        # depth and gate options
        ("backprop_depth-depth=-1", lambda c: gg.backprop_depth(m(c), -1), "-1"),
        ("backprop_depth-depth=99", lambda c: gg.backprop_depth(m(c), 99), "99"),
        ("backprop_depth-depth=1.5", lambda c: gg.backprop_depth(m(c), 1.5), "1.5"),
        ("backprop_depth-depth='2'", lambda c: gg.backprop_depth(m(c), "2"), "'2'"),
        ("backprop_depth-depth=True", lambda c: gg.backprop_depth(m(c), True), "True"),
        ("BackpropGate-depth=-1", lambda c: gg.BackpropGate(m(c), depth=-1), "-1"),
        ("BackpropGate-prefix_mode", lambda c: gg.BackpropGate(m(c), prefix_mode="x"), "'x'"),
        ("BackpropGate-check_ranks", lambda c: gg.BackpropGate(m(c), check_ranks="y"), "'y'"),
        ("BackpropGate.learn-position=n", lambda c: _plan(c, "learn", {0, 4}), "4"),
        ("BackpropGate.learn-position=-n-1", lambda c: _plan(c, "learn", -5), "-5"),
        ("BackpropGate.skip-position=n", lambda c: _plan(c, "skip", {0, 4}), "4"),
        ("BackpropGate.skip-position=-n-1", lambda c: _plan(c, "skip", {-5}), "-5"),
        (
            "BackpropGate-blocks=named twice",
            lambda c: gg.BackpropGate(m(c), blocks=["blocks.0", "blocks.0"]),
            "'blocks.0' twice",
        ),
        ("stop_gradient_at-slice", lambda c: gg.stop_gradient_at(m(c), slice(0, 2)), "slice"),
        (
            "stop_gradient_at-prefix_mode",
            lambda c: gg.stop_gradient_at(m(c), "head", prefix_mode="x"),
            "'x'",
        ),
        # freeze
        # estimate
        ("estimate-optimizer", lambda c: gg.estimate(m(c), X, optimizer="lion"), "'lion'"),
        ("estimate-depths=[9]", lambda c: gg.estimate(m(c), X, depths=[9]), "9"),
        ("estimate-depths=[None]", lambda c: gg.estimate(m(c), X, depths=[None]), "None"),
        ("estimate-dtype", lambda c: gg.estimate(m(c), X, dtype="int8"), "'int8'"),
        ("estimate-learn=3", lambda c: gg.estimate(m(c), X, learn=3), "3"),
        ("freeze-norm", lambda c: gg.freeze(m(c), "head", norm="frozen"), "'frozen'"),
        ("freeze-norm=None", lambda c: gg.freeze(m(c), "head", norm=None), "None"),
        ("unfreeze-optimizer=str", lambda c: gg.unfreeze(m(c), "head", optimizer="sgd"), "'sgd'"),
        (
            "unfreeze-optimizer=list",
            lambda c: gg.unfreeze(m(c), "head", optimizer=[c.optimizer]),
            "list",
        ),
        ("freeze-no-pattern", lambda c: gg.freeze(m(c)), "no pattern"),
        ("unfreeze-no-pattern", lambda c: gg.unfreeze(m(c)), "no pattern"),
        ("BackpropGate-blocks=2 positional", lambda c: gg.BackpropGate(m(c), 2), "depth=2"),
        ("BackpropGate-blocks=['**']", lambda c: gg.BackpropGate(m(c), ["**"]), "'**'"),
        ("compile_blocks-bakend=", lambda c: gg.compile_blocks(m(c), bakend="eager"), "bakend"),
        # capture
        ("capture_grads-no-pattern", lambda c: gg.capture_grads(m(c)), "no pattern"),
        ("capture_grads-inputs", lambda c: gg.capture_grads(m(c), "head", inputs="yes"), "'yes'"),
        # transforms
        ("scale_grad-factor=str", lambda c: gg.scale_grad(m(c), "head", "0.5"), "'0.5'"),
        ("scale_grad-factor=nan", lambda c: gg.scale_grad(m(c), "head", math.nan), "nan"),
        ("scale_grad-factor=inf", lambda c: gg.scale_grad(m(c), "head", math.inf), "inf"),
        (
            "scale_grad-factor=vector",
            lambda c: gg.scale_grad(m(c), "head", torch.ones(2)),
            "tensor",
        ),
        ("scale_grad-factor=None", lambda c: gg.scale_grad(m(c), "head", None), "None"),
        ("scale_grad-on", lambda c: gg.scale_grad(m(c), "head", 0.5, on="weights"), "'weights'"),
        ("scale_grad-when=3", lambda c: gg.scale_grad(m(c), "head", 0.5, when=3), "3"),
        ("reverse_grad-lambd", lambda c: gg.reverse_grad(m(c), "head", "1"), "'1'"),
        ("clip_grad-neither", lambda c: gg.clip_grad(m(c), "head"), "max_value=None"),
        (
            "clip_grad-both",
            lambda c: gg.clip_grad(m(c), "head", max_value=1, max_norm=1),
            "max_value=1",
        ),
        ("clip_grad-max_value=-1", lambda c: gg.clip_grad(m(c), "head", max_value=-1), "-1"),
        ("clip_grad-max_norm=0", lambda c: gg.clip_grad(m(c), "head", max_norm=0), "max_norm=0"),
        (
            "clip_grad-norm_type=0",
            lambda c: gg.clip_grad(m(c), "head", max_norm=1, norm_type=0),
            "norm_type=0",
        ),
        (
            "clip_grad-norm_type=str",
            lambda c: gg.clip_grad(m(c), "head", max_norm=1, norm_type="l2"),
            "'l2'",
        ),
        ("grad_transform-fn=None", lambda c: gg.grad_transform(m(c), "head", None), "None"),
        (
            "grad_transform-count",
            lambda c: gg.grad_transform(m(c), "head", torch.neg, count="x"),
            "'x'",
        ),
        ("zero_grad_of-on", lambda c: gg.zero_grad_of(m(c), "head", on=1), "1"),
        (
            "grad_transform-params-of-Tanh",
            lambda c: gg.grad_transform(m(c), "blocks.0.1", torch.neg),
            "'blocks.0.1'",
        ),
        # audit, check, graph, explain
        ("audit-optimizer=str", lambda c: gg.audit(m(c), optimizer="sgd"), "'sgd'"),
        ("audit-kernels=str", lambda c: gg.audit(m(c), kernels="yes"), "'yes'"),
        ("check-optimizer=str", lambda c: gg.check(m(c), "sgd"), "'sgd'"),
        ("check-loss=str", lambda c: gg.check(m(c), loss="x"), "'x'"),
        ("graph-loss=str", lambda c: gg.graph("loss"), "'loss'"),
        ("graph-loss=no-grad", lambda c: gg.graph(torch.ones(2)), "grad_fn"),
        ("graph-collapse=str", lambda c: gg.graph(c.loss, collapse="yes"), "'yes'"),
        ("graph-saved=str", lambda c: gg.graph(c.loss, saved="yes"), "'yes'"),
        ("explain-model=int", lambda c: gg.explain(3), "3"),
        # handles and the public classes
        ("Handle-undo=int", lambda c: gg.Handle(3), "3"),
        ("Handle-description=int", lambda c: gg.Handle(lambda: None, description=3), "3"),
        # schedules
        ("RandomDepth-n=0", lambda c: gg.schedules.RandomDepth(0), "0"),
        ("RandomDepth-n=-1", lambda c: gg.schedules.RandomDepth(-1), "-1"),
        ("RandomDepth-n=str", lambda c: gg.schedules.RandomDepth("4"), "'4'"),
        ("RandomDepth-low>n", lambda c: gg.schedules.RandomDepth(4, low=5), "5"),
        ("RandomDepth-high<low", lambda c: gg.schedules.RandomDepth(4, low=3, high=2), "2"),
        ("RandomDepth-seed=str", lambda c: gg.schedules.RandomDepth(4, seed="x"), "'x'"),
        ("LISA-k>n", lambda c: gg.schedules.LISA(4, k=9), "9"),
        ("LISA-every=0", lambda c: gg.schedules.LISA(4, every=0), "0"),
        ("LISA-always=n", lambda c: gg.schedules.LISA(4, k=0, always=[4]), "always entry=4"),
        ("LISA-always=-n-1", lambda c: gg.schedules.LISA(4, k=0, always=[-5]), "entry=-5"),
        ("LISA-k=True", lambda c: gg.schedules.LISA(4, k=True), "k=True"),
        ("LISA-embeddings=str", lambda c: gg.schedules.LISA(4, embeddings="no"), "'no'"),
        (
            "GradualUnfreeze-every=True",
            lambda c: gg.schedules.GradualUnfreeze(4, every=True),
            "True",
        ),
        ("Schedule.plan-step=True", lambda c: gg.schedules.RandomDepth(4).plan(True), "True"),
        ("DropBP-rate=1.5", lambda c: gg.schedules.DropBP(4, rate=1.5), "1.5"),
        ("DropBP-rates-length", lambda c: gg.schedules.DropBP(4, rates=[0.1]), "[0.1]"),
        ("FreezeOut-total_steps=-1", lambda c: gg.schedules.FreezeOut(4, total_steps=-1), "-1"),
        (
            "FreezeOut-spacing",
            lambda c: gg.schedules.FreezeOut(4, total_steps=10, spacing="x"),
            "'x'",
        ),
        ("GradualUnfreeze-every=0", lambda c: gg.schedules.GradualUnfreeze(4, every=0), "0"),
        # optim
        ("param_groups-lr=-1", lambda c: gg.optim.param_groups(m(c), lr=-1.0), "-1"),
        ("param_groups-lr=str", lambda c: gg.optim.param_groups(m(c), lr="x"), "'x'"),
        ("param_groups-decay=2", lambda c: gg.optim.param_groups(m(c), lr=0.1, decay=2.0), "2"),
        ("add_missing-optimizer=str", lambda c: gg.optim.add_missing("sgd", m(c)), "'sgd'"),
        ("drop_state-optimizer=str", lambda c: gg.optim.drop_state("sgd", m(c)), "'sgd'"),
        ("state_bytes-optimizer=str", lambda c: gg.optim.state_bytes("sgd"), "'sgd'"),
        (
            "drop_state-params=str",
            lambda c: gg.optim.drop_state(c.optimizer, "blocks.0"),
            "'blocks.0'",
        ),
        ("drop_state-params=None", lambda c: gg.optim.drop_state(c.optimizer, None), "None"),
        ("drop_state-params=int-list", lambda c: gg.optim.drop_state(c.optimizer, [3]), "3"),
        ("add_missing-lr=-0.1", lambda c: gg.optim.add_missing(c.optimizer, m(c), lr=-0.1), "-0.1"),
        (
            "add_missing-weight_decay=-1",
            lambda c: gg.optim.add_missing(c.optimizer, m(c), weight_decay=-1.0),
            "-1",
        ),
        (
            "Schedule.load_state_dict-None",
            lambda c: gg.schedules.LISA(4).load_state_dict(None),
            "None",
        ),
        (
            "Schedule.load_state_dict-partial",
            lambda c: gg.schedules.LISA(4).load_state_dict(
                {"schedule": "LISA", "config": gg.schedules.LISA(4)._config()}
            ),
            "'next_step'",
        ),
        # distributed
        ("allreduce_trained-not-ddp", lambda c: gg.distributed.allreduce_trained(m(c)), "Model"),
        ("check_same_plan-key=str", lambda c: gg.distributed.check_same_plan("x"), "'x'"),
    ]
    return [Case(name, call, needle) for name, call, needle in raw]


CASES: list[Case] = _not_module_cases() + _pattern_cases() + _blocks_cases() + _option_cases()

# Cases that fail today, with the owner who fixes them (filled from a run; see the report).
KNOWN: dict[str, str] = {}


def _global_hooks() -> tuple[int, ...]:
    from torch.nn.modules import module as torch_module

    names = [n for n in dir(torch_module) if n.startswith("_global_") and n.endswith("hooks")]
    return tuple(len(getattr(torch_module, n)) for n in sorted(names))


def snapshot(model: nn.Module) -> tuple[object, ...]:
    """Everything a gradgate call could leave behind on a model or in the process."""
    hook_dicts = [k for k in vars(nn.Module()) if "hooks" in k]
    return (
        torch.is_grad_enabled(),
        _global_hooks(),
        [p.requires_grad for p in model.parameters()],
        [bool(p._backward_hooks) for p in model.parameters()],
        [m.training for m in model.modules()],
        [tuple(len(getattr(m, d)) for d in hook_dicts) for m in model.modules()],
        [sorted(m.__dict__) for m in model.modules()],
    )


def outcome(case: Case) -> tuple[str, str]:
    """('clear' | 'unclear' | 'other' | 'silent' | 'trace', detail)."""
    ctx = _ctx()
    before = snapshot(ctx.model)
    try:
        result = case.call(ctx)
    except gg.GradgateError as err:
        text = str(err)
        if snapshot(ctx.model) != before:
            return "trace", f"{type(err).__name__}: {text}"
        if case.needle not in text or "expected" not in text.lower():
            return "unclear", f"{type(err).__name__}: {text}"
        return "clear", text
    except Exception as err:
        traced = snapshot(ctx.model) != before
        return ("trace" if traced else "other"), f"{type(err).__name__}: {err}"
    if isinstance(result, gg.Handle):
        try:
            result.remove()
        except Exception as err:
            return "other", f"accepted, then remove() raised {type(err).__name__}: {err}"
    return "silent", f"returned {type(result).__name__}"


def _param(case: Case) -> Any:
    owner = KNOWN.get(case.id)
    marks = [pytest.mark.xfail(strict=True, reason=owner)] if owner else []
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input_is_a_clear_error_with_no_trace(case: Case) -> None:
    kind, detail = outcome(case)
    assert kind == "clear", f"{case.id}: {kind}: {detail}"


# -- valid values that look unusual are accepted ---------------------------------------------


VALID: list[tuple[str, Callable[[Ctx], Any]]] = [
    (
        "clip_grad-norm_type=inf",
        lambda c: gg.clip_grad(c.model, "head", max_norm=1, norm_type=math.inf),
    ),
    (
        "clip_grad-norm_type='inf'",
        lambda c: gg.clip_grad(c.model, "head", max_norm=1, norm_type="inf"),
    ),
    ("scale_grad-np.float32", lambda c: gg.scale_grad(c.model, "head", np.float32(0.5))),
    ("scale_grad-0-d tensor", lambda c: gg.scale_grad(c.model, "head", torch.tensor(0.5))),
    ("reverse_grad-np.int64", lambda c: gg.reverse_grad(c.model, "head", np.int64(2))),
    ("freeze-np.int64 block", lambda c: gg.freeze(c.model, np.int64(1))),
    ("BackpropGate-blocks=one position", lambda c: gg.BackpropGate(c.model, blocks=3, depth=1)),
    ("BackpropGate-blocks=slice", lambda c: gg.BackpropGate(c.model, blocks=slice(0, 2))),
    ("BackpropGate-blocks=np.int64", lambda c: gg.BackpropGate(c.model, blocks=[np.int64(1)])),
    ("BackpropGate-blocks=0-d tensor", lambda c: gg.BackpropGate(c.model, [torch.tensor(1)])),
    (
        "backprop_depth-blocks=np.int64",
        lambda c: gg.backprop_depth(c.model, 1, blocks=np.int64(-1)),
    ),
    (
        "param_groups-blocks=0-d tensor",
        lambda c: gg.optim.param_groups(c.model, lr=0.1, blocks=torch.tensor(2)),
    ),
    ("freeze-full range", lambda c: gg.freeze(c.model, "blocks.-4:4")),
    ("unfreeze-np.int64 block", lambda c: gg.unfreeze(c.model, np.int64(1))),
    ("capture_grads-np.int64 block", lambda c: gg.capture_grads(c.model, np.int64(1))),
    ("scale_grad-np.int64 block", lambda c: gg.scale_grad(c.model, np.int64(1), 0.5)),
    ("freeze-empty slice", lambda c: gg.freeze(c.model, slice(0, 0))),
    ("capture_grads-empty slice", lambda c: gg.capture_grads(c.model, slice(2, 2))),
    ("scale_grad-empty slice", lambda c: gg.scale_grad(c.model, slice(2, 2), 0.5)),
    ("capture_grads-''", lambda c: gg.capture_grads(c.model, "")),
    ("select-np.int64 block", lambda c: gg.select(c.model, np.int64(1))),
    ("backprop_depth-np.int64 depth", lambda c: gg.backprop_depth(c.model, np.int64(2))),
    ("BackpropGate-np.int64 depth", lambda c: gg.BackpropGate(c.model, depth=np.int64(2))),
    ("backprop_depth-0-d tensor depth", lambda c: gg.backprop_depth(c.model, torch.tensor(2))),
]
VALID_KNOWN: dict[str, str] = {}


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(
            call,
            id=name,
            marks=[pytest.mark.xfail(strict=True, reason=VALID_KNOWN[name])]
            if name in VALID_KNOWN
            else [],
        )
        for name, call in VALID
    ],
)
def test_valid_values_are_accepted(call: Callable[[Ctx], Any]) -> None:
    ctx = _ctx()
    before = snapshot(ctx.model)
    result = call(ctx)
    if isinstance(result, gg.Handle):
        result.remove()
    assert snapshot(ctx.model) == before


def test_every_public_callable_has_a_bad_input_case() -> None:
    covered = {case.id.split("-")[0].split("(")[0].removeprefix("optim.") for case in CASES}
    covered = {name.removeprefix("distributed.") for name in covered}
    public = {
        name
        for name in gg.__all__
        if callable(getattr(gg, name))
        and not (isinstance(getattr(gg, name), type) and issubclass(getattr(gg, name), Exception))
    }
    exempt = {  # results that gradgate hands back, not entry points
        "AuditReport",
        "MemoryPlan",
        "MemoryRow",
        "CaptureHandle",
        "Finding",
        "FreezeHandle",
        "Learning",
        "RowsHandle",
        "Graph",
        "GradStore",
        "TransformHandle",
        "UnfreezeHandle",
    }
    assert public - exempt - covered == set()


if __name__ == "__main__":
    counts: dict[str, list[str]] = {}
    for case in CASES:
        kind, detail = outcome(case)
        counts.setdefault(kind, []).append(f"{case.id}: {detail[:160]}")
    print(f"bad inputs tried: {len(CASES)}")
    for kind in ("clear", "unclear", "other", "silent", "trace"):
        print(f"{kind}: {len(counts.get(kind, []))}")
    for kind in ("unclear", "other", "silent", "trace"):
        for line in counts.get(kind, []):
            print(f"  [{kind}] {line}")
