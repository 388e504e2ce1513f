"""Where does the graph start? A cut that follows the blocks as they actually run.

A root forward pre-hook remembers the caller's grad mode and turns grad off. Block hooks follow
the calls: the first learning block that runs turns grad back on (only if the caller had it on);
a non-learning block that runs after that (called again, or out of order) runs frozen for that
call, so gradients pass through it but it gets none; a skipped block (DropBP) runs with no graph
and the gradient passes around it through its residual path. The root forward hook restores
everything, also when the forward raises; after a ``KeyboardInterrupt`` the next gated forward
(or the gate's removal) does. Changing the plan is a field write: no hook is added or removed.
"""

from __future__ import annotations

import operator
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Literal, get_args

import torch
from torch import nn

from ._autograd import tensors_in
from ._errors import (
    BlockCallError,
    BlockCallWarning,
    CheckpointAfterCutWarning,
    GradgateError,
    InvalidDepthError,
    SharedParameterWarning,
    warn,
)
from ._handles import Handle
from ._hooks import GateHook, HookSet
from ._select import (
    Pattern,
    ancestors,
    check_module,
    find_module,
    resolve_blocks,
    resolve_modules,
)
from ._validate import check_choice

PrefixMode = Literal["keep", "eval", "train"]

_THREAD = threading.local()  # the gated root forwards running in this thread, outermost first


def _open_frames() -> list[_Frame]:
    frames: list[_Frame] | None = getattr(_THREAD, "frames", None)
    if frames is None:
        frames = _THREAD.frames = []
    return frames


@dataclass(eq=False)
class _Frame:
    """What one gated root forward changed, so that it can be put back exactly."""

    gate: _Cut
    call_site: FrameType | None  # the root's Python call frame: gone from the stack = stale
    grad_before: bool
    blocking: bool
    training: list[tuple[nn.Module, bool]]
    autocast_cache: bool | None = None  # the cache setting to restore at the cut, if changed
    opened: bool = False
    tentative: int | None = None  # opened after this block; a later non-learner closes again
    last_position: int = -1
    ran: set[int] = field(default_factory=set)
    frozen: dict[int, list[nn.Parameter]] = field(default_factory=dict)
    skipped: dict[int, bool] = field(default_factory=dict)
    block_training: dict[int, list[tuple[nn.Module, bool]]] = field(default_factory=dict)
    explained: bool = False  # a warning already said why the output may have no graph
    shared_uses: dict[int, set[bool]] = field(default_factory=dict)


def _grad_held_off() -> bool:
    """Whether some gated forward in this thread is still before its cut."""
    return any(f.blocking and not f.opened for f in _open_frames())


class _Cut(Handle):
    """Hooks on a root module and its blocks; the plan says which blocks learn or skip."""

    def __init__(
        self,
        model: nn.Module,
        points: list[tuple[str, nn.Module]],
        *,
        prefix_mode: PrefixMode,
        check_ranks: bool = False,
    ) -> None:
        check_choice("prefix_mode", prefix_mode, get_args(PrefixMode))
        _require_a_forward(model)
        super().__init__(self._remove_hooks, description=f"cut in {type(model).__name__}")
        self._model = model
        self._points = points
        self._prefix_mode = prefix_mode
        self._check_ranks = check_ranks
        self._learn: range | frozenset[int] | None = None  # None: no cut; a range for depth
        self._first: int | None = None  # the first block that opens the cut (cached per plan)
        self._skip: frozenset[int] = frozenset()
        self._extra: tuple[nn.Module, ...] = ()  # learning modules that are not blocks
        self._warned: set[str] = set()
        self._stacks = [name.rpartition(".")[0] for name, _ in points]
        self._shared = _shared_parameter_owners(model)
        self._ddp_checked = not _distributed_running()
        if not self._ddp_checked:
            from .distributed import require_find_unused_parameters

            require_find_unused_parameters(model)
        self._fsdp_restore: Any = None
        self._fsdp = any(hasattr(m, "set_unshard_in_backward") for _, m in points)
        self._hooks = HookSet()
        self._hooks.pre(model, GateHook(self, "_enter_root"), prepend=True)
        self._hooks.post(model, GateHook(self, "_exit_root"), always_call=True)
        for position, (_, module) in enumerate(points):
            self._hooks.pre(
                module, GateHook(self, "_enter_block", position), with_kwargs=True, prepend=True
            )
            self._hooks.post(
                module, GateHook(self, "_exit_block", position), with_kwargs=True, always_call=True
            )
        for index, (_, owners) in enumerate(self._shared):
            for owner in owners:
                self._hooks.pre(owner, GateHook(self, "_use_shared", index))
        self._extra_hooks = HookSet()

    # -- the plan ------------------------------------------------------------------------------
    def _set_plan(
        self, learn: range | frozenset[int] | None, extra: tuple[nn.Module, ...] = ()
    ) -> None:
        self._require_active()
        if extra != self._extra:
            self._extra_hooks.remove()
            for module in extra:
                self._extra_hooks.pre(module, GateHook(self, "_enter_extra"))
        self._learn, self._extra, self._first = learn, extra, None
        self._apply_to_fsdp()

    def _first_opener(self) -> int:
        """Position of the first learning block that is not skipped (n when there is none)."""
        if self._first is None:
            learn = self._learn or ()
            if isinstance(learn, range) and not self._skip:
                self._first = learn.start
            else:
                opening = (p for p in learn if p not in self._skip)
                self._first = min(opening, default=len(self._points))
        return self._first

    def _apply_to_fsdp(self) -> None:
        """FSDP2: no all-gather in backward for blocks that backward does not run through."""
        if not self._fsdp:
            return
        from .distributed import apply_plan_to_fsdp

        if self._fsdp_restore is not None:
            self._fsdp_restore()
        first = self._first_opener()
        in_backward = [
            self._learn is None or (p >= first and p not in self._skip)
            for p in range(len(self._points))
        ]
        self._fsdp_restore = apply_plan_to_fsdp([m for _, m in self._points], in_backward)

    def _plan_key(self) -> tuple[int, ...]:
        learn = (-1,) if self._learn is None else tuple(sorted(self._learn))
        return (*learn, -2, *sorted(self._skip), -3, len(self._extra))

    def _require_active(self) -> None:
        if not self.active:
            raise GradgateError(
                f"{self!r} was removed; its plan cannot change. Create a new gate with "
                "gg.BackpropGate(model)."
            )

    # -- root hooks ----------------------------------------------------------------------------
    def _enter_root(self, module: nn.Module, args: Any) -> None:
        _recover_stale_frames()
        if not self._ddp_checked:  # a gate on ddp.module: find the wrapper once
            from .distributed import calling_ddp, require_find_unused_parameters

            self._ddp_checked = True
            require_find_unused_parameters(calling_ddp())
        if self._check_ranks:
            from .distributed import check_same_plan

            check_same_plan(self._plan_key())
        grad = torch.is_grad_enabled()
        blocking = self._learn is not None and (grad or _grad_held_off())
        frame = _Frame(
            gate=self,
            call_site=_root_call_site(),
            grad_before=grad,
            blocking=blocking,
            training=self._set_prefix_mode() if blocking else [],
        )
        _open_frames().append(frame)
        if blocking:
            torch.set_grad_enabled(False)
            if torch.is_autocast_cache_enabled():
                # Autocast caches low-precision copies of weights that require grad until the
                # autocast region ends, even under no_grad: without the cache the prefix's
                # copies are freed as soon as each layer is done.
                frame.autocast_cache = True
                torch.set_autocast_cache_enabled(False)

    def _exit_root(self, module: nn.Module, args: Any, output: Any) -> None:
        frame = self._own_frame()
        if frame is None:
            return
        never_opened = frame.blocking and not frame.opened and frame.grad_before
        nothing_learns = (
            frame.blocking
            and frame.opened
            and not frame.explained
            and torch.is_grad_enabled()  # else reentrant checkpointing lost it: warned below
            and not _has_graph(output)
        )
        _close_frame(frame)
        self._warn_after_forward(frame, never_opened, nothing_learns)

    # -- block hooks ---------------------------------------------------------------------------
    def _enter_block(self, position: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        frame = self._own_frame()
        if frame is None:
            self._warn_outside_call(position)
            return
        if position < frame.last_position and position not in frame.ran:
            self._warn_once(
                "order",
                f"block {self._points[position][0]!r} ran after "
                f"{self._points[frame.last_position][0]!r}, out of the listed order; depth "
                "counts blocks in the listed order and the cut follows the run (blocks that "
                "run after the cut without learning pass gradients but get none). Pass "
                "blocks=[...] in the order they run if that is what you meant.",
            )
        frame.last_position = max(frame.last_position, position)
        frame.ran.add(position)
        learns = self._learn is not None and position in self._learn
        if frame.tentative is not None:
            if learns:
                frame.tentative = None
            else:
                self._close_again(frame)
        if learns and position not in self._skip:
            self._open(frame)
        elif frame.blocking and not frame.opened and not frame.training:
            frame.block_training[position] = self._set_prefix_mode(module)
        if position in self._skip:
            frame.skipped[position] = torch.is_grad_enabled()
            torch.set_grad_enabled(False)
        elif frame.opened and not learns and torch.is_grad_enabled():
            frame.frozen[position] = _freeze_for_call(module)

    def _exit_block(
        self, position: int, module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> Any:
        frame = self._own_frame()
        if frame is None:
            return None
        for param in frame.frozen.pop(position, ()):
            param.requires_grad_(True)
        for block_module, training in frame.block_training.pop(position, ()):
            block_module.training = training
        if position in frame.skipped:
            torch.set_grad_enabled(frame.skipped.pop(position))
            output = _pass_around(self._points[position][0], args, kwargs, output)
        elif frame.opened and self._learn is not None and position in self._learn:
            frame.explained |= _check_block_output_learns(self._points[position][0], module, output)
        if frame.blocking and not frame.opened and self._opens_after(position):
            frame.tentative = position
            self._open(frame)
        return output

    def _enter_extra(self, module: nn.Module, args: Any) -> None:
        frame = self._own_frame()
        if frame is not None:
            frame.tentative = None
            self._open(frame)

    def _use_shared(self, index: int, module: nn.Module, args: Any) -> None:
        frame = self._own_frame()
        if frame is not None and frame.blocking:
            frame.shared_uses.setdefault(index, set()).add(frame.opened)

    # -- opening and closing the cut -----------------------------------------------------------
    def _opens_after(self, position: int) -> bool:
        """Whether the cut opens, for now, right after this non-learning block.

        It does inside the stack (the container) of the first learner, or of the last block when
        only what runs after the blocks learns: the next non-learning block of the stack closes
        it again, a learner keeps it open. So the code between blocks (where a learner may be
        called through ``checkpoint()``) sees grad on, and blocks skipped by LayerDrop cannot
        keep the cut shut.
        """
        assert self._learn is not None
        first = min(self._first_opener(), len(self._points) - 1)
        opens = position in self._learn and position not in self._skip
        return not opens and self._stacks[position] == self._stacks[first]

    def _open(self, frame: _Frame) -> None:
        if not frame.blocking or frame.opened:
            return
        frame.opened = True
        if frame.autocast_cache is not None:
            torch.set_autocast_cache_enabled(frame.autocast_cache)
        for prefix_module, training in frame.training:
            prefix_module.training = training
        frame.training = []
        if not _grad_held_off():
            torch.set_grad_enabled(True)  # a blocking frame always traces back to grad on

    def _close_again(self, frame: _Frame) -> None:
        frame.tentative = None
        frame.opened = False
        torch.set_grad_enabled(False)
        if frame.autocast_cache is not None:
            torch.set_autocast_cache_enabled(False)

    def _own_frame(self) -> _Frame | None:
        for frame in reversed(_open_frames()):
            if frame.gate is self:
                return frame
        return None

    # -- what lies before the cut --------------------------------------------------------------
    def _set_prefix_mode(self, block: nn.Module | None = None) -> list[tuple[nn.Module, bool]]:
        """Put what may run before the cut in the prefix mode: the whole model, or one block.

        Containers of blocks keep their mode (their forward also runs the learning part); the
        modes come back when the cut opens, so what runs after it is untouched. A block that
        runs before the cut after it opened once (it closes again between blocks) gets the
        prefix mode for its own call.
        """
        if self._prefix_mode == "keep":
            return []
        keep = {""} | {a for name, _ in self._points for a in ancestors(name)}
        changed = []
        named = self._model.named_modules() if block is None else block.named_modules(prefix="·")
        for name, module in named:
            if name not in keep:
                changed.append((module, module.training))
                module.training = self._prefix_mode == "train"
        return changed

    # -- diagnostics ---------------------------------------------------------------------------
    def _warn_after_forward(self, frame: _Frame, never_opened: bool, nothing_learns: bool) -> None:
        if never_opened:
            warn(  # every time: it is about this step
                "the cut never opened in this forward, so nothing in it learns: no learning "
                "block ran (LayerDrop skipped every block of the stack, or the plan names blocks "
                "that did not run). Lower the layerdrop probability, or choose a plan with a "
                "block that always runs.",
                BlockCallWarning,
            )
        if nothing_learns:
            self._warn_once(
                "nothing-learns",
                "nothing that runs after the cut has trainable parameters (nothing runs after "
                "the last block, or all of it has requires_grad=False, e.g. a frozen head with "
                "adapters only in cut-off blocks), so the output has no graph and backward "
                "would fail. Choose a larger depth, or unfreeze a module after the cut.",
            )
        straddling = [i for i, when in frame.shared_uses.items() if when == {False, True}]
        if straddling and "shared" not in self._warned:
            self._warned.add("shared")
            names = {id(m): n for n, m in self._model.named_modules(remove_duplicate=False)}
            uses = [names.get(id(m), "?") for m in self._shared[straddling[0]][1]]
            warn(
                f"a parameter shared by {uses[0]!r} and {uses[1]!r} is used before the cut "
                "and again after it: only the use after the cut gets a gradient, so its .grad "
                "differs from full backprop. Untie the weights, or accept the partial gradient "
                "(the usual choice for tied embeddings).",
                SharedParameterWarning,
            )

    def _warn_outside_call(self, position: int) -> None:
        if self._learn is None or not torch.is_grad_enabled() or _grad_held_off():
            return
        if torch._C._current_autograd_node() is not None:
            return  # activation checkpointing recomputing the block during backward
        self._warn_once(
            "outside",
            f"block {self._points[position][0]!r} ran outside a call of the gated "
            f"{type(self._model).__name__}, so the cut does not apply to it and it learns "
            "fully. Call the gated model itself, or gate the module you call.",
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message, BlockCallWarning)

    def _remove_hooks(self) -> None:
        for frame in [f for f in _open_frames() if f.gate is self]:
            _close_frame(frame)
        self._hooks.remove()
        self._extra_hooks.remove()
        if self._fsdp_restore is not None:
            self._fsdp_restore()


def _close_frame(frame: _Frame) -> None:
    """Put back what one root forward changed: grad mode, train flags, frozen parameters."""
    frames = _open_frames()
    if frame not in frames:
        return
    held_before = _grad_held_off()
    frames.remove(frame)
    for params in frame.frozen.values():
        for param in params:
            param.requires_grad_(True)
    for module, training in frame.training:
        module.training = training
    if frame.autocast_cache is not None:
        torch.set_autocast_cache_enabled(frame.autocast_cache)
    if frame.blocking and held_before and not _grad_held_off():
        torch.set_grad_enabled(True)
    elif frame.blocking and frame.opened and not torch.is_grad_enabled() and frame.grad_before:
        torch.set_grad_enabled(True)
        _warn_lost_grad_mode()
    frame.call_site = None


def _root_call_site() -> FrameType:
    """The Python frame of the root module's call that is running the hooks now."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code is not _CALL_IMPL:
        frame = frame.f_back
    return frame or sys._getframe(2)


_CALL_IMPL = nn.Module._call_impl.__code__


def _recover_stale_frames() -> None:
    """Close frames whose root call ended without its hooks (KeyboardInterrupt, SystemExit)."""
    frames = _open_frames()
    if not frames:
        return
    live: set[int] = set()
    caller: FrameType | None = sys._getframe(1)
    while caller is not None:
        live.add(id(caller))
        caller = caller.f_back
    for frame in reversed(frames):
        if frame.call_site is None or id(frame.call_site) not in live:
            _close_frame(frame)


class BackpropGate(_Cut):
    """Per-minibatch plan: which blocks learn (``depth`` or ``learn``) and which skip backward.

    ``depth=k``: only the last ``k`` blocks and what runs after them learn; ``None`` cuts
    nowhere; ``0`` lets only what runs after the last block learn. ``learn={1, 4}`` lets any
    set of blocks (or modules, by name) learn; ``skip={2}`` runs residual blocks with no graph
    and passes the gradient around them (DropBP). Setting a field is O(1); ``gate.remove()``
    (or leaving a ``with`` block) removes every hook.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)])
    >>> gate = gg.BackpropGate(net)
    >>> gate.depth = 1
    >>> net(torch.randn(2, 3)).sum().backward()
    >>> [name for name, p in net.named_parameters() if p.grad is not None]
    ['3.weight', '3.bias']
    >>> gate.remove()
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[Pattern] | str | None = None,
        *,
        depth: int | None = None,
        prefix_mode: PrefixMode = "keep",
        check_ranks: bool = False,
    ) -> None:
        check_module(model)
        points = resolve_blocks(model, blocks)
        if not points:
            raise InvalidDepthError(
                f"blocks={blocks!r} selects no module of {type(model).__name__}; expected at "
                "least one block name or pattern."
            )
        depth = _validate_depth(depth, len(points), type(model).__name__)
        if not isinstance(check_ranks, bool):
            raise InvalidDepthError(f"check_ranks={check_ranks!r}; expected True or False.")
        if check_ranks:
            from .distributed import check_same_plan  # noqa: F401  (fails early if missing)
        super().__init__(model, points, prefix_mode=prefix_mode, check_ranks=check_ranks)
        self._depth: int | None = None
        self.depth = depth

    @property
    def blocks(self) -> list[str]:
        """The block names this gate plans over, in order."""
        return [name for name, _ in self._points]

    @property
    def depth(self) -> int | None:
        """How many of the last blocks learn; ``None`` for no cut (or when ``learn`` is set)."""
        return self._depth

    @depth.setter
    def depth(self, value: int | None) -> None:
        n = len(self._points)
        value = _validate_depth(value, n, type(self._model).__name__)
        self._set_plan(None if value is None else range(n - value, n))  # O(1)
        self._depth = value

    @property
    def learn(self) -> frozenset[int | str] | None:
        """The learning set: block positions and module names; ``None`` when not set."""
        if self._learn is None or self._depth is not None:
            return None
        names = {n: m for n, m in self._model.named_modules()}
        extra = [n for n, m in names.items() if any(m is e for e in self._extra)]
        return frozenset([*self._learn, *extra])

    @learn.setter
    def learn(self, value: Iterable[int | str] | None) -> None:
        if value is None:
            self._set_plan(None)
            self._depth = None
            return
        positions, extra = self._resolve_learn(value)
        self._set_plan(frozenset(positions), tuple(extra))
        self._depth = None

    @property
    def skip(self) -> frozenset[int]:
        """Block positions that run with no graph; the gradient passes around them (DropBP)."""
        return self._skip

    @skip.setter
    def skip(self, value: Iterable[int] | None) -> None:
        self._require_active()
        self._skip = frozenset(self._positions(value or (), option="skip"))
        self._first = None
        self._apply_to_fsdp()

    def _resolve_learn(self, value: Iterable[int | str]) -> tuple[set[int], list[nn.Module]]:
        if isinstance(value, (str, int)):
            value = [value]
        try:
            items = list(value)
        except TypeError:
            raise InvalidDepthError(
                f"learn={value!r} is not a set; expected block positions and/or module names, "
                "e.g. learn={1, 4, 'transformer.wte'}, or None."
            ) from None
        numbers = [v for v in items if not isinstance(v, str)]
        positions = set(self._positions(numbers, option="learn"))
        extra: list[nn.Module] = []
        by_id = {id(m): i for i, (_, m) in enumerate(self._points)}
        for pattern in (v for v in items if isinstance(v, str)):
            for _, module in resolve_modules(self._model, [pattern]):
                if id(module) in by_id:
                    positions.add(by_id[id(module)])
                elif module is self._model:
                    raise InvalidDepthError(
                        f"learn={pattern!r} names the whole model; expected blocks or modules "
                        "inside it (use depth=None for no cut)."
                    )
                elif all(module is not e for e in extra):
                    extra.append(module)
        return positions, extra

    def _positions(self, values: Iterable[object], *, option: str) -> list[int]:
        n = len(self._points)
        found = []
        for value in values:
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                raise InvalidDepthError(
                    f"{option} contains {value!r} ({type(value).__name__}); expected block "
                    f"positions 0..{n - 1}" + (" or module names." if option == "learn" else ".")
                )
            index = operator.index(value)  # type: ignore[arg-type]
            if not -n <= index < n:
                raise InvalidDepthError(
                    f"{option} contains block position {index}, out of range: "
                    f"{type(self._model).__name__} has {n} blocks (0..{n - 1})."
                )
            found.append(index % n)
        return found

    def __repr__(self) -> str:
        if self._depth is not None or self._learn is None:
            plan = f"depth={self._depth}"
        else:
            plan = f"learn={sorted(self._learn)}"
        skip = f" skip={sorted(self._skip)}" if self._skip else ""
        state = "" if self.active else " (removed)"
        return f"<gradgate.BackpropGate {plan}{skip} of {len(self._points)} blocks{state}>"


def backprop_depth(
    model: nn.Module,
    depth: int | None,
    blocks: Sequence[Pattern] | str | None = None,
    *,
    prefix_mode: PrefixMode = "keep",
) -> BackpropGate:
    """Context manager: forwards inside it learn only in the last ``depth`` blocks and after.

    ``prefix_mode`` sets the train/eval mode of the modules that run before the cut
    (``"keep"``, the default, leaves them alone).

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)])
    >>> with gg.backprop_depth(net, 2):
    ...     loss = net(torch.randn(2, 3)).sum()
    >>> loss.backward()
    >>> [i for i, layer in enumerate(net) if layer.weight.grad is not None]
    [2, 3]
    """
    return BackpropGate(model, blocks, depth=depth, prefix_mode=prefix_mode)


class StopGradient(_Cut):
    """A cut at the input of one named module; see :func:`stop_gradient_at`."""

    def __init__(self, model: nn.Module, name: str, *, prefix_mode: PrefixMode = "keep") -> None:
        check_module(model)
        if not isinstance(name, str) or not name:
            raise InvalidDepthError(
                f"stop_gradient_at needs a module name; got {name!r}. Expected the qualified "
                "name of a module inside the model, e.g. 'encoder.layer.4'."
            )
        point = find_module(model, name)
        if point[1] is model:
            raise InvalidDepthError(
                f"{name!r} is the model itself; a cut at its input stops nothing. Name a "
                "module inside it."
            )
        super().__init__(model, [point], prefix_mode=prefix_mode)
        self._set_plan(frozenset({0}))

    def __repr__(self) -> str:
        state = "" if self.active else " (removed)"
        return f"<gradgate.StopGradient at input of {self._points[0][0]!r}{state}>"


def stop_gradient_at(
    model: nn.Module, name: str, *, prefix_mode: PrefixMode = "keep"
) -> StopGradient:
    """Cut at the input of the named module: nothing that runs before it records a graph.

    Returns a removable handle that is also a context manager.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    >>> with gg.stop_gradient_at(net, "1"):
    ...     net(torch.randn(2, 3)).sum().backward()
    >>> net[0].weight.grad is None, net[1].weight.grad is not None
    (True, True)
    """
    return StopGradient(model, name, prefix_mode=prefix_mode)


def _validate_depth(depth: object, n: int, model_name: str) -> int | None:
    if depth is None:
        return None
    if isinstance(depth, bool) or not hasattr(depth, "__index__"):
        raise InvalidDepthError(
            f"depth {depth!r} has type {type(depth).__name__}; expected an integer 0..{n} "
            "or None (no cut)."
        )
    value = operator.index(depth)  # type: ignore[arg-type]
    if not 0 <= value <= n:
        raise InvalidDepthError(
            f"depth {value} is out of range: {model_name} has {n} blocks; expected an integer "
            f"0..{n} (0: only what runs after the last block learns) or None (no cut)."
        )
    return value


def _require_a_forward(model: nn.Module) -> None:
    if isinstance(model, (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)):
        raise BlockCallError(
            f"a {type(model).__name__} has no forward of its own, so a gate on it would never "
            "run. Gate the model that calls it, e.g. gg.BackpropGate(model) or "
            "gg.BackpropGate(model, blocks='transformer.h.*')."
        )


def _distributed_running() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _has_graph(output: Any) -> bool:
    tensors = tensors_in(output)
    return not tensors or any(t.requires_grad for t in tensors)


def _freeze_for_call(module: nn.Module) -> list[nn.Parameter]:
    params = [p for p in module.parameters() if p.requires_grad]
    for param in params:
        param.requires_grad_(False)
    return params


def _pass_around(name: str, args: Any, kwargs: Any, output: Any) -> Any:
    """DropBP: the block's value, with the gradient of its input passed through unchanged."""
    inputs = tensors_in((args, kwargs))
    if not inputs:
        raise BlockCallError(f"skipped block {name!r} got no tensor input to pass around.")
    x = inputs[0]
    outputs = tensors_in(output)
    if not outputs or outputs[0].shape != x.shape:
        shape = tuple(outputs[0].shape) if outputs else None
        raise BlockCallError(
            f"block {name!r} cannot be skipped: its output shape {shape} differs from its "
            f"input shape {tuple(x.shape)}, so there is no residual path for the gradient. "
            "Skip only residual blocks (output = input + f(input))."
        )
    if not x.requires_grad:
        return output
    through = outputs[0].detach() + (x - x.detach())  # value of the block, gradient of identity
    return _replace_first_tensor(output, through)


def _replace_first_tensor(output: Any, tensor: torch.Tensor) -> Any:
    if isinstance(output, torch.Tensor):
        return tensor
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (
            type(output)((tensor, *output[1:]))
            if type(output) is tuple
            else (output.__class__(tensor, *output[1:]))
        )
    if isinstance(output, list) and output and isinstance(output[0], torch.Tensor):
        return [tensor, *output[1:]]
    raise BlockCallError(
        f"a skipped block returned {type(output).__name__}; expected a tensor or a tuple whose "
        "first element is the hidden state."
    )


def _shared_parameter_owners(model: nn.Module) -> list[tuple[nn.Parameter, list[nn.Module]]]:
    """Parameters owned by two or more different modules (tied weights), with their owners."""
    owners: dict[int, tuple[nn.Parameter, list[nn.Module]]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            entry = owners.setdefault(id(param), (param, []))
            if all(module is not m for m in entry[1]):
                entry[1].append(module)
    return [(param, mods) for param, mods in owners.values() if len(mods) > 1]


def _check_block_output_learns(name: str, block: nn.Module, output: Any) -> bool:
    """Warn (and say so) when a learning block has trainable parameters but no output graph."""
    tensors = tensors_in(output)
    if not torch.is_grad_enabled() or not tensors or any(t.requires_grad for t in tensors):
        return False
    if any(p.requires_grad for p in block.parameters()):
        warn(
            f"the learning block {name!r} has trainable parameters but its output does not "
            "require grad, so they will get no gradient. The usual cause is reentrant "
            "activation checkpointing inside the block: its input comes from the cut and does "
            "not require grad. Fix: torch.utils.checkpoint.checkpoint(..., use_reentrant=False).",
            CheckpointAfterCutWarning,
        )
        return True
    return False


def _warn_lost_grad_mode() -> None:
    warn(
        "grad mode was switched on at the cut but was off again when the forward ended, so "
        "nothing after the cut will get gradients. The usual cause is reentrant activation "
        "checkpointing around the first learning block: its inputs come from the cut and do "
        "not require grad. Fix: torch.utils.checkpoint.checkpoint(..., use_reentrant=False) "
        "(for transformers: gradient_checkpointing_enable(gradient_checkpointing_kwargs="
        "{'use_reentrant': False})).",
        CheckpointAfterCutWarning,
    )
