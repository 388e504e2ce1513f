"""Hooks that belong to one gradgate object and never travel with a copy of the model.

``copy.deepcopy``, ``pickle`` and ``torch.save`` copy a module's hook dictionaries. A
:class:`GateHook` copies as :data:`~gradgate._hooks.DETACHED`, a hook that does nothing and
removes itself from the copy the first time it runs, so a copy is an ordinary model with no
gradgate state. Wrappers installed as a module's ``forward`` copy as the forward they wrapped.
What a copy becomes lives in :mod:`gradgate._hooks`, the path pickles name.
"""

from __future__ import annotations

import inspect
import sys
from functools import partial
from types import CodeType
from typing import Any

import torch
from torch import nn

from .._hooks import _detached, _plain_forward
from . import torch_internals as internals
from .frames_compile import (
    BlockFrame,
    CacheNotice,
    compiled_block,
    disabled_caller,
    eager_with_compiled_blocks,
    opaque,
)
from .torch_internals import skip_frames


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


class _InstanceForward:
    """A wrapper installed as the instance attribute ``module.forward``.

    A copy of the module (``copy.deepcopy``, ``pickle``, ``torch.save``) gets the forward the
    wrapper wrapped; once uninstalled (or if it could not be, e.g. wrapped again later) the
    wrapper only calls through. ``around_forward``: the wrapper calls ``inner`` as the block's
    own forward, which ``compile_blocks`` may replace beneath it (a gate's, a prefix cache's).
    """

    around_forward = False

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

    ``exit(module, args, output, raising, entered)`` (``entered``: what ``enter`` returned) runs
    also when ``forward`` raises, ``KeyboardInterrupt`` and ``SystemExit`` included (torch's
    ``always_call`` forward hooks run for ``Exception`` only, and a module's other hooks run
    outside ``forward``, where an interrupt would leave the state ``enter`` set).
    """

    def __init__(
        self, module: nn.Module, enter: GateHook, exit: GateHook, blocks: list[nn.Module]
    ) -> None:
        super().__init__(module)
        assert not (enter.bound or exit.bound)  # called directly as module hooks, see _guarded
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
        traced = torch.compiler.is_compiling()  # dynamo traces a compiled caller through here
        # eager frames under torch.compile: dynamo's frame callback is set
        compiling = not traced and bool(internals.eval_frame_callback())
        if traced or compiling:
            enter, exit = self.enter, self.exit  # they keep the gate out of compiled code
        else:  # the gate's methods, directly (root_call_site knows this frame)
            enter, exit = self.enter.function, self.exit.function
        entered = enter(self.module, args)
        try:
            if compiling:
                output = self._compiled_by_block(*args, **kwargs)
            else:
                output = self.inner(*args, **kwargs)
        except BaseException:
            exit(self.module, args, None, True, entered)
            raise
        exit(self.module, args, output, False, entered)
        return output

    def _compiled_by_block(self, *args: Any, **kwargs: Any) -> Any:
        """Under ``torch.compile(model)``: the forward eager, each block's forward compiled."""
        if not self.compiled:
            opaque(self._install_compiled)
        return eager_with_compiled_blocks(self.inner, *args, **kwargs)

    def _install_compiled(self) -> None:
        unique = {id(block): block for block in self.blocks}.values()  # a block used twice
        notice = CacheNotice()  # one warning for all the blocks
        self.compiled = [CompiledForward(block, notice) for block in unique]
        for wrapper in self.compiled:
            wrapper.install()


def guard_owners(module: nn.Module) -> list[Any]:
    """What installed each live :class:`ForwardGuard` on ``module`` (its gates), outermost first.

    >>> guard_owners(nn.Linear(2, 2))
    []
    """
    found: list[Any] = []
    wrapper = module.__dict__.get("forward")
    while isinstance(wrapper, _InstanceForward):
        if isinstance(wrapper, ForwardGuard) and wrapper.live:
            found.append(getattr(wrapper.enter.function, "__self__", None))
        wrapper = wrapper.previous
    return [owner for owner in found if owner is not None]


class HookedForward(_InstanceForward):
    """A module's gate hooks, run around its ``forward`` instead of as module hooks.

    Pre-hooks ``enter(module, args)`` and post-hooks ``exit(module, args, kwargs, output)`` are
    called as torch calls module hooks (a result that is not ``None`` replaces the args or the
    output). ``runs`` is false while they are module hooks (``hooked``) or off: the wrapper then
    only calls through. Outside ``torch.compile`` it calls the gate's methods directly, not
    through :class:`GateHook`, or, while its only hooks are those added with a lane
    ``(function, first)`` (an enter and an exit, or an enter alone), the lane:
    ``function(first, wrapper, args, kwargs)`` does what they would, and more cheaply (a bound
    method, so that calling it from here needs no C frame).
    """

    around_forward = True

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.enter: list[GateHook] = []
        self.exit: list[GateHook] = []
        self.always: list[GateHook] = []  # exits that run also when forward raises
        self._direct: tuple[list[Any], list[Any]] = ([], [])  # enter, exit: the bound methods
        self._lane_for: tuple[GateHook, ...] = ()  # the hooks the lane replaces
        self._lane_of_pair: tuple[Any, Any] = (None, None)
        self._lane: Any = None  # the lane's function while the pair are the only hooks
        self._lane_first: Any = None
        self.hooked = self.runs = False

    def add(self, hook: GateHook, *, pre: bool, first: bool = False, always: bool = False) -> None:
        hooks = self.enter if pre else self.exit
        hooks.insert(0 if first else len(hooks), hook)
        if always:
            self.always.append(hook)
        self._update()

    def add_lane(self, enter: GateHook, exit: GateHook | None, lane: tuple[Any, Any]) -> None:
        """``lane`` takes the place of ``enter`` and ``exit`` while they are the only hooks."""
        self._lane_for = (enter,) if exit is None else (enter, exit)
        self._lane_of_pair = lane
        self._update()

    def drop(self, hook: GateHook) -> None:
        (self.enter if hook in self.enter else self.exit).remove(hook)
        if hook in self.always:
            self.always.remove(hook)
        if hook in self._lane_for:
            self._lane_for, self._lane_of_pair = (), (None, None)
        self._update()

    def _update(self) -> None:
        self._direct = tuple(  # type: ignore[assignment]
            [partial(hook.function, *hook.bound) for hook in hooks]
            for hooks in (self.enter, self.exit)
        )
        only_replaced = self._lane_for and (*self.enter, *self.exit) == self._lane_for
        lane = self._lane_of_pair if only_replaced else (None, None)
        self._lane, self._lane_first = lane

    def others(self) -> bool:
        """Whether the module has hooks that are not these."""
        own_pre, own_post = (len(self.enter), len(self.exit)) if self.hooked else (0, 0)
        return internals.other_module_hooks(self.module, own_pre, own_post)

    def uninstall(self) -> None:
        self.runs = False
        super().uninstall()

    remove = uninstall

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.runs:
            return self.inner(*args, **kwargs)
        # running, so dynamo skips this frame (internals.SKIPS_FRAMES): is_compiling() would
        # only read the flag
        if internals.COMPILER._is_compiling_flag or internals.eval_frame_callback():
            return self.call_hooks(args, kwargs, compiled=True)  # the gate stays out of graphs
        if self._lane is not None:
            return self._lane(self._lane_first, self, args, kwargs)
        return self.call_hooks(args, kwargs)

    def call_hooks(self, args: Any, kwargs: Any, *, compiled: bool = False) -> Any:
        """The hooks around the forward, the gate's methods called directly unless
        ``compiled`` (then through their :class:`GateHook`, which keeps them out of graphs)."""
        enters, exits = (self.enter, self.exit) if compiled else self._direct
        module = self.module
        for enter in enters:
            replaced = enter(module, args)
            if replaced is not None:
                args = replaced if isinstance(replaced, tuple) else (replaced,)
        if self.always:
            output = self._call_always(args, kwargs, compiled)
        else:
            output = self.inner(*args, **kwargs)
        for exit in exits:
            replaced = exit(module, args, kwargs, output)
            if replaced is not None:
                output = replaced
        return output

    def _call_always(self, args: Any, kwargs: Any, compiled: bool) -> Any:
        """The forward; when it raises, the ``always`` exits run (with no output) first."""
        try:
            return self.inner(*args, **kwargs)
        except BaseException:
            for hook in self.always:
                run = hook if compiled else partial(hook.function, *hook.bound)
                run(self.module, args, kwargs, None)
            raise


class TracedHookedForward(HookedForward):
    """A :class:`HookedForward` where dynamo cannot be told to skip its frame (torch 2.6, 2.7):
    traced (a block compiled after the gate), it calls the hooks through their
    :class:`GateHook`, which keeps them out of the graph, as it does for module hooks."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.runs and torch.compiler.is_compiling():
            return self.call_hooks(args, kwargs, compiled=True)
        return super().__call__(*args, **kwargs)


def hooked_forward(module: nn.Module) -> HookedForward:
    """The wrapper for ``module`` that this torch can run under ``torch.compile``."""
    return (HookedForward if internals.SKIPS_FRAMES else TracedHookedForward)(module)


class CompiledForward(_InstanceForward):
    """A block's ``forward``, compiled as a frame of its own under a compiled gated root;
    ``notice`` (one for the root's blocks) says when a transformers cache reaches it."""

    def __init__(self, module: nn.Module, notice: CacheNotice | None = None) -> None:
        super().__init__(module)
        self.notice = CacheNotice() if notice is None else notice
        if isinstance(self.inner, HookedForward):  # its hooks stay eager, the layer compiles
            self.inner.inner = BlockFrame(module, self.inner.inner)
            self.traced: Any = self.inner
        else:
            self.traced = BlockFrame(module, self.inner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.notice.said:
            self.notice.look(self.module, args, kwargs)
        return compiled_block(self.traced, *args, **kwargs)


# the wrappers' frames that call root hooks directly (see frames.root_call_site)
CALL_SITES: set[CodeType] = {ForwardGuard._guarded.__code__}
skip_frames(
    GateHook.__call__,
    ForwardGuard.__call__,
    ForwardGuard._guarded,
    ForwardGuard._compiled_by_block,
    HookedForward.__call__,
    HookedForward.call_hooks,
    HookedForward._call_always,
    CompiledForward.__call__,
)
