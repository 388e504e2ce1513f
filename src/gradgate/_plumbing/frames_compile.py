"""How a gated model runs under ``torch.compile(model)``: the gate's code is never traced.

A gate changes grad mode and module modes between blocks, and its plan changes every step.
Were dynamo to trace that code it would guard on the plan (a recompile per depth) or break the
graph at every hook. So under ``torch.compile`` the root's forward runs eagerly, as does
everything the gate does around the blocks, and each block's ``forward`` is compiled as a frame
of its own, by the very compiler the root was called under: no graph break, one graph per block
class and state, no guard on the plan. A block whose graph a gate's hook inside it would break
runs eagerly for the call instead (see :func:`keep_eager`). Outside ``torch.compile`` these are
plain calls.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from . import torch_internals as internals
from .errors import GradgateWarning, warn
from .torch_internals import skip_frames

_DISABLED: Any = None
_BLOCK_COMPILER: ContextVar[Any] = ContextVar("gradgate_block_compiler", default=None)
_EAGER_BLOCK: ContextVar[Any] = ContextVar("gradgate_eager_block", default=None)


# torch._dynamo reads ``.grad`` of non-leaf inputs while tracing; it hides the resulting
# UserWarning with ``warnings.showwarning``, which fails when warnings are errors (-W error).
_NON_LEAF_GRAD = "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"


@contextmanager
def block_tracing() -> Iterator[None]:
    """Around a call that may compile a block's frame.

    The blocks of one class share their graphs, so dynamo must guard on the hooks of the modules
    inside them (a learning set's hook, ``capture_grads``, a user's hook on one block): it skips
    those guards by default and would run one block's graph for another block's hooks. And
    dynamo's own non-leaf ``.grad`` warning is ignored.
    """
    with internals.hook_guards(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NON_LEAF_GRAD, category=UserWarning)
        yield


def _call(function: Any, *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


def opaque(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args)`` under ``torch.compiler.disable``: dynamo compiles nothing it calls."""
    return disabled_caller()(function, *args, **kwargs)


def disabled_caller() -> Any:
    """The disabled caller, made on first need: importing torch._dynamo takes about a second,
    and only a compiled model needs it."""
    global _DISABLED
    if _DISABLED is None:
        _DISABLED = torch.compiler.disable(_call)
    return _DISABLED


def eager_with_compiled_blocks(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` eagerly; :func:`compiled_block` calls in it are compiled
    with the compiler active now."""
    token = _BLOCK_COMPILER.set(internals.eval_frame_callback())
    try:
        return opaque(function, *args, **kwargs)
    finally:
        _BLOCK_COMPILER.reset(token)


def compiled_block(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``; compiled when inside :func:`eager_with_compiled_blocks`."""
    if torch.compiler.is_compiling():  # traced into a frame compiled some other way
        return function(*args, **kwargs)
    compiler = _BLOCK_COMPILER.get()
    if compiler is None or internals.eval_frame_callback() or not _can_compile_blocks():
        return function(*args, **kwargs)
    with block_tracing():
        prior = internals.set_eval_frame(compiler)
        try:
            return function(*args, **kwargs)
        finally:
            internals.set_eval_frame(prior)


def keep_eager(module: Any) -> None:
    """Until ``keep_eager(None)``, ``module``'s compiled forward runs eagerly.

    For a block whose graph a gate's hook inside it would break (a module named in a learning
    set): dynamo guards the first half of a broken graph only on what ran before the break, so
    the later calls of that block class in the same state, hooked or not, would run the two
    halves, and the second half would compile again for each state they bring.
    """
    _EAGER_BLOCK.set(module)


def kept_eager(module: Any) -> bool:
    """Whether ``module``'s compiled forward runs eagerly now (see :func:`keep_eager`)."""
    return _EAGER_BLOCK.get() is module


class BlockFrame:
    """What calls a block's own ``forward`` under a compiled root: a frame dynamo compiles
    (``torch_internals.traceable``), or the forward itself, eagerly, while :func:`keep_eager`
    names the block."""

    __slots__ = ("__wrapped__", "module", "traced")

    def __init__(self, module: Any, forward: Any) -> None:
        self.module, self.__wrapped__, self.traced = module, forward, internals.traceable(forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _EAGER_BLOCK.get() is self.module:
            return opaque(self.__wrapped__, *args, **kwargs)
        return self.traced(*args, **kwargs)


class CacheNotice:
    """Says once, for a set of compiled blocks, that a transformers cache reached one of them
    in a call with grad on (training with ``use_cache`` left at its default)."""

    __slots__ = ("said",)

    def __init__(self) -> None:
        self.said = False

    def look(self, module: Any, args: Any, kwargs: Any) -> None:
        """Warn if a transformers ``Cache`` is among the block's arguments (grad on)."""
        cache = _transformers_cache(args, kwargs)
        if cache is None or not torch.is_grad_enabled():
            return
        self.said = True
        warn(
            f"a transformers {type(cache).__name__} reaches the compiled block "
            f"{type(module).__name__}: dynamo guards on each layer's entry in it, so each layer "
            "compiles graphs of its own (a graph per layer and state, not per state) until "
            "dynamo's recompile limit, whose message names grad mode, the last guard to fail. "
            "Fix: pass `use_cache=False` when training (model(..., use_cache=False), or "
            "model.config.use_cache = False; the Hugging Face Trainer does this).",
            GradgateWarning,
        )


def _transformers_cache(args: Any, kwargs: Any) -> Any:
    """The first transformers ``Cache`` among the arguments, or None (transformers unloaded:
    none can be)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_type = getattr(cache_utils, "Cache", None)
    if cache_type is None:
        return None
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, cache_type)), None)


COMPILED_MARK = "_gradgate_compiled_forward"  # on the forwards gg.compile_blocks installs


def runs_compiled(module: Any) -> bool:
    """Whether ``module``'s forward runs compiled now: a block under a compiled gated root
    (``torch.compile(model)``), or compiled by ``gg.compile_blocks``, before or after a gate
    wrapped it."""
    if _BLOCK_COMPILER.get() is not None and _can_compile_blocks():
        return True
    forward = vars(module).get("forward")
    for _ in range(8):  # down the wrappers installed as its forward (each keeps its ``inner``)
        if forward is None or getattr(forward, COMPILED_MARK, False):
            return forward is not None
        forward = getattr(forward, "inner", None)
    return False


def _can_compile_blocks() -> bool:
    """Without setting dynamo's callback, or with dynamo unable to guard on hooks, the blocks
    run uncompiled (exact, slower)."""
    return internals.can_set_eval_frame() and internals.guards_hooks()


skip_frames(
    opaque,
    disabled_caller,
    eager_with_compiled_blocks,
    compiled_block,
    BlockFrame.__call__,
    internals._callback_unknown,
)
