"""Every private torch API gradgate uses, in one fenced home, each behind a feature check.

torch promises nothing about these names from one release to the next. Each is looked up once,
when its module is imported, into a constant that is ``None`` where the installed torch lacks
it; the function that uses it then takes its fallback. A fallback is exact: a slower path or an
uncompiled block, never a different gradient. Where a feature cannot work without the API, the
fallback raises :class:`~gradgate.TorchVersionError` instead. The tests force each fallback on
the installed torch by setting the constant to ``None``.

This package, by concern: here, the lookups and what the cut and its hooks use (autograd's
engine, module hooks, sequence numbers, saved-tensor hooks, dynamo's frames); ``trees``, nested
args and outputs (torch's pytree); ``planner``, the memory planner's fake tensors and dispatch
tools; ``schedulers``, the LR schedulers' private fields. No other module of gradgate names
``torch._C``, ``torch._dynamo`` or a private ``torch.utils`` module (tests/test_layout.py
checks).
"""

from __future__ import annotations

import importlib
import itertools
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import TorchVersionError


def _lookup(module: str, *names: str) -> Any:
    """``module.name1.name2...``, or ``None`` where the module or a name is missing."""
    try:
        found: Any = importlib.import_module(module)
    except ImportError:
        return None
    for name in names:
        found = getattr(found, name, None)
    return found


DISPATCH_MODE = _lookup("torch.utils._python_dispatch", "TorchDispatchMode")
CURRENT_NODE = _lookup("torch._C", "_current_autograd_node")
SEQUENCE_NR = _lookup("torch._C._autograd", "_get_sequence_nr")
TOP_SAVED_HOOKS = _lookup("torch._C._autograd", "_top_saved_tensors_default_hooks")
EVAL_FRAME = _lookup("torch._C._dynamo", "eval_frame")
ENGINE = _lookup("torch.autograd", "Variable", "_execution_engine")
SET_GRAD = _lookup("torch._C", "_set_grad_enabled")
# torch.distributed's state: its ``_default_pg`` is what is_initialized() returns through three
# Python calls (asked at every forward)
DISTRIBUTED_WORLD = _lookup("torch.distributed.distributed_c10d", "_world")
# torch._dynamo itself is imported on first need only: it takes about a second.
DYNAMO = "torch._dynamo"
HOOK_GUARDS_FLAG = "skip_nnmodule_hook_guards"  # a torch._dynamo.config option


TORCH_RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
FLOOR = "2.6"  # pyproject.toml's torch floor; docs/compatibility.md lists the releases tested


def needs(feature: str, api: str, *, since: str = FLOOR) -> TorchVersionError:
    """The error for a feature this torch cannot support."""
    return TorchVersionError(
        f"{feature} needs torch {since} or newer: it uses torch's {api}, which torch "
        f"{torch.__version__} does not have. Install a newer torch "
        "(docs/compatibility.md lists the releases tested)."
    )


# -- autograd ----------------------------------------------------------------------------------
def current_autograd_node() -> Any:
    """The autograd node whose backward runs now in this thread, else ``None`` (also ``None``
    where torch cannot say: see :func:`knows_current_autograd_node`)."""
    return None if CURRENT_NODE is None else CURRENT_NODE()


def maybe_in_backward() -> bool:
    """Whether an autograd node's backward may be running now (activation checkpointing
    recomputing a forward): true where torch cannot say."""
    return CURRENT_NODE is None or CURRENT_NODE() is not None


# ``torch.set_grad_enabled(mode)`` builds a context manager (three times the cost) to call this
# setter; a gate switches grad mode between blocks, every block of every step
set_grad_mode: Callable[[bool], Any] = SET_GRAD or torch.set_grad_enabled


def other_module_hooks(module: torch.nn.Module, own_pre: int, own_post: int) -> bool:
    """Whether ``module`` has forward or backward hooks besides ``own_pre`` pre-hooks and
    ``own_post`` forward hooks of the caller's (hooks set for every module do not count: they
    run outside ``forward`` either way)."""
    return (
        len(module._forward_pre_hooks) > own_pre
        or len(module._forward_hooks) > own_post
        or bool(module._backward_hooks or module._backward_pre_hooks)
    )


def on_module_assignment(
    parents: set[int], callback: Callable[[], object]
) -> RemovableHandle | None:
    """Have ``callback()`` run whenever a module is assigned to a module whose id is in
    ``parents`` (a set the caller keeps up to date), until the handle is removed; ``None`` where
    torch has no such hook. A global registration hook: it runs at every assignment in the
    process (``ModuleList`` slices in some models' forwards), so it only looks up the id.
    ``callback`` (a bound method) is held weakly: the hook keeps nothing alive."""
    register = getattr(torch.nn.modules.module, "register_module_module_registration_hook", None)
    if register is None:
        return None
    method = weakref.WeakMethod(callback)  # type: ignore[arg-type]

    def assigned(parent: Any, name: str, module: Any) -> None:
        if id(parent) in parents:
            alive = method()
            if alive is not None:
                alive()
        # None: torch would assign what the hook returns instead

    return register(assigned)  # type: ignore[no-any-return]


def hooks_registered() -> int:
    """A number that changes whenever torch registers a hook anywhere in this process: module,
    global, tensor, autograd node and optimizer hooks all draw their handle's id from one
    counter (a new number at each call where torch has no such counter)."""
    counter: int | None = getattr(RemovableHandle, "next_id", None)
    return next(_NEVER_SAME) if counter is None else counter


_NEVER_SAME = itertools.count(-1, -1)


def next_sequence_nr() -> int:
    """The sequence number autograd gives the next node it creates in this thread; without
    torch's getter, one more than that of a throwaway node's (the same count)."""
    if SEQUENCE_NR is not None:
        return SEQUENCE_NR()  # type: ignore[no-any-return]
    with torch.enable_grad():
        node = torch.zeros((), requires_grad=True).neg().grad_fn
    return sequence_nr(node) + 1


def sequence_nr(node: Any) -> int:
    """A node's creation number, increasing within a thread (``Node._sequence_nr``)."""
    number = getattr(node, "_sequence_nr", None)
    if number is None:
        raise needs("Telling which module or line created an autograd node", "Node._sequence_nr")
    return int(number())


Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], Any]]


def queue_after_backward(callback: Callable[[], object]) -> bool:
    """Have autograd call ``callback`` when the backward running now ends; false where torch
    cannot (the caller then does it later, at its next chance)."""
    queue = getattr(ENGINE, "queue_callback", None)
    if queue is None:
        return False
    queue(callback)
    return True


def outer_saved_tensors_hooks() -> Hooks | None:
    """The ``saved_tensors_hooks`` pair active now, or ``None`` (none active, or a torch that
    cannot say: then a pair installed inside replaces it, as torch documents)."""
    return None if TOP_SAVED_HOOKS is None else TOP_SAVED_HOOKS(False)


def knows_saved_tensors_hooks() -> bool:
    return TOP_SAVED_HOOKS is not None


def saved_tensors_hooks_active() -> bool:
    """Whether some ``saved_tensors_hooks`` are active now, for a torch that cannot name them:
    a throwaway node's saved tensor then has hooks already (their pack runs on it once)."""
    with torch.enable_grad():
        x = torch.zeros((), requires_grad=True)
        node = (x * x).grad_fn
    try:
        node._raw_saved_self.register_hooks(_same, _same)  # type: ignore[union-attr]
    except RuntimeError:
        return True
    return False


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket as GradBucket  # DDP's comm hook argument
    from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
else:  # a stand-in base where torch lacks it: require_op_observer then raises
    TorchDispatchMode = DISPATCH_MODE or object


def require_op_observer(feature: str) -> None:
    """Raise unless torch can show every op run in backward with the node running it."""
    if DISPATCH_MODE is None:
        raise needs(feature, "torch.utils._python_dispatch.TorchDispatchMode")
    if CURRENT_NODE is None:
        raise needs(feature, "torch._C._current_autograd_node")


# -- dynamo: how a gated model runs under torch.compile ----------------------------------------
def _callback_unknown() -> bool:
    """Without a way to read dynamo's callback, every eager frame counts as under
    ``torch.compile``: the slower path, exact either way."""
    return True


class _AskTorch:
    """Where ``torch.compiler`` keeps no flag: ask it."""

    @property
    def _is_compiling_flag(self) -> bool:
        return torch.compiler.is_compiling()


# ``COMPILER._is_compiling_flag``: what torch.compiler.is_compiling() answers in a frame dynamo
# does not trace (torch.export's tracing sets it), read with no call: the wrappers' frames ask
# at every block of every forward, and the function costs two Python calls.
COMPILER: Any = torch.compiler if hasattr(torch.compiler, "_is_compiling_flag") else _AskTorch()


# dynamo's frame callback set now (falsy outside torch.compile). torch's own builtin, not a
# Python wrapper: a Python frame called from eager code under torch.compile would be traced.
eval_frame_callback: Callable[[], Any] = (
    getattr(EVAL_FRAME, "get_eval_frame_callback", None) or _callback_unknown
)


# Sets dynamo's frame callback, returns the one set before (the builtin itself, for the same
# reason; ``None`` where missing, see can_set_eval_frame).
set_eval_frame: Any = getattr(EVAL_FRAME, "set_eval_frame", None)


def can_set_eval_frame() -> bool:
    """Whether a block's frame can be compiled from eager code by setting dynamo's callback."""
    return (
        callable(getattr(EVAL_FRAME, "get_eval_frame_callback", None))
        and callable(getattr(EVAL_FRAME, "set_eval_frame", None))
        and can_skip_frames()
    )


def _dynamo_config() -> Any:
    return importlib.import_module(f"{DYNAMO}.config")


def guards_hooks() -> bool:
    """Whether dynamo can be told to guard on module hooks (else a compiled block could run
    another block's graph with the wrong hooks, so it must stay uncompiled)."""
    return hasattr(_dynamo_config(), HOOK_GUARDS_FLAG)


@contextmanager
def hook_guards() -> Iterator[None]:
    """dynamo guards on the hooks of the modules it traces inside the block."""
    config = _dynamo_config()
    if not hasattr(config, HOOK_GUARDS_FLAG):
        yield
        return
    skip = getattr(config, HOOK_GUARDS_FLAG)
    setattr(config, HOOK_GUARDS_FLAG, False)
    try:
        yield
    finally:
        setattr(config, HOOK_GUARDS_FLAG, skip)


def traceable(function: Any) -> Any:
    """``function``, or a frame around it that dynamo compiles where it would skip its own frame
    (the forwards of torch.nn's modules are in dynamo's skip list as top frames). Without the
    means, ``function`` itself: such a block then runs uncompiled."""
    wrap = _lookup(f"{DYNAMO}.external_utils", "wrap_inline")
    check = _lookup(f"{DYNAMO}.trace_rules", "check")
    plain = isinstance(function, (types.FunctionType, types.MethodType))
    if wrap is None or check is None or not plain:
        return function
    return wrap(function) if check(function) else function


def skip_frames(*functions: Any) -> None:
    """Tell dynamo never to trace these functions' own frames (their callees still may be);
    where torch cannot, dynamo meets them under ``torch.compiler.disable`` (a graph break)."""
    if can_skip_frames():
        action = EVAL_FRAME._FrameAction
        skip = EVAL_FRAME._FrameExecStrategy(action.SKIP, action.DEFAULT)
        for function in functions:
            EVAL_FRAME.set_code_exec_strategy(function.__code__, skip)


def can_skip_frames() -> bool:
    """Whether dynamo can be told to skip a code object's own frame (torch 2.8 on: without
    it, compiling a block's frame from the gate's eager code crashed torch 2.6; torch 2.7 has
    the API, but a second compile after one with skipped frames crashed it)."""
    names = ("set_code_exec_strategy", "_FrameAction", "_FrameExecStrategy")
    if TORCH_RELEASE < (2, 8):
        return False
    return all(getattr(EVAL_FRAME, name, None) is not None for name in names)


SKIPS_FRAMES = can_skip_frames()  # read by frames dynamo may trace: a constant it can fold


def storage_key(storage: Any) -> int:
    """One number per live storage, shared by all its tensors (its C++ address)."""
    key = getattr(storage, "_cdata", None)
    if key is None:
        from torch.multiprocessing.reductions import StorageWeakRef

        key = StorageWeakRef(storage).cdata
    return int(key)
