"""The cut's hooks on its blocks, and on named and outside modules: where the cut opens and
closes as they run (see :mod:`gradgate._cut.cut`, whose ``_Cut`` holds the state they read).

The usual block before the cut takes :meth:`BlockHooks._block_lane`, one function with no hook
dispatch: it runs at every block of every forward.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .._plumbing import torch_internals as internals
from .._plumbing.autograd import leaf_variable, tensors_in, walk
from .._plumbing.frames_compile import keep_eager
from .._plumbing.hooks import HookedForward
from .block_calls import (
    ResidualPaths,
    check_block_output_learns,
    freeze_for_call,
    freeze_in,
    modules_within,
    outside_call,
    pass_around,
)
from .frames import THREAD, Frame, grad_held_off, open_frames
from .plans import HOOKED, LEARNER, OPENS_GAP, OPENS_LAST, PREFIX, opening_step
from .stacks import Stacks

GAP = -1  # Frame.frozen key: what is not a block's, frozen between the cut and the learner


class BlockHooks:
    """The block, named-module and outside-module hooks of a cut (a mixin of ``_Cut``)."""

    # what they read: the cut's modules, the plan and its tables (see _Cut)
    prefix_mode: str
    _model: nn.Module
    _points: list[tuple[str, nn.Module]]
    _stacks: Stacks
    _learn: range | frozenset[int] | None
    _skip: frozenset[int]
    _first: int | None
    _after: list[bool]
    _steps: list[int]
    _keep: frozenset[int]
    _gap_keep: frozenset[int]
    _gap_modules: set[int]
    _gap_walk: list[nn.Module] | None
    _gap_walked: set[int]
    _assignments: Any
    _block_ids: frozenset[int]
    _shared_ids: frozenset[int]
    _shares_params: list[bool]
    _extra_blocks: frozenset[int]
    _extra_outside: frozenset[int]
    _residual: ResidualPaths
    _hooks: Any  # the cut's HookSet

    def _own_frame(self) -> Frame | None:
        frames = open_frames()
        if frames and frames[-1].gate is self:  # one gated model running: the usual case
            return frames[-1]
        for frame in reversed(frames):
            if frame.gate is self:
                return frame
        return None

    def _first_opener(self) -> int:
        raise NotImplementedError

    def _set_prefix_mode(self, module: nn.Module) -> list[tuple[nn.Module, bool]]:
        raise NotImplementedError

    def _warn_once(self, key: str, message: str) -> None:
        raise NotImplementedError

    def _enter_block(self, position: int, module: nn.Module, args: Any) -> None:
        frame = self._own_frame()
        if frame is None:
            planned = self._learn is not None or self._skip  # a skip-only (DropBP) plan too
            if planned and torch.is_grad_enabled() and not grad_held_off():
                self._warn_once("outside", outside_call(self._points[position][0], self._model))
            return
        if self._first is None:
            self._first_opener()  # the plan's tables, for _exit_block too
        if self._stacks.of[position] not in frame.stacks_ran:
            self._stacks.start(frame, position, planned=self._learn is not None)
        if position > frame.last_position:
            frame.last_position = position
        elif position < frame.last_position and position not in frame.ran:
            self._warn_once(
                "order",
                f"block {self._points[position][0]!r} ran after "
                f"{self._points[frame.last_position][0]!r}, out of the listed order; depth "
                "counts blocks in the listed order and the cut follows the run (blocks that "
                "run after the cut without learning pass gradients but get none). Pass "
                "blocks=[...] in the order they run if that is what you meant.",
            )
        if frame.gap_calls:
            self._gap_modules.update(frame.gap_calls)  # these ran between blocks
            frame.gap_calls.clear()
            frame.lane = self if self.prefix_mode == "keep" else None
        frame.ran.add(position)
        learns = self._learn is not None and position in self._learn
        if frame.gap_guess is not None:  # else the cut closes again here: no graph goes on
            self._gap_guessed_wrong(frame, position, args, learns)
        if frame.tentative is not None:
            if learns:
                self._end_gap(frame)
            else:
                self._close_again(frame)
        if learns and position not in self._skip:
            self._open(frame)
        elif frame.blocking and not (frame.opened or frame.training or self.prefix_mode == "keep"):
            frame.block_training[position] = self._set_prefix_mode(module)
        if position in self._skip:
            frame.skipped[position] = torch.is_grad_enabled()
            frame.skipped_args[position] = args
            traced = frame.skipped[position] and self._residual.trace(position, args, module)
            internals.set_grad_mode(traced)
        elif not learns and (
            position in self._extra_blocks or (frame.opened and torch.is_grad_enabled())
        ):  # a named module inside it may learn (and open the cut): the rest of it does not
            frame.frozen[position] = freeze_for_call(module, self._keep)
        if position in self._extra_blocks:  # its named module's hook would break its graph
            keep_eager(module)
        if frame.watch is not None:  # the missing-gradient guard's evidence
            learner = position not in self._skip and (self._learn is None or learns)
            frame.watch.entered(position, learner, args, frame.grad_before)

    def _block_lane(self, position: int, wrapper: HookedForward, args: Any, kwargs: Any) -> Any:
        """A block's call, the usual way: in order, in a frame the lane may take (see
        Frame.lane), with its step in the plan's table (see plans.lane_steps). Before the
        cut its hooks would only note it ran, close the cut if it opened for now, and open it for
        now after the block; after the first learner (which opened the cut and had its output
        checked), a learner's would only note it ran. Else its hooks run around it. One
        function: this runs at every block of every forward, so it also closes and opens the cut
        itself in a thread's only frame (see _close_again and _open)."""
        try:
            frame = THREAD.frames[-1]
        except (AttributeError, IndexError):  # no gated forward runs in this thread
            return self._hooked_call(position, wrapper, args, kwargs)
        if frame.lane is not self or position != frame.last_position + 1:
            return self._hooked_call(position, wrapper, args, kwargs)
        if frame.watch is not None and self._watched(position):  # a plan's first forward
            return self._hooked_call(position, wrapper, args, kwargs)
        step = self._steps[position]  # the root's enter made the plan's tables
        if step > LEARNER:  # before the cut
            if frame.opened:
                if frame.tentative is None:  # running after the cut: frozen for the call
                    return self._hooked_call(position, wrapper, args, kwargs)
                frame.tentative, frame.opened = None, False  # close the cut again
                internals.set_grad_mode(False)
            if self._stacks.starts[position]:
                self._stacks.start(frame, position, planned=self._learn is not None)
            frame.last_position = position
            frame.ran.add(position)
            output = wrapper.inner(*args, **kwargs)
            if step > PREFIX and frame.blocking and not frame.opened and frame.call_site:
                # open the cut for now (no call site: closed, the gate was removed)
                frame.tentative = position
                if frame.single:
                    frame.opened = True
                    internals.set_grad_mode(True)
                else:
                    self._open(frame, for_now=True)
                if step == OPENS_GAP:
                    if GAP not in frame.frozen:
                        self._freeze_gap(frame)
                elif step == OPENS_LAST and GAP in frame.frozen:
                    self._end_gap(frame, position)  # what runs after the last block learns
            return output
        if step == HOOKED or not (frame.checked and frame.opened) or frame.tentative is not None:
            return self._hooked_call(position, wrapper, args, kwargs)  # the first learner checks
        if self._stacks.starts[position]:
            self._stacks.start(frame, position, planned=True)
        frame.last_position = position
        frame.ran.add(position)
        return wrapper.inner(*args, **kwargs)

    def _watched(self, position: int) -> bool:
        """Whether the missing-gradient guard needs the block's hooks: from the first learner
        on (what runs before it learns nothing, so it shows the guard nothing)."""
        learn = self._learn
        return learn is None or any(i <= position for i in learn) or bool(self._extra_blocks)

    def _hooked_call(self, position: int, wrapper: HookedForward, args: Any, kwargs: Any) -> Any:
        """The block's call with its hooks around it (its only gate hooks: the lane's pair)."""
        module = wrapper.module
        self._enter_block(position, module, args)  # never replaces the arguments
        output = wrapper.inner(*args, **kwargs)
        replaced = self._exit_block(position, module, args, kwargs, output)
        return output if replaced is None else replaced

    def _exit_block(
        self, position: int, module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> Any:
        frame = self._own_frame()
        if frame is None:
            return None
        if position in frame.frozen:
            frozen = frame.frozen.pop(position)
            if self._shares_params[position]:
                for param in frozen:
                    param.requires_grad_(True)  # another block may learn with them later
            else:
                frame.held.extend(frozen)
        if frame.block_training and position in frame.block_training:
            for block_module, training in frame.block_training.pop(position):
                block_module.training = training
        if position in self._extra_blocks:
            keep_eager(None)
        replaced = None
        if frame.skipped and position in frame.skipped:
            traced = torch.is_grad_enabled()
            internals.set_grad_mode(frame.skipped.pop(position))
            name = self._points[position][0]
            output = self._residual.check(traced, position, name, args, kwargs, output)
            # around to the args the gate saw, not a later pre-hook's no-graph copies (ZeRO-3)
            replaced = pass_around(name, frame.skipped_args.pop(position, args), kwargs, output)
        elif frame.opened and not frame.checked and self._learns(position):
            frame.checked = True  # the first learner after the cut is where it would show
            frame.explained = check_block_output_learns(self._points[position][0], module, output)
        if frame.blocking and not frame.opened and self._after[position]:  # made at the enter
            self._open_after(frame, position)
        if frame.watch is not None:
            learner = position not in self._skip and (self._learn is None or self._learns(position))
            mark = internals.hooks_registered()
            frame.watch.exited(position, learner, module, output)
            self._hooks.registered_since(mark)  # the guard's own (node hooks): no module's
        return replaced

    def _open_after(self, frame: Frame, position: int) -> None:
        """Open the cut for now after a block that does not learn (see plans); autocast's
        cache stays off until a learner runs."""
        frame.tentative = position
        self._open(frame, for_now=True)
        step = opening_step(position, self._first_opener(), len(self._points))
        if step == OPENS_GAP and GAP not in frame.frozen:
            self._freeze_gap(frame)
        elif step == OPENS_LAST and GAP in frame.frozen:
            self._end_gap(frame, position)

    def _freeze_gap(self, frame: Frame) -> None:
        """Grad is on between the blocks (for checkpoint()), yet the code before the first
        learner records nothing."""
        walk = self._gap_walk
        if walk is None:
            walk = modules_within(self._model, self._block_ids)
            if self._assignments is not None:
                self._gap_walk = walk
                self._gap_walked.update(id(module) for module in walk)
        frame.frozen[GAP] = freeze_in(walk, self._gap_keep)

    def _forget_gap(self) -> None:
        """A module was assigned to one of those the gap's walk found: walk again."""
        self._gap_walk = None
        self._gap_walked.clear()

    def _end_gap(self, frame: Frame, tentative: int | None = None) -> None:
        """What runs now learns: the code between the blocks is no longer frozen, and unless
        the cut stays open only for now (``tentative``), autocast's cache is back on."""
        if tentative is None and frame.tentative is not None and frame.autocast_cache is not None:
            torch.set_autocast_cache_enabled(frame.autocast_cache)
        frame.tentative = tentative
        for param in frame.frozen.pop(GAP, ()):
            param.requires_grad_(True)

    def _gap_guessed_wrong(self, frame: Frame, position: int, args: Any, learns: bool) -> None:
        """A block ran after an outside module ended the gap's freeze, taken for code after the
        last block that ran: it was code between the blocks. Where this block learns (the cut
        stays open) and what the freeze had held got a graph that reaches it, a backward
        through this forward says so (a forward with no backward, such as one run to show the
        gate where the code runs, gives no gradient and says nothing)."""
        (index, given), frame.gap_guess = frame.gap_guess, None  # type: ignore[misc]
        if not learns:
            return
        held = {id(param) for param in given}
        nodes = [t.grad_fn for t in tensors_in(args) if t.grad_fn is not None]
        reached = {id(leaf) for node in walk(nodes) if (leaf := leaf_variable(node)) is not None}
        if not held & reached:
            return
        names = [n for n, p in self._model.named_parameters() if id(p) in held & reached]
        modules = {id(m): n for n, m in self._model.named_modules()}
        listed = " and ".join(map(repr, names)) if len(names) < 3 else f"{names[0]!r}, ..."
        message = (
            f"{listed} got a gradient though they run before the first learner "
            f"({self._points[self._first_opener()][0]!r}): at its first run gradgate took "
            f"{modules.get(id(self._stacks.outside[index]), '?')!r} for code after the last "
            "block that ran (LayerDrop), and gave the code between the blocks back its "
            f"gradients there, before block {self._points[position][0]!r} ran. From the next "
            "forward on they are frozen there. To have the first step exact too, run one "
            "forward with grad on before training (its output unused)."
        )
        gate = weakref.ref(self)  # the graph may outlive the gate

        def at_backward(*grads: Any) -> None:
            found = gate()
            if found is not None:
                found._warn_once("gap-guess", message)

        mark = internals.hooks_registered()
        for node in nodes:
            node.register_prehook(at_backward)  # goes with the graph: no trace on the model
        self._hooks.registered_since(mark)  # the gate's own

    def _enter_extra(self, module: nn.Module, args: Any) -> None:
        frame = self._own_frame()
        if frame is not None and not frame.skipped:  # inside a skipped block nothing learns
            self._end_gap(frame)
            self._open(frame)

    def _enter_outside(self, index: int, module: nn.Module, args: Any) -> None:
        """An embedding, norm or head ran: open the cut here if LayerDrop skipped the stack.

        No block hook can open the cut then; it opens at the first module that earlier forwards
        saw run after that stack (never before it: registration order is no guide). Under a
        learning set, one that runs after the cut unnamed, and not after the last stack, is
        frozen for the step. Where the code between the blocks is frozen (up to the first
        learner), one that no forward saw run between two blocks, and that is no member of a
        list (norms[i] after block i), ends that freeze: it runs after the last block that ran.
        """
        frame = self._own_frame()
        if frame is None:
            return
        frame.outside_calls.append((index, len(frame.stacks_ran), frame.last_position))
        if GAP in frame.frozen:  # unless known to run between blocks, it runs after them
            frame.gap_calls.append(index)
            frame.lane = None  # the next block's hooks take note of it
            if not (index in self._gap_modules or self._stacks.between_blocks(index)):
                frame.gap_guess = (index, frame.frozen.get(GAP, []))
                self._end_gap(frame, frame.tentative)  # LayerDrop skipped the blocks after
        if frame.blocking and not frame.opened:
            stack = self._stacks.of[min(self._first_opener(), len(self._points) - 1)]
            if stack not in frame.stacks_ran and self._stacks.seen_after(stack, index):
                self._enter_extra(module, args)  # else the stack's own blocks open the cut
        elif (
            isinstance(self._learn, frozenset)  # a learning set freezes what it does not name
            and frame.opened
            and torch.is_grad_enabled()
            and index not in self._extra_outside
            and not self._stacks.runs_after_last(frame, index)
        ):
            frame.held.extend(freeze_for_call(module, self._keep | self._shared_ids))

    def _outside_lane(self, index: int, wrapper: HookedForward, args: Any, kwargs: Any) -> Any:
        """An outside module's call, the usual way: its hook would only take note that it ran,
        with the cut open (for now too) under a depth (no learning set to freeze it for), or
        before the cut when no forward has seen it run after a stack (so it cannot be where the
        cut opens after a stack LayerDrop skipped). Else its hook runs (see _enter_outside)."""
        try:
            frame = THREAD.frames[-1]
        except (AttributeError, IndexError):  # no gated forward runs in this thread
            return wrapper.call_hooks(args, kwargs)
        if (
            frame.lane is self
            and GAP not in frame.frozen
            and (
                type(self._learn) is not frozenset
                if frame.opened
                else index not in self._stacks.after_some
            )
        ):
            frame.outside_calls.append((index, len(frame.stacks_ran), frame.last_position))
            return wrapper.inner(*args, **kwargs)
        return wrapper.call_hooks(args, kwargs)

    def _use_shared(self, index: int, module: nn.Module, args: Any) -> None:
        frame = self._own_frame()
        if frame is not None and frame.blocking:
            frame.shared_uses.setdefault(index, {}).setdefault(frame.opened, module)

    # -- opening and closing the cut -----------------------------------------------------------
    def _close_again(self, frame: Frame) -> None:
        frame.tentative, frame.opened = None, False
        internals.set_grad_mode(False)

    def _open(self, frame: Frame, *, for_now: bool = False) -> None:
        if not frame.blocking or frame.opened:
            return
        frame.opened = True
        if frame.autocast_cache is not None and not for_now:
            torch.set_autocast_cache_enabled(frame.autocast_cache)
        if frame.training or frame.block_training:
            for prefix_module, training in [
                *frame.training,
                *(m for ms in frame.block_training.values() for m in ms),
            ]:  # also a block running before the cut that a named module inside it opens
                prefix_module.training = training
            frame.training, frame.block_training = [], {}
        if len(open_frames()) == 1 or not grad_held_off():  # one: this one, open now
            internals.set_grad_mode(True)  # a blocking frame always traces back to grad on

    def _learns(self, position: int) -> bool:
        return self._learn is not None and position in self._learn
