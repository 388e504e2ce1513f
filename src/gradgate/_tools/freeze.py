"""Which parameters learn? Freezing by pattern, with norm layers and exact undo.

A frozen parameter has ``requires_grad=False`` before the forward: autograd computes no weight
gradient for it (gradients still flow *through* its layer), and no optimizer step moves it.

Handles compose as layers. Each :func:`freeze` or :func:`unfreeze` pushes one layer onto every
parameter slot (a module and an attribute name) it touches; a slot's flag is the one set by its
latest live layer, or the flag it had before the first layer once every layer is undone. So
handles may be undone in any order and a parameter is frozen exactly while the latest live
handle touching it froze it. Slots are kept by module and name, not by tensor, so a parameter
replaced while frozen (``load_state_dict(assign=True)``) is restored too.

Copies (``copy.deepcopy``, ``pickle``, ``torch.save``) carry the flags as they are and no
gradgate state: no handle reaches the copy, and its norm layers follow ``train()`` again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.weak import WeakIdKeyDictionary

from .._cut.stale_grads import FrozenGrads
from .._plumbing.errors import AlreadyFrozenError, InvalidOptionError
from .._plumbing.handles import Handle
from .._plumbing.validate import check_choice
from .._select.names import Pattern, _match, check_module, check_patterns
from .optimizer import add_missing_near, refuse_foreign, remove_groups
from .schedulers import follow_groups, forget_groups, schedulers_option
from .tied import warn_tied_outside

NormMode = Literal["keep", "eval"]


# -- per-slot layers ---------------------------------------------------------------------------


@dataclass
class _Slot:
    """One parameter slot: its flag before any layer, and the live layers (token, flag)."""

    base: bool
    layers: list[tuple[object, bool]] = field(default_factory=list)


@dataclass
class _NormSlot:
    """One norm layer: live layers (token, locked in eval)."""

    layers: list[tuple[object, bool]] = field(default_factory=list)


@dataclass
class _ModuleState:
    params: dict[str, _Slot] = field(default_factory=dict)
    norm: _NormSlot | None = None


# Weak by module identity: a module's entry dies with the module and never travels with a copy.
_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _state_of(module: nn.Module) -> _ModuleState:
    state: _ModuleState | None = _STATES.get(module)
    if state is None:
        state = _STATES[module] = _ModuleState()
    return state


def _forget_if_empty(module: nn.Module) -> None:
    state = _STATES.get(module)
    if state is not None and not state.params and state.norm is None:
        del _STATES[module]


def _push_flag(token: object, module: nn.Module, name: str, flag: bool) -> None:
    param = module._parameters[name]
    assert param is not None
    slot = _state_of(module).params.setdefault(name, _Slot(param.requires_grad))
    slot.layers.append((token, flag))
    param.requires_grad_(flag)


def _pop_flag(token: object, module: nn.Module, name: str) -> None:
    state = _STATES.get(module)
    slot = state.params.get(name) if state is not None else None
    if slot is None:
        return
    slot.layers = [layer for layer in slot.layers if layer[0] is not token]
    flag = slot.layers[-1][1] if slot.layers else slot.base
    param = module._parameters.get(name)
    if param is not None:  # the parameter now in the slot, also one assigned while frozen
        param.requires_grad_(flag)
    if not slot.layers:
        del state.params[name]  # type: ignore[union-attr]
        _forget_if_empty(module)


def _top_layer(module: nn.Module, name: str) -> object | None:
    """The token of the freeze layer holding this slot frozen, if any."""
    state = _STATES.get(module)
    slot = state.params.get(name) if state is not None else None
    if slot is None or not slot.layers or slot.layers[-1][1]:
        return None
    token: object = slot.layers[-1][0]
    return token


def _push_norm(token: object, module: nn.Module, locked: bool) -> None:
    state = _state_of(module)
    if state.norm is None:
        state.norm = _NormSlot()
    state.norm.layers.append((token, locked))
    _apply_norm(module, locked)


def _pop_norm(token: object, module: nn.Module) -> None:
    state = _STATES.get(module)
    if state is None or state.norm is None:
        return
    state.norm.layers = [layer for layer in state.norm.layers if layer[0] is not token]
    _apply_norm(module, bool(state.norm.layers) and state.norm.layers[-1][1])
    if not state.norm.layers:
        state.norm = None
        _forget_if_empty(module)


def _is_locked(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("train"), _EvalLock)


def _apply_norm(module: nn.Module, locked: bool) -> None:
    if locked and not _is_locked(module):
        module.__dict__["train"] = _EvalLock(module, requested=module.training)
        module.training = False
    elif not locked and _is_locked(module):
        lock = module.__dict__.pop("train")
        module.training = lock.requested


class _EvalLock:
    """Stands in for ``Module.train`` on a frozen norm layer: remembers the request, stays in
    eval. A copy of the module gets a :class:`_ReleasedLock` instead (no gradgate state)."""

    __slots__ = ("module", "requested")

    def __init__(self, module: nn.Module, *, requested: bool) -> None:
        self.module, self.requested = module, requested

    def __call__(self, mode: bool = True) -> nn.Module:
        self.requested = bool(mode)
        self.module.training = False
        return self.module

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ReleasedLock, (self.module,))


class _ReleasedLock:
    """In a copy: the first ``train()`` call removes this stand-in and trains normally."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, mode: bool = True) -> nn.Module:
        if self.module.__dict__.get("train") is self:
            del self.module.__dict__["train"]
        return self.module.train(mode)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ReleasedLock, (self.module,))


# -- handles -----------------------------------------------------------------------------------


class _LayerHandle(Handle):
    """One freeze or unfreeze: the layers it pushed, popped exactly once."""

    _flag = False

    def __init__(self, description: str) -> None:
        super().__init__(self._restore, description=description)
        self._slots: list[tuple[str, nn.Module, str]] = []
        self._changed: set[str] = set()  # names whose flag this handle changed when applied
        self._norms: list[nn.Module] = []
        self._grads: FrozenGrads | None = None  # a freeze's guard against stale gradients

    def _hold(self, reported: str, locations: list[tuple[str, nn.Module, str]]) -> None:
        """Push this handle's flag onto every slot of one parameter, reported by its name.

        Pushed also where the flag already has this value: the latest live handle touching a
        parameter decides its flag, whatever the others did before or are undone after."""
        if locations:
            param = locations[0][1]._parameters[locations[0][2]]
            if param is not None and param.requires_grad != self._flag:
                self._changed.add(reported)
        for _, module, name in locations:
            _push_flag(self, module, name, self._flag)
            self._slots.append((reported, module, name))

    def _hold_norm(self, module: nn.Module, *, locked: bool) -> None:
        _push_norm(self, module, locked)
        self._norms.append(module)

    def _restore(self) -> None:
        for _, module, name in reversed(self._slots):
            _pop_flag(self, module, name)
        for module in reversed(self._norms):
            _pop_norm(self, module)
        if self._grads is not None:
            self._grads.remove()


class FreezeHandle(_LayerHandle):
    """Undoes one :func:`freeze`: flags and norm modes back to what they were, exactly once."""

    @property
    def parameters(self) -> list[str]:
        """Names of the parameters this handle holds frozen now (not since unfrozen)."""
        names: dict[int, str] = {}
        for qualified, module, name in self._slots:
            param = module._parameters.get(name)
            held = qualified in self._changed and _top_layer(module, name) is self
            if param is not None and held:
                names.setdefault(id(param), qualified)
        return list(names.values())


class UnfreezeHandle(_LayerHandle):
    """Undoes one :func:`unfreeze`: flags, norm modes and optimizer groups back, exactly once."""

    _flag = True

    def __init__(self, description: str) -> None:
        super().__init__(description)
        self._optimizer: torch.optim.Optimizer | None = None
        self._added: list[dict[str, Any]] = []
        self._added_names: list[str] = []
        self._schedulers: list[Any] = []  # they follow the groups added, until the undo

    @property
    def parameters(self) -> list[str]:
        """Names of the parameters this handle made learn (they did not before)."""
        return [
            name for name in dict.fromkeys(q for q, _, _ in self._slots) if name in self._changed
        ]

    @property
    def added_to_optimizer(self) -> list[str]:
        """Names of the parameters this handle added to the optimizer (they were not in it)."""
        return list(self._added_names)

    def _restore(self) -> None:
        super()._restore()
        if self._optimizer is not None:
            groups = self._optimizer.param_groups
            indices = [i for i, g in enumerate(groups) if any(g is a for a in self._added)]
            forget_groups(self._schedulers, indices)
            remove_groups(self._optimizer, self._added)


# -- public functions --------------------------------------------------------------------------


def freeze(model: nn.Module, *patterns: Pattern, norm: NormMode = "keep") -> FreezeHandle:
    """Stop the matched parameters from learning; returns an undo handle (a context manager).

    Patterns are module or parameter names, globs or ranges (see :func:`gradgate.select`);
    ``'**'`` is the whole model and ``''`` is refused. What is frozen is the union of the
    matches; no pattern at all is refused (an empty slice such as ``slice(0, 0)`` is an explicit
    empty set).
    Frozen parameters get ``requires_grad=False``, so backward gives them no new gradient;
    a non-zero gradient they hold (earlier micro-batches of an accumulation) reaches the next
    optimizer step and is then dropped, an all-zero one is dropped now: no step moves them.
    ``norm="eval"`` also keeps BatchNorm / InstanceNorm layers in the frozen region in eval
    mode (no running-statistics updates), even across ``model.train()``, until undone.

    >>> import torch, gradgate as gg
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    >>> handle = gg.freeze(net, "0", "1", norm="eval")
    >>> _ = net.train()
    >>> net[0].weight.requires_grad, net[1].training
    (False, False)
    >>> handle.undo()
    >>> net[0].weight.requires_grad, net[1].training
    (True, True)
    """
    check_module(model)
    check_choice("norm", norm, get_args(NormMode))
    patterns = check_patterns("freeze", patterns, model=model)
    modules, params = _matched(model, patterns)
    locations = _locations(model)
    for name, param in params:
        holder = next((top for _, m, n in locations[id(param)] if (top := _top_layer(m, n))), None)
        # a weight learn_rows holds frozen stays frozen under it: this freeze adds its layer
        if isinstance(holder, FreezeHandle) and not param.requires_grad:
            raise AlreadyFrozenError(
                f"parameter {name!r} is already frozen by {holder!r}; a parameter can be held "
                "by one freeze at a time. Undo that handle first, or leave it out of the "
                "patterns."
            )
    warn_tied_outside(model, patterns, params)  # before any change: it may raise (-W error)
    handle = FreezeHandle(_describe("freeze", patterns))
    for name, param in params:
        handle._hold(name, locations[id(param)])
    if norm == "eval":
        for module in _norm_layers(model, modules, params):
            handle._hold_norm(module, locked=True)
    handle._grads = FrozenGrads(param for _, param in params)
    return handle


def frozen(model: nn.Module, *patterns: Pattern, norm: NormMode = "keep") -> FreezeHandle:
    """Context manager form of :func:`freeze`.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> with gg.frozen(net, "0"):
    ...     net(torch.randn(3, 2)).sum().backward()
    >>> net[0].weight.grad is None, net[1].weight.grad is None
    (True, False)
    """
    return freeze(model, *patterns, norm=norm)


def unfreeze(
    model: nn.Module,
    *patterns: Pattern,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
) -> UnfreezeHandle:
    """Make the matched parameters learn again; returns a handle that undoes exactly that.

    Norm layers a :func:`freeze` kept in eval mode follow ``train()`` again. Handles compose:
    undoing the freeze while the unfreeze is live changes nothing; undoing both, in any order,
    gives back the flags from before either. With ``optimizer=``, matched parameters the
    optimizer does not hold are added to it, in a new param group with the options of the
    group their module's other parameters use (else the optimizer's defaults), so they really
    train; undoing the handle takes those groups (and their state) out again. ``scheduler``
    (a torch LR scheduler of that optimizer, or several) follows the groups added, from the
    current step (see :func:`gradgate.optim.add_missing`), and forgets them at the undo. An
    optimizer that holds none of the model's parameters (another model's, a stale copy's) is
    refused.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> handle = gg.freeze(net, "0", "1")
    >>> back = gg.unfreeze(net, "1")
    >>> handle.parameters, back.parameters
    (['0.weight', '0.bias'], ['1.weight', '1.bias'])
    """
    check_module(model)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidOptionError(
            f"optimizer={optimizer!r:.60} has type {type(optimizer).__name__}; expected a "
            "torch.optim.Optimizer (the one training this model) or None."
        )
    patterns = check_patterns("unfreeze", patterns, model=model)
    if optimizer is not None:
        refuse_foreign(model, optimizer)
    following = [] if optimizer is None else schedulers_option(scheduler, optimizer)
    if scheduler is not None and optimizer is None:
        raise InvalidOptionError(
            f"unfreeze(scheduler={scheduler!r:.60}) without optimizer=; expected both: the "
            "scheduler follows the groups added to the optimizer."
        )
    modules, params = _matched(model, patterns)
    locations = _locations(model)
    handle = UnfreezeHandle(_describe("unfreeze", patterns))
    for name, param in params:
        handle._hold(name, locations[id(param)])
    for module in _norm_layers(model, modules, params):
        handle._hold_norm(module, locked=False)
    if optimizer is not None:
        handle._optimizer = optimizer
        handle._added, handle._added_names, like = add_missing_near(model, optimizer, params)
        handle._schedulers = following
        follow_groups(following, handle._added, like=like)
    return handle


# -- helpers -----------------------------------------------------------------------------------


def _describe(function: str, patterns: tuple[Pattern, ...]) -> str:
    return f"{function} {', '.join(map(repr, patterns))}" if patterns else f"{function} nothing"


def _matched(
    model: nn.Module, patterns: Iterable[Pattern]
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Parameter]]]:
    """Matched modules and each parameter under them or named directly (a tied alias too),
    unique by identity, in model order."""
    wanted: set[str] = set()
    for pattern in patterns:
        wanted.update(_match(model, pattern, include_parameters=True))
    modules = [(name, module) for name, module in model.named_modules() if name in wanted]
    prefixes = tuple(f"{name}." for name, _ in modules)
    chosen: dict[int, tuple[str, nn.Parameter]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in wanted or "" in wanted or name.startswith(prefixes):
            chosen.setdefault(id(param), (name, param))
    return modules, list(chosen.values())


def _locations(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """Every slot (qualified name, owning module, attribute) where each parameter sits."""
    found: dict[int, list[tuple[str, nn.Module, str]]] = {}
    seen: set[tuple[int, str]] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None and (id(module), name) not in seen:
                seen.add((id(module), name))
                qualified = f"{prefix}.{name}" if prefix else name
                found.setdefault(id(param), []).append((qualified, module, name))
    return found


def _norm_layers(
    model: nn.Module, modules: list[tuple[str, nn.Module]], params: list[tuple[str, nn.Parameter]]
) -> list[nn.Module]:
    """Norm layers with running statistics inside the matched modules, or all of whose
    parameters were matched by name."""
    held = {id(p) for _, p in params}
    inside = [sub for _, module in modules for sub in module.modules()]
    owners = [model.get_submodule(name.rpartition(".")[0]) for name, _ in params]
    found: dict[int, nn.Module] = {}
    for module in inside + owners:
        if isinstance(module, _NormBase) and (
            any(module is m for m in inside) or all(id(p) in held for p in module.parameters())
        ):
            found[id(module)] = module
    return list(found.values())
