"""Which parameters learn? Freezing by pattern, with norm layers and exact undo.

A frozen parameter has ``requires_grad=False`` before the forward, so autograd computes no
weight gradient for it (gradients still flow *through* its layer to earlier trainable layers).
"""

from __future__ import annotations

import types
from typing import Literal, get_args

from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ._errors import AlreadyFrozenError
from ._handles import Handle
from ._select import Pattern, resolve_parameters
from ._validate import check_choice

NormMode = Literal["keep", "eval"]
_OWNER = "_gradgate_frozen_by"
_REQUESTED = "_gradgate_requested_training"


class FreezeHandle(Handle):
    """Undoes one :func:`freeze`: flags and norm modes back to what they were, exactly once."""

    def __init__(self, description: str) -> None:
        super().__init__(self._restore, description=description)
        self._params: dict[int, tuple[str, nn.Parameter, bool]] = {}
        self._norms: dict[int, nn.Module] = {}

    @property
    def parameters(self) -> list[str]:
        """Names of the parameters this handle still holds frozen."""
        return [name for name, _, _ in self._params.values()]

    def _hold(self, name: str, param: nn.Parameter) -> None:
        self._params[id(param)] = (name, param, param.requires_grad)
        setattr(param, _OWNER, self)
        param.requires_grad_(False)
        param.grad = None

    def _lock_norm(self, module: nn.Module) -> None:
        self._norms[id(module)] = module
        module.__dict__[_REQUESTED] = module.training
        module.__dict__["train"] = types.MethodType(_train_locked_in_eval, module)
        module.training = False

    def release(self, param: nn.Parameter) -> None:
        """Give one parameter back its flag from before the freeze."""
        entry = self._params.pop(id(param), None)
        if entry is not None:
            _, held, requires_grad = entry
            held.requires_grad_(requires_grad)
            if getattr(held, _OWNER, None) is self:
                delattr(held, _OWNER)

    def release_norm(self, module: nn.Module) -> None:
        """Let one norm layer follow ``train()`` again, in the mode last asked of it."""
        if self._norms.pop(id(module), None) is not None:
            del module.__dict__["train"]
            module.training = module.__dict__.pop(_REQUESTED)

    def _restore(self) -> None:
        for _, param, _ in list(self._params.values()):
            self.release(param)
        for module in list(self._norms.values()):
            self.release_norm(module)


def freeze(model: nn.Module, *patterns: Pattern, norm: NormMode = "keep") -> FreezeHandle:
    """Stop the matched parameters from learning; returns an undo handle (a context manager).

    Patterns are module or parameter names, globs or ranges (see :func:`gradgate.select`).
    Frozen parameters get ``requires_grad=False`` and ``.grad = None`` so no optimizer moves
    them. ``norm="eval"`` also keeps BatchNorm / InstanceNorm layers in the frozen region in
    eval mode (no running-statistics updates), even across ``model.train()``, until undone.

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
    check_choice("norm", norm, get_args(NormMode))
    modules, params = resolve_parameters(model, patterns)
    for name, param in params:
        owner = getattr(param, _OWNER, None)
        if owner is not None and owner.active:
            raise AlreadyFrozenError(
                f"parameter {name!r} is already frozen by {owner!r}; a parameter can be held "
                "by one freeze at a time. Undo that handle first, or leave it out of the "
                "patterns."
            )
    handle = FreezeHandle(f"freeze {', '.join(map(repr, patterns))}")
    for name, param in params:
        if param.requires_grad:
            handle._hold(name, param)
    if norm == "eval":
        for module in _norm_layers(model, modules, params):
            handle._lock_norm(module)
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


def unfreeze(model: nn.Module, *patterns: Pattern) -> Handle:
    """Make the matched parameters learn again; returns a handle that re-applies the old flags.

    Parameters held by a :func:`freeze` handle are released from it (that handle no longer
    touches them), and norm layers it kept in eval mode follow ``train()`` again.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> handle = gg.freeze(net, "0", "1")
    >>> _ = gg.unfreeze(net, "1")
    >>> handle.parameters
    ['0.weight', '0.bias']
    """
    modules, params = resolve_parameters(model, patterns)
    before = [(param, param.requires_grad) for _, param in params]
    owners = _live_owners(params)
    for module in _norm_layers(model, modules, params):
        for holder in owners:
            holder.release_norm(module)  # a no-op for handles that do not hold it
    for _, param in params:
        owner = getattr(param, _OWNER, None)
        if owner is not None:
            owner.release(param)
        param.requires_grad_(True)

    def restore() -> None:
        for param, requires_grad in before:
            param.requires_grad_(requires_grad)

    return Handle(restore, description=f"unfreeze {', '.join(map(repr, patterns))}")


def _live_owners(params: list[tuple[str, nn.Parameter]]) -> list[FreezeHandle]:
    owners: dict[int, FreezeHandle] = {}
    for _, param in params:
        owner = getattr(param, _OWNER, None)
        if owner is not None:
            owners[id(owner)] = owner
    return list(owners.values())


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
            module in inside or all(id(p) in held for p in module.parameters())
        ):
            found[id(module)] = module
    return list(found.values())


def _train_locked_in_eval(self: nn.Module, mode: bool = True) -> nn.Module:
    """Stand-in for ``Module.train`` on a frozen norm layer: remember the request, stay in eval."""
    self.__dict__[_REQUESTED] = mode
    self.training = False
    return self
