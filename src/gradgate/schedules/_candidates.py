"""Importance's parts that need no schedule: its options, its candidates resolved on a model,
the budget check, the checks of a saved state, and the maths of the draw weights."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .._plumbing.errors import InvalidOptionError
from .._select.names import resolve_modules


# -- options -----------------------------------------------------------------------------------
def candidates_option(modules: object) -> tuple[str | int, ...]:
    if isinstance(modules, str):
        modules = [modules]
    if not isinstance(modules, Iterable):
        raise InvalidOptionError(
            f"modules={modules!r}; expected the candidate modules: names or globs such as "
            "'model.layers.*.mlp.*_proj', or the list gg.choose.top(scores) returns."
        )
    items = list(modules)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int)) or item == "":
            raise InvalidOptionError(
                f"modules contains {item!r} ({type(item).__name__}); expected module names or "
                "globs (strings), or block positions."
            )
    if not items:
        raise InvalidOptionError(
            "modules=[] is empty; expected at least one candidate module: names or globs such "
            "as 'model.layers.*.mlp.*_proj', or the list gg.choose.top(scores) returns."
        )
    return tuple(dict.fromkeys(items))


def temperature_option(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidOptionError(
            f"temperature={value!r}; expected a finite number > 0 (1: drawn in proportion to "
            "the gradient's size; larger: closer to uniform; smaller: closer to greedy)."
        )
    if value <= 0:
        raise InvalidOptionError(
            f"temperature={value!r} is out of range; expected a finite number > 0, e.g. 1.0."
        )
    return float(value)


def decay_option(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise InvalidOptionError(
            f"decay={value!r}; expected a number in [0, 1), the moving average's weight on "
            "the past (0: the last observation only), e.g. 0.9."
        )
    return float(value)


# -- helpers -------------------------------------------------------------------------------
def resolve(
    model: nn.Module, points: list[tuple[str, nn.Module]], items: Iterable[str | int]
) -> tuple[list[str], list[list[nn.Parameter]], dict[str, int], frozenset[str]]:
    """The candidates' names, parameters, block positions (for blocks) and which lie inside
    blocks; refuses the model, a container of blocks, no parameters and overlaps. A position
    counts the gate's blocks (``points``), as a depth or a learning set does."""
    found = resolve_modules(model, [_block_name(item, points) for item in items])
    by_id = {id(module): i for i, (_, module) in enumerate(points)}
    inside = {id(inner) for _, block in points for inner in block.modules()} - set(by_id)
    owner: dict[int, str] = {}
    names, params, positions = [], [], {}
    for name, module in found:
        if module is model or (id(module) not in by_id and holds_block(module, by_id)):
            raise InvalidOptionError(
                f"the candidate {name or '<the model>'!r} holds the gate's blocks; expected "
                "blocks or modules inside them (e.g. 'model.layers.*' or "
                "'model.layers.*.mlp.*_proj')."
            )
        group = list({id(p): p for p in module.parameters()}.values())
        if not group:
            raise InvalidOptionError(
                f"the candidate {name!r} ({type(module).__name__}) holds no parameters; "
                "expected modules with weights, e.g. Linear layers."
            )
        for param in group:
            if id(param) in owner:
                raise InvalidOptionError(
                    f"the candidates {owner[id(param)]!r} and {name!r} share parameters (one "
                    "holds the other, or a tied weight), which would count twice in the "
                    "budget; expected candidates that do not overlap."
                )
            owner[id(param)] = name
        names.append(name)
        params.append(group)
        if id(module) in by_id:
            positions[name] = by_id[id(module)]
    inner = frozenset(name for name, module in found if id(module) in inside)
    return names, params, positions, inner


def _block_name(item: str | int, points: list[tuple[str, nn.Module]]) -> str | int:
    if isinstance(item, str):
        return item
    if not -len(points) <= item < len(points):
        raise InvalidOptionError(
            f"modules holds block position {item}, but the gate has {len(points)} blocks; "
            f"expected positions 0 to {len(points) - 1} (or -1 for the last), or module names."
        )
    return points[item][0]


def holds_block(module: nn.Module, by_id: dict[int, int]) -> bool:
    return any(id(inner) in by_id for inner in module.modules())


def check_budget(names: list[str], sizes: list[int], budget: float) -> None:
    """Every candidate must fit alone, so that the first draw always fits (the floor holds)."""
    total = sum(sizes)
    largest = max(range(len(sizes)), key=sizes.__getitem__)
    if sizes[largest] <= budget * total:
        return
    need = math.ceil(sizes[largest] / total * 10_000) / 10_000
    while need * total < sizes[largest]:
        need = math.nextafter(need, 2.0)
    raise InvalidOptionError(
        f"budget={budget} allows {budget * total:.0f} of the candidates' {total} parameters "
        f"per step, fewer than {names[largest]!r} holds ({sizes[largest]}); expected a budget "
        f"that fits every candidate: budget >= {need}, or smaller candidates (modules inside "
        "the blocks)."
    )


def check_known(names: set[str], scores: dict[str, Any], drawn: Iterable[str]) -> None:
    unknown = sorted((set(scores) | set(drawn)) - names)
    if unknown:
        raise InvalidOptionError(
            f"the schedule's state names {unknown[:3]}, which are not candidates on this model; "
            "expected the state of a run on the same model with the same candidates."
        )


def restored(state: Any) -> tuple[Any, ...]:
    """The Importance part of a state dict, checked before anything changes."""
    keys = ("scores", "observations", "picks", "window", "drawn", "step")
    missing = [k for k in keys if k not in state] if isinstance(state, dict) else list(keys)
    if missing:
        raise InvalidOptionError(
            f"state={state!r:.80} lacks {missing}; expected the dict that "
            "Importance.state_dict() returned."
        )
    scores, seen, picks = state["scores"], state["observations"], state["picks"]
    fine = isinstance(scores, dict) and all(
        isinstance(k, str) and (v is None or (isinstance(v, (int, float)) and math.isfinite(v)))
        for k, v in scores.items()
    )
    for counts in (seen, picks):
        fine = fine and isinstance(counts, dict)
        fine = fine and all(isinstance(k, str) and is_count(v) for k, v in counts.items())
    window, step, drawn = state["window"], state["step"], state["drawn"]
    fine = fine and (window is None or is_count(window)) and (step is None or is_count(step))
    fine = fine and isinstance(drawn, list) and all(isinstance(d, str) for d in drawn)
    if not fine:
        raise InvalidOptionError(
            f"state's scores/observations/picks/window/drawn/step are not what "
            f"Importance.state_dict() writes (state={state!r:.80}); expected that dict, unedited."
        )
    return dict(scores), dict(seen), dict(picks), window, tuple(drawn), step


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def tempered(values: list[float], temperature: float) -> list[float]:
    """``v ** (1 / temperature)``, normalised (computed in logs); uniform when all are 0."""
    if not any(v > 0 for v in values):
        return [1 / len(values)] * len(values)
    logs = [math.log(v) / temperature if v > 0 else -math.inf for v in values]
    top = max(logs)
    raw = [math.exp(v - top) for v in logs]
    total = math.fsum(raw)
    return [r / total for r in raw]


def norm(grad: torch.Tensor) -> torch.Tensor:
    if grad.is_sparse:
        grad = grad.coalesce().values()
    norm: torch.Tensor = torch.linalg.vector_norm(grad.detach(), dtype=torch.float32)
    return norm


def same_model(given: nn.Module, gated: nn.Module) -> bool:
    return any(m is gated for m in given.modules()) or any(m is given for m in gated.modules())
