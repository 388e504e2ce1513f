"""torch.compile for a per-minibatch depth: compile each block's ``forward``, not the model.

Under a :class:`~gradgate.BackpropGate`, a block runs in one of three states: in the cut-off
prefix (grad mode off), as the first learning block (grad mode on, input not requiring grad),
or further in the suffix (input requiring grad). Compiling each block's ``forward`` gives one
graph per state and block class, shared by all blocks of that class (parameters are graph
inputs), so every depth reuses the same <= 3 graphs and nothing recompiles after warm-up.

The gate's hooks stay outside the compiled region: they live in ``Module.__call__``, and only
``forward`` is compiled. (``block.compile()`` compiles ``__call__`` with its hooks, which
traces the gate's bookkeeping into the graphs.) ``torch.compile(model)`` of a gated model does
the same per block by itself (see ``_plumbing.frames_compile``); whole-model ``torch.compile`` with
``requires_grad`` toggling instead recompiles for every new depth.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .._plumbing.errors import InvalidOptionError
from .._plumbing.frames_compile import block_tracing
from .._plumbing.handles import Handle
from .._plumbing.torch_internals import guards_hooks, needs
from .._select.names import Pattern, resolve_blocks

_MARK = "_gradgate_compiled_forward"


def compile_blocks(
    model: nn.Module, blocks: Sequence[Pattern] | str | None = None, **compile_kwargs: Any
) -> Handle:
    """Compile the ``forward`` of every block with ``torch.compile(**compile_kwargs)``.

    ``blocks`` selects the blocks as in :class:`~gradgate.BackpropGate` (auto-found when
    None). Returns a :class:`~gradgate.Handle`; ``handle.remove()`` restores the original
    forwards. Modules outside the blocks (embeddings, head) stay eager. A gated model compiled
    whole (``torch.compile(model)``) is compiled block by block like this without it.

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
        if getattr(block.forward, _MARK, False):
            raise InvalidOptionError(
                f"block {name!r} is already compiled by gg.compile_blocks; expected each block "
                "compiled once. Remove the earlier handle first."
            )
    try:  # torch.compile checks its options (a backend name) before anything is replaced
        torch.compile(points[0][1].forward, **compile_kwargs)
    except Exception as error:
        raise InvalidOptionError(
            f"torch.compile refused the options {compile_kwargs!r:.120}: {error}; expected "
            "options torch.compile accepts, e.g. backend='inductor' or mode='reduce-overhead'."
        ) from None
    restores = []
    for _, block in points:
        had_own = "forward" in vars(block)
        previous = vars(block).get("forward")
        compiled = _quiet(torch.compile(block.forward, **compile_kwargs))
        # a plain instance attribute: nn.Module.__call__ (hooks included) calls it eagerly
        object.__setattr__(block, "forward", compiled)
        restores.append((block, had_own, previous))

    def undo() -> None:
        for block, had_own, previous in restores:
            if had_own:
                object.__setattr__(block, "forward", previous)
            else:
                vars(block).pop("forward", None)

    return Handle(undo, description=f"compile_blocks over {len(points)} blocks")


def _quiet(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """The compiled forward, called under :func:`block_tracing` (hook guards, no warning)."""

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with block_tracing():
            return compiled(*args, **kwargs)

    setattr(forward, _MARK, True)
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
