"""The state of each gated forward running in a thread, and how it is put back exactly.

A forward of a gated model pushes a :class:`Frame`: the caller's grad mode, what the gate
changed (train flags, autocast's cache, parameters frozen for a call). Frames are per thread
(grad mode is too). ``KeyboardInterrupt`` and ``SystemExit`` skip torch's ``always_call``
hooks, so a frame can outlive its call: the next gated forward finds it gone from the Python
stack and closes it.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn

from .._plumbing import torch_internals as internals
from .._plumbing.errors import BlockCallError, CheckpointAfterCutWarning, warn
from .._plumbing.hooks import CALL_SITES

THREAD = threading.local()  # .frames: the gated root forwards in this thread, outermost first
_EVERY_THREAD: dict[int, list[Frame]] = {}  # the same lists, by thread, for push_frame
_ENTERING = threading.Lock()  # one thread at a time between checking and pushing a frame


def open_frames() -> list[Frame]:
    frames: list[Frame] | None = getattr(THREAD, "frames", None)
    if frames is None:
        frames = THREAD.frames = _EVERY_THREAD[threading.get_ident()] = []
    return frames


def push_frame(frame: Frame, *, alone: bool) -> None:
    """Open a frame; with ``alone``, refuse while another thread has a frame of the same gate.

    A gate that sets ``module.training`` for its prefix cannot serve two threads at once: the
    flags are shared, so each thread would save and restore the other's temporary modes.
    """
    if not alone:  # nothing to check: no lock
        open_frames().append(frame)
        return
    with _ENTERING:
        me = threading.get_ident()
        if len(_EVERY_THREAD) > 1 and any(
            f.gate is frame.gate
            for thread, frames in _EVERY_THREAD.items()
            if thread != me
            for f in list(frames)
        ):
            raise BlockCallError(
                f"another thread is running a forward of this gated model, and "
                f"prefix_mode={frame.gate.prefix_mode!r} sets module.training, which all threads "
                "share: one thread's cut-off blocks and the other's learning blocks cannot both "
                "have their mode. Use prefix_mode='keep' (set the modes yourself), or give each "
                "thread its own copy of the model."
            )
        open_frames().append(frame)


@dataclass(eq=False, slots=True)
class Frame:
    """What one gated root forward changed, so that it can be put back exactly."""

    gate: Any  # the _Cut that pushed it
    call_site: FrameType | None  # the root's Python call frame: gone from the stack = stale
    grad_before: bool
    blocking: bool
    training: list[tuple[nn.Module, bool]] = field(default_factory=list)
    autocast_cache: bool | None = None  # the cache setting to restore at the cut, if changed
    opened: bool = False
    tentative: int | None = None  # opened after this block; a later non-learner closes again
    last_position: int = -1
    ran: set[int] = field(default_factory=set)
    stacks_ran: list[int] = field(default_factory=list)  # in the order they first ran
    # (outside module, stacks started, the last block position that ran) at each of its calls
    outside_calls: list[tuple[int, int, int]] = field(default_factory=list)
    gap_calls: list[int] = field(default_factory=list)  # outside modules run before the learner
    # the gap's frozen parameters, given back by an outside module taken for code after the
    # last block (LayerDrop) at its first run: a later block says whether that was wrong
    gap_guess: tuple[int, list[nn.Parameter]] | None = None
    frozen: dict[int, list[nn.Parameter]] = field(default_factory=dict)
    held: list[nn.Parameter] = field(default_factory=list)  # frozen until backward ends
    skipped: dict[int, bool] = field(default_factory=dict)
    # a skipped block's arguments as the gate's pre-hook saw them: hooks that run after it
    # (ZeRO-3's) may swap them for tensors made under the block's no-grad
    skipped_args: dict[int, Any] = field(default_factory=dict)
    block_training: dict[int, list[tuple[nn.Module, bool]]] = field(default_factory=dict)
    checked: bool = False  # the first learning block's output was checked
    explained: bool = False  # a warning already said why the output may have no graph
    shared_uses: dict[int, dict[bool, nn.Module]] = field(default_factory=dict)  # by opened
    # the gate whose block lane may take this frame's blocks (see cut_blocks): unset while an
    # outside module that ran before the learner waits for the next block's hooks
    lane: Any = None
    single: bool = False  # the only frame in its thread: opening the cut is turning grad on
    watch: Any = None  # the first forward of a plan: what the missing-gradient guard sees


def grad_held_off() -> bool:
    """Whether some gated forward in this thread is still before its cut."""
    return any(f.blocking and not f.opened for f in open_frames())


def before_a_depth_cut() -> bool:
    """Whether a gated forward in this thread, called with grad on, is still before a cut that
    a depth placed (a plan of the last blocks): what runs there learns at no depth."""
    return any(
        f.blocking and not f.opened and f.grad_before and isinstance(f.gate._learn, range)
        for f in open_frames()
    )


def close_frame(frame: Frame) -> None:
    """Put back what one root forward changed: grad mode, train flags, frozen parameters."""
    frames = open_frames()
    if frames and frames[-1] is frame:  # the innermost: the usual case
        frames.pop()
    elif frame in frames:
        frames.remove(frame)
    else:
        return
    if frame.frozen or frame.held:
        for params in [*frame.frozen.values(), frame.held]:
            for param in params:
                param.requires_grad_(True)
    if frame.training or frame.block_training:
        # a block that raised skipped its own exit hook: what it changed is put back here
        for module, training in [
            *frame.training,
            *(m for ms in frame.block_training.values() for m in ms),
        ]:
            module.training = training
    if frame.skipped:
        internals.set_grad_mode(next(iter(frame.skipped.values())))
    if frame.autocast_cache is not None:
        torch.set_autocast_cache_enabled(frame.autocast_cache)
    if frame.blocking and not frame.opened and not grad_held_off():  # it held grad off last
        internals.set_grad_mode(True)
    elif frame.blocking and frame.opened and not torch.is_grad_enabled() and frame.grad_before:
        internals.set_grad_mode(True)
        warn_lost_grad_mode()
    frame.call_site = frame.lane = None


def set_prefix_mode(
    module: nn.Module, mode: str, containers: set[str], *, whole: bool
) -> list[tuple[nn.Module, bool]]:
    """Put what may run before the cut in the prefix mode (``'eval'``, ``'train'``; ``'keep'``
    changes nothing): the whole model, or one block. Returns the modes to put back.

    ``containers`` (names of the modules holding blocks) keep their mode: their forward also runs
    the learning part. The modes come back when the cut opens, so what runs after it is
    untouched. A block that runs before the cut after it opened once (it closes again between
    blocks) gets the prefix mode for its own call.
    """
    if mode == "keep":
        return []
    changed = []
    for name, submodule in module.named_modules() if whole else module.named_modules(prefix="·"):
        if name and name not in containers:
            changed.append((submodule, submodule.training))
            submodule.training = mode == "train"
    return changed


def root_call_site() -> FrameType:
    """The Python frame of the root module's call that is running the hooks now: the frame of
    the wrapper that called the root's hook directly, or else torch's ``_call_impl``."""
    frame: FrameType | None = sys._getframe(2)
    if frame is not None and frame.f_code in CALL_SITES:
        return frame
    while frame is not None and frame.f_code is not _CALL_IMPL:
        frame = frame.f_back
    return frame or sys._getframe(2)


_CALL_IMPL = nn.Module._call_impl.__code__


def recover_stale_frames() -> None:
    """Close frames whose root call ended without its hooks (KeyboardInterrupt, SystemExit)."""
    frames = open_frames()
    if not frames:
        return
    live: set[int] = set()
    caller: FrameType | None = sys._getframe(1)
    while caller is not None:
        live.add(id(caller))
        caller = caller.f_back
    for frame in reversed(frames):
        if frame.call_site is None or id(frame.call_site) not in live:
            close_frame(frame)


def warn_lost_grad_mode() -> None:
    warn(
        "grad mode was switched on at the cut but was off again when the forward ended, so "
        "nothing after the cut will get gradients. The usual cause is reentrant activation "
        "checkpointing around the first learning block: its inputs come from the cut and do "
        "not require grad. Fix: torch.utils.checkpoint.checkpoint(..., use_reentrant=False) "
        "(transformers 5.23 and later: model.activation_checkpointing_enable("
        "{'use_reentrant': False}); before: gradient_checkpointing_enable("
        "gradient_checkpointing_kwargs={'use_reentrant': False})).",
        CheckpointAfterCutWarning,
    )
