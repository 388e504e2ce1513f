"""The module hooks one gradgate object registers, taken off and put back together.

A module hook sends every call of its module down torch's slow path (hook dispatch), so hooks
added with :meth:`HookSet.around` run from a wrapper around the module's ``forward`` instead,
while the module has no other hook; beside other hooks they are module hooks, in their place.
Hooks registered for every module (``FlopCounterMode``'s module tracker) do not count: they
run outside ``forward`` either way, and a module hook would turn off the fused kernels of
modules that look for their own hooks (``nn.TransformerEncoderLayer``).
Where dynamo cannot be told to skip the wrapper's frame (torch 2.6, 2.7), a wrapper it traces
calls them through their :class:`GateHook`, which it does not trace, as for module hooks
(:class:`~gradgate._plumbing.hooks.TracedHookedForward`).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from . import torch_internals as internals
from .hooks import GateHook, HookedForward, hooked_forward


class HookSet:
    """The forward hooks one gradgate object registered; ``remove()`` takes them all off.

    Hooks added with ``around`` run from a wrapper around the module's ``forward`` while the
    module has no other hook, so torch calls it on its fast path (no hook dispatch), and as module
    hooks, in their place among the others, while it has some (a user's, FSDP2's, ZeRO-3's):
    ``fit()`` chooses again. ``suspend()`` takes every hook off for a while and
    ``resume()`` puts them back where they were.
    """

    def __init__(self) -> None:
        self._hooks: list[_ModuleHook] = []
        self._plain: list[_ModuleHook] = []  # those added with pre() and post(): module hooks
        self._wrappers: list[HookedForward] = []
        self._entry: dict[int, _ModuleHook] = {}  # by id of the hook: those of the wrappers
        self.suspended = False
        self._outermost = False  # pre-hooks first, the others last (see outermost)
        self._fitted: int | None = None  # internals.hooks_registered() when fit() last looked
        self._quiet: int | None = None  # while suspended: see suspend()

    def pre(self, module: nn.Module, hook: GateHook, **options: Any) -> None:
        self._add(_ModuleHook(module, hook, True, options)).register(self._outermost, set())

    def post(self, module: nn.Module, hook: GateHook, **options: Any) -> None:
        self._add(_ModuleHook(module, hook, False, options)).register(self._outermost, set())

    def around(
        self,
        module: nn.Module,
        enter: GateHook | None = None,
        exit: GateHook | None = None,
        *,
        prepend: bool = False,
        lane: tuple[Any, Any] | None = None,
        always: bool = False,
    ) -> list[_ModuleHook]:
        """``enter(module, args)`` before the module's forward (before its other pre-hooks with
        ``prepend``), ``exit(module, args, kwargs, output)`` after it (with ``always``, also
        when the forward raises, the output then ``None``), like module hooks, or ``lane`` in
        their place while they are the module's only hooks (see HookedForward). Returns them,
        for :meth:`discard`."""
        wrapper = next((w for w in self._wrappers if w.module is module), None)
        if wrapper is None:
            wrapper = hooked_forward(module)
            wrapper.install()
            self._wrappers.append(wrapper)
        added = []
        if enter is not None:
            added.append(_ModuleHook(module, enter, True, {"prepend": prepend}, off=True))
            wrapper.add(enter, pre=True, first=prepend)
        if exit is not None:
            options = {"with_kwargs": True} | ({"always_call": True} if always else {})
            added.append(_ModuleHook(module, exit, False, options, off=True))
            wrapper.add(exit, pre=False, always=always)
        if lane is not None and enter is not None:
            wrapper.add_lane(enter, exit, lane)
        self._hooks += added
        self._entry.update((id(entry.hook), entry) for entry in added)
        if wrapper.hooked:
            wrapper.hooked = False  # registered again, the new ones in their place
        self._fit(wrapper)
        self._fitted = self._quiet = None  # the new ones: see fit()
        return added

    def discard(self, entries: list[_ModuleHook]) -> None:
        """Take hooks added with :meth:`around` off for good."""
        for entry in entries:
            entry.unregister()
            self._hooks.remove(entry)
            del self._entry[id(entry.hook)]
            wrapper = next(w for w in self._wrappers if w.module is entry.module)
            wrapper.drop(entry.hook)
            if not (wrapper.enter or wrapper.exit):
                wrapper.uninstall()
                self._wrappers.remove(wrapper)
        self._fitted = self._quiet = None

    def _entries(self, wrapper: HookedForward) -> list[_ModuleHook]:
        return [self._entry[id(hook)] for hook in (*wrapper.enter, *wrapper.exit)]

    def _add(self, entry: _ModuleHook) -> _ModuleHook:
        self._hooks.append(entry)
        self._plain.append(entry)
        return entry

    def fit(self) -> None:
        """Each wrapped module's hooks as module hooks if it has others now, else from its
        forward wrapper (called before each forward of the root: hooks come and go). With no
        hook registered anywhere since it last looked, and none of them module hooks, there is
        nothing to look at (a hook removed only makes a module hook-free)."""
        registered = internals.hooks_registered()
        if registered == self._fitted or self.suspended:
            return
        for wrapper in self._wrappers:
            self._fit(wrapper)
        hooked = any(wrapper.hooked for wrapper in self._wrappers)
        self._fitted = None if hooked else internals.hooks_registered()

    def registered_since(self, mark: int) -> None:
        """The hooks registered since ``mark`` (a ``hooks_registered()``) are the caller's own,
        none of them module hooks: they do not make fit() look again."""
        now = internals.hooks_registered()
        if self._fitted == mark:
            self._fitted = now
        if self._quiet == mark:  # while suspended: see suspend()
            self._quiet = now

    def _fit(self, wrapper: HookedForward) -> None:
        if self.suspended:
            return
        hooked = wrapper.others()
        if hooked == wrapper.hooked and wrapper.runs != hooked:
            return  # as it should be
        own: set[int] = set()
        for entry in self._entries(wrapper):
            entry.unregister()
            if hooked:
                entry.register(self._outermost, own)
        wrapper.hooked, wrapper.runs = hooked, not hooked

    def suspend(self) -> None:
        """Take every hook off (a module with no hook takes torch's fast path).

        When fit() found every wrapper running its hooks and no hook was registered since, only
        the ``pre``/``post`` hooks are registered: a resume() with still none registered puts
        the wrappers back as they were, with no module looked at (depths that go to ``None``
        and back at every step).
        """
        fitted, self._fitted, self.suspended = self._fitted, None, True
        quiet = fitted is not None and fitted == internals.hooks_registered()
        self._quiet = fitted if quiet else None
        if quiet:  # no wrapper hooked
            for entry in self._plain:
                entry.unregister()
            for wrapper in self._wrappers:
                wrapper.runs = False
            return
        for entry in self._hooks:
            entry.unregister()
        for wrapper in self._wrappers:
            wrapper.hooked = wrapper.runs = False

    def resume(self) -> None:
        """Put the hooks back where they were among the module's other hooks."""
        self.suspended = False
        quiet, self._quiet = self._quiet == internals.hooks_registered(), None
        own: set[int] = set()
        for entry in self._plain:
            entry.register(self._outermost, own)
        if not quiet:
            self.fit()
            return
        for wrapper in self._wrappers:
            wrapper.runs = True
        self._fitted = internals.hooks_registered()  # the registrations counted are these

    def outermost(self) -> None:
        """Run these module hooks around those registered after them, now and when they come
        back: pre-hooks first, the others last (``fully_shard`` after a gate puts FSDP2's hooks
        around the gate's otherwise)."""
        self._outermost = True
        for entry in self._hooks:
            entry.place(outermost=True)

    def remove(self) -> None:
        hooks, self._hooks, self._plain = self._hooks, [], []
        wrappers, self._wrappers = self._wrappers, []
        self._entry = {}
        self.suspended = self._outermost = False
        for entry in hooks:
            entry.unregister()
        for wrapper in wrappers:
            wrapper.uninstall()


class _ModuleHook:
    """One hook as a module hook: registered, or off and remembering its place among the
    module's other hooks."""

    __slots__ = ("after", "before", "handle", "hook", "module", "options", "pre")

    def __init__(
        self,
        module: nn.Module,
        hook: GateHook,
        pre: bool,
        options: dict[str, Any],
        *,
        off: bool = False,
    ) -> None:
        self.module, self.hook, self.pre, self.options = module, hook, pre, options
        self.handle: RemovableHandle | None = None
        # while off: the keys of the module's hooks that ran before it, and after it
        self.before: set[int] | None = None
        self.after: set[int] = set()
        if off:  # as if registered now and taken off at once
            hooks = set(module._forward_pre_hooks if pre else module._forward_hooks)
            self.before, self.after = (set(), hooks) if options.get("prepend") else (hooks, set())

    def register(self, outermost: bool, own: set[int]) -> None:
        """Register it where it was among the module's hooks, and after ``own`` (the keys of
        hooks of its set registered before it in this pass; its key is added)."""
        module = self.module
        register = module.register_forward_pre_hook if self.pre else module.register_forward_hook
        self.handle = register(self.hook, **self.options)
        hooks = self.handle.hooks_dict_ref()
        if self.before is not None and hooks is not None:
            mine = self.handle.id
            keys = [key for key in hooks if key != mine]
            for key in [mine, *keys[self._place_in(keys, own) :]]:
                hooks.move_to_end(key)
        own.add(self.handle.id)
        self.place(outermost=outermost)

    def _place_in(self, keys: list[int], own: set[int]) -> int:
        """Where it goes among ``keys``: after those it ran after and hooks prepended while it
        was off (new keys in front of the old ones; with no old key left, new ones count as
        registered after it, the usual way)."""
        assert self.before is not None
        old = self.before | self.after
        first_old = next((i for i, key in enumerate(keys) if key in old), None)
        place = 0
        for i, key in enumerate(keys):
            prepended = first_old is not None and i < first_old and key not in old
            if key in self.before or key in own or prepended:
                place = i + 1
        return place

    def place(self, *, outermost: bool) -> None:
        hooks = None if self.handle is None else self.handle.hooks_dict_ref()
        if outermost and hooks is not None and self.handle.id in hooks:  # type: ignore[union-attr]
            hooks.move_to_end(self.handle.id, last=not self.pre)  # type: ignore[union-attr]

    def unregister(self) -> None:
        if self.handle is None:
            return
        hooks = self.handle.hooks_dict_ref()
        if hooks is not None and self.handle.id in hooks:
            keys = list(hooks)
            at = keys.index(self.handle.id)
            self.before, self.after = set(keys[:at]), set(keys[at + 1 :])
        self.handle.remove()
        self.handle = None
