"""Module hooks that belong to one gradgate object and never travel with a copy of the model.

``copy.deepcopy``, ``pickle`` and ``torch.save`` copy a module's hook dictionaries. A
:class:`GateHook` copies as :data:`DETACHED`, a hook that does nothing and removes itself from the
copy the first time it runs, so a copy is an ordinary model with no gradgate state.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import _torch_internals as internals
from ._frames_compile import (
    compiled_block,
    disabled_caller,
    eager_with_compiled_blocks,
    opaque,
    under_compile,
)
from ._torch_internals import skip_frames, traceable


class GateHook:
    """A hook that calls ``owner.method(*bound, *hook_args)``."""

    __slots__ = ("bound", "function")

    def __init__(self, owner: object, method: str, *bound: object) -> None:
        self.function, self.bound = getattr(owner, method), bound
        if "torch._dynamo" in sys.modules:
            disabled_caller()

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling() or internals.eval_frame_callback():
            return opaque(self.function, *self.bound, *args)
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
    """The forward hooks one gradgate object registered; ``remove()`` takes them all off.

    ``suspend()`` takes the module hooks off for a while (a module with no hook takes torch's
    fast path: no hook dispatch at all) and ``resume()`` puts them back where they were among the
    module's other hooks.
    """

    def __init__(self) -> None:
        self._handles: list[RemovableHandle | _InstanceForward] = []
        self._pre: set[int] = set()  # ids of the pre-hook handles
        # each module hook as first registered: (module, hook, pre, options, handle id)
        self._registered: list[tuple[nn.Module, GateHook, bool, dict[str, Any], int]] = []
        self.suspended = False

    def pre(self, module: nn.Module, hook: GateHook, **options: Any) -> None:
        self._register(module, hook, True, options)

    def _register(self, module: nn.Module, hook: GateHook, pre: bool, options: Any) -> None:
        register = module.register_forward_pre_hook if pre else module.register_forward_hook
        handle = register(hook, **options)
        self._handles.append(handle)
        if pre:
            self._pre.add(id(handle))
        if not self.suspended:  # not a resume
            self._registered.append((module, hook, pre, options, handle.id))

    def suspend(self) -> None:
        """Take the module hooks off; wrapped forwards (see wrap) stay."""
        self.suspended = True
        for handle in self._handles:
            if isinstance(handle, RemovableHandle):
                handle.remove()
        self._handles = [h for h in self._handles if not isinstance(h, RemovableHandle)]
        self._pre.clear()

    def resume(self) -> None:
        """Put the module hooks back: before the hooks registered after them (a prepended one
        first), as when they were first registered."""
        ours: set[int] = set()
        for module, hook, pre, options, first_id in self._registered:
            self._register(module, hook, pre, options)
            handle = self._handles[-1]
            assert isinstance(handle, RemovableHandle)
            ours.add(handle.id)
            hooks = handle.hooks_dict_ref()
            if hooks is not None and not options.get("prepend"):
                for later in [key for key in hooks if key > first_id and key not in ours]:
                    hooks.move_to_end(later)
        self.suspended = False

    def outermost(self) -> None:
        """Run these hooks around those registered after them: pre-hooks first, the others
        last (``fully_shard`` after a gate puts FSDP2's hooks around the gate's otherwise)."""
        for handle in self._handles:
            if not isinstance(handle, RemovableHandle):
                continue  # a wrapped forward runs inside every hook anyway
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                hooks.move_to_end(handle.id, last=id(handle) not in self._pre)

    def post(self, module: nn.Module, hook: GateHook, **options: Any) -> None:
        self._register(module, hook, False, options)

    def wrap(self, module: nn.Module, enter: GateHook, exit: GateHook) -> None:
        """Hooks for a module whose forward must see no module hooks (see HookedForward)."""
        wrapper = HookedForward(module, enter, exit)
        wrapper.install()
        self._handles.append(wrapper)

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        self._pre.clear()
        self._registered, self.suspended = [], False
        for handle in handles:
            handle.remove()


class _InstanceForward:
    """A wrapper installed as the instance attribute ``module.forward``.

    A copy of the module (``copy.deepcopy``, ``pickle``, ``torch.save``) gets the forward the
    wrapper wrapped; once uninstalled (or if it could not be, e.g. wrapped again later) the
    wrapper only calls through.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.previous = module.__dict__.get("forward")  # an instance forward it wraps, if any
        self.inner = module.forward
        self.live = False

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.inner)  # what callers that inspect ``forward`` rely on

    def install(self) -> None:
        object.__setattr__(self.module, "forward", self)
        self.live = True

    def uninstall(self) -> None:
        self.live = False
        previous = self.previous
        while isinstance(previous, _InstanceForward) and not previous.live:
            previous = previous.previous  # a wrapper removed while this one wrapped it
        if self.module.__dict__.get("forward") is self:
            if previous is None:
                del self.module.__dict__["forward"]
            else:
                object.__setattr__(self.module, "forward", previous)

    remove = uninstall

    def __reduce__(self) -> tuple[Any, ...]:
        return (_plain_forward, (self.module, self.previous))


class ForwardGuard(_InstanceForward):
    """Runs ``enter`` before a module's ``forward`` and ``exit`` after it, whatever happens.

    ``exit(module, args, output, raising)`` runs also when ``forward`` raises, ``KeyboardInterrupt``
    and ``SystemExit`` included (torch's ``always_call`` forward hooks run for ``Exception``
    only, and a module's other hooks run outside ``forward``, where an interrupt would leave the
    state ``enter`` set).
    """

    def __init__(
        self, module: nn.Module, enter: GateHook, exit: GateHook, blocks: list[nn.Module]
    ) -> None:
        super().__init__(module)
        self.enter, self.exit, self.blocks = enter, exit, blocks
        self.compiled: list[CompiledForward] = []

    def uninstall(self) -> None:
        super().uninstall()
        for wrapper in reversed(self.compiled):
            wrapper.uninstall()

    remove = uninstall

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.live:
            return self.inner(*args, **kwargs)
        if torch.compiler.is_compiling() and not internals.SKIPS_FRAMES:
            # dynamo traces this frame where torch cannot be told to skip it (torch 2.6, whose
            # dynamo crashed on it): the gated forward runs eagerly, a graph break
            return opaque(self._guarded, *args, **kwargs)
        return self._guarded(*args, **kwargs)

    def _guarded(self, *args: Any, **kwargs: Any) -> Any:
        self.enter(self.module, args)
        try:
            if under_compile():
                output = self._compiled_by_block(*args, **kwargs)
            else:
                output = self.inner(*args, **kwargs)
        except BaseException:
            self.exit(self.module, args, None, True)
            raise
        self.exit(self.module, args, output, False)
        return output

    def _compiled_by_block(self, *args: Any, **kwargs: Any) -> Any:
        """Under ``torch.compile(model)``: the forward eager, each block's forward compiled."""
        if not self.compiled:
            opaque(self._install_compiled)
        return eager_with_compiled_blocks(self.inner, *args, **kwargs)

    def _install_compiled(self) -> None:
        unique = {id(block): block for block in self.blocks}.values()  # a block used twice
        self.compiled = [CompiledForward(block) for block in unique]
        for wrapper in self.compiled:
            wrapper.install()


class HookedForward(_InstanceForward):
    """A pre- and a post-hook run around ``forward`` instead of as module hooks.

    For modules whose forward looks at their own hook dictionaries: torch's fused
    ``nn.TransformerEncoderLayer`` path is switched off while a layer has any forward hook.
    ``enter(module, args)`` and ``exit(module, args, kwargs, output)`` are called like module
    hooks; a non-``None`` result of ``exit`` replaces the output.
    """

    def __init__(self, module: nn.Module, enter: GateHook, exit: GateHook) -> None:
        super().__init__(module)
        self.enter, self.exit = enter, exit

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.live:
            return self.inner(*args, **kwargs)
        self.enter(self.module, args)
        output = self.inner(*args, **kwargs)
        replaced = self.exit(self.module, args, kwargs, output)
        return output if replaced is None else replaced


class CompiledForward(_InstanceForward):
    """A block's ``forward``, compiled as a frame of its own under a compiled gated root."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        if isinstance(self.inner, HookedForward):  # its hooks stay eager, the layer compiles
            self.inner.inner = traceable(self.inner.inner)
            self.traced = self.inner
        else:
            self.traced = traceable(self.inner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return compiled_block(self.traced, *args, **kwargs)


def _plain_forward(module: nn.Module, previous: Any) -> Any:
    """What a copy's ``forward`` attribute becomes: the one the wrapper wrapped."""
    return previous if previous is not None else type(module).forward.__get__(module)


skip_frames(
    GateHook.__call__,
    ForwardGuard.__call__,
    ForwardGuard._guarded,
    ForwardGuard._compiled_by_block,
    HookedForward.__call__,
    CompiledForward.__call__,
)
