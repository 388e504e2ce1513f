"""torch.compile for a per-minibatch depth: compile each block's ``forward``, not the model.

Under a :class:`~gradgate.BackpropGate`, a block runs in one of three states under a depth: in
the cut-off prefix (grad mode off), as the first learning block (grad mode on, input not
requiring grad), or further in the suffix (input requiring grad); learning sets and skips add
two (frozen after the cut, skipped after the cut). Compiling each block's ``forward`` gives one
graph per state and block class, shared by all blocks of that class (parameters are graph
inputs), so after one pass over the plans nothing compiles again (docs/performance.md).

The gate's hooks stay outside the compiled region: they run around ``forward``, and only the
block's own ``forward`` is compiled, beneath a gate's wrapper when the gate came first.
(``block.compile()`` compiles ``__call__`` with its hooks, which traces the gate's bookkeeping
into the graphs.) ``torch.compile(model)`` of a gated model does the same per block by itself
(see ``_plumbing.frames_compile``); whole-model ``torch.compile`` with ``requires_grad``
toggling instead recompiles for every new depth.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .._plumbing.errors import InvalidOptionError
from .._plumbing.frames_compile import COMPILED_MARK, CacheNotice, block_tracing, kept_eager
from .._plumbing.handles import Handle
from .._plumbing.torch_internals import guards_hooks, needs
from .._select.names import Pattern, resolve_blocks


def compile_blocks(
    model: nn.Module, blocks: Sequence[Pattern] | str | None = None, **compile_kwargs: Any
) -> Handle:
    """Compile the ``forward`` of every block with ``torch.compile(**compile_kwargs)``.

    ``blocks`` selects the blocks as in :class:`~gradgate.BackpropGate` (auto-found when
    None). Returns a :class:`~gradgate.Handle`; ``handle.remove()`` restores the original
    forwards. Modules outside the blocks (embeddings, head) stay eager. A gated model compiled
    whole (``torch.compile(model)``) is compiled block by block like this without it. Before
    or after a gate, and either removed first, the gate's hooks stay out of the graphs.

    Graphs: one per block class and state it runs in, at most five (before the cut; first
    learner; learning after it; frozen after it, under a learning set; skipped after the cut);
    a block holding a module named in ``learn=`` runs eagerly for that plan. After one pass over
    the plans, nothing compiles again at the same input sizes. With ``dynamic=None`` (the
    default) each graph compiles once more, dynamic, when its state first meets another size;
    pass ``dynamic=True`` when sizes change (docs/performance.md).

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    >>> handle = gg.compile_blocks(net, backend="eager")
    >>> gate = gg.BackpropGate(net)
    >>> for depth in [2, 1, None]:
    ...     gate.depth = depth
    ...     net(torch.randn(2, 4)).sum().backward()
    >>> handle.remove(); gate.remove()
    >>> "forward" in vars(net[0])
    False
    """
    import torch

    _check_compile_keywords(compile_kwargs)
    if "fullgraph" in compile_kwargs and not isinstance(compile_kwargs["fullgraph"], bool):
        raise InvalidOptionError(
            f"fullgraph={compile_kwargs['fullgraph']!r}; expected True or False."
        )
    if not guards_hooks():
        raise needs(
            "gg.compile_blocks (blocks of a class share graphs, so dynamo must guard on hooks)",
            "torch._dynamo.config.skip_nnmodule_hook_guards",
        )
    points = resolve_blocks(model, blocks)
    for name, block in points:
        if getattr(_slot(block)[1], COMPILED_MARK, False):
            raise InvalidOptionError(
                f"block {name!r} is already compiled by gg.compile_blocks; expected each block "
                "compiled once. Remove the earlier handle first."
            )
    try:  # torch.compile checks its options (a backend name) before anything is replaced
        torch.compile(_slot(points[0][1])[1], **compile_kwargs)
    except Exception as error:
        raise InvalidOptionError(
            f"torch.compile refused the options {compile_kwargs!r:.120}: {error}; expected "
            "options torch.compile accepts, e.g. backend='inductor' or mode='reduce-overhead'."
        ) from None
    undos = []
    notice = CacheNotice()  # one warning for all the blocks
    for _, block in points:
        wrapper, eager = _slot(block)
        compiled = _quiet(torch.compile(eager, **compile_kwargs), eager, block, notice)
        undos.append(_install(block, wrapper, eager, compiled))

    def undo() -> None:
        for one in undos:
            one()

    return Handle(undo, description=f"compile_blocks over {len(points)} blocks")


def _slot(block: nn.Module) -> tuple[Any, Any]:
    """Where the block's own forward is called from, and that forward: the block itself, or
    the innermost of the wrappers installed as its ``forward`` (a gate's, a prefix cache's:
    they stay out of the compiled code, as when they come after ``compile_blocks``)."""
    wrapper = None
    forward: Any = block.forward
    while getattr(forward, "around_forward", False):
        wrapper, forward = forward, forward.inner
    return wrapper, forward


def _install(block: nn.Module, wrapper: Any, eager: Any, compiled: Any) -> Callable[[], None]:
    """``compiled`` in the place of ``eager``; returns what puts ``eager`` back, wherever the
    gates added or removed since have left ``compiled``."""
    if wrapper is None:
        before = vars(block).get("forward")  # an instance forward of the user's, if any
        # a plain instance attribute: nn.Module.__call__ (hooks included) calls it eagerly
        object.__setattr__(block, "forward", compiled)
    else:
        before = wrapper.previous
        wrapper.inner = compiled
        if before is None or before is eager:  # the block keeps it once the gate is removed
            wrapper.previous = compiled

    def undo() -> None:
        forward: Any = vars(block).get("forward")
        if forward is compiled:
            if before is None:
                del vars(block)["forward"]
            else:
                object.__setattr__(block, "forward", before)
            return
        while getattr(forward, "around_forward", False):  # a wrapper around it
            if forward.previous is compiled:
                forward.previous = before
            if forward.inner is compiled:
                forward.inner = eager
                return
            forward = forward.inner

    return undo


def _quiet(
    compiled: Callable[..., Any], eager: Callable[..., Any], block: nn.Module, notice: CacheNotice
) -> Any:
    """The compiled forward, called under :func:`block_tracing` (hook guards, no warning of
    dynamo's own), or ``eager`` while a gate keeps the block eager (``keep_eager``);
    ``notice`` says when a transformers cache reaches it."""

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not notice.said:
            notice.look(block, args, kwargs)
        if kept_eager(block):
            return eager(*args, **kwargs)
        with block_tracing():
            return compiled(*args, **kwargs)

    setattr(forward, COMPILED_MARK, True)
    return forward


def _check_compile_keywords(compile_kwargs: dict[str, Any]) -> None:
    """Refuse a keyword ``torch.compile`` does not take (before any block is touched)."""
    import difflib
    import inspect

    import torch

    known = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    for keyword in compile_kwargs:
        if keyword not in known:
            close = difflib.get_close_matches(keyword, known, n=1)
            hint = f" Did you mean {close[0]}=?" if close else ""
            raise InvalidOptionError(
                f"compile_blocks got the keyword {keyword}=, which torch.compile does not take; "
                f"expected blocks= or one of torch.compile's: {', '.join(known)}.{hint}"
            )
