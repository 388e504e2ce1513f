"""Where does the graph start? A cut: the forward before it runs without autograd.

A forward pre-hook on the root remembers the caller's grad mode and turns grad off; a hook at
the cut point turns it back on (only if the caller had it on); a root forward hook registered
with ``always_call=True`` restores the caller's mode, also when the forward raises. Changing
the depth only moves an index: no hook is registered or removed.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._errors import (
    CheckpointAfterCutWarning,
    InvalidDepthError,
    SharedParameterWarning,
    warn,
)
from ._handles import Handle
from ._select import Pattern, ancestors, find_module, resolve_blocks
from ._autograd import tensors_in
from ._validate import check_choice

PrefixMode = Literal["keep", "eval", "train"]


# How many gates are blocking grad in this thread right now. Context-local on purpose: grad mode
# itself is thread-local in PyTorch, and nested gates must agree on who turns it back on.
_BLOCKING: ContextVar[int] = ContextVar("gradgate_blocking_gates", default=0)


@dataclass
class _Frame:
    """What one root forward changed: grad mode turned off, then on at the cut; train flags."""

    blocking: bool
    training: list[tuple[nn.Module, bool]]
    opened: bool = False


class _Cut(Handle):
    """Hooks on a root module and a list of cut points; ``_index`` says which point cuts.

    ``_index == i < len(points)`` cuts at the input of ``points[i]``; ``_index == len(points)``
    cuts at the output of the last point; ``None`` cuts nowhere.
    """

    def __init__(
        self,
        model: nn.Module,
        points: list[tuple[str, nn.Module]],
        *,
        prefix_mode: PrefixMode,
    ) -> None:
        check_choice("prefix_mode", prefix_mode, get_args(PrefixMode))
        super().__init__(self._remove_hooks, description=f"cut in {type(model).__name__}")
        self._model = model
        self._points = points
        self._prefix_mode = prefix_mode
        self._index: int | None = None
        self._frames: list[_Frame] = []
        self._warned_shared = False
        self._checked_for_sharing: set[int] = set()
        self._order = [name for name, _ in model.named_modules(remove_duplicate=False)]
        self._hooks: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._enter_root, prepend=True),
            model.register_forward_hook(self._exit_root, always_call=True),
        ]
        for position, (_, module) in enumerate(points):
            self._hooks.append(module.register_forward_pre_hook(self._make_pre_hook(position)))
            self._hooks.append(module.register_forward_hook(self._make_post_hook(position)))
        self._hooks.append(points[-1][1].register_forward_hook(self._after_last_point))

    # -- the hooks ---------------------------------------------------------------------------
    # Each root forward pushes a frame. A gate blocks when it has a cut and grad is on (or off
    # only because another gate blocks); grad comes back on when the last blocking gate reaches
    # its cut, so cuts on nested modules compose: nothing before any of them records a graph.
    def _enter_root(self, module: nn.Module, args: Any) -> None:
        blocking = self._index is not None and (torch.is_grad_enabled() or _BLOCKING.get() > 0)
        self._frames.append(_Frame(blocking=blocking, training=self._set_prefix_mode()))
        if blocking:
            _BLOCKING.set(_BLOCKING.get() + 1)
            torch.set_grad_enabled(False)

    def _make_pre_hook(self, position: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if position == self._index:
                self._open()

        return hook

    def _make_post_hook(self, position: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if position == self._index and torch.is_grad_enabled() and self._is_open():
                _check_block_output_learns(self._points[position][0], module, output)

        return hook

    def _after_last_point(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._index == len(self._points):
            self._open()

    def _is_open(self) -> bool:
        return bool(self._frames) and self._frames[-1].opened

    def _open(self) -> None:
        frame = self._frames[-1] if self._frames else None
        if frame is None or not frame.blocking or frame.opened:
            return
        frame.opened = True
        _BLOCKING.set(_BLOCKING.get() - 1)
        if _BLOCKING.get() == 0:
            torch.set_grad_enabled(True)

    def _exit_root(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._frames:
            return
        frame = self._frames.pop()
        for prefix_module, training in frame.training:
            prefix_module.training = training
        if not frame.blocking:
            return
        if not frame.opened:
            _BLOCKING.set(_BLOCKING.get() - 1)
        if _BLOCKING.get() > 0:
            return
        lost = frame.opened and not torch.is_grad_enabled()
        torch.set_grad_enabled(True)
        if lost:
            _warn_lost_grad_mode(self._cut_name())

    # -- what lies before the cut ------------------------------------------------------------
    def _cut_name(self) -> str:
        cut, after_last = self._cut_point()
        return f"{'output' if after_last else 'input'} of {cut!r}"

    def _cut_point(self) -> tuple[str, bool]:
        """The cut module's name, and whether the cut is at its output."""
        assert self._index is not None
        after_last = self._index == len(self._points)
        return self._points[-1 if after_last else self._index][0], after_last

    def _prefix_names(self) -> set[str]:
        """Module names registered before the cut point (and inside it for an output cut)."""
        cut, after_last = self._cut_point()
        position = self._order.index(cut)
        inside = {n for n in self._order if n == cut or n.startswith(f"{cut}.")}
        outer = set(ancestors(cut))
        before = {n for n in self._order[:position] if n not in outer and n not in inside}
        return before | inside if after_last else before

    def _set_prefix_mode(self) -> list[tuple[nn.Module, bool]]:
        if self._prefix_mode == "keep" or self._index is None:
            return []
        lookup = dict(self._model.named_modules(remove_duplicate=False))
        changed = []
        for name in self._prefix_names():
            module = lookup[name]
            changed.append((module, module.training))
            module.training = self._prefix_mode == "train"
        return changed

    def _warn_shared_parameters(self) -> None:
        if self._warned_shared or self._index is None or self._index in self._checked_for_sharing:
            return
        self._checked_for_sharing.add(self._index)  # depth changes every step: check each once
        prefix = self._prefix_names()
        outer = set(ancestors(self._cut_point()[0]))
        uses: dict[int, tuple[list[str], list[str]]] = {}
        for name, param in self._model.named_parameters(remove_duplicate=False):
            owner = name.rpartition(".")[0]
            if owner not in outer:
                uses.setdefault(id(param), ([], []))[owner not in prefix].append(name)
        for before, after in uses.values():
            if before and after:
                self._warned_shared = True
                warn(
                    f"parameter {before[0]!r} is used before the cut ({self._cut_name()}) and "
                    f"again after it as {after[0]!r}: only the use after the cut gets a "
                    "gradient, so its .grad differs from full backprop. Untie the weights, or "
                    "accept the partial gradient (the usual choice for tied embeddings).",
                    SharedParameterWarning,
                )
                return

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()


class BackpropGate(_Cut):
    """Per-minibatch backprop depth: only the last ``depth`` blocks and what runs after them learn.

    ``depth=None`` cuts nowhere; ``depth=0`` lets only what runs after the last block learn.
    Setting ``gate.depth`` is a field write; ``gate.remove()`` (or leaving a ``with`` block)
    removes every hook.

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
    ) -> None:
        points = resolve_blocks(model, blocks)
        if not points:
            raise InvalidDepthError(
                f"blocks={blocks!r} selects no module of {type(model).__name__}; expected at "
                "least one block name or pattern."
            )
        depth = _validate_depth(depth, len(points), type(model).__name__)
        super().__init__(model, points, prefix_mode=prefix_mode)
        self.depth = depth

    @property
    def blocks(self) -> list[str]:
        """The block names this gate counts depth over, in order."""
        return [name for name, _ in self._points]

    @property
    def depth(self) -> int | None:
        """How many of the last blocks learn; ``None`` for no cut."""
        n = len(self._points)
        return None if self._index is None else n - self._index

    @depth.setter
    def depth(self, value: int | None) -> None:
        n = len(self._points)
        value = _validate_depth(value, n, type(self._model).__name__)
        self._index = None if value is None else n - value
        self._warn_shared_parameters()

    def __repr__(self) -> str:
        return f"<gradgate.BackpropGate depth={self.depth} of {len(self._points)} blocks>"


def backprop_depth(
    model: nn.Module,
    depth: int | None,
    blocks: Sequence[Pattern] | str | None = None,
    *,
    prefix_mode: PrefixMode = "keep",
) -> BackpropGate:
    """Context manager: forwards inside it learn only in the last ``depth`` blocks and after.

    ``prefix_mode`` sets the train/eval mode of the modules before the cut during the forward
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
        point = find_module(model, name)
        super().__init__(model, [point], prefix_mode=prefix_mode)
        self._index = 0
        self._warn_shared_parameters()

    def __repr__(self) -> str:
        return f"<gradgate.StopGradient at input of {self._points[0][0]!r}>"


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


def _check_block_output_learns(name: str, block: nn.Module, output: Any) -> None:
    """Warn when the first learning block has trainable parameters but its output has no graph."""
    tensors = tensors_in(output)
    if not tensors or any(t.requires_grad for t in tensors):
        return
    if any(p.requires_grad for p in block.parameters()):
        warn(
            f"the first learning block {name!r} has trainable parameters but its output does "
            "not require grad, so they will get no gradient. The usual cause is reentrant "
            "activation checkpointing inside the block: its input comes from the cut and does "
            "not require grad. Fix: torch.utils.checkpoint.checkpoint(..., use_reentrant=False).",
            CheckpointAfterCutWarning,
        )


def _warn_lost_grad_mode(cut: str) -> None:
    warn(
        f"grad mode was switched on at the cut ({cut}) but was off again when the forward "
        "ended, so nothing after the cut will get gradients. The usual cause is reentrant "
        "activation checkpointing around the first learning block: its inputs come from the "
        "cut and do not require grad. Fix: torch.utils.checkpoint.checkpoint(..., "
        "use_reentrant=False) (for transformers: gradient_checkpointing_enable("
        "gradient_checkpointing_kwargs={'use_reentrant': False})).",
        CheckpointAfterCutWarning,
    )
