"""How a gated model runs under ``torch.compile(model)``: the gate's code is never traced.

A gate changes grad mode and module modes between blocks, and its plan changes every step.
Were dynamo to trace that code it would guard on the plan (a recompile per depth) or break the
graph at every hook. So under ``torch.compile`` the root's forward runs eagerly, as does
everything the gate does around the blocks, and each block's ``forward`` is compiled as a frame
of its own, by the very compiler the root was called under: no graph break, one graph per block
class and grad state, no guard on the plan. Outside ``torch.compile`` these are plain calls.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from . import torch_internals as internals
from .torch_internals import skip_frames

_DISABLED: Any = None
_BLOCK_COMPILER: ContextVar[Any] = ContextVar("gradgate_block_compiler", default=None)


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


def _can_compile_blocks() -> bool:
    """Without setting dynamo's callback, or with dynamo unable to guard on hooks, the blocks
    run uncompiled (exact, slower)."""
    return internals.can_set_eval_frame() and internals.guards_hooks()


skip_frames(
    opaque,
    disabled_caller,
    eager_with_compiled_blocks,
    compiled_block,
    internals._callback_unknown,
)
