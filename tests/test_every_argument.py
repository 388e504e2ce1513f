"""Every argument does what it says, or refuses: a property over every public function.

Hypothesis draws a public function and arguments from a pool of wrong, odd and valid values
(types, empty, out of range, names that do not exist, a module that never runs, tensors, numpy
scalars) and calls it on a fresh model. Each call must either

* apply exactly what it says, checked against the model's state or against plain autograd
  (``applied``),
* raise a :class:`gradgate.GradgateError` that leaves the model as it was, or warn with a
  :class:`gradgate.GradgateWarning` (``clear``),

and never return having done nothing or something else (``silent``), nor raise another exception
(``other``). Calls Python itself refuses (arity, unknown keyword of a fixed signature) are not
made. ``python tests/test_every_argument.py [N]`` prints the counts for N examples.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradgate as gg

N_BLOCKS = 4


class Model(nn.Module):
    """Four shape-keeping blocks (no residual path), a norm, a head, and a module never called."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(3, 3), nn.Tanh()) for _ in range(N_BLOCKS)]
        )
        self.norm = nn.LayerNorm(3)
        self.head = nn.Linear(3, 2)
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


class Odd:
    def __repr__(self) -> str:
        return "<odd>"


POOL: list[Any] = [
    None,
    True,
    0,
    1,
    2,
    -1,
    N_BLOCKS,  # the block count and one below -N_BLOCKS: the first positions out of range
    -N_BLOCKS - 1,
    7,
    -9,
    1.5,
    2.0,
    float("nan"),
    "",
    " ",
    "blocks",
    "blocks.1",
    "blocks.*",
    "blocks.0:2",
    "blocks.9",
    "blocks.1.0",
    "blocks.1.0.weight",
    "head",
    "head.weight",
    "norm",
    "unused",
    "nope",
    "**",
    "*",
    "params",
    "input",
    "output",
    "eval",
    "keep",
    "forward",
    slice(0, 2),
    slice(0, 0),
    slice(9, 12),
    [],
    ["blocks.1"],
    ["blocks.*"],
    ["**"],
    [0, 2],
    {1},
    {1, 3},
    {0, N_BLOCKS},
    {-N_BLOCKS - 1},
    {1.5},
    {"head"},
    {"unused"},
    (0, "nope"),
    torch.tensor(1),
    torch.tensor([1, 2]),
    torch.tensor(1.5),
    np.int64(1),
    np.float32(0.5),
    Odd(),
    nn.Linear(2, 2),
    torch.neg,
    lambda g: g * 2,
]

FUNCTIONS: dict[str, Callable[..., Any]] = {
    "select": gg.select,
    "blocks": gg.blocks,
    "BackpropGate": gg.BackpropGate,
    "backprop_depth": gg.backprop_depth,
    "stop_gradient_at": gg.stop_gradient_at,
    "freeze": gg.freeze,
    "frozen": gg.frozen,
    "unfreeze": gg.unfreeze,
    "capture_grads": gg.capture_grads,
    "scale_grad": gg.scale_grad,
    "reverse_grad": gg.reverse_grad,
    "clip_grad": gg.clip_grad,
    "zero_grad_of": gg.zero_grad_of,
    "grad_transform": gg.grad_transform,
    "audit": gg.audit,
    "check": gg.check,
    "compile_blocks": gg.compile_blocks,
    "explain": gg.explain,
    "AuditReport.from_json": gg.AuditReport.from_json,
    "gate.depth": lambda model, value: _set(model, "depth", value),
    "gate.learn": lambda model, value: _set(model, "learn", value),
    "gate.skip": lambda model, value: _set(model, "skip", value),
}
KEYWORDS = {
    "BackpropGate": ["blocks", "depth", "prefix_mode"],
    "backprop_depth": ["blocks", "prefix_mode"],
    "stop_gradient_at": ["prefix_mode"],
    "freeze": ["norm"],
    "frozen": ["norm"],
    "unfreeze": [],
    "capture_grads": ["inputs"],
    "scale_grad": ["on"],
    "reverse_grad": ["on"],
    "clip_grad": ["max_value", "max_norm", "norm_type", "on"],
    "zero_grad_of": ["on"],
    "grad_transform": ["on", "count"],
    "compile_blocks": ["backend", "bakend", "fullgraph"],
}


ARITY = {  # positional arguments after the model, as the signatures take them
    "blocks": (0, 0),
    "audit": (0, 0),
    "explain": (0, 0),
    "check": (0, 1),
    "BackpropGate": (0, 1),
    "compile_blocks": (0, 1),
    "backprop_depth": (1, 2),
    "stop_gradient_at": (1, 1),
    "scale_grad": (2, 2),
    "reverse_grad": (1, 2),
    "clip_grad": (1, 1),
    "zero_grad_of": (1, 1),
    "grad_transform": (2, 2),
    "AuditReport.from_json": (1, 1),
    "gate.depth": (1, 1),
    "gate.learn": (1, 1),
    "gate.skip": (1, 1),
}


def _set(model: nn.Module, field: str, value: object) -> gg.BackpropGate:
    gate = gg.BackpropGate(model, "blocks.*")
    try:
        setattr(gate, field, value)
    except BaseException:
        gate.remove()
        raise
    return gate


def _x() -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(0))


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    out = model(_x())
    if out.requires_grad:
        out.pow(2).sum().backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _state(model: nn.Module) -> tuple[object, ...]:
    hooks = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
    return (
        [(n, p.requires_grad) for n, p in model.named_parameters()],
        [m.training for m in model.modules()],
        [tuple(len(getattr(m, h)) for h in hooks) for m in model.modules()],
        [sorted(m.__dict__) for m in model.modules()],
        torch.is_grad_enabled(),
    )


def _block_positions_learning(model: nn.Module, grads: dict[str, Any]) -> set[int]:
    return {
        i
        for i in range(N_BLOCKS)
        if grads[f"blocks.{i}.0.weight"] is not None
        and grads[f"blocks.{i}.0.weight"].abs().sum() > 0
    }


def _matched_params(model: nn.Module, pattern: Any) -> list[str]:
    names = gg.select(model, pattern)
    return [n for n, _ in model.named_parameters() if any(n.startswith(f"{m}.") for m in names)]


# -- what each function says it does, checked ------------------------------------------------
def verify(name: str, model: nn.Module, result: Any, args: list[Any], kw: dict[str, Any]) -> str:
    """'' when the result does exactly what the call says, else why not."""
    modules = dict(model.named_modules())
    if name in ("gate.learn", "gate.skip") and _positions_out_of_range(args[0]):
        return f"{name}={args[0]!r} accepted a position outside -{N_BLOCKS}..{N_BLOCKS - 1}"
    if name == "select":
        empty = all(isinstance(a, slice) and a == slice(0, 0) for a in args)
        if not result and not empty:
            return "select matched nothing, silently"
        return "" if all(n in modules for n in result) else f"unknown names {result}"
    if name == "blocks":
        return "" if result == [f"blocks.{i}" for i in range(N_BLOCKS)] else f"blocks {result}"
    if isinstance(result, (gg.BackpropGate, gg.StopGradient)):
        return _verify_cut(model, result)
    if name in ("freeze", "frozen", "unfreeze"):
        return _verify_flags(model, result, frozen=name != "unfreeze", args=args)
    if name == "capture_grads":
        _grads(model)
        empty = all(isinstance(a, slice) and a == slice(0, 0) for a in args)
        return "" if list(result.keys()) or empty else "captured nothing"
    if name in ("scale_grad", "zero_grad_of", "clip_grad", "grad_transform", "reverse_grad"):
        return _verify_transform(name, model, result, args, kw)
    if name == "audit":
        with result:
            _grads(model)
        return "" if result.totals["wgrad"] > 0 else "audit counted nothing"
    if name == "check":
        return "" if isinstance(result, list) else f"check returned {type(result).__name__}"
    if name == "compile_blocks":
        compiled = any("forward" in vars(module) for module in modules.values())
        return "" if compiled else "compile_blocks compiled no block"
    if name == "explain":
        return "" if hasattr(result, "__enter__") else "explain returned no context manager"
    if name == "AuditReport.from_json":
        return "from_json accepted text to_json never wrote"
    return f"no checker for {name}"


def _positions_out_of_range(value: Any) -> bool:
    """Whether a learn/skip value holds an integer position no block has (it must be refused,
    not wrapped around to another block)."""
    items = [value] if isinstance(value, (int, np.integer)) else value
    if isinstance(items, torch.Tensor) or not isinstance(items, (list, set, tuple)):
        return False
    return any(
        isinstance(v, (int, np.integer))
        and not isinstance(v, bool)
        and not -N_BLOCKS <= v < N_BLOCKS
        for v in items
    )


def _verify_cut(model: nn.Module, gate: Any) -> str:
    reference = _grads(model)  # the gate is live: this is the gated step
    learning = _block_positions_learning(model, reference)
    if isinstance(gate, gg.StopGradient):
        name = gate._points[0][0]
        params = [n for n, _ in model.named_parameters() if n.startswith(f"{name}.")]
        if params and all(reference[n] is None for n in params):
            return f"stop_gradient_at({name!r}): the named module did not learn"
        return ""
    blocks = gate.blocks
    n = len(blocks)
    if any(not b.startswith("blocks.") or b.count(".") != 1 for b in blocks):
        return ""  # a plan over other modules: the gate's own tests check those
    listed = [int(b.split(".")[1]) for b in blocks]
    if gate.depth is not None:  # what runs after the cut learns, listed or not
        first = listed[n - gate.depth] if gate.depth else max(listed) + 1
        expected = set(range(first, N_BLOCKS))
    elif gate.learn is not None:
        named = {listed[p] for p in gate.learn if isinstance(p, int)}
        if any(isinstance(s, str) for s in gate.learn):
            return ""
        first = min(named, default=max(listed) + 1)
        expected = {i for i in range(first, N_BLOCKS) if i in named or i not in listed}
    else:
        expected = set(range(N_BLOCKS))
    if any(listed[p] > min(expected, default=N_BLOCKS) for p in gate.skip):
        return f"{gate!r}: passed a gradient around a block with no residual path"
    expected -= {listed[p] for p in gate.skip}
    if learning != expected:
        return f"{gate!r}: blocks {sorted(learning)} learned, expected {sorted(expected)}"
    return ""


def _verify_flags(model: nn.Module, handle: Any, *, frozen: bool, args: list[Any]) -> str:
    changed = [
        n
        for n, p in model.named_parameters()
        if ((not p.requires_grad) if frozen else (p.requires_grad and n in BEFORE_FROZEN))
    ]
    said = set(handle.parameters)
    if frozen and set(changed) != said:
        return f"froze {changed}, said {sorted(said)}"
    if not frozen and not said <= set(BEFORE_FROZEN):
        return f"unfroze {sorted(said)}, which were not frozen"
    if not said and not any(a == slice(0, 0) for a in args if isinstance(a, slice)):
        flags_before = {n: n not in BEFORE_FROZEN for n, _ in model.named_parameters()}
        matched = [n for a in args for n in _matched_params(model, a)]
        if frozen or any(not flags_before[n] for n in matched):
            return "changed nothing, silently"
    return ""


def _verify_transform(
    name: str, model: nn.Module, handle: Any, args: list[Any], kw: dict[str, Any]
) -> str:
    handle.remove()
    reference = _grads(model)
    again = FUNCTIONS[name](model, *args, **kw)
    try:
        got = _grads(model)
    finally:
        again.remove()
    if kw.get("on", "input" if name == "reverse_grad" else "params") != "params":
        if set(gg.select(model, args[0])) <= FED_BY_DATA:
            return ""  # on='input' where nothing upstream learns: nothing to change (see report)
        return "" if any(_differs(got[n], reference[n]) for n in got) else f"{name}: no change"
    params = _matched_params(model, args[0])
    if not params:
        return ""  # a module without parameters: nothing to transform on='params'
    expected: Callable[[torch.Tensor], torch.Tensor]
    if name == "scale_grad":
        expected = lambda g: g * float(args[1])  # noqa: E731
    elif name == "zero_grad_of":
        expected = torch.zeros_like
    elif name == "grad_transform":
        expected = args[1]
    elif name == "clip_grad" and kw.get("max_value") is not None and kw.get("max_norm") is None:
        expected = lambda g: g.clamp(-float(kw["max_value"]), float(kw["max_value"]))  # noqa: E731
    else:
        return ""  # clip by norm, reverse on params: checked elsewhere
    for n in params:
        if reference[n] is not None and not torch.allclose(got[n], expected(reference[n])):
            return f"{name}: {n} gradient is not what it says"
    return ""


def _differs(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None) != (b is None) or (a is not None and not torch.allclose(a, b))


BEFORE_FROZEN = ["blocks.0.0.weight", "blocks.0.0.bias"]  # frozen by hand before unfreeze
FED_BY_DATA = {"", "blocks", "blocks.0", "blocks.0.0", "unused"}  # their input is the data


def _fresh(name: str) -> Model:
    torch.manual_seed(0)
    model = Model()
    for param_name, param in model.named_parameters():
        if name == "unfreeze" and param_name in BEFORE_FROZEN:
            param.requires_grad_(False)
    return model


# -- one call, classified ---------------------------------------------------------------------
def outcome(name: str, args: list[Any], kw: dict[str, Any]) -> tuple[str, str]:
    """('applied' | 'clear' | 'silent' | 'other' | 'python', detail)."""
    function = FUNCTIONS[name]
    model = _fresh(name)
    call_args = [model, *args] if name != "AuditReport.from_json" else list(args)
    try:
        inspect.signature(function).bind(*call_args, **kw)
    except TypeError as err:
        return "python", str(err)
    before = _state(model)
    result = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = function(*call_args, **kw)
            except gg.GradgateError as err:
                if _state(model) != before:
                    return "other", f"{type(err).__name__} left a trace: {err}"
                return "clear", f"{type(err).__name__}: {err}"
            try:
                problem = verify(name, model, result, list(args), kw)
            except gg.GradgateError as err:  # refused at the first forward
                return "clear", f"{type(err).__name__} at the forward: {err}"
        if any(issubclass(w.category, gg.GradgateWarning) for w in caught):
            return "clear", f"warned: {caught[0].message}"
        others = [w for w in caught if not issubclass(w.category, DeprecationWarning)]
        if others:
            return "other", f"{others[0].category.__name__}: {others[0].message}"
        return ("silent", problem) if problem else ("applied", "")
    except Exception as err:
        return "other", f"{type(err).__name__}: {err}"
    finally:
        if isinstance(result, gg.Handle):
            result.remove()


def calls() -> st.SearchStrategy[tuple[str, list[Any], dict[str, Any]]]:
    values = st.sampled_from(POOL)

    @st.composite
    def draw(data: st.DrawFn) -> tuple[str, list[Any], dict[str, Any]]:
        name = data(st.sampled_from(sorted(FUNCTIONS)))
        low, high = ARITY.get(name, (0, 2))
        args = data(st.lists(values, min_size=low, max_size=high))
        keywords = KEYWORDS.get(name, [])
        kw = (
            data(st.dictionaries(st.sampled_from(keywords), values, max_size=2)) if keywords else {}
        )
        return name, args, kw

    return draw()


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(call=calls())
def test_every_call_applies_what_it_says_or_refuses(call: tuple[str, list, dict]) -> None:
    name, args, kw = call
    kind, detail = outcome(name, args, kw)
    assert kind in ("applied", "clear", "python"), f"{name}(model, {args}, {kw}): {kind}: {detail}"


@pytest.mark.parametrize(
    ("name", "args", "kw"),
    [
        ("BackpropGate", [2], {}),
        ("freeze", [], {}),
        ("BackpropGate", [["**"]], {}),
        ("gate.depth", [torch.tensor([1, 2])], {}),
        ("gate.skip", [{1}], {}),
        ("gate.learn", [N_BLOCKS], {}),
        ("gate.learn", [{-N_BLOCKS - 1}], {}),
        ("gate.skip", [{0, N_BLOCKS}], {}),
        ("gate.skip", [-N_BLOCKS - 1], {}),
        ("stop_gradient_at", ["unused"], {}),
        ("AuditReport.from_json", ["not json"], {}),
        ("compile_blocks", [], {"bakend": "eager"}),
    ],
)
def test_the_issue_traps_are_clear(name: str, args: list, kw: dict) -> None:
    assert outcome(name, args, kw)[0] == "clear"


if __name__ == "__main__":  # counts for the closing note
    examples = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    counts: Counter[str] = Counter()
    failures: list[str] = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None)
    @given(call=calls())
    def tally(call: tuple[str, list, dict]) -> None:
        kind, detail = outcome(*call)
        counts[kind] += 1
        if kind in ("silent", "other"):
            failures.append(f"{kind}: {call[0]}({call[1]}, {call[2]}): {detail[:200]}")

    tally()
    tried = sum(counts.values()) - counts["python"]
    print(
        f"tried {tried}: applied {counts['applied']}, clear {counts['clear']}, "
        f"other {counts['other']}, silent {counts['silent']} "
        f"(+{counts['python']} refused by Python's own signature binding, not made)"
    )
    print("\n".join(sorted(set(failures))[:40]))
