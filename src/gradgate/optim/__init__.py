"""Optimizers for partial training: groups per block, missing parameters, state that can go.

>>> import torch, gradgate as gg
>>> net = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(3)], torch.nn.ReLU())
>>> groups = gg.optim.param_groups(net, lr=1.0, decay=0.5)
>>> [(g["name"], g["lr"]) for g in groups]
[('0', 0.25), ('1', 0.5), ('2', 1.0)]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from numbers import Real
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._cut.gate import gate_parts, named_learner_ids
from .._plumbing.errors import InvalidOptionError
from .._select.names import Pattern, check_module, resolve_blocks
from .._tools.masters import LearnerMasters
from .._tools.optimizer import add_group, held
from .._tools.schedulers import follow_groups, schedulers_option
from .._tools.sharded import clip_grad_norm_, local

if TYPE_CHECKING:
    from ..schedules import Schedule

__all__ = [
    "LearnerMasters",
    "add_missing",
    "clip_grad_norm_",
    "drop_finished",
    "drop_state",
    "param_groups",
    "state_bytes",
]


def param_groups(
    model: nn.Module,
    *,
    lr: float | Sequence[float],
    decay: float | None = None,
    blocks: Sequence[Pattern] | str | None = None,
    rest_lr: float | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """One optimizer parameter group per block, and one (``"rest"``) for everything else.

    ``lr`` is the last block's learning rate, or a sequence with one rate per block.
    ``decay`` is layer-wise learning-rate decay: block ``i`` of ``n`` gets
    ``lr * decay ** (n - 1 - i)``. ``rest`` (embeddings, head, final norm) gets ``rest_lr``,
    by default the last block's rate. ``options`` (``weight_decay=...``) go into every group.
    Each group has a ``"name"``; a parameter shared by several modules is in one group only.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> opt = torch.optim.AdamW(gg.optim.param_groups(net, lr=[0.1, 0.2], blocks="*"))
    >>> [(g["name"], g["lr"]) for g in opt.param_groups]
    [('0', 0.1), ('1', 0.2)]
    """
    check_module(model)
    points = resolve_blocks(model, blocks)
    rates = _block_rates(lr, decay, len(points))
    seen: set[int] = set()
    groups = []
    for (name, module), rate in zip(points, rates, strict=True):
        params = _new_params(module.parameters(), seen)
        if params:
            groups.append({"params": params, "lr": rate, "name": name, **options})
    rest = _new_params(model.parameters(), seen)
    if rest:
        groups.append(
            {
                "params": rest,
                "lr": rates[-1] if rest_lr is None else rest_lr,
                "name": "rest",
                **options,
            }
        )
    return groups


def add_missing(
    optimizer: torch.optim.Optimizer,
    model: nn.Module | Iterable[tuple[str, nn.Parameter]],
    *,
    scheduler: Any = None,
    trainable_only: bool = True,
    **options: Any,
) -> list[str]:
    """Add the model's parameters that no group of ``optimizer`` holds; return their names.

    Parameters unfrozen after the optimizer was built otherwise never train. They go into
    one new group with ``options`` (the optimizer's defaults fill the rest).
    ``trainable_only=False`` adds frozen parameters too. Instead of a model, ``(name,
    parameter)`` pairs limit the search (e.g. the parameters one unfreeze matched).

    ``scheduler`` (a torch LR scheduler of ``optimizer``, or several) then follows the new
    group: its base rate is the group's ``lr`` (OneCycleLR: or its ``max_lr``), and its rate
    is set to what the schedule gives at the current step, as for a group that was there from
    the start (LambdaLR, MultiplicativeLR, StepLR, MultiStepLR, ConstantLR, LinearLR,
    ExponentialLR, PolynomialLR, CosineAnnealingLR, CosineAnnealingWarmRestarts, OneCycleLR,
    SequentialLR of those, ReduceLROnPlateau; another kind is refused before anything changes).

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> opt = torch.optim.SGD(net[1].parameters(), lr=0.1)
    >>> gg.optim.add_missing(opt, net, lr=0.01)
    ['0.weight', '0.bias']
    >>> [g["lr"] for g in opt.param_groups]
    [0.1, 0.01]

    With a scheduler, at step 2 of a decay by half per step:

    >>> opt = torch.optim.SGD(net[1].parameters(), lr=0.1)
    >>> sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    >>> for _ in range(2):
    ...     opt.step(); sched.step()
    >>> gg.optim.add_missing(opt, net, scheduler=sched, lr=0.01)
    ['0.weight', '0.bias']
    >>> [g["lr"] for g in opt.param_groups]
    [0.025, 0.0025]
    """
    _optimizer(optimizer)
    _group_options(options)
    following = schedulers_option(scheduler, optimizer)
    named = _named_pairs(model)
    holding = set(held(optimizer))
    missing: list[tuple[str, nn.Parameter]] = []
    for name, param in named:
        if id(param) not in holding and (param.requires_grad or not trainable_only):
            holding.add(id(param))
            missing.append((name, param))
    if missing:
        follow_groups(following, [add_group(optimizer, missing, options)])
    return [name for name, _ in missing]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's per-parameter state (momentum, Adam moments, ...).

    >>> import torch, gradgate as gg
    >>> layer = torch.nn.Linear(10, 10)  # 110 float32 parameters
    >>> opt = torch.optim.AdamW(layer.parameters())
    >>> layer(torch.randn(2, 10)).sum().backward(); opt.step()
    >>> gg.optim.state_bytes(opt)  # two moments of 440 bytes each, two step counters
    888
    """
    _optimizer(optimizer)
    seen: set[tuple[int, int]] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = local(value).untyped_storage()  # a DTensor: this rank's shard
                key = (storage.data_ptr(), storage.nbytes())
                if key not in seen or storage.data_ptr() == 0:
                    seen.add(key)
                    total += storage.nbytes()
    return total


def drop_state(optimizer: torch.optim.Optimizer, params: nn.Module | Iterable[torch.Tensor]) -> int:
    """Forget the optimizer state of ``params`` (a module or parameters); return bytes freed.

    For parameters that rest (or never learn again): their ``.grad`` is set to ``None``, so the
    optimizer skips them even after ``zero_grad(set_to_none=False)``, and their moments are dead
    weight. Should one learn again, its state restarts from zero, as for a new parameter.
    A :class:`LearnerMasters` rests them its own way: their masters and state are dropped, or
    with ``offload="cpu"`` moved to the CPU (the bytes freed are those on the device).

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 1))
    >>> opt = torch.optim.AdamW(net.parameters())
    >>> net(torch.randn(2, 10)).sum().backward(); opt.step()
    >>> gg.optim.drop_state(opt, net[0])
    888
    >>> gg.optim.state_bytes(opt)
    96
    """
    _optimizer(optimizer)
    going = _tensors(params)
    if isinstance(optimizer, LearnerMasters):
        return optimizer._rest_params(going)
    before = state_bytes(optimizer)
    for param in going:
        optimizer.state.pop(param, None)
        param.grad = None  # a zero .grad (zero_grad(set_to_none=False)) would step it again
    return before - state_bytes(optimizer)


def drop_finished(
    optimizer: torch.optim.Optimizer,
    gate: Any,
    schedule: Schedule,
    step: int,
) -> int:
    """Drop the optimizer state of the blocks (and modules) ``schedule`` rests from ``step`` on.

    That is the blocks that never learn again (FreezeOut, a shrinking depth), under LISA and
    BAdam the blocks not drawn for ``step`` (they start afresh when drawn again), and under
    ``Importance`` the modules inside blocks that were not drawn.

    ``gate`` is the :class:`gradgate.BackpropGate` the schedule drives. Parameters shared with
    a block (or module) that still learns are kept. Returns the bytes freed.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(10, 10) for _ in range(3)])
    >>> gate = gg.BackpropGate(net)
    >>> sched = gg.schedules.FreezeOut(3, stops=[1, 2, 3])
    >>> opt = torch.optim.AdamW(net.parameters())
    >>> for step in range(3):
    ...     _ = sched.apply(gate, step)
    ...     net(torch.randn(2, 10)).sum().backward(); opt.step(); opt.zero_grad()
    ...     print(step, gg.optim.drop_finished(opt, gate, sched, step + 1))
    0 888
    1 888
    2 888
    >>> gate.remove()
    """
    _optimizer(optimizer, "drop_finished")
    points, model = _gate_parts(gate, schedule)
    schedule._bind(gate)
    finished = schedule.resting(step)
    modules = schedule.resting_modules(step)
    if not finished and not modules:
        return 0
    if len(points) != schedule.n:
        raise InvalidOptionError(
            f"{schedule!r} plans over {schedule.n} blocks but the gate has {len(points)}; "
            "pass the gate the schedule drives."
        )
    going = {id(p): p for i in finished for p in points[i][1].parameters()}
    staying = [p for i, (_, m) in enumerate(points) if i not in finished for p in m.parameters()]
    # what runs around the blocks learns at every step, also a weight it shares with a block
    # (model.parameters() would name a tied weight once, as the block's)
    in_blocks = {id(inner) for _, m in points for inner in m.modules()}
    staying += [p for m in model.modules() if id(m) not in in_blocks for p in m.parameters(False)]
    for param in staying:
        going.pop(id(param), None)
    for kept in named_learner_ids(gate):  # named learners inside blocks ("h.*.ln_1")
        going.pop(kept, None)
    going.update((id(p), p) for p in _resting_parameters(model, modules))
    return drop_state(optimizer, going.values())


def _resting_parameters(model: nn.Module, names: Iterable[str]) -> list[nn.Parameter]:
    """The parameters of the named modules that no other module of ``model`` holds."""
    resting = [model.get_submodule(name) for name in names]
    inside = {id(m) for module in resting for m in module.modules()}
    held = {id(p) for m in model.modules() if id(m) not in inside for p in m.parameters(False)}
    return [p for module in resting for p in module.parameters() if id(p) not in held]


def _block_rates(lr: float | Sequence[float], decay: float | None, n: int) -> list[float]:
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        factor = 1.0 if decay is None else _fraction("decay", decay)
        return [_positive("lr", lr) * factor ** (n - 1 - i) for i in range(n)]
    if decay is not None:
        raise InvalidOptionError(
            f"decay={decay!r} with a learning rate per block; expected one: lr=[...] (one "
            "per block) or lr=<float> with decay=<factor>."
        )
    try:
        rates = [float(r) for r in lr]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise InvalidOptionError(
            f"lr={lr!r}; expected a number or a sequence of numbers, one per block."
        ) from None
    for rate in rates:
        _positive("lr", rate)
    if len(rates) != n:
        raise InvalidOptionError(
            f"lr has {len(rates)} rates; expected one per block ({n}), or a single number."
        )
    return rates


def _fraction(option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise InvalidOptionError(f"{option}={value!r}; expected a number in (0, 1], e.g. 0.8.")
    return float(value)


def _optimizer(value: object, function: str = "") -> torch.optim.Optimizer:
    if not isinstance(value, torch.optim.Optimizer):
        called = f"optimizer={_shown(value)}"
        raise InvalidOptionError(
            f"{f'{function}({called})' if function else called}: expected a torch.optim.Optimizer, "
            "e.g. torch.optim.AdamW(model.parameters())."
        )
    return value


def _shown(value: object) -> str:
    """A short repr, or the type for one that spans lines (a module, an optimizer).

    >>> _shown(None), _shown(torch.nn.Sequential(torch.nn.ReLU()))
    ('None', 'a Sequential')
    """
    text = repr(value)
    return text if "\n" not in text and len(text) <= 60 else f"a {type(value).__name__}"


def _gate_parts(gate: object, schedule: object) -> tuple[list[tuple[str, nn.Module]], nn.Module]:
    """The blocks and the model of the gate ``drop_finished`` was given; refuses a gate or a
    schedule of the wrong kind before the schedule looks at either."""
    from ..schedules import Schedule

    parts = gate_parts(gate)
    if parts is None:
        raise InvalidOptionError(
            f"drop_finished(gate={_shown(gate)}): expected the "
            "gradgate.BackpropGate the schedule drives, e.g. gate = gg.BackpropGate(model)."
        )
    if not isinstance(schedule, Schedule):
        raise InvalidOptionError(
            f"drop_finished(schedule={_shown(schedule)}): expected "
            "the gradgate.schedules schedule that drives the gate, e.g. "
            "gg.schedules.LISA(n, k=2)."
        )
    model, points = parts
    return points, model


def _tensors(params: object) -> list[torch.Tensor]:
    """A module's parameters, or the tensors given; anything else is refused (a name is not)."""
    if isinstance(params, nn.Module):
        return list(params.parameters())
    found = None
    if isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
        found = list(params)
    if found is None or not all(isinstance(p, torch.Tensor) for p in found):
        raise InvalidOptionError(
            f"params={params!r:.60} ({type(params).__name__}); expected a module or its "
            "parameters, e.g. model.get_submodule('blocks.0') or "
            "model.get_submodule('blocks.0').parameters()."
        )
    return found


def _group_options(options: dict[str, Any]) -> None:
    """Refuse the negative rates torch checks only when an optimizer is built, not per group."""
    for option in ("lr", "weight_decay"):
        if option in options:
            value = options[option]
            number = (
                value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            )
            if isinstance(number, bool) or not isinstance(number, Real) or not float(number) >= 0:
                raise InvalidOptionError(f"{option}={value!r}; expected a number >= 0.")


def _positive(option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidOptionError(f"{option}={value!r}; expected a number > 0.")
    return float(value)


def _new_params(params: Iterable[nn.Parameter], seen: set[int]) -> list[nn.Parameter]:
    found = []
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            found.append(param)
    return found


def _named_pairs(model: object) -> list[tuple[str, nn.Parameter]]:
    """A model's named parameters, or the ``(name, parameter)`` pairs given instead."""
    if isinstance(model, nn.Module):
        return list(model.named_parameters())
    pairs = list(model) if isinstance(model, (list, tuple)) else None
    if pairs is None or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], torch.Tensor) for p in pairs
    ):
        raise InvalidOptionError(
            f"model={model!r:.60} ({type(model).__name__}); expected a torch.nn.Module or a "
            "list of (name, parameter) pairs, e.g. list(model.named_parameters())."
        )
    return pairs
