"""What a pickled gated model names: the hooks and ``forward`` a copy of it gets.

``copy.deepcopy``, ``pickle`` and ``torch.save`` of a gated or frozen model copy its hook
dictionaries and its instance ``forward``. gradgate's hooks and wrappers (in
``gradgate._plumbing.hooks``) copy as the objects made here, so a copy is a plain model. A
pickle refers to these functions by this module's path: they stay at ``gradgate._hooks``, where
every release since the first wrote them, so that a model pickled by any release loads.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class _Detached:
    """What a gate hook becomes in a copy: removes itself, changes nothing."""

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


def _plain_forward(module: nn.Module, previous: Any) -> Any:
    """What a copy's ``forward`` attribute becomes: the one the wrapper wrapped."""
    return previous if previous is not None else type(module).forward.__get__(module)
