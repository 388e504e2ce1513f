"""Where does the graph start? A cut that follows the blocks as they actually run.

A wrapper around the root's ``forward`` remembers the caller's grad mode and turns grad off.
Block hooks follow the calls: the first learning block that runs turns grad back on (only if
the caller had it on); a non-learning block that runs after that (called again, or out of
order) runs frozen for that call, so gradients pass through it but it gets none; a skipped block
(DropBP) runs with no graph and the gradient passes around it through its residual path. The
wrapper restores everything when ``forward`` returns or raises, ``KeyboardInterrupt`` included.
Changing the plan is a field write; only with no plan at all do the block hooks come off (at
the next forward), to come back when a plan is set. The block hooks are in ``cut_blocks``.
"""

from __future__ import annotations

import weakref
from types import TracebackType
from typing import Any, Literal, TypeVar, get_args

import torch
from torch import nn

from .._plumbing import torch_internals as internals
from .._plumbing.autograd import tensors_in
from .._plumbing.errors import BlockCallWarning, GradgateError, PlanNotAppliedWarning, warn
from .._plumbing.handles import Handle
from .._plumbing.hook_set import HookSet
from .._plumbing.hooks import ForwardGuard, GateHook
from .._plumbing.validate import check_choice
from .._select.names import ancestors
from .block_calls import (
    NOTHING_LEARNS,
    ResidualPaths,
    blocks_sharing_parameters,
    distributed_running,
    has_graph,
    input_graph_message,
    plan_changed_message,
    require_a_forward,
    shared_parameter_owners,
    unused_context_message,
    warn_learners_not_run,
    warn_shared_straddles,
)
from .cut_blocks import GAP, BlockHooks
from .frames import (
    Frame,
    close_frame,
    grad_held_off,
    open_frames,
    push_frame,
    recover_stale_frames,
    root_call_site,
    set_prefix_mode,
)
from .fsdp import FsdpPlan
from .held import HeldFrozen, Learners, MissingGradients, call_at_backward, graph_of
from .plans import PlanKey, first_opener, lane_steps, learners_under_every_gate, opens_after
from .stacks import Stacks
from .stale_grads import CutGrads

PrefixMode = Literal["keep", "eval", "train"]
_C = TypeVar("_C", bound="_Cut")


class _Cut(BlockHooks, Handle):
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
        self._after: list[bool] = []  # per block, per plan: see plans
        self._steps: list[int] = []
        self._tables: dict[tuple[Any, ...], tuple[int, list[bool], list[int]]] = {}
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
        # what the code between the blocks may use (see _freeze_gap): walked again after a
        # module is assigned to one of them (at every forward, where torch cannot tell)
        self._gap_walk: list[nn.Module] | None = None
        self._gap_walked: set[int] = set()  # their ids (kept in place: the hook reads it)
        self._containers = {a for name, _ in points for a in ancestors(name)}  # keep their mode
        self._held = HeldFrozen()
        self._missing = MissingGradients()
        self._shares_params = blocks_sharing_parameters(points)
        self._stale_grads = CutGrads(
            points, self._shared_ids, model, self._stacks, self._gap_modules
        )
        self._residual = ResidualPaths()
        self._ddp_checked = False  # at a forward: the process group may start after the gate
        self._forwards = 0  # root forwards so far: a plan change and a `with` block compare
        self._planned_at = 0  # _forwards at the last change of plan
        self._changed: tuple[Any, int] | None = None  # the plan before a change, _forwards then
        self._unheld: list[Any] = []  # graph nodes of the last forward with nothing held (depth 0)
        self._watch_hook: Any = None  # a parameter's hook set by a plan change (see there)
        self._input_unseen = True  # the first forward with grad looks for a graph on its input
        self._entered_at: int | None = None  # _forwards when a `with` block entered
        self._warns_unused = False  # backprop_depth / stop_gradient_at: a `with` block is its use
        if distributed_running():
            from .ranks import require_find_unused_parameters

            require_find_unused_parameters(model)
        self._hooks = HookSet()
        for position, (_, module) in enumerate(points):
            enter, exit = (GateHook(self, f"_{e}_block", position) for e in ("enter", "exit"))
            lane = (self._block_lane, position)
            self._hooks.around(module, enter, exit, prepend=True, lane=lane)
        for index, module in enumerate(self._stacks.outside):
            enter = GateHook(self, "_enter_outside", index)
            self._hooks.around(module, enter, lane=(self._outside_lane, index))
        for index, (_, owners) in enumerate(self._shared):
            for owner in owners:
                self._hooks.around(owner, GateHook(self, "_use_shared", index))
        self._extra_hooks: list[Any] = []  # what around() gave for the named modules
        self._fsdp = FsdpPlan([m for _, m in points], self._in_backward, self._hooks)
        enter, exit = GateHook(self, "_enter_root"), GateHook(self, "_exit_root")
        self._guard = ForwardGuard(model, enter, exit, [module for _, module in points])
        self._guard.install()
        self._assignments = internals.on_module_assignment(self._gap_walked, self._forget_gap)

    # -- the plan ------------------------------------------------------------------------------
    def _set_plan(
        self, learn: range | frozenset[int] | None, extra: tuple[nn.Module, ...] = ()
    ) -> None:
        self._require_active()
        if type(learn) is type(self._learn) and learn == self._learn and extra == self._extra:
            return  # the same plan again (loops set it at every step): its tables stay
        self._plan_changing()
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
        self._learn, self._extra = learn, extra
        self._new_tables()
        self._hooks_for_plan()
        self._fsdp.plan_changed()  # FSDP2: no backward all-gather where backward never runs

    def _hooks_for_plan(self, *, forward: bool = False) -> None:
        """Gate hooks only while a plan needs them: they come back with a plan, and go at a
        ``forward`` without one once a forward ran every stack (LayerDrop: what runs after each
        stack is known). With a plan, see HookSet.fit."""
        planned = self._planned()
        if planned and self._hooks.suspended:
            self._hooks.resume()
        elif forward and self._stacks.seen_all and not (planned or self._hooks.suspended):
            self._hooks.suspend()
        elif forward:
            self._hooks.fit()

    def _planned(self) -> bool:
        return self._learn is not None or bool(self._skip) or bool(self._extra)

    def _new_tables(self) -> None:
        """The plan changed: its tables are made at the next forward. A forward of this thread
        running now takes its blocks the hooks' way from here on (they make the tables)."""
        self._first = None
        for frame in open_frames():
            if frame.gate is self:
                frame.lane = None

    def _first_opener(self) -> int:
        """Position of the first learning block that is not skipped (n when there is none); the
        plan's other tables (see plans) are made with it, once per plan: loops set the
        depth at every step, often to one they set before."""
        if self._first is None:
            key = (self._learn, self._skip, self._extra)
            tables = self._tables.get(key)
            if tables is None:
                if len(self._tables) >= 64:  # random learning sets (LISA): a few at a time
                    self._tables.clear()
                learn, skip, of = self._learn, self._skip, self._stacks.of
                first = first_opener(learn, skip, len(self._points))
                after = opens_after(learn, skip, of, first)
                steps = lane_steps(learn, skip, self._extra_blocks, after, first)
                tables = self._tables[key] = (first, after, steps)
                self._missing.new_plan()  # a plan not seen lately: its first forward is watched
            self._first, self._after, self._steps = tables
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
    def _enter_root(self, module: nn.Module, args: Any) -> Frame | None:
        """Set up a forward of the root; returns its frame, for _exit_root (none with no plan
        and the hooks off: nothing to set up, nothing to put back)."""
        self._forwards += 1
        recover_stale_frames()
        distributed = distributed_running()
        if self._learn is None and not (
            self._skip or self._extra or distributed or self._held.params or self._check_ranks
        ):  # no plan: nothing to set up once the hooks are off (see _hooks_for_plan)
            if not self._hooks.suspended:
                self._hooks_for_plan(forward=True)
            if self._hooks.suspended:
                if torch.is_grad_enabled():
                    self._stale_grads.saw(self._learn, self._skip, self._keep)
                return None
        else:
            if distributed:
                self._fsdp.before_forward()
            self._hooks_for_plan(forward=True)
        if self._held.params and not any(f.gate is self for f in open_frames()):
            self._held.release()  # the last forward had no backward that reached its output
        if distributed and not self._ddp_checked:  # find a DDP wrapper once
            from .ranks import calling_ddp, require_find_unused_parameters

            self._ddp_checked = True
            require_find_unused_parameters(calling_ddp())
        if self._check_ranks and (torch.is_grad_enabled() or grad_held_off()):
            from .ranks import check_same_plan  # no graph (an evaluation): no averaging

            check_same_plan(self._key(self._learn, self._skip, self._extra))
        grad = torch.is_grad_enabled()
        blocking = self._learn is not None and (grad or grad_held_off())
        if blocking and grad and self._input_unseen:
            self._look_at_input(args)
        if grad:
            self._stale_grads.saw(self._learn, self._skip, self._keep)
        frame = Frame(gate=self, call_site=root_call_site(), grad_before=grad, blocking=blocking)
        push_frame(frame, alone=blocking and self.prefix_mode != "keep")
        frame.single = len(open_frames()) == 1
        if self._first is None:
            self._first_opener()  # the plan's tables, which the lane reads (made: a new plan)
        if self.prefix_mode == "keep":
            frame.lane = self
        elif blocking:
            frame.training = self._set_prefix_mode(self._model)
        if self._missing.pending and grad and not self._fsdp.sharded:  # a plan's first forward
            frame.watch = self._missing.arm((self._learn, self._skip, self._extra))
        if blocking:
            internals.set_grad_mode(False)
            if torch.is_autocast_cache_enabled():
                # Autocast caches low-precision copies of weights that require grad until the
                # autocast region ends, even under no_grad: without the cache the prefix's
                # copies are freed as soon as each layer is done.
                frame.autocast_cache = True
                torch.set_autocast_cache_enabled(False)
        return frame

    def _exit_root(
        self, module: nn.Module, args: Any, output: Any, raising: bool, frame: Frame | None
    ) -> None:
        if frame is None or frame.call_site is None:  # no frame, or closed already (removed)
            return
        mark = internals.hooks_registered()  # the tensor hooks registered here are the gate's
        held, frame.held = frame.held, []
        graph = graph_of(output) if frame.blocking or held else []
        if frame.blocking and frame.opened and torch.is_grad_enabled():
            if held or self._learn or self._extra:  # else nothing to wait for in its backward
                self._held.hold(held, graph, self._learners(frame))
            else:  # a plan changed before its backward looks at these (see _plan_changing)
                self._unheld = [tensor.grad_fn for tensor in graph if tensor.grad_fn is not None]
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
        if frame.gap_calls and not raising:  # they ran after the last block that ran
            self._gap_ran_last(frame.gap_calls, GAP in frame.frozen)
        close_frame(frame)
        if frame.watch is not None:  # after close: the learners' own flags
            watched = [] if raising else graph or graph_of(output)  # none: watch the next one
            learners = None if raising else learners_under_every_gate(self._model)
            frame.watch.after_forward(learners, self._model, self._points, frame.ran, watched)
        if not raising:  # no diagnostics while an exception propagates
            self._stacks.learn(frame)
            self._warn_after_forward(frame, never_opened, nothing_learns)
            self._fsdp.after_forward(output)
        self._hooks.registered_since(mark)

    def _learners(self, frame: Frame) -> Learners:
        """The modules whose parameters this forward's graph gives gradients to."""
        return Learners.of_run(self._points, frame.ran, self._learn, self._skip, self._extra)

    def _set_prefix_mode(self, module: nn.Module) -> list[tuple[nn.Module, bool]]:
        return set_prefix_mode(
            module, self.prefix_mode, self._containers, whole=module is self._model
        )

    # -- a plan that cannot act ----------------------------------------------------------------
    def _plan_changing(self) -> None:
        """The plan is about to change. A backward of a forward run before (under the old plan)
        that comes with no forward in between follows the old plan: the next backward says so
        (see _backward_after_change). Micro-batches, a forward after each change, are fine."""
        if self._forwards == self._planned_at:
            return  # nothing ran under the plan being replaced (or it changed already)
        self._planned_at = self._forwards
        if self._own_frame() is not None:
            return  # set during a forward: the blocks that run after it follow it
        self._changed = ((self._learn, self._skip, self._extra), self._forwards)
        watch = weakref.WeakMethod(self._backward_after_change)
        self._held.watch = watch  # forwards whose backward the held parameters wait for
        unheld, self._unheld = self._unheld, []
        param = None
        for position in reversed(range(len(self._points)) if self._learn is None else ()):
            # no plan, or skips only, watched by nothing: a parameter of the last block learns
            params = self._points[position][1].parameters() if position not in self._skip else ()
            param = next((p for p in params if p.requires_grad), None)
            if param is not None:
                break
        mark = internals.hooks_registered()
        self._drop_watch_hook()  # one at a time: the last change's, if no backward reached it
        self._watch_hook = call_at_backward(watch, unheld, param)
        self._hooks.registered_since(mark)  # the gate's own: no module's hooks to look at

    def _drop_watch_hook(self) -> None:
        hook, self._watch_hook = self._watch_hook, None
        if hook is not None:
            hook.remove()  # does nothing if a backward took it off already

    def _backward_after_change(self) -> None:
        changed, self._changed, self._held.watch = self._changed, None, None
        if changed is None or changed[1] != self._forwards:
            return  # a forward ran after the change: this backward is (also) its own
        if changed[0] != (self._learn, self._skip, self._extra):  # not set back meanwhile
            warn(plan_changed_message(self, *changed[0]), PlanNotAppliedWarning)

    def _look_at_input(self, args: Any) -> None:
        """A gate's first forward with grad: an input that carries a graph means that what ran
        before the gated module learns, whatever the plan."""
        self._input_unseen = False
        if any(t.grad_fn is not None for t in tensors_in(args)):
            warn(input_graph_message(self._model, self._learn), PlanNotAppliedWarning)

    def __enter__(self: _C) -> _C:
        entered = super().__enter__()
        self._entered_at = self._forwards
        return entered

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        unused = self._warns_unused and exc_type is None and self._entered_at == self._forwards
        super().__exit__(exc_type, exc, tb)  # the cut is gone before the warning
        if unused:
            warn(unused_context_message(self), PlanNotAppliedWarning)

    # -- diagnostics ---------------------------------------------------------------------------
    def _warn_after_forward(self, frame: Frame, never_opened: bool, nothing_learns: bool) -> None:
        said = (never_opened or nothing_learns) and warn_learners_not_run(self, frame, never_opened)
        if nothing_learns and not said:  # the first warns every time: it is about this step
            self._warn_once("nothing-learns", NOTHING_LEARNS)
        if frame.shared_uses and "shared" not in self._warned:
            warn_shared_straddles(self._model, frame.shared_uses, self._warned)

    def _gap_ran_last(self, calls: list[int], frozen: bool) -> None:
        """Outside modules taken for code between the blocks (see Stacks.between_blocks) ran
        after the last block that ran (LayerDrop skipped the rest): they are not, from now on.
        Still ``frozen``, they got no gradient in this forward."""
        calls = [index for index in calls if index not in self._gap_modules]
        self._stacks.ran_last(calls)
        if frozen and calls:
            names = {id(m): n for n, m in self._model.named_modules()}
            listed = ", ".join(repr(names.get(id(self._stacks.outside[i]), "?")) for i in calls)
            self._warn_once(
                "ran-last",
                f"{listed} ran after the last block that ran in this forward (the blocks after "
                "it were skipped: LayerDrop?), where gradgate took them for code between the "
                "blocks before the first learner, so they got no gradient in this step. From "
                "now on they learn when they run after the last block.",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if message and key not in self._warned:  # no message: nothing to say this time
            self._warned.add(key)
            warn(message, BlockCallWarning)

    def _remove_hooks(self) -> None:
        self._unheld = []
        self._missing.release()
        self._drop_watch_hook()
        if self._assignments is not None:
            self._assignments.remove()
        for frame in [f for f in open_frames() if f.gate is self]:
            close_frame(frame)
        self._guard.uninstall()
        self._held.backward_done()
        self._hooks.remove()
        self._stale_grads.remove()
        self._fsdp.restore()
