"""How a gated model runs under ``torch.compile(model)``: the gate's code is never traced.

A gate changes grad mode and module modes between blocks, and its plan changes every step.
Were dynamo to trace that code it would guard on the plan (a recompile per depth) or break the
graph at every hook. So under ``torch.compile`` the root's forward runs eagerly, as does
everything the gate does around the blocks, and each block's ``forward`` is compiled as a frame
of its own, by the very compiler the root was called under: no graph break, one graph per block
class and grad state, no guard on the plan. Outside ``torch.compile`` these are plain calls.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

_frames = torch._C._dynamo.eval_frame
eval_frame_callback = getattr(_frames, "get_eval_frame_callback", lambda: True)
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
    config = torch._dynamo.config
    skip_hook_guards = config.skip_nnmodule_hook_guards
    config.skip_nnmodule_hook_guards = False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NON_LEAF_GRAD, category=UserWarning)
            yield
    finally:
        config.skip_nnmodule_hook_guards = skip_hook_guards


def under_compile() -> bool:
    """Whether an eager frame runs inside ``torch.compile`` (dynamo's frame callback is set)."""
    return bool(eval_frame_callback()) and not torch.compiler.is_compiling()


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
    token = _BLOCK_COMPILER.set(eval_frame_callback())
    try:
        return opaque(function, *args, **kwargs)
    finally:
        _BLOCK_COMPILER.reset(token)


def compiled_block(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``; compiled when inside :func:`eager_with_compiled_blocks`."""
    if torch.compiler.is_compiling():  # traced into a frame compiled some other way
        return function(*args, **kwargs)
    compiler = _BLOCK_COMPILER.get()
    if compiler is None or eval_frame_callback():
        return function(*args, **kwargs)
    with block_tracing():
        prior = _frames.set_eval_frame(compiler)
        try:
            return function(*args, **kwargs)
        finally:
            _frames.set_eval_frame(prior)


def traceable(function: Any) -> Any:
    """``function``, or a frame around it that dynamo compiles where it would skip its own frame
    (the forwards of torch.nn's modules, e.g. ``nn.TransformerEncoderLayer``, are in dynamo's
    skip list as top frames; ``torch.compile(module)`` wraps them the same way)."""
    from torch._dynamo import external_utils, trace_rules

    plain = isinstance(function, (types.FunctionType, types.MethodType))
    return (
        external_utils.wrap_inline(function) if plain and trace_rules.check(function) else function
    )


def skip_frames(*functions: Any) -> None:
    """Tell dynamo never to trace these functions' own frames (their callees still may be).

    They are gradgate's wrappers and hooks, entered from eager code while a compiler is active.
    """
    if not hasattr(_frames, "set_code_exec_strategy"):
        return
    action = _frames._FrameAction
    skip = _frames._FrameExecStrategy(action.SKIP, action.DEFAULT)
    for function in functions:
        _frames.set_code_exec_strategy(function.__code__, skip)


skip_frames(under_compile, opaque, disabled_caller, eager_with_compiled_blocks, compiled_block)
