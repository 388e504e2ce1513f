"""Module hooks that belong to one gradgate object and never travel with a copy of the model.

``copy.deepcopy``, ``pickle`` and ``torch.save`` copy a module's hook dictionaries. A
:class:`GateHook` copies as :data:`DETACHED`, a hook that does nothing and removes itself from the
copy the first time it runs, so a copy is an ordinary model with no gradgate state.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle


class GateHook:
    """A hook that calls ``owner.method(*bound, *hook_args)``."""

    __slots__ = ("bound", "function")

    def __init__(self, owner: object, method: str, *bound: object) -> None:
        self.function, self.bound = getattr(owner, method), bound

    def __call__(self, *args: Any) -> Any:
        return self.function(*self.bound, *args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_detached, ())


class _Detached:
    """What a :class:`GateHook` becomes in a copy: removes itself, changes nothing."""

    def __call__(self, module: nn.Module, *args: Any) -> None:
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, hook in hooks.items() if isinstance(hook, _Detached)]:
                del hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_pre_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_detached, ())


DETACHED = _Detached()


def _detached() -> _Detached:
    return DETACHED


class HookSet:
    """The forward hooks one gradgate object registered; ``remove()`` takes them all off."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def pre(self, module: nn.Module, hook: GateHook, **options: Any) -> None:
        self._handles.append(module.register_forward_pre_hook(hook, **options))

    def post(self, module: nn.Module, hook: GateHook, **options: Any) -> None:
        self._handles.append(module.register_forward_hook(hook, **options))

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()


class ForwardGuard:
    """Wraps a module's ``forward`` in try/finally for what hooks cannot see.

    torch's ``always_call`` forward hooks run for ``Exception`` only; ``KeyboardInterrupt`` and
    ``SystemExit`` skip them. The guard calls ``on_interrupt()`` for those, then re-raises. It
    is an instance attribute (``module.forward``); a copy of the module gets its plain forward.
    """

    def __init__(self, module: nn.Module, on_interrupt: Any) -> None:
        self.module, self.on_interrupt = module, on_interrupt
        self.previous = module.__dict__.get("forward")  # an instance forward it wraps, if any
        self.inner = module.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.inner(*args, **kwargs)
        except BaseException as error:
            if not isinstance(error, Exception):
                self.on_interrupt()
            raise

    def install(self) -> None:
        object.__setattr__(self.module, "forward", self)

    def uninstall(self) -> None:
        if self.module.__dict__.get("forward") is self:
            if self.previous is None:
                del self.module.__dict__["forward"]
            else:
                object.__setattr__(self.module, "forward", self.previous)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_plain_forward, (self.module, self.previous))


def _plain_forward(module: nn.Module, previous: Any) -> Any:
    """What a copy's ``forward`` attribute becomes: the one the guard wrapped."""
    return previous if previous is not None else type(module).forward.__get__(module)
