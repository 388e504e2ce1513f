"""Where does the graph start? A cut that follows the blocks as they actually run.

A wrapper around the root's ``forward`` remembers the caller's grad mode and turns grad off.
Block hooks follow the calls: the first learning block that runs turns grad back on (only if
the caller had it on); a non-learning block that runs after that (called again, or out of
order) runs frozen for that call, so gradients pass through it but it gets none; a skipped block
(DropBP) runs with no graph and the gradient passes around it through its residual path. The
wrapper restores everything when ``forward`` returns or raises, ``KeyboardInterrupt`` included.
Changing the plan is a field write; only with no plan at all do the block hooks come off (at
the next forward), to come back when a plan is set.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch
from torch import nn

from . import _torch_internals as internals
from ._block_calls import (
    NOTHING_LEARNS,
    ResidualPaths,
    blocks_sharing_parameters,
    check_block_output_learns,
    distributed_running,
    freeze_for_call,
    has_graph,
    outside_call,
    pass_around,
    require_a_forward,
    shared_parameter_owners,
    warn_learners_not_run,
    warn_shared_straddles,
)
from ._errors import BlockCallWarning, GradgateError, warn
from ._frames import (
    Frame,
    close_frame,
    grad_held_off,
    open_frames,
    push_frame,
    recover_stale_frames,
    root_call_site,
    set_prefix_mode,
)
from ._fsdp import FsdpPlan
from ._handles import Handle
from ._held import HeldFrozen, Learners, graph_of
from ._hook_set import HookSet
from ._hooks import ForwardGuard, GateHook
from ._plan_key import PlanKey
from ._plan_tables import first_opener, opens_after, plain_blocks
from ._select import ancestors
from ._stacks import Stacks
from ._stale_grads import CutGrads
from ._validate import check_choice

PrefixMode = Literal["keep", "eval", "train"]


_GAP = -1  # Frame.frozen key: what is not a block's, frozen between the cut and the learner


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
        require_a_forward(model)
        super().__init__(self._remove_hooks, description=f"cut in {type(model).__name__}")
        self._model = model
        self._points = points
        self.prefix_mode = prefix_mode
        self._check_ranks = check_ranks
        self._key = PlanKey(model)
        self._learn: range | frozenset[int] | None = None  # None: no cut; a range for depth
        self._first: int | None = None  # the first block that opens the cut (per plan)
        self._after: list[bool] = []  # per block, per plan: see _plan_tables
        self._plain: list[bool] = []
        self._skip: frozenset[int] = frozenset()
        self._extra: tuple[nn.Module, ...] = ()  # learning modules that are not blocks
        self._keep: frozenset[int] = frozenset()  # ids of their parameters
        self._extra_blocks = self._extra_outside = frozenset[int]()  # where they are
        self._warned: set[str] = set()
        self._stacks = Stacks(model, points)
        self._shared = shared_parameter_owners(model)
        self._shared_ids = frozenset(id(param) for param, _ in self._shared)
        self._in_blocks = frozenset(id(p) for _, m in points for p in m.parameters())
        self._block_ids = frozenset(id(module) for _, module in points)
        self._gap_keep = self._in_blocks  # what the code between the blocks leaves trainable
        self._gap_modules: set[int] = set()  # outside modules seen running between blocks
        self._containers = {a for name, _ in points for a in ancestors(name)}  # keep their mode
        self._held = HeldFrozen()
        self._shares_params = blocks_sharing_parameters(points)
        self._stale_grads = CutGrads(points, self._shared_ids)
        self._residual = ResidualPaths()
        self._ddp_checked = False  # at a forward: the process group may start after the gate
        if distributed_running():
            from .distributed import require_find_unused_parameters

            require_find_unused_parameters(model)
        self._hooks = HookSet()
        for position, (_, module) in enumerate(points):
            enter = GateHook(self, "_enter_block", position)
            self._hooks.around(module, enter, GateHook(self, "_exit_block", position), prepend=True)
        for index, module in enumerate(self._stacks.outside):
            self._hooks.around(module, GateHook(self, "_enter_outside", index))
        for index, (_, owners) in enumerate(self._shared):
            for owner in owners:
                self._hooks.around(owner, GateHook(self, "_use_shared", index))
        self._extra_hooks: list[Any] = []  # what around() gave for the named modules
        self._fsdp = FsdpPlan([m for _, m in points], self._in_backward, self._hooks)
        enter, exit = GateHook(self, "_enter_root"), GateHook(self, "_exit_root")
        self._guard = ForwardGuard(model, enter, exit, [module for _, module in points])
        self._guard.install()

    # -- the plan ------------------------------------------------------------------------------
    def _set_plan(
        self, learn: range | frozenset[int] | None, extra: tuple[nn.Module, ...] = ()
    ) -> None:
        self._require_active()
        if extra != self._extra:
            self._hooks.discard(self._extra_hooks)
            self._extra_hooks = [
                hook
                for module in extra
                for hook in self._hooks.around(module, GateHook(self, "_enter_extra"), prepend=True)
            ]
            self._keep = frozenset(id(p) for module in extra for p in module.parameters())
            self._gap_keep = self._keep | self._in_blocks
            self._extra_blocks, self._extra_outside = self._stacks.holding(extra)
        self._learn, self._extra, self._first = learn, extra, None
        self._hooks_for_plan()
        self._fsdp.plan_changed()  # FSDP2: no backward all-gather where backward never runs

    def _hooks_for_plan(self, *, forward: bool = False) -> None:
        """Gate hooks only while a plan needs them: they come back with a plan, and go at a
        ``forward`` without one once a forward ran every stack (LayerDrop: what runs after each
        stack is known). With a plan, see HookSet.fit."""
        planned = self._learn is not None or bool(self._skip) or bool(self._extra)
        if planned and self._hooks.suspended:
            self._hooks.resume()
        elif forward and self._stacks.seen_all and not (planned or self._hooks.suspended):
            self._hooks.suspend()
        elif forward:
            self._hooks.fit()

    def _first_opener(self) -> int:
        """Position of the first learning block that is not skipped (n when there is none); the
        plan's other tables (see _plan_tables) are made with it, once per plan."""
        if self._first is None:
            learn, skip, of = self._learn, self._skip, self._stacks.of
            self._first = first_opener(learn, skip, len(self._points))
            self._after = opens_after(learn, skip, of, self._first)
            self._plain = plain_blocks(learn, skip, self._extra_blocks, of)
        return self._first

    def _in_backward(self) -> list[bool]:
        """Per block: whether backward runs through it, from the first learner on (a named
        module, or one outside the blocks that may run before them, included)."""
        outside = map(self._stacks.first_block_after, self._extra_outside)
        first = min([self._first_opener(), *(self._extra_blocks - self._skip), *outside])
        n, learn = len(self._points), self._learn
        return [learn is None or (p >= first and p not in self._skip) for p in range(n)]

    def _require_active(self) -> None:
        if not self.active:
            raise GradgateError(
                f"{self!r} was removed; its plan cannot change. Create a new gate with "
                "gg.BackpropGate(model)."
            )

    # -- around the root's forward ---------------------------------------------------------
    def _enter_root(self, module: nn.Module, args: Any) -> None:
        recover_stale_frames()
        distributed = distributed_running()
        if distributed:
            self._fsdp.before_forward()
        self._hooks_for_plan(forward=True)
        if self._held.params and not any(f.gate is self for f in open_frames()):
            self._held.release()  # the last forward had no backward that reached its output
        if distributed and not self._ddp_checked:  # find a DDP wrapper once
            from .distributed import calling_ddp, require_find_unused_parameters

            self._ddp_checked = True
            require_find_unused_parameters(calling_ddp())
        if self._check_ranks and (torch.is_grad_enabled() or grad_held_off()):
            from .distributed import check_same_plan  # no graph (an evaluation): no averaging

            check_same_plan(self._key(self._learn, self._skip, self._extra))
        grad = torch.is_grad_enabled()
        blocking = self._learn is not None and (grad or grad_held_off())
        if grad:
            self._stale_grads.saw(self._learn, self._skip, self._keep)
        frame = Frame(gate=self, call_site=root_call_site(), grad_before=grad, blocking=blocking)
        push_frame(frame, alone=blocking and self.prefix_mode != "keep")
        if blocking and self.prefix_mode != "keep":
            frame.training = self._set_prefix_mode(self._model)
        if blocking:
            internals.set_grad_mode(False)
            if torch.is_autocast_cache_enabled():
                # Autocast caches low-precision copies of weights that require grad until the
                # autocast region ends, even under no_grad: without the cache the prefix's
                # copies are freed as soon as each layer is done.
                frame.autocast_cache = True
                torch.set_autocast_cache_enabled(False)

    def _exit_root(self, module: nn.Module, args: Any, output: Any, raising: bool) -> None:
        frame = self._own_frame()
        if frame is None:
            return
        mark = internals.hooks_registered()  # the tensor hooks registered here are the gate's
        held, frame.held = frame.held, []
        graph = graph_of(output) if frame.blocking or held else []
        if frame.blocking and frame.opened and torch.is_grad_enabled():
            self._held.hold(held, graph, self._learners(frame))
        elif held:
            self._held.hold(held, graph, Learners())
        never_opened = frame.blocking and not frame.opened and frame.grad_before and not raising
        nothing_learns = (
            frame.blocking
            and not raising
            and frame.opened
            and not frame.explained
            and torch.is_grad_enabled()  # else reentrant checkpointing lost it: warned below
            and not graph
            and not has_graph(output)  # an output with no tensors
        )
        close_frame(frame)
        if not raising:  # no diagnostics while an exception propagates
            self._stacks.learn(frame)
            self._warn_after_forward(frame, never_opened, nothing_learns)
            self._fsdp.after_forward(output)
        self._hooks.registered_since(mark)

    # -- block hooks ---------------------------------------------------------------------------
    def _enter_block(self, position: int, module: nn.Module, args: Any) -> None:
        frame = self._own_frame()
        if frame is None:
            planned = self._learn is not None or self._skip  # a skip-only (DropBP) plan too
            if planned and torch.is_grad_enabled() and not grad_held_off():
                self._warn_once("outside", outside_call(self._points[position][0], self._model))
            return
        if self._first is None:
            self._first_opener()
        if (
            position == frame.last_position + 1
            and (frame.tentative is not None or not frame.opened)
            and not frame.gap_calls
            and self.prefix_mode == "keep"
            and self._plain[position]
        ):  # the usual block before the cut: in order, its stack running, nothing to change
            frame.last_position = position
            frame.ran.add(position)
            if frame.tentative is not None:
                self._close_again(frame)
            return
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
        frame.ran.add(position)
        learns = self._learn is not None and position in self._learn
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
            traced = frame.skipped[position] and self._residual.trace(position, args)
            internals.set_grad_mode(traced)
        elif not learns and (
            position in self._extra_blocks or (frame.opened and torch.is_grad_enabled())
        ):  # a named module inside it may learn (and open the cut): the rest of it does not
            frame.frozen[position] = freeze_for_call(module, self._keep)

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
            frame.tentative = position
            self._open(frame)
            if position < self._first_opener() < len(self._points) and _GAP not in frame.frozen:
                # grad on for checkpoint(), yet the code before the learner records nothing
                frame.frozen[_GAP] = freeze_for_call(
                    self._model, self._gap_keep, around=self._block_ids
                )
        return replaced

    def _end_gap(self, frame: Frame, tentative: int | None = None) -> None:
        frame.tentative = tentative
        for param in frame.frozen.pop(_GAP, ()):
            param.requires_grad_(True)

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
        frozen for the step.
        """
        frame = self._own_frame()
        if frame is None:
            return
        frame.outside_calls.append((index, len(frame.stacks_ran)))
        if _GAP in frame.frozen:  # unless seen before a block, it runs after them (LayerDrop)
            frame.gap_calls.append(index)
            if index not in self._gap_modules:
                self._end_gap(frame, frame.tentative)
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

    def _use_shared(self, index: int, module: nn.Module, args: Any) -> None:
        frame = self._own_frame()
        if frame is not None and frame.blocking:
            frame.shared_uses.setdefault(index, {}).setdefault(frame.opened, module)

    # -- opening and closing the cut -----------------------------------------------------------
    def _close_again(self, frame: Frame) -> None:
        frame.tentative, frame.opened = None, False
        internals.set_grad_mode(False)
        if frame.autocast_cache is not None:
            torch.set_autocast_cache_enabled(False)

    def _open(self, frame: Frame) -> None:
        if not frame.blocking or frame.opened:
            return
        frame.opened = True
        if frame.autocast_cache is not None:
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

    def _learners(self, frame: Frame) -> Learners:
        """The modules whose parameters this forward's graph gives gradients to."""
        return Learners.of_run(self._points, frame.ran, self._learn, self._skip, self._extra)

    def _own_frame(self) -> Frame | None:
        frames = open_frames()
        if frames and frames[-1].gate is self:  # one gated model running: the usual case
            return frames[-1]
        for frame in reversed(frames):
            if frame.gate is self:
                return frame
        return None

    def _set_prefix_mode(self, module: nn.Module) -> list[tuple[nn.Module, bool]]:
        return set_prefix_mode(
            module, self.prefix_mode, self._containers, whole=module is self._model
        )

    # -- diagnostics ---------------------------------------------------------------------------
    def _warn_after_forward(self, frame: Frame, never_opened: bool, nothing_learns: bool) -> None:
        said = (never_opened or nothing_learns) and warn_learners_not_run(self, frame, never_opened)
        if nothing_learns and not said:  # the first warns every time: it is about this step
            self._warn_once("nothing-learns", NOTHING_LEARNS)
        if frame.shared_uses and "shared" not in self._warned:
            warn_shared_straddles(self._model, frame.shared_uses, self._warned)

    def _warn_once(self, key: str, message: str) -> None:
        if message and key not in self._warned:  # no message: nothing to say this time
            self._warned.add(key)
            warn(message, BlockCallWarning)

    def _remove_hooks(self) -> None:
        for frame in [f for f in open_frames() if f.gate is self]:
            close_frame(frame)
        self._guard.uninstall()
        self._held.backward_done()
        self._hooks.remove()
        self._stale_grads.remove()
        self._fsdp.restore()
